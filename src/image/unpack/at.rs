//! File operations relative to an open directory, on one name at a time, never following a
//! symlink. Every path the unpacker takes from a layer (entry names, link targets, lookups in
//! the layers below) goes through these, one component per call, so the kernel never resolves
//! a layer's symlink on the host.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid};

/// One normal path component: not empty, no `/`, not `.` or `..`. The callers only pass such
/// names; this keeps a mistake from turning into a multi-component lookup.
fn name_ok(name: &OsStr) -> io::Result<()> {
    let b = name.as_bytes();
    if b.is_empty() || b == b"." || b == b".." || b.contains(&b'/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a single path component"),
        ));
    }
    Ok(())
}

fn from_fd(fd: std::os::fd::RawFd) -> File {
    // SAFETY: `fd` was just returned by a successful open and is owned by no one else.
    unsafe { File::from_raw_fd(fd) }
}

/// Opens a directory we own (a layer root) by its path.
pub fn open_root(path: &Path) -> io::Result<File> {
    let fd = nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(from_fd(fd))
}

/// `lstat` of `name` in `dir`; `None` when it does not exist.
pub fn stat(dir: &File, name: &OsStr) -> io::Result<Option<FileStat>> {
    name_ok(name)?;
    match nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(nix::errno::Errno::ENOENT) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

pub fn fstat(f: &File) -> io::Result<FileStat> {
    Ok(nix::sys::stat::fstat(f.as_raw_fd())?)
}

/// Opens the directory `name` in `dir`; fails (ELOOP/ENOTDIR) on anything else, symlinks
/// included.
pub fn open_dir(dir: &File, name: &OsStr) -> io::Result<File> {
    name_ok(name)?;
    hako_runtime::fsat::open_dir_nofollow(Some(dir), name)
}

/// Opens the regular file `name` in `dir` for reading; anything else is an error (a FIFO is
/// not waited on, a device not opened).
pub fn open_regular(dir: &File, name: &OsStr) -> io::Result<File> {
    let pinned = pin(dir, name)?;
    let st = fstat(&pinned)?;
    if !is_type(&st, SFlag::S_IFREG) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    // Reopen, for reading, the very inode the O_PATH descriptor holds.
    let fd = nix::fcntl::open(
        &proc_fd(&pinned),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(from_fd(fd))
}

/// Creates the regular file `name` in `dir` (mode 0600 until the caller sets the real one);
/// fails if anything exists there.
pub fn create(dir: &File, name: &OsStr) -> io::Result<File> {
    name_ok(name)?;
    let fd = nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )?;
    Ok(from_fd(fd))
}

pub fn mkdir(dir: &File, name: &OsStr) -> io::Result<()> {
    name_ok(name)?;
    nix::sys::stat::mkdirat(Some(dir.as_raw_fd()), name, Mode::from_bits_truncate(0o700))?;
    Ok(())
}

pub fn symlink(target: &Path, dir: &File, name: &OsStr) -> io::Result<()> {
    name_ok(name)?;
    nix::unistd::symlinkat(target, Some(dir.as_raw_fd()), name)?;
    Ok(())
}

pub fn mknod(dir: &File, name: &OsStr, kind: SFlag, dev: u64) -> io::Result<()> {
    name_ok(name)?;
    nix::sys::stat::mknodat(
        Some(dir.as_raw_fd()),
        name,
        kind,
        Mode::from_bits_truncate(0o600),
        dev,
    )?;
    Ok(())
}

/// A hard link `to_dir/to_name` to `from_dir/from_name` itself (a symlink is not followed).
pub fn link(from_dir: &File, from_name: &OsStr, to_dir: &File, to_name: &OsStr) -> io::Result<()> {
    name_ok(from_name)?;
    name_ok(to_name)?;
    nix::unistd::linkat(
        Some(from_dir.as_raw_fd()),
        from_name,
        Some(to_dir.as_raw_fd()),
        to_name,
        AtFlags::empty(),
    )?;
    Ok(())
}

pub fn readlink(dir: &File, name: &OsStr) -> io::Result<PathBuf> {
    name_ok(name)?;
    Ok(nix::fcntl::readlinkat(Some(dir.as_raw_fd()), name)?.into())
}

/// Owner of `name` itself (a symlink's own owner).
pub fn chown(dir: &File, name: &OsStr, uid: u32, gid: u32) -> io::Result<()> {
    name_ok(name)?;
    nix::unistd::fchownat(
        Some(dir.as_raw_fd()),
        name,
        Some(Uid::from_raw(uid)),
        Some(Gid::from_raw(gid)),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// Mode of `name`, which must not be a symlink (Linux has no mode for them): it is pinned with
/// an O_PATH descriptor first, so the change lands on that inode and nowhere else.
pub fn chmod(dir: &File, name: &OsStr, mode: u32) -> io::Result<()> {
    let pinned = pin(dir, name)?;
    let st = fstat(&pinned)?;
    if is_type(&st, SFlag::S_IFLNK) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "cannot change the mode of a symlink",
        ));
    }
    nix::sys::stat::fchmodat(
        None,
        &proc_fd(&pinned),
        Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )?;
    Ok(())
}

/// Sets an extended attribute on `name` itself (not what a symlink points to).
pub fn set_xattr(dir: &File, name: &OsStr, key: &OsStr, value: &[u8]) -> io::Result<()> {
    name_ok(name)?;
    // `/proc/self/fd/<dir>` is the directory itself; `lsetxattr` does not follow `name`.
    xattr::set(proc_fd(dir).join(name), key, value)
}

/// Access and modification time of `name` itself.
pub fn set_times(dir: &File, name: &OsStr, t: filetime::FileTime) -> io::Result<()> {
    name_ok(name)?;
    let ts = timespec(t);
    nix::sys::stat::utimensat(
        Some(dir.as_raw_fd()),
        name,
        &ts,
        &ts,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )?;
    Ok(())
}

pub fn set_fd_times(f: &File, t: filetime::FileTime) -> io::Result<()> {
    let ts = timespec(t);
    nix::sys::stat::futimens(f.as_raw_fd(), &ts, &ts)?;
    Ok(())
}

fn timespec(t: filetime::FileTime) -> TimeSpec {
    TimeSpec::new(t.unix_seconds(), t.nanoseconds().into())
}

/// Removes `name` from `dir`: a directory with everything in it, anything else unlinked.
pub fn remove(dir: &File, name: &OsStr, is_dir: bool) -> io::Result<()> {
    name_ok(name)?;
    if is_dir {
        // std's remove_dir_all opens each level with O_NOFOLLOW relative to the one above, so
        // a symlink inside is removed, never followed.
        std::fs::remove_dir_all(proc_fd(dir).join(name))
    } else {
        nix::unistd::unlinkat(
            Some(dir.as_raw_fd()),
            name,
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        )?;
        Ok(())
    }
}

/// The names in an open directory.
pub fn read_dir(dir: &File) -> io::Result<std::fs::ReadDir> {
    std::fs::read_dir(proc_fd(dir))
}

/// An O_PATH descriptor for `name` itself, whatever it is (opening it has no side effect).
fn pin(dir: &File, name: &OsStr) -> io::Result<File> {
    name_ok(name)?;
    let fd = nix::fcntl::openat(
        Some(dir.as_raw_fd()),
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    Ok(from_fd(fd))
}

/// The procfs name of an open descriptor: resolving it yields that very file.
fn proc_fd(f: &File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()))
}

pub fn is_type(st: &FileStat, kind: SFlag) -> bool {
    (st.st_mode & SFlag::S_IFMT.bits()) == kind.bits()
}
