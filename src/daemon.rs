//! `hako serve`: opens the store, binds the CRI socket, serves (`server::run`) until
//! SIGTERM/SIGINT.
//!
//! Shutdown: stop accepting, let in-flight calls finish (bounded by `server::SHUTDOWN_GRACE`),
//! drop the store (redb flushes on drop), remove the socket, exit 0.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use tokio::net::UnixListener;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::image::Images;
use crate::store::Store;

/// How long a graceful stop waits for the background syncs of pulled layers, after the
/// server's grace for in-flight calls (which the syncs overlap): the two stay under the
/// unit's `TimeoutStopSec` (45 s).
const FLUSH_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Everything the CRI handlers reach.
pub struct Daemon {
    pub config: Config,
    pub images: Images,
    pub runtime: crate::pods::Runtime,
    pub network: Arc<crate::network::Network>,
    pub cdi: Arc<hako_runtime::cdi::Registry>,
    /// The exec/attach/port-forward server, once `serve` started it.
    pub streaming: std::sync::OnceLock<crate::streaming::Streaming>,
}

/// One `Status` condition.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub ready: bool,
    pub reason: String,
    pub message: String,
}

pub struct Health {
    pub runtime: Condition,
    pub network: Condition,
}

impl Daemon {
    /// Opens (or creates) the state under `config.root` and reconciles it; from then on a pod
    /// whose monitor stops listening is released as soon as its watcher notices.
    pub async fn open(config: Config) -> Result<Arc<Daemon>> {
        // The root holds the store, images and containers' layers: owner only. The state dir
        // stays traversable so a group given the socket (0660) can reach it; what is below it
        // is owner only.
        for (dir, mode) in [(&config.root, 0o700), (&config.state, 0o711)] {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("change mode of", dir, e))?;
        }
        // The layout exists from the start (not when first used), owner-only whatever the
        // umask; an existing install gets its modes fixed here too.
        // Containers' bundles are reached through one that others may only traverse: a
        // container in a user namespace is set up by its root, which is not the host's, on
        // the way to its own bundle (owned by it, every other bundle owner only).
        for (dir, mode) in [
            (config.state.join("pods"), 0o700),
            (config.state.join("containers"), 0o711),
            (config.root.join("containers"), 0o700),
            (config.root.join("cni"), 0o700),
            (config.root.join("cni/results"), 0o700),
        ] {
            std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("change mode of", &dir, e))?;
        }
        // Bundles of earlier builds were made with the umask's mode: owner only now.
        for e in std::fs::read_dir(config.state.join("containers"))
            .into_iter()
            .flatten()
            .flatten()
        {
            use std::os::unix::fs::MetadataExt;
            if e.metadata()
                .is_ok_and(|m| m.is_dir() && m.uid() == 0 && m.mode() & 0o077 != 0)
            {
                let _ = std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o700));
            }
        }
        let store = Arc::new(Store::open(&config.root.join("meta.db"))?);
        // Before the image GC: running pods' records (and their layers' pins) come back
        // from their monitors when the store lost them.
        crate::pods::Runtime::adopt_lost_records(&store, &config.state).await?;
        let images = Images::open(
            &config.root,
            store.clone(),
            config.registry.config_path.clone(),
            config.image.clone(),
        )
        .await?;
        let network = Arc::new(crate::network::Network::new(&config.cni, &config.root));
        // Reading the specs now logs broken ones at start, not at the first container.
        let cdi = Arc::new(hako_runtime::cdi::Registry::new(
            config.cdi.spec_dirs.clone(),
        ));
        let _ = cdi.report();
        let runtime = crate::pods::Runtime::new(
            store,
            images.clone(),
            &config.state,
            &config.root,
            &config.runtime,
            network.clone(),
            cdi.clone(),
        );
        let unfinished = runtime.reconcile().await?;
        let lost = runtime.lost_monitors();
        let daemon = Arc::new(Daemon {
            config,
            images,
            runtime,
            network,
            cdi,
            streaming: std::sync::OnceLock::new(),
        });
        if !unfinished.is_empty() {
            tokio::spawn(release_unfinished_creates(
                Arc::downgrade(&daemon),
                unfinished,
            ));
        }
        if let Some(lost) = lost {
            tokio::spawn(release_lost_monitors(Arc::downgrade(&daemon), lost));
        }
        Ok(daemon)
    }

    /// What `Status` reports: pods run (RuntimeReady); NetworkReady is whether a CNI
    /// configuration is there with its plugins (and, for CNI 1.1, their STATUS), with the
    /// cause when not.
    pub async fn health(&self) -> Health {
        let network = match self.network.cni.ready().await {
            Ok(()) => Condition {
                ready: true,
                reason: String::new(),
                message: String::new(),
            },
            Err(e) => Condition {
                ready: false,
                reason: "NetworkPluginNotReady".into(),
                message: crate::error::chain(&e),
            },
        };
        Health {
            runtime: Condition {
                ready: true,
                reason: String::new(),
                message: String::new(),
            },
            network,
        }
    }

    pub fn config_json(&self) -> String {
        serde_json::to_string(&self.config).unwrap_or_default()
    }

    pub fn set_pod_cidr(&self, cidr: String) -> Result<()> {
        self.network.set_pod_cidr(cidr)
    }

    /// Starts the streaming server on `[streaming]` with `backend`.
    pub async fn start_streaming(&self, backend: Arc<dyn crate::streaming::Backend>) -> Result<()> {
        let s = crate::streaming::Streaming::start(&self.config.streaming, backend).await?;
        self.streaming
            .set(s)
            .map_err(|_| Error::Internal("streaming server started twice".into()))
    }

    pub fn streaming(&self) -> Result<&crate::streaming::Streaming> {
        self.streaming
            .get()
            .ok_or_else(|| Error::Unavailable("the streaming server is not running".into()))
    }
}

/// Binds the CRI socket with mode 0660. A stale socket file (nobody answering) is replaced; a
/// live one means another daemon serves there, which is an error.
pub fn bind(path: &Path) -> Result<UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("create directory", parent, e))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(Error::FailedPrecondition(format!(
                "another process is serving on {}",
                path.display()
            )));
        }
        std::fs::remove_file(path).map_err(|e| Error::io("remove stale socket", path, e))?;
    }
    // Bound under a temporary name and given its mode before it appears under the real one:
    // whatever the umask, nobody can connect to the socket while it is wider than 0660.
    let tmp = path.with_file_name(format!(
        ".{}.{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| Error::io("bind", &tmp, e))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| Error::io("change mode of", &tmp, e))
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|e| Error::io("rename socket to", path, e))
        });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(listener)
}

/// Installs the SIGTERM and SIGINT handlers now, so a signal that arrives as soon as readiness
/// is announced is not lost to the default action; the future resolves on the first of them.
pub fn signalled() -> Result<impl Future<Output = ()> + Send + 'static> {
    use tokio::signal::unix::{signal, SignalKind};
    let install = |k: SignalKind, name: &str| {
        signal(k).map_err(|e| Error::Internal(format!("install {name} handler: {e}")))
    };
    let mut term = install(SignalKind::terminate(), "SIGTERM")?;
    let mut int = install(SignalKind::interrupt(), "SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    })
}

/// Releases each pod whose watcher found its monitor no longer listening; ends with the
/// daemon (its weak handle does not keep the daemon alive).
async fn release_lost_monitors(
    daemon: std::sync::Weak<Daemon>,
    mut lost: tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    while let Some(pod) = lost.recv().await {
        let Some(d) = daemon.upgrade() else {
            return;
        };
        if let Err(e) = d.runtime.release_lost_monitor(&pod).await {
            tracing::error!(pod = %pod, error = %crate::error::chain(&e), "releasing a pod whose monitor is gone");
        }
    }
}

/// Asks after the creates an earlier daemon left under way, releasing the files of those that
/// ended, until none is left (or the daemon is gone): after 2 s, then less and less often (a
/// hook without a timeout may run for ever), every 30 s at the least.
async fn release_unfinished_creates(
    daemon: std::sync::Weak<Daemon>,
    mut pending: crate::pods::UnfinishedCreates,
) {
    let mut wait = std::time::Duration::from_secs(2);
    while !pending.is_empty() {
        tokio::time::sleep(wait).await;
        wait = (wait * 3 / 2).min(std::time::Duration::from_secs(30));
        let Some(d) = daemon.upgrade() else {
            return;
        };
        pending = d.runtime.release_finished_creates(pending).await;
    }
}

/// `hako serve`.
pub async fn serve(config: Config) -> Result<()> {
    let listen = config.listen.clone();
    let signal = signalled()?;
    let daemon = Daemon::open(config).await?;
    // Queued layer syncs start at the signal, beside the in-flight calls' grace.
    let images = daemon.images.clone();
    let shutdown = async move {
        signal.await;
        images.stop_waiting_for_syncs();
    };
    // The server reaches the pods through a weak handle: the daemon holds the server, and a
    // strong one would keep the daemon (and its store) alive past shutdown.
    daemon
        .start_streaming(Arc::new(PodStreams(Arc::downgrade(&daemon))))
        .await?;
    let listener = bind(&listen)?;
    tracing::info!(socket = %listen.display(), version = env!("CARGO_PKG_VERSION"), "hako serving CRI");
    crate::notify::ready();
    let result = crate::server::run(listener, daemon.clone(), shutdown).await;
    crate::notify::stopping();
    // Layers recorded before their sync: synced now, or the next boot drops them (and their
    // images) for nothing after a clean reboot.
    if !daemon.images.flush_syncs(FLUSH_GRACE).await {
        tracing::warn!(
            "layers still syncing at shutdown; a start in the next boot drops those not synced"
        );
    }
    let _ = std::fs::remove_file(&listen);
    drop(daemon);
    tracing::info!("stopped");
    result
}

/// The streaming server's way to the daemon's pods (see `serve`).
struct PodStreams(std::sync::Weak<Daemon>);

impl PodStreams {
    fn daemon(&self) -> Result<Arc<Daemon>> {
        self.0
            .upgrade()
            .ok_or_else(|| Error::Unavailable("the daemon is shutting down".into()))
    }
}

#[tonic::async_trait]
impl crate::streaming::Backend for PodStreams {
    async fn exec(&self, req: crate::streaming::ExecRequest) -> Result<crate::streaming::Session> {
        crate::streaming::Backend::exec(&*self.daemon()?, req).await
    }

    async fn attach(
        &self,
        req: crate::streaming::AttachRequest,
    ) -> Result<crate::streaming::Session> {
        crate::streaming::Backend::attach(&*self.daemon()?, req).await
    }

    async fn port_forward(&self, pod_sandbox_id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        crate::streaming::Backend::port_forward(&*self.daemon()?, pod_sandbox_id, port).await
    }
}

/// Gives the allocator's free pages back to the kernel a moment from now, once: after a list
/// whose answer is built and encoded whole (ListPodSandboxMetrics: some 60 series of six or
/// seven strings per pod, several MiB at a few hundred pods). glibc keeps what such a burst
/// freed in its arenas, among the long-lived allocations it cannot release around, so the
/// daemon's RSS stayed that much higher until the next burst (20.8 against 28.6 MiB at 250
/// idle pods, docs/BENCHMARKS.md). The delay lets tonic encode and drop the answer first;
/// calls that come while one is pending share it.
pub fn trim_memory_soon() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static PENDING: AtomicBool = AtomicBool::new(false);
    if PENDING.swap(true, Ordering::AcqRel) {
        return;
    }
    tokio::spawn(async {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        PENDING.store(false, Ordering::Release);
        let _ = tokio::task::spawn_blocking(|| {
            #[cfg(target_env = "gnu")]
            // SAFETY: malloc_trim only returns free memory of the allocator's own to the kernel.
            unsafe {
                libc::malloc_trim(0);
            }
        })
        .await;
    });
}
