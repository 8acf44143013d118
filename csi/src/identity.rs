//! The CSI Identity service: who the driver is, what it offers, and whether it is ready.

use crate::spec::{
    identity_server::Identity, GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse,
    GetPluginInfoRequest, GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};
use crate::ublkd::Ublkd;
use tonic::{Request, Response, Status};

#[derive(Debug, Clone)]
pub struct IdentityService {
    pub ublkd: Ublkd,
    /// Plugin capabilities of the services this process actually serves.
    pub capabilities: Vec<PluginCapability>,
    /// Whether readiness needs the node's ublkd (false for the central instance that only
    /// answers the resizer's capability questions).
    pub needs_ublkd: bool,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: crate::DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(GetPluginCapabilitiesResponse {
            capabilities: self.capabilities.clone(),
        }))
    }

    /// Ready when the node's ublkd answers: without it the driver can do nothing. An unreachable
    /// ublkd is FAILED_PRECONDITION (the spec's "plugin unhealthy"), so the livenessprobe
    /// sidecar reports the reason.
    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        if !self.needs_ublkd {
            return Ok(Response::new(ProbeResponse { ready: Some(true) }));
        }
        match self.ublkd.node_info().await {
            Ok(_) => Ok(Response::new(ProbeResponse { ready: Some(true) })),
            Err(e) => Err(Status::failed_precondition(format!(
                "ublkd at {} does not answer: {}",
                self.ublkd.endpoint(),
                ublkd_client::cause_chain(&e)
            ))),
        }
    }
}
