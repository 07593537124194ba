//! hako's domain error. Each variant is one kind of failure; the gRPC layer maps kinds to codes
//! in exactly one place (`server::status`). Messages name the object and the cause; sources are
//! kept so the whole chain reaches the caller and the log.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The named object does not exist; the message names it.
    #[error("{0}")]
    NotFound(String),
    /// The request itself is malformed (unparsable reference, bad field).
    #[error("{0}")]
    InvalidArgument(String),
    /// The object exists and the request conflicts with it.
    #[error("{0}")]
    AlreadyExists(String),
    /// The system is not in a state that allows the operation.
    #[error("{0}")]
    FailedPrecondition(String),
    /// A registry refused our credentials (401).
    #[error("{0}")]
    Unauthenticated(String),
    /// A registry understood our credentials and refused access (403).
    #[error("{0}")]
    PermissionDenied(String),
    /// An operation made no progress within its limit.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A remote service could not be reached or failed; retrying may help.
    #[error("{0}")]
    Unavailable(String),
    /// The RPC or feature is not built yet.
    #[error("{0} is not implemented")]
    Unimplemented(String),
    /// A filesystem operation on `path` failed.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The metadata store failed.
    #[error("metadata store: {0}")]
    Store(String),
    /// Anything else: a bug or an unexpected condition.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// Wraps this error's message with a leading context while keeping its kind.
    pub fn context(self, ctx: impl std::fmt::Display) -> Error {
        match self {
            // Its display adds "is not implemented" to the inner text: prefix that instead.
            Error::Unimplemented(what) => Error::Unimplemented(format!("{ctx}: {what}")),
            _ => self.with_message(format!("{ctx}: {}", chain(&self))),
        }
    }

    /// An error of the same kind with another message (kinds without a message of their own
    /// become Internal). Also how a shared error is handed to each of its waiters.
    pub fn with_message(&self, msg: String) -> Error {
        match self {
            Error::NotFound(_) => Error::NotFound(msg),
            Error::InvalidArgument(_) => Error::InvalidArgument(msg),
            Error::AlreadyExists(_) => Error::AlreadyExists(msg),
            Error::FailedPrecondition(_) => Error::FailedPrecondition(msg),
            Error::Unauthenticated(_) => Error::Unauthenticated(msg),
            Error::PermissionDenied(_) => Error::PermissionDenied(msg),
            Error::DeadlineExceeded(_) => Error::DeadlineExceeded(msg),
            Error::Unavailable(_) => Error::Unavailable(msg),
            Error::Unimplemented(_) => Error::Unimplemented(msg),
            Error::Io { .. } | Error::Store(_) | Error::Internal(_) => Error::Internal(msg),
        }
    }
}

/// The error and all its sources, joined with ": ".
pub fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        // Some libraries repeat their source in their own message (#[error(transparent)]).
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

/// The runtime crate's errors by kind: this is where each of its causes gets its gRPC code
/// (through the kind, in `server::status`). The message is the whole chain.
impl From<hako_runtime::Error> for Error {
    fn from(e: hako_runtime::Error) -> Self {
        use hako_runtime::Error as R;
        let msg = chain(&e);
        match e {
            // The request names a profile that is malformed.
            R::SeccompSyntax { .. } | R::SeccompProfile { .. } | R::AppArmorEmptyName => {
                Error::InvalidArgument(msg)
            }
            // Limits the kernel or libcgroups refuses.
            R::CgroupUpdate { .. } => Error::InvalidArgument(msg),
            // Devices the request names that CDI cannot give as asked.
            R::CdiName { .. } | R::CdiAmbiguous { .. } | R::CdiSpec { .. } | R::CdiEdit { .. } => {
                Error::InvalidArgument(msg)
            }
            // What the request names is not on this host.
            R::AppArmorNotLoaded { .. } | R::CgroupNotFound { .. } | R::CdiNotFound { .. } => {
                Error::NotFound(msg)
            }
            // The host cannot do what is asked as it is set up.
            R::AppArmorNotEnabled { .. } | R::AppArmorNoParser { .. } | R::AppArmorLoad { .. } => {
                Error::FailedPrecondition(msg)
            }
            // The pod's PID namespace ended with its infra process: the pod must be remade.
            R::PidNsGone => Error::FailedPrecondition(msg),
            R::Io { op, path, source } => Error::Io { op, path, source },
            // The monitor's own set-up: the host or hako failed, not the request.
            R::CgroupRead { .. } | R::Sys { .. } | R::Helper(_) => Error::Internal(msg),
        }
    }
}

impl From<redb::Error> for Error {
    fn from(e: redb::Error) -> Self {
        Error::Store(chain(&e))
    }
}

macro_rules! store_error_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Self {
                Error::Store(chain(&e))
            }
        }
    )*};
}
store_error_from!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::SetDurabilityError
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_includes_sources() {
        let e = Error::io(
            "create",
            "/x/y",
            std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"),
        );
        assert_eq!(chain(&e), "create /x/y: denied");
    }

    /// Each cause of the runtime crate reaches the client with its code and its whole chain.
    #[test]
    fn runtime_errors_map_to_grpc_codes() {
        use hako_runtime::error::{CdiNameDefect, ProfileDefect};
        use hako_runtime::Error as R;
        use tonic::Code;
        let json_error = || serde_json::from_str::<u32>("x").unwrap_err();
        let io = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let cases: Vec<(R, Code, &str)> = vec![
            (
                R::SeccompSyntax {
                    profile: "/p.json".into(),
                    source: json_error(),
                },
                Code::InvalidArgument,
                "seccomp profile /p.json: expected value at line 1 column 1",
            ),
            (
                R::SeccompProfile {
                    profile: "/p.json".into(),
                    defect: ProfileDefect::NoAction(2),
                },
                Code::InvalidArgument,
                "seccomp profile /p.json: syscalls[2] has no action",
            ),
            (
                R::AppArmorEmptyName,
                Code::InvalidArgument,
                "apparmor localhost profile has no name",
            ),
            (
                R::AppArmorNotEnabled {
                    profile: "runtime/default".into(),
                },
                Code::FailedPrecondition,
                "apparmor profile runtime/default was requested, but apparmor is not enabled on this host",
            ),
            (
                R::AppArmorNotLoaded {
                    profile: "mine".into(),
                },
                Code::NotFound,
                "apparmor profile mine is not loaded",
            ),
            (
                R::AppArmorNoParser {
                    profile: "hako-default".into(),
                    parser: "apparmor_parser",
                },
                Code::FailedPrecondition,
                "apparmor profile hako-default is not loaded and apparmor_parser is not installed to load it",
            ),
            (
                R::AppArmorLoad {
                    profile: "hako-default".into(),
                    parser: "/sbin/apparmor_parser".into(),
                    status: std::os::unix::process::ExitStatusExt::from_raw(256),
                    stderr: "syntax error".into(),
                },
                Code::FailedPrecondition,
                "load apparmor profile hako-default: /sbin/apparmor_parser exit status: 1: syntax error",
            ),
            (
                R::Io {
                    op: "read",
                    path: "/sys/kernel/security/apparmor/profiles".into(),
                    source: io(),
                },
                Code::Internal,
                "read /sys/kernel/security/apparmor/profiles: denied",
            ),
            (
                R::CgroupNotFound {
                    path: "/hako/p/hako-c".into(),
                },
                Code::NotFound,
                "cgroup /hako/p/hako-c does not exist",
            ),
            (
                R::CgroupUpdate {
                    path: "/hako/p/hako-c".into(),
                    source: Box::new(io()),
                },
                Code::InvalidArgument,
                "update cgroup /hako/p/hako-c: denied",
            ),
            (
                R::CgroupRead {
                    path: "/hako/p/hako-c".into(),
                    source: Box::new(io()),
                },
                Code::Internal,
                "read cgroup /hako/p/hako-c: denied",
            ),
            (
                R::CdiName {
                    name: "v/c".into(),
                    defect: CdiNameDefect::NotQualified,
                },
                Code::InvalidArgument,
                "CDI device \"v/c\" is not a fully qualified name (vendor.com/class=name)",
            ),
            (
                R::CdiNotFound {
                    device: "v.com/c=d".into(),
                    dirs: vec!["/etc/cdi".into(), "/var/run/cdi".into()],
                    broken: vec!["/etc/cdi/x.json (cdiVersion: missing)".into()],
                },
                Code::NotFound,
                "CDI device v.com/c=d not found in /etc/cdi, /var/run/cdi; it may be in a broken spec: /etc/cdi/x.json (cdiVersion: missing)",
            ),
            (
                R::CdiAmbiguous {
                    device: "v.com/c=d".into(),
                    files: vec!["/a.json".into(), "/b.json".into()],
                },
                Code::InvalidArgument,
                "CDI device v.com/c=d is ambiguous: defined in /a.json and /b.json",
            ),
            (
                R::CdiSpec {
                    file: "/etc/cdi/x.json".into(),
                    at: "devices[0].name".into(),
                    problem: "device \"d\" is defined twice".into(),
                },
                Code::InvalidArgument,
                "devices[0].name: device \"d\" is defined twice",
            ),
            (
                R::CdiEdit {
                    file: "/etc/cdi/x.json".into(),
                    device: "v.com/c=d".into(),
                    problem: "/dev/x is not a device node".into(),
                },
                Code::InvalidArgument,
                "CDI spec /etc/cdi/x.json: /dev/x is not a device node",
            ),
            (
                R::PidNsGone,
                Code::FailedPrecondition,
                "the pod's PID namespace is gone",
            ),
            (
                R::Sys {
                    op: "unshare pod namespaces".into(),
                    source: Box::new(io()),
                },
                Code::Internal,
                "unshare pod namespaces: denied",
            ),
            (
                R::Helper("infra process died".into()),
                Code::Internal,
                "infra process died",
            ),
        ];
        for (runtime, code, message) in cases {
            let what = format!("{runtime:?}");
            let status = crate::server::status("Test", Error::from(runtime).context("container c"));
            assert_eq!(status.code(), code, "{what}");
            assert!(
                status
                    .message()
                    .starts_with(&format!("container c: {message}")),
                "{what}: {}",
                status.message()
            );
        }
    }

    #[test]
    fn context_keeps_kind() {
        let e = Error::Unauthenticated("registry r refused credentials".into()).context("pull x");
        assert!(
            matches!(e, Error::Unauthenticated(ref m) if m == "pull x: registry r refused credentials")
        );
        let e = Error::Unimplemented("TTY".into()).context("create container c");
        assert_eq!(e.to_string(), "create container c: TTY is not implemented");
        assert!(matches!(e, Error::Unimplemented(_)));
    }
}
