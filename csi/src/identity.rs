//! The CSI Identity service: who the driver is, what it offers, and whether it is ready.

use crate::spec::{
    identity_server::Identity, GetPluginCapabilitiesRequest, GetPluginCapabilitiesResponse,
    GetPluginInfoRequest, GetPluginInfoResponse, PluginCapability, ProbeRequest, ProbeResponse,
};
use tonic::{Request, Response, Status};

#[derive(Debug, Clone)]
pub struct IdentityService {
    /// Plugin capabilities of the services this process actually serves.
    pub capabilities: Vec<PluginCapability>,
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

    /// Ready once this process serves, whether or not the node's ublkd answers. The
    /// livenessprobe sidecar turns a failed Probe into a restart of this container, which
    /// cannot bring ublkd back: the first real cluster showed every ublkd restart (a
    /// configuration change, a rolled image) reported as this driver's liveness failing, and a
    /// ublkd away for more than 5 × 30 s would have had a healthy driver restarted. ublkd's own
    /// health is its pod's readiness; each call that needs it fails UNAVAILABLE meanwhile, and
    /// the sidecars retry.
    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        Ok(Response::new(ProbeResponse { ready: Some(true) }))
    }
}
