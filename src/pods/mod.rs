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

mod monitor_client;
pub mod rootfs;
pub mod types;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hako_proto::monitor as pb;
use hako_runtime::monitor::{NamespaceSet, Options as MonitorOptions};
use hako_runtime::spec::{self, ContainerSpec, Ns};

use crate::error::{chain, Error, Result};
use crate::image::Images;
use crate::network::{Network, IFNAME};
use crate::store::{Store, Table, RECORD_VERSION};
use monitor_client::MonitorClient;
pub use types::*;

pub(crate) fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

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
    /// Last CPU reading per container (time, cumulative ns), for usage rates.
    cpu_samples: std::sync::Mutex<HashMap<String, (i64, u64)>>,
    /// New pods keep the kernel's cgroup-migration lock warm until their first container is
    /// created (at most 1 s): kubelet creates containers right after RunPodSandbox.
    warm_pods: Arc<std::sync::Mutex<HashMap<String, hako_runtime::cgroup_warm::Hold>>>,
    network: Arc<Network>,
    cdi: Arc<hako_runtime::cdi::Registry>,
}

/// Resource usage of a container, as the stats RPCs report it.
#[derive(Debug, Clone)]
pub struct Usage {
    pub timestamp: i64,
    pub sample: Option<hako_runtime::stats::Sample>,
    /// CPU use since the previous reading, in nanocores.
    pub nano_cores: Option<u64>,
    pub writable_bytes: u64,
    pub writable_inodes: u64,
    pub writable_mountpoint: PathBuf,
}

/// Whether containers must not get a lower oom_score_adj than ours: asked for, or forced
/// because without CAP_SYS_RESOURCE the kernel refuses to lower it.
fn oom_floor(restrict: bool, caps: &[String]) -> Option<i32> {
    let forced = !caps.iter().any(|c| c == "CAP_SYS_RESOURCE");
    if !(restrict || forced) {
        return None;
    }
    let own = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if forced && !restrict {
        tracing::warn!(
            floor = own,
            "no CAP_SYS_RESOURCE: container oom_score_adj is clamped to the daemon's own"
        );
    }
    Some(own)
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
        let cap_limit = spec::own_bounding_set();
        Runtime {
            oom_floor: oom_floor(restrict_oom_score_adj, &cap_limit),
            store,
            images,
            state_dir: state_dir.to_path_buf(),
            root_dir: root_dir.to_path_buf(),
            monitors: std::sync::Mutex::new(HashMap::new()),
            name_locks: tokio::sync::Mutex::new(HashMap::new()),
            cap_limit,
            cpu_samples: std::sync::Mutex::new(HashMap::new()),
            warm_pods: Default::default(),
            network,
            cdi,
        }
    }

    /// Usage of a container's or pod's cgroup; `key` names the rate cache entry.
    fn cgroup_usage(
        &self,
        key: &str,
        cgroups_path: &str,
    ) -> (i64, Option<hako_runtime::stats::Sample>, Option<u64>) {
        let now = now_nanos();
        let sample = match hako_runtime::stats::sample(cgroups_path) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::debug!(cgroup = cgroups_path, error = %e, "no cgroup stats");
                None
            }
        };
        let mut cache = self.cpu_samples.lock().expect("cpu samples poisoned");
        let rate = sample.and_then(|s| {
            let prev = cache.insert(key.to_string(), (now, s.cpu_usage_ns));
            prev.and_then(|(t, u)| {
                let dt = (now - t) as f64;
                (dt > 0.0 && s.cpu_usage_ns >= u)
                    .then(|| ((s.cpu_usage_ns - u) as f64 * 1e9 / dt) as u64)
            })
        });
        (now, sample, rate)
    }

    /// Current resource usage of a container.
    pub fn container_usage(&self, c: &ContainerRecord) -> Usage {
        let (timestamp, sample, nano_cores) = self.cgroup_usage(&c.id, &c.cgroups_path);
        let upper = self.layer_dir(&c.id).join("upper");
        let (writable_bytes, writable_inodes) =
            crate::image::unpack::disk_usage(&upper).unwrap_or((0, 0));
        Usage {
            timestamp,
            sample,
            nano_cores,
            writable_bytes,
            writable_inodes,
            writable_mountpoint: self.root_dir.join("containers"),
        }
    }

    /// Current resource usage of a pod's cgroup (its containers' parent).
    pub fn pod_usage(&self, pod: &PodRecord) -> Usage {
        let (timestamp, sample, nano_cores) =
            self.cgroup_usage(&format!("pod/{}", pod.id), &pod_cgroup(pod));
        Usage {
            timestamp,
            sample,
            nano_cores,
            writable_bytes: 0,
            writable_inodes: 0,
            writable_mountpoint: PathBuf::new(),
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

    // ---- pods ----

    /// RunPodSandbox. A retry of a pod that was created returns it; a failed attempt leaves
    /// nothing behind.
    pub async fn run_pod(&self, spec: PodSpec) -> Result<String> {
        if spec.name.is_empty() || spec.uid.is_empty() || spec.namespace.is_empty() {
            return Err(Error::InvalidArgument(
                "pod sandbox metadata needs name, uid and namespace".into(),
            ));
        }
        if !spec.runtime_handler.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "runtime handler {:?} is not configured",
                spec.runtime_handler
            )));
        }
        if !spec.cgroup_parent.is_empty() {
            confined_cgroup_path(&spec.cgroup_parent).map_err(|why| {
                Error::InvalidArgument(format!(
                    "pod sandbox {}/{}: cgroup parent {:?} {why}",
                    spec.namespace, spec.name, spec.cgroup_parent
                ))
            })?;
        }
        let t0 = std::time::Instant::now();
        // Its grace period then passes during this call and the first container's create
        // finds the lock ready (see cgroup_warm).
        let warm = hako_runtime::cgroup_warm::hold();
        let key = spec.reservation();
        let _guard = self.name_lock(&key).await;
        if let Some(existing) = self.store.reserved(&key)? {
            if let Some(p) = self.store.get::<PodRecord>(Table::Pods, &existing)? {
                if p.spec == spec && p.state == PodState::Ready {
                    return Ok(p.id);
                }
            }
            return Err(Error::AlreadyExists(format!(
                "pod name {key} is reserved by pod sandbox {existing}"
            )));
        }
        let id = new_id();
        let mut undo = Undo::default();
        self.reserve(&key, &id, &mut undo)?;
        let dir = self.pod_dir(&id);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create directory", &dir, e))?;
        {
            let dir = dir.clone();
            undo.push(move || {
                let _ = std::fs::remove_dir_all(dir);
            });
        }
        write_pod_files(&dir, &spec)?;
        let ns = NamespaceSet {
            network: spec.network != NsMode::Node,
            ipc: spec.ipc != NsMode::Node,
            uts: spec.network != NsMode::Node,
            pid: spec.pid == NsMode::Pod,
        };
        let net_sysctls = spec
            .sysctls
            .iter()
            .filter(|(k, _)| ns.network && k.starts_with("net."))
            .map(|(k, v)| (k.clone(), v.clone()));
        let ipc_sysctls = spec
            .sysctls
            .iter()
            .filter(|(k, _)| {
                ns.ipc
                    && (k.starts_with("kernel.shm")
                        || k.starts_with("kernel.msg")
                        || k.starts_with("kernel.sem")
                        || k.starts_with("fs.mqueue."))
            })
            .map(|(k, v)| (k.clone(), v.clone()));
        let opts = MonitorOptions {
            pod_id: id.clone(),
            dir: dir.clone(),
            hostname: spec.hostname.clone(),
            namespaces: ns,
            sysctls: net_sysctls.chain(ipc_sysctls).collect(),
        };
        let t_prepared = t0.elapsed();
        let (pid, namespaces) = monitor_client::spawn(&opts)
            .await
            .map_err(|e| e.context(format!("start pod {}", spec.name)))?;
        let t_spawned = t0.elapsed();
        let client = MonitorClient::new(dir.join("monitor.sock"));
        let recorded = async {
            let ips = match namespaces.get("network") {
                Some(netns) => {
                    let att = self.network.attachment(&id, Path::new(netns), &spec);
                    self.network
                        .attach(&att)
                        .await
                        .map_err(|e| e.context(format!("network of pod {}", spec.name)))?
                }
                None => Vec::new(),
            };
            let t_network = t0.elapsed();
            let record = PodRecord {
                v: RECORD_VERSION,
                id: id.clone(),
                spec,
                state: PodState::Ready,
                created_at: now_nanos(),
                monitor_pid: pid,
                namespaces,
                ips,
            };
            if let Err(e) = self.store.put(Table::Pods, &id, &record) {
                let _ = self.network.cni.del(&id, IFNAME).await;
                return Err(e);
            }
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(
                pod = %id,
                prepare_ms = ms(t_prepared),
                monitor_ms = ms(t_spawned - t_prepared),
                network_ms = ms(t_network - t_spawned),
                record_ms = ms(t0.elapsed() - t_network),
                "run timings"
            );
            Ok::<_, Error>(record)
        }
        .await;
        let record = match recorded {
            Ok(r) => r,
            Err(e) => {
                // The monitor holds mounts in the pod dir: it goes before the dir does.
                client.shutdown().await;
                return Err(e);
            }
        };
        self.monitors
            .lock()
            .expect("monitors poisoned")
            .insert(id.clone(), client);
        undo.commit();
        self.warm_pods
            .lock()
            .expect("warm pods poisoned")
            .insert(id.clone(), warm);
        let (warm_pods, pod) = (self.warm_pods.clone(), id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            warm_pods.lock().expect("warm pods poisoned").remove(&pod);
        });
        tracing::info!(pod = %id, name = %record.spec.name, namespace = %record.spec.namespace, "pod sandbox ready");
        Ok(id)
    }

    /// StopPodSandbox: kills every container, releases the namespaces. Idempotent; an unknown
    /// pod is already stopped.
    pub async fn stop_pod(&self, id: &str) -> Result<()> {
        let mut pod = match self.pod(id) {
            Ok(p) => p,
            Err(Error::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        if pod.state == PodState::NotReady {
            // Its monitor may have died before the network was torn down.
            return self.detach(&pod).await;
        }
        let containers = self.containers_of(&pod.id)?;
        let monitor = self.monitor(&pod);
        let states: HashMap<String, pb::ContainerState> = match monitor.info().await {
            Ok(info) => info
                .containers
                .into_iter()
                .map(|c| (c.id.clone(), c))
                .collect(),
            Err(e) => {
                tracing::warn!(pod = %pod.id, error = %chain(&e), "monitor unreachable while stopping");
                HashMap::new()
            }
        };
        for c in &containers {
            if let Some(s) = states.get(&c.id) {
                if s.status != pb::Status::Exited as i32 {
                    let _ = monitor.signal(&c.id, libc::SIGKILL, true).await;
                    let _ = monitor.wait(&c.id, 10_000).await;
                }
            }
        }
        // Record final states before the monitor (their source of truth) goes away.
        if let Ok(info) = monitor.info().await {
            for s in info.containers {
                if let Ok(mut rec) = self.container_record(&s.id) {
                    apply_state(&mut rec, &s);
                    self.store.put(Table::Containers, &rec.id, &rec)?;
                }
            }
        }
        for mut c in self.containers_of(&pod.id)? {
            if c.state != ContainerState::Exited {
                c.state = ContainerState::Exited;
                c.exit.get_or_insert(ExitInfo {
                    code: 137,
                    signal: 9,
                    finished_at: now_nanos(),
                    oom_killed: false,
                });
                self.store.put(Table::Containers, &c.id, &c)?;
            }
            let _ = rootfs::unmount(&self.bundle_dir(&c.id).join("rootfs"));
        }
        // Before the namespace goes: plugins clean up inside it. A failure fails the stop
        // (kubelet retries it) rather than leak an IP lease.
        self.detach(&pod).await?;
        monitor.shutdown().await;
        self.monitors
            .lock()
            .expect("monitors poisoned")
            .remove(&pod.id);
        pod.state = PodState::NotReady;
        self.store.put(Table::Pods, &pod.id, &pod)?;
        tracing::info!(pod = %pod.id, "pod sandbox stopped");
        Ok(())
    }

    /// CNI DEL of the pod's attachment, from the cached ADD result (nothing when it has none).
    async fn detach(&self, pod: &PodRecord) -> Result<()> {
        self.network
            .cni
            .del(&pod.id, IFNAME)
            .await
            .map_err(|e| e.context(format!("tear down the network of pod {}", pod.id)))
    }

    /// RemovePodSandbox: stops it if needed, removes its containers and files. Idempotent.
    pub async fn remove_pod(&self, id: &str) -> Result<()> {
        let pod = match self.pod(id) {
            Ok(p) => p,
            Err(Error::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        self.stop_pod(&pod.id).await?;
        for c in self.containers_of(&pod.id)? {
            self.remove_container(&c.id).await?;
        }
        let dir = self.pod_dir(&pod.id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(Error::io("remove", &dir, e));
            }
        }
        if pod.spec.cgroup_parent.is_empty() {
            // Ours (kubelet's parents are kubelet's): empty once the containers are deleted.
            if !remove_cgroup(&pod_cgroup(&pod)) {
                tracing::warn!(pod = %pod.id, cgroup = %pod_cgroup(&pod), "pod cgroup not empty; left in place");
            }
        }
        self.store.delete(Table::Pods, &pod.id)?;
        self.store.release(&pod.spec.reservation())?;
        tracing::info!(pod = %pod.id, "pod sandbox removed");
        Ok(())
    }

    /// After a failed call to a pod's monitor: if the monitor process is gone, the pod is
    /// reported NotReady, its containers Exited with the exit their monitor recorded, or
    /// Unknown when it recorded none, and what the monitor held is released. Logged, never
    /// silent. A monitor that is alive but did not answer is left alone.
    fn check_monitor(&self, pod: &PodRecord, err: &Error) -> Result<()> {
        if monitor_alive(pod.monitor_pid) {
            tracing::warn!(pod = %pod.id, error = %chain(err), "pod monitor did not answer");
            return Ok(());
        }
        tracing::error!(pod = %pod.id, name = %pod.spec.name, monitor_pid = pod.monitor_pid, error = %chain(err), "pod monitor is gone: pod marked not ready");
        self.monitor_lost(pod)
    }

    fn monitor_lost(&self, pod: &PodRecord) -> Result<()> {
        let dir = self.pod_dir(&pod.id);
        for mut c in self.containers_of(&pod.id)? {
            if c.state == ContainerState::Exited {
                continue;
            }
            let recorded = std::fs::read(dir.join("containers").join(&c.id).join("exit.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<hako_runtime::monitor::Exit>(&b).ok());
            match recorded {
                Some(e) => {
                    c.state = ContainerState::Exited;
                    c.exit = Some(ExitInfo {
                        code: e.code,
                        signal: e.signal,
                        finished_at: e.finished_at,
                        oom_killed: e.oom_killed,
                    });
                }
                None => {
                    // Orphaned processes would run on unwatched: end them.
                    kill_cgroup(&c.cgroups_path);
                    c.state = ContainerState::Unknown;
                }
            }
            self.store.put(Table::Containers, &c.id, &c)?;
            let _ = rootfs::unmount(&self.bundle_dir(&c.id).join("rootfs"));
        }
        // The infra process outlives its monitor (it was reparented).
        kill_pod_processes(&pod.id);
        hako_runtime::monitor::unpin_namespaces(&dir);
        let mut pod = pod.clone();
        pod.state = PodState::NotReady;
        self.monitors
            .lock()
            .expect("monitors poisoned")
            .remove(&pod.id);
        self.store.put(Table::Pods, &pod.id, &pod)
    }

    /// At start: pods whose monitor died while the daemon was down are reported as such.
    ///
    /// Also releases what a crash in the middle of a RunPodSandbox or CreateContainer made
    /// before its record was written (a monitor and its namespaces, a container in a live pod,
    /// an overlay mount, directories, a name reservation, an image pin), so kubelet's retry
    /// under the same name succeeds instead of finding the name reserved by an object nobody
    /// can list or remove. Each release is logged.
    pub async fn reconcile(&self) -> Result<()> {
        let pods: HashMap<String, PodRecord> = self
            .pods()?
            .into_iter()
            .map(|p| (p.id.clone(), p))
            .collect();
        let containers: HashSet<String> = self
            .store
            .all::<ContainerRecord>(Table::Containers)?
            .into_iter()
            .map(|c| c.id)
            .collect();
        for pod in pods.values().filter(|p| p.state == PodState::Ready) {
            let monitor = self.monitor(pod);
            let info = match monitor.info().await {
                Ok(info) => info,
                Err(e) => {
                    self.check_monitor(pod, &e)?;
                    continue;
                }
            };
            for c in info
                .containers
                .iter()
                .filter(|c| !containers.contains(&c.id))
            {
                tracing::warn!(pod = %pod.id, container = %c.id, "deleting a container whose create did not finish");
                monitor.delete(&c.id, true).await?;
            }
        }
        self.release_orphans(&pods, &containers).await?;
        self.network_gc().await;
        Ok(())
    }

    /// The part of `reconcile` that needs no monitor: pod directories, bundles and layers,
    /// reservations and pins no record owns.
    async fn release_orphans(
        &self,
        pods: &HashMap<String, PodRecord>,
        containers: &HashSet<String>,
    ) -> Result<()> {
        for id in dir_names(&self.state_dir.join("pods")) {
            if pods.contains_key(&id) {
                continue;
            }
            tracing::warn!(pod = %id, "releasing a pod sandbox whose start did not finish");
            let dir = self.pod_dir(&id);
            let monitor = MonitorClient::new(dir.join("monitor.sock"));
            if monitor.info().await.is_ok() {
                monitor.shutdown().await;
            }
            kill_pod_processes(&id);
            hako_runtime::monitor::unpin_namespaces(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            remove_cgroup(&format!("/hako/{id}"));
        }
        // A container's bundle and layer dirs share its id: each id once.
        let dirs: std::collections::BTreeSet<String> =
            dir_names(&self.state_dir.join("containers"))
                .into_iter()
                .chain(dir_names(&self.root_dir.join("containers")))
                .collect();
        for id in dirs.into_iter().filter(|id| !containers.contains(id)) {
            tracing::warn!(container = %id, "removing the files of a container whose create did not finish");
            self.remove_container_files(&id)?;
        }
        for (name, holder) in self.store.reservations()? {
            if !pods.contains_key(&holder) && !containers.contains(&holder) {
                tracing::warn!(
                    name,
                    holder,
                    "releasing a name reserved by an unfinished create"
                );
                self.store.release(&name)?;
            }
        }
        for owner in self.store.pin_owners()? {
            if !containers.contains(&owner) {
                self.store.unpin(&owner)?;
            }
        }
        Ok(())
    }

    /// At start: running pods' attachments are CHECKed; attachments no pod owns (a pod removed
    /// while its DEL failed, state lost) are deleted; with CNI 1.1 the plugins are also told
    /// which attachments are valid. Failures are logged: they must not keep the daemon from
    /// starting.
    async fn network_gc(&self) {
        let pods: HashMap<String, PodRecord> = match self.pods() {
            Ok(p) => p.into_iter().map(|p| (p.id.clone(), p)).collect(),
            Err(_) => return,
        };
        let mut valid = Vec::new();
        for c in self.network.cni.cached() {
            let id = c.attachment.container_id.clone();
            if let Some(pod) = pods.get(&id) {
                valid.push((id.clone(), c.attachment.ifname.clone()));
                // A running pod's network may have been changed while the daemon was down.
                if pod.state == PodState::Ready && !c.result.is_null() {
                    match self.network.cni.check(&c).await {
                        Ok(()) => tracing::debug!(pod = %id, "CNI CHECK passed"),
                        Err(e) => {
                            tracing::warn!(pod = %id, error = %chain(&e), "CNI CHECK failed: the pod's network is not as it was set up")
                        }
                    }
                }
                continue;
            }
            match self.network.cni.del_cached(&c).await {
                Ok(()) => {
                    tracing::info!(pod = %id, "released the network of a pod that no longer exists")
                }
                Err(e) => tracing::warn!(pod = %id, error = %chain(&e), "network GC: DEL failed"),
            }
        }
        if let Err(e) = self.network.cni.gc(&valid).await {
            if !matches!(e, Error::FailedPrecondition(_)) {
                tracing::warn!(error = %chain(&e), "CNI GC");
            }
        }
    }

    fn containers_of(&self, pod_id: &str) -> Result<Vec<ContainerRecord>> {
        Ok(self
            .store
            .all::<ContainerRecord>(Table::Containers)?
            .into_iter()
            .filter(|c| c.pod_id == pod_id)
            .collect())
    }

    // ---- containers ----

    /// CreateContainer: prepares the rootfs and config, has the pod's monitor create it.
    pub async fn create_container(&self, pod_id: &str, req: ContainerSpecReq) -> Result<String> {
        let pod = self.pod(pod_id)?;
        if pod.state != PodState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "pod sandbox {} is not ready",
                pod.id
            )));
        }
        if req.name.is_empty() {
            return Err(Error::InvalidArgument(
                "container metadata needs a name".into(),
            ));
        }
        let t0 = std::time::Instant::now();
        // libcontainer moves the container into its cgroups some ms from now.
        let _warm = hako_runtime::cgroup_warm::hold();
        let key = req.reservation(&pod.id);
        let _guard = self.name_lock(&key).await;
        if let Some(existing) = self.store.reserved(&key)? {
            if let Some(c) = self
                .store
                .get::<ContainerRecord>(Table::Containers, &existing)?
            {
                if c.spec == req {
                    return Ok(c.id);
                }
            }
            return Err(Error::AlreadyExists(format!(
                "container name {key} is reserved by container {existing}"
            )));
        }
        let image = self.images.find(&req.image)?.ok_or_else(|| {
            Error::NotFound(format!("image {:?} not found: pull it first", req.image))
        })?;
        let config: serde_json::Value =
            serde_json::from_slice(&self.images.read_content(&image.id)?)
                .map_err(|e| Error::Internal(format!("image {} config: {e}", image.id)))?;
        let id = new_id();
        let mut undo = Undo::default();
        self.reserve(&key, &id, &mut undo)?;
        self.store.pin(&id, &image.chain_ids)?;
        {
            let (store, id) = (self.store.clone(), id.clone());
            undo.push(move || {
                let _ = store.unpin(&id);
            });
        }
        let bundle = self.bundle_dir(&id);
        let layer = self.layer_dir(&id);
        {
            let (b, l) = (bundle.clone(), layer.clone());
            undo.push(move || {
                let _ = rootfs::unmount(&b.join("rootfs"));
                let _ = std::fs::remove_dir_all(&b);
                let _ = std::fs::remove_dir_all(&l);
            });
        }
        let lowers: Vec<PathBuf> = image
            .chain_ids
            .iter()
            .rev()
            .map(|c| self.images.snapshot_fs(c))
            .collect();
        let stop_signal = match config["config"]["StopSignal"].as_str() {
            Some(sig) if !sig.is_empty() => {
                parse_signal(sig).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "image {} has an unknown STOPSIGNAL {sig:?}",
                        req.image
                    ))
                })?;
                Some(sig.to_string())
            }
            _ => None,
        };
        // CDI devices resolve before anything is made: an unknown one leaves nothing behind.
        let cdi_names = cdi_requests(&req);
        let cdi = if cdi_names.is_empty() {
            Ok(Default::default())
        } else {
            let (reg, names) = (self.cdi.clone(), cdi_names.clone());
            tokio::task::spawn_blocking(move || reg.resolve(&names))
                .await
                .map_err(|e| Error::Internal(format!("CDI task: {e}")))?
        }
        .map_err(|e| {
            let msg = format!("container {}: {e}", req.name);
            match e {
                hako_runtime::cdi::CdiError::NotFound(_) => Error::NotFound(msg),
                hako_runtime::cdi::CdiError::Invalid(_) => Error::InvalidArgument(msg),
            }
        })?;
        let target_pid = if req.security.pid == NsMode::Target {
            Some(self.pid_target(&pod, &req).await?)
        } else {
            None
        };
        let root = bundle.join("rootfs");
        let t_prepared = t0.elapsed();
        rootfs::mount_overlay(&lowers, &layer.join("upper"), &layer.join("work"), &root)?;
        let t_mounted = t0.elapsed();
        // Reads the image's account files: bounded, but still file I/O, so off the async workers.
        let spec = tokio::task::block_in_place(|| {
            self.container_spec(&pod, &id, &req, &config, &root, target_pid)
        })?;
        let user = UserIds {
            uid: spec.uid,
            gid: spec.gid,
            groups: std::iter::once(spec.gid)
                .chain(
                    spec.additional_gids
                        .iter()
                        .copied()
                        .filter(|g| *g != spec.gid),
                )
                .collect(),
        };
        let cgroups_path = spec.cgroups_path.clone();
        let mut oci = spec::generate_json(&spec);
        hako_runtime::cdi::apply(&mut oci, &cdi)
            .map_err(|e| Error::InvalidArgument(format!("container {}: {e}", req.name)))?;
        if !cdi_names.is_empty() {
            tracing::info!(container = %id, devices = ?cdi_names, "CDI devices injected");
        }
        let oci = spec::typed(oci).map_err(Error::Internal)?;
        let cfg = bundle.join("config.json");
        oci.save(&cfg)
            .map_err(|e| Error::Internal(format!("write {}: {e}", cfg.display())))?;
        let log_path = container_log_path(&pod.spec.log_directory, &req.log_path)
            .map_err(|e| e.context(format!("container {}", req.name)))?
            .display()
            .to_string();
        let monitor = self.monitor(&pod);
        let t_spec = t0.elapsed();
        monitor
            .create(&id, &bundle, &log_path, req.tty, req.stdin, req.stdin_once)
            .await
            .map_err(|e| e.context(format!("create container {} in pod {}", req.name, pod.id)))?;
        let t_created = t0.elapsed();
        self.warm_pods
            .lock()
            .expect("warm pods poisoned")
            .remove(&pod.id);
        let record = ContainerRecord {
            v: RECORD_VERSION,
            id: id.clone(),
            pod_id: pod.id.clone(),
            image_id: image.id.clone(),
            image_ref: image
                .repo_digests
                .first()
                .cloned()
                .unwrap_or_else(|| image.id.clone()),
            spec: req,
            created_at: now_nanos(),
            log_path,
            state: ContainerState::Created,
            started_at: 0,
            exit: None,
            chain_ids: image.chain_ids.clone(),
            cgroups_path,
            stop_signal,
            user: Some(user),
            start_error: None,
        };
        if let Err(e) = self.store.put(Table::Containers, &id, &record) {
            let _ = monitor.delete(&id, true).await;
            return Err(e);
        }
        undo.commit();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            container = %id,
            prepare_ms = ms(t_prepared),
            mount_ms = ms(t_mounted - t_prepared),
            spec_ms = ms(t_spec - t_mounted),
            monitor_ms = ms(t_created - t_spec),
            record_ms = ms(t0.elapsed() - t_created),
            "create timings"
        );
        tracing::info!(container = %id, pod = %pod.id, name = %record.spec.name, "container created");
        Ok(id)
    }

    /// The pid whose PID namespace a TARGET-mode container joins: a running container of the
    /// same pod.
    async fn pid_target(&self, pod: &PodRecord, req: &ContainerSpecReq) -> Result<u32> {
        let target = &req.security.pid_target;
        let c = self
            .container_record(target)
            .map_err(|e| e.context(format!("PID namespace target of container {}", req.name)))?;
        if c.pod_id != pod.id {
            return Err(Error::InvalidArgument(format!(
                "container {}: PID namespace target {target} is in another pod",
                req.name
            )));
        }
        let s = self.monitor(pod).state(&c.id).await?;
        if s.status != pb::Status::Running as i32 || s.pid == 0 {
            return Err(Error::FailedPrecondition(format!(
                "container {}: PID namespace target {target} is not running",
                req.name
            )));
        }
        Ok(s.pid)
    }

    /// The OCI-level description of a container, from the CRI request and the image config.
    fn container_spec(
        &self,
        pod: &PodRecord,
        id: &str,
        req: &ContainerSpecReq,
        image: &serde_json::Value,
        root: &Path,
        target_pid: Option<u32>,
    ) -> Result<ContainerSpec> {
        let ic = &image["config"];
        let strings = |v: &serde_json::Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let (entrypoint, cmd) = (strings(&ic["Entrypoint"]), strings(&ic["Cmd"]));
        // Kubernetes: command replaces the entrypoint (and drops the image's cmd); args replace cmd.
        let args: Vec<String> = if !req.command.is_empty() {
            req.command.iter().chain(&req.args).cloned().collect()
        } else if !req.args.is_empty() {
            entrypoint.iter().chain(&req.args).cloned().collect()
        } else {
            entrypoint.iter().chain(&cmd).cloned().collect()
        };
        if args.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "container {}: no command given and the image has none",
                req.name
            )));
        }
        let mut env: Vec<String> = strings(&ic["Env"]);
        for (k, v) in &req.envs {
            env.retain(|e| e.split('=').next() != Some(k.as_str()));
            env.push(format!("{k}={v}"));
        }
        if !env.iter().any(|e| e.starts_with("PATH=")) {
            env.insert(
                0,
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            );
        }
        if !pod.spec.hostname.is_empty() && !env.iter().any(|e| e.starts_with("HOSTNAME=")) {
            env.push(format!("HOSTNAME={}", pod.spec.hostname));
        }
        let cwd = if req.working_dir.is_empty() {
            ic["WorkingDir"].as_str().unwrap_or("").to_string()
        } else {
            req.working_dir.clone()
        };
        // The user: the request's uid or name, else the image's USER.
        let sec = &req.security;
        if sec.run_as_group.is_some() && sec.run_as_user.is_none() && sec.run_as_username.is_empty()
        {
            return Err(Error::InvalidArgument(format!(
                "container {}: run_as_group needs run_as_user or run_as_username",
                req.name
            )));
        }
        let image_user = ic["User"].as_str().unwrap_or("");
        let (user, group) = match (&sec.run_as_user, sec.run_as_username.as_str()) {
            (Some(uid), _) => (uid.to_string(), None),
            (None, name) if !name.is_empty() => (name.to_string(), None),
            _ => {
                let mut parts = image_user.splitn(2, ':');
                (
                    parts.next().unwrap_or("").to_string(),
                    parts.next().map(str::to_string),
                )
            }
        };
        let group = sec.run_as_group.map(|g| g.to_string()).or(group);
        let user = if user.is_empty() { "0" } else { user.as_str() };
        let (uid, gid, mut extra) = rootfs::resolve_user(root, user, group.as_deref())
            .map_err(|e| e.context(format!("container {} (image {})", req.name, req.image)))?;
        if sec.strict_supplemental_groups {
            extra.clear();
        }
        for g in &sec.supplemental_groups {
            if !extra.contains(&(*g as u32)) {
                extra.push(*g as u32);
            }
        }
        let mut mounts = Vec::new();
        for m in &req.mounts {
            if m.recursive_readonly && !(m.readonly && m.propagation == Propagation::Private) {
                return Err(Error::InvalidArgument(format!(
                    "container {}: recursive read-only mount {} needs readonly and private propagation",
                    req.name, m.container_path
                )));
            }
            if !Path::new(&m.host_path).exists() {
                // A missing host path becomes a directory, as containerd and CRI-O do, with
                // their 0755 (the daemon's umask is 077).
                rootfs::create_dirs(Path::new(&m.host_path), 0o755)?;
            }
            mounts.push(spec::Mount {
                destination: m.container_path.clone(),
                source: m.host_path.clone(),
                readonly: m.readonly,
                propagation: match m.propagation {
                    Propagation::Private => "rprivate",
                    Propagation::HostToContainer => "rslave",
                    Propagation::Bidirectional => "rshared",
                }
                .into(),
                recursive_readonly: m.recursive_readonly,
            });
        }
        let pod_dir = self.pod_dir(&pod.id);
        for (dest, file) in [
            ("/etc/resolv.conf", "resolv.conf"),
            ("/etc/hostname", "hostname"),
            ("/etc/hosts", "hosts"),
        ] {
            if !mounts.iter().any(|m| m.destination == dest) && pod_dir.join(file).exists() {
                mounts.push(spec::Mount {
                    destination: dest.into(),
                    source: pod_dir.join(file).display().to_string(),
                    readonly: sec.readonly_rootfs,
                    propagation: "rprivate".into(),
                    recursive_readonly: false,
                });
            }
        }
        let join = |kind: &str| {
            pod.namespaces
                .get(kind)
                .map(|p| Ns::Join(p.clone()))
                .unwrap_or(Ns::Host)
        };
        let pid = match (sec.pid, pod.spec.pid) {
            (NsMode::Pod, NsMode::Node) | (NsMode::Node, _) => Ns::Host,
            (NsMode::Pod, NsMode::Pod) => pod
                .namespaces
                .get("pid")
                .map(|p| Ns::Join(p.clone()))
                .ok_or_else(|| Error::Internal(format!("pod {} has no PID namespace", pod.id)))?,
            // A pod without a shared PID namespace: the container gets its own.
            (NsMode::Pod, _) | (NsMode::Container, _) => Ns::New,
            (NsMode::Target, _) => Ns::Join(format!(
                "/proc/{}/ns/pid",
                target_pid.ok_or_else(|| Error::Internal("PID target not resolved".into()))?
            )),
        };
        let devices = if sec.privileged {
            hako_runtime::devices::host_devices()
        } else {
            req.devices
                .iter()
                .map(|d| device_nodes(d).map_err(|e| e.context(format!("container {}", req.name))))
                .collect::<Result<Vec<_>>>()?
                .concat()
        };
        let cgroup_parent = pod_cgroup(pod);
        let annotations: BTreeMap<String, String> = req.annotations.clone();
        let mut cs = ContainerSpec {
            args,
            env,
            cwd,
            uid,
            gid,
            additional_gids: extra,
            tty: req.tty,
            hostname: pod.spec.hostname.clone(),
            rootfs: root.display().to_string(),
            readonly_rootfs: sec.readonly_rootfs,
            mounts,
            devices,
            network: Some(join("network")),
            ipc: Some(join("ipc")),
            uts: Some(join("uts")),
            pid: Some(pid),
            privileged: sec.privileged,
            add_capabilities: sec.add_capabilities.clone(),
            drop_capabilities: sec.drop_capabilities.clone(),
            no_new_privileges: sec.no_new_privs,
            cgroups_path: format!("{cgroup_parent}/hako-{id}"),
            resources: {
                let mut r = req.resources.clone();
                let dropped = hako_runtime::stats::drop_unsupported(&mut r);
                if !dropped.is_empty() {
                    tracing::info!(container = %id, ?dropped, "limits this node's cgroups cannot apply are skipped");
                }
                r
            },
            oom_score_adj: req.oom_score_adj.map(|adj| {
                let adj = adj.clamp(-1000, 1000) as i32;
                match self.oom_floor {
                    Some(floor) if adj < floor => {
                        tracing::info!(container = %id, requested = adj, used = floor, "oom_score_adj raised to the daemon's own");
                        floor
                    }
                    _ => adj,
                }
            }),
            sysctls: BTreeMap::new(),
            annotations,
            masked_paths: sec.masked_paths.clone(),
            readonly_paths: sec.readonly_paths.clone(),
            cap_limit: self.cap_limit.clone(),
            seccomp: spec::Seccomp::Unconfined,
            apparmor_profile: None,
        };
        let caps = spec::capabilities(&cs);
        cs.seccomp = match &sec.seccomp {
            SeccompReq::Unconfined => spec::Seccomp::Unconfined,
            SeccompReq::RuntimeDefault => spec::Seccomp::RuntimeDefault,
            SeccompReq::Localhost(path) => {
                if !path.starts_with('/') {
                    return Err(Error::InvalidArgument(format!(
                        "seccomp profile {path:?} of container {}: not an absolute path",
                        req.name
                    )));
                }
                // A regular file of bounded size: a FIFO or device named here must not block
                // or flood the daemon.
                let text = crate::inroot::read_regular(Path::new("/"), path, SECCOMP_PROFILE_CAP)
                    .map_err(|e| {
                    let msg = format!(
                        "seccomp profile {path} of container {}: {}",
                        req.name,
                        chain(&e)
                    );
                    if e.is_not_found() {
                        Error::NotFound(msg)
                    } else {
                        Error::InvalidArgument(msg)
                    }
                })?;
                let json: serde_json::Value = serde_json::from_slice(&text)
                    .map_err(|e| Error::InvalidArgument(format!("seccomp profile {path}: {e}")))?;
                spec::Seccomp::Profile(
                    spec::profile_to_oci(&json, &caps).map_err(|e| {
                        Error::InvalidArgument(format!("seccomp profile {path}: {e}"))
                    })?,
                )
            }
        };
        cs.apparmor_profile = apparmor_profile(sec, &req.name)?;
        Ok(cs)
    }

    fn pod_of(&self, c: &ContainerRecord) -> Result<PodRecord> {
        self.pod(&c.pod_id)
            .map_err(|e| e.context(format!("container {}", c.id)))
    }

    pub async fn start_container(&self, id: &str) -> Result<()> {
        let mut c = self.container_record(id)?;
        let pod = self.pod_of(&c)?;
        if c.state != ContainerState::Created {
            return Err(Error::FailedPrecondition(format!(
                "container {} is {:?}, not created",
                c.id, c.state
            )));
        }
        let m = self.monitor(&pod);
        let s = match m.start(&c.id).await {
            Ok(s) => s,
            Err(e) => {
                let e = e.context(format!("start container {}", c.id));
                // The container is done for: its init must not linger waiting for a start, and
                // its status says why (reason StartError), as containerd reports it.
                c.start_error = Some(chain(&e));
                let _ = m.signal(&c.id, libc::SIGKILL, true).await;
                match m.wait(&c.id, 5_000).await {
                    Ok(s) => {
                        apply_state(&mut c, &s);
                    }
                    Err(_) => c.state = ContainerState::Exited,
                }
                if c.exit.is_none() {
                    c.exit = Some(ExitInfo {
                        code: 128,
                        finished_at: now_nanos(),
                        ..Default::default()
                    });
                }
                self.store.put(Table::Containers, &c.id, &c)?;
                return Err(e);
            }
        };
        apply_state(&mut c, &s);
        self.store.put(Table::Containers, &c.id, &c)?;
        Ok(())
    }

    /// StopContainer: the image's STOPSIGNAL (SIGTERM when it has none), then SIGKILL after
    /// `timeout`. Stopping an exited or unknown container succeeds.
    pub async fn stop_container(&self, id: &str, timeout: Duration) -> Result<()> {
        let mut c = match self.container_record(id) {
            Ok(c) => c,
            Err(Error::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let Ok(pod) = self.pod_of(&c) else {
            return Ok(());
        };
        if pod.state != PodState::Ready {
            return Ok(());
        }
        let m = self.monitor(&pod);
        let s = m.state(&c.id).await?;
        if s.status == pb::Status::Exited as i32 {
            apply_state(&mut c, &s);
            return self.store.put(Table::Containers, &c.id, &c);
        }
        if s.status == pb::Status::Running as i32 && !timeout.is_zero() {
            let sig = c
                .stop_signal
                .as_deref()
                .and_then(parse_signal)
                .unwrap_or(libc::SIGTERM);
            // Whatever goes wrong with the polite signal, the stop still ends in SIGKILL.
            let polite = match m.signal(&c.id, sig, false).await {
                Ok(()) => m.wait(&c.id, timeout.as_millis() as i64).await,
                Err(e) => Err(e),
            };
            match polite {
                Ok(s) if s.status == pb::Status::Exited as i32 => {
                    apply_state(&mut c, &s);
                    return self.store.put(Table::Containers, &c.id, &c);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(container = %c.id, signal = sig, error = %chain(&e), "stop signal failed; killing")
                }
            }
        }
        m.signal(&c.id, libc::SIGKILL, true).await?;
        let s = m.wait(&c.id, 30_000).await?;
        apply_state(&mut c, &s);
        self.store.put(Table::Containers, &c.id, &c)
    }

    /// UpdateContainerResources: new limits on the cgroup of a created or running container,
    /// kept in its record (ContainerStatus reports them). An exited container only has its
    /// record updated, as containerd does.
    pub async fn update_container(&self, id: &str, resources: spec::Resources) -> Result<()> {
        let view = self.container(id).await?;
        let mut c = view.record;
        let resources = c.spec.resources.merged(&resources);
        let mut applicable = resources.clone();
        hako_runtime::stats::drop_unsupported(&mut applicable);
        if matches!(
            view.state,
            ContainerState::Created | ContainerState::Running
        ) {
            let path = c.cgroups_path.clone();
            let r = applicable;
            tokio::task::spawn_blocking(move || hako_runtime::stats::update(&path, &r))
                .await
                .map_err(|e| Error::Internal(format!("update task: {e}")))?
                .map_err(|e| {
                    Error::InvalidArgument(format!("update resources of container {id}: {e}"))
                })?;
        }
        c.spec.resources = resources;
        self.store.put(Table::Containers, &c.id, &c)?;
        tracing::info!(container = %c.id, "container resources updated");
        Ok(())
    }

    /// RemoveContainer: force-removes a running one. Removing an unknown container succeeds.
    pub async fn remove_container(&self, id: &str) -> Result<()> {
        let c = match self.container_record(id) {
            Ok(c) => c,
            Err(Error::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        match self.pod_of(&c) {
            Ok(pod) if pod.state == PodState::Ready => {
                self.monitor(&pod).delete(&c.id, true).await?
            }
            // No monitor to delete it (stopped pod, or a monitor that died): its cgroup is ours
            // to clear. A dying process leaves its cgroup a moment later.
            _ => {
                for _ in 0..50 {
                    kill_cgroup(&c.cgroups_path);
                    if remove_cgroup(&c.cgroups_path) {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        self.remove_container_files(&c.id)?;
        self.store.delete(Table::Containers, &c.id)?;
        self.store.release(&c.spec.reservation(&c.pod_id))?;
        self.store.unpin(&c.id)?;
        tracing::info!(container = %c.id, "container removed");
        Ok(())
    }

    /// Current view of a container: live from its monitor while the pod runs.
    pub async fn container(&self, id: &str) -> Result<ContainerView> {
        let mut c = self.container_record(id)?;
        let mut pid = 0;
        if let Ok(pod) = self.pod_of(&c) {
            if pod.state == PodState::Ready {
                match self.monitor(&pod).state(&c.id).await {
                    Ok(s) => {
                        if s.status == pb::Status::Running as i32 {
                            pid = s.pid;
                        }
                        if apply_state(&mut c, &s) {
                            self.store.put(Table::Containers, &c.id, &c)?;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(container = %c.id, error = %chain(&e), "monitor unreachable")
                    }
                }
            }
        }
        Ok(ContainerView {
            state: c.state,
            started_at: c.started_at,
            exit: c.exit.clone(),
            record: c,
            pid,
        })
    }

    /// Every container, states refreshed with one call per running pod.
    pub async fn containers(&self) -> Result<Vec<ContainerView>> {
        let mut live: HashMap<String, pb::ContainerState> = HashMap::new();
        for pod in self
            .pods()?
            .into_iter()
            .filter(|p| p.state == PodState::Ready)
        {
            match self.monitor(&pod).info().await {
                Ok(info) => live.extend(info.containers.into_iter().map(|s| (s.id.clone(), s))),
                Err(e) => self.check_monitor(&pod, &e)?,
            }
        }
        // Read after the monitors: a monitor found gone has updated its containers' records.
        let mut recs: Vec<ContainerRecord> = self.store.all(Table::Containers)?;
        for c in recs.iter_mut() {
            if let Some(s) = live.get(&c.id) {
                if apply_state(c, s) {
                    self.store.put(Table::Containers, &c.id, c)?;
                }
            }
        }
        Ok(recs
            .into_iter()
            .map(|c| ContainerView {
                state: c.state,
                started_at: c.started_at,
                exit: c.exit.clone(),
                pid: 0,
                record: c,
            })
            .collect())
    }

    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout: Duration,
    ) -> Result<ExecOutput> {
        let c = self.container_record(id)?;
        let pod = self.pod_of(&c)?;
        if pod.state != PodState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                c.id
            )));
        }
        // The exec process joins the container's cgroups.
        let _warm = hako_runtime::cgroup_warm::hold();
        let r = self
            .monitor(&pod)
            .exec_sync(&c.id, cmd, timeout.as_millis() as i64)
            .await?;
        if r.timed_out {
            return Err(Error::DeadlineExceeded(format!(
                "command in container {} timed out after {} s",
                c.id,
                timeout.as_secs()
            )));
        }
        Ok(ExecOutput {
            stdout: r.stdout,
            stderr: r.stderr,
            exit_code: r.exit_code,
        })
    }

    pub async fn reopen_log(&self, id: &str) -> Result<()> {
        let c = self.container_record(id)?;
        let pod = self.pod_of(&c)?;
        let v = self.container(id).await?;
        if v.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                c.id
            )));
        }
        self.monitor(&pod).reopen_log(&c.id).await
    }
}

/// The largest Localhost seccomp profile read (Docker's default profile is about 20 KiB).
const SECCOMP_PROFILE_CAP: u64 = 1 << 20;

/// Where a container's CRI log goes: `log_path` below the pod's `log_directory`. A relative
/// path may not climb out (`..`); an absolute one is accepted only when it already lies below
/// the log directory. No log directory (or no path): no log.
fn container_log_path(log_directory: &str, log_path: &str) -> Result<PathBuf> {
    if log_path.is_empty() || log_directory.is_empty() {
        return Ok(PathBuf::new());
    }
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "log path {log_path:?} {why} (log directory {log_directory:?})"
        )))
    };
    let dir = Path::new(log_directory);
    let p = Path::new(log_path);
    if p.components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return bad("climbs out with \"..\"");
    }
    if p.is_absolute() {
        return match p.strip_prefix(dir) {
            Ok(rel) if !rel.as_os_str().is_empty() => Ok(p.to_path_buf()),
            _ => bad("is not below the pod's log directory"),
        };
    }
    Ok(dir.join(p))
}

/// CDI devices a container asks for: `cdi_devices`, then `cdi.k8s.io/*` annotations of the
/// container (comma-separated names), without repeats. Never the pod sandbox's annotations:
/// kubelet copies a pod's own metadata annotations there, so any pod author could name any
/// device; the container's annotations and `cdi_devices` come from device plugins and DRA.
fn cdi_requests(req: &ContainerSpecReq) -> Vec<String> {
    let from_annotations = |a: &BTreeMap<String, String>| -> Vec<String> {
        a.iter()
            .filter(|(k, _)| k.starts_with("cdi.k8s.io/"))
            .flat_map(|(_, v)| v.split(',').map(|d| d.trim().to_string()))
            .filter(|d| !d.is_empty())
            .collect()
    };
    let mut out: Vec<String> = Vec::new();
    for d in req
        .cdi_devices
        .iter()
        .cloned()
        .chain(from_annotations(&req.annotations))
    {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// The nodes a CRI device request names.
fn device_nodes(d: &DeviceReq) -> Result<Vec<spec::Device>> {
    hako_runtime::devices::from_host(&d.host_path, &d.container_path, &d.permissions).map_err(|e| {
        match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound(e.to_string()),
            _ => Error::InvalidArgument(e.to_string()),
        }
    })
}

/// A signal as images name it in STOPSIGNAL: "SIGQUIT", "QUIT", "3" or "SIGRTMIN+3".
pub fn parse_signal(s: &str) -> Option<i32> {
    let s = s.trim();
    if let Ok(n) = s.parse::<i32>() {
        return (1..=libc::SIGRTMAX()).contains(&n).then_some(n);
    }
    let up = s.to_ascii_uppercase();
    let name = if up.starts_with("SIG") {
        up
    } else {
        format!("SIG{up}")
    };
    // Offsets are plain decimal digits ("SIGRTMIN+-40" and "+" signs inside are not), and the
    // result must be a real-time signal of this kernel.
    let rt_range = libc::SIGRTMIN()..=libc::SIGRTMAX();
    let offset = |digits: &str| -> Option<i32> {
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse::<i32>().ok()
    };
    if let Some(rt) = name.strip_prefix("SIGRTMIN") {
        let off = if rt.is_empty() {
            0
        } else {
            offset(rt.strip_prefix('+')?)?
        };
        let n = libc::SIGRTMIN().checked_add(off)?;
        return rt_range.contains(&n).then_some(n);
    }
    if let Some(rt) = name.strip_prefix("SIGRTMAX") {
        let off = if rt.is_empty() {
            0
        } else {
            offset(rt.strip_prefix('-')?)?
        };
        let n = libc::SIGRTMAX().checked_sub(off)?;
        return rt_range.contains(&n).then_some(n);
    }
    name.parse::<nix::sys::signal::Signal>()
        .ok()
        .map(|s| s as i32)
}

/// Whether `pid` is still a hako pod monitor (not a reused pid).
/// SIGKILLs the processes whose command line names the pod: its monitor and its infra
/// process (which carries the monitor's command line).
fn kill_pod_processes(pod_id: &str) {
    let needle = format!("\"pod_id\":\"{pod_id}\"");
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        {
            tracing::warn!(pod = %pod_id, pid, "killing a process of the pod left without its monitor");
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The names of the directories in `dir` (none when it does not exist).
fn dir_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn monitor_alive(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == b"monitor"))
}

/// SIGKILLs every process in a container's cgroup (v1 controllers or v2).
fn kill_cgroup(cgroups_path: &str) {
    let rel = cgroups_path.trim_start_matches('/');
    for base in [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup",
    ] {
        if let Ok(procs) = std::fs::read_to_string(Path::new(base).join(rel).join("cgroup.procs")) {
            for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// Removes an empty cgroup from every hierarchy it exists in; true when none is left.
fn remove_cgroup(cgroups_path: &str) -> bool {
    let rel = cgroups_path.trim_start_matches('/');
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return true;
    };
    let mut bases: Vec<PathBuf> = hierarchies.flatten().map(|e| e.path()).collect();
    bases.push(PathBuf::from("/sys/fs/cgroup"));
    let mut all_gone = true;
    for base in bases {
        let p = base.join(rel);
        if p.is_dir() && std::fs::remove_dir(&p).is_err() {
            all_gone = false;
        }
    }
    all_gone
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

/// The pod's cgroup: kubelet's parent, or `/hako/<pod id>` when it gives none.
fn pod_cgroup(pod: &PodRecord) -> String {
    if pod.spec.cgroup_parent.is_empty() {
        format!("/hako/{}", pod.id)
    } else {
        // Checked at RunPodSandbox; a record from before that check keeps its old path.
        confined_cgroup_path(&pod.spec.cgroup_parent)
            .unwrap_or_else(|_| cgroupfs_path(&pod.spec.cgroup_parent))
    }
}

/// A cgroup parent as a cgroupfs path that stays below the cgroup root: `..` anywhere (or a
/// slice name that would make one) is refused, empty and `.` components are dropped. A
/// parent outside the tree would leave the pod's containers without their limits.
pub fn confined_cgroup_path(parent: &str) -> std::result::Result<String, &'static str> {
    if parent.contains('\0') {
        return Err("contains a NUL byte");
    }
    let path = cgroupfs_path(parent);
    let mut clean = String::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err("leaves the cgroup tree (\"..\")"),
            c => {
                clean.push('/');
                clean.push_str(c);
            }
        }
    }
    if clean.is_empty() {
        return Err("is the cgroup root itself");
    }
    Ok(clean)
}

/// A kubelet cgroup parent in systemd form (`kubepods-burstable-pod1.slice`) as a cgroupfs
/// path (`/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice`).
pub fn cgroupfs_path(parent: &str) -> String {
    if !parent.ends_with(".slice") || parent.contains('/') {
        return if parent.starts_with('/') {
            parent.to_string()
        } else {
            format!("/{parent}")
        };
    }
    let name = parent.trim_end_matches(".slice");
    let mut path = String::new();
    let mut prefix = String::new();
    for part in name.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        path.push('/');
        path.push_str(&prefix);
        path.push_str(".slice");
    }
    path
}

/// resolv.conf, hostname and hosts for the pod's containers.
fn write_pod_files(dir: &Path, spec: &PodSpec) -> Result<()> {
    let resolv = match &spec.dns {
        Some(d) if !d.servers.is_empty() || !d.searches.is_empty() || !d.options.is_empty() => {
            let mut s = String::new();
            if !d.searches.is_empty() {
                s.push_str(&format!("search {}\n", d.searches.join(" ")));
            }
            for n in &d.servers {
                s.push_str(&format!("nameserver {n}\n"));
            }
            if !d.options.is_empty() {
                s.push_str(&format!("options {}\n", d.options.join(" ")));
            }
            s
        }
        _ => std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
    };
    let hostname = if spec.hostname.is_empty() {
        nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default()
    } else {
        spec.hostname.clone()
    };
    let hosts = if spec.network == NsMode::Node {
        std::fs::read_to_string("/etc/hosts").unwrap_or_default()
    } else {
        format!("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n")
    };
    for (file, content) in [
        ("resolv.conf", resolv),
        ("hostname", format!("{hostname}\n")),
        ("hosts", hosts),
    ] {
        let p = dir.join(file);
        std::fs::write(&p, content).map_err(|e| Error::io("write", &p, e))?;
        // Bind-mounted into every container, read by whatever user it runs as.
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .map_err(|e| Error::io("change mode of", &p, e))?;
    }
    Ok(())
}

/// The AppArmor profile of container `name`, decided as containerd's CRI decides it (see
/// `hako_runtime::apparmor`); a requested profile this host cannot apply is an error.
fn apparmor_profile(sec: &Security, name: &str) -> Result<Option<String>> {
    use hako_runtime::apparmor::{self, ApplyError, Refusal};
    let decision = apparmor::decide(
        sec.apparmor.as_ref(),
        sec.privileged,
        apparmor::host_enabled(),
    )
    .map_err(|e| match e {
        Refusal::NotSupported(_) => Error::FailedPrecondition(format!("container {name}: {e}")),
        Refusal::EmptyName => Error::InvalidArgument(format!("container {name}: {e}")),
    })?;
    apparmor::apply(&decision).map_err(|e| match e {
        ApplyError::NotLoaded(_) => Error::NotFound(format!("container {name}: {e}")),
        ApplyError::Host(_) => Error::FailedPrecondition(format!("container {name}: {e}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_paths_stay_below_the_log_directory() {
        let ok = |d: &str, p: &str| container_log_path(d, p).unwrap();
        assert_eq!(
            ok("/var/log/pods/a", "c/0.log"),
            Path::new("/var/log/pods/a/c/0.log")
        );
        assert_eq!(
            ok("/var/log/pods/a", "/var/log/pods/a/c/0.log"),
            Path::new("/var/log/pods/a/c/0.log")
        );
        assert_eq!(ok("", "c/0.log"), Path::new(""));
        assert_eq!(ok("/var/log/pods/a", ""), Path::new(""));
        for bad in [
            "../b/0.log",
            "c/../../0.log",
            "/etc/passwd",
            "/var/log/pods/ab/0.log",
            "/var/log/pods/a",
            "/var/log/pods/a/../b/0.log",
        ] {
            let e = container_log_path("/var/log/pods/a", bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e:?}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn cgroup_parents_stay_in_the_tree() {
        assert_eq!(
            confined_cgroup_path("/kubepods//burstable/./pod1/").unwrap(),
            "/kubepods/burstable/pod1"
        );
        assert_eq!(
            confined_cgroup_path("kubepods-burstable-pod1.slice").unwrap(),
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"
        );
        for bad in ["/kubepods/../../escape", "..", "/a/..", "/", "//", "a\0b"] {
            assert!(confined_cgroup_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stop_signals_are_parsed_strictly() {
        let (min, max) = (libc::SIGRTMIN(), libc::SIGRTMAX());
        for (s, want) in [
            ("SIGQUIT", Some(libc::SIGQUIT)),
            ("quit", Some(libc::SIGQUIT)),
            ("3", Some(3)),
            ("SIGRTMIN", Some(min)),
            ("SIGRTMIN+3", Some(min + 3)),
            ("SIGRTMAX-2", Some(max - 2)),
            ("SIGRTMAX", Some(max)),
        ] {
            assert_eq!(parse_signal(s), want, "{s}");
        }
        for bad in [
            "SIGRTMIN+-40",
            "SIGRTMIN-1",
            "SIGRTMIN++1",
            "SIGRTMIN+",
            "SIGRTMIN+2147483647",
            "SIGRTMIN+99999999999",
            "SIGRTMAX--5",
            "SIGRTMAX-+5",
            "SIGRTMAX-99",
            "SIGRTMIN+99",
            "0",
            "-9",
            "65",
            "99999999999",
            "SIGNOPE",
            "",
        ] {
            assert_eq!(parse_signal(bad), None, "{bad}");
        }
    }

    #[test]
    fn systemd_slices_become_cgroupfs_paths() {
        assert_eq!(
            cgroupfs_path("kubepods-burstable-pod12.slice"),
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12.slice"
        );
        assert_eq!(
            cgroupfs_path("/kubepods/besteffort/pod1"),
            "/kubepods/besteffort/pod1"
        );
        assert_eq!(cgroupfs_path("kubepods"), "/kubepods");
    }

    #[test]
    fn pod_files_carry_dns_and_hostname() {
        let d = tempfile::tempdir().unwrap();
        let spec = PodSpec {
            hostname: "web-0".into(),
            dns: Some(Dns {
                servers: vec!["10.10.10.10".into()],
                searches: vec!["google.com".into()],
                options: vec!["ndots:8".into()],
            }),
            ..Default::default()
        };
        write_pod_files(d.path(), &spec).unwrap();
        let r = std::fs::read_to_string(d.path().join("resolv.conf")).unwrap();
        assert_eq!(
            r,
            "search google.com\nnameserver 10.10.10.10\noptions ndots:8\n"
        );
        assert_eq!(
            std::fs::read_to_string(d.path().join("hostname")).unwrap(),
            "web-0\n"
        );
        assert!(std::fs::read_to_string(d.path().join("hosts"))
            .unwrap()
            .contains("web-0"));
    }
}
