# syntax=docker/dockerfile:1
# The courier image: one binary for the sidecar (`courier run`), the injector
# (`courier inject`) and the operator tools (`courier dlq`, `courier crd`).
#
#   docker build -t REGISTRY/courier:0.1.0 .
#
# Build stage: the binary of the dist profile (the release profile with thin
# LTO and one codegen unit: smaller and 9 % fewer instructions per message,
# at the price of a long link), with Cargo.lock as committed (--locked).
# TLS is rustls with ring, except Kafka's: librdkafka's own TLS and SASL on
# the system's OpenSSL, so the binary needs glibc and libssl3 at run time,
# which the distroless "cc" image has (libcurl is linked in statically).
FROM rust:1-bookworm AS build
WORKDIR /src
# The whole repository (less .dockerignore), so that every workspace member
# Cargo.toml names is there.
COPY . .
# cmake for librdkafka (scripts/build-deps says why).
RUN scripts/build-deps
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked --package courier --bin courier \
    && install -m 0755 target/dist/courier /courier

# Run stage: distroless, no shell, no package manager; the nonroot user
# (65532), the same UID the injector's securityContext asks for.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /courier /usr/local/bin/courier
USER 65532:65532
# 9464: the sidecar's /metrics, /healthz, /readyz. 8443: the injector (HTTPS).
EXPOSE 9464 8443
ENTRYPOINT ["/usr/local/bin/courier"]
CMD ["run"]
