//! Recovery: what the daemon finds at start (as containerd's restart reconcile) and a pod
//! monitor found gone at any time.
//!
//! At start the store is a hint: monitors are asked what they hold, what a crash in the middle
//! of a create left without a record is released, and cached CNI attachments no pod owns are
//! deleted. A monitor found gone (at start or by the relist) turns its pod NotReady. Below the
//! lifecycle rooms: the container list (container.rs) reports monitors it finds gone here.

use std::collections::{HashMap, HashSet};

use super::host::{dir_names, kill_cgroup, kill_pod_processes, monitor_alive, remove_cgroup};
use super::monitor_client::MonitorClient;
use super::{rootfs, ContainerRecord, ContainerState, ExitInfo, PodRecord, PodState, Runtime};
use crate::error::{chain, Error, Result};
use crate::store::Table;

impl Runtime {
    /// After a failed call to a pod's monitor: if the monitor process is gone, the pod is
    /// reported NotReady, its containers Exited with the exit their monitor recorded, or
    /// Unknown when it recorded none, and what the monitor held is released. Logged, never
    /// silent. A monitor that is alive but did not answer is left alone.
    pub(super) fn check_monitor(&self, pod: &PodRecord, err: &Error) -> Result<()> {
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
}
