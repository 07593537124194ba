//! The CRI streaming server: the URLs that Exec, Attach and PortForward return, and the
//! HTTP server behind them (kubelet proxies `kubectl exec/attach/port-forward` to it).
//!
//! The server speaks the wire protocols (SPDY/3.1, WebSocket) and knows nothing about pods;
//! what a session does inside a container goes through [`Backend`], which `pods::Pods`
//! implements (`src/pods/streams.rs`). The split keeps the protocol code testable on its own
//! and the pod code free of HTTP.

mod conn;
mod remote;
mod server;
pub mod spdy;
pub mod ws;

pub use conn::BUDGET;
pub use remote::{MAX_FORWARDS, STREAM_CREATION_TIMEOUT};
pub use server::{
    NoBackend, Owner, Streaming, MAX_SESSIONS_PER_NAMESPACE, MAX_SESSIONS_PER_POD, MAX_TOKENS,
    RESERVED_FOR_NEW_NAMESPACES, TOKEN_TTL,
};

use std::future::Future;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::error::Result;

/// A process to run in a running container, with the streams the client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    pub container_id: String,
    pub cmd: Vec<String>,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// Joining a running container's own stdio (the streams its monitor holds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    pub container_id: String,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// A terminal size, as the resize stream sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermSize {
    pub width: u16,
    pub height: u16,
}

pub type BoxRead = Box<dyn AsyncRead + Send + Unpin>;
pub type BoxWrite = Box<dyn AsyncWrite + Send + Unpin>;

/// An open exec or attach. Each stream is `Some` exactly when the request asked for it (with a
/// TTY, stderr is `None`: the terminal merges it into stdout).
///
/// Shutting down `stdin` closes the process's stdin (EOF). Dropping the session (client gone,
/// idle timeout) kills an exec'ed process and detaches an attach, leaving the container running.
pub struct Session {
    pub stdin: Option<BoxWrite>,
    pub stdout: Option<BoxRead>,
    pub stderr: Option<BoxRead>,
    /// Terminal resizes; `Some` only with a TTY.
    pub resize: Option<tokio::sync::mpsc::Sender<TermSize>>,
    /// Exec: the process's exit code. Attach: resolves with the container's exit code when it
    /// exits (a detach is the client going away, which drops the session instead).
    pub exit: Pin<Box<dyn Future<Output = Result<i32>> + Send>>,
}

/// What the streaming server needs from the pods.
#[tonic::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Starts `cmd` in the container, with the container's namespaces, cgroup, user, env,
    /// capabilities and seccomp, as ExecSync runs it.
    async fn exec(&self, req: ExecRequest) -> Result<Session>;
    /// Joins the container's stdio; several clients may attach at once.
    async fn attach(&self, req: AttachRequest) -> Result<Session>;
    /// A connection to `port` on the pod's loopback, inside the pod's network namespace (the
    /// host's for host-network pods).
    async fn port_forward(&self, pod_sandbox_id: &str, port: u16) -> Result<tokio::net::TcpStream>;
}
