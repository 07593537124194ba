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
//! mod.rs        `Runtime`, record lookups, name and object locks, the undo stack,
//!               `apply_state`
//! host.rs       cgroups (kill, remove), oom floor, processes, directories
//! ```
//! `types.rs` (records and requests), `rootfs.rs` (overlay, accounts) and
//! `monitor_client.rs` (spawning and calling monitors) sit beside them; none of them
//! knows `Runtime`.

mod container;
mod host;
mod live;
mod monitor_client;
mod recovery;
pub mod rootfs;
mod sandbox;
pub mod spec;
mod stats;
mod streams;
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
pub use recovery::UnfinishedCreates;
pub use stats::{NetCounters, PodStats, Usage, MAX_INTERFACES};
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

/// Async locks by key (a name, a pod or container id), made on first use and dropped from the
/// map as soon as no one holds or waits for them, so the map holds only keys in use.
///
/// The map is a `std` mutex (held for a lookup, never across `.await`); the locks are tokio
/// `RwLock`s because their holders await monitor calls. Every clone of a lock's `Arc` is made
/// and dropped under the map's mutex, so a count of one means only the map still has it.
#[derive(Default)]
pub(crate) struct Locks(LockMap);

type LockMap = Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::RwLock<()>>>>>;

enum Held {
    Shared(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>),
    Exclusive(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>),
}

/// One key of [`Locks`], held (or still awaited: a waiter dropped by a cancel also removes
/// its interest).
pub(crate) struct KeyGuard {
    map: LockMap,
    key: String,
    lock: Option<Arc<tokio::sync::RwLock<()>>>,
    held: Option<Held>,
}

impl Locks {
    /// The only holder of `key` (a change of the object).
    pub(crate) async fn exclusive(&self, key: &str) -> KeyGuard {
        let mut g = self.interest(key);
        let lock = g.lock.clone().expect("interest has its lock");
        g.held = Some(Held::Exclusive(lock.write_owned().await));
        g
    }

    /// One of the holders of `key` (a change inside the object: a container in its pod).
    pub(crate) async fn shared(&self, key: &str) -> KeyGuard {
        let mut g = self.interest(key);
        let lock = g.lock.clone().expect("interest has its lock");
        g.held = Some(Held::Shared(lock.read_owned().await));
        g
    }

    /// `key` held exclusively when nobody holds or awaits it now; `None` otherwise.
    pub(crate) fn try_exclusive(&self, key: &str) -> Option<KeyGuard> {
        let mut g = self.interest(key);
        let lock = g.lock.clone().expect("interest has its lock");
        // On failure the clone is consumed, so `g` going drops the map entry when unheld.
        let w = lock.try_write_owned().ok()?;
        g.held = Some(Held::Exclusive(w));
        Some(g)
    }

    fn interest(&self, key: &str) -> KeyGuard {
        let mut map = self.0.lock().expect("locks poisoned");
        let lock = map.entry(key.to_string()).or_default().clone();
        KeyGuard {
            map: self.0.clone(),
            key: key.to_string(),
            lock: Some(lock),
            held: None,
        }
    }

    /// Keys in the map (held or awaited).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().expect("locks poisoned").len()
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        let mut map = self.map.lock().expect("locks poisoned");
        // The guard and the clone `write_owned`/`read_owned` took go before the count is read.
        self.held = None;
        self.lock = None;
        if map
            .get(&self.key)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            map.remove(&self.key);
        }
    }
}

pub struct Runtime {
    store: Arc<Store>,
    images: Images,
    state_dir: PathBuf,
    root_dir: PathBuf,
    monitors: std::sync::Mutex<HashMap<String, MonitorClient>>,
    /// What the Ready pods' monitors last reported (live.rs): lists and statuses read it.
    live: Arc<live::Live>,
    /// Pods whose monitor stopped listening, as watchers find them (taken once by the daemon,
    /// see [`Runtime::lost_monitors`]).
    lost: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<String>>>,
    /// One create per pod or container name at a time: a retry waits for the first attempt.
    name_locks: Locks,
    /// Changes of one pod or container, by id, one at a time: a pod's stop and removal hold
    /// it exclusively, changes of its containers share it and hold their container's. Order:
    /// name, then pod, then container.
    object_locks: Locks,
    /// The daemon's bounding set: what containers can be granted (no more than we hold).
    cap_limit: Vec<String>,
    /// The lowest oom_score_adj a container may get, when restricted (the daemon's own).
    oom_floor: Option<i32>,
    /// Containers' writable layers are mounted `volatile` (see `rootfs::mount_overlay`):
    /// configured, and cleared by a kernel that refuses the option.
    volatile_layers: std::sync::atomic::AtomicBool,
    /// Last CPU reading per container and pod, for usage rates (pruned at each stats list).
    cpu_samples: stats::CpuSamples,
    /// New pods keep the kernel's cgroup-migration lock warm until their first container is
    /// created (at most 1 s): kubelet creates containers right after RunPodSandbox.
    warm_pods: Arc<std::sync::Mutex<HashMap<String, hako_runtime::cgroup_warm::Hold>>>,
    network: Arc<Network>,
    cdi: Arc<hako_runtime::cdi::Registry>,
    /// Why pods cannot have a user namespace of their own here, if they cannot (tried once at
    /// start: `rootfs::userns_probe`).
    userns_missing: Option<String>,
    /// The node's cgroups are cgroup v2 (unified): read once at start, not at every create.
    cgroup2: bool,
}

/// What the CRI layer shows of a pod: its record, and NotReady while its monitor does not
/// answer (the record keeps Ready: the pod is Ready again once it answers).
#[derive(Debug, Clone)]
pub struct PodView {
    /// Shared with the store's cache: lists copy no record.
    pub record: Arc<PodRecord>,
    pub state: PodState,
    /// Why its monitor did not answer this time (silent, or found gone): why it is NotReady.
    pub unanswered: Option<String>,
}

/// What the CRI layer shows of a container.
#[derive(Debug, Clone)]
pub struct ContainerView {
    pub record: Arc<ContainerRecord>,
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
        config: &crate::config::RuntimeConfig,
        network: Arc<Network>,
        cdi: Arc<hako_runtime::cdi::Registry>,
    ) -> Runtime {
        let cap_limit = hako_runtime::spec::own_bounding_set();
        let (live, lost) = live::Live::new();
        let userns_missing = rootfs::userns_probe(&root_dir.join("containers")).err();
        match &userns_missing {
            None => tracing::info!("pods may have user namespaces of their own"),
            Some(why) => tracing::warn!(why, "pods cannot have user namespaces of their own here"),
        }
        Runtime {
            userns_missing,
            cgroup2: nix::sys::statfs::statfs("/sys/fs/cgroup")
                .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC),
            oom_floor: host::oom_floor(config.restrict_oom_score_adj, &cap_limit),
            volatile_layers: std::sync::atomic::AtomicBool::new(!config.sync_writable_layers),
            store,
            images,
            state_dir: state_dir.to_path_buf(),
            root_dir: root_dir.to_path_buf(),
            monitors: std::sync::Mutex::new(HashMap::new()),
            live: Arc::new(live),
            lost: std::sync::Mutex::new(Some(lost)),
            name_locks: Locks::default(),
            object_locks: Locks::default(),
            cap_limit,
            cpu_samples: Default::default(),
            warm_pods: Default::default(),
            network,
            cdi,
        }
    }

    /// Whether pods may have a user namespace of their own here (the runtime handler's
    /// `user_namespaces`).
    pub fn userns_supported(&self) -> bool {
        self.userns_missing.is_none()
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
        rootfs::unmount_bundle(&bundle)?;
        for d in [bundle, self.layer_dir(id)] {
            if let Err(e) = std::fs::remove_dir_all(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    return Err(Error::io("remove", &d, e));
                }
            }
        }
        Ok(())
    }

    /// Reserves `key` for `id`, with its release registered as the first undo step. Callers
    /// hold the name's lock and found it free; one held all the same is not taken.
    fn reserve(&self, key: &str, id: &str, undo: &mut Undo) -> Result<()> {
        if let Some(other) = self.store.reserve(key, id)? {
            return Err(Error::AlreadyExists(format!(
                "name {key} is reserved by {other}"
            )));
        }
        let (store, key, id) = (self.store.clone(), key.to_string(), id.to_string());
        undo.push(move || {
            let _ = store.release(&key, &id);
        });
        Ok(())
    }

    async fn name_lock(&self, name: &str) -> KeyGuard {
        self.name_locks.exclusive(name).await
    }

    /// The pod is NotReady from now on: its monitor client is forgotten and its record, while
    /// it exists, says so (a removal racing this stays a removal).
    fn mark_not_ready(&self, pod_id: &str) -> Result<()> {
        self.monitors
            .lock()
            .expect("monitors poisoned")
            .remove(pod_id);
        self.live.forget(pod_id);
        self.store
            .update(Table::Pods, pod_id, |p: &mut PodRecord| {
                let changed = p.state != PodState::NotReady;
                p.state = PodState::NotReady;
                changed
            })?;
        Ok(())
    }

    fn monitor(&self, pod: &PodRecord) -> MonitorClient {
        let mut m = self.monitors.lock().expect("monitors poisoned");
        m.entry(pod.id.clone())
            .or_insert_with(|| MonitorClient::new(self.pod_dir(&pod.id).join("monitor.sock")))
            .clone()
    }

    /// Follows a Ready pod's monitor from now on (see live.rs).
    fn watch(&self, pod: &PodRecord) {
        live::watch(&self.live, &self.store, pod, self.monitor(pod));
    }

    /// A record by full id, or by a unique prefix of it, as crictl allows.
    fn lookup<T: crate::store::Record>(
        &self,
        table: Table,
        id: &str,
        what: &str,
        id_of: fn(&T) -> &str,
    ) -> Result<T> {
        if let Some(r) = self.store.get::<T>(table, id)? {
            return Ok(r);
        }
        let mut matches: Vec<Arc<T>> = self
            .store
            .all_shared::<T>(table)?
            .into_iter()
            .filter(|r| !id.is_empty() && id_of(r).starts_with(id))
            .collect();
        match matches.len() {
            1 => Ok(T::clone(&matches.pop().expect("one"))),
            0 => Err(Error::NotFound(format!("{what} {id} not found"))),
            _ => Err(Error::InvalidArgument(format!(
                "{what} id prefix {id} is ambiguous"
            ))),
        }
    }

    pub fn pod(&self, id: &str) -> Result<PodRecord> {
        self.lookup(Table::Pods, id, "pod sandbox", |p: &PodRecord| &p.id)
    }

    pub fn pods(&self) -> Result<Vec<Arc<PodRecord>>> {
        self.store.all_shared(Table::Pods)
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
///
/// States only move forward: an answer read before a change that was written meanwhile (a
/// status call racing a stop) is stale, and must not turn an exited container back into a
/// running one, nor a running one into a created one.
fn apply_state(c: &mut ContainerRecord, s: &pb::ContainerState) -> bool {
    match next_state(c, s) {
        Some((state, started_at, exit)) => {
            c.state = state;
            c.started_at = started_at;
            c.exit = exit;
            true
        }
        None => false,
    }
}

/// Whether [`apply_state`] would change `c`.
fn state_changes(c: &ContainerRecord, s: &pb::ContainerState) -> bool {
    next_state(c, s).is_some()
}

/// What [`apply_state`] makes of `c`'s state, start and exit; `None` when they stay.
fn next_state(
    c: &ContainerRecord,
    s: &pb::ContainerState,
) -> Option<(ContainerState, i64, Option<ExitInfo>)> {
    let state = match pb::Status::try_from(s.status).unwrap_or(pb::Status::Unknown) {
        pb::Status::Created => ContainerState::Created,
        pb::Status::Running => ContainerState::Running,
        pb::Status::Exited => ContainerState::Exited,
        pb::Status::Unknown => ContainerState::Unknown,
    };
    let stale = match c.state {
        // Exited again may carry the monitor's own record of an exit the daemon had to assume.
        ContainerState::Exited => state != ContainerState::Exited,
        ContainerState::Running => state == ContainerState::Created,
        _ => false,
    };
    if stale {
        return None;
    }
    let started_at = if s.started_at != 0 {
        s.started_at
    } else {
        c.started_at
    };
    let exit = if state == ContainerState::Exited {
        Some(ExitInfo {
            code: s.exit_code,
            signal: s.signal,
            finished_at: s.finished_at,
            oom_killed: s.oom_killed,
        })
    } else {
        c.exit.clone()
    };
    let changed = state != c.state || started_at != c.started_at || exit != c.exit;
    changed.then_some((state, started_at, exit))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Holders exclude each other, and the map keeps only keys someone holds or awaits: a
    /// released lock and a waiter given up on (a cancelled call) leave nothing behind.
    #[tokio::test]
    async fn locks_exclude_and_are_dropped_when_unused() {
        use futures::FutureExt;
        let locks = Locks::default();
        let a = locks.exclusive("pod-a").await;
        let shared1 = locks.shared("pod-b").await;
        let shared2 = locks.shared("pod-b").await;
        assert_eq!(locks.len(), 2);
        // A second holder waits (polled once, it is pending); given up on, as a cancelled
        // call's is, its interest goes.
        assert!(
            locks.exclusive("pod-a").now_or_never().is_none(),
            "pod-a is held"
        );
        assert!(
            locks.exclusive("pod-b").now_or_never().is_none(),
            "pod-b is shared, not free"
        );
        assert_eq!(locks.len(), 2);
        // try_exclusive never waits: it fails while anyone holds the key, and leaves no
        // interest behind when it does.
        assert!(locks.try_exclusive("pod-a").is_none());
        assert!(locks.try_exclusive("pod-b").is_none());
        assert_eq!(locks.len(), 2);
        let free = locks.try_exclusive("pod-c").expect("pod-c is free");
        assert!(locks.try_exclusive("pod-c").is_none(), "pod-c is held now");
        drop(free);
        assert_eq!(locks.len(), 2);
        drop((shared1, shared2));
        assert_eq!(locks.len(), 1);
        let mut again = Box::pin(locks.exclusive("pod-a"));
        assert!((&mut again).now_or_never().is_none());
        drop(a);
        assert_eq!(locks.len(), 1, "the waiter keeps pod-a");
        let again = again.await;
        drop(again);
        assert_eq!(locks.len(), 0);
        // Many keys used and released: none kept.
        for i in 0..100 {
            let _g = locks.exclusive(&format!("name-{i}")).await;
        }
        assert_eq!(locks.len(), 0);
    }

    fn record(state: ContainerState) -> ContainerRecord {
        ContainerRecord {
            v: 1,
            id: "c".into(),
            pod_id: "p".into(),
            spec: Default::default(),
            image_id: String::new(),
            image_ref: String::new(),
            created_at: 0,
            log_path: String::new(),
            state,
            started_at: 5,
            exit: (state == ContainerState::Exited).then(|| ExitInfo {
                code: 137,
                ..Default::default()
            }),
            chain_ids: vec![],
            cgroups_path: String::new(),
            stop_signal: None,
            user: None,
            start_error: None,
        }
    }

    /// A monitor answer read before a stop was written is stale: states only move forward.
    #[test]
    fn a_stale_state_never_moves_a_record_back() {
        let said = |status: pb::Status, code: i32| pb::ContainerState {
            status: status as i32,
            started_at: 5,
            exit_code: code,
            ..Default::default()
        };
        let mut c = record(ContainerState::Exited);
        assert!(!apply_state(&mut c, &said(pb::Status::Running, 0)));
        assert_eq!(c.state, ContainerState::Exited);
        // The monitor's own record of the exit replaces one the daemon assumed.
        assert!(apply_state(&mut c, &said(pb::Status::Exited, 3)));
        assert_eq!(c.exit.as_ref().map(|e| e.code), Some(3));
        let mut c = record(ContainerState::Running);
        assert!(!apply_state(&mut c, &said(pb::Status::Created, 0)));
        assert_eq!(c.state, ContainerState::Running);
        assert!(apply_state(&mut c, &said(pb::Status::Exited, 0)));
        let mut c = record(ContainerState::Created);
        assert!(apply_state(&mut c, &said(pb::Status::Running, 0)));
        assert_eq!(c.state, ContainerState::Running);
    }
}
