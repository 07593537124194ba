//! The container spec: a pure function from the CRI request, the image config, the pod and
//! the [`Inputs`] the container room gathered from the host beforehand (the user resolved in
//! the rootfs, device nodes, a Localhost seccomp profile's text, the AppArmor profile) to
//! what the container is made of. No I/O here, so every rule is table-tested below.
//!
//! Also the other pure rules a container's creation follows: which CDI devices it asks for,
//! which user to look up, the AppArmor decision, cgroup paths, STOPSIGNAL parsing and where
//! its log goes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hako_runtime::spec::{self as oci, ContainerSpec, Ns, Resources};
use oci_spec::image::{Config, ImageConfiguration};

use super::types::MOUNT_OPTIONS;
use super::{ContainerSpecReq, NsMode, PodRecord, Propagation, SeccompReq, Security, UserIds};
use crate::error::{Error, Result};

/// What the container room read from the host before the spec is computed.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// The container's root filesystem (its overlay mount).
    pub rootfs: PathBuf,
    /// The user [`user_to_resolve`] named, as the rootfs's account files resolve it.
    pub account: Account,
    /// The device nodes: every host device for a privileged container, else the requested.
    pub devices: Vec<oci::Device>,
    /// The pod's resolv.conf, hostname and hosts that exist: (destination, host file).
    pub pod_files: Vec<(String, String)>,
    /// The pid whose PID namespace a TARGET-mode container joins.
    pub target_pid: Option<u32>,
    /// The requested limits without those this node's cgroups cannot apply.
    pub resources: Resources,
    /// The text of the Localhost seccomp profile the request names.
    pub seccomp_profile: Option<Vec<u8>>,
    /// The AppArmor profile decided by [`apparmor_decision`] and checked on this host.
    pub apparmor_profile: Option<String>,
    /// The lowest oom_score_adj a container may get, when restricted.
    pub oom_floor: Option<i32>,
    /// The daemon's bounding set.
    pub cap_limit: Vec<String>,
    /// The node's cgroups are cgroup v2 (unified).
    pub cgroup2: bool,
}

/// A user as the image's /etc/passwd and /etc/group resolve it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Account {
    pub uid: u32,
    pub gid: u32,
    /// Groups /etc/group lists the user in, besides `gid`.
    pub groups: Vec<u32>,
}

/// Everything the container's creation derives from request, image and pod.
#[derive(Debug, Clone)]
pub struct Planned {
    pub spec: ContainerSpec,
    /// The signal a stop sends first (the pod spec's or the image's), validated.
    pub stop_signal: Option<String>,
    /// Full path of the CRI log file, or empty.
    pub log_path: String,
    /// The identity the first process starts with.
    pub user: UserIds,
}

/// The user and group to look up in the rootfs: the request's uid or name, else the image's
/// USER (`user[:group]`); `run_as_group` overrides the group. Root when nothing names one.
pub fn user_to_resolve(
    req: &ContainerSpecReq,
    image: &ImageConfiguration,
) -> Result<(String, Option<String>)> {
    let sec = &req.security;
    if sec.run_as_group.is_some() && sec.run_as_user.is_none() && sec.run_as_username.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "container {}: run_as_group needs run_as_user or run_as_username",
            req.name
        )));
    }
    let image_user = section(image).user().as_deref().unwrap_or("");
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
    let user = if user.is_empty() { "0".into() } else { user };
    Ok((user, group))
}

/// The image config's `config` section; an image without one has all its fields unset.
fn section(image: &ImageConfiguration) -> &Config {
    static NONE: std::sync::OnceLock<Config> = std::sync::OnceLock::new();
    image
        .config()
        .as_ref()
        .unwrap_or_else(|| NONE.get_or_init(Config::default))
}

/// The OCI-level description of container `id`, from the CRI request, the image config, its
/// pod and what was read from the host.
pub fn container_spec(
    pod: &PodRecord,
    id: &str,
    req: &ContainerSpecReq,
    image: &ImageConfiguration,
    inputs: Inputs,
) -> Result<Planned> {
    let ic = section(image);
    let strings = |v: &Option<Vec<String>>| v.clone().unwrap_or_default();
    let stop_signal = stop_signal(req, image)?;
    let (entrypoint, cmd) = (strings(ic.entrypoint()), strings(ic.cmd()));
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
    // The process's strings reach execve as C strings, and libcontainer's init sets each
    // environment entry with set_var, which panics on an empty name or a NUL (and silently
    // empties an argument with a NUL): refused here, naming where they came from. The
    // request's own variables were checked with the request.
    if let Some(i) = args.iter().position(|a| a.contains('\0')) {
        return Err(Error::InvalidArgument(format!(
            "container {}: argument {i} of its command contains a NUL byte",
            req.name
        )));
    }
    let mut env: Vec<String> = strings(ic.env());
    for (k, v) in &req.envs {
        env.retain(|e| e.split('=').next() != Some(k.as_str()));
        env.push(format!("{k}={v}"));
    }
    // What is left of the image's (the request's own were checked with the request, and
    // a variable the pod sets replaces the image's of that name).
    if let Some(e) = env
        .iter()
        .find(|e| e.contains('\0') || e.split('=').next().is_none_or(str::is_empty))
    {
        let name = e.split('=').next().unwrap_or_default();
        return Err(Error::InvalidArgument(format!(
            "image {}: ENV entry {name:?} has an empty name or a NUL byte",
            req.image
        )));
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
        ic.working_dir().clone().unwrap_or_default()
    } else {
        req.working_dir.clone()
    };
    if cwd.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "container {}: working directory {cwd:?} contains a NUL byte",
            req.name
        )));
    }
    let sec = &req.security;
    let Account { uid, gid, groups } = inputs.account;
    let mut extra = groups;
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
        // Relative, it would resolve against wherever the daemon and the monitor happen to run.
        if !m.host_path.starts_with('/') {
            return Err(Error::InvalidArgument(format!(
                "container {}: mount {}: host path {:?} is not absolute",
                req.name, m.container_path, m.host_path
            )));
        }
        if m.recursive_readonly && !(m.readonly && m.propagation == Propagation::Private) {
            return Err(Error::InvalidArgument(format!(
                "container {}: recursive read-only mount {} needs readonly and private propagation",
                req.name, m.container_path
            )));
        }
        if let Some(bad) = m
            .options
            .iter()
            .find(|o| !MOUNT_OPTIONS.contains(&o.as_str()))
        {
            return Err(Error::InvalidArgument(format!(
                "container {}: mount {}: option {bad:?} is not one of {:?}",
                req.name, m.container_path, MOUNT_OPTIONS
            )));
        }
        mounts.push(oci::Mount {
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
            options: m.options.clone(),
        });
    }
    for (dest, source) in &inputs.pod_files {
        if !mounts.iter().any(|m| &m.destination == dest) {
            mounts.push(oci::Mount {
                destination: dest.clone(),
                source: source.clone(),
                readonly: sec.readonly_rootfs,
                propagation: "rprivate".into(),
                recursive_readonly: false,
                options: Vec::new(),
            });
        }
    }
    // A pod with a user namespace has its network and PID ones held by the monitor too:
    // joined through those (see `infra::hold_by_fd`).
    let held = |kind: &str| {
        pod.namespaces
            .get(&format!("{kind}-held"))
            .or_else(|| pod.namespaces.get(kind))
    };
    let join = |kind: &str| held(kind).map(|p| Ns::Join(p.clone())).unwrap_or(Ns::Host);
    let pid = match (sec.pid, pod.spec.pid) {
        (NsMode::Pod, NsMode::Node) | (NsMode::Node, _) => Ns::Host,
        (NsMode::Pod, NsMode::Pod) => held("pid")
            .map(|p| Ns::Join(p.clone()))
            .ok_or_else(|| Error::Internal(format!("pod {} has no PID namespace", pod.id)))?,
        // A pod without a shared PID namespace: the container gets its own.
        (NsMode::Pod, _) | (NsMode::Container, _) => Ns::New,
        (NsMode::Target, _) => Ns::Join(format!(
            "/proc/{}/ns/pid",
            inputs
                .target_pid
                .ok_or_else(|| Error::Internal("PID target not resolved".into()))?
        )),
    };
    // A container is in its pod's user namespace or in none, as kubelet asks: never one the
    // pod lacks, never out of the pod's (its namespaces are that namespace's).
    if req.userns != pod.spec.userns {
        return Err(Error::InvalidArgument(format!(
            "container {}: user namespace {} is not its pod's ({})",
            req.name,
            userns_text(req.userns.as_ref()),
            userns_text(pod.spec.userns.as_ref())
        )));
    }
    // What a user namespace cannot have, or cannot give as asked (its mount namespace makes
    // a shared mount a slave), refused rather than ignored.
    let unfit = if sec.privileged {
        Some("privileged".to_string())
    } else if sec.pid == NsMode::Node {
        Some("in the node's PID namespace".to_string())
    } else {
        req.mounts
            .iter()
            .find(|m| m.propagation == Propagation::Bidirectional)
            .map(|m| format!("with Bidirectional mount {}", m.container_path))
    };
    let user = match pod.spec.userns {
        None => None,
        Some(_) if unfit.is_some() => {
            return Err(Error::InvalidArgument(format!(
                "container {}: {} in a pod with a user namespace",
                req.name,
                unfit.unwrap_or_default()
            )))
        }
        Some(_) => Some(Ns::Join(pod.namespaces.get("user").cloned().ok_or_else(
            || {
                Error::FailedPrecondition(format!(
                    "pod sandbox {}: its monitor made no user namespace (started before hako \
                 supported them): recreate the pod",
                    pod.id
                ))
            },
        )?)),
    };
    // kubelet asks for an unmasked /proc (procMount Unmasked, which it allows only with
    // hostUsers: false) with empty lists, which the CRI cannot tell from none (a Default one
    // comes with its lists): in a user namespace none means none. Elsewhere hako's defaults.
    let unlisted = |given: &Option<Vec<String>>| match given {
        None if user.is_some() => Some(Vec::new()),
        g => g.clone(),
    };
    let (masked_paths, readonly_paths) =
        (unlisted(&sec.masked_paths), unlisted(&sec.readonly_paths));
    let cgroup_parent = pod_cgroup(pod);
    let mut cs = ContainerSpec {
        args,
        env,
        cwd,
        uid,
        gid,
        additional_gids: extra,
        tty: req.tty,
        hostname: pod.spec.hostname.clone(),
        rootfs: inputs.rootfs.display().to_string(),
        readonly_rootfs: sec.readonly_rootfs,
        mounts,
        devices: inputs.devices,
        network: Some(join("network")),
        ipc: Some(join("ipc")),
        uts: Some(join("uts")),
        pid: Some(pid),
        no_cgroup_ns: user.is_some() && !inputs.cgroup2,
        user,
        privileged: sec.privileged,
        add_capabilities: sec.add_capabilities.clone(),
        drop_capabilities: sec.drop_capabilities.clone(),
        no_new_privileges: sec.no_new_privs,
        cgroups_path: format!("{cgroup_parent}/hako-{id}"),
        resources: inputs.resources,
        oom_score_adj: req.oom_score_adj.map(|adj| {
            let adj = adj.clamp(-1000, 1000) as i32;
            match inputs.oom_floor {
                Some(floor) if adj < floor => {
                    tracing::info!(container = %id, requested = adj, used = floor, "oom_score_adj raised to the daemon's own");
                    floor
                }
                _ => adj,
            }
        }),
        sysctls: BTreeMap::new(),
        annotations: req.annotations.clone(),
        masked_paths,
        readonly_paths,
        cap_limit: inputs.cap_limit,
        seccomp: oci::Seccomp::Unconfined,
        apparmor_profile: inputs.apparmor_profile,
    };
    let caps = oci::capabilities(&cs);
    cs.seccomp = match &sec.seccomp {
        SeccompReq::Unconfined => oci::Seccomp::Unconfined,
        SeccompReq::RuntimeDefault => oci::Seccomp::RuntimeDefault,
        SeccompReq::Localhost(path) => {
            let text = inputs
                .seccomp_profile
                .as_deref()
                .ok_or_else(|| Error::Internal(format!("seccomp profile {path} was not read")))?;
            oci::Seccomp::Profile(oci::localhost_profile(path, text, &caps)?)
        }
    };
    let log_path = container_log_path(&pod.spec.log_directory, &req.log_path)
        .map_err(|e| e.context(format!("container {}", req.name)))?
        .display()
        .to_string();
    let user = UserIds {
        uid: cs.uid,
        gid: cs.gid,
        groups: std::iter::once(cs.gid)
            .chain(cs.additional_gids.iter().copied().filter(|g| *g != cs.gid))
            .collect(),
    };
    Ok(Planned {
        spec: cs,
        stop_signal,
        log_path,
        user,
    })
}

/// The signal a stop sends first: the pod spec's when it names one, else the image's
/// STOPSIGNAL, else none (SIGTERM). One no kernel has is refused, naming where it came from.
pub fn stop_signal(req: &ContainerSpecReq, image: &ImageConfiguration) -> Result<Option<String>> {
    let (sig, from) = match &req.stop_signal {
        Some(sig) => (sig.as_str(), format!("container {}: stop signal", req.name)),
        None => match section(image).stop_signal().as_deref() {
            Some(sig) if !sig.is_empty() => (sig, format!("image {}: STOPSIGNAL", req.image)),
            _ => return Ok(None),
        },
    };
    parse_signal(sig)
        .ok_or_else(|| Error::InvalidArgument(format!("{from} {sig:?} is unknown")))?;
    Ok(Some(sig.to_string()))
}

/// The Localhost seccomp profile a container names, to be read before its spec; refused
/// when not an absolute path.
pub fn seccomp_profile_path(req: &ContainerSpecReq) -> Result<Option<&str>> {
    match &req.security.seccomp {
        SeccompReq::Localhost(path) if !path.starts_with('/') => {
            Err(Error::InvalidArgument(format!(
                "seccomp profile {path:?} of container {}: not an absolute path",
                req.name
            )))
        }
        SeccompReq::Localhost(path) => Ok(Some(path)),
        _ => Ok(None),
    }
}

/// The AppArmor decision for container `name`, as containerd's CRI makes it (see
/// `hako_runtime::apparmor`), `host_enabled` being whether this host has AppArmor.
pub fn apparmor_decision(
    sec: &Security,
    name: &str,
    host_enabled: bool,
) -> Result<hako_runtime::apparmor::Decision> {
    hako_runtime::apparmor::decide(sec.apparmor.as_ref(), sec.privileged, host_enabled)
        .map_err(|e| Error::from(e).context(format!("container {name}")))
}

/// Where a container's CRI log goes: `log_path` below the pod's `log_directory`. A relative
/// path may not climb out (`..`); an absolute one is accepted only when it already lies below
/// the log directory. No log directory (or no path): no log.
pub fn container_log_path(log_directory: &str, log_path: &str) -> Result<PathBuf> {
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
pub fn cdi_requests(req: &ContainerSpecReq) -> Vec<String> {
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
    // Linux's other names for three signals, which nix does not parse (the CRI's Signal enum
    // and Docker's signal table have them).
    let name = match name.as_str() {
        "SIGCLD" => "SIGCHLD",
        "SIGPOLL" => "SIGIO",
        "SIGIOT" => "SIGABRT",
        other => other,
    };
    name.parse::<nix::sys::signal::Signal>()
        .ok()
        .map(|s| s as i32)
}

/// The pod's cgroup: kubelet's parent, or `/hako/<pod id>` when it gives none.
pub fn pod_cgroup(pod: &PodRecord) -> String {
    if pod.spec.cgroup_parent.is_empty() {
        format!("/hako/{}", pod.id)
    } else {
        // Checked at RunPodSandbox; a record from before that check keeps its old path.
        normalized_cgroup_path(&pod.spec.cgroup_parent)
            .unwrap_or_else(|_| cgroupfs_path(&pod.spec.cgroup_parent))
    }
}

/// A cgroup parent as a cgroupfs path that stays below the cgroup root: `..` anywhere (or a
/// slice name that would make one) is refused, empty and `.` components are dropped. A
/// parent outside the tree would leave the pod's containers without their limits. So is a
/// parent in hako's own cgroups, the pods' `/hako/<id>` and the containers' `hako-<id>`: a pod
/// placed there would be killed by the kill of the cgroup it sits in (another pod's
/// container's, whose kill walks the cgroups below).
pub fn confined_cgroup_path(parent: &str) -> std::result::Result<String, &'static str> {
    let clean = normalized_cgroup_path(parent)?;
    let container_cgroup = |c: &str| {
        c.strip_prefix("hako-")
            .is_some_and(|id| id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    if clean == "/hako" || clean.starts_with("/hako/") || clean.split('/').any(container_cgroup) {
        return Err("is in hako's own cgroups (\"/hako\", a container's \"hako-<id>\")");
    }
    Ok(clean)
}

/// The cgroupfs path of a cgroup parent, `.` and empty components dropped; refused when it
/// leaves the tree or is its root (see [`confined_cgroup_path`], which RunPodSandbox checks).
fn normalized_cgroup_path(parent: &str) -> std::result::Result<String, &'static str> {
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

fn userns_text(u: Option<&hako_runtime::monitor::UserNs>) -> String {
    match u {
        None => "none".into(),
        Some(u) => format!(
            "UIDs 0-{} as {}-{}, GIDs 0-{} as {}-{}",
            u.uid.length - 1,
            u.uid.host_id,
            u.uid.host_id as u64 + u.uid.length as u64 - 1,
            u.gid.length - 1,
            u.gid.host_id,
            u.gid.host_id as u64 + u.gid.length as u64 - 1
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::json;

    use crate::pods::{ContainerSpecReq, MountReq, PodSpec, PodState, Propagation, SeccompReq};
    use hako_runtime::apparmor::{Decision, Request as AppArmorReq};

    /// What `container_spec` takes: a pod, a request, the image config (as the registry serves
    /// it, typed by [`image`]) and the host's inputs.
    struct Case {
        pod: PodRecord,
        req: ContainerSpecReq,
        image: serde_json::Value,
        inputs: Inputs,
    }

    /// The image config document typed, as CreateContainer reads it from the store.
    fn image(doc: &serde_json::Value) -> Result<ImageConfiguration> {
        crate::image::parse_config("example.com/app:1", &serde_json::to_vec(doc).unwrap())
    }

    fn base() -> Case {
        let ns = |k: &str| (k.to_string(), format!("/run/hako/pods/p1/ns/{k}"));
        Case {
            pod: PodRecord {
                v: crate::store::RECORD_VERSION,
                id: "p1".into(),
                spec: PodSpec {
                    name: "web".into(),
                    uid: "u1".into(),
                    namespace: "default".into(),
                    hostname: "web-0".into(),
                    log_directory: "/var/log/pods/p1".into(),
                    pid: NsMode::Container,
                    ..Default::default()
                },
                state: PodState::Ready,
                created_at: 0,
                monitor_pid: 1,
                namespaces: [ns("network"), ns("ipc"), ns("uts")].into_iter().collect(),
                ips: vec![],
            },
            req: ContainerSpecReq {
                name: "app".into(),
                image: "example.com/app:1".into(),
                log_path: "app/0.log".into(),
                security: Security {
                    pid: NsMode::Container,
                    ..Default::default()
                },
                ..Default::default()
            },
            image: json!({
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": []},
                "config": {
                    "Entrypoint": ["/bin/sh"],
                    "Cmd": ["-c", "echo hi"],
                    "Env": ["PATH=/bin", "A=1"],
                    "WorkingDir": "/srv",
                },
            }),
            inputs: Inputs {
                rootfs: "/run/hako/containers/c1/rootfs".into(),
                ..Default::default()
            },
        }
    }

    fn plan(tweak: impl FnOnce(&mut Case)) -> Result<Planned> {
        let mut c = base();
        tweak(&mut c);
        container_spec(&c.pod, "c1", &c.req, &image(&c.image)?, c.inputs)
    }

    /// Applies `tweak` to the base case and hands what it plans to `check`.
    fn check(tweak: impl FnOnce(&mut Case), check: impl FnOnce(&Planned)) {
        match plan(tweak) {
            Ok(p) => check(&p),
            Err(e) => panic!("refused: {e:?}"),
        }
    }

    /// Applies `tweak` to the base case, which must be refused; `check` gets the error.
    fn refused(tweak: impl FnOnce(&mut Case), check: impl FnOnce(&Error)) {
        match plan(tweak) {
            Ok(p) => panic!("planned: {:?}", p.spec),
            Err(e) => check(&e),
        }
    }

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn command_and_args_come_from_request_then_image() {
        // (command, args, image entrypoint, image cmd) → process args
        for (command, args, entrypoint, cmd, want) in [
            (vec![], vec![], vec!["/ep"], vec!["c1"], vec!["/ep", "c1"]),
            (
                vec![],
                vec!["a1"],
                vec!["/ep"],
                vec!["c1"],
                vec!["/ep", "a1"],
            ),
            (vec!["/x"], vec![], vec!["/ep"], vec!["c1"], vec!["/x"]),
            (
                vec!["/x"],
                vec!["a1"],
                vec!["/ep"],
                vec!["c1"],
                vec!["/x", "a1"],
            ),
            (vec![], vec![], vec![], vec!["c1", "c2"], vec!["c1", "c2"]),
            (vec![], vec!["a1"], vec![], vec!["c1"], vec!["a1"]),
        ] {
            check(
                |c| {
                    c.req.command = strs(&command);
                    c.req.args = strs(&args);
                    c.image["config"]["Entrypoint"] = json!(entrypoint);
                    c.image["config"]["Cmd"] = json!(cmd);
                },
                |p| assert_eq!(p.spec.args, strs(&want), "{command:?} {args:?}"),
            );
        }
        // A null Cmd is no cmd; an image without a config section has no command at all.
        check(
            |c| c.image["config"]["Cmd"] = json!(null),
            |p| assert_eq!(p.spec.args, strs(&["/bin/sh"])),
        );
        let no_section = |c: &mut Case| {
            c.image.as_object_mut().unwrap().remove("config");
        };
        for empty in [
            (|c: &mut Case| c.image["config"] = json!({})) as fn(&mut Case),
            no_section,
        ] {
            refused(empty, |e| {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                assert!(e.to_string().contains("container app: no command"), "{e}");
            });
        }
        check(
            |c| {
                no_section(c);
                c.req.command = strs(&["/x"]);
            },
            |p| {
                assert_eq!(p.spec.args, strs(&["/x"]));
                assert_eq!(p.spec.cwd, "");
                assert_eq!(p.stop_signal, None);
            },
        );
        // A config that is not one is refused naming the image.
        refused(
            |c| c.image["config"]["Entrypoint"] = json!("/bin/sh"),
            |e| assert!(e.to_string().contains("image example.com/app:1"), "{e}"),
        );
    }

    #[test]
    fn env_merges_image_and_request_with_path_and_hostname() {
        check(
            |c| c.req.envs = vec![("A".into(), "2".into()), ("B".into(), "3".into())],
            |p| {
                assert_eq!(
                    p.spec.env,
                    strs(&["PATH=/bin", "A=2", "B=3", "HOSTNAME=web-0"])
                )
            },
        );
        // No PATH anywhere: the usual one goes first.
        check(
            |c| c.image["config"]["Env"] = json!(["A=1"]),
            |p| {
                assert_eq!(
                    p.spec.env[0],
                    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                );
                assert_eq!(p.spec.env[1..], strs(&["A=1", "HOSTNAME=web-0"]));
            },
        );
        // A HOSTNAME given is kept; no pod hostname, none is added.
        check(
            |c| c.req.envs = vec![("HOSTNAME".into(), "mine".into())],
            |p| assert_eq!(p.spec.env, strs(&["PATH=/bin", "A=1", "HOSTNAME=mine"])),
        );
        check(
            |c| c.pod.spec.hostname.clear(),
            |p| assert_eq!(p.spec.env, strs(&["PATH=/bin", "A=1"])),
        );
        // A null Env (Docker writes one) is no env.
        check(
            |c| c.image["config"]["Env"] = json!(null),
            |p| {
                assert_eq!(
                    p.spec.env,
                    strs(&[
                        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "HOSTNAME=web-0"
                    ])
                )
            },
        );
    }

    #[test]
    fn nul_bytes_and_nameless_image_env_entries_are_refused_naming_their_source() {
        let ia = |want: &'static str| {
            move |e: &Error| {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                assert!(e.to_string().contains(want), "{e}");
            }
        };
        refused(
            |c| c.image["config"]["Env"] = json!(["=x"]),
            ia("ENV entry \"\" has an empty name"),
        );
        refused(
            |c| c.image["config"]["Env"] = json!(["A=1\u{0}"]),
            ia("ENV entry \"A\""),
        );
        refused(
            |c| c.image["config"]["Cmd"] = json!(["sh", "-c", "a\u{0}b"]),
            ia("argument 3 of its command contains a NUL byte"),
        );
        refused(
            |c| c.req.args = vec!["ok".into(), "x\0".into()],
            ia("argument 2 of its command"),
        );
        refused(
            |c| c.req.working_dir = "/a\0b".into(),
            ia("working directory"),
        );
        // An image entry the pod's own variable replaces is not checked.
        check(
            |c| {
                c.image["config"]["Env"] = json!(["A=bad\u{0}"]);
                c.req.envs = vec![("A".into(), "good".into())];
            },
            |p| {
                assert!(
                    p.spec.env.contains(&"A=good".to_string()),
                    "{:?}",
                    p.spec.env
                )
            },
        );
        // An entry without `=` is a variable with an empty value, as libcontainer sets it.
        check(
            |c| c.image["config"]["Env"] = json!(["FLAG"]),
            |p| assert!(p.spec.env.contains(&"FLAG".to_string()), "{:?}", p.spec.env),
        );
    }

    #[test]
    fn working_dir_from_request_else_image() {
        check(|_| {}, |p| assert_eq!(p.spec.cwd, "/srv"));
        check(
            |c| c.req.working_dir = "/work".into(),
            |p| assert_eq!(p.spec.cwd, "/work"),
        );
        check(
            |c| c.image["config"]["WorkingDir"] = json!(null),
            |p| assert_eq!(p.spec.cwd, ""),
        );
    }

    #[test]
    fn the_user_to_look_up_comes_from_request_then_image() {
        // (run_as_user, run_as_username, run_as_group, image USER) → (user, group)
        for (uid, name, gid, image_user, want) in [
            (None, "", None, "", ("0", None)),
            (None, "", None, "www-data", ("www-data", None)),
            (
                None,
                "",
                None,
                "www-data:wheel",
                ("www-data", Some("wheel")),
            ),
            (None, "", None, "1000:50", ("1000", Some("50"))),
            (Some(7), "", None, "www-data:wheel", ("7", None)),
            (None, "bob", None, "www-data:wheel", ("bob", None)),
            (Some(7), "bob", Some(9), "", ("7", Some("9"))),
            (None, "", Some(9), "", ("", None)),
        ] {
            let mut c = base();
            c.req.security.run_as_user = uid;
            c.req.security.run_as_username = name.into();
            c.req.security.run_as_group = gid;
            c.image["config"]["User"] = json!(image_user);
            let got = user_to_resolve(&c.req, &image(&c.image).unwrap());
            if want.0.is_empty() {
                let e = got.unwrap_err();
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                assert!(e.to_string().contains("run_as_group needs"), "{e}");
                continue;
            }
            let want = (want.0.to_string(), want.1.map(str::to_string));
            assert_eq!(
                got.unwrap(),
                want,
                "{uid:?} {name:?} {gid:?} {image_user:?}"
            );
        }
    }

    #[test]
    fn the_resolved_user_gets_supplemental_groups() {
        let account = Account {
            uid: 1000,
            gid: 1000,
            groups: vec![10, 50000],
        };
        for (strict, supplemental, want) in [
            (false, vec![], vec![10, 50000]),
            (false, vec![5, 10, 1000], vec![10, 50000, 5, 1000]),
            (true, vec![5], vec![5]),
            (true, vec![], vec![]),
        ] {
            let account = account.clone();
            check(
                |c| {
                    c.inputs.account = account;
                    c.req.security.strict_supplemental_groups = strict;
                    c.req.security.supplemental_groups = supplemental.clone();
                },
                |p| {
                    assert_eq!((p.spec.uid, p.spec.gid), (1000, 1000));
                    assert_eq!(p.spec.additional_gids, want, "{strict} {supplemental:?}");
                    // The record's groups: the primary first, never twice.
                    let mut groups = vec![1000];
                    groups.extend(want.iter().filter(|g| **g != 1000));
                    assert_eq!(p.user.groups, groups);
                    assert_eq!((p.user.uid, p.user.gid), (1000, 1000));
                },
            );
        }
    }

    #[test]
    fn mounts_keep_their_propagation_and_pod_files_fill_in() {
        let mount = |dest: &str, propagation, readonly, rro| MountReq {
            container_path: dest.into(),
            host_path: format!("/host{dest}"),
            readonly,
            propagation,
            recursive_readonly: rro,
            ..Default::default()
        };
        let pod_files = vec![
            (
                "/etc/resolv.conf".to_string(),
                "/pd/resolv.conf".to_string(),
            ),
            ("/etc/hosts".to_string(), "/pd/hosts".to_string()),
        ];
        check(
            |c| {
                c.req.mounts = vec![
                    mount("/data", Propagation::Private, false, false),
                    mount("/ro", Propagation::Private, true, true),
                    mount("/slave", Propagation::HostToContainer, false, false),
                    mount("/shared", Propagation::Bidirectional, false, false),
                    mount("/etc/hosts", Propagation::Private, true, false),
                ];
                c.inputs.pod_files = pod_files.clone();
                c.req.security.readonly_rootfs = true;
            },
            |p| {
                let got: Vec<(&str, &str, &str, bool, bool)> = p
                    .spec
                    .mounts
                    .iter()
                    .map(|m| {
                        (
                            m.destination.as_str(),
                            m.source.as_str(),
                            m.propagation.as_str(),
                            m.readonly,
                            m.recursive_readonly,
                        )
                    })
                    .collect();
                assert_eq!(
                    got,
                    [
                        ("/data", "/host/data", "rprivate", false, false),
                        ("/ro", "/host/ro", "rprivate", true, true),
                        ("/slave", "/host/slave", "rslave", false, false),
                        ("/shared", "/host/shared", "rshared", false, false),
                        // The request's own /etc/hosts wins over the pod's.
                        ("/etc/hosts", "/host/etc/hosts", "rprivate", true, false),
                        // Read-only with a read-only rootfs.
                        (
                            "/etc/resolv.conf",
                            "/pd/resolv.conf",
                            "rprivate",
                            true,
                            false
                        ),
                    ]
                );
            },
        );
        for (readonly, propagation) in [
            (false, Propagation::Private),
            (true, Propagation::HostToContainer),
        ] {
            refused(
                |c| c.req.mounts = vec![mount("/rro", propagation, readonly, true)],
                |e| {
                    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                    assert!(
                        e.to_string().contains("recursive read-only mount /rro"),
                        "{e}"
                    );
                },
            );
        }
    }

    #[test]
    fn devices_and_rootfs_are_the_inputs() {
        let dev = oci::Device {
            path: "/dev/fake0".into(),
            kind: "c".into(),
            major: 10,
            minor: 200,
            access: "rw".into(),
            ..Default::default()
        };
        check(
            |c| c.inputs.devices = vec![dev.clone()],
            |p| {
                assert_eq!(p.spec.devices, vec![dev.clone()]);
                assert_eq!(p.spec.rootfs, "/run/hako/containers/c1/rootfs");
            },
        );
    }

    #[test]
    fn namespaces_follow_pod_and_container_modes() {
        check(
            |_| {},
            |p| {
                assert_eq!(
                    p.spec.network,
                    Some(Ns::Join("/run/hako/pods/p1/ns/network".into()))
                );
                assert_eq!(p.spec.pid, Some(Ns::New));
                assert_eq!(p.spec.user, None);
            },
        );
        // A pod's user namespace: its containers join it, and only they.
        let ids = |host_id| hako_runtime::monitor::UserNs {
            uid: hako_runtime::monitor::IdRange {
                host_id,
                length: 65536,
            },
            gid: hako_runtime::monitor::IdRange {
                host_id,
                length: 65536,
            },
        };
        let in_userns = |c: &mut Case| {
            c.pod.spec.userns = Some(ids(65536));
            c.pod.namespaces.insert("user".into(), "/pd/ns/user".into());
            c.req.userns = Some(ids(65536));
        };
        check(in_userns, |p| {
            assert_eq!(p.spec.user, Some(Ns::Join("/pd/ns/user".into())));
            assert!(p.spec.no_cgroup_ns, "cgroup v1 in the test inputs");
            // No lists: unmasked, as kubelet's procMount Unmasked; given lists stay.
            assert_eq!(p.spec.masked_paths, Some(vec![]));
            assert_eq!(p.spec.readonly_paths, Some(vec![]));
        });
        check(
            |c| {
                in_userns(c);
                c.req.security.masked_paths = Some(vec!["/proc/kcore".into()]);
            },
            |p| assert_eq!(p.spec.masked_paths, Some(vec!["/proc/kcore".to_string()])),
        );
        check(|_| {}, |p| assert_eq!(p.spec.masked_paths, None));
        let other = ids(131072);
        type Tweak = Box<dyn Fn(&mut Case)>;
        let tweaks: [(Tweak, &str); 6] = [
            (Box::new(|c| c.req.userns = None), "is not its pod's"),
            (
                Box::new(move |c| c.req.userns = Some(other)),
                "is not its pod's",
            ),
            (Box::new(|c| c.req.security.privileged = true), "privileged"),
            (
                Box::new(|c| c.req.security.pid = NsMode::Node),
                "node's PID namespace",
            ),
            (
                Box::new(|c| {
                    c.req.mounts = vec![MountReq {
                        container_path: "/b".into(),
                        host_path: "/srv/b".into(),
                        propagation: Propagation::Bidirectional,
                        ..Default::default()
                    }]
                }),
                "Bidirectional mount /b",
            ),
            (
                Box::new(|c| {
                    c.pod.namespaces.remove("user");
                }),
                "made no user namespace",
            ),
        ];
        for (tweak, why) in tweaks {
            refused(
                |c| {
                    in_userns(c);
                    tweak(c);
                },
                |e| assert!(e.to_string().contains(why), "{e}"),
            );
        }
        refused(
            |c| c.req.userns = Some(ids(65536)),
            |e| assert!(e.to_string().contains("is not its pod's (none)"), "{e}"),
        );
        // A pod on the host's network has no network namespace to join.
        check(
            |c| {
                c.pod.namespaces.remove("network");
            },
            |p| assert_eq!(p.spec.network, Some(Ns::Host)),
        );
        check(
            |c| {
                c.pod.spec.pid = NsMode::Pod;
                c.req.security.pid = NsMode::Pod;
                c.pod.namespaces.insert("pid".into(), "/pd/ns/pid".into());
            },
            |p| assert_eq!(p.spec.pid, Some(Ns::Join("/pd/ns/pid".into()))),
        );
        check(
            |c| {
                c.req.security.pid = NsMode::Target;
                c.inputs.target_pid = Some(4242);
            },
            |p| assert_eq!(p.spec.pid, Some(Ns::Join("/proc/4242/ns/pid".into()))),
        );
        check(
            |c| c.req.security.pid = NsMode::Node,
            |p| assert_eq!(p.spec.pid, Some(Ns::Host)),
        );
    }

    #[test]
    fn stop_signals_are_kept_or_refused() {
        check(|_| {}, |p| assert_eq!(p.stop_signal, None));
        // An empty STOPSIGNAL is none.
        check(
            |c| c.image["config"]["StopSignal"] = json!(""),
            |p| assert_eq!(p.stop_signal, None),
        );
        check(
            |c| c.image["config"]["StopSignal"] = json!("SIGQUIT"),
            |p| assert_eq!(p.stop_signal.as_deref(), Some("SIGQUIT")),
        );
        for bad in ["SIGRTMIN+-40", "SIGNOPE", "0"] {
            refused(
                |c| c.image["config"]["StopSignal"] = json!(bad),
                |e| {
                    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                    let m = e.to_string();
                    assert!(m.contains("example.com/app:1") && m.contains(bad), "{m}");
                },
            );
        }
    }

    #[test]
    fn the_pod_specs_stop_signal_wins_over_the_images() {
        check(
            |c| {
                c.image["config"]["StopSignal"] = json!("SIGQUIT");
                c.req.stop_signal = Some("SIGUSR1".into());
            },
            |p| assert_eq!(p.stop_signal.as_deref(), Some("SIGUSR1")),
        );
        check(
            |c| c.req.stop_signal = Some("SIGRTMIN+3".into()),
            |p| assert_eq!(p.stop_signal.as_deref(), Some("SIGRTMIN+3")),
        );
        refused(
            |c| c.req.stop_signal = Some("SIGNOPE".into()),
            |e| {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                assert!(e.to_string().contains("SIGNOPE"), "{e}");
            },
        );
    }

    #[test]
    fn mount_options_only_take_away() {
        let with = |options: &[&str]| {
            let options = strs(options);
            move |c: &mut Case| {
                c.req.mounts = vec![MountReq {
                    container_path: "/data".into(),
                    host_path: "/srv/data".into(),
                    options,
                    ..Default::default()
                }]
            }
        };
        check(with(&["noexec", "nodev", "nosuid"]), |p| {
            let m = p
                .spec
                .mounts
                .iter()
                .find(|m| m.destination == "/data")
                .unwrap();
            assert_eq!(m.options, strs(&["noexec", "nodev", "nosuid"]));
        });
        for bad in ["suid", "dev", "exec", "rw", "remount", "bind", "x-foo"] {
            refused(with(&["nosuid", bad]), |e| {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                let m = e.to_string();
                assert!(m.contains("/data") && m.contains(bad), "{m}");
            });
        }
        for relative in ["srv/data", "", "./x"] {
            refused(
                |c: &mut Case| {
                    c.req.mounts = vec![MountReq {
                        container_path: "/data".into(),
                        host_path: relative.into(),
                        ..Default::default()
                    }]
                },
                |e| {
                    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                    assert!(e.to_string().contains("is not absolute"), "{e}");
                },
            );
        }
    }

    #[test]
    fn the_cgroup_is_below_the_pod_parent() {
        check(
            |_| {},
            |p| assert_eq!(p.spec.cgroups_path, "/hako/p1/hako-c1"),
        );
        check(
            |c| c.pod.spec.cgroup_parent = "kubepods-besteffort-pod1.slice".into(),
            |p| {
                assert_eq!(
                    p.spec.cgroups_path,
                    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/hako-c1"
                )
            },
        );
        check(
            |c| c.pod.spec.cgroup_parent = "/kubepods//burstable/./pod1".into(),
            |p| assert_eq!(p.spec.cgroups_path, "/kubepods/burstable/pod1/hako-c1"),
        );
    }

    #[test]
    fn the_log_goes_below_the_pod_log_directory() {
        check(
            |_| {},
            |p| assert_eq!(p.log_path, "/var/log/pods/p1/app/0.log"),
        );
        check(
            |c| c.pod.spec.log_directory.clear(),
            |p| assert_eq!(p.log_path, ""),
        );
        refused(
            |c| c.req.log_path = "../other/0.log".into(),
            |e| {
                assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                let m = e.to_string();
                assert!(
                    m.contains("container app") && m.contains("../other/0.log"),
                    "{m}"
                );
            },
        );
    }

    #[test]
    fn oom_score_adj_is_clamped_and_floored() {
        for (asked, floor, want) in [
            (None, Some(-500), None),
            (Some(-2000), None, Some(-1000)),
            (Some(5000), None, Some(1000)),
            (Some(-900), Some(-500), Some(-500)),
            (Some(100), Some(-500), Some(100)),
        ] {
            check(
                |c| {
                    c.req.oom_score_adj = asked;
                    c.inputs.oom_floor = floor;
                },
                |p| assert_eq!(p.spec.oom_score_adj, want, "{asked:?} {floor:?}"),
            );
        }
    }

    #[test]
    fn seccomp_is_chosen_from_the_request() {
        check(
            |_| {},
            |p| assert_eq!(p.spec.seccomp, oci::Seccomp::Unconfined),
        );
        check(
            |c| c.req.security.seccomp = SeccompReq::RuntimeDefault,
            |p| assert_eq!(p.spec.seccomp, oci::Seccomp::RuntimeDefault),
        );
        // A Localhost profile is converted against the container's capabilities: a rule
        // for CAP_SYS_ADMIN holders only applies once the container has it.
        let profile = json!({
            "defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [
                {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}}
            ]
        });
        let names = |p: &Planned| -> Vec<String> {
            let oci::Seccomp::Profile(v) = &p.spec.seccomp else {
                panic!("not a profile: {:?}", p.spec.seccomp)
            };
            assert_eq!(
                v.default_action(),
                oci_spec::runtime::LinuxSeccompAction::ScmpActErrno
            );
            v.syscalls()
                .iter()
                .flatten()
                .flat_map(|s| s.names().clone())
                .collect()
        };
        for (add, want) in [
            (vec![], vec!["read"]),
            (vec!["SYS_ADMIN"], vec!["read", "mount"]),
        ] {
            check(
                |c| {
                    c.req.security.seccomp = SeccompReq::Localhost("/p.json".into());
                    c.inputs.seccomp_profile = Some(profile.to_string().into_bytes());
                    c.req.security.add_capabilities = strs(&add);
                },
                |p| assert_eq!(names(p), strs(&want)),
            );
        }
        for text in ["not json", "[]", "{}"] {
            refused(
                |c| {
                    c.req.security.seccomp = SeccompReq::Localhost("/p.json".into());
                    c.inputs.seccomp_profile = Some(text.into());
                },
                |e| {
                    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
                    assert!(e.to_string().contains("seccomp profile /p.json"), "{e}");
                },
            );
        }
        // Which file to read: only an absolute path.
        let mut req = base().req;
        assert_eq!(seccomp_profile_path(&req).unwrap(), None);
        req.security.seccomp = SeccompReq::Localhost("/etc/p.json".into());
        assert_eq!(seccomp_profile_path(&req).unwrap(), Some("/etc/p.json"));
        req.security.seccomp = SeccompReq::Localhost("p.json".into());
        let e = seccomp_profile_path(&req).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(e.to_string().contains("not an absolute path"), "{e}");
    }

    #[test]
    fn apparmor_is_decided_then_carried_into_the_spec() {
        let sec = |req: Option<AppArmorReq>, privileged| Security {
            apparmor: req,
            privileged,
            ..Default::default()
        };
        let local = |n: &str| Some(AppArmorReq::Localhost(n.into()));
        // (request, privileged, host enabled) → decision
        for (req, privileged, host, want) in [
            (None, false, false, Decision::None),
            (Some(AppArmorReq::Unconfined), false, true, Decision::None),
            (None, false, true, Decision::Default),
            (None, true, true, Decision::None),
            (
                local("mine"),
                false,
                true,
                Decision::Localhost("mine".into()),
            ),
        ] {
            let got = apparmor_decision(&sec(req.clone(), privileged), "app", host).unwrap();
            assert_eq!(got, want, "{req:?} {privileged} {host}");
        }
        let e = apparmor_decision(&sec(Some(AppArmorReq::RuntimeDefault), false), "app", false)
            .unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
        assert!(e.to_string().contains("container app"), "{e}");
        let e = apparmor_decision(&sec(local(""), false), "app", true).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        check(
            |c| c.inputs.apparmor_profile = Some("hako-default".into()),
            |p| assert_eq!(p.spec.apparmor_profile.as_deref(), Some("hako-default")),
        );
    }

    #[test]
    fn cdi_devices_come_from_the_field_then_container_annotations() {
        let mut req = base().req;
        req.cdi_devices = strs(&["a.com/x=1", "b.com/y=2"]);
        req.annotations = [
            (
                "cdi.k8s.io/one".to_string(),
                " b.com/y=2 , c.com/z=3,".to_string(),
            ),
            ("other".to_string(), "d.com/w=4".to_string()),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            cdi_requests(&req),
            strs(&["a.com/x=1", "b.com/y=2", "c.com/z=3"])
        );
    }

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
        for bad in [
            "/kubepods/../../escape",
            "..",
            "/a/..",
            "/",
            "//",
            "a\0b",
            "/hako",
            "hako/p1",
            "//hako/./p1",
            format!("/kubepods/pod1/hako-{}", "0a".repeat(32)).as_str(),
        ] {
            assert!(confined_cgroup_path(bad).is_err(), "{bad:?}");
        }
        for fine in ["/hakoish", "/hako-tenants/x", "/kubepods/hako-c1"] {
            assert_eq!(confined_cgroup_path(fine).unwrap(), fine);
        }
        assert_eq!(
            confined_cgroup_path("hako-batch.slice").unwrap(),
            "/hako.slice/hako-batch.slice"
        );
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
}
