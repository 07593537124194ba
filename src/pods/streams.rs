//! The pods' side of the CRI streaming server (`streaming::Backend`): exec and attach through
//! the pod's monitor (a streaming monitor call whose connection then carries the stream frames
//! of `hako_runtime::monitor::wire`), port-forward by a connection made inside the pod's
//! network namespace.
//!
//! Flow control end to end: each output reaches the session through a small in-memory pipe
//! that the frames are written into, so a client reading slowly stops this side reading the
//! monitor's connection, which stops the monitor reading the process's output.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use hako_proto::monitor as pb;
use hako_runtime::monitor::wire::{self, stream, Method};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{ContainerRecord, ContainerState, NsMode, PodRecord, PodState, Runtime};
use crate::error::{Error, Result};
use crate::streaming::{AttachRequest, Backend, ExecRequest, Session, TermSize};

/// Bytes an output or the input may have in flight between the monitor and the client.
const PIPE: usize = 64 * 1024;

/// How long a port-forward's connect inside the pod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

impl Runtime {
    /// The container and its pod, for an exec or a stream into the container: the pod must
    /// be ready (its monitor holds the container's processes); the monitor checks the
    /// container runs.
    pub(super) fn exec_target(&self, id: &str) -> Result<(ContainerRecord, PodRecord)> {
        let c = self.container_record(id)?;
        let pod = self.pod_of(&c)?;
        if pod.state != PodState::Ready {
            let why = if c.state == ContainerState::Unknown {
                "its pod's monitor is gone".to_string()
            } else {
                format!("its pod {} is not ready", pod.id)
            };
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running: {why}",
                c.id
            )));
        }
        Ok((c, pod))
    }

    /// A streaming call to the container's monitor; a monitor found gone turns the pod
    /// NotReady and the call's error into FailedPrecondition, as for ExecSync.
    async fn open_stream<Q: prost::Message>(
        &self,
        pod: &PodRecord,
        c: &ContainerRecord,
        method: Method,
        req: &Q,
        what: &str,
    ) -> Result<tokio::net::UnixStream> {
        match self.monitor(pod).open_stream(method, req, what).await {
            Ok(conn) => Ok(conn),
            Err(e @ Error::Unavailable(_)) => {
                self.check_monitor(pod, &e)?;
                if self
                    .pod(&pod.id)
                    .map_or(true, |p| p.state != PodState::Ready)
                {
                    return Err(Error::FailedPrecondition(format!(
                        "container {} is not running: its pod's monitor is gone",
                        c.id
                    )));
                }
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// Starts `req.cmd` in the container (see `Backend::exec`).
    pub async fn exec_stream(&self, req: ExecRequest) -> Result<Session> {
        let (c, pod) = self.exec_target(&req.container_id)?;
        if req.cmd.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "exec in container {}: the command is empty",
                c.id
            )));
        }
        let call = pb::ExecRequest {
            id: c.id.clone(),
            cmd: req.cmd.clone(),
            tty: req.tty,
            stdin: req.stdin,
            stdout: req.stdout,
            // A terminal merges stderr into stdout.
            stderr: req.stderr && !req.tty,
        };
        let what = format!("exec in container {}", c.id);
        let conn = self
            .open_stream(&pod, &c, Method::Exec, &call, &what)
            .await?;
        Ok(session(
            conn, &what, req.tty, req.stdin, req.stdout, req.stderr,
        ))
    }

    /// Joins the container's stdio (see `Backend::attach`).
    pub async fn attach(&self, req: AttachRequest) -> Result<Session> {
        let (c, pod) = self.exec_target(&req.container_id)?;
        // The terminal is the container's: its config decides, not the request.
        let tty = c.spec.tty;
        let call = pb::AttachRequest {
            id: c.id.clone(),
            stdin: req.stdin,
            stdout: req.stdout,
            stderr: req.stderr && !tty,
        };
        let what = format!("attach to container {}", c.id);
        let conn = self
            .open_stream(&pod, &c, Method::Attach, &call, &what)
            .await?;
        Ok(session(conn, &what, tty, req.stdin, req.stdout, req.stderr))
    }

    /// A connection to `port` on the pod's loopback (see `Backend::port_forward`).
    pub async fn port_forward(&self, pod_id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        let pod = self.pod(pod_id)?;
        if pod.state != PodState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "port-forward to pod sandbox {}: the pod is not ready",
                pod.id
            )));
        }
        let what = |e: std::io::Error| {
            Error::Unavailable(format!(
                "port-forward to port {port} of pod sandbox {}: {e}",
                pod.id
            ))
        };
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        // Decided by the spec: a pod whose netns path went missing must never reach the host's
        // loopback.
        let netns = if pod.spec.network == NsMode::Node {
            None
        } else {
            Some(pod.namespaces.get("network").cloned().ok_or_else(|| {
                Error::Internal(format!(
                    "port-forward to pod sandbox {}: the pod has no network namespace path",
                    pod.id
                ))
            })?)
        };
        let Some(netns) = netns else {
            // The host's network: its loopback is the pod's.
            return tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
                .await
                .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
                .map_err(what);
        };
        // A socket stays in the namespace it was made in: made by a thread of its own that
        // joins the pod's namespace and ends with it (a pool thread would stay there). Each
        // such thread may block for CONNECT_TIMEOUT: their number is bounded, permits held
        // by the thread until it ends (even when this call was given up).
        static CONNECTS: std::sync::OnceLock<ConnectPermits> = std::sync::OnceLock::new();
        let permit = CONNECTS
            .get_or_init(ConnectPermits::new)
            .acquire(&pod.id)
            .await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("port-forward".into())
            .spawn(move || {
                let _permit = permit;
                let made = (|| {
                    let ns = std::fs::File::open(&netns).map_err(|e| {
                        std::io::Error::new(
                            e.kind(),
                            format!("open network namespace {netns}: {e}"),
                        )
                    })?;
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
                        std::io::Error::other(format!("join network namespace {netns}: {e}"))
                    })?;
                    let s = std::net::TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)?;
                    s.set_nonblocking(true)?;
                    Ok::<_, std::io::Error>(s)
                })();
                let _ = tx.send(made);
            })
            .map_err(|e| Error::Internal(format!("start a port-forward thread: {e}")))?;
        let s = rx
            .await
            .map_err(|_| Error::Internal("the port-forward thread died".into()))?
            .map_err(what)?;
        tokio::net::TcpStream::from_std(s).map_err(what)
    }
}

/// Port-forward connects in flight at once, each on a thread of its own: node-wide, and to
/// one pod. A pod whose ports never answer a connect (each then takes CONNECT_TIMEOUT) holds
/// up only its own share, not every pod's port-forwards.
const MAX_CONNECTING: usize = 256;
const MAX_CONNECTING_PER_POD: usize = 16;

/// The permits of port-forward connects: a pod's own, then one of the node's.
struct ConnectPermits {
    pods: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>,
    node: Arc<tokio::sync::Semaphore>,
}

impl ConnectPermits {
    fn new() -> Self {
        ConnectPermits {
            pods: Default::default(),
            node: Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTING)),
        }
    }

    async fn acquire(&self, pod: &str) -> Result<ConnectPermit> {
        let closed = |_| Error::Internal("the port-forward semaphore closed".into());
        let of_pod = {
            let mut pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
            // Pods with no connect in flight or waiting (only the map holds theirs) drop out.
            pods.retain(|_, s| Arc::strong_count(s) > 1);
            pods.entry(pod.to_string())
                .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTING_PER_POD)))
                .clone()
        };
        let pod = of_pod.acquire_owned().await.map_err(closed)?;
        let node = self.node.clone().acquire_owned().await.map_err(closed)?;
        Ok(ConnectPermit {
            _pod: pod,
            _node: node,
        })
    }
}

struct ConnectPermit {
    _pod: tokio::sync::OwnedSemaphorePermit,
    _node: tokio::sync::OwnedSemaphorePermit,
}

/// The session over a streaming call's connection. A task of its own moves the frames; it
/// ends (closing the connection: the monitor kills the exec'd process, or detaches) when the
/// monitor sent the exit, or when the session's `exit` is dropped unresolved (the client
/// went).
fn session(
    conn: tokio::net::UnixStream,
    what: &str,
    tty: bool,
    stdin: bool,
    stdout: bool,
    stderr: bool,
) -> Session {
    let (mut from_monitor, mut to_monitor) = conn.into_split();
    let pipe = |on: bool| on.then(|| tokio::io::duplex(PIPE));
    let (stdin_pipe, stdout_pipe, stderr_pipe) = (pipe(stdin), pipe(stdout), pipe(stderr && !tty));
    let (resize_tx, mut resize_rx) = match tty {
        true => {
            let (tx, rx) = tokio::sync::mpsc::channel::<TermSize>(8);
            (Some(tx), Some(rx))
        }
        false => (None, None),
    };
    let (exit_tx, exit_rx) = tokio::sync::oneshot::channel::<Result<i32>>();
    let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
    let (stdin_w, mut stdin_r) = match stdin_pipe {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let (stdout_r, mut stdout_w) = match stdout_pipe {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let (stderr_r, mut stderr_w) = match stderr_pipe {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let what = what.to_string();
    tokio::spawn(async move {
        // Monitor → client: outputs, then the exit.
        let inbound = async {
            let mut buf = Vec::with_capacity(wire::STREAM_CHUNK);
            loop {
                let s = match wire::read_stream(&mut from_monitor, &mut buf).await {
                    Ok(s) => s,
                    Err(e) => {
                        return Err(Error::Unavailable(format!(
                            "{what}: the pod monitor ended the stream without an exit: {e}"
                        )))
                    }
                };
                let out = match s {
                    stream::STDOUT => &mut stdout_w,
                    stream::STDERR => &mut stderr_w,
                    stream::EXIT => {
                        return wire::parse_exit(&buf).ok_or_else(|| {
                            Error::Internal(format!("{what}: bad exit frame from the pod monitor"))
                        })
                    }
                    _ => continue,
                };
                if buf.is_empty() {
                    // That output's end: the client reads EOF after what is buffered.
                    if let Some(mut w) = out.take() {
                        let _ = w.shutdown().await;
                    }
                } else if let Some(w) = out {
                    // A client that dropped this output loses the rest of it.
                    if w.write_all(&buf).await.is_err() {
                        *out = None;
                    }
                }
            }
        };
        // Client → monitor: input, its end, resizes. The write half stays open until the
        // task ends: the monitor takes its end for the client's going.
        let outbound = async {
            let mut buf = vec![0u8; wire::STREAM_CHUNK];
            loop {
                tokio::select! {
                    n = async { stdin_r.as_mut().expect("open").read(&mut buf).await }, if stdin_r.is_some() => {
                        let n = n.unwrap_or(0);
                        if n == 0 {
                            stdin_r = None;
                        }
                        if wire::write_stream(&mut to_monitor, stream::STDIN, &buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    size = async { resize_rx.as_mut().expect("open").recv().await }, if resize_rx.is_some() => match size {
                        Some(sz) => {
                            let body = wire::resize_body(sz.width, sz.height);
                            if wire::write_stream(&mut to_monitor, stream::RESIZE, &body).await.is_err() {
                                break;
                            }
                        }
                        None => resize_rx = None,
                    },
                    else => break,
                }
            }
            std::future::pending::<()>().await
        };
        tokio::select! {
            r = inbound => {
                let _ = exit_tx.send(r);
            }
            _ = outbound => {}
            _ = gone_rx => {}
        }
    });
    let exit = Box::pin(async move {
        // Dropped unresolved, the session's task ends and the call with it.
        let _gone = gone_tx;
        exit_rx
            .await
            .unwrap_or_else(|_| Err(Error::Internal("the stream's task ended".into())))
    });
    Session {
        stdin: stdin_w.map(|w| Box::new(w) as _),
        stdout: stdout_r.map(|r| Box::new(r) as _),
        stderr: stderr_r.map(|r| Box::new(r) as _),
        resize: resize_tx,
        exit,
    }
}

#[tonic::async_trait]
impl Backend for Runtime {
    async fn exec(&self, req: ExecRequest) -> Result<Session> {
        self.exec_stream(req).await
    }

    async fn attach(&self, req: AttachRequest) -> Result<Session> {
        Runtime::attach(self, req).await
    }

    async fn port_forward(&self, pod_sandbox_id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        Runtime::port_forward(self, pod_sandbox_id, port).await
    }
}

/// The daemon serves the streams of its pods (the server holds the daemon, which holds the
/// pods).
#[tonic::async_trait]
impl Backend for crate::daemon::Daemon {
    async fn exec(&self, req: ExecRequest) -> Result<Session> {
        self.runtime.exec_stream(req).await
    }

    async fn attach(&self, req: AttachRequest) -> Result<Session> {
        self.runtime.attach(req).await
    }

    async fn port_forward(&self, pod_sandbox_id: &str, port: u16) -> Result<tokio::net::TcpStream> {
        self.runtime.port_forward(pod_sandbox_id, port).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One pod's connects, all stuck, hold its own share and no other pod's.
    #[tokio::test]
    async fn a_pod_whose_connects_hang_holds_up_only_its_own() {
        let permits = ConnectPermits::new();
        let mut stuck = Vec::new();
        for _ in 0..MAX_CONNECTING_PER_POD {
            stuck.push(permits.acquire("a").await.unwrap());
        }
        let more_of_a = tokio::time::timeout(Duration::from_millis(50), permits.acquire("a"));
        assert!(more_of_a.await.is_err(), "a pod past its share waits");
        let b = tokio::time::timeout(Duration::from_millis(50), permits.acquire("b"));
        assert!(
            b.await.is_ok(),
            "another pod's connect does not wait behind it"
        );
        drop(stuck);
        assert!(permits.acquire("a").await.is_ok());
        // Pods with nothing in flight are forgotten.
        let _ = permits.acquire("c").await.unwrap();
        assert!(permits.pods.lock().unwrap().len() <= 1);
    }

    /// The frames a monitor sends become the session's outputs and exit, the client's input
    /// and resizes become frames; dropping the session closes the connection (the monitor's
    /// signal to kill or detach).
    #[tokio::test]
    async fn a_session_moves_frames_both_ways_and_its_drop_closes_the_call() {
        let (ours, mut monitor) = tokio::net::UnixStream::pair().unwrap();
        let mut s = session(ours, "exec in container c", false, true, true, true);
        assert!(s.resize.is_none());
        wire::write_stream(&mut monitor, stream::STDOUT, b"out")
            .await
            .unwrap();
        wire::write_stream(&mut monitor, stream::STDERR, b"err")
            .await
            .unwrap();
        wire::write_stream(&mut monitor, stream::STDOUT, b"")
            .await
            .unwrap();
        wire::write_stream(&mut monitor, stream::STDERR, b"")
            .await
            .unwrap();
        let mut stdin = s.stdin.take().unwrap();
        stdin.write_all(b"in").await.unwrap();
        stdin.shutdown().await.unwrap();
        let mut buf = Vec::new();
        assert_eq!(
            wire::read_stream(&mut monitor, &mut buf).await.unwrap(),
            stream::STDIN
        );
        assert_eq!(buf, b"in");
        assert_eq!(
            wire::read_stream(&mut monitor, &mut buf).await.unwrap(),
            stream::STDIN
        );
        assert!(buf.is_empty(), "stdin's end is an empty frame");
        let mut out = String::new();
        s.stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        let mut err = String::new();
        s.stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .await
            .unwrap();
        assert_eq!((out.as_str(), err.as_str()), ("out", "err"));
        wire::write_stream(&mut monitor, stream::EXIT, &9i32.to_be_bytes())
            .await
            .unwrap();
        assert_eq!(s.exit.await.unwrap(), 9);

        // A client gone before the exit: the call's connection closes.
        let (ours, mut monitor) = tokio::net::UnixStream::pair().unwrap();
        let s = session(ours, "attach to container c", true, false, true, false);
        assert!(s.stderr.is_none() && s.resize.is_some());
        s.resize
            .as_ref()
            .unwrap()
            .send(TermSize {
                width: 80,
                height: 24,
            })
            .await
            .unwrap();
        assert_eq!(
            wire::read_stream(&mut monitor, &mut buf).await.unwrap(),
            stream::RESIZE
        );
        assert_eq!(wire::parse_resize(&buf), Some((80, 24)));
        drop(s);
        let e = wire::read_stream(&mut monitor, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
