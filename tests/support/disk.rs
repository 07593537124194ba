//! A disk that loses writes: ext4 in a sparse 512 MiB file on a 16 MiB tmpfs, so that data
//! beyond what the tmpfs holds fails its writeback; `grow` then gives the tmpfs room, so that
//! later writes succeed and only the errors already recorded remain. Needs root, `mount`,
//! `truncate` and `mkfs.ext4`. Standalone (std only): the crate's unit tests include it too.

use std::path::Path;

fn run(args: &[&str]) {
    let out = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}: {out:?}");
}

/// Mounts the small tmpfs on `backing` and the ext4 made in it on `mountpoint` (both existing
/// directories). The caller unmounts them, `mountpoint` first.
pub fn mount_small_ext4(backing: &Path, mountpoint: &Path) {
    let b = backing.to_str().unwrap();
    let file = format!("{b}/ext4.img");
    run(&["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", b]);
    run(&["truncate", "-s", "512M", &file]);
    // No journal: only the writes that failed are lost, not every later commit. Inode tables
    // written now, not by a lazy-init thread filling the tmpfs later.
    run(&[
        "mkfs.ext4",
        "-q",
        "-F",
        "-O",
        "^has_journal",
        "-N",
        "8192",
        "-E",
        "lazy_itable_init=0,nodiscard",
        &file,
    ]);
    run(&[
        "mount",
        "-o",
        "loop,errors=continue",
        &file,
        mountpoint.to_str().unwrap(),
    ]);
}

/// Gives the tmpfs under the ext4 room (1 GiB): writes from now on reach it.
pub fn grow(backing: &Path) {
    run(&["mount", "-o", "remount,size=1g", backing.to_str().unwrap()]);
}
