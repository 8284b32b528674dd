#!/usr/bin/env python3
"""Checks on rendered courier chart manifests that a schema cannot make.

scripts/test-chart renders the chart with several sets of values and calls
this once per rendering:

    check-chart.py VARIANT RENDERED.yaml

VARIANT names what the values turned on (see VARIANTS in scripts/test-chart);
the checks for it say what must and must not be rendered. Custom resources
that kubernetes-validate has no schema for are checked here: RetryPolicy
against the CRD's own openAPIV3Schema, PrometheusRule and the dashboard
against the files in monitoring/ they are copied from. Needs PyYAML and
jsonschema (both come with kubernetes-validate). Exits 1 on the first failure.
"""

import base64
import hashlib
import json
import posixpath
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
RELEASE_NAMESPACE = "courier-system"
SIDECAR_NAMESPACES = ["shop", "billing"]
# sidecar.serviceAccounts in the variants that set namespaces.
SIDECAR_ACCOUNTS = ["default", "orders"]
# The console's values in the "console" variants (scripts/test-chart passes
# this file, and overrides some of it in "console-read-only").
CONSOLE_VALUES = ROOT / "tests/fixtures/helm/console-values.yaml"
# The image's user (the Dockerfile's USER, the injector's and sidecar's).
UID = 65532
# generatedCertificate.existingSecret and .caBundle in "provided-cert".
PROVIDED_SECRET = "orders-injector-tls"
PROVIDED_CA = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCg=="


class Failed(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failed(message)


class UniqueKeyLoader(yaml.SafeLoader):
    """Refuses a mapping with the same key twice: PyYAML keeps the last one
    silently, the API server refuses some and not others."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise Failed(f"duplicate key {key!r} at line {key_node.start_mark.line + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(path):
    with open(path) as f:
        return [d for d in yaml.load_all(f, Loader=UniqueKeyLoader) if d]


def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def one(docs, kind):
    found = by_kind(docs, kind)
    check(len(found) == 1, f"expected one {kind}, found {len(found)}")
    return found[0]


def of(docs, component):
    """The objects of one part of the chart (injector, console, monitoring),
    by their app.kubernetes.io/component label."""
    return [
        d for d in docs
        if d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component") == component
    ]


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def injector(docs):
    deployment = one(of(docs, "injector"), "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


# === Always ===


def check_common(docs):
    webhook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    check(webhook["sideEffects"] == "None", "sideEffects must be None")
    check(webhook["admissionReviewVersions"] == ["v1"], "admission.k8s.io/v1 only")
    check(1 <= webhook["timeoutSeconds"] <= 10, "a short timeout")
    check(
        webhook["objectSelector"] == {"matchLabels": {"courier.dev/inject": "true"}},
        "pods are selected by courier.dev/inject=true",
    )
    excluded = webhook["namespaceSelector"]["matchExpressions"][0]
    check(
        excluded["key"] == "kubernetes.io/metadata.name"
        and excluded["operator"] == "NotIn"
        and RELEASE_NAMESPACE in excluded["values"],
        "the release namespace is never injected",
    )
    check(webhook["rules"][0]["operations"] == ["CREATE"], "only CREATE")
    check(webhook["rules"][0]["resources"] == ["pods"], "only pods")
    service = one(of(docs, "injector"), "Service")
    check(
        webhook["clientConfig"]["service"]["name"] == service["metadata"]["name"],
        "the webhook calls the injector's Service",
    )
    check(webhook["clientConfig"]["service"]["path"] == "/mutate", "path /mutate")

    container = injector(docs)
    check(container["args"] == ["inject"], "the injector runs `courier inject`")
    sc = container["securityContext"]
    check(sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], "locked down")
    check(sc["capabilities"]["drop"] == ["ALL"], "no capabilities")
    pod = one(of(docs, "injector"), "Deployment")["spec"]["template"]["spec"]
    check(pod["securityContext"]["runAsNonRoot"], "the injector runs as non-root")
    check(pod["automountServiceAccountToken"] is False, "the injector needs no API token")
    account = one(docs, "ServiceAccount")
    check(pod["serviceAccountName"] == account["metadata"]["name"], "its own service account")
    secret_volume = pod["volumes"][0]["secret"]["secretName"]
    check(secret_volume.endswith("-injector-tls"), "the certificate comes from the TLS Secret")

    selector = one(of(docs, "injector"), "Deployment")["spec"]["selector"]["matchLabels"]
    spread = pod.get("topologySpreadConstraints", [])
    check(
        spread and spread[0]["labelSelector"]["matchLabels"] == selector,
        "the injector's replicas are spread across zones",
    )

    role = one(docs, "ClusterRole")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    check(
        rules[(("courier.dev",), ("retrypolicies",))] == {"get", "list", "watch"},
        "sidecars get, list and watch RetryPolicies",
    )
    check("create" in rules[(("",), ("events",))], "sidecars create Events")
    check(role["rules"] == documented_sidecar_rules(), "docs/policy.md shows the sidecar ClusterRole's rules as rendered")


def documented_sidecar_rules():
    """The YAML block under "RBAC the sidecar's service account needs" in
    docs/policy.md."""
    text = (ROOT / "docs/policy.md").read_text()
    section = text.split("### RBAC the sidecar's service account needs", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)["rules"]


# === Variants ===


def check_scope(docs, namespaces):
    """A pod is injected only where its sidecar may read its policy: in the
    namespaces of sidecar.namespaces (each with a RoleBinding), or with none
    listed, in the namespaces labelled courier.dev/injection=enabled."""
    selector = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]["namespaceSelector"]
    expressions = selector["matchExpressions"]
    if namespaces:
        check("matchLabels" not in selector, "no opt-in label with sidecar.namespaces")
        check(
            len(expressions) == 2
            and expressions[1] == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces},
            f"only the namespaces of sidecar.namespaces are injected: {selector}",
        )
        bound = sorted(b["metadata"]["namespace"] for b in by_kind(docs, "RoleBinding"))
        check(bound == sorted(namespaces), f"every injected namespace has the sidecar's RoleBinding: {bound}")
    else:
        check(
            selector.get("matchLabels") == {"courier.dev/injection": "enabled"} and len(expressions) == 1,
            f"without sidecar.namespaces only opted-in namespaces are injected: {selector}",
        )


def check_generated_certificate(docs):
    secret = one(docs, "Secret")
    check(secret["type"] == "kubernetes.io/tls", "a TLS Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    check(set(data) == {"ca.crt", "tls.crt", "tls.key"}, f"keys {sorted(data)}")
    webhook = one(docs, "MutatingWebhookConfiguration")
    check(
        webhook["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"],
        "caBundle is the generated CA",
    )
    check(not by_kind(docs, "Certificate"), "no cert-manager Certificate")
    service = one(of(docs, "injector"), "Service")["metadata"]["name"]
    host = f"{service}.{RELEASE_NAMESPACE}.svc"
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in data.items():
            Path(tmp, name).write_text(text)
        verify = subprocess.run(
            ["openssl", "verify", "-CAfile", f"{tmp}/ca.crt", f"{tmp}/tls.crt"],
            capture_output=True,
            text=True,
        )
        check(verify.returncode == 0, f"the certificate is signed by the CA: {verify.stderr}")
        text = subprocess.run(
            ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", f"{tmp}/tls.crt"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        check(f"DNS:{host}" in text, f"the certificate names {host}: {text}")
        cert_key = subprocess.run(
            ["openssl", "x509", "-noout", "-pubkey", "-in", f"{tmp}/tls.crt"],
            capture_output=True, text=True, check=True,
        ).stdout
        key_key = subprocess.run(
            ["openssl", "pkey", "-pubout", "-in", f"{tmp}/tls.key"],
            capture_output=True, text=True, check=True,
        ).stdout
        check(cert_key == key_key, "the key belongs to the certificate")


def check_anti_affinity(docs, kind):
    pod = one(of(docs, "injector"), "Deployment")["spec"]["template"]["spec"]
    selector = one(of(docs, "injector"), "Deployment")["spec"]["selector"]["matchLabels"]
    anti = pod.get("affinity", {}).get("podAntiAffinity", {})
    if kind == "soft":
        terms = [t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    else:
        terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    check(
        len(terms) == 1
        and terms[0]["topologyKey"] == "kubernetes.io/hostname"
        and terms[0]["labelSelector"]["matchLabels"] == selector,
        f"{kind} anti-affinity keeps the injector's replicas on different nodes: {anti}",
    )


def serving_certificate(docs):
    name = one(of(docs, "injector"), "Service")["metadata"]["name"]
    found = [c for c in by_kind(docs, "Certificate") if c["metadata"]["name"] == name]
    check(len(found) == 1, f"one serving Certificate named {name}")
    return found[0]


def check_cert_manager(docs, own_issuer=True):
    check(not by_kind(docs, "Secret"), "no chart-made Secret with cert-manager")
    certificate = serving_certificate(docs)
    webhook = one(docs, "MutatingWebhookConfiguration")
    annotation = webhook["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from")
    check(
        annotation == f"{RELEASE_NAMESPACE}/{certificate['metadata']['name']}",
        f"cainjector is pointed at the Certificate: {annotation}",
    )
    check("caBundle" not in webhook["webhooks"][0]["clientConfig"], "cainjector fills caBundle")
    check(
        certificate["spec"]["secretName"]
        == one(of(docs, "injector"), "Deployment")["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"],
        "the injector mounts the Certificate's Secret",
    )
    issuers = {i["metadata"]["name"]: i for i in by_kind(docs, "Issuer")}
    if own_issuer:
        # self-signed Issuer -> root CA Certificate -> CA Issuer -> serving
        # Certificate: renewing the serving certificate keeps the trusted CA.
        check(len(issuers) == 2, f"a self-signed and a CA Issuer: {sorted(issuers)}")
        ca_issuer = issuers.get(certificate["spec"]["issuerRef"]["name"])
        check(ca_issuer is not None and "ca" in ca_issuer["spec"], "the serving certificate comes from a CA Issuer")
        roots = [c for c in by_kind(docs, "Certificate") if c["spec"].get("isCA")]
        check(len(roots) == 1, "one root CA Certificate")
        root = roots[0]
        check(ca_issuer["spec"]["ca"]["secretName"] == root["spec"]["secretName"], "the CA Issuer signs with the root")
        check(root["spec"]["privateKey"]["rotationPolicy"] == "Never", "the root keeps its key across renewals")
        self_signed = issuers.get(root["spec"]["issuerRef"]["name"])
        check(self_signed is not None and self_signed["spec"] == {"selfSigned": {}}, "the root is self-signed")
        check(
            root["spec"]["secretName"] != certificate["spec"]["secretName"],
            "the root and the serving certificate live in different Secrets",
        )
    else:
        check(not issuers, "no Issuer of the chart's own with issuerRef set")
        check(certificate["spec"]["issuerRef"]["kind"] == "ClusterIssuer", "the given issuer")


def check_provided_certificate(docs):
    check(not by_kind(docs, "Secret"), "no chart-made Secret with existingSecret")
    check(not by_kind(docs, "Certificate"), "no Certificate with existingSecret")
    webhook = one(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    check(webhook["clientConfig"]["caBundle"] == PROVIDED_CA, "caBundle is generatedCertificate.caBundle")
    volume = one(of(docs, "injector"), "Deployment")["spec"]["template"]["spec"]["volumes"][0]["secret"]["secretName"]
    check(volume == PROVIDED_SECRET, f"the injector mounts existingSecret, not {volume}")


def check_native(docs, native):
    env = env_of(injector(docs))
    check(
        env["COURIER_NATIVE_SIDECARS"] == ("true" if native else "false"),
        f"COURIER_NATIVE_SIDECARS is {env['COURIER_NATIVE_SIDECARS']}",
    )


def check_no_monitoring(docs):
    for kind in ("PodMonitor", "PrometheusRule", "ConfigMap", "RetryPolicy", "RoleBinding"):
        check(not by_kind(docs, kind), f"no {kind} unless asked for")


def check_monitoring(docs):
    monitor = one(docs, "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    check(endpoint["port"] == "courier-metrics", "scrapes the sidecar's named port")
    check(
        monitor["spec"]["namespaceSelector"] == {"matchNames": SIDECAR_NAMESPACES},
        f"in the injected namespaces: {monitor['spec']['namespaceSelector']}",
    )
    check(monitor["metadata"]["labels"].get("release") == "prom", "extra labels are added")

    rule = one(docs, "PrometheusRule")
    with open(ROOT / "monitoring/prometheus/courier-prometheusrule.yaml") as f:
        shipped = yaml.safe_load(f)
    check(rule["spec"] == shipped["spec"], "the PrometheusRule's rules are monitoring/'s")
    check(rule["metadata"]["labels"].get("release") == "prom", "ruleSelector labels are added")

    dashboard = one(of(docs, "monitoring"), "ConfigMap")
    check(dashboard["metadata"]["labels"].get("grafana_dashboard") == "1", "the grafana_dashboard label")
    shipped = (ROOT / "monitoring/grafana/courier-dashboard.json").read_text()
    check(
        json.loads(dashboard["data"]["courier-dashboard.json"]) == json.loads(shipped),
        "the dashboard is monitoring/'s",
    )


def check_monitoring_tuned(docs):
    """Thresholds and waits (`for`) by name, extra labels and the runbook
    base URL reach the rules; everything else is the shipped rules'."""
    rule = one(docs, "PrometheusRule")
    with open(ROOT / "monitoring/prometheus/courier-prometheusrule.yaml") as f:
        shipped = {r["alert"]: r for g in yaml.safe_load(f)["spec"]["groups"] for r in g["rules"]}
    rendered = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    check(set(rendered) == set(shipped), "the same alerts")
    tuned = {"CourierRetryRateHigh": "0.5", "CourierAppDown": "2"}
    for name, r in rendered.items():
        original = shipped[name]
        if name in tuned:
            head, _, _ = original["expr"].rpartition(" ")
            check(r["expr"] == f"{head} {tuned[name]}", f"{name}: threshold {tuned[name]}: {r['expr']}")
        else:
            check(r["expr"] == original["expr"], f"{name}: expr unchanged")
        waits = {"CourierQueuePaused": "4h"}
        check(r.get("for") == waits.get(name, original.get("for")), f"{name}: for {r.get('for')}")
        check(r["labels"] == {**original["labels"], "team": "payments"}, f"{name}: extra labels: {r['labels']}")
        anchor = original["annotations"]["runbook_url"].split("#")[1]
        check(
            r["annotations"]["runbook_url"] == f"https://runbooks.example/courier.md#{anchor}",
            f"{name}: runbook_url on the base URL",
        )


def check_no_console(docs):
    found = [f"{d['kind']} {d['metadata']['name']}" for d in of(docs, "console")]
    check(not found, f"nothing of the console unless console.enabled: {found}")


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_console(docs, overrides=None):
    """The console of tests/fixtures/helm/console-values.yaml (with
    `overrides` of its console values): a ConfigMap with queues.yaml, a
    ClusterIP Service and a locked-down Deployment of the courier image whose
    flags are the console's, every URL and the token from Secrets."""
    values = yaml.safe_load(CONSOLE_VALUES.read_text())["console"]
    values.update(overrides or {})
    objects = of(docs, "console")
    kinds = sorted(d["kind"] for d in objects)
    check(kinds == ["ConfigMap", "Deployment", "Service"], f"the console is a ConfigMap, a Deployment and a Service: {kinds}")
    config = one(objects, "ConfigMap")
    service = one(objects, "Service")
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    check(len(pod["containers"]) == 1 and not pod.get("initContainers"), "one container")
    container = pod["containers"][0]

    # Only its own pods behind each selector.
    selector = deployment["spec"]["selector"]["matchLabels"]
    check(selector.get("app.kubernetes.io/component") == "console", f"the console's selector: {selector}")
    check(selects(selector, labels), "the Deployment selects its pods")
    check(service["spec"]["selector"] == selector, "the Service selects the console's pods")
    injector_deployment = one(of(docs, "injector"), "Deployment")
    injector_labels = injector_deployment["spec"]["template"]["metadata"]["labels"]
    check(not selects(selector, injector_labels), "the console's selector leaves the injector's pods alone")
    for other in by_kind(docs, "Service") + by_kind(docs, "PodDisruptionBudget") + by_kind(docs, "Deployment"):
        if other is service or other is deployment:
            continue
        theirs = other["spec"]["selector"]
        theirs = theirs.get("matchLabels", theirs)
        check(not selects(theirs, labels), f"{other['kind']} {other['metadata']['name']} does not select the console")
    check(service["spec"]["type"] == "ClusterIP", "a ClusterIP Service")
    check(
        service["spec"]["ports"] == [{"name": "http", "port": 9470, "targetPort": "http", "protocol": "TCP"}],
        f"the Service's port: {service['spec']['ports']}",
    )
    check(deployment["spec"]["replicas"] == 1, "one replica")

    # The flags, and the files they name are mounted.
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}

    def mounted(path):
        mount = mounts.get(posixpath.dirname(path))
        check(mount is not None and mount.get("readOnly"), f"{path} is in a read-only mount: {sorted(mounts)}")
        return volumes[mount["name"]], posixpath.basename(path)

    args = container["args"]
    expected = ["console", "--listen", "0.0.0.0:9470", "--queues-file", "/etc/courier-console/queues.yaml"]
    token = values.get("tokenSecret") or {}
    # Wherever the chart puts the token, as long as it is mounted there
    # (checked below).
    token_file = args[args.index("--token-file") + 1] if "--token-file" in args[:-1] else None
    if values.get("allowWrites"):
        expected += ["--allow-writes"]
    if token:
        expected += ["--token-file", token_file]
    if values.get("prometheusUrl"):
        expected += ["--prometheus-url", values["prometheusUrl"]]
    check(args == expected, f"the console's flags: {args}, expected {expected}")
    volume, name = mounted("/etc/courier-console/queues.yaml")
    check(volume.get("configMap", {}).get("name") == config["metadata"]["name"], "queues.yaml is the ConfigMap's")
    check(name in config["data"], f"the ConfigMap has {name}")
    if token:
        volume, name = mounted(token_file)
        check(
            volume.get("secret") == {"secretName": token["name"], "items": [{"key": token["key"], "path": name}]},
            f"--token-file is the key {token['key']} of the Secret {token['name']}: {volume}",
        )
    else:
        check(not any("secret" in v for v in volumes.values()), "no Secret mounted without a token")

    # queues.yaml names each queue and the variable that has its URL; the
    # Deployment fills that variable from the queue's Secret.
    queues = yaml.safe_load(config["data"]["queues.yaml"])["queues"]
    check(len(queues) == len(values["queues"]), f"every queue: {queues}")
    env = {e["name"]: e for e in container["env"]}
    check(len(env) == len(container["env"]), "no variable twice")
    for i, (rendered, given) in enumerate(zip(queues, values["queues"])):
        check(rendered["queue"] == given["queue"], f"queue {i}: {rendered}")
        for key in ("name", "dlq"):
            check(rendered.get(key) == given.get(key), f"queue {i}: {key} {rendered.get(key)!r}")
        check("source" not in rendered, f"queue {i}: no URL in the ConfigMap")
        check(set(rendered) <= {"name", "queue", "dlq", "sourceEnv"}, f"queue {i}: keys {sorted(rendered)}")
        variable = env.get(rendered["sourceEnv"])
        check(variable is not None, f"queue {i}: {rendered['sourceEnv']} is set")
        check(
            variable.get("valueFrom") == {"secretKeyRef": {"name": given["sourceSecret"]["name"], "key": given["sourceSecret"]["key"]}},
            f"queue {i}: {rendered['sourceEnv']} comes from its sourceSecret: {variable}",
        )
    check(
        not any("://" in str(e.get("value", "")) for e in container["env"]) and "://" not in config["data"]["queues.yaml"],
        "no URL in the clear",
    )
    annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
    check(
        annotations.get("checksum/queues") == hashlib.sha256(config["data"]["queues.yaml"].rstrip("\n").encode()).hexdigest(),
        "a change of queues.yaml rolls the pods",
    )

    # Probes on /healthz (no token needed), on the port it listens on.
    ports = container["ports"]
    check(ports == [{"name": "http", "containerPort": 9470, "protocol": "TCP"}], f"the console's port: {ports}")
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        check(get["path"] == "/healthz" and get["port"] == "http" and get.get("scheme", "HTTP") == "HTTP", f"{probe}: {get}")

    # The image and the lock-down of the injector.
    check(container["image"] == injector(docs)["image"], "the injector's image")
    sc = container["securityContext"]
    check(
        sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False,
        f"the console is locked down: {sc}",
    )
    check(sc["capabilities"] == {"drop": ["ALL"]}, "no capabilities")
    check(
        pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == UID,
        f"the console runs as {UID}",
    )
    check(pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, "the runtime's seccomp profile")
    check(pod["automountServiceAccountToken"] is False, "the console needs no API token")
    check(container["resources"]["limits"]["memory"] == "64Mi", "a memory limit")


def check_policy_and_rbac(docs):
    bindings = by_kind(docs, "RoleBinding")
    check(
        sorted(b["metadata"]["namespace"] for b in bindings) == sorted(SIDECAR_NAMESPACES),
        "one RoleBinding per sidecar namespace",
    )
    for b in bindings:
        ns = b["metadata"]["namespace"]
        check(b["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": ns}
            for account in SIDECAR_ACCOUNTS
        ], f"bound to the service accounts {SIDECAR_ACCOUNTS} of {ns}, not to all of them: {b['subjects']}")
        check(b["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"], "the sidecar role")

    policies = by_kind(docs, "RetryPolicy")
    check(
        sorted(p["metadata"]["namespace"] for p in policies) == sorted(SIDECAR_NAMESPACES),
        "one default RetryPolicy per sidecar namespace",
    )
    crd = yaml.safe_load((ROOT / "charts/courier/crds/retrypolicy.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    schema = version["schema"]["openAPIV3Schema"]
    for policy in policies:
        check(policy["apiVersion"] == f"{crd['spec']['group']}/v1alpha1", "the CRD's group and version")
        try:
            validate_structural(policy, schema)
        except jsonschema.ValidationError as e:
            raise Failed(f"RetryPolicy {policy['metadata']['namespace']}: {e.message}")


def validate_structural(document, schema):
    """A CRD's openAPIV3Schema as a JSON schema, unknown fields refused
    (the API server prunes them; here they are a mistake)."""
    def strict(node):
        if isinstance(node, dict):
            node = {k: strict(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            return node
        if isinstance(node, list):
            return [strict(v) for v in node]
        return node

    body = {k: v for k, v in document.items() if k not in ("apiVersion", "kind", "metadata")}
    schema = strict(schema)
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in ("apiVersion", "kind", "metadata")}
    jsonschema.validate(body, schema)


VARIANTS = {
    "default": [
        check_generated_certificate,
        lambda d: check_scope(d, []),
        lambda d: check_native(d, True),
        check_no_monitoring,
        check_no_console,
        lambda d: check_anti_affinity(d, "soft"),
    ],
    "console": [check_console, check_generated_certificate],
    "console-read-only": [
        lambda d: check_console(d, {"allowWrites": False, "tokenSecret": None, "prometheusUrl": ""}),
    ],
    "anti-affinity-hard": [lambda d: check_anti_affinity(d, "hard")],
    "provided-cert": [check_provided_certificate],
    "cert-manager": [check_cert_manager],
    "cert-manager-issuer": [lambda d: check_cert_manager(d, own_issuer=False)],
    "apis-present": [check_generated_certificate, check_no_monitoring, check_no_console],
    "native-off": [lambda d: check_native(d, False), check_generated_certificate],
    "monitoring-tuned": [
        check_monitoring_tuned,
        lambda d: check(
            one(d, "PodMonitor")["spec"]["namespaceSelector"] == {"any": True},
            "without sidecar.namespaces the PodMonitor scrapes every namespace",
        ),
    ],
    "monitoring": [check_monitoring, check_policy_and_rbac, lambda d: check_scope(d, SIDECAR_NAMESPACES)],
    "everything": [
        check_cert_manager,
        check_monitoring,
        check_policy_and_rbac,
        check_console,
        lambda d: check_native(d, False),
        lambda d: check_scope(d, SIDECAR_NAMESPACES),
    ],
}


def main():
    variant, path = sys.argv[1], sys.argv[2]
    try:
        docs = load(path)
        check_common(docs)
        for step in VARIANTS[variant]:
            step(docs)
    except Failed as e:
        print(f"check-chart {variant}: {e}", file=sys.stderr)
        return 1
    print(f"check-chart {variant}: {len(docs)} manifests as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
