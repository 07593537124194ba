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
    /// Limits that do not form an OCI `linux.resources`.
    #[error("resources for cgroup {path}")]
    Resources {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    /// The OCI spec hako generated (and CDI edited) does not parse as one: a bug.
    #[error("generated OCI spec is invalid")]
    InvalidSpec(#[source] serde_json::Error),
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
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }
}
