use super::*;
use std::fs;
use std::io::Cursor;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

/// Builds a tar stream from entries described in a tiny DSL.
enum E<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32),
    FileOwned(&'a str, &'a [u8], u32, u64, u64),
    Symlink(&'a str, &'a str),
    Hardlink(&'a str, &'a str),
    Char(&'a str, u32, u32),
    Fifo(&'a str),
    Xattr(&'a str, &'a str, &'a [u8]),
    /// A raw name written straight into the header bytes, bypassing the builder's checks.
    RawFile(&'a str, &'a [u8]),
}

fn tarball(entries: &[E]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for e in entries {
        let mut h = tar::Header::new_gnu();
        h.set_mtime(1_600_000_000);
        h.set_uid(0);
        h.set_gid(0);
        match e {
            E::Dir(p, mode) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(*mode);
                h.set_size(0);
                b.append_data(&mut h, p, io::empty()).unwrap();
            }
            E::File(p, data, mode) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            E::FileOwned(p, data, mode, uid, gid) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(*mode);
                h.set_uid(*uid);
                h.set_gid(*gid);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            E::Symlink(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Hardlink(p, t) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_mode(0o644);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            E::Char(p, maj, min) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_mode(0o666);
                h.set_device_major(*maj).unwrap();
                h.set_device_minor(*min).unwrap();
                h.set_size(0);
                b.append_data(&mut h, p, io::empty()).unwrap();
            }
            E::Fifo(p) => {
                h.set_entry_type(tar::EntryType::Fifo);
                h.set_mode(0o640);
                h.set_size(0);
                b.append_data(&mut h, p, io::empty()).unwrap();
            }
            E::Xattr(p, name, value) => {
                let key = format!("SCHILY.xattr.{name}");
                b.append_pax_extensions([(key.as_str(), *value)]).unwrap();
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(1);
                b.append_data(&mut h, p, &b"x"[..]).unwrap();
            }
            E::RawFile(p, data) => {
                let mut h = tar::Header::new_old();
                h.as_old_mut().name[..p.len()].copy_from_slice(p.as_bytes());
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                h.set_cksum();
                b.append(&h, *data).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// A GNU header of `kind`, `mode` and `size`, owned by 0:0, mtime 0: set what differs.
fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_size(size);
    h
}

fn diff_id(tar: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(tar))
}

fn unpack(tar: &[u8], dest: &Path, lowers: &[PathBuf]) -> Result<Unpacked, UnpackError> {
    unpack_layer(
        Cursor::new(tar.to_vec()),
        dest,
        lowers,
        &diff_id(tar),
        Limits::UNLIMITED,
    )
}

fn layer_dir(root: &tempfile::TempDir, name: &str) -> PathBuf {
    let p = root.path().join(name);
    fs::create_dir(&p).unwrap();
    p
}

/// A file outside every layer root whose content, inode, link count and mtime must not change.
struct Canary {
    path: PathBuf,
    content: Vec<u8>,
    ino: u64,
    nlink: u64,
    mtime: i64,
}

impl Canary {
    fn plant(path: &Path, content: &[u8]) -> Canary {
        fs::write(path, content).unwrap();
        filetime::set_file_mtime(path, filetime::FileTime::from_unix_time(1_234_567_890, 0))
            .unwrap();
        let md = fs::symlink_metadata(path).unwrap();
        Canary {
            path: path.to_path_buf(),
            content: content.to_vec(),
            ino: md.ino(),
            nlink: md.nlink(),
            mtime: md.mtime(),
        }
    }

    fn assert_untouched(&self) {
        let md = fs::symlink_metadata(&self.path)
            .unwrap_or_else(|e| panic!("canary {}: {e}", self.path.display()));
        assert_eq!(
            (md.ino(), md.nlink(), md.mtime()),
            (self.ino, self.nlink, self.mtime),
            "canary {} (inode, links, mtime)",
            self.path.display()
        );
        assert_eq!(
            fs::read(&self.path).unwrap(),
            self.content,
            "canary content"
        );
    }
}

/// `T`, a temp dir: layer roots live in `T/store/`, a canary at `T/canary` outside all of them.
struct Sandbox {
    t: tempfile::TempDir,
    canary: Canary,
}

impl Sandbox {
    fn new() -> Sandbox {
        let t = tempfile::tempdir().unwrap();
        fs::create_dir(t.path().join("store")).unwrap();
        let canary = Canary::plant(&t.path().join("canary"), b"canary");
        Sandbox { t, canary }
    }

    /// `T`, canonical, so symlink targets written from it are what the kernel would follow.
    fn path(&self) -> PathBuf {
        self.t.path().canonicalize().unwrap()
    }

    fn layer(&self, name: &str) -> PathBuf {
        let p = self.path().join("store").join(name);
        fs::create_dir(&p).unwrap();
        p
    }

    /// `lower` unpacked as layer `l0`, then `upper` as `l1` over it; both must succeed.
    fn two_layers(&self, lower: &[E], upper: &[E]) -> PathBuf {
        let l0 = self.layer("l0");
        unpack(&tarball(lower), &l0, &[]).unwrap();
        let l1 = self.layer("l1");
        unpack(&tarball(upper), &l1, &[l0]).unwrap();
        l1
    }

    fn assert_untouched(&self) {
        self.canary.assert_untouched();
    }
}

/// Every regular file under `dir` whose content contains `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = fs::symlink_metadata(&p).unwrap();
        if md.is_dir() {
            stack.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if md.is_file() {
            let data = fs::read(&p).unwrap();
            if data.windows(needle.len()).any(|w| w == needle) {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn files_dirs_links_devices_and_metadata_are_preserved() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    let t = tarball(&[
        E::Dir("bin/", 0o755),
        E::File("bin/busybox", b"#!elf", 0o755),
        E::Hardlink("bin/sh", "bin/busybox"),
        E::Symlink("bin/ls", "busybox"),
        E::FileOwned("usr/bin/su", b"su", 0o4755, 0, 0),
        E::FileOwned("home/www/index.html", b"hi", 0o640, 33, 33),
        E::Char("dev/null", 1, 3),
        E::Fifo("run/fifo"),
        E::Xattr("etc/capfile", "user.test", b"value"),
    ]);
    let u = unpack(&t, &l, &[]).unwrap();
    assert_eq!(u.diff_id, diff_id(&t));
    assert!(u.usage_inodes >= 10, "{u:?}");

    let bb = fs::metadata(l.join("bin/busybox")).unwrap();
    assert_eq!(bb.mode() & 0o7777, 0o755);
    assert_eq!(fs::read(l.join("bin/busybox")).unwrap(), b"#!elf");
    assert_eq!(
        fs::metadata(l.join("bin/sh")).unwrap().ino(),
        bb.ino(),
        "hard link shares the inode"
    );
    assert_eq!(
        fs::read_link(l.join("bin/ls")).unwrap(),
        PathBuf::from("busybox")
    );
    assert_eq!(
        fs::metadata(l.join("usr/bin/su")).unwrap().mode() & 0o7777,
        0o4755,
        "setuid kept"
    );
    let www = fs::metadata(l.join("home/www/index.html")).unwrap();
    assert_eq!((www.uid(), www.gid(), www.mode() & 0o777), (33, 33, 0o640));
    assert_eq!(www.mtime(), 1_600_000_000);
    let null = fs::symlink_metadata(l.join("dev/null")).unwrap();
    assert!(null.file_type().is_char_device());
    assert_eq!(null.rdev(), nix::sys::stat::makedev(1, 3));
    assert!(fs::symlink_metadata(l.join("run/fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(
        xattr::get(l.join("etc/capfile"), "user.test")
            .unwrap()
            .as_deref(),
        Some(&b"value"[..])
    );
    assert_eq!(
        fs::metadata(l.join("bin")).unwrap().mtime(),
        1_600_000_000,
        "dir mtime set last"
    );
}

#[test]
fn whiteouts_and_opaque_dirs_become_overlay_form() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l1");
    let t = tarball(&[
        E::File("etc/.wh.passwd", b"", 0o644),
        E::File("var/cache/.wh..wh..opq", b"", 0o644),
    ]);
    unpack(&t, &l, &[]).unwrap();
    let wh = fs::symlink_metadata(l.join("etc/passwd")).unwrap();
    assert!(
        wh.file_type().is_char_device() && wh.rdev() == 0,
        "whiteout is a 0:0 char device"
    );
    assert!(fs::symlink_metadata(l.join("etc/.wh.passwd")).is_err());
    assert_eq!(
        xattr::get(l.join("var/cache"), OPAQUE_XATTR)
            .unwrap()
            .as_deref(),
        Some(&b"y"[..])
    );
    assert!(fs::symlink_metadata(l.join("var/cache/.wh..wh..opq")).is_err());
}

#[test]
fn lower_layer_symlinks_are_followed_inside_the_root() {
    let root = tempfile::tempdir().unwrap();
    let l0 = layer_dir(&root, "l0");
    unpack(
        &tarball(&[E::Dir("usr/lib/", 0o700), E::Symlink("lib", "usr/lib")]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = layer_dir(&root, "l1");
    unpack(
        &tarball(&[E::File("lib/libc.so", b"c", 0o644)]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    assert_eq!(fs::read(l1.join("usr/lib/libc.so")).unwrap(), b"c");
    assert!(
        fs::symlink_metadata(l1.join("lib")).is_err(),
        "the symlink itself is not shadowed"
    );
    // The copied-up directory takes the lower directory's mode.
    assert_eq!(
        fs::metadata(l1.join("usr/lib")).unwrap().mode() & 0o7777,
        0o700
    );
}

/// A failed wait for the layers below is not forgotten: the next entry that needs them waits
/// again and finds what they hold, instead of finding no layers below at all.
#[test]
fn a_failed_wait_for_the_layers_below_is_asked_again() {
    let root = tempfile::tempdir().unwrap();
    let l0 = layer_dir(&root, "l0");
    unpack(
        &tarball(&[E::Dir("etc/", 0o755), E::File("etc/passwd", b"root", 0o644)]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = layer_dir(&root, "l1");
    let calls = std::cell::Cell::new(0);
    let gate = || {
        calls.set(calls.get() + 1);
        if calls.get() == 1 {
            Err("not yet".to_string())
        } else {
            Ok(())
        }
    };
    let mut u = Unpacker::new(&l1, std::slice::from_ref(&l0), &gate, Limits::UNLIMITED).unwrap();
    let passwd = Path::new("etc/passwd");
    assert!(matches!(
        u.find_in_lowers(passwd, "etc/passwd"),
        Err(UnpackError::Below { .. })
    ));
    assert!(u.find_in_lowers(passwd, "etc/passwd").unwrap().is_some());
    assert_eq!(calls.get(), 2);
    // Open now: not asked again.
    assert!(u.find_in_lowers(Path::new("etc"), "etc").unwrap().is_some());
    assert_eq!(calls.get(), 2);
}

/// Unpacks `tar` over `lowers` with a `lowers_ready` that counts its calls and answers
/// `ready`.
fn unpack_gated(
    tar: &[u8],
    dest: &Path,
    lowers: &[PathBuf],
    ready: Result<(), &str>,
) -> (Result<Unpacked, UnpackError>, usize) {
    let calls = std::cell::Cell::new(0);
    let gate = || {
        calls.set(calls.get() + 1);
        ready.map_err(String::from)
    };
    let r = unpack_layer_over(
        Cursor::new(tar.to_vec()),
        dest,
        lowers,
        &gate,
        &diff_id(tar),
        Limits::UNLIMITED,
    );
    (r, calls.get())
}

#[test]
fn the_layers_below_are_waited_for_only_when_an_entry_needs_them() {
    let root = tempfile::tempdir().unwrap();
    let l0 = layer_dir(&root, "l0");
    unpack(
        &tarball(&[
            E::Dir("usr/lib/", 0o700),
            E::Symlink("lib", "usr/lib"),
            E::Dir("etc/", 0o755),
            E::File("etc/passwd", b"root", 0o644),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let lowers = std::slice::from_ref(&l0);

    // Every entry's parent has its own entry in the layer: unpacked while the layer below
    // is not there yet.
    let own = tarball(&[
        E::Dir("etc/", 0o755),
        E::File("etc/hosts", b"h", 0o644),
        E::Dir("lib/", 0o755),
        E::File("lib/own.so", b"o", 0o644),
    ]);
    let l1 = layer_dir(&root, "l1");
    let (r, calls) = unpack_gated(&own, &l1, lowers, Err("not yet"));
    r.unwrap();
    assert_eq!(calls, 0);
    assert_eq!(fs::read(l1.join("lib/own.so")).unwrap(), b"o");

    // A file under a lower symlink and a hard link to a lower file: the layers below are
    // waited for, once, and then used.
    let through = tarball(&[
        E::File("lib/libc.so", b"c", 0o644),
        E::Hardlink("etc/passwd2", "etc/passwd"),
    ]);
    let l2 = layer_dir(&root, "l2");
    let (r, calls) = unpack_gated(&through, &l2, lowers, Ok(()));
    r.unwrap();
    assert_eq!(calls, 1);
    assert_eq!(fs::read(l2.join("usr/lib/libc.so")).unwrap(), b"c");
    assert_eq!(fs::read(l2.join("etc/passwd2")).unwrap(), b"root");

    // The layers below never come: the entry that needed them fails, saying why.
    let l3 = layer_dir(&root, "l3");
    let (r, calls) = unpack_gated(&through, &l3, lowers, Err("download failed"));
    assert_eq!(calls, 1);
    match r.unwrap_err() {
        UnpackError::Below { entry, reason } => {
            assert_eq!(
                (entry.as_str(), reason.as_str()),
                ("lib/libc.so", "download failed")
            )
        }
        e => panic!("{e}"),
    }
}

#[test]
fn symlink_escapes_are_contained() {
    let sb = Sandbox::new();
    let l = sb.layer("l0");
    // Each link, followed on the host from `<T>/store/l0`, reaches `<T>/outside`.
    let outside = sb.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let kept = Canary::plant(&outside.join("kept"), b"host file");
    let in_image = outside.strip_prefix("/").unwrap();
    let deep = format!("{}{}", "../".repeat(32), in_image.display());
    let t = tarball(&[
        E::Symlink("abs", outside.to_str().unwrap()),
        E::File("abs/pwned", b"x", 0o644),
        E::Symlink("rel", "../../outside"),
        E::File("rel/pwned2", b"x", 0o644),
        E::Symlink("deep", &deep),
        E::File("deep/pwned3", b"x", 0o644),
        // Overwrites through a link, too.
        E::File("abs/kept", b"overwritten", 0o644),
    ]);
    unpack(&t, &l, &[]).unwrap();
    let on_host: Vec<_> = fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(on_host, ["kept"], "nothing written outside");
    kept.assert_untouched();
    sb.assert_untouched();
    // Each landed inside the layer, where the link resolves in a chroot.
    for p in ["pwned", "pwned3", "kept"] {
        assert!(l.join(in_image).join(p).is_file(), "{p}");
    }
    assert!(l.join("outside/pwned2").is_file());
}

#[test]
fn dotdot_names_are_rejected_with_the_entry_named() {
    let sb = Sandbox::new();
    let l = sb.layer("l0");
    let t = tarball(&[E::RawFile("../../escape", b"x")]);
    let result = unpack(&t, &l, &[]);
    // `<T>/store/l0/../../escape` is `<T>/escape`: where a name taken as a host path lands.
    let landing = l.join("../../escape");
    assert_eq!(landing.parent().unwrap().canonicalize().unwrap(), sb.path());
    assert!(!landing.exists(), "{} written", landing.display());
    sb.assert_untouched();
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("../../escape") && err.contains("climbs out"),
        "{err}"
    );
}

#[test]
fn hardlink_cannot_reach_outside() {
    let sb = Sandbox::new();
    // `up/../secret` followed on the host: `up` is `<T>/host/sub`, so `..` is `<T>/host` and
    // the name lands on `<T>/host/secret`.
    let host = sb.path().join("host");
    fs::create_dir_all(host.join("sub")).unwrap();
    let secret = Canary::plant(&host.join("secret"), b"host secret");
    let l = sb.layer("l0");
    let t = tarball(&[
        E::Symlink("up", host.join("sub").to_str().unwrap()),
        E::Hardlink("stolen", "up/../secret"),
    ]);
    let result = unpack(&t, &l, &[]);
    secret.assert_untouched();
    sb.assert_untouched();
    assert!(fs::symlink_metadata(l.join("stolen")).is_err());
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("stolen") && err.contains("does not exist"),
        "{err}"
    );
}

#[test]
fn directory_recreated_over_a_whiteout_is_opaque() {
    let sb = Sandbox::new();
    let host = sb.path().join("host");
    fs::create_dir(&host).unwrap();
    let l0 = sb.layer("l0");
    unpack(
        &tarball(&[
            E::Symlink("data", host.to_str().unwrap()),
            E::File("old/stale", b"0", 0o644),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = sb.layer("l1");
    // Delete the lower symlink and directory, then recreate both names as fresh directories.
    let t = tarball(&[
        E::File(".wh.data", b"", 0o644),
        E::File(".wh.old", b"", 0o644),
        E::File("data/f", b"1", 0o644),
        E::Dir("old/", 0o755),
    ]);
    unpack(&t, &l1, std::slice::from_ref(&l0)).unwrap();
    assert!(
        l1.join("data/f").exists(),
        "the whited-out symlink is not followed"
    );
    assert!(!l1.join(host.strip_prefix("/").unwrap()).exists());
    assert_eq!(
        fs::read_dir(&host).unwrap().count(),
        0,
        "nothing on the host"
    );
    sb.assert_untouched();
    for d in ["data", "old"] {
        assert_eq!(
            xattr::get(l1.join(d), OPAQUE_XATTR).unwrap().as_deref(),
            Some(&b"y"[..]),
            "{d}"
        );
    }
}

/// A whiteout between two entries of one directory removes it for the entries after it too:
/// the next entry resolves its directory afresh (a recreated, opaque one), not through the
/// directory the entry before it used.
#[test]
fn a_whiteout_between_entries_of_a_directory_is_seen_by_the_next_one() {
    let sb = Sandbox::new();
    let l = sb.layer("l0");
    let t = tarball(&[
        E::File("a/b/f1", b"1", 0o644),
        E::File("a/.wh.b", b"", 0o644),
        E::File("a/b/f2", b"2", 0o644),
    ]);
    unpack(&t, &l, &[]).unwrap();
    assert!(fs::symlink_metadata(l.join("a/b")).unwrap().is_dir());
    assert!(!l.join("a/b/f1").exists(), "the whiteout removed f1");
    assert_eq!(fs::read(l.join("a/b/f2")).unwrap(), b"2");
    sb.assert_untouched();
}

/// Whiteouts that hide no name (`.wh.`, `.wh..`, `.wh...`) are refused, naming the entry.
#[test]
fn whiteouts_hiding_no_name_are_refused() {
    let sb = Sandbox::new();
    for (i, name) in ["d/.wh.", "d/.wh..", "d/.wh..."].into_iter().enumerate() {
        let t = tarball(&[E::Dir("d/", 0o755), E::File(name, b"", 0o644)]);
        let err = unpack(&t, &sb.layer(&format!("l{i}")), &[])
            .map_err(|e| crate::error::chain(&e))
            .unwrap_err();
        assert!(
            err.contains("invalid whiteout name") && err.contains(name),
            "{name}: {err}"
        );
    }
    sb.assert_untouched();
}

#[test]
fn diff_id_mismatch_is_an_error() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    let t = tarball(&[E::File("a", b"1", 0o644)]);
    let err = unpack_layer(Cursor::new(t), &l, &[], "sha256:0000", Limits::UNLIMITED).unwrap_err();
    assert!(matches!(err, UnpackError::DiffIdMismatch { .. }), "{err}");
}

#[test]
fn gzip_and_zstd_layers_unpack_with_the_uncompressed_digest() {
    let t = tarball(&[E::File("hello", b"world", 0o644)]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&t).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::bulk::compress(&t[..], 1).unwrap();
    for (name, data) in [("gz", gz), ("zst", zst)] {
        let root = tempfile::tempdir().unwrap();
        let l = layer_dir(&root, name);
        let u = unpack_layer(Cursor::new(data), &l, &[], &diff_id(&t), Limits::UNLIMITED).unwrap();
        assert_eq!(u.diff_id, diff_id(&t));
        assert_eq!(fs::read(l.join("hello")).unwrap(), b"world", "{name}");
    }
}

/// Gives at most 700 bytes per read, and is interrupted by a signal (EINTR) before each one.
struct Interrupting {
    inner: Cursor<Vec<u8>>,
    interrupt: bool,
}

impl Read for Interrupting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.interrupt = !self.interrupt;
        if self.interrupt {
            return Err(io::ErrorKind::Interrupted.into());
        }
        let n = buf.len().min(700);
        self.inner.read(&mut buf[..n])
    }
}

#[test]
fn reads_interrupted_by_a_signal_are_retried_in_every_format() {
    let t = tarball(&[
        E::File("hello", &[b'w'; 5000], 0o644),
        E::File("again", b"world", 0o644),
    ]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&t).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::bulk::compress(&t[..], 1).unwrap();
    for (name, data) in [("tar", t.clone()), ("gz", gz), ("zst", zst)] {
        let root = tempfile::tempdir().unwrap();
        let l = layer_dir(&root, name);
        let input = Interrupting {
            inner: Cursor::new(data),
            interrupt: false,
        };
        let u = unpack_layer(input, &l, &[], &diff_id(&t), Limits::UNLIMITED)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(u.diff_id, diff_id(&t));
        assert_eq!(fs::read(l.join("again")).unwrap(), b"world", "{name}");
    }
}

#[test]
fn a_read_error_at_the_first_byte_fails_the_unpack_and_is_not_retried() {
    let t = tarball(&[E::File("a", b"1", 0o644)]);
    // Fails its first read only: a retry would succeed and hide the broken download.
    struct FailsOnce {
        failed: bool,
        inner: Cursor<Vec<u8>>,
    }
    impl Read for FailsOnce {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if !self.failed {
                self.failed = true;
                return Err(io::ErrorKind::ConnectionReset.into());
            }
            self.inner.read(buf)
        }
    }
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    let input = FailsOnce {
        failed: false,
        inner: Cursor::new(t.clone()),
    };
    let err = unpack_layer(input, &l, &[], &diff_id(&t), Limits::UNLIMITED).unwrap_err();
    assert!(matches!(err, UnpackError::Read(_)), "{err}");
}

#[test]
fn a_zstd_frame_asking_for_a_window_over_the_bound_fails_and_one_within_it_unpacks() {
    let t = tarball(&[E::File("a", b"1", 0o644)]);
    let frame = |window_log: u32| {
        let mut e = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
        e.window_log(window_log).unwrap();
        e.write_all(&t).unwrap();
        e.finish().unwrap()
    };
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "within");
    let ok = frame(ZSTD_WINDOW_LOG_MAX);
    unpack_layer(Cursor::new(ok), &l, &[], &diff_id(&t), Limits::UNLIMITED).unwrap();
    let l = layer_dir(&root, "over");
    let over = frame(ZSTD_WINDOW_LOG_MAX + 1);
    let err =
        unpack_layer(Cursor::new(over), &l, &[], &diff_id(&t), Limits::UNLIMITED).unwrap_err();
    assert!(matches!(err, UnpackError::Read(_)), "{err}");
    let cause = std::error::Error::source(&err).unwrap().to_string();
    assert!(cause.contains("memory"), "{cause}");
}

#[test]
fn zstd_layers_of_several_frames_unpack_whole_and_trailing_bytes_fail() {
    // Parallel encoders may write a layer as several frames; `zstd -d` decodes them all.
    let t = tarball(&[
        E::File("first", &[b'a'; 3000], 0o644),
        E::File("second", &[b'b'; 3000], 0o644),
    ]);
    let mut frames = zstd::bulk::compress(&t[..2048], 1).unwrap();
    frames.extend(zstd::bulk::compress(&t[2048..], 1).unwrap());
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "frames");
    let u = unpack_layer(
        Cursor::new(&frames),
        &l,
        &[],
        &diff_id(&t),
        Limits::UNLIMITED,
    )
    .unwrap();
    assert_eq!(u.diff_id, diff_id(&t));
    assert_eq!(fs::read(l.join("second")).unwrap(), [b'b'; 3000]);

    let mut trailing = zstd::bulk::compress(&t[..], 1).unwrap();
    trailing.extend_from_slice(b"not a frame");
    let l = layer_dir(&root, "trailing");
    let err = unpack_layer(
        Cursor::new(trailing),
        &l,
        &[],
        &diff_id(&t),
        Limits::UNLIMITED,
    )
    .unwrap_err();
    assert!(matches!(err, UnpackError::Read(_)), "{err}");
}

#[test]
fn overlay_xattrs_from_a_layer_are_ignored() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    unpack(
        &tarball(&[E::Xattr("f", "trusted.overlay.redirect", b"/etc")]),
        &l,
        &[],
    )
    .unwrap();
    assert_eq!(
        xattr::get(l.join("f"), "trusted.overlay.redirect").unwrap(),
        None
    );
    // Nor on what cannot be opened to set them (device nodes, fifos, symlinks), while the
    // node's other xattrs are kept.
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([
        ("SCHILY.xattr.trusted.overlay.opaque", &b"y"[..]),
        ("SCHILY.xattr.trusted.hako-test", &b"1"[..]),
    ])
    .unwrap();
    let mut h = header(tar::EntryType::Fifo, 0o640, 0);
    b.append_data(&mut h, "p", io::empty()).unwrap();
    let l1 = layer_dir(&root, "l1");
    unpack(&b.into_inner().unwrap(), &l1, &[]).unwrap();
    assert_eq!(
        xattr::get(l1.join("p"), "trusted.overlay.opaque").unwrap(),
        None
    );
    assert_eq!(
        xattr::get(l1.join("p"), "trusted.hako-test")
            .unwrap()
            .as_deref(),
        Some(&b"1"[..])
    );
}

#[test]
fn opaque_lower_dir_hides_layers_below_it() {
    let root = tempfile::tempdir().unwrap();
    let l0 = layer_dir(&root, "l0");
    unpack(&tarball(&[E::Symlink("d/x", "/target")]), &l0, &[]).unwrap();
    let l1 = layer_dir(&root, "l1");
    unpack(
        &tarball(&[E::Dir("d/", 0o755), E::File("d/.wh..wh..opq", b"", 0o644)]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    let l2 = layer_dir(&root, "l2");
    // d/x is hidden by l1's opaque d, so d/x/f creates a directory d/x, not /target/f.
    unpack(
        &tarball(&[E::File("d/x/f", b"1", 0o644)]),
        &l2,
        &[l1.clone(), l0.clone()],
    )
    .unwrap();
    assert!(l2.join("d/x/f").exists());
    assert!(!l2.join("target").exists());
}

#[derive(Clone, Copy)]
enum Escape {
    Absolute,
    Relative,
    DeepRelative,
}

/// A symlink target that, followed on the host from `<T>/store/l0`, reaches `<T>/host/etc`:
/// absolute, relative with one `..` per level, or relative with far more `..` than levels.
fn escaping_target(sb: &Sandbox, which: Escape) -> String {
    let host_etc = sb.path().join("host/etc");
    match which {
        Escape::Absolute => host_etc.display().to_string(),
        Escape::Relative => "../../host/etc".into(),
        Escape::DeepRelative => format!(
            "{}{}",
            "../".repeat(32),
            host_etc.strip_prefix("/").unwrap().display()
        ),
    }
}

/// A layer with `a -> <target>` (a directory on the host), then a layer with a directory `a/`
/// and a hard link `x -> a/shadow`.
fn lower_symlink_then_hardlink_copy_up(which: Escape) {
    let sb = Sandbox::new();
    let target = escaping_target(&sb, which);
    fs::create_dir_all(sb.path().join("host/etc")).unwrap();
    let shadow = Canary::plant(&sb.path().join("host/etc/shadow"), b"HOST-SHADOW");
    let l0 = sb.layer("l0");
    unpack(&tarball(&[E::Symlink("a", &target)]), &l0, &[]).unwrap();
    assert!(l0.join("a/shadow").exists(), "{target}: fixture escapes");
    let l1 = sb.layer("l1");
    // `a/` here is a directory of its own: in the merged view it hides the lower symlink, so
    // `a/shadow` does not exist in the image.
    let t = tarball(&[E::Dir("a/", 0o755), E::Hardlink("x", "a/shadow")]);
    let result = unpack(&t, &l1, std::slice::from_ref(&l0));
    let leaked = files_containing(&sb.path().join("store"), b"HOST-SHADOW");
    assert!(
        leaked.is_empty(),
        "{target}: host file copied to {leaked:?}"
    );
    shadow.assert_untouched();
    sb.assert_untouched();
    let err = result.unwrap_err().to_string();
    assert!(
        err.contains("\"x\"") && err.contains("does not exist"),
        "{target}: {err}"
    );
}

#[test]
fn lower_symlink_then_hardlink_copy_up_absolute() {
    lower_symlink_then_hardlink_copy_up(Escape::Absolute);
}

#[test]
fn lower_symlink_then_hardlink_copy_up_relative() {
    lower_symlink_then_hardlink_copy_up(Escape::Relative);
}

#[test]
fn lower_symlink_then_hardlink_copy_up_deep_relative() {
    lower_symlink_then_hardlink_copy_up(Escape::DeepRelative);
}

#[test]
fn hardlink_through_a_lower_symlink_reaches_the_in_image_file() {
    let sb = Sandbox::new();
    let host_etc = sb.path().join("host/etc");
    fs::create_dir_all(&host_etc).unwrap();
    let shadow = Canary::plant(&host_etc.join("shadow"), b"HOST-SHADOW");
    let l0 = sb.layer("l0");
    // In the image, `a` points at the image's own `<same path>/shadow`: a chroot's meaning.
    let in_image = host_etc.strip_prefix("/").unwrap().join("shadow");
    unpack(
        &tarball(&[
            E::Symlink("a", host_etc.to_str().unwrap()),
            E::File(in_image.to_str().unwrap(), b"image shadow", 0o640),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = sb.layer("l1");
    unpack(
        &tarball(&[E::Hardlink("x", "a/shadow")]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    assert_eq!(fs::read(l1.join(&in_image)).unwrap(), b"image shadow");
    assert_eq!(
        fs::metadata(l1.join("x")).unwrap().ino(),
        fs::metadata(l1.join(&in_image)).unwrap().ino()
    );
    assert_eq!(
        fs::metadata(l1.join("x")).unwrap().mode() & 0o7777,
        0o640,
        "copy-up keeps the mode"
    );
    shadow.assert_untouched();
    sb.assert_untouched();
}

/// A layer with `d -> <target>` (a directory on the host), a layer with a directory `d/`, then
/// a layer writing `d/sub/f` and `d/lnk/f`, where the host has `sub/` and `lnk -> /elsewhere`.
fn lower_symlinked_dir_then_owner_and_mode_copy(which: Escape) {
    let sb = Sandbox::new();
    let host = sb.path().join("host");
    let target = escaping_target(&sb, which).replace("host/etc", "host");
    fs::create_dir_all(host.join("sub")).unwrap();
    fs::set_permissions(host.join("sub"), fs::Permissions::from_mode(0o710)).unwrap();
    std::os::unix::fs::chown(host.join("sub"), Some(1234), Some(5678)).unwrap();
    // A host symlink the merged view must not see either.
    std::os::unix::fs::symlink("/elsewhere", host.join("lnk")).unwrap();
    let l0 = sb.layer("l0");
    unpack(&tarball(&[E::Symlink("d", &target)]), &l0, &[]).unwrap();
    assert!(l0.join("d/sub").is_dir(), "{target}: fixture escapes");
    let l1 = sb.layer("l1");
    unpack(
        &tarball(&[E::Dir("d/", 0o755)]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    let l2 = sb.layer("l2");
    unpack(
        &tarball(&[
            E::File("d/sub/f", b"1", 0o644),
            E::File("d/lnk/f", b"2", 0o644),
        ]),
        &l2,
        &[l1.clone(), l0.clone()],
    )
    .unwrap();
    // `d` is l1's own directory, which hides l0's symlink: `d/sub` is new, 0755 root.
    let sub = fs::metadata(l2.join("d/sub")).unwrap();
    assert_eq!(
        (sub.mode() & 0o7777, sub.uid(), sub.gid()),
        (0o755, 0, 0),
        "{target}: owner and mode of d/sub"
    );
    assert!(l2.join("d/lnk/f").is_file(), "{target}");
    assert!(
        !l2.join("elsewhere").exists(),
        "{target}: a host symlink was followed"
    );
    let host_sub = fs::metadata(host.join("sub")).unwrap();
    assert_eq!(
        (host_sub.mode() & 0o7777, host_sub.uid(), host_sub.gid()),
        (0o710, 1234, 5678)
    );
    assert_eq!(fs::read_dir(host.join("sub")).unwrap().count(), 0);
    sb.assert_untouched();
}

#[test]
fn lower_symlinked_dir_then_owner_and_mode_copy_absolute() {
    lower_symlinked_dir_then_owner_and_mode_copy(Escape::Absolute);
}

#[test]
fn lower_symlinked_dir_then_owner_and_mode_copy_relative() {
    lower_symlinked_dir_then_owner_and_mode_copy(Escape::Relative);
}

#[test]
fn lower_symlinked_dir_then_owner_and_mode_copy_deep_relative() {
    lower_symlinked_dir_then_owner_and_mode_copy(Escape::DeepRelative);
}

#[test]
fn dotdot_in_a_lower_symlink_resolves_inside_the_root() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    unpack(
        &tarball(&[
            E::Dir("usr/lib/", 0o755),
            E::Symlink("a/b", "../usr/lib"),
            E::Symlink("a/deep", "../../../../../../usr/lib"),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = sb.layer("l1");
    unpack(
        &tarball(&[
            E::File("a/b/f", b"1", 0o644),
            E::File("a/deep/g", b"2", 0o644),
        ]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    assert_eq!(fs::read(l1.join("usr/lib/f")).unwrap(), b"1");
    assert_eq!(fs::read(l1.join("usr/lib/g")).unwrap(), b"2");
    sb.assert_untouched();
}

#[test]
fn copy_up_keeps_owner_mode_xattrs_and_mtime_of_the_lower_file() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    unpack(
        &tarball(&[
            E::FileOwned("bin/ping", b"elf", 0o4750, 7, 8),
            E::Xattr("bin/cap", "user.cap", b"net_raw"),
            E::Symlink("bin/sh", "busybox"),
            E::Fifo("run/ctl"),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = sb.layer("l1");
    unpack(
        &tarball(&[
            E::Hardlink("ping2", "bin/ping"),
            E::Hardlink("cap2", "bin/cap"),
            E::Hardlink("sh2", "bin/sh"),
            E::Hardlink("ctl2", "run/ctl"),
        ]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    let ping = fs::metadata(l1.join("bin/ping")).unwrap();
    assert_eq!(
        (ping.mode() & 0o7777, ping.uid(), ping.gid(), ping.mtime()),
        (0o4750, 7, 8, 1_600_000_000)
    );
    assert_eq!(ping.ino(), fs::metadata(l1.join("ping2")).unwrap().ino());
    assert_eq!(fs::read(l1.join("ping2")).unwrap(), b"elf");
    assert_eq!(
        xattr::get(l1.join("cap2"), "user.cap").unwrap().as_deref(),
        Some(&b"net_raw"[..])
    );
    assert_eq!(
        fs::read_link(l1.join("sh2")).unwrap(),
        PathBuf::from("busybox")
    );
    assert!(fs::symlink_metadata(l1.join("ctl2"))
        .unwrap()
        .file_type()
        .is_fifo());
    sb.assert_untouched();
}

#[test]
fn hardlink_to_a_lower_file_under_an_opaque_dir_does_not_exist() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    unpack(&tarball(&[E::File("d/f", b"old", 0o644)]), &l0, &[]).unwrap();
    let l1 = sb.layer("l1");
    let err = unpack(
        &tarball(&[
            E::File("d/.wh..wh..opq", b"", 0o644),
            E::Hardlink("x", "d/f"),
        ]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("does not exist"), "{err}");
}

/// A hard link to a directory, or to a name this layer whited out, is refused naming the
/// entry and the cause, in the layer that made them as in a layer below (a link to the whiteout
/// would make the link hide a lower file).
#[test]
fn hardlinks_to_this_layers_directories_and_whiteouts_are_refused() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    unpack(&tarball(&[E::File("gone", b"lower", 0o644)]), &l0, &[]).unwrap();
    let cases: [(&[E], &str); 2] = [
        (
            &[E::Dir("d/", 0o755), E::Hardlink("x", "d")],
            "hard link to directory \"d\"",
        ),
        (
            &[E::File(".wh.gone", b"", 0o644), E::Hardlink("x", "gone")],
            "hard link target \"gone\" does not exist",
        ),
    ];
    for (i, (entries, want)) in cases.into_iter().enumerate() {
        let err = unpack(
            &tarball(entries),
            &sb.layer(&format!("l1-{i}")),
            std::slice::from_ref(&l0),
        )
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
        assert!(err.contains(want) && err.contains("\"x\""), "{want}: {err}");
    }
}

/// An entry's path may pass 40 symlinks, as the kernel allows; the 41st, or a loop, is
/// refused naming the entry, and the unpack ends (a loop must not spin the unpack thread).
#[test]
fn symlink_chains_past_40_hops_and_loops_are_refused() {
    let sb = Sandbox::new();
    let names: Vec<String> = (0..=41).map(|i| format!("s{i}")).collect();
    let chain = |links: usize| -> Vec<u8> {
        let mut entries = vec![E::Dir("d/", 0o755)];
        for i in 0..links {
            let target = if i + 1 == links { "d" } else { &names[i + 1] };
            entries.push(E::Symlink(&names[i], target));
        }
        entries.push(E::File("s0/f", b"1", 0o644));
        tarball(&entries)
    };
    let l = sb.layer("forty");
    unpack(&chain(40), &l, &[]).unwrap();
    assert_eq!(fs::read(l.join("d/f")).unwrap(), b"1");
    for (layer, t) in [
        ("forty-one", chain(41)),
        (
            "loop",
            tarball(&[
                E::Symlink("a", "b"),
                E::Symlink("b", "a"),
                E::File("a/f", b"1", 0o644),
            ]),
        ),
    ] {
        let err = unpack(&t, &sb.layer(layer), &[])
            .map_err(|e| crate::error::chain(&e))
            .unwrap_err();
        assert!(
            err.contains("too many levels of symbolic links") && err.contains("/f\""),
            "{layer}: {err}"
        );
    }
    sb.assert_untouched();
}

/// A directory this layer made opaque stays opaque when a symlink's `..` climbs back into it:
/// a name it hides in the layers below (here a symlink) is not followed.
#[test]
fn an_opaque_directory_reached_again_through_dotdot_hides_the_layers_below() {
    let sb = Sandbox::new();
    let l1 = sb.two_layers(
        &[E::Dir("target/", 0o755), E::Symlink("o/s", "/target")],
        &[
            E::File("o/.wh..wh..opq", b"", 0o644),
            E::Dir("o/sub/", 0o755),
            E::Symlink("o/sub/link", "../s"),
            E::File("o/sub/link/f", b"1", 0o644),
        ],
    );
    assert_eq!(fs::read(l1.join("o/s/f")).unwrap(), b"1");
    assert!(
        !l1.join("target").exists(),
        "the hidden lower symlink was followed"
    );
}

/// A directory this layer creates under an opaque parent, or over a whiteout, takes nothing
/// from the lower directory it hides (not its mode), and hides the lower names below it (a
/// lower symlink is not followed).
#[test]
fn directories_made_under_an_opaque_parent_or_over_a_whiteout_hide_the_layers_below() {
    let sb = Sandbox::new();
    let l1 = sb.two_layers(
        &[
            E::Dir("o/d/", 0o700),
            E::Dir("target/", 0o755),
            E::Symlink("w/s", "/target"),
        ],
        &[
            E::File("o/.wh..wh..opq", b"", 0o644),
            E::File("o/d/f", b"1", 0o644),
            E::File(".wh.w", b"", 0o644),
            E::File("w/s/f", b"2", 0o644),
        ],
    );
    let mode = |p: &str| fs::metadata(l1.join(p)).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode("o/d"), 0o755, "not the hidden lower directory's 0700");
    assert_eq!(fs::read(l1.join("w/s/f")).unwrap(), b"2");
    assert!(
        !l1.join("target").exists(),
        "the whited-out lower symlink was followed"
    );
}

/// A hard link to a lower device node or FIFO copies it up with its mode.
#[test]
fn a_node_copied_up_for_a_hard_link_keeps_its_mode() {
    let sb = Sandbox::new();
    let l1 = sb.two_layers(&[E::Fifo("p")], &[E::Hardlink("x", "p")]);
    for name in ["p", "x"] {
        let m = fs::symlink_metadata(l1.join(name)).unwrap();
        assert!(m.file_type().is_fifo(), "{name}");
        assert_eq!(m.permissions().mode() & 0o7777, 0o640, "{name}");
    }
}

/// A name the nearest layer below lacks is looked for in the layers under it, unless a
/// directory of the nearest one is opaque or whites the name out: a hard link finds its target
/// two layers down in the first case and nothing in the others.
#[test]
fn lookups_go_past_a_lower_layer_lacking_the_name_unless_it_hides_it() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    unpack(&tarball(&[E::File("a/f", b"deep", 0o644)]), &l0, &[]).unwrap();
    let plain = sb.layer("plain");
    unpack(&tarball(&[E::File("a/g", b"1", 0o644)]), &plain, &[]).unwrap();
    let opaque = sb.layer("opaque");
    unpack(
        &tarball(&[E::File("a/.wh..wh..opq", b"", 0o644)]),
        &opaque,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    let whited = sb.layer("whited");
    unpack(
        &tarball(&[E::File("a/.wh.f", b"", 0o644)]),
        &whited,
        std::slice::from_ref(&l0),
    )
    .unwrap();
    let link = tarball(&[E::Hardlink("x", "a/f")]);
    let top = sb.layer("over-plain");
    unpack(&link, &top, &[plain.clone(), l0.clone()]).unwrap();
    assert_eq!(fs::read(top.join("x")).unwrap(), b"deep");
    // An opaque directory, or a whiteout of the name, in the nearest layer hides it.
    for (name, nearest) in [("over-opaque", opaque), ("over-whiteout", whited)] {
        let err = unpack(&link, &sb.layer(name), &[nearest, l0.clone()])
            .map_err(|e| crate::error::chain(&e))
            .unwrap_err();
        assert!(err.contains("does not exist"), "{name}: {err}");
    }
}

#[test]
fn replacing_a_directory_removes_its_symlinks_without_following_them() {
    let sb = Sandbox::new();
    let host = sb.path().join("host");
    fs::create_dir(&host).unwrap();
    let kept = Canary::plant(&host.join("kept"), b"host file");
    let l = sb.layer("l0");
    unpack(
        &tarball(&[
            E::Dir("d/", 0o755),
            E::Symlink("d/out", host.to_str().unwrap()),
            E::File("d", b"now a file", 0o644),
        ]),
        &l,
        &[],
    )
    .unwrap();
    assert_eq!(fs::read(l.join("d")).unwrap(), b"now a file");
    kept.assert_untouched();
    assert_eq!(fs::read_dir(&host).unwrap().count(), 1);
    sb.assert_untouched();
}

/// Directory times are set at the end, by path from the layer root; a later entry may have
/// put something else at that path. Found by tests/fuzz.rs: the layer failed at the end.
#[test]
fn directories_replaced_later_keep_no_pending_time_and_no_link_is_followed() {
    let sb = Sandbox::new();
    let host = sb.path().join("host");
    fs::create_dir_all(host.join("c")).unwrap();
    let old = filetime::FileTime::from_unix_time(1_234_567_890, 0);
    for d in [host.clone(), host.join("c")] {
        filetime::set_file_mtime(&d, old).unwrap();
    }
    let l = sb.layer("l0");
    let abs = host.to_str().unwrap();
    // From `l0/<name>`, two levels up is the sandbox.
    let rel = "../../host";
    let t = tarball(&[
        E::Dir("file/", 0o755),
        E::File("file", b"now a file", 0o644),
        E::Dir("abs/", 0o755),
        E::Symlink("abs", abs),
        E::Dir("rel/", 0o755),
        E::Symlink("rel", rel),
        // The directory stays; a parent of it becomes a link to a host directory that has one
        // of the same name.
        E::Dir("p/", 0o755),
        E::Dir("p/c/", 0o755),
        E::Symlink("p", abs),
        E::Dir("fifo/", 0o755),
        E::Fifo("fifo"),
        E::Dir("gone/", 0o755),
        E::Char(".wh.gone", 0, 0),
    ]);
    let u = unpack(&t, &l, &[]);
    assert!(u.is_ok(), "{:?}", u.map_err(|e| crate::error::chain(&e)));
    assert_eq!(fs::read(l.join("file")).unwrap(), b"now a file");
    assert_eq!(fs::read_link(l.join("abs")).unwrap(), Path::new(abs));
    assert_eq!(fs::read_link(l.join("rel")).unwrap(), Path::new(rel));
    assert_eq!(fs::read_link(l.join("p")).unwrap(), Path::new(abs));
    for d in [host.clone(), host.join("c")] {
        let m = fs::metadata(&d).unwrap();
        assert_eq!(
            m.mtime(),
            old.unix_seconds(),
            "{} time changed",
            d.display()
        );
    }
    sb.assert_untouched();
}

#[test]
fn names_longer_than_path_max_are_rejected() {
    let sb = Sandbox::new();
    let l = sb.layer("l0");
    let long = "d/".repeat(2100) + "f";
    let err = unpack(&tarball(&[E::File(&long, b"x", 0o644)]), &l, &[])
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(err.contains("more than 4096"), "{err}");
    assert_eq!(fs::read_dir(&l).unwrap().count(), 0, "nothing created");
    // The bound itself: a name of exactly 4096 bytes unpacks (20 directories of 200 bytes,
    // then a 76-byte file name).
    let exact = format!(
        "{}{}",
        format!("{}/", "a".repeat(200)).repeat(20),
        "f".repeat(76)
    );
    assert_eq!(exact.len(), 4096);
    let l = sb.layer("exact");
    unpack(&tarball(&[E::File(&exact, b"x", 0o644)]), &l, &[]).unwrap();
    // Walked a directory at a time: the whole path is longer than the kernel's path calls take.
    let mut dir = fs::File::open(&l).unwrap();
    let comps: Vec<&str> = exact.split('/').collect();
    for c in &comps[..comps.len() - 1] {
        dir = at::open_dir(&dir, OsStr::new(c)).unwrap();
    }
    let st = at::stat(&dir, OsStr::new(comps[comps.len() - 1]))
        .unwrap()
        .expect("the file at the end of the 4096-byte name");
    assert_eq!(st.st_size, 1);
}

fn unpack_limited(tar: &[u8], dest: &Path, limits: Limits) -> Result<Unpacked, UnpackError> {
    unpack_layer(Cursor::new(tar.to_vec()), dest, &[], &diff_id(tar), limits)
}

fn bytes(max_bytes: u64) -> Limits {
    Limits {
        max_bytes,
        max_entries: 0,
    }
}

#[test]
fn the_byte_bound_counts_the_uncompressed_stream() {
    let sb = Sandbox::new();
    let data = vec![7u8; 1 << 20];
    let t = tarball(&[E::File("big", &data, 0o644)]);
    // The whole stream fits exactly.
    unpack_limited(&t, &sb.layer("fits"), bytes(t.len() as u64)).unwrap();
    let err = unpack_limited(&t, &sb.layer("over"), bytes(t.len() as u64 - 1)).unwrap_err();
    assert!(
        matches!(err, UnpackError::TooLarge { limit, .. } if limit == t.len() as u64 - 1),
        "{err}"
    );
    let err = unpack_limited(&t, &sb.layer("small"), bytes(64 << 10))
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(
        err.contains("image.max_layer_unpacked_bytes = 65536") && err.contains("\"big\""),
        "{err}"
    );
    // Bytes after the end of the archive count too (they are hashed, so they are read).
    let mut padded = tarball(&[E::File("a", b"1", 0o644)]);
    let len = padded.len() as u64;
    padded.extend(std::iter::repeat_n(0u8, 1 << 20));
    let err = unpack_limited(&padded, &sb.layer("padded"), bytes(len + 4096)).unwrap_err();
    assert!(matches!(err, UnpackError::TooLarge { .. }), "{err}");
}

/// A layer of one GNU sparse file, `sparse`, of `real` bytes, all of them a hole: a stream of
/// one header, whatever `real` is.
fn sparse_tar(real: u64) -> Vec<u8> {
    let mut h = header(tar::EntryType::GNUSparse, 0o644, 0);
    h.set_path("sparse").unwrap();
    let gnu = h.as_gnu_mut().unwrap();
    gnu.set_real_size(real);
    gnu.sparse[0].set_offset(real);
    gnu.sparse[0].set_length(0);
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, io::empty()).unwrap();
    b.into_inner().unwrap()
}

#[test]
fn the_byte_bound_counts_what_a_sparse_file_expands_to() {
    let sb = Sandbox::new();
    // One 512-byte GNU sparse header describing a 1 GiB hole: tiny stream, 1 GiB of zeros.
    let t = sparse_tar(1 << 30);
    assert!(t.len() < 4096);
    let l = sb.layer("l0");
    let err = unpack_limited(&t, &l, bytes(1 << 20))
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(
        err.contains("image.max_layer_unpacked_bytes = 1048576") && err.contains("\"sparse\""),
        "{err}"
    );
    assert!(fs::metadata(l.join("sparse")).unwrap().len() <= 1 << 20);
}

#[test]
fn the_byte_bound_on_written_content_is_inclusive() {
    let sb = Sandbox::new();
    // A sparse file of 300 000 bytes from a stream of under 4 KiB: the written bytes, not
    // the stream, reach the bound, and not at a multiple of the copy buffer.
    let real = 300_000u64;
    let t = sparse_tar(real);
    assert!((t.len() as u64) < real - 1);
    let fits = sb.layer("fits");
    unpack_limited(&t, &fits, bytes(real)).unwrap();
    assert_eq!(fs::metadata(fits.join("sparse")).unwrap().len(), real);
    let err = unpack_limited(&t, &sb.layer("over"), bytes(real - 1)).unwrap_err();
    assert!(
        matches!(err, UnpackError::TooLarge { limit, .. } if limit == real - 1),
        "{err}"
    );
}

#[test]
fn an_xattr_the_filesystem_refuses_fails_the_layer_unless_it_is_unsupported() {
    let root = tempfile::tempdir().unwrap();
    // A namespace no filesystem knows: EOPNOTSUPP, passed over with a warning, as for a
    // filesystem without xattrs.
    let l0 = layer_dir(&root, "l0");
    unpack(&tarball(&[E::Xattr("f", "hako.test", b"1")]), &l0, &[]).unwrap();
    assert_eq!(fs::read(l0.join("f")).unwrap(), b"x");
    // A value over the kernel's 64 KiB: E2BIG on every filesystem, and the layer is not
    // unpacked without it.
    let big = vec![b'v'; 70_000];
    let l1 = layer_dir(&root, "l1");
    let err = unpack(&tarball(&[E::Xattr("f", "trusted.big", &big)]), &l1, &[])
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(
        err.contains("set xattr on") && err.contains("\"f\""),
        "{err}"
    );
}

#[test]
fn the_entry_bound_counts_implied_parent_directories() {
    let sb = Sandbox::new();
    let entries = |n| Limits {
        max_bytes: 0,
        max_entries: n,
    };
    let t = tarball(&[
        E::File("a", b"1", 0o644),
        E::File("b", b"1", 0o644),
        E::Hardlink("c", "a"),
    ]);
    unpack_limited(&t, &sb.layer("fits"), entries(3)).unwrap();
    let err = unpack_limited(&t, &sb.layer("over"), entries(2))
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(
        err.contains("image.max_layer_entries = 2") && err.contains("\"c\""),
        "{err}"
    );
    // One entry, seven names: six directories the tar never lists, and the file.
    let deep = tarball(&[E::File("1/2/3/4/5/6/f", b"1", 0o644)]);
    unpack_limited(&deep, &sb.layer("deep_fits"), entries(7)).unwrap();
    let err = unpack_limited(&deep, &sb.layer("deep_over"), entries(6)).unwrap_err();
    assert!(
        matches!(err, UnpackError::TooManyEntries { limit: 6, .. }),
        "{err}"
    );
}

#[test]
fn entry_headers_held_in_memory_are_bounded() {
    let sb = Sandbox::new();
    let huge = vec![b'a'; (MAX_ENTRY_HEADER_BYTES + (1 << 20)) as usize];
    let mut b = tar::Builder::new(Vec::new());
    let mut h = header(tar::EntryType::Regular, 0o644, 1);
    b.append_data(&mut h, "first", &b"1"[..]).unwrap();
    b.append_pax_extensions([("comment", &huge[..])]).unwrap();
    let mut h = header(tar::EntryType::Regular, 0o644, 1);
    b.append_data(&mut h, "second", &b"2"[..]).unwrap();
    let t = b.into_inner().unwrap();
    let err = unpack_limited(&t, &sb.layer("l0"), Limits::UNLIMITED)
        .map_err(|e| crate::error::chain(&e))
        .unwrap_err();
    assert!(
        err.contains("headers") && err.contains("4194304") && err.contains("\"first\""),
        "{err}"
    );
    // Headers under the bound are fine.
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([("comment", &huge[..1 << 20])])
        .unwrap();
    let mut h = header(tar::EntryType::Regular, 0o644, 1);
    b.append_data(&mut h, "ok", &b"1"[..]).unwrap();
    // And an entry's content, read once its headers are parsed, is not a header: a file
    // larger than the header bound unpacks.
    h.set_size(huge.len() as u64);
    b.append_data(&mut h, "big", &huge[..]).unwrap();
    let t = b.into_inner().unwrap();
    let l1 = sb.layer("l1");
    unpack_limited(&t, &l1, Limits::UNLIMITED).unwrap();
    assert_eq!(fs::read(l1.join("big")).unwrap(), huge);
}

#[test]
fn pax_records_give_the_owner_and_the_mtime() {
    // IDs above what a ustar header's octal fields hold (2097151), as images built for user
    // namespaces have, and sub-second times, only fit in pax records; they override the
    // header's own fields.
    let root = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    b.append_pax_extensions([
        ("uid", &b"3000000"[..]),
        ("gid", &b"3000001"[..]),
        ("mtime", &b"1700000000.25"[..]),
    ])
    .unwrap();
    let mut h = header(tar::EntryType::Regular, 0o640, 1);
    h.set_uid(1);
    h.set_gid(2);
    h.set_mtime(3);
    b.append_data(&mut h, "f", &b"x"[..]).unwrap();
    // Only the gid in a record: the uid comes from the header.
    b.append_pax_extensions([("gid", &b"4000000"[..])]).unwrap();
    b.append_data(&mut h, "g", &b"y"[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let dest = layer_dir(&root, "l0");
    unpack(&tar, &dest, &[]).unwrap();
    let f = fs::symlink_metadata(dest.join("f")).unwrap();
    assert_eq!((f.uid(), f.gid()), (3_000_000, 3_000_001));
    assert_eq!((f.mtime(), f.mtime_nsec()), (1_700_000_000, 250_000_000));
    assert_eq!(f.mode() & 0o7777, 0o640);
    let g = fs::symlink_metadata(dest.join("g")).unwrap();
    assert_eq!((g.uid(), g.gid()), (1, 4_000_000));
    assert_eq!(g.mtime(), 3);
}

#[test]
fn paths_nested_deeper_than_path_max_through_symlinks_are_rejected() {
    let sb = Sandbox::new();
    let l0 = sb.layer("l0");
    let deep = "d/".repeat(2000);
    unpack(&tarball(&[E::Symlink("s", &deep)]), &l0, &[]).unwrap();
    let l1 = sb.layer("l1");
    let name = format!("s/{}f", "e/".repeat(100));
    let err = unpack(
        &tarball(&[E::File(&name, b"x", 0o644)]),
        &l1,
        std::slice::from_ref(&l0),
    )
    .map_err(|e| crate::error::chain(&e))
    .unwrap_err();
    assert!(err.contains("resolves to a path longer than 4096"), "{err}");
}

#[test]
fn disk_usage_measures_deep_trees_and_follows_no_symlink() {
    let sb = Sandbox::new();
    let host = sb.path().join("host");
    fs::create_dir(&host).unwrap();
    fs::write(host.join("big"), vec![1u8; 1 << 20]).unwrap();
    let l = sb.layer("l0");
    // 1500 levels of 5 bytes: deeper than PATH_MAX, so only a descriptor walk gets there.
    let mut dir = at::open_root(&l).unwrap();
    for _ in 0..1500 {
        at::mkdir(&dir, OsStr::new("dddd")).unwrap();
        dir = at::open_dir(&dir, OsStr::new("dddd")).unwrap();
    }
    let mut f = at::create(&dir, OsStr::new("leaf")).unwrap();
    f.write_all(&[2u8; 8192]).unwrap();
    let (bytes, inodes) = disk_usage(&l).unwrap();
    // The root, 1500 directories and the leaf.
    assert_eq!(inodes, 1502);
    assert!(bytes >= 1500 * 4096 + 8192, "{bytes}");
    // A symlink to a host directory adds itself (stored inline), not what it points to.
    std::os::unix::fs::symlink(&host, l.join("out")).unwrap();
    assert_eq!(disk_usage(&l).unwrap(), (bytes, inodes + 1));
}

#[test]
fn a_directory_replaced_mid_layer_is_resolved_again_for_the_next_files() {
    // Files of one directory reuse its resolution; an entry replacing that directory with a
    // symlink (or a whiteout of it) must send the next files through the new path.
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l");
    let t = tarball(&[
        E::Dir("c", 0o755),
        E::File("a/b/f1", b"1", 0o644),
        E::File("a/b/f2", b"2", 0o644),
        E::Symlink("a/b", "../c"),
        E::File("a/b/f3", b"3", 0o644),
        E::File("a/b/f4", b"4", 0o644),
        E::File("d/g1", b"1", 0o644),
        E::File("d/.wh.g1", b"", 0o644),
        E::File("d/g2", b"2", 0o644),
    ]);
    unpack(&t, &l, &[]).unwrap();
    assert_eq!(fs::read_link(l.join("a/b")).unwrap(), Path::new("../c"));
    assert_eq!(fs::read(l.join("c/f3")).unwrap(), b"3");
    assert_eq!(fs::read(l.join("c/f4")).unwrap(), b"4");
    assert!(!l.join("c/f1").exists());
    assert!(fs::symlink_metadata(l.join("d/g1"))
        .unwrap()
        .file_type()
        .is_char_device());
    assert_eq!(fs::read(l.join("d/g2")).unwrap(), b"2");
}

#[test]
fn a_file_gets_its_entrys_owner_and_mode_whatever_its_directory_gives_new_files() {
    // What a directory imposes on the files created in it is undone: a setgid directory's
    // group and a default ACL's mask (an unpack that created files with their modes and
    // skipped the chown and chmod where they looked needless would miss both).
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    // Directories and one-byte files, with a group.
    let with_gid = |kind, mode, gid| {
        let mut h = header(kind, mode, u64::from(kind == tar::EntryType::Regular));
        h.set_gid(gid);
        h
    };
    // system.posix_acl_default of user::rwx group::--- other::---: a version, then tag,
    // permissions and id per entry.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm) in [(0x01u16, 7u16), (0x04, 0), (0x20, 0)] {
        acl.extend(tag.to_le_bytes());
        acl.extend(perm.to_le_bytes());
        acl.extend(u32::MAX.to_le_bytes());
    }
    let mut b = tar::Builder::new(Vec::new());
    let mut h = with_gid(tar::EntryType::Directory, 0o2775, 1234);
    b.append_data(&mut h, "sgid/", io::empty()).unwrap();
    let mut h = with_gid(tar::EntryType::Regular, 0o644, 0);
    b.append_data(&mut h, "sgid/f", &b"x"[..]).unwrap();
    b.append_pax_extensions([("SCHILY.xattr.system.posix_acl_default", &acl[..])])
        .unwrap();
    let mut h = with_gid(tar::EntryType::Directory, 0o755, 0);
    b.append_data(&mut h, "acl/", io::empty()).unwrap();
    let mut h = with_gid(tar::EntryType::Regular, 0o644, 0);
    b.append_data(&mut h, "acl/f", &b"x"[..]).unwrap();
    let mut h = with_gid(tar::EntryType::Regular, 0o1751, 0);
    b.append_data(&mut h, "sticky", &b"x"[..]).unwrap();
    let mut h = with_gid(tar::EntryType::Regular, 0o000, 0);
    b.append_data(&mut h, "none", &b"x"[..]).unwrap();
    unpack(&b.into_inner().unwrap(), &l, &[]).unwrap();

    let d = fs::metadata(l.join("sgid")).unwrap();
    assert_eq!((d.gid(), d.mode() & 0o7777), (1234, 0o2775));
    let f = fs::metadata(l.join("sgid/f")).unwrap();
    assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (0, 0, 0o644));
    assert_eq!(
        fs::metadata(l.join("sticky")).unwrap().mode() & 0o7777,
        0o1751
    );
    assert_eq!(fs::metadata(l.join("none")).unwrap().mode() & 0o7777, 0);
    if xattr::get(l.join("acl"), "system.posix_acl_default")
        .unwrap()
        .is_none()
    {
        eprintln!("SKIP the default ACL case: this filesystem keeps no ACLs");
        return;
    }
    assert_eq!(
        fs::metadata(l.join("acl/f")).unwrap().mode() & 0o7777,
        0o644
    );
}
