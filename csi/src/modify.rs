//! ControllerModifyVolume: a VolumeAttributesClass's I/O limits onto a volume, live (ublkd's
//! SetVolumeQos), merged over the limits the volume has.
//!
//! The one who calls it is the central csi-resizer (external-resizer has no per-node mode),
//! whose ublkd-csi runs on no particular node, while each volume lives in one node's ublkd, and
//! the request names only the volume. By default that ublkd-csi records the limits on the
//! volume's PersistentVolume and its node's plugin applies them over the local socket
//! (`pvlimits`): no way into the nodes is needed. With `--remote-ublkd` it reaches every
//! node's ublkd itself instead, through the remote-access component: each ublkd pod serves
//! gRPC on port 7443 with mutual TLS, and the headless Service `ublkd-grpc` resolves to every
//! ublkd pod (`--remote-ublkd https://ublkd-grpc.ublkd-system.svc:7443`); each address is
//! dialled with this driver's client certificate, and each server certificate is checked
//! against the Service's name, which the shared server certificate holds.
//!
//! Nothing is ever reported applied that was not: over remote access a volume no node holds is
//! NOT_FOUND only when every node answered, and a node that did not answer makes the call
//! UNAVAILABLE (the resizer retries); through the PV, OK waits for the node's answer.

use crate::error::CsiError;
use crate::qos::QosChange;
use crate::spec;
use crate::ublkd::Ublkd;
use std::net::SocketAddr;
use std::time::Duration;
use ublkd_client::{v1, Target, TlsFiles};

/// Where ControllerModifyVolume finds a volume's ublkd.
#[derive(Clone)]
pub enum Route {
    /// This node's ublkd: the driver on each node (and csi-sanity).
    Local,
    /// Every node's ublkd, over remote access: the central driver beside the csi-resizer.
    Remote(Remote),
    /// The volume's PersistentVolume, which its node's plugin reads (`pvlimits`): the central
    /// driver without `--remote-ublkd`, the default.
    Record(kube::Client),
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Route::Local => f.write_str("Local"),
            Route::Remote(r) => f.debug_tuple("Remote").field(r).finish(),
            Route::Record(_) => f.write_str("Record"),
        }
    }
}

/// Every node's ublkd, as one DNS name that resolves to all of them.
#[derive(Debug, Clone)]
pub struct Remote {
    host: String,
    port: u16,
    tls: TlsFiles,
    timeout: Duration,
}

impl Remote {
    /// `uri` is `https://NAME[:PORT]` (port 7443 unless given); `tls` holds the CA and this
    /// driver's client certificate and key. The server name checked is NAME.
    pub fn new(uri: &str, mut tls: TlsFiles, timeout: Duration) -> Result<Self, String> {
        let bad = || format!("--remote-ublkd {uri:?}: expected https://NAME:PORT");
        if !uri.starts_with("https://") {
            return Err(bad());
        }
        let parsed: tonic::transport::Uri = uri.parse().map_err(|_| bad())?;
        let host = parsed
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(bad)?
            .to_owned();
        if tls.ca.is_none() || tls.cert.is_none() || tls.key.is_none() {
            return Err(format!(
                "--remote-ublkd {uri:?} needs the CA, a client certificate and its key \
                 (ublkd's remote access is mutual TLS)"
            ));
        }
        tls.domain = Some(host.clone());
        Ok(Remote {
            host,
            port: parsed.port_u16().unwrap_or(7443),
            tls,
            timeout,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("https://{}:{}", self.host, self.port)
    }

    /// Every address the name resolves to now: one per ublkd pod.
    async fn addresses(&self) -> Result<Vec<SocketAddr>, String> {
        let resolve = tokio::net::lookup_host((self.host.as_str(), self.port));
        let found = tokio::time::timeout(self.timeout, resolve)
            .await
            .map_err(|_| format!("resolving {} took over {:?}", self.host, self.timeout))?
            .map_err(|e| format!("cannot resolve {}: {e}", self.host))?;
        let mut addrs: Vec<SocketAddr> = found.collect();
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty() {
            return Err(format!("{} resolves to no address", self.host));
        }
        Ok(addrs)
    }

    fn ublkd_at(&self, addr: SocketAddr) -> Ublkd {
        let target = Target::Tcp {
            uri: format!("https://{addr}"),
            tls: true,
        };
        Ublkd::with_tls(target, self.tls.clone(), self.timeout)
    }

    /// The ublkd that holds volume `id`, and the volume as it says. Every node is asked at
    /// once; the first that holds it is the one (volume ids are the claims' UIDs, unique in the
    /// cluster), so a node that is slow to answer delays nothing but its own volumes.
    pub async fn find(&self, id: &str) -> Result<(Ublkd, v1::Volume), CsiError> {
        let addrs = self
            .addresses()
            .await
            .map_err(|why| CsiError::NodesUnreachable {
                id: id.to_owned(),
                why,
            })?;
        let mut asks = tokio::task::JoinSet::new();
        for addr in addrs {
            let ublkd = self.ublkd_at(addr);
            let id = id.to_owned();
            asks.spawn(async move {
                let answer = ublkd
                    .get(&id)
                    .await
                    .map_err(|e| format!("{addr}: {}", ublkd_client::cause_chain(&e)));
                (ublkd, answer)
            });
        }
        let mut silent = Vec::new();
        while let Some(done) = asks.join_next().await {
            match done {
                Ok((ublkd, Ok(Some(volume)))) => return Ok((ublkd, volume)),
                Ok((_, Ok(None))) => {}
                Ok((_, Err(why))) => silent.push(why),
                Err(e) => silent.push(format!("a lookup failed: {e}")),
            }
        }
        Err(not_held(id, silent))
    }
}

/// Why no node gave volume `id`, once every node was asked: NOT_FOUND only when every node
/// answered; otherwise the volume may be on one that did not (`silent`), and the call is
/// UNAVAILABLE, to be retried.
pub fn not_held(id: &str, silent: Vec<String>) -> CsiError {
    if silent.is_empty() {
        return CsiError::VolumeNotFound(id.to_owned());
    }
    CsiError::NodesUnreachable {
        id: id.to_owned(),
        why: format!(
            "no node that answered has it, and these did not answer: {}",
            silent.join("; ")
        ),
    }
}

/// Applies the mutable parameters' limits over the volume's; the parameters are checked
/// before anything is asked of any ublkd, so a refused call changed nothing.
pub async fn modify(
    local: &Ublkd,
    route: &Route,
    req: spec::ControllerModifyVolumeRequest,
) -> Result<(), CsiError> {
    if req.volume_id.is_empty() {
        return Err(CsiError::MissingField("volume_id"));
    }
    let change = QosChange::from_mutable(&req.mutable_parameters)?;
    let id = req.volume_id;
    let (ublkd, volume) = match route {
        Route::Local => {
            let v = local
                .get(&id)
                .await?
                .ok_or_else(|| CsiError::VolumeNotFound(id.clone()))?;
            (local.clone(), v)
        }
        Route::Remote(remote) => remote.find(&id).await?,
        Route::Record(client) => {
            // The node applies them: within the resizer's 60 s timeout, with room to answer.
            let wait = Duration::from_secs(20);
            return crate::pvlimits::record(client, &id, &req.mutable_parameters, wait).await;
        }
    };
    let current = volume.spec.and_then(|s| s.qos).unwrap_or_default();
    let wanted = change.apply(&current);
    if wanted == current {
        return Ok(());
    }
    ublkd.set_qos(&id, wanted).await?;
    tracing::info!(volume = %id, ublkd = %ublkd.endpoint(), ?wanted, "volume limits changed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_only_when_every_node_answered() {
        let e = not_held("pvc-1", Vec::new());
        assert_eq!(e.code(), tonic::Code::NotFound);
        let e = not_held("pvc-1", vec!["10.0.0.9:7443: timed out".into()]);
        assert_eq!(
            e.code(),
            tonic::Code::Unavailable,
            "retried, never NOT_FOUND"
        );
        assert!(e.to_string().contains("10.0.0.9:7443: timed out"), "{e}");
    }

    #[test]
    fn the_remote_endpoint_is_an_https_name_with_client_tls() {
        let tls = TlsFiles {
            ca: Some("/tls/ca.crt".into()),
            cert: Some("/tls/tls.crt".into()),
            key: Some("/tls/tls.key".into()),
            domain: None,
        };
        let t = Duration::from_secs(5);
        let r = Remote::new("https://ublkd-grpc.ublkd-system.svc:7443", tls.clone(), t).unwrap();
        assert_eq!(r.endpoint(), "https://ublkd-grpc.ublkd-system.svc:7443");
        assert_eq!(
            r.tls.domain.as_deref(),
            Some("ublkd-grpc.ublkd-system.svc"),
            "each pod's certificate is checked against the Service's name"
        );
        let r = Remote::new("https://ublkd-grpc.ublkd-system.svc", tls.clone(), t).unwrap();
        assert_eq!(r.port, 7443);
        for bad in [
            "http://ublkd-grpc:7443",
            "ublkd-grpc:7443",
            "unix:///run/ublkd/ublkd.sock",
            "https://:7443",
        ] {
            assert!(Remote::new(bad, tls.clone(), t).is_err(), "{bad}");
        }
        let no_cert = TlsFiles { cert: None, ..tls };
        assert!(Remote::new("https://ublkd-grpc:7443", no_cert, t).is_err());
    }

    #[tokio::test]
    async fn a_name_that_resolves_nowhere_is_unavailable() {
        let tls = TlsFiles {
            ca: Some("/nonexistent/ca.crt".into()),
            cert: Some("/nonexistent/tls.crt".into()),
            key: Some("/nonexistent/tls.key".into()),
            domain: None,
        };
        let r = Remote::new(
            "https://ublkd-grpc.invalid:7443",
            tls,
            Duration::from_secs(5),
        )
        .unwrap();
        let e = r.find("pvc-1").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    }
}
