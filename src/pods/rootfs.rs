//! Container root filesystems: an overlay of the image's layer snapshots with a writable upper
//! directory of the container's own, and user/group lookup inside it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::{Error, Result};

/// Creates `path` and its missing parents; each one created gets `mode` whatever the umask.
pub fn create_dirs(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut missing = Vec::new();
    let mut p = path;
    while !p.as_os_str().is_empty() && std::fs::symlink_metadata(p).is_err() {
        missing.push(p);
        p = p.parent().unwrap_or(Path::new(""));
    }
    for d in missing.into_iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("change mode of", d, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(Error::io("create directory", d, e)),
        }
    }
    Ok(())
}

/// Mounts `lowers` (topmost first) under `upper`/`work` at `target`, with overlayfs'
/// `volatile` option while `volatile` holds: without it the kernel syncs the whole filesystem
/// beneath the upper dir when the overlay is unmounted (every other writer's dirty data too,
/// an image pull's say) and honours the container's fsyncs, for a layer nothing reads after a
/// crash (a container is never started again; kubelet makes a new one). Mounted once: a
/// volatile work dir is refused a second mount. A kernel without the option (before Linux
/// 5.10) refuses it: the mount is made without, and `volatile` cleared.
pub fn mount_overlay(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
    volatile: &AtomicBool,
) -> Result<()> {
    overlay_dirs(lowers, upper, work, target)?;
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
    overlay_with(target, &data, "volatile", volatile, lowers.len())
}

/// The directories of a container's overlay, made.
fn overlay_dirs(lowers: &[PathBuf], upper: &Path, work: &Path, target: &Path) -> Result<()> {
    for d in [work, target] {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
    }
    // The upper dir's own mode is the container's `/`: 0755, or a non-root user could not
    // reach anything (its parents, owner only, keep host users out).
    create_dirs(upper, 0o755)?;
    std::fs::set_permissions(upper, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| Error::io("change mode of", upper, e))?;
    if lowers.is_empty() {
        return Err(Error::InvalidArgument("image has no layers".into()));
    }
    Ok(())
}

/// Makes `path` owned by the host IDs of the root of the user namespace `ids` maps.
pub fn give_to_userns_root(path: &Path, ids: &hako_runtime::monitor::UserNs) -> Result<()> {
    nix::unistd::chown(
        path,
        Some(nix::unistd::Uid::from_raw(ids.uid.host_id)),
        Some(nix::unistd::Gid::from_raw(ids.gid.host_id)),
    )
    .map_err(|e| Error::io("change owner of", path, e.into()))
}

/// `mount_overlay` for a container in the user namespace `ns` (`ids` its mappings): the
/// layers ID-mapped through it, the writable layer's root its root's on the host
/// (`hako_runtime::mountapi::overlay_idmapped`).
pub fn mount_overlay_userns(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
    ns: &std::os::fd::OwnedFd,
    ids: &hako_runtime::monitor::UserNs,
    volatile: &AtomicBool,
) -> Result<()> {
    overlay_dirs(lowers, upper, work, target)?;
    give_to_userns_root(upper, ids)?;
    hako_runtime::mountapi::overlay_idmapped(
        lowers,
        upper,
        work,
        target,
        ns,
        volatile.load(Ordering::Relaxed),
    )
    .map_err(|e| Error::io("mount an ID-mapped overlay at", target, e))
}

/// An overlay mount of `data` at `target` with `option` added while `wanted` holds; when the
/// kernel refuses the option, the mount without it and `wanted` cleared.
fn overlay_with(
    target: &Path,
    data: &str,
    option: &str,
    wanted: &AtomicBool,
    layers: usize,
) -> Result<()> {
    let op = "mount overlay at";
    let plain = || overlay(target, data, MsFlags::empty(), layers, op);
    if !wanted.load(Ordering::Relaxed) {
        return plain();
    }
    let with = format!("{data},{option}");
    if with.len() >= OPTIONS_MAX {
        tracing::debug!(target = %target.display(), option, "overlay options at a page's edge: mounted without the option");
        return plain();
    }
    let first = match overlay(target, &with, MsFlags::empty(), layers, op) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let errno = match &first {
        Error::Io { source, .. } => source.raw_os_error(),
        _ => None,
    };
    match errno {
        // The option is unknown, or the mount is bad anyway: only a mount that then works
        // without it says which. When that fails too, the first error stands.
        Some(libc::EINVAL) => {
            plain().map_err(|_| first)?;
            if wanted.swap(false, Ordering::Relaxed) {
                tracing::warn!(option, "this kernel's overlayfs refuses the option (volatile came in Linux 5.10): containers' writable layers go without it, and are synced when unmounted");
            }
            Ok(())
        }
        // A volatile overlay refuses an upper filesystem holding a writeback error that no
        // sync has reported yet (any file's on it); a plain one mounts. This container goes
        // without the option; the next tries again (a sync of that filesystem clears it).
        Some(libc::EIO) => {
            plain().map_err(|_| first)?;
            tracing::warn!(target = %target.display(), "the filesystem under containers' writable layers lost data in a writeback no sync has reported yet: this container's layer is mounted without volatile");
            Ok(())
        }
        _ => Err(first),
    }
}

/// The most bytes of mount options the kernel reads (a page, with its terminating NUL).
const OPTIONS_MAX: usize = 4096;

/// Mounts an overlay with options `data` at `target`; `layers` names the count in the error
/// when the options do not fit the page the kernel reads them from.
fn overlay(
    target: &Path,
    data: &str,
    flags: MsFlags,
    layers: usize,
    op: &'static str,
) -> Result<()> {
    if data.len() >= OPTIONS_MAX {
        return Err(Error::FailedPrecondition(format!(
            "overlay options for {} exceed a page ({layers} layers)",
            target.display(),
        )));
    }
    mount(Some("overlay"), target, Some("overlay"), flags, Some(data))
        .map_err(|e| Error::io(op, target, e.into()))
}

/// Makes the container's `/dev` a directory of the writable layer when the image has it as
/// anything else. libcontainer 0.7 mounts the `/dev` tmpfs resolving the path inside the root
/// filesystem, but then makes the default links (`fd`, `stdin`, `stdout`, `stderr`, `kcore`,
/// `ptmx`, removing a `ptmx` first) through plain `<rootfs>/dev/…` paths, before its
/// pivot_root: an image whose `/dev` is a symlink would have them made, as root, in whatever
/// host directory the link names. The tmpfs covers the directory either way.
pub fn own_dev_dir(root: &Path) -> Result<()> {
    let dev = root.join("dev");
    let meta = match std::fs::symlink_metadata(&dev) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("inspect", &dev, e)),
    };
    if meta.is_dir() {
        return Ok(());
    }
    // Removed through the overlay: a whiteout in the writable layer, the image untouched.
    std::fs::remove_file(&dev).map_err(|e| Error::io("remove the image's /dev at", &dev, e))?;
    create_dirs(&dev, 0o755)?;
    tracing::info!(path = %dev.display(), kind = ?meta.file_type(), "the image's /dev is not a directory: replaced by one in the writable layer");
    Ok(())
}

/// Refuses a mount whose destination reaches the container's `/dev` through the image's
/// symlinks (`/data -> /dev`). A mount named `/dev` is made over libcontainer's /dev once the
/// container is created (`spec::late_mounts`); one reaching it under another name would be
/// made before, and libcontainer 0.7 would then make /dev's links (removing a `ptmx` first)
/// and device nodes in the mounted directory, as root.
pub fn refuse_mounts_on_dev<'a>(
    root: &Path,
    container: &str,
    destinations: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    use nix::fcntl::OFlag;
    use std::os::unix::fs::MetadataExt;
    let destinations: Vec<&str> = destinations
        .into_iter()
        .filter(|d| !hako_runtime::spec::names_dev(d))
        .collect();
    if destinations.is_empty() {
        return Ok(());
    }
    let id = |fd: std::os::fd::OwnedFd| {
        std::fs::File::from(fd)
            .metadata()
            .map(|m| (m.dev(), m.ino()))
            .ok()
    };
    let Some(dev) = crate::inroot::open(root, "/dev", OFlag::O_PATH | OFlag::O_DIRECTORY)
        .ok()
        .and_then(id)
    else {
        return Ok(());
    };
    for dest in destinations {
        if crate::inroot::open(root, dest, OFlag::O_PATH)
            .ok()
            .and_then(id)
            == Some(dev)
        {
            return Err(Error::InvalidArgument(format!(
                "container {container}: a mount at {dest} (the image's /dev) is not supported: \
                 hako's executor (libcontainer 0.7) sets up /dev's devices and links after the \
                 mounts, which would make them in the mounted directory; mount it at /dev"
            )));
        }
    }
    Ok(())
}

/// Where a container's bundle keeps its image volumes' mounts, one directory per volume.
pub const IMAGE_VOLUMES: &str = "imagevols";

/// Mounts an image's layers (`lowers`, topmost first) read-only at `target`: an image volume.
/// Overlay needs two lower layers when it has no upper one, so a one-layer image gets an empty
/// directory (`empty`, created here) beneath it.
pub fn mount_image_volume(lowers: &[PathBuf], empty: &Path, target: &Path) -> Result<()> {
    for d in [empty, target] {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
    }
    if lowers.is_empty() {
        return Err(Error::InvalidArgument("image has no layers".into()));
    }
    let mut dirs: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
    if dirs.len() == 1 {
        dirs.push(empty.display().to_string());
    }
    let data = format!("lowerdir={}", dirs.join(":"));
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID;
    overlay(target, &data, flags, lowers.len(), "mount image volume at")
}

/// Unmounts what a container's bundle has mounted: its rootfs and its image volumes (with
/// their sub path binds). Done before the bundle is removed, so the removal never walks into a
/// mounted image. Tries every mount and returns the first error.
pub fn unmount_bundle(bundle: &Path) -> Result<()> {
    let mut first = unmount(&bundle.join("rootfs")).err();
    // Left by a daemon that stopped during a create.
    Staged::release(&bundle.join(STAGED));
    let vols = bundle.join(IMAGE_VOLUMES);
    let entries = match std::fs::read_dir(&vols) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return first.map_or(Ok(()), Err),
        Err(e) => return Err(first.unwrap_or(Error::io("list", &vols, e))),
    };
    for e in entries {
        let r = e
            .map_err(|e| Error::io("list", &vols, e))
            .and_then(|e| unmount(&e.path()));
        if let Err(e) = r {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// A user namespace for trying ID-mapped mounts: a `sleep` unshares it, its maps are written,
/// it is held by the descriptor returned, and the `sleep` is gone.
fn scratch_userns() -> std::result::Result<std::os::fd::OwnedFd, String> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("sleep");
    cmd.arg("60");
    // SAFETY: unshare is async-signal-safe; the child then execs.
    unsafe {
        cmd.pre_exec(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUSER).map_err(Into::into)
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("start sleep in a user namespace: {e}"))?;
    let held = (|| {
        let proc = format!("/proc/{}", child.id());
        for file in ["uid_map", "gid_map"] {
            std::fs::write(format!("{proc}/{file}"), "0 65536 65536\n")
                .map_err(|e| format!("write {file}: {e}"))?;
        }
        std::fs::File::open(format!("{proc}/ns/user"))
            .map(std::os::fd::OwnedFd::from)
            .map_err(|e| format!("open its user namespace: {e}"))
    })();
    let _ = child.kill();
    let _ = child.wait();
    held
}

/// Whether containers of pods with a user namespace can be given their root filesystem here:
/// an ID-mapped overlay in `dir` (on the filesystem of the image layers and writable layers),
/// tried once. Why not, when not.
pub fn userns_probe(dir: &Path) -> std::result::Result<(), String> {
    let ns = scratch_userns()?;
    let name = format!(".userns-probe-{}", std::process::id());
    let (low, top) = (dir.join(format!("{name}-lower")), dir.join(name));
    let tried = (|| {
        for d in [
            low.clone(),
            top.join("upper"),
            top.join("work"),
            top.join("root"),
        ] {
            std::fs::create_dir_all(&d).map_err(|e| format!("create {}: {e}", d.display()))?;
        }
        std::fs::write(low.join("f"), "").map_err(|e| format!("create a file: {e}"))?;
        let root = top.join("root");
        hako_runtime::mountapi::overlay_idmapped(
            std::slice::from_ref(&low),
            &top.join("upper"),
            &top.join("work"),
            &root,
            &ns,
            false,
        )
        .map_err(|e| format!("ID-mapped overlay: {e}"))?;
        let owner =
            std::fs::metadata(root.join("f")).map(|m| std::os::unix::fs::MetadataExt::uid(&m));
        let _ = umount2(&root, MntFlags::MNT_DETACH);
        match owner {
            Ok(65536) => Ok(()),
            Ok(uid) => Err(format!(
                "the ID-mapped overlay shows a file of the host's root as {uid}'s, not 65536's"
            )),
            Err(e) => Err(format!("inspect the ID-mapped overlay: {e}")),
        }
    })();
    let _ = std::fs::remove_dir_all(&low);
    let _ = std::fs::remove_dir_all(&top);
    tried
}

/// The bundle's directory of staged volume sources.
pub const STAGED: &str = "staged";

/// Copies of volumes' sources with their own propagation, which libcontainer binds instead of
/// the sources (`hako_runtime::spec::staged_mounts` says which and why), for the length of a
/// create: the container's mount namespace has its own copies once it exists, and the host's
/// are detached when this is dropped.
pub struct Staged {
    dir: PathBuf,
    made: usize,
    /// The pod's user namespace, when it has one: each copy is ID-mapped through it.
    userns: Option<std::os::fd::OwnedFd>,
}

impl Staged {
    pub fn new(bundle: &Path, userns: Option<std::os::fd::OwnedFd>) -> Staged {
        Staged {
            dir: bundle.join(STAGED),
            made: 0,
            userns,
        }
    }

    /// Stages `m`'s source with its propagation and read-only flags; the path to bind it from.
    pub fn add(&mut self, m: &hako_runtime::spec::Mount) -> Result<String> {
        let source = m.source.as_str();
        if self.made == 0 {
            use std::os::unix::fs::DirBuilderExt;
            // Traversable: in a user namespace the container's root binds from here (the
            // bundle around it is owner only).
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&self.dir)
                .map_err(|e| Error::io("create", &self.dir, e))?;
            std::fs::set_permissions(
                &self.dir,
                std::os::unix::fs::PermissionsExt::from_mode(0o711),
            )
            .map_err(|e| Error::io("change mode of", &self.dir, e))?;
        }
        let target = self.dir.join(self.made.to_string());
        hako_runtime::mountapi::stage(
            source,
            &target,
            &m.propagation,
            self.userns.as_ref(),
            (m.readonly, m.recursive_readonly),
        )
        .map_err(|e| {
            // A target made before the mount failed goes with the rest.
            self.made += 1;
            Error::FailedPrecondition(format!("stage volume {source}: {e}"))
        })?;
        self.made += 1;
        Ok(target.display().to_string())
    }

    /// Detaches whatever is mounted in `dir` and removes it.
    fn release(dir: &Path) {
        // Never through a link put in its place (a bundle may be a user namespace root's).
        if !std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            return;
        }
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if let Err(e) = umount2(&p, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
                if e != nix::errno::Errno::EINVAL && e != nix::errno::Errno::ENOENT {
                    tracing::warn!(path = %p.display(), error = %e, "release a staged volume");
                }
            }
            let _ = std::fs::remove_dir(&p).or_else(|_| std::fs::remove_file(&p));
        }
        let _ = std::fs::remove_dir(dir);
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if self.made > 0 {
            Staged::release(&self.dir);
        }
    }
}

/// Unmounts `target` if it is mounted; a path that is not a mount point is fine.
pub fn unmount(target: &Path) -> Result<()> {
    match umount2(target, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => Ok(()),
        Err(e) => Err(Error::io("unmount", target, e.into())),
    }
}

/// The largest /etc/passwd or /etc/group read from an image.
const ACCOUNT_FILE_CAP: u64 = 4 << 20;

/// An account file of the rootfs: resolved inside it, a regular file, at most
/// `ACCOUNT_FILE_CAP` bytes. A missing file is empty (numeric users need none).
fn account_file(root: &Path, path: &str) -> Result<String> {
    match crate::inroot::read_regular(root, path, ACCOUNT_FILE_CAP) {
        Ok(b) => Ok(String::from_utf8_lossy(&b).into_owned()),
        Err(e) if e.is_not_found() => Ok(String::new()),
        Err(e) => Err(Error::InvalidArgument(format!(
            "the image's {path}: {}",
            crate::error::chain(&e)
        ))),
    }
}

/// A numeric field of a passwd/group line; malformed is an error naming the file and line,
/// never uid or gid 0.
fn id_field(file: &str, lineno: usize, line: &str, field: &str, v: &str) -> Result<u32> {
    v.parse().map_err(|_| {
        Error::InvalidArgument(format!(
            "the image's {file} line {lineno} ({line:?}): {field} {v:?} is not a number"
        ))
    })
}

/// The uid, primary gid and supplementary gids of a user, from the rootfs's /etc/passwd and
/// /etc/group. `user` is a name or a number; a number unknown to passwd runs with gid 0.
/// Blocking (reads files): callers on async workers use `spawn_blocking`.
pub fn resolve_user(root: &Path, user: &str, group: Option<&str>) -> Result<(u32, u32, Vec<u32>)> {
    let passwd = account_file(root, "/etc/passwd")?;
    let groups = account_file(root, "/etc/group")?;
    let entry = passwd
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l, l.split(':').collect::<Vec<_>>()))
        .find(|(_, _, f)| {
            f.len() >= 4 && (f[0] == user || (user.parse::<u32>().is_ok() && f[2] == user))
        });
    let (uid, mut gid, name) = match (&entry, user.parse::<u32>()) {
        (Some((n, line, f)), _) => (
            id_field("/etc/passwd", *n, line, "uid", f[2])?,
            id_field("/etc/passwd", *n, line, "gid", f[3])?,
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
            Err(_) => {
                let (n, line, f) = groups
                    .lines()
                    .enumerate()
                    .map(|(i, l)| (i + 1, l, l.split(':').collect::<Vec<_>>()))
                    .find(|(_, _, f)| f.len() >= 3 && f[0] == g)
                    .ok_or_else(|| {
                        Error::InvalidArgument(format!(
                            "group {g:?} not found in the image's /etc/group"
                        ))
                    })?;
                id_field("/etc/group", n, line, "gid", f[2])?
            }
        };
    }
    let mut extra = Vec::new();
    if !name.is_empty() {
        for (i, line) in groups.lines().enumerate() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 4 && f[3].split(',').any(|m| m == name) {
                let g = id_field("/etc/group", i + 1, line, "gid", f[2])?;
                if g != gid && !extra.contains(&g) {
                    extra.push(g);
                }
            }
        }
    }
    Ok((uid, gid, extra))
}

/// The e2e tests' disk that loses writes.
#[cfg(test)]
#[path = "../../tests/support/disk.rs"]
mod disk;

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
        // Where the escape would land on the host, a canary the lookup must never read.
        let canary = r.path().join("../canary-passwd");
        std::fs::write(&canary, "evil:x:0:0::/:/bin/sh\n").unwrap();
        std::os::unix::fs::symlink("../../canary-passwd", r.path().join("etc/passwd")).unwrap();
        let e = resolve_user(r.path(), "evil", None)
            .unwrap_err()
            .to_string();
        std::fs::remove_file(&canary).unwrap();
        assert!(e.contains("\"evil\" not found"), "{e}");
    }

    #[test]
    fn a_symlinked_etc_stays_in_the_root() {
        let outer = tempfile::tempdir().unwrap();
        let host_etc = outer.path().join("host-etc");
        std::fs::create_dir(&host_etc).unwrap();
        std::fs::write(host_etc.join("passwd"), "hostonly:x:7:7::/:/bin/sh\n").unwrap();
        let r = outer.path().join("root");
        std::fs::create_dir(&r).unwrap();
        std::os::unix::fs::symlink(&host_etc, r.join("etc")).unwrap();
        let e = resolve_user(&r, "hostonly", None).unwrap_err().to_string();
        assert!(e.contains("\"hostonly\" not found"), "{e}");
        std::os::unix::fs::symlink("../../host-etc", r.join("etc2")).unwrap();
        std::fs::remove_file(r.join("etc")).unwrap();
        std::fs::rename(r.join("etc2"), r.join("etc")).unwrap();
        assert!(resolve_user(&r, "hostonly", None).is_err());
    }

    #[test]
    fn account_files_that_are_not_regular_are_refused() {
        let r = root();
        std::fs::remove_file(r.path().join("etc/passwd")).unwrap();
        nix::unistd::mkfifo(
            &r.path().join("etc/passwd"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        // A FIFO with no writer: read naively, this would block the daemon forever. A lookup
        // that blocks fails this test by a deadline instead of hanging the test binary.
        let (tx, rx) = std::sync::mpsc::channel();
        let root_path = r.path().to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(resolve_user(&root_path, "www-data", None));
        });
        let e = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the lookup blocked on a FIFO /etc/passwd (not returned after 10 s)")
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert!(
            e.to_string().contains("/etc/passwd") && e.to_string().contains("not a regular file"),
            "{e}"
        );
        std::fs::remove_file(r.path().join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", r.path().join("etc/passwd")).unwrap();
        // /dev/zero of the image (absent here), never the host's endless one.
        assert_eq!(resolve_user(r.path(), "33", None).unwrap(), (33, 0, vec![]));
    }

    #[test]
    fn malformed_ids_are_errors_naming_the_line_never_root() {
        let r = root();
        std::fs::write(
            r.path().join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\napp:x:10o1:1000::/:/bin/sh\n",
        )
        .unwrap();
        let e = resolve_user(r.path(), "app", None).unwrap_err().to_string();
        assert!(
            e.contains("line 2") && e.contains("10o1") && e.contains("/etc/passwd"),
            "{e}"
        );
        std::fs::write(r.path().join("etc/passwd"), "app:x:1001:-1::/:/bin/sh\n").unwrap();
        assert!(resolve_user(r.path(), "app", None).is_err());
        std::fs::write(r.path().join("etc/passwd"), "app:x:1001:1001::/:/bin/sh\n").unwrap();
        std::fs::write(r.path().join("etc/group"), "staff:x:5o:app\n").unwrap();
        let e = resolve_user(r.path(), "app", None).unwrap_err().to_string();
        assert!(e.contains("/etc/group line 1"), "{e}");
        // A group named by the container config, malformed on line 2.
        std::fs::write(r.path().join("etc/group"), "root:x:0:\nstaff:x:5o:\n").unwrap();
        let e = resolve_user(r.path(), "app", Some("staff"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/etc/group line 2") && e.contains("5o"), "{e}");
    }

    #[test]
    fn supplementary_groups_leave_out_the_primary_and_repeats() {
        let r = root();
        // www-data is listed in its own primary group, and in two lines of gid 10.
        std::fs::write(
            r.path().join("etc/group"),
            "www-data:x:33:www-data\nwheel:x:10:www-data\nwheel-alias:x:10:root,www-data\n",
        )
        .unwrap();
        assert_eq!(
            resolve_user(r.path(), "www-data", None).unwrap(),
            (33, 33, vec![10])
        );
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn create_dirs_gives_each_new_directory_the_mode_and_keeps_existing_ones() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("a")).unwrap();
        std::fs::set_permissions(
            d.path().join("a"),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        // 0777: what the umask (022 or stricter) would take away if only mkdir's mode applied.
        create_dirs(&d.path().join("a/b/c"), 0o777).unwrap();
        assert_eq!(
            mode(&d.path().join("a")),
            0o700,
            "an existing parent keeps its mode"
        );
        assert_eq!(mode(&d.path().join("a/b")), 0o777);
        assert_eq!(mode(&d.path().join("a/b/c")), 0o777);
        // Already there: nothing to do.
        create_dirs(&d.path().join("a/b/c"), 0o700).unwrap();
        assert_eq!(mode(&d.path().join("a/b/c")), 0o777);
        // A directory found to exist on the way (`x/..` is `a/b` again) is not an error.
        create_dirs(&d.path().join("a/b/x/.."), 0o755).unwrap();
        assert!(d.path().join("a/b/x").is_dir());
        // Any other failure is, naming the directory.
        std::fs::write(d.path().join("file"), "").unwrap();
        let e = create_dirs(&d.path().join("file/sub"), 0o755)
            .unwrap_err()
            .to_string();
        assert!(e.contains("file/sub"), "{e}");
    }

    /// Unmounts (lazily) on drop, so a failing assertion leaves no mount behind.
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = umount2(&self.0, MntFlags::MNT_DETACH);
        }
    }

    #[test]
    fn overlay_mounts_layers_topmost_first_and_unmounts() {
        let d = tempfile::tempdir().unwrap();
        let (low1, low2) = (d.path().join("l1"), d.path().join("l2"));
        for (l, text) in [(&low1, "top"), (&low2, "bottom")] {
            std::fs::create_dir(l).unwrap();
            std::fs::write(l.join("f"), text).unwrap();
        }
        std::fs::write(low2.join("only-bottom"), "b").unwrap();
        let (upper, work, target) = (
            d.path().join("c/upper"),
            d.path().join("c/work"),
            d.path().join("c/rootfs"),
        );
        let volatile = AtomicBool::new(true);
        mount_overlay(
            &[low1.clone(), low2.clone()],
            &upper,
            &work,
            &target,
            &volatile,
        )
        .unwrap();
        let guard = Unmount(target.clone());
        assert!(is_volatile(&target), "{:?}", super_options(&target));
        assert!(
            volatile.load(Ordering::Relaxed),
            "this kernel has the option"
        );
        assert_eq!(std::fs::read_to_string(target.join("f")).unwrap(), "top");
        assert!(target.join("only-bottom").exists());
        std::fs::write(target.join("new"), "w").unwrap();
        assert!(upper.join("new").exists(), "writes land in the upper dir");
        assert_eq!(mode(&upper), 0o755, "the container's / is 0755");
        unmount(&target).unwrap();
        assert!(!target.join("f").exists(), "unmounted");
        std::mem::forget(guard);
        // Not mounted, or not there at all: fine.
        unmount(&target).unwrap();
        unmount(&d.path().join("missing")).unwrap();
    }

    /// The /proc/self/mountinfo line of the mount at `target`.
    fn mountinfo_line(target: &Path) -> String {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        mountinfo
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(target.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{} not mounted", target.display()))
            .to_string()
    }

    /// The super block options of the mount at `target` (the field after the fs type and
    /// source in its mountinfo line).
    fn super_options(target: &Path) -> Vec<String> {
        let line = mountinfo_line(target);
        let after = line.split(" - ").nth(1).unwrap();
        let opts = after.split(' ').nth(2).unwrap();
        opts.split(',').map(str::to_string).collect()
    }

    /// Whether the overlay at `target` is volatile: the option as given, or as newer kernels
    /// show it (`fsync=volatile`).
    fn is_volatile(target: &Path) -> bool {
        super_options(target)
            .iter()
            .any(|o| o == "volatile" || o == "fsync=volatile")
    }

    /// An option the kernel refuses is dropped (and stays dropped); a mount that is bad
    /// without it too is an error, and the option is still wanted.
    #[test]
    fn an_overlay_option_the_kernel_refuses_is_dropped_once_and_for_all() {
        let d = tempfile::tempdir().unwrap();
        let low = d.path().join("low");
        std::fs::create_dir(&low).unwrap();
        std::fs::write(low.join("f"), "x").unwrap();
        // A bad mount: the work dir inside the upper one, which overlayfs refuses with EINVAL
        // as it does an unknown option.
        let mount_at = |name: &str, bad: bool, wanted: &AtomicBool| {
            let upper = d.path().join(format!("{name}/upper"));
            let (work, target) = (
                if bad {
                    upper.join("work")
                } else {
                    d.path().join(format!("{name}/work"))
                },
                d.path().join(format!("{name}/rootfs")),
            );
            for p in [&upper, &work, &target] {
                std::fs::create_dir_all(p).unwrap();
            }
            let data = format!(
                "lowerdir={},upperdir={},workdir={}",
                low.display(),
                upper.display(),
                work.display()
            );
            let r = overlay_with(&target, &data, "hako_no_such_option", wanted, 1);
            (r, target)
        };
        let wanted = AtomicBool::new(true);
        let (r, bad) = mount_at("bad", true, &wanted);
        match r {
            Err(Error::Io { source, path, .. }) => {
                assert_eq!(source.raw_os_error(), Some(libc::EINVAL), "{source}");
                assert_eq!(path, bad);
            }
            other => panic!("{other:?}"),
        }
        assert!(
            wanted.load(Ordering::Relaxed),
            "a bad mount says nothing of the option"
        );
        let (r, good) = mount_at("good", false, &wanted);
        r.unwrap();
        let _guard = Unmount(good.clone());
        assert_eq!(std::fs::read_to_string(good.join("f")).unwrap(), "x");
        assert!(!super_options(&good).contains(&"hako_no_such_option".to_string()));
        assert!(
            !wanted.load(Ordering::Relaxed),
            "refused once, not asked for again"
        );
    }

    /// A writeback error on the upper filesystem that no sync has reported makes overlayfs
    /// refuse a volatile mount (EIO) though not a plain one: the container gets the plain
    /// mount and the option stays wanted; once a sync has reported the error, the next mount
    /// is volatile again. The disk: ext4 in a sparse file on a 16 MiB tmpfs that a 48 MiB file
    /// overflows; the tmpfs then grows, so that only the error already recorded remains.
    #[test]
    fn an_unreported_writeback_error_gets_a_plain_mount_and_keeps_the_option() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let why = if !nix::unistd::Uid::effective().is_root() {
            Some("needs root")
        } else if std::process::Command::new("mkfs.ext4")
            .arg("-V")
            .output()
            .is_err()
        {
            Some("needs mkfs.ext4")
        } else {
            None
        };
        if let Some(why) = why {
            eprintln!("SKIPPED an_unreported_writeback_error_gets_a_plain_mount_and_keeps_the_option: {why}");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let (backing, fs, low) = (
            d.path().join("disk"),
            d.path().join("fs"),
            d.path().join("low"),
        );
        for p in [&backing, &fs, &low] {
            std::fs::create_dir(p).unwrap();
        }
        std::fs::write(low.join("f"), "x").unwrap();
        // Unmounted in reverse: the ext4, then its tmpfs.
        let _backing = Unmount(backing.clone());
        disk::mount_small_ext4(&backing, &fs);
        let _fs = Unmount(fs.clone());
        let mut big = std::fs::File::create(fs.join("big")).unwrap();
        let block = vec![0x5a_u8; 1 << 20];
        for _ in 0..48 {
            big.write_all(&block).unwrap();
        }
        // The file's own fsync reports the loss to the file, not to the filesystem's syncs.
        assert!(
            big.sync_all().is_err(),
            "the writes never failed: the disk did not overflow"
        );
        disk::grow(&backing);
        let mount = |name: &str, wanted: &AtomicBool| {
            let target = d.path().join(format!("{name}-rootfs"));
            let (upper, work) = (fs.join(name).join("upper"), fs.join(name).join("work"));
            mount_overlay(std::slice::from_ref(&low), &upper, &work, &target, wanted).unwrap();
            (Unmount(target.clone()), target)
        };
        let wanted = AtomicBool::new(true);
        let (_a, a) = mount("a", &wanted);
        assert_eq!(std::fs::read_to_string(a.join("f")).unwrap(), "x");
        assert!(!is_volatile(&a), "{:?}", super_options(&a));
        assert!(wanted.load(Ordering::Relaxed), "the kernel has the option");
        let dir = std::fs::File::open(&fs).unwrap();
        assert!(
            nix::unistd::syncfs(dir.as_raw_fd()).is_err(),
            "the sync reports the loss"
        );
        let (_b, b) = mount("b", &wanted);
        assert!(is_volatile(&b), "{:?}", super_options(&b));
    }

    #[test]
    fn image_volumes_mount_read_only_and_go_with_the_bundle() {
        let d = tempfile::tempdir().unwrap();
        let layer = d.path().join("layer");
        std::fs::create_dir(&layer).unwrap();
        std::fs::write(layer.join("f"), "data").unwrap();
        let bundle = d.path().join("bundle");
        let vols = bundle.join(IMAGE_VOLUMES);
        let targets = [vols.join("0"), vols.join("1")];
        let _guards: Vec<_> = targets.iter().map(|t| Unmount(t.clone())).collect();
        // One layer (overlay wants two without an upper: the empty dir is the second), then two.
        mount_image_volume(
            std::slice::from_ref(&layer),
            &vols.join(".empty"),
            &targets[0],
        )
        .unwrap();
        let below = d.path().join("below");
        std::fs::create_dir(&below).unwrap();
        std::fs::write(below.join("f"), "covered").unwrap();
        mount_image_volume(&[layer.clone(), below], &vols.join(".empty"), &targets[1]).unwrap();
        for t in &targets {
            assert_eq!(std::fs::read_to_string(t.join("f")).unwrap(), "data");
            let e = std::fs::write(t.join("new"), "w").unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{}", t.display());
            // The mount's own flags: read-only, no set-id programs, no device nodes.
            let line = mountinfo_line(t);
            let flags: Vec<&str> = line.split(' ').nth(5).unwrap().split(',').collect();
            for want in ["ro", "nosuid", "nodev"] {
                assert!(flags.contains(&want), "{want} missing: {line}");
            }
        }
        unmount_bundle(&bundle).unwrap();
        for t in &targets {
            assert!(!t.join("f").exists(), "{} still mounted", t.display());
        }
        // The bundle can go now, and a bundle without image volumes unmounts fine.
        std::fs::remove_dir_all(&bundle).unwrap();
        unmount_bundle(&bundle).unwrap();
        // A volumes entry that cannot be listed is an error, not "no volumes".
        std::fs::create_dir(&bundle).unwrap();
        std::fs::write(bundle.join(IMAGE_VOLUMES), "").unwrap();
        assert!(unmount_bundle(&bundle).is_err());
    }

    #[test]
    fn overlay_refuses_no_layers_and_options_over_a_page() {
        let d = tempfile::tempdir().unwrap();
        let (upper, work, target) = (d.path().join("u"), d.path().join("w"), d.path().join("t"));
        let volatile = AtomicBool::new(true);
        let e = mount_overlay(&[], &upper, &work, &target, &volatile).unwrap_err();
        assert!(e.to_string().contains("no layers"), "{e}");
        let many: Vec<PathBuf> = (0..200)
            .map(|i| d.path().join(format!("layer-with-a-long-name-{i:04}")))
            .collect();
        let e = mount_overlay(&many, &upper, &work, &target, &volatile).unwrap_err();
        assert!(
            matches!(e, Error::FailedPrecondition(_)) && e.to_string().contains("200 layers"),
            "{e}"
        );
    }
}
