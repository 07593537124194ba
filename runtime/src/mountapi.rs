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
pub fn stage(source: &str, target: &Path, propagation: &str) -> Result<(), String> {
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

pub fn unsafe_owned(fd: RawFd) -> OwnedFd {
    // SAFETY: a new fd, just returned by a successful open, ours alone.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
