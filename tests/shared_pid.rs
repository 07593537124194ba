//! Pods with a shared PID namespace (`namespace_options.pid = POD`, what kubelet sends for
//! `shareProcessNamespace: true`) end to end: several containers — plain, with CDI devices
//! (node, mount, hooks), with bind mounts, created after others exited — start, see each
//! other's processes, report their exits, and the pod goes without leaks.
//!
//! Before each create the pod's PID namespace is brought to a pid the host has no process
//! with. libcontainer 0.7's init looks itself up by that pid in /proc while mounting cgroup v1
//! filesystems; with the host's /proc there (before runtime/src/monitor/joined_pid.rs) the
//! create failed with "failed to prepare rootfs" (`NotFound("/proc/<pid>")`). On cgroup v2
//! hosts that lookup does not happen; the tests then check the rest.

mod support;

use std::path::Path;
use std::time::Duration;

use hako_proto::cri;
use support::cri::*;

fn shared_pid_pod(name: &str, logs: &Path) -> cri::PodSandboxConfig {
    with_namespaces(
        pod_config(name, logs),
        cri::NamespaceOption {
            pid: cri::NamespaceMode::Pod as i32,
            ..Default::default()
        },
    )
}

fn host_has_pid(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Brings the pod's PID namespace to where the next pid it hands out is one no host process
/// has, and returns it. Pids are handed out in order: an exec into `via` (an idle container of
/// the pod) takes one, each process it forks the next.
async fn next_pod_pid_unknown_to_host(rt: &mut Rt, via: &str) -> i32 {
    for _ in 0..5 {
        let last: i32 = exec(rt, via, "echo $$").await.parse().unwrap();
        let free = (last + 1..).find(|p| !host_has_pid(*p)).unwrap();
        if free == last + 1 {
            return free;
        }
        // This exec takes last + 1, its children the pids up to free - 1.
        let children = free - last - 2;
        let out = exec(
            rt,
            via,
            &format!(
                "echo $$; i=0; while [ $i -lt {children} ]; do sh -c 'echo $$'; i=$((i+1)); done"
            ),
        )
        .await;
        let end: i32 = out.lines().last().unwrap().trim().parse().unwrap();
        if end + 1 == free && !host_has_pid(free) {
            return free;
        }
    }
    panic!("could not bring the pod's PID namespace to a pid the host has not");
}

/// The pid of a host process in the innermost PID namespace it is in.
fn pod_pid(host_pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{host_pid}/status"))
        .unwrap_or_else(|e| panic!("status of host pid {host_pid}: {e}"))
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|v| v.split_whitespace().last())
        .and_then(|p| p.parse().ok())
        .expect("NSpid in status")
}

/// The pod pid of the one container init that waits to be started in the PID namespace of
/// host process `member`.
fn created_init_pod_pid(member: i32) -> i32 {
    let ns = std::fs::read_link(format!("/proc/{member}/ns/pid")).unwrap();
    let inits: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "youki:[2:INIT]")
                && std::fs::read_link(format!("/proc/{p}/ns/pid")).is_ok_and(|n| n == ns)
        })
        .collect();
    assert_eq!(inits.len(), 1, "created inits in the pod: {inits:?}");
    pod_pid(inits[0])
}

/// Creates and starts a container once the pod's next pid is one the host lacks, and checks
/// that the container's init (waiting to be started) got that pid or a later one.
async fn run_at_a_host_free_pid(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    via: &str,
    cc: cri::ContainerConfig,
) -> String {
    let name = cc.metadata.as_ref().unwrap().name.clone();
    let free = next_pod_pid_unknown_to_host(rt, via).await;
    let id = rt
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.into(),
            config: Some(cc),
            sandbox_config: Some(cfg.clone()),
        })
        .await
        .unwrap_or_else(|e| panic!("create {name} at pod pid {free}: {e:?}"))
        .into_inner()
        .container_id;
    let got = created_init_pod_pid(container_pid(rt, via).await);
    assert!(
        got >= free,
        "container {name} got pod pid {got}, before {free} that the test prepared"
    );
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    id
}

/// The commands running in the pod as `id` sees them (`ps`), without the pod's init (pid 1)
/// and the exec running `ps`.
async fn pod_commands(rt: &mut Rt, id: &str) -> Vec<String> {
    let out = exec(rt, id, "ps -o pid,args").await;
    let mut cmds: Vec<String> = out
        .lines()
        .skip(1)
        .filter_map(|l| {
            let (pid, args) = l.trim().split_once(char::is_whitespace)?;
            let args = args.trim();
            (pid != "1" && !args.contains("ps -o pid,args")).then(|| args.to_string())
        })
        .collect();
    cmds.sort();
    cmds
}

/// The pids `ls /proc` shows in `id`.
async fn proc_pids(rt: &mut Rt, id: &str) -> Vec<i32> {
    exec(rt, id, "ls /proc")
        .await
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// The daemon's spec of a container, as libcontainer was handed it.
fn bundle_spec(h: &support::hako::Hako, id: &str) -> serde_json::Value {
    let path = h.state.join("containers").join(id).join("config.json");
    serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_mounted_and_later_containers_share_the_pods_processes() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("in"), "from-host\n").unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("shared", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;

    let first = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("first", &["sleep", "3601"]),
    )
    .await;
    let second = run_at_a_host_free_pid(
        &mut rt,
        &pod,
        &cfg,
        &first,
        container_config("second", &["sleep", "3602"]),
    )
    .await;
    // The daemon's spec is left as it wrote it: a mount namespace the init makes itself.
    let spec = bundle_spec(&h, &second);
    let mnt = spec["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["type"] == "mount")
        .unwrap();
    assert!(mnt.get("path").is_none(), "{mnt}");

    // A short one that sees the others and exits with its own code.
    let short = run_at_a_host_free_pid(
        &mut rt,
        &pod,
        &cfg,
        &first,
        container_config("short", &["sh", "-c", "ps -o args; exit 7"]),
    )
    .await;
    let st = wait_exited(&mut rt, &short).await;
    assert_eq!((st.exit_code, st.reason.as_str()), (7, "Error"));
    let seen = log_lines(&logs.path().join("short.log"));
    for cmd in ["sleep 3601", "sleep 3602"] {
        assert!(
            seen.iter().any(|l| l.ends_with(cmd)),
            "short did not see {cmd}: {seen:?}"
        );
    }

    // Stopped: its exit is reported (SIGTERM ends a sleep that is not its namespace's init).
    rt.stop_container(cri::StopContainerRequest {
        container_id: second.clone(),
        timeout: 10,
    })
    .await
    .unwrap();
    let st = wait_exited(&mut rt, &second).await;
    assert_eq!(st.exit_code, 128 + libc::SIGTERM, "{st:?}");

    // Created after two exited: one with bind mounts, one plain.
    let mut mounted = container_config("mounted", &["sleep", "3604"]);
    mounted.mounts.push(cri::Mount {
        container_path: "/data".into(),
        host_path: data.path().display().to_string(),
        ..Default::default()
    });
    mounted.mounts.push(cri::Mount {
        container_path: "/ro".into(),
        host_path: data.path().display().to_string(),
        readonly: true,
        ..Default::default()
    });
    let mounted = run_at_a_host_free_pid(&mut rt, &pod, &cfg, &first, mounted).await;
    assert_eq!(exec(&mut rt, &mounted, "cat /data/in").await, "from-host");
    exec(&mut rt, &mounted, "echo from-container > /data/out").await;
    assert_eq!(
        std::fs::read_to_string(data.path().join("out")).unwrap(),
        "from-container\n"
    );
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: mounted.clone(),
            cmd: vec!["sh".into(), "-c".into(), "echo x > /ro/nope".into()],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(out.exit_code, 0, "a read-only mount was written");
    let late = run_at_a_host_free_pid(
        &mut rt,
        &pod,
        &cfg,
        &mounted,
        container_config("late", &["sleep", "3605"]),
    )
    .await;

    // Every running container sees the same namespace and the same processes: the sleeps of
    // those still running and nothing else (no process left over from any create).
    let want = ["sleep 3601", "sleep 3604", "sleep 3605"];
    let ns = exec(&mut rt, &first, "readlink /proc/self/ns/pid").await;
    for id in [&first, &mounted, &late] {
        assert_eq!(exec(&mut rt, id, "readlink /proc/self/ns/pid").await, ns);
        assert_eq!(pod_commands(&mut rt, id).await, want, "seen from {id}");
        let pids = proc_pids(&mut rt, id).await;
        for other in [&first, &mounted, &late] {
            let p = pod_pid(container_pid(&mut rt, other).await);
            assert!(
                pids.contains(&p),
                "{id} does not list {other}'s pid {p}: {pids:?}"
            );
        }
    }
    // A process started in one container is visible (and signalable) from another.
    exec(&mut rt, &late, "sleep 3606 >/dev/null 2>&1 &").await;
    support::wait_for(
        "the background sleep to show in another container",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "3606"]) == 1,
    )
    .await;
    assert!(pod_commands(&mut rt, &first)
        .await
        .contains(&"sleep 3606".to_string()));
    let sleep = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline")).is_ok_and(|c| c == b"sleep\x003606\x00")
        })
        .find_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .expect("the background sleep's host pid");
    exec(&mut rt, &first, &format!("kill {}", pod_pid(sleep))).await;
    support::wait_for(
        "the background sleep to be killed from another container",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "3606"]) == 0,
    )
    .await;

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Fake CDI devices: character nodes with /dev/null's numbers, a directory to mount, and hooks
/// that append the state they get to marker files.
struct Cdi {
    dir: tempfile::TempDir,
}

impl Cdi {
    fn new() -> Option<Cdi> {
        if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        for d in ["etc", "dev", "data", "hooks"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        nix::sys::stat::mknod(
            &dir.path().join("dev/fake-null"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 3),
        )
        .unwrap();
        std::fs::write(dir.path().join("data/vendor.txt"), "vendor-library\n").unwrap();
        let path = |p: &str| dir.path().join(p).display().to_string();
        let hook = |stage: &str| {
            let marker = path(&format!("hooks/{stage}"));
            let script = format!("cat >> {marker}; echo >> {marker}");
            serde_json::json!({"hookName": stage, "path": "/bin/sh", "args": ["sh", "-c", script]})
        };
        let spec = serde_json::json!({
            "cdiVersion": "0.6.0",
            "kind": "hako.test/shared",
            "devices": [{
                "name": "dev",
                "containerEdits": {
                    "env": ["FAKE_DEVICE=yes"],
                    "deviceNodes": [{"path": "/dev/fake-null", "hostPath": path("dev/fake-null")}],
                    "mounts": [{"hostPath": path("data"), "containerPath": "/opt/fake", "options": ["ro", "bind"]}],
                    "hooks": [hook("createRuntime"), hook("createContainer"), hook("poststart")]
                }
            }]
        });
        std::fs::write(dir.path().join("etc/shared.json"), spec.to_string()).unwrap();
        Some(Cdi { dir })
    }

    fn config(&self) -> String {
        format!(
            "[cdi]\nspec_dirs = [\"{}\"]\n",
            self.dir.path().join("etc").display()
        )
    }

    /// The states the hooks of `stage` were given, one a line.
    fn hook_states(&self, stage: &str) -> String {
        std::fs::read_to_string(self.dir.path().join("hooks").join(stage)).unwrap_or_default()
    }
}

fn with_device(mut cc: cri::ContainerConfig) -> cri::ContainerConfig {
    cc.cdi_devices = vec![cri::CdiDevice {
        name: "hako.test/shared=dev".into(),
    }];
    cc
}

#[tokio::test(flavor = "multi_thread")]
async fn containers_with_cdi_devices_share_the_pods_processes() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let Some((_reg, h)) = ready_with_config(&cdi.config()).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("shared-cdi", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;

    let first = run_container(
        &mut rt,
        &pod,
        &cfg,
        with_device(container_config("dev0", &["sleep", "3700"])),
    )
    .await;
    let mut running = vec![first.clone()];
    for i in 1..=3 {
        let cc = with_device(container_config(
            &format!("dev{i}"),
            &["sleep", &format!("370{i}")],
        ));
        running.push(run_at_a_host_free_pid(&mut rt, &pod, &cfg, &first, cc).await);
    }
    // One that uses its device and mount, then exits with its own code.
    let short = run_at_a_host_free_pid(
        &mut rt,
        &pod,
        &cfg,
        &first,
        with_device(container_config(
            "dev-short",
            &[
                "sh",
                "-c",
                "test -c /dev/fake-null && echo gone > /dev/fake-null && cat /opt/fake/vendor.txt; exit 4",
            ],
        )),
    )
    .await;
    let st = wait_exited(&mut rt, &short).await;
    assert_eq!(st.exit_code, 4, "{st:?}");
    assert_eq!(
        log_lines(&logs.path().join("dev-short.log")),
        ["stdout F vendor-library"]
    );
    // And one more after it exited, and a plain one beside them.
    running.push(
        run_at_a_host_free_pid(
            &mut rt,
            &pod,
            &cfg,
            &first,
            with_device(container_config("dev-late", &["sleep", "3709"])),
        )
        .await,
    );
    running.push(
        run_at_a_host_free_pid(
            &mut rt,
            &pod,
            &cfg,
            &first,
            container_config("plain", &["sleep", "3710"]),
        )
        .await,
    );

    let want = [
        "sleep 3700",
        "sleep 3701",
        "sleep 3702",
        "sleep 3703",
        "sleep 3709",
        "sleep 3710",
    ];
    for (n, id) in running.iter().enumerate() {
        assert_eq!(pod_commands(&mut rt, id).await, want, "seen from {id}");
        if n + 1 < running.len() {
            assert_eq!(
                exec(
                    &mut rt,
                    id,
                    "echo $FAKE_DEVICE; stat -c '%t:%T' /dev/fake-null; cat /opt/fake/vendor.txt"
                )
                .await,
                "yes\n1:3\nvendor-library"
            );
        }
    }
    // Every device container's hooks ran, each stage once per container.
    let with_devices: Vec<&String> = running[..running.len() - 1]
        .iter()
        .chain(std::iter::once(&short))
        .collect();
    for stage in ["createRuntime", "createContainer", "poststart"] {
        let states = cdi.hook_states(stage);
        for id in &with_devices {
            assert_eq!(
                states.lines().filter(|l| l.contains(id.as_str())).count(),
                1,
                "{stage} hook states: {states}"
            );
        }
        assert!(!states.contains(running.last().unwrap().as_str()));
    }

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The pod's infra process, PID 1 of its PID namespace, is killed: the kernel ends every
/// process of the namespace and nothing can start in it again, so PodSandboxStatus reports
/// the pod NotReady (kubelet then recreates it). Its monitor still answers; stop and remove
/// leave nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_whose_infra_process_died_is_not_ready() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("infra-dies", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let sleeper = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("sleeper", &["sleep", "3600"]),
    )
    .await;
    let pod_state = |rt: &mut Rt| {
        let mut rt = rt.clone();
        let pod = pod.clone();
        async move {
            rt.pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: pod,
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner()
            .status
            .unwrap()
            .state
        }
    };
    assert_eq!(
        pod_state(&mut rt).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    let init = pod_init(container_pid(&mut rt, &sleeper).await);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while pod_state(&mut rt).await != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(
            std::time::Instant::now() < deadline,
            "the pod is still reported ready 30 s after its infra process died"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The kernel ended the namespace's other processes with it.
    assert_eq!(
        wait_exited(&mut rt, &sleeper).await.state,
        cri::ContainerState::ContainerExited as i32
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The host pid of PID 1 of the PID namespace host process `member` is in.
fn pod_init(member: i32) -> i32 {
    let ns = std::fs::read_link(format!("/proc/{member}/ns/pid")).unwrap();
    let inits: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/ns/pid")).is_ok_and(|n| n == ns)
                && Path::new(&format!("/proc/{p}/status")).exists()
                && pod_pid(*p) == 1
        })
        .collect();
    assert_eq!(inits.len(), 1, "PID 1 of the pod: {inits:?}");
    inits[0]
}

/// The pod's monitor is killed: the pod's init (PID 1 of its PID namespace) dies with it, by
/// the kernel's hand, so no one has to search the host's processes for it; the pod is
/// reported NotReady at the next relist and goes without leaks.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_init_dies_with_its_monitor() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("monitor-dies", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let sleeper = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("sleeper", &["sleep", "3600"]),
    )
    .await;
    let init = pod_init(container_pid(&mut rt, &sleeper).await);
    kill_monitor(&mut rt, &pod).await;
    support::wait_for(
        "the pod's init to die with its monitor",
        Duration::from_secs(30),
        || support::process_dead(init),
    )
    .await;
    rt.list_containers(cri::ListContainersRequest::default())
        .await
        .unwrap();
    wait_not_ready(&mut rt, &pod).await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Host processes of hako's binary that are PID 1 of a namespace of their own: pods' PID 1s.
fn pod_pid_1s() -> Vec<i32> {
    let exe = support::hako::Hako::binary();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                s.lines().any(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() == 3 && f[0] == "NSpid:" && f[2] == "1"
                })
            })
        })
        .collect()
}

/// A monitor killed while its pod's infra process is still making the pod's namespaces,
/// before the pod's PID 1 exists: the start fails and no PID 1 is left. The infra process took
/// the monitor from getppid(), the host's init by then, and tied the PID 1 it made to init,
/// which never exits (seen after churn's monitor kills, an hour later).
#[tokio::test(flavor = "multi_thread")]
async fn a_monitor_killed_while_its_pod_starts_leaves_no_pod_pid_1() {
    if !support::e2e_ready(&[]) {
        return;
    }
    let h = support::hako::Hako::start_with_env("", &[("HAKO_TEST_INFRA_STALL_MS", "3000")]);
    let logs = tempfile::tempdir().unwrap();
    let cfg = shared_pid_pod("stalled", logs.path());
    let before = pod_pid_1s();
    let mut rt = h.runtime().await;
    let start = tokio::spawn(async move {
        rt.run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg),
            runtime_handler: String::new(),
        })
        .await
    });
    // Its monitor: the one whose options name the pod's hostname.
    let monitor = std::sync::Arc::new(std::sync::Mutex::new(None));
    let found = monitor.clone();
    support::wait_for("the pod's monitor", Duration::from_secs(10), move || {
        let m = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd);
            (cmd.contains("monitor") && cmd.contains("stalled-host")).then_some(pid)
        });
        *found.lock().unwrap() = m;
        m.is_some()
    })
    .await;
    let monitor = monitor.lock().unwrap().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let r = start.await.unwrap();
    assert!(r.is_err(), "{r:?}");
    // Past the stall, when the infra process would have gone on to make the PID 1.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let left: Vec<i32> = pod_pid_1s()
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    for p in &left {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*p),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert!(left.is_empty(), "pods' PID 1s left: {left:?}");
}

/// The pod's PID 1 (hako's infra process, where containerd and CRI-O have a pause container)
/// is every container's /proc/1. A container reads its mount table without any privilege, and
/// one granted CAP_SYS_PTRACE reaches its root, cwd and memory: it must hold nothing of the
/// host. Forked from the monitor unconfined, it was root with every capability in the host's
/// mount namespace, so the container read the node's mount table and its root filesystem.
#[tokio::test(flavor = "multi_thread")]
async fn the_pods_pid_1_gives_a_container_nothing_of_the_host() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("pid1-confined", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut tracer = container_config("tracer", &["sleep", "3600"]);
    tracer.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            capabilities: Some(cri::Capability {
                add_capabilities: vec!["SYS_PTRACE".into()],
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let tracer = run_container(&mut rt, &pod, &cfg, tracer).await;

    let status = exec(
        &mut rt,
        &tracer,
        "grep -E '^(Uid|Gid|CapPrm|CapEff|CapBnd|NoNewPrivs):' /proc/1/status",
    )
    .await;
    let field = |name: &str| -> Vec<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    assert_eq!(field("Uid"), ["65535"; 4], "{status}");
    assert_eq!(field("Gid"), ["65535"; 4], "{status}");
    for caps in ["CapPrm", "CapEff", "CapBnd"] {
        assert_eq!(field(caps), ["0000000000000000"], "{status}");
    }
    assert_eq!(field("NoNewPrivs"), ["1"], "{status}");

    // Its mount table: one empty tmpfs, nothing of the node's.
    let mounts = exec(&mut rt, &tracer, "cat /proc/1/mountinfo").await;
    let lines: Vec<&str> = mounts.lines().collect();
    assert_eq!(lines.len(), 1, "{mounts}");
    let fields: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(fields[4], "/", "{mounts}");
    assert!(lines[0].contains(" - tmpfs "), "{mounts}");
    assert!(!mounts.contains(&h.state.display().to_string()), "{mounts}");

    // Nothing of hako's options (the pod's directory under its state) or the daemon's
    // environment: PID 1 is a fork of the monitor that never execs.
    let cmdline = exec(&mut rt, &tracer, "tr '\\0' ' ' < /proc/1/cmdline").await;
    assert!(
        !cmdline.contains(&h.state.display().to_string()),
        "{cmdline}"
    );
    assert!(!cmdline.contains("--options"), "{cmdline}");
    let environ = exec(&mut rt, &tracer, "tr '\\0' '\\n' < /proc/1/environ; true").await;
    assert!(!environ.contains('='), "{environ}");
    // Not dumpable and no longer root: even CAP_SYS_PTRACE finds an empty root, if any.
    let root = exec(
        &mut rt,
        &tracer,
        "ls -A /proc/1/root/ 2>&1; readlink /proc/1/cwd 2>&1; true",
    )
    .await;
    assert!(
        !root.contains("etc") && !root.contains("usr"),
        "the host's root through /proc/1/root: {root}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Processes of the pod's PID namespace (host pids) in state `Z`.
fn zombies_in_pid_ns_of(member: i32) -> Vec<i32> {
    let ns = std::fs::read_link(format!("/proc/{member}/ns/pid")).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/ns/pid")).is_ok_and(|n| n == ns)
                && std::fs::read_to_string(format!("/proc/{p}/status"))
                    .is_ok_and(|s| s.lines().any(|l| l.starts_with("State:\tZ")))
        })
        .collect()
}

/// What a container of the pod orphans is reparented to the pod's PID 1, which reaps it when
/// it ends: no zombie stays behind. (The kernel drops a SIGCHLD at its default disposition for
/// a namespace's init, and PID 1 used to wait for it in `pause` forever.)
#[tokio::test(flavor = "multi_thread")]
async fn the_pods_pid_1_reaps_what_the_pod_orphans() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = shared_pid_pod("reaper", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let c = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("parent", &["sleep", "3600"]),
    )
    .await;
    // Each subshell exits at once; its sleep, orphaned, ends a moment later.
    exec(
        &mut rt,
        &c,
        "for i in 1 2 3 4 5; do (sleep 0.2 &); done; echo started",
    )
    .await;
    let member = container_pid(&mut rt, &c).await;
    support::wait_for(
        "the orphaned sleeps to end",
        Duration::from_secs(10),
        || processes_with_cmdline(&["sleep", "0.2"]) == 0,
    )
    .await;
    support::wait_for(
        "the pod's PID 1 to reap the orphans",
        Duration::from_secs(5),
        || zombies_in_pid_ns_of(member).is_empty(),
    )
    .await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
