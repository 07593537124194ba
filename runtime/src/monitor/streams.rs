//! The monitor's streaming calls: Exec (a process in a container, its stdio streamed) and
//! Attach (a container's own stdio). After the OK answer the call's connection carries the
//! stream frames of [`wire`]; see there for the framing and the flow control.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use hako_proto::monitor as pb;
use libcontainer::container::builder::ContainerBuilder;
use libcontainer::syscall::syscall::SyscallType;
use nix::sys::signal::Signal;
use nix::sys::wait::WaitStatus;
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncRead;

use super::service::{
    async_fd, devnull, err, in_helper, lc_err, pipe, ConsoleSocket, Inherit, Workload,
};
use super::wire::{self, stream, Status, STREAM_CHUNK};
use super::{now_nanos, Phase, Shared};

/// Output chunks a slow attach client may fall behind by before it is disconnected (up to
/// 2 MiB at full chunks): the container and its log never wait for an attach client.
const ATTACH_BACKLOG: usize = 64;

/// How long output is still forwarded after the process exited: descendants may hold its
/// pipes open (as ExecSync, which waits 500 ms).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// A container's live output, fanned out to its attach clients: `(stream, bytes)`, an empty
/// chunk being that stream's end. Made by the first attach; idle pods carry no channel.
pub(crate) type Fanout =
    Arc<std::sync::Mutex<Option<tokio::sync::broadcast::Sender<(u8, Arc<[u8]>)>>>>;

/// Hands output to the attach clients, if any (never waits: a lagging client loses it and is
/// disconnected by its own task).
pub(crate) fn fan_out(f: &Fanout, stream: u8, bytes: &[u8]) {
    if let Some(tx) = f.lock().expect("fanout").as_ref() {
        if tx.receiver_count() > 0 {
            let _ = tx.send((stream, Arc::from(bytes)));
        }
    }
}

/// A close-on-exec copy of `fd`: the same pipe, terminal or socket, registered on its own.
fn dup(fd: &impl AsRawFd) -> Result<OwnedFd, Status> {
    let raw = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3))
        .map_err(|e| err("dup", e))?;
    // SAFETY: fcntl just made this fd for us.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(raw) })
}

/// Reads once; 0 at end of file (a pty master's EIO, once the last slave closed, included).
/// Cancel-safe: nothing is read until the fd is ready and then the read completes at once.
async fn read_fd(fd: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        let mut guard = fd.readable().await?;
        match guard.try_io(|fd| {
            nix::unistd::read(fd.get_ref().as_raw_fd(), buf).map_err(std::io::Error::from)
        }) {
            Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
            Ok(r) => return r,
            Err(_would_block) => continue,
        }
    }
}

/// Writes all of `bytes`, waiting while the pipe or terminal is full (backpressure to the
/// client, whose frames are not read meanwhile).
async fn write_fd(fd: &AsyncFd<OwnedFd>, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        let mut guard = fd.writable().await?;
        match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), bytes).map_err(Into::into)) {
            Ok(Ok(n)) => bytes = &bytes[n..],
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

/// Returns once the daemon closed (or shut down its side of) the connection `conn` watches, a
/// copy of the call's connection with its own registration: readiness cleared here leaves the
/// connection's own untouched, so its frames are still read later.
async fn hung_up(conn: &AsyncFd<OwnedFd>) {
    loop {
        let Ok(mut g) = conn.readable().await else {
            return;
        };
        if g.ready().is_read_closed() {
            return;
        }
        g.clear_ready();
    }
}

/// The container's seccomp filter from its spec, for an exec: absent or null is none; anything
/// else that does not parse fails the exec (it must never run unconfined by mistake).
pub(super) fn exec_seccomp(
    spec: &serde_json::Value,
) -> Result<Option<oci_spec::runtime::LinuxSeccomp>, Status> {
    match &spec["linux"]["seccomp"] {
        serde_json::Value::Null => Ok(None),
        v => serde_json::from_value(v.clone()).map(Some).map_err(|e| {
            Status::internal(format!(
                "parse linux.seccomp of the container's config.json: {e}"
            ))
        }),
    }
}

/// Adds a waiter for a container's exit, first dropping those whose receiver went (a detached
/// attach, a timed-out Wait): the list is drained only at the exit.
pub(super) fn add_waiter(
    waiters: &mut Vec<tokio::sync::oneshot::Sender<()>>,
) -> tokio::sync::oneshot::Receiver<()> {
    waiters.retain(|w| !w.is_closed());
    let (tx, rx) = tokio::sync::oneshot::channel();
    waiters.push(tx);
    rx
}

fn set_size(console: &OwnedFd, body: &[u8]) {
    if let Some((width, height)) = wire::parse_resize(body) {
        let ws = libc::winsize {
            ws_row: height,
            ws_col: width,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize from the pointer, which outlives the call.
        unsafe { libc::ioctl(console.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    }
}

/// Why a streaming call's frames from the daemon stopped: the daemon went (closed the
/// connection, or sent garbage). While stdin is full, `conn` (a copy of the connection) is
/// watched for the daemon hanging up, as frames are then not read.
async fn client_frames<R: AsyncRead + Unpin>(
    r: &mut R,
    conn: &AsyncFd<OwnedFd>,
    mut stdin: Option<AsyncFd<OwnedFd>>,
    console: Option<&OwnedFd>,
    mut on_stdin_end: impl FnMut(),
) {
    let mut buf = Vec::with_capacity(STREAM_CHUNK);
    loop {
        let Ok(s) = wire::read_stream(r, &mut buf).await else {
            if stdin.take().is_some() {
                on_stdin_end();
            }
            return;
        };
        match s {
            stream::STDIN if buf.is_empty() && stdin.is_some() => {
                stdin = None;
                on_stdin_end();
            }
            stream::STDIN if buf.is_empty() => {}
            stream::STDIN => {
                if let Some(fd) = &stdin {
                    tokio::select! {
                        r = write_fd(fd, &buf) => {
                            // The process closed its stdin: later input has nowhere to go.
                            if r.is_err() {
                                stdin = None;
                                on_stdin_end();
                            }
                        }
                        _ = hung_up(conn) => {
                            on_stdin_end();
                            return;
                        }
                    }
                }
            }
            stream::RESIZE => {
                if let Some(c) = console {
                    set_size(c, &buf);
                }
            }
            _ => {}
        }
    }
}

fn exit_code(ws: WaitStatus) -> i32 {
    match ws {
        WaitStatus::Exited(_, c) => c,
        WaitStatus::Signaled(_, s, _) => 128 + s as i32,
        _ => -1,
    }
}

/// Answers `Exec`: starts the process, answers OK, streams until it exited and its output
/// ended (then the exit frame), or until the daemon closed the connection (then the process
/// is killed with SIGKILL; in a terminal its session also gets the hangup of the terminal
/// closing). Every fd of the call is closed when it returns.
pub(crate) async fn exec(state: &Shared, req: pb::ExecRequest, mut conn: tokio::net::UnixStream) {
    let call = match start_exec(state, &req).await {
        Ok(c) => c,
        Err(s) => {
            let _ = wire::write_frame(&mut conn, s.code(), s.message().as_bytes()).await;
            return;
        }
    };
    let Started {
        pid,
        mut exited,
        stdin,
        stdout,
        stderr,
        console,
        console_dir,
    } = call;
    // The process's exit code, once reaped.
    let mut code = None;
    let watch = match dup(&conn).and_then(|f| async_fd(f, tokio::io::Interest::READABLE)) {
        Ok(w) => Some(w),
        Err(s) => {
            let _ = wire::write_frame(&mut conn, s.code(), s.message().as_bytes()).await;
            None
        }
    };
    let answered = match &watch {
        Some(_) => wire::write_frame(&mut conn, wire::code::OK, b"")
            .await
            .is_ok(),
        None => false,
    };
    if let (Some(watch), true) = (watch.as_ref(), answered) {
        let (mut rd, mut wr) = conn.split();
        let outputs = async {
            let mut ended = [stdout.is_none(), stderr.is_none()];
            let mut bufs = (vec![0u8; STREAM_CHUNK], vec![0u8; STREAM_CHUNK]);
            let code = &mut code;
            let mut drain_until = None;
            loop {
                if ended == [true, true] && code.is_some() {
                    break;
                }
                let drained = async {
                    match drain_until {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    n = async { read_fd(stdout.as_ref().expect("open"), &mut bufs.0).await }, if !ended[0] => {
                        let n = n.unwrap_or(0);
                        ended[0] = n == 0;
                        wire::write_stream(&mut wr, stream::STDOUT, &bufs.0[..n]).await?;
                    }
                    n = async { read_fd(stderr.as_ref().expect("open"), &mut bufs.1).await }, if !ended[1] => {
                        let n = n.unwrap_or(0);
                        ended[1] = n == 0;
                        wire::write_stream(&mut wr, stream::STDERR, &bufs.1[..n]).await?;
                    }
                    ws = &mut exited, if code.is_none() => {
                        *code = Some(ws.map(exit_code).unwrap_or(-1));
                        drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
                    }
                    _ = drained => break,
                }
            }
            // Streams still held open by descendants end here.
            if !ended[0] {
                wire::write_stream(&mut wr, stream::STDOUT, b"").await?;
            }
            if !ended[1] {
                wire::write_stream(&mut wr, stream::STDERR, b"").await?;
            }
            let c = code.expect("exited");
            wire::write_stream(&mut wr, stream::EXIT, &c.to_be_bytes()).await?;
            Ok::<_, std::io::Error>(())
        };
        let inputs = client_frames(&mut rd, watch, stdin, console.as_ref(), || {});
        tokio::select! {
            _ = outputs => {}
            _ = inputs => {}
        }
    }
    // The client gone first: the process must not outlive the call. Its exit is awaited so
    // the reaper's record of it goes too. Once reaped (its status maybe sent but not yet
    // taken), its pid is not ours to signal: checked under the state lock, which the reaper
    // holds to hand the status over (left: the instant between its waitpid and that lock).
    let unreaped = code.is_none() && {
        let _st = state.lock().expect("state");
        matches!(
            exited.try_recv(),
            Err(tokio::sync::oneshot::error::TryRecvError::Empty)
        )
    };
    if unreaped {
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        if tokio::time::timeout(Duration::from_secs(10), exited)
            .await
            .is_err()
        {
            state
                .lock()
                .expect("state")
                .reaped
                .waiting
                .remove(&pid.as_raw());
        }
    }
    drop(console);
    if let Some(d) = console_dir {
        let _ = std::fs::remove_dir_all(d);
    }
}

struct Started {
    pid: nix::unistd::Pid,
    exited: tokio::sync::oneshot::Receiver<WaitStatus>,
    stdin: Option<AsyncFd<OwnedFd>>,
    stdout: Option<AsyncFd<OwnedFd>>,
    stderr: Option<AsyncFd<OwnedFd>>,
    /// The terminal's master (a TTY exec), for resizes.
    console: Option<OwnedFd>,
    console_dir: Option<std::path::PathBuf>,
}

/// What an exec (streaming or ExecSync) runs: the container's own process (user, env, cwd,
/// capabilities, no_new_privs) with another command, written where libcontainer reads it,
/// and the container's seccomp filter.
pub(super) struct ExecPlan {
    /// The container's directory in the monitor's state.
    pub(super) cdir: std::path::PathBuf,
    pub(super) root: std::path::PathBuf,
    /// The process file libcontainer execs.
    pub(super) pfile: std::path::PathBuf,
    pub(super) seccomp: Option<oci_spec::runtime::LinuxSeccomp>,
    /// Names this exec's files apart from others running at once.
    pub(super) nanos: i64,
    /// The container's init, held from the reaper, and its exec slot, until the exec's helper
    /// has answered.
    pub(super) hold: super::ExecHold,
    /// The pod's user namespace, which the exec's helper enters first: libcontainer 0.7
    /// joins a container's other namespaces for an exec but not that one, and the process
    /// would run as the host's root in them.
    pub(super) userns: Option<std::path::PathBuf>,
}

/// In an exec's helper, before libcontainer: into the pod's user namespace, if it has one.
pub(super) fn enter_userns(userns: Option<&std::path::Path>) -> Result<(), Status> {
    if let Some(path) = userns {
        let f = std::fs::File::open(path)
            .map_err(|e| Status::internal(format!("exec: open {}: {e}", path.display())))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWUSER)
            .map_err(|e| Status::internal(format!("exec: enter the pod's user namespace: {e}")))?;
    }
    Ok(())
}

/// Waits for `id`'s exec slot, checks that it is running and plans `cmd` in it (see
/// [`ExecPlan`]).
pub(super) async fn plan_exec(
    state: &Shared,
    id: &str,
    cmd: &[String],
    tty: bool,
) -> Result<ExecPlan, Status> {
    let slot = exec_slot(state, id).await?;
    let not_running = || Status::failed_precondition(format!("container {id} is not running"));
    let (bundle, cdir, root, hold, userns) = {
        let mut st = state.lock().expect("state");
        let c = st
            .containers
            .get(id)
            .ok_or_else(|| Status::not_found(format!("container {id} not found in pod monitor")))?;
        if c.phase != Phase::Running {
            return Err(not_running());
        }
        // Teardown has listed the helpers it kills: one forked after would outlive it.
        if st.shutting_down {
            return Err(Status::failed_precondition(format!(
                "container {id}: the pod monitor is shutting down"
            )));
        }
        let (bundle, pid) = (c.bundle.clone(), c.pid.as_raw());
        // In the step that found it running: nothing is reaped in between.
        let hold = super::ExecHold::take(state, &mut st, pid, slot).ok_or_else(not_running)?;
        (
            bundle,
            st.opts.container_dir(id),
            st.opts.youki_root(),
            hold,
            st.opts.userns.map(|_| st.opts.dir.join("ns").join("user")),
        )
    };
    if cmd.is_empty() {
        return Err(Status::invalid_argument(format!(
            "container {id}: exec command is empty"
        )));
    }
    // execve takes C strings, and libcontainer turns an argument with a NUL into an empty
    // one: `sh -c "test -f /ready\0"` would run `sh -c ""` and pass a probe.
    if let Some(i) = cmd.iter().position(|a| a.contains('\0')) {
        return Err(Status::invalid_argument(format!(
            "container {id}: argument {i} of the exec command contains a NUL byte"
        )));
    }
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(bundle.join("config.json")).map_err(|e| err("read config.json", e))?,
    )
    .map_err(|e| err("parse config.json", e))?;
    let mut process = spec["process"].clone();
    process["args"] = serde_json::json!(cmd);
    process["terminal"] = serde_json::json!(tty);
    let seccomp = exec_seccomp(&spec)?;
    std::fs::create_dir_all(&cdir).map_err(|e| err("create container dir", e))?;
    // Strictly increasing: execs run at once, and two may be planned within a clock tick.
    // (The monitor is single-threaded: a load and a store do.)
    static LAST: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);
    let nanos = now_nanos().max(LAST.load(std::sync::atomic::Ordering::Relaxed) + 1);
    LAST.store(nanos, std::sync::atomic::Ordering::Relaxed);
    let pfile = cdir.join(format!("exec-{nanos}.json"));
    std::fs::write(&pfile, serde_json::to_vec(&process).expect("json"))
        .map_err(|e| err("write exec process", e))?;
    Ok(ExecPlan {
        cdir,
        root,
        pfile,
        seccomp,
        nanos,
        hold,
        userns,
    })
}

/// The slot for an exec's helper in container `id`: one at a time per container, as when the
/// monitor waited for each. More at once brought no more execs per second here and halved the
/// pod starts of a loaded node (tests/load.rs; their setups read the mount table under the
/// kernel's one mount lock); an exec slowed in one container (a CPU quota it has used up)
/// holds up only that container's next execs.
async fn exec_slot(state: &Shared, id: &str) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
    let slot = {
        let mut st = state.lock().expect("state");
        // Only a container's: the slots go with their containers.
        if !st.containers.contains_key(id) {
            return Err(Status::not_found(format!(
                "container {id} not found in pod monitor"
            )));
        }
        st.exec_slots
            .entry(id.to_string())
            .or_insert_with(|| std::sync::Arc::new(tokio::sync::Semaphore::new(1)))
            .clone()
    };
    Ok(slot.acquire_owned().await.expect("never closed"))
}

async fn start_exec(state: &Shared, req: &pb::ExecRequest) -> Result<Started, Status> {
    let ExecPlan {
        cdir,
        root,
        pfile,
        seccomp,
        nanos,
        hold,
        userns,
    } = plan_exec(state, &req.id, &req.cmd, req.tty).await?;
    // A terminal's init sends its master over a socket of this exec's own (execs run at once).
    let console_dir = cdir.join(format!("exec-{nanos}"));
    let console = if req.tty {
        Some(ConsoleSocket::bind(&console_dir)?)
    } else {
        None
    };
    let console_path = console.as_ref().map(|c| c.path.clone());
    // Without a terminal: a pipe for each stream asked for, /dev/null for the others.
    let wanted = |on: bool| -> Result<Option<(OwnedFd, OwnedFd)>, Status> {
        if on && !req.tty {
            pipe().map(Some)
        } else {
            Ok(None)
        }
    };
    let (i, o, e) = (wanted(req.stdin)?, wanted(req.stdout)?, wanted(req.stderr)?);
    let null = || devnull().map(OwnedFd::from);
    let (child_in, parent_in) = match i {
        Some((r, w)) => (r, Some(w)),
        None => (null()?, None),
    };
    let (parent_out, child_out) = match o {
        Some((r, w)) => (Some(r), w),
        None => (None, null()?),
    };
    let (parent_err, child_err) = match e {
        Some((r, w)) => (Some(r), w),
        None => (None, null()?),
    };
    let id = req.id.clone();
    let process_file = pfile.clone();
    let inherit = Inherit {
        stdio: Some([child_in, child_out, child_err]),
        named: console
            .as_ref()
            .map(ConsoleSocket::dir_fd)
            .into_iter()
            .collect(),
    };
    let built = in_helper(state, inherit, move |stdio| {
        let [child_in, child_out, child_err] = stdio.expect("stdio given");
        enter_userns(userns.as_deref())?;
        ContainerBuilder::new(id.clone(), SyscallType::default())
            .with_executor(Workload { seccomp })
            .with_root_path(root)
            .map_err(|e| lc_err("state root", e))?
            .with_console_socket(console_path)
            .with_stdin(child_in)
            .with_stdout(child_out)
            .with_stderr(child_err)
            .as_tenant()
            .with_process(Some(&process_file))
            .with_detach(true)
            .build()
            .map_err(|e| lc_err(format!("exec in container {id}"), e))
    })
    .await;
    // Not under the state's lock (its drop takes it).
    drop(hold);
    let _ = std::fs::remove_file(&pfile);
    let made = match built {
        Ok(p) => p,
        Err(e) => {
            drop(console);
            let _ = std::fs::remove_dir_all(&console_dir);
            return Err(e);
        }
    };
    let pid = made.pid;
    // Registered before the helper lets it go to the reaper.
    let exited = {
        let mut st = state.lock().expect("state");
        st.reaped.register(pid.as_raw())
    };
    drop(made);
    let fds = (|| {
        use tokio::io::Interest;
        let mut s = Started {
            pid,
            exited,
            stdin: parent_in
                .map(|f| async_fd(f, Interest::WRITABLE))
                .transpose()?,
            stdout: parent_out
                .map(|f| async_fd(f, Interest::READABLE))
                .transpose()?,
            stderr: parent_err
                .map(|f| async_fd(f, Interest::READABLE))
                .transpose()?,
            console: None,
            console_dir: req.tty.then(|| console_dir.clone()),
        };
        if let Some(c) = console {
            let master = c.receive()?;
            // One copy read (output), one written (input), one for resizes.
            if req.stdout {
                s.stdout = Some(async_fd(dup(&master)?, Interest::READABLE)?);
            }
            if req.stdin {
                s.stdin = Some(async_fd(dup(&master)?, Interest::WRITABLE)?);
            }
            s.console = Some(master);
        }
        Ok::<_, Status>(s)
    })();
    match fds {
        Ok(s) => Ok(s),
        Err(e) => {
            let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
            let _ = std::fs::remove_dir_all(&console_dir);
            Err(e)
        }
    }
}

/// Answers `Attach`: the container's output from now on (until it ends, or the client falls
/// [`ATTACH_BACKLOG`] chunks behind: then it is disconnected), its stdin when it was created
/// with stdin, its terminal's size; the exit frame once it exited. The daemon closing the
/// connection detaches; the container runs on.
pub(crate) async fn attach(
    state: &Shared,
    req: pb::AttachRequest,
    mut conn: tokio::net::UnixStream,
) {
    let joined = (|| {
        let mut st = state.lock().expect("state");
        let c = st.containers.get_mut(&req.id).ok_or_else(|| {
            Status::not_found(format!("container {} not found in pod monitor", req.id))
        })?;
        if c.phase != Phase::Running {
            return Err(Status::failed_precondition(format!(
                "container {} is not running",
                req.id
            )));
        }
        let rx = c
            .fanout
            .lock()
            .expect("fanout")
            .get_or_insert_with(|| tokio::sync::broadcast::channel(ATTACH_BACKLOG).0)
            .subscribe();
        let exited = add_waiter(&mut c.waiters);
        // Input goes to the container's stdin only when it was created with one.
        let stdin = match (&c.stdin, req.stdin) {
            (Some(fd), true) => Some(async_fd(dup(fd)?, tokio::io::Interest::WRITABLE)?),
            _ => None,
        };
        let console = c.console.as_ref().map(dup).transpose()?;
        let watch = async_fd(dup(&conn)?, tokio::io::Interest::READABLE)?;
        Ok((rx, exited, stdin, console, c.stdin_once, watch))
    })();
    let (mut rx, exited, stdin, console, stdin_once, watch) = match joined {
        Ok(j) => j,
        Err(s) => {
            let _ = wire::write_frame(&mut conn, s.code(), s.message().as_bytes()).await;
            return;
        }
    };
    if wire::write_frame(&mut conn, wire::code::OK, b"")
        .await
        .is_err()
    {
        return;
    }
    let (mut rd, mut wr) = conn.split();
    let id = req.id.clone();
    let outputs = async {
        use tokio::sync::broadcast::error::RecvError;
        let mut open = [req.stdout, req.stderr && console.is_none()];
        let mut exited = std::pin::pin!(exited);
        let mut drain_until = None;
        loop {
            let drained = async {
                match drain_until {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                chunk = rx.recv(), if open != [false, false] => match chunk {
                    Ok((s, bytes)) => {
                        let i = usize::from(s == stream::STDERR);
                        if open[i] {
                            open[i] = !bytes.is_empty();
                            wire::write_stream(&mut wr, s, &bytes).await?;
                        }
                    }
                    Err(RecvError::Lagged(n)) => {
                        tracing::info!(container = %id, chunks = n, "attach client too slow; disconnected");
                        return Ok(());
                    }
                    Err(RecvError::Closed) => open = [false, false],
                },
                _ = &mut exited, if drain_until.is_none() => {
                    drain_until = Some(tokio::time::Instant::now() + DRAIN_AFTER_EXIT);
                }
                _ = drained => break,
            }
            if open == [false, false] && drain_until.is_some() {
                break;
            }
        }
        for (i, s) in [stream::STDOUT, stream::STDERR].into_iter().enumerate() {
            if open[i] {
                wire::write_stream(&mut wr, s, b"").await?;
            }
        }
        let code = state
            .lock()
            .expect("state")
            .containers
            .get(&id)
            .and_then(|c| c.exit)
            .map_or(-1, |e| e.code);
        wire::write_stream(&mut wr, stream::EXIT, &code.to_be_bytes()).await
    };
    // CRI's stdin_once: the container's stdin closes when the first attach's stdin does.
    let close_stdin = || {
        if stdin_once {
            if let Some(c) = state.lock().expect("state").containers.get_mut(&req.id) {
                c.stdin = None;
            }
        }
    };
    let inputs = client_frames(&mut rd, &watch, stdin, console.as_ref(), close_stdin);
    tokio::select! {
        _ = outputs => {}
        _ = inputs => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_seccomp_is_none_when_absent_and_refuses_what_does_not_parse() {
        assert_eq!(exec_seccomp(&serde_json::json!({})).unwrap(), None);
        assert_eq!(
            exec_seccomp(&serde_json::json!({"linux": {"seccomp": null}})).unwrap(),
            None
        );
        let f = exec_seccomp(&serde_json::json!({"linux": {"seccomp": {
            "defaultAction": "SCMP_ACT_ERRNO",
            "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]
        }}}))
        .unwrap()
        .expect("a filter");
        assert_eq!(f.syscalls().as_ref().map(Vec::len), Some(1));
        let e = exec_seccomp(&serde_json::json!({"linux": {"seccomp": {"defaultAction": 7}}}))
            .unwrap_err();
        assert_eq!(e.code(), wire::code::INTERNAL);
        assert!(e.message().contains("linux.seccomp"), "{e:?}");
    }

    #[test]
    fn add_waiter_drops_the_waiters_that_went() {
        let mut waiters = Vec::new();
        let kept = add_waiter(&mut waiters);
        for _ in 0..100 {
            drop(add_waiter(&mut waiters));
        }
        // The last one's receiver went after its push: only it is left of the gone ones.
        assert_eq!(waiters.len(), 2);
        drop(kept);
        let _live = add_waiter(&mut waiters);
        assert_eq!(waiters.len(), 1);
    }
}
