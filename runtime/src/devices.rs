//! Host device nodes as container devices: type and numbers read from the host node, for CRI
//! `Device`s, privileged containers (every host device) and CDI device nodes.

use std::io::{Error, ErrorKind, Result};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;

use crate::spec::Device;

/// Directories under /dev that hold no device a container should get as a node.
const SKIP_DIRS: &[&str] = &["pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"];

/// The host node at `host` as a container device at `container_path`: character, block or
/// (for CDI) fifo; `None` for anything else.
pub fn host_node(host: &Path, container_path: &str, access: &str) -> Result<Option<Device>> {
    let md = std::fs::metadata(host)?;
    let ft = md.file_type();
    let kind = if ft.is_char_device() {
        "c"
    } else if ft.is_block_device() {
        "b"
    } else if ft.is_fifo() {
        "p"
    } else {
        return Ok(None);
    };
    let rdev = md.rdev();
    Ok(Some(Device {
        path: container_path.to_string(),
        kind: kind.into(),
        major: libc::major(rdev) as i64,
        minor: libc::minor(rdev) as i64,
        file_mode: Some(md.permissions().mode() & 0o7777),
        uid: Some(md.uid()),
        gid: Some(md.gid()),
        access: access.into(),
    }))
}

/// A character or block device only: what CRI devices and privileged containers get.
fn node(host: &Path, container_path: &str, access: &str) -> Result<Option<Device>> {
    Ok(host_node(host, container_path, access)?.filter(|d| d.kind != "p"))
}

/// Checks a cgroup access string: one or more of r, w, m; empty means all.
pub fn access(permissions: &str) -> Result<String> {
    if permissions.is_empty() {
        return Ok("rwm".into());
    }
    if permissions.chars().all(|c| "rwm".contains(c)) {
        Ok(permissions.into())
    } else {
        Err(Error::new(
            ErrorKind::InvalidInput,
            format!("device permissions {permissions:?}: only r, w and m are allowed"),
        ))
    }
}

/// The device at `host` (a node, or a directory whose nodes are taken recursively), seen at
/// `container_path`.
pub fn from_host(host: &str, container_path: &str, permissions: &str) -> Result<Vec<Device>> {
    let access = access(permissions)?;
    let md =
        std::fs::metadata(host).map_err(|e| Error::new(e.kind(), format!("device {host}: {e}")))?;
    if !md.is_dir() {
        return node(Path::new(host), container_path, &access)?
            .map(|d| vec![d])
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidInput,
                    format!("device {host} is not a character or block device"),
                )
            });
    }
    let mut out = Vec::new();
    walk(Path::new(host), container_path, &access, &mut out)?;
    Ok(out)
}

fn walk(dir: &Path, container_dir: &str, access: &str, out: &mut Vec<Device>) -> Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        let cpath = format!("{}/{name}", container_dir.trim_end_matches('/'));
        let ft = e.file_type()?;
        if ft.is_dir() {
            if !SKIP_DIRS.contains(&name.as_str()) {
                walk(&e.path(), &cpath, access, out)?;
            }
        } else if !ft.is_symlink() {
            if let Some(d) = node(&e.path(), &cpath, access)? {
                out.push(d);
            }
        }
    }
    Ok(())
}

/// Every device node of the host's /dev, for privileged containers (as containerd and CRI-O
/// give them). /dev/console is left out: it is the container's own terminal when it has one.
pub fn host_devices() -> Vec<Device> {
    let mut out = Vec::new();
    if let Err(e) = walk(Path::new("/dev"), "/dev", "rwm", &mut out) {
        tracing::warn!(error = %e, "listing host devices for a privileged container");
    }
    out.retain(|d| d.path != "/dev/console");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_keeps_its_numbers_and_a_directory_is_walked() {
        let d = from_host("/dev/null", "/dev/mynull", "rw").unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].kind.as_str(), d[0].major, d[0].minor), ("c", 1, 3));
        assert_eq!(d[0].path, "/dev/mynull");
        assert_eq!(d[0].access, "rw");

        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let dev = nix::sys::stat::makedev(1, 5);
        nix::sys::stat::mknod(
            &sub.join("zero"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            dev,
        )
        .unwrap();
        std::fs::write(dir.path().join("plain"), b"x").unwrap();
        let d = from_host(dir.path().to_str().unwrap(), "/dev/things", "").unwrap();
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].path, "/dev/things/sub/zero");
        assert_eq!(
            (d[0].major, d[0].minor, d[0].access.as_str()),
            (1, 5, "rwm")
        );
    }

    #[test]
    fn bad_devices_are_refused_with_the_cause() {
        let e = from_host("/nonexistent/dev", "/dev/x", "").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound);
        assert!(e.to_string().contains("/nonexistent/dev"), "{e}");
        let f = tempfile::NamedTempFile::new().unwrap();
        let e = from_host(f.path().to_str().unwrap(), "/dev/x", "").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput);
        let e = from_host("/dev/null", "/dev/x", "rwx").unwrap_err();
        assert!(e.to_string().contains("rwx"), "{e}");
    }
}
