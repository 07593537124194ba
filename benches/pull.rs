//! Pull benchmark: a multi-layer image of about 200 MB from a local registry, pulled and
//! unpacked through CRI `PullImage` by hako (with and without `image.sync_layers`) and by
//! Debian's containerd 1.6, in the same run on the same machine, alternating, each pull cold
//! (the image removed in between).
//!
//! `cargo bench --bench pull` (as root; needs docker-registry and containerd).
//! `HAKO_BENCH_ROUNDS` sets the number of pulls per runtime (default 5).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::{client, start_containerd, start_hako, start_hako_with};
use k8s_cri::v1 as cri;
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
        // hako as configured by default (each layer synced to disk before it is recorded), and
        // without the sync, as containerd pulls by default.
        let mut unsynced =
            start_hako_with(certs.path(), "warn", None, "[image]\nsync_layers = false\n");
        unsynced.name = "hako, sync_layers = false";
        let runtimes = [
            start_hako(certs.path(), "warn", None),
            unsynced,
            start_containerd(certs.path(), None),
        ];
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
                // Settle the page cache writeback of the previous round so rounds are alike.
                nix::unistd::sync();
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
    });
}
