//! hako's own description of pods and containers: what the CRI layer converts requests into,
//! and what the store keeps (versioned JSON records).

use std::collections::BTreeMap;

use hako_runtime::spec::Resources;
use serde::{Deserialize, Serialize};

/// Where a pod or container namespace comes from (CRI `NamespaceMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum NsMode {
    /// Shared by the pod.
    #[default]
    Pod,
    /// The container's own.
    Container,
    /// The host's.
    Node,
    /// Another container's (PID only).
    Target,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dns {
    pub servers: Vec<String>,
    pub searches: Vec<String>,
    pub options: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PortMapping {
    pub protocol: String,
    pub container_port: i32,
    pub host_port: i32,
    pub host_ip: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PodSpec {
    pub name: String,
    pub uid: String,
    pub namespace: String,
    pub attempt: u32,
    pub hostname: String,
    pub log_directory: String,
    pub dns: Option<Dns>,
    pub port_mappings: Vec<PortMapping>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub cgroup_parent: String,
    pub sysctls: BTreeMap<String, String>,
    pub network: NsMode,
    pub pid: NsMode,
    pub ipc: NsMode,
    pub runtime_handler: String,
    /// A user namespace of the pod's own (CRI mode POD), which owns its other namespaces.
    #[serde(default)]
    pub userns: Option<hako_runtime::monitor::UserNs>,
}

impl PodSpec {
    /// kubelet's unique key for a pod attempt.
    pub fn reservation(&self) -> String {
        format!(
            "pod/{}_{}_{}_{}",
            self.name, self.namespace, self.uid, self.attempt
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodState {
    Ready,
    NotReady,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodRecord {
    pub v: u32,
    pub id: String,
    pub spec: PodSpec,
    pub state: PodState,
    pub created_at: i64,
    pub monitor_pid: u32,
    /// Namespace paths containers join, by kind ("network", "ipc", "uts", "pid").
    pub namespaces: BTreeMap<String, String>,
    /// The pod's IPs from its CNI attachment, IPv4 first; empty with the host's network.
    #[serde(default)]
    pub ips: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Propagation {
    #[default]
    Private,
    HostToContainer,
    Bidirectional,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MountReq {
    pub container_path: String,
    pub host_path: String,
    pub readonly: bool,
    pub propagation: Propagation,
    #[serde(default)]
    pub recursive_readonly: bool,
    /// Restrictions kubelet adds to the bind mount (CRI `mount_options`): any of `MOUNT_OPTIONS`.
    #[serde(default)]
    pub options: Vec<String>,
    /// An image volume (CRI `Mount.image`): the image, as kubelet names it after its pull,
    /// whose layers are mounted read-only in place of a host path.
    #[serde(default)]
    pub image: Option<String>,
    /// The directory of the image to mount instead of its root (CRI `image_sub_path`).
    #[serde(default)]
    pub image_sub_path: String,
}

/// The bind-mount options a CRI mount may ask for. Each only takes something away from what
/// the volume allows; an option that would give something (`suid`, `dev`, `exec`, `rw`) or
/// change the mount's kind is refused.
pub const MOUNT_OPTIONS: &[&str] = &["noexec", "nodev", "nosuid", "noatime", "nodiratime", "ro"];

/// A host device the container asks for (CRI `Device`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DeviceReq {
    pub container_path: String,
    pub host_path: String,
    /// Any of "r", "w", "m"; empty means "rwm".
    pub permissions: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub enum SeccompReq {
    #[default]
    Unconfined,
    RuntimeDefault,
    /// A profile file on the node (docker/Kubernetes JSON format).
    Localhost(String),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Security {
    pub privileged: bool,
    pub run_as_user: Option<i64>,
    pub run_as_username: String,
    pub run_as_group: Option<i64>,
    pub supplemental_groups: Vec<i64>,
    /// SupplementalGroupsPolicy Strict: the image's /etc/group adds nothing.
    #[serde(default)]
    pub strict_supplemental_groups: bool,
    pub readonly_rootfs: bool,
    pub no_new_privs: bool,
    pub add_capabilities: Vec<String>,
    pub drop_capabilities: Vec<String>,
    pub masked_paths: Option<Vec<String>>,
    pub readonly_paths: Option<Vec<String>>,
    pub pid: NsMode,
    pub pid_target: String,
    pub seccomp: SeccompReq,
    /// `None`: the request names no AppArmor profile.
    #[serde(default)]
    pub apparmor: Option<hako_runtime::apparmor::Request>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerSpecReq {
    pub name: String,
    pub attempt: u32,
    /// The image as the request names it.
    pub image: String,
    /// The image as the pod spec names it (CRI `user_specified_image`): kubelet names the image
    /// by its ID in `image` and compares the status' image with the pod spec's.
    #[serde(default)]
    pub user_image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub working_dir: String,
    pub envs: Vec<(String, String)>,
    pub mounts: Vec<MountReq>,
    #[serde(default)]
    pub devices: Vec<DeviceReq>,
    /// Fully qualified CDI device names (`vendor.com/class=name`) from `cdi_devices`.
    #[serde(default)]
    pub cdi_devices: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// Relative to the pod's log directory.
    pub log_path: String,
    pub tty: bool,
    pub stdin: bool,
    pub stdin_once: bool,
    pub resources: Resources,
    pub oom_score_adj: Option<i64>,
    pub security: Security,
    /// The signal a stop sends first, by name, when the pod spec names one (CRI `stop_signal`,
    /// Kubernetes' `lifecycle.stopSignal`); it wins over the image's STOPSIGNAL.
    #[serde(default)]
    pub stop_signal: Option<String>,
    /// The user namespace asked for: its pod's (mode POD) or none (mode NODE).
    #[serde(default)]
    pub userns: Option<hako_runtime::monitor::UserNs>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerState {
    Created,
    Running,
    Exited,
    Unknown,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExitInfo {
    pub code: i32,
    pub signal: i32,
    pub finished_at: i64,
    pub oom_killed: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub v: u32,
    pub id: String,
    pub pod_id: String,
    pub spec: ContainerSpecReq,
    pub image_id: String,
    pub image_ref: String,
    pub created_at: i64,
    /// Full path of the CRI log file, or empty.
    pub log_path: String,
    /// Last state seen; the monitor is the source of truth while the pod runs.
    pub state: ContainerState,
    pub started_at: i64,
    pub exit: Option<ExitInfo>,
    pub chain_ids: Vec<String>,
    /// The container's cgroup, as in its OCI spec.
    #[serde(default)]
    pub cgroups_path: String,
    /// The image's STOPSIGNAL, if it has one.
    #[serde(default)]
    pub stop_signal: Option<String>,
    /// The identity the first process starts with.
    #[serde(default)]
    pub user: Option<UserIds>,
    /// Why the last start failed (ContainerStatus reason StartError).
    #[serde(default)]
    pub start_error: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
    /// The primary group first, then the others.
    pub groups: Vec<u32>,
}

impl ContainerSpecReq {
    pub fn reservation(&self, pod_id: &str) -> String {
        format!("ctr/{pod_id}/{}_{}", self.name, self.attempt)
    }
}
