//! Starting pod monitors and talking to them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hako_proto::monitor as pb;
use hako_runtime::monitor::wire::{self, code, Method};
use hako_runtime::monitor::Options;

use crate::error::{Error, Result};

/// Starts `hako monitor` for a pod and waits for it to report ready (or the error that
/// stopped it). Returns its pid and the paths of the namespaces it pinned. The monitor makes
/// itself a session of its own.
pub async fn spawn(opts: &Options) -> Result<(u32, BTreeMap<String, String>, Started)> {
    // Executed through /proc/self/exe: the daemon's own image even when a package upgrade
    // has replaced the file (its path then no longer names it), so daemon and monitor always
    // speak the same protocol. argv[0] keeps the path for ps.
    let name = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "hako".into());
    let name = name.trim_end_matches(" (deleted)").to_string();
    let json = serde_json::to_string(opts).expect("options serialize");
    let log_path = opts.dir.join("monitor.log");
    let log = std::fs::File::create(&log_path).map_err(|e| Error::io("create", &log_path, e))?;
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| Error::Internal(format!("pipe: {e}")))?;
    // The readiness pipe goes in as stdout (see `take_ready_pipe`): with no pre-exec hook the
    // standard library spawns through posix_spawn (vfork), not a fork copying this process's
    // page tables.
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.arg0(name)
        .arg("monitor")
        .arg("--options")
        .arg(json)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::from(w))
        .stderr(log)
        .kill_on_drop(false);
    let child = cmd
        .spawn()
        .map_err(|e| Error::Internal(format!("start pod monitor: {e}")))?;
    // The parent's copy of the write end went with `cmd`.
    drop(cmd);
    let pid = child.id().unwrap_or(0);
    // Held through a pidfd opened while the child is unreaped (its pid names it alone): a
    // call dropped while the monitor starts (the daemon's shutdown) kills it (`Started`'s
    // guard), and the caller can until the pod is recorded.
    let mut started = Started::open(pid);
    // tokio reaps the monitor if it exits while this daemon lives; otherwise it outlives us.
    drop(child);
    let report = tokio::time::timeout(Duration::from_secs(30), async move {
        // One line: the pod's own processes may keep the pipe open after it.
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
        let mut s = String::new();
        tokio::io::AsyncBufReadExt::read_line(&mut tokio::io::BufReader::new(rx), &mut s).await?;
        Ok::<_, std::io::Error>(s)
    })
    .await;
    let text = match report {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(Error::Internal(format!("read pod monitor report: {e}"))),
        Err(_) => {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            return Err(Error::DeadlineExceeded(
                "pod monitor did not report ready within 30 s".into(),
            ));
        }
    };
    match text.trim().strip_prefix("ok ") {
        Some(ns) => {
            let ns = serde_json::from_str(ns)
                .map_err(|e| Error::Internal(format!("pod monitor report {ns:?}: {e}")))?;
            started.armed = false;
            Ok((pid, ns, started))
        }
        None => {
            let other = text.trim();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let msg = other.strip_prefix("error: ").unwrap_or(other);
            Err(Error::FailedPrecondition(format!(
                "pod monitor failed: {}{}",
                if msg.is_empty() {
                    "exited without a report"
                } else {
                    msg
                },
                if log.trim().is_empty() {
                    String::new()
                } else {
                    format!(" (log: {})", log.trim())
                }
            )))
        }
    }
}

/// A process held by a pidfd: signals reach it or nothing, never a process that reused its
/// pid.
pub struct Pidfd(std::os::fd::OwnedFd);

impl Pidfd {
    /// `None` when the process is gone (or the kernel has no pidfds).
    pub fn open(pid: u32) -> Option<Pidfd> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        // SAFETY: the syscall just returned this fd; nothing else owns it.
        (fd >= 0).then(|| {
            Pidfd(unsafe {
                <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
            })
        })
    }

    pub fn kill(&self) {
        // SAFETY: pidfd_send_signal on a pidfd this value owns.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                std::os::fd::AsRawFd::as_raw_fd(&self.0),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

/// A just-started monitor, by pidfd. While `armed` (until it reported ready) dropping it kills
/// the monitor; after, [`Started::kill`] does, for a start undone before its record.
pub struct Started {
    pidfd: Option<Pidfd>,
    armed: bool,
}

impl Started {
    fn open(pid: u32) -> Started {
        Started {
            pidfd: Pidfd::open(pid),
            armed: true,
        }
    }

    /// SIGKILLs the monitor (nothing if it is gone: the pidfd cannot name another process).
    pub fn kill(&self) {
        if let Some(p) = &self.pidfd {
            p.kill();
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        if self.armed {
            self.kill();
        }
    }
}

/// How long a quick call (info, state, signal, delete, reopen) may take before the monitor
/// counts as stuck.
const CALL_DEADLINE: Duration = Duration::from_secs(10);
/// How long a create or start may take: libcontainer's work, slow on a loaded node.
const SLOW_CALL_DEADLINE: Duration = Duration::from_secs(60);
/// How long a read for a list, a status or stats may take. A monitor answers those from
/// memory, each call on a task of its own (a create under way does not delay them), within
/// milliseconds even on a loaded node; one silent that long is reported (pod NotReady) rather
/// than holding the caller. Under crictl's default 2 s timeout, so `crictl ps` still answers
/// with a monitor stuck.
pub(super) const READ_DEADLINE: Duration = Duration::from_millis(1500);
/// How long a monitor holds an `Events` call without a change before it answers anyway: its
/// heartbeat. A monitor that misses that by more than [`READ_DEADLINE`] counts as stuck, so a
/// stuck monitor shows within 6.5 s, at one call per idle pod every 5 s.
pub(super) const EVENTS_HOLD: Duration = Duration::from_secs(5);
/// How long adoption at start waits for one monitor: they answer Info from memory.
pub(super) const ADOPT_DEADLINE: Duration = Duration::from_secs(2);

/// Calls a pod's monitor: one unix-socket connection per call (see `wire`).
#[derive(Clone)]
pub struct MonitorClient {
    socket: PathBuf,
}

/// Connects to a monitor socket and names the process that listens there.
fn peer_of(path: &Path) -> std::result::Result<u32, nix::errno::Errno> {
    use nix::sys::socket::{connect, socket, sockopt, AddressFamily, SockFlag, SockType, UnixAddr};
    let (_dir, short) = hako_runtime::monitor::short_socket_path(path)
        .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::ENOENT)))?;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    // Non-blocking: a stuck monitor whose backlog is full answers EAGAIN instead of holding
    // the caller.
    connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &UnixAddr::new(&short)?,
    )?;
    let cred = nix::sys::socket::getsockopt(&fd, sockopt::PeerCredentials)?;
    u32::try_from(cred.pid())
        .ok()
        .filter(|p| *p > 0)
        .ok_or(nix::errno::Errno::ESRCH)
}

fn status_err(what: &str, status: u8, message: &[u8]) -> Error {
    let msg = format!("{what}: {}", String::from_utf8_lossy(message));
    match status {
        code::NOT_FOUND => Error::NotFound(msg),
        code::INVALID_ARGUMENT => Error::InvalidArgument(msg),
        code::ALREADY_EXISTS => Error::AlreadyExists(msg),
        code::FAILED_PRECONDITION => Error::FailedPrecondition(msg),
        code::UNIMPLEMENTED => Error::Unimplemented(msg),
        code::UNAVAILABLE => Error::Unavailable(msg),
        _ => Error::Internal(msg),
    }
}

impl MonitorClient {
    pub fn new(socket: PathBuf) -> MonitorClient {
        MonitorClient { socket }
    }

    async fn call<Q: prost::Message, R: prost::Message + Default>(
        &self,
        method: Method,
        req: &Q,
        what: &str,
    ) -> Result<R> {
        self.call_within(method, req, what, Some(CALL_DEADLINE))
            .await
    }

    /// A call that fails with DEADLINE_EXCEEDED when the monitor has not answered within
    /// `deadline` (`None`: as long as it takes, for an exec without a timeout). A stuck
    /// monitor then costs its caller a bounded wait, not a hang.
    async fn call_within<Q: prost::Message, R: prost::Message + Default>(
        &self,
        method: Method,
        req: &Q,
        what: &str,
        deadline: Option<Duration>,
    ) -> Result<R> {
        let call = self.call_unbounded(method, req, what);
        match deadline {
            None => call.await,
            Some(d) => tokio::time::timeout(d, call).await.unwrap_or_else(|_| {
                Err(Error::DeadlineExceeded(format!(
                    "{what}: pod monitor at {} did not answer {method:?} within {} s",
                    self.socket.display(),
                    d.as_secs_f64()
                )))
            }),
        }
    }

    async fn call_unbounded<Q: prost::Message, R: prost::Message + Default>(
        &self,
        method: Method,
        req: &Q,
        what: &str,
    ) -> Result<R> {
        let unavailable = |e: std::io::Error| {
            Error::Unavailable(format!("pod monitor at {}: {e}", self.socket.display()))
        };
        // Deep state dirs make the full path too long for sun_path.
        let (_dir, short) =
            hako_runtime::monitor::short_socket_path(&self.socket).map_err(unavailable)?;
        let mut conn = tokio::net::UnixStream::connect(short)
            .await
            .map_err(unavailable)?;
        wire::write_frame(&mut conn, method as u8, &req.encode_to_vec())
            .await
            .map_err(unavailable)?;
        let (status, body) = wire::read_frame(&mut conn).await.map_err(unavailable)?;
        if status != code::OK {
            return Err(status_err(what, status, &body));
        }
        R::decode(body.as_slice())
            .map_err(|e| Error::Internal(format!("{what}: bad answer from the pod monitor: {e}")))
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The pod's states once they differ from generation `since`, or at `answer_by` (unix
    /// ms) regardless. No deadline here: the watcher (live.rs) keeps its own.
    pub async fn events(&self, since: u64, answer_by: i64) -> Result<pb::InfoResponse> {
        let req = pb::EventsRequest { since, answer_by };
        self.call_unbounded(Method::Events, &req, "pod monitor events")
            .await
    }

    /// `info` with its records, within `deadline` (adoption at start).
    pub async fn info_within(&self, deadline: Duration) -> Result<pb::InfoResponse> {
        let req = pb::InfoRequest {
            skip_records: false,
        };
        self.call_within(Method::Info, &req, "pod monitor info", Some(deadline))
            .await
    }

    /// `info` without the kept records (which may be tens of MiB), within the call deadline:
    /// the containers' states, for changes of the pod.
    pub async fn states(&self) -> Result<pb::InfoResponse> {
        let req = pb::InfoRequest { skip_records: true };
        self.call(Method::Info, &req, "pod monitor info").await
    }

    /// `info` within the read deadline, for lists, statuses and stats.
    /// The kept records are left out: a read needs states only.
    pub async fn read_info(&self) -> Result<pb::InfoResponse> {
        let req = pb::InfoRequest { skip_records: true };
        self.call_within(Method::Info, &req, "pod monitor info", Some(READ_DEADLINE))
            .await
    }

    pub async fn create(
        &self,
        req: &pb::CreateContainerRequest,
    ) -> Result<pb::CreateContainerResponse> {
        let r: pb::CreateContainerResponse = self
            .call_within(
                Method::CreateContainer,
                req,
                "monitor",
                Some(SLOW_CALL_DEADLINE),
            )
            .await?;
        Ok(r)
    }

    pub async fn start(&self, id: &str) -> Result<pb::ContainerState> {
        self.call_within(
            Method::StartContainer,
            &pb::ContainerRef { id: id.into() },
            "monitor",
            Some(SLOW_CALL_DEADLINE),
        )
        .await
    }

    pub async fn state(&self, id: &str) -> Result<pb::ContainerState> {
        self.call(
            Method::State,
            &pb::ContainerRef { id: id.into() },
            "monitor",
        )
        .await
    }

    pub async fn signal(&self, id: &str, signal: i32, all: bool) -> Result<()> {
        let req = pb::SignalRequest {
            id: id.into(),
            signal,
            all,
        };
        let _: pb::Empty = self.call(Method::Signal, &req, "monitor").await?;
        Ok(())
    }

    pub async fn wait(&self, id: &str, timeout_ms: i64) -> Result<pb::ContainerState> {
        let req = pb::WaitRequest {
            id: id.into(),
            timeout_ms,
        };
        let deadline =
            (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms as u64) + CALL_DEADLINE);
        self.call_within(Method::Wait, &req, "monitor", deadline)
            .await
    }

    pub async fn delete(&self, id: &str, force: bool) -> Result<()> {
        let req = pb::DeleteRequest {
            id: id.into(),
            force,
        };
        let _: pb::Empty = self.call(Method::Delete, &req, "monitor").await?;
        Ok(())
    }

    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout_ms: i64,
    ) -> Result<pb::ExecSyncResponse> {
        let req = pb::ExecSyncRequest {
            id: id.into(),
            cmd,
            timeout_ms,
        };
        // The monitor enforces the exec's own timeout; this bounds a monitor that is stuck.
        let deadline =
            (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms as u64) + CALL_DEADLINE);
        self.call_within(Method::ExecSync, &req, "monitor", deadline)
            .await
    }

    /// Starts a streaming call (`Exec`, `Attach`): its connection, once the monitor answered
    /// OK, carries the stream frames of `wire`. Bounded by the slow-call deadline (an exec is
    /// a libcontainer run) up to the answer; the stream itself has no deadline.
    pub async fn open_stream<Q: prost::Message>(
        &self,
        method: Method,
        req: &Q,
        what: &str,
    ) -> Result<tokio::net::UnixStream> {
        let unavailable = |e: std::io::Error| {
            Error::Unavailable(format!("pod monitor at {}: {e}", self.socket.display()))
        };
        let open = async {
            let (_dir, short) =
                hako_runtime::monitor::short_socket_path(&self.socket).map_err(unavailable)?;
            let mut conn = tokio::net::UnixStream::connect(short)
                .await
                .map_err(unavailable)?;
            wire::write_frame(&mut conn, method as u8, &req.encode_to_vec())
                .await
                .map_err(unavailable)?;
            let (status, body) = wire::read_frame(&mut conn).await.map_err(unavailable)?;
            if status != code::OK {
                return Err(status_err(what, status, &body));
            }
            Ok(conn)
        };
        tokio::time::timeout(SLOW_CALL_DEADLINE, open)
            .await
            .unwrap_or_else(|_| {
                Err(Error::DeadlineExceeded(format!(
                    "{what}: pod monitor at {} did not answer {method:?} within {} s",
                    self.socket.display(),
                    SLOW_CALL_DEADLINE.as_secs()
                )))
            })
    }

    pub async fn reopen_log(&self, id: &str) -> Result<()> {
        let _: pb::Empty = self
            .call(
                Method::ReopenLog,
                &pb::ContainerRef { id: id.into() },
                "monitor",
            )
            .await?;
        Ok(())
    }

    /// Has the monitor keep the daemon's record of its pod (`container` empty) or of one of
    /// its containers, so that the record can be rebuilt from the monitor if the store loses
    /// it (see `Runtime::reconcile`).
    pub async fn keep_record(&self, container: &str, record: Vec<u8>) -> Result<()> {
        let req = pb::KeepRecordRequest {
            container_id: container.into(),
            record,
        };
        let _: pb::Empty = self
            .call(
                Method::KeepRecord,
                &req,
                "keep the record in the pod monitor",
            )
            .await?;
        Ok(())
    }

    /// The process listening on this monitor socket, by the kernel's word (SO_PEERCRED of a
    /// connection to it): the pod's monitor, whether or not it answers calls. `None` when
    /// nothing listens there. It names the process without reading any command line, and a
    /// reused pid cannot pass for it: only the process that bound the socket is its peer.
    pub fn listener_pid(&self) -> Option<u32> {
        peer_of(&self.socket).ok()
    }

    /// Whether a process listens on this monitor socket (answering or not: one too stuck to
    /// accept still counts). A monitor that exited, or never bound it, does not. Only an
    /// answer about the socket says it is gone: the daemon out of descriptors or memory
    /// cannot tell, and a live monitor taken for gone would have its containers killed.
    pub fn listening(&self) -> bool {
        use nix::errno::Errno;
        match peer_of(&self.socket) {
            Ok(_) => true,
            Err(Errno::ECONNREFUSED | Errno::ENOENT | Errno::ENOTDIR | Errno::ESRCH) => false,
            Err(e) => {
                tracing::warn!(socket = %self.socket.display(), error = %e, "cannot tell whether the pod monitor listens: taken as listening");
                true
            }
        }
    }

    /// Asks the monitor to tear the pod down and waits until its socket is gone; false when
    /// it was not gone within 5 s (the caller then ends the pod's processes itself).
    pub async fn shutdown(&self) -> bool {
        let _ = self
            .call::<_, pb::Empty>(Method::Shutdown, &pb::Empty {}, "monitor")
            .await;
        // The monitor removes its socket last, once the pod's processes are gone and its
        // namespaces released: usually within a few ms, so poll finely at first.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut pause = Duration::from_millis(1);
        while std::time::Instant::now() < deadline {
            if !self.socket.exists() {
                return true;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        tracing::warn!(socket = %self.socket.display(), "pod monitor did not shut down within 5 s");
        false
    }
}
