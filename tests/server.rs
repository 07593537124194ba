//! The in-process tier: the real CRI server (`hako::server::run`) on a temp socket, over a
//! `Daemon` opened on temp directories, driven by tonic clients. No containers, registry or
//! root: the gRPC layer's conversions, its validation and error codes, and shutdown, in
//! milliseconds. What needs real pods is in the end-to-end tests (pods.rs and the others).

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hako::config::Config;
use hako::daemon::Daemon;
use hako_proto::cri;
use hako_proto::cri::image_service_client::ImageServiceClient;
use hako_proto::cri::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

/// A daemon serving on a temp socket in this process.
struct Server {
    dir: tempfile::TempDir,
    socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<hako::error::Result<()>>,
}

impl Server {
    async fn start() -> Server {
        Self::start_with(|_, _| {}).await
    }

    /// As `start`, with `tweak` applied to the config (every path is under the temp dir).
    async fn start_with(tweak: impl FnOnce(&mut Config, &Path)) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let socket = d.join("hako.sock");
        let mut config = Config {
            listen: socket.clone(),
            root: d.join("root"),
            state: d.join("state"),
            ..Default::default()
        };
        config.registry.config_path = d.join("certs.d");
        // A network config dir of the test's own, empty unless the test writes one.
        config.cni.conf_dir = d.join("net.d");
        config.cni.bin_dirs = vec![d.join("bin")];
        config.cdi.spec_dirs = vec![d.join("cdi")];
        for sub in ["certs.d", "net.d", "bin", "cdi"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        tweak(&mut config, d);
        let daemon = Daemon::open(config).await.expect("open the daemon");
        let listener = hako::daemon::bind(&socket).expect("bind the socket");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(hako::server::run(listener, daemon, async move {
            let _ = stopped.await;
        }));
        Server {
            dir,
            socket,
            stop: Some(stop),
            task,
        }
    }

    async fn channel(&self) -> Channel {
        let path = self.socket.clone();
        Endpoint::try_from("http://[::]:50051")
            .unwrap()
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(path).await?,
                    ))
                }
            }))
            .await
            .expect("connect to the server")
    }

    async fn runtime(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel().await)
    }

    async fn images(&self) -> ImageServiceClient<Channel> {
        ImageServiceClient::new(self.channel().await)
    }

    /// Asks the server to stop; `run`'s result once it has.
    async fn shutdown(mut self) -> hako::error::Result<()> {
        let _ = self.stop.take().expect("running").send(());
        (&mut self.task).await.expect("server task")
    }
}

fn pod_config(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "default".into(),
            attempt: 0,
        }),
        ..Default::default()
    }
}

async fn run_pod_err(
    rt: &mut RuntimeServiceClient<Channel>,
    config: cri::PodSandboxConfig,
) -> tonic::Status {
    rt.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(config),
        ..Default::default()
    })
    .await
    .expect_err("RunPodSandbox must be refused")
}

#[tokio::test(flavor = "multi_thread")]
async fn version_and_status() {
    let s = Server::start().await;
    let mut rt = s.runtime().await;
    let v = rt
        .version(cri::VersionRequest {
            version: "v1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v.runtime_name, "hako");
    assert_eq!(v.runtime_api_version, "v1");
    assert_eq!(v.runtime_version, env!("CARGO_PKG_VERSION"));

    let st = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner();
    let conditions = st.status.unwrap().conditions;
    let cond = |t: &str| conditions.iter().find(|c| c.r#type == t).cloned().unwrap();
    assert!(cond("RuntimeReady").status);
    // No network config in the test's own config dir: not ready, and the reason says so.
    let net = cond("NetworkReady");
    assert!(!net.status);
    assert_eq!(net.reason, "NetworkPluginNotReady");
    assert!(!net.message.is_empty());
    // Verbose: the config in effect, with the test's paths.
    let config: serde_json::Value = serde_json::from_str(&st.info["config"]).unwrap();
    assert_eq!(
        config["root"],
        s.dir.path().join("root").display().to_string()
    );
    assert!(st.info.contains_key("cdi") && st.info.contains_key("apparmor"));
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_empty_store_lists_no_images() {
    let s = Server::start().await;
    let mut im = s.images().await;
    let list = im
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(list.images.is_empty(), "{:?}", list.images);
    // An unknown image is no error for ImageStatus: the image is just absent.
    let st = im
        .image_status(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: "example.com/none:1".into(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.image.is_none(), "{:?}", st.image);
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn run_pod_sandbox_refuses_bad_requests() {
    let s = Server::start().await;
    let mut rt = s.runtime().await;
    let e = run_pod_err(
        &mut rt,
        cri::PodSandboxConfig {
            metadata: None,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("metadata"), "{e:?}");

    for parent in ["/kubepods/../../escape", "..", "/", "/hako/p1"] {
        let mut config = pod_config("escape");
        config.linux = Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: parent.into(),
            ..Default::default()
        });
        let e = run_pod_err(&mut rt, config).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{parent}: {e:?}");
        assert!(
            e.message().contains("cgroup parent") && e.message().contains(parent),
            "{e:?}"
        );
    }

    let e = rt
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod_config("handler")),
            runtime_handler: "kata".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("kata"), "{e:?}");

    // Refused before anything was made: nothing listed, nothing on disk.
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(pods.is_empty(), "{pods:?}");
    let dirs: Vec<_> = std::fs::read_dir(s.dir.path().join("state/pods"))
        .unwrap()
        .collect();
    assert!(dirs.is_empty(), "{dirs:?}");
    s.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_objects_are_not_found_or_already_gone() {
    let s = Server::start().await;
    let mut rt = s.runtime().await;
    let e = rt
        .container_status(cri::ContainerStatusRequest {
            container_id: "feedface".into(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("container feedface"), "{e:?}");
    let e = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: "feedface".into(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");

    // Stop and remove are idempotent: what is unknown is already stopped and removed.
    rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: "feedface".into(),
    })
    .await
    .unwrap();
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: "feedface".into(),
    })
    .await
    .unwrap();
    rt.stop_container(cri::StopContainerRequest {
        container_id: "feedface".into(),
        timeout: 0,
    })
    .await
    .unwrap();
    rt.remove_container(cri::RemoveContainerRequest {
        container_id: "feedface".into(),
    })
    .await
    .unwrap();
    s.shutdown().await.unwrap();
}

/// Shutdown stops accepting at once and lets a call under way finish with its answer.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_finishes_in_flight_calls() {
    // A CNI 1.1 network whose one plugin answers STATUS (what Status runs) only once the test
    // says so; its other commands (GC at start) answer at once.
    let mut s = Server::start_with(|config, d| {
        let flags = d.join("flags");
        std::fs::create_dir_all(&flags).unwrap();
        let plugin = d.join("bin/slow-status");
        std::fs::write(
            &plugin,
            format!(
                "#!/bin/sh\n[ \"$CNI_COMMAND\" = STATUS ] || exit 0\n: > {f}/started\nwhile [ -d {f} ] && [ ! -e {f}/release ]; do sleep 0.02; done\n",
                f = flags.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(
            config.cni.conf_dir.join("10-slow.conflist"),
            r#"{"cniVersion": "1.1.0", "name": "slow", "plugins": [{"type": "slow-status"}]}"#,
        )
        .unwrap();
    })
    .await;
    let flags = s.dir.path().join("flags");
    let mut rt = s.runtime().await;
    let call = tokio::spawn(async move { rt.status(cri::StatusRequest { verbose: false }).await });
    let started = flags.join("started");
    support::wait_for(
        "the Status call to reach the plugin",
        Duration::from_secs(30),
        || started.exists(),
    )
    .await;

    let _ = s.stop.take().expect("running").send(());
    // The listener goes at once: a new client is refused while the old call still runs.
    let socket = s.socket.clone();
    support::wait_for(
        "the server to stop accepting",
        Duration::from_secs(30),
        || std::os::unix::net::UnixStream::connect(&socket).is_err(),
    )
    .await;
    assert!(
        !call.is_finished(),
        "the in-flight call ended before it was released"
    );
    assert!(!s.task.is_finished(), "run returned with a call in flight");

    std::fs::write(flags.join("release"), "").unwrap();
    let st = call
        .await
        .unwrap()
        .expect("the in-flight Status call is answered")
        .into_inner();
    let net = st
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.r#type == "NetworkReady")
        .unwrap();
    assert!(net.status, "{net:?}");
    (&mut s.task)
        .await
        .unwrap()
        .expect("run ends cleanly once the call is answered");
}
