//! The monitor's gRPC service and its serving loop.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hako_proto::monitor as pb;
use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::Container;
use libcontainer::syscall::syscall::SyscallType;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;
use tokio::io::AsyncReadExt;

use prost::Message as _;

use super::wire::{self, Method, Status, EXEC_OUTPUT_CAP};
use super::{infra, joined_pid, late_mounts, now_nanos, reap, streams, Ctr, Phase, Shared};
use crate::logs::{LogWriter, Stream};

#[derive(Clone)]
struct Svc {
    state: Shared,
}

pub(super) fn err(what: impl std::fmt::Display, e: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {e}"))
}

pub(super) fn lc_err(
    what: impl std::fmt::Display,
    e: libcontainer::error::LibcontainerError,
) -> Status {
    // libcontainer's chain says what failed (missing executable, bad mount…): keep all of it.
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    Status::failed_precondition(format!("{what}: {msg}"))
}

/// A create or start that failed in a CDI hook run through `hako cdi-hook`: the hook's own
/// report (hook, device, spec, status, start of stderr) leads the error.
fn with_hook_report(bundle: &std::path::Path, e: Status) -> Status {
    match crate::cdi::HookReport::take(bundle) {
        Some(r) => Status::new(e.code(), format!("{}: {}", r.describe(), e.message())),
        None => e,
    }
}

/// A kept record costs the monitor memory for the pod's life: one over `wire::MAX_RECORD` is
/// refused, naming what it was for.
fn check_record_size(pod_id: &str, req: &pb::KeepRecordRequest) -> Result<(), Status> {
    if req.record.len() <= wire::MAX_RECORD {
        return Ok(());
    }
    let what = if req.container_id.is_empty() {
        format!("pod {pod_id}")
    } else {
        format!("container {} of pod {pod_id}", req.container_id)
    };
    Err(Status::invalid_argument(format!(
        "record of {what} is {} bytes, over the {} bytes a pod monitor keeps",
        req.record.len(),
        wire::MAX_RECORD
    )))
}

/// A kept record must also fit beside the pod's others (`kept_others` bytes) within
/// `wire::MAX_KEPT`, or the `Info` that returns them all would be refused by the daemon.
fn check_kept_total(
    pod_id: &str,
    kept_others: usize,
    req: &pb::KeepRecordRequest,
) -> Result<(), Status> {
    if kept_others + req.record.len() <= wire::MAX_KEPT {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "records of pod {pod_id} would take {} bytes, over the {} bytes a pod monitor keeps for a pod",
        kept_others + req.record.len(),
        wire::MAX_KEPT
    )))
}

fn proto_state(id: &str, c: &Ctr) -> pb::ContainerState {
    let exit = c.exit.unwrap_or_default();
    pb::ContainerState {
        id: id.to_string(),
        status: match c.phase {
            Phase::Created => pb::Status::Created,
            Phase::Running => pb::Status::Running,
            Phase::Exited => pb::Status::Exited,
        } as i32,
        pid: c.pid.as_raw() as u32,
        started_at: c.started_at,
        finished_at: exit.finished_at,
        exit_code: exit.code,
        signal: exit.signal,
        oom_killed: exit.oom_killed,
    }
}

/// What Info answers: the pod's states, and the kept records when `records`.
fn info_of(st: &super::State, records: bool) -> pb::InfoResponse {
    pb::InfoResponse {
        pid: std::process::id(),
        pod_id: st.opts.pod_id.clone(),
        namespaces: st.ns_paths.clone(),
        containers: st
            .containers
            .iter()
            .map(|(id, c)| proto_state(id, c))
            .collect(),
        pod_record: if records {
            st.pod_record.clone()
        } else {
            Vec::new()
        },
        container_records: st
            .containers
            .iter()
            .filter(|(_, c)| records && !c.record.is_empty())
            .map(|(id, c)| (id.clone(), c.record.clone()))
            .collect(),
        pid_ns_gone: st.pid_ns_dead,
        generation: *st.changes.borrow(),
        creating: st.creating.iter().cloned().collect(),
    }
}

fn now_millis() -> i64 {
    now_nanos() / 1_000_000
}

pub(super) fn pipe() -> Result<(OwnedFd, OwnedFd), Status> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| err("pipe", e))
}

/// Reads a pipe or a pty master without blocking the monitor. A pty master reports EIO once
/// the last slave closes: that is its end of file.
struct FdReader(tokio::io::unix::AsyncFd<OwnedFd>);

impl FdReader {
    fn new(fd: OwnedFd) -> Result<Self, Status> {
        async_fd(fd, tokio::io::Interest::READABLE).map(FdReader)
    }

    /// Waits until the fd is readable, reads once into a buffer shared by every reader of this
    /// (single-threaded) monitor and hands the bytes to `f` before any other task runs. One
    /// 32 KiB buffer per monitor rather than one per container stream: idle pods stay small.
    async fn read_with(&mut self, mut f: impl FnMut(&[u8])) -> std::io::Result<usize> {
        thread_local! {
            static BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; 32 * 1024]);
        }
        loop {
            let mut guard = self.0.readable().await?;
            let r = BUF.with_borrow_mut(|buf| {
                guard.try_io(|fd| {
                    use std::os::fd::AsRawFd;
                    let n = nix::unistd::read(fd.get_ref().as_raw_fd(), buf)
                        .map_err(std::io::Error::from)?;
                    f(&buf[..n]);
                    Ok(n)
                })
            });
            match r {
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(r) => return r,
                Err(_would_block) => continue,
            }
        }
    }
}

/// Copies a pipe (or a TTY's master) into the container's log until the writer side closes.
/// Attach clients get the same bytes, never holding the pump up (see `streams::fan_out`).
fn pump(
    fd: OwnedFd,
    log: Arc<Mutex<LogWriter>>,
    stream: Stream,
    fanout: streams::Fanout,
) -> Result<(), Status> {
    let mut rx = FdReader::new(fd)?;
    let id = match stream {
        Stream::Stdout => wire::stream::STDOUT,
        Stream::Stderr => wire::stream::STDERR,
    };
    tokio::spawn(async move {
        // Logged once per run of failed writes (a full disk fails every one of them, and the
        // monitor's own log is in memory).
        let mut failing = false;
        loop {
            let wrote = rx
                .read_with(|bytes| {
                    if bytes.is_empty() {
                        return;
                    }
                    match log.lock().expect("log poisoned").write(stream, bytes) {
                        Err(e) if !failing => {
                            failing = true;
                            tracing::warn!(error = %e, "write container log (further failures not logged until a write succeeds)");
                        }
                        Ok(_) if failing => {
                            failing = false;
                            tracing::info!("container log written again");
                        }
                        _ => {}
                    }
                    streams::fan_out(&fanout, id, bytes);
                })
                .await;
            if matches!(wrote, Ok(0) | Err(_)) {
                break;
            }
        }
        let _ = log.lock().expect("log poisoned").close_stream(stream);
        streams::fan_out(&fanout, id, b"");
    });
    Ok(())
}

/// Reads a pipe into memory, up to the cap, until its write ends are all closed or `stop`
/// turns true: a process the exec left behind may hold the pipe open for ever, and the read,
/// its buffer and the pipe must not outlive the call.
fn collect(
    fd: OwnedFd,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Vec<u8>>, Status> {
    let mut rx =
        tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(|e| err("exec pipe", e))?;
    Ok(tokio::spawn(async move {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            tokio::select! {
                r = rx.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let room = EXEC_OUTPUT_CAP.saturating_sub(out.len());
                        out.extend_from_slice(&buf[..n.min(room)]);
                    }
                },
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        out
    }))
}

/// The socket a TTY container's init sends its pty master on.
pub(super) struct ConsoleSocket {
    listener: std::os::unix::net::UnixListener,
    /// Kept open: `path` names the socket through it (see `short_socket_path`).
    dir: std::fs::File,
    pub(super) path: PathBuf,
    real: PathBuf,
}

impl ConsoleSocket {
    pub(super) fn bind(dir: &std::path::Path) -> Result<Self, Status> {
        std::fs::create_dir_all(dir).map_err(|e| err(format!("create {}", dir.display()), e))?;
        let real = dir.join("console.sock");
        let _ = std::fs::remove_file(&real);
        let (dir_fd, path) = super::short_socket_path(&real)
            .map_err(|e| err(format!("open {}", dir.display()), e))?;
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .map_err(|e| err(format!("bind console socket {}", real.display()), e))?;
        Ok(ConsoleSocket {
            listener,
            dir: dir_fd,
            path,
            real,
        })
    }

    /// The directory `path` names the socket through, for [`Inherit::dir`].
    pub(super) fn dir_fd(&self) -> std::os::fd::RawFd {
        self.dir.as_raw_fd()
    }

    /// The pty master, once the container's init has sent it (it did before create returned).
    pub(super) fn receive(self) -> Result<OwnedFd, Status> {
        use std::os::fd::{AsRawFd, FromRawFd};
        self.listener
            .set_nonblocking(true)
            .map_err(|e| err("console socket", e))?;
        let result = (|| {
            let (conn, _) = self
                .listener
                .accept()
                .map_err(|e| err("the container sent no terminal", e))?;
            let mut name = [0u8; 64];
            let mut iov = [std::io::IoSliceMut::new(&mut name)];
            let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
            let msg = nix::sys::socket::recvmsg::<()>(
                conn.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .map_err(|e| err("receive the container's terminal", e))?;
            for c in msg.cmsgs().map_err(|e| err("terminal message", e))? {
                if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                    if let Some(fd) = fds.first() {
                        // SAFETY: SCM_RIGHTS just gave this process the fd; nothing else owns it.
                        return Ok(unsafe { OwnedFd::from_raw_fd(*fd) });
                    }
                }
            }
            Err(Status::internal(
                "the container's terminal message carried no fd",
            ))
        })();
        let _ = std::fs::remove_file(&self.real);
        result
    }
}

/// What a helper's work uses of the monitor's descriptors, besides the pod's namespaces
/// (`infra::held_fds`) and the monitor's log. The helper closes every other before it works: the container's init it makes is its child and holds what it inherits
/// until it execs, at the start, possibly much later. Inherited, another container's stdin
/// write end would keep that stdin from its EOF (`stdin_once`), an attach stream's socket
/// would keep its client from seeing the end, and the monitor's listener would keep the daemon
/// taking a dead monitor for alive.
pub(super) struct Inherit {
    /// The new process's stdin, stdout and stderr (none for a start).
    pub(super) stdio: Option<[OwnedFd; 3]>,
    /// Descriptors a path given to the work names through `/proc/<pid>/fd/<n>` (a console
    /// socket's directory, see `short_socket_path`; a PID target's namespace).
    pub(super) named: Vec<std::os::fd::RawFd>,
}

/// Runs a libcontainer create, start or exec in a forked helper and returns the new process's
/// pid (0 for a start), held by the helper until the returned [`Made`] is dropped.
///
/// libcontainer writes the spec's `oom_score_adj` to its *caller* and marks the caller
/// non-dumpable; done in the monitor itself, one container's score would stick to the monitor
/// and every later container (it cannot be lowered again without CAP_SYS_RESOURCE). The helper
/// takes those changes and exits; the new process, its child, is reparented to the monitor,
/// which is the pod's child subreaper. The monitor is single-threaded, so forking is safe. And
/// what libcontainer allocates and runs stays out of the long-lived monitor.
///
/// The monitor serves other calls while the helper works (a CDI hook may take a minute: status
/// calls, probes and the pod's other containers must not wait for it; an exec's caller holds
/// its container's init from the reaper meanwhile, see `ExecHold`). What the helper made stays
/// its child, out of the monitor's reaper's reach, until the caller has registered it and
/// drops [`Made`]: a process that exits at once is not reaped
/// before anyone waits for it.
pub(super) async fn in_helper(
    state: &Shared,
    inherit: Inherit,
    f: impl FnOnce(Option<[OwnedFd; 3]>) -> Result<nix::unistd::Pid, Status>,
) -> Result<Made, Status> {
    use std::io::Write;
    let (r, w) = pipe()?;
    let (release_r, release_w) = pipe()?;
    let monitor = nix::unistd::getpid();
    // SAFETY: the monitor runs a current-thread runtime and no other thread.
    match unsafe { nix::unistd::fork() }.map_err(|e| err("fork helper", e))? {
        nix::unistd::ForkResult::Child => {
            drop(r);
            drop(release_w);
            // Not dumpable from the start, nor anything it forks: what it forks into a pod's
            // PID namespace (`joined_pid`) is the host's root there, in the pod's user
            // namespace when it has one, where a container given CAP_SYS_PTRACE could
            // otherwise attach to it (libcontainer sets this only when it builds).
            // SAFETY: prctl on this process only.
            unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) };
            drop_signal_handlers();
            let mut keep = vec![
                0,
                1,
                2,
                w.as_raw_fd(),
                release_r.as_raw_fd(),
                super::log::fd(),
            ];
            keep.extend(&inherit.named);
            keep.extend(infra::held_fds());
            keep.extend(inherit.stdio.iter().flatten().map(|fd| fd.as_raw_fd()));
            // SAFETY: what this process uses from here is `keep`; the rest (the monitor's
            // runtime, sockets, other containers' pipes) it never touches again before `_exit`.
            unsafe { super::close_fds_except(&keep) };
            // A helper never outlives its monitor: what it would create then has no pod to
            // answer for it.
            let orphaned = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).is_err()
                || nix::unistd::getppid() != monitor;
            // A panic must end this process like any other outcome: unwound further, it would
            // reach the monitor's runtime (tokio catches task panics) and leave a second monitor
            // running on the parent's descriptors.
            let run = || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(inherit.stdio)))
                    .unwrap_or_else(|_| Err(Status::internal("the monitor's helper panicked")))
            };
            let helper = nix::unistd::getpid();
            let result = if orphaned {
                Err(Status::failed_precondition("the pod's monitor is gone"))
            } else {
                run()
            };
            // A start makes no process: nothing to hold until the monitor has registered it.
            let holds = matches!(&result, Ok(pid) if pid.as_raw() > 0);
            let msg = match result {
                Ok(pid) => format!("P{}\n", pid.as_raw()),
                Err(s) => format!("E{}:{}\n", s.code(), s.message().replace('\n', " ")),
            };
            // Only the helper answers (and waits): a process it forked (the joined_pid mounter)
            // that got here by a panic must not.
            if nix::unistd::getpid() == helper {
                let mut w = std::fs::File::from(w);
                if w.write_all(msg.as_bytes()).is_ok() && holds {
                    drop(w);
                    // Until the monitor has taken over what was made: one byte, or the end of
                    // the pipe if the monitor is gone.
                    let mut b = [0u8; 1];
                    while let Err(nix::errno::Errno::EINTR) =
                        nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&release_r), &mut b)
                    {
                    }
                }
            }
            // SAFETY: leave without running the parent's destructors or atexit handlers.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(w);
            drop(release_r);
            // What the child's work holds (its ends of pipes) goes now, not after the wait.
            drop(inherit);
            drop(f);
            let release = Release(release_w);
            // Teardown kills helpers still at work.
            let _helper = Helper::new(state, child);
            // One line, not to EOF: a helper forked meanwhile, or the new process until it
            // execs, may hold a copy of the pipe; a helper that dies without one is seen
            // through its pidfd. (It is reaped by the SIGCHLD reaper, which drops exits
            // nobody waits for.)
            // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
            let pidfd = match unsafe { libc::syscall(libc::SYS_pidfd_open, child.as_raw(), 0) } {
                // SAFETY: a new fd, ours alone.
                fd if fd >= 0 => Some(unsafe { OwnedFd::from_raw_fd(fd as i32) }),
                _ => None,
            };
            let mut msg = Vec::new();
            let mut reader = FdReader::new(r)?;
            let exited = async {
                match pidfd.map(|fd| async_fd(fd, tokio::io::Interest::READABLE)) {
                    Some(Ok(fd)) => {
                        let _ = fd.readable().await;
                    }
                    _ => std::future::pending().await,
                }
            };
            tokio::pin!(exited);
            let mut gone = false;
            while !msg.contains(&b'\n') {
                let read = reader.read_with(|b| msg.extend_from_slice(b));
                let n = if gone {
                    // Gone: what it wrote before is in the pipe already.
                    match tokio::time::timeout(Duration::from_millis(1), read).await {
                        Ok(n) => n,
                        Err(_) => break,
                    }
                } else {
                    tokio::select! {
                        n = read => n,
                        _ = &mut exited => {
                            gone = true;
                            continue;
                        }
                    }
                };
                if n.map_err(|e| err("read helper result", e))? == 0 {
                    break;
                }
            }
            let msg = String::from_utf8_lossy(&msg);
            let msg = msg.lines().next().unwrap_or_default();
            if let Some(p) = msg.strip_prefix('P') {
                let pid = p
                    .parse()
                    .map_err(|_| Status::internal(format!("helper result {msg:?}")))?;
                return Ok(Made {
                    pid: nix::unistd::Pid::from_raw(pid),
                    _release: release,
                });
            }
            let (code, text) = msg
                .strip_prefix('E')
                .and_then(|m| m.split_once(':'))
                .unwrap_or(("13", "helper died"));
            Err(Status::new(
                code.parse::<u8>().unwrap_or(wire::code::INTERNAL),
                text.to_string(),
            ))
        }
    }
}

/// A helper at work, listed for teardown (which kills those left).
struct Helper {
    state: Shared,
    pid: nix::unistd::Pid,
}

impl Helper {
    fn new(state: &Shared, pid: nix::unistd::Pid) -> Helper {
        state.lock().expect("state").helpers.insert(pid.as_raw());
        Helper {
            state: state.clone(),
            pid,
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.state
            .lock()
            .expect("state")
            .helpers
            .remove(&self.pid.as_raw());
    }
}

fn set_nonblocking(fd: &OwnedFd) -> Result<(), Status> {
    nix::fcntl::fcntl(
        fd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map(drop)
    .map_err(|e| err("set O_NONBLOCK", e))
}

/// Registers a non-blocking fd with the runtime for `interest`.
pub(super) fn async_fd(
    fd: OwnedFd,
    interest: tokio::io::Interest,
) -> Result<tokio::io::unix::AsyncFd<OwnedFd>, Status> {
    set_nonblocking(&fd)?;
    // SAFETY: an OwnedFd is valid and stays the same fd until the AsyncFd drops it.
    unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }
        .map_err(|e| err("register fd", e.into_parts().1))
}

/// An id whose create runs: a second create of it is refused meanwhile (the monitor serves
/// other calls while a helper works).
struct Creating {
    state: Shared,
    id: String,
}

impl Creating {
    fn new(state: &Shared, id: &str) -> Result<Creating, Status> {
        let mut st = state.lock().expect("state");
        if st.shutting_down {
            return Err(Status::failed_precondition(format!(
                "container {id}: the pod monitor is shutting down"
            )));
        }
        if st.containers.contains_key(id) || !st.creating.insert(id.to_string()) {
            return Err(Status::already_exists(format!(
                "container {id} exists in the pod monitor"
            )));
        }
        Ok(Creating {
            state: state.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for Creating {
    fn drop(&mut self) {
        self.state.lock().expect("state").creating.remove(&self.id);
    }
}

/// A created container not listed yet: dropped armed (a failure on the way), its init is
/// killed and its libcontainer state deleted.
struct Unlisted {
    pid: nix::unistd::Pid,
    state_dir: PathBuf,
    armed: bool,
}

impl Drop for Unlisted {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let _ = nix::sys::signal::kill(self.pid, Signal::SIGKILL);
        if let Ok(mut c) = Container::load(self.state_dir.clone()) {
            if let Err(e) = c.delete(true) {
                tracing::warn!(state = %self.state_dir.display(), error = %e, "delete of a container whose create failed after libcontainer's");
            }
        }
    }
}

/// What a helper made; the helper (its parent) exits when this is dropped.
pub(super) struct Made {
    pub pid: nix::unistd::Pid,
    _release: Release,
}

/// Lets a helper exit: one byte, not the end of the pipe, which a helper forked meanwhile may
/// hold open.
struct Release(OwnedFd);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = nix::unistd::write(&self.0, b"x");
    }
}

/// In a forked helper, before it closes the monitor's descriptors: every signal the monitor
/// handles (tokio's SIGCHLD and SIGTERM) back to SIG_DFL. The handlers write a byte to a
/// pipe of the monitor's runtime; closed in the helper, its number is free for libcontainer's
/// own sockets, and the SIGCHLD of its intermediate process would write into one (seen: the
/// exec's init channel broke with ECONNRESET). Ignored signals stay ignored.
fn drop_signal_handlers() {
    for sig in 1..=libc::SIGRTMAX() {
        // SAFETY: a zeroed sigaction is a valid out-parameter; the query installs nothing.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // glibc refuses its internal signals (EINVAL): nothing of the monitor's is there.
        // SAFETY: queries the disposition into `old`.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } == 0
            && old.sa_sigaction != libc::SIG_DFL
            && old.sa_sigaction != libc::SIG_IGN
        {
            // SAFETY: installs the default disposition, no handler.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
        }
    }
}

/// Every catchable signal at SIG_DFL, as a fresh process under runc starts: an ignored one
/// survives libcontainer's forks and the exec. (None is blocked there; the e2e checks that
/// too.) The system call itself: glibc's `sigaction` refuses its internal signals. A zeroed
/// kernel `sigaction` is SIG_DFL with no flags, mask or restorer, whatever the architecture's
/// field order. Failures are left alone: a seccomp profile may refuse the calls, and the
/// process then starts as it would have.
fn default_signals() {
    let dfl = [0u64; 8];
    // The kernel's sigset size: 8 bytes for 64 signals (16 where there are 128).
    let sigset_size = (libc::SIGRTMAX() as usize).div_ceil(64) * 8;
    for sig in 1..=libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: installs no handler; the kernel reads at most `sigset_size` bytes of mask,
        // within `dfl`.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                dfl.as_ptr(),
                std::ptr::null_mut::<u64>(),
                sigset_size,
            )
        };
    }
}

/// The last steps of a container's init or an exec'd process before `execvp`.
///
/// Every signal back at its default disposition (`default_signals`): an ignored signal stays
/// ignored through libcontainer's forks and the exec, and runc's containers start with none
/// ignored, as programs expect. The monitor ignores SIGPIPE (Rust does), and 32 and 33, glibc's
/// internal signals, which its posix_spawn (how the daemon starts monitors) leaves ignored in
/// the child. Restored only here, at the end: libcontainer's own processes report failures over
/// sockets whose reader may be gone, and must get EPIPE there, not die (a failed
/// startContainer hook is known by its init's exit status 255).
///
/// And an exec's seccomp filter: libcontainer builds an exec's spec without the container's
/// `linux.seccomp`, so an exec would escape the filter its container runs under. It is
/// installed last, when the process holds only the container's capabilities; without
/// CAP_SYS_ADMIN the kernel accepts a filter only under no_new_privs, which is then set.
#[derive(Clone)]
pub(super) struct Workload {
    /// For an exec: its container's filter (a container's init gets its own from the spec).
    pub(super) seccomp: Option<oci_spec::runtime::LinuxSeccomp>,
}

impl libcontainer::workload::Executor for Workload {
    fn exec(
        &self,
        spec: &oci_spec::runtime::Spec,
    ) -> Result<(), libcontainer::workload::ExecutorError> {
        default_signals();
        if let Some(filter) = &self.seccomp {
            // CAP_SYS_ADMIN is bit 21 of the effective set.
            let has_sys_admin = std::fs::read_to_string("/proc/self/status")
                .ok()
                .and_then(|st| {
                    st.lines()
                        .find_map(|l| l.strip_prefix("CapEff:"))
                        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
                })
                .is_some_and(|eff| eff & (1 << 21) != 0);
            if !has_sys_admin {
                let _ = nix::sys::prctl::set_no_new_privs();
            }
            libcontainer::seccomp::initialize_seccomp(filter).map_err(|e| {
                libcontainer::workload::ExecutorError::Other(format!(
                    "load the container's seccomp filter: {e}"
                ))
            })?;
        }
        libcontainer::workload::default::DefaultExecutor {}.exec(spec)
    }

    fn validate(
        &self,
        spec: &oci_spec::runtime::Spec,
    ) -> Result<(), libcontainer::workload::ExecutorValidationError> {
        libcontainer::workload::default::DefaultExecutor {}.validate(spec)
    }
}

pub(super) fn devnull() -> Result<std::fs::File, Status> {
    std::fs::File::open("/dev/null").map_err(|e| err("open /dev/null", e))
}

impl Svc {
    fn youki_root(&self) -> PathBuf {
        self.state.lock().expect("state").opts.youki_root()
    }

    fn container_dir(&self, id: &str) -> PathBuf {
        self.state.lock().expect("state").opts.container_dir(id)
    }

    fn state_of(&self, id: &str) -> Result<pb::ContainerState, Status> {
        let st = self.state.lock().expect("state");
        let c = st
            .containers
            .get(id)
            .ok_or_else(|| Status::not_found(format!("container {id} not found in pod monitor")))?;
        Ok(proto_state(id, c))
    }
}

impl Svc {
    /// startContainer hooks run in the container's init after libcontainer's start returns,
    /// and a failing one makes the init exit (255) before the process runs. The OCI runtime
    /// spec makes that an error of start: wait for the exec or that exit and report it.
    async fn await_start_hooks(&self, id: &str) -> Result<(), Status> {
        use std::os::unix::fs::MetadataExt;
        let (pid, bundle) = {
            let st = self.state.lock().expect("state");
            match st.containers.get(id) {
                Some(c) => (c.pid, c.bundle.clone()),
                None => return Ok(()),
            }
        };
        let hooks = crate::cdi::hooks_of(&bundle, "startContainer");
        if hooks.is_empty() {
            return Ok(());
        }
        let exe = |p: &str| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
        // The init is this binary until it execs the container's process.
        let own = exe("/proc/self/exe");
        // Under the daemon's deadline for a start (60 s): past it the daemon would give up on
        // the call and keep the record as Created while the container ran.
        let deadline = std::time::Instant::now() + Duration::from_secs(50);
        loop {
            let exit = {
                let st = self.state.lock().expect("state");
                st.containers.get(id).and_then(|c| c.exit)
            };
            if let Some(exit) = exit {
                if exit.code == 255 {
                    let which: Vec<String> = hooks.iter().map(|h| h.describe()).collect();
                    let m = format!(
                        "container {id}: startContainer hook failed: {}: the container's init exited with status 255 before its process ran (or its process exited 255 at once; the hook's stderr is in the container's log)",
                        which.join(", or ")
                    );
                    tracing::error!(container = %id, "{m}");
                    return Err(Status::failed_precondition(m));
                }
                return Ok(());
            }
            let now = exe(&format!("/proc/{}/exe", pid.as_raw()));
            if now.is_some() && now != own {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                tracing::warn!(container = %id, "startContainer hooks still running after 50 s; start reported as done");
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn info(&self, req: pb::InfoRequest) -> Result<pb::InfoResponse, Status> {
        Ok(info_of(
            &self.state.lock().expect("state"),
            !req.skip_records,
        ))
    }

    /// Info (states only) once the generation differs from `since`, or at `answer_by`.
    async fn events(&self, req: pb::EventsRequest) -> Result<pb::InfoResponse, Status> {
        let mut rx = self.state.lock().expect("state").changes.subscribe();
        if *rx.borrow_and_update() == req.since {
            let now = now_millis();
            if req.answer_by > now {
                let wait = Duration::from_millis((req.answer_by - now) as u64);
                let _ = tokio::time::timeout(wait, rx.changed()).await;
            }
        }
        Ok(info_of(&self.state.lock().expect("state"), false))
    }

    async fn keep_record(&self, req: pb::KeepRecordRequest) -> Result<pb::Empty, Status> {
        let mut st = self.state.lock().expect("state");
        check_record_size(&st.opts.pod_id, &req)?;
        // What the others take: every kept record but the one this replaces, and each
        // container's state beside them in the Info (a generous 256 bytes each).
        let kept_others = if req.container_id.is_empty() {
            0
        } else {
            st.pod_record.len()
        } + st.containers.len() * 256
            + st.containers
                .iter()
                .filter(|(id, _)| **id != req.container_id)
                .map(|(_, c)| c.record.len())
                .sum::<usize>();
        check_kept_total(&st.opts.pod_id, kept_others, &req)?;
        if req.container_id.is_empty() {
            st.pod_record = req.record;
        } else {
            st.containers
                .get_mut(&req.container_id)
                .ok_or_else(|| {
                    Status::not_found(format!(
                        "container {} not found in pod monitor",
                        req.container_id
                    ))
                })?
                .record = req.record;
        }
        Ok(pb::Empty {})
    }

    async fn create_container(
        &self,
        req: pb::CreateContainerRequest,
    ) -> Result<pb::CreateContainerResponse, Status> {
        if self.state.lock().expect("state").pid_ns_dead {
            return Err(Status::failed_precondition(format!(
                "container {}: {}",
                req.id,
                crate::Error::PidNsGone
            )));
        }
        // Before anything of the id is touched (its console socket, say).
        let creating = Creating::new(&self.state, &req.id)?;
        // The PID target's namespace, held from the check on: the create joins it however
        // soon that container exits and its pid is reaped and reused.
        let pid_target = self.check_pid_target(&req)?;
        let log = Arc::new(Mutex::new(
            LogWriter::open(std::path::Path::new(&req.log_path))
                .map_err(|e| err(format!("open log {}", req.log_path), e))?,
        ));
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let bundle = PathBuf::from(&req.bundle);
        let bundle_for_helper = bundle.clone();
        let root = self.youki_root();
        let id = req.id.clone();
        // With `stdin` (and no terminal, which carries input itself) a pipe whose write end
        // the monitor keeps for attach clients.
        let (stdin, stdin_w) = if req.stdin && !req.tty {
            let (r, w) = pipe()?;
            (r, Some(w))
        } else {
            (OwnedFd::from(devnull()?), None)
        };
        // A TTY container's init opens a pty in its own devpts and sends the master back
        // over this socket; its output then all reaches the log as stdout.
        let console = if req.tty {
            Some(ConsoleSocket::bind(&self.container_dir(&req.id))?)
        } else {
            None
        };
        let console_path = console.as_ref().map(|c| c.path.clone());
        let started = std::time::Instant::now();
        let hook_bundle = bundle.clone();
        let target_name = req.pid_target.clone();
        let late = req.late_mounts.clone();
        let fixes = req.propagation_fixes.clone();
        let inherit = Inherit {
            stdio: Some([stdin, out_w, err_w]),
            named: console
                .as_ref()
                .map(ConsoleSocket::dir_fd)
                .into_iter()
                .chain(pid_target.as_ref().map(AsRawFd::as_raw_fd))
                .collect(),
        };
        let made = in_helper(&self.state, inherit, move |stdio| {
            let [stdin, out_w, err_w] = stdio.expect("stdio given");
            // Joining a PID namespace, the init needs that namespace's /proc (see joined_pid);
            // held until the create returns. A PID target is joined through the descriptor.
            let target_ns = pid_target.as_ref().map(AsRawFd::as_raw_fd);
            let _mount_ns =
                joined_pid::prepare(&bundle_for_helper, target_ns).map_err(|e| match e {
                    // A PID target that exited since the check took its namespace with it.
                    crate::Error::PidNsGone if target_ns.is_some() => {
                        Status::failed_precondition(format!(
                            "container {id}: container {target_name}, whose PID namespace it joins, has exited"
                        ))
                    }
                    crate::Error::PidNsGone => {
                        Status::failed_precondition(format!("container {id}: {e}"))
                    }
                    e => Status::internal(format!(
                        "prepare container {id}'s mount namespace: {}",
                        e.chain()
                    )),
                })?;
            let mut c = ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(Workload { seccomp: None })
                .with_root_path(root)
                .map_err(|e| lc_err("state root", e))?
                .with_console_socket(console_path)
                .with_stdin(stdin)
                .with_stdout(out_w)
                .with_stderr(err_w)
                .as_init(&bundle_for_helper)
                .with_systemd(false)
                .with_detach(true)
                .build()
                .map_err(|e| lc_err(format!("create container {id}"), e))?;
            let pid = c
                .pid()
                .ok_or_else(|| Status::internal("created container has no pid"))?;
            // Before the late mounts, which may put a host directory on /dev.
            crate::cdi::fix_device_dirs(pid.as_raw(), &bundle_for_helper);
            if let Err(e) = late_mounts::apply(pid, &id, &late, &fixes) {
                if let Err(d) = c.delete(true) {
                    // At least its init goes: nobody would ever start or reap it.
                    let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                    tracing::warn!(container = %id, error = %d, "remove the container whose late mounts failed");
                }
                return Err(e);
            }
            Ok(pid)
        })
        .await
        .map_err(|e| with_hook_report(&hook_bundle, e))?;
        let pid = made.pid;
        // Until it is listed, a failure ends what the helper made.
        let mut unlisted = Unlisted {
            pid,
            state_dir: self.youki_root().join(&req.id),
            armed: true,
        };
        if self.state.lock().expect("state").shutting_down {
            return Err(Status::failed_precondition(format!(
                "container {}: the pod monitor is shutting down",
                req.id
            )));
        }
        tracing::debug!(container = %req.id, ms = started.elapsed().as_secs_f64() * 1e3, "libcontainer create");
        let fanout = streams::Fanout::default();
        let (mut stdin_w, mut console_fd) = (stdin_w, None);
        match console {
            Some(console) => {
                let master = console.receive()?;
                // Copies for attach clients: input (with `stdin`) and resizes.
                let copy = || {
                    nix::unistd::dup(std::os::fd::AsRawFd::as_raw_fd(&master))
                        .and_then(|fd| {
                            nix::fcntl::fcntl(
                                fd,
                                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
                            )
                            .map(|_| fd)
                        })
                        // SAFETY: dup just made this fd for us.
                        .map(|fd| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
                        .map_err(|e| err("dup the container's terminal", e))
                };
                console_fd = Some(copy()?);
                if req.stdin {
                    stdin_w = Some(copy()?);
                }
                pump(master, log.clone(), Stream::Stdout, fanout.clone())?;
            }
            None => {
                pump(out_r, log.clone(), Stream::Stdout, fanout.clone())?;
                pump(err_r, log.clone(), Stream::Stderr, fanout.clone())?;
            }
        }
        let mut st = self.state.lock().expect("state");
        st.containers.insert(
            req.id.clone(),
            Ctr {
                pid,
                own_pid_ns: leads_own_pid_ns(pid),
                phase: Phase::Created,
                started_at: 0,
                exit: None,
                bundle,
                log,
                waiters: Vec::new(),
                record: Vec::new(),
                stdin: stdin_w,
                stdin_once: req.stdin_once,
                console: console_fd,
                fanout,
            },
        );
        st.changed();
        drop(st);
        unlisted.armed = false;
        // Registered: the helper may exit and hand the init over to the reaper.
        drop(made);
        drop(creating);
        tracing::info!(container = %req.id, pid = pid.as_raw(), "container created");
        Ok(pb::CreateContainerResponse {
            pid: pid.as_raw() as u32,
            late_mounts: req.late_mounts.len() as u32,
            propagation_fixes: req.propagation_fixes.len() as u32,
        })
    }

    /// A spec that joins another container's PID namespace (TARGET) names it by that
    /// container's pid, looked up by the daemon before the call, and the request names the
    /// container: it must still be this pod's, not exited, and still hold that pid, or the
    /// pid may since name another process (another container of the pod, even). Checked and
    /// the namespace opened with no await in between, and the reaper records an exit in the
    /// step that reaps it (a zombie keeps its pid until then): the create joins the namespace
    /// through that descriptor, not the pid, so the monitor serves (and reaps) meanwhile.
    fn check_pid_target(
        &self,
        req: &pb::CreateContainerRequest,
    ) -> Result<Option<OwnedFd>, Status> {
        let id = &req.id;
        let config = std::path::Path::new(&req.bundle).join("config.json");
        let raw =
            std::fs::read(&config).map_err(|e| err(format!("read {}", config.display()), e))?;
        if !raw.windows(7).any(|w| w == b"/ns/pid") {
            return Ok(None);
        }
        let spec: serde_json::Value = serde_json::from_slice(&raw)
            .map_err(|e| err(format!("parse {}", config.display()), e))?;
        let path = spec
            .pointer("/linux/namespaces")
            .and_then(|n| n.as_array())
            .into_iter()
            .flatten()
            .find(|n| n["type"] == "pid")
            .and_then(|n| n["path"].as_str());
        // The pod's own shared namespace is a pin under its directory; any path through a
        // process is a container's, by its pid.
        let Some(path) = path.filter(|p| p.starts_with("/proc/")) else {
            return Ok(None);
        };
        let Some(target) = path
            .strip_prefix("/proc/")
            .and_then(|p| p.strip_suffix("/ns/pid"))
            .and_then(|p| p.parse::<i32>().ok())
        else {
            return Err(Status::invalid_argument(format!(
                "container {id}: PID namespace path {path:?} names no process"
            )));
        };
        let st = self.state.lock().expect("state");
        pid_target_holds(&st, id, &req.pid_target, target)?;
        let ns = std::fs::File::open(path).map_err(|e| {
            Status::failed_precondition(format!(
                "container {id}: open the PID namespace it joins ({path}): {e}"
            ))
        })?;
        Ok(Some(ns.into()))
    }

    async fn start_container(&self, req: pb::ContainerRef) -> Result<pb::ContainerState, Status> {
        let id = req.id;
        let bundle = {
            let st = self.state.lock().expect("state");
            let c = st.containers.get(&id).ok_or_else(|| {
                Status::not_found(format!("container {id} not found in pod monitor"))
            })?;
            if c.phase != Phase::Created {
                return Err(Status::failed_precondition(format!(
                    "container {id} is not in created state"
                )));
            }
            c.bundle.clone()
        };
        // In a helper too: libcontainer's start (state file, notify socket, poststart hooks)
        // would otherwise leave its code and heap mapped in every idle monitor.
        let root = self.youki_root();
        let cid = id.clone();
        // Its start time is taken now: the container may exit, and its exit be reported, before
        // the helper answers (the monitor serves meanwhile).
        let started_at = now_nanos();
        if let Some(c) = self.state.lock().expect("state").containers.get_mut(&id) {
            c.started_at = started_at;
        }
        let inherit = Inherit {
            stdio: None,
            named: Vec::new(),
        };
        let started = in_helper(&self.state, inherit, move |_| {
            let mut c = Container::load(root.join(&cid))
                .map_err(|e| lc_err(format!("load container {cid}"), e))?;
            c.start()
                .map_err(|e| lc_err(format!("start container {cid}"), e))?;
            Ok(nix::unistd::Pid::from_raw(0))
        })
        .await;
        if started.is_err() {
            if let Some(c) = self.state.lock().expect("state").containers.get_mut(&id) {
                if c.phase == Phase::Created {
                    c.started_at = 0;
                }
            }
        }
        // A failing poststart hook fails the start; its report names it.
        started.map_err(|e| with_hook_report(&bundle, e))?;
        self.await_start_hooks(&id).await?;
        {
            let mut st = self.state.lock().expect("state");
            if let Some(c) = st.containers.get_mut(&id) {
                c.started_at = started_at;
                if c.phase == Phase::Created {
                    c.phase = Phase::Running;
                }
            }
            st.changed();
        }
        self.state_of(&id)
    }

    async fn signal(&self, req: pb::SignalRequest) -> Result<pb::Empty, Status> {
        if !(1..=libc::SIGRTMAX()).contains(&req.signal) {
            return Err(Status::invalid_argument(format!("signal {}", req.signal)));
        }
        let (pid, phase, own_pid_ns) = {
            let st = self.state.lock().expect("state");
            let c = st.containers.get(&req.id).ok_or_else(|| {
                Status::not_found(format!("container {} not found in pod monitor", req.id))
            })?;
            (c.pid, c.phase, c.own_pid_ns)
        };
        // An exited container's pid is reaped and may be reused: never signal it.
        if phase == Phase::Exited {
            return Ok(pb::Empty {});
        }
        if req.all {
            let sig = Signal::try_from(req.signal).map_err(|_| {
                Status::invalid_argument(format!("signal {} to every process", req.signal))
            })?;
            signal_every_process(&self.youki_root(), &req.id, pid, own_pid_ns, sig)?;
        } else {
            // Raw kill: images may name real-time signals (SIGRTMIN+3) that nix's enum lacks.
            // SAFETY: kill(2) with a pid this monitor reaps and has not reaped yet.
            if unsafe { libc::kill(pid.as_raw(), req.signal) } != 0 {
                let e = nix::errno::Errno::last();
                if e != nix::errno::Errno::ESRCH {
                    return Err(err(format!("signal container {}", req.id), e));
                }
            }
        }
        Ok(pb::Empty {})
    }

    async fn state(&self, req: pb::ContainerRef) -> Result<pb::ContainerState, Status> {
        self.state_of(&req.id)
    }

    async fn wait(&self, req: pb::WaitRequest) -> Result<pb::ContainerState, Status> {
        let rx = {
            let mut st = self.state.lock().expect("state");
            let c = st.containers.get_mut(&req.id).ok_or_else(|| {
                Status::not_found(format!("container {} not found in pod monitor", req.id))
            })?;
            if c.phase == Phase::Exited {
                None
            } else {
                Some(super::streams::add_waiter(&mut c.waiters))
            }
        };
        if let Some(rx) = rx {
            if req.timeout_ms > 0 {
                let _ =
                    tokio::time::timeout(Duration::from_millis(req.timeout_ms as u64), rx).await;
            } else {
                let _ = rx.await;
            }
        }
        self.state_of(&req.id)
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::Empty, Status> {
        let (phase, pid, own_pid_ns) = {
            let st = self.state.lock().expect("state");
            match st.containers.get(&req.id) {
                Some(c) => (c.phase, c.pid, c.own_pid_ns),
                None => return Ok(pb::Empty {}),
            }
        };
        if phase == Phase::Running && !req.force {
            return Err(Status::failed_precondition(format!(
                "container {} is running",
                req.id
            )));
        }
        if phase != Phase::Exited {
            let root = self.youki_root();
            let _ = signal_every_process(&root, &req.id, pid, own_pid_ns, Signal::SIGKILL);
            // Wait for the reaper to record the exit.
            let rx = {
                let mut st = self.state.lock().expect("state");
                let c = st.containers.get_mut(&req.id).expect("checked");
                if c.phase == Phase::Exited {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let _ = tx.send(());
                    rx
                } else {
                    super::streams::add_waiter(&mut c.waiters)
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(10), rx).await;
        }
        // The kernel lets a cgroup go only once its last task is fully gone, which can trail
        // the reaped exit by a moment (EBUSY under load, seen on cgroup v1's cpuset):
        // retried with backoff, about 0.6 s in all, as runc retries its rmdir.
        // A state that does not load while its directory is there is retried the same way: a
        // start the daemon gave up on may be rewriting it in its helper (libcontainer
        // truncates the file in place). One that never loads is removed with a warning (the
        // pod's removal sweeps what is left in its cgroups).
        let state_dir = self.youki_root().join(&req.id);
        let mut attempt = 0;
        loop {
            let (deleted, loaded) = match Container::load(state_dir.clone()) {
                Ok(mut c) => (c.delete(true), true),
                Err(_) if !state_dir.exists() => break,
                Err(e) => (Err(e), false),
            };
            match deleted {
                Ok(()) => break,
                Err(e) if attempt < 6 => {
                    tracing::debug!(container = %req.id, attempt, error = %e, "delete failed; retrying");
                    tokio::time::sleep(Duration::from_millis(10 << attempt)).await;
                    attempt += 1;
                }
                Err(e) if !loaded => {
                    tracing::warn!(container = %req.id, error = %e, "the container's libcontainer state does not load: removed as it is");
                    let _ = std::fs::remove_dir_all(&state_dir);
                    break;
                }
                Err(e) => return Err(lc_err(format!("delete container {}", req.id), e)),
            }
        }
        let mut st = self.state.lock().expect("state");
        let dir = st.opts.container_dir(&req.id);
        st.containers.remove(&req.id);
        st.exec_slots.remove(&req.id);
        st.changed();
        let _ = std::fs::remove_dir_all(dir);
        Ok(pb::Empty {})
    }

    /// ExecSync; `went` ends when the caller has gone (its gRPC call cancelled, its deadline
    /// passed): an exec still waiting for its slot is not run then, and one running is killed,
    /// as containerd does, instead of running on for nobody.
    async fn exec_sync(
        &self,
        req: pb::ExecSyncRequest,
        went: impl std::future::Future<Output = ()>,
    ) -> Result<pb::ExecSyncResponse, Status> {
        let mut went = std::pin::pin!(went);
        let gone = |id: &str, when: &str| {
            Status::cancelled(format!("exec in container {id}: the caller went {when}"))
        };
        // plan_exec awaits only its slot: dropped there, it has taken nothing.
        let plan = tokio::select! {
            plan = super::streams::plan_exec(&self.state, &req.id, &req.cmd, false) => plan?,
            _ = &mut went => return Err(gone(&req.id, "before the exec ran")),
        };
        let super::streams::ExecPlan {
            root,
            pfile,
            seccomp,
            hold,
            userns,
            ..
        } = plan;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let id = req.id.clone();
        let inherit = Inherit {
            stdio: Some([devnull()?.into(), out_w, err_w]),
            named: Vec::new(),
        };
        let process = pfile.clone();
        let built = in_helper(&self.state, inherit, move |stdio| {
            let [stdin, out_w, err_w] = stdio.expect("stdio given");
            super::streams::enter_userns(userns.as_deref())?;
            ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(Workload { seccomp })
                .with_root_path(root)
                .map_err(|e| lc_err("state root", e))?
                .with_stdin(stdin)
                .with_stdout(out_w)
                .with_stderr(err_w)
                .as_tenant()
                .with_process(Some(&process))
                .with_detach(true)
                .build()
                .map_err(|e| lc_err(format!("exec in container {id}"), e))
        })
        .await;
        // Not under the state's lock (its drop takes it).
        drop(hold);
        let _ = std::fs::remove_file(&pfile);
        let made = built?;
        let pid = made.pid;
        // Registered before the helper lets it go to the reaper.
        let rx = {
            let mut st = self.state.lock().expect("state");
            st.reaped.register(pid.as_raw())
        };
        drop(made);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let out = collect(out_r, stopped.clone())?;
        let errs = collect(err_r, stopped)?;
        let waited = tokio::select! {
            // An exit that came first is the answer (the caller may still be there to read it).
            biased;
            w = async {
                if req.timeout_ms > 0 {
                    tokio::time::timeout(Duration::from_millis(req.timeout_ms as u64), rx)
                        .await
                        .ok()
                } else {
                    Some(rx.await)
                }
            } => w,
            _ = &mut went => {
                // Still the exec's pid: no exit came first, and only this thread reaps.
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                tracing::info!(container = %req.id, pid = pid.as_raw(), "the caller of an exec went: killed it");
                return Err(gone(&req.id, "while the exec ran"));
            }
        };
        let (exit_code, timed_out) = match waited {
            Some(Ok(WaitStatus::Exited(_, c))) => (c, false),
            Some(Ok(WaitStatus::Signaled(_, s, _))) => (128 + s as i32, false),
            Some(_) => (-1, false),
            None => {
                let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
                (-1, true)
            }
        };
        // Descendants may hold the pipes open: output is what arrived by shortly after exit,
        // and then the reads end (their pipes closed, their buffers freed). A dropped `stop`
        // ends them too, should this call be dropped first.
        let deadline = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let _ = stop.send(true);
        });
        let stdout = out.await.unwrap_or_default();
        let stderr = errs.await.unwrap_or_default();
        deadline.abort();
        Ok(pb::ExecSyncResponse {
            stdout,
            stderr,
            exit_code,
            timed_out,
        })
    }

    async fn reopen_log(&self, req: pb::ContainerRef) -> Result<pb::Empty, Status> {
        let id = req.id;
        let log = {
            let st = self.state.lock().expect("state");
            st.containers
                .get(&id)
                .ok_or_else(|| {
                    Status::not_found(format!("container {id} not found in pod monitor"))
                })?
                .log
                .clone()
        };
        log.lock()
            .expect("log")
            .reopen()
            .map_err(|e| err(format!("reopen log of {id}"), e))?;
        Ok(pb::Empty {})
    }

    async fn shutdown(&self, _: pb::Empty) -> Result<pb::Empty, Status> {
        if let Some(tx) = self.state.lock().expect("state").shutdown.take() {
            let _ = tx.send(());
        }
        Ok(pb::Empty {})
    }
}

impl Svc {
    /// Answers the one call a connection carries (see [`wire`]).
    async fn answer(&self, mut conn: tokio::net::UnixStream) {
        // Only the daemon may drive the pod: root or the uid this monitor runs as. The socket
        // sits in an owner-only directory; this holds even if that is ever loosened.
        match conn.peer_cred() {
            Ok(c) if c.uid() == 0 || c.uid() == nix::unistd::geteuid().as_raw() => {}
            Ok(c) => {
                tracing::warn!(uid = c.uid(), pid = ?c.pid(), "refused a call from another user on the monitor socket");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "no peer credentials on the monitor socket");
                return;
            }
        }
        // A peer that connects and says nothing does not hold a task forever.
        let call = tokio::time::timeout(
            CALL_READ_TIMEOUT,
            wire::read_frame_max(&mut conn, wire::MAX_REQUEST),
        )
        .await;
        let (tag, body) = match call {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "unreadable call on the monitor socket");
                return;
            }
            Err(_) => {
                tracing::warn!("a caller on the monitor socket sent nothing in time");
                return;
            }
        };
        // Streaming calls keep the connection (see `wire`) and answer it themselves.
        match wire::method(tag) {
            Some(Method::Exec) => {
                match pb::ExecRequest::decode(body.as_slice()) {
                    Ok(req) => streams::exec(&self.state, req, conn).await,
                    Err(e) => {
                        let m = format!("bad request: {e}");
                        let _ = wire::write_frame(
                            &mut conn,
                            wire::code::INVALID_ARGUMENT,
                            m.as_bytes(),
                        )
                        .await;
                    }
                }
                return;
            }
            Some(Method::Attach) => {
                match pb::AttachRequest::decode(body.as_slice()) {
                    Ok(req) => streams::attach(&self.state, req, conn).await,
                    Err(e) => {
                        let m = format!("bad request: {e}");
                        let _ = wire::write_frame(
                            &mut conn,
                            wire::code::INVALID_ARGUMENT,
                            m.as_bytes(),
                        )
                        .await;
                    }
                }
                return;
            }
            _ => {}
        }
        // A create the daemon gave up on (its deadline, or it died, with the call queued behind
        // a slow one) is not made: nobody would record it, and it would run on, unlisted,
        // until the pod stops.
        let create = match wire::method(tag) {
            Some(Method::CreateContainer) => {
                let id = pb::CreateContainerRequest::decode(body.as_slice())
                    .map(|r| r.id)
                    .unwrap_or_default();
                if caller_gone(&conn) {
                    tracing::warn!(container = %id, "the caller of a create is gone: not created");
                    return;
                }
                Some(id)
            }
            _ => None,
        };
        let answer = match wire::method(tag) {
            Some(Method::ExecSync) => match pb::ExecSyncRequest::decode(body.as_slice()) {
                Ok(req) => self
                    .exec_sync(req, caller_went(&conn))
                    .await
                    .map(|r| r.encode_to_vec()),
                Err(e) => Err(Status::invalid_argument(format!("bad request: {e}"))),
            },
            Some(m) => self.dispatch(m, &body).await,
            None => Err(Status::new(
                wire::code::UNIMPLEMENTED,
                format!("monitor call {tag} is not known to this monitor"),
            )),
        };
        let (code, body) = match answer {
            Ok(bytes) => (wire::code::OK, bytes),
            Err(s) => (s.code(), s.message().as_bytes().to_vec()),
        };
        let delivered = wire::write_frame(&mut conn, code, &body).await.is_ok();
        match create {
            // ... nor kept when the caller went while it was made (the write to a closed
            // socket fails).
            Some(id) if code == wire::code::OK && !delivered => {
                tracing::warn!(container = %id, "the caller of a create went while it was made: deleting the container");
                if let Err(e) = self
                    .delete(pb::DeleteRequest {
                        id: id.clone(),
                        force: true,
                    })
                    .await
                {
                    tracing::warn!(container = %id, error = %e.message(), "deleting a container nobody recorded");
                }
            }
            // Otherwise the caller may have gone (its own timeout): nothing to undo.
            _ => {}
        }
    }

    async fn dispatch(&self, m: Method, body: &[u8]) -> Result<Vec<u8>, Status> {
        fn decode<T: prost::Message + Default>(body: &[u8]) -> Result<T, Status> {
            T::decode(body).map_err(|e| Status::invalid_argument(format!("bad request: {e}")))
        }
        let out = match m {
            Method::Info => self.info(decode(body)?).await?.encode_to_vec(),
            Method::CreateContainer => self.create_container(decode(body)?).await?.encode_to_vec(),
            Method::StartContainer => self.start_container(decode(body)?).await?.encode_to_vec(),
            Method::Signal => self.signal(decode(body)?).await?.encode_to_vec(),
            Method::State => self.state(decode(body)?).await?.encode_to_vec(),
            Method::Wait => self.wait(decode(body)?).await?.encode_to_vec(),
            Method::Delete => self.delete(decode(body)?).await?.encode_to_vec(),
            Method::ReopenLog => self.reopen_log(decode(body)?).await?.encode_to_vec(),
            Method::Shutdown => self.shutdown(decode(body)?).await?.encode_to_vec(),
            Method::KeepRecord => self.keep_record(decode(body)?).await?.encode_to_vec(),
            Method::Events => self.events(decode(body)?).await?.encode_to_vec(),
            Method::Exec | Method::Attach | Method::ExecSync => {
                return Err(Status::internal(
                    "streaming calls and ExecSync are answered in `answer`",
                ))
            }
            Method::Unspecified => {
                return Err(Status::new(
                    wire::code::UNIMPLEMENTED,
                    "monitor call 0 names no call",
                ))
            }
        };
        Ok(out)
    }
}

/// Whether the peer of a connection whose call was read has closed it: it sends nothing after
/// its call, so the socket can only become readable (or hung up) by its end.
fn caller_gone(conn: &tokio::net::UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(conn),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd for a descriptor the stream owns, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Ends when the caller of a unary call has closed its connection: the daemon sends nothing
/// after its call (and does not half-close), so a readable connection is one at its end.
async fn caller_went(conn: &tokio::net::UnixStream) {
    let mut byte = [0u8; 1];
    loop {
        if conn.readable().await.is_err() {
            return;
        }
        match conn.try_read(&mut byte) {
            Ok(0) => return,
            // Not part of the protocol: ignored, as the rest of the call's bytes would be.
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// How long the monitor waits for a connected caller to send its call.
const CALL_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves until `Shutdown` (or SIGTERM), then kills what is left of the pod and releases it.
pub(crate) async fn serve(
    state: Shared,
    shutdown: tokio::sync::oneshot::Receiver<()>,
    ready: Option<std::fs::File>,
) -> crate::Result<()> {
    use std::io::Write;
    use tokio::signal::unix::{signal, SignalKind};
    let sock = state.lock().expect("state").opts.socket();
    let _ = std::fs::remove_file(&sock);
    let (_dir, short) =
        super::short_socket_path(&sock).map_err(|e| crate::Error::io("open", &sock, e))?;
    let listener =
        tokio::net::UnixListener::bind(&short).map_err(|e| crate::Error::io("bind", &sock, e))?;
    let mut sigchld =
        signal(SignalKind::child()).map_err(|e| crate::Error::sys("SIGCHLD handler", e))?;
    let mut sigterm =
        signal(SignalKind::terminate()).map_err(|e| crate::Error::sys("SIGTERM handler", e))?;
    let reaper_state = state.clone();
    tokio::spawn(async move {
        // Exits that happened before the handler existed are reaped on the first pass.
        loop {
            reap(&reaper_state);
            if sigchld.recv().await.is_none() {
                return;
            }
        }
    });
    if let Some(mut r) = ready {
        let ns =
            serde_json::to_string(&state.lock().expect("state").ns_paths).expect("paths serialize");
        // One write: the daemon reads one line, and a line in pieces is a reader's trap.
        let _ = r.write_all(format!("ok {ns}\n").as_bytes());
    }
    let mut stop = std::pin::pin!(async move {
        tokio::select! {
            _ = shutdown => {}
            _ = sigterm.recv() => tracing::info!("SIGTERM: shutting the pod down"),
        }
    });
    let svc = Svc {
        state: state.clone(),
    };
    loop {
        tokio::select! {
            conn = listener.accept() => match conn {
                Ok((conn, _)) => {
                    let svc = svc.clone();
                    tokio::spawn(async move { svc.answer(conn).await });
                }
                Err(e) => tracing::warn!(error = %e, "accept on the monitor socket"),
            },
            _ = &mut stop => break,
        }
    }
    teardown(&state).await;
    let _ = std::fs::remove_file(&sock);
    Ok(())
}

/// Kills every container and the infra process, and releases the namespaces.
async fn teardown(state: &Shared) {
    state.lock().expect("state").shutting_down = true;
    // Creates under way finish first, for 2 s at most; the helpers of those that do not are
    // killed, and what they made is deleted with the rest.
    for _ in 0..100 {
        if state.lock().expect("state").creating.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let helpers: Vec<i32> = state
        .lock()
        .expect("state")
        .helpers
        .iter()
        .copied()
        .collect();
    for pid in helpers {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
    let (to_kill, ids, infra_pid, dir, root) = {
        let st = state.lock().expect("state");
        (
            // An exited container with a PID namespace of its own has nothing left (its
            // namespace died with its init); one sharing the pod's or the node's may have
            // left processes behind in its cgroup.
            st.containers
                .iter()
                .filter(|(_, c)| !(c.own_pid_ns && c.phase == Phase::Exited))
                .map(|(id, c)| (id.clone(), c.pid, c.own_pid_ns))
                .collect::<Vec<_>>(),
            st.containers
                .keys()
                .chain(st.creating.iter())
                .cloned()
                .collect::<Vec<_>>(),
            st.infra_pid,
            st.opts.dir.clone(),
            st.opts.youki_root(),
        )
    };
    for (id, pid, own_pid_ns) in to_kill {
        let _ = signal_every_process(&root, &id, pid, own_pid_ns, Signal::SIGKILL);
    }
    if let Some(pid) = infra_pid {
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
    }
    // Give the reaper a moment so exits get recorded.
    wait_all_exited(state).await;
    // After the exits, so that libcontainer finds them stopped (one it sees running it kills
    // through its cgroup first). What is left in a cgroup (a process of the node's PID
    // namespace that outlived its init) is killed by the delete's removal of the cgroup.
    for id in ids {
        if let Ok(mut c) = Container::load(root.join(&id)) {
            let _ = c.delete(true);
        }
    }
    // The deletes may have ended processes the wait above did not see.
    reap(state);
    if let Some(pid) = infra_pid {
        let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
    }
    infra::unpin(&dir);
}

/// Reaps until every container's init has exited, for at most a second.
async fn wait_all_exited(state: &Shared) {
    for _ in 0..50 {
        reap(state);
        let all_exited = state
            .lock()
            .expect("state")
            .containers
            .values()
            .all(|c| c.phase == Phase::Exited);
        if all_exited {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether a spec joining the PID namespace of process `pid` (TARGET mode) joins what the
/// request meant: with `target` naming a container, that container, not exited and still
/// holding `pid`; with none, only the pod's init (a pin is the usual way to name it).
fn pid_target_holds(st: &super::State, id: &str, target: &str, pid: i32) -> Result<(), Status> {
    let holds = if target.is_empty() {
        st.infra_pid.map(|p| p.as_raw()) == Some(pid)
    } else {
        st.containers
            .get(target)
            .is_some_and(|c| c.pid.as_raw() == pid && c.phase != Phase::Exited)
    };
    if holds {
        return Ok(());
    }
    let whose = if target.is_empty() {
        "the container whose PID namespace it joins".to_string()
    } else {
        format!("container {target}, whose PID namespace it joins,")
    };
    Err(Status::failed_precondition(format!(
        "container {id}: {whose} (pid {pid}) is no longer running in this pod"
    )))
}

/// Whether `pid` is PID 1 of the innermost PID namespace it is in (the last `NSpid` field of
/// its status). A container init that is has a namespace of its own: a pod's shared one has
/// the pod's init as PID 1, the node's has the node's.
fn leads_own_pid_ns(pid: nix::unistd::Pid) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("NSpid:"))
                .map(|v| v.split_whitespace().last() == Some("1"))
        })
        .unwrap_or(false)
}

/// Sends `sig` to every process of container `id` (init `pid`, not reaped yet; its
/// libcontainer state under `root`): a SIGKILL to a container with a PID namespace of its own
/// goes to its init (`kill_namespace_init`), anything else through libcontainer's cgroup kill.
fn signal_every_process(
    root: &std::path::Path,
    id: &str,
    pid: nix::unistd::Pid,
    own_pid_ns: bool,
    sig: Signal,
) -> Result<(), Status> {
    if sig == Signal::SIGKILL && own_pid_ns {
        return kill_namespace_init(pid).map_err(|e| err(format!("signal container {id}"), e));
    }
    let mut c =
        Container::load(root.join(id)).map_err(|e| lc_err(format!("load container {id}"), e))?;
    c.kill(sig, true)
        .map_err(|e| lc_err(format!("signal container {id}"), e))
}

/// SIGKILL to the init of a container with a PID namespace of its own: when a namespace's
/// PID 1 dies the kernel kills every other process in it (and in the namespaces below it),
/// which is every process of the container, exec'd ones included, since they join it. That
/// is what libcontainer's kill of every process does by freezing and listing the cgroup,
/// which on cgroup v1 costs a read of the whole mount table per controller and a freeze
/// and thaw of the cgroup. Its pid is not reaped yet, so it is still the container's.
fn kill_namespace_init(pid: nix::unistd::Pid) -> nix::Result<()> {
    match nix::sys::signal::kill(pid, Signal::SIGKILL) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_over_the_cap_are_refused_naming_the_object_and_size() {
        let req = |container: &str, len: usize| pb::KeepRecordRequest {
            container_id: container.into(),
            record: vec![b'x'; len],
        };
        assert!(check_record_size("p1", &req("c1", wire::MAX_RECORD)).is_ok());
        let e = check_record_size("p1", &req("c1", wire::MAX_RECORD + 1)).unwrap_err();
        assert_eq!(e.code(), wire::code::INVALID_ARGUMENT);
        assert_eq!(
            e.message(),
            format!(
                "record of container c1 of pod p1 is {} bytes, over the {} bytes a pod monitor keeps",
                wire::MAX_RECORD + 1,
                wire::MAX_RECORD
            )
        );
        let e = check_record_size("p1", &req("", wire::MAX_RECORD + 1)).unwrap_err();
        assert!(e.message().starts_with("record of pod p1 is "), "{e:?}");
        // A call keeping the largest record allowed is read, so it gets its answer.
        let mut body = Vec::new();
        req(&"c".repeat(64), wire::MAX_RECORD)
            .encode(&mut body)
            .unwrap();
        let (mut a, mut b) = tokio::io::duplex(64 << 10);
        let write = tokio::spawn(async move { wire::write_frame(&mut a, 1, &body).await });
        let (_, got) = wire::read_frame_max(&mut b, wire::MAX_REQUEST)
            .await
            .unwrap();
        write.await.unwrap().unwrap();
        assert!(got.len() > wire::MAX_RECORD);
    }

    #[test]
    fn a_pods_kept_records_fit_in_the_info_that_returns_them() {
        let req = |len: usize| pb::KeepRecordRequest {
            container_id: "c1".into(),
            record: vec![b'x'; len],
        };
        assert!(check_kept_total("p1", wire::MAX_KEPT - 10, &req(10)).is_ok());
        let e = check_kept_total("p1", wire::MAX_KEPT - 10, &req(11)).unwrap_err();
        assert_eq!(e.code(), wire::code::INVALID_ARGUMENT);
        assert!(
            e.message().starts_with("records of pod p1 would take "),
            "{e:?}"
        );
        // All the records allowed, in as many containers as they can be split into, with
        // their states: the Info carrying them is within the frame the daemon reads.
        let n = wire::MAX_KEPT / wire::MAX_RECORD + 1;
        let each = wire::MAX_KEPT / n;
        let info = pb::InfoResponse {
            pod_id: "p".repeat(64),
            pod_record: vec![b'x'; wire::MAX_KEPT - each * n],
            containers: (0..n)
                .map(|i| pb::ContainerState {
                    id: format!("{i:064}"),
                    ..Default::default()
                })
                .collect(),
            container_records: (0..n)
                .map(|i| (format!("{i:064}"), vec![b'x'; each]))
                .collect(),
            ..Default::default()
        };
        assert!(
            info.encoded_len() <= wire::MAX_FRAME,
            "{}",
            info.encoded_len()
        );
    }
}
