//! OCI runtime spec generation: a pure function from hako's container description to the
//! `config.json` libcontainer runs. Defaults follow containerd's CRI plugin (capabilities,
//! mounts, masked and read-only paths, device rules), so workloads see what they would there.

use std::collections::BTreeMap;

use std::path::PathBuf;
use std::str::FromStr;

use oci_spec::runtime::{
    self as oci, Capabilities, Capability, Linux, LinuxCapabilities, LinuxCpu, LinuxDevice,
    LinuxDeviceCgroup, LinuxDeviceType, LinuxHugepageLimit, LinuxMemory, LinuxNamespace,
    LinuxNamespaceType, LinuxPids, LinuxResources, LinuxSeccomp, Process, Root, Spec, User,
};
use serde::{Deserialize, Serialize};

/// containerd's default capability set for unprivileged containers.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Every capability the kernel knows, for privileged containers and `ALL`.
pub const ALL_CAPABILITIES: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// Where a namespace of the container comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Ns {
    /// A new namespace for this container.
    New,
    /// Join the namespace at this path (the pod's pinned one, or another container's).
    Join(String),
    /// The host's: no namespace entry at all.
    Host,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mount {
    pub destination: String,
    pub source: String,
    pub readonly: bool,
    /// "private", "rslave" or "rshared".
    pub propagation: String,
    /// Read-only all the way down: submounts of the source too (`rro`, kernel 5.12+).
    #[serde(default)]
    pub recursive_readonly: bool,
    /// More mount options (`noexec`, `nodev`, `nosuid`...), checked by the caller.
    #[serde(default)]
    pub options: Vec<String>,
}

/// A device node the container gets, and the cgroup rule that lets it use it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Device {
    /// Path inside the container.
    pub path: String,
    /// "c" or "b".
    pub kind: String,
    pub major: i64,
    pub minor: i64,
    pub file_mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// cgroup access: any of "r", "w", "m".
    pub access: String,
}

/// The container's seccomp filter.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub enum Seccomp {
    #[default]
    Unconfined,
    /// hako's default profile (see [`crate::seccomp`]).
    RuntimeDefault,
    /// A profile in OCI form (`linux.seccomp`), e.g. converted from a Localhost profile.
    Profile(LinuxSeccomp),
}

pub use crate::seccomp::{localhost_profile, profile_to_oci};

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Resources {
    pub cpu_shares: Option<u64>,
    pub cpu_quota: Option<i64>,
    pub cpu_period: Option<u64>,
    pub cpuset_cpus: Option<String>,
    pub cpuset_mems: Option<String>,
    pub memory_limit: Option<i64>,
    pub memory_swap: Option<i64>,
    pub pids_limit: Option<i64>,
    /// (page size as the kernel names it, e.g. "2MB"; limit in bytes)
    #[serde(default)]
    pub hugepage_limits: Vec<(String, u64)>,
    /// cgroup v2 files to write as given.
    #[serde(default)]
    pub unified: BTreeMap<String, String>,
}

impl Resources {
    /// These limits with every one `newer` sets replaced (an update names only what changes).
    pub fn merged(&self, newer: &Resources) -> Resources {
        let mut unified = self.unified.clone();
        unified.extend(newer.unified.clone());
        Resources {
            cpu_shares: newer.cpu_shares.or(self.cpu_shares),
            cpu_quota: newer.cpu_quota.or(self.cpu_quota),
            cpu_period: newer.cpu_period.or(self.cpu_period),
            cpuset_cpus: newer
                .cpuset_cpus
                .clone()
                .or_else(|| self.cpuset_cpus.clone()),
            cpuset_mems: newer
                .cpuset_mems
                .clone()
                .or_else(|| self.cpuset_mems.clone()),
            memory_limit: newer.memory_limit.or(self.memory_limit),
            memory_swap: newer.memory_swap.or(self.memory_swap),
            pids_limit: newer.pids_limit.or(self.pids_limit),
            hugepage_limits: if newer.hugepage_limits.is_empty() {
                self.hugepage_limits.clone()
            } else {
                newer.hugepage_limits.clone()
            },
            unified,
        }
    }
}

/// What a container is, in hako's terms; the CRI layer builds it from the CRI request and the
/// image config.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ContainerSpec {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    pub tty: bool,
    pub hostname: String,
    /// Relative to the bundle, or absolute.
    pub rootfs: String,
    pub readonly_rootfs: bool,
    pub mounts: Vec<Mount>,
    #[serde(default)]
    pub devices: Vec<Device>,
    pub network: Option<Ns>,
    pub ipc: Option<Ns>,
    pub uts: Option<Ns>,
    pub pid: Option<Ns>,
    /// The pod's user namespace to join (`None`: the host's).
    #[serde(default)]
    pub user: Option<Ns>,
    /// No cgroup namespace: a container in a user namespace on cgroup v1, whose hierarchies
    /// cannot be mounted there (libcontainer binds the host's instead).
    #[serde(default)]
    pub no_cgroup_ns: bool,
    pub privileged: bool,
    pub add_capabilities: Vec<String>,
    pub drop_capabilities: Vec<String>,
    pub no_new_privileges: bool,
    pub cgroups_path: String,
    pub resources: Resources,
    pub oom_score_adj: Option<i32>,
    pub sysctls: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// Extra masked/read-only paths from the CRI security context; `None` keeps the defaults.
    pub masked_paths: Option<Vec<String>>,
    pub readonly_paths: Option<Vec<String>>,
    /// Capabilities the runtime itself holds (its bounding set); others cannot be granted.
    /// Empty: no limit.
    pub cap_limit: Vec<String>,
    /// Ignored for privileged containers, as in containerd and CRI-O.
    pub seccomp: Seccomp,
    /// The AppArmor profile to run under (`process.apparmorProfile`), already decided by
    /// [`crate::apparmor::decide`]; `None`: no profile in the spec.
    #[serde(default)]
    pub apparmor_profile: Option<String>,
}

fn cap_name(c: &str) -> String {
    let up = c.to_ascii_uppercase();
    if up.starts_with("CAP_") {
        up
    } else {
        format!("CAP_{up}")
    }
}

/// The effective capability set: defaults (or all, when privileged), then `add`, then `drop`;
/// `ALL` in either list means every capability.
pub fn capabilities(s: &ContainerSpec) -> Vec<String> {
    let mut caps: Vec<String> = if s.privileged {
        ALL_CAPABILITIES.iter().map(|c| c.to_string()).collect()
    } else {
        DEFAULT_CAPABILITIES.iter().map(|c| c.to_string()).collect()
    };
    for a in &s.add_capabilities {
        if a.eq_ignore_ascii_case("ALL") {
            caps = ALL_CAPABILITIES.iter().map(|c| c.to_string()).collect();
        } else if !caps.contains(&cap_name(a)) {
            caps.push(cap_name(a));
        }
    }
    for d in &s.drop_capabilities {
        if d.eq_ignore_ascii_case("ALL") {
            caps.clear();
        } else {
            caps.retain(|c| c != &cap_name(d));
        }
    }
    if !s.cap_limit.is_empty() {
        caps.retain(|c| s.cap_limit.contains(c));
    }
    caps
}

/// The capabilities in a `CapBnd:`-style hex mask (`/proc/self/status`).
pub fn capabilities_in_mask(mask: u64) -> Vec<String> {
    ALL_CAPABILITIES
        .iter()
        .enumerate()
        .filter(|(i, _)| mask & (1u64 << i) != 0)
        .map(|(_, c)| c.to_string())
        .collect()
}

/// This process's bounding set: what it can grant to containers.
pub fn own_bounding_set() -> Vec<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .map(capabilities_in_mask)
        .unwrap_or_default()
}

fn namespaces(s: &ContainerSpec) -> Vec<LinuxNamespace> {
    let ns = |typ: LinuxNamespaceType, path: Option<&String>| {
        let mut n = LinuxNamespace::default();
        n.set_typ(typ);
        n.set_path(path.map(PathBuf::from));
        n
    };
    let mut out = vec![ns(LinuxNamespaceType::Mount, None)];
    if let Some(Ns::Join(path)) = &s.user {
        out.push(ns(LinuxNamespaceType::User, Some(path)));
    }
    for (kind, which) in [
        (LinuxNamespaceType::Network, &s.network),
        (LinuxNamespaceType::Ipc, &s.ipc),
        (LinuxNamespaceType::Uts, &s.uts),
        (LinuxNamespaceType::Pid, &s.pid),
    ] {
        match which.as_ref().unwrap_or(&Ns::New) {
            Ns::New => out.push(ns(kind, None)),
            Ns::Join(path) => out.push(ns(kind, Some(path))),
            Ns::Host => {}
        }
    }
    // A cgroup namespace hides the host's hierarchy, as containerd does on cgroup v2.
    if !s.no_cgroup_ns {
        out.push(ns(LinuxNamespaceType::Cgroup, None));
    }
    out
}

fn mount(destination: &str, kind: &str, source: &str, options: &[&str]) -> oci::Mount {
    let mut m = oci::Mount::default();
    m.set_destination(destination.into());
    m.set_typ(Some(kind.into()));
    m.set_source(Some(source.into()));
    m.set_options(Some(options.iter().map(|o| o.to_string()).collect()));
    m
}

fn default_mounts(s: &ContainerSpec) -> Vec<oci::Mount> {
    let sys_opts: &[&str] = if s.privileged {
        &["nosuid", "noexec", "nodev"]
    } else {
        &["nosuid", "noexec", "nodev", "ro"]
    };
    let mut m = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
        mount("/sys", "sysfs", "sysfs", sys_opts),
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        ),
    ];
    // /dev/shm comes from the pod when IPC is shared, else a private tmpfs.
    if !s.mounts.iter().any(|x| x.destination == "/dev/shm") {
        m.push(mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ));
    }
    m
}

/// `dest`'s components as the kernel walks them from the root without symlinks: `.` and
/// empty ones dropped, `..` stopping at the root.
fn lexical_parts(dest: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    for c in dest.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    parts
}

/// Whether the mount destination `dest` is /dev itself, however spelt (`//dev/.`,
/// `/tmp/../dev`), symlinks aside.
pub fn names_dev(dest: &str) -> bool {
    lexical_parts(dest) == ["dev"]
}

/// The mounts the monitor makes once libcontainer has created the container, before it
/// starts, instead of the spec: with a mount on /dev itself, that one and every mount below
/// /dev, shallowest first (a stable sort, so mounts at one depth keep their order, the last
/// on top), each destination spelt plainly (`/dev/x`, as the kernel would walk it without
/// symlinks). libcontainer 0.7 makes /dev's device nodes and links after the spec's mounts,
/// into whatever is mounted on /dev; runc skips them for a bind there. So libcontainer fills
/// its own tmpfs and these go on top of it. Without a mount on /dev: none.
pub fn late_mounts(s: &ContainerSpec) -> Vec<Mount> {
    let mut late: Vec<(usize, Mount)> = s
        .mounts
        .iter()
        .filter(|m| is_late(s, m))
        .map(|m| {
            let parts = lexical_parts(&m.destination);
            let mut m = m.clone();
            m.destination = format!("/{}", parts.join("/"));
            (parts.len(), m)
        })
        .collect();
    late.sort_by_key(|(depth, _)| *depth);
    late.into_iter().map(|(_, m)| m).collect()
}

/// The propagation of the container's root, as a mount option: shared with a Bidirectional
/// mount, a slave with a HostToContainer one, private otherwise (see `generate`).
fn root_propagation(s: &ContainerSpec) -> &'static str {
    if s.mounts.iter().any(|m| m.propagation == "rshared") {
        "rshared"
    } else if s.mounts.iter().any(|m| m.propagation == "rslave") {
        "rslave"
    } else {
        "rprivate"
    }
}

/// A volume whose propagation the monitor sets once the container is created.
#[derive(Debug, Clone, PartialEq)]
pub struct PropagationFix {
    pub destination: String,
    /// "rprivate" or "rslave": a root's propagation is never less than a volume's.
    pub propagation: String,
    /// Its whole tree; only its top mount when other volumes lie below it (theirs is theirs).
    pub recursive: bool,
}

/// The volumes whose propagation the monitor sets once the container is created:
/// libcontainer 0.7 binds each as a copy of the root's view of its source and never applies
/// the mount's own propagation, so under a shared or slave root (a Bidirectional or
/// HostToContainer mount in the container) a Private volume would receive the host's later
/// mounts, or under a shared one send the container's to the host. Only those whose wish
/// differs from the root's; the late mounts get theirs where they are made. Set after the
/// create, so what libcontainer itself mounts inside such a volume under a shared root has
/// propagated by then (as before this existed).
pub fn propagation_fixes(s: &ContainerSpec) -> Vec<PropagationFix> {
    let root = root_propagation(s);
    let parts = destination_parts(s);
    s.mounts
        .iter()
        .zip(&parts)
        .filter_map(|(m, mine)| {
            let want = if m.propagation.is_empty() {
                "rprivate"
            } else {
                m.propagation.as_str()
            };
            if want == root || mine.is_empty() || is_late(s, m) {
                return None;
            }
            Some(PropagationFix {
                destination: m.destination.clone(),
                propagation: want.to_string(),
                recursive: !has_mount_below(&parts, mine),
            })
        })
        .collect()
}

/// The volumes libcontainer is to bind from a staging copy of their source whose propagation
/// is already theirs (`mountapi::stage`, made by the daemon for the create), by index in
/// `s.mounts`. Under a shared root (a Bidirectional mount in the container) libcontainer binds
/// each volume as a peer of the host's mount of its source, and sets its own propagation only
/// after the create (`propagation_fixes`): a volume it mounts inside another one meanwhile
/// would be propagated to the outer one's source on the host (when that is on a shared mount,
/// as systemd makes `/`), and outlive the container there. So: every volume but a
/// Bidirectional one that has another mount below it.
pub fn staged_mounts(s: &ContainerSpec) -> Vec<usize> {
    if root_propagation(s) != "rshared" {
        return Vec::new();
    }
    let parts = destination_parts(s);
    s.mounts
        .iter()
        .zip(&parts)
        .enumerate()
        .filter(|(_, (m, mine))| {
            m.propagation != "rshared"
                && !mine.is_empty()
                && !is_late(s, m)
                && has_mount_below(&parts, mine)
        })
        .map(|(i, _)| i)
        .collect()
}

/// Each of `s`'s mount destinations as its lexical parts.
fn destination_parts(s: &ContainerSpec) -> Vec<Vec<&str>> {
    s.mounts
        .iter()
        .map(|m| lexical_parts(&m.destination))
        .collect()
}

/// Whether one of `all` lies strictly below `mine`.
fn has_mount_below(all: &[Vec<&str>], mine: &[&str]) -> bool {
    all.iter()
        .any(|o| o.len() > mine.len() && o.starts_with(mine))
}

/// Whether the mount destination `dest` is /dev or below it, symlinks aside.
pub fn at_or_below_dev(dest: &str) -> bool {
    lexical_parts(dest).first() == Some(&"dev")
}

/// Whether `m` is one of `s`'s [`late_mounts`].
fn is_late(s: &ContainerSpec, m: &Mount) -> bool {
    at_or_below_dev(&m.destination) && s.mounts.iter().any(|m| names_dev(&m.destination))
}

fn user_mounts(s: &ContainerSpec) -> Vec<oci::Mount> {
    s.mounts
        .iter()
        .filter(|mt| !is_late(s, mt))
        .map(|mt| {
            let mut opts = vec!["rbind"];
            opts.push(if mt.propagation.is_empty() {
                "rprivate"
            } else {
                &mt.propagation
            });
            if mt.readonly {
                opts.push("ro");
            }
            if mt.recursive_readonly {
                opts.push("rro");
            }
            // The restrictions asked for hold below the volume too (a mount under a host path
            // would otherwise keep its exec, dev and suid): their recursive forms, which
            // libcontainer applies with mount_setattr to the tree as it is at create (mounts
            // propagated in later keep their own flags). The atime options stay on the top
            // mount: changing the atime mode of a submount whose mode is locked (one
            // inherited into a user namespace) fails the whole call with EPERM. `ro` stays
            // what Kubernetes' readOnly is, the top mount only (recursive_readonly is the
            // other).
            opts.extend(mt.options.iter().map(|o| match o.as_str() {
                "noexec" => "rnoexec",
                "nodev" => "rnodev",
                "nosuid" => "rnosuid",
                other => other,
            }));
            mount(&mt.destination, "bind", &mt.source, &opts)
        })
        .collect()
}

/// A device cgroup rule; `None` for what it leaves open (every type, number or access).
fn rule(
    allow: bool,
    kind: Option<LinuxDeviceType>,
    major: Option<i64>,
    minor: Option<i64>,
    access: &str,
) -> LinuxDeviceCgroup {
    let mut r = LinuxDeviceCgroup::default();
    r.set_allow(allow);
    r.set_typ(kind);
    r.set_major(major);
    r.set_minor(minor);
    r.set_access(Some(access.into()));
    r
}

fn resources(s: &ContainerSpec) -> LinuxResources {
    let mut v = limits(&s.resources);
    if !s.privileged {
        let c = Some(LinuxDeviceType::C);
        let mut rules = vec![
            rule(false, None, None, None, "rwm"),
            rule(true, c, Some(1), Some(3), "rwm"),
            rule(true, c, Some(1), Some(5), "rwm"),
            rule(true, c, Some(1), Some(7), "rwm"),
            rule(true, c, Some(1), Some(8), "rwm"),
            rule(true, c, Some(1), Some(9), "rwm"),
            rule(true, c, Some(5), Some(0), "rwm"),
            rule(true, c, Some(5), Some(2), "rwm"),
            rule(true, c, Some(136), None, "rwm"),
        ];
        rules.extend(s.devices.iter().filter_map(device_rule));
        v.set_devices(Some(rules));
    }
    v
}

/// `linux.resources` without device rules: what UpdateContainerResources changes. A limit the
/// kernel's counters cannot hold (a hugepage limit past `i64::MAX`) is no limit.
pub fn limits(r: &Resources) -> LinuxResources {
    let mut v = LinuxResources::default();
    let mut cpu = LinuxCpu::default();
    cpu.set_shares(r.cpu_shares);
    cpu.set_quota(r.cpu_quota);
    cpu.set_period(r.cpu_period);
    cpu.set_cpus(r.cpuset_cpus.clone());
    cpu.set_mems(r.cpuset_mems.clone());
    if cpu != LinuxCpu::default() {
        v.set_cpu(Some(cpu));
    }
    let mut mem = LinuxMemory::default();
    mem.set_limit(r.memory_limit);
    mem.set_swap(r.memory_swap);
    if mem != LinuxMemory::default() {
        v.set_memory(Some(mem));
    }
    if let Some(x) = r.pids_limit {
        let mut pids = LinuxPids::default();
        pids.set_limit(x);
        v.set_pids(Some(pids));
    }
    if !r.hugepage_limits.is_empty() {
        let pages = r
            .hugepage_limits
            .iter()
            .map(|(size, limit)| {
                let mut h = LinuxHugepageLimit::default();
                h.set_page_size(size.clone());
                h.set_limit(i64::try_from(*limit).unwrap_or(i64::MAX));
                h
            })
            .collect();
        v.set_hugepage_limits(Some(pages));
    }
    if !r.unified.is_empty() {
        v.set_unified(Some(r.unified.clone().into_iter().collect()));
    }
    v
}

/// The OCI type of a [`Device`]'s kind: "b", "u" and "p" by name, anything else a character
/// device (what [`crate::devices::host_node`] and CDI's validation give are b, c, u or p).
fn device_type(kind: &str) -> LinuxDeviceType {
    match kind {
        "b" => LinuxDeviceType::B,
        "u" => LinuxDeviceType::U,
        "p" => LinuxDeviceType::P,
        _ => LinuxDeviceType::C,
    }
}

/// A `linux.devices` entry.
pub fn device_node(d: &Device) -> LinuxDevice {
    let mut v = LinuxDevice::default();
    v.set_path(PathBuf::from(&d.path));
    v.set_typ(device_type(&d.kind));
    v.set_major(d.major);
    v.set_minor(d.minor);
    v.set_file_mode(d.file_mode);
    v.set_uid(d.uid);
    v.set_gid(d.gid);
    v
}

/// The device cgroup rule that lets the container use `d` (fifos need none; an unbuffered
/// character device, "u", is a character device to the cgroup).
pub fn device_rule(d: &Device) -> Option<LinuxDeviceCgroup> {
    let kind = match device_type(&d.kind) {
        LinuxDeviceType::P => return None,
        LinuxDeviceType::U => LinuxDeviceType::C,
        k => k,
    };
    Some(rule(
        true,
        Some(kind),
        Some(d.major),
        Some(d.minor),
        &d.access,
    ))
}

/// Capability names as OCI types them; a name oci-spec does not know is left out (the
/// runtime's bounding set, which limits every real container, never holds one).
fn capability_set(caps: &[String]) -> Capabilities {
    caps.iter()
        .filter_map(|c| Capability::from_str(c.trim_start_matches("CAP_")).ok())
        .collect()
}

/// The OCI spec for `s`.
///
/// Built field by field on purpose: oci-spec's `Default`s (and so its builders, which fill
/// unset fields from them) are runc's example config (rlimits, noNewPrivileges, a "youki"
/// hostname, default mounts and masks), none of which hako wants unasked.
pub fn generate(s: &ContainerSpec) -> Spec {
    let caps = capability_set(&capabilities(s));
    let mut mounts = default_mounts(s);
    mounts.extend(user_mounts(s));

    let mut user = User::default();
    user.set_uid(s.uid);
    user.set_gid(s.gid);
    user.set_additional_gids(Some(s.additional_gids.clone()));
    let mut cap_sets = LinuxCapabilities::default();
    cap_sets.set_bounding(Some(caps.clone()));
    cap_sets.set_effective(Some(caps.clone()));
    cap_sets.set_permitted(Some(caps));
    cap_sets.set_inheritable(None);
    cap_sets.set_ambient(None);
    let mut process = Process::default();
    process.set_terminal(Some(s.tty));
    process.set_user(user);
    process.set_args(Some(s.args.clone()));
    process.set_env(Some(s.env.clone()));
    process.set_cwd(if s.cwd.is_empty() { "/" } else { &s.cwd }.into());
    process.set_capabilities(Some(cap_sets));
    process.set_rlimits(None);
    // Only present when true: libcontainer decides when to load seccomp by whether the field
    // is there, not by its value, and loads it too late (without privileges) for `false`.
    process.set_no_new_privileges(s.no_new_privileges.then_some(true));
    process.set_oom_score_adj(s.oom_score_adj);
    process.set_apparmor_profile(s.apparmor_profile.clone());

    let mut linux = Linux::default();
    linux.set_namespaces(Some(namespaces(s)));
    linux.set_cgroups_path(Some(PathBuf::from(&s.cgroups_path)));
    linux.set_resources(Some(resources(s)));
    linux.set_sysctl(Some(s.sysctls.clone().into_iter().collect()));
    linux.set_devices((!s.devices.is_empty()).then(|| s.devices.iter().map(device_node).collect()));
    // Mount events only cross into (rslave) or out of (rshared) the container when its root
    // itself propagates them, as containerd sets it. Otherwise private: libcontainer 0.7 binds
    // a volume as a clone of the root's copy of its source and never applies the mount's own
    // propagation, so under the slave root runc would use (and then make each private volume
    // private) a Private volume would still receive the host's later mounts.
    linux.set_rootfs_propagation(Some(
        root_propagation(s).trim_start_matches('r').to_string(),
    ));
    let caps_list = capabilities(s);
    let seccomp = match &s.seccomp {
        _ if s.privileged => None,
        Seccomp::Unconfined => None,
        Seccomp::RuntimeDefault => Some(crate::seccomp::runtime_default(&caps_list)),
        Seccomp::Profile(p) => Some(p.clone()),
    };
    linux.set_seccomp(seccomp.map(crate::seccomp::for_libcontainer));
    let paths = |given: &Option<Vec<String>>, default: &[&str]| {
        given
            .clone()
            .unwrap_or_else(|| default.iter().map(|p| p.to_string()).collect())
    };
    if s.privileged {
        linux.set_masked_paths(None);
        linux.set_readonly_paths(None);
    } else {
        linux.set_masked_paths(Some(paths(&s.masked_paths, MASKED_PATHS)));
        linux.set_readonly_paths(Some(paths(&s.readonly_paths, READONLY_PATHS)));
    }

    let mut root = Root::default();
    root.set_path(PathBuf::from(&s.rootfs));
    root.set_readonly(Some(s.readonly_rootfs));
    let mut spec = Spec::default();
    spec.set_version("1.0.2".into());
    spec.set_process(Some(process));
    spec.set_root(Some(root));
    spec.set_mounts(Some(mounts));
    spec.set_linux(Some(linux));
    spec.set_annotations(Some(s.annotations.clone().into_iter().collect()));
    spec.set_hostname(
        (!matches!(s.uts, Some(Ns::Host)) && !s.hostname.is_empty()).then(|| s.hostname.clone()),
    );
    spec
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use oci_spec::runtime::{LinuxSeccompAction, LinuxSeccompOperator, LinuxSyscall};
    use serde_json::json;

    fn base() -> ContainerSpec {
        ContainerSpec {
            args: vec!["sh".into()],
            env: vec!["PATH=/bin".into()],
            rootfs: "rootfs".into(),
            cgroups_path: "/hako/c1".into(),
            hostname: "pod".into(),
            ..Default::default()
        }
    }

    /// Applies `tweak` to a base spec and hands the generated spec to `check`.
    fn check(tweak: impl FnOnce(&mut ContainerSpec), check: impl FnOnce(&Spec)) {
        let mut s = base();
        tweak(&mut s);
        let spec = generate(&s);
        // What libcontainer reads back is what was generated.
        let text = serde_json::to_string(&spec).unwrap();
        assert_eq!(serde_json::from_str::<Spec>(&text).unwrap(), spec);
        check(&spec);
    }

    fn process(s: &Spec) -> &Process {
        s.process().as_ref().unwrap()
    }

    fn linux(s: &Spec) -> &Linux {
        s.linux().as_ref().unwrap()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    /// The bounding set, by name; effective and permitted must be the same set.
    fn caps_of(s: &Spec) -> Vec<String> {
        let c = process(s).capabilities().as_ref().unwrap();
        assert_eq!(c.bounding(), c.effective());
        assert_eq!(c.bounding(), c.permitted());
        assert!(c.inheritable().is_none() && c.ambient().is_none());
        let mut names: Vec<String> = c
            .bounding()
            .iter()
            .flatten()
            .map(|c| format!("CAP_{c}"))
            .collect();
        names.sort();
        names
    }

    fn mount_at<'a>(s: &'a Spec, destination: &str) -> Vec<&'a oci::Mount> {
        s.mounts()
            .iter()
            .flatten()
            .filter(|m| m.destination() == Path::new(destination))
            .collect()
    }

    fn rules(s: &Spec) -> &[LinuxDeviceCgroup] {
        linux(s)
            .resources()
            .as_ref()
            .unwrap()
            .devices()
            .as_deref()
            .unwrap_or_default()
    }

    fn syscalls(s: &Spec) -> &[LinuxSyscall] {
        linux(s)
            .seccomp()
            .as_ref()
            .expect("a seccomp profile")
            .syscalls()
            .as_deref()
            .unwrap()
    }

    #[test]
    fn defaults_match_containerd() {
        check(
            |_| {},
            |s| {
                let mut want = strings(DEFAULT_CAPABILITIES);
                want.sort();
                assert_eq!(caps_of(s), want);
                assert_eq!(process(s).cwd(), Path::new("/"));
                assert_eq!(process(s).terminal(), Some(false));
                // None of oci-spec's runc-like defaults come along.
                assert!(process(s).rlimits().is_none());
                assert!(process(s).no_new_privileges().is_none());
                assert_eq!(s.version(), "1.0.2");
                assert_eq!(s.hostname().as_deref(), Some("pod"));
                let masked = linux(s).masked_paths().as_ref().unwrap();
                assert!(masked.iter().any(|p| p == "/proc/kcore"));
                let deny = &rules(s)[0];
                assert_eq!(
                    (deny.allow(), deny.typ(), deny.major(), deny.minor()),
                    (false, None, None, None)
                );
                assert_eq!(deny.access().as_deref(), Some("rwm"));
                assert_eq!(mount_at(s, "/dev/shm").len(), 1);
                assert_eq!(
                    linux(s).cgroups_path().as_deref(),
                    Some(Path::new("/hako/c1"))
                );
                assert!(linux(s).devices().is_none());
                assert!(linux(s).uid_mappings().is_none());
            },
        );
    }

    #[test]
    fn capabilities_add_drop_and_all() {
        let has = |s: &Spec, c: &str| caps_of(s).contains(&c.to_string());
        check(
            |s| s.add_capabilities = vec!["SYS_ADMIN".into()],
            |s| assert!(has(s, "CAP_SYS_ADMIN")),
        );
        check(
            |s| s.drop_capabilities = vec!["CHOWN".into()],
            |s| assert!(!has(s, "CAP_CHOWN")),
        );
        check(
            |s| s.drop_capabilities = vec!["ALL".into()],
            |s| assert!(caps_of(s).is_empty()),
        );
        check(
            |s| {
                s.add_capabilities = vec!["ALL".into()];
                s.drop_capabilities = vec!["NET_RAW".into()];
            },
            |s| {
                assert_eq!(caps_of(s).len(), ALL_CAPABILITIES.len() - 1);
                assert!(!has(s, "CAP_NET_RAW"));
            },
        );
    }

    #[test]
    fn capabilities_are_limited_to_what_the_runtime_holds() {
        let without_sys_resource = capabilities_in_mask(0x1fffeffffff);
        assert_eq!(without_sys_resource.len(), ALL_CAPABILITIES.len() - 1);
        assert!(!without_sys_resource.contains(&"CAP_SYS_RESOURCE".to_string()));
        check(
            |s| {
                s.privileged = true;
                s.cap_limit = without_sys_resource.clone();
            },
            |s| {
                assert_eq!(caps_of(s).len(), ALL_CAPABILITIES.len() - 1);
                assert!(!caps_of(s).contains(&"CAP_SYS_RESOURCE".to_string()));
            },
        );
    }

    #[test]
    fn seccomp_default_is_generated_and_privileged_ignores_it() {
        check(
            |s| s.seccomp = Seccomp::RuntimeDefault,
            |s| {
                let sc = linux(s).seccomp().as_ref().unwrap();
                assert_eq!(sc.default_action(), LinuxSeccompAction::ScmpActErrno);
                let allowed = syscalls(s)[0].names();
                assert!(allowed.iter().any(|n| n == "read"));
                assert!(!allowed.iter().any(|n| n == "mount"));
                // The clone rule reaches the spec in libcontainer's reading (mask in valueTwo).
                let clone = syscalls(s)
                    .iter()
                    .find(|r| r.names() == &["clone".to_string()])
                    .expect("a clone rule");
                let arg = &clone.args().as_ref().unwrap()[0];
                assert_eq!(arg.op(), LinuxSeccompOperator::ScmpCmpMaskedEq);
                assert_eq!(
                    (arg.value(), arg.value_two()),
                    (0, Some(crate::seccomp::CLONE_NAMESPACE_FLAGS))
                );
            },
        );
        check(
            |s| {
                s.seccomp = Seccomp::RuntimeDefault;
                s.add_capabilities = vec!["SYS_ADMIN".into()];
            },
            |s| {
                let allowed = syscalls(s)[0].names();
                assert!(
                    allowed.iter().any(|n| n == "mount"),
                    "CAP_SYS_ADMIN allows mount"
                );
                assert!(!allowed.iter().any(|n| n == "kexec_load"));
            },
        );
        check(
            |s| {
                s.seccomp = Seccomp::RuntimeDefault;
                s.privileged = true;
            },
            |s| assert!(linux(s).seccomp().is_none()),
        );
        check(
            |_| {},
            |s| assert!(linux(s).seccomp().is_none(), "unconfined by default"),
        );
    }

    #[test]
    fn localhost_seccomp_profiles_are_adapted_for_libcontainer() {
        let p = json!({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 0x7E02_0000u64, "op": "SCMP_CMP_MASKED_EQ"}]}]});
        check(
            |s| s.seccomp = Seccomp::Profile(serde_json::from_value(p.clone()).unwrap()),
            |s| {
                let arg = &syscalls(s)[0].args().as_ref().unwrap()[0];
                assert_eq!(
                    (arg.index(), arg.value(), arg.value_two(), arg.op()),
                    (
                        0,
                        0,
                        Some(0x7E02_0000u64),
                        LinuxSeccompOperator::ScmpCmpMaskedEq
                    )
                );
            },
        );
    }

    #[test]
    fn apparmor_profile_reaches_the_process() {
        check(
            |s| s.apparmor_profile = Some("hako-default".into()),
            |s| {
                assert_eq!(
                    process(s).apparmor_profile().as_deref(),
                    Some("hako-default")
                )
            },
        );
        check(|_| {}, |s| assert!(process(s).apparmor_profile().is_none()));
    }

    #[test]
    fn privileged_gets_everything_and_no_masks() {
        check(
            |s| s.privileged = true,
            |s| {
                assert_eq!(caps_of(s).len(), ALL_CAPABILITIES.len());
                assert!(linux(s).masked_paths().is_none());
                assert!(linux(s).readonly_paths().is_none());
                assert!(linux(s).resources().as_ref().unwrap().devices().is_none());
                let sys = mount_at(s, "/sys")[0];
                assert!(!sys.options().iter().flatten().any(|o| o == "ro"));
            },
        );
    }

    #[test]
    fn namespaces_join_new_or_host() {
        check(
            |s| {
                s.network = Some(Ns::Join("/run/hako/pods/p/ns/net".into()));
                s.pid = Some(Ns::Host);
                s.uts = Some(Ns::Host);
            },
            |s| {
                let ns: Vec<(LinuxNamespaceType, Option<PathBuf>)> = linux(s)
                    .namespaces()
                    .iter()
                    .flatten()
                    .map(|n| (n.typ(), n.path().clone()))
                    .collect();
                assert_eq!(
                    ns,
                    [
                        (LinuxNamespaceType::Mount, None),
                        (
                            LinuxNamespaceType::Network,
                            Some("/run/hako/pods/p/ns/net".into())
                        ),
                        (LinuxNamespaceType::Ipc, None),
                        (LinuxNamespaceType::Cgroup, None),
                    ]
                );
                assert!(
                    s.hostname().is_none(),
                    "no hostname in the host's UTS namespace"
                );
            },
        );
        // The pod's user namespace, joined first; no cgroup namespace when told (cgroup v1
        // in a user namespace).
        let kinds = |s: &Spec| -> Vec<(LinuxNamespaceType, Option<PathBuf>)> {
            linux(s)
                .namespaces()
                .iter()
                .flatten()
                .map(|n| (n.typ(), n.path().clone()))
                .collect()
        };
        for no_cgroup_ns in [false, true] {
            check(
                |s| {
                    s.user = Some(Ns::Join("/p/ns/user".into()));
                    s.no_cgroup_ns = no_cgroup_ns;
                },
                |s| {
                    let ns = kinds(s);
                    assert_eq!(ns[1], (LinuxNamespaceType::User, Some("/p/ns/user".into())));
                    assert_eq!(
                        ns.iter().any(|(t, _)| *t == LinuxNamespaceType::Cgroup),
                        !no_cgroup_ns
                    );
                },
            );
        }
    }

    #[test]
    fn mount_restrictions_reach_submounts_and_atime_stays_on_the_top_mount() {
        check(
            |s| {
                s.mounts.push(Mount {
                    destination: "/data".into(),
                    source: "/srv".into(),
                    readonly: true,
                    propagation: String::new(),
                    recursive_readonly: false,
                    options: strings(&["noexec", "nodev", "nosuid", "noatime", "nodiratime"]),
                });
            },
            |s| {
                assert_eq!(
                    mount_at(s, "/data")[0].options().as_deref(),
                    Some(
                        &strings(&[
                            "rbind",
                            "rprivate",
                            "ro",
                            "rnoexec",
                            "rnodev",
                            "rnosuid",
                            "noatime",
                            "nodiratime"
                        ])[..]
                    )
                );
            },
        );
    }

    #[test]
    fn a_mount_on_dev_takes_the_mounts_below_dev_out_of_the_spec() {
        let bind = |dest: &str, source: &str| Mount {
            destination: dest.into(),
            source: source.into(),
            readonly: false,
            propagation: "rprivate".into(),
            recursive_readonly: false,
            options: Vec::new(),
        };
        let mut s = base();
        s.mounts = vec![
            bind("/dev/termination-log", "/t"),
            bind("/data", "/srv"),
            bind("/dev/shm", "/shm"),
            bind("//dev/.", "/dev"),
            bind("/devices", "/d"),
        ];
        let late: Vec<String> = late_mounts(&s).into_iter().map(|m| m.destination).collect();
        // /dev first however spelt and wherever given; the rest in their order.
        assert_eq!(late, ["/dev", "/dev/termination-log", "/dev/shm"]);
        let spec = generate(&s);
        let binds: Vec<String> = spec
            .mounts()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|m| m.typ().as_deref() == Some("bind"))
            .map(|m| m.destination().display().to_string())
            .collect();
        assert_eq!(binds, ["/data", "/devices"]);
        // libcontainer still gets its own /dev to fill.
        assert_eq!(mount_at(&spec, "/dev").len(), 1);

        // Without a mount on /dev itself, the mounts below it stay in the spec.
        s.mounts.remove(3);
        assert!(late_mounts(&s).is_empty());
        assert_eq!(mount_at(&generate(&s), "/dev/termination-log").len(), 1);
    }

    #[test]
    fn volumes_whose_propagation_differs_from_the_roots_are_fixed_after_the_create() {
        let bind = |dest: &str, propagation: &str| Mount {
            destination: dest.into(),
            source: "/srv".into(),
            readonly: false,
            propagation: propagation.into(),
            recursive_readonly: false,
            options: Vec::new(),
        };
        let mut s = base();
        let fixes = |s: &ContainerSpec| -> Vec<(String, String, bool)> {
            propagation_fixes(s)
                .into_iter()
                .map(|f| (f.destination, f.propagation, f.recursive))
                .collect()
        };
        let want = |v: &[(&str, &str, bool)]| -> Vec<(String, String, bool)> {
            v.iter()
                .map(|(d, p, r)| (d.to_string(), p.to_string(), *r))
                .collect()
        };
        s.mounts = vec![bind("/a", ""), bind("/b", "rprivate")];
        assert!(fixes(&s).is_empty(), "all private, as the root");
        s.mounts.push(bind("/c", "rslave"));
        assert_eq!(
            fixes(&s),
            want(&[("/a", "rprivate", true), ("/b", "rprivate", true)])
        );
        // Under a shared root the slave one is fixed too, only its top mount when a volume
        // lies below it; a mount on /dev is made by the monitor with its own.
        s.mounts.push(bind("/d", "rshared"));
        s.mounts.push(bind("/c/./inner", "rshared"));
        s.mounts.push(bind("/dev", "rprivate"));
        assert_eq!(
            fixes(&s),
            want(&[
                ("/a", "rprivate", true),
                ("/b", "rprivate", true),
                ("/c", "rslave", false)
            ])
        );
        assert_eq!(
            linux(&generate(&s)).rootfs_propagation().as_deref(),
            Some("shared")
        );
        // Staged: only /c, which is not shared and has a volume below it ("/c/./inner"); not
        // /d, shared, nor /dev, a late mount. Under a slave root, none.
        assert_eq!(staged_mounts(&s), vec![2]);
        s.mounts.push(bind("/d/x", "rprivate"));
        s.mounts.push(bind("/a/./", "rprivate"));
        assert_eq!(
            staged_mounts(&s),
            vec![2],
            "below a shared one; on it, not below it"
        );
        s.mounts.push(bind("/b/y/z", "rprivate"));
        assert_eq!(staged_mounts(&s), vec![1, 2]);
        s.mounts.retain(|m| m.propagation != "rshared");
        assert!(staged_mounts(&s).is_empty(), "{:?}", s.mounts);
    }

    #[test]
    fn mounts_resources_and_user() {
        check(
            |s| {
                s.mounts.push(Mount {
                    destination: "/data".into(),
                    source: "/srv".into(),
                    readonly: true,
                    propagation: "rslave".into(),
                    recursive_readonly: false,
                    options: Vec::new(),
                });
                s.resources = Resources {
                    memory_limit: Some(64 << 20),
                    cpu_quota: Some(50_000),
                    cpu_period: Some(100_000),
                    pids_limit: Some(42),
                    ..Default::default()
                };
                s.uid = 1000;
                s.gid = 1000;
                s.additional_gids = vec![10, 50000];
                s.readonly_rootfs = true;
                s.no_new_privileges = true;
                s.oom_score_adj = Some(-998);
            },
            |s| {
                let m = mount_at(s, "/data")[0];
                assert_eq!(m.typ().as_deref(), Some("bind"));
                assert_eq!(m.source().as_deref(), Some(Path::new("/srv")));
                assert_eq!(
                    m.options().as_deref(),
                    Some(&strings(&["rbind", "rslave", "ro"])[..])
                );
                let r = linux(s).resources().as_ref().unwrap();
                assert_eq!(r.memory().as_ref().unwrap().limit(), Some(64 << 20));
                assert_eq!(r.memory().as_ref().unwrap().swap(), None);
                let cpu = r.cpu().as_ref().unwrap();
                assert_eq!(
                    (cpu.quota(), cpu.period(), cpu.shares()),
                    (Some(50_000), Some(100_000), None)
                );
                assert_eq!(r.pids().as_ref().unwrap().limit(), 42);
                let user = process(s).user();
                assert_eq!((user.uid(), user.gid()), (1000, 1000));
                assert_eq!(user.additional_gids().as_deref(), Some(&[10, 50000][..]));
                assert_eq!(s.root().as_ref().unwrap().readonly(), Some(true));
                assert_eq!(process(s).no_new_privileges(), Some(true));
                assert_eq!(process(s).oom_score_adj(), Some(-998));
                assert_eq!(linux(s).rootfs_propagation().as_deref(), Some("slave"));
            },
        );
    }

    #[test]
    fn the_root_is_private_unless_a_mount_propagates() {
        check(
            |_| {},
            |s| assert_eq!(linux(s).rootfs_propagation().as_deref(), Some("private")),
        );
    }

    #[test]
    fn merged_limits_take_what_the_update_names() {
        let old = Resources {
            cpu_shares: Some(512),
            cpu_quota: Some(10_000),
            cpuset_cpus: Some("0".into()),
            memory_limit: Some(1 << 30),
            pids_limit: Some(10),
            hugepage_limits: vec![("2MB".into(), 2 << 20)],
            unified: [("memory.high".to_string(), "max".to_string())].into(),
            ..Default::default()
        };
        let newer = Resources {
            cpu_quota: Some(20_000),
            cpu_period: Some(50_000),
            cpuset_mems: Some("0".into()),
            memory_swap: Some(2 << 30),
            unified: [("pids.max".to_string(), "5".to_string())].into(),
            ..Default::default()
        };
        assert_eq!(
            old.merged(&newer),
            Resources {
                cpu_shares: Some(512),
                cpu_quota: Some(20_000),
                cpu_period: Some(50_000),
                cpuset_cpus: Some("0".into()),
                cpuset_mems: Some("0".into()),
                memory_limit: Some(1 << 30),
                memory_swap: Some(2 << 30),
                pids_limit: Some(10),
                hugepage_limits: vec![("2MB".into(), 2 << 20)],
                unified: [
                    ("memory.high".to_string(), "max".to_string()),
                    ("pids.max".to_string(), "5".to_string())
                ]
                .into(),
            }
        );
        let hp = Resources {
            hugepage_limits: vec![("1GB".into(), 0)],
            ..Default::default()
        };
        assert_eq!(old.merged(&hp).hugepage_limits, hp.hugepage_limits);
    }

    #[test]
    fn unified_limits_reach_the_spec_only_when_set() {
        let mut r = Resources::default();
        assert_eq!(limits(&r), LinuxResources::default());
        r.unified.insert("memory.high".into(), "64M".into());
        assert_eq!(limits(&r).unified().as_ref().unwrap()["memory.high"], "64M");
    }

    #[test]
    fn the_pods_dev_shm_replaces_the_private_one() {
        let mount = |destination: &str, source: &str| Mount {
            destination: destination.into(),
            source: source.into(),
            readonly: false,
            propagation: String::new(),
            recursive_readonly: false,
            options: Vec::new(),
        };
        let source = |m: &oci::Mount| m.source().clone().unwrap();
        check(
            |s| s.mounts.push(mount("/dev/shm", "/run/hako/pods/p/shm")),
            |s| {
                let m = mount_at(s, "/dev/shm");
                assert_eq!(m.len(), 1, "{m:?}");
                assert_eq!(source(m[0]), Path::new("/run/hako/pods/p/shm"));
            },
        );
        check(
            |s| s.mounts.push(mount("/data", "/srv")),
            |s| assert_eq!(source(mount_at(s, "/dev/shm")[0]), Path::new("shm")),
        );
    }

    #[test]
    fn generate_gives_the_typed_spec() {
        let s = generate(&base());
        assert_eq!(process(&s).args().as_deref(), Some(&strings(&["sh"])[..]));
        assert_eq!(
            process(&s).env().as_deref(),
            Some(&strings(&["PATH=/bin"])[..])
        );
        assert_eq!(s.root().as_ref().unwrap().path(), Path::new("rootfs"));
        assert!(s.hooks().is_none() && s.domainname().is_none());
    }

    #[test]
    fn the_bounding_set_is_what_the_kernel_says() {
        // The kernel's answer, capability by capability (ALL_CAPABILITIES is in bit order).
        let held: Vec<String> = ALL_CAPABILITIES
            .iter()
            .enumerate()
            .filter(|(i, cap)| {
                // SAFETY: PR_CAPBSET_READ only reads this thread's bounding set.
                let r = unsafe { libc::prctl(libc::PR_CAPBSET_READ, *i as libc::c_ulong, 0, 0, 0) };
                assert!(r >= 0, "PR_CAPBSET_READ {cap}");
                r == 1
            })
            .map(|(_, c)| c.to_string())
            .collect();
        assert_eq!(own_bounding_set(), held);
    }

    #[test]
    fn devices_hugepages_and_recursive_readonly_reach_the_spec() {
        check(
            |s| {
                s.devices.push(Device {
                    path: "/dev/fake0".into(),
                    kind: "c".into(),
                    major: 1,
                    minor: 3,
                    file_mode: Some(0o620),
                    uid: None,
                    gid: Some(5),
                    access: "rw".into(),
                });
                s.resources.hugepage_limits.push(("2MB".into(), 4 << 20));
                s.mounts.push(Mount {
                    destination: "/data".into(),
                    source: "/srv".into(),
                    readonly: true,
                    propagation: "rprivate".into(),
                    recursive_readonly: true,
                    options: Vec::new(),
                });
            },
            |s| {
                let d = &linux(s).devices().as_ref().unwrap()[0];
                assert_eq!(
                    (d.path(), d.typ(), d.major(), d.minor()),
                    (&PathBuf::from("/dev/fake0"), LinuxDeviceType::C, 1, 3)
                );
                assert_eq!(
                    (d.file_mode(), d.uid(), d.gid()),
                    (Some(0o620), None, Some(5))
                );
                let last = rules(s).last().unwrap();
                assert_eq!(last.access().as_deref(), Some("rw"));
                assert_eq!(
                    (last.allow(), last.typ(), last.major(), last.minor()),
                    (true, Some(LinuxDeviceType::C), Some(1), Some(3))
                );
                let pages = linux(s)
                    .resources()
                    .as_ref()
                    .unwrap()
                    .hugepage_limits()
                    .clone()
                    .unwrap();
                assert_eq!(
                    (pages[0].page_size().as_str(), pages[0].limit()),
                    ("2MB", 4 << 20)
                );
                let opts = mount_at(s, "/data")[0].options().clone().unwrap();
                assert!(
                    opts.iter().any(|o| o == "ro") && opts.iter().any(|o| o == "rro"),
                    "{opts:?}"
                );
            },
        );
        // A fifo gets a node and no cgroup rule; "u" is a character device to the cgroup.
        let fifo = Device {
            path: "/dev/f".into(),
            kind: "p".into(),
            access: "rwm".into(),
            ..Default::default()
        };
        assert_eq!(device_node(&fifo).typ(), LinuxDeviceType::P);
        assert!(device_rule(&fifo).is_none());
        let u = Device {
            kind: "u".into(),
            ..fifo
        };
        assert_eq!(device_rule(&u).unwrap().typ(), Some(LinuxDeviceType::C));
    }
}
