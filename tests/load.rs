//! Load: 100 concurrent CRI clients, each on its own connection, make the calls a busy node's
//! kubelet makes (relists, status, stats, exec probes, image status) while some of them run
//! whole pod and container lives, for `HAKO_LOAD_SECS` (default 60). Every call must answer
//! (a call that has not answered in 60 s is a deadlock and fails the test) and no call may
//! fail: every object a client names exists while it calls. Latency per method (p50, p99,
//! max) is printed, not asserted: figures go to docs/RELIABILITY.md.

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hako_proto::cri;
use hako_proto::cri::image_service_client::ImageServiceClient;
use hako_proto::cri::runtime_service_client::RuntimeServiceClient;
use support::cri::*;

const CLIENTS: usize = 100;
/// Clients that run pod lives; the others read.
const LIFECYCLE_CLIENTS: usize = 10;
/// Long-lived pods (one running container each) the readers look at.
const FIXED_PODS: usize = 5;
/// No call of these takes this long unless something is stuck.
const CALL_LIMIT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Record {
    latencies: BTreeMap<&'static str, Vec<Duration>>,
    errors: Vec<String>,
    /// Pods the lifecycle clients ran (and removed), for the leak check.
    pods: Vec<String>,
}

struct Client {
    rt: Rt,
    images: ImageServiceClient<tonic::transport::Channel>,
    record: Arc<Mutex<Record>>,
}

impl Client {
    /// Times one call; an error or a call over the limit is recorded as a failure.
    async fn timed<T, Fut>(&self, method: &'static str, call: Fut) -> Option<T>
    where
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let t = Instant::now();
        let r = tokio::time::timeout(CALL_LIMIT, call).await;
        let took = t.elapsed();
        let mut rec = self.record.lock().unwrap();
        rec.latencies.entry(method).or_default().push(took);
        match r {
            Ok(Ok(resp)) => Some(resp.into_inner()),
            Ok(Err(s)) => {
                rec.errors
                    .push(format!("{method}: {:?}: {}", s.code(), s.message()));
                None
            }
            Err(_) => {
                rec.errors
                    .push(format!("{method}: no answer in {CALL_LIMIT:?} (stuck)"));
                None
            }
        }
    }
}

/// xorshift64*, seeded per client.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n as u64) as usize
    }
}

const SLEEPER: &[&str] = &["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"];

/// One reader call, chosen at random among what kubelet's relist, probes and stats make.
async fn read_once(c: &mut Client, rng: &mut Rng, fixed: &[(String, String)]) {
    let (pod, ctr) = fixed[rng.below(fixed.len())].clone();
    let mut rt = c.rt.clone();
    let mut images = c.images.clone();
    match rng.below(10) {
        0 => {
            c.timed(
                "ListPodSandbox",
                rt.list_pod_sandbox(cri::ListPodSandboxRequest::default()),
            )
            .await;
        }
        1 => {
            c.timed(
                "ListContainers",
                rt.list_containers(cri::ListContainersRequest::default()),
            )
            .await;
        }
        2 => {
            c.timed(
                "PodSandboxStatus",
                rt.pod_sandbox_status(cri::PodSandboxStatusRequest {
                    pod_sandbox_id: pod,
                    verbose: false,
                }),
            )
            .await;
        }
        3 => {
            let st = c
                .timed(
                    "ContainerStatus",
                    rt.container_status(cri::ContainerStatusRequest {
                        container_id: ctr.clone(),
                        verbose: false,
                    }),
                )
                .await;
            if let Some(st) = st {
                let state = st.status.map(|s| s.state).unwrap_or(-1);
                if state != cri::ContainerState::ContainerRunning as i32 {
                    c.record
                        .lock()
                        .unwrap()
                        .errors
                        .push(format!("ContainerStatus {ctr}: state {state}, not running"));
                }
            }
        }
        4 | 5 => {
            let out = c
                .timed(
                    "ExecSync",
                    rt.exec_sync(cri::ExecSyncRequest {
                        container_id: ctr.clone(),
                        cmd: vec!["echo".into(), "probe".into()],
                        timeout: 30,
                    }),
                )
                .await;
            if let Some(out) = out {
                if out.exit_code != 0 || out.stdout != b"probe\n" {
                    c.record.lock().unwrap().errors.push(format!(
                        "ExecSync {ctr}: exit {} stdout {:?}",
                        out.exit_code,
                        String::from_utf8_lossy(&out.stdout)
                    ));
                }
            }
        }
        6 => {
            c.timed(
                "ListContainerStats",
                rt.list_container_stats(cri::ListContainerStatsRequest::default()),
            )
            .await;
        }
        7 => {
            c.timed(
                "ListPodSandboxStats",
                rt.list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest::default()),
            )
            .await;
        }
        8 => {
            c.timed(
                "ContainerStats",
                rt.container_stats(cri::ContainerStatsRequest { container_id: ctr }),
            )
            .await;
        }
        _ => {
            c.timed(
                "ImageStatus",
                images.image_status(cri::ImageStatusRequest {
                    image: Some(cri::ImageSpec {
                        image: IMAGE.into(),
                        ..Default::default()
                    }),
                    verbose: false,
                }),
            )
            .await;
        }
    }
}

/// One pod life: run, create and start a container, probe it, stop and remove both.
async fn pod_life(c: &mut Client, name: &str, logs: &std::path::Path) {
    let mut rt = c.rt.clone();
    let cfg = pod_config(name, logs);
    let Some(pod) = c
        .timed(
            "RunPodSandbox",
            rt.run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cfg.clone()),
                runtime_handler: String::new(),
            }),
        )
        .await
    else {
        return;
    };
    let pod = pod.pod_sandbox_id;
    c.record.lock().unwrap().pods.push(pod.clone());
    let created = c
        .timed(
            "CreateContainer",
            rt.create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(container_config("c", SLEEPER)),
                sandbox_config: Some(cfg),
            }),
        )
        .await;
    if let Some(created) = created {
        let id = created.container_id;
        c.timed(
            "StartContainer",
            rt.start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            }),
        )
        .await;
        c.timed(
            "ExecSync",
            rt.exec_sync(cri::ExecSyncRequest {
                container_id: id.clone(),
                cmd: vec!["true".into()],
                timeout: 30,
            }),
        )
        .await;
        c.timed(
            "StopContainer",
            rt.stop_container(cri::StopContainerRequest {
                container_id: id.clone(),
                timeout: 10,
            }),
        )
        .await;
        c.timed(
            "RemoveContainer",
            rt.remove_container(cri::RemoveContainerRequest { container_id: id }),
        )
        .await;
    }
    c.timed(
        "StopPodSandbox",
        rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        }),
    )
    .await;
    c.timed(
        "RemovePodSandbox",
        rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        }),
    )
    .await;
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_clients_for_a_minute_all_answered_no_undeserved_error() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let secs: u64 = std::env::var("HAKO_LOAD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let mut fixed = Vec::new();
    for i in 0..FIXED_PODS {
        let cfg = pod_config(&format!("load-fixed-{i}"), logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        let ctr = run_container(&mut rt, &pod, &cfg, container_config("c", SLEEPER)).await;
        fixed.push((pod, ctr));
    }
    let fixed = Arc::new(fixed);
    let record = Arc::new(Mutex::new(Record::default()));
    let until = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        // Each client its own connection, as separate kubelet goroutines share one but
        // separate tools (crictl, node agents) do not: the server sees 100 streams.
        let ch = h.channel().await;
        let mut c = Client {
            rt: RuntimeServiceClient::new(ch.clone()),
            images: ImageServiceClient::new(ch),
            record: record.clone(),
        };
        let (fixed, logs) = (fixed.clone(), logs.path().to_path_buf());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((i as u64 + 1) * 0x1000_0001));
            let mut n = 0;
            while Instant::now() < until {
                if i < LIFECYCLE_CLIENTS {
                    pod_life(&mut c, &format!("load-{i}-{n}"), &logs).await;
                } else {
                    read_once(&mut c, &mut rng, &fixed).await;
                }
                n += 1;
            }
        }));
    }
    for t in tasks {
        t.await.expect("a client panicked");
    }
    let rec = std::mem::take(&mut *record.lock().unwrap());
    let mut total = 0;
    let lives = rec.pods.len();
    eprintln!("load: {CLIENTS} clients, {secs} s; latency per method (ms):");
    eprintln!(
        "{:<20} {:>7} {:>8} {:>8} {:>8}",
        "method", "calls", "p50", "p99", "max"
    );
    for (m, l) in &rec.latencies {
        let mut l = l.clone();
        l.sort();
        total += l.len();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        eprintln!(
            "{:<20} {:>7} {:>8.2} {:>8.2} {:>8.2}",
            m,
            l.len(),
            ms(percentile(&l, 0.50)),
            ms(percentile(&l, 0.99)),
            ms(*l.last().unwrap())
        );
    }
    eprintln!(
        "load: {total} calls in all, {lives} pod lives, {} errors",
        rec.errors.len()
    );
    assert!(
        rec.errors.is_empty(),
        "{} calls failed or never answered; first ones: {:#?}",
        rec.errors.len(),
        &rec.errors[..rec.errors.len().min(20)]
    );
    assert!(total > CLIENTS, "the clients did work: {total} calls");
    // No monitor died: a stop racing the relists is no lost monitor.
    let false_alarms = h
        .log_text()
        .lines()
        .filter(|l| l.contains("pod monitor is gone"))
        .count();
    assert_eq!(
        false_alarms, 0,
        "ordinary stops were taken for lost monitors {false_alarms} times"
    );
    // The lifecycle clients removed what they made: only the fixed pods are left, and every
    // fixed container still runs.
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    let mut ids: Vec<_> = pods.iter().map(|p| p.id.clone()).collect();
    ids.sort();
    let mut want: Vec<_> = fixed.iter().map(|(p, _)| p.clone()).collect();
    want.sort();
    assert_eq!(ids, want, "pods left besides the fixed ones");
    for (pod, _) in fixed.iter() {
        remove_pod(&mut rt, pod).await;
    }
    for (pod, _) in fixed.iter() {
        assert_no_leaks(&h, pod);
    }
    for pod in &rec.pods {
        assert_no_leaks(&h, pod);
    }
}
