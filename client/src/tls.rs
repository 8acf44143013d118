//! TLS to ublkd, done here rather than by tonic so that a refused certificate, on either side,
//! is known when [`connect`](crate::connect) returns, and says what to do about it.
//!
//! With TLS 1.3 the client's handshake is over before the server has looked at the client's
//! certificate: a refusal comes back as an alert on the connection's first read. Under tonic's
//! own TLS that read is hyper's, and the first call then fails as "transport error" or, when
//! hyper sees the connection close first, as "operation was canceled", the alert lost. So the
//! connector waits for the server's first bytes (the HTTP/2 SETTINGS that an h2 server sends
//! without waiting for the client) or its alert, and leaves those bytes in rustls's buffer for
//! hyper.
//!
//! [`explain`] is the one place where TLS failures become [`ConnectError`]s.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{AlertDescription, CertificateError, ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use crate::{read, ConnectError};

/// The protocol ublkd's TLS listener offers by ALPN.
const ALPN_H2: &[u8] = b"h2";

/// Why the server's certificate was not accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerCertProblem {
    /// Its validity ended `ago_secs` seconds before now, when known.
    Expired { ago_secs: Option<u64> },
    /// Its validity has not begun.
    NotValidYet,
    /// It is not signed by the CA this client trusts (`ca`, when one was given).
    UnknownIssuer { ca: Option<PathBuf> },
    /// It does not hold the name this client checks, `expected`; it holds `presented`.
    WrongName {
        expected: String,
        presented: Vec<String>,
    },
    /// It is not meant for a TLS server (its extended key usage lacks serverAuth).
    NotForServers,
    /// Anything else rustls found wrong with it.
    Other(String),
}

/// Why ublkd refused this client's certificate: the alert it sent, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientCertProblem {
    /// None was sent, and ublkd requires one (`grpc.tls.client_ca` is set).
    Missing,
    /// It has expired, or is not valid yet (TLS has one alert for both).
    Expired,
    /// It is not signed by the CA ublkd trusts for clients.
    UnknownCa,
    /// It is not meant for a TLS client (its extended key usage lacks clientAuth).
    NotForClients,
    /// It was revoked.
    Revoked,
    /// Another alert.
    Other(String),
}

/// The client side of TLS: the trusted CA, the optional client certificate, and the server
/// name the certificate is checked against.
#[derive(Debug, Clone)]
pub(crate) struct Client {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
    /// `host:port` to dial.
    address: String,
}

impl Client {
    /// Reads the TLS files and prepares to dial `host:port` (from the `https://` URI `uri`).
    pub(crate) fn new(uri: &str, files: &TlsFiles) -> Result<Self, ConnectError> {
        let parsed: tonic::transport::Uri = uri.parse().map_err(|_| ConnectError::BadUri {
            uri: uri.to_owned(),
        })?;
        let host = parsed
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| ConnectError::BadUri {
                uri: uri.to_owned(),
            })?;
        // The URI keeps an IPv6 address in brackets; a server name does not have them.
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let address = format!("{host}:{}", parsed.port_u16().unwrap_or(443));
        let wanted = files.domain.as_deref().unwrap_or(bare);
        let name =
            ServerName::try_from(wanted.to_owned()).map_err(|_| ConnectError::BadServerName {
                name: wanted.to_owned(),
            })?;
        Ok(Self {
            config: Arc::new(files.rustls_config()?),
            name,
            address,
        })
    }

    /// Dials, shakes hands, and waits for the server's verdict on this client's certificate.
    pub(crate) async fn connect(&self) -> io::Result<TokioIo<TlsStream<TcpStream>>> {
        let tcp = TcpStream::connect(&self.address).await?;
        tcp.set_nodelay(true)?;
        let mut tls = tokio_rustls::TlsConnector::from(Arc::clone(&self.config))
            .connect(self.name.clone(), tcp)
            .await?;
        if tls.get_ref().1.alpn_protocol() != Some(ALPN_H2) {
            return Err(io::Error::other(
                "the server did not agree to HTTP/2 (ALPN h2)",
            ));
        }
        await_verdict(&mut tls).await?;
        Ok(TokioIo::new(tls))
    }
}

/// Reads TLS records until the server has sent data (it accepted us) or an alert (it did not),
/// keeping the data in rustls's plaintext buffer, where the stream's next read finds it.
async fn await_verdict(tls: &mut TlsStream<TcpStream>) -> io::Result<()> {
    let (tcp, conn) = tls.get_mut();
    loop {
        if conn
            .process_new_packets()
            .map_err(invalid)?
            .plaintext_bytes_to_read()
            > 0
        {
            return Ok(());
        }
        tcp.readable().await?;
        match conn.read_tls(&mut TryRead(tcp)) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection right after the TLS handshake",
                ))
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}

/// How tokio-rustls reports a TLS error: an `InvalidData` I/O error around it.
fn invalid(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// A non-blocking `io::Read` over a tokio socket, for rustls's `read_tls`.
struct TryRead<'a>(&'a TcpStream);

impl io::Read for TryRead<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

/// The TLS files and server name; all optional (each client checks the combination it needs).
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

    /// The rustls configuration: the CA (alone) as the trusted root, the client certificate and
    /// key when given, HTTP/2 by ALPN.
    fn rustls_config(&self) -> Result<ClientConfig, ConnectError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ConnectError::TlsSetup(e.to_string()))?;
        let mut roots = RootCertStore::empty();
        if let Some(ca) = &self.ca {
            for cert in certificates("ca", ca)? {
                roots.add(cert).map_err(|e| bad("ca", ca, e.to_string()))?;
            }
        }
        let builder = builder.with_root_certificates(roots);
        let mut config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = certificates("cert", cert)?;
                let der = PrivateKeyDer::from_pem_slice(&read("key", key)?)
                    .map_err(|e| bad("key", key, e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, der)
                    .map_err(|e| bad("key", key, e.to_string()))?
            }
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) | (None, Some(_)) => return Err(ConnectError::HalfIdentity),
        };
        config.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(config)
    }
}

fn bad(what: &'static str, path: &Path, reason: String) -> ConnectError {
    ConnectError::BadTlsFile {
        what,
        path: path.to_owned(),
        reason,
    }
}

/// The certificates of a PEM file; none is an error.
fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConnectError> {
    let pem = read(what, path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| bad(what, path, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad(what, path, "it holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// The rustls error somewhere in `err`'s chain: itself, or inside an I/O error (how
/// tokio-rustls and hyper pass it on; `io::Error::source` skips what it wraps).
fn rustls_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    std::iter::successors(Some(err), |e| e.source()).find_map(|e| {
        e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<io::Error>()
                .and_then(io::Error::get_ref)
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        })
    })
}

/// What a failed TLS connection to `endpoint` means, when `err` holds a certificate problem of
/// either side; `None` for anything else (the caller reports it as unreachable).
pub(crate) fn explain(
    err: &(dyn std::error::Error + 'static),
    endpoint: &str,
    files: &TlsFiles,
) -> Option<ConnectError> {
    let server = |problem| {
        Some(ConnectError::ServerCertificate {
            endpoint: endpoint.to_owned(),
            problem,
        })
    };
    let client = |problem| {
        Some(ConnectError::ClientCertificateRefused {
            endpoint: endpoint.to_owned(),
            cert: files.cert.clone(),
            problem,
        })
    };
    match rustls_error(err)? {
        rustls::Error::InvalidCertificate(e) => server(match e {
            CertificateError::Expired => ServerCertProblem::Expired { ago_secs: None },
            CertificateError::ExpiredContext { time, not_after } => ServerCertProblem::Expired {
                ago_secs: Some(time.as_secs().saturating_sub(not_after.as_secs())),
            },
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                ServerCertProblem::NotValidYet
            }
            CertificateError::UnknownIssuer => ServerCertProblem::UnknownIssuer {
                ca: files.ca.clone(),
            },
            CertificateError::NotValidForName => ServerCertProblem::WrongName {
                expected: String::new(),
                presented: Vec::new(),
            },
            CertificateError::NotValidForNameContext {
                expected,
                presented,
            } => ServerCertProblem::WrongName {
                expected: expected.to_str().into_owned(),
                presented: presented.iter().map(|n| bare_name(n)).collect(),
            },
            CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
                ServerCertProblem::NotForServers
            }
            other => ServerCertProblem::Other(
                rustls::Error::InvalidCertificate(other.clone()).to_string(),
            ),
        }),
        rustls::Error::AlertReceived(alert) => client(match alert {
            AlertDescription::CertificateRequired => ClientCertProblem::Missing,
            // TLS 1.2 has no certificate_required alert: a server that wanted a certificate
            // and got none fails the handshake.
            AlertDescription::HandshakeFailure if files.cert.is_none() => {
                ClientCertProblem::Missing
            }
            AlertDescription::CertificateExpired => ClientCertProblem::Expired,
            AlertDescription::UnknownCA => ClientCertProblem::UnknownCa,
            AlertDescription::UnsupportedCertificate => ClientCertProblem::NotForClients,
            AlertDescription::CertificateRevoked => ClientCertProblem::Revoked,
            AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::DecryptError
            | AlertDescription::AccessDenied => ClientCertProblem::Other(format!("{alert:?}")),
            // Not about certificates (a protocol mismatch, an internal error): unreachable,
            // with rustls's words.
            _ => return None,
        }),
        _ => None,
    }
}

/// `DnsName("a.example")` or `IpAddress(10.0.0.1)` (how rustls lists a certificate's names) as
/// the name alone.
fn bare_name(presented: &str) -> String {
    for prefix in ["DnsName(\"", "IpAddress("] {
        if let Some(rest) = presented.strip_prefix(prefix) {
            return rest.trim_end_matches(')').trim_end_matches('"').to_owned();
        }
    }
    presented.to_owned()
}

/// Whole days in `secs`, in words.
fn days_ago(secs: u64) -> String {
    match secs / 86_400 {
        0 => "less than a day ago".to_owned(),
        1 => "1 day ago".to_owned(),
        n => format!("{n} days ago"),
    }
}

impl fmt::Display for ServerCertProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerCertProblem::Expired { ago_secs } => {
                f.write_str("its certificate expired")?;
                if let Some(secs) = ago_secs {
                    write!(f, " {}", days_ago(*secs))?;
                }
                f.write_str(
                    ": renew it on the node (the files grpc.tls.cert and grpc.tls.key; ublkd \
                     reads them again when they change, no restart needed)",
                )
            }
            ServerCertProblem::NotValidYet => f.write_str(
                "its certificate is not valid yet: compare this machine's clock with the node's",
            ),
            ServerCertProblem::UnknownIssuer { ca: Some(ca) } => write!(
                f,
                "its certificate is not signed by the CA in {}: give the CA that signed \
                 ublkd's certificate (--ca, or ca in the node's profile)",
                ca.display()
            ),
            ServerCertProblem::UnknownIssuer { ca: None } => f.write_str(
                "its certificate is not signed by a trusted CA: give the CA that signed \
                 ublkd's certificate (--ca, or ca in the node's profile)",
            ),
            ServerCertProblem::WrongName {
                expected,
                presented,
            } => {
                write!(f, "its certificate is not valid for the name {expected:?}")?;
                if !presented.is_empty() {
                    write!(f, " (it holds {})", presented.join(", "))?;
                }
                f.write_str(
                    ": connect by a name the certificate holds, or set --tls-domain (or \
                     tls_domain in the node's profile) to one",
                )
            }
            ServerCertProblem::NotForServers => f.write_str(
                "its certificate is not meant for a TLS server (extendedKeyUsage lacks \
                 serverAuth): reissue it with serverAuth",
            ),
            ServerCertProblem::Other(text) => f.write_str(text),
        }
    }
}

impl fmt::Display for ClientCertProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientCertProblem::Missing => f.write_str(
                "it requires a client certificate and none was given: give one signed by the \
                 CA in the node's grpc.tls.client_ca (--cert and --key, or cert and key in the \
                 node's profile)",
            ),
            ClientCertProblem::Expired => f.write_str(
                "it has expired (or is not valid yet): renew it, from the CA in the node's \
                 grpc.tls.client_ca",
            ),
            ClientCertProblem::UnknownCa => f.write_str(
                "it is not signed by the CA ublkd trusts for clients (grpc.tls.client_ca on the \
                 node): use a certificate from that CA",
            ),
            ClientCertProblem::NotForClients => f.write_str(
                "it is not meant for a TLS client (extendedKeyUsage lacks clientAuth): reissue \
                 it with clientAuth",
            ),
            ClientCertProblem::Revoked => {
                f.write_str("it was revoked: get a new one from the node's client CA")
            }
            ClientCertProblem::Other(alert) => write!(f, "the server's TLS alert is {alert}"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use rustls::pki_types::UnixTime;
    use std::time::Duration;

    /// A rustls error as it reaches the caller: inside an I/O error inside another error.
    #[derive(Debug)]
    struct Outer(io::Error);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("transport error")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn files() -> TlsFiles {
        TlsFiles {
            ca: Some("/p/ca.pem".into()),
            cert: Some("/p/me.pem".into()),
            key: Some("/p/me.key".into()),
            domain: None,
        }
    }

    fn explained(e: rustls::Error, files: &TlsFiles) -> Option<ConnectError> {
        explain(&Outer(invalid(e)), "https://n1:7443", files)
    }

    fn text(e: rustls::Error) -> String {
        explained(e, &files()).unwrap().to_string()
    }

    #[test]
    fn an_expired_server_certificate_says_renew_it_on_the_node() {
        let t = |s| UnixTime::since_unix_epoch(Duration::from_secs(s));
        let e = rustls::Error::InvalidCertificate(CertificateError::ExpiredContext {
            time: t(10 * 86_400 + 5),
            not_after: t(86_400),
        });
        assert_eq!(
            text(e),
            "ublkd at https://n1:7443 presented a certificate this client does not accept: \
             its certificate expired 9 days ago: renew it on the node (the files \
             grpc.tls.cert and grpc.tls.key; ublkd reads them again when they change, no \
             restart needed)"
        );
    }

    #[test]
    fn a_server_certificate_from_another_ca_names_the_ca_file() {
        let e = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let err = explained(e, &files()).unwrap();
        assert!(
            matches!(
                &err,
                ConnectError::ServerCertificate {
                    problem: ServerCertProblem::UnknownIssuer { ca: Some(ca) },
                    ..
                } if ca == Path::new("/p/ca.pem")
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("not signed by the CA in /p/ca.pem") && text.contains("--ca"),
            "{text}"
        );
    }

    #[test]
    fn a_wrong_server_name_lists_the_names_it_holds() {
        let e = rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
            expected: ServerName::try_from("ublkd.example").unwrap(),
            presented: vec![
                "DnsName(\"localhost\")".into(),
                "IpAddress(127.0.0.1)".into(),
            ],
        });
        let text = text(e);
        assert!(
            text.contains(
                "not valid for the name \"ublkd.example\" (it holds localhost, 127.0.0.1)"
            ) && text.contains("--tls-domain"),
            "{text}"
        );
    }

    #[test]
    fn refusals_of_the_client_certificate_are_read_from_the_alert() {
        for (alert, problem, words) in [
            (
                AlertDescription::CertificateExpired,
                ClientCertProblem::Expired,
                "it has expired",
            ),
            (
                AlertDescription::UnknownCA,
                ClientCertProblem::UnknownCa,
                "not signed by the CA ublkd trusts",
            ),
            (
                AlertDescription::CertificateRequired,
                ClientCertProblem::Missing,
                "requires a client certificate",
            ),
            (
                AlertDescription::UnsupportedCertificate,
                ClientCertProblem::NotForClients,
                "lacks clientAuth",
            ),
            (
                AlertDescription::BadCertificate,
                ClientCertProblem::Other("BadCertificate".into()),
                "alert is BadCertificate",
            ),
        ] {
            let err = explained(rustls::Error::AlertReceived(alert), &files()).unwrap();
            match &err {
                ConnectError::ClientCertificateRefused {
                    problem: got, cert, ..
                } => {
                    assert_eq!(got, &problem);
                    assert_eq!(cert.as_deref(), Some(Path::new("/p/me.pem")));
                }
                other => panic!("{alert:?}: {other:?}"),
            }
            let text = err.to_string();
            assert!(
                text.contains(words)
                    && (problem == ClientCertProblem::Missing
                        || text.starts_with(
                            "ublkd at https://n1:7443 refused this client's certificate \
                             /p/me.pem: "
                        )),
                "{text}"
            );
        }
    }

    #[test]
    fn a_tls12_handshake_failure_without_a_certificate_is_a_missing_one() {
        let none = TlsFiles {
            cert: None,
            key: None,
            ..files()
        };
        let err = explained(
            rustls::Error::AlertReceived(AlertDescription::HandshakeFailure),
            &none,
        )
        .unwrap();
        assert_eq!(
            err.to_string(),
            "ublkd at https://n1:7443 refused the connection: it requires a client certificate \
             and none was given: give one signed by the CA in the node's grpc.tls.client_ca (--cert and --key, or cert \
             and key in the node's profile)"
        );
        assert!(
            explained(
                rustls::Error::AlertReceived(AlertDescription::HandshakeFailure),
                &files()
            )
            .is_none(),
            "with a certificate, a handshake failure is not about it"
        );
    }

    #[test]
    fn other_errors_are_not_certificate_problems() {
        assert!(explained(
            rustls::Error::AlertReceived(AlertDescription::ProtocolVersion),
            &files()
        )
        .is_none());
        let plain = io::Error::new(io::ErrorKind::ConnectionRefused, "refused");
        assert!(explain(&Outer(plain), "e", &files()).is_none());
    }

    #[test]
    fn names_and_ages_read_as_words() {
        assert_eq!(bare_name("DnsName(\"a.example\")"), "a.example");
        assert_eq!(bare_name("IpAddress(::1)"), "::1");
        assert_eq!(bare_name("odd"), "odd");
        assert_eq!(days_ago(5), "less than a day ago");
        assert_eq!(days_ago(86_400 + 1), "1 day ago");
        assert_eq!(days_ago(3 * 86_400), "3 days ago");
    }
}
