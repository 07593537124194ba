//! Recovery: what the daemon finds at start (as containerd's restart reconcile) and a pod
//! monitor found gone at any time.
//!
//! At start the store is a hint: monitors are asked what they hold. Each monitor keeps a copy
//! of the daemon's records of its pod and containers (`KeepRecord`), so a pod whose record the
//! store lost (an empty, deleted or damaged `meta.db`) is adopted from its running monitor
//! ([`adopt_lost_records`], before the image GC so its layers stay pinned), never destroyed.
//! What a crash in the middle of a create left without a record anywhere is released; what no
//! live monitor holds is released only when it is provably orphaned (its monitor is not
//! listening); cached CNI attachments no pod owns are deleted. A monitor found gone (at start
//! or by the relist) turns its pod NotReady. Below the lifecycle rooms: the container list
//! (container.rs) reports monitors it finds gone here.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::host::{dir_names, kill_cgroup, kill_pod_processes, remove_cgroup};
use super::monitor_client::{MonitorClient, ADOPT_DEADLINE};
use super::{
    apply_state, rootfs, ContainerRecord, ContainerState, ExitInfo, PodRecord, PodState, Runtime,
};
use crate::error::{chain, Error, Result};
use crate::store::{Store, Table};
use futures::StreamExt;
use hako_proto::monitor as pb;

/// Creates an earlier daemon left under way in their pods' monitors, found at start: pod id
/// and container ids. Their files and layer pins are kept until they end.
#[derive(Debug, Default)]
pub struct UnfinishedCreates(Vec<(String, Vec<String>)>);

impl UnfinishedCreates {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// At start, before anything collects what no record owns: rebuilds from the pods' monitors
/// the records the store lost. A monitor under `<state>/pods/<id>` that answers for pod `<id>`
/// with a kept record gets its pod record back (its pid and namespaces as the monitor reports
/// them), and each container it holds with a kept record gets its record back (in the state
/// the monitor reports), with their name reservations and image pins. Logged; a record that
/// cannot be read is reported and skipped (what it names is then left alone, not released).
/// (An associated function: it runs before the `Runtime` exists, see `Daemon::open`.)
pub(super) async fn adopt_lost_records(store: &Store, state_dir: &Path) -> Result<()> {
    let mut ids = dir_names(&state_dir.join("pods"));
    ids.sort();
    // All asked at once (bounded), each within a short deadline, and handled as they answer:
    // a stuck monitor delays the start by one deadline, not the pods after it.
    let mut answers = futures::stream::iter(ids.into_iter().map(|id| {
        let monitor = MonitorClient::new(state_dir.join("pods").join(&id).join("monitor.sock"));
        async move {
            if !monitor.listening() {
                return (id, None);
            }
            let info = monitor.info_within(ADOPT_DEADLINE).await;
            (id, Some(info))
        }
    }))
    .buffer_unordered(START_CONCURRENCY);
    while let Some((id, info)) = answers.next().await {
        let info = match info {
            None => continue,
            Some(Ok(info)) if info.pod_id == id => info,
            Some(Ok(info)) => {
                tracing::error!(pod = %id, answered_for = %info.pod_id, "the monitor in a pod's directory answers for another pod: left alone");
                continue;
            }
            Some(Err(e)) => {
                tracing::error!(pod = %id, error = %chain(&e), "pod monitor did not answer at start: its pod is left alone");
                continue;
            }
        };
        adopt_pod(store, &id, &info)?;
    }
    Ok(())
}

/// How many monitors the start asks at once.
const START_CONCURRENCY: usize = 16;

/// One pod's adoption from its monitor's answer (see [`adopt_lost_records`]).
fn adopt_pod(store: &Store, id: &str, info: &pb::InfoResponse) -> Result<()> {
    let id = id.to_string();
    let known = store.get::<PodRecord>(Table::Pods, &id)?;
    if known.is_none() {
        if info.pod_record.is_empty() {
            // The start did not finish: `reconcile` releases it.
            return Ok(());
        }
        let mut pod: PodRecord = match crate::store::decode_record(
            Table::Pods,
            &id,
            &info.pod_record,
        ) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(pod = %id, error = %chain(&e), "the record a pod monitor kept cannot be read: pod left alone");
                return Ok(());
            }
        };
        pod.monitor_pid = info.pid;
        pod.namespaces = info.namespaces.clone().into_iter().collect();
        pod.state = PodState::Ready;
        if let Some(other) = store.reserve(&pod.spec.reservation(), &id)? {
            tracing::error!(pod = %id, name = %pod.spec.reservation(), holder = %other, "an adopted pod's name is reserved by another object");
        }
        store.put(Table::Pods, &id, &pod)?;
        tracing::warn!(pod = %id, name = %pod.spec.name, namespace = %pod.spec.namespace, monitor_pid = info.pid, "adopted a running pod whose record was lost, from its monitor");
    }
    adopt_containers(store, &id, info)
}

/// The containers a pod's monitor holds and kept records of, where the store has none.
fn adopt_containers(store: &Store, pod_id: &str, info: &pb::InfoResponse) -> Result<()> {
    for s in &info.containers {
        let Some(bytes) = info.container_records.get(&s.id) else {
            continue;
        };
        if store
            .get::<ContainerRecord>(Table::Containers, &s.id)?
            .is_some()
        {
            continue;
        }
        let mut c: ContainerRecord = match crate::store::decode_record(
            Table::Containers,
            &s.id,
            bytes,
        ) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(container = %s.id, error = %chain(&e), "the record a pod monitor kept cannot be read: container left alone");
                continue;
            }
        };
        apply_state(&mut c, s);
        if let Some(other) = store.reserve(&c.spec.reservation(pod_id), &c.id)? {
            tracing::error!(container = %c.id, holder = %other, "an adopted container's name is reserved by another object");
        }
        store.pin(&c.id, &c.chain_ids)?;
        store.put(Table::Containers, &c.id, &c)?;
        tracing::warn!(container = %c.id, pod = %pod_id, name = %c.spec.name, state = ?c.state, "adopted a container whose record was lost, from its pod's monitor");
    }
    Ok(())
}

impl Runtime {
    /// See [`adopt_lost_records`].
    pub async fn adopt_lost_records(store: &Store, state_dir: &Path) -> Result<()> {
        adopt_lost_records(store, state_dir).await
    }

    /// After a failed call to a pod's monitor: if the monitor process is gone, the pod is
    /// reported NotReady, its containers Exited with the exit their monitor recorded, or
    /// Unknown when it recorded none, and what the monitor held is released. Logged, never
    /// silent. A monitor that is alive but did not answer is left alone.
    ///
    /// For callers that hold none of the pod's locks (reads: status, lists, the reconcile). A
    /// pod whose lock someone holds is being changed: a stop ends its monitor itself and
    /// records what it finds, so a read racing it leaves the pod to that change (and does not
    /// log a monitor "lost" on every relist during an ordinary stop).
    pub(super) fn check_monitor(&self, pod: &PodRecord, err: &Error) -> Result<()> {
        if self.only_silent(pod, err) {
            return Ok(());
        }
        let Some(_guard) = self.object_locks.try_exclusive(&pod.id) else {
            tracing::debug!(pod = %pod.id, "pod monitor not answering while the pod is being changed");
            return Ok(());
        };
        self.monitor_gone(pod, err)
    }

    /// The ids of pods whose monitor stopped listening, as their watchers find them; `None`
    /// after the first call. Each is for [`Runtime::release_lost_monitor`].
    pub fn lost_monitors(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<String>> {
        self.lost.lock().expect("lost poisoned").take()
    }

    /// A pod whose watcher found its monitor no longer listening: once no change of the pod
    /// is under way, recovery as for any read that finds it gone (containers Exited or
    /// Unknown, namespaces and mounts released, pod NotReady; its network stays leased until
    /// StopPodSandbox). A stop that ran meanwhile, or a monitor that answers again, leaves
    /// nothing to do.
    pub async fn release_lost_monitor(&self, pod_id: &str) -> Result<()> {
        let _guard = self.object_locks.exclusive(pod_id).await;
        let Some(pod) = self.store.get::<PodRecord>(Table::Pods, pod_id)? else {
            return Ok(());
        };
        let Some(why) = self.live.get(pod_id).and_then(|l| l.gone) else {
            return Ok(());
        };
        if pod.state != PodState::Ready {
            return Ok(());
        }
        self.check_monitor_locked(&pod, &Error::Unavailable(why))
    }

    /// [`Runtime::check_monitor`] for a caller that holds the pod's lock (shared or
    /// exclusive): no stop of the pod can be under way.
    pub(super) fn check_monitor_locked(&self, pod: &PodRecord, err: &Error) -> Result<()> {
        if self.only_silent(pod, err) {
            return Ok(());
        }
        self.monitor_gone(pod, err)
    }

    /// Whether the pod's monitor is still there: it answered `err` itself, or it still listens
    /// and only did not answer (logged, left alone).
    fn only_silent(&self, pod: &PodRecord, err: &Error) -> bool {
        if answered(err) {
            return true;
        }
        let listening = self.monitor(pod).listening();
        if listening {
            tracing::warn!(pod = %pod.id, error = %chain(err), "pod monitor did not answer");
        }
        listening
    }

    /// A monitor that no longer listens, with the pod's lock held: lost, unless the record
    /// (read again) says a stop that finished since made the pod NotReady or a removal took it.
    fn monitor_gone(&self, pod: &PodRecord, err: &Error) -> Result<()> {
        match self.store.get::<PodRecord>(Table::Pods, &pod.id)? {
            Some(p) if p.state == PodState::Ready && p.monitor_pid == pod.monitor_pid => {}
            _ => return Ok(()),
        }
        tracing::error!(pod = %pod.id, name = %pod.spec.name, monitor_pid = pod.monitor_pid, error = %chain(err), "pod monitor is gone: pod marked not ready");
        self.monitor_lost(pod)
    }

    fn monitor_lost(&self, pod: &PodRecord) -> Result<()> {
        let dir = self.pod_dir(&pod.id);
        for c in self.containers_of(&pod.id)? {
            if c.state == ContainerState::Exited {
                continue;
            }
            let recorded = hako_runtime::monitor::recorded_exit(&dir, &c.id);
            if recorded.is_none() {
                // Orphaned processes would run on unwatched: end them.
                kill_cgroup(&c.cgroups_path);
            }
            // Only while the record exists: a removal racing this stays a removal.
            self.store
                .update(Table::Containers, &c.id, |c: &mut ContainerRecord| {
                    if c.state == ContainerState::Exited {
                        return false;
                    }
                    match &recorded {
                        Some(e) => {
                            c.state = ContainerState::Exited;
                            c.exit = Some(ExitInfo {
                                code: e.code,
                                signal: e.signal,
                                finished_at: e.finished_at,
                                oom_killed: e.oom_killed,
                            });
                        }
                        None => c.state = ContainerState::Unknown,
                    }
                    true
                })?;
            let _ = rootfs::unmount_bundle(&self.bundle_dir(&c.id));
        }
        // The pod's init died with its monitor (PR_SET_PDEATHSIG): only the pins are left. The
        // network one stays for CNI DEL at StopPodSandbox: plugins clean up inside the
        // namespace (and some fail DEL without it), so it must not be gone before.
        hako_runtime::monitor::unpin_all_but_network(&dir);
        self.mark_not_ready(&pod.id)
    }

    /// At start (after [`adopt_lost_records`]): pods whose monitor died while the daemon was
    /// down are reported as such, and monitors get copies of records they lack (kept by an
    /// older hako, or a crash between the store and the copy).
    ///
    /// Also releases what a crash in the middle of a RunPodSandbox or CreateContainer made
    /// before its record was written (a monitor and its namespaces, a container in a live pod,
    /// an overlay mount, directories, a name reservation, an image pin), so kubelet's retry
    /// under the same name succeeds instead of finding the name reserved by an object nobody
    /// can list or remove. Each release is logged.
    pub async fn reconcile(&self) -> Result<UnfinishedCreates> {
        let pods: HashMap<String, Arc<PodRecord>> = self
            .pods()?
            .into_iter()
            .map(|p| (p.id.clone(), p))
            .collect();
        let records: HashMap<String, ContainerRecord> = self
            .store
            .all::<ContainerRecord>(Table::Containers)?
            .into_iter()
            .map(|c| (c.id.clone(), c))
            .collect();
        let containers: HashSet<String> = records.keys().cloned().collect();
        // Asked all at once (bounded), each within a short deadline: a stuck monitor delays
        // the start by one deadline.
        let ready: Vec<&Arc<PodRecord>> = pods
            .values()
            .filter(|p| p.state == PodState::Ready)
            .collect();
        let infos: Vec<_> = futures::stream::iter(ready.iter().map(|pod| {
            let monitor = self.monitor(pod);
            async move { monitor.info_within(ADOPT_DEADLINE).await }
        }))
        .buffered(START_CONCURRENCY)
        .collect()
        .await;
        // Set when a monitor may hold a container no record names (it did not answer, or
        // did not delete one): container files no record owns are then left for a later start.
        let mut unsure = false;
        let mut under_way = UnfinishedCreates::default();
        for (pod, info) in ready.into_iter().zip(infos) {
            let monitor = self.monitor(pod);
            let info = match info {
                Ok(info) => info,
                Err(e) => {
                    self.check_monitor(pod, &e)?;
                    // Still Ready: its monitor only did not answer (a gone one, after a
                    // reboot say, has turned the pod NotReady and holds nothing).
                    if self
                        .store
                        .get::<PodRecord>(Table::Pods, &pod.id)?
                        .is_some_and(|p| p.state == PodState::Ready)
                    {
                        unsure = true;
                    }
                    continue;
                }
            };
            if info.pod_record.is_empty() {
                self.keep_record(&monitor, &pod.id, "", &**pod).await;
            }
            if !info.creating.is_empty() {
                // A create the last daemon left under way: its bundle and layer pins are in
                // use (the monitor deletes it when its answer finds no caller), and released
                // once it has ended (`release_finished_creates`).
                tracing::warn!(pod = %pod.id, containers = ?info.creating, "creates under way in a pod monitor: their files are kept until they end");
                under_way.0.push((pod.id.clone(), info.creating.clone()));
            }
            for c in &info.containers {
                match records.get(&c.id) {
                    Some(rec) => {
                        // Exits while the daemon was down are in the records before it serves.
                        self.store
                            .update(Table::Containers, &c.id, |r| apply_state(r, c))?;
                        if !info.container_records.contains_key(&c.id) {
                            self.keep_record(&monitor, &pod.id, &c.id, rec).await;
                        }
                    }
                    None => {
                        tracing::warn!(pod = %pod.id, container = %c.id, "deleting a container whose create did not finish");
                        // A failure must not keep the node's runtime down: the container
                        // stays in its monitor (and its files), and the next start tries again.
                        if let Err(e) = monitor.delete(&c.id, true).await {
                            tracing::error!(pod = %pod.id, container = %c.id, error = %chain(&e), "could not delete a container whose create did not finish: left in its pod monitor");
                            unsure = true;
                        }
                    }
                }
            }
        }
        // From now on each Ready pod's monitor is followed (live.rs).
        for pod in self.pods()? {
            if pod.state == PodState::Ready {
                self.watch(&pod);
            }
        }
        let keep: HashSet<String> = under_way
            .0
            .iter()
            .flat_map(|(_, ids)| ids.clone())
            .collect();
        let left_running = self
            .release_orphans(&pods, &containers, &keep, unsure)
            .await?;
        self.network_gc(&left_running).await;
        Ok(under_way)
    }

    /// Releases the files and layer pins of the creates the last daemon left under way
    /// ([`Runtime::reconcile`]) that have ended since: deleted by their monitor (their answer
    /// found no caller), or with their monitor gone. A create its monitor finished but still
    /// holds is deleted first, as at start. What is still under way is returned, to be asked
    /// again later.
    pub async fn release_finished_creates(&self, pending: UnfinishedCreates) -> UnfinishedCreates {
        let mut left = UnfinishedCreates::default();
        for (pod, ids) in pending.0 {
            let monitor = MonitorClient::new(self.pod_dir(&pod).join("monitor.sock"));
            let info = monitor.states().await;
            let gone = info.is_err() && !monitor.listening();
            let mut still = Vec::new();
            for id in ids {
                // Ids are new for every create: no record can have taken this one since. A
                // record's files are never released here, nor any while the store cannot say.
                match self.store.get::<ContainerRecord>(Table::Containers, &id) {
                    Ok(None) => {}
                    Ok(Some(_)) => continue,
                    Err(e) => {
                        tracing::warn!(container = %id, error = %chain(&e), "the store could not be read for a create that did not finish: asked again later");
                        still.push(id);
                        continue;
                    }
                }
                let ended = match &info {
                    Ok(info) if info.creating.contains(&id) => false,
                    Ok(info) if info.containers.iter().any(|c| c.id == id) => {
                        match monitor.delete(&id, true).await {
                            Ok(()) => true,
                            Err(e) => {
                                tracing::warn!(pod = %pod, container = %id, error = %chain(&e), "could not delete a container whose create did not finish: asked again later");
                                false
                            }
                        }
                    }
                    Ok(_) => true,
                    // Gone: its monitor no longer holds or makes anything.
                    Err(_) => gone,
                };
                if !ended {
                    still.push(id);
                    continue;
                }
                // What the create made may outlive it (an init cloned before its helper died,
                // or one in a PID namespace of its own whose monitor is gone): it must not run
                // on over the files released below.
                if let Some(cgroups_path) = self.bundle_cgroups_path(&id) {
                    super::container::clear_cgroup(&cgroups_path).await;
                }
                match self.remove_container_files(&id) {
                    Ok(()) => {
                        tracing::info!(pod = %pod, container = %id, "released the files of a create the last daemon left under way");
                        if let Err(e) = self.store.unpin(&id) {
                            tracing::error!(container = %id, error = %chain(&e), "could not release the layers of a create that did not finish: released at the next start");
                        }
                    }
                    Err(e) => {
                        tracing::error!(container = %id, error = %chain(&e), "could not remove the files of a create that did not finish: left in place until the next start");
                    }
                }
            }
            if !still.is_empty() {
                left.0.push((pod, still));
            }
        }
        left
    }

    /// The cgroups path in a container's bundle spec (hako's own file), if it is there.
    fn bundle_cgroups_path(&self, id: &str) -> Option<String> {
        let config = std::fs::read(self.bundle_dir(id).join("config.json")).ok()?;
        let spec: serde_json::Value = serde_json::from_slice(&config).ok()?;
        spec.pointer("/linux/cgroupsPath")?
            .as_str()
            .filter(|p| !p.is_empty())
            .map(str::to_string)
    }

    /// Gives a pod's monitor a copy of a record (see `adopt_lost_records`). A failure is
    /// logged, not returned: the store has the record, only its spare copy is missing (the
    /// next start's reconcile gives it again). Copies are taken when a pod or container is
    /// created; an adopted record has the monitor's state, but changes made only to the
    /// record since (updated resources) are not in the copy. A record the monitor refuses
    /// (over its size cap) never will be kept: an error, but the pod or container is created
    /// and recorded by then, so the call that made it still succeeds.
    pub(super) async fn keep_record<T: serde::Serialize>(
        &self,
        monitor: &MonitorClient,
        pod: &str,
        container: &str,
        record: &T,
    ) {
        match monitor
            .keep_record(container, crate::store::encode_record(record))
            .await
        {
            Ok(()) => {}
            Err(e @ Error::InvalidArgument(_)) => {
                tracing::error!(pod, container, error = %chain(&e), "the pod monitor refused to keep a copy of the record: it cannot be adopted if the store loses it");
            }
            Err(e) => {
                tracing::warn!(pod, container, error = %chain(&e), "the pod monitor did not take a copy of the record: it cannot be adopted if the store loses it");
            }
        }
    }

    /// The part of `reconcile` that needs no record: pod directories, bundles and layers,
    /// reservations and pins no record owns. A pod directory whose monitor still listens is
    /// not orphaned: one that kept no record is an unfinished start and is shut down; one that
    /// did not answer is left alone, and so are all record-less container files then (they may
    /// be its containers'), as they are when `unsure` (a recorded pod's monitor did not
    /// answer, or kept a record-less container). Returns the pods so left running.
    async fn release_orphans(
        &self,
        pods: &HashMap<String, Arc<PodRecord>>,
        containers: &HashSet<String>,
        under_way: &HashSet<String>,
        mut unsure: bool,
    ) -> Result<HashSet<String>> {
        let mut left_running = HashSet::new();
        for id in dir_names(&self.state_dir.join("pods")) {
            if pods.contains_key(&id) {
                continue;
            }
            let dir = self.pod_dir(&id);
            let monitor = MonitorClient::new(dir.join("monitor.sock"));
            if monitor.listening() {
                match monitor.info_within(ADOPT_DEADLINE).await {
                    Ok(info) if info.pod_id == id && info.pod_record.is_empty() => {
                        tracing::warn!(pod = %id, "releasing a pod sandbox whose start did not finish");
                        if !monitor.shutdown().await {
                            kill_pod_processes(&dir);
                        }
                    }
                    _ => {
                        tracing::error!(pod = %id, "a live pod monitor holds a pod that has no record and could not be adopted: left running, with every container file no record owns");
                        unsure = true;
                        left_running.insert(id);
                        continue;
                    }
                }
            } else {
                tracing::warn!(pod = %id, "releasing the files of a pod whose monitor is gone and whose record was lost");
            }
            hako_runtime::monitor::unpin_namespaces(&dir);
            if let Err(e) = std::fs::remove_dir_all(&dir) {
                tracing::warn!(pod = %id, dir = %dir.display(), error = %e, "could not remove the directory of a released pod: the next start tries again");
            }
            // Its monitor is gone: what runs in hako's container cgroups below it is orphaned.
            let cgroup = format!("/hako/{id}");
            self.remove_leftover_container_cgroups(&id, &cgroup).await;
            remove_cgroup(&cgroup);
        }
        if !unsure {
            // A container's bundle and layer dirs share its id: each id once.
            let dirs: std::collections::BTreeSet<String> =
                dir_names(&self.state_dir.join("containers"))
                    .into_iter()
                    .chain(dir_names(&self.root_dir.join("containers")))
                    .collect();
            for id in dirs
                .into_iter()
                .filter(|id| !containers.contains(id) && !under_way.contains(id))
            {
                tracing::warn!(container = %id, "removing the files of a container whose create did not finish");
                // What its create made may have outlived its monitor (an init in a PID
                // namespace of its own): it must not run on over the files removed here.
                if let Some(cgroups_path) = self.bundle_cgroups_path(&id) {
                    super::container::clear_cgroup(&cgroups_path).await;
                }
                // One container's files that cannot go must not keep the node's runtime
                // down: they stay, said once per start, and the next start tries again.
                if let Err(e) = self.remove_container_files(&id) {
                    tracing::error!(container = %id, error = %crate::error::chain(&e), "could not remove the files of a container whose create did not finish: left in place");
                }
            }
        }
        for (name, holder) in self.store.reservations()? {
            if !pods.contains_key(&holder) && !containers.contains(&holder) {
                tracing::warn!(
                    name,
                    holder,
                    "releasing a name reserved by an unfinished create"
                );
                self.store.release(&name, &holder)?;
            }
        }
        // Layers stay pinned for a container that may still be in a monitor (its overlay is
        // mounted on them) until a start finds out.
        for owner in self.store.pin_owners()? {
            if !containers.contains(&owner) && !under_way.contains(&owner) && !unsure {
                self.store.unpin(&owner)?;
            }
        }
        Ok(left_running)
    }

    /// At start: running pods' attachments are CHECKed; attachments no pod owns (a pod removed
    /// while its DEL failed, state lost) are deleted, but not those of the pods `left_running`
    /// (no record, a monitor that did not answer: see `release_orphans`); with CNI 1.1 the
    /// plugins are also told which attachments are valid. Failures are logged: they must not
    /// keep the daemon from starting.
    async fn network_gc(&self, left_running: &HashSet<String>) {
        let pods: HashMap<String, Arc<PodRecord>> = match self.pods() {
            Ok(p) => p.into_iter().map(|p| (p.id.clone(), p)).collect(),
            Err(_) => return,
        };
        let mut valid = Vec::new();
        let (cached, unreadable) = self.network.cni.cached();
        let owned = |id: &str| pods.contains_key(id) || left_running.contains(id);
        for (id, ifname) in unreadable {
            if owned(&id) {
                // Its stop DELs it with the pod's own attachment.
                valid.push((id, ifname));
                continue;
            }
            match self.network.cni.del(&id, &ifname, None).await {
                Ok(()) => {
                    tracing::info!(pod = %id, "released the network of a pod that no longer exists (its CNI result cache entry did not parse)")
                }
                Err(e) => tracing::warn!(pod = %id, error = %chain(&e), "network GC: DEL failed"),
            }
        }
        for c in cached {
            let id = c.attachment.container_id.clone();
            if owned(&id) {
                valid.push((id.clone(), c.attachment.ifname.clone()));
                let Some(pod) = pods.get(&id) else {
                    continue;
                };
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
}

/// An error the monitor answered with (the call's own failure: an exec that could not be
/// set up, say): the monitor is there. Only a call it did not answer (`UNAVAILABLE` from the
/// connection, `DEADLINE_EXCEEDED`) says anything about it.
fn answered(err: &Error) -> bool {
    !matches!(err, Error::Unavailable(_) | Error::DeadlineExceeded(_))
}
