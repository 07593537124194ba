use super::*;
use std::io::Cursor;

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

fn diff_id(tar: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(tar))
}

fn unpack(tar: &[u8], dest: &Path, lowers: &[PathBuf]) -> Result<Unpacked, UnpackError> {
    unpack_layer(Cursor::new(tar.to_vec()), dest, lowers, &diff_id(tar))
}

fn layer_dir(root: &tempfile::TempDir, name: &str) -> PathBuf {
    let p = root.path().join(name);
    fs::create_dir(&p).unwrap();
    p
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

#[test]
fn symlink_escapes_are_contained() {
    let root = tempfile::tempdir().unwrap();
    let outside = root.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let l = layer_dir(&root, "l0");
    // Absolute and relative links pointing out of the root, then writes through them.
    let t = tarball(&[
        E::Symlink("abs", outside.to_str().unwrap()),
        E::File("abs/pwned", b"x", 0o644),
        E::Symlink("rel", "../../../../../../outside"),
        E::File("rel/pwned2", b"x", 0o644),
    ]);
    unpack(&t, &l, &[]).unwrap();
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing written outside"
    );
    // Both landed inside the layer, where the links would resolve in a chroot.
    let inside = l.join(outside.strip_prefix("/").unwrap()).join("pwned");
    assert!(inside.exists(), "{}", inside.display());
    assert!(l.join("outside/pwned2").exists());
}

#[test]
fn dotdot_names_are_rejected_with_the_entry_named() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    let t = tarball(&[E::RawFile("../../escape", b"x")]);
    let err = unpack(&t, &l, &[]).unwrap_err().to_string();
    assert!(
        err.contains("../../escape") && err.contains("climbs out"),
        "{err}"
    );
    assert!(!root.path().join("escape").exists());
}

#[test]
fn hardlink_cannot_reach_outside() {
    let root = tempfile::tempdir().unwrap();
    let secret = root.path().join("secret");
    fs::write(&secret, b"s").unwrap();
    let l = layer_dir(&root, "l0");
    let t = tarball(&[E::Symlink("up", "/"), E::Hardlink("stolen", "up/../secret")]);
    let err = unpack(&t, &l, &[]).unwrap_err().to_string();
    assert!(
        err.contains("stolen") && err.contains("does not exist"),
        "{err}"
    );
    assert_eq!(fs::metadata(&secret).unwrap().nlink(), 1);
}

#[test]
fn directory_recreated_over_a_whiteout_is_opaque() {
    let root = tempfile::tempdir().unwrap();
    let l0 = layer_dir(&root, "l0");
    unpack(
        &tarball(&[
            E::Symlink("data", "/etc"),
            E::File("old/stale", b"0", 0o644),
        ]),
        &l0,
        &[],
    )
    .unwrap();
    let l1 = layer_dir(&root, "l1");
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
    assert!(!l1.join("etc").exists());
    for d in ["data", "old"] {
        assert_eq!(
            xattr::get(l1.join(d), OPAQUE_XATTR).unwrap().as_deref(),
            Some(&b"y"[..]),
            "{d}"
        );
    }
}

#[test]
fn diff_id_mismatch_is_an_error() {
    let root = tempfile::tempdir().unwrap();
    let l = layer_dir(&root, "l0");
    let t = tarball(&[E::File("a", b"1", 0o644)]);
    let err = unpack_layer(Cursor::new(t), &l, &[], "sha256:0000").unwrap_err();
    assert!(matches!(err, UnpackError::DiffIdMismatch { .. }), "{err}");
}

#[test]
fn gzip_and_zstd_layers_unpack_with_the_uncompressed_digest() {
    let t = tarball(&[E::File("hello", b"world", 0o644)]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&t).unwrap();
    let gz = gz.finish().unwrap();
    let zst =
        ruzstd::encoding::compress_to_vec(&t[..], ruzstd::encoding::CompressionLevel::Fastest);
    for (name, data) in [("gz", gz), ("zst", zst)] {
        let root = tempfile::tempdir().unwrap();
        let l = layer_dir(&root, name);
        let u = unpack_layer(Cursor::new(data), &l, &[], &diff_id(&t)).unwrap();
        assert_eq!(u.diff_id, diff_id(&t));
        assert_eq!(fs::read(l.join("hello")).unwrap(), b"world", "{name}");
    }
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
