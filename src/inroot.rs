//! Reading files that belong to an image or a container: paths are resolved inside their root
//! by the kernel (`openat2` with `RESOLVE_IN_ROOT`), so a symlink anywhere on the way (`etc ->
//! /`, `passwd -> ../../../etc/shadow`) means what it would mean inside the container and never
//! reaches the host's files. Only regular files are read (a FIFO or device there would block or
//! never end), opened non-blocking, and never more than a cap.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::Mode;

/// Why a file in a root could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InRootError {
    #[error("{path} is not a regular file")]
    NotRegular { path: String },
    #[error("{path} is larger than {cap} bytes")]
    TooLarge { path: String, cap: u64 },
    #[error("{path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl InRootError {
    pub fn is_not_found(&self) -> bool {
        matches!(self, InRootError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Opens `path` (absolute or relative, as seen from inside) below the directory `root`.
pub fn open(root: &Path, path: &str, flags: OFlag) -> std::io::Result<OwnedFd> {
    let dir = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let dir = unsafe_owned(dir);
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let rel = path.trim_start_matches('/');
    let rel = if rel.is_empty() { "." } else { rel };
    let fd = nix::fcntl::openat2(dir.as_raw_fd(), rel, how)?;
    Ok(unsafe_owned(fd))
}

fn unsafe_owned(fd: std::os::fd::RawFd) -> OwnedFd {
    // SAFETY: the fd was just returned by a successful open and is owned by nobody else.
    unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }
}

/// The contents of the regular file `path` inside `root`, at most `cap` bytes.
pub fn read_regular(root: &Path, path: &str, cap: u64) -> Result<Vec<u8>, InRootError> {
    let io = |source: std::io::Error| InRootError::Io {
        path: path.to_string(),
        source,
    };
    // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
    let fd = open(
        root,
        path,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY,
    )
    .map_err(io)?;
    let mut file = std::fs::File::from(fd);
    let md = file.metadata().map_err(io)?;
    if !md.file_type().is_file() {
        return Err(InRootError::NotRegular {
            path: path.to_string(),
        });
    }
    if md.len() > cap {
        return Err(InRootError::TooLarge {
            path: path.to_string(),
            cap,
        });
    }
    let mut buf = Vec::with_capacity(md.len() as usize);
    // The file may grow while read: the cap holds whatever its size said.
    (&mut file)
        .take(cap + 1)
        .read_to_end(&mut buf)
        .map_err(io)?;
    if buf.len() as u64 > cap {
        return Err(InRootError::TooLarge {
            path: path.to_string(),
            cap,
        });
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let outer = tempfile::tempdir().unwrap();
        // A canary next to the root: where `../../secret` and `/secret` would land on the host.
        std::fs::write(outer.path().join("secret"), "host-secret").unwrap();
        let root = outer.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(root.join("secret"), "image-secret").unwrap();
        std::os::unix::fs::symlink("../../secret", root.join("etc/up")).unwrap();
        std::os::unix::fs::symlink("/secret", root.join("etc/abs")).unwrap();
        std::os::unix::fs::symlink("/", root.join("hostroot")).unwrap();
        for p in ["/etc/up", "etc/abs", "/hostroot/secret", "../secret"] {
            assert_eq!(read_regular(&root, p, 100).unwrap(), b"image-secret", "{p}");
        }
    }

    #[test]
    fn only_regular_files_and_only_up_to_the_cap() {
        let root = tempfile::tempdir().unwrap();
        nix::unistd::mkfifo(&root.path().join("fifo"), Mode::from_bits_truncate(0o600)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", root.path().join("zero")).unwrap();
        std::fs::create_dir(root.path().join("dir")).unwrap();
        std::fs::write(root.path().join("big"), vec![b'x'; 101]).unwrap();
        assert!(matches!(
            read_regular(root.path(), "fifo", 100),
            Err(InRootError::NotRegular { .. })
        ));
        assert!(matches!(
            read_regular(root.path(), "dir", 100),
            Err(InRootError::NotRegular { .. })
        ));
        // /dev/zero inside the root does not exist; the host's is never reached.
        assert!(read_regular(root.path(), "zero", 100)
            .unwrap_err()
            .is_not_found());
        assert!(matches!(
            read_regular(root.path(), "big", 100),
            Err(InRootError::TooLarge { cap: 100, .. })
        ));
        assert_eq!(read_regular(root.path(), "big", 101).unwrap().len(), 101);
    }
}
