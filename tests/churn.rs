//! Churn: concurrent clients run pods and containers through their whole lives while the
//! daemon is killed with SIGKILL at random points (≥ 50 times), pod monitors are killed
//! (≥ 20 times) and some calls are cancelled mid-flight. Clients behave as kubelet does:
//! retry a call under the same name after an error or a cancel, clean up what a dead monitor
//! left. At the end every exit seen was reported with its code, everything is removable and
//! nothing is left: no mount, netns, cgroup, process, IP lease, directory, name reservation or
//! pin.
//!
//! `HAKO_CHURN_DAEMON_KILLS` / `HAKO_CHURN_MONITOR_KILLS` raise the counts for a soak (see
//! docs/RELIABILITY.md).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hako_proto::cri;
use hako_proto::cri::runtime_service_client::RuntimeServiceClient;
use support::cni::{self, TestNet};
use support::cri::*;
use tonic::transport::{Endpoint, Uri};

/// xorshift64*: the test's own randomness, seeded per worker (printed, to replay a run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn connect(socket: &std::path::Path) -> Option<Rt> {
    let path = socket.to_path_buf();
    let ch = Endpoint::try_from("http://[::]:50051")
        .ok()?
        .connect_timeout(Duration::from_secs(2))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .ok()?;
    Some(RuntimeServiceClient::new(ch))
}

/// What a client sees of one call: an answer, or an error the request deserved.
type Answer<T> = Result<T, tonic::Status>;

/// Whether an error is the daemon's absence (connection refused, reset, the daemon dying
/// mid-call), which a client retries, rather than an answer.
fn transient(s: &tonic::Status) -> bool {
    matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Cancelled)
        || (s.code() == tonic::Code::Unknown && s.message().contains("transport"))
        || s.message().contains("h2 protocol error")
        || s.message().contains("connection")
}

struct Ctx {
    socket: PathBuf,
    cancelled: AtomicUsize,
    retries: AtomicUsize,
}

impl Ctx {
    /// Runs `op` until it answers (retrying while the daemon is away or the client
    /// cancelled), failing the test if nothing answers for 90 s. One call in eight is
    /// cancelled after a random few milliseconds, as a client timing out would.
    async fn call<T, F, Fut>(&self, rng: &mut Rng, what: &str, op: F) -> Answer<T>
    where
        F: Fn(Rt) -> Fut,
        Fut: std::future::Future<Output = Answer<T>>,
    {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            assert!(
                Instant::now() < deadline,
                "{what}: no answer for 90 s (the daemon is stuck or the call never finishes)"
            );
            let Some(rt) = connect(&self.socket).await else {
                tokio::time::sleep(Duration::from_millis(30)).await;
                continue;
            };
            let cancel_after = (rng.below(8) == 0).then(|| Duration::from_millis(rng.below(40)));
            let result = match cancel_after {
                Some(d) => match tokio::time::timeout(d, op(rt)).await {
                    Ok(r) => r,
                    Err(_) => {
                        self.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                },
                None => op(rt).await,
            };
            match result {
                Err(s) if transient(&s) => {
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                other => return other,
            }
        }
    }
}

/// What the clients know about the pods they made.
#[derive(Default)]
struct Model {
    /// Every pod id ever returned.
    pods: BTreeSet<String>,
    /// Pods whose monitor the test killed: their containers may end Unknown.
    monitor_killed: BTreeSet<String>,
    /// Exits seen: container id → (expected code, reported code, pod).
    exits: BTreeMap<String, (i32, i32, String)>,
}

fn pod_cfg(name: &str, attempt: u32, logs: &std::path::Path) -> cri::PodSandboxConfig {
    let mut cfg = pod_config(name, logs);
    cfg.metadata.as_mut().unwrap().attempt = attempt;
    cfg
}

async fn find_pod(ctx: &Ctx, rng: &mut Rng, name: &str) -> Vec<String> {
    let name = name.to_string();
    let items = ctx
        .call(rng, "ListPodSandbox", |mut rt| async move {
            rt.list_pod_sandbox(cri::ListPodSandboxRequest::default())
                .await
                .map(|r| r.into_inner().items)
        })
        .await
        .expect("ListPodSandbox answers");
    items
        .into_iter()
        .filter(|p| p.metadata.as_ref().is_some_and(|m| m.name == name))
        .map(|p| p.id)
        .collect()
}

async fn remove_pod_retrying(ctx: &Ctx, rng: &mut Rng, id: &str) {
    let id = id.to_string();
    for what in ["StopPodSandbox", "RemovePodSandbox"] {
        let id = id.clone();
        let r = ctx
            .call(rng, what, |mut rt| {
                let id = id.clone();
                async move {
                    if what == "StopPodSandbox" {
                        rt.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: id })
                            .await
                            .map(|_| ())
                    } else {
                        rt.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id })
                            .await
                            .map(|_| ())
                    }
                }
            })
            .await;
        r.unwrap_or_else(|e| panic!("{what} {id}: {e:?}"));
    }
}

/// One pod's life: run, a container that exits with a chosen code or sleeps, exec, stop,
/// remove. Errors that a request does not deserve fail the test.
async fn one_pod(
    ctx: &Ctx,
    model: &Mutex<Model>,
    rng: &mut Rng,
    name: &str,
    logs: &std::path::Path,
) {
    // RunPodSandbox, kubelet style: a retry under the same name returns the same pod; a pod
    // of that name that is no longer ready (its monitor was killed) is removed and the next
    // attempt made.
    let mut attempt = 0;
    let pod = loop {
        let cfg = pod_cfg(name, attempt, logs);
        let r = ctx
            .call(rng, "RunPodSandbox", |mut rt| {
                let cfg = cfg.clone();
                async move {
                    rt.run_pod_sandbox(cri::RunPodSandboxRequest {
                        config: Some(cfg),
                        runtime_handler: String::new(),
                    })
                    .await
                    .map(|r| r.into_inner().pod_sandbox_id)
                }
            })
            .await;
        match r {
            Ok(id) => break id,
            // The test killed the new pod's monitor while it started (a pod no client has
            // seen yet): the start failed, and left nothing, so the retry starts afresh.
            Err(e)
                if e.code() == tonic::Code::FailedPrecondition
                    && e.message().contains("pod monitor failed")
                    && {
                        let m = model.lock().unwrap();
                        m.monitor_killed.iter().any(|p| !m.pods.contains(p))
                    } =>
            {
                ctx.retries.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.code() == tonic::Code::AlreadyExists => {
                for id in find_pod(ctx, rng, name).await {
                    remove_pod_retrying(ctx, rng, &id).await;
                }
                attempt += 1;
            }
            Err(e) => panic!("RunPodSandbox {name}: {e:?}"),
        }
    };
    model.lock().unwrap().pods.insert(pod.clone());
    let cfg = pod_cfg(name, attempt, logs);
    let code = rng.below(100) as i32;
    let sleeper = rng.below(3) == 0;
    let cmd = if sleeper {
        "trap 'exit 0' TERM; sleep 30 & wait".to_string()
    } else {
        format!("sleep 0.{}; exit {code}", rng.below(5))
    };
    let cc = container_config("c", &["sh", "-c", &cmd]);
    let created = ctx
        .call(rng, "CreateContainer", |mut rt| {
            let (pod, cfg, cc) = (pod.clone(), cfg.clone(), cc.clone());
            async move {
                rt.create_container(cri::CreateContainerRequest {
                    pod_sandbox_id: pod,
                    config: Some(cc),
                    sandbox_config: Some(cfg),
                })
                .await
                .map(|r| r.into_inner().container_id)
            }
        })
        .await;
    let ctr = match created {
        Ok(id) => Some(id),
        // The pod's monitor was killed: the pod is not ready any more.
        Err(e)
            if e.code() == tonic::Code::FailedPrecondition
                && model.lock().unwrap().monitor_killed.contains(&pod) =>
        {
            None
        }
        Err(e) => panic!("CreateContainer in {name}: {e:?}"),
    };
    if let Some(ctr) = &ctr {
        let started = ctx
            .call(rng, "StartContainer", |mut rt| {
                let ctr = ctr.clone();
                async move {
                    rt.start_container(cri::StartContainerRequest { container_id: ctr })
                        .await
                        .map(|_| ())
                }
            })
            .await;
        if let Err(e) = &started {
            // A retried start may find it started or exited already; a dead monitor fails it.
            let ok = matches!(
                e.code(),
                tonic::Code::FailedPrecondition | tonic::Code::Unknown
            ) || model.lock().unwrap().monitor_killed.contains(&pod);
            assert!(ok, "StartContainer {ctr}: {e:?}");
        }
        if sleeper {
            let _ = ctx
                .call(rng, "ExecSync", |mut rt| {
                    let ctr = ctr.clone();
                    async move {
                        rt.exec_sync(cri::ExecSyncRequest {
                            container_id: ctr,
                            cmd: vec!["echo".into(), "hi".into()],
                            timeout: 5,
                        })
                        .await
                        .map(|r| r.into_inner())
                    }
                })
                .await;
            let r = ctx
                .call(rng, "StopContainer", |mut rt| {
                    let ctr = ctr.clone();
                    async move {
                        rt.stop_container(cri::StopContainerRequest {
                            container_id: ctr,
                            timeout: 2,
                        })
                        .await
                        .map(|_| ())
                    }
                })
                .await;
            r.unwrap_or_else(|e| panic!("StopContainer {ctr}: {e:?}"));
        } else {
            // Wait for its exit.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let st = ctx
                    .call(rng, "ContainerStatus", |mut rt| {
                        let ctr = ctr.clone();
                        async move {
                            rt.container_status(cri::ContainerStatusRequest {
                                container_id: ctr,
                                verbose: false,
                            })
                            .await
                            .map(|r| r.into_inner().status.unwrap())
                        }
                    })
                    .await
                    .unwrap_or_else(|e| panic!("ContainerStatus {ctr}: {e:?}"));
                if st.state == cri::ContainerState::ContainerExited as i32 {
                    if started.is_ok() && st.reason != "StartError" {
                        model
                            .lock()
                            .unwrap()
                            .exits
                            .insert(ctr.clone(), (code, st.exit_code, pod.clone()));
                    }
                    break;
                }
                if st.state == cri::ContainerState::ContainerUnknown as i32 {
                    assert!(
                        model.lock().unwrap().monitor_killed.contains(&pod),
                        "container {ctr} Unknown though its monitor lives: {st:?}"
                    );
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "container {ctr} ({cmd}) never exited: {st:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let r = ctx
            .call(rng, "RemoveContainer", |mut rt| {
                let ctr = ctr.clone();
                async move {
                    rt.remove_container(cri::RemoveContainerRequest { container_id: ctr })
                        .await
                        .map(|_| ())
                }
            })
            .await;
        r.unwrap_or_else(|e| panic!("RemoveContainer {ctr}: {e:?}"));
    }
    remove_pod_retrying(ctx, rng, &pod).await;
}

fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Pids of the monitors of this daemon (their command line names its state dir), not their
/// children (infra process, create helpers), which carry the same command line.
fn monitors_of(h_dir: &str) -> Vec<(i32, String)> {
    let is_monitor = |pid: &str| {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("monitor"))
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(c) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let c = String::from_utf8_lossy(&c);
        let ppid = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().nth(1))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        if c.contains("monitor") && c.contains(h_dir) && !is_monitor(&ppid) {
            if let Some(i) = c.find("\"pod_id\":\"") {
                let id = c[i + 10..].chars().take(64).collect();
                out.push((pid, id));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn churn_under_daemon_and_monitor_kills_leaves_everything_accounted_for() {
    if !cni::ready() {
        return;
    }
    let net = TestNet::new();
    let Some((_reg, h)) = ready_with_config(&net.hako_config(30)).await else {
        return;
    };
    let daemon_kills = env_count("HAKO_CHURN_DAEMON_KILLS", 50);
    let monitor_kills = env_count("HAKO_CHURN_MONITOR_KILLS", 20);
    let workers = 4;
    let logs = tempfile::tempdir().unwrap();
    let ctx = Arc::new(Ctx {
        socket: h.socket.clone(),
        cancelled: AtomicUsize::new(0),
        retries: AtomicUsize::new(0),
    });
    let model = Arc::new(Mutex::new(Model::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let seed = std::env::var("HAKO_CHURN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("churn seed {seed} (HAKO_CHURN_SEED replays the clients' choices)");
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (ctx, model, stop) = (ctx.clone(), model.clone(), stop.clone());
        let logs = logs.path().to_path_buf();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(seed.wrapping_add(w as u64 * 0x9E37_79B9));
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                one_pod(&ctx, &model, &mut rng, &format!("churn-{w}-{i}"), &logs).await;
                i += 1;
            }
            i
        }));
    }
    let h = Arc::new(tokio::sync::Mutex::new(h));
    let dir = h.lock().await.dir.path().display().to_string();
    let started = Instant::now();
    let mut rng = Rng(seed ^ 0xDEAD_BEEF);
    let (mut dk, mut mk) = (0, 0);
    while dk < daemon_kills || mk < monitor_kills {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "churn ran 10 minutes: {dk} daemon kills, {mk} monitor kills"
        );
        tokio::time::sleep(Duration::from_millis(100 + rng.below(400))).await;
        if mk < monitor_kills && rng.below(3) == 0 {
            let ms = monitors_of(&dir);
            if !ms.is_empty() {
                let (pid, pod) = ms[rng.below(ms.len() as u64) as usize].clone();
                model.lock().unwrap().monitor_killed.insert(pod);
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                mk += 1;
            }
        } else if dk < daemon_kills {
            let mut g = h.lock().await;
            g.kill9();
            // Dead for a moment, as a crash and a service manager's restart delay are.
            tokio::time::sleep(Duration::from_millis(rng.below(200))).await;
            tokio::task::block_in_place(|| g.restart());
            dk += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut pods_run = 0;
    for t in tasks {
        pods_run += t.await.expect("a client failed");
    }
    let m = std::mem::take(&mut *model.lock().unwrap());
    eprintln!(
        "churn: {pods_run} pod lives, {dk} daemon kills, {mk} monitor kills, {} cancelled calls, {} retries, {} exits checked, in {:?}",
        ctx.cancelled.load(Ordering::Relaxed),
        ctx.retries.load(Ordering::Relaxed),
        m.exits.len(),
        started.elapsed()
    );
    // Every exit seen carries the code the container exited with (a container whose monitor
    // was killed may have been killed with it: 137, or its recorded exit).
    for (id, (want, got, pod)) in &m.exits {
        if *got != *want {
            assert!(
                m.monitor_killed.contains(pod) && *got == 137,
                "container {id} exited {want} but was reported {got}"
            );
        }
    }
    assert!(pods_run > 0 && !m.exits.is_empty(), "the clients did work");
    let mut g = h.lock().await;
    let mut rt = g.runtime().await;
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(
        pods.is_empty(),
        "pods left after every client removed its own: {pods:?}"
    );
    let ctrs = all_containers(&mut rt).await;
    assert!(ctrs.is_empty(), "containers left: {ctrs:?}");
    for pod in &m.pods {
        assert_no_leaks(&g, pod);
    }
    assert!(
        net.leased().is_empty(),
        "IP leases left: {:?}",
        net.leased()
    );
    assert!(net.veths().is_empty(), "veths left: {:?}", net.veths());
    assert!(cni::netns_mounts_under(g.dir.path()).is_empty());
    g.stop();
    let store = hako::store::Store::open(&g.root.join("meta.db")).unwrap();
    assert!(
        store.reservations().unwrap().is_empty(),
        "{:?}",
        store.reservations()
    );
    assert!(
        store.pin_owners().unwrap().is_empty(),
        "{:?}",
        store.pin_owners()
    );
    drop(store);
    g.restart();
}
