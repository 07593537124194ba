//! The pod monitor: one process per pod (`hako monitor`, a re-exec of the daemon's binary).
//!
//! It pins the pod's namespaces through an infra child, is the child subreaper of every process
//! of the pod, creates and starts containers through libcontainer, owns their stdio (CRI log
//! files), records each exit durably (`containers/<id>/exit.json`) before reporting it, keeps
//! in memory the copies of the daemon's records it is given (`KeepRecord`; the daemon adopts a
//! pod from them when its store lost it), and serves `hako.monitor.v1.Monitor` on
//! `<pod dir>/monitor.sock`.
//!
//! It runs a current-thread tokio runtime and never uses the blocking pool, so it is
//! single-threaded whenever it forks. libcontainer runs in forked helpers; the monitor serves
//! other calls while they work (see `service::in_helper`), holding back from its reaper the
//! init of a container an exec's helper is joining (see [`ExecHold`]).
//!
//! Container states: `Created` (init waits on libcontainer's notify socket) → `Running` (after
//! `start`) → `Exited` (reaped here, exit recorded). `Delete` removes an exited or created one.

mod infra;
mod joined_pid;
mod late_mounts;
pub mod log;
mod service;
mod streams;
pub mod wire;

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::logs::LogWriter;

pub use infra::{unpin as unpin_namespaces, unpin_all_but_network, IdRange, NamespaceSet, UserNs};

/// How the daemon starts a monitor (as arguments of `hako monitor`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Options {
    pub pod_id: String,
    /// `<state>/pods/<pod id>`: socket, pinned namespaces, libcontainer state, exits.
    pub dir: PathBuf,
    pub hostname: String,
    pub namespaces: NamespaceSet,
    /// Network sysctls set inside the pod's network namespace.
    pub sysctls: Vec<(String, String)>,
    /// The pod's own user namespace, which owns its other namespaces.
    #[serde(default)]
    pub userns: Option<UserNs>,
}

/// The recorded end of a container, written before it is reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Exit {
    pub code: i32,
    pub signal: i32,
    pub finished_at: i64,
    pub oom_killed: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Created,
    Running,
    Exited,
}

pub(crate) struct Ctr {
    pub pid: Pid,
    /// Its init is PID 1 of a PID namespace of its own (`service::kill_namespace_init`).
    pub own_pid_ns: bool,
    pub phase: Phase,
    pub started_at: i64,
    pub exit: Option<Exit>,
    pub bundle: PathBuf,
    pub log: Arc<Mutex<LogWriter>>,
    pub waiters: Vec<tokio::sync::oneshot::Sender<()>>,
    /// The daemon's record of the container (KeepRecord), opaque here; empty until kept.
    pub record: Vec<u8>,
    /// Where attach clients' input goes, for a container created with `stdin`: its stdin
    /// pipe's write end, or its terminal's master. Held for the container's life so its stdin
    /// stays open between attaches; `None` once closed (`stdin_once`).
    pub stdin: Option<std::os::fd::OwnedFd>,
    pub stdin_once: bool,
    /// A TTY container's terminal master, for attach clients' resizes.
    pub console: Option<std::os::fd::OwnedFd>,
    /// Its live output for attach clients.
    pub fanout: streams::Fanout,
}

/// Exits of processes that are not container inits (execs), by pid, for whoever waits.
#[derive(Default)]
pub(crate) struct Reaped {
    pub waiting: HashMap<i32, tokio::sync::oneshot::Sender<WaitStatus>>,
}

impl Reaped {
    /// Hands an exit to its waiter. One nobody waits for (an orphan the pod's processes left,
    /// the monitor being their subreaper, or a helper) is dropped: a waiter is registered
    /// before its process can be reaped, so none would ever be asked for, and keeping them
    /// would hand an old orphan's exit to a new process reusing its pid.
    fn deliver(&mut self, pid: i32, ws: WaitStatus) {
        if let Some(tx) = self.waiting.remove(&pid) {
            let _ = tx.send(ws);
        }
    }

    /// Registers the waiter of `pid`, a process just made. Its exit cannot have been reaped
    /// yet: it is its helper's child until the caller lets the helper go, after this, and only
    /// the reaper task reaps.
    pub fn register(&mut self, pid: i32) -> tokio::sync::oneshot::Receiver<WaitStatus> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.waiting.insert(pid, tx);
        rx
    }
}

pub(crate) struct State {
    pub opts: Options,
    /// PID 1 of the pod's PID namespace, when the pod has one.
    pub infra_pid: Option<Pid>,
    /// That PID 1 exited: the kernel ended every process of the namespace, and nothing can
    /// be started in it any more (fork into it fails with ENOMEM).
    pub pid_ns_dead: bool,
    pub ns_paths: HashMap<String, String>,
    pub containers: HashMap<String, Ctr>,
    /// Ids whose create is under way (see `service::in_helper`).
    pub creating: std::collections::HashSet<String>,
    /// Pids of the helpers at work (see `service::in_helper`).
    pub helpers: std::collections::HashSet<i32>,
    /// Container inits an exec's helper is joining, with how many: not reaped meanwhile (see
    /// [`ExecHold`]).
    pub exec_holds: HashMap<i32, usize>,
    /// Per container, the slot its execs' helpers take turns in (see `streams::exec_slot`).
    pub exec_slots: HashMap<String, Arc<tokio::sync::Semaphore>>,
    /// Teardown has begun: no create or start begins, none that ends is kept.
    pub shutting_down: bool,
    /// The daemon's record of the pod (KeepRecord), opaque here; empty until kept.
    pub pod_record: Vec<u8>,
    pub reaped: Reaped,
    pub shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// The generation of the pod's state, counted up at each change the daemon follows
    /// (created, started, exited, deleted, PID 1 gone); `Events` callers wait on it.
    pub changes: tokio::sync::watch::Sender<u64>,
}

impl State {
    /// A change the daemon follows: wakes its outstanding `Events` call.
    pub(crate) fn changed(&self) {
        self.changes.send_modify(|g| *g += 1);
    }
}

pub(crate) type Shared = Arc<Mutex<State>>;

pub(crate) fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

impl Options {
    pub fn youki_root(&self) -> PathBuf {
        self.dir.join("youki")
    }
    pub fn container_dir(&self, id: &str) -> PathBuf {
        self.dir.join("containers").join(id)
    }
    pub fn socket(&self) -> PathBuf {
        self.dir.join("monitor.sock")
    }
}

/// Writes `exit.json` atomically (temp file, fsync, rename).
pub(crate) fn record_exit(dir: &Path, exit: &Exit) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join("exit.json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(exit).expect("exit serializes"))?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join("exit.json"))
}

/// The exit a pod's monitor recorded for a container (under the pod directory `pod_dir`),
/// if it recorded one: what the daemon knows of a container whose monitor is gone. The file's
/// format stays this module's business.
pub fn recorded_exit(pod_dir: &Path, container_id: &str) -> Option<Exit> {
    let file = pod_dir
        .join("containers")
        .join(container_id)
        .join("exit.json");
    serde_json::from_slice(&std::fs::read(file).ok()?).ok()
}

/// Whether the kernel OOM-killed something in the container's memory cgroup.
pub(crate) fn oom_killed(bundle: &Path) -> bool {
    let cgroup = std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["linux"]["cgroupsPath"].as_str().map(str::to_string))
        .unwrap_or_default();
    let rel = cgroup.trim_start_matches('/');
    let candidates = [
        (
            PathBuf::from("/sys/fs/cgroup/memory")
                .join(rel)
                .join("memory.oom_control"),
            "oom_kill ",
        ),
        (
            PathBuf::from("/sys/fs/cgroup")
                .join(rel)
                .join("memory.events"),
            "oom_kill ",
        ),
    ];
    for (file, key) in candidates {
        if let Ok(text) = std::fs::read_to_string(&file) {
            return text
                .lines()
                .filter_map(|l| l.strip_prefix(key))
                .any(|n| n.trim().parse::<u64>().unwrap_or(0) > 0);
        }
    }
    false
}

/// A container's init, held from the reaper while an exec's helper joins it: libcontainer
/// finds the init's namespaces, root and cgroup through `/proc/<pid>`, and an init that exits
/// meanwhile stays a zombie, keeping its pid from reuse, until the last hold on it goes. Taken
/// in the step that checks the container runs (nothing is reaped between); dropped, never
/// while the state's lock is held, once the helper has answered.
pub(crate) struct ExecHold {
    state: Shared,
    pid: i32,
    /// The container's exec slot (`streams::exec_slot`), given back with the hold.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl ExecHold {
    /// Holds `pid`, unless it has already exited (a zombie awaiting its reaping gets no new
    /// exec, so holds on it end and it is reaped).
    pub(crate) fn take(
        state: &Shared,
        st: &mut State,
        pid: i32,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Option<ExecHold> {
        if is_zombie(pid) {
            return None;
        }
        *st.exec_holds.entry(pid).or_default() += 1;
        Some(ExecHold {
            state: state.clone(),
            pid,
            _slot: slot,
        })
    }
}

impl Drop for ExecHold {
    fn drop(&mut self) {
        {
            let mut st = self.state.lock().expect("monitor state poisoned");
            if let Some(n) = st.exec_holds.get_mut(&self.pid) {
                *n -= 1;
                if *n == 0 {
                    st.exec_holds.remove(&self.pid);
                }
            }
        }
        // An exit left to wait meanwhile has no SIGCHLD still to come.
        reap(&self.state);
    }
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// The next exited child to reap, if any. With holds, the one the kernel would hand out next
/// unless it is held; when it is (the kernel hands out the oldest first, and a held init is
/// older than most), one of `known` (the pod's processes the monitor knows of: inits, execs,
/// helpers) that has exited and is not held. An orphan the pod left waits for the holds to go
/// (they end with their execs' helpers, and a held zombie gets no new one).
fn next_exit(held: &HashMap<i32, usize>, known: &[i32]) -> Option<WaitStatus> {
    let reaped = |pid: Pid| match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
        Ok(WaitStatus::StillAlive) | Err(_) => None,
        Ok(ws) => Some(ws),
    };
    if held.is_empty() {
        return reaped(Pid::from_raw(-1));
    }
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    let pid = waitid(Id::All, flags).ok()?.pid()?;
    if !held.contains_key(&pid.as_raw()) {
        return reaped(pid);
    }
    known
        .iter()
        .filter(|p| **p > 0 && !held.contains_key(p))
        .find_map(|p| reaped(Pid::from_raw(*p)))
}

/// The pids [`next_exit`] may reap by name while a held exit blocks the kernel's order.
fn known_pids(st: &State) -> Vec<i32> {
    st.containers
        .values()
        .filter(|c| c.phase != Phase::Exited)
        .map(|c| c.pid.as_raw())
        .chain(st.reaped.waiting.keys().copied())
        .chain(st.helpers.iter().copied())
        .chain(st.infra_pid.map(Pid::as_raw))
        .collect()
}

/// Reaps every exited child but those held (see [`ExecHold`]); container exits are recorded,
/// exec exits handed to waiters.
pub(crate) fn reap(state: &Shared) {
    loop {
        let next = {
            let st = state.lock().expect("monitor state poisoned");
            let known = if st.exec_holds.is_empty() {
                Vec::new()
            } else {
                known_pids(&st)
            };
            next_exit(&st.exec_holds, &known)
        };
        let Some(ws) = next else { return };
        let Some(pid) = ws.pid() else { continue };
        let mut st = state.lock().expect("monitor state poisoned");
        if Some(pid) == st.infra_pid {
            tracing::error!(pod = %st.opts.pod_id, "the pod's infra process, PID 1 of its PID namespace, exited: no container can start in the pod any more");
            st.infra_pid = None;
            st.pid_ns_dead = true;
            st.changed();
            continue;
        }
        let dirs: Vec<(String, PathBuf)> = st
            .containers
            .iter()
            .filter(|(_, c)| c.pid == pid && c.phase != Phase::Exited)
            .map(|(id, c)| (id.clone(), c.bundle.clone()))
            .collect();
        if let Some((id, bundle)) = dirs.into_iter().next() {
            let (code, signal) = match ws {
                WaitStatus::Exited(_, c) => (c, 0),
                WaitStatus::Signaled(_, s, _) => (128 + s as i32, s as i32),
                _ => continue,
            };
            let exit = Exit {
                code,
                signal,
                finished_at: now_nanos(),
                oom_killed: signal == 9 && oom_killed(&bundle),
            };
            let cdir = st.opts.container_dir(&id);
            if let Err(e) = record_exit(&cdir, &exit) {
                tracing::error!(container = %id, error = %e, "cannot record exit");
            }
            let c = st.containers.get_mut(&id).expect("listed above");
            c.phase = Phase::Exited;
            c.exit = Some(exit);
            for w in c.waiters.drain(..) {
                let _ = w.send(());
            }
            // After the record: the daemon may take the reported exit as durable.
            st.changed();
            tracing::info!(container = %id, code, signal, "container exited");
            continue;
        }
        st.reaped.deliver(pid.as_raw(), ws);
    }
}

/// `hako monitor`: sets up the pod and serves until shut down. `ready` receives `ok` once the
/// socket is up, or the error that stopped the start-up.
pub fn run(opts: Options, ready: Option<OwnedFd>) -> Result<()> {
    use std::io::Write;
    let mut ready = ready.map(std::fs::File::from);
    let result = start(opts);
    let (state, shutdown_rx) = match result {
        Ok(x) => x,
        Err(e) => {
            if let Some(r) = ready.as_mut() {
                let _ = r.write_all(format!("error: {}\n", e.chain()).as_bytes());
            }
            return Err(e);
        }
    };
    // A pod's handful of fds needs no 1024-event buffer per poll.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_io_events_per_tick(64)
        .build()
        .map_err(|e| Error::sys("runtime", e))?;
    rt.block_on(service::serve(state, shutdown_rx, ready))
}

fn start(opts: Options) -> Result<(Shared, tokio::sync::oneshot::Receiver<()>)> {
    // Orphans of the pod (double-forked daemons, exec children) come back to us.
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| Error::sys("become child subreaper", e))?;
    std::fs::create_dir_all(opts.dir.join("containers"))
        .map_err(|e| Error::io("create", &opts.dir, e))?;
    let (infra_pid, ns_paths) = infra::spawn(&opts)?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let state = State {
        opts,
        infra_pid,
        pid_ns_dead: false,
        ns_paths,
        containers: HashMap::new(),
        creating: Default::default(),
        helpers: Default::default(),
        exec_holds: HashMap::new(),
        exec_slots: HashMap::new(),
        shutting_down: false,
        pod_record: Vec::new(),
        reaped: Reaped::default(),
        shutdown: Some(tx),
        changes: tokio::sync::watch::Sender::new(0),
    };
    Ok((Arc::new(Mutex::new(state)), rx))
}

/// A socket path that fits in `sun_path` (108 bytes) however deep the state dir is: the
/// socket's directory opened and named through `/proc/self/fd/<n>/`. Keep the returned
/// directory open while the path is used.
pub fn short_socket_path(socket: &Path) -> std::io::Result<(std::fs::File, PathBuf)> {
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(socket.parent().unwrap_or(Path::new("/")))?;
    let name = socket.file_name().unwrap_or_default();
    let short = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    Ok((dir, short))
}

/// Closes every descriptor of this process but `keep`, by
/// `close_range` over the gaps; before Linux 5.9, one by one up to the descriptor limit.
///
/// # Safety
/// Whatever owns a descriptor closed here must never use or close it again: call it in a
/// forked child that goes on to use only `keep` and leaves by `_exit` or exec.
pub(crate) unsafe fn close_fds_except(keep: &[i32]) {
    // No allocation: a test calls this in a child forked from a threaded process.
    let mut from = 0u32;
    loop {
        let next = keep
            .iter()
            .filter(|&&fd| fd >= 0 && fd as u32 >= from)
            .map(|&fd| fd as u32)
            .min();
        let last = match next {
            Some(fd) if fd == from => {
                from = fd + 1;
                continue;
            }
            Some(fd) => fd - 1,
            None => u32::MAX,
        };
        // SAFETY: closes descriptors the caller gave up (see above).
        if unsafe { libc::syscall(libc::SYS_close_range, from, last, 0u32) } != 0 {
            let mut lim = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            // SAFETY: fills a local struct.
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
            let end = (lim.rlim_cur.min(1 << 20) as u32).min(last.saturating_add(1));
            for fd in from..end {
                // SAFETY: as above.
                unsafe { libc::close(fd as i32) };
            }
        }
        match next {
            Some(fd) => from = fd + 1,
            None => return,
        }
    }
}

/// Where the monitor keeps the readiness pipe (close-on-exec) while it starts.
pub const READY_FD: i32 = 3;

/// Takes the readiness pipe, which the daemon passes as stdout (so it can spawn the monitor
/// without a pre-exec hook, which would make it fork instead of posix_spawn): the pipe moves to
/// [`READY_FD`] and stdout joins stderr in the monitor's log. The report is one line: `ok
/// <namespace paths as JSON>`, or `error: <cause>`.
pub fn take_ready_pipe() -> Option<OwnedFd> {
    // SAFETY: fds 1 to 3 belong to this process and nothing else in it uses them yet.
    unsafe {
        if libc::dup3(1, READY_FD, libc::O_CLOEXEC) < 0 {
            return None;
        }
        libc::dup2(2, 1);
        Some(OwnedFd::from_raw_fd(READY_FD))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_go_to_their_waiters_and_no_others() {
        let mut r = Reaped::default();
        let exit = |pid| WaitStatus::Exited(Pid::from_raw(pid), 0);
        let mut rx = r.register(7);
        r.deliver(7, exit(7));
        assert_eq!(rx.try_recv(), Ok(exit(7)));
        assert!(r.waiting.is_empty());
        // Exits nobody waits for are not kept: an orphan's exit under a pid a new process
        // reuses is not that process's, whose waiter gets nothing until it is reaped itself.
        for pid in 1..=2560 {
            r.deliver(pid, exit(pid));
        }
        let mut rx = r.register(2560);
        assert!(rx.try_recv().is_err());
        assert!(r.waiting.contains_key(&2560));
    }

    /// The reaper passes over a held exit (an init an exec's helper joins) and takes the
    /// others, by name when the held one is first in the kernel's order; a held one stays a
    /// zombie until released. Run in a child of its own: the
    /// reaper's waits take any child of the process, and other tests fork too.
    #[test]
    fn a_held_exit_stays_a_zombie_while_the_others_are_reaped() {
        let (report_r, report_w) = nix::unistd::pipe().unwrap();
        // SAFETY: the child forks, waits and writes one byte, then _exits.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let code = (|| -> u8 {
                    let spawn = |code: i32| match unsafe { nix::unistd::fork() } {
                        Ok(nix::unistd::ForkResult::Child) => unsafe { libc::_exit(code) },
                        Ok(nix::unistd::ForkResult::Parent { child }) => child.as_raw(),
                        Err(_) => unsafe { libc::_exit(99) },
                    };
                    let (a, b) = (spawn(3), spawn(4));
                    while !(is_zombie(a) && is_zombie(b)) {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    // Whichever exit the kernel hands out first.
                    let peek = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
                    let first = waitid(Id::All, peek).ok().and_then(|w| w.pid());
                    let (first, other) = match first.map(Pid::as_raw) {
                        Some(p) if p == a => (a, b),
                        Some(p) if p == b => (b, a),
                        _ => return 1,
                    };
                    let code_of = |p: i32| if p == a { 3 } else { 4 };
                    let held = |p: i32| HashMap::from([(p, 1)]);
                    // The first held: nothing is reaped in the kernel's order, both stay zombies.
                    if next_exit(&held(first), &[]).is_some()
                        || !is_zombie(first)
                        || !is_zombie(other)
                    {
                        return 2;
                    }
                    // The other, named as a known process, is reaped past it; the held one not.
                    match next_exit(&held(first), &[first, other]) {
                        Some(WaitStatus::Exited(p, c))
                            if p.as_raw() == other && c == code_of(other) => {}
                        _ => return 3,
                    }
                    if next_exit(&held(first), &[first, other]).is_some() || !is_zombie(first) {
                        return 4;
                    }
                    // Released: reaped.
                    match next_exit(&HashMap::new(), &[]) {
                        Some(WaitStatus::Exited(p, c))
                            if p.as_raw() == first && c == code_of(first) =>
                        {
                            0
                        }
                        _ => 5,
                    }
                })();
                let _ = nix::unistd::write(&report_w, &[code]);
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(report_w);
                let mut code = [9u8; 1];
                let n = nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&report_r), &mut code)
                    .unwrap();
                waitpid(child, None).unwrap();
                assert_eq!(&code[..n], &[0], "step that failed (1 to 5, see the test)");
            }
        }
    }

    #[test]
    fn a_forked_child_keeps_only_the_descriptors_it_names() {
        use std::os::fd::AsRawFd;
        let pipes: Vec<(OwnedFd, OwnedFd)> = (0..4)
            .map(|_| nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap())
            .collect();
        let (report_r, report_w) = nix::unistd::pipe().unwrap();
        let fds: Vec<i32> = pipes.iter().map(|(r, _)| r.as_raw_fd()).collect();
        // Kept: the second and the last, between and beyond gaps, and the report pipe.
        let keep = [0, 1, 2, fds[1], fds[3], report_w.as_raw_fd()];
        // SAFETY: the child only checks descriptors, writes to the report pipe and _exits.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                unsafe { close_fds_except(&keep) };
                let mut open = [0u8; 4];
                for (o, &fd) in open.iter_mut().zip(&fds) {
                    *o = (unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0) as u8;
                }
                let _ = nix::unistd::write(&report_w, &open);
                unsafe { libc::_exit(0) }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(report_w);
                let mut open = [9u8; 4];
                let n = nix::unistd::read(report_r.as_raw_fd(), &mut open).unwrap();
                waitpid(child, None).unwrap();
                assert_eq!(&open[..n], &[0, 1, 0, 1]);
            }
        }
    }
}
