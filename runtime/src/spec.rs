//! OCI runtime spec generation: a pure function from hako's container description to the
//! `config.json` libcontainer runs. Defaults follow containerd's CRI plugin (capabilities,
//! mounts, masked and read-only paths, device rules), so workloads see what they would there.

use std::collections::BTreeMap;

use oci_spec::runtime::Spec;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

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
    Profile(serde_json::Value),
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

fn namespaces(s: &ContainerSpec) -> Vec<Value> {
    let mut out = vec![json!({"type": "mount"})];
    for (kind, ns) in [
        ("network", &s.network),
        ("ipc", &s.ipc),
        ("uts", &s.uts),
        ("pid", &s.pid),
    ] {
        match ns.as_ref().unwrap_or(&Ns::New) {
            Ns::New => out.push(json!({"type": kind})),
            Ns::Join(path) => out.push(json!({"type": kind, "path": path})),
            Ns::Host => {}
        }
    }
    // A cgroup namespace hides the host's hierarchy, as containerd does on cgroup v2.
    out.push(json!({"type": "cgroup"}));
    out
}

fn default_mounts(s: &ContainerSpec) -> Vec<Value> {
    let sys_opts = if s.privileged {
        json!(["nosuid", "noexec", "nodev"])
    } else {
        json!(["nosuid", "noexec", "nodev", "ro"])
    };
    let mut m = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": sys_opts}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
    ];
    // /dev/shm comes from the pod when IPC is shared, else a private tmpfs.
    if !s.mounts.iter().any(|x| x.destination == "/dev/shm") {
        m.push(json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}));
    }
    m
}

fn user_mounts(s: &ContainerSpec) -> Vec<Value> {
    s.mounts
        .iter()
        .map(|mt| {
            let mut opts = vec!["rbind".to_string()];
            opts.push(if mt.propagation.is_empty() { "rprivate".into() } else { mt.propagation.clone() });
            if mt.readonly {
                opts.push("ro".into());
            }
            if mt.recursive_readonly {
                opts.push("rro".into());
            }
            json!({"destination": mt.destination, "type": "bind", "source": mt.source, "options": opts})
        })
        .collect()
}

fn resources(s: &ContainerSpec) -> Value {
    let mut v = limits(&s.resources);
    if !s.privileged {
        v["devices"] = json!([
            {"allow": false, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 5, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 7, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 8, "access": "rwm"},
            {"allow": true, "type": "c", "major": 1, "minor": 9, "access": "rwm"},
            {"allow": true, "type": "c", "major": 5, "minor": 0, "access": "rwm"},
            {"allow": true, "type": "c", "major": 5, "minor": 2, "access": "rwm"},
            {"allow": true, "type": "c", "major": 136, "access": "rwm"},
        ]);
        let rules = v["devices"].as_array_mut().expect("array above");
        rules.extend(s.devices.iter().filter_map(device_rule));
    }
    v
}

/// `linux.resources` without device rules: what UpdateContainerResources changes.
pub fn limits(r: &Resources) -> Value {
    let mut v = json!({});
    let mut cpu = json!({});
    if let Some(x) = r.cpu_shares {
        cpu["shares"] = json!(x);
    }
    if let Some(x) = r.cpu_quota {
        cpu["quota"] = json!(x);
    }
    if let Some(x) = r.cpu_period {
        cpu["period"] = json!(x);
    }
    if let Some(x) = &r.cpuset_cpus {
        cpu["cpus"] = json!(x);
    }
    if let Some(x) = &r.cpuset_mems {
        cpu["mems"] = json!(x);
    }
    if cpu.as_object().is_some_and(|o| !o.is_empty()) {
        v["cpu"] = cpu;
    }
    let mut mem = json!({});
    if let Some(x) = r.memory_limit {
        mem["limit"] = json!(x);
    }
    if let Some(x) = r.memory_swap {
        mem["swap"] = json!(x);
    }
    if mem.as_object().is_some_and(|o| !o.is_empty()) {
        v["memory"] = mem;
    }
    if let Some(x) = r.pids_limit {
        v["pids"] = json!({"limit": x});
    }
    if !r.hugepage_limits.is_empty() {
        v["hugepageLimits"] = r
            .hugepage_limits
            .iter()
            .map(|(size, limit)| json!({"pageSize": size, "limit": limit}))
            .collect();
    }
    if !r.unified.is_empty() {
        v["unified"] = json!(r.unified);
    }
    v
}

/// A `linux.devices` entry.
pub fn device_node(d: &Device) -> Value {
    let mut v = json!({"path": d.path, "type": d.kind, "major": d.major, "minor": d.minor});
    if let Some(m) = d.file_mode {
        v["fileMode"] = json!(m);
    }
    if let Some(u) = d.uid {
        v["uid"] = json!(u);
    }
    if let Some(g) = d.gid {
        v["gid"] = json!(g);
    }
    v
}

/// The device cgroup rule that lets the container use `d` (fifos need none; an unbuffered
/// character device, "u", is a character device to the cgroup).
pub fn device_rule(d: &Device) -> Option<Value> {
    let kind = match d.kind.as_str() {
        "p" => return None,
        "u" => "c",
        k => k,
    };
    Some(
        json!({"allow": true, "type": kind, "major": d.major, "minor": d.minor, "access": d.access}),
    )
}

fn devices(s: &ContainerSpec) -> Value {
    s.devices.iter().map(device_node).collect()
}

/// The OCI spec for `s`, as JSON.
pub fn generate_json(s: &ContainerSpec) -> Value {
    let caps = capabilities(s);
    let mut mounts = default_mounts(s);
    mounts.extend(user_mounts(s));
    let mut process = json!({
        "terminal": s.tty,
        "user": {"uid": s.uid, "gid": s.gid, "additionalGids": s.additional_gids},
        "args": s.args,
        "env": s.env,
        "cwd": if s.cwd.is_empty() { "/" } else { &s.cwd },
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
    });
    // Only present when true: libcontainer decides when to load seccomp by whether the field
    // is there, not by its value, and loads it too late (without privileges) for `false`.
    if s.no_new_privileges {
        process["noNewPrivileges"] = json!(true);
    }
    if let Some(adj) = s.oom_score_adj {
        process["oomScoreAdj"] = json!(adj);
    }
    let mut linux = json!({
        "namespaces": namespaces(s),
        "cgroupsPath": s.cgroups_path,
        "resources": resources(s),
        "sysctl": s.sysctls,
    });
    if !s.devices.is_empty() {
        linux["devices"] = devices(s);
    }
    // Mount events only cross into (rslave) or out of (rshared) the container when its root
    // itself propagates them, as containerd sets it.
    if s.mounts.iter().any(|m| m.propagation == "rshared") {
        linux["rootfsPropagation"] = json!("shared");
    } else if s.mounts.iter().any(|m| m.propagation == "rslave") {
        linux["rootfsPropagation"] = json!("slave");
    }
    if let Some(profile) = &s.apparmor_profile {
        process["apparmorProfile"] = json!(profile);
    }
    if !s.privileged {
        let profile = match &s.seccomp {
            Seccomp::Unconfined => None,
            Seccomp::RuntimeDefault => Some(crate::seccomp::runtime_default(&caps)),
            Seccomp::Profile(p) => Some(p.clone()),
        };
        if let Some(p) = profile {
            linux["seccomp"] = crate::seccomp::for_libcontainer(p);
        }
    }
    if !s.privileged {
        linux["maskedPaths"] = json!(s
            .masked_paths
            .clone()
            .unwrap_or_else(|| MASKED_PATHS.iter().map(|p| p.to_string()).collect()));
        linux["readonlyPaths"] = json!(s
            .readonly_paths
            .clone()
            .unwrap_or_else(|| READONLY_PATHS.iter().map(|p| p.to_string()).collect()));
    }
    let mut spec = json!({
        "ociVersion": "1.0.2",
        "process": process,
        "root": {"path": s.rootfs, "readonly": s.readonly_rootfs},
        "mounts": mounts,
        "linux": linux,
        "annotations": s.annotations,
    });
    if !matches!(s.uts, Some(Ns::Host)) && !s.hostname.is_empty() {
        spec["hostname"] = json!(s.hostname);
    }
    spec
}

/// An OCI spec in JSON form (generated, then edited by CDI), typed; one that does not parse
/// is [`crate::Error::InvalidSpec`], a bug.
pub fn typed(v: Value) -> crate::Result<Spec> {
    serde_json::from_value(v).map_err(crate::Error::InvalidSpec)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Applies `tweak` to a base spec and hands the generated JSON to `check`.
    fn check(tweak: impl FnOnce(&mut ContainerSpec), check: impl FnOnce(&Value)) {
        let mut s = base();
        tweak(&mut s);
        let v = generate_json(&s);
        typed(v.clone()).expect("spec parses as OCI");
        check(&v);
    }

    fn caps_of(v: &Value) -> Vec<String> {
        v["process"]["capabilities"]["bounding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    }

    #[test]
    fn defaults_match_containerd() {
        check(
            |_| {},
            |v| {
                assert_eq!(caps_of(v).len(), DEFAULT_CAPABILITIES.len());
                assert_eq!(v["process"]["cwd"], "/");
                assert_eq!(v["hostname"], "pod");
                assert!(v["linux"]["maskedPaths"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p == "/proc/kcore"));
                assert_eq!(
                    v["linux"]["resources"]["devices"][0],
                    json!({"allow": false, "access": "rwm"})
                );
                assert!(v["mounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["destination"] == "/dev/shm"));
                assert_eq!(v["linux"]["cgroupsPath"], "/hako/c1");
            },
        );
    }

    #[test]
    fn capabilities_add_drop_and_all() {
        check(
            |s| s.add_capabilities = vec!["SYS_ADMIN".into()],
            |v| assert!(caps_of(v).contains(&"CAP_SYS_ADMIN".to_string())),
        );
        check(
            |s| s.drop_capabilities = vec!["CHOWN".into()],
            |v| assert!(!caps_of(v).contains(&"CAP_CHOWN".to_string())),
        );
        check(
            |s| s.drop_capabilities = vec!["ALL".into()],
            |v| assert!(caps_of(v).is_empty()),
        );
        check(
            |s| {
                s.add_capabilities = vec!["ALL".into()];
                s.drop_capabilities = vec!["NET_RAW".into()];
            },
            |v| {
                assert_eq!(caps_of(v).len(), ALL_CAPABILITIES.len() - 1);
                assert!(!caps_of(v).contains(&"CAP_NET_RAW".to_string()));
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
            |v| {
                assert_eq!(caps_of(v).len(), ALL_CAPABILITIES.len() - 1);
                assert!(!caps_of(v).contains(&"CAP_SYS_RESOURCE".to_string()));
            },
        );
    }

    #[test]
    fn seccomp_default_is_generated_and_privileged_ignores_it() {
        check(
            |s| s.seccomp = Seccomp::RuntimeDefault,
            |v| {
                let sc = &v["linux"]["seccomp"];
                assert_eq!(sc["defaultAction"], "SCMP_ACT_ERRNO");
                let allowed = sc["syscalls"][0]["names"].as_array().unwrap();
                assert!(allowed.iter().any(|n| n == "read"));
                assert!(!allowed.iter().any(|n| n == "mount"));
                // The clone rule reaches the spec in libcontainer's reading (mask in valueTwo).
                let clone = sc["syscalls"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|r| r["names"] == json!(["clone"]))
                    .expect("a clone rule");
                assert_eq!(
                    clone["args"][0]["valueTwo"],
                    crate::seccomp::CLONE_NAMESPACE_FLAGS
                );
                assert_eq!(clone["args"][0]["value"], 0);
            },
        );
        check(
            |s| {
                s.seccomp = Seccomp::RuntimeDefault;
                s.add_capabilities = vec!["SYS_ADMIN".into()];
            },
            |v| {
                let allowed = v["linux"]["seccomp"]["syscalls"][0]["names"]
                    .as_array()
                    .unwrap();
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
            |v| assert!(v["linux"].get("seccomp").is_none()),
        );
        check(
            |_| {},
            |v| assert!(v["linux"].get("seccomp").is_none(), "unconfined by default"),
        );
    }

    #[test]
    fn localhost_seccomp_profiles_are_adapted_for_libcontainer() {
        let p = json!({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 0x7E02_0000u64, "op": "SCMP_CMP_MASKED_EQ"}]}]});
        check(
            |s| s.seccomp = Seccomp::Profile(p.clone()),
            |v| {
                assert_eq!(
                    v["linux"]["seccomp"]["syscalls"][0]["args"][0],
                    json!({"index": 0, "value": 0, "valueTwo": 0x7E02_0000u64, "op": "SCMP_CMP_MASKED_EQ"})
                );
            },
        );
    }

    #[test]
    fn apparmor_profile_reaches_the_process() {
        check(
            |s| s.apparmor_profile = Some("hako-default".into()),
            |v| assert_eq!(v["process"]["apparmorProfile"], "hako-default"),
        );
        check(
            |_| {},
            |v| assert!(v["process"].get("apparmorProfile").is_none()),
        );
    }

    #[test]
    fn privileged_gets_everything_and_no_masks() {
        check(
            |s| s.privileged = true,
            |v| {
                assert_eq!(caps_of(v).len(), ALL_CAPABILITIES.len());
                assert!(v["linux"].get("maskedPaths").is_none());
                assert!(v["linux"]["resources"].get("devices").is_none());
                let sys = v["mounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["destination"] == "/sys")
                    .unwrap();
                assert!(!sys["options"].as_array().unwrap().iter().any(|o| o == "ro"));
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
            |v| {
                let ns = v["linux"]["namespaces"].as_array().unwrap();
                assert!(ns.contains(&json!({"type": "network", "path": "/run/hako/pods/p/ns/net"})));
                assert!(ns.contains(&json!({"type": "ipc"})));
                assert!(!ns.iter().any(|n| n["type"] == "pid" || n["type"] == "uts"));
                assert!(
                    v.get("hostname").is_none(),
                    "no hostname in the host's UTS namespace"
                );
            },
        );
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
            },
            |v| {
                let m = v["mounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["destination"] == "/data")
                    .unwrap();
                assert_eq!(m["options"], json!(["rbind", "rslave", "ro"]));
                assert_eq!(v["linux"]["resources"]["memory"]["limit"], 64 << 20);
                assert_eq!(v["linux"]["resources"]["cpu"]["quota"], 50_000);
                assert_eq!(v["linux"]["resources"]["pids"]["limit"], 42);
                assert_eq!(
                    v["process"]["user"],
                    json!({"uid": 1000, "gid": 1000, "additionalGids": [10, 50000]})
                );
                assert_eq!(v["root"]["readonly"], true);
                assert_eq!(v["process"]["noNewPrivileges"], true);
                assert_eq!(v["linux"]["rootfsPropagation"], "slave");
            },
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
        assert!(limits(&r).get("unified").is_none());
        r.unified.insert("memory.high".into(), "64M".into());
        assert_eq!(limits(&r)["unified"], json!({"memory.high": "64M"}));
    }

    #[test]
    fn the_pods_dev_shm_replaces_the_private_one() {
        let shm = |v: &Value| -> Vec<Value> {
            v["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["destination"] == "/dev/shm")
                .cloned()
                .collect()
        };
        let mount = |destination: &str, source: &str| Mount {
            destination: destination.into(),
            source: source.into(),
            readonly: false,
            propagation: String::new(),
            recursive_readonly: false,
        };
        check(
            |s| s.mounts.push(mount("/dev/shm", "/run/hako/pods/p/shm")),
            |v| {
                let m = shm(v);
                assert_eq!(m.len(), 1, "{m:?}");
                assert_eq!(m[0]["source"], "/run/hako/pods/p/shm");
            },
        );
        check(
            |s| s.mounts.push(mount("/data", "/srv")),
            |v| assert_eq!(shm(v)[0]["source"], "shm"),
        );
    }

    #[test]
    fn typed_keeps_the_spec_and_names_a_bad_one() {
        let s = typed(generate_json(&base())).unwrap();
        let process = s.process().as_ref().unwrap();
        assert_eq!(process.args().as_ref().unwrap(), &["sh".to_string()]);
        assert_eq!(s.hostname().as_deref(), Some("pod"));
        let e = typed(json!({"ociVersion": 1})).unwrap_err();
        assert!(matches!(e, crate::Error::InvalidSpec(_)), "{e:?}");
        assert_eq!(e.to_string(), "generated OCI spec is invalid");
        let source = std::error::Error::source(&e).expect("serde's error as the source");
        assert!(source.to_string().contains("invalid type"), "{source}");
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
                });
            },
            |v| {
                let d = &v["linux"]["devices"][0];
                assert_eq!(
                    (d["path"].as_str(), d["type"].as_str()),
                    (Some("/dev/fake0"), Some("c"))
                );
                assert_eq!(
                    (d["fileMode"].as_u64(), d["gid"].as_u64()),
                    (Some(0o620), Some(5))
                );
                assert!(d.get("uid").is_none());
                let rules = v["linux"]["resources"]["devices"].as_array().unwrap();
                let last = rules.last().unwrap();
                assert_eq!(last["access"], "rw");
                assert_eq!(
                    (last["major"].as_i64(), last["minor"].as_i64()),
                    (Some(1), Some(3))
                );
                assert_eq!(
                    v["linux"]["resources"]["hugepageLimits"][0]["pageSize"],
                    "2MB"
                );
                assert_eq!(
                    v["linux"]["resources"]["hugepageLimits"][0]["limit"],
                    4 << 20
                );
                let m = v["mounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["destination"] == "/data")
                    .unwrap();
                let opts: Vec<&str> = m["options"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter_map(|o| o.as_str())
                    .collect();
                assert!(opts.contains(&"ro") && opts.contains(&"rro"), "{opts:?}");
            },
        );
    }
}
