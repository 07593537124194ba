//! Bind mounts made once libcontainer has created a container, before it starts: a host
//! directory on /dev (a CSI or device plugin's hostPath `/dev`) and the mounts below it.
//!
//! Why not in the spec: libcontainer 0.7 makes /dev's links (`fd`, `stdin`, `kcore`, `ptmx`,
//! removing a `ptmx` first) and device nodes after the spec's mounts, in whatever is mounted
//! on /dev, where runc skips them for a bind on /dev. Given the host's /dev, that would
//! replace the host's `/dev/ptmx`. So the spec keeps libcontainer's own tmpfs on /dev (the
//! daemon leaves these mounts out of it, `spec::late_mounts`), and here each source is cloned
//! with `open_tree` in the monitor's mount namespace (the host's), then moved onto its
//! destination from inside the container's and given its flags and propagation there, in
//! order, as libcontainer mounts: what a later mount lands on already carries the earlier
//! ones. Destinations resolve inside the container's root, which nothing of the container
//! has run in yet.
//!
//! The same child then sets the propagation of the volumes libcontainer made with the root's
//! instead of their own (`spec::propagation_fixes`).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};

use hako_proto::monitor as pb;
use nix::sched::{setns, CloneFlags};
use nix::unistd::{fork, ForkResult, Pid};

use super::wire::Status;
use crate::mountapi::{
    self, clone_tree, mount_setattr, propagation, unsafe_owned, MountAttr, MOUNT_ATTR_ATIME,
    MOUNT_ATTR_NOATIME, MOUNT_ATTR_NODEV, MOUNT_ATTR_NODIRATIME, MOUNT_ATTR_NOEXEC,
    MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY,
};

fn setattr(tree: &OwnedFd, recursive: bool, attr: &MountAttr, what: &str) -> Result<(), String> {
    mount_setattr(tree, recursive, attr).map_err(|e| format!("set {what}: {e}"))
}

/// The flags of `m`: those of the whole tree, then those of its top mount only (Kubernetes'
/// readOnly, the atime modes, as the spec's bind mounts get them).
fn attrs(m: &pb::LateMount) -> Result<(MountAttr, MountAttr), String> {
    let mut tree = MountAttr {
        propagation: propagation(&m.propagation)?,
        ..Default::default()
    };
    let mut top = MountAttr::default();
    if m.recursive_readonly {
        tree.attr_set |= MOUNT_ATTR_RDONLY;
    }
    if m.readonly {
        top.attr_set |= MOUNT_ATTR_RDONLY;
    }
    for o in &m.options {
        match o.as_str() {
            "noexec" => tree.attr_set |= MOUNT_ATTR_NOEXEC,
            "nodev" => tree.attr_set |= MOUNT_ATTR_NODEV,
            "nosuid" => tree.attr_set |= MOUNT_ATTR_NOSUID,
            "ro" => top.attr_set |= MOUNT_ATTR_RDONLY,
            "noatime" => {
                top.attr_clr |= MOUNT_ATTR_ATIME;
                top.attr_set |= MOUNT_ATTR_NOATIME;
            }
            "nodiratime" => top.attr_set |= MOUNT_ATTR_NODIRATIME,
            o => return Err(format!("option {o:?} is not supported here")),
        }
    }
    Ok((tree, top))
}

/// The mount point `dest` (absolute, no `.` or `..`) below `root` as an O_PATH fd; with
/// `make`, made if missing (its missing parents as directories; itself a directory for a
/// directory tree, else an empty file), else `None` then. Walked one component at a time,
/// never through a symlink: the host's /dev is not the container's to trust, nor are its
/// world-writable directories, and a magic link of /proc (a host-PID pod's /proc/self/fd)
/// would lead out of the container.
fn mount_point(
    root: &OwnedFd,
    dest: &str,
    dir: bool,
    make: bool,
) -> Result<Option<OwnedFd>, String> {
    use nix::fcntl::{openat, OFlag};
    use nix::sys::stat::{mkdirat, Mode};
    let fail = |what: &str, e: nix::Error| format!("{what} the mount point {dest}: {e}");
    let open = |at: &OwnedFd, name: &str, flags: OFlag| {
        openat(
            Some(at.as_raw_fd()),
            name,
            flags | OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(unsafe_owned)
    };
    let parts: Vec<&str> = dest.split('/').filter(|p| !p.is_empty()).collect();
    let Some((last, parents)) = parts.split_last() else {
        return Err(format!("{dest:?} is no mount point"));
    };
    let mut at = root.try_clone().map_err(|e| format!("{dest}: {e}"))?;
    for name in parents {
        at = match open(&at, name, OFlag::O_DIRECTORY) {
            Err(nix::Error::ENOENT) if !make => return Ok(None),
            Err(nix::Error::ENOENT) => {
                match mkdirat(Some(at.as_raw_fd()), *name, Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(nix::Error::EEXIST) => {}
                    Err(e) => return Err(fail("create a directory on the way to", e)),
                }
                open(&at, name, OFlag::O_DIRECTORY)
            }
            r => r,
        }
        .map_err(|e| fail("walk to", e))?;
    }
    let made = match open(&at, last, OFlag::empty()) {
        Err(nix::Error::ENOENT) if !make => return Ok(None),
        Err(nix::Error::ENOENT) if dir => {
            match mkdirat(Some(at.as_raw_fd()), *last, Mode::from_bits_truncate(0o755)) {
                Ok(()) | Err(nix::Error::EEXIST) => open(&at, last, OFlag::empty()),
                Err(e) => return Err(fail("create", e)),
            }
        }
        Err(nix::Error::ENOENT) => {
            match openat(
                Some(at.as_raw_fd()),
                *last,
                OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_WRONLY
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o644),
            ) {
                Ok(fd) => drop(unsafe_owned(fd)),
                Err(nix::Error::EEXIST) => {}
                Err(e) => return Err(fail("create", e)),
            }
            open(&at, last, OFlag::empty())
        }
        r => r,
    }
    .map_err(|e| fail("open", e))?;
    let st = nix::sys::stat::fstat(made.as_raw_fd()).map_err(|e| fail("inspect", e))?;
    if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
        return Err(format!("the mount point {dest} is a symlink"));
    }
    Ok(Some(made))
}

/// Whether the detached tree `tree` is a directory's (else a file's).
fn is_dir(tree: &OwnedFd) -> Result<bool, String> {
    mountapi::is_dir(tree).map_err(|e| format!("inspect: {e}"))
}

fn move_onto(tree: &OwnedFd, target: &OwnedFd, what: &str) -> Result<(), String> {
    mountapi::move_onto(tree, target).map_err(|e| format!("mount {what}: {e}"))
}

/// The root of the mount namespace entered: the container's (setns sets it).
fn container_root() -> Result<OwnedFd, String> {
    use nix::fcntl::OFlag;
    nix::fcntl::open(
        "/",
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map(unsafe_owned)
    .map_err(|e| format!("open the container's root: {e}"))
}

/// What libcontainer mounted below its /dev that the container keeps over a /dev given to
/// it: its own shared memory (never the host's, which any process of the node writes), its
/// message queues, its own terminals, and its console.
/// Only a missing `shm` gets a mount point made (in the directory given: the host's /dev
/// has one); without one of the others the container goes without it.
const OWN: &[&str] = &["shm", "mqueue", "pts", "console"];

/// In the child, inside the container's mount namespace: each clone onto its destination,
/// its propagation and whole-tree flags set before (as the spec's bind would have them from
/// the start; libcontainer's /dev, which they land on, is not shared even under a shared
/// root, so they keep it: tested); its top mount's flags
/// right after it too (a read-only source takes no mount point made below it, as with runc)
/// but for a mount on /dev itself, read-only only once all are in place (a read-only /dev
/// still takes the termination log's mount point).
fn attach(
    root: &OwnedFd,
    mounts: &[pb::LateMount],
    trees: &[OwnedFd],
    flags: &[(MountAttr, MountAttr)],
) -> Result<(), String> {
    if mounts.is_empty() {
        return Ok(());
    }
    // libcontainer's own mounts below /dev, cloned before anything covers them; one a mount
    // given to the container replaces is left under it. Not onto a /dev shared with the
    // host (Bidirectional): a mount moved onto it would be copied to the host's /dev and to
    // every peer (the host's shared memory and terminals would become the container's), so
    // that container has the given /dev's own, as a bind of it gets them with runc.
    let shared_dev = mounts
        .iter()
        .zip(flags)
        .any(|(m, (all, _))| m.destination == "/dev" && all.propagation == libc::MS_SHARED);
    let mut own = Vec::new();
    for name in OWN.iter().filter(|_| !shared_dev) {
        let dest = format!("/dev/{name}");
        if mounts.iter().any(|m| m.destination == dest) {
            continue;
        }
        match clone_tree(
            root.as_raw_fd(),
            &format!("dev/{name}"),
            libc::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(tree) => own.push((dest, tree)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("keep the container's {dest}: {e}")),
        }
    }
    let top_flags = |tree: &OwnedFd, top: &MountAttr, dest: &str| {
        if top.attr_set != 0 || top.attr_clr != 0 {
            setattr(tree, false, top, &format!("the flags of {dest}"))?;
        }
        Ok::<(), String>(())
    };
    for (i, ((m, tree), (all, top))) in mounts.iter().zip(trees).zip(flags).enumerate() {
        let dest = &m.destination;
        setattr(tree, true, all, &format!("the flags of {dest}"))?;
        let target = mount_point(root, dest, is_dir(tree)?, true)?.expect("made");
        move_onto(tree, &target, &format!("{} on {dest}", m.source))?;
        if dest != "/dev" {
            top_flags(tree, top, dest)?;
        }
        // Once the mounts on /dev itself are made (the first, shallowest), the container's
        // own go back on top, before the mounts below /dev that may name paths in them.
        let last_on_dev = mounts.get(i + 1).is_none_or(|n| n.destination != "/dev");
        if m.destination == "/dev" && last_on_dev {
            for (dest, tree) in own.drain(..) {
                let make = dest == "/dev/shm";
                if let Some(target) = mount_point(root, &dest, is_dir(&tree)?, make)? {
                    move_onto(&tree, &target, &format!("the container's own {dest}"))?;
                }
            }
        }
    }
    for ((m, tree), (_, top)) in mounts.iter().zip(trees).zip(flags) {
        if m.destination == "/dev" {
            top_flags(tree, top, &m.destination)?;
        }
    }
    Ok(())
}

/// Sets each volume's propagation as `fixes` say (its whole tree, or only its top mount when
/// other volumes lie below it: theirs is their own), the volume found as libcontainer found
/// its destination: inside the root, through the image's symlinks (nothing of the container
/// has run yet), never through a magic link. A volume that a later mount covers (not found,
/// or no longer a mount's root there) is out of the container's reach and left as it is.
fn fix_propagation(
    root: &OwnedFd,
    fixes: &[pb::PropagationFix],
    propagations: &[u64],
) -> Result<(), String> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    for (f, &propagation) in fixes.iter().zip(propagations) {
        let rel = f.destination.trim_start_matches('/');
        if rel.is_empty() {
            return Err(format!("a volume on {:?} (the root)", f.destination));
        }
        let open = || {
            let how = OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
                .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
            nix::fcntl::openat2(root.as_raw_fd(), rel, how)
        };
        // RESOLVE_IN_ROOT answers EAGAIN when a rename or mount anywhere raced a `..` in the
        // walk (an image's `var/run -> ../run`): tried again, as libpathrs does.
        let mut tries = 0;
        let fd = loop {
            match open() {
                Err(nix::Error::EAGAIN) if tries < 8 => tries += 1,
                r => break r,
            }
        };
        let fd = match fd {
            Ok(fd) => unsafe_owned(fd),
            Err(nix::Error::ENOENT) => continue,
            Err(e) => return Err(format!("find the volume at {}: {e}", f.destination)),
        };
        let attr = MountAttr {
            propagation,
            ..Default::default()
        };
        match mount_setattr(&fd, f.recursive, &attr) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
            Err(e) => return Err(format!("set the propagation of {}: {e}", f.destination)),
            Ok(()) => {}
        }
    }
    Ok(())
}

/// Makes `mounts` (destinations as `spec::late_mounts` gives them: absolute, without `.` or
/// `..`, the first on /dev) in the mount namespace of `init`, the created container's waiting
/// init, then sets the propagation of the volumes `fixes` name. Runs in the monitor's helper
/// (single-threaded); the namespace is entered by a child of its own, so the helper's root and
/// directories stay the host's.
pub(super) fn apply(
    init: Pid,
    container: &str,
    mounts: &[pb::LateMount],
    fixes: &[pb::PropagationFix],
) -> Result<(), Status> {
    if mounts.is_empty() && fixes.is_empty() {
        return Ok(());
    }
    let failed = |e: String| Status::internal(format!("container {container}: {e}"));
    // Read before anything is mounted, once.
    let propagations = fixes
        .iter()
        .map(|f| {
            propagation(&f.propagation).map_err(|e| failed(format!("mount {}: {e}", f.destination)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let flags = mounts
        .iter()
        .map(|m| attrs(m).map_err(|e| failed(format!("mount {}: {e}", m.destination))))
        .collect::<Result<Vec<_>, _>>()?;
    for m in mounts {
        if m.destination.split('/').any(|p| p == "." || p == "..")
            || !(m.destination == "/dev" || m.destination.starts_with("/dev/"))
        {
            return Err(failed(format!(
                "late mount destination {:?} is not below /dev",
                m.destination
            )));
        }
    }
    let ns_path = format!("/proc/{}/ns/mnt", init.as_raw());
    let ns = std::fs::File::open(&ns_path).map_err(|e| failed(format!("open {ns_path}: {e}")))?;
    // The init is the helper's child, so its pid cannot name another process yet; but should
    // this ever be the helper's own namespace (the host's), nothing is mounted.
    let same = |a: &std::fs::File, b: &std::fs::File| {
        use std::os::unix::fs::MetadataExt;
        matches!((a.metadata(), b.metadata()), (Ok(a), Ok(b)) if (a.dev(), a.ino()) == (b.dev(), b.ino()))
    };
    let own_ns = std::fs::File::open("/proc/self/ns/mnt")
        .map_err(|e| failed(format!("open /proc/self/ns/mnt: {e}")))?;
    if same(&ns, &own_ns) {
        return Err(failed(format!(
            "process {init} is in the monitor's mount namespace, not a container's"
        )));
    }
    let mut trees = Vec::with_capacity(mounts.len());
    for m in mounts {
        trees.push(
            clone_tree(libc::AT_FDCWD, &m.source, libc::AT_RECURSIVE).map_err(|e| {
                let msg = format!(
                    "mount {}: clone the mounts at {}: {e}",
                    m.destination, m.source
                );
                match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        Status::not_found(format!("container {container}: {msg}"))
                    }
                    _ => failed(msg),
                }
            })?,
        );
    }
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| failed(format!("pipe: {e}")))?;
    let helper = nix::unistd::getpid();
    // SAFETY: the helper is single-threaded (forked from the single-threaded monitor).
    match unsafe { fork() }.map_err(|e| failed(format!("fork: {e}")))? {
        ForkResult::Child => {
            drop(r);
            // SAFETY: prctl on this process only; it goes with the helper.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            // A helper gone before that: nobody waits for these mounts.
            if nix::unistd::getppid() != helper {
                // SAFETY: leave at once, touching nothing of the parent's.
                unsafe { libc::_exit(1) };
            }
            // A panic must end this process here, reported: unwound, it would reach the
            // helper's own handling as if this were the helper.
            let result = std::panic::catch_unwind(|| {
                setns(&ns, CloneFlags::CLONE_NEWNS)
                    .map_err(|e| format!("enter the container's mount namespace: {e}"))
                    .and_then(|()| {
                        let root = container_root()?;
                        attach(&root, mounts, &trees, &flags)?;
                        fix_propagation(&root, fixes, &propagations)
                    })
            })
            .unwrap_or_else(|_| Err("the mounting process panicked".into()));
            let msg = match result {
                Ok(()) => "ok".to_string(),
                Err(e) => e,
            };
            let _ = std::fs::File::from(w).write_all(msg.as_bytes());
            // SAFETY: leave without running the helper's destructors or atexit handlers.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => {
            drop(w);
            let mut msg = String::new();
            let _ = std::fs::File::from(r).read_to_string(&mut msg);
            let _ = nix::sys::wait::waitpid(child, None);
            match msg.as_str() {
                "ok" => Ok(()),
                "" => Err(failed("the mounting process died".into())),
                // What is on the way (a symlink, a read-only parent) or the kernel: the
                // node's state, not the request's form.
                _ => Err(Status::failed_precondition(format!(
                    "container {container}: {msg}{}",
                    if msg.contains("Function not implemented") {
                        " (mounts on /dev need Linux 5.12: open_tree, move_mount, mount_setattr)"
                    } else {
                        ""
                    }
                ))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn late(readonly: bool, rro: bool, propagation: &str, options: &[&str]) -> pb::LateMount {
        pb::LateMount {
            source: "/dev".into(),
            destination: "/dev".into(),
            readonly,
            recursive_readonly: rro,
            propagation: propagation.into(),
            options: options.iter().map(|o| o.to_string()).collect(),
        }
    }

    #[test]
    fn flags_split_between_the_tree_and_its_top_mount() {
        let (tree, top) = attrs(&late(true, false, "rslave", &["nodev", "noatime"])).unwrap();
        assert_eq!(
            (tree.attr_set, tree.propagation),
            (MOUNT_ATTR_NODEV, libc::MS_SLAVE)
        );
        assert_eq!(
            (top.attr_set, top.attr_clr),
            (MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOATIME, MOUNT_ATTR_ATIME)
        );
        let (tree, top) = attrs(&late(false, true, "", &[])).unwrap();
        assert_eq!(
            (tree.attr_set, tree.propagation, top.attr_set),
            (MOUNT_ATTR_RDONLY, libc::MS_PRIVATE, 0)
        );
        assert!(attrs(&late(false, false, "shared", &[])).is_err());
        assert!(attrs(&late(false, false, "rshared", &["exec"])).is_err());
    }
}
