//! Pull benchmark, two parts, each runtime in the same run on the same machine, alternating:
//!
//! - Pull: a multi-layer image of about 200 MB from a local registry, pulled and unpacked
//!   through CRI `PullImage` by hako (as configured by default, with
//!   `image.wait_for_layer_sync` and without `image.sync_layers`), Debian's
//!   containerd 1.6 and containerd 2.x (built by `.ci/build-containerd.sh`, see
//!   `common::containerd2_dir`), each pull cold (the image removed in between).
//! - Cold start: from `PullImage` of an image the node does not have to the container's first
//!   log line (`PullImage`, `CreateContainer`, `StartContainer`, then the log file read until
//!   its first line), every round on a freshly started runtime with an empty root (only the
//!   pod sandbox, and containerd's pause image, exist before the clock starts). Three images:
//!   about 210 MB of incompressible data, and a distro-like one built from this machine's
//!   /usr/lib and /usr/share files (6 layers, a few hundred MB), gzip and zstd.
//!
//! `cargo bench --bench pull` (as root; needs docker-registry, containerd and runc).
//! `HAKO_BENCH_ROUNDS` sets the number of pulls per runtime (default 5), `HAKO_BENCH_COLD`
//! the cold starts per runtime and image (default 3; 0 skips that part), `HAKO_BENCH_LOG`
//! hako's log filter (`hako::image=debug` prints where each layer's time went). For a closer
//! look at the cold starts: `HAKO_BENCH_ROUNDS=0` skips the pulls, `HAKO_BENCH_COLD_IMAGES=zstd`
//! runs only the images whose name holds one of these comma-separated words,
//! `HAKO_BENCH_HAKO_ONLY=1` leaves containerd out, and `HAKO_BENCH_COLD_CONFIG` is added to
//! both hako builds' config (say `[image]` and `sync_layers = false` on two lines).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    client, start_containerd, start_containerd2, start_hako, start_hako_bin, start_hako_with,
    Runtime,
};
use hako_proto::cri;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher, Tar};
use support::registry::Registry;

/// Deterministic data that gzip shrinks to about half, like binaries and libraries do.
fn half_compressible(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = seed | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // 64 random bytes, then 64 bytes of a short repeating pattern.
        for i in 0..64 {
            out.push((x >> (i % 8 * 8)) as u8 ^ (i as u8).wrapping_mul(31));
        }
        out.extend(std::iter::repeat_n((x & 0xff) as u8, 64));
    }
    out.truncate(len);
    out
}

/// Five layers, ~200 MB uncompressed: big files, medium files, and one of many small files.
fn bench_image() -> Image {
    let base = Layer::new(&oci::busybox_base_tar(), Compression::Gzip, false);
    let mut layers = vec![base];
    let specs: [(usize, usize); 4] = [
        (60, 1 << 20),
        (600, 100 << 10),
        (12_000, 4 << 10),
        (8, 8 << 20),
    ];
    for (li, (count, size)) in specs.iter().enumerate() {
        let mut t = Tar::default();
        for i in 0..*count {
            t.file(
                &format!("data/l{li}/d{}/f{i}", i % 64),
                &half_compressible(*size, (li * 100_000 + i) as u64 + 7),
                0o644,
            );
        }
        layers.push(Layer::new(&t.finish(), Compression::Gzip, false));
    }
    Image::new(layers, &ImageConf::default(), false)
}

/// `HAKO_BENCH_BASE`: another hako binary (say, a build of the commit before a change) to run
/// beside this one, with the default config.
fn base_hako() -> Option<PathBuf> {
    std::env::var_os("HAKO_BENCH_BASE").map(PathBuf::from)
}

fn du(p: &Path) -> u64 {
    let out = Command::new("du").args(["-sb"]).arg(p).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .parse()
        .unwrap_or(0)
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

fn main() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "containerd"]) {
        return;
    }
    let rounds: usize = std::env::var("HAKO_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let reg = Registry::start();
        let t = Instant::now();
        let img = bench_image();
        let compressed: usize = img.layers.iter().map(|l| l.blob.len()).sum();
        Pusher::new(&reg.addr).push("bench/big", "1", &img).await;
        eprintln!(
            "image: {} layers, {:.1} MB compressed, built and pushed in {:.1} s",
            img.layers.len(),
            compressed as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
        let name = format!("{}/bench/big:1", reg.addr);
        let certs =
            common::certs_for(&[(&reg.addr, &format!("server = \"http://{}\"\n", reg.addr))]);
        // hako as configured by default (each layer recorded at once and synced in the
        // background), with each layer's sync before its record (the default until
        // 2026-11-29), and without the sync, as containerd pulls by default.
        let mut waited = start_hako_with(
            certs.path(),
            "warn",
            None,
            "[image]\nwait_for_layer_sync = true\n",
        );
        waited.name = "hako, wait_for_layer_sync = true";
        let mut unsynced =
            start_hako_with(certs.path(), "warn", None, "[image]\nsync_layers = false\n");
        unsynced.name = "hako, sync_layers = false";
        let mut runtimes = vec![
            start_hako(certs.path(), "warn", None),
            waited,
            unsynced,
            start_containerd(certs.path(), None),
        ];
        match common::containerd2_dir() {
            Some(d) => runtimes.push(start_containerd2(&d, certs.path(), None)),
            None => eprintln!("containerd 2.x not built (.ci/build-containerd.sh): left out"),
        }
        if let Some(bin) = base_hako() {
            let mut base = start_hako_bin(&bin, certs.path(), "warn", None, "");
            base.name = "hako, HAKO_BENCH_BASE build";
            runtimes.insert(1, base);
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); runtimes.len()];
        let mut disk = vec![0u64; runtimes.len()];
        for round in 0..rounds {
            for (i, r) in runtimes.iter().enumerate() {
                let mut c = client(&r.socket).await.images;
                let _ = c
                    .remove_image(cri::RemoveImageRequest {
                        image: Some(cri::ImageSpec {
                            image: name.clone(),
                            ..Default::default()
                        }),
                    })
                    .await;
                settle(&reg);
                let t = Instant::now();
                c.pull_image(cri::PullImageRequest {
                    image: Some(cri::ImageSpec {
                        image: name.clone(),
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("{} pull: {e}", r.name));
                let secs = t.elapsed().as_secs_f64();
                times[i].push(secs);
                disk[i] = du(&r.root);
                eprintln!("round {round}: {:<15} {:.3} s", r.name, secs);
            }
        }
        if rounds > 0 {
            println!(
                "\npull + unpack of {} ({} layers, {:.1} MB compressed), {rounds} cold pulls each:",
                name,
                img.layers.len(),
                compressed as f64 / 1e6
            );
            println!("| runtime | min s | median s | max s | root dir after pull |");
            println!("|---|---|---|---|---|");
            for (i, r) in runtimes.iter().enumerate() {
                let (min, med, max) = stats(&mut times[i]);
                println!(
                    "| {} | {min:.3} | {med:.3} | {max:.3} | {:.1} MB |",
                    r.name,
                    disk[i] as f64 / 1e6
                );
            }
        }
        drop(runtimes);
        let cold: usize = std::env::var("HAKO_BENCH_COLD")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3);
        if cold > 0 {
            cold_starts(&reg, cold).await;
        }
    });
}

/// About 210 MB of incompressible data: the busybox base and 4 layers of 50 × 1 MiB files.
fn incompressible_image() -> Image {
    let mut layers = vec![Layer::new(
        &oci::busybox_base_tar(),
        Compression::Gzip,
        false,
    )];
    for li in 0..4u64 {
        let mut t = Tar::default();
        for i in 0..50u64 {
            t.file(
                &format!("data/l{li}/f{i}"),
                &random_bytes(1 << 20, li * 1000 + i + 1),
                0o644,
            );
        }
        layers.push(Layer::new(&t.finish(), Compression::Gzip, false));
    }
    Image::new(layers, &ImageConf::default(), false)
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    oci::noise(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), len)
}

/// This machine's regular files under each root, in path order, until its budget of bytes: a
/// deterministic stand-in for a distro image (libraries, data, documentation).
fn distro_files(roots: &[(&str, u64)]) -> Vec<(PathBuf, u64)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, u64)>, left: &mut u64) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        let mut entries: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if *left == 0 {
                return;
            }
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_dir() {
                walk(&p, out, left);
            } else if md.is_file() && std::fs::File::open(&p).is_ok() {
                *left = left.saturating_sub(md.len());
                out.push((p, md.len()));
            }
        }
    }
    let mut out = Vec::new();
    for (root, budget) in roots {
        let mut left = *budget;
        walk(Path::new(root), &mut out, &mut left);
    }
    out
}

/// The busybox base and 6 layers of about equal size from `distro_files`, compressed with `c`.
fn distro_image(files: &[(PathBuf, u64)], c: Compression) -> Image {
    let mut layers = vec![Layer::new(&oci::busybox_base_tar(), c, false)];
    let total: u64 = files.iter().map(|f| f.1).sum();
    let per = total / 6 + 1;
    let mut t = Tar::default();
    let mut acc = 0u64;
    for (p, len) in files {
        t.host_file(p, &p.to_string_lossy());
        acc += len;
        if acc >= per {
            layers.push(Layer::new(&std::mem::take(&mut t).finish(), c, false));
            acc = 0;
        }
    }
    if acc > 0 {
        layers.push(Layer::new(&t.finish(), c, false));
    }
    Image::new(layers, &ImageConf::default(), false)
}

fn cold_pod_config(dir: &Path) -> cri::PodSandboxConfig {
    // Host network and a PID namespace per container, as benches/pods.rs: no CNI in the path.
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "cold".into(),
            uid: "uid-cold".into(),
            namespace: "bench".into(),
            attempt: 0,
        }),
        log_directory: dir.join("logs").display().to_string(),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    pid: cri::NamespaceMode::Container as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One cold start on `r` (fresh, empty root): ms to the pull's end, to StartContainer's
/// return and to the first log line; the root's size after.
async fn cold_start(r: &Runtime, image: &str) -> (f64, f64, f64, u64) {
    let mut c = client(&r.socket).await;
    let cfg = cold_pod_config(r.dir.path());
    let pod = c
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: run pod: {e}", r.name))
        .into_inner()
        .pod_sandbox_id;
    let log = r.dir.path().join("logs").join("c.log");
    let t = Instant::now();
    c.images
        .pull_image(cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{}: pull: {e}", r.name));
    let pulled = t.elapsed().as_secs_f64() * 1e3;
    let config = cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "c".into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: vec![
            "sh".into(),
            "-c".into(),
            "echo ready; exec sleep 3600".into(),
        ],
        log_path: "c.log".into(),
        linux: cfg.linux.as_ref().map(|_| cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    pid: cri::NamespaceMode::Container as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let id = c
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(config),
            sandbox_config: Some(cfg),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: create: {e}", r.name))
        .into_inner()
        .container_id;
    c.runtime
        .start_container(cri::StartContainerRequest { container_id: id })
        .await
        .unwrap_or_else(|e| panic!("{}: start: {e}", r.name));
    let started = t.elapsed().as_secs_f64() * 1e3;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if std::fs::read(&log).is_ok_and(|b| b.contains(&b'\n')) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: no log line in {}",
            r.name,
            log.display()
        );
        std::thread::sleep(Duration::from_micros(500));
    }
    let first_line = t.elapsed().as_secs_f64() * 1e3;
    let disk = du(&r.root);
    let _ = c
        .runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await;
    let _ = c
        .runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await;
    (pulled, started, first_line, disk)
}

/// Puts every round on the same footing. Writes out what the previous round left dirty, then,
/// because this machine's root is ext4 without a journal, drops the clean caches: such an ext4
/// skips every inode deleted in the last 30 s whose inode table block is still cached, looking
/// each one up, when it allocates an inode. After one runtime's root (thousands of files) was
/// removed, the next runtime's unpack of `/usr/share` spent most of its time in the kernel's
/// `recently_deleted` and took 1.7–2.0 s instead of 0.5 s (perf, 2026-11-24). The registry's
/// files are read back in so downloads come from memory, as they did before.
fn settle(reg: &Registry) {
    nix::unistd::sync();
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "3") {
        eprintln!("caches not dropped between rounds ({e}): rounds after a removal may be slower");
        return;
    }
    fn warm(dir: &Path) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            match e.file_type() {
                Ok(t) if t.is_dir() => warm(&p),
                Ok(t) if t.is_file() => {
                    if let Ok(mut f) = std::fs::File::open(&p) {
                        let _ = std::io::copy(&mut f, &mut std::io::sink());
                    }
                }
                _ => {}
            }
        }
    }
    warm(&reg.data_dir());
}

/// Starts a fresh runtime with an empty root.
type Starter = Box<dyn Fn() -> Runtime>;
/// A runtime's name, its pull, start and first-line times (ms), and its root dir's size.
type Row = (String, Vec<f64>, Vec<f64>, Vec<f64>, u64);

async fn cold_starts(reg: &Registry, rounds: usize) {
    let pusher = Pusher::new(&reg.addr);
    // containerd's sandboxes need a pause image; hako's do not.
    let mut pause_tar = Tar::default();
    pause_tar.file("pause", &support::standins::go_binary("pause"), 0o755);
    let pause = Image::new(
        vec![Layer::new(&pause_tar.finish(), Compression::Gzip, false)],
        &ImageConf {
            entrypoint: vec!["/pause".into()],
            ..Default::default()
        },
        false,
    );
    for tag in ["3.6", "3.10"] {
        pusher.push("pause", tag, &pause).await;
    }
    let t = Instant::now();
    let files = distro_files(&[
        ("/usr/lib/x86_64-linux-gnu", 200 << 20),
        ("/usr/share", 120 << 20),
    ]);
    let wanted = std::env::var("HAKO_BENCH_COLD_IMAGES").unwrap_or_default();
    let images: Vec<(&str, Image)> = [
        ("incompressible, gzip", incompressible_image()),
        (
            "distro files, gzip",
            distro_image(&files, Compression::Gzip),
        ),
        (
            "distro files, zstd",
            distro_image(&files, Compression::Zstd),
        ),
    ]
    .into_iter()
    .filter(|(what, _)| wanted.is_empty() || wanted.split(',').any(|w| what.contains(w)))
    .collect();
    let mut names = Vec::new();
    for (i, (what, img)) in images.iter().enumerate() {
        pusher.push(&format!("bench/cold{i}"), "1", img).await;
        let compressed: usize = img.layers.iter().map(|l| l.blob.len()).sum();
        names.push(format!("{}/bench/cold{i}:1", reg.addr));
        eprintln!(
            "cold image {what}: {} layers, {:.1} MB compressed",
            img.layers.len(),
            compressed as f64 / 1e6
        );
    }
    eprintln!(
        "cold images built and pushed in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mirror = support::standins::hosts_toml("registry.k8s.io", &reg.addr);
    let certs = common::certs_for(&[
        (&reg.addr, &format!("server = \"http://{}\"\n", reg.addr)),
        ("registry.k8s.io", &mirror),
    ]);
    let ctrd2 = common::containerd2_dir();
    let starters: Vec<(&str, Starter)> = {
        let certs = certs.path().to_path_buf();
        let mut v: Vec<(&str, Starter)> = Vec::new();
        let config = std::env::var("HAKO_BENCH_COLD_CONFIG").unwrap_or_default();
        let (c, conf) = (certs.clone(), config.clone());
        v.push((
            "hako",
            Box::new(move || start_hako_with(&c, "warn", None, &conf)),
        ));
        if let Some(bin) = base_hako() {
            let c = certs.clone();
            v.push((
                "hako base",
                Box::new(move || {
                    let mut r = start_hako_bin(&bin, &c, "warn", None, &config);
                    r.name = "hako, HAKO_BENCH_BASE build";
                    r
                }),
            ));
        }
        let hako_only = std::env::var_os("HAKO_BENCH_HAKO_ONLY").is_some();
        if let Some(d) = ctrd2.filter(|_| !hako_only) {
            let c = certs.clone();
            v.push((
                "containerd 2",
                Box::new(move || start_containerd2(&d, &c, None)),
            ));
        }
        if !hako_only {
            let c = certs.clone();
            v.push((
                "containerd 1.6",
                Box::new(move || start_containerd(&c, None)),
            ));
        }
        v
    };
    println!("\ncold start: PullImage of an absent image to the container's first log line, fresh runtime and empty root each round, {rounds} rounds (ms, median [min–max]):");
    println!("| image | runtime | pull | + create + start | first log line | root dir after |");
    println!("|---|---|---|---|---|---|");
    for (ii, (what, img)) in images.iter().enumerate() {
        let mut rows: Vec<Row> = vec![(String::new(), vec![], vec![], vec![], 0); starters.len()];
        for round in 0..rounds {
            for (si, (_, start)) in starters.iter().enumerate() {
                settle(reg);
                let r = start();
                let (p, s, f, d) = cold_start(&r, &names[ii]).await;
                eprintln!("{what} round {round}: {:<16} pull {p:.0} ms, started {s:.0} ms, first line {f:.0} ms", r.name);
                rows[si].0 = r.name.to_string();
                rows[si].1.push(p);
                rows[si].2.push(s);
                rows[si].3.push(f);
                rows[si].4 = d;
            }
        }
        for (name, p, s, f, d) in rows.iter_mut() {
            let fmt = |v: &mut Vec<f64>| {
                let (min, med, max) = stats(v);
                format!("{med:.0} [{min:.0}–{max:.0}]")
            };
            println!(
                "| {what} ({:.0} MB compressed) | {name} | {} | {} | {} | {:.1} MB |",
                img.layers.iter().map(|l| l.blob.len()).sum::<usize>() as f64 / 1e6,
                fmt(p),
                fmt(s),
                fmt(f),
                *d as f64 / 1e6
            );
        }
    }
}
