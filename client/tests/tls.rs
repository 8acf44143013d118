//! Mutual TLS against a real gRPC server on the host: the certificates either side refuses are
//! reported when `connect` returns, each as what happened and what to do. Certificates are made
//! by openssl, expired ones with `openssl ca -startdate/-enddate` (OpenSSL 3.0's `x509` cannot
//! set dates).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;
use ublkd_client::{
    connect, ClientCertProblem, ConnectError, Connection, ServerCertProblem, Target, TlsFiles,
};

/// Two CAs, a server certificate for localhost/127.0.0.1 and an expired one, client
/// certificates: good, expired, and from the other CA.
const PKI: &str = r#"
set -e
ca() { openssl req -x509 -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.pem" -days 2 -subj "/CN=$1" 2>/dev/null; }
csr() { openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null; }
sign() { openssl x509 -req -in "$2.csr" -CA "$1.pem" -CAkey "$1.key" -CAcreateserial -out "$3.pem" -days 1 -extfile "$4" 2>/dev/null; }
ca ca; ca other-ca
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
csr server localhost; sign ca server server server.ext
csr client ublkctl; sign ca client client client.ext; sign other-ca client client-other client.ext
mkdir issued; : > index.txt; echo 1000 > serial
printf '[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = issued\nserial = serial\ndefault_md = sha256\npolicy = p\nunique_subject = no\n[p]\ncommonName = supplied\n' > ca.cnf
expired() { openssl ca -batch -notext -config ca.cnf -cert ca.pem -keyfile ca.key -in "$1.csr" -out "$2.pem" -startdate 20200101000000Z -enddate 20200102000000Z -extfile "$3" 2>/dev/null; }
expired client client-expired client.ext
expired server server-expired server.ext
"#;

fn pki() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("sh")
        .arg("-c")
        .arg(PKI)
        .current_dir(dir.path())
        .status()
        .expect("sh runs")
        .success();
    assert!(ok, "openssl made the certificates");
    dir
}

/// A gRPC health server on 127.0.0.1 serving `cert`, requiring client certificates from `ca`.
async fn serve(dir: &Path, cert: &str) -> SocketAddr {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dir.join("ca.pem")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .unwrap();
    let chain = CertificateDer::pem_file_iter(dir.join(format!("{cert}.pem")))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<_>>(8);
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let _ = tx.send(Ok(tls)).await;
                }
            });
        }
    });
    let (_, health) = tonic_health::server::health_reporter();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .serve_with_incoming(ReceiverStream::new(rx)),
    );
    addr
}

fn conn(
    uri: String,
    dir: &Path,
    ca: &str,
    client: Option<&str>,
    domain: Option<&str>,
) -> Connection {
    let p = |f: String| -> PathBuf { dir.join(f) };
    Connection {
        target: Target::Tcp { uri, tls: true },
        tls: TlsFiles {
            ca: Some(p(format!("{ca}.pem"))),
            cert: client.map(|c| p(format!("{c}.pem"))),
            key: client.map(|_| p("client.key".into())),
            domain: domain.map(str::to_owned),
        },
        timeout: Duration::from_secs(10),
    }
}

#[tokio::test]
async fn refused_certificates_are_reported_at_connect_with_what_to_do() {
    let pki = pki();
    let dir = pki.path();
    let good = format!("https://{}", serve(dir, "server").await);
    let stale = format!("https://{}", serve(dir, "server-expired").await);

    // The good pair gets in, and a call goes through.
    let channel = connect(&conn(good.clone(), dir, "ca", Some("client"), None))
        .await
        .unwrap();
    let reply = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap();
    assert_eq!(reply.into_inner().status, 1, "SERVING");

    // The server's refusals. An expired certificate, every time (under tonic's own TLS the
    // alert was lost to a race about half the time).
    for _ in 0..5 {
        let err = connect(&conn(good.clone(), dir, "ca", Some("client-expired"), None))
            .await
            .unwrap_err();
        assert!(
            matches!(
                &err,
                ConnectError::ClientCertificateRefused {
                    problem: ClientCertProblem::Expired,
                    cert: Some(c),
                    ..
                } if c.ends_with("client-expired.pem")
            ),
            "{err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("refused this client's certificate")
                && text.contains("client-expired.pem: it has expired")
                && text.contains("renew it"),
            "{text}"
        );
    }
    let err = connect(&conn(good.clone(), dir, "ca", Some("client-other"), None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConnectError::ClientCertificateRefused {
                problem: ClientCertProblem::UnknownCa,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        err.to_string()
            .contains("not signed by the CA ublkd trusts for clients"),
        "{err}"
    );
    let err = connect(&conn(good.clone(), dir, "ca", None, None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConnectError::ClientCertificateRefused {
                problem: ClientCertProblem::Missing,
                cert: None,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--cert and --key"), "{err}");

    // This client's refusals.
    let err = connect(&conn(stale, dir, "ca", Some("client"), None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConnectError::ServerCertificate {
                problem: ServerCertProblem::Expired { ago_secs: Some(_) },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("renew it on the node"), "{err}");
    let err = connect(&conn(good.clone(), dir, "other-ca", Some("client"), None))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConnectError::ServerCertificate {
                problem: ServerCertProblem::UnknownIssuer { .. },
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("other-ca.pem"), "{err}");
    let err = connect(&conn(
        good,
        dir,
        "ca",
        Some("client"),
        Some("ublkd.example"),
    ))
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("not valid for the name \"ublkd.example\" (it holds localhost, 127.0.0.1)"),
        "{text}"
    );
}

#[tokio::test]
async fn a_name_from_tls_domain_is_checked_instead_of_the_host() {
    let pki = pki();
    let dir = pki.path();
    let addr = serve(dir, "server").await;
    // Dialled by IP address, checked as "localhost", a name the certificate holds.
    connect(&conn(
        format!("https://127.0.0.1:{}", addr.port()),
        dir,
        "ca",
        Some("client"),
        Some("localhost"),
    ))
    .await
    .unwrap();
}
