//! The pod's namespaces, with no pause image: the monitor forks an infra process that
//! unshares the namespaces the pod gets of its own (network, IPC, UTS, and PID when the pod
//! shares one), sets the hostname, brings up loopback and applies network sysctls. The monitor
//! then bind-mounts the network and PID namespace files under `<pod dir>/ns/` and holds the
//! IPC and UTS ones open (see `hold_by_fd`); containers join them all by path.
//! With a pod PID namespace the infra process is its PID 1: it reaps the orphans of the pod.
//! Without one it exits as soon as the namespaces are held, so an idle pod is the monitor
//! alone; a pod that shares every namespace with the host forks nothing.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;

use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult, Pid};
use serde::{Deserialize, Serialize};

use super::Options;
use crate::error::{Error, Result};

/// Which namespaces the pod gets of its own (false: the host's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceSet {
    pub network: bool,
    pub ipc: bool,
    pub uts: bool,
    pub pid: bool,
}

/// A pod's user namespace: container IDs from 0 mapped to `length` host IDs from `host_id`,
/// for users and for groups (CRI's mode POD, one mapping each, as kubelet gives it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserNs {
    pub uid: IdRange,
    pub gid: IdRange,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    pub host_id: u32,
    pub length: u32,
}

/// Makes the pod's user namespace and pins it at `<dir>/ns/user`: a child unshares it and
/// waits while this process (root in the host's) writes its maps, then goes; the pin holds
/// the namespace. Made before the infra process, which enters it before making the others,
/// so that the pod's network, IPC, UTS and PID namespaces are its (sysfs, proc and mqueue are
/// mountable in the containers, the pod's sysctls are its root's).
fn make_userns(dir: &Path, u: &UserNs) -> Result<String> {
    let (ready_r, ready_w) = nix::unistd::pipe().map_err(|e| Error::sys("pipe", e))?;
    let (done_r, done_w) = nix::unistd::pipe().map_err(|e| Error::sys("pipe", e))?;
    // SAFETY: called before the monitor starts any thread.
    let child = match unsafe { fork() }.map_err(|e| Error::sys("fork", e))? {
        ForkResult::Child => {
            drop(ready_r);
            drop(done_w);
            let mut ready = std::fs::File::from(ready_w);
            let ok = unshare(CloneFlags::CLONE_NEWUSER).is_ok();
            let _ = ready.write_all(if ok { b"k" } else { b"E" });
            drop(ready);
            // Until the monitor has pinned the namespace (it closes its end).
            let _ = std::fs::File::from(done_r).read(&mut [0u8; 1]);
            // SAFETY: leave at once; the monitor reaps this process.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => child,
    };
    drop(ready_w);
    drop(done_r);
    let made = (|| {
        let mut b = [0u8; 1];
        let n = std::fs::File::from(ready_r)
            .read(&mut b)
            .map_err(|e| Error::sys("read user namespace report", e))?;
        if n != 1 || b[0] != b'k' {
            return Err(Error::Helper(
                "unshare the pod's user namespace failed".into(),
            ));
        }
        let proc = format!("/proc/{}", child.as_raw());
        for (file, r) in [("uid_map", u.uid), ("gid_map", u.gid)] {
            let path = format!("{proc}/{file}");
            std::fs::write(&path, format!("0 {} {}\n", r.host_id, r.length))
                .map_err(|e| Error::io("write", Path::new(&path), e))?;
        }
        let ns_dir = dir.join("ns");
        std::fs::create_dir_all(&ns_dir).map_err(|e| Error::io("create", &ns_dir, e))?;
        pin_one(&ns_dir, child, "user", "user")
    })();
    drop(done_w);
    let _ = waitpid(child, None);
    made
}

/// Sets IFF_UP on `lo` in the current network namespace.
fn loopback_up() -> Result<()> {
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    // SAFETY: plain socket/ioctl calls on a struct laid out as the kernel's ifreq.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(Error::sys("socket", std::io::Error::last_os_error()));
        }
        let mut req = IfReq {
            name: [0; 16],
            flags: 0,
            _pad: [0; 22],
        };
        req.name[..2].copy_from_slice(b"lo");
        let r = if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) < 0 {
            Err(Error::sys("get lo flags", std::io::Error::last_os_error()))
        } else {
            req.flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) < 0 {
                Err(Error::sys("set lo up", std::io::Error::last_os_error()))
            } else {
                Ok(())
            }
        };
        libc::close(fd);
        r
    }
}

fn set_sysctl(key: &str, value: &str) -> Result<()> {
    let path = Path::new("/proc/sys").join(key.replace('.', "/"));
    std::fs::write(&path, value).map_err(|e| Error::sys(format!("sysctl {key}={value}"), e))
}

/// Runs in the forked child: never returns. `monitor` is a pidfd of the monitor, opened by
/// it before the fork: should the monitor die before this process asks for its parent, that
/// parent is the host's init (never the monitor again), and a parent-death signal or a pidfd
/// taken from `getppid()` would tie the pod's PID 1 to init, which never exits (seen: a pod's
/// PID 1 left for an hour after churn's monitor kills).
fn infra_child(opts: &Options, monitor: libc::c_int, mut report: std::fs::File) -> ! {
    // With the monitor from the start, and gone at once if it is gone already.
    die_with_monitor(monitor);
    // Tests widen the window in which the monitor may die before the pod's PID 1 exists.
    if let Some(ms) = std::env::var("HAKO_TEST_INFRA_STALL_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    // The daemon's readiness pipe is the monitor's to answer, not ours to hold open.
    // SAFETY: closing an fd this process does not otherwise use.
    unsafe { libc::close(super::READY_FD) };
    let ns = opts.namespaces;
    let setup = || -> Result<()> {
        if opts.userns.is_some() {
            let path = opts.dir.join("ns").join("user");
            let f = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
            setns(f, CloneFlags::CLONE_NEWUSER)
                .map_err(|e| Error::sys("enter the pod's user namespace", e))?;
        }
        let mut flags = CloneFlags::empty();
        if ns.network {
            flags |= CloneFlags::CLONE_NEWNET;
        }
        if ns.ipc {
            flags |= CloneFlags::CLONE_NEWIPC;
        }
        if ns.uts {
            flags |= CloneFlags::CLONE_NEWUTS;
        }
        unshare(flags).map_err(|e| Error::sys("unshare pod namespaces", e))?;
        if ns.uts && !opts.hostname.is_empty() {
            nix::unistd::sethostname(&opts.hostname)
                .map_err(|e| Error::sys(format!("set hostname {:?}", opts.hostname), e))?;
        }
        if ns.network {
            loopback_up()?;
        }
        for (k, v) in &opts.sysctls {
            set_sysctl(k, v)?;
        }
        if ns.pid {
            unshare(CloneFlags::CLONE_NEWPID)
                .map_err(|e| Error::sys("unshare pid namespace", e))?;
        }
        Ok(())
    };
    if let Err(e) = setup() {
        let _ = writeln!(report, "E{}", e.chain());
        std::process::exit(1);
    }
    if ns.pid {
        // The first child in the new PID namespace is its init. Cloned as the monitor's own
        // child (CLONE_PARENT), so it can die with the monitor (PR_SET_PDEATHSIG fires when
        // the parent goes): a pod's init never outlives the monitor that answers for it, and
        // no one has to search for it afterwards.
        // With CLONE_PARENT the new init's parent is this process's: the monitor, held by
        // the pidfd it opened before forking (the child, in its new PID namespace, cannot name
        // it by pid). Checked again right before the clone: a monitor gone since would make
        // the host's init the new process's parent.
        die_with_monitor(monitor);
        // SAFETY: a fork-like clone (no new stack, no shared memory) of a single-threaded
        // process; the child only makes system calls.
        let child = unsafe {
            libc::syscall(
                libc::SYS_clone,
                (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        };
        match child {
            0 => {
                die_with_monitor(monitor);
                // In a user namespace, an ID it maps (kubelet's map 65536).
                let id = opts.userns.map_or(POD_INIT_ID, |u| {
                    POD_INIT_ID.min(u.uid.length.min(u.gid.length).saturating_sub(1))
                });
                if let Err(e) = confine(id) {
                    let _ = writeln!(report, "Econfine the pod's PID 1: {}", e.chain());
                    // SAFETY: leave at once; the monitor reaps this process.
                    unsafe { libc::_exit(1) };
                }
                // The credential change cleared the parent-death signal: set it again.
                die_with_monitor(monitor);
                drop(report);
                // Nothing the monitor holds (its listener, the pod's descriptors) stays
                // reachable through this process, whose /proc entries the pod can read.
                // SAFETY: this process owns no descriptor it uses after this point.
                unsafe { super::close_fds_except(&[]) };
                wait_forever()
            }
            c if c > 0 => {
                let _ = writeln!(report, "P{c}");
                std::process::exit(0);
            }
            _ => {
                let e = std::io::Error::last_os_error();
                let _ = writeln!(report, "Efork pod init: {e}");
                std::process::exit(1);
            }
        }
    } else {
        let _ = writeln!(report, "P{}", std::process::id());
    }
    drop(report);
    wait_forever()
}

/// Sets the parent-death signal and leaves at once if the monitor (the pidfd `monitor`) is
/// already gone, when the signal can no longer come (a pidfd polls readable once its process
/// has exited).
fn die_with_monitor(monitor: libc::c_int) {
    // SAFETY: prctl on this process only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if monitor >= 0 {
        let mut p = libc::pollfd {
            fd: monitor,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd on a descriptor this process holds; no waiting.
        if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
            // SAFETY: leave at once, as the signal would have made it.
            unsafe { libc::_exit(1) };
        }
    }
}

/// The uid and gid of the pod's PID 1, as of kubelet's pause container.
const POD_INIT_ID: u32 = 65535;

/// Confines the pod's PID 1, which lives as long as the pod and which every container of the
/// pod sees: its `/proc/1/mountinfo` is readable by any of them, and its `root`, `cwd` and
/// memory by one granted CAP_SYS_PTRACE. Left as forked from the monitor it would be root with
/// every capability in the host's mount namespace, so those would hand a container the node's
/// mount table and its root filesystem. Like a pause container it gets an empty read-only root
/// of its own, uid and gid 65535 with no capability (bounding set included), no new
/// privileges, and it is not dumpable.
fn confine(id: u32) -> Result<()> {
    scrub_cmdline_and_environ()?;
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| Error::sys("unshare mount namespace", e))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| Error::sys("make mounts private", e))?;
    // Any directory every host has will do as the mount point: the host's tree goes below.
    let root = "/proc";
    mount(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=4k,nr_inodes=4,mode=0555"),
    )
    .map_err(|e| Error::sys("mount an empty root", e))?;
    nix::unistd::chdir(root).map_err(|e| Error::sys("enter the empty root", e))?;
    // pivot_root(".", "."): the old root ends up stacked on the new one, and goes.
    nix::unistd::pivot_root(".", ".").map_err(|e| Error::sys("pivot_root", e))?;
    nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| Error::sys("detach the host's root", e))?;
    nix::unistd::chdir("/").map_err(|e| Error::sys("chdir /", e))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| Error::sys("make the root read-only", e))?;
    // Every capability out of the bounding set while CAP_SETPCAP is still held; the kernel
    // answers EINVAL past the last one it knows.
    for cap in 0.. {
        // SAFETY: prctl on this process only.
        if unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) && cap > 0 {
                break;
            }
            return Err(Error::sys(format!("drop capability {cap}"), e));
        }
    }
    nix::unistd::setgroups(&[]).map_err(|e| Error::sys("setgroups", e))?;
    let gid = nix::unistd::Gid::from_raw(id);
    nix::unistd::setresgid(gid, gid, gid).map_err(|e| Error::sys("setresgid", e))?;
    let uid = nix::unistd::Uid::from_raw(id);
    // From root to another uid without keep-caps: permitted and effective sets are cleared.
    nix::unistd::setresuid(uid, uid, uid).map_err(|e| Error::sys("setresuid", e))?;
    // SAFETY: prctl on this process only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(Error::sys(
            "no new privileges",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: prctl on this process only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0) } != 0 {
        return Err(Error::sys("not dumpable", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Blanks what `/proc/1/cmdline` and `/proc/1/environ` show of the pod's PID 1, a fork of the
/// monitor that never execs: the monitor's options (the pod's directory under hako's state)
/// and the daemon's environment (proxy credentials, say), which any container of the pod
/// reads, or one with CAP_SYS_PTRACE. Its argv[0] stays. The kernel shows these from the
/// process's own memory, where its arguments and environment were laid out at exec; nothing
/// in this process reads them again.
fn scrub_cmdline_and_environ() -> Result<()> {
    // As bytes: the command name need not be UTF-8.
    let stat = std::fs::read("/proc/self/stat")
        .map_err(|e| Error::io("read", Path::new("/proc/self/stat"), e))?;
    let stat = String::from_utf8_lossy(&stat);
    // Fields 48 to 51 (arg_start, arg_end, env_start, env_end), counted after the command
    // name, which may hold spaces: there field 3 (the state) comes first, so field 48 is the
    // 46th.
    let fields: Vec<Option<usize>> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(|f| f.parse().ok()).collect())
        .unwrap_or_default();
    let [arg_start, arg_end, env_start, env_end] = match fields.get(45..49) {
        Some(&[Some(a), Some(b), Some(c), Some(d)]) if a < b && c <= d => [a, b, c, d],
        _ => return Err(Error::Helper(format!("unexpected /proc/self/stat: {stat}"))),
    };
    // SAFETY: the ranges are this process's argument and environment strings as the kernel
    // reports them, writable stack memory that nothing reads after this.
    unsafe {
        let args = std::slice::from_raw_parts_mut(arg_start as *mut u8, arg_end - arg_start);
        let first = args
            .iter()
            .position(|&b| b == 0)
            .map_or(args.len(), |n| n + 1);
        args[first..].fill(0);
        std::ptr::write_bytes(env_start as *mut u8, 0, env_end - env_start);
    }
    Ok(())
}

/// The rest of an infra process's life: it reaps whatever the pod's PID namespace orphans.
///
/// SIGCHLD is blocked and waited for: at its default disposition the kernel drops it for a
/// namespace's init (which has no children of its own, so a plain `waitpid` fails at once and
/// `pause` would never return), and the pod's orphans would stay zombies, counted against
/// its pids limit.
fn wait_forever() -> ! {
    // SAFETY: sigset operations on a local set, and this process's own signal mask.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        set
    };
    loop {
        // Every child that has ended, then wait for the next end.
        while let Ok(s) = waitpid(
            Pid::from_raw(-1),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        ) {
            if s == WaitStatus::StillAlive {
                break;
            }
        }
        // SAFETY: waits for a signal of a set this function owns; the info is not needed.
        unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
    }
}

/// Starts the infra process and pins its namespaces; returns the pid of the pod's init (only
/// with a pod PID namespace: it lives as long as the pod) and the namespace paths containers
/// join ("network", "ipc", "uts", "pid").
pub fn spawn(opts: &Options) -> Result<(Option<Pid>, HashMap<String, String>)> {
    let ns = opts.namespaces;
    if !(ns.network || ns.ipc || ns.uts || ns.pid) && opts.sysctls.is_empty() {
        return Ok((None, HashMap::new()));
    }
    let user = match &opts.userns {
        Some(u) => Some(make_userns(&opts.dir, u)?),
        None => None,
    };
    let spawned = spawn_infra(opts);
    match (spawned, user) {
        (Ok((pid, mut paths)), Some(user)) => {
            paths.insert("user".to_string(), user);
            Ok((pid, paths))
        }
        (Err(e), Some(_)) => {
            unpin_files(&opts.dir, &["user"]);
            Err(e)
        }
        (r, None) => r,
    }
}

fn spawn_infra(opts: &Options) -> Result<(Option<Pid>, HashMap<String, String>)> {
    let ns = opts.namespaces;
    let (r, w) = nix::unistd::pipe().map_err(|e| Error::sys("pipe", e))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let me = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) } as libc::c_int;
    if me < 0 {
        return Err(Error::sys("pidfd_open", std::io::Error::last_os_error()));
    }
    // SAFETY: a new fd, ours alone; closed in the monitor once the fork is made.
    let me = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(me) };
    // SAFETY: called before the monitor starts any thread.
    let pid = match unsafe { fork() }.map_err(|e| Error::sys("fork infra", e))? {
        ForkResult::Child => {
            drop(r);
            infra_child(
                opts,
                std::os::fd::AsRawFd::as_raw_fd(&me),
                std::fs::File::from(w),
            )
        }
        ForkResult::Parent { child } => child,
    };
    drop(me);
    drop(w);
    let mut msg = String::new();
    std::fs::File::from(r)
        .read_to_string(&mut msg)
        .map_err(|e| Error::sys("read infra report", e))?;
    // "P<pid>" from whoever made the pod's init, then "E<error>" if the init failed to
    // confine itself (it has exited then), or "E<error>" alone.
    let made = msg.lines().find_map(|l| l.strip_prefix('P'));
    let failed = msg.lines().find_map(|l| l.strip_prefix('E'));
    let infra = match (made.map(str::parse::<i32>), failed) {
        (Some(Ok(p)), None) => Pid::from_raw(p),
        (made, failed) => {
            let _ = waitpid(pid, None);
            if let Some(Ok(p)) = made {
                if p != pid.as_raw() {
                    // The pod's init, the monitor's child too (CLONE_PARENT).
                    let _ =
                        nix::sys::signal::kill(Pid::from_raw(p), nix::sys::signal::Signal::SIGKILL);
                    let _ = waitpid(Pid::from_raw(p), None);
                }
            }
            return Err(Error::Helper(match failed {
                Some(e) => e.to_string(),
                None if made.is_some() => format!("infra report {:?}", msg.trim()),
                None => "infra process died".to_string(),
            }));
        }
    };
    if infra != pid {
        // The intermediate exits once pid 1 of the pod namespace exists.
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, 0)) => {}
            other => return Err(Error::Helper(format!("infra intermediate: {other:?}"))),
        }
    }
    let pinned = pin(opts, infra).and_then(|mut paths| {
        hold_by_fd(opts, infra)?.into_iter().for_each(|(k, v)| {
            paths.insert(k, v);
        });
        Ok(paths)
    });
    if pinned.is_err() || !ns.pid {
        // The pins and the monitor now hold the namespaces; nothing needs the process.
        let _ = nix::sys::signal::kill(infra, nix::sys::signal::Signal::SIGKILL);
        let _ = waitpid(infra, None);
    }
    match pinned {
        Ok(paths) => Ok((ns.pid.then_some(infra), paths)),
        Err(e) => {
            unpin(&opts.dir);
            Err(e)
        }
    }
}

/// Pins the network and PID namespaces with bind mounts under `<pod dir>/ns/`: the network
/// one outlives the monitor (CNI DEL after a monitor is lost, or after a restart, needs its
/// path), the PID one is named by path in a spec.
fn pin(opts: &Options, infra: Pid) -> Result<HashMap<String, String>> {
    let ns = opts.namespaces;
    let mut paths = HashMap::new();
    if !(ns.network || ns.pid) {
        return Ok(paths);
    }
    let ns_dir = opts.dir.join("ns");
    std::fs::create_dir_all(&ns_dir).map_err(|e| Error::io("create", &ns_dir, e))?;
    for (kind, file, wanted) in [("network", "net", ns.network), ("pid", "pid", ns.pid)] {
        if wanted {
            paths.insert(kind.to_string(), pin_one(&ns_dir, infra, kind, file)?);
        }
    }
    Ok(paths)
}

/// Pins process `pid`'s namespace `file` (of `kind`, for errors) at `<ns_dir>/<file>` with a
/// bind mount; its path.
fn pin_one(ns_dir: &Path, pid: Pid, kind: &str, file: &str) -> Result<String> {
    let target = ns_dir.join(file);
    std::fs::File::create(&target).map_err(|e| Error::io("create", &target, e))?;
    let source = format!("/proc/{}/ns/{file}", pid.as_raw());
    mount(
        Some(source.as_str()),
        &target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| Error::sys(format!("pin {kind} namespace at {}", target.display()), e))?;
    Ok(target.to_string_lossy().into_owned())
}

/// The pod's IPC and UTS namespaces are held by descriptors the monitor keeps open, not by
/// bind mounts: two fewer mounts per pod in every mountinfo on the node, which libcontainer
/// reads a dozen times per container create on cgroup v1 under the node-wide mount lock, and
/// two fewer unmounts at stop. Nothing needs them once the monitor is gone (a lost monitor's
/// pod is released). Containers join them by `/proc/self/fd/<n>`: a container's init is a
/// descendant of the monitor (through its forked helper and libcontainer's clones, none of
/// which exec before the namespaces are joined), so it has the same descriptor at the same
/// number, and the path can name nothing else. The monitor itself stays in the namespaces it
/// was started in (the runtime's), where OCI hooks run.
fn hold_by_fd(opts: &Options, infra: Pid) -> Result<HashMap<String, String>> {
    use std::os::fd::AsRawFd;
    let ns = opts.namespaces;
    let mut paths = HashMap::new();
    let mut held = Vec::new();
    // In a user namespace, the network and PID ones too (as "network-held", "pid-held"):
    // libcontainer joins them after it has become the namespace's root, which the path to
    // their pins (owner only, the host's root's) does not let through.
    let user = opts.userns.is_some();
    for (kind, file, wanted) in [
        ("ipc", "ipc", ns.ipc),
        ("uts", "uts", ns.uts),
        ("network-held", "net", user && ns.network),
        ("pid-held", "pid", user && ns.pid),
    ] {
        if !wanted {
            continue;
        }
        let source = format!("/proc/{}/ns/{file}", infra.as_raw());
        let f = std::fs::File::open(&source).map_err(|e| Error::io("open", &source, e))?;
        paths.insert(kind.to_string(), format!("/proc/self/fd/{}", f.as_raw_fd()));
        held.push(f);
    }
    HELD.set(held)
        .map_err(|_| Error::Helper("the pod's namespaces are held already".into()))?;
    Ok(paths)
}

/// The pod's IPC and UTS namespaces, for as long as the monitor lives.
static HELD: std::sync::OnceLock<Vec<std::fs::File>> = std::sync::OnceLock::new();

/// The descriptors holding the pod's namespaces, which containers join by number: a helper
/// that closes what it does not use keeps these.
pub(super) fn held_fds() -> impl Iterator<Item = std::os::fd::RawFd> {
    use std::os::fd::AsRawFd;
    HELD.get().into_iter().flatten().map(|f| f.as_raw_fd())
}

/// Releases pinned namespaces (unmounts the bind mounts; `ipc` and `uts` too, which monitors
/// of earlier builds pinned).
pub fn unpin(dir: &Path) {
    unpin_files(dir, &["net", "ipc", "uts", "pid", "user"]);
}

/// Releases the pinned namespaces but the network one, which CNI DEL is still to be run in
/// (a pod whose monitor is lost keeps it until StopPodSandbox has run DEL).
pub fn unpin_all_but_network(dir: &Path) {
    unpin_files(dir, &["ipc", "uts", "pid", "user"]);
    // Only a pin that still holds the namespace: a plain file left where one was (its mount
    // gone with a reboot, the state dir kept) would be handed to DEL as a namespace path,
    // which plugins refuse, and the stop would fail for good.
    let net = dir.join("ns").join("net");
    if net.exists() && !is_namespace(&net) {
        let _ = std::fs::remove_file(&net);
    }
}

/// Whether `path` is a namespace file (on nsfs, as a pin's bind mount is).
fn is_namespace(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

fn unpin_files(dir: &Path, files: &[&str]) {
    for file in files {
        let p = dir.join("ns").join(file);
        if p.exists() {
            if let Err(e) = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH) {
                tracing::warn!(path = %p.display(), error = %e, "unpin namespace");
            }
            let _ = std::fs::remove_file(&p);
        }
    }
}
