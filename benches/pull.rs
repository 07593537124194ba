//! Pull benchmark: a multi-layer image of about 200 MB from a local registry, pulled and
//! unpacked through CRI `PullImage` by hako and by Debian's containerd 1.6, in the same run on
//! the same machine, alternating, each pull cold (the image removed in between).
//!
//! `cargo bench --bench pull` (as root; needs docker-registry and containerd).
//! `HAKO_BENCH_ROUNDS` sets the number of pulls per runtime (default 5).

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher, Tar};
use support::registry::Registry;
use tonic::transport::Channel;

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

struct Runtime {
    name: &'static str,
    socket: PathBuf,
    child: Child,
    root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
        // containerd leaves overlay mounts of its snapshots only for containers; none here.
    }
}

fn wait_socket(p: &Path, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(p).is_err() {
        if let Some(s) = child.try_wait().unwrap() {
            panic!("{what} exited: {s}");
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not listen on {}",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn certs_d(dir: &Path, registry: &str) -> PathBuf {
    let d = dir.join("certs.d");
    std::fs::create_dir_all(d.join(registry)).unwrap();
    std::fs::write(
        d.join(registry).join("hosts.toml"),
        format!("server = \"http://{registry}\"\n"),
    )
    .unwrap();
    d
}

fn start_hako(registry: &str) -> Runtime {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let socket = dir.path().join("hako.sock");
    let root = dir.path().join("root");
    let certs = certs_d(dir.path(), registry);
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "listen = \"{}\"\nroot = \"{}\"\nstate = \"{}\"\n[registry]\nconfig_path = \"{}\"\n",
            socket.display(),
            root.display(),
            dir.path().join("state").display(),
            certs.display()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_hako"))
        .args(["serve", "--config"])
        .arg(&cfg)
        .env("HAKO_LOG", "warn")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    wait_socket(&socket, &mut child, "hako");
    Runtime {
        name: "hako",
        socket,
        child,
        root,
        _dir: dir,
    }
}

fn start_containerd(registry: &str) -> Runtime {
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let socket = dir.path().join("containerd.sock");
    let root = dir.path().join("root");
    let certs = certs_d(dir.path(), registry);
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{certs}"
"#,
            root = root.display(),
            state = dir.path().join("state").display(),
            sock = socket.display(),
            certs = certs.display()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
    let mut child = Command::new("containerd")
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    wait_socket(&socket, &mut child, "containerd");
    Runtime {
        name: "containerd 1.6",
        socket,
        child,
        root,
        _dir: dir,
    }
}

async fn client(socket: &Path) -> ImageServiceClient<Channel> {
    let path = socket.to_path_buf();
    let ch = tonic::transport::Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap();
    ImageServiceClient::new(ch).max_decoding_message_size(64 << 20)
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
        let runtimes = [start_hako(&reg.addr), start_containerd(&reg.addr)];
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); runtimes.len()];
        let mut disk = vec![0u64; runtimes.len()];
        for round in 0..rounds {
            for (i, r) in runtimes.iter().enumerate() {
                let mut c = client(&r.socket).await;
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
