//! CRI helpers shared by the pod, container and network e2e tests: a hako with the busybox
//! stand-in pulled, pod and container configs, run/exec/wait shortcuts and the leak check.

use std::collections::HashMap;
use std::time::Duration;

use k8s_cri::v1 as cri;

use super::hako::Hako;
use super::oci::{self, Compression, Image, ImageConf, Layer, Pusher};
use super::registry::Registry;

pub type Rt = k8s_cri::v1::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>;

pub const IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.29-2";

/// A hako with the busybox stand-in pulled (served through a hosts.toml mirror).
pub async fn ready() -> Option<(Registry, Hako)> {
    ready_with_state("state").await
}

pub async fn ready_with_state(state: &str) -> Option<(Registry, Hako)> {
    ready_with(state, "").await
}

/// As `ready`, with `extra` in hako's config.
pub async fn ready_with_config(extra: &str) -> Option<(Registry, Hako)> {
    ready_with("state", extra).await
}

async fn ready_with(state: &str, extra: &str) -> Option<(Registry, Hako)> {
    if !super::e2e_ready(&[super::registry::REGISTRY_BIN]) {
        return None;
    }
    let reg = Registry::start();
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr)
        .push("e2e-test-images/busybox", "1.29-2", &img)
        .await;
    let h = Hako::start_with_state(extra, state);
    h.hosts_toml(
        "registry.k8s.io",
        &super::standins::hosts_toml("registry.k8s.io", &reg.addr),
    );
    let mut c = h.images().await;
    c.pull_image(cri::PullImageRequest {
        image: Some(cri::ImageSpec {
            image: IMAGE.into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .expect("pull busybox");
    Some((reg, h))
}

pub fn pod_config(name: &str, log_dir: &std::path::Path) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        hostname: format!("{name}-host"),
        log_directory: log_dir.display().to_string(),
        labels: HashMap::from([("app".to_string(), name.to_string())]),
        ..Default::default()
    }
}

/// `cfg` with pod-level namespace modes, as kubelet sets them in the sandbox security context.
pub fn with_namespaces(
    mut cfg: cri::PodSandboxConfig,
    ns: cri::NamespaceOption,
) -> cri::PodSandboxConfig {
    cfg.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(ns),
            ..Default::default()
        }),
        ..Default::default()
    });
    cfg
}

pub fn container_config(name: &str, cmd: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: IMAGE.into(),
            ..Default::default()
        }),
        command: cmd.iter().map(|s| s.to_string()).collect(),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

pub async fn wait_exited(rt: &mut Rt, id: &str) -> cri::ContainerStatus {
    for _ in 0..300 {
        let s = status(rt, id).await;
        if s.state == cri::ContainerState::ContainerExited as i32 {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("container {id} did not exit");
}

pub async fn run_pod(rt: &mut Rt, cfg: &cri::PodSandboxConfig) -> String {
    rt.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(cfg.clone()),
        runtime_handler: String::new(),
    })
    .await
    .unwrap()
    .into_inner()
    .pod_sandbox_id
}

/// RunPodSandbox that is expected to fail; its error.
pub async fn run_pod_err(rt: &mut Rt, cfg: &cri::PodSandboxConfig) -> tonic::Status {
    rt.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(cfg.clone()),
        runtime_handler: String::new(),
    })
    .await
    .unwrap_err()
}

pub async fn run_container(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    cc: cri::ContainerConfig,
) -> String {
    let id = rt
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(cc),
            sandbox_config: Some(cfg.clone()),
        })
        .await
        .unwrap()
        .into_inner()
        .container_id;
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    id
}

pub async fn exec(rt: &mut Rt, id: &str, script: &str) -> String {
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        out.exit_code,
        0,
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Nothing of a removed pod is left: mounts under the daemon's dirs, pod and container state
/// files, the pod's cgroups, its monitor.
pub fn assert_no_leaks(h: &Hako, pod: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&h.dir.path().display().to_string()),
        "leaked mounts:\n{mounts}"
    );
    for d in ["state/pods", "state/containers", "root/containers"] {
        let left = Hako::files_under(&h.dir.path().join(d));
        assert!(left.is_empty(), "{d} left: {left:?}");
    }
    for ctrl in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let cg = ctrl.path().join("hako").join(pod);
        assert!(!cg.exists(), "cgroup left: {}", cg.display());
    }
    let monitors = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(pod))
        })
        .count();
    assert_eq!(monitors, 0, "a process of pod {pod} is left");
}

/// The container's log lines, without timestamps: "<stream> <tag> <text>".
pub fn log_lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| l.split_once(' ').map(|x| x.1).unwrap_or("").to_string())
        .collect()
}

pub async fn status(rt: &mut Rt, id: &str) -> cri::ContainerStatus {
    rt.container_status(cri::ContainerStatusRequest {
        container_id: id.into(),
        verbose: false,
    })
    .await
    .unwrap()
    .into_inner()
    .status
    .unwrap()
}

/// StopPodSandbox then RemovePodSandbox, both expected to succeed.
pub async fn remove_pod(rt: &mut Rt, pod: &str) {
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.into(),
    })
    .await
    .unwrap();
    rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: pod.into(),
    })
    .await
    .unwrap();
}

/// The host pid of a container's init, from the verbose ContainerStatus.
pub async fn container_pid(rt: &mut Rt, id: &str) -> i32 {
    let info = rt
        .container_status(cri::ContainerStatusRequest {
            container_id: id.into(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner()
        .info;
    let v: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    v["pid"].as_i64().expect("verbose info has the pid") as i32
}

/// SIGKILLs the pod's monitor (its pid from the verbose PodSandboxStatus).
pub async fn kill_monitor(rt: &mut Rt, pod: &str) {
    let info = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.into(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner()
        .info;
    let v: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    let monitor = v["monitorPid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}
