//! The new mount API's calls (Linux 5.12: `open_tree`, `mount_setattr`, `move_mount`), which
//! libc wraps as bare syscalls, for the monitor's late mounts and the daemon's staged volumes.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

pub const OPEN_TREE_CLONE: libc::c_uint = 1;
pub const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;
pub const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
pub const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub const MOUNT_ATTR_NODEV: u64 = 0x4;
pub const MOUNT_ATTR_NOEXEC: u64 = 0x8;
pub const MOUNT_ATTR_ATIME: u64 = 0x70;
pub const MOUNT_ATTR_NOATIME: u64 = 0x10;
pub const MOUNT_ATTR_NODIRATIME: u64 = 0x80;
pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// mount_setattr(2)'s argument.
#[repr(C)]
#[derive(Default)]
pub struct MountAttr {
    pub attr_set: u64,
    pub attr_clr: u64,
    pub propagation: u64,
    pub userns_fd: u64,
}

/// A detached copy of the mount at `path` (relative to `dir`), as a bind mount of it would
/// be; `flags` add to OPEN_TREE_CLONE (AT_RECURSIVE: the mounts below it too).
pub fn clone_tree(dir: RawFd, path: &str, flags: libc::c_int) -> std::io::Result<OwnedFd> {
    let path = CString::new(path).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    let flags = OPEN_TREE_CLONE | (libc::O_CLOEXEC | flags) as libc::c_uint;
    // SAFETY: open_tree reads the NUL-terminated path and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, dir, path.as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(unsafe_owned(fd as i32))
}

/// Sets `attr` on the detached or attached mount `tree` (and the mounts below it with
/// `recursive`).
pub fn mount_setattr(tree: &OwnedFd, recursive: bool, attr: &MountAttr) -> std::io::Result<()> {
    let mut flags = libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: mount_setattr reads the empty path and `attr`, of the size given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            flags,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches the detached `tree` on the mount point `target` (an O_PATH fd).
pub fn move_onto(tree: &OwnedFd, target: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: move_mount reads two empty NUL-terminated paths and takes the fds as they are.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            target.as_raw_fd(),
            c"".as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The propagation flag a mount option names.
pub fn propagation(p: &str) -> Result<u64, String> {
    match p {
        "" | "private" | "rprivate" => Ok(libc::MS_PRIVATE),
        "rslave" => Ok(libc::MS_SLAVE),
        "rshared" => Ok(libc::MS_SHARED),
        p => Err(format!(
            "propagation {p:?} is not rprivate, rslave or rshared"
        )),
    }
}

/// Whether the tree or file `fd` is a directory's (else a file's).
pub fn is_dir(fd: &OwnedFd) -> std::io::Result<bool> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd())?;
    Ok(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
}

/// Attaches at `target` (made here: a directory or an empty file, as `source` is; its parent
/// must exist) a copy of `source` and of everything mounted below it, as a recursive bind
/// mount of it would be, with `propagation` all the way down. `source` resolves as mount(2)
/// resolves a bind's source.
/// With `userns`, the copy is ID-mapped through that user namespace (its root sees the
/// files the host's root owns as its own). `readonly` makes its top mount read-only
/// (`recursive_readonly`: all of it) here, where the flag is then locked for a container in
/// a user namespace of its own, which could otherwise remount its bind read-write.
pub fn stage(
    source: &str,
    target: &Path,
    propagation: &str,
    userns: Option<&OwnedFd>,
    (readonly, recursive_readonly): (bool, bool),
) -> Result<(), String> {
    use nix::fcntl::OFlag;
    let flag = self::propagation(propagation)?;
    let tree = clone_tree(libc::AT_FDCWD, source, libc::AT_RECURSIVE)
        .map_err(|e| format!("clone {source}: {e}"))?;
    mount_setattr(
        &tree,
        true,
        &MountAttr {
            propagation: flag,
            ..Default::default()
        },
    )
    .map_err(|e| format!("set the propagation of a copy of {source}: {e}"))?;
    if let Some(ns) = userns {
        idmap(&tree, ns).map_err(|e| format!("map the IDs of a copy of {source}: {e}"))?;
    }
    if readonly || recursive_readonly {
        let ro = MountAttr {
            attr_set: MOUNT_ATTR_RDONLY,
            ..Default::default()
        };
        mount_setattr(&tree, recursive_readonly, &ro)
            .map_err(|e| format!("make a copy of {source} read-only: {e}"))?;
    }
    let made = if is_dir(&tree).map_err(|e| format!("inspect {source}: {e}"))? {
        std::fs::DirBuilder::new().mode(0o700).create(target)
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(target)
            .map(drop)
    };
    made.map_err(|e| format!("create {}: {e}", target.display()))?;
    let at = nix::fcntl::open(
        target,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map(unsafe_owned)
    .map_err(|e| format!("open {}: {e}", target.display()))?;
    move_onto(&tree, &at)
        .map_err(|e| format!("mount a copy of {source} on {}: {e}", target.display()))
}

/// ID-maps the detached `tree` and the mounts below it through the user namespace `userns`.
pub fn idmap(tree: &OwnedFd, userns: &OwnedFd) -> std::io::Result<()> {
    mount_setattr(
        tree,
        true,
        &MountAttr {
            attr_set: MOUNT_ATTR_IDMAP,
            userns_fd: userns.as_raw_fd() as u64,
            ..Default::default()
        },
    )
}

const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_FD: libc::c_uint = 5;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;

fn fsconfig(
    fs: &OwnedFd,
    cmd: libc::c_uint,
    key: Option<&std::ffi::CStr>,
    fd: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: fsconfig reads the NUL-terminated key (or none) and takes the fd as it is.
    let r = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            cmd,
            key.map_or(std::ptr::null(), |k| k.as_ptr()),
            std::ptr::null::<libc::c_void>(),
            fd,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts at `target` an overlay of `lowers` (topmost first), each an ID-mapped copy through
/// `userns`, under `upper` and `work` as they are: the files the host's root owns in the image
/// are the namespace's root's, and the layers stay shared with every other container. The
/// writable layer is not mapped (overlayfs works in it as its mounter, the host's root, which
/// the mapping does not name: it could not make its work directory nor copy a file up): what
/// the container writes there is its host IDs', as the caller makes the layer's root.
/// overlayfs itself cannot be ID-mapped, its layers can (Linux 5.19); handed over as
/// descriptors (Linux 6.13), nothing but the overlay is attached on the host. `volatile` as
/// `mount_overlay` has it.
pub fn overlay_idmapped(
    lowers: &[std::path::PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
    userns: &OwnedFd,
    volatile: bool,
) -> std::io::Result<()> {
    use nix::fcntl::OFlag;
    // Which step failed, for the message.
    let step =
        |what: &str, e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"));
    let dir = |p: &Path| {
        nix::fcntl::open(
            p,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map(unsafe_owned)
        .map_err(std::io::Error::from)
    };
    // SAFETY: fsopen reads the NUL-terminated name and returns a new fd or -1.
    let fs = unsafe { libc::syscall(libc::SYS_fsopen, c"overlay".as_ptr(), FSOPEN_CLOEXEC) };
    if fs < 0 {
        return Err(step("fsopen overlay", std::io::Error::last_os_error()));
    }
    let fs = unsafe_owned(fs as RawFd);
    // Held until the overlay is made: a detached copy is gone with its last descriptor.
    let mut held = Vec::with_capacity(lowers.len());
    for l in lowers {
        let s = l.to_str().ok_or(std::io::ErrorKind::InvalidInput)?;
        let tree = clone_tree(libc::AT_FDCWD, s, 0).map_err(|e| step("copy a layer", e))?;
        idmap(&tree, userns).map_err(|e| step("map a layer's IDs", e))?;
        fsconfig(&fs, FSCONFIG_SET_FD, Some(c"lowerdir+"), tree.as_raw_fd())
            .map_err(|e| step("lowerdir+", e))?;
        held.push(tree);
    }
    let (upper, work) = (dir(upper)?, dir(work)?);
    fsconfig(&fs, FSCONFIG_SET_FD, Some(c"upperdir"), upper.as_raw_fd())
        .map_err(|e| step("upperdir", e))?;
    fsconfig(&fs, FSCONFIG_SET_FD, Some(c"workdir"), work.as_raw_fd())
        .map_err(|e| step("workdir", e))?;
    if volatile {
        fsconfig(&fs, FSCONFIG_SET_FLAG, Some(c"volatile"), 0).map_err(|e| step("volatile", e))?;
    }
    fsconfig(&fs, FSCONFIG_CMD_CREATE, None, 0).map_err(|e| step("create", e))?;
    // SAFETY: fsmount takes the configured context and returns a new mount fd or -1.
    let m = unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, 0) };
    if m < 0 {
        return Err(step("fsmount", std::io::Error::last_os_error()));
    }
    let m = unsafe_owned(m as RawFd);
    move_onto(&m, &dir(target)?).map_err(|e| step("attach", e))
}

pub fn unsafe_owned(fd: RawFd) -> OwnedFd {
    // SAFETY: a new fd, just returned by a successful open, ours alone.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
