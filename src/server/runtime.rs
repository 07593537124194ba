//! `runtime.v1.RuntimeService`. RPCs not built yet (CheckpointContainer, CheckpointPod,
//! RestorePod, GetContainerEvents) answer UNIMPLEMENTED naming the RPC. ListPodSandboxMetrics
//! and ListMetricDescriptors are in `metrics`. Exec, Attach and PortForward return URLs on the streaming server
//! (`crate::streaming`). The Stream* lists (kubelet's CRIListStreaming) send what the List RPC
//! of the same filter answers, in responses of at most `STREAM_CHUNK` items and
//! `STREAM_CHUNK_BYTES`.

use std::pin::Pin;
use std::sync::Arc;

use hako_proto::cri;
use hako_proto::cri::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use super::{convert, metrics, status, unimplemented};
use crate::config::CgroupDriver;
use crate::daemon::Daemon;
use crate::error::Error;
use crate::pods::PodStats;

pub struct Runtime {
    pub(super) daemon: Arc<Daemon>,
}

/// Refuses a runtime handler that is neither the default (empty) nor configured.
pub(super) fn check_handler(daemon: &Daemon, handler: &str) -> Result<(), Error> {
    if handler.is_empty() || daemon.config.runtime.handlers.iter().any(|h| h == handler) {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "runtime handler {handler:?} is not configured (runtime.handlers)"
    )))
}

impl Runtime {
    /// Every pod's metrics (ListPodSandboxMetrics and its stream).
    async fn pod_metrics(&self, rpc: &str) -> Result<Vec<cri::PodSandboxMetrics>, Status> {
        let answer = self
            .daemon
            .runtime
            .list_pod_metrics()
            .await
            .map_err(|e| status(rpc, e))?
            .iter()
            .map(metrics::pod_metrics)
            .collect();
        // Built: what remains is tonic's encoding, well within the trim's delay.
        crate::daemon::trim_memory_soon();
        Ok(answer)
    }
}

fn pod_stats(s: &PodStats) -> cri::PodSandboxStats {
    let containers = s
        .containers
        .iter()
        .map(|(c, u)| convert::container_stats(c, u))
        .collect();
    convert::pod_stats(&s.pod.record, &s.usage, s.network.as_deref(), containers)
}

/// Runs a lifecycle change (`body`, given the daemon) as a task of its own and waits for it.
/// tonic drops a handler's future when the client cancels (deadline, disconnect); the task is
/// not dropped with it, so the change finishes, or undoes itself on failure, whatever the
/// client does. kubelet's retry then finds the object made (under the name lock) instead of
/// half of it.
async fn to_completion<T, F>(
    daemon: &Arc<Daemon>,
    rpc: &'static str,
    body: impl FnOnce(Arc<Daemon>) -> F,
) -> Result<T, Status>
where
    F: std::future::Future<Output = crate::error::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    match tokio::spawn(body(daemon.clone())).await {
        Ok(r) => r.map_err(|e| status(rpc, e)),
        Err(e) => Err(status(rpc, Error::Internal(format!("{rpc} task: {e}")))),
    }
}

impl Runtime {
    /// Exec and Attach need the container running (kubelet's server checks the same): whom
    /// container `id`'s streaming sessions are counted to, once it is known to run.
    /// The owner of running container `id` and its full id: a stream's URL names the full id,
    /// so a prefix cannot name another container by the time the URL is used.
    async fn running(
        &self,
        rpc: &str,
        id: &str,
    ) -> Result<(crate::streaming::Owner, String), Status> {
        let v = self
            .daemon
            .runtime
            .container(id)
            .await
            .map_err(|e| status(rpc, e))?;
        if v.state != crate::pods::ContainerState::Running {
            return Err(status(
                rpc,
                Error::FailedPrecondition(format!(
                    "container {id} is not running (state {:?})",
                    v.state
                )),
            ));
        }
        let pod = self
            .daemon
            .runtime
            .pod_view(&v.record.pod_id)
            .await
            .map_err(|e| status(rpc, e))?;
        Ok((
            crate::streaming::Owner {
                pod: pod.record.id.clone(),
                namespace: pod.record.spec.namespace.clone(),
            },
            v.record.id.clone(),
        ))
    }
}

type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>> + Send>>;

/// Items per response of a Stream* list, and bytes of their encodings: a response ends at
/// whichever comes first. Items carry pod authors' labels and annotations (256 KiB of
/// annotations per object), so a count alone could make one response exceed a client's
/// message limit (4 MiB by default in gRPC, 16 MiB in kubelet), which is what the streamed
/// lists exist to avoid. An item over the byte budget goes alone.
pub(super) const STREAM_CHUNK: usize = 256;
pub(super) const STREAM_CHUNK_BYTES: usize = 1 << 20;

/// What one unary ListPodSandboxMetrics answer may take: kubelet's 16 MiB receive limit less
/// room for the response's own framing.
const UNARY_METRICS_LIMIT: usize = (16 << 20) - (64 << 10);

pub(super) type ListStream<T> = Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

/// `items` as a stream of responses within `STREAM_CHUNK` items and `STREAM_CHUNK_BYTES`,
/// every item in exactly one, in order; no items, no response (the stream ends at once).
pub(super) fn chunked<I, T>(items: Vec<I>, wrap: fn(Vec<I>) -> T) -> Response<ListStream<T>>
where
    I: prost::Message + Send + 'static,
    T: Send + 'static,
{
    let lengths = chunk_lengths(items.iter().map(super::element_len));
    let mut items = items.into_iter();
    let chunks: Vec<Result<T, Status>> = lengths
        .into_iter()
        .map(|n| Ok(wrap(items.by_ref().take(n).collect())))
        .collect();
    Response::new(Box::pin(futures::stream::iter(chunks)))
}

/// How many of the items, of these encoded sizes in order, each response takes.
fn chunk_lengths(sizes: impl IntoIterator<Item = usize>) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut n, mut bytes) = (0, 0);
    for size in sizes {
        if n > 0 && (n == STREAM_CHUNK || bytes + size > STREAM_CHUNK_BYTES) {
            out.push(n);
            (n, bytes) = (0, 0);
        }
        n += 1;
        bytes += size;
    }
    if n > 0 {
        out.push(n);
    }
    out
}

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
        let health = self.daemon.health().await;
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
            // The configured handlers are the default one under other names.
            runtime_handlers: std::iter::once(String::new())
                .chain(self.daemon.config.runtime.handlers.iter().cloned())
                .map(|name| cri::RuntimeHandler {
                    name,
                    features: Some(cri::RuntimeHandlerFeatures {
                        recursive_read_only_mounts: true,
                        user_namespaces: self.daemon.runtime.userns_supported(),
                    }),
                })
                .collect(),
            features: Some(cri::RuntimeFeatures {
                supplemental_groups_policy: true,
                mount_options: true,
                user_namespaces_host_network: false,
            }),
            ..Default::default()
        };
        if req.get_ref().verbose {
            resp.info.insert("config".into(), self.daemon.config_json());
            // Whether this host can enforce AppArmor profiles, and what a request for one does.
            resp.info.insert(
                "apparmor".into(),
                hako_runtime::apparmor::status_info().to_string(),
            );
            // Broken CDI specs are reported here (and logged), never skipped silently.
            let cdi = self.daemon.cdi.clone();
            let (devices, errors) = tokio::task::spawn_blocking(move || cdi.report())
                .await
                .unwrap_or_default();
            let errors: Vec<serde_json::Value> = errors
                .into_iter()
                .map(|(file, error)| serde_json::json!({"file": file, "error": error}))
                .collect();
            resp.info.insert(
                "cdi".into(),
                serde_json::json!({"devices": devices, "errors": errors}).to_string(),
            );
        }
        Ok(Response::new(resp))
    }

    async fn runtime_config(
        &self,
        _: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        tracing::debug!(rpc = "RuntimeConfig");
        let driver = match self.daemon.config.runtime.cgroup_driver {
            CgroupDriver::Cgroupfs => cri::CgroupDriver::Cgroupfs,
            CgroupDriver::Systemd => cri::CgroupDriver::Systemd,
        };
        Ok(Response::new(cri::RuntimeConfigResponse {
            linux: Some(cri::LinuxRuntimeConfiguration {
                cgroup_driver: driver as i32,
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
        self.daemon
            .set_pod_cidr(cidr)
            .map_err(|e| status("UpdateRuntimeConfig", e))?;
        Ok(Response::new(cri::UpdateRuntimeConfigResponse {}))
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        let f = req.into_inner().filter.unwrap_or_default();
        let pods = self
            .daemon
            .runtime
            .pod_views()
            .await
            .map_err(|e| status("ListPodSandbox", e))?;
        let items = pods
            .iter()
            .filter(|p| f.id.is_empty() || p.record.id.starts_with(&f.id))
            .filter(|p| {
                f.state
                    .as_ref()
                    .is_none_or(|s| convert::pod_state(p.state) == s.state)
            })
            .filter(|p| convert::labels_match(&p.record.spec.labels, &f.label_selector))
            .map(convert::pod_item)
            .collect();
        Ok(Response::new(cri::ListPodSandboxResponse { items }))
    }

    async fn list_containers(
        &self,
        req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        let f = req.into_inner().filter.unwrap_or_default();
        let all = self
            .daemon
            .runtime
            .containers()
            .await
            .map_err(|e| status("ListContainers", e))?;
        let containers = all
            .iter()
            .filter(|c| f.id.is_empty() || c.record.id.starts_with(&f.id))
            .filter(|c| {
                f.pod_sandbox_id.is_empty() || c.record.pod_id.starts_with(&f.pod_sandbox_id)
            })
            .filter(|c| {
                f.state
                    .as_ref()
                    .is_none_or(|s| convert::container_state_matches(c, s.state))
            })
            .filter(|c| convert::labels_match(&c.record.spec.labels, &f.label_selector))
            .map(convert::container_item)
            .collect();
        Ok(Response::new(cri::ListContainersResponse { containers }))
    }

    async fn list_container_stats(
        &self,
        req: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        let f = req.into_inner().filter.unwrap_or_default();
        let stats = self
            .daemon
            .runtime
            .list_container_stats(|c| {
                (f.id.is_empty() || c.record.id.starts_with(&f.id))
                    && (f.pod_sandbox_id.is_empty()
                        || c.record.pod_id.starts_with(&f.pod_sandbox_id))
                    && convert::labels_match(&c.record.spec.labels, &f.label_selector)
            })
            .await
            .map_err(|e| status("ListContainerStats", e))?
            .iter()
            .map(|(c, u)| convert::container_stats(c, u))
            .collect();
        Ok(Response::new(cri::ListContainerStatsResponse { stats }))
    }

    async fn container_stats(
        &self,
        req: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        let id = req.into_inner().container_id;
        let (v, u) = self
            .daemon
            .runtime
            .container_stats(&id)
            .await
            .map_err(|e| status("ContainerStats", e))?;
        let stats = convert::container_stats(&v, &u);
        Ok(Response::new(cri::ContainerStatsResponse {
            stats: Some(stats),
        }))
    }

    async fn list_pod_sandbox_stats(
        &self,
        req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        let f = req.into_inner().filter.unwrap_or_default();
        let stats = self
            .daemon
            .runtime
            .list_pod_stats(|p| {
                (f.id.is_empty() || p.record.id.starts_with(&f.id))
                    && convert::labels_match(&p.record.spec.labels, &f.label_selector)
            })
            .await
            .map_err(|e| status("ListPodSandboxStats", e))?
            .iter()
            .map(pod_stats)
            .collect();
        Ok(Response::new(cri::ListPodSandboxStatsResponse { stats }))
    }

    async fn pod_sandbox_stats(
        &self,
        req: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        let id = req.into_inner().pod_sandbox_id;
        let stats = self
            .daemon
            .runtime
            .pod_stats(&id)
            .await
            .map_err(|e| status("PodSandboxStats", e))?;
        Ok(Response::new(cri::PodSandboxStatsResponse {
            stats: Some(pod_stats(&stats)),
        }))
    }

    async fn list_metric_descriptors(
        &self,
        _: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Result<Response<cri::ListMetricDescriptorsResponse>, Status> {
        Ok(Response::new(cri::ListMetricDescriptorsResponse {
            descriptors: metrics::descriptors(),
        }))
    }

    async fn run_pod_sandbox(
        &self,
        req: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        let req = req.into_inner();
        let config = req.config.ok_or_else(|| {
            status(
                "RunPodSandbox",
                Error::InvalidArgument("pod sandbox config is missing".into()),
            )
        })?;
        check_handler(&self.daemon, &req.runtime_handler)
            .map_err(|e| status("RunPodSandbox", e))?;
        let md = config.metadata.clone().unwrap_or_default();
        let userns = convert::userns(
            config
                .linux
                .as_ref()
                .and_then(|l| l.security_context.as_ref())
                .and_then(|s| s.namespace_options.as_ref())
                .and_then(|n| n.userns_options.as_ref()),
            &format!("pod sandbox {}/{}", md.namespace, md.name),
        )
        .map_err(|e| status("RunPodSandbox", e))?;
        let mut spec = convert::pod_spec(config, req.runtime_handler);
        spec.userns = userns;
        tracing::debug!(rpc = "RunPodSandbox", name = %spec.name, namespace = %spec.namespace);
        let id = to_completion(&self.daemon, "RunPodSandbox", |d| async move {
            d.runtime.run_pod(spec).await
        })
        .await?;
        Ok(Response::new(cri::RunPodSandboxResponse {
            pod_sandbox_id: id,
        }))
    }

    async fn stop_pod_sandbox(
        &self,
        req: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        let id = req.into_inner().pod_sandbox_id;
        tracing::debug!(rpc = "StopPodSandbox", pod = %id);
        to_completion(&self.daemon, "StopPodSandbox", |d| async move {
            d.runtime.stop_pod(&id).await
        })
        .await?;
        Ok(Response::new(cri::StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        let id = req.into_inner().pod_sandbox_id;
        tracing::debug!(rpc = "RemovePodSandbox", pod = %id);
        to_completion(&self.daemon, "RemovePodSandbox", |d| async move {
            d.runtime.remove_pod(&id).await
        })
        .await?;
        Ok(Response::new(cri::RemovePodSandboxResponse {}))
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "PodSandboxStatus", pod = %req.pod_sandbox_id);
        let view = self
            .daemon
            .runtime
            .pod_view(&req.pod_sandbox_id)
            .await
            .map_err(|e| status("PodSandboxStatus", e))?;
        let mut resp = cri::PodSandboxStatusResponse {
            status: Some(convert::pod_status(&view)),
            ..Default::default()
        };
        if req.verbose {
            let pod = &view.record;
            // Only the pinned ones: the IPC and UTS namespaces are held by the monitor, their
            // paths meaningful only to its own descendants.
            let namespaces: std::collections::BTreeMap<&String, &String> = pod
                .namespaces
                .iter()
                .filter(|(_, p)| !p.starts_with("/proc/"))
                .collect();
            let mut info = serde_json::json!({"monitorPid": pod.monitor_pid, "namespaces": namespaces, "spec": pod.spec});
            // CRI's pod status has no reason field: why a Ready pod is reported NotReady.
            if let Some(why) = &view.unanswered {
                info["notReadyReason"] = why.as_str().into();
            }
            resp.info.insert("info".into(), info.to_string());
        }
        Ok(Response::new(resp))
    }

    async fn create_container(
        &self,
        req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        let req = req.into_inner();
        let config = req.config.ok_or_else(|| {
            status(
                "CreateContainer",
                Error::InvalidArgument("container config is missing".into()),
            )
        })?;
        let spec = convert::container_req(config).map_err(|e| status("CreateContainer", e))?;
        tracing::debug!(rpc = "CreateContainer", pod = %req.pod_sandbox_id, name = %spec.name);
        let pod = req.pod_sandbox_id;
        let id = to_completion(&self.daemon, "CreateContainer", |d| async move {
            d.runtime.create_container(&pod, spec).await
        })
        .await?;
        Ok(Response::new(cri::CreateContainerResponse {
            container_id: id,
        }))
    }

    async fn start_container(
        &self,
        req: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        let id = req.into_inner().container_id;
        tracing::debug!(rpc = "StartContainer", container = %id);
        to_completion(&self.daemon, "StartContainer", |d| async move {
            d.runtime.start_container(&id).await
        })
        .await?;
        Ok(Response::new(cri::StartContainerResponse {}))
    }

    async fn stop_container(
        &self,
        req: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "StopContainer", container = %req.container_id, timeout = req.timeout);
        let timeout = std::time::Duration::from_secs(req.timeout.max(0) as u64);
        let id = req.container_id;
        to_completion(&self.daemon, "StopContainer", |d| async move {
            d.runtime.stop_container(&id, timeout).await
        })
        .await?;
        Ok(Response::new(cri::StopContainerResponse {}))
    }

    async fn remove_container(
        &self,
        req: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        let id = req.into_inner().container_id;
        tracing::debug!(rpc = "RemoveContainer", container = %id);
        to_completion(&self.daemon, "RemoveContainer", |d| async move {
            d.runtime.remove_container(&id).await
        })
        .await?;
        Ok(Response::new(cri::RemoveContainerResponse {}))
    }

    async fn container_status(
        &self,
        req: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "ContainerStatus", container = %req.container_id);
        let v = self
            .daemon
            .runtime
            .container(&req.container_id)
            .await
            .map_err(|e| status("ContainerStatus", e))?;
        let mut resp = cri::ContainerStatusResponse {
            status: Some(convert::container_status(&v)),
            ..Default::default()
        };
        if req.verbose {
            // containerd's keys where they mean the same (tools read `pid` and `sandboxID`).
            let info = serde_json::json!({
                "sandboxID": v.record.pod_id,
                "pid": v.pid,
                "cgroupsPath": v.record.cgroups_path,
                "chainIDs": v.record.chain_ids,
                "spec": v.record.spec,
            });
            resp.info.insert("info".into(), info.to_string());
        }
        Ok(Response::new(resp))
    }

    async fn reopen_container_log(
        &self,
        req: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        let id = req.into_inner().container_id;
        tracing::debug!(rpc = "ReopenContainerLog", container = %id);
        self.daemon
            .runtime
            .reopen_log(&id)
            .await
            .map_err(|e| status("ReopenContainerLog", e))?;
        Ok(Response::new(cri::ReopenContainerLogResponse {}))
    }

    async fn exec_sync(
        &self,
        req: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "ExecSync", container = %req.container_id, cmd = ?req.cmd);
        let timeout = std::time::Duration::from_secs(req.timeout.max(0) as u64);
        let out = self
            .daemon
            .runtime
            .exec_sync(&req.container_id, req.cmd, timeout)
            .await
            .map_err(|e| status("ExecSync", e))?;
        Ok(Response::new(cri::ExecSyncResponse {
            stdout: out.stdout,
            stderr: out.stderr,
            exit_code: out.exit_code,
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

    async fn update_container_resources(
        &self,
        req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "UpdateContainerResources", id = %req.container_id);
        let Some(linux) = req.linux else {
            return Err(status(
                "UpdateContainerResources",
                Error::InvalidArgument(format!(
                    "update of container {}: no Linux resources given",
                    req.container_id
                )),
            ));
        };
        let (id, resources) = (req.container_id, convert::resources(linux));
        to_completion(&self.daemon, "UpdateContainerResources", |d| async move {
            d.runtime.update_container(&id, resources).await
        })
        .await?;
        Ok(Response::new(cri::UpdateContainerResourcesResponse {}))
    }

    async fn exec(
        &self,
        req: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "Exec", container = %req.container_id, cmd = ?req.cmd, tty = req.tty);
        let (owner, container_id) = self.running("Exec", &req.container_id).await?;
        let url = self
            .daemon
            .streaming()
            .and_then(|s| {
                s.exec_url(
                    owner,
                    crate::streaming::ExecRequest {
                        container_id,
                        cmd: req.cmd,
                        tty: req.tty,
                        stdin: req.stdin,
                        stdout: req.stdout,
                        stderr: req.stderr,
                    },
                )
            })
            .map_err(|e| status("Exec", e))?;
        Ok(Response::new(cri::ExecResponse { url }))
    }

    async fn attach(
        &self,
        req: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "Attach", container = %req.container_id, tty = req.tty);
        let (owner, container_id) = self.running("Attach", &req.container_id).await?;
        let url = self
            .daemon
            .streaming()
            .and_then(|s| {
                s.attach_url(
                    owner,
                    crate::streaming::AttachRequest {
                        container_id,
                        tty: req.tty,
                        stdin: req.stdin,
                        stdout: req.stdout,
                        stderr: req.stderr,
                    },
                )
            })
            .map_err(|e| status("Attach", e))?;
        Ok(Response::new(cri::AttachResponse { url }))
    }

    async fn port_forward(
        &self,
        req: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        let req = req.into_inner();
        tracing::debug!(rpc = "PortForward", pod = %req.pod_sandbox_id, ports = ?req.port);
        let view = self
            .daemon
            .runtime
            .pod_view(&req.pod_sandbox_id)
            .await
            .map_err(|e| status("PortForward", e))?;
        if view.state != crate::pods::PodState::Ready {
            return Err(status(
                "PortForward",
                Error::FailedPrecondition(format!(
                    "port-forward to pod {}: the pod is not ready",
                    req.pod_sandbox_id
                )),
            ));
        }
        let url = self
            .daemon
            .streaming()
            .and_then(|s| {
                s.port_forward_url(crate::streaming::Owner {
                    pod: view.record.id.clone(),
                    namespace: view.record.spec.namespace.clone(),
                })
            })
            .map_err(|e| status("PortForward", e))?;
        Ok(Response::new(cri::PortForwardResponse { url }))
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
        let mut pod_metrics = self.pod_metrics("ListPodSandboxMetrics").await?;
        // kubelet reads the whole node's metrics in one message of at most 16 MiB unless it
        // streams them (its CRIListStreaming gate); past that it would get none at all.
        let left_out = metrics::fit_node_metrics(&mut pod_metrics, UNARY_METRICS_LIMIT);
        if left_out > 0 {
            tracing::warn!(
                containers = left_out,
                "ListPodSandboxMetrics: the node's metrics fill kubelet's 16 MiB message; containers left out (kubelet's CRIListStreaming gate streams them whole)"
            );
        }
        Ok(Response::new(cri::ListPodSandboxMetricsResponse {
            pod_metrics,
        }))
    }

    type StreamPodSandboxMetricsStream = ListStream<cri::StreamPodSandboxMetricsResponse>;

    async fn stream_pod_sandbox_metrics(
        &self,
        _: Request<cri::StreamPodSandboxMetricsRequest>,
    ) -> Result<Response<Self::StreamPodSandboxMetricsStream>, Status> {
        let items = self.pod_metrics("StreamPodSandboxMetrics").await?;
        Ok(chunked(items, |pod_sandbox_metrics| {
            cri::StreamPodSandboxMetricsResponse {
                pod_sandbox_metrics,
            }
        }))
    }

    type StreamPodSandboxesStream = ListStream<cri::StreamPodSandboxesResponse>;

    async fn stream_pod_sandboxes(
        &self,
        req: Request<cri::StreamPodSandboxesRequest>,
    ) -> Result<Response<Self::StreamPodSandboxesStream>, Status> {
        let filter = req.into_inner().filter;
        let items = self
            .list_pod_sandbox(Request::new(cri::ListPodSandboxRequest { filter }))
            .await?
            .into_inner()
            .items;
        Ok(chunked(items, |pod_sandboxes| {
            cri::StreamPodSandboxesResponse { pod_sandboxes }
        }))
    }

    type StreamContainersStream = ListStream<cri::StreamContainersResponse>;

    async fn stream_containers(
        &self,
        req: Request<cri::StreamContainersRequest>,
    ) -> Result<Response<Self::StreamContainersStream>, Status> {
        let filter = req.into_inner().filter;
        let items = self
            .list_containers(Request::new(cri::ListContainersRequest { filter }))
            .await?
            .into_inner()
            .containers;
        Ok(chunked(items, |containers| cri::StreamContainersResponse {
            containers,
        }))
    }

    type StreamContainerStatsStream = ListStream<cri::StreamContainerStatsResponse>;

    async fn stream_container_stats(
        &self,
        req: Request<cri::StreamContainerStatsRequest>,
    ) -> Result<Response<Self::StreamContainerStatsStream>, Status> {
        let filter = req.into_inner().filter;
        let items = self
            .list_container_stats(Request::new(cri::ListContainerStatsRequest { filter }))
            .await?
            .into_inner()
            .stats;
        Ok(chunked(items, |container_stats| {
            cri::StreamContainerStatsResponse { container_stats }
        }))
    }

    type StreamPodSandboxStatsStream = ListStream<cri::StreamPodSandboxStatsResponse>;

    async fn stream_pod_sandbox_stats(
        &self,
        req: Request<cri::StreamPodSandboxStatsRequest>,
    ) -> Result<Response<Self::StreamPodSandboxStatsStream>, Status> {
        let filter = req.into_inner().filter;
        let items = self
            .list_pod_sandbox_stats(Request::new(cri::ListPodSandboxStatsRequest { filter }))
            .await?
            .into_inner()
            .stats;
        Ok(chunked(items, |pod_sandbox_stats| {
            cri::StreamPodSandboxStatsResponse { pod_sandbox_stats }
        }))
    }

    async fn checkpoint_pod(
        &self,
        _: Request<cri::CheckpointPodRequest>,
    ) -> Result<Response<cri::CheckpointPodResponse>, Status> {
        unimplemented("CheckpointPod")
    }

    async fn restore_pod(
        &self,
        _: Request<cri::RestorePodRequest>,
    ) -> Result<Response<cri::RestorePodResponse>, Status> {
        unimplemented("RestorePod")
    }

    /// kubelet calls this after it has resized the pod's cgroup itself; it tells a runtime
    /// that keeps pod-level resources (for NRI plugins, say) what they are now. hako keeps
    /// none (its pods' cgroups are kubelet's), so it only answers for a pod it knows.
    async fn update_pod_sandbox_resources(
        &self,
        req: Request<cri::UpdatePodSandboxResourcesRequest>,
    ) -> Result<Response<cri::UpdatePodSandboxResourcesResponse>, Status> {
        let id = req.into_inner().pod_sandbox_id;
        self.daemon
            .runtime
            .pod(&id)
            .map_err(|e| status("UpdatePodSandboxResources", e))?;
        tracing::debug!(rpc = "UpdatePodSandboxResources", pod = %id, "nothing to update");
        Ok(Response::new(cri::UpdatePodSandboxResourcesResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[test]
    fn responses_end_at_the_item_count_or_the_byte_budget_whichever_comes_first() {
        let small = |n: usize| vec![100; n];
        for n in [
            0,
            1,
            STREAM_CHUNK - 1,
            STREAM_CHUNK,
            STREAM_CHUNK + 1,
            3 * STREAM_CHUNK + 7,
        ] {
            let l = chunk_lengths(small(n));
            assert_eq!(l.len(), n.div_ceil(STREAM_CHUNK), "{n} items");
            assert!(l.iter().all(|&c| c > 0 && c <= STREAM_CHUNK), "{n}: {l:?}");
            assert_eq!(l.iter().sum::<usize>(), n);
        }
        // 256 KiB items: four to a response of 1 MiB, not 256.
        let big = 256 << 10;
        assert_eq!(chunk_lengths(vec![big; 9]), vec![4, 4, 1]);
        assert_eq!(chunk_lengths(vec![big + 1; 4]), vec![3, 1]);
        // An item over the budget goes alone, between full responses, and first too.
        let l = chunk_lengths([10, STREAM_CHUNK_BYTES * 2, 10, 10]);
        assert_eq!(l, vec![1, 1, 2]);
        assert_eq!(chunk_lengths([STREAM_CHUNK_BYTES * 2, 10]), vec![1, 1]);
    }

    #[tokio::test]
    async fn a_streamed_list_sends_every_item_once_in_order_within_the_budget() {
        use prost::Message;
        // Pods with 200 KiB of annotations each, as a pod author may give them.
        let pods: Vec<cri::PodSandbox> = (0..30)
            .map(|i| cri::PodSandbox {
                id: format!("pod-{i}"),
                annotations: [("big".to_string(), "x".repeat(200 << 10))].into(),
                ..Default::default()
            })
            .collect();
        let responses: Vec<cri::StreamPodSandboxesResponse> = chunked(pods, |pod_sandboxes| {
            cri::StreamPodSandboxesResponse { pod_sandboxes }
        })
        .into_inner()
        .map(|r| r.unwrap())
        .collect()
        .await;
        assert!(
            responses
                .iter()
                .all(|r| r.encoded_len() <= STREAM_CHUNK_BYTES && !r.pod_sandboxes.is_empty()),
            "{:?}",
            responses
                .iter()
                .map(|r| r.encoded_len())
                .collect::<Vec<_>>()
        );
        // Five of these to a response (5 × 200 KiB and their framing fit in 1 MiB, six do not).
        assert_eq!(responses.len(), 6);
        let ids: Vec<String> = responses
            .into_iter()
            .flat_map(|r| r.pod_sandboxes)
            .map(|p| p.id)
            .collect();
        assert_eq!(ids, (0..30).map(|i| format!("pod-{i}")).collect::<Vec<_>>());

        // At the byte: four pods whose response, framing counted, is 4 bytes over the
        // budget (one each) are split three and one; each response stays within it.
        let pod = |n: usize| cri::PodSandbox {
            id: "p".into(),
            annotations: [("a".to_string(), "x".repeat(n))].into(),
            ..Default::default()
        };
        let framed = |p: &cri::PodSandbox| {
            let len = p.encoded_len();
            1 + prost::encoding::encoded_len_varint(len as u64) + len
        };
        let n = (1..STREAM_CHUNK_BYTES / 4)
            .rev()
            .find(|&n| 4 * framed(&pod(n)) <= STREAM_CHUNK_BYTES + 4)
            .unwrap();
        assert_eq!(
            4 * framed(&pod(n)),
            STREAM_CHUNK_BYTES + 4,
            "sizes step by one byte"
        );
        let responses: Vec<cri::StreamPodSandboxesResponse> =
            chunked(vec![pod(n); 4], |pod_sandboxes| {
                cri::StreamPodSandboxesResponse { pod_sandboxes }
            })
            .into_inner()
            .map(|r| r.unwrap())
            .collect()
            .await;
        let sizes: Vec<usize> = responses.iter().map(|r| r.pod_sandboxes.len()).collect();
        assert_eq!(sizes, vec![3, 1]);
        assert!(responses
            .iter()
            .all(|r| r.encoded_len() <= STREAM_CHUNK_BYTES));
    }
}
