//! `runtime.v1.RuntimeService`. Pods and containers are not built yet: their RPCs answer
//! UNIMPLEMENTED naming the RPC, and `Status` says the runtime is not ready and why. Listing
//! RPCs answer truthfully: there are no pods, containers or stats to list.

use std::pin::Pin;
use std::sync::Arc;

use k8s_cri::v1 as cri;
use k8s_cri::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use super::{status, unimplemented};
use crate::daemon::Daemon;
use crate::error::Error;

pub struct Runtime {
    pub(super) daemon: Arc<Daemon>,
}

type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RuntimeService for Runtime {
    async fn version(
        &self,
        req: Request<cri::VersionRequest>,
    ) -> Result<Response<cri::VersionResponse>, Status> {
        tracing::debug!(rpc = "Version", client_version = %req.get_ref().version);
        Ok(Response::new(cri::VersionResponse {
            version: "0.1.0".into(),
            runtime_name: "hako".into(),
            runtime_version: env!("CARGO_PKG_VERSION").into(),
            runtime_api_version: "v1".into(),
        }))
    }

    async fn status(
        &self,
        req: Request<cri::StatusRequest>,
    ) -> Result<Response<cri::StatusResponse>, Status> {
        tracing::debug!(rpc = "Status");
        let health = self.daemon.health();
        let cond = |t: &str, c: &crate::daemon::Condition| cri::RuntimeCondition {
            r#type: t.into(),
            status: c.ready,
            reason: c.reason.clone(),
            message: c.message.clone(),
        };
        let mut resp = cri::StatusResponse {
            status: Some(cri::RuntimeStatus {
                conditions: vec![
                    cond("RuntimeReady", &health.runtime),
                    cond("NetworkReady", &health.network),
                ],
            }),
            runtime_handlers: vec![cri::RuntimeHandler {
                name: String::new(),
                features: Some(cri::RuntimeHandlerFeatures {
                    recursive_read_only_mounts: false,
                    user_namespaces: false,
                }),
            }],
            features: Some(cri::RuntimeFeatures {
                supplemental_groups_policy: false,
            }),
            ..Default::default()
        };
        if req.get_ref().verbose {
            resp.info.insert("config".into(), self.daemon.config_json());
        }
        Ok(Response::new(resp))
    }

    async fn runtime_config(
        &self,
        _: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        tracing::debug!(rpc = "RuntimeConfig");
        // cgroupfs is the only driver built so far.
        Ok(Response::new(cri::RuntimeConfigResponse {
            linux: Some(cri::LinuxRuntimeConfiguration {
                cgroup_driver: cri::CgroupDriver::Cgroupfs as i32,
            }),
        }))
    }

    async fn update_runtime_config(
        &self,
        req: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        let cidr = req
            .into_inner()
            .runtime_config
            .and_then(|c| c.network_config)
            .map(|n| n.pod_cidr)
            .unwrap_or_default();
        tracing::debug!(rpc = "UpdateRuntimeConfig", pod_cidr = %cidr);
        self.daemon.set_pod_cidr(cidr);
        Ok(Response::new(cri::UpdateRuntimeConfigResponse {}))
    }

    async fn list_pod_sandbox(
        &self,
        _: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        Ok(Response::new(cri::ListPodSandboxResponse { items: vec![] }))
    }

    async fn list_containers(
        &self,
        _: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        Ok(Response::new(cri::ListContainersResponse {
            containers: vec![],
        }))
    }

    async fn list_container_stats(
        &self,
        _: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        Ok(Response::new(cri::ListContainerStatsResponse {
            stats: vec![],
        }))
    }

    async fn list_pod_sandbox_stats(
        &self,
        _: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        Ok(Response::new(cri::ListPodSandboxStatsResponse {
            stats: vec![],
        }))
    }

    async fn list_metric_descriptors(
        &self,
        _: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Result<Response<cri::ListMetricDescriptorsResponse>, Status> {
        Ok(Response::new(cri::ListMetricDescriptorsResponse {
            descriptors: vec![],
        }))
    }

    type GetContainerEventsStream = EventStream;

    async fn get_container_events(
        &self,
        _: Request<cri::GetEventsRequest>,
    ) -> Result<Response<EventStream>, Status> {
        Err(status(
            "GetContainerEvents",
            Error::Unimplemented(format!(
                "GetContainerEvents in hako {}",
                env!("CARGO_PKG_VERSION")
            )),
        ))
    }

    async fn run_pod_sandbox(
        &self,
        _: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        unimplemented("RunPodSandbox")
    }

    async fn stop_pod_sandbox(
        &self,
        _: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        unimplemented("StopPodSandbox")
    }

    async fn remove_pod_sandbox(
        &self,
        _: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        unimplemented("RemovePodSandbox")
    }

    async fn pod_sandbox_status(
        &self,
        _: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        unimplemented("PodSandboxStatus")
    }

    async fn create_container(
        &self,
        _: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        unimplemented("CreateContainer")
    }

    async fn start_container(
        &self,
        _: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        unimplemented("StartContainer")
    }

    async fn stop_container(
        &self,
        _: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        unimplemented("StopContainer")
    }

    async fn remove_container(
        &self,
        _: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        unimplemented("RemoveContainer")
    }

    async fn container_status(
        &self,
        _: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        unimplemented("ContainerStatus")
    }

    async fn update_container_resources(
        &self,
        _: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        unimplemented("UpdateContainerResources")
    }

    async fn reopen_container_log(
        &self,
        _: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        unimplemented("ReopenContainerLog")
    }

    async fn exec_sync(
        &self,
        _: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        unimplemented("ExecSync")
    }

    async fn exec(
        &self,
        _: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        unimplemented("Exec")
    }

    async fn attach(
        &self,
        _: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        unimplemented("Attach")
    }

    async fn port_forward(
        &self,
        _: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        unimplemented("PortForward")
    }

    async fn container_stats(
        &self,
        _: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        unimplemented("ContainerStats")
    }

    async fn pod_sandbox_stats(
        &self,
        _: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        unimplemented("PodSandboxStats")
    }

    async fn checkpoint_container(
        &self,
        _: Request<cri::CheckpointContainerRequest>,
    ) -> Result<Response<cri::CheckpointContainerResponse>, Status> {
        unimplemented("CheckpointContainer")
    }

    async fn list_pod_sandbox_metrics(
        &self,
        _: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Result<Response<cri::ListPodSandboxMetricsResponse>, Status> {
        unimplemented("ListPodSandboxMetrics")
    }
}
