//! CRI helpers shared by the pod, container and network e2e tests: a hako with the busybox
//! stand-in pulled, pod and container configs, run/exec/wait shortcuts and the leak check.

use std::collections::HashMap;
use std::time::Duration;

use hako_proto::cri;

use super::hako::Hako;
use super::oci::{self, Compression, Image, ImageConf, Layer, Pusher};
use super::registry::Registry;

pub type Rt =
    hako_proto::cri::runtime_service_client::RuntimeServiceClient<tonic::transport::Channel>;

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
    super::hako::pull(&h, IMAGE).await.expect("pull busybox");
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

/// A config's Linux security context, made if missing.
pub trait Secured {
    type Context;
    fn sc(&mut self) -> &mut Self::Context;
}

impl Secured for cri::ContainerConfig {
    type Context = cri::LinuxContainerSecurityContext;
    fn sc(&mut self) -> &mut Self::Context {
        self.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
    }
}

impl Secured for cri::PodSandboxConfig {
    type Context = cri::LinuxSandboxSecurityContext;
    fn sc(&mut self) -> &mut Self::Context {
        self.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
    }
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
    for _ in 0..1500 {
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

/// Every container hako lists (ListContainers, no filter).
pub async fn all_containers(rt: &mut Rt) -> Vec<cri::Container> {
    rt.list_containers(cri::ListContainersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .containers
}

/// CreateContainer that is expected to fail; its error.
pub async fn create_container_err(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    cc: cri::ContainerConfig,
) -> tonic::Status {
    rt.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: pod.into(),
        config: Some(cc),
        sandbox_config: Some(cfg.clone()),
    })
    .await
    .unwrap_err()
}

/// CreateContainer, without a start; the container's id.
pub async fn create_container(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    cc: cri::ContainerConfig,
) -> String {
    rt.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: pod.into(),
        config: Some(cc),
        sandbox_config: Some(cfg.clone()),
    })
    .await
    .unwrap()
    .into_inner()
    .container_id
}

pub async fn run_container(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    cc: cri::ContainerConfig,
) -> String {
    let id = create_container(rt, pod, cfg, cc).await;
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    id
}

/// `cc`, joining the PID namespace of container `target` (TARGET, as `kubectl debug --target`
/// asks; `target` may be a prefix of the id).
pub fn in_pid_namespace_of(mut cc: cri::ContainerConfig, target: &str) -> cri::ContainerConfig {
    let linux = cc.linux.get_or_insert_with(Default::default);
    let sc = linux.security_context.get_or_insert_with(Default::default);
    sc.namespace_options = Some(cri::NamespaceOption {
        pid: cri::NamespaceMode::Target as i32,
        target_id: target.to_string(),
        ..Default::default()
    });
    cc
}

/// The command lines of the processes container `id` sees, NULs as spaces.
pub async fn visible_processes(rt: &mut Rt, id: &str) -> String {
    exec(rt, id, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").await
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

/// The daemon's directories that hold a pod's traces: pod state (monitor socket, namespace
/// mounts, logs), container bundles, container layers, cached CNI results.
pub fn watched_dirs(h: &Hako) -> [std::path::PathBuf; 4] {
    [
        h.state.join("pods"),
        h.state.join("containers"),
        h.root.join("containers"),
        h.root.join("cni/results"),
    ]
}

/// Mount points of every cgroup hierarchy here (v1 controllers, the v2 one), from mountinfo.
pub fn cgroup_mounts() -> Vec<std::path::PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fstype = post.split(' ').next()?;
            (fstype == "cgroup" || fstype == "cgroup2")
                .then(|| std::path::PathBuf::from(pre.split(' ').nth(4).unwrap()))
        })
        .collect()
}

/// Where the pod's cgroup is (or would be) in every hierarchy: `<mount>/hako/<pod>`.
pub fn pod_cgroup_dirs(pod: &str) -> Vec<std::path::PathBuf> {
    cgroup_mounts()
        .into_iter()
        .map(|m| m.join("hako").join(pod))
        .collect()
}

/// Child cgroups (containers) under the pod's cgroup, in every hierarchy.
pub fn container_cgroups(pod: &str) -> Vec<std::path::PathBuf> {
    pod_cgroup_dirs(pod)
        .into_iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flat_map(|rd| rd.flatten().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect()
}

/// Processes whose command line names the pod (its monitor, its infra process).
fn pod_processes(pod: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(pod))
        })
        .count()
}

/// Entries under a watched directory; the directory must exist (a leak check that looks at a
/// path nothing writes to any more would pass forever).
fn watched_entries(dir: &std::path::Path) -> Vec<String> {
    assert!(
        dir.is_dir(),
        "watched dir {} does not exist: did the layout change?",
        dir.display()
    );
    Hako::files_under(dir)
}

/// While a pod runs container `cid`: every place `assert_no_leaks` looks at holds something of
/// it (mounts, each watched dir, the cgroup in each hierarchy the container is in, a process),
/// so a layout change cannot turn the leak check into a check of places nothing uses.
pub async fn assert_traces_present(h: &Hako, rt: &mut Rt, pod: &str, cid: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        mounts.contains(&h.dir.path().display().to_string()),
        "no mount under the daemon's dirs while pod {pod} runs"
    );
    for d in watched_dirs(h) {
        let entries = watched_entries(&d);
        assert!(
            !entries.is_empty(),
            "{} is empty while pod {pod} runs: the leak check would see nothing there",
            d.display()
        );
    }
    let pid = container_pid(rt, cid).await;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let dirs = pod_cgroup_dirs(pod);
    let mut in_pod_cgroup = 0;
    for line in cgroups.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        if path.starts_with(&format!("/hako/{pod}/")) {
            in_pod_cgroup += 1;
        }
    }
    assert!(
        in_pod_cgroup > 0,
        "container {cid} is in no cgroup under /hako/{pod}: {cgroups}"
    );
    let present = dirs.iter().filter(|d| d.is_dir()).count();
    assert!(
        present >= in_pod_cgroup,
        "the pod's cgroup dirs found ({present} of {dirs:?}) do not cover the {in_pod_cgroup} hierarchies its container is in"
    );
    assert!(pod_processes(pod) > 0, "no process names pod {pod}");
}

/// Nothing of a removed pod is left: mounts under the daemon's dirs, pod and container state
/// files, cached CNI results, the pod's cgroup in any hierarchy (v1, hybrid, v2), its monitor.
pub fn assert_no_leaks(h: &Hako, pod: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&h.dir.path().display().to_string()),
        "leaked mounts:\n{mounts}"
    );
    for d in watched_dirs(h) {
        let left = watched_entries(&d);
        assert!(left.is_empty(), "{} left: {left:?}", d.display());
    }
    let dirs = pod_cgroup_dirs(pod);
    assert!(!dirs.is_empty(), "no cgroup hierarchy mounted?");
    for cg in dirs {
        assert!(!cg.exists(), "cgroup left: {}", cg.display());
    }
    assert_eq!(pod_processes(pod), 0, "a process of pod {pod} is left");
}

/// The container's log lines, without timestamps: "<stream> <tag> <text>". The file must
/// exist (it is created with the container): a missing log is a failure, not an empty one.
pub fn log_lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("container log {}: {e}", path.display()))
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

/// StopContainer (no grace period) then RemoveContainer, both expected to succeed.
pub async fn remove_container(rt: &mut Rt, id: &str) {
    rt.stop_container(cri::StopContainerRequest {
        container_id: id.into(),
        timeout: 0,
    })
    .await
    .unwrap();
    rt.remove_container(cri::RemoveContainerRequest {
        container_id: id.into(),
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

/// The pid of the pod's monitor, from the verbose PodSandboxStatus.
pub async fn monitor_pid(rt: &mut Rt, pod: &str) -> nix::unistd::Pid {
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
    nix::unistd::Pid::from_raw(v["monitorPid"].as_i64().unwrap() as i32)
}

/// SIGKILLs the pod's monitor (its pid from the verbose PodSandboxStatus) and waits until it
/// has died (a zombie or gone): kill(2) only queues the signal, and a daemon started or asked
/// right after could still reach the monitor.
pub async fn kill_monitor(rt: &mut Rt, pod: &str) {
    let monitor = monitor_pid(rt, pod).await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGKILL).unwrap();
    super::wait_for("the killed monitor to die", Duration::from_secs(30), || {
        super::process_dead(monitor.as_raw())
    })
    .await;
}

/// Host processes whose command line is exactly `argv` (NUL-separated, as in /proc).
pub fn processes_with_cmdline(argv: &[&str]) -> usize {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| a.bytes().chain(std::iter::once(0)))
        .collect();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == want))
        .count()
}

/// ContainerStats of one container.
pub async fn container_stats(rt: &mut Rt, id: &str) -> cri::ContainerStats {
    rt.container_stats(cri::ContainerStatsRequest {
        container_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .stats
    .unwrap()
}

/// The pod's state as ListPodSandbox reports it.
pub async fn pod_state(rt: &mut Rt, pod: &str) -> i32 {
    rt.list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .expect("ListPodSandbox")
        .into_inner()
        .items
        .into_iter()
        .find(|i| i.id == pod)
        .expect("the pod is listed")
        .state
}

/// Waits (60 s at most) until the pod of a killed monitor is listed NotReady: the daemon learns
/// of the death from its own watch of the monitor, which nothing the test sees waits for.
pub async fn wait_not_ready(rt: &mut Rt, pod: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while pod_state(rt, pod).await != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pod of a killed monitor was never reported NotReady"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Resumes a SIGSTOPped monitor when dropped, so a failing test does not leave it stopped.
pub struct Resume(pub nix::unistd::Pid);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGCONT);
    }
}
