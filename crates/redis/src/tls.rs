//! `rediss://`: the `--tls-*` files in the form the redis client takes them,
//! for a single node and for every other way of reaching Redis.

use redis::{Client, ClientTlsConfig, ConnectionInfo, RedisResult, TlsCertificates};

use courier_core::source::Tls;

/// The CA and client certificate of the `--tls-*` flags as the redis client
/// takes them (`Client::build_with_tls`, a cluster client's `certs`,
/// sentinel's certificates); `None` without flags, when `rediss://`
/// verifies the server against the system's roots.
pub(super) fn certificates(tls: &Tls) -> Option<TlsCertificates> {
    tls.is_set().then(|| TlsCertificates {
        client_tls: tls.client_pem().map(|(cert, key)| ClientTlsConfig {
            client_cert: cert.to_vec(),
            client_key: key.to_vec(),
        }),
        root_cert: tls.ca_pem().map(<[u8]>::to_vec),
    })
}

/// A client of one node, with the TLS flags when there are any.
pub(super) fn client(info: ConnectionInfo, tls: &Tls) -> RedisResult<Client> {
    match certificates(tls) {
        Some(certificates) => Client::build_with_tls(info, certificates),
        None => Client::open(info),
    }
}
