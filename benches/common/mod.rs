//! Starting hako and Debian's containerd side by side for benchmarks, each in its own temp
//! dirs, and CRI clients to both.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hako_proto::cri::image_service_client::ImageServiceClient;
use hako_proto::cri::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;

pub struct Runtime {
    pub name: &'static str,
    pub socket: PathBuf,
    pub child: Child,
    pub root: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        let _ = nix::mount::umount2(
            &self.dir.path().join("state"),
            nix::mount::MntFlags::MNT_DETACH,
        );
    }
}

/// Where every runtime's directory (root, state, config) goes: `HAKO_BENCH_DIR`, else
/// `/var/tmp`. This machine's root is ext4 without a journal, unlike a node's; a journaled
/// filesystem mounted elsewhere lets the same run compare runtimes there.
pub fn bench_dir() -> PathBuf {
    std::env::var_os("HAKO_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp"))
}

/// A runtime's state directory, `dir/state`: a tmpfs of its own, as `/run` is on a node
/// (`/run/hako`, `/run/containerd`), for every runtime alike. This machine's `/run` and
/// `/var/tmp` are ext4 without a journal, where each new inode is found by scanning past
/// the recently deleted ones (`recently_deleted` in `find_inode_bit`): with pods made and
/// removed by the hundred, that scan was a fifth of hako's daemon CPU and an eighth of its
/// monitors' (docs/BENCHMARKS.md). `HAKO_BENCH_STATE_ON_DISK=1` leaves it on the disk, as
/// runs before 2026-11-27 had it.
pub fn state_dir(dir: &Path) -> PathBuf {
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    if std::env::var_os("HAKO_BENCH_STATE_ON_DISK").is_none() {
        nix::mount::mount(
            Some("tmpfs"),
            &state,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
            Some("mode=0711"),
        )
        .expect("a tmpfs for the runtime's state");
    }
    state
}

pub fn wait_socket(p: &Path, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(p).is_err() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("{what} exited: {s}");
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {}",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A certs.d directory with `hosts.toml` files: (registry, contents).
pub fn certs_for(hosts: &[(&str, &str)]) -> tempfile::TempDir {
    let d = tempfile::tempdir_in(bench_dir()).unwrap();
    for (registry, text) in hosts {
        std::fs::create_dir_all(d.path().join(registry)).unwrap();
        std::fs::write(d.path().join(registry).join("hosts.toml"), text).unwrap();
    }
    d
}

pub fn start_hako(certs: &Path, log: &str, cni_conf: Option<&Path>) -> Runtime {
    start_hako_with(certs, log, cni_conf, "")
}

/// As `start_hako`, with `extra` appended to its config file (whole TOML tables).
pub fn start_hako_with(certs: &Path, log: &str, cni_conf: Option<&Path>, extra: &str) -> Runtime {
    start_hako_bin(
        Path::new(env!("CARGO_BIN_EXE_hako")),
        certs,
        log,
        cni_conf,
        extra,
    )
}

/// As `start_hako_with`, running the hako binary `bin` (e.g. an earlier build, for a before
/// and after in one run).
pub fn start_hako_bin(
    bin: &Path,
    certs: &Path,
    log: &str,
    cni_conf: Option<&Path>,
    extra: &str,
) -> Runtime {
    let dir = tempfile::tempdir_in(bench_dir()).unwrap();
    let socket = dir.path().join("hako.sock");
    let root = dir.path().join("root");
    let cfg = dir.path().join("config.toml");
    let cni = match cni_conf {
        Some(c) => format!(
            "[cni]\nconf_dir = \"{}\"\nbin_dirs = [\"/usr/lib/cni\"]\n",
            c.display()
        ),
        None => String::new(),
    };
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{}\"\nroot = \"{}\"\nstate = \"{}\"\n{cni}[registry]\nconfig_path = \"{}\"\n{extra}",
            socket.display(),
            root.display(),
            state_dir(dir.path()).display(),
            certs.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&cfg)
        // HAKO_BENCH_LOG: a tracing filter for hako during the benchmark (e.g. for timings).
        .env(
            "HAKO_LOG",
            std::env::var("HAKO_BENCH_LOG").unwrap_or_else(|_| log.to_string()),
        )
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_socket(&socket, &mut child, "hako");
    Runtime {
        name: "hako",
        socket,
        child,
        root,
        dir,
    }
}

/// containerd 1.6 with its CRI plugin; `cni_conf` gives pods a network config (else pods
/// cannot start, only images are usable).
pub fn start_containerd(certs: &Path, cni_conf: Option<&Path>) -> Runtime {
    let dir = tempfile::tempdir_in(bench_dir()).unwrap();
    let socket = dir.path().join("containerd.sock");
    let root = dir.path().join("root");
    let cfg = dir.path().join("config.toml");
    let cni = match cni_conf {
        Some(c) => format!("  [plugins.\"io.containerd.grpc.v1.cri\".cni]\n    bin_dir = \"/usr/lib/cni\"\n    conf_dir = \"{}\"\n", c.display()),
        None => String::new(),
    };
    std::fs::write(
        &cfg,
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  sandbox_image = "registry.k8s.io/pause:3.6"
{cni}  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{certs}"
"#,
            root = root.display(),
            state = state_dir(dir.path()).display(),
            sock = socket.display(),
            certs = certs.display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
    let mut child = Command::new("containerd")
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    wait_socket(&socket, &mut child, "containerd");
    Runtime {
        name: "containerd 1.6",
        socket,
        child,
        root,
        dir,
    }
}

#[derive(Clone)]
pub struct Clients {
    pub runtime: RuntimeServiceClient<Channel>,
    pub images: ImageServiceClient<Channel>,
}

pub async fn client(socket: &Path) -> Clients {
    let path = socket.to_path_buf();
    let ch = tonic::transport::Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap();
    Clients {
        runtime: RuntimeServiceClient::new(ch.clone()).max_decoding_message_size(64 << 20),
        images: ImageServiceClient::new(ch).max_decoding_message_size(64 << 20),
    }
}

/// Where `.ci/build-containerd.sh` left containerd 2.x and its runc shim:
/// `HAKO_BENCH_CONTAINERD2`, else /var/tmp/hako-containerd-v2.2.1 (the script's cache dir in
/// the docs). None when it is not built: the benchmarks then compare with 1.6 only.
pub fn containerd2_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("HAKO_BENCH_CONTAINERD2")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/hako-containerd-v2.2.1"));
    (dir.join("containerd").is_file() && dir.join("containerd-shim-runc-v2").is_file())
        .then_some(dir)
}

/// containerd 2.x from `bin_dir` (see [`containerd2_dir`]) with its CRI plugins, configured
/// as [`start_containerd`] configures 1.6 (config version 3). Its shim is found on PATH.
pub fn start_containerd2(bin_dir: &Path, certs: &Path, cni_conf: Option<&Path>) -> Runtime {
    let dir = tempfile::tempdir_in(bench_dir()).unwrap();
    let socket = dir.path().join("containerd.sock");
    let root = dir.path().join("root");
    let cfg = dir.path().join("config.toml");
    let cni = match cni_conf {
        Some(c) => format!(
            "[plugins.'io.containerd.cri.v1.runtime'.cni]\n  bin_dirs = [\"/usr/lib/cni\"]\n  conf_dir = \"{}\"\n",
            c.display()
        ),
        None => String::new(),
    };
    std::fs::write(
        &cfg,
        format!(
            r#"version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
# Another containerd may run beside it: no shared NRI socket.
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "registry.k8s.io/pause:3.10"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{certs}"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
{cni}"#,
            root = root.display(),
            state = state_dir(dir.path()).display(),
            sock = socket.display(),
            certs = certs.display()
        ),
    )
    .unwrap();
    let version = std::fs::read_to_string(bin_dir.join(".containerd-version"))
        .map(|v| v.trim().trim_start_matches('v').to_string())
        .unwrap_or_else(|_| "2.x".into());
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
    let mut child = Command::new(bin_dir.join("containerd"))
        .arg("--config")
        .arg(&cfg)
        .env("PATH", path)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    wait_socket(&socket, &mut child, "containerd 2");
    Runtime {
        // One name per process run; a handful of runtimes are started.
        name: Box::leak(format!("containerd {version}").into_boxed_str()),
        socket,
        child,
        root,
        dir,
    }
}

/// The image both benches run: the busybox stand-in under its registry.k8s.io name.
pub const SLEEPER_IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.29-2";

/// What kubelet sends for a pod without shareProcessNamespace, on the host network: a PID
/// namespace per container (the proto default, POD, would share one).
fn host_network_namespaces() -> Option<hako_proto::cri::NamespaceOption> {
    Some(hako_proto::cri::NamespaceOption {
        network: hako_proto::cri::NamespaceMode::Node as i32,
        pid: hako_proto::cri::NamespaceMode::Container as i32,
        ..Default::default()
    })
}

/// A host-network pod `name` in namespace `bench`, its logs under /var/tmp/hako-bench-logs.
/// Host network for every runtime: containerd needs a CNI result with an IP for pod networks,
/// and this keeps them all doing the same work (a bench that wants CNI adds it).
pub fn host_pod_config(name: &str) -> hako_proto::cri::PodSandboxConfig {
    use hako_proto::cri;
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "bench".into(),
            attempt: 0,
        }),
        // No hostname: a host-network pod shares the host's UTS namespace.
        log_directory: format!("/var/tmp/hako-bench-logs/{name}"),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: host_network_namespaces(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A container `sleeper` of [`SLEEPER_IMAGE`] that sleeps an hour. PID 1 of its own PID
/// namespace ignores SIGTERM unless it handles it: this one does, so a stop is graceful.
pub fn sleeper_config() -> hako_proto::cri::ContainerConfig {
    use hako_proto::cri;
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "sleeper".into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: SLEEPER_IMAGE.into(),
            ..Default::default()
        }),
        command: vec![
            "sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM; sleep 3600 & wait".into(),
        ],
        log_path: "sleeper.log".into(),
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: host_network_namespaces(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The `p` quantile (0..=1) of `v`, nearest rank; sorts `v`.
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}
