//! The container room: CreateContainer (gathering from the host what the pure spec in
//! spec.rs needs, then the bundle and the monitor's create), Start/Stop/Update/Remove,
//! status and list, ExecSync and ReopenContainerLog. Lists and statuses ask no monitor: they
//! read the records and what each pod's watcher last heard from its monitor (`survey`,
//! live.rs); a stuck monitor's pod is reported NotReady and its containers as last recorded
//! (as containerd reports from its own store).

use std::collections::{HashMap, HashSet};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hako_proto::monitor as pb;
use hako_runtime::spec as oci;

use super::host::{kill_cgroup, now_nanos, remove_cgroup};
use super::spec::{self, parse_signal};
use super::{
    apply_state, new_id, rootfs, state_changes, ContainerRecord, ContainerSpecReq, ContainerState,
    ContainerView, DeviceReq, ExecOutput, ExitInfo, NsMode, PodRecord, PodState, Runtime, Security,
    Undo,
};
use crate::error::{chain, Error, Result};
use crate::store::{ImageRecord, Table, RECORD_VERSION};

/// The largest Localhost seccomp profile read (Docker's default profile is about 20 KiB).
const SECCOMP_PROFILE_CAP: u64 = 1 << 20;

impl Runtime {
    /// CreateContainer: prepares the rootfs and config, has the pod's monitor create it.
    pub async fn create_container(&self, pod_id: &str, req: ContainerSpecReq) -> Result<String> {
        let pod = self.pod(pod_id)?;
        if req.name.is_empty() {
            return Err(Error::InvalidArgument(
                "container metadata needs a name".into(),
            ));
        }
        let t0 = std::time::Instant::now();
        let key = req.reservation(&pod.id);
        let _guard = self.name_lock(&key).await;
        // The pod cannot stop or go while this create holds its share of the pod's lock.
        let _pod_guard = self.object_locks.shared(&pod.id).await;
        let pod = self
            .store
            .get::<PodRecord>(Table::Pods, &pod.id)?
            .ok_or_else(|| Error::NotFound(format!("pod sandbox {} not found", pod.id)))?;
        if pod.state != PodState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "pod sandbox {} is not ready",
                pod.id
            )));
        }
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
        // Image volumes' images are on the node already (kubelet pulled them); each is found
        // before anything is made, and their layers are pinned with the container's own.
        let mut volume_images = Vec::new();
        for m in &req.mounts {
            // An image volume is an overlay, which cannot be ID-mapped.
            if m.image.is_some() && pod.spec.userns.is_some() {
                return Err(Error::InvalidArgument(format!(
                    "container {}: image volume {} in a pod with a user namespace is not supported",
                    req.name, m.container_path
                )));
            }
            if let Some(name) = &m.image {
                volume_images.push(self.images.find(name)?.ok_or_else(|| {
                    Error::NotFound(format!(
                        "container {}: image {name:?} of volume {} not found: pull it first",
                        req.name, m.container_path
                    ))
                })?);
            }
        }
        let mut chain_ids = image.chain_ids.clone();
        for c in volume_images.iter().flat_map(|v| &v.chain_ids) {
            if !chain_ids.contains(c) {
                chain_ids.push(c.clone());
            }
        }
        let id = new_id();
        let mut undo = Undo::default();
        self.reserve(&key, &id, &mut undo)?;
        let pinned: Vec<&ImageRecord> = std::iter::once(&image).chain(&volume_images).collect();
        let config = self.images.pin(&id, &pinned, &chain_ids).await?;
        // libcontainer moves the container into its cgroups some ms from now. Taken after the
        // pin, which may wait for a collection: the hold lapses after a while.
        let _warm = hako_runtime::cgroup_warm::hold();
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
                // A bundle still holding a mount is left to the next start's orphan release:
                // removing it would walk into the mount.
                if rootfs::unmount_bundle(&b).is_ok() {
                    let _ = std::fs::remove_dir_all(&b);
                }
                let _ = std::fs::remove_dir_all(&l);
            });
        }
        let lowers = self.lowers(&image);
        // CDI devices resolve before anything is made: an unknown one leaves nothing behind.
        let cdi_names = spec::cdi_requests(&req);
        let cdi = if cdi_names.is_empty() {
            Ok(Default::default())
        } else {
            let (reg, names) = (self.cdi.clone(), cdi_names.clone());
            tokio::task::spawn_blocking(move || reg.resolve(&names))
                .await
                .map_err(|e| Error::Internal(format!("CDI task: {e}")))?
        }
        .map_err(|e| Error::from(e).context(format!("container {}", req.name)))?;
        let target = if req.security.pid == NsMode::Target {
            Some(self.pid_target(&pod, &req).await?)
        } else {
            None
        };
        let target_pid = target.as_ref().map(|(_, pid)| *pid);
        let root = bundle.join("rootfs");
        let t_prepared = t0.elapsed();
        let userns = match pod.spec.userns {
            None => None,
            Some(_) => {
                let path = pod.namespaces.get("user").ok_or_else(|| {
                    Error::FailedPrecondition(format!(
                        "create container {} in pod {}: its monitor made no user namespace \
                         (started before hako supported them): recreate the pod",
                        req.name, pod.id
                    ))
                })?;
                let f =
                    std::fs::File::open(path).map_err(|e| Error::io("open", Path::new(path), e))?;
                Some(std::os::fd::OwnedFd::from(f))
            }
        };
        // Owner only: the host's root's, or the root of the container's user namespace, which
        // sets it up (and is no other user of the node).
        rootfs::create_dirs(&bundle, 0o700)?;
        if let Some(ids) = &pod.spec.userns {
            rootfs::give_to_userns_root(&bundle, ids)?;
        }
        match (&userns, &pod.spec.userns) {
            (Some(ns), Some(ids)) => tokio::task::block_in_place(|| {
                rootfs::mount_overlay_userns(
                    &lowers,
                    &layer.join("upper"),
                    &layer.join("work"),
                    &root,
                    ns,
                    ids,
                    &self.volatile_layers,
                )
            })?,
            _ => rootfs::mount_overlay(
                &lowers,
                &layer.join("upper"),
                &layer.join("work"),
                &root,
                &self.volatile_layers,
            )?,
        }
        let t_mounted = t0.elapsed();
        // Checks the rootfs's /dev and reads the image's account files, devices and profiles:
        // bounded, but still file I/O, so off the async workers. All of it before the spec,
        // which is a pure function.
        let planned = tokio::task::block_in_place(|| {
            rootfs::own_dev_dir(&root).map_err(|e| {
                e.context(format!("container {} of image {:?}", req.name, req.image))
            })?;
            rootfs::refuse_mounts_on_dev(
                &root,
                &req.name,
                req.mounts.iter().map(|m| m.container_path.as_str()),
            )?;
            let req = self.mount_image_volumes(&bundle, &req, &volume_images)?;
            let inputs = self.spec_inputs(&pod, &id, &req, &config, &root, target_pid)?;
            let planned = spec::container_spec(&pod, &id, &req, &config, inputs)?;
            create_host_paths(&req)?;
            Ok::<_, Error>(planned)
        })?;
        let spec::Planned {
            spec: mut cs,
            stop_signal,
            log_path,
            user,
        } = planned;
        let late_mounts = hako_runtime::spec::late_mounts(&cs);
        // In a user namespace every volume is bound from a staged copy ID-mapped through it.
        let to_stage: Vec<usize> = match &userns {
            Some(_) if !late_mounts.is_empty() => {
                return Err(Error::InvalidArgument(format!(
                    "container {}: a mount on /dev in a pod with a user namespace is not supported",
                    req.name
                )))
            }
            Some(_) => (0..cs.mounts.len()).collect(),
            None => hako_runtime::spec::staged_mounts(&cs),
        };
        let mut staged = rootfs::Staged::new(&bundle, userns);
        for i in to_stage {
            let m = &mut cs.mounts[i];
            m.source = tokio::task::block_in_place(|| staged.add(m))
                .map_err(|e| e.context(format!("container {}", req.name)))?;
        }
        let cgroups_path = cs.cgroups_path.clone();
        let mut oci = oci::generate(&cs);
        hako_runtime::cdi::apply(&mut oci, &cdi)
            .map_err(|e| Error::from(e).context(format!("container {}", req.name)))?;
        if !cdi_names.is_empty() {
            tracing::info!(container = %id, devices = ?cdi_names, "CDI devices injected");
        }
        let propagation_fixes = hako_runtime::spec::propagation_fixes(&cs);
        // A CDI mount below /dev would be made before, and so under, the /dev given.
        if let Some(m) = oci.mounts().iter().flatten().find(|m| {
            !late_mounts.is_empty()
                && m.typ().as_deref() == Some("bind")
                && hako_runtime::spec::at_or_below_dev(&m.destination().to_string_lossy())
        }) {
            return Err(Error::InvalidArgument(format!(
                "container {}: CDI mount {} below /dev together with a mount on /dev is not supported",
                req.name,
                m.destination().display()
            )));
        }
        let cfg = bundle.join("config.json");
        oci.save(&cfg)
            .map_err(|e| Error::Internal(format!("write {}: {e}", cfg.display())))?;
        let monitor = self.monitor(&pod);
        let t_spec = t0.elapsed();
        let create = pb::CreateContainerRequest {
            id: id.clone(),
            bundle: bundle.display().to_string(),
            log_path: log_path.clone(),
            stdin: req.stdin,
            stdin_once: req.stdin_once,
            tty: req.tty,
            // The full id: the request may have named the target by a prefix.
            pid_target: target.map(|(id, _)| id).unwrap_or_default(),
            late_mounts: late_mounts
                .into_iter()
                .map(|m| pb::LateMount {
                    source: m.source,
                    destination: m.destination,
                    readonly: m.readonly,
                    recursive_readonly: m.recursive_readonly,
                    propagation: m.propagation,
                    options: m.options,
                })
                .collect(),
            propagation_fixes: propagation_fixes
                .into_iter()
                .map(|f| pb::PropagationFix {
                    destination: f.destination,
                    propagation: f.propagation,
                    recursive: f.recursive,
                })
                .collect(),
        };
        let created = monitor.create(&create).await;
        // The container has its copies (or none, failed): the host's go.
        drop(staged);
        if let Ok(r) = &created {
            // A monitor older than these fields (a pod from before an upgrade) makes none.
            // Without its mounts on /dev the container would run on the wrong /dev: removed.
            if (r.late_mounts as usize) < create.late_mounts.len() {
                if let Err(e) = monitor.delete(&id, true).await {
                    tracing::warn!(container = %id, error = %e, "remove the container its monitor made without its mounts on /dev");
                }
                return Err(Error::FailedPrecondition(format!(
                    "create container {} in pod {}: the pod's monitor predates mounts on /dev \
                     (hako was upgraded since the pod started): recreate the pod",
                    req.name, pod.id
                )));
            }
            // Without the propagation fixes it runs as hako ran it before them: a restarted
            // container of a running plugin pod is not refused over it.
            if (r.propagation_fixes as usize) < create.propagation_fixes.len() {
                tracing::warn!(container = %id, pod = %pod.id, "the pod's monitor predates per-volume propagation: the container's volumes follow its root's; recreate the pod to have them as asked");
            }
        }
        if let Err(e) = created {
            // A monitor found gone turns the pod NotReady here, not only at the next relist:
            // the create then fails for good instead of UNAVAILABLE on every retry.
            self.check_monitor_locked(&pod, &e)?;
            if self
                .pod(&pod.id)
                .map_or(true, |p| p.state != PodState::Ready)
            {
                return Err(Error::FailedPrecondition(format!(
                    "create container {} in pod {}: the pod's monitor is gone and the pod is not ready",
                    req.name, pod.id
                )));
            }
            return Err(e.context(format!("create container {} in pod {}", req.name, pod.id)));
        }
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
            chain_ids,
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
        // After the commit: a cancelled call must not undo a recorded container.
        self.keep_record(&monitor, &record.pod_id, &id, &record)
            .await;
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

    /// What the container's spec needs from the host, read once its rootfs is mounted at
    /// `root`: the user in the image's account files, device nodes, the pod's files, the limits
    /// this node can apply, a Localhost seccomp profile, the AppArmor profile. Blocking.
    fn spec_inputs(
        &self,
        pod: &PodRecord,
        id: &str,
        req: &ContainerSpecReq,
        image: &oci_spec::image::ImageConfiguration,
        root: &Path,
        target_pid: Option<u32>,
    ) -> Result<spec::Inputs> {
        let sec = &req.security;
        let (user, group) = spec::user_to_resolve(req, image)?;
        let (uid, gid, groups) = rootfs::resolve_user(root, &user, group.as_deref())
            .map_err(|e| e.context(format!("container {} (image {})", req.name, req.image)))?;
        let devices = if sec.privileged {
            hako_runtime::devices::host_devices()
        } else {
            req.devices
                .iter()
                .map(|d| device_nodes(d).map_err(|e| e.context(format!("container {}", req.name))))
                .collect::<Result<Vec<_>>>()?
                .concat()
        };
        let pod_dir = self.pod_dir(&pod.id);
        let pod_files = [
            ("/etc/resolv.conf", "resolv.conf"),
            ("/etc/hostname", "hostname"),
            ("/etc/hosts", "hosts"),
        ]
        .into_iter()
        .filter(|(_, file)| pod_dir.join(file).exists())
        .map(|(dest, file)| (dest.to_string(), pod_dir.join(file).display().to_string()))
        .collect();
        let mut resources = req.resources.clone();
        let dropped = hako_runtime::stats::drop_unsupported(&mut resources);
        if !dropped.is_empty() {
            tracing::info!(container = %id, ?dropped, "limits this node's cgroups cannot apply are skipped");
        }
        let seccomp_profile = match spec::seccomp_profile_path(req)? {
            Some(path) => Some(read_seccomp_profile(path, &req.name)?),
            None => None,
        };
        Ok(spec::Inputs {
            rootfs: root.to_path_buf(),
            account: spec::Account { uid, gid, groups },
            devices,
            pod_files,
            target_pid,
            resources,
            seccomp_profile,
            apparmor_profile: apparmor_profile(sec, &req.name)?,
            oom_floor: self.oom_floor,
            cap_limit: self.cap_limit.clone(),
            cgroup2: self.cgroup2,
        })
    }

    /// The container (its full id) and pid whose PID namespace a TARGET-mode container joins:
    /// a running container of the same pod.
    async fn pid_target(&self, pod: &PodRecord, req: &ContainerSpecReq) -> Result<(String, u32)> {
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
        Ok((c.id, s.pid))
    }

    pub async fn start_container(&self, id: &str) -> Result<()> {
        let (c, _guards) = self.lock_container(id).await?;
        let mut c = c.ok_or_else(|| Error::NotFound(format!("container {id} not found")))?;
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
                self.store
                    .update(Table::Containers, &c.id, |r: &mut ContainerRecord| {
                        r.state = c.state;
                        r.started_at = c.started_at;
                        r.exit = c.exit.clone();
                        r.start_error = c.start_error.clone();
                        true
                    })?;
                return Err(e);
            }
        };
        self.record_state(&c.id, &s)
    }

    /// The container `id` names, held for a change (its pod's lock shared, its own
    /// exclusively), as stored once the locks are held: `None` when it was removed meanwhile.
    /// The guards go with the change.
    async fn lock_container(
        &self,
        id: &str,
    ) -> Result<(Option<ContainerRecord>, [super::KeyGuard; 2])> {
        let c = self.container_record(id)?;
        let pod = self.object_locks.shared(&c.pod_id).await;
        let own = self.object_locks.exclusive(&c.id).await;
        let now = self
            .store
            .get::<ContainerRecord>(Table::Containers, &c.id)?;
        Ok((now, [pod, own]))
    }

    /// Folds a monitor state into the stored record, if the container still has one.
    fn record_state(&self, id: &str, s: &pb::ContainerState) -> Result<()> {
        self.store
            .update(Table::Containers, id, |c| apply_state(c, s))?;
        Ok(())
    }

    /// StopContainer: the image's STOPSIGNAL (SIGTERM when it has none), then SIGKILL after
    /// `timeout`. Stopping an exited or unknown container succeeds.
    pub async fn stop_container(&self, id: &str, timeout: Duration) -> Result<()> {
        let (c, guards) = match self.lock_container(id).await {
            Ok((Some(c), guards)) => (c, guards),
            Ok((None, _)) | Err(Error::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut _guards = Some(guards);
        let Ok(pod) = self.pod_of(&c) else {
            return Ok(());
        };
        if pod.state != PodState::Ready {
            return Ok(());
        }
        let m = self.monitor(&pod);
        let s = m.state(&c.id).await?;
        if s.status == pb::Status::Exited as i32 {
            return self.record_state(&c.id, &s);
        }
        if s.status == pb::Status::Running as i32 && !timeout.is_zero() {
            let sig = c
                .stop_signal
                .as_deref()
                .and_then(parse_signal)
                .unwrap_or(libc::SIGTERM);
            // Whatever goes wrong with the polite signal, the stop still ends in SIGKILL.
            let polite = match m.signal(&c.id, sig, false).await {
                Ok(()) => {
                    // The grace period holds no lock: a later stop with a shorter timeout
                    // (kubelet's force delete) and the pod's stop go ahead meanwhile, as
                    // containerd lets them; a pod author's long grace period pins nothing.
                    _guards = None;
                    let r = m.wait(&c.id, millis(timeout)).await;
                    match self.lock_container(id).await {
                        Ok((Some(_), guards)) => _guards = Some(guards),
                        Ok((None, _)) | Err(Error::NotFound(_)) => return Ok(()),
                        Err(e) => return Err(e),
                    }
                    if !self.pod(&pod.id).is_ok_and(|p| p.state == PodState::Ready) {
                        // The pod's stop ended it and recorded its exit.
                        return Ok(());
                    }
                    r
                }
                Err(e) => Err(e),
            };
            match polite {
                Ok(s) if s.status == pb::Status::Exited as i32 => {
                    return self.record_state(&c.id, &s);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(container = %c.id, signal = sig, error = %chain(&e), "stop signal failed; killing")
                }
            }
        }
        m.signal(&c.id, libc::SIGKILL, true).await?;
        let s = m.wait(&c.id, 30_000).await?;
        self.record_state(&c.id, &s)
    }

    /// UpdateContainerResources: new limits on the cgroup of a created or running container,
    /// kept in its record (ContainerStatus reports them). An exited container only has its
    /// record updated, as containerd does.
    pub async fn update_container(&self, id: &str, resources: oci::Resources) -> Result<()> {
        let (found, _guards) = self.lock_container(id).await?;
        let gone = || Error::NotFound(format!("container {id} not found"));
        let c = found.ok_or_else(gone)?;
        let view = self.container(&c.id).await?;
        let c = view.record;
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
                    Error::from(e).context(format!("update resources of container {id}"))
                })?;
        }
        self.store
            .update(Table::Containers, &c.id, |r: &mut ContainerRecord| {
                r.spec.resources = resources;
                true
            })?
            .ok_or_else(gone)?;
        tracing::info!(container = %c.id, "container resources updated");
        Ok(())
    }

    /// RemoveContainer: force-removes a running one. Removing an unknown container succeeds.
    pub async fn remove_container(&self, id: &str) -> Result<()> {
        match self.lock_container(id).await {
            Ok((Some(c), _guards)) => self.remove_container_locked(&c).await,
            Ok((None, _)) | Err(Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// RemoveContainer with the container's lock (or its pod's, exclusively) held.
    pub(super) async fn remove_container_locked(&self, c: &ContainerRecord) -> Result<()> {
        match self.pod_of(c) {
            Ok(pod) if pod.state == PodState::Ready => {
                if let Err(e) = self.monitor(&pod).delete(&c.id, true).await {
                    // A monitor found gone turns the pod NotReady: then the container is
                    // cleared here as for a stopped pod, instead of failing every retry.
                    self.check_monitor_locked(&pod, &e)?;
                    if self.pod(&pod.id)?.state == PodState::Ready {
                        return Err(e);
                    }
                    clear_cgroup(&c.cgroups_path).await;
                }
            }
            // No monitor to delete it (stopped pod, or a monitor that died): its cgroup is ours
            // to clear.
            _ => clear_cgroup(&c.cgroups_path).await,
        }
        self.remove_container_files(&c.id)?;
        self.store.delete(Table::Containers, &c.id)?;
        self.store.release(&c.spec.reservation(&c.pod_id), &c.id)?;
        self.store.unpin(&c.id)?;
        tracing::info!(container = %c.id, "container removed");
        Ok(())
    }

    /// Current view of a container: its record with what its monitor last reported.
    pub async fn container(&self, id: &str) -> Result<ContainerView> {
        let c = self.container_record(id)?;
        let mut pid = 0;
        if let Ok(pod) = self.pod_of(&c) {
            let pod = Arc::new(pod);
            let survey = self.survey(std::slice::from_ref(&pod)).await?;
            if let Some(s) = survey.live.get(&c.id) {
                if s.status == pb::Status::Running as i32 {
                    pid = s.pid;
                }
            }
            let views =
                self.container_views_of(&survey, vec![Arc::new(self.container_record(&c.id)?)])?;
            if let Some(v) = views.into_iter().next() {
                // Just started: the record says Running before the watcher's next report
                // carries the pid. Only the monitor knows it then; ask it once.
                if pid == 0 && v.state == ContainerState::Running {
                    if let Ok(s) = self.monitor(&pod).state(&c.id).await {
                        if s.status == pb::Status::Running as i32 {
                            pid = s.pid;
                        }
                    }
                }
                return Ok(ContainerView { pid, ..v });
            }
            return Err(Error::NotFound(format!("container {} not found", c.id)));
        }
        Ok(ContainerView {
            state: c.state,
            started_at: c.started_at,
            exit: c.exit.clone(),
            record: Arc::new(c),
            pid,
        })
    }

    /// Every container, states refreshed with one round of monitor reads.
    pub async fn containers(&self) -> Result<Vec<ContainerView>> {
        let survey = self.survey(&self.pods()?).await?;
        self.container_views(&survey)
    }

    /// What the monitors of the Ready pods among `pods` last reported (live.rs): no monitor
    /// is asked. A monitor its watcher found no longer listening and not yet released (see
    /// `release_lost_monitor`) is handed to recovery (`check_monitor`: its pod turns NotReady); one that missed its deadline leaves its
    /// records as they are and its pod reported NotReady, with why.
    pub(super) async fn survey(&self, pods: &[Arc<PodRecord>]) -> Result<Survey> {
        let mut survey = Survey::default();
        for pod in pods.iter().filter(|p| p.state == PodState::Ready) {
            let Some(live) = self.live.get(&pod.id) else {
                // A pod adopted or recorded by a call cut short before its watch began.
                self.watch(pod);
                continue;
            };
            if let Some(e) = &live.gone {
                self.check_monitor(pod, &Error::Unavailable(e.clone()))?;
                survey.unanswered.insert(pod.id.clone(), e.clone());
                survey.gone.insert(pod.id.clone());
                continue;
            }
            if let Some(why) = live.silent {
                survey.unanswered.insert(pod.id.clone(), why);
            } else if live.pid_ns_gone && pod.namespaces.contains_key("pid") {
                // Its monitor lives but the pod's PID 1 died: nothing can run in it.
                survey.unanswered.insert(
                    pod.id.clone(),
                    "the pod's PID namespace lost its init process".into(),
                );
            }
            survey.live.extend(live.states);
        }
        Ok(survey)
    }

    /// The container records with what `survey` found folded in. Read after the monitors: a
    /// monitor found gone has updated its containers' records.
    pub(super) fn container_views(&self, survey: &Survey) -> Result<Vec<ContainerView>> {
        self.container_views_of(
            survey,
            self.store
                .all_shared::<ContainerRecord>(Table::Containers)?,
        )
    }

    /// [`Runtime::container_views`] of the records `of`.
    fn container_views_of(
        &self,
        survey: &Survey,
        of: Vec<Arc<ContainerRecord>>,
    ) -> Result<Vec<ContainerView>> {
        let mut recs = Vec::with_capacity(of.len());
        for c in of {
            let Some(s) = survey.live.get(&c.id) else {
                recs.push(c);
                continue;
            };
            if !state_changes(&c, s) {
                recs.push(c);
                continue;
            }
            // Only while it exists: one removed since the read is not listed (or written) again.
            recs.extend(
                self.store
                    .update(Table::Containers, &c.id, |r| apply_state(r, s))?
                    .map(Arc::new),
            );
        }
        Ok(recs
            .into_iter()
            .map(|c| ContainerView {
                state: match c.state {
                    ContainerState::Created | ContainerState::Running
                        if survey.gone.contains(&c.pod_id) =>
                    {
                        ContainerState::Unknown
                    }
                    s => s,
                },
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
        let (c, pod) = self.exec_target(id)?;
        // No cgroup-warm hold here (see docs/BENCHMARKS.md): exec probes are steady load, and
        // keeping the node-wide migration lock in writer mode for them would slow every fork
        // and exit on the node; the exec pays one grace period itself instead.
        let r = match self
            .monitor(&pod)
            .exec_sync(&c.id, cmd, millis(timeout))
            .await
        {
            Ok(r) => r,
            Err(e) => {
                // A monitor found gone turns the pod NotReady here, not only at the next
                // relist: kubelet's probe then gets a final answer instead of UNAVAILABLE.
                self.check_monitor(&pod, &e)?;
                if self
                    .pod(&pod.id)
                    .map_or(true, |p| p.state != PodState::Ready)
                {
                    return Err(Error::FailedPrecondition(format!(
                        "container {} is not running: its pod's monitor is gone",
                        c.id
                    )));
                }
                return Err(e);
            }
        };
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

/// What one round of monitor reads found.
#[derive(Default)]
pub(super) struct Survey {
    /// Live states of the containers of the pods whose monitor answered.
    live: HashMap<String, pb::ContainerState>,
    /// Pods reported NotReady though their record says Ready, with why: their monitor did not
    /// answer, or their PID namespace lost its init.
    pub(super) unanswered: HashMap<String, String>,
    /// Pods whose monitor no longer listens. Until its recovery (which another call may be
    /// running) has written their final states, their containers that did not exit are
    /// Unknown, not what their records last said.
    gone: HashSet<String>,
}

impl Runtime {
    /// An image's unpacked layers as overlay lower dirs, topmost first.
    fn lowers(&self, image: &ImageRecord) -> Vec<PathBuf> {
        image
            .chain_ids
            .iter()
            .rev()
            .map(|c| self.images.snapshot_fs(c))
            .collect()
    }

    /// Mounts each image volume of `req` (its image in `images`, in mount order) read-only
    /// under the container's bundle, and returns the request as the spec is to see it: those
    /// mounts bound from there, read-only, a sub path resolved inside the image.
    fn mount_image_volumes<'a>(
        &self,
        bundle: &Path,
        req: &'a ContainerSpecReq,
        images: &[ImageRecord],
    ) -> Result<std::borrow::Cow<'a, ContainerSpecReq>> {
        if images.is_empty() {
            return Ok(std::borrow::Cow::Borrowed(req));
        }
        if images.len() > MAX_IMAGE_VOLUMES {
            return Err(Error::InvalidArgument(format!(
                "container {}: {} image volumes, more than {MAX_IMAGE_VOLUMES}",
                req.name,
                images.len()
            )));
        }
        let mut out = req.clone();
        let vols = bundle.join(rootfs::IMAGE_VOLUMES);
        // One read-only mount per image, however many volumes name it.
        let mut mounted: HashMap<&str, PathBuf> = HashMap::new();
        let mounts = out
            .mounts
            .iter_mut()
            .enumerate()
            .filter(|(_, m)| m.image.is_some());
        for ((n, m), image) in mounts.zip(images) {
            let root = match mounted.get(image.id.as_str()) {
                Some(root) => root.clone(),
                None => {
                    let root = vols.join(n.to_string());
                    rootfs::mount_image_volume(&self.lowers(image), &vols.join(".empty"), &root)
                        .map_err(|e| e.context(format!("container {}", req.name)))?;
                    mounted.insert(&image.id, root.clone());
                    root
                }
            };
            let source = if m.image_sub_path.is_empty() {
                root
            } else {
                let at = vols.join(format!("{n}.sub"));
                bind_sub_path(&root, &m.image_sub_path, &at).map_err(|e| {
                    let msg = format!(
                        "container {}: sub path {:?} of image volume {} (image {}): {e}",
                        req.name, m.image_sub_path, m.container_path, image.id
                    );
                    if e.kind() == std::io::ErrorKind::NotFound {
                        Error::NotFound(msg)
                    } else {
                        Error::InvalidArgument(msg)
                    }
                })?;
                at
            };
            // A path the daemon named (`imagevols/<n>` or `<n>.sub`): nothing of the image's
            // own names reaches the OCI spec, where libcontainer resolves it again.
            m.host_path = source.display().to_string();
            m.readonly = true;
        }
        Ok(std::borrow::Cow::Owned(out))
    }
}

/// Image volumes a container may have: each is a mount in the host's mount table (and in
/// every mount namespace made after it) until the container is removed.
const MAX_IMAGE_VOLUMES: usize = 64;

/// Binds `sub` (a path inside the image mounted at `root`) onto `at`, a path the daemon
/// names. The kernel resolves `sub` inside the image (`RESOLVE_IN_ROOT`): a symlink on the way
/// means what it means in the image and never leads onto the host. The bind is made from the
/// descriptor that resolution returned, never from the path again, so no name in the image
/// (one that is not UTF-8, say) is ever read as a host path.
fn bind_sub_path(root: &Path, sub: &str, at: &Path) -> std::io::Result<()> {
    use nix::fcntl::OFlag;
    let fd = crate::inroot::open(root, sub, OFlag::O_PATH | OFlag::O_CLOEXEC)?;
    let from = format!("/proc/self/fd/{}", fd.as_raw_fd());
    // The bind's root appears in every mountinfo on the node, and libcontainer cannot read a
    // mountinfo line that is not UTF-8: such a mount would fail every container create.
    let real = std::fs::read_link(&from)?;
    if real.to_str().is_none() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "it resolves to a name that is not UTF-8",
        ));
    }
    let st = nix::sys::stat::fstat(fd.as_raw_fd())?;
    // The mount point has the kind of what is bound onto it.
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        std::fs::create_dir(at)?;
    } else {
        std::fs::File::create(at)?;
    }
    nix::mount::mount(
        Some(from.as_str()),
        at,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )?;
    Ok(())
}

/// Creates the missing host paths of a container's mounts as directories, as containerd
/// and CRI-O do, with their 0755 (the daemon's umask is 077).
fn create_host_paths(req: &ContainerSpecReq) -> Result<()> {
    // An image volume's source is a mount the daemon made, never a path to create.
    for m in req.mounts.iter().filter(|m| m.image.is_none()) {
        if !Path::new(&m.host_path).exists() {
            rootfs::create_dirs(Path::new(&m.host_path), 0o755)?;
        }
    }
    Ok(())
}

/// A Localhost seccomp profile: a regular file of bounded size, so that a FIFO or device
/// named here cannot block or flood the daemon.
fn read_seccomp_profile(path: &str, name: &str) -> Result<Vec<u8>> {
    crate::inroot::read_regular(Path::new("/"), path, SECCOMP_PROFILE_CAP).map_err(|e| {
        let msg = format!("seccomp profile {path} of container {name}: {}", chain(&e));
        if e.is_not_found() {
            Error::NotFound(msg)
        } else {
            Error::InvalidArgument(msg)
        }
    })
}

/// The AppArmor profile of container `name`: decided in spec.rs from whether this host has
/// AppArmor; a requested profile this host cannot apply is an error.
fn apparmor_profile(sec: &Security, name: &str) -> Result<Option<String>> {
    use hako_runtime::apparmor;
    let decision = spec::apparmor_decision(sec, name, apparmor::host_enabled())?;
    apparmor::apply(&decision).map_err(|e| Error::from(e).context(format!("container {name}")))
}

/// The nodes a CRI device request names.
fn device_nodes(d: &DeviceReq) -> Result<Vec<oci::Device>> {
    hako_runtime::devices::from_host(&d.host_path, &d.container_path, &d.permissions).map_err(|e| {
        match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound(e.to_string()),
            _ => Error::InvalidArgument(e.to_string()),
        }
    })
}

/// Kills what is left in a container's cgroup and removes it; a dying process leaves its
/// cgroup a moment later, so this tries for up to a second.
pub(super) async fn clear_cgroup(cgroups_path: &str) {
    super::host::lift_cpu_quota(cgroups_path);
    for _ in 0..50 {
        kill_cgroup(cgroups_path);
        if remove_cgroup(cgroups_path) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A timeout in milliseconds for the monitor, saturated (a huge one must not wrap into a
/// negative, which the monitor reads as "no timeout").
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
