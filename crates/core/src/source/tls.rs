//! TLS to the broker: the files of `--tls-ca-file`, `--tls-cert-file` and
//! `--tls-key-file`, read and checked once before anything connects, in the
//! forms each broker's client takes (PEM for Redis and RabbitMQ, a rustls
//! configuration with the ring provider for NATS), and the error a failed
//! certificate check becomes.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};

use super::{ErrorKind, SourceError};

/// The TLS files as given on the command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// The TLS settings a source connects with: the CA that signs the broker's
/// certificate (else the system's roots) and a client certificate for
/// mutual TLS, both read and checked at start.
#[derive(Clone, Default)]
pub struct Tls {
    ca: Option<Loaded>,
    client: Option<Client>,
    config: Option<Arc<ClientConfig>>,
}

#[derive(Clone)]
struct Loaded {
    path: PathBuf,
    pem: Vec<u8>,
}

#[derive(Clone)]
struct Client {
    cert: Loaded,
    key: Loaded,
}

impl fmt::Debug for Tls {
    // The key's contents never reach a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_file", &self.ca.as_ref().map(|ca| &ca.path))
            .field("cert_file", &self.client.as_ref().map(|c| &c.cert.path))
            .field("key_file", &self.client.as_ref().map(|c| &c.key.path))
            .finish()
    }
}

impl Tls {
    /// Reads and checks the files: each readable, the CA file and the
    /// certificate file PEM certificates, the key file a PEM private key
    /// that belongs to the certificate, and the certificate and key given
    /// together. The message names the flag, the file and what to do.
    pub fn load(files: &TlsFiles) -> Result<Self, String> {
        let ca = files
            .ca_file
            .as_deref()
            .map(|path| read("--tls-ca-file", path))
            .transpose()?;
        let client = match (&files.cert_file, &files.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(Client {
                cert: read("--tls-cert-file", cert)?,
                key: read("--tls-key-file", key)?,
            }),
            (Some(_), None) => {
                return Err(
                    "--tls-cert-file is given without --tls-key-file; mutual TLS needs both, the key of the certificate in PEM".into(),
                );
            }
            (None, Some(_)) => {
                return Err(
                    "--tls-key-file is given without --tls-cert-file; mutual TLS needs both, the certificate in PEM".into(),
                );
            }
        };
        let mut tls = Self {
            ca,
            client,
            config: None,
        };
        if tls.is_set() {
            tls.config = Some(Arc::new(tls.build()?));
        }
        Ok(tls)
    }

    /// Whether any TLS flag was given.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.client.is_some()
    }

    /// The CA certificates (PEM) of `--tls-ca-file`.
    pub fn ca_pem(&self) -> Option<&[u8]> {
        self.ca.as_ref().map(|ca| ca.pem.as_slice())
    }

    /// The client certificate chain and its key (PEM), for mutual TLS.
    pub fn client_pem(&self) -> Option<(&[u8], &[u8])> {
        self.client
            .as_ref()
            .map(|c| (c.cert.pem.as_slice(), c.key.pem.as_slice()))
    }

    /// A rustls client configuration (ring) trusting `--tls-ca-file` only,
    /// or the system's roots without it, and presenting the client
    /// certificate when one is given; `None` when no flag was given.
    pub fn client_config(&self) -> Option<ClientConfig> {
        self.config.as_deref().cloned()
    }

    fn build(&self) -> Result<ClientConfig, String> {
        let builder = verifying("--tls-ca-file", self.ca.as_ref(), "broker")?;
        let Some(client) = &self.client else {
            return Ok(builder.with_no_client_auth());
        };
        let chain = certificates("--tls-cert-file", &client.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&client.key.pem).map_err(|e| {
            format!(
                "--tls-key-file {}: not a PEM private key ({e}); give the unencrypted key of --tls-cert-file (BEGIN PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)",
                client.key.path.display()
            )
        })?;
        builder.with_client_auth_cert(chain, key).map_err(|e| {
            format!(
                "--tls-key-file {} does not go with --tls-cert-file {} ({e}); give the key the certificate was issued for",
                client.key.path.display(),
                client.cert.path.display()
            )
        })
    }

    /// The error to show when opening a source failed on TLS: a broker
    /// certificate the CA does not vouch for, or a client certificate the
    /// broker refused (or did not get). Such a failure does not pass by
    /// itself, so it ends the start ([`ErrorKind::Invalid`]) instead of
    /// being retried as an unreachable broker; any other error is kept.
    pub fn explain(&self, error: SourceError) -> SourceError {
        if error.kind() == ErrorKind::Invalid {
            return error;
        }
        let text = error.message();
        let trusted = match &self.ca {
            Some(ca) => format!(
                "the CA in --tls-ca-file {} did not sign it",
                ca.path.display()
            ),
            None => "no CA in the system's store signed it".to_string(),
        };
        if text.contains("invalid peer certificate") {
            let fix = match &self.ca {
                Some(_) => {
                    "check that --tls-ca-file holds the CA that signed the broker's certificate, and that the certificate names the host of --source"
                }
                None => "give the CA that signed it with --tls-ca-file",
            };
            return SourceError::invalid(format!(
                "certificate verify failed: the broker's certificate is not trusted ({trusted}, or it is not valid for the host): {text}; {fix}"
            ));
        }
        let refused = [
            "CertificateRequired",
            "BadCertificate",
            "UnknownCA",
            "CertificateUnknown",
            "HandshakeFailure",
        ];
        if text.contains("received fatal alert") && refused.iter().any(|alert| text.contains(alert))
        {
            let fix = match &self.client {
                Some(c) => format!(
                    "the broker did not accept the client certificate --tls-cert-file {}; check that the broker trusts the CA that issued it",
                    c.cert.path.display()
                ),
                None => "the broker asks for a client certificate (mutual TLS); give it with --tls-cert-file and --tls-key-file".to_string(),
            };
            return SourceError::invalid(format!(
                "the TLS handshake was refused by the broker: {text}; {fix}"
            ));
        }
        error
    }
}

/// A TLS client configuration (the ring provider) that trusts the CA
/// certificates of the PEM file at `ca`, else the system's roots, and shows
/// no certificate of its own. `flag` names the file in errors, `server`
/// what the CA signed (the OpenTelemetry collector's export uses it too).
pub fn client_config(flag: &str, ca: Option<&Path>, server: &str) -> Result<ClientConfig, String> {
    let ca = ca.map(|path| read(flag, path)).transpose()?;
    Ok(verifying(flag, ca.as_ref(), server)?.with_no_client_auth())
}

/// The configuration up to the client's own certificate: the ring provider
/// and the roots of `ca` (named `flag`), else the system's.
fn verifying(
    flag: &str,
    ca: Option<&Loaded>,
    server: &str,
) -> Result<rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert>, String> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(ca) => {
            for cert in certificates(flag, ca)? {
                roots.add(cert).map_err(|e| {
                    format!(
                        "{flag} {}: a certificate in it cannot be used as a CA ({e}); give the PEM certificate of the CA that signed the {server}'s certificate",
                        ca.path.display()
                    )
                })?;
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    Ok(
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots),
    )
}

fn read(flag: &str, path: &Path) -> Result<Loaded, String> {
    let pem = std::fs::read(path)
        .map_err(|e| format!("{flag} {}: cannot read it ({e})", path.display()))?;
    Ok(Loaded {
        path: path.to_path_buf(),
        pem,
    })
}

/// Every certificate of a PEM file; at least one.
fn certificates(flag: &str, file: &Loaded) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(&file.pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            format!(
                "{flag} {}: not a PEM certificate file ({e}); give certificates as -----BEGIN CERTIFICATE----- blocks",
                file.path.display()
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "{flag} {}: no PEM certificate in it; give certificates as -----BEGIN CERTIFICATE----- blocks",
            file.path.display()
        ));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path, ca: Option<&str>, cert: Option<&str>, key: Option<&str>) -> TlsFiles {
        let write = |name: &str, text: Option<&str>| {
            text.map(|t| {
                let path = dir.join(name);
                std::fs::write(&path, t).unwrap();
                path
            })
        };
        TlsFiles {
            ca_file: write("ca.pem", ca),
            cert_file: write("cert.pem", cert),
            key_file: write("key.pem", key),
        }
    }

    #[test]
    fn no_flags_mean_no_tls_settings() {
        let tls = Tls::load(&TlsFiles::default()).unwrap();
        assert!(!tls.is_set());
        assert!(tls.client_config().is_none());
    }

    #[test]
    fn bad_files_are_named_with_their_flag() {
        let dir = tempfile::tempdir().unwrap();
        let missing = TlsFiles {
            ca_file: Some(dir.path().join("nope.pem")),
            ..Default::default()
        };
        let err = Tls::load(&missing).unwrap_err();
        assert!(
            err.contains("--tls-ca-file") && err.contains("cannot read"),
            "{err}"
        );
        let err = Tls::load(&files(dir.path(), Some("not pem"), None, None)).unwrap_err();
        assert!(
            err.contains("--tls-ca-file") && err.contains("no PEM certificate"),
            "{err}"
        );
        let err = Tls::load(&files(dir.path(), None, Some("x"), None)).unwrap_err();
        assert!(err.contains("without --tls-key-file"), "{err}");
    }

    #[test]
    fn a_certificate_failure_ends_the_start_naming_the_flag() {
        let tls = Tls::default();
        let e = tls.explain(SourceError::unavailable(
            "127.0.0.1:1: invalid peer certificate: UnknownIssuer",
        ));
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e:?}");
        let text = e.message();
        assert!(text.starts_with("certificate verify failed"), "{text}");
        assert!(text.contains("--tls-ca-file"), "{text}");
        let e = tls.explain(SourceError::unavailable(
            "received fatal alert: CertificateRequired",
        ));
        assert!(
            e.kind() == ErrorKind::Invalid && e.message().contains("--tls-cert-file"),
            "{e:?}"
        );
        let e = tls.explain(SourceError::unavailable("connection refused"));
        assert_eq!(e.kind(), ErrorKind::Unavailable, "{e:?}");
    }
}
