//! Exec round trip: hako against containerd 2.x (built by `.ci/build-containerd.sh`, see
//! `common::containerd2_dir`) in the same run, one host-network pod with one `sleep` container
//! per runtime, the same image from the local registry.
//!
//! Per iteration, alternating between runtimes (`HAKO_BENCH_EXECS` iterations, default 50,
//! after 5 untimed ones):
//! - `crictl exec <ctr> true` (the real crictl, `.tools/crictl`), wall time of the process,
//!   over SPDY and over WebSocket (`-r websocket`);
//! - CRI Exec of `echo hi` from a gRPC client, then the returned URL upgraded to SPDY/3.1 with
//!   `v4.channel.k8s.io` by a small client in this file (hako's SPDY framing module; no Go
//!   process in the measurement): the time until the Exec answer, until the first byte of
//!   stdout, and until the exit status on the error stream;
//! - ExecSync of `true`.
//!
//! `cargo bench --bench exec` (as root; needs docker-registry, crictl, containerd 2.x).
//! `HAKO_BENCH_HAKO_ONLY=1` leaves containerd out.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Instant;

use common::{client, Clients, Runtime};
use hako::streaming::spdy::{self, Codec, Frame};
use hako_proto::cri;
use support::oci::Pusher;
use support::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::SLEEPER_IMAGE as IMAGE;
const STEPS: [&str; 6] = [
    "crictl exec true (SPDY)",
    "crictl exec -r websocket true",
    "Exec RPC answered",
    "Exec + SPDY: first byte of `echo hi`",
    "Exec + SPDY: exit status",
    "ExecSync true",
];

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// The pod and container the iterations exec into.
async fn setup(r: &Runtime) -> (String, String) {
    let mut c = client(&r.socket).await;
    c.images
        .pull_image(cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: IMAGE.into(),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{}: pull: {e}", r.name));
    let cfg = common::host_pod_config("exec-bench");
    let pod = c
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: RunPodSandbox: {e}", r.name))
        .into_inner()
        .pod_sandbox_id;
    let id = c
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(common::sleeper_config()),
            sandbox_config: Some(cfg),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: CreateContainer: {e}", r.name))
        .into_inner()
        .container_id;
    c.runtime
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: StartContainer: {e}", r.name));
    (pod, id)
}

/// What the iterations exec into on one runtime.
#[derive(Clone)]
struct Target {
    name: &'static str,
    socket: std::path::PathBuf,
    container: String,
    /// Why crictl's WebSocket transport is not measured here, once it failed.
    no_websocket: Option<String>,
}

/// `crictl exec -r <transport> <ctr> true`: its wall time, or crictl's error.
fn crictl_exec(crictl: &std::path::Path, t: &Target, transport: &str) -> Result<f64, String> {
    let start = Instant::now();
    let out = std::process::Command::new(crictl)
        .arg("--runtime-endpoint")
        .arg(format!("unix://{}", t.socket.display()))
        .args(["exec", "-r", transport, &t.container, "true"])
        .output()
        .unwrap();
    let took = ms(start);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        // The line with crictl's fatal error, without its config-file warning.
        let err = err
            .lines()
            .filter(|l| !l.contains("level=warning"))
            .collect::<Vec<_>>()
            .join(" ");
        return Err(format!("{}: crictl exec -r {transport}: {err}", t.name));
    }
    Ok(took)
}

/// CRI Exec of `echo hi` (stdout and stderr, no TTY, as crictl asks), then the URL spoken
/// SPDY/3.1 + v4.channel.k8s.io: (Exec answered, first stdout byte, exit status) in ms.
async fn exec_spdy(c: &mut Clients, name: &str, id: &str) -> (f64, f64, f64) {
    let t = Instant::now();
    let url = c
        .runtime
        .exec(cri::ExecRequest {
            container_id: id.into(),
            cmd: vec!["echo".into(), "hi".into()],
            stdout: true,
            stderr: true,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: Exec: {e}"))
        .into_inner()
        .url;
    let rpc = ms(t);
    let rest = url
        .strip_prefix("http://")
        .unwrap_or_else(|| panic!("{name}: not an http URL: {url}"));
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let s = tokio::net::TcpStream::connect(host).await.unwrap();
    s.set_nodelay(true).unwrap();
    let (r, mut w) = s.into_split();
    w.write_all(
        format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n\
             X-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // The response head, then SPDY frames (some may have come with the head).
    let mut r = tokio::io::BufReader::new(r);
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let b = r.read_u8().await.unwrap();
        head.push(b);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(
        head.starts_with("HTTP/1.1 101"),
        "{name}: upgrade refused: {head}"
    );
    let mut codec = Codec::new();
    // Stream ids as client-go's remotecommand opens them: error, stdout, stderr.
    for (stream, kind) in [(1, "error"), (3, "stdout"), (5, "stderr")] {
        let f = codec
            .encode(&Frame::SynStream {
                stream,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: vec![("streamtype".into(), kind.into())],
            })
            .unwrap();
        w.write_all(&f).await.unwrap();
    }
    let (mut first, mut out, mut status) = (None, Vec::new(), Vec::new());
    let done = loop {
        let Some((h, payload)) = spdy::read_frame(&mut r).await.unwrap() else {
            panic!("{name}: connection closed before the exit status")
        };
        match codec.decode(h, &payload).unwrap() {
            Frame::Data {
                stream: 3, data, ..
            } if !data.is_empty() => {
                first.get_or_insert_with(|| ms(t));
                out.extend_from_slice(&data);
            }
            Frame::Data {
                stream: 1,
                data,
                fin,
            } => {
                status.extend_from_slice(&data);
                // The v4 Status is one JSON object; the stream may stay open after it.
                if fin || serde_json::from_slice::<serde_json::Value>(&status).is_ok() {
                    break ms(t);
                }
            }
            Frame::RstStream { stream: 1, status } => panic!("{name}: error stream reset {status}"),
            Frame::GoAway { .. } => panic!("{name}: GOAWAY before the exit status"),
            _ => {}
        }
    };
    let status = String::from_utf8_lossy(&status);
    assert!(status.contains("Success"), "{name}: exit status {status}");
    assert_eq!(out, b"hi\n", "{name}");
    (rpc, first.unwrap(), done)
}

async fn exec_sync(c: &mut Clients, name: &str, id: &str) -> f64 {
    let t = Instant::now();
    let out = c
        .runtime
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: vec!["true".into()],
            timeout: 10,
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: ExecSync: {e}"))
        .into_inner();
    assert_eq!(out.exit_code, 0, "{name}");
    ms(t)
}

async fn iteration(
    crictl: &std::path::Path,
    t: &mut Target,
    times: &mut BTreeMap<&'static str, Vec<f64>>,
) {
    let mut c = client(&t.socket).await;
    let mut add = |step: &'static str, v: f64| times.entry(step).or_default().push(v);
    add(
        STEPS[0],
        crictl_exec(crictl, t, "spdy").unwrap_or_else(|e| panic!("{e}")),
    );
    if t.no_websocket.is_none() {
        match crictl_exec(crictl, t, "websocket") {
            Ok(v) => add(STEPS[1], v),
            // containerd's streaming server may not speak crictl's WebSocket: say so once
            // and leave the row empty for it.
            Err(e) => {
                eprintln!("{e}");
                t.no_websocket = Some(e);
            }
        }
    }
    let (rpc, first, done) = exec_spdy(&mut c, t.name, &t.container).await;
    add(STEPS[2], rpc);
    add(STEPS[3], first);
    add(STEPS[4], done);
    add(STEPS[5], exec_sync(&mut c, t.name, &t.container).await);
}

fn main() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "crictl"]) {
        return;
    }
    let crictl = support::which("crictl").unwrap();
    let n: usize = std::env::var("HAKO_BENCH_EXECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let reg = Registry::start();
        support::standins::push_all(&Pusher::new(&reg.addr)).await;
        let mirror = support::standins::hosts_toml("registry.k8s.io", &reg.addr);
        let certs = common::certs_for(&[("registry.k8s.io", &mirror)]);
        let mut runtimes = vec![common::start_hako(certs.path(), "warn", None)];
        if std::env::var_os("HAKO_BENCH_HAKO_ONLY").is_none() {
            match common::containerd2_dir() {
                Some(d) => runtimes.push(common::start_containerd2(&d, certs.path(), None)),
                None => eprintln!("containerd 2.x not built (.ci/build-containerd.sh): hako only"),
            }
        }
        let mut pods = Vec::new();
        let mut targets = Vec::new();
        for r in &runtimes {
            let (pod, container) = setup(r).await;
            pods.push(pod);
            targets.push(Target { name: r.name, socket: r.socket.clone(), container, no_websocket: None });
        }
        // In a task of its own, so that the pods are removed even when an iteration fails.
        let measured = tokio::spawn(async move {
            for _ in 0..5 {
                for t in &mut targets {
                    iteration(&crictl, t, &mut BTreeMap::new()).await;
                }
            }
            let mut results = vec![BTreeMap::new(); targets.len()];
            for _ in 0..n {
                for (i, t) in targets.iter_mut().enumerate() {
                    iteration(&crictl, t, &mut results[i]).await;
                }
            }
            (targets, results)
        })
        .await;
        for (r, pod) in runtimes.iter().zip(pods) {
            let mut c = client(&r.socket).await;
            let _ = c.runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: pod.clone() }).await;
            let _ = c.runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: pod }).await;
        }
        let (targets, mut results) = measured.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        println!("\nExec round trip, one host-network pod with a running container per runtime, {n} iterations alternating between runtimes (ms, from the client's start):");
        let mut head = "| step |".to_string();
        for t in &targets {
            head.push_str(&format!(" {} p50 | {} p90 |", t.name, t.name));
        }
        println!("{head}");
        println!("|{}", "---|".repeat(head.matches('|').count() - 1));
        for step in STEPS {
            let mut row = format!("| {step} |");
            for res in &mut results {
                match res.get_mut(step) {
                    Some(v) => row.push_str(&format!(" {:.2} | {:.2} |", common::percentile(v, 0.5), common::percentile(v, 0.9))),
                    None => row.push_str(" – | – |"),
                }
            }
            println!("{row}");
        }
        for t in &targets {
            if let Some(e) = &t.no_websocket {
                println!("\n{e}");
            }
        }
    });
}
