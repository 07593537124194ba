//! CRI ⇄ hako conversions for pods and containers.

use std::collections::{BTreeMap, HashMap};

use hako_proto::cri;

use crate::error::Error;
use crate::pods::spec::parse_signal;
use crate::pods::{
    ContainerSpecReq, ContainerState, ContainerView, DeviceReq, Dns, MountReq, NsMode, PodRecord,
    PodSpec, PodState, PodView, PortMapping, Propagation, SeccompReq, Security,
};
use hako_runtime::apparmor::Request as AppArmorReq;
use hako_runtime::spec::Resources;

/// A CRI `Signal` as the name hako keeps and `parse_signal` reads (`SIGRTMIN+3`); `None` for
/// the runtime default (the image's STOPSIGNAL, else SIGTERM).
pub fn signal_name(v: i32) -> Result<Option<String>, Error> {
    let sig = cri::Signal::try_from(v)
        .map_err(|_| Error::InvalidArgument(format!("stop signal {v} is not a CRI Signal")))?;
    if sig == cri::Signal::RuntimeDefault {
        return Ok(None);
    }
    let name = sig.as_str_name().trim_start_matches("SIGNAL_");
    Ok(Some(name.replace("PLUS", "+").replace("MINUS", "-")))
}

/// The signal a stop of this container sends first, as a CRI `Signal`: `name` as hako keeps
/// it (a name or number, from the pod spec or the image), SIGTERM when there is none.
pub fn signal_cri(name: Option<&str>) -> i32 {
    // A CRI name is reported as kept: a pod spec's SIGCLD is SIGCLD in its status, as kubelet
    // compares it with the spec (containerd echoes it too), not SIGCHLD.
    let as_kept = name.and_then(|n| {
        cri::Signal::from_str_name(&format!(
            "SIGNAL_{}",
            n.replace('+', "PLUS").replace('-', "MINUS")
        ))
    });
    if let Some(s) = as_kept.filter(|s| *s != cri::Signal::RuntimeDefault) {
        return s as i32;
    }
    let n = name.and_then(parse_signal).unwrap_or(libc::SIGTERM);
    let (lo, hi) = (libc::SIGRTMIN(), libc::SIGRTMAX());
    let name = if (lo..=hi).contains(&n) {
        // The CRI names real-time signals from both ends, as Go's unix package does.
        match (n - lo, hi - n) {
            (0, _) => "SIGRTMIN".to_string(),
            (_, 0) => "SIGRTMAX".to_string(),
            (up, down) if up <= down => format!("SIGRTMINPLUS{up}"),
            (_, down) => format!("SIGRTMAXMINUS{down}"),
        }
    } else {
        match nix::sys::signal::Signal::try_from(n) {
            Ok(s) => s.as_str().to_string(),
            Err(_) => return cri::Signal::RuntimeDefault as i32,
        }
    };
    cri::Signal::from_str_name(&format!("SIGNAL_{name}"))
        .map_or(cri::Signal::RuntimeDefault as i32, |s| s as i32)
}

fn btree(m: HashMap<String, String>) -> BTreeMap<String, String> {
    m.into_iter().collect()
}

fn hash(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn ns_mode(v: i32) -> NsMode {
    match cri::NamespaceMode::try_from(v).unwrap_or(cri::NamespaceMode::Pod) {
        cri::NamespaceMode::Pod => NsMode::Pod,
        cri::NamespaceMode::Container => NsMode::Container,
        cri::NamespaceMode::Node => NsMode::Node,
        cri::NamespaceMode::Target => NsMode::Target,
    }
}

fn ns_mode_cri(m: NsMode) -> i32 {
    (match m {
        NsMode::Pod => cri::NamespaceMode::Pod,
        NsMode::Container => cri::NamespaceMode::Container,
        NsMode::Node => cri::NamespaceMode::Node,
        NsMode::Target => cri::NamespaceMode::Target,
    }) as i32
}

/// The user namespace a pod or container asks for (`what` names it in errors): its own for
/// mode POD with one mapping from container ID 0 each for users and groups (kubelet's shape),
/// none for mode NODE or no options. Anything else no runtime could honour is refused
/// (containerd and CRI-O refuse it too); whether hako can make one here is the runtime's call.
pub fn userns(
    u: Option<&cri::UserNamespace>,
    what: &str,
) -> Result<Option<hako_runtime::monitor::UserNs>, Error> {
    let Some(u) = u else { return Ok(None) };
    let bad = |why: String| {
        Err(Error::InvalidArgument(format!(
            "{what}: user namespace {why}"
        )))
    };
    match cri::NamespaceMode::try_from(u.mode) {
        Ok(cri::NamespaceMode::Node) if u.uids.is_empty() && u.gids.is_empty() => Ok(None),
        Ok(cri::NamespaceMode::Node) => bad("mode NODE takes no ID mappings".into()),
        Ok(cri::NamespaceMode::Pod) => {
            let mut ranges = Vec::new();
            for (kind, maps) in [("UID", &u.uids), ("GID", &u.gids)] {
                let [m] = maps.as_slice() else {
                    return bad(format!(
                        "mode POD needs exactly one {kind} mapping, got {}",
                        maps.len()
                    ));
                };
                if m.container_id != 0 {
                    return bad(format!(
                        "{kind} mapping does not map container ID 0 (it starts at {})",
                        m.container_id
                    ));
                }
                if m.length == 0 || m.host_id.checked_add(m.length - 1).is_none() {
                    return bad(format!(
                        "{kind} mapping of {} IDs from host ID {} is empty or runs past the last ID",
                        m.length, m.host_id
                    ));
                }
                // The container's root would be the node's, owning what the node's root owns.
                if m.host_id == 0 {
                    return bad(format!("{kind} mapping maps the node's root (host ID 0)"));
                }
                ranges.push(hako_runtime::monitor::IdRange {
                    host_id: m.host_id,
                    length: m.length,
                });
            }
            Ok(Some(hako_runtime::monitor::UserNs {
                uid: ranges[0],
                gid: ranges[1],
            }))
        }
        Ok(mode) => bad(format!(
            "mode {} is not supported (only NODE or POD)",
            mode.as_str_name()
        )),
        Err(_) => bad(format!("mode {} is not a CRI NamespaceMode", u.mode)),
    }
}

pub fn pod_spec(c: cri::PodSandboxConfig, runtime_handler: String) -> PodSpec {
    let md = c.metadata.unwrap_or_default();
    let linux = c.linux.unwrap_or_default();
    let ns = linux
        .security_context
        .as_ref()
        .and_then(|s| s.namespace_options.clone())
        .unwrap_or_default();
    PodSpec {
        name: md.name,
        uid: md.uid,
        namespace: md.namespace,
        attempt: md.attempt,
        hostname: c.hostname,
        log_directory: c.log_directory,
        dns: c.dns_config.map(|d| Dns {
            servers: d.servers,
            searches: d.searches,
            options: d.options,
        }),
        port_mappings: c
            .port_mappings
            .into_iter()
            .map(|p| PortMapping {
                protocol: cri::Protocol::try_from(p.protocol)
                    .map(|x| x.as_str_name().to_string())
                    .unwrap_or_default(),
                container_port: p.container_port,
                host_port: p.host_port,
                host_ip: p.host_ip,
            })
            .collect(),
        labels: btree(c.labels),
        annotations: btree(c.annotations),
        cgroup_parent: linux.cgroup_parent,
        sysctls: btree(linux.sysctls),
        // CONTAINER mode for network/IPC means the pod's own, as containerd treats it.
        network: match ns_mode(ns.network) {
            NsMode::Node => NsMode::Node,
            _ => NsMode::Pod,
        },
        pid: ns_mode(ns.pid),
        ipc: match ns_mode(ns.ipc) {
            NsMode::Node => NsMode::Node,
            _ => NsMode::Pod,
        },
        runtime_handler,
        userns: None,
    }
}

fn pod_metadata(s: &PodSpec) -> cri::PodSandboxMetadata {
    cri::PodSandboxMetadata {
        name: s.name.clone(),
        uid: s.uid.clone(),
        namespace: s.namespace.clone(),
        attempt: s.attempt,
    }
}

pub fn pod_state(s: PodState) -> i32 {
    (match s {
        PodState::Ready => cri::PodSandboxState::SandboxReady,
        PodState::NotReady => cri::PodSandboxState::SandboxNotready,
    }) as i32
}

/// The pod as reported: its record, in the state `v` gives it (NotReady while its monitor does
/// not answer).
pub fn pod_status(v: &PodView) -> cri::PodSandboxStatus {
    let p = &v.record;
    cri::PodSandboxStatus {
        id: p.id.clone(),
        metadata: Some(pod_metadata(&p.spec)),
        state: pod_state(v.state),
        created_at: p.created_at,
        network: Some(cri::PodSandboxNetworkStatus {
            ip: p.ips.first().cloned().unwrap_or_default(),
            additional_ips: p
                .ips
                .iter()
                .skip(1)
                .map(|ip| cri::PodIp { ip: ip.clone() })
                .collect(),
        }),
        linux: Some(cri::LinuxPodSandboxStatus {
            namespaces: Some(cri::Namespace {
                options: Some(cri::NamespaceOption {
                    network: ns_mode_cri(p.spec.network),
                    pid: ns_mode_cri(p.spec.pid),
                    ipc: ns_mode_cri(p.spec.ipc),
                    ..Default::default()
                }),
            }),
        }),
        labels: hash(&p.spec.labels),
        annotations: hash(&p.spec.annotations),
        runtime_handler: p.spec.runtime_handler.clone(),
    }
}

/// [`pod_status`]' list item.
pub fn pod_item(v: &PodView) -> cri::PodSandbox {
    let p = &v.record;
    cri::PodSandbox {
        id: p.id.clone(),
        metadata: Some(pod_metadata(&p.spec)),
        state: pod_state(v.state),
        created_at: p.created_at,
        labels: hash(&p.spec.labels),
        annotations: hash(&p.spec.annotations),
        runtime_handler: p.spec.runtime_handler.clone(),
    }
}

pub fn labels_match(labels: &BTreeMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// CRI limits as hako's; zero and empty mean "not set".
pub fn resources(r: cri::LinuxContainerResources) -> Resources {
    let pos = |x: i64| (x > 0).then_some(x);
    Resources {
        cpu_shares: (r.cpu_shares > 0).then_some(r.cpu_shares as u64),
        cpu_quota: pos(r.cpu_quota),
        cpu_period: (r.cpu_period > 0).then_some(r.cpu_period as u64),
        cpuset_cpus: (!r.cpuset_cpus.is_empty()).then_some(r.cpuset_cpus),
        cpuset_mems: (!r.cpuset_mems.is_empty()).then_some(r.cpuset_mems),
        memory_limit: pos(r.memory_limit_in_bytes),
        memory_swap: pos(r.memory_swap_limit_in_bytes),
        pids_limit: None,
        hugepage_limits: r
            .hugepage_limits
            .into_iter()
            .map(|h| (h.page_size, h.limit))
            .collect(),
        unified: r.unified.into_iter().collect(),
    }
}

fn resources_cri(r: &Resources) -> cri::LinuxContainerResources {
    cri::LinuxContainerResources {
        cpu_period: r.cpu_period.unwrap_or(0) as i64,
        cpu_quota: r.cpu_quota.unwrap_or(0),
        cpu_shares: r.cpu_shares.unwrap_or(0) as i64,
        memory_limit_in_bytes: r.memory_limit.unwrap_or(0),
        memory_swap_limit_in_bytes: r.memory_swap.unwrap_or(0),
        cpuset_cpus: r.cpuset_cpus.clone().unwrap_or_default(),
        cpuset_mems: r.cpuset_mems.clone().unwrap_or_default(),
        hugepage_limits: r
            .hugepage_limits
            .iter()
            .map(|(page_size, limit)| cri::HugepageLimit {
                page_size: page_size.clone(),
                limit: *limit,
            })
            .collect(),
        unified: r.unified.clone().into_iter().collect(),
        ..Default::default()
    }
}

pub fn container_req(c: cri::ContainerConfig) -> Result<ContainerSpecReq, Error> {
    let md = c.metadata.unwrap_or_default();
    // Environment values are bytes in the CRI; an OCI process environment is text, `NAME=value`
    // C strings (libcontainer's init sets each with set_var, which panics on an empty name, an
    // `=` in it or a NUL). The value is never quoted: it may be a secret.
    let envs = c
        .envs
        .into_iter()
        .map(|kv| {
            let bad = |why: &str| {
                Err(Error::InvalidArgument(format!(
                    "container {}: environment variable {:?} {why}",
                    md.name, kv.key
                )))
            };
            if kv.key.is_empty() {
                return bad("has an empty name");
            }
            if kv.key.contains(['=', '\0']) {
                return bad("has = or a NUL byte in its name");
            }
            match String::from_utf8(kv.value.clone()) {
                Ok(v) if v.contains('\0') => bad("has a NUL byte in its value"),
                Ok(v) => Ok((kv.key, v)),
                Err(_) => bad("is not valid UTF-8"),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    for m in &c.mounts {
        let bad = |why: &str| {
            Err(Error::InvalidArgument(format!(
                "container {}: mount {}: {why}",
                md.name, m.container_path
            )))
        };
        match &m.image {
            Some(_) if !m.host_path.is_empty() => {
                return bad("names both a host path and an image");
            }
            Some(i) if i.image.is_empty() => return bad("names an empty image"),
            None if !m.image_sub_path.is_empty() => {
                return bad("has an image sub path but no image");
            }
            _ => {}
        }
    }
    let stop_signal =
        signal_name(c.stop_signal).map_err(|e| e.context(format!("container {}", md.name)))?;
    let linux = c.linux.unwrap_or_default();
    let r = linux.resources.unwrap_or_default();
    let s = linux.security_context.unwrap_or_default();
    let caps = s.capabilities.clone().unwrap_or_default();
    let ns = s.namespace_options.clone().unwrap_or_default();
    let userns = userns(
        ns.userns_options.as_ref(),
        &format!("container {}", md.name),
    )?;
    // kubelet gives each mount its container's mappings, which are what hako maps every mount
    // with; other mappings (or any without a user namespace) it cannot honour.
    if let Some(m) = c.mounts.iter().find(|m| {
        let mapped = !m.uid_mappings.is_empty() || !m.gid_mappings.is_empty();
        let own = ns
            .userns_options
            .as_ref()
            .filter(|_| userns.is_some())
            .is_some_and(|u| u.uids == m.uid_mappings && u.gids == m.gid_mappings);
        mapped && !own
    }) {
        return Err(Error::InvalidArgument(format!(
            "container {}: mount {}: ID mappings other than its user namespace's are not supported",
            md.name, m.container_path
        )));
    }
    let oom_score_adj = (r.oom_score_adj != 0).then_some(r.oom_score_adj);
    Ok(ContainerSpecReq {
        name: md.name,
        attempt: md.attempt,
        image: c
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default(),
        user_image: c.image.map(|i| i.user_specified_image).unwrap_or_default(),
        command: c.command,
        args: c.args,
        working_dir: c.working_dir,
        envs,
        mounts: c
            .mounts
            .into_iter()
            .map(|m| MountReq {
                container_path: m.container_path,
                host_path: m.host_path,
                readonly: m.readonly,
                propagation: match cri::MountPropagation::try_from(m.propagation)
                    .unwrap_or(cri::MountPropagation::PropagationPrivate)
                {
                    cri::MountPropagation::PropagationPrivate => Propagation::Private,
                    cri::MountPropagation::PropagationHostToContainer => {
                        Propagation::HostToContainer
                    }
                    cri::MountPropagation::PropagationBidirectional => Propagation::Bidirectional,
                },
                recursive_readonly: m.recursive_read_only,
                options: m.mount_options,
                image: m.image.map(|i| i.image),
                image_sub_path: m.image_sub_path,
            })
            .collect(),
        devices: c
            .devices
            .into_iter()
            .map(|d| DeviceReq {
                container_path: d.container_path,
                host_path: d.host_path,
                permissions: d.permissions,
            })
            .collect(),
        cdi_devices: c.cdi_devices.into_iter().map(|d| d.name).collect(),
        labels: btree(c.labels),
        annotations: btree(c.annotations),
        log_path: c.log_path,
        tty: c.tty,
        stdin: c.stdin,
        stdin_once: c.stdin_once,
        resources: resources(r),
        oom_score_adj,
        security: Security {
            privileged: s.privileged,
            run_as_user: s.run_as_user.map(|v| v.value),
            run_as_username: s.run_as_username,
            run_as_group: s.run_as_group.map(|v| v.value),
            supplemental_groups: s.supplemental_groups,
            strict_supplemental_groups: s.supplemental_groups_policy
                == cri::SupplementalGroupsPolicy::Strict as i32,
            readonly_rootfs: s.readonly_rootfs,
            no_new_privs: s.no_new_privs,
            add_capabilities: caps.add_capabilities,
            drop_capabilities: caps.drop_capabilities,
            masked_paths: (!s.masked_paths.is_empty()).then_some(s.masked_paths),
            readonly_paths: (!s.readonly_paths.is_empty()).then_some(s.readonly_paths),
            pid: ns_mode(ns.pid),
            pid_target: ns.target_id,
            // The deprecated path form is still what older kubelets send.
            #[allow(deprecated)]
            seccomp: seccomp(s.seccomp.as_ref(), &s.seccomp_profile_path),
            #[allow(deprecated)]
            apparmor: apparmor(s.apparmor.as_ref(), &s.apparmor_profile),
        },
        stop_signal,
        userns,
    })
}

/// The seccomp request: the typed field, else the deprecated path form (`runtime/default`,
/// `docker/default`, `unconfined`, `localhost/<path>`). No profile at all is unconfined.
fn seccomp(p: Option<&cri::SecurityProfile>, path: &str) -> SeccompReq {
    if let Some(p) = p {
        return match cri::security_profile::ProfileType::try_from(p.profile_type)
            .unwrap_or(cri::security_profile::ProfileType::RuntimeDefault)
        {
            cri::security_profile::ProfileType::RuntimeDefault => SeccompReq::RuntimeDefault,
            cri::security_profile::ProfileType::Unconfined => SeccompReq::Unconfined,
            cri::security_profile::ProfileType::Localhost => {
                SeccompReq::Localhost(p.localhost_ref.clone())
            }
        };
    }
    match path {
        "runtime/default" | "docker/default" => SeccompReq::RuntimeDefault,
        p if p.starts_with("localhost/") => {
            SeccompReq::Localhost(p["localhost/".len()..].to_string())
        }
        _ => SeccompReq::Unconfined,
    }
}

/// The AppArmor request: the typed field, else the deprecated string form; neither is `None`.
fn apparmor(p: Option<&cri::SecurityProfile>, path: &str) -> Option<AppArmorReq> {
    let Some(p) = p else {
        return AppArmorReq::from_path(path);
    };
    Some(
        match cri::security_profile::ProfileType::try_from(p.profile_type)
            .unwrap_or(cri::security_profile::ProfileType::RuntimeDefault)
        {
            cri::security_profile::ProfileType::RuntimeDefault => AppArmorReq::RuntimeDefault,
            cri::security_profile::ProfileType::Unconfined => AppArmorReq::Unconfined,
            // The name, with the prefix of the string form tolerated as containerd does.
            cri::security_profile::ProfileType::Localhost => AppArmorReq::Localhost(
                p.localhost_ref
                    .strip_prefix("localhost/")
                    .unwrap_or(&p.localhost_ref)
                    .to_string(),
            ),
        },
    )
}

fn container_state(s: ContainerState) -> i32 {
    (match s {
        ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
        ContainerState::Unknown => cri::ContainerState::ContainerUnknown,
    }) as i32
}

fn container_metadata(v: &ContainerView) -> cri::ContainerMetadata {
    cri::ContainerMetadata {
        name: v.record.spec.name.clone(),
        attempt: v.record.spec.attempt,
    }
}

pub fn container_status(v: &ContainerView) -> cri::ContainerStatus {
    let r = &v.record;
    let (exit_code, finished_at, reason) = match (&v.exit, v.state) {
        (Some(e), ContainerState::Exited) if r.start_error.is_some() => {
            (128, e.finished_at, "StartError".to_string())
        }
        (Some(e), ContainerState::Exited) => {
            let reason = if e.oom_killed {
                "OOMKilled"
            } else if e.code == 0 {
                "Completed"
            } else {
                "Error"
            };
            (e.code, e.finished_at, reason.to_string())
        }
        _ => (0, 0, String::new()),
    };
    cri::ContainerStatus {
        id: r.id.clone(),
        metadata: Some(container_metadata(v)),
        state: container_state(v.state),
        created_at: r.created_at,
        started_at: v.started_at,
        finished_at,
        exit_code,
        image: Some(status_image(&r.spec)),
        image_ref: r.image_ref.clone(),
        stop_signal: signal_cri(r.stop_signal.as_deref()),
        reason,
        message: r.start_error.clone().unwrap_or_default(),
        labels: hash(&r.spec.labels),
        annotations: hash(&r.spec.annotations),
        mounts: r
            .spec
            .mounts
            .iter()
            .map(|m| cri::Mount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                readonly: m.readonly,
                propagation: (match m.propagation {
                    Propagation::Private => cri::MountPropagation::PropagationPrivate,
                    Propagation::HostToContainer => {
                        cri::MountPropagation::PropagationHostToContainer
                    }
                    Propagation::Bidirectional => cri::MountPropagation::PropagationBidirectional,
                }) as i32,
                recursive_read_only: m.recursive_readonly,
                image: m.image.as_ref().map(|image| cri::ImageSpec {
                    image: image.clone(),
                    ..Default::default()
                }),
                image_sub_path: m.image_sub_path.clone(),
                mount_options: m.options.clone(),
                ..Default::default()
            })
            .collect(),
        log_path: r.log_path.clone(),
        resources: Some(cri::ContainerResources {
            linux: Some(resources_cri(&r.spec.resources)),
            windows: None,
        }),
        image_id: r.image_id.clone(),
        user: r.user.as_ref().map(|u| cri::ContainerUser {
            linux: Some(cri::LinuxContainerUser {
                uid: u.uid as i64,
                gid: u.gid as i64,
                supplemental_groups: u.groups.iter().map(|g| *g as i64).collect(),
            }),
        }),
    }
}

/// The image of a container's status: the name the pod spec gave, as containerd and CRI-O
/// report a name. kubelet creates containers from the image ID and sets the status' `image`
/// from this answer; the status must read as the pod spec's image (an update of the spec's image
/// is seen done when they are equal).
fn status_image(spec: &ContainerSpecReq) -> cri::ImageSpec {
    let image = if spec.user_image.is_empty() {
        &spec.image
    } else {
        &spec.user_image
    };
    cri::ImageSpec {
        image: image.clone(),
        user_specified_image: spec.user_image.clone(),
        ..Default::default()
    }
}

pub fn container_item(v: &ContainerView) -> cri::Container {
    let r = &v.record;
    cri::Container {
        id: r.id.clone(),
        pod_sandbox_id: r.pod_id.clone(),
        metadata: Some(container_metadata(v)),
        image: Some(cri::ImageSpec {
            image: r.spec.image.clone(),
            ..Default::default()
        }),
        image_ref: r.image_ref.clone(),
        state: container_state(v.state),
        created_at: r.created_at,
        labels: hash(&r.spec.labels),
        annotations: hash(&r.spec.annotations),
        image_id: r.image_id.clone(),
    }
}

pub fn container_state_matches(v: &ContainerView, want: i32) -> bool {
    container_state(v.state) == want
}

fn u64v(v: u64) -> Option<cri::UInt64Value> {
    Some(cri::UInt64Value { value: v })
}

/// A cgroup's pressure figures as the CRI carries them (kubelet's KubeletPSI, GA in 1.36).
fn psi(p: Option<hako_runtime::stats::Psi>) -> Option<cri::PsiStats> {
    let data = |l: hako_runtime::stats::PsiLine| cri::PsiData {
        total: l.total_ns,
        avg10: l.avg10,
        avg60: l.avg60,
        avg300: l.avg300,
    };
    p.map(|p| cri::PsiStats {
        full: Some(data(p.full)),
        some: Some(data(p.some)),
    })
}

/// IO usage: only its pressure is read, so none without it (cgroup v1).
fn io_usage(u: &crate::pods::Usage) -> Option<cri::IoUsage> {
    let p = u.sample.and_then(|s| s.io_psi)?;
    Some(cri::IoUsage {
        timestamp: u.timestamp,
        psi: psi(Some(p)),
    })
}

fn cpu_memory(u: &crate::pods::Usage) -> (Option<cri::CpuUsage>, Option<cri::MemoryUsage>) {
    let Some(s) = u.sample else {
        return (
            Some(cri::CpuUsage {
                timestamp: u.timestamp,
                ..Default::default()
            }),
            Some(cri::MemoryUsage {
                timestamp: u.timestamp,
                ..Default::default()
            }),
        );
    };
    (
        Some(cri::CpuUsage {
            timestamp: u.timestamp,
            usage_core_nano_seconds: u64v(s.cpu_usage_ns),
            usage_nano_cores: u.nano_cores.and_then(u64v),
            psi: psi(s.cpu_psi),
        }),
        Some(cri::MemoryUsage {
            timestamp: u.timestamp,
            working_set_bytes: u64v(s.working_set),
            // As kubelet's cAdvisor path and containerd compute it: only under a limit.
            available_bytes: s
                .memory_limit
                .and_then(|l| u64v(l.saturating_sub(s.working_set))),
            usage_bytes: u64v(s.memory_usage),
            rss_bytes: u64v(s.rss),
            page_faults: u64v(s.page_faults),
            major_page_faults: u64v(s.major_page_faults),
            psi: psi(s.memory_psi),
        }),
    )
}

pub fn container_stats(v: &ContainerView, u: &crate::pods::Usage) -> cri::ContainerStats {
    let (cpu, memory) = cpu_memory(u);
    cri::ContainerStats {
        attributes: Some(cri::ContainerAttributes {
            id: v.record.id.clone(),
            metadata: Some(container_metadata(v)),
            labels: hash(&v.record.spec.labels),
            annotations: hash(&v.record.spec.annotations),
        }),
        cpu,
        memory,
        writable_layer: Some(cri::FilesystemUsage {
            timestamp: u.timestamp,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: u.writable_mountpoint.display().to_string(),
            }),
            used_bytes: u64v(u.writable_bytes),
            inodes_used: u64v(u.writable_inodes),
        }),
        swap: None,
        io: io_usage(u),
    }
}

pub fn pod_stats(
    p: &PodRecord,
    u: &crate::pods::Usage,
    network: Option<&[crate::pods::NetCounters]>,
    containers: Vec<cri::ContainerStats>,
) -> cri::PodSandboxStats {
    let (cpu, memory) = cpu_memory(u);
    cri::PodSandboxStats {
        attributes: Some(cri::PodSandboxAttributes {
            id: p.id.clone(),
            metadata: Some(pod_metadata(&p.spec)),
            labels: hash(&p.spec.labels),
            annotations: hash(&p.spec.annotations),
        }),
        linux: Some(cri::LinuxPodSandboxStats {
            cpu,
            memory,
            network: network.and_then(|ifaces| net_usage(u.timestamp, ifaces)),
            process: u.sample.map(|s| cri::ProcessUsage {
                timestamp: u.timestamp,
                process_count: u64v(s.pids),
            }),
            containers,
            io: io_usage(u),
        }),
        windows: None,
    }
}

/// The pod's interfaces; the default one is the interface hako's CNI call names. None without
/// that interface: kubelet reads the default interface of any network usage it is given
/// (a nil one crashed kubelet 1.37's eviction manager).
fn net_usage(timestamp: i64, ifaces: &[crate::pods::NetCounters]) -> Option<cri::NetworkUsage> {
    let usage = |c: &crate::pods::NetCounters| cri::NetworkInterfaceUsage {
        name: c.name.clone(),
        rx_bytes: u64v(c.rx_bytes),
        rx_errors: u64v(c.rx_errors),
        tx_bytes: u64v(c.tx_bytes),
        tx_errors: u64v(c.tx_errors),
    };
    let default = ifaces.iter().find(|c| c.name == crate::network::IFNAME)?;
    Some(cri::NetworkUsage {
        timestamp,
        default_interface: Some(usage(default)),
        interfaces: ifaces.iter().map(usage).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_namespaces_are_read_and_malformed_ones_refused_saying_why() {
        let map = |container_id, host_id, length| cri::IdMapping {
            container_id,
            host_id,
            length,
        };
        let ns = |mode: cri::NamespaceMode, uids: Vec<cri::IdMapping>, gids| cri::UserNamespace {
            mode: mode as i32,
            uids,
            gids,
        };
        let range = |host_id, length| hako_runtime::monitor::IdRange { host_id, length };
        let good = vec![map(0, 65536, 65536)];
        assert_eq!(userns(None, "pod p").unwrap(), None);
        assert_eq!(
            userns(Some(&ns(cri::NamespaceMode::Node, vec![], vec![])), "pod p").unwrap(),
            None
        );
        assert_eq!(
            userns(
                Some(&ns(
                    cri::NamespaceMode::Pod,
                    good.clone(),
                    vec![map(0, 1000, 5)]
                )),
                "pod p"
            )
            .unwrap(),
            Some(hako_runtime::monitor::UserNs {
                uid: range(65536, 65536),
                gid: range(1000, 5)
            })
        );
        let refused = |u: cri::UserNamespace| userns(Some(&u), "pod p").unwrap_err();
        for (u, why) in [
            (
                ns(cri::NamespaceMode::Node, good.clone(), vec![]),
                "takes no ID mappings",
            ),
            (
                ns(cri::NamespaceMode::Pod, vec![], good.clone()),
                "one UID mapping, got 0",
            ),
            (
                ns(cri::NamespaceMode::Pod, good.clone(), vec![map(1, 0, 5)]),
                "GID mapping does not map container ID 0",
            ),
            (
                ns(
                    cri::NamespaceMode::Pod,
                    vec![map(0, u32::MAX, 2)],
                    good.clone(),
                ),
                "runs past",
            ),
            (
                ns(cri::NamespaceMode::Pod, vec![map(0, 5, 0)], good.clone()),
                "is empty",
            ),
            (
                ns(
                    cri::NamespaceMode::Pod,
                    good.clone(),
                    vec![map(0, 0, 65536)],
                ),
                "GID mapping maps the node's root",
            ),
            (
                ns(cri::NamespaceMode::Container, vec![], vec![]),
                "CONTAINER is not supported",
            ),
            (
                ns(cri::NamespaceMode::Target, vec![], vec![]),
                "TARGET is not supported",
            ),
            (
                cri::UserNamespace {
                    mode: 9,
                    ..Default::default()
                },
                "9 is not a CRI",
            ),
        ] {
            let e = refused(u.clone());
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.starts_with("pod p: user namespace") && m.contains(why)),
                "{u:?}: {e:?}"
            );
        }
        // The last ID of the node is a valid end of a range.
        let last = ns(cri::NamespaceMode::Pod, vec![map(0, u32::MAX, 1)], good);
        assert!(userns(Some(&last), "pod p").is_ok());
    }

    #[test]
    fn network_usage_always_has_its_default_interface() {
        let iface = |name: &str, rx: u64| crate::pods::NetCounters {
            name: name.into(),
            rx_bytes: rx,
            tx_bytes: 1,
            ..Default::default()
        };
        // A pod whose netns has no eth0 (only loopback): no network usage at all.
        let usage = net_usage(7, &[iface("lo", 5)]);
        assert!(
            usage.as_ref().is_none_or(|u| u.default_interface.is_some()),
            "network usage without a default interface: {usage:?}"
        );
        let u = net_usage(7, &[iface("lo", 5), iface(crate::network::IFNAME, 9)]).unwrap();
        let d = u.default_interface.unwrap();
        assert_eq!((d.name.as_str(), d.rx_bytes.unwrap().value), ("eth0", 9));
        assert_eq!(u.interfaces.len(), 2);
        assert_eq!(u.timestamp, 7);
    }

    #[test]
    fn pressure_reaches_cpu_memory_and_io_only_where_the_cgroup_has_it() {
        use hako_runtime::stats::{Psi, PsiLine, Sample};
        let usage = |sample: Sample| crate::pods::Usage {
            timestamp: 5,
            sample: Some(sample),
            nano_cores: None,
            writable_bytes: 0,
            writable_inodes: 0,
            writable_mountpoint: Default::default(),
        };
        let p = Psi {
            some: PsiLine {
                avg10: 1.5,
                avg60: 0.5,
                avg300: 0.1,
                total_ns: 3000,
            },
            full: PsiLine {
                total_ns: 1000,
                ..Default::default()
            },
        };
        let u = usage(Sample {
            cpu_psi: Some(p),
            memory_psi: Some(Psi::default()),
            io_psi: Some(p),
            ..Default::default()
        });
        let (cpu, memory) = cpu_memory(&u);
        let cpu = cpu.unwrap().psi.unwrap();
        let some = cpu.some.unwrap();
        assert_eq!(
            (some.total, some.avg10, some.avg60, some.avg300),
            (3000, 1.5, 0.5, 0.1)
        );
        assert_eq!(cpu.full.unwrap().total, 1000);
        assert_eq!(memory.unwrap().psi.unwrap().some.unwrap().total, 0);
        let io = io_usage(&u).unwrap();
        assert_eq!(
            (io.timestamp, io.psi.unwrap().some.unwrap().total),
            (5, 3000)
        );
        // cgroup v1: no pressure files, no figures and no IO usage.
        let v1 = usage(Sample::default());
        let (cpu, memory) = cpu_memory(&v1);
        assert!(cpu.unwrap().psi.is_none() && memory.unwrap().psi.is_none());
        assert!(io_usage(&v1).is_none());
    }

    #[test]
    fn available_memory_is_the_limit_less_the_working_set() {
        let usage = |memory_limit| crate::pods::Usage {
            timestamp: 1,
            sample: Some(hako_runtime::stats::Sample {
                memory_usage: 500,
                working_set: 300,
                memory_limit,
                ..Default::default()
            }),
            nano_cores: None,
            writable_bytes: 0,
            writable_inodes: 0,
            writable_mountpoint: Default::default(),
        };
        let available = |limit| cpu_memory(&usage(limit)).1.unwrap().available_bytes;
        assert_eq!(available(Some(1000)).map(|v| v.value), Some(700));
        // Over the limit (the kernel is reclaiming): none left, not a wrapped number.
        assert_eq!(available(Some(200)).map(|v| v.value), Some(0));
        // kubelet reads no available memory as "unlimited".
        assert_eq!(available(None), None);
    }

    #[test]
    fn every_cri_signal_round_trips_through_the_name_hako_keeps() {
        for v in 1..=64 {
            let Ok(sig) = cri::Signal::try_from(v) else {
                break;
            };
            let name = signal_name(v).unwrap().unwrap();
            assert!(parse_signal(&name).is_some(), "{name} ({sig:?}) not parsed");
            // Aliases (SIGCLD, SIGIOT, SIGPOLL) too come back as sent.
            assert_eq!(signal_cri(Some(&name)), v, "{sig:?} kept as {name}");
        }
        // An image's STOPSIGNAL by number or in another spelling is named as the CRI names it.
        assert_eq!(signal_cri(Some("17")), cri::Signal::Sigchld as i32);
        assert_eq!(signal_cri(Some("sigterm")), cri::Signal::Sigterm as i32);
        assert_eq!(signal_name(0).unwrap(), None);
        assert!(signal_name(9999).is_err());
        assert_eq!(signal_cri(None), cri::Signal::Sigterm as i32);
        assert_eq!(signal_cri(Some("9")), cri::Signal::Sigkill as i32);
        assert_eq!(
            signal_cri(Some("SIGRTMIN+1")),
            cri::Signal::Sigrtminplus1 as i32
        );
        assert_eq!(
            signal_cri(Some("SIGRTMAX-1")),
            cri::Signal::Sigrtmaxminus1 as i32
        );
    }

    #[test]
    fn environment_variables_are_names_and_text_values_without_nul() {
        let with = |key: &str, value: &[u8]| cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: "c".into(),
                attempt: 0,
            }),
            envs: vec![cri::KeyValue {
                key: key.into(),
                value: value.to_vec(),
            }],
            ..Default::default()
        };
        for (key, value, why) in [
            ("", &b"v"[..], "empty name"),
            ("A=B", b"v", "= or a NUL byte in its name"),
            ("A\0", b"v", "= or a NUL byte in its name"),
            ("SECRET", b"s3cr\0t", "NUL byte in its value"),
            ("BIN", b"\xff", "not valid UTF-8"),
        ] {
            let e = container_req(with(key, value)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
            let msg = e.to_string();
            assert!(msg.contains("container c") && msg.contains(why), "{msg}");
            assert!(!msg.contains("s3cr"), "a value is never quoted: {msg}");
        }
        let req = container_req(with("A", b"x=y")).unwrap();
        assert_eq!(req.envs, vec![("A".to_string(), "x=y".to_string())]);
    }

    #[test]
    fn a_mounts_id_mappings_must_be_its_user_namespaces() {
        let map = |host_id| {
            vec![cri::IdMapping {
                container_id: 0,
                host_id,
                length: 65536,
            }]
        };
        let with = |mount_ids: Vec<cri::IdMapping>, userns: Option<Vec<cri::IdMapping>>| {
            cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: "c".into(),
                    attempt: 0,
                }),
                mounts: vec![cri::Mount {
                    container_path: "/v".into(),
                    host_path: "/srv/v".into(),
                    uid_mappings: mount_ids.clone(),
                    gid_mappings: mount_ids,
                    ..Default::default()
                }],
                linux: Some(cri::LinuxContainerConfig {
                    security_context: Some(cri::LinuxContainerSecurityContext {
                        namespace_options: Some(cri::NamespaceOption {
                            userns_options: Some(match userns {
                                Some(ids) => cri::UserNamespace {
                                    mode: cri::NamespaceMode::Pod as i32,
                                    uids: ids.clone(),
                                    gids: ids,
                                },
                                None => cri::UserNamespace {
                                    mode: cri::NamespaceMode::Node as i32,
                                    ..Default::default()
                                },
                            }),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }
        };
        // As kubelet sends them: the container's own, or none.
        assert!(container_req(with(map(65536), Some(map(65536)))).is_ok());
        assert!(container_req(with(vec![], Some(map(65536)))).is_ok());
        assert!(container_req(with(vec![], None)).is_ok());
        for (mount_ids, userns) in [(map(131072), Some(map(65536))), (map(65536), None)] {
            let e = container_req(with(mount_ids, userns)).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("mount /v: ID mappings")),
                "{e:?}"
            );
        }
    }

    #[test]
    fn a_mount_is_a_host_path_or_an_image_never_both() {
        let with = |m: cri::Mount| cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: "c".into(),
                attempt: 0,
            }),
            mounts: vec![m],
            ..Default::default()
        };
        let image = |name: &str| {
            Some(cri::ImageSpec {
                image: name.into(),
                ..Default::default()
            })
        };
        for (m, why) in [
            (
                cri::Mount {
                    container_path: "/v".into(),
                    host_path: "/srv".into(),
                    image: image("app:1"),
                    ..Default::default()
                },
                "both a host path and an image",
            ),
            (
                cri::Mount {
                    container_path: "/v".into(),
                    image: image(""),
                    ..Default::default()
                },
                "an empty image",
            ),
            (
                cri::Mount {
                    container_path: "/v".into(),
                    host_path: "/srv".into(),
                    image_sub_path: "etc".into(),
                    ..Default::default()
                },
                "sub path but no image",
            ),
        ] {
            let e = container_req(with(m)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains("container c") && msg.contains("/v") && msg.contains(why),
                "{msg}"
            );
        }
        // An image volume with a sub path, and a plain host path, are taken as sent.
        let req = container_req(with(cri::Mount {
            container_path: "/v".into(),
            image: image("app:1"),
            image_sub_path: "etc".into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(req.mounts[0].image.as_deref(), Some("app:1"));
        assert_eq!(req.mounts[0].image_sub_path, "etc");
        let req = container_req(with(cri::Mount {
            container_path: "/v".into(),
            host_path: "/srv".into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(
            (
                req.mounts[0].image.as_deref(),
                req.mounts[0].host_path.as_str()
            ),
            (None, "/srv")
        );
    }

    #[test]
    fn a_container_status_names_the_image_as_the_pod_spec_does() {
        let config = |image: &str, user: &str| cri::ContainerConfig {
            image: Some(cri::ImageSpec {
                image: image.into(),
                user_specified_image: user.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let id = "sha256:7def0b33c7739046f2a81c7b6a2c2799560e389243f18246f4dce8e041781eee";
        let spec = container_req(config(
            id,
            "registry.k8s.io/e2e-test-images/busybox:1.37.0-2",
        ))
        .unwrap();
        assert_eq!(spec.image, id, "the image the container is made from");
        let st = status_image(&spec);
        assert_eq!(st.image, "registry.k8s.io/e2e-test-images/busybox:1.37.0-2");
        assert_eq!(
            st.user_specified_image,
            "registry.k8s.io/e2e-test-images/busybox:1.37.0-2"
        );
        // Without a user-specified image (crictl, older kubelets): the one requested.
        assert_eq!(
            status_image(&container_req(config("busybox:1", "")).unwrap()).image,
            "busybox:1"
        );
    }

    #[test]
    fn apparmor_request_from_the_typed_field_or_the_string() {
        let typed = |t: cri::security_profile::ProfileType, r: &str| cri::SecurityProfile {
            profile_type: t as i32,
            localhost_ref: r.into(),
        };
        use cri::security_profile::ProfileType as T;
        assert_eq!(apparmor(None, ""), None);
        assert_eq!(
            apparmor(None, "runtime/default"),
            Some(AppArmorReq::RuntimeDefault)
        );
        assert_eq!(
            apparmor(None, "localhost/p"),
            Some(AppArmorReq::Localhost("p".into()))
        );
        // The typed field wins over the string.
        assert_eq!(
            apparmor(Some(&typed(T::Unconfined, "")), "runtime/default"),
            Some(AppArmorReq::Unconfined)
        );
        assert_eq!(
            apparmor(Some(&typed(T::RuntimeDefault, "")), ""),
            Some(AppArmorReq::RuntimeDefault)
        );
        for r in ["p", "localhost/p"] {
            assert_eq!(
                apparmor(Some(&typed(T::Localhost, r)), ""),
                Some(AppArmorReq::Localhost("p".into()))
            );
        }
    }
}
