//! Container root filesystems: an overlay of the image's layer snapshots with a writable upper
//! directory of the container's own, and user/group lookup inside it.

use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::{Error, Result};

/// Mounts `lowers` (topmost first) under `upper`/`work` at `target`.
pub fn mount_overlay(lowers: &[PathBuf], upper: &Path, work: &Path, target: &Path) -> Result<()> {
    for d in [upper, work, target] {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
    }
    if lowers.is_empty() {
        return Err(Error::InvalidArgument("image has no layers".into()));
    }
    let lower = lowers
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":");
    let data = format!(
        "lowerdir={lower},upperdir={},workdir={}",
        upper.display(),
        work.display()
    );
    if data.len() >= 4096 {
        return Err(Error::FailedPrecondition(format!(
            "overlay options for {} exceed a page ({} layers)",
            target.display(),
            lowers.len()
        )));
    }
    mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::empty(),
        Some(data.as_str()),
    )
    .map_err(|e| Error::io("mount overlay at", target, e.into()))
}

/// Unmounts `target` if it is mounted; a path that is not a mount point is fine.
pub fn unmount(target: &Path) -> Result<()> {
    match umount2(target, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => Ok(()),
        Err(e) => Err(Error::io("unmount", target, e.into())),
    }
}

/// Reads a file of the rootfs, resolving symlinks inside it (never to the host's files).
pub fn read_in_root(root: &Path, path: &str) -> Option<String> {
    let mut rel = PathBuf::from(path.trim_start_matches('/'));
    for _ in 0..8 {
        let p = root.join(&rel);
        match std::fs::symlink_metadata(&p) {
            Ok(md) if md.file_type().is_symlink() => {
                let t = std::fs::read_link(&p).ok()?;
                rel = if t.is_absolute() {
                    t.strip_prefix("/").ok()?.to_path_buf()
                } else {
                    rel.parent().unwrap_or(Path::new("")).join(t)
                };
                if rel
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
                {
                    return None;
                }
            }
            Ok(_) => return std::fs::read_to_string(p).ok(),
            Err(_) => return None,
        }
    }
    None
}

/// The uid, primary gid and supplementary gids of a user, from the rootfs's /etc/passwd and
/// /etc/group. `user` is a name or a number; a number unknown to passwd runs with gid 0.
pub fn resolve_user(root: &Path, user: &str, group: Option<&str>) -> Result<(u32, u32, Vec<u32>)> {
    let passwd = read_in_root(root, "/etc/passwd").unwrap_or_default();
    let groups = read_in_root(root, "/etc/group").unwrap_or_default();
    let entry = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 4 && (f[0] == user || (user.parse::<u32>().is_ok() && f[2] == user)));
    let (uid, mut gid, name) = match (&entry, user.parse::<u32>()) {
        (Some(f), _) => (
            f[2].parse().unwrap_or(0),
            f[3].parse().unwrap_or(0),
            f[0].to_string(),
        ),
        (None, Ok(n)) => (n, 0, String::new()),
        (None, Err(_)) => {
            return Err(Error::InvalidArgument(format!(
                "user {user:?} not found in the image's /etc/passwd"
            )))
        }
    };
    if let Some(g) = group.filter(|g| !g.is_empty()) {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => groups
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "group {g:?} not found in the image's /etc/group"
                    ))
                })?,
        };
    }
    let mut extra = Vec::new();
    if !name.is_empty() {
        for f in groups.lines().map(|l| l.split(':').collect::<Vec<_>>()) {
            if f.len() >= 4 && f[3].split(',').any(|m| m == name) {
                if let Ok(g) = f[2].parse::<u32>() {
                    if g != gid && !extra.contains(&g) {
                        extra.push(g);
                    }
                }
            }
        }
    }
    Ok((uid, gid, extra))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(d.path().join("etc/passwd"), "root:x:0:0::/root:/bin/sh\nwww-data:x:33:33::/var/www:/bin/false\ndefault-user:x:1000:1000::/home:/bin/sh\n").unwrap();
        std::fs::write(d.path().join("etc/group"), "root:x:0:\nwww-data:x:33:\nwheel:x:10:root,default-user\ngroup-defined-in-image:x:50000:default-user\n").unwrap();
        d
    }

    #[test]
    fn users_by_name_number_and_group() {
        let r = root();
        assert_eq!(
            resolve_user(r.path(), "www-data", None).unwrap(),
            (33, 33, vec![])
        );
        assert_eq!(
            resolve_user(r.path(), "1000", None).unwrap(),
            (1000, 1000, vec![10, 50000])
        );
        assert_eq!(
            resolve_user(r.path(), "4242", None).unwrap(),
            (4242, 0, vec![])
        );
        assert_eq!(
            resolve_user(r.path(), "www-data", Some("wheel")).unwrap(),
            (33, 10, vec![])
        );
        assert_eq!(
            resolve_user(r.path(), "0", Some("1234")).unwrap(),
            (0, 1234, vec![10])
        );
        let e = resolve_user(r.path(), "nobody-here", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("nobody-here"), "{e}");
    }

    #[test]
    fn symlinked_passwd_stays_in_the_root() {
        let r = root();
        std::fs::rename(
            r.path().join("etc/passwd"),
            r.path().join("etc/passwd.real"),
        )
        .unwrap();
        std::os::unix::fs::symlink("/etc/passwd.real", r.path().join("etc/passwd")).unwrap();
        assert_eq!(resolve_user(r.path(), "www-data", None).unwrap().0, 33);
        std::fs::remove_file(r.path().join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("../../../../etc/shadow", r.path().join("etc/passwd")).unwrap();
        assert_eq!(read_in_root(r.path(), "/etc/passwd"), None);
    }
}
