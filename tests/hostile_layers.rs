//! End-to-end tests of hostile image layers: a real `hako serve`, a real registry (Debian's
//! docker-registry) on 127.0.0.1, images built here. A layer must not read the host through a
//! lower layer's symlink, and a decompression bomb must fail cleanly, with a bounded daemon,
//! leaving nothing under hako's root.

mod support;

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use hako_proto::cri;
use support::hako::{pull, Hako};
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher, Tar};
use support::registry::Registry;

/// The daemon's peak resident memory must stay under this while it refuses a bomb. An idle
/// daemon refusing these bombs peaks under 50 MiB here; one that got through would add hundreds
/// of MiB or GiB.
const PEAK_RSS_BOUND_KIB: u64 = 256 * 1024;

async fn image_count(h: &Hako) -> usize {
    let mut c = h.images().await;
    c.list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images
        .len()
}

/// What a failed pull may leave under hako's root: nothing in `snapshots/` (no layer, no
/// `tmp-*` unpack dir), `ingest/` or `trash/`, once the layers still running have ended.
async fn assert_nothing_left(h: &Hako) {
    let dirs = ["snapshots", "ingest", "trash"];
    h.settle_store(&dirs).await;
    for d in dirs {
        let dir = h.root.join(d);
        assert!(
            dir.is_dir(),
            "{} exists while the daemon runs",
            dir.display()
        );
        let left = Hako::files_under(&dir);
        assert!(left.is_empty(), "left in {}: {left:?}", dir.display());
    }
}

/// A pull refused as a user must see it: INVALID_ARGUMENT with a message naming each of
/// `parts`, no image listed, nothing left under hako's root.
async fn assert_refused(h: &Hako, result: Result<String, tonic::Status>, parts: &[&str]) {
    let err = result.expect_err("the pull is refused");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    for part in parts {
        assert!(
            err.message().contains(part),
            "{part:?} in {}",
            err.message()
        );
    }
    assert_eq!(image_count(h).await, 0);
    assert_nothing_left(h).await;
}

/// Peak resident memory of a process, from `VmHWM` in /proc/<pid>/status.
fn peak_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Every regular file under `dir` whose content holds `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if md.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if md.is_file() {
            let data = std::fs::read(&p).unwrap();
            if data.windows(needle.len()).any(|w| w == needle) {
                out.push(p);
            }
        }
    }
    out
}

/// A host file whose content, inode, link count and mtime must not change.
struct Canary {
    path: PathBuf,
    content: Vec<u8>,
    stat: (u64, u64, i64),
}

impl Canary {
    fn plant(path: &Path, content: &[u8]) -> Canary {
        std::fs::write(path, content).unwrap();
        filetime::set_file_mtime(path, filetime::FileTime::from_unix_time(1_234_567_890, 0))
            .unwrap();
        let md = std::fs::symlink_metadata(path).unwrap();
        Canary {
            path: path.into(),
            content: content.into(),
            stat: (md.ino(), md.nlink(), md.mtime()),
        }
    }

    fn assert_untouched(&self) {
        let md = std::fs::symlink_metadata(&self.path).unwrap();
        assert_eq!(
            (md.ino(), md.nlink(), md.mtime()),
            self.stat,
            "canary {} (inode, links, mtime)",
            self.path.display()
        );
        assert_eq!(std::fs::read(&self.path).unwrap(), self.content);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn symlink_then_hardlink_copy_up_never_copies_a_host_file() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    // The host's "/etc/shadow": a canary with a content no image has.
    let host = tempfile::tempdir().unwrap();
    let host_etc = host.path().canonicalize().unwrap().join("etc");
    std::fs::create_dir(&host_etc).unwrap();
    let secret = format!(
        "HAKO-HOST-SECRET-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let shadow = Canary::plant(&host_etc.join("shadow"), secret.as_bytes());
    let relative = format!(
        "{}{}",
        "../".repeat(40),
        host_etc.strip_prefix("/").unwrap().display()
    );
    let reg = Registry::start();
    let pusher = Pusher::new(&reg.addr);
    let mut images = Vec::new();
    for (repo, target) in [
        ("hostile/copyup-absolute", host_etc.display().to_string()),
        ("hostile/copyup-relative", relative),
    ] {
        // Layer 1: `a -> <host etc>`. Layer 2: a directory `a/` and `x` hard-linked to
        // `a/shadow`, which a host-side lookup in layer 1 would find through the symlink.
        let mut l1 = Tar::default();
        l1.symlink("a", &target);
        let mut l2 = Tar::default();
        l2.dir("a", 0o755).hardlink("x", "a/shadow", 0o644);
        let img = Image::new(
            vec![
                Layer::new(&l1.finish(), Compression::Gzip, false),
                Layer::new(&l2.finish(), Compression::Gzip, false),
            ],
            &ImageConf::default(),
            false,
        );
        pusher.push(repo, "1", &img).await;
        images.push(format!("{}/{repo}:1", reg.addr));
    }
    let h = Hako::start("");
    for image in &images {
        let result = pull(&h, image).await;
        // Whatever the pull did, the host file is nowhere under hako's root or state.
        let leaked = files_containing(h.dir.path(), secret.as_bytes());
        assert!(leaked.is_empty(), "{image}: host file copied to {leaked:?}");
        shadow.assert_untouched();
        // In the image, layer 2's `a/` hides layer 1's symlink: `a/shadow` does not exist.
        let err = result.expect_err(image);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(
            err.message().contains(image.as_str())
                && err.message().contains("\"x\"")
                && err.message().contains("does not exist"),
            "{}",
            err.message()
        );
    }
    assert_eq!(image_count(&h).await, 0);
    assert_nothing_left(&h).await;
}

/// Computes SHA-256 with `openssl dgst` (optimised: GiBs hash in seconds, where this
/// unoptimised test build takes minutes) over what `write` produces, streamed.
const OPENSSL: &str = "/usr/bin/openssl";

fn sha256_streamed(write: impl FnOnce(&mut dyn Write)) -> String {
    let mut child = std::process::Command::new(OPENSSL)
        .args(["dgst", "-sha256", "-r"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run openssl dgst");
    {
        let mut stdin = child.stdin.take().unwrap();
        write(&mut stdin);
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "openssl dgst: {}", out.status);
    let hex = String::from_utf8(out.stdout).unwrap();
    let hex = hex.split_whitespace().next().unwrap().to_string();
    assert_eq!(hex.len(), 64, "{hex}");
    format!("sha256:{hex}")
}

/// A gzip layer that decompresses to one tar entry `name` of type `kind` holding `size` zero
/// bytes (a multiple of 64 MiB), built as gzip members over one compressed 64 MiB chunk, so
/// neither side ever holds the uncompressed stream. Its diff id is the real one: the bomb is a
/// valid layer, and only a bound stops it.
fn zero_bomb(name: &str, kind: tar::EntryType, size: u64) -> Layer {
    const CHUNK: u64 = 64 << 20;
    assert_eq!(size % CHUNK, 0);
    let gzip = |data: &mut dyn FnMut(&mut dyn Write)| {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        data(&mut gz);
        gz.finish().unwrap()
    };
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_path(name).unwrap();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_cksum();
    let zeros = vec![0u8; 1 << 20];
    let mut blob = gzip(&mut |w| w.write_all(h.as_bytes()).unwrap());
    let chunk = gzip(&mut |w| {
        for _ in 0..CHUNK / zeros.len() as u64 {
            w.write_all(&zeros).unwrap();
        }
    });
    for _ in 0..size / CHUNK {
        blob.extend_from_slice(&chunk);
    }
    // The end-of-archive: two zero blocks (the content needs no padding).
    blob.extend(gzip(&mut |w| w.write_all(&zeros[..1024]).unwrap()));
    let diff_id = sha256_streamed(|w| {
        w.write_all(h.as_bytes()).unwrap();
        for _ in 0..size / zeros.len() as u64 {
            w.write_all(&zeros).unwrap();
        }
        w.write_all(&zeros[..1024]).unwrap();
    });
    Layer {
        digest: oci::sha256(&blob),
        diff_id,
        blob,
        media_type: "application/vnd.oci.image.layer.v1.tar+gzip".into(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn gzip_bomb_fails_at_the_configured_bound_and_leaves_nothing() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, OPENSSL]) {
        return;
    }
    // 4 GiB of zeros in a file, about 4 MiB compressed.
    let bomb = zero_bomb("zeros", tar::EntryType::Regular, 4 << 30);
    assert!(bomb.blob.len() < 8 << 20, "{} bytes", bomb.blob.len());
    let reg = Registry::start();
    let base = Layer::new(
        &oci::marker_tar("etc/hostname", b"bomb\n"),
        Compression::Gzip,
        false,
    );
    let img = Image::new(vec![base, bomb.clone()], &ImageConf::default(), false);
    Pusher::new(&reg.addr).push("hostile/bomb", "1", &img).await;
    let h = Hako::start("[image]\nmax_layer_unpacked_bytes = 67108864\n");
    let image = format!("{}/hostile/bomb:1", reg.addr);
    let result = pull(&h, &image).await;
    let parts = [
        image.as_str(),
        bomb.digest.as_str(),
        "image.max_layer_unpacked_bytes = 67108864",
    ];
    assert_refused(&h, result, &parts).await;
    // The peak once the store is clean: the layer below may still run when the pull answers.
    let peak = peak_rss_kib(h.pid());
    assert!(
        peak < PEAK_RSS_BOUND_KIB,
        "daemon peak RSS {peak} KiB, bound {PEAK_RSS_BOUND_KIB} KiB"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn header_bomb_is_refused_without_holding_it_in_memory() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, OPENSSL]) {
        return;
    }
    // A 1 GiB pax header, about 1 MiB compressed: the tar reader would hold it whole. The
    // default bounds apply: the header bound, not the byte bound, stops it.
    let bomb = zero_bomb("pax", tar::EntryType::XHeader, 1 << 30);
    let reg = Registry::start();
    let img = Image::new(vec![bomb.clone()], &ImageConf::default(), false);
    Pusher::new(&reg.addr).push("hostile/pax", "1", &img).await;
    let h = Hako::start("");
    let image = format!("{}/hostile/pax:1", reg.addr);
    let result = pull(&h, &image).await;
    let peak = peak_rss_kib(h.pid());
    assert!(
        peak < PEAK_RSS_BOUND_KIB,
        "daemon peak RSS {peak} KiB, bound {PEAK_RSS_BOUND_KIB} KiB"
    );
    let parts = [image.as_str(), bomb.digest.as_str(), "headers", "4194304"];
    assert_refused(&h, result, &parts).await;
}

/// A zstd layer whose frame asks for a 2 GiB window, the format's largest: refused before the
/// decoder sets it up, with an error naming the image, the layer and the cause, and nothing
/// left under hako's root.
#[tokio::test(flavor = "multi_thread")]
async fn a_zstd_frame_asking_for_a_2_gib_window_is_refused_and_leaves_nothing() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let tar = oci::marker_tar("etc/window", b"2 GiB\n");
    let mut e = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    e.window_log(31).unwrap();
    e.write_all(&tar).unwrap();
    let blob = e.finish().unwrap();
    let layer = Layer {
        digest: oci::sha256(&blob),
        diff_id: oci::sha256(&tar),
        blob,
        media_type: "application/vnd.oci.image.layer.v1.tar+zstd".into(),
    };
    let reg = Registry::start();
    let base = Layer::new(
        &oci::marker_tar("etc/hostname", b"window\n"),
        Compression::Gzip,
        false,
    );
    let img = Image::new(vec![base, layer.clone()], &ImageConf::default(), false);
    Pusher::new(&reg.addr)
        .push("hostile/window", "1", &img)
        .await;
    let h = Hako::start("");
    let image = format!("{}/hostile/window:1", reg.addr);
    let result = pull(&h, &image).await;
    assert_refused(&h, result, &[&image, &layer.digest, "memory"]).await;
}
