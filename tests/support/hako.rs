//! Runs the real `hako serve` binary in temp directories and talks CRI to it over its socket.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hako_proto::cri::image_service_client::ImageServiceClient;
use hako_proto::cri::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

/// PullImage of `image` through `h`'s CRI socket; the image ref it answers.
pub async fn pull(h: &Hako, image: &str) -> Result<String, tonic::Status> {
    h.images()
        .await
        .pull_image(hako_proto::cri::PullImageRequest {
            image: Some(hako_proto::cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().image_ref)
}

pub struct Hako {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub root: PathBuf,
    pub state: PathBuf,
    pub certs_d: PathBuf,
    pub config: PathBuf,
    pub log: PathBuf,
    child: Option<Child>,
    /// Set in the daemon's environment, at every start.
    env: Vec<(String, String)>,
}

impl Hako {
    /// Starts hako with `extra` appended to its config file (TOML).
    pub fn start(extra: &str) -> Hako {
        Self::start_with_state(extra, "state")
    }

    /// As `start`, with the state dir at `state` under the temp dir (deep paths test socket
    /// path limits).
    pub fn start_with_state(extra: &str, state: &str) -> Hako {
        Self::start_with(extra, state, &[], |_| {})
    }

    /// As `start`, with `env` set in the daemon's environment.
    pub fn start_with_env(extra: &str, env: &[(&str, &str)]) -> Hako {
        Self::start_with(extra, "state", env, |_| {})
    }

    /// As `start`, with `prepare` run on the temp dir before the daemon starts (to mount a
    /// filesystem of the test's own at `<dir>/root`, say; `drop` unmounts what is under it).
    pub fn start_prepared(extra: &str, prepare: impl FnOnce(&std::path::Path)) -> Hako {
        Self::start_with(extra, "state", &[], prepare)
    }

    fn start_with(
        extra: &str,
        state: &str,
        env: &[(&str, &str)],
        prepare: impl FnOnce(&std::path::Path),
    ) -> Hako {
        let dir = tempfile::tempdir().unwrap();
        // Traversable, as /run is above hako's state dir on a node: the root of a container's
        // user namespace finds its bundle through it (the state dir keeps its own modes).
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )
        .unwrap();
        prepare(dir.path());
        let root = dir.path().join("root");
        let certs_d = dir.path().join("certs.d");
        std::fs::create_dir_all(&certs_d).unwrap();
        let socket = dir.path().join("hako.sock");
        let config = dir.path().join("config.toml");
        // Hermetic unless the test configures CNI itself: a loopback-only network of the
        // test's own (the node's /etc/cni/net.d is not the test's business).
        let cni = if extra.contains("[cni]") {
            String::new()
        } else {
            let conf_dir = dir.path().join("cni");
            std::fs::create_dir_all(&conf_dir).unwrap();
            std::fs::write(
                conf_dir.join("99-loopback.conflist"),
                r#"{"cniVersion": "1.0.0", "name": "loopback-only", "plugins": [{"type": "loopback"}]}"#,
            )
            .unwrap();
            let bins: Vec<String> = super::cni::PLUGIN_DIRS
                .iter()
                .map(|d| format!("\"{d}\""))
                .collect();
            format!(
                "[cni]\nconf_dir = \"{}\"\nbin_dirs = [{}]\n",
                conf_dir.display(),
                bins.join(", ")
            )
        };
        std::fs::write(
            &config,
            format!(
                "listen = \"{}\"\nroot = \"{}\"\nstate = \"{}\"\n{extra}\n{cni}[registry]\nconfig_path = \"{}\"\n",
                socket.display(),
                root.display(),
                dir.path().join(state).display(),
                certs_d.display()
            ),
        )
        .unwrap();
        let log = dir.path().join("hako.log");
        let state = dir.path().join(state);
        let mut h = Hako {
            dir,
            socket,
            root,
            state,
            certs_d,
            config,
            log,
            child: None,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        h.spawn();
        h
    }

    /// Starts `hako serve` as a service manager would: nothing is cleaned up first, so after a
    /// kill -9 the daemon itself must replace its stale socket.
    fn spawn(&mut self) {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(Self::binary())
            .args(["serve", "--config"])
            .arg(&self.config)
            .env("HAKO_LOG", "hako=debug,info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start hako");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("hako exited with {status}: {}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "hako did not listen: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let md = std::fs::symlink_metadata(&self.socket).unwrap();
        assert!(md.file_type().is_socket(), "{:?}", md.file_type());
        assert_eq!(
            md.permissions().mode() & 0o7777,
            0o660,
            "the CRI socket's mode"
        );
    }

    /// The hako under test: `$HAKO_BIN` when set (a copy, e.g. for runs in the cgroup v2 VM
    /// that must not see rebuilds), else the one cargo built.
    pub fn binary() -> PathBuf {
        std::env::var_os("HAKO_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_hako")))
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Writes `<certs.d>/<host>/hosts.toml`.
    pub fn hosts_toml(&self, host: &str, text: &str) {
        let d = self.certs_d.join(host);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("hosts.toml"), text).unwrap();
    }

    pub async fn channel(&self) -> Channel {
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
            .expect("connect to hako")
    }

    pub async fn images(&self) -> ImageServiceClient<Channel> {
        ImageServiceClient::new(self.channel().await)
    }

    pub async fn runtime(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel().await)
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            // What a crash leaves: the next start must replace this stale socket itself.
            assert!(
                self.socket.exists(),
                "a killed daemon leaves its socket file"
            );
        }
    }

    /// SIGTERM and wait for exit.
    pub fn stop(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                panic!("hako did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop or kill first");
        self.spawn();
    }

    /// Files under `dir`, relative.
    pub fn files_under(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(p) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&p) {
                for e in rd.flatten() {
                    let path = e.path();
                    out.push(path.strip_prefix(dir).unwrap().display().to_string());
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(path);
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// Waits up to 30 s for `dirs` (under the root) to hold nothing, and returns either way:
    /// the caller asserts, naming what is left. A failed pull answers at its first failed
    /// layer; its layers still running are removed once they end.
    pub async fn settle_store(&self, dirs: &[&str]) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::time::Instant::now() < deadline
            && dirs
                .iter()
                .any(|d| !Self::files_under(&self.root.join(d)).is_empty())
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Hako {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.stop();
        }
        // A failed test can leave its pods running: end their processes and mounts so they do
        // not outlive the run (passing tests have asserted there are none).
        let dir = self.dir.path().display().to_string();
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            if std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&dir))
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for m in mounts.lines().rev() {
            if let Some(point) = m.split(' ').nth(4).filter(|p| p.starts_with(&dir)) {
                let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "--- hako log ({}) ---\n{}",
                self.log.display(),
                self.log_text()
            );
        }
    }
}
