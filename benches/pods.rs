//! Pod and container lifecycle benchmark: hako against Debian's containerd 1.6 (with runc and
//! its pause image, here the Go stand-in), in the same run on the same machine.
//!
//! For each of `HAKO_BENCH_PODS` rounds (default 50), per runtime: RunPodSandbox,
//! CreateContainer, StartContainer, ExecSync, StopContainer, StopPodSandbox (then an untimed
//! RemovePodSandbox). Pods use the host network (containerd cannot run pod networks without a
//! CNI result carrying an IP; hako has no CNI yet); IPC, UTS and the rest are the pod's own.
//! Then 20 idle pods each, and the PSS of the runtime's own processes.
//!
//! `cargo bench --bench pods` (as root; needs docker-registry, containerd, runc, Go).

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Instant;

use common::{client, start_containerd, start_hako, Runtime};
use k8s_cri::v1 as cri;
use support::oci::Pusher;
use support::registry::Registry;

const IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.29-2";
const STEPS: [&str; 6] = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "ExecSync",
    "StopContainer",
    "StopPodSandbox",
];

fn pod_config(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "bench".into(),
            attempt: 0,
        }),
        // No hostname: a host-network pod shares the host's UTS namespace.
        log_directory: format!("/var/tmp/hako-bench-logs/{name}"),
        // Host network for both: containerd 1.6 needs a CNI result with an IP for pod
        // networks, and hako has no CNI yet; this keeps the two doing the same work.
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                // What kubelet sends for a pod without shareProcessNamespace: a PID
                // namespace per container (the proto default, POD, would share one).
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

fn container_config() -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "sleeper".into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: IMAGE.into(),
            ..Default::default()
        }),
        // PID 1 of its own PID namespace (as kubelet asks by default) ignores SIGTERM unless
        // it handles it: this one does, so StopContainer measures a graceful stop.
        command: vec![
            "sh".into(),
            "-c".into(),
            "trap 'exit 0' TERM; sleep 3600 & wait".into(),
        ],
        log_path: "sleeper.log".into(),
        linux: Some(cri::LinuxContainerConfig {
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
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// PSS in KiB of a process, from smaps_rollup.
fn pss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix("Pss:")
                    .map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}

fn cmdline(pid: i32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .unwrap_or_default()
}

fn children_of(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().nth(1))
            .and_then(|x| x.parse::<i32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// The runtime's own per-pod processes: hako's monitors and infra processes (named in their
/// command lines by the runtime's state dir); containerd's shims and pause processes.
fn per_pod_processes(r: &Runtime) -> Vec<i32> {
    let dir = r.dir.path().display().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let c = cmdline(p);
        let ours = if r.name == "hako" {
            c.contains("hako monitor") && c.contains(&dir)
        } else {
            c.contains("containerd-shim") && c.contains(&dir)
        };
        if ours {
            out.push(p);
            if r.name != "hako" {
                // The shim's pause process (its child; containers are children too).
                out.extend(
                    children_of(p)
                        .into_iter()
                        .filter(|c| cmdline(*c).starts_with("/pause")),
                );
            }
        }
    }
    out
}

/// Adds the time since `t` to `step`'s samples, in ms.
fn record(times: &mut BTreeMap<&'static str, Vec<f64>>, step: &'static str, t: Instant) {
    times
        .entry(step)
        .or_default()
        .push(t.elapsed().as_secs_f64() * 1e3);
}

async fn lifecycle(r: &Runtime, round: usize, times: &mut BTreeMap<&'static str, Vec<f64>>) {
    let mut c = client(&r.socket).await;
    let cfg = pod_config(&format!("bench-{round}"));
    let t = Instant::now();
    let pod = c
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", r.name))
        .into_inner()
        .pod_sandbox_id;
    record(times, STEPS[0], t);
    let t = Instant::now();
    let id = c
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(container_config()),
            sandbox_config: Some(cfg.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", r.name))
        .into_inner()
        .container_id;
    record(times, STEPS[1], t);
    let t = Instant::now();
    c.runtime
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
    record(times, STEPS[2], t);
    let t = Instant::now();
    let out = c
        .runtime
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec!["true".into()],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.exit_code, 0);
    record(times, STEPS[3], t);
    let t = Instant::now();
    c.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: id.clone(),
            timeout: 10,
        })
        .await
        .unwrap();
    record(times, STEPS[4], t);
    let t = Instant::now();
    c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
    record(times, STEPS[5], t);
    c.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await
        .unwrap();
}

fn main() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "containerd", "runc"]) {
        return;
    }
    let n: usize = std::env::var("HAKO_BENCH_PODS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let idle: usize = 20;
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let reg = Registry::start();
        support::standins::push_all(&Pusher::new(&reg.addr)).await;
        let mirror = support::standins::hosts_toml("registry.k8s.io", &reg.addr);
        let certs = common::certs_for(&[("registry.k8s.io", &mirror)]);
        // One bridge network both runtimes use (same config, same IPAM leases).
        let net = tempfile::tempdir_in("/var/tmp").unwrap();
        let conf_dir = net.path().join("net.d");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::write(
            conf_dir.join("10-bench.conflist"),
            serde_json::to_vec(&serde_json::json!({
                "cniVersion": "1.0.0",
                "name": "bench-bridge",
                "plugins": [
                    {"type": "bridge", "bridge": "hkbench0", "isGateway": true, "ipMasq": false,
                     "ipam": {"type": "host-local", "dataDir": net.path().join("leases"),
                              "ranges": [[{"subnet": "10.99.0.0/24"}]]}},
                    {"type": "portmap", "capabilities": {"portMappings": true}}
                ]
            }))
            .unwrap(),
        )
        .unwrap();
        let runtimes = [
            start_hako(certs.path(), "warn", Some(&conf_dir)),
            start_containerd(certs.path(), Some(&conf_dir)),
        ];
        for r in &runtimes {
            let mut c = client(&r.socket).await;
            c.images.pull_image(cri::PullImageRequest { image: Some(cri::ImageSpec { image: IMAGE.into(), ..Default::default() }), ..Default::default() }).await.unwrap();
            // A first pod outside the measurement: containerd pulls its pause image here.
            lifecycle(r, 100_000, &mut BTreeMap::new()).await;
        }
        let mut results: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
        for round in 0..n {
            for (i, r) in runtimes.iter().enumerate() {
                lifecycle(r, round, &mut results[i]).await;
            }
        }
        println!("\nPod and container lifecycle, {n} rounds per runtime, alternating (ms):");
        println!("| step | hako p50 | hako p99 | containerd p50 | containerd p99 | p50 ratio |");
        println!("|---|---|---|---|---|---|");
        let mut total = [0.0f64; 2];
        for step in STEPS {
            let mut h = results[0][step].clone();
            let mut c = results[1][step].clone();
            let (h50, h99, c50, c99) = (percentile(&mut h, 0.5), percentile(&mut h, 0.99), percentile(&mut c, 0.5), percentile(&mut c, 0.99));
            if ["RunPodSandbox", "CreateContainer", "StartContainer"].contains(&step) {
                total[0] += h50;
                total[1] += c50;
            }
            println!("| {step} | {h50:.2} | {h99:.2} | {c50:.2} | {c99:.2} | {:.1}× |", c50 / h50);
        }
        println!("| pod + container start (sum of p50s) | {:.2} | | {:.2} | | {:.1}× |", total[0], total[1], total[1] / total[0]);

        // Pods on the bridge network: RunPodSandbox now includes CNI ADD (and Stop, DEL).
        let mut net_times: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
        for round in 0..n {
            for (i, r) in runtimes.iter().enumerate() {
                let mut c = client(&r.socket).await;
                let mut cfg = pod_config(&format!("net-{round}"));
                cfg.linux = None;
                let t = Instant::now();
                let pod = c.runtime.run_pod_sandbox(cri::RunPodSandboxRequest { config: Some(cfg), runtime_handler: String::new() }).await.unwrap_or_else(|e| panic!("{}: {e}", r.name)).into_inner().pod_sandbox_id;
                record(&mut net_times[i], "RunPodSandbox", t);
                let t = Instant::now();
                c.runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: pod.clone() }).await.unwrap();
                record(&mut net_times[i], "StopPodSandbox", t);
                c.runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: pod }).await.unwrap();
            }
        }
        println!("\nPods on a bridge network (CNI bridge + host-local + portmap from /usr/lib/cni), {n} rounds (ms):");
        println!("| step | hako p50 | hako p99 | containerd p50 | containerd p99 | p50 ratio |");
        println!("|---|---|---|---|---|---|");
        for step in ["RunPodSandbox", "StopPodSandbox"] {
            let mut h = net_times[0][step].clone();
            let mut c = net_times[1][step].clone();
            let (h50, h99, c50, c99) = (percentile(&mut h, 0.5), percentile(&mut h, 0.99), percentile(&mut c, 0.5), percentile(&mut c, 0.99));
            println!("| {step} | {h50:.2} | {h99:.2} | {c50:.2} | {c99:.2} | {:.1}× |", c50 / h50);
        }
        let _ = std::process::Command::new("ip").args(["link", "del", "hkbench0"]).output();

        // Idle pods and memory.
        let mut pods: Vec<Vec<String>> = vec![Vec::new(); runtimes.len()];
        for (i, r) in runtimes.iter().enumerate() {
            let mut c = client(&r.socket).await;
            for k in 0..idle {
                let cfg = pod_config(&format!("idle-{k}"));
                let pod = c.runtime.run_pod_sandbox(cri::RunPodSandboxRequest { config: Some(cfg.clone()), runtime_handler: String::new() }).await.unwrap().into_inner().pod_sandbox_id;
                let id = c.runtime.create_container(cri::CreateContainerRequest { pod_sandbox_id: pod.clone(), config: Some(container_config()), sandbox_config: Some(cfg) }).await.unwrap().into_inner().container_id;
                c.runtime.start_container(cri::StartContainerRequest { container_id: id }).await.unwrap();
                pods[i].push(pod);
            }
        }
        std::thread::sleep(std::time::Duration::from_secs(2));
        println!("\nMemory with {idle} idle pods (one `sleep` container each), PSS of the runtime's own processes:");
        println!("| runtime | daemon | per-pod processes, total | per pod | daemon + per-pod, per pod |");
        println!("|---|---|---|---|---|");
        for r in &runtimes {
            let daemon = pss_kib(r.child.id() as i32);
            let per_pod: u64 = per_pod_processes(r).iter().map(|p| pss_kib(*p)).sum();
            println!(
                "| {} | {:.1} MiB | {:.1} MiB ({} processes) | {:.2} MiB | {:.2} MiB |",
                r.name,
                daemon as f64 / 1024.0,
                per_pod as f64 / 1024.0,
                per_pod_processes(r).len(),
                per_pod as f64 / 1024.0 / idle as f64,
                (daemon + per_pod) as f64 / 1024.0 / idle as f64
            );
        }
        if let Ok(secs) = std::env::var("HAKO_BENCH_HOLD").map(|s| s.parse::<u64>().unwrap_or(60)) {
            // Leaves the idle pods up for inspection (smaps of the per-pod processes).
            for r in &runtimes {
                println!("{}: per-pod processes {:?}", r.name, per_pod_processes(r));
            }
            tokio::time::sleep(std::time::Duration::from_secs(secs)).await;
        }
        for (i, r) in runtimes.iter().enumerate() {
            let mut c = client(&r.socket).await;
            for p in &pods[i] {
                let _ = c.runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: p.clone() }).await;
                let _ = c.runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: p.clone() }).await;
            }
        }
    });
}
