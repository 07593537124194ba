//! A container that joins an existing PID namespace (its pod's shared one, or another
//! container's for TARGET) gets, until its pivot_root, a /proc of that namespace.
//!
//! Why: on cgroup v1 and hybrid hosts libcontainer 0.7's init, mounting the container's cgroup
//! filesystems (`rootfs/mount.rs`, `mount_cgroup_v1`), reads `/proc/<getppid()>/cgroup`, and
//! its own pid when getppid() is 0. Its parent (the monitor's helper) is outside the joined
//! namespace, so getppid() is 0 and the pid is the init's pid *in that namespace*, looked up in
//! the /proc the init inherited from the helper: the host's. Once the namespace has handed out
//! a few pids that names another host process or none (`NotFound("/proc/11")`) and the create
//! fails with "failed to prepare rootfs". (An init with a PID namespace of its own is pid 1 and
//! finds the host's init; one in the host's namespace finds its real parent.)
//!
//! So the container's mount namespace is made here instead of being unshared by the init: a
//! process forked into the joined PID namespace unshares one and mounts that namespace's procfs
//! on /proc, and the spec names it, so the init enters it (where it would have unshared a copy
//! of the helper's) and finds itself in /proc. The rest of the tree is the copy the init would
//! have made; the helper, libcontainer's intermediate process and the hooks it runs in the
//! runtime's namespaces keep the host's /proc.

use std::io::{BufRead, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{open, OFlag};
use nix::mount::{mount, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::stat::Mode;
use nix::unistd::{fork, ForkResult};

use crate::error::{Error, Result};

/// The prepared mount namespace, named in the bundle's config.json while this lives; dropping
/// it puts back the daemon's config.json.
pub(super) struct MountNs {
    /// Held so the namespace outlives the process that made it; the spec names it through
    /// this process's fd table.
    _ns: Option<OwnedFd>,
    config: PathBuf,
    original: Vec<u8>,
}

impl Drop for MountNs {
    fn drop(&mut self) {
        if let Err(e) = replace(&self.config, &self.original) {
            tracing::warn!(file = %self.config.display(), error = %e, "restore the container's spec");
        }
    }
}

/// When the bundle's spec joins a PID namespace by path and would unshare a mount namespace,
/// prepares that mount namespace and names it in the spec; `target_ns`, a descriptor of this
/// process, is named as the PID namespace instead of the spec's path (a PID target's, opened
/// by the monitor while its pid was known to be the target's). Runs in the throwaway helper
/// that then calls libcontainer; keep the result alive until libcontainer's create returns.
pub(super) fn prepare(bundle: &Path, target_ns: Option<RawFd>) -> Result<Option<MountNs>> {
    let config = bundle.join("config.json");
    let original = std::fs::read(&config).map_err(|e| Error::io("read", &config, e))?;
    let mut spec: serde_json::Value = serde_json::from_slice(&original)
        .map_err(|e| Error::sys(format!("parse {}", config.display()), e))?;
    let Some(namespaces) = spec
        .pointer_mut("/linux/namespaces")
        .and_then(|n| n.as_array_mut())
    else {
        return Ok(None);
    };
    let of_type = |n: &serde_json::Value, t: &str| n["type"].as_str() == Some(t);
    // The pod's user namespace, when the container joins one: the mount namespace is made in
    // it (its init, that namespace's root, could not enter one of the host's).
    let userns = namespaces
        .iter()
        .find(|n| of_type(n, "user"))
        .and_then(|n| n["path"].as_str())
        .map(str::to_string);
    // Named through this process's pid, not `self`: the process that opens a path may be
    // another (libcontainer's intermediate process, the init). In a user namespace through
    // `self`: the init, that namespace's root, may not look into this process's fd table, and
    // has a copy of it (a descendant that has not exec'd).
    let own_fd = |fd: RawFd| {
        serde_json::json!(match userns {
            Some(_) => format!("/proc/self/fd/{fd}"),
            None => format!("/proc/{}/fd/{fd}", std::process::id()),
        })
    };
    let Some(pid_entry) = namespaces
        .iter_mut()
        .find(|n| of_type(n, "pid") && n.get("path").is_some())
    else {
        return Ok(None);
    };
    if let Some(fd) = target_ns {
        pid_entry["path"] = own_fd(fd);
    }
    let pid_ns = pid_entry["path"].as_str().unwrap_or_default().to_string();
    let ns = match namespaces
        .iter_mut()
        .find(|n| of_type(n, "mount") && n.get("path").is_none())
    {
        Some(mnt) => {
            let ns = mount_ns_with_proc_of(&pid_ns, userns.as_deref())?;
            mnt["path"] = own_fd(ns.as_raw_fd());
            Some(ns)
        }
        None if target_ns.is_some() => None,
        None => return Ok(None),
    };
    let edited = serde_json::to_vec(&spec).expect("a parsed spec serializes");
    replace(&config, &edited).map_err(|e| Error::io("write", &config, e))?;
    Ok(Some(MountNs {
        _ns: ns,
        config,
        original,
    }))
}

/// Writes `bytes` to `path` through a temp file and a rename (never a half-written spec),
/// keeping the file's mode.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("json.tmp");
    // Never through a link left there (the bundle of a pod with a user namespace is its
    // root's): a new file of this process's.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(&tmp)?;
    if let Ok(md) = std::fs::metadata(path) {
        f.set_permissions(md.permissions())?;
    }
    f.write_all(bytes)?;
    std::fs::rename(&tmp, path)
}

/// A new mount namespace, a copy of this process's, with the procfs of the PID namespace at
/// `pid_ns` on /proc.
fn mount_ns_with_proc_of(pid_ns: &str, userns: Option<&str>) -> Result<OwnedFd> {
    let open_ns = |p: &str| {
        open(p, OFlag::O_RDONLY | OFlag::O_CLOEXEC, Mode::empty())
            .map(|fd| {
                // SAFETY: open just returned this fd; nothing else owns it.
                unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) }
            })
            .map_err(|e| Error::sys(format!("open {p}"), e))
    };
    let target = open_ns(pid_ns)?;
    let own = open_ns("/proc/self/ns/pid")?;
    let user = userns.map(open_ns).transpose()?;
    let pipe = || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| Error::sys("pipe", e));
    let (ready_r, ready_w) = pipe()?;
    let (hold_r, hold_w) = pipe()?;
    setns(&target, CloneFlags::CLONE_NEWPID)
        .map_err(|e| Error::sys(format!("join PID namespace {pid_ns}"), e))?;
    // SAFETY: the helper is single-threaded (forked from the single-threaded monitor).
    let forked = unsafe { fork() };
    if let Ok(ForkResult::Child) = forked {
        drop(ready_r);
        drop(hold_w);
        mounter(ready_w, hold_r, user)
    }
    // What this process forks next (libcontainer's intermediate process) must be born in our
    // own PID namespace, as libcontainer expects: the init pid it reports is then the one the
    // monitor waits for and signals.
    let restored = setns(&own, CloneFlags::CLONE_NEWPID);
    let child = match forked {
        Ok(ForkResult::Parent { child }) => child,
        Ok(ForkResult::Child) => unreachable!("the child never returns"),
        // The kernel answers ENOMEM for a PID namespace whose init has exited.
        Err(nix::errno::Errno::ENOMEM) => return Err(Error::PidNsGone),
        Err(e) => return Err(Error::sys(format!("fork into PID namespace {pid_ns}"), e)),
    };
    drop(ready_w);
    drop(hold_r);
    let mut report = String::new();
    let _ = std::io::BufReader::new(std::fs::File::from(ready_r)).read_line(&mut report);
    let result = match (restored, report.trim_end()) {
        (Err(e), _) => Err(Error::sys("return to the monitor's PID namespace", e)),
        (Ok(()), "ok") => open_ns(&format!("/proc/{}/ns/mnt", child.as_raw())),
        (Ok(()), r) => Err(Error::Helper(format!(
            "mount the procfs of PID namespace {pid_ns}: {}",
            r.strip_prefix('E').unwrap_or("the mounting process died")
        ))),
    };
    // The namespace is held by `result`'s fd now (or not needed): let the process go.
    drop(hold_w);
    let _ = nix::sys::wait::waitpid(child, None);
    result
}

/// Runs in the child forked into the joined PID namespace: never returns.
fn mounter(ready: OwnedFd, hold: OwnedFd, user: Option<OwnedFd>) -> ! {
    let setup = || -> Result<()> {
        if let Some(user) = user {
            setns(user, CloneFlags::CLONE_NEWUSER)
                .map_err(|e| Error::sys("enter the pod's user namespace", e))?;
        }
        unshare(CloneFlags::CLONE_NEWNS).map_err(|e| Error::sys("unshare mount namespace", e))?;
        // Only our copy of the /proc mount leaves its peer group, so the procfs mounted on it
        // stays here; the rest of the tree keeps the propagation libcontainer then sets.
        mount(
            None::<&str>,
            "/proc",
            None::<&str>,
            MsFlags::MS_PRIVATE,
            None::<&str>,
        )
        .map_err(|e| Error::sys("make /proc private", e))?;
        mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(|e| Error::sys("mount proc", e))
    };
    let msg = match setup() {
        Ok(()) => "ok\n".to_string(),
        Err(e) => format!("E{}\n", e.chain().replace('\n', " ")),
    };
    let _ = std::fs::File::from(ready).write_all(msg.as_bytes());
    // Stay until the helper holds the namespace (it closes the pipe).
    let _ = std::fs::File::from(hold).read(&mut [0u8; 1]);
    // SAFETY: leave without running the parent's destructors or atexit handlers.
    unsafe { libc::_exit(0) }
}
