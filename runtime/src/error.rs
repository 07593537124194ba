//! The runtime crate's error. A variant is one cause, and says what the caller can do about it
//! (the request is wrong, the host lacks something, an object is missing, a bug); each names
//! the object that failed and keeps the underlying error as its source. The daemon maps them
//! to its own kinds, and so to gRPC codes, in one place (`hako::error`).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A seccomp profile is not JSON.
    #[error("seccomp profile {profile}")]
    SeccompSyntax {
        profile: String,
        #[source]
        source: serde_json::Error,
    },
    /// A seccomp profile is JSON but not a profile.
    #[error("seccomp profile {profile}: {defect}")]
    SeccompProfile {
        profile: String,
        defect: ProfileDefect,
    },
    /// A Localhost AppArmor profile without a name.
    #[error("apparmor localhost profile has no name")]
    AppArmorEmptyName,
    /// An AppArmor profile was asked for and this host cannot enforce one.
    #[error("apparmor profile {profile} was requested, but apparmor is not enabled on this host")]
    AppArmorNotEnabled { profile: String },
    /// A Localhost AppArmor profile the kernel does not have.
    #[error("apparmor profile {profile} is not loaded")]
    AppArmorNotLoaded { profile: String },
    /// The default profile is not loaded and there is no parser to load it.
    #[error("apparmor profile {profile} is not loaded and {parser} is not installed to load it")]
    AppArmorNoParser {
        profile: String,
        parser: &'static str,
    },
    /// `apparmor_parser` refused or failed to load a profile.
    #[error("load apparmor profile {profile}: {} {status}: {stderr}", parser.display())]
    AppArmorLoad {
        profile: String,
        parser: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// A host file or program failed: `op` on `path` (a file, or the program run).
    #[error("{op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The cgroup (as in the OCI spec, e.g. `/kubepods/pod1/hako-<id>`) does not exist.
    #[error("cgroup {path} does not exist")]
    CgroupNotFound { path: String },
    /// Reading a cgroup's usage failed.
    #[error("read cgroup {path}")]
    CgroupRead {
        path: String,
        #[source]
        source: BoxError,
    },
    /// The kernel (or libcgroups) refused new limits for a cgroup.
    #[error("update cgroup {path}")]
    CgroupUpdate {
        path: String,
        #[source]
        source: BoxError,
    },
    /// A CDI device name that is not `vendor.com/class=name`.
    #[error("CDI device {name:?}{defect}")]
    CdiName { name: String, defect: CdiNameDefect },
    /// A CDI spec file that is not a valid spec. `at` is the field's path
    /// (`devices[0].name`), empty for the file as a whole. The file is not in the message:
    /// the registry lists the message beside the file.
    #[error("{}{problem}", if at.is_empty() { String::new() } else { format!("{at}: ") })]
    CdiSpec {
        file: PathBuf,
        at: String,
        problem: String,
    },
    /// No valid spec in the CDI directories defines the device; `broken` lists the spec files
    /// (with why) that do not parse and might.
    #[error(
        "CDI device {device} not found in {}{}",
        dirs_list(dirs),
        broken_list(broken)
    )]
    CdiNotFound {
        device: String,
        dirs: Vec<PathBuf>,
        broken: Vec<String>,
    },
    /// Two spec files of one directory define the device.
    #[error("CDI device {device} is ambiguous: defined in {}", files.join(" and "))]
    CdiAmbiguous { device: String, files: Vec<String> },
    /// A CDI edit (of `device`, from spec `file`) that cannot be applied to the container.
    #[error("CDI spec {}: {problem}", file.display())]
    CdiEdit {
        file: PathBuf,
        device: String,
        problem: String,
    },
    /// A system call of the monitor's set-up failed; `op` says what it was for.
    #[error("{op}")]
    Sys {
        op: String,
        #[source]
        source: BoxError,
    },
    /// A process the monitor forks for its set-up failed; the message is its report.
    #[error("{0}")]
    Helper(String),
    /// The PID namespace a container should join has no init any more.
    #[error("the pod's PID namespace is gone (its init, the infra process, exited)")]
    PidNsGone,
}

fn dirs_list(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn broken_list(broken: &[String]) -> String {
    if broken.is_empty() {
        String::new()
    } else {
        format!("; it may be in a broken spec: {}", broken.join("; "))
    }
}

/// What is wrong with a CDI device name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdiNameDefect {
    #[error(" is not a fully qualified name (vendor.com/class=name)")]
    NotQualified,
    #[error(" has no vendor/class")]
    NoVendorClass,
    #[error(": invalid vendor {0:?}")]
    Vendor(String),
    #[error(": invalid class {0:?}")]
    Class(String),
    #[error(": invalid device name {0:?}")]
    Device(String),
}

/// A library's error, kept as the source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What is wrong with a seccomp profile's content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileDefect {
    #[error("profile is not a JSON object")]
    NotAnObject,
    #[error("profile has no defaultAction")]
    NoDefaultAction,
    #[error("syscalls[{0}] has no action")]
    NoAction(usize),
    #[error("syscalls[{0}] names no syscall")]
    NoNames(usize),
    #[error("not an OCI seccomp profile: {0}")]
    NotOci(String),
}

impl Error {
    /// A failed system call of the monitor's set-up.
    pub fn sys(op: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Sys {
            op: op.into(),
            source: source.into(),
        }
    }

    /// The error and all its sources, joined with ": " (what the monitor reports as text).
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut cur = std::error::Error::source(self);
        while let Some(e) = cur {
            out.push_str(": ");
            out.push_str(&e.to_string());
            cur = e.source();
        }
        out
    }

    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
