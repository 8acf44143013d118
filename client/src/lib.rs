//! Connecting to ublkd's gRPC API: a unix socket, or TCP with or without TLS. Shared by every
//! client (`ublkctl`, `ublkd-csi`) so they reach the daemon the same way.
//!
//! The channel connects eagerly, so "the daemon is not there" surfaces here, as
//! [`ConnectError::Unreachable`], before any request is sent; so do certificates that either
//! side refuses ([`ConnectError::ServerCertificate`], [`ConnectError::ClientCertificateRefused`]),
//! worded as what happened and what to do (`tls`).
#![forbid(unsafe_code)]

mod tls;

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

pub use tls::{ClientCertProblem, ServerCertProblem, TlsFiles};
pub use ublkd_proto::units;
pub use ublkd_proto::v1;

/// Why no channel was made, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// A TLS file named by `what` (`ca`, `cert`, `key`) could not be read.
    #[error("cannot read {what} {}: {source}", path.display())]
    ReadTlsFile {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A TLS file was read but does not hold what it should (no PEM certificate, a key that is
    /// no key or does not match the certificate).
    #[error("{what} {}: {reason}", path.display())]
    BadTlsFile {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("a client certificate needs its key and a key its certificate: give both or neither")]
    HalfIdentity,
    /// The `https://` URI has no host to dial.
    #[error("{uri} is not an https://HOST:PORT URI")]
    BadUri { uri: String },
    /// The name the server's certificate is checked against (the host, or the TLS domain) is
    /// neither a DNS name nor an IP address.
    #[error("{name:?} cannot be checked against a certificate: it is no DNS name or IP address")]
    BadServerName { name: String },
    /// rustls could not be set up (no protocol version its crypto provider supports).
    #[error("cannot set TLS up: {0}")]
    TlsSetup(String),
    /// This client did not accept the server's certificate.
    #[error("ublkd at {endpoint} presented a certificate this client does not accept: {problem}")]
    ServerCertificate {
        endpoint: String,
        problem: ServerCertProblem,
    },
    /// The server did not accept this client's certificate (`cert`, when one was given).
    #[error("{}", refused(endpoint, cert.as_deref(), problem))]
    ClientCertificateRefused {
        endpoint: String,
        cert: Option<PathBuf>,
        problem: ClientCertProblem,
    },
    /// The daemon is not there (or not answering): `cause` is the transport's reason.
    #[error("cannot reach ublkd at {endpoint}: {cause}: is it running?")]
    Unreachable { endpoint: String, cause: String },
}

fn refused(endpoint: &str, cert: Option<&Path>, problem: &ClientCertProblem) -> String {
    match (problem, cert) {
        (ClientCertProblem::Missing, _) | (_, None) => {
            format!("ublkd at {endpoint} refused the connection: {problem}")
        }
        (_, Some(cert)) => format!(
            "ublkd at {endpoint} refused this client's certificate {}: {problem}",
            cert.display()
        ),
    }
}

/// Where ublkd listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A unix socket path (`unix:///run/ublkd/ublkd.sock`).
    Unix(PathBuf),
    /// An `http://` (`tls: false`) or `https://` URI.
    Tcp { uri: String, tls: bool },
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Unix(path) => write!(f, "unix://{}", path.display()),
            Target::Tcp { uri, .. } => f.write_str(uri),
        }
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::ReadTlsFile {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Everything needed to reach the daemon.
#[derive(Debug, Clone)]
pub struct Connection {
    pub target: Target,
    pub tls: TlsFiles,
    /// Bounds connecting and, separately, each call.
    pub timeout: Duration,
}

/// Connects to ublkd.
pub async fn connect(conn: &Connection) -> Result<Channel, ConnectError> {
    let unreachable = |cause: String| ConnectError::Unreachable {
        endpoint: conn.target.to_string(),
        cause,
    };
    let attempt = async {
        match &conn.target {
            Target::Unix(path) => {
                let path = path.clone();
                // The URI is a placeholder: the connector ignores it and HTTP/2 needs one.
                Endpoint::from_static("http://localhost")
                    .connect_timeout(conn.timeout)
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            let stream = tokio::net::UnixStream::connect(path).await?;
                            Ok::<_, std::io::Error>(TokioIo::new(stream))
                        }
                    }))
                    .await
                    .map_err(|e| unreachable(cause_chain(&e)))
            }
            Target::Tcp { uri, tls: false } => Endpoint::from_shared(uri.clone())
                .map_err(|e| unreachable(cause_chain(&e)))?
                .connect_timeout(conn.timeout)
                .connect()
                .await
                .map_err(|e| unreachable(cause_chain(&e))),
            Target::Tcp { uri, tls: true } => {
                let client = tls::Client::new(uri, &conn.tls)?;
                // TLS is the connector's (see `tls`), and tonic refuses an https:// URI it
                // does not do TLS for: the channel's own URI is plain, and only names the
                // server in requests.
                let plain = format!("http://{}", uri.trim_start_matches("https://"));
                Endpoint::from_shared(plain)
                    .map_err(|e| unreachable(cause_chain(&e)))?
                    .connect_timeout(conn.timeout)
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let client = client.clone();
                        async move { client.connect().await }
                    }))
                    .await
                    .map_err(|e| {
                        tls::explain(&e, uri, &conn.tls)
                            .unwrap_or_else(|| unreachable(cause_chain(&e)))
                    })
            }
        }
    };
    match tokio::time::timeout(conn.timeout, attempt).await {
        Ok(channel) => channel,
        Err(_) => Err(unreachable(format!(
            "no connection within {}s",
            conn.timeout.as_secs()
        ))),
    }
}

impl std::str::FromStr for Target {
    type Err = String;

    /// Reads `unix:///PATH` (or a bare absolute path), `http://HOST:PORT` or `https://HOST:PORT`.
    fn from_str(s: &str) -> Result<Target, String> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("unix:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if !path.starts_with('/') {
                return Err("expected unix:///ABSOLUTE/PATH".into());
            }
            return Ok(Target::Unix(PathBuf::from(path)));
        }
        if s.starts_with('/') {
            return Ok(Target::Unix(PathBuf::from(s)));
        }
        let tls = if s.starts_with("https://") {
            true
        } else if s.starts_with("http://") {
            false
        } else {
            return Err("expected unix:///PATH, http://HOST:PORT or https://HOST:PORT".into());
        };
        let endpoint =
            Endpoint::from_shared(s.to_owned()).map_err(|_| "not a valid URI".to_owned())?;
        if endpoint.uri().host().is_none_or(str::is_empty) {
            return Err("the URI has no host".into());
        }
        Ok(Target::Tcp {
            uri: s.to_owned(),
            tls,
        })
    }
}

fn chain<'a>(
    first: Option<&'a (dyn std::error::Error + 'static)>,
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(first, |&e| e.source())
}

/// An error and its sources as one line, without tonic's generic "transport error" wrapper and
/// without repeating a message that wrapper layers pass through unchanged.
pub fn cause_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    for e in chain(Some(err)) {
        let text = e.to_string();
        if text == "transport error" || parts.last() == Some(&text) {
            continue;
        }
        parts.push(text);
    }
    if parts.is_empty() {
        return err.to_string();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn a_missing_socket_is_unreachable() {
        let conn = Connection {
            target: Target::Unix("/nonexistent/ublkd-test.sock".into()),
            tls: TlsFiles::default(),
            timeout: Duration::from_secs(5),
        };
        let err = connect(&conn).await.unwrap_err();
        assert!(matches!(err, ConnectError::Unreachable { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.starts_with("cannot reach ublkd at unix:///nonexistent/ublkd-test.sock: ")
                && text.ends_with(": is it running?"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn an_unreadable_ca_is_a_usage_error() {
        let conn = Connection {
            target: Target::Tcp {
                uri: "https://localhost:1".into(),
                tls: true,
            },
            tls: TlsFiles {
                ca: Some("/nonexistent/ca.pem".into()),
                ..TlsFiles::default()
            },
            timeout: Duration::from_secs(5),
        };
        let err = connect(&conn).await.unwrap_err();
        assert!(
            matches!(err, ConnectError::ReadTlsFile { what: "ca", .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("cannot read ca"), "{err}");
    }

    #[test]
    fn cause_chains_skip_wrappers_and_repeats() {
        #[derive(Debug)]
        struct Wrap(&'static str, Option<Box<Wrap>>);
        impl fmt::Display for Wrap {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let err = Wrap(
            "transport error",
            Some(Box::new(Wrap(
                "No such file",
                Some(Box::new(Wrap("No such file", None))),
            ))),
        );
        assert_eq!(cause_chain(&err), "No such file");
    }
}
