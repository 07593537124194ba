//! Pods and containers: the daemon's side of the runtime.
//!
//! Each pod has a monitor process (`hako monitor`, see `hako_runtime::monitor`) that holds its
//! namespaces and every process of it. The daemon keeps the records (store tables `pods`,
//! `containers`, name `reservations`, layer `pins`), prepares container bundles (overlay rootfs
//! plus `config.json`) and asks the monitor to create, start, signal, wait for and delete
//! containers. The daemon never forks container processes.
//!
//! Pod states: Ready → NotReady (stopped: monitor shut down, namespaces released) → removed.
//! Container states: Created → Running → Exited → removed; Unknown when its monitor is gone
//! without having recorded an exit.
//!
//! The rooms, each using only those below it:
//!
//! ```text
//! stats.rs      the stats RPCs: cgroup usage and CPU rates, the bounded writable-layer walk
//! sandbox.rs    RunPodSandbox, StopPodSandbox, RemovePodSandbox, pod status and list,
//!               pod files
//! container.rs  Create/Start/Stop/Update/RemoveContainer, status, list (one concurrent
//!               round of monitor reads), ExecSync, ReopenContainerLog; gathers what the
//!               spec needs (I/O)
//! recovery.rs   reconcile at start, orphans of unfinished creates, network GC, and a
//!               monitor found gone (also by the relist in container.rs, hence below it)
//! spec.rs       the container spec: a pure function of request, image config, pod and
//!               the inputs container.rs gathered; cgroup paths, signals, log paths
//! mod.rs        `Runtime`, record lookups, name locks, the undo stack, `apply_state`
//! host.rs       cgroups (kill, remove), oom floor, processes, directories
//! ```
//! `types.rs` (records and requests), `rootfs.rs` (overlay, accounts) and
//! `monitor_client.rs` (spawning and calling monitors) sit beside them; none of them
//! knows `Runtime`.

mod container;
mod host;
mod monitor_client;
mod recovery;
pub mod rootfs;
mod sandbox;
pub mod spec;
mod stats;
pub mod types;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hako_proto::monitor as pb;

use crate::error::{Error, Result};
use crate::image::Images;
use crate::network::Network;
use crate::store::{Store, Table};
use monitor_client::MonitorClient;
pub use stats::{PodStats, Usage};
pub use types::*;

/// A fresh 64-hex-digit id, as containerd's.
fn new_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("read /dev/urandom");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Undo steps registered as a create goes; run in reverse unless the create succeeds.
#[derive(Default)]
struct Undo(Vec<Box<dyn FnOnce() + Send>>);

impl Undo {
    fn push(&mut self, f: impl FnOnce() + Send + 'static) {
        self.0.push(Box::new(f));
    }
    fn commit(mut self) {
        self.0.clear();
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        while let Some(f) = self.0.pop() {
            f();
        }
    }
}

pub struct Runtime {
    store: Arc<Store>,
    images: Images,
    state_dir: PathBuf,
    root_dir: PathBuf,
    monitors: std::sync::Mutex<HashMap<String, MonitorClient>>,
    /// One create per pod or container name at a time: a retry waits for the first attempt.
    name_locks: tokio::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The daemon's bounding set: what containers can be granted (no more than we hold).
    cap_limit: Vec<String>,
    /// The lowest oom_score_adj a container may get, when restricted (the daemon's own).
    oom_floor: Option<i32>,
    /// Last CPU reading per container and pod, for usage rates (pruned at each stats list).
    cpu_samples: stats::CpuSamples,
    /// New pods keep the kernel's cgroup-migration lock warm until their first container is
    /// created (at most 1 s): kubelet creates containers right after RunPodSandbox.
    warm_pods: Arc<std::sync::Mutex<HashMap<String, hako_runtime::cgroup_warm::Hold>>>,
    network: Arc<Network>,
    cdi: Arc<hako_runtime::cdi::Registry>,
}

/// What the CRI layer shows of a pod: its record, and NotReady while its monitor does not
/// answer (the record keeps Ready: the pod is Ready again once it answers).
#[derive(Debug, Clone)]
pub struct PodView {
    pub record: PodRecord,
    pub state: PodState,
    /// Why its monitor did not answer this time (silent, or found gone): why it is NotReady.
    pub unanswered: Option<String>,
}

/// What the CRI layer shows of a container.
#[derive(Debug, Clone)]
pub struct ContainerView {
    pub record: ContainerRecord,
    pub state: ContainerState,
    pub started_at: i64,
    pub exit: Option<ExitInfo>,
    /// The init process, while it runs (0 otherwise or when not asked for).
    pub pid: u32,
}

#[derive(Debug, Clone)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub exit_code: i32,
}

impl Runtime {
    pub fn new(
        store: Arc<Store>,
        images: Images,
        state_dir: &Path,
        root_dir: &Path,
        restrict_oom_score_adj: bool,
        network: Arc<Network>,
        cdi: Arc<hako_runtime::cdi::Registry>,
    ) -> Runtime {
        let cap_limit = hako_runtime::spec::own_bounding_set();
        Runtime {
            oom_floor: host::oom_floor(restrict_oom_score_adj, &cap_limit),
            store,
            images,
            state_dir: state_dir.to_path_buf(),
            root_dir: root_dir.to_path_buf(),
            monitors: std::sync::Mutex::new(HashMap::new()),
            name_locks: tokio::sync::Mutex::new(HashMap::new()),
            cap_limit,
            cpu_samples: Default::default(),
            warm_pods: Default::default(),
            network,
            cdi,
        }
    }

    fn pod_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("pods").join(id)
    }

    fn bundle_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("containers").join(id)
    }

    fn layer_dir(&self, id: &str) -> PathBuf {
        self.root_dir.join("containers").join(id)
    }

    /// Unmounts a container's rootfs and removes its bundle and writable layer.
    fn remove_container_files(&self, id: &str) -> Result<()> {
        let bundle = self.bundle_dir(id);
        rootfs::unmount(&bundle.join("rootfs"))?;
        for d in [bundle, self.layer_dir(id)] {
            if let Err(e) = std::fs::remove_dir_all(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    return Err(Error::io("remove", &d, e));
                }
            }
        }
        Ok(())
    }

    /// Reserves `key` for `id`, with its release registered as the first undo step.
    fn reserve(&self, key: &str, id: &str, undo: &mut Undo) -> Result<()> {
        self.store.reserve(key, id)?;
        let (store, key) = (self.store.clone(), key.to_string());
        undo.push(move || {
            let _ = store.release(&key);
        });
        Ok(())
    }

    async fn name_lock(&self, name: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self
            .name_locks
            .lock()
            .await
            .entry(name.to_string())
            .or_default()
            .clone();
        lock.lock_owned().await
    }

    fn monitor(&self, pod: &PodRecord) -> MonitorClient {
        let mut m = self.monitors.lock().expect("monitors poisoned");
        m.entry(pod.id.clone())
            .or_insert_with(|| MonitorClient::new(self.pod_dir(&pod.id).join("monitor.sock")))
            .clone()
    }

    /// A record by full id, or by a unique prefix of it, as crictl allows.
    fn lookup<T: serde::de::DeserializeOwned>(
        &self,
        table: Table,
        id: &str,
        what: &str,
        id_of: fn(&T) -> &str,
    ) -> Result<T> {
        if let Some(r) = self.store.get::<T>(table, id)? {
            return Ok(r);
        }
        let mut matches: Vec<T> = self
            .store
            .all::<T>(table)?
            .into_iter()
            .filter(|r| !id.is_empty() && id_of(r).starts_with(id))
            .collect();
        match matches.len() {
            1 => Ok(matches.pop().expect("one")),
            0 => Err(Error::NotFound(format!("{what} {id} not found"))),
            _ => Err(Error::InvalidArgument(format!(
                "{what} id prefix {id} is ambiguous"
            ))),
        }
    }

    pub fn pod(&self, id: &str) -> Result<PodRecord> {
        self.lookup(Table::Pods, id, "pod sandbox", |p: &PodRecord| &p.id)
    }

    pub fn pods(&self) -> Result<Vec<PodRecord>> {
        self.store.all(Table::Pods)
    }

    pub fn container_record(&self, id: &str) -> Result<ContainerRecord> {
        self.lookup(Table::Containers, id, "container", |c: &ContainerRecord| {
            &c.id
        })
    }

    fn containers_of(&self, pod_id: &str) -> Result<Vec<ContainerRecord>> {
        Ok(self
            .store
            .all::<ContainerRecord>(Table::Containers)?
            .into_iter()
            .filter(|c| c.pod_id == pod_id)
            .collect())
    }

    fn pod_of(&self, c: &ContainerRecord) -> Result<PodRecord> {
        self.pod(&c.pod_id)
            .map_err(|e| e.context(format!("container {}", c.id)))
    }
}

/// Folds a monitor state into a record; true when something changed.
fn apply_state(c: &mut ContainerRecord, s: &pb::ContainerState) -> bool {
    let before = (c.state, c.started_at, c.exit.clone());
    c.state = match pb::Status::try_from(s.status).unwrap_or(pb::Status::Unknown) {
        pb::Status::Created => ContainerState::Created,
        pb::Status::Running => ContainerState::Running,
        pb::Status::Exited => ContainerState::Exited,
        pb::Status::Unknown => ContainerState::Unknown,
    };
    if s.started_at != 0 {
        c.started_at = s.started_at;
    }
    if c.state == ContainerState::Exited {
        c.exit = Some(ExitInfo {
            code: s.exit_code,
            signal: s.signal,
            finished_at: s.finished_at,
            oom_killed: s.oom_killed,
        });
    }
    before != (c.state, c.started_at, c.exit.clone())
}
