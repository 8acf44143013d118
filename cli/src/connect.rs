//! Opening the gRPC channel to ublkd: a unix socket, or TCP with or without TLS.
//!
//! The channel connects eagerly, so "the daemon is not there" surfaces here, as
//! [`Error::Unreachable`], before any request is sent.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};

use crate::error::{cause_chain, Error};

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

/// The TLS options, as given; all optional until [`crate::args::Cli::connection`] checks them.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub domain: Option<String>,
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none() && self.domain.is_none()
    }

    fn client_config(&self) -> Result<ClientTlsConfig, Error> {
        let mut config = ClientTlsConfig::new();
        if let Some(ca) = &self.ca {
            config = config.ca_certificate(Certificate::from_pem(read("--ca", ca)?));
        }
        if let (Some(cert), Some(key)) = (&self.cert, &self.key) {
            config = config.identity(Identity::from_pem(
                read("--cert", cert)?,
                read("--key", key)?,
            ));
        }
        if let Some(domain) = &self.domain {
            config = config.domain_name(domain.clone());
        }
        Ok(config)
    }
}

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path)
        .map_err(|e| Error::Usage(format!("cannot read {flag} {}: {e}", path.display())))
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
pub async fn connect(conn: &Connection) -> Result<Channel, Error> {
    let unreachable = |cause: String| Error::Unreachable {
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
            Target::Tcp { uri, tls } => {
                let mut endpoint = Endpoint::from_shared(uri.clone())
                    .map_err(|e| unreachable(cause_chain(&e)))?
                    .connect_timeout(conn.timeout);
                if *tls {
                    endpoint = endpoint
                        .tls_config(conn.tls.client_config()?)
                        .map_err(|e| unreachable(cause_chain(&e)))?;
                }
                endpoint
                    .connect()
                    .await
                    .map_err(|e| unreachable(cause_chain(&e)))
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
        assert_eq!(err.exit_code(), 3);
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
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("cannot read --ca"), "{err}");
    }
}
