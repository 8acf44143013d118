//! gRPC over TCP with TLS whose certificate and key are read again when their files change, so
//! rotating them (cert-manager, a renewal timer) never needs a restart, which would pause every
//! volume's I/O. Connections already open keep the certificate they were made with.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

/// How often a handshake may look at the files' modification times.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of setting TLS up, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the certificate chain {path}")]
    ReadCertificate {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    #[error("cannot read the private key {path}")]
    ReadKey {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("the private key {path} is of no supported type")]
    KeyType {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the key {} is not the key of the certificate {}", key.display(), cert.display())]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot read the client CA {path}")]
    ReadClientCa {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("the client CA {path} is not usable")]
    ClientCa {
        path: PathBuf,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("building the TLS configuration")]
    Config(#[source] rustls::Error),
}

/// The server certificate and key, from `cert` and `key`, reloaded when either file changes.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    checked: Instant,
    stamps: [Option<SystemTime>; 2],
    current: Arc<CertifiedKey>,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect())
        .map_err(|source| TlsError::ReadCertificate {
            path: cert.to_owned(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate(cert.to_owned()));
    }
    let der = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::ReadKey {
        path: key.to_owned(),
        source,
    })?;
    let signing = rustls::crypto::ring::sign::any_supported_type(&der).map_err(|source| {
        TlsError::KeyType {
            path: key.to_owned(),
            source,
        }
    })?;
    let pair = CertifiedKey::new(chain, signing);
    // A pair whose key does not match would fail every handshake; refused here, it leaves the
    // pair in use as it was (a rotation half done: the certificate renamed in, the key not yet).
    pair.keys_match().map_err(|source| TlsError::KeyMismatch {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    })?;
    Ok(pair)
}

impl ReloadingCert {
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let stamps = [modified(cert), modified(key)];
        let current = Arc::new(load_pair(cert, key)?);
        Ok(Self {
            cert: cert.to_owned(),
            key: key.to_owned(),
            state: Mutex::new(State {
                checked: Instant::now(),
                stamps,
                current,
            }),
        })
    }

    /// Reads the pair again when a file's modification time changed since it was last read.
    /// Returns whether a new pair is in use. A pair that does not load (a half-written file, a
    /// key that does not match yet) leaves the old one in use, says so in the log, and is tried
    /// again at the next check.
    pub fn refresh(&self) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        state.checked = Instant::now();
        let stamps = [modified(&self.cert), modified(&self.key)];
        if stamps == state.stamps {
            return false;
        }
        match load_pair(&self.cert, &self.key) {
            Ok(pair) => {
                state.current = Arc::new(pair);
                state.stamps = stamps;
                tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                true
            }
            Err(e) => {
                tracing::warn!(error = %crate::error::chain(&e), "new TLS certificate not loaded; keeping the old one");
                false
            }
        }
    }

    /// The pair in use now.
    pub fn current(&self) -> Option<Arc<CertifiedKey>> {
        self.state.lock().ok().map(|s| Arc::clone(&s.current))
    }

    fn due(&self) -> bool {
        self.state
            .lock()
            .is_ok_and(|s| s.checked.elapsed() >= CHECK_EVERY)
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if self.due() {
            self.refresh();
        }
        self.current()
    }
}

/// The server's TLS configuration: the reloading certificate, client certificates required
/// and checked against `client_ca` when given, HTTP/2 by ALPN.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Config)?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let read = |source| TlsError::ReadClientCa {
                path: ca.to_owned(),
                source,
            };
            let unusable = |source: Box<dyn std::error::Error + Send + Sync>| TlsError::ClientCa {
                path: ca.to_owned(),
                source,
            };
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).map_err(read)? {
                roots
                    .add(c.map_err(read)?)
                    .map_err(|e| unusable(Box::new(e)))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| unusable(Box::new(e)))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(ReloadingCert::load(cert, key)?));
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// TLS connections accepted on `listener`, each handshake on its own task (a slow client
/// never holds up the next), for `serve_with_incoming`.
pub fn incoming(
    listener: TcpListener,
    config: Arc<ServerConfig>,
) -> ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        while !tx.is_closed() {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accepting a gRPC connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        // The receiver is gone only when the server stops: the connection
                        // is dropped with it.
                        let _ = tx.send(Ok(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate and key for `cn`, made by openssl.
    fn make_pair(dir: &Path, name: &str, cn: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = (
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.key")),
        );
        let ok = std::process::Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .arg("-subj")
            .arg(format!("/CN={cn}"))
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs")
            .success();
        assert!(ok, "openssl made a certificate");
        (cert, key)
    }

    fn leaf(r: &ReloadingCert) -> Vec<u8> {
        r.current().unwrap().cert[0].as_ref().to_vec()
    }

    #[test]
    fn a_changed_pair_is_picked_up_and_a_broken_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let (a_cert, a_key) = make_pair(dir.path(), "a", "a.example");
        let (b_cert, b_key) = make_pair(dir.path(), "b", "b.example");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::copy(&a_cert, &cert).unwrap();
        std::fs::copy(&a_key, &key).unwrap();
        let r = ReloadingCert::load(&cert, &key).unwrap();
        let a = leaf(&r);
        assert!(!r.refresh(), "nothing changed, nothing reloaded");

        // Rotation: both files replaced (their times moved on, as a writer's would).
        let later = SystemTime::now() + Duration::from_secs(5);
        for (from, to) in [(&b_cert, &cert), (&b_key, &key)] {
            std::fs::copy(from, to).unwrap();
            std::fs::File::options()
                .write(true)
                .open(to)
                .unwrap()
                .set_modified(later)
                .unwrap();
        }
        assert!(r.refresh(), "the new pair is in use");
        let b = leaf(&r);
        assert_ne!(a, b);

        // A half-written certificate keeps the pair in use.
        std::fs::write(&cert, b"-----BEGIN CERTIFICATE-----\nAAAA").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&cert)
            .unwrap()
            .set_modified(later + Duration::from_secs(5))
            .unwrap();
        assert!(!r.refresh());
        assert_eq!(leaf(&r), b);
    }

    /// The doc of `refresh` promised it; nothing checked it (issue 38, the lower list).
    #[test]
    fn a_key_that_is_not_the_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (a_cert, _) = make_pair(dir.path(), "a", "a.example");
        let (_, b_key) = make_pair(dir.path(), "b", "b.example");
        let e = server_config(&a_cert, &b_key, None).unwrap_err();
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
    }

    #[test]
    fn bad_files_are_named_in_the_error() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = make_pair(dir.path(), "a", "a.example");
        let missing = dir.path().join("missing.key");
        let e = server_config(&cert, &missing, None).unwrap_err();
        assert!(
            matches!(&e, TlsError::ReadKey { path, .. } if path == &missing),
            "{e}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, b"").unwrap();
        let e = server_config(&empty, &key, None).unwrap_err();
        assert!(matches!(e, TlsError::NoCertificate(_)), "{e}");
        assert!(server_config(&cert, &key, Some(&cert)).is_ok());
    }
}
