//! Pod and container lifecycle benchmark: hako against Debian's containerd 1.6 (with runc and
//! its pause image, here the Go stand-in), in the same run on the same machine.
//!
//! For each of `HAKO_BENCH_PODS` rounds (default 50), per runtime: RunPodSandbox,
//! CreateContainer, StartContainer, ExecSync, StopContainer, StopContainer with timeout 0 of a
//! second container (created and started untimed), StopPodSandbox, RemovePodSandbox. Pods use the host network for this part, so it times the runtimes without
//! CNI plugins; IPC, UTS and the rest are the pod's own.
//! Then, on a bridge network (CNI bridge + host-local + portmap): the CNI chain alone (1 and
//! 10 at a time, no runtime), 10 RunPodSandbox in flight and 10 CreateContainer+StartContainer
//! in flight (`HAKO_BENCH_ROUNDS` rounds, default 5), and a burst of 50 pods with one
//! container each issued at once. Last, 100 and then 250 idle pods per runtime (one runtime at
//! a time): ListContainers, ListPodSandbox, ListContainerStats and ListPodSandboxMetrics
//! latency from a gRPC client (`HAKO_BENCH_LISTS` calls), the daemon's RSS and the PSS of the
//! per-pod processes, then CreateContainer+StartContainer 10 in flight among them (3 rounds).
//!
//! Runtimes: hako (this build), hako from `HAKO_BENCH_BASE` (another build's binary, for a
//! before and after in one run), Debian's containerd 1.6 and containerd 2.x when
//! `.ci/build-containerd.sh` has built it (see `common::containerd2_dir`).
//!
//! `cargo bench --bench pods` (as root; needs docker-registry, containerd, runc, Go).
//! `HAKO_BENCH_HAKO_ONLY=1` leaves containerd out; `HAKO_BENCH_DENSITY=100` picks the idle pod
//! counts; `HAKO_BENCH_PODS`, `HAKO_BENCH_ROUNDS`, `HAKO_BENCH_LISTS` size the rest;
//! `HAKO_BENCH_WRITER_MIB` (default 256, 0 for none) sizes the unsynced data another writer
//! leaves beside a container's stop and removal (`HAKO_BENCH_ROUNDS` rounds, after the
//! lifecycle); `HAKO_BENCH_NO_METRICS=1` lists no metrics; `HAKO_BENCH_MARKS=1` prints the 10-in-flight
//! phases' bounds for perf; `HAKO_BENCH_STATE_ON_DISK=1` keeps state dirs off tmpfs.

mod common;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Instant;

use common::{client, start_containerd, start_hako, Runtime};
use hako_proto::cri;
use support::oci::Pusher;
use support::registry::Registry;

use common::{
    host_pod_config as pod_config, percentile, sleeper_config as container_config,
    SLEEPER_IMAGE as IMAGE,
};
const STEPS: [&str; 8] = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "ExecSync",
    "StopContainer",
    "StopContainer, timeout 0",
    "StopPodSandbox",
    "RemovePodSandbox",
];

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
        let hako = r.name.starts_with("hako");
        let ours = if hako {
            c.contains("hako monitor") && c.contains(&dir)
        } else {
            c.contains("containerd-shim") && c.contains(&dir)
        };
        if ours {
            out.push(p);
            if !hako {
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
    // A second container stopped without a grace period (kubelet's force delete, or a grace
    // period run out): SIGKILL to every process of it.
    let mut killed_cfg = container_config();
    killed_cfg.metadata.as_mut().unwrap().name = "killed".into();
    let killed = c
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(killed_cfg),
            sandbox_config: Some(cfg.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", r.name))
        .into_inner()
        .container_id;
    c.runtime
        .start_container(cri::StartContainerRequest {
            container_id: killed.clone(),
        })
        .await
        .unwrap();
    let t = Instant::now();
    c.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: killed,
            timeout: 0,
        })
        .await
        .unwrap();
    record(times, STEPS[5], t);
    let t = Instant::now();
    c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
    record(times, STEPS[6], t);
    let t = Instant::now();
    c.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await
        .unwrap();
    record(times, STEPS[7], t);
}

/// One column per runtime: p50 (p99), and containerd's p50 over this hako's.
fn table(
    title: &str,
    runtimes: &[Runtime],
    results: &[BTreeMap<&'static str, Vec<f64>>],
    steps: &[&'static str],
) {
    println!("\n{title}");
    let mut head = "| step |".to_string();
    for r in runtimes {
        head.push_str(&format!(" {} p50 (p99) |", r.name));
    }
    for r in runtimes
        .iter()
        .skip(1)
        .filter(|r| r.name.starts_with("containerd"))
    {
        head.push_str(&format!(" {} / hako |", r.name));
    }
    println!("{head}");
    println!("|{}", "---|".repeat(head.matches('|').count() - 1));
    for step in steps {
        let mut row = format!("| {step} |");
        let mut p50s = Vec::new();
        for res in results {
            let mut v = res.get(step).cloned().unwrap_or_default();
            if v.is_empty() {
                row.push_str(" – |");
                p50s.push(f64::NAN);
                continue;
            }
            let (p50, p99) = (percentile(&mut v, 0.5), percentile(&mut v, 0.99));
            row.push_str(&format!(" {p50:.2} ({p99:.2}) |"));
            p50s.push(p50);
        }
        for (i, r) in runtimes.iter().enumerate().skip(1) {
            if r.name.starts_with("containerd") {
                row.push_str(&format!(" {:.1}× |", p50s[i] / p50s[0]));
            }
        }
        println!("{row}");
    }
}

/// Runs `plugin` with the CNI environment; its stdout parsed (the result of an ADD).
fn cni_exec(
    plugin: &str,
    command: &str,
    id: &str,
    netns: &str,
    conf: &serde_json::Value,
) -> serde_json::Value {
    use std::io::Write;
    let mut child = std::process::Command::new(format!("/usr/lib/cni/{plugin}"))
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&serde_json::to_vec(conf).unwrap())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{plugin} {command}: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

/// The chain's plugin configs as a runtime hands them to each plugin (name, version and, for
/// portmap, the previous result and the runtime config).
fn chain_conf(
    list: &serde_json::Value,
    i: usize,
    prev: Option<&serde_json::Value>,
) -> serde_json::Value {
    let mut c = list["plugins"][i].clone();
    c["name"] = list["name"].clone();
    c["cniVersion"] = list["cniVersion"].clone();
    if c["type"] == "portmap" {
        c["runtimeConfig"] = serde_json::json!({"portMappings": []});
    }
    if let Some(p) = prev {
        c["prevResult"] = p.clone();
    }
    c
}

/// The CNI chain alone, `parallel` pods at a time, `rounds` times: ADD then DEL timings (ms).
fn cni_chain_alone(
    list: &serde_json::Value,
    parallel: usize,
    rounds: usize,
) -> BTreeMap<&'static str, Vec<f64>> {
    let mut times: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    let names: Vec<String> = (0..parallel).map(|i| format!("hkbench-cni-{i}")).collect();
    for n in &names {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", n])
            .output();
        assert!(std::process::Command::new("ip")
            .args(["netns", "add", n])
            .status()
            .unwrap()
            .success());
    }
    for round in 0..rounds {
        let adds: Vec<(f64, serde_json::Value)> = std::thread::scope(|s| {
            let hs: Vec<_> = names
                .iter()
                .map(|n| {
                    s.spawn(move || {
                        let id = format!("{n}-{round}");
                        let netns = format!("/var/run/netns/{n}");
                        let t = Instant::now();
                        let r = cni_exec("bridge", "ADD", &id, &netns, &chain_conf(list, 0, None));
                        let r = cni_exec(
                            "portmap",
                            "ADD",
                            &id,
                            &netns,
                            &chain_conf(list, 1, Some(&r)),
                        );
                        (t.elapsed().as_secs_f64() * 1e3, r)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let dels: Vec<f64> = std::thread::scope(|s| {
            let hs: Vec<_> = names
                .iter()
                .zip(&adds)
                .map(|(n, (_, result))| {
                    s.spawn(move || {
                        let id = format!("{n}-{round}");
                        let netns = format!("/var/run/netns/{n}");
                        let t = Instant::now();
                        cni_exec(
                            "portmap",
                            "DEL",
                            &id,
                            &netns,
                            &chain_conf(list, 1, Some(result)),
                        );
                        cni_exec("bridge", "DEL", &id, &netns, &chain_conf(list, 0, None));
                        t.elapsed().as_secs_f64() * 1e3
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        times
            .entry("CNI ADD (bridge+host-local, portmap)")
            .or_default()
            .extend(adds.iter().map(|a| a.0));
        times.entry("CNI DEL").or_default().extend(dels);
    }
    for n in &names {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", n])
            .output();
    }
    times
}

fn rss_kib(pid: i32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `kB` figure of /proc/PID/status (`VmRSS:`, `RssAnon:`, ...).
fn status_kib(pid: i32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(key)
                    .map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0))
            })
        })
        .unwrap_or(0)
}

/// A pod on the bridge network (the pod config kubelet sends for an ordinary pod).
fn net_pod_config(name: &str) -> cri::PodSandboxConfig {
    let mut cfg = pod_config(name);
    cfg.linux = None;
    cfg
}

fn net_container_config() -> cri::ContainerConfig {
    let mut c = container_config();
    c.linux = None;
    c
}

async fn run_pod(
    c: &mut common::Clients,
    cfg: &cri::PodSandboxConfig,
) -> Result<String, tonic::Status> {
    Ok(c.runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: String::new(),
        })
        .await?
        .into_inner()
        .pod_sandbox_id)
}

async fn create_start(
    c: &mut common::Clients,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    ctr: cri::ContainerConfig,
) -> Result<String, tonic::Status> {
    let id = c
        .runtime
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(ctr),
            sandbox_config: Some(cfg.clone()),
        })
        .await?
        .into_inner()
        .container_id;
    c.runtime
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await?;
    Ok(id)
}

/// StopContainer (timeout 0) and RemoveContainer of a running container while `mib` MiB that
/// another writer left unsynced wait on the filesystem under the runtime's root (an image
/// pull's layers, another container's writes): ms for the two calls. A plain overlay's unmount
/// syncs that whole filesystem; the data is synced away, untimed, before the next round.
async fn removal_beside_a_writer(r: &Runtime, round: usize, mib: usize) -> f64 {
    use std::io::Write;
    let mut c = client(&r.socket).await;
    let cfg = pod_config(&format!("writer-{round}"));
    let pod = run_pod(&mut c, &cfg)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", r.name));
    let id = create_start(&mut c, &pod, &cfg, container_config())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", r.name));
    nix::unistd::sync();
    let file = r.root.join("bench-writer");
    let mut f = std::fs::File::create(&file).unwrap();
    let block = vec![0x5a_u8; 1 << 20];
    for _ in 0..mib {
        f.write_all(&block).unwrap();
    }
    drop(f);
    let t = Instant::now();
    c.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: id.clone(),
            timeout: 0,
        })
        .await
        .unwrap();
    c.runtime
        .remove_container(cri::RemoveContainerRequest { container_id: id })
        .await
        .unwrap();
    let took = t.elapsed().as_secs_f64() * 1e3;
    c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
    c.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await
        .unwrap();
    std::fs::remove_file(&file).unwrap();
    nix::unistd::sync();
    took
}

/// CreateContainer+StartContainer of a `ctr` into each of `pods`, all in flight at once: each
/// call's time (ms).
async fn timed_create_starts<'a>(
    c: &common::Clients,
    r: &Runtime,
    pods: impl Iterator<Item = (&'a str, &'a cri::PodSandboxConfig)>,
    ctr: fn() -> cri::ContainerConfig,
) -> Vec<f64> {
    futures::future::join_all(pods.map(|(pod, cfg)| {
        let mut c = c.clone();
        async move {
            let t = Instant::now();
            create_start(&mut c, pod, cfg, ctr())
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", r.name));
            t.elapsed().as_secs_f64() * 1e3
        }
    }))
    .await
}

/// Stops and removes pods, `parallel` at a time (untimed).
async fn teardown(r: &Runtime, pods: Vec<String>, parallel: usize) {
    use futures::StreamExt;
    let c = client(&r.socket).await;
    futures::stream::iter(pods.into_iter().map(|p| {
        let mut c = c.clone();
        async move {
            let _ = c
                .runtime
                .stop_pod_sandbox(cri::StopPodSandboxRequest {
                    pod_sandbox_id: p.clone(),
                })
                .await;
            let _ = c
                .runtime
                .remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: p })
                .await;
        }
    }))
    .buffer_unordered(parallel)
    .collect::<Vec<_>>()
    .await;
}

/// With `HAKO_BENCH_MARKS=1`, prints `MARK <what> <CLOCK_MONOTONIC seconds>` to stderr: the
/// phases' bounds for a `perf record -k CLOCK_MONOTONIC` of the run (docs/BENCHMARKS.md).
fn mark(what: &str) {
    if std::env::var_os("HAKO_BENCH_MARKS").is_some() {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the timespec it is given.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
        eprintln!("MARK {what} {}.{:09}", t.tv_sec, t.tv_nsec);
    }
}

/// CPU time the whole machine has spent busy (every CPU, user and system), in ms, from
/// /proc/stat (10 ms ticks: a figure over a batch of calls is good to a few ticks).
fn busy_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let f: Vec<f64> = stat
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap())
        .collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy = f[0] + f[1] + f[2] + f[5] + f[6] + f.get(7).copied().unwrap_or(0.0);
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    busy * 1000.0 / hz
}

/// 10 RunPodSandbox in flight, then 10 CreateContainer+StartContainer in flight (one into
/// each of those pods), on the bridge network: each call's time (ms), and each round's median.
async fn ten_in_flight(
    r: &Runtime,
    round: usize,
    times: &mut BTreeMap<&'static str, Vec<f64>>,
    medians: &mut BTreeMap<&'static str, Vec<f64>>,
) {
    let c = client(&r.socket).await;
    let cfgs: Vec<_> = (0..10)
        .map(|k| net_pod_config(&format!("par-{round}-{k}")))
        .collect();
    let cpu_before = busy_cpu_ms();
    mark("RunPodSandbox start");
    let runs = futures::future::join_all(cfgs.iter().map(|cfg| {
        let mut c = c.clone();
        async move {
            let t = Instant::now();
            let pod = run_pod(&mut c, cfg)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", r.name));
            (pod, t.elapsed().as_secs_f64() * 1e3)
        }
    }))
    .await;
    mark("RunPodSandbox end");
    medians
        .entry("RunPodSandbox, CPU ms per call")
        .or_default()
        .push((busy_cpu_ms() - cpu_before) / runs.len() as f64);
    let cpu_before = busy_cpu_ms();
    mark("CreateContainer+StartContainer start");
    let starts = timed_create_starts(
        &c,
        r,
        runs.iter().map(|(pod, _)| pod.as_str()).zip(&cfgs),
        net_container_config,
    )
    .await;
    mark("CreateContainer+StartContainer end");
    // The machine's CPU time per call (all processes: the runtime's, its plugins' and the
    // containers' own first moments), as the calls finish.
    medians
        .entry("CreateContainer+StartContainer, CPU ms per call")
        .or_default()
        .push((busy_cpu_ms() - cpu_before) / starts.len() as f64);
    let mut pod_t: Vec<f64> = runs.iter().map(|r| r.1).collect();
    let mut ctr_t = starts.clone();
    medians
        .entry("RunPodSandbox")
        .or_default()
        .push(percentile(&mut pod_t, 0.5));
    medians
        .entry("CreateContainer+StartContainer")
        .or_default()
        .push(percentile(&mut ctr_t, 0.5));
    times.entry("RunPodSandbox").or_default().extend(pod_t);
    times
        .entry("CreateContainer+StartContainer")
        .or_default()
        .extend(ctr_t);
    teardown(r, runs.into_iter().map(|r| r.0).collect(), 10).await;
}

/// 50 pods with one container each, all issued at once: the time until all run, failures.
async fn burst(r: &Runtime, n: usize) -> (f64, usize) {
    let c = client(&r.socket).await;
    let t = Instant::now();
    let out = futures::future::join_all((0..n).map(|k| {
        let mut c = c.clone();
        async move {
            let cfg = net_pod_config(&format!("burst-{k}"));
            let pod = run_pod(&mut c, &cfg).await.map_err(|e| (None, e))?;
            create_start(&mut c, &pod, &cfg, net_container_config())
                .await
                .map_err(|e| (Some(pod.clone()), e))?;
            Ok::<_, (Option<String>, tonic::Status)>(pod)
        }
    }))
    .await;
    let took = t.elapsed().as_secs_f64();
    let mut pods = Vec::new();
    let mut failed = 0;
    for o in out {
        match o {
            Ok(p) => pods.push(p),
            Err((p, e)) => {
                failed += 1;
                eprintln!("{}: burst: {e}", r.name);
                pods.extend(p);
            }
        }
    }
    teardown(r, pods, 10).await;
    (took, failed)
}

/// Brings the runtime to `target` idle pods (host network, one container each), 10 at a time.
async fn idle_pods(r: &Runtime, pods: &mut Vec<String>, target: usize) {
    use futures::StreamExt;
    let c = client(&r.socket).await;
    let from = pods.len();
    let made: Vec<String> = futures::stream::iter((from..target).map(|k| {
        let mut c = c.clone();
        async move {
            let cfg = pod_config(&format!("idle-{k}"));
            let pod = run_pod(&mut c, &cfg)
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", r.name));
            create_start(&mut c, &pod, &cfg, container_config())
                .await
                .unwrap_or_else(|e| panic!("{}: {e}", r.name));
            pod
        }
    }))
    .buffer_unordered(10)
    .collect()
    .await;
    pods.extend(made);
}

/// CreateContainer+StartContainer 10 in flight at the runtime's current density: into 10 new
/// host-network pods (started untimed, then removed), `rounds` times; each call's time (ms).
/// Every container create reads the node's mount table, which the idle pods have grown.
async fn creates_at_density(r: &Runtime, rounds: usize) -> Vec<f64> {
    let c = client(&r.socket).await;
    let mut times = Vec::new();
    for round in 0..rounds {
        let cfgs: Vec<_> = (0..10)
            .map(|k| pod_config(&format!("dense-{round}-{k}")))
            .collect();
        let pods = futures::future::join_all(cfgs.iter().map(|cfg| {
            let mut c = c.clone();
            async move {
                run_pod(&mut c, cfg)
                    .await
                    .unwrap_or_else(|e| panic!("{}: {e}", r.name))
            }
        }))
        .await;
        let took = timed_create_starts(
            &c,
            r,
            pods.iter().map(String::as_str).zip(&cfgs),
            container_config,
        )
        .await;
        times.extend(took);
        teardown(r, pods, 10).await;
    }
    times
}

/// List latencies at the runtime's current density (ms), as kubelet's relist issues them.
async fn list_latencies(r: &Runtime, n: usize) -> BTreeMap<&'static str, Vec<f64>> {
    let mut c = client(&r.socket).await;
    let mut times: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
    for i in 0..n {
        let t = Instant::now();
        c.runtime
            .list_containers(cri::ListContainersRequest::default())
            .await
            .unwrap();
        record(&mut times, "ListContainers", t);
        let t = Instant::now();
        c.runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest::default())
            .await
            .unwrap();
        record(&mut times, "ListPodSandbox", t);
        if i % 10 == 0 {
            let t = Instant::now();
            c.runtime
                .list_container_stats(cri::ListContainerStatsRequest::default())
                .await
                .unwrap();
            record(&mut times, "ListContainerStats", t);
            // kubelet's /metrics/cadvisor scrape under PodAndContainerStatsFromCRI; a runtime
            // without it (containerd 1.6) gets no figure. HAKO_BENCH_NO_METRICS leaves it out
            // (what the lists alone leave in the daemon's memory).
            let t = Instant::now();
            if std::env::var_os("HAKO_BENCH_NO_METRICS").is_none()
                && c.runtime
                    .list_pod_sandbox_metrics(cri::ListPodSandboxMetricsRequest::default())
                    .await
                    .is_ok()
            {
                record(&mut times, "ListPodSandboxMetrics", t);
            }
        }
    }
    times
}

fn main() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "containerd", "runc"]) {
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let n = env("HAKO_BENCH_PODS", 50);
    let rounds = env("HAKO_BENCH_ROUNDS", 5);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let reg = Registry::start();
        support::standins::push_all(&Pusher::new(&reg.addr)).await;
        let mirror = support::standins::hosts_toml("registry.k8s.io", &reg.addr);
        let certs = common::certs_for(&[("registry.k8s.io", &mirror)]);
        // One bridge network every runtime uses (same config, same IPAM leases).
        let net = tempfile::tempdir_in("/var/tmp").unwrap();
        let conf_dir = net.path().join("net.d");
        std::fs::create_dir_all(&conf_dir).unwrap();
        let list = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "bench-bridge",
            "plugins": [
                {"type": "bridge", "bridge": "hkbench0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "dataDir": net.path().join("leases"),
                          "ranges": [[{"subnet": "10.99.0.0/23"}]]}},
                {"type": "portmap", "capabilities": {"portMappings": true}}
            ]
        });
        std::fs::write(conf_dir.join("10-bench.conflist"), serde_json::to_vec(&list).unwrap()).unwrap();
        let mut runtimes = vec![start_hako(certs.path(), "warn", Some(&conf_dir))];
        if let Some(bin) = std::env::var_os("HAKO_BENCH_BASE") {
            let mut base = common::start_hako_bin(std::path::Path::new(&bin), certs.path(), "warn", Some(&conf_dir), "");
            base.name = "hako, HAKO_BENCH_BASE build";
            runtimes.push(base);
        }
        // HAKO_BENCH_HAKO_ONLY: no containerd (a quick look, e.g. with HAKO_BENCH_LOG timings).
        if std::env::var_os("HAKO_BENCH_HAKO_ONLY").is_none() {
            runtimes.push(start_containerd(certs.path(), Some(&conf_dir)));
            match common::containerd2_dir() {
                Some(d) => runtimes.push(common::start_containerd2(&d, certs.path(), Some(&conf_dir))),
                None => eprintln!("containerd 2.x not built (.ci/build-containerd.sh): compared with 1.6 only"),
            }
        }
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
        table(&format!("Pod and container lifecycle, host network, one call at a time, {n} rounds per runtime, alternating (ms):"), &runtimes, &results, &STEPS);

        // HAKO_BENCH_WRITER_MIB: the unsynced data beside the removals (0: not measured).
        let writer_mib = env("HAKO_BENCH_WRITER_MIB", 256);
        if writer_mib > 0 {
            let mut removals: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
            for round in 0..rounds {
                for (i, r) in runtimes.iter().enumerate() {
                    let ms = removal_beside_a_writer(r, round, writer_mib).await;
                    removals[i].entry("StopContainer+RemoveContainer").or_default().push(ms);
                }
            }
            table(&format!("A container's removal while {writer_mib} MiB another writer left unsynced wait on the filesystem of the runtime's root, host network, {rounds} rounds (ms):"), &runtimes, &removals, &["StopContainer+RemoveContainer"]);
        }

        // Pods on the bridge network: RunPodSandbox now includes CNI ADD (and Stop, DEL).
        let mut net_times: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
        for round in 0..n {
            for (i, r) in runtimes.iter().enumerate() {
                let mut c = client(&r.socket).await;
                let cfg = net_pod_config(&format!("net-{round}"));
                let t = Instant::now();
                let pod = run_pod(&mut c, &cfg).await.unwrap_or_else(|e| panic!("{}: {e}", r.name));
                record(&mut net_times[i], "RunPodSandbox", t);
                let t = Instant::now();
                c.runtime.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: pod.clone() }).await.unwrap();
                record(&mut net_times[i], "StopPodSandbox", t);
                c.runtime.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: pod }).await.unwrap();
            }
        }
        table(&format!("Pods on a bridge network (CNI bridge + host-local + portmap from /usr/lib/cni), one at a time, {n} rounds (ms):"), &runtimes, &net_times, &["RunPodSandbox", "StopPodSandbox"]);

        // The floor: the same chain run by hand, no runtime.
        for parallel in [1, 10] {
            let mut t = cni_chain_alone(&list, parallel, if parallel == 1 { n } else { rounds });
            println!("\nThe CNI chain alone (bridge ADD with host-local, then portmap ADD; DEL in reverse), {parallel} at a time (ms per pod):");
            println!("| step | p50 | p99 |");
            println!("|---|---|---|");
            for (step, v) in t.iter_mut() {
                println!("| {step} | {:.2} | {:.2} |", percentile(v, 0.5), percentile(v, 0.99));
            }
        }

        // 10 in flight, rounds alternating between runtimes.
        let mut par: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
        let mut par_medians: Vec<BTreeMap<&'static str, Vec<f64>>> = vec![BTreeMap::new(); runtimes.len()];
        for round in 0..rounds {
            for (i, r) in runtimes.iter().enumerate() {
                ten_in_flight(r, round, &mut par[i], &mut par_medians[i]).await;
            }
        }
        table(&format!("10 calls in flight on the bridge network, {rounds} rounds of 10 per runtime, alternating (ms per call):"), &runtimes, &par, &["RunPodSandbox", "CreateContainer+StartContainer"]);
        println!("\nEach round's median (ms):");
        for (i, r) in runtimes.iter().enumerate() {
            for (step, v) in &par_medians[i] {
                println!("- {} {step}: {}", r.name, v.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(", "));
            }
        }

        // A burst of 50 pods, each with one container, issued at once.
        println!("\nBurst: 50 pods with one container each (bridge network), all issued at once:");
        println!("| runtime | until all running, s | failures |");
        println!("|---|---|---|");
        for r in &runtimes {
            let (took, failed) = burst(r, 50).await;
            println!("| {} | {took:.2} | {failed} |", r.name);
        }
        let _ = std::process::Command::new("ip").args(["link", "del", "hkbench0"]).output();

        // Density: one runtime at a time (hundreds of shims of two containerds at once would
        // measure the machine, not the runtime).
        let listing = env("HAKO_BENCH_LISTS", 200);
        // HAKO_BENCH_DENSITY: the pod counts measured, comma-separated (empty: none).
        let densities: Vec<usize> = std::env::var("HAKO_BENCH_DENSITY")
            .unwrap_or_else(|_| "100,250".into())
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        println!("\nIdle pods (host network, one `sleep` container each): list latency from a gRPC client ({listing} calls, ListContainerStats and ListPodSandboxMetrics every 10th) and memory:");
        println!("| runtime | pods | ListContainers p50 (p99) ms | ListPodSandbox p50 (p99) ms | ListContainerStats p50 (p99) ms | ListPodSandboxMetrics p50 (p99) ms | daemon RSS MiB (anonymous) | daemon RSS MiB, 12 s later | per-pod PSS MiB ({{processes}}) | CreateContainer+StartContainer, 10 in flight, p50 (p99) ms | mountinfo lines |");
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &runtimes {
            let mut pods = Vec::new();
            for &target in &densities {
                idle_pods(r, &mut pods, target).await;
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
                let mut t = list_latencies(r, listing).await;
                let mut cell = |k: &str| match t.get_mut(k) {
                    Some(v) => format!("{:.2} ({:.2})", percentile(v, 0.5), percentile(v, 0.99)),
                    None => "not served".into(),
                };
                let (lc, lp, ls, lm) = (
                    cell("ListContainers"),
                    cell("ListPodSandbox"),
                    cell("ListContainerStats"),
                    cell("ListPodSandboxMetrics"),
                );
                let procs = per_pod_processes(r);
                let per_pod: u64 = procs.iter().map(|p| pss_kib(*p)).sum();
                let rss = rss_kib(r.child.id() as i32);
                let anon = status_kib(r.child.id() as i32, "RssAnon:");
                // Then as an idle node's daemon settles (Go's scavenger returns memory in the
                // background; glibc's malloc keeps what it keeps).
                tokio::time::sleep(std::time::Duration::from_secs(12)).await;
                let settled = rss_kib(r.child.id() as i32);
                let lines = std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines().count();
                let mut creates = creates_at_density(r, 3).await;
                println!(
                    "| {} | {target} | {lc} | {lp} | {ls} | {lm} | {:.1} ({:.1}) | {:.1} | {:.2} ({}) | {:.2} ({:.2}) | {lines} |",
                    r.name,
                    rss as f64 / 1024.0,
                    anon as f64 / 1024.0,
                    settled as f64 / 1024.0,
                    per_pod as f64 / 1024.0 / target as f64,
                    procs.len(),
                    percentile(&mut creates, 0.5),
                    percentile(&mut creates, 0.99),
                );
            }
            teardown(r, pods, 10).await;
        }
    });
}
