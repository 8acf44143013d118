//! The Node service of the `--resizer-only` instance: it serves no node, but the external-resizer
//! asks its driver for the node capabilities before it starts (to learn that a grown claim is
//! finished by NodeExpandVolume), and exits when the call is unimplemented, as the first real
//! cluster showed. It answers that question as the node plugin does and refuses everything
//! else.

use crate::spec::{self, node_server::Node as NodeApi};
use tonic::{Request, Response, Status};

#[derive(Debug, Clone, Copy, Default)]
pub struct ResizerNode;

fn not_a_node<T>() -> Result<Response<T>, Status> {
    Err(Status::failed_precondition(
        "this ublkd-csi runs --resizer-only: it serves no node (the kubelet talks to the node plugin)",
    ))
}

#[tonic::async_trait]
impl NodeApi for ResizerNode {
    async fn node_stage_volume(
        &self,
        _req: Request<spec::NodeStageVolumeRequest>,
    ) -> Result<Response<spec::NodeStageVolumeResponse>, Status> {
        not_a_node()
    }

    async fn node_unstage_volume(
        &self,
        _req: Request<spec::NodeUnstageVolumeRequest>,
    ) -> Result<Response<spec::NodeUnstageVolumeResponse>, Status> {
        not_a_node()
    }

    async fn node_publish_volume(
        &self,
        _req: Request<spec::NodePublishVolumeRequest>,
    ) -> Result<Response<spec::NodePublishVolumeResponse>, Status> {
        not_a_node()
    }

    async fn node_unpublish_volume(
        &self,
        _req: Request<spec::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<spec::NodeUnpublishVolumeResponse>, Status> {
        not_a_node()
    }

    async fn node_get_volume_stats(
        &self,
        _req: Request<spec::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<spec::NodeGetVolumeStatsResponse>, Status> {
        not_a_node()
    }

    async fn node_expand_volume(
        &self,
        _req: Request<spec::NodeExpandVolumeRequest>,
    ) -> Result<Response<spec::NodeExpandVolumeResponse>, Status> {
        not_a_node()
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<spec::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<spec::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(crate::node::capabilities()))
    }

    async fn node_get_info(
        &self,
        _req: Request<spec::NodeGetInfoRequest>,
    ) -> Result<Response<spec::NodeGetInfoResponse>, Status> {
        not_a_node()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spec::node_service_capability::{rpc::Type, Type as Cap};

    #[tokio::test]
    async fn answers_the_resizers_question_as_the_node_plugin_does_and_nothing_else() {
        let caps = ResizerNode
            .node_get_capabilities(Request::new(spec::NodeGetCapabilitiesRequest {}))
            .await
            .unwrap()
            .into_inner();
        let expand = caps.capabilities.iter().any(
            |c| matches!(&c.r#type, Some(Cap::Rpc(r)) if r.r#type == Type::ExpandVolume as i32),
        );
        assert!(expand, "{caps:?}");
        assert_eq!(caps, crate::node::capabilities());
        let err = ResizerNode
            .node_get_info(Request::new(spec::NodeGetInfoRequest {}))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    }
}
