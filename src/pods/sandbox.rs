//! The sandbox room: RunPodSandbox, StopPodSandbox and RemovePodSandbox, a pod's status and
//! the list (a pod whose monitor does not answer within the read deadline is reported
//! NotReady, with the reason), and the files its containers get (resolv.conf, hostname,
//! hosts).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hako_proto::monitor as pb;
use hako_runtime::monitor::{NamespaceSet, Options as MonitorOptions};

use super::host::{
    container_cgroup_ids, end_cgroup, kill_pod_processes, monitor_gone, now_nanos, remove_cgroup,
    remove_container_cgroups,
};
use super::monitor_client::{self, MonitorClient};
use super::spec::{confined_cgroup_path, pod_cgroup};
use super::{
    apply_state, new_id, rootfs, ContainerRecord, ContainerState, ContainerView, ExitInfo, NsMode,
    PodRecord, PodSpec, PodState, PodView, Runtime, Undo,
};
use crate::error::{chain, Error, Result};
use crate::network::IFNAME;
use crate::store::{Table, RECORD_VERSION};

impl Runtime {
    /// PodSandboxStatus: the pod as its monitor reports it now (within the read deadline).
    pub async fn pod_view(&self, id: &str) -> Result<PodView> {
        let pod = self.pod(id)?;
        let (mut pods, _) = self.views_of(vec![Arc::new(pod)], false).await?;
        pods.pop()
            .ok_or_else(|| Error::NotFound(format!("pod sandbox {id} not found")))
    }

    /// ListPodSandbox: every pod, its monitor asked along with all the others.
    pub async fn pod_views(&self) -> Result<Vec<PodView>> {
        Ok(self.views_of(self.pods()?, false).await?.0)
    }

    /// Views of `pods` after one round of reads of their monitors, and (when `containers`)
    /// of every container. Records are read again after the reads: a monitor found gone has
    /// turned its pod NotReady and a pod removed meanwhile is left out.
    pub(super) async fn views_of(
        &self,
        pods: Vec<Arc<PodRecord>>,
        containers: bool,
    ) -> Result<(Vec<PodView>, Vec<ContainerView>)> {
        let survey = self.survey(&pods).await?;
        let mut views = Vec::with_capacity(pods.len());
        for p in pods {
            let record = match self.store.get_shared::<PodRecord>(Table::Pods, &p.id)? {
                Some(r) => r,
                None => continue,
            };
            // Not kept in the record: the pod is Ready again once its monitor answers. The
            // survey has logged it (recovery.rs, `check_monitor`).
            let unanswered = survey.unanswered.get(&p.id).cloned();
            let state = match unanswered {
                Some(_) => PodState::NotReady,
                None => record.state,
            };
            views.push(PodView {
                record,
                state,
                unanswered,
            });
        }
        let containers = if containers {
            self.container_views(&survey)?
        } else {
            Vec::new()
        };
        Ok((views, containers))
    }

    /// RunPodSandbox. A retry of a pod that was created returns it; a failed attempt leaves
    /// nothing behind.
    pub async fn run_pod(&self, spec: PodSpec) -> Result<String> {
        if spec.name.is_empty() || spec.uid.is_empty() || spec.namespace.is_empty() {
            return Err(Error::InvalidArgument(
                "pod sandbox metadata needs name, uid and namespace".into(),
            ));
        }
        // The kernel takes at most 64 bytes (sethostname), and the name is written into the
        // pod's /etc/hosts and its containers' HOSTNAME: no NUL, no line break, no blank.
        if spec.hostname.len() > 64
            || spec
                .hostname
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(Error::InvalidArgument(format!(
                "pod sandbox {}/{}: hostname {:?} is longer than 64 bytes or has a control or blank character",
                spec.namespace, spec.name, spec.hostname
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
        check_sysctls(&spec)?;
        if spec.userns.is_some() {
            if let Some(why) = &self.userns_missing {
                return Err(Error::Unimplemented(format!(
                    "pod sandbox {}/{}: user namespaces are not supported on this node: {why}",
                    spec.namespace, spec.name
                )));
            }
            if [spec.network, spec.pid, spec.ipc].contains(&NsMode::Node) {
                return Err(Error::InvalidArgument(format!(
                    "pod sandbox {}/{}: a user namespace of its own with the node's network, PID \
                     or IPC namespace is not supported",
                    spec.namespace, spec.name
                )));
            }
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
        let opts = MonitorOptions {
            pod_id: id.clone(),
            dir: dir.clone(),
            hostname: spec.hostname.clone(),
            namespaces: ns,
            sysctls: spec.sysctls.clone().into_iter().collect(),
            userns: spec.userns,
        };
        let t_prepared = t0.elapsed();
        let (pid, namespaces, started) = monitor_client::spawn(&opts)
            .await
            .map_err(|e| e.context(format!("start pod {}", spec.name)))?;
        let t_spawned = t0.elapsed();
        {
            // A call dropped from here on (the daemon's shutdown ends what its grace did not
            // let finish) must not leave the monitor running unreachable, its socket removed
            // with the pod dir: it goes first (undo steps run last-in first-out), by its
            // pidfd (a hung monitor may not even accept a connection to be found by).
            let dir = dir.clone();
            undo.push(move || {
                started.kill();
                hako_runtime::monitor::unpin_namespaces(&dir);
            });
        }
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
                let _ = self.network.cni.del(&id, IFNAME, None).await;
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
                if !client.shutdown().await {
                    kill_pod_processes(&self.pod_dir(&id));
                    hako_runtime::monitor::unpin_namespaces(&self.pod_dir(&id));
                }
                return Err(e);
            }
        };
        self.monitors
            .lock()
            .expect("monitors poisoned")
            .insert(id.clone(), client);
        undo.commit();
        // A spare copy (after the commit: a cancelled call must not undo a recorded pod): the
        // pod is adopted from its monitor if the store loses the record.
        // Before any await: a cancelled call leaves no Ready pod unwatched.
        self.watch(&record);
        self.keep_record(&self.monitor(&record), &record.id, "", &record)
            .await;
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
        let Some((pod, _guard)) = self.lock_pod(id).await? else {
            return Ok(());
        };
        self.stop_locked(pod).await
    }

    /// The pod `id` names, held exclusively (no change of it or its containers under way), as
    /// stored once the lock is held; `None` when there is none.
    async fn lock_pod(&self, id: &str) -> Result<Option<(PodRecord, super::KeyGuard)>> {
        let pod = match self.pod(id) {
            Ok(p) => p,
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let guard = self.object_locks.exclusive(&pod.id).await;
        Ok(self
            .store
            .get::<PodRecord>(Table::Pods, &pod.id)?
            .map(|p| (p, guard)))
    }

    /// StopPodSandbox with the pod's lock held.
    async fn stop_locked(&self, pod: PodRecord) -> Result<()> {
        if pod.state == PodState::NotReady {
            // Its monitor may have died before the network was torn down; the network
            // namespace's pin was kept for that DEL, and goes after it. What its containers
            // left running (the lost monitor's single kill raced a fork, say) ends first.
            self.end_containers(&pod).await?;
            self.detach(&pod).await?;
            hako_runtime::monitor::unpin_namespaces(&self.pod_dir(&pod.id));
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let containers = self.containers_of(&pod.id)?;
        let monitor = self.monitor(&pod);
        let first = monitor.states().await;
        let answered = first.is_ok();
        let states: HashMap<String, pb::ContainerState> = match first {
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
        // Record final states before the monitor (their source of truth) goes away. (One that
        // did not answer above is not waited for twice.)
        let last = match answered {
            true => monitor.states().await.map(Some),
            false => Ok(None),
        };
        match last {
            Ok(None) => {}
            Ok(Some(info)) => {
                for s in info.containers {
                    self.store
                        .update(Table::Containers, &s.id, |c| apply_state(c, &s))?;
                }
            }
            Err(e) => {
                tracing::warn!(pod = %pod.id, error = %chain(&e), "monitor unreachable while stopping: containers are ended through their cgroups");
            }
        }
        self.end_containers(&pod).await?;
        for c in self.containers_of(&pod.id)? {
            self.store
                .update(Table::Containers, &c.id, |r: &mut ContainerRecord| {
                    if r.state == ContainerState::Exited {
                        return false;
                    }
                    r.state = ContainerState::Exited;
                    r.exit.get_or_insert(ExitInfo {
                        code: 137,
                        signal: 9,
                        finished_at: now_nanos(),
                        oom_killed: false,
                    });
                    true
                })?;
            let _ = rootfs::unmount_bundle(&self.bundle_dir(&c.id));
        }
        // Before the namespace goes: plugins clean up inside it. A failure fails the stop
        // (kubelet retries it) rather than leak an IP lease.
        let t_containers = t0.elapsed();
        self.detach(&pod).await?;
        let t_network = t0.elapsed();
        if !monitor.shutdown().await {
            // A monitor that does not finish its teardown is ended, and what it pinned
            // released, here: the pod's removal must not find its namespaces still mounted.
            tracing::warn!(pod = %pod.id, "ending the pod's processes and releasing its namespaces itself");
            kill_pod_processes(&self.pod_dir(&pod.id));
            hako_runtime::monitor::unpin_namespaces(&self.pod_dir(&pod.id));
        }
        // The monitor removes its socket last and exits right after: the stop is complete when
        // it is gone (bounded; a zombie no longer counts).
        let t_shutdown = t0.elapsed();
        monitor_gone(pod.monitor_pid, Duration::from_secs(1)).await;
        let t_gone = t0.elapsed();
        self.mark_not_ready(&pod.id)?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            pod = %pod.id,
            containers_ms = ms(t_containers),
            network_ms = ms(t_network - t_containers),
            shutdown_ms = ms(t_shutdown - t_network),
            exit_ms = ms(t_gone - t_shutdown),
            record_ms = ms(t0.elapsed() - t_gone),
            "stop timings"
        );
        tracing::info!(pod = %pod.id, "pod sandbox stopped");
        Ok(())
    }

    /// Ends through its cgroup each container of the pod not recorded Exited (its monitor died,
    /// hangs, or lost it) before the stop records it so: kubelet takes a stopped pod's
    /// containers for gone and unmounts their volumes. A container that cannot be emptied
    /// fails the stop (kubelet retries it) rather than be reported exited while it runs.
    async fn end_containers(&self, pod: &PodRecord) -> Result<()> {
        for c in self.containers_of(&pod.id)? {
            if c.state != ContainerState::Exited && !end_cgroup(&c.cgroups_path).await {
                return Err(Error::Internal(format!(
                    "stop pod sandbox {}: container {} still has processes in cgroup {} after SIGKILL",
                    pod.id, c.id, c.cgroups_path
                )));
            }
        }
        Ok(())
    }

    /// CNI DEL of the pod's attachment, from the cached ADD result (nothing when it has none;
    /// the pod's attachment as it would be made now when the entry does not parse).
    async fn detach(&self, pod: &PodRecord) -> Result<()> {
        let fallback = pod.namespaces.get("network").map(|netns| {
            self.network
                .attachment(&pod.id, Path::new(netns), &pod.spec)
        });
        self.network
            .cni
            .del(&pod.id, IFNAME, fallback.as_ref())
            .await
            .map_err(|e| e.context(format!("tear down the network of pod {}", pod.id)))
    }

    /// Kills and removes the container cgroups left under a pod's cgroup by creates that never
    /// got a record (a monitor or daemon killed mid-create), or by deletes that found them still
    /// in use (an exec's setup process dying under a spent CPU quota): no record names them any
    /// more, so nothing else would. Called when the pod goes, after its recorded containers are
    /// removed. The cgroups of other pods' containers are spared: kubelet gives every pod a
    /// cgroup parent of its own, but any CRI client may give two pods the same one.
    pub(super) async fn remove_leftover_container_cgroups(&self, pod_id: &str, pod_cgroup: &str) {
        let found = container_cgroup_ids(pod_cgroup);
        if found.is_empty() {
            return;
        }
        // Read after the listing: a create reserves its id before its cgroup is made, so the
        // create of another pod whose cgroup was listed holds its reservation or its record.
        let mine = format!("ctr/{pod_id}/");
        let others = self.store.reservations().and_then(|r| {
            let recorded = self.store.all::<ContainerRecord>(Table::Containers)?;
            Ok(r.into_iter()
                .filter(|(key, _)| key.starts_with("ctr/") && !key.starts_with(&mine))
                .map(|(_, id)| id)
                .chain(
                    recorded
                        .into_iter()
                        .filter(|c| c.pod_id != pod_id)
                        .map(|c| c.id),
                )
                .collect::<std::collections::HashSet<String>>())
        });
        let others = match others {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(pod = %pod_id, cgroup = %pod_cgroup, error = %chain(&e), "container cgroups left under the pod's cgroup are kept: the store could not say whose they are");
                return;
            }
        };
        let leftovers: Vec<String> = found
            .into_iter()
            .filter(|id| !others.contains(id))
            .collect();
        remove_container_cgroups(pod_cgroup, &leftovers).await;
    }

    /// RemovePodSandbox: stops it if needed, removes its containers and files. Idempotent.
    pub async fn remove_pod(&self, id: &str) -> Result<()> {
        let Some((pod, _guard)) = self.lock_pod(id).await? else {
            return Ok(());
        };
        self.stop_locked(pod.clone()).await?;
        // Changes of its containers wait for the pod's lock, then find them gone.
        for c in self.containers_of(&pod.id)? {
            self.remove_container_locked(&c).await?;
        }
        let dir = self.pod_dir(&pod.id);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(Error::io("remove", &dir, e));
            }
        }
        self.remove_leftover_container_cgroups(&pod.id, &pod_cgroup(&pod))
            .await;
        if pod.spec.cgroup_parent.is_empty() {
            // Ours (kubelet's parents are kubelet's): empty once the containers are deleted.
            if !remove_cgroup(&pod_cgroup(&pod)) {
                tracing::warn!(pod = %pod.id, cgroup = %pod_cgroup(&pod), "pod cgroup not empty; left in place");
            }
        }
        self.store.delete(Table::Pods, &pod.id)?;
        self.store.release(&pod.spec.reservation(), &pod.id)?;
        tracing::info!(pod = %pod.id, "pod sandbox removed");
        Ok(())
    }
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

/// The pod's sysctls must belong to a namespace the pod has of its own, where the infra
/// process sets them: a network one with the pod's network, an IPC one with its IPC. Anything
/// else would be the node's (runc refuses them too; kubelet never sends them).
fn check_sysctls(spec: &PodSpec) -> Result<()> {
    for key in spec.sysctls.keys() {
        let ipc = ["kernel.shm", "kernel.msg", "kernel.sem", "fs.mqueue."]
            .iter()
            .any(|p| key.starts_with(p));
        let why = if key.starts_with("net.") {
            (spec.network == NsMode::Node)
                .then_some("is a network one and the pod has the node's network")
        } else if ipc {
            (spec.ipc == NsMode::Node)
                .then_some("is an IPC one and the pod has the node's IPC namespace")
        } else {
            Some("is not in a namespace of the pod's (only net.*, kernel.shm*, kernel.msg*, kernel.sem* and fs.mqueue.* are)")
        };
        if let Some(why) = why {
            return Err(Error::InvalidArgument(format!(
                "pod sandbox {}/{}: sysctl {key:?} {why}",
                spec.namespace, spec.name
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::Dns;

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
