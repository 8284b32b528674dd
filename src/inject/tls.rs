//! The webhook's certificate, reloaded when its files change, so that a
//! rotated Secret needs no restart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// Errors reading the webhook's certificate and key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate in it")]
    NoCertificate { path: PathBuf },
    #[error("{path}: not a PEM certificate chain: {source}")]
    BadCertificate {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path}: not a PEM private key: {source}")]
    BadKey {
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("the certificate and key do not go together: {0}")]
    Mismatch(rustls::Error),
}

/// Serves whichever certificate was loaded last. The files are read again
/// when their contents change (a Secret volume swaps a symlink, so content
/// is what to compare, not the modification time).
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    state: RwLock<LoadedCert>,
}

#[derive(Debug)]
struct LoadedCert {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    key: Arc<CertifiedKey>,
}

impl ReloadingCert {
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, TlsError> {
        let (cert_pem, key_pem) = read_pair(cert_path, key_path)?;
        let key = Arc::new(certified_key(cert_path, key_path, &cert_pem, &key_pem)?);
        Ok(Self {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            state: RwLock::new(LoadedCert {
                cert_pem,
                key_pem,
                key,
            }),
        })
    }

    /// The certificate file, for logs.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }

    /// Reads the files again; `Ok(true)` when a new pair is now served.
    /// A bad new pair is refused and the old one stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let (cert_pem, key_pem) = read_pair(&self.cert_path, &self.key_path)?;
        {
            let state = self.state.read().unwrap_or_else(|e| e.into_inner());
            if state.cert_pem == cert_pem && state.key_pem == key_pem {
                return Ok(false);
            }
        }
        let key = Arc::new(certified_key(
            &self.cert_path,
            &self.key_path,
            &cert_pem,
            &key_pem,
        )?);
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = LoadedCert {
            cert_pem,
            key_pem,
            key,
        };
        Ok(true)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.state
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .key
                .clone(),
        )
    }
}

fn read_pair(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })
    };
    Ok((read(cert)?, read(key)?))
}

fn certified_key(
    cert_path: &Path,
    key_path: &Path,
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCertificate {
            path: cert_path.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_path_buf(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::BadKey {
        path: key_path.to_path_buf(),
        source,
    })?;
    CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider())
        .map_err(TlsError::Mismatch)
}

/// A rustls server configuration that serves the reloading certificate,
/// with the ring provider named explicitly (never the process default).
pub fn server_config(cert: Arc<ReloadingCert>) -> anyhow::Result<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .context("the TLS protocol versions")?
    .with_no_client_auth()
    .with_cert_resolver(cert);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}
