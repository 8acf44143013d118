//! Who may call what over mutual TLS. A client certificate names its role in a SAN URI,
//! `urn:ublkd:role:<admin|modify|read>` (the highest one counts); each API method needs a role
//! (`Method::needs`), checked here for every call, in one place, before any handler runs. A
//! certificate that names no role may call nothing: before roles existed, any certificate the
//! CA had signed could delete every volume on every node.
//!
//! Connections without a client certificate (the unix socket, whose file permissions decide;
//! TCP without TLS, which must be allowed explicitly; TLS without a client CA) keep full access,
//! as before.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tonic::codegen::http;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

/// The prefix of a SAN URI that names a role.
pub const ROLE_URI: &str = "urn:ublkd:role:";

/// What a client may do, each role including the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Look: volumes, snapshots, statistics, the node, its capacity.
    Read,
    /// Change a volume's size and QoS (the CSI resizer's role), and read.
    Modify,
    /// Everything: create, delete, snapshots, orphans.
    Admin,
}

impl Role {
    fn parse(s: &str) -> Option<Role> {
        match s {
            "read" => Some(Role::Read),
            "modify" => Some(Role::Modify),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Modify => "modify",
            Role::Admin => "admin",
        }
    }
}

/// The API's methods, as their gRPC paths name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    CreateVolume,
    DeleteVolume,
    GetVolume,
    ListVolumes,
    ResizeVolume,
    GetVolumeStats,
    SetVolumeQos,
    CreateSnapshot,
    DeleteSnapshot,
    ListSnapshots,
    GetNodeInfo,
    AdoptDevice,
    DeleteOrphan,
    GetCapacity,
    ReportVolumesWithoutPv,
}

impl Method {
    pub const ALL: [Method; 15] = [
        Method::CreateVolume,
        Method::DeleteVolume,
        Method::GetVolume,
        Method::ListVolumes,
        Method::ResizeVolume,
        Method::GetVolumeStats,
        Method::SetVolumeQos,
        Method::CreateSnapshot,
        Method::DeleteSnapshot,
        Method::ListSnapshots,
        Method::GetNodeInfo,
        Method::AdoptDevice,
        Method::DeleteOrphan,
        Method::GetCapacity,
        Method::ReportVolumesWithoutPv,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::CreateVolume => "CreateVolume",
            Method::DeleteVolume => "DeleteVolume",
            Method::GetVolume => "GetVolume",
            Method::ListVolumes => "ListVolumes",
            Method::ResizeVolume => "ResizeVolume",
            Method::GetVolumeStats => "GetVolumeStats",
            Method::SetVolumeQos => "SetVolumeQos",
            Method::CreateSnapshot => "CreateSnapshot",
            Method::DeleteSnapshot => "DeleteSnapshot",
            Method::ListSnapshots => "ListSnapshots",
            Method::GetNodeInfo => "GetNodeInfo",
            Method::AdoptDevice => "AdoptDevice",
            Method::DeleteOrphan => "DeleteOrphan",
            Method::GetCapacity => "GetCapacity",
            Method::ReportVolumesWithoutPv => "ReportVolumesWithoutPv",
        }
    }

    /// The role a call of this method needs.
    pub fn needs(self) -> Role {
        match self {
            Method::GetVolume
            | Method::ListVolumes
            | Method::GetVolumeStats
            | Method::ListSnapshots
            | Method::GetNodeInfo
            | Method::GetCapacity => Role::Read,
            Method::ResizeVolume | Method::SetVolumeQos => Role::Modify,
            Method::CreateVolume
            | Method::DeleteVolume
            | Method::CreateSnapshot
            | Method::DeleteSnapshot
            | Method::AdoptDevice
            | Method::DeleteOrphan
            | Method::ReportVolumesWithoutPv => Role::Admin,
        }
    }
}

/// The role a gRPC path needs: None for what is not the ublkd API (health, reflection); an API
/// path this build does not know needs admin.
fn path_needs(path: &str) -> Option<Role> {
    let rest = path.strip_prefix("/ublkd.v1.")?;
    let name = rest.rsplit('/').next().unwrap_or("");
    Some(
        Method::ALL
            .iter()
            .find(|m| m.name() == name)
            .map_or(Role::Admin, |m| m.needs()),
    )
}

/// The highest role the certificate (DER) names; None when it names none or does not parse.
pub fn role_of(der: &[u8]) -> Option<Role> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => u.strip_prefix(ROLE_URI),
            _ => None,
        })
        .filter_map(Role::parse)
        .max()
}

/// Whether a call of `path` is allowed from a peer that presented `certs` (None: no client
/// certificate on this connection); the refusal says why.
pub fn decide(path: &str, certs: Option<&[Vec<u8>]>) -> Result<(), String> {
    let (Some(needs), Some(certs)) = (path_needs(path), certs) else {
        return Ok(());
    };
    match certs.first().and_then(|leaf| role_of(leaf)) {
        Some(role) if role >= needs => Ok(()),
        Some(role) => Err(format!(
            "the client certificate's role {} may not call {path}: it needs {}",
            role.name(),
            needs.name()
        )),
        None => Err(format!(
            "the client certificate names no ublkd role (a SAN URI {ROLE_URI}admin, modify or \
             read): it may call nothing"
        )),
    }
}

/// The layer that checks every call's role.
#[derive(Debug, Clone, Default)]
pub struct AuthzLayer;

impl<S> tower::Layer<S> for AuthzLayer {
    type Service = Authz<S>;

    fn layer(&self, inner: S) -> Authz<S> {
        Authz { inner }
    }
}

#[derive(Debug, Clone)]
pub struct Authz<S> {
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Authz<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<http::Response<tonic::body::Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let certs: Option<Vec<Vec<u8>>> = req
            .extensions()
            .get::<TlsConnectInfo<TcpConnectInfo>>()
            .and_then(|t| t.peer_certs())
            .map(|c| c.iter().map(|d| d.as_ref().to_vec()).collect());
        match decide(req.uri().path(), certs.as_deref()) {
            Ok(()) => Box::pin(self.inner.call(req)),
            Err(why) => {
                tracing::warn!(path = %req.uri().path(), "{why}");
                let status = tonic::Status::permission_denied(why);
                Box::pin(async move { Ok(status.into_http()) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for `cn` with `san` (openssl), DER.
    fn cert(dir: &std::path::Path, name: &str, san: Option<&str>) -> Vec<u8> {
        let (key, pem, der) = (
            dir.join(format!("{name}.key")),
            dir.join(format!("{name}.pem")),
            dir.join(format!("{name}.der")),
        );
        let mut cmd = std::process::Command::new("openssl");
        cmd.args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .arg("ec_paramgen_curve:prime256v1")
            .args(["-nodes", "-days", "1", "-subj", "/CN=client"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&pem)
            .stderr(std::process::Stdio::null());
        if let Some(san) = san {
            cmd.arg("-addext").arg(format!("subjectAltName={san}"));
        }
        assert!(cmd.status().is_ok_and(|s| s.success()), "openssl req");
        let ok = std::process::Command::new("openssl")
            .args(["x509", "-outform", "der", "-in"])
            .arg(&pem)
            .arg("-out")
            .arg(&der)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "openssl x509");
        std::fs::read(der).unwrap_or_default()
    }

    #[test]
    fn each_role_calls_what_it_may_and_a_certificate_without_one_nothing() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let d = dir.path();
        let admin = cert(d, "admin", Some("URI:urn:ublkd:role:admin"));
        let modify = cert(d, "modify", Some("URI:urn:ublkd:role:modify,DNS:x.example"));
        let read = cert(d, "read", Some("URI:urn:ublkd:role:read"));
        let none = cert(d, "none", Some("DNS:client.example"));
        let two = cert(
            d,
            "two",
            Some("URI:urn:ublkd:role:read,URI:urn:ublkd:role:modify"),
        );
        assert_eq!(role_of(&admin), Some(Role::Admin));
        assert_eq!(role_of(&modify), Some(Role::Modify));
        assert_eq!(role_of(&read), Some(Role::Read));
        assert_eq!(role_of(&none), None);
        assert_eq!(role_of(&two), Some(Role::Modify), "the highest counts");
        assert_eq!(role_of(b"not a certificate"), None);

        let call = |m: Method, c: &Vec<u8>| {
            let path = format!(
                "/ublkd.v1.{}/{}",
                if m.name().ends_with("Volume") || m.name().contains("Snapshot") {
                    "VolumeService"
                } else {
                    "NodeService"
                },
                m.name()
            );
            decide(&path, Some(std::slice::from_ref(c))).is_ok()
        };
        for m in Method::ALL {
            assert!(call(m, &admin), "admin may call {m:?}");
            assert_eq!(call(m, &modify), m.needs() <= Role::Modify, "modify, {m:?}");
            assert_eq!(call(m, &read), m.needs() == Role::Read, "read, {m:?}");
            assert!(!call(m, &none), "no role may not call {m:?}");
        }
        // What the resizer needs, and what it must not do.
        assert!(call(Method::SetVolumeQos, &modify) && call(Method::GetVolume, &modify));
        assert!(!call(Method::DeleteVolume, &modify) && !call(Method::CreateVolume, &modify));
        // Health and reflection are no API; an API method this build does not know needs admin.
        assert!(decide(
            "/grpc.health.v1.Health/Check",
            Some(std::slice::from_ref(&none))
        )
        .is_ok());
        assert!(decide("/ublkd.v1.VolumeService/Future", Some(&[modify])).is_err());
        assert!(decide("/ublkd.v1.VolumeService/Future", Some(&[admin])).is_ok());
        // No client certificate: the connection's own rules (socket permissions) decide.
        assert!(decide("/ublkd.v1.VolumeService/DeleteVolume", None).is_ok());
    }
}
