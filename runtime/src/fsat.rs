//! Directories opened by handle, never through a symlink: the primitive of every walk that
//! must stay inside a tree someone else can write to (image layers, a container's /dev, a
//! writable layer being measured).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

/// Opens the directory `name` (relative to `dir`, or a path when none); fails (ELOOP,
/// ENOTDIR) when its last component is a symlink or not a directory.
pub fn open_dir_nofollow(dir: Option<&impl AsRawFd>, name: &OsStr) -> std::io::Result<File> {
    let fd = nix::fcntl::openat(
        dir.map(|d| d.as_raw_fd()),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: `fd` was just returned by a successful open and is owned by no one else.
    Ok(unsafe { File::from_raw_fd(fd) })
}
