//! Pods and containers end to end: a real hako runs busybox containers through its pod
//! monitors and libcontainer; CRI over gRPC, crictl for the operator's view.

mod support;

use std::time::Duration;

use hako_proto::cri;
use support::cri::*;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher};

#[tokio::test(flavor = "multi_thread")]
async fn pod_and_container_lifecycle() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("web", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    // A retry of the same pod returns the same sandbox.
    let again = run_pod(&mut rt, &cfg).await;
    assert_eq!(again, pod);
    let st = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(st.state, cri::PodSandboxState::SandboxReady as i32);
    assert_eq!(st.metadata.unwrap().name, "web");

    // A container that prints, sees its hostname, and exits.
    let cc = container_config(
        "hello",
        &["sh", "-c", "echo hello; echo err >&2; hostname; id -u"],
    );
    let cid = create_container(&mut rt, &pod, &cfg, cc).await;
    let st = status(&mut rt, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerCreated as i32);
    rt.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();
    let st = wait_exited(&mut rt, &cid).await;
    assert_eq!((st.exit_code, st.reason.as_str()), (0, "Completed"));
    assert!(st.started_at > 0 && st.finished_at >= st.started_at);
    let log = std::fs::read_to_string(logs.path().join("hello.log")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert!(
        lines.iter().any(|l| l.ends_with(" stdout F hello")),
        "{log}"
    );
    assert!(lines.iter().any(|l| l.ends_with(" stderr F err")), "{log}");
    assert!(
        lines.iter().any(|l| l.ends_with(" stdout F web-host")),
        "{log}"
    );
    assert!(lines.iter().any(|l| l.ends_with(" stdout F 0")), "{log}");

    // A long-running one: exec into it, then stop it.
    let cc = container_config(
        "sleeper",
        &[
            "sh",
            "-c",
            "trap 'exit 3' TERM; while true; do sleep 0.1; done",
        ],
    );
    let sid = run_container(&mut rt, &pod, &cfg, cc).await;
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: sid.clone(),
            cmd: vec![
                "sh".into(),
                "-c".into(),
                "echo in; echo out >&2; exit 7".into(),
            ],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (out.stdout.as_slice(), out.stderr.as_slice(), out.exit_code),
        (&b"in\n"[..], &b"out\n"[..], 7)
    );
    let err = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: sid.clone(),
            cmd: vec!["sleep".into(), "37".into()],
            timeout: 1,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded, "{err:?}");
    // The timeout kills what it ran (a probe that hangs must not pile up processes).
    support::wait_for(
        "the timed-out exec's process to be killed",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "37"]) == 0,
    )
    .await;
    let listed = all_containers(&mut rt).await;
    assert_eq!(listed.len(), 2);
    let running = listed.iter().find(|c| c.id == sid).unwrap();
    assert_eq!(running.state, cri::ContainerState::ContainerRunning as i32);
    assert_traces_present(&h, &mut rt, &pod, &sid).await;
    // The pod's IPC and UTS namespaces are its own, held open by its monitor, which stays in
    // the runtime's (the host's) itself: no bind mount pins them. Only the network namespace
    // (and a shared PID one) is pinned: CNI DEL needs its path whatever becomes of the monitor.
    let ns = |pid: i32, kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    let ctr = container_pid(&mut rt, &sid).await;
    let monitor = monitor_pid(&mut rt, &pod).await.as_raw();
    let held: Vec<std::path::PathBuf> = std::fs::read_dir(format!("/proc/{monitor}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.unwrap().path()).ok())
        .collect();
    let host = std::process::id() as i32;
    for kind in ["ipc", "uts"] {
        assert!(held.contains(&ns(ctr, kind)), "{kind}: {held:?}");
        assert_ne!(ns(ctr, kind), ns(host, kind), "{kind} is the host's");
        assert_eq!(
            ns(monitor, kind),
            ns(host, kind),
            "the monitor left the host's {kind}"
        );
    }
    let pins: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(" nsfs ") && l.contains(&pod))
        .map(str::to_string)
        .collect();
    // This pod shares a PID namespace too: it is pinned beside the network one.
    let mut pinned: Vec<&str> = pins
        .iter()
        .filter_map(|l| l.split_whitespace().nth(4)?.rsplit('/').next())
        .collect();
    pinned.sort();
    assert_eq!(pinned, ["net", "pid"], "{pins:?}");
    rt.stop_container(cri::StopContainerRequest {
        container_id: sid.clone(),
        timeout: 10,
    })
    .await
    .unwrap();
    let st = wait_exited(&mut rt, &sid).await;
    assert_eq!(
        (st.exit_code, st.reason.as_str()),
        (3, "Error"),
        "SIGTERM handled by the trap"
    );

    // Removal and the pod's end.
    rt.remove_container(cri::RemoveContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();
    rt.remove_container(cri::RemoveContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();
    let err = rt
        .container_status(cri::ContainerStatusRequest {
            container_id: cid.clone(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    })
    .await
    .unwrap();
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    })
    .await
    .unwrap();
    let st = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(st.state, cri::PodSandboxState::SandboxNotready as i32);
    remove_pod(&mut rt, &pod).await;
    remove_pod(&mut rt, &pod).await;
    assert!(rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items
        .is_empty());
    assert!(all_containers(&mut rt).await.is_empty());
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn oom_score_adj_is_clamped_to_the_daemons_own() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("oom", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let own: i32 = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", h.pid()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let with_adj = |name: &str, adj: i64| {
        let mut cc = container_config(name, &["sleep", "300"]);
        // Its own PID namespace, so /proc/1 is the container's init.
        cc.linux = Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                oom_score_adj: adj,
                ..Default::default()
            }),
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    pid: cri::NamespaceMode::Container as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        });
        cc
    };
    let low = run_container(&mut rt, &pod, &cfg, with_adj("low", -998)).await;
    let high = run_container(&mut rt, &pod, &cfg, with_adj("high", 500)).await;
    let has_sys_resource = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| {
            l.starts_with("CapBnd:")
                && u64::from_str_radix(l[7..].trim(), 16).unwrap() & (1 << 24) != 0
        });
    let low_seen: i32 = exec(&mut rt, &low, "cat /proc/1/oom_score_adj")
        .await
        .parse()
        .unwrap();
    if has_sys_resource {
        assert_eq!(low_seen, -998);
    } else {
        assert_eq!(low_seen, own, "clamped to the daemon's own score");
    }
    assert_eq!(
        exec(&mut rt, &high, "cat /proc/1/oom_score_adj").await,
        "500"
    );
    // The monitor keeps its own score: a later container may go back down to the floor.
    let low2 = run_container(&mut rt, &pod, &cfg, with_adj("low2", -998)).await;
    assert_eq!(
        exec(&mut rt, &low2, "cat /proc/1/oom_score_adj").await,
        low_seen.to_string()
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_outlive_a_killed_daemon_and_exits_are_reported_after_restart() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("survivor", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let ticker = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config(
            "ticker",
            &[
                "sh",
                "-c",
                "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.1; done",
            ],
        ),
    )
    .await;
    let short = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("short", &["sh", "-c", "sleep 1; exit 5"]),
    )
    .await;
    h.kill9();
    let log = logs.path().join("ticker.log");
    let before = std::fs::read_to_string(&log).unwrap().lines().count();
    support::wait_for(
        "log lines written while the daemon is down",
        Duration::from_secs(30),
        || std::fs::read_to_string(&log).unwrap().lines().count() > before + 3,
    )
    .await;
    // The short container exits while the daemon is down: its monitor records the exit.
    let recorded = h
        .state
        .join("pods")
        .join(&pod)
        .join("containers")
        .join(&short)
        .join("exit.json");
    support::wait_for(
        "the monitor to record the short container's exit while the daemon is down",
        Duration::from_secs(30),
        || recorded.exists(),
    )
    .await;
    h.restart();
    let mut rt = h.runtime().await;
    let st = status(&mut rt, &short).await;
    assert_eq!(
        st.state,
        cri::ContainerState::ContainerExited as i32,
        "the exit while the daemon was down is known"
    );
    assert_eq!(st.exit_code, 5);
    let st = status(&mut rt, &ticker).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    assert_eq!(exec(&mut rt, &ticker, "echo alive").await, "alive");
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert_eq!(pods.len(), 1);
    assert_eq!(pods[0].state, cri::PodSandboxState::SandboxReady as i32);
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_report_real_cpu_memory_and_writable_layer_usage() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("stats", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    // Busy on CPU, 8 MiB written to its own layer.
    let cmd = [
        "sh",
        "-c",
        "dd if=/dev/zero of=/blob bs=1M count=8 2>/dev/null; while true; do :; done",
    ];
    let id = run_container(&mut rt, &pod, &cfg, container_config("busy", &cmd)).await;
    let cpu = |s: &cri::ContainerStats| {
        s.cpu
            .as_ref()
            .unwrap()
            .usage_core_nano_seconds
            .as_ref()
            .unwrap()
            .value
    };
    let layer_bytes = |s: &cri::ContainerStats| {
        s.writable_layer
            .as_ref()
            .unwrap()
            .used_bytes
            .as_ref()
            .unwrap()
            .value
    };
    // Wait for the 8 MiB to be written and the counters to have started.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let s1 = loop {
        let s = container_stats(&mut rt, &id).await;
        if cpu(&s) > 0 && layer_bytes(&s) >= 8 << 20 {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stats never showed CPU use and the 8 MiB layer: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The busy loop's counter moves between two readings; the rate follows from them.
    let s2 = loop {
        let s = container_stats(&mut rt, &id).await;
        if cpu(&s) > cpu(&s1) {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the CPU counter of a busy loop did not move: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let cores = s2
        .cpu
        .as_ref()
        .unwrap()
        .usage_nano_cores
        .as_ref()
        .unwrap()
        .value;
    assert!(cores > 0, "a rate from two readings: {cores} nanocores");
    assert!(
        s2.memory
            .as_ref()
            .unwrap()
            .usage_bytes
            .as_ref()
            .unwrap()
            .value
            > 0
    );
    assert_eq!(
        s2.attributes
            .as_ref()
            .unwrap()
            .metadata
            .as_ref()
            .unwrap()
            .name,
        "busy"
    );
    let pods = rt
        .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .stats;
    let ps = pods
        .iter()
        .find(|p| p.attributes.as_ref().unwrap().id == pod)
        .unwrap();
    let linux = ps.linux.as_ref().unwrap();
    assert_eq!(linux.containers.len(), 1);
    // Pressure (KubeletPSI): read from the cgroup's pressure files on cgroup v2, for the
    // container and the pod; cgroup v1 has none, and none are made up.
    let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let pressures = |cpu: &Option<cri::CpuUsage>,
                     memory: &Option<cri::MemoryUsage>,
                     io: &Option<cri::IoUsage>| {
        [
            cpu.as_ref().unwrap().psi.is_some(),
            memory.as_ref().unwrap().psi.is_some(),
            io.as_ref().is_some_and(|io| io.psi.is_some()),
        ]
    };
    assert_eq!(
        pressures(&s2.cpu, &s2.memory, &s2.io),
        [v2; 3],
        "container pressure on cgroup v2 = {v2}: {s2:?}"
    );
    assert_eq!(
        pressures(&linux.cpu, &linux.memory, &linux.io),
        [v2; 3],
        "pod pressure on cgroup v2 = {v2}"
    );
    if v2 {
        let some = s2.cpu.as_ref().unwrap().psi.unwrap().some.unwrap();
        assert!(some.avg10 >= 0.0 && some.avg300 <= 100.0, "{some:?}");
    }
    assert!(
        linux
            .cpu
            .as_ref()
            .unwrap()
            .usage_core_nano_seconds
            .as_ref()
            .unwrap()
            .value
            >= cpu(&s1),
        "the pod cgroup holds the container"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_monitor_is_detected_and_its_pod_reported() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("doomed", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let done = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("done", &["sh", "-c", "exit 4"]),
    )
    .await;
    let running = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("running", &["sleep", "301"]),
    )
    .await;
    wait_exited(&mut rt, &done).await;
    let monitor = monitor_pid(&mut rt, &pod).await;
    kill_monitor(&mut rt, &pod).await;
    support::wait_for(
        "the monitor to die",
        std::time::Duration::from_secs(10),
        || !std::path::Path::new(&format!("/proc/{monitor}")).exists(),
    )
    .await;
    // A probe's ExecSync notices, with a final answer (not UNAVAILABLE on every retry).
    let err = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: running.clone(),
            cmd: vec!["true".into()],
            timeout: 5,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("monitor is gone"), "{err:?}");
    // The relist reports what the monitor recorded.
    let listed = all_containers(&mut rt).await;
    let state = |id: &str| listed.iter().find(|c| c.id == id).unwrap().state;
    assert_eq!(
        state(&done),
        cri::ContainerState::ContainerExited as i32,
        "its recorded exit is kept"
    );
    assert_eq!(
        state(&running),
        cri::ContainerState::ContainerUnknown as i32
    );
    let st = status(&mut rt, &done).await;
    assert_eq!(st.exit_code, 4);
    let p = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(p.state, cri::PodSandboxState::SandboxNotready as i32);
    assert!(h.log_text().contains("pod monitor is gone"), "logged");
    // The orphaned container process was ended; the pod can still be removed cleanly.
    // The orphaned container process is ended.
    support::wait_for(
        "the unwatched container process to be killed",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "301"]) == 0,
    )
    .await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deep_state_dir_does_not_overflow_socket_paths() {
    // <state>/pods/<64 hex>/monitor.sock exceeds sun_path's 108 bytes here.
    let deep = "state/a-rather-long-directory-name-for-the-state/and-another-level";
    let Some((_reg, h)) = ready_with_state(deep).await else {
        return;
    };
    assert!(
        h.dir
            .path()
            .join(deep)
            .join("pods")
            .join("x".repeat(64))
            .join("monitor.sock")
            .as_os_str()
            .len()
            > 108
    );
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("deep", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(&mut rt, &pod, &cfg, container_config("c", &["sleep", "60"])).await;
    assert_eq!(exec(&mut rt, &id, "echo ok").await, "ok");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn tty_devices_pid_target_and_live_resource_updates() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    // What kubelet sends for a pod without shareProcessNamespace.
    let cfg = with_namespaces(
        pod_config("features", logs.path()),
        cri::NamespaceOption {
            pid: cri::NamespaceMode::Container as i32,
            ..Default::default()
        },
    );
    let pod = run_pod(&mut rt, &cfg).await;

    // A TTY container: its output arrives through a pty, all of it as stdout.
    let mut tty = container_config("tty", &["sh", "-c", "tty; echo to-stderr >&2; sleep 61"]);
    tty.tty = true;
    let tty_id = run_container(&mut rt, &pod, &cfg, tty).await;
    let log = logs.path().join("tty.log");
    support::wait_for("two lines in the tty log", Duration::from_secs(30), || {
        log_lines(&log).len() >= 2
    })
    .await;
    let lines = log_lines(&log);
    assert!(lines[0].starts_with("stdout F /dev/pts/"), "{lines:?}");
    assert_eq!(lines[1], "stdout F to-stderr", "{lines:?}");
    // sh prints before it execs the sleep: wait for PID 1 to become it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let init = exec(&mut rt, &tty_id, "cat /proc/1/cmdline | tr '\\0' ' '").await;
        if init == "sleep 61" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline && init.starts_with("sh -c"),
            "a container PID namespace of its own, its init the sleep: {init:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // TARGET: a container in the PID namespace of the tty container sees its sleep.
    // By a prefix of its id, as crictl users name containers.
    let debug = in_pid_namespace_of(container_config("debug", &["sleep", "60"]), &tty_id[..12]);
    let debug_id = run_container(&mut rt, &pod, &cfg, debug).await;
    let procs = visible_processes(&mut rt, &debug_id).await;
    assert!(
        procs.contains("sleep 61"),
        "target's processes visible: {procs}"
    );

    // A device under another name, usable; a device node it was not given is refused by
    // the device cgroup even though CAP_MKNOD lets it create the node.
    let mut dev = container_config("dev", &["sleep", "60"]);
    dev.devices = vec![cri::Device {
        container_path: "/dev/hako-null".into(),
        host_path: "/dev/null".into(),
        permissions: "rw".into(),
    }];
    // kubelet sends a limit for every page size the node has, with or without a hugetlb
    // controller (this machine's cgroup v1 has none; the cgroup v2 VM has one).
    dev.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            hugepage_limits: vec![cri::HugepageLimit {
                page_size: "2MB".into(),
                limit: 4 << 20,
            }],
            ..Default::default()
        }),
        ..Default::default()
    });
    let dev_id = run_container(&mut rt, &pod, &cfg, dev).await;
    let cgroup = std::fs::read_to_string(format!(
        "/proc/{}/cgroup",
        container_pid(&mut rt, &dev_id).await
    ))
    .unwrap();
    let mut hugetlb_checked = false;
    for line in cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (ctrl, path) = (f.nth(1).unwrap_or(""), f.next().unwrap_or(""));
        let file = match ctrl {
            "hugetlb" => format!("/sys/fs/cgroup/hugetlb{path}/hugetlb.2MB.limit_in_bytes"),
            "" if std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "hugetlb")) =>
            {
                format!("/sys/fs/cgroup{path}/hugetlb.2MB.max")
            }
            _ => continue,
        };
        match std::fs::read_to_string(&file) {
            Ok(v) => {
                assert_eq!(v.trim(), (4u64 << 20).to_string(), "{file}");
                hugetlb_checked = true;
            }
            Err(e) => panic!("the container's hugetlb cgroup has no {file}: {e}"),
        }
    }
    if !hugetlb_checked {
        support::record_skip(
            "hugepage limit in the cgroup",
            "this kernel has no hugetlb controller (the create with the limit still ran)",
        );
    }
    assert_eq!(
        exec(
            &mut rt,
            &dev_id,
            "echo x > /dev/hako-null && stat -c '%t:%T' /dev/hako-null"
        )
        .await,
        "1:3"
    );
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: dev_id.clone(),
            cmd: vec![
                "sh".into(),
                "-c".into(),
                "mknod /tmp/kmsg c 1 11 && head -c1 /tmp/kmsg".into(),
            ],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(out.exit_code, 0);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A device that is not there: NOT_FOUND naming it, nothing left behind.
    let mut missing = container_config("missing-dev", &["sleep", "60"]);
    missing.devices = vec![cri::Device {
        container_path: "/dev/x".into(),
        host_path: "/dev/hako-no-such-device".into(),
        permissions: "rwm".into(),
    }];
    let e = rt
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(missing),
            sandbox_config: Some(cfg.clone()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("/dev/hako-no-such-device"), "{e:?}");

    // UpdateContainerResources reaches the running container's cgroup and its status.
    rt.update_container_resources(cri::UpdateContainerResourcesRequest {
        container_id: dev_id.clone(),
        linux: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 96 << 20,
            cpu_shares: 256,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .unwrap();
    let limit = exec(
        &mut rt,
        &dev_id,
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
    )
    .await;
    assert_eq!(limit, (96u64 << 20).to_string());
    let st = status(&mut rt, &dev_id).await;
    let r = st.resources.unwrap().linux.unwrap();
    assert_eq!((r.memory_limit_in_bytes, r.cpu_shares), (96 << 20, 256));
    let e = rt
        .update_container_resources(cri::UpdateContainerResourcesRequest {
            container_id: "no-such-container".into(),
            linux: Some(cri::LinuxContainerResources::default()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);

    // Status carries the identity the process started with.
    let user = st.user.unwrap().linux.unwrap();
    assert_eq!((user.uid, user.gid), (0, 0));

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn stop_uses_the_pod_specs_or_the_images_stop_signal() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf {
            stop_signal: Some("SIGUSR1".into()),
            ..Default::default()
        },
        false,
    );
    Pusher::new(&reg.addr)
        .push("e2e-test-images/stopper", "1", &img)
        .await;
    let image = "registry.k8s.io/e2e-test-images/stopper:1";
    support::hako::pull(&h, image).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("stopper", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    // Exits 42 on SIGUSR1 only; SIGTERM would leave it to the SIGKILL (137).
    let mut cc = container_config(
        "trap",
        &[
            "sh",
            "-c",
            "trap 'exit 42' USR1; trap '' TERM; echo ready; while true; do sleep 0.1; done",
        ],
    );
    cc.image = Some(cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    });
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    support::wait_for("the trap to be set", Duration::from_secs(30), || {
        !log_lines(&logs.path().join("trap.log")).is_empty()
    })
    .await;
    rt.stop_container(cri::StopContainerRequest {
        container_id: id.clone(),
        timeout: 10,
    })
    .await
    .unwrap();
    let st = status(&mut rt, &id).await;
    assert_eq!(st.exit_code, 42);
    assert_eq!(st.stop_signal, cri::Signal::Sigusr1 as i32, "{st:?}");

    // The pod spec's stop signal (CRI stop_signal, Kubernetes' lifecycle.stopSignal) wins
    // over the image's: SIGINT exits 43, the image's SIGUSR1 would exit 42.
    let mut cc = container_config(
        "int",
        &[
            "sh",
            "-c",
            "trap 'exit 43' INT; trap 'exit 42' USR1; trap '' TERM; echo ready; while true; do sleep 0.1; done",
        ],
    );
    cc.image = Some(cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    });
    cc.stop_signal = cri::Signal::Sigint as i32;
    let int = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(
        status(&mut rt, &int).await.stop_signal,
        cri::Signal::Sigint as i32
    );
    support::wait_for("the INT trap to be set", Duration::from_secs(30), || {
        !log_lines(&logs.path().join("int.log")).is_empty()
    })
    .await;
    rt.stop_container(cri::StopContainerRequest {
        container_id: int.clone(),
        timeout: 10,
    })
    .await
    .unwrap();
    assert_eq!(status(&mut rt, &int).await.exit_code, 43);
    // A container that names no signal, of an image without STOPSIGNAL: SIGTERM.
    let plain = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("plain", &["sleep", "60"]),
    )
    .await;
    assert_eq!(
        status(&mut rt, &plain).await.stop_signal,
        cri::Signal::Sigterm as i32
    );
    // An alias is reported as the pod spec names it (kubelet compares the two).
    let mut cc = container_config("alias", &["sleep", "60"]);
    cc.stop_signal = cri::Signal::Sigcld as i32;
    let alias = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(
        status(&mut rt, &alias).await.stop_signal,
        cri::Signal::Sigcld as i32
    );
    // A stop signal outside the CRI's enum is refused at create, naming it.
    let mut cc = container_config("nosig", &["sleep", "60"]);
    cc.stop_signal = 4242;
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("4242") && e.message().contains("nosig"),
        "{e:?}"
    );

    // A STOPSIGNAL no kernel has is refused at create, naming image and signal, and the
    // refused create leaves no container behind.
    for (n, bad) in ["SIGRTMIN+-40", "99999999999", "SIGRTMAX--5"]
        .iter()
        .enumerate()
    {
        let img = Image::new(
            vec![Layer::new(
                &oci::busybox_base_tar(),
                Compression::Gzip,
                false,
            )],
            &ImageConf {
                stop_signal: Some(bad.to_string()),
                ..Default::default()
            },
            false,
        );
        Pusher::new(&reg.addr)
            .push("e2e-test-images/badstop", &n.to_string(), &img)
            .await;
        let image = format!("registry.k8s.io/e2e-test-images/badstop:{n}");
        support::hako::pull(&h, &image).await.unwrap();
        let mut cc = container_config(&format!("bad{n}"), &["sleep", "60"]);
        cc.image = Some(cri::ImageSpec {
            image: image.clone(),
            ..Default::default()
        });
        let e = rt
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod.clone(),
                config: Some(cc),
                sandbox_config: Some(cfg.clone()),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}: {e:?}");
        assert!(
            e.message().contains(&image) && e.message().contains(bad),
            "{e:?}"
        );
    }
    let listed = all_containers(&mut rt).await;
    assert_eq!(
        listed.len(),
        4,
        "only trap, int, plain and alias: {listed:?}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_that_cannot_start_reports_start_error() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("unstartable", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = create_container(&mut rt, &pod, &cfg, container_config("c", &["sleep", "60"])).await;
    // Its init process, waiting to be started, dies first (as an OOM kill or an operator would
    // make it): the start cannot happen. Which of two answers comes depends on whether the
    // monitor's exit report reaches the daemon before the start does; both are checked. The
    // StartError status is checked for certain by the CDI test of a failing startContainer hook.
    let init = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cgroup"))
                .is_ok_and(|c| c.contains(&format!("hako-{id}")))
        })
        .expect("the created container's init process");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(init),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // kill(2) only queues the signal: until the process has run its exit (a zombie, or reaped
    // and gone) a start can still reach it, and then it starts and is killed, which is another
    // story. A fresh-clone CI saw exactly that.
    support::wait_for("the killed init to die", Duration::from_secs(30), || {
        support::process_dead(init)
    })
    .await;
    let e = rt
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert!(e.message().contains(&id), "{e:?}");
    let st = status(&mut rt, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    if st.reason == "StartError" {
        // The start reached the dead init (or its monitor, which had reaped it): it failed,
        // and the status says so.
        assert_eq!(st.exit_code, 128, "{st:?}");
        assert!(st.message.contains("start container"), "{st:?}");
    } else {
        // The monitor's report of the exit reached the daemon first: the container had exited
        // before the start was asked for, and says how (as containerd does when its exit event
        // wins).
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert_eq!((st.reason.as_str(), st.exit_code), ("Error", 137), "{st:?}");
    }
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The daemon dies and its store is lost (deleted, or truncated to nothing): the running pod
/// and its containers are adopted from their monitor, which kept copies of their records;
/// nothing of them is destroyed. kubelet sees them as before and can stop and remove them.
#[tokio::test(flavor = "multi_thread")]
async fn a_running_pod_survives_the_loss_of_the_store() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    for lose in ["delete", "truncate"] {
        // The image records went with the store: the second round pulls again.
        support::hako::pull(&h, IMAGE).await.unwrap();
        let mut rt = h.runtime().await;
        let cfg = pod_config(&format!("kept-{lose}"), logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        let sleeper = run_container(
            &mut rt,
            &pod,
            &cfg,
            container_config("sleeper", &["sleep", "3600"]),
        )
        .await;
        let done = run_container(
            &mut rt,
            &pod,
            &cfg,
            container_config("done", &["sh", "-c", "exit 7"]),
        )
        .await;
        wait_exited(&mut rt, &done).await;
        let pid = container_pid(&mut rt, &sleeper).await;
        // The copies are kept, and sent only when asked (not with every relist's read).
        let full = monitor_info(&h, &pod, false).await;
        assert!(!full.pod_record.is_empty());
        assert_eq!(full.container_records.len(), 2);
        let read = monitor_info(&h, &pod, true).await;
        assert!(read.pod_record.is_empty() && read.container_records.is_empty());
        assert_eq!(read.containers.len(), 2);
        h.kill9();
        let db = h.root.join("meta.db");
        match lose {
            "delete" => std::fs::remove_file(&db).unwrap(),
            _ => std::fs::File::create(&db).map(drop).unwrap(),
        }
        h.restart();
        let mut rt = h.runtime().await;
        let pods = rt
            .list_pod_sandbox(cri::ListPodSandboxRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items;
        assert_eq!(pods.len(), 1, "{lose}: {pods:?}");
        assert_eq!(pods[0].id, pod);
        assert_eq!(pods[0].state, cri::PodSandboxState::SandboxReady as i32);
        let meta = pods[0].metadata.clone().unwrap();
        assert_eq!(meta.name, cfg.metadata.as_ref().unwrap().name);
        assert_eq!(pods[0].labels, cfg.labels);
        let listed = all_containers(&mut rt).await;
        assert_eq!(listed.len(), 2, "{lose}: {listed:?}");
        let st = status(&mut rt, &sleeper).await;
        assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
        assert_eq!(st.metadata.unwrap().name, "sleeper");
        assert_eq!(
            container_pid(&mut rt, &sleeper).await,
            pid,
            "the same process"
        );
        let st = status(&mut rt, &done).await;
        assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
        assert_eq!(st.exit_code, 7);
        // kubelet pulls the image again (its record went with the store): the layers the
        // running container's overlay has as lowers stay as they are.
        support::hako::pull(&h, IMAGE).await.unwrap();
        assert_eq!(exec(&mut rt, &sleeper, "echo alive").await, "alive");
        assert!(h
            .log_text()
            .contains("adopted a running pod whose record was lost"));
        // A retried RunPodSandbox finds the adopted pod under its name.
        assert_eq!(run_pod(&mut rt, &cfg).await, pod);
        remove_pod(&mut rt, &pod).await;
        assert_no_leaks(&h, &pod);
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    }
}

/// One call to a pod's monitor over its socket, as the daemon makes it; the answer's body.
async fn monitor_call(
    h: &support::hako::Hako,
    pod: &str,
    method: hako_runtime::monitor::wire::Method,
    req: impl prost::Message,
) -> Vec<u8> {
    use hako_runtime::monitor::wire::{self, code};
    let sock = h.state.join("pods").join(pod).join("monitor.sock");
    let (_dir, short) = hako_runtime::monitor::short_socket_path(&sock).unwrap();
    let mut c = tokio::net::UnixStream::connect(short).await.unwrap();
    wire::write_frame(&mut c, method as u8, &req.encode_to_vec())
        .await
        .unwrap();
    let (status, body) = wire::read_frame(&mut c).await.unwrap();
    assert_eq!(status, code::OK, "{}", String::from_utf8_lossy(&body));
    body
}

/// A pod monitor's Info.
async fn monitor_info(
    h: &support::hako::Hako,
    pod: &str,
    skip_records: bool,
) -> hako_proto::monitor::InfoResponse {
    use prost::Message as _;
    let req = hako_proto::monitor::InfoRequest { skip_records };
    let body = monitor_call(h, pod, hako_runtime::monitor::wire::Method::Info, req).await;
    hako_proto::monitor::InfoResponse::decode(body.as_slice()).unwrap()
}

/// Makes a pod's monitor forget the copy of a record it kept (the pod's when `container` is
/// empty), as if the create had not finished: the monitor holds the object, no record exists.
async fn forget_kept_record(h: &support::hako::Hako, pod: &str, container: &str) {
    let req = hako_proto::monitor::KeepRecordRequest {
        container_id: container.into(),
        record: Vec::new(),
    };
    monitor_call(h, pod, hako_runtime::monitor::wire::Method::KeepRecord, req).await;
}

/// A crash between the first step of a RunPodSandbox or CreateContainer and the record that
/// ends it, made by killing the daemon and deleting from its store the records that crash
/// would not have written. The restarted daemon releases all the unfinished objects held, and
/// kubelet's retries under the same names succeed.
#[tokio::test(flavor = "multi_thread")]
async fn what_a_crash_cut_short_is_released_and_its_names_are_free_again() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let sleeper = |name: &str| container_config(name, &["sleep", "3600"]);
    // Pod `keeps` stays; its container `half` loses its record.
    let keeps_cfg = pod_config("keeps", logs.path());
    let keeps = run_pod(&mut rt, &keeps_cfg).await;
    let half = run_container(&mut rt, &keeps, &keeps_cfg, sleeper("half")).await;
    let half_pid = container_pid(&mut rt, &half).await;
    // Pod `lost` loses its record, and so does its container.
    let lost_cfg = pod_config("lost", logs.path());
    let lost = run_pod(&mut rt, &lost_cfg).await;
    let inner = run_container(&mut rt, &lost, &lost_cfg, sleeper("inner")).await;
    let inner_pid = container_pid(&mut rt, &inner).await;
    h.kill9();
    // Neither the store nor the monitors keep a record of what the crash cut short.
    for (pod, container) in [
        (&keeps, half.as_str()),
        (&lost, ""),
        (&lost, inner.as_str()),
    ] {
        forget_kept_record(&h, pod, container).await;
    }
    {
        use hako::store::{Store, Table};
        let store = Store::open(&h.root.join("meta.db")).unwrap();
        for (t, id) in [
            (Table::Containers, &half),
            (Table::Containers, &inner),
            (Table::Pods, &lost),
        ] {
            store.delete(t, id).unwrap();
        }
    }
    h.restart();
    let mut rt = h.runtime().await;
    for pid in [half_pid, inner_pid] {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} of an unfinished container still runs"
        );
    }
    let again = run_container(&mut rt, &keeps, &keeps_cfg, sleeper("half")).await;
    assert_ne!(again, half, "a new container under the freed name");
    assert_eq!(exec(&mut rt, &again, "echo up").await, "up");
    // Nothing of the lost pod is left, and its name is free.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for id in [&lost, &inner, &half] {
        assert!(!mounts.contains(id.as_str()), "a mount of {id} is left");
    }
    assert!(!h.dir.path().join("state/pods").join(&lost).exists());
    for id in [&inner, &half] {
        assert!(!h.dir.path().join("state/containers").join(id).exists());
        assert!(!h.dir.path().join("root/containers").join(id).exists());
    }
    let lost_again = run_pod(&mut rt, &lost_cfg).await;
    assert_ne!(lost_again, lost);
    remove_pod(&mut rt, &keeps).await;
    remove_pod(&mut rt, &lost_again).await;
    assert_no_leaks(&h, &keeps);
    assert_no_leaks(&h, &lost_again);
}

/// A stop that ends in SIGKILL (timeout 0, as kubelet's force delete) ends every process of
/// the container, not only its init, whether the container has a PID namespace of its own,
/// shares the pod's, or runs in the node's; and so does a RemovePodSandbox of its running pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_kill_ends_every_process_of_the_container_whatever_its_pid_namespace() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let modes = [
        ("own", cri::NamespaceMode::Container),
        ("pod", cri::NamespaceMode::Pod),
        ("node", cri::NamespaceMode::Node),
    ];
    for (n, (name, mode)) in modes.into_iter().enumerate() {
        let mut cfg = pod_config(&format!("kill-{name}"), logs.path());
        let ns = cri::NamespaceOption {
            pid: mode as i32,
            ..Default::default()
        };
        cfg.linux = Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(ns.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        let pod = run_pod(&mut rt, &cfg).await;
        // Two background processes beside an init that ignores SIGTERM; one per stop path.
        let (stopped, removed) = (format!("{}", 7710 + n), format!("{}", 7720 + n));
        let mut ids = Vec::new();
        for (c, marker) in [("stopped", &stopped), ("removed", &removed)] {
            let script = format!("trap '' TERM; sleep {marker} & sleep {marker} & wait");
            let mut cc = container_config(c, &["sh", "-c", &script]);
            cc.linux = Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(ns.clone()),
                    ..Default::default()
                }),
                ..Default::default()
            });
            ids.push(run_container(&mut rt, &pod, &cfg, cc).await);
            support::wait_for(
                "the container's background processes",
                Duration::from_secs(30),
                || processes_with_cmdline(&["sleep", marker]) == 2,
            )
            .await;
        }
        rt.stop_container(cri::StopContainerRequest {
            container_id: ids[0].clone(),
            timeout: 0,
        })
        .await
        .unwrap();
        support::wait_for(
            &format!("every process of the stopped container ({name} PID namespace) to end"),
            Duration::from_secs(10),
            || processes_with_cmdline(&["sleep", &stopped]) == 0,
        )
        .await;
        assert_eq!(processes_with_cmdline(&["sleep", &removed]), 2);
        // RemovePodSandbox alone, as kubelet may send it: it stops what still runs.
        rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
        support::wait_for(
            &format!("every process of the removed pod's container ({name} PID namespace) to end"),
            Duration::from_secs(10),
            || processes_with_cmdline(&["sleep", &removed]) == 0,
        )
        .await;
        assert_no_leaks(&h, &pod);
    }
}

/// Files of an unfinished create that cannot be removed (here a bundle whose image-volume
/// directory is a file, so its mounts cannot be listed) do not keep the daemon from starting:
/// they are left in place and named in its log, and the other orphans are removed.
#[tokio::test(flavor = "multi_thread")]
async fn an_orphan_that_cannot_be_removed_does_not_keep_the_daemon_down() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    h.stop();
    let bundles = h.dir.path().join("state/containers");
    let stuck = bundles.join("stuck-orphan");
    std::fs::create_dir_all(stuck.join("rootfs")).unwrap();
    std::fs::write(stuck.join("imagevols"), b"not a directory").unwrap();
    let gone = bundles.join("gone-orphan");
    std::fs::create_dir_all(gone.join("rootfs")).unwrap();
    h.restart();
    assert!(
        stuck.exists(),
        "the orphan that could not be unmounted is left"
    );
    assert!(!gone.exists(), "the other orphan is removed");
    let log = h.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("stuck-orphan") && l.contains("left in place")),
        "{log}"
    );
    // Serving: a pod and its container run.
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("after-orphans", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("up", &["sleep", "60"]),
    )
    .await;
    assert_eq!(exec(&mut rt, &id, "echo up").await, "up");
    remove_pod(&mut rt, &pod).await;
    std::fs::remove_dir_all(&stuck).unwrap();
    assert_no_leaks(&h, &pod);
}

/// The monitor's socket answers what it does not know with an error and keeps serving:
/// an unknown call, a message that does not decode, an oversized frame.
#[tokio::test(flavor = "multi_thread")]
async fn a_monitor_answers_bad_calls_with_errors_and_keeps_serving() {
    use hako_runtime::monitor::wire::{self, code, Method};
    use tokio::io::AsyncWriteExt;
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("wire", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let socket = h
        .dir
        .path()
        .join("state/pods")
        .join(&pod)
        .join("monitor.sock");
    let (_dir, short) = hako_runtime::monitor::short_socket_path(&socket).unwrap();
    let call = |tag: u8, body: Vec<u8>| {
        let short = short.clone();
        async move {
            let mut c = tokio::net::UnixStream::connect(&short).await.unwrap();
            wire::write_frame(&mut c, tag, &body).await.unwrap();
            wire::read_frame(&mut c).await
        }
    };
    let (status, msg) = call(99, Vec::new()).await.unwrap();
    assert_eq!(status, code::UNIMPLEMENTED);
    assert!(String::from_utf8_lossy(&msg).contains("call 99"), "{msg:?}");
    let (status, msg) = call(Method::CreateContainer as u8, vec![0xff; 7])
        .await
        .unwrap();
    assert_eq!(status, code::INVALID_ARGUMENT);
    assert!(
        String::from_utf8_lossy(&msg).contains("bad request"),
        "{msg:?}"
    );
    // A spec joining a PID namespace by a pid that is none of the pod's running containers
    // (TARGET whose container exited after the daemon looked it up) is refused before any
    // process is made: the pid may name another process by then.
    let bundle = tempfile::tempdir().unwrap();
    // A spec that joins the PID namespace at `path` and nothing else of use.
    let spec_joining = |path: &str| {
        std::fs::write(
            bundle.path().join("config.json"),
            serde_json::to_vec(&serde_json::json!({
                "ociVersion": "1.0.2",
                "linux": {"namespaces": [{"type": "pid", "path": path}, {"type": "mount"}]}
            }))
            .unwrap(),
        )
        .unwrap()
    };
    let create = |req: &hako_proto::monitor::CreateContainerRequest| {
        let body = prost::Message::encode_to_vec(req);
        async move {
            let (status, msg) = call(Method::CreateContainer as u8, body).await.unwrap();
            (status, String::from_utf8_lossy(&msg).into_owned())
        }
    };
    spec_joining("/proc/1/ns/pid");
    let req = hako_proto::monitor::CreateContainerRequest {
        id: "target-gone".into(),
        bundle: bundle.path().display().to_string(),
        log_path: logs.path().join("target-gone.log").display().to_string(),
        ..Default::default()
    };
    let (status, msg) = create(&req).await;
    assert_eq!(status, code::FAILED_PRECONDITION, "{msg}");
    assert!(msg.contains("pid 1) is no longer running"), "{msg}");
    let mut c = tokio::net::UnixStream::connect(&short).await.unwrap();
    c.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    assert!(
        wire::read_frame(&mut c).await.is_err(),
        "an oversized frame is dropped, not read"
    );
    // Still serving: a container runs in the pod.
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("after", &["sleep", "60"]),
    )
    .await;
    assert_eq!(exec(&mut rt, &id, "echo fine").await, "fine");
    // TARGET names a container and, through its pid, a namespace: a pid that has come to be
    // another container's of the same pod (the target exited, its pid reused) is refused
    // even though that container runs. Here the pid is simply the other one's.
    let other = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("other", &["sleep", "60"]),
    )
    .await;
    let other_pid = container_pid(&mut rt, &other).await;
    spec_joining(&format!("/proc/{other_pid}/ns/pid"));
    let req = hako_proto::monitor::CreateContainerRequest {
        id: "target-reused".into(),
        pid_target: id.clone(),
        ..req
    };
    let (status, msg) = create(&req).await;
    assert_eq!(status, code::FAILED_PRECONDITION, "{msg}");
    assert!(
        msg.contains(&format!(
            "container {id}, whose PID namespace it joins, (pid {other_pid}) is no longer running"
        )),
        "{msg}"
    );
    // Named by its own pid, the target is joined: the check lets the create through (it then
    // fails on this bundle, which has no rootfs; nothing of it is left in the monitor).
    let id_pid = container_pid(&mut rt, &id).await;
    spec_joining(&format!("/proc/{id_pid}/ns/pid"));
    let (status, msg) = create(&req).await;
    assert_ne!(status, code::OK, "{msg}");
    assert!(!msg.contains("no longer running"), "{msg}");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// libcontainer logs from the processes it makes; by the time a container's init fails to
/// exec its command, that process's stderr is the container's. Those lines belong in the
/// pod's monitor.log, not in the container's CRI log.
#[tokio::test(flavor = "multi_thread")]
async fn runtime_errors_stay_out_of_the_containers_log() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    // An executable whose interpreter does not exist: it passes libcontainer's checks at
    // create and fails in init's execve at start.
    let bin = tempfile::tempdir().unwrap();
    let script = bin.path().join("run");
    std::fs::write(&script, "#!/no/such/interpreter\n").unwrap();
    std::fs::set_permissions(
        &script,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )
    .unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("quiet", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut c = container_config("broken", &["/opt/bin/run"]);
    c.mounts.push(cri::Mount {
        container_path: "/opt/bin".into(),
        host_path: bin.path().display().to_string(),
        readonly: true,
        ..Default::default()
    });
    let id = create_container(&mut rt, &pod, &cfg, c).await;
    // The exec fails in init after start has returned: start succeeds and the container
    // exits at once with a failure code (what kubelet then sees is a crash, with the cause in
    // monitor.log).
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .expect("start returns before init's execve");
    let st = wait_exited(&mut rt, &id).await;
    assert_ne!(st.exit_code, 0, "a failed exec is not a success: {st:?}");
    let monitor_log = std::fs::read_to_string(
        h.dir
            .path()
            .join("state/pods")
            .join(&pod)
            .join("monitor.log"),
    )
    .unwrap();
    assert!(
        monitor_log.contains("/opt/bin/run"),
        "the failed exec is in monitor.log:\n{monitor_log}"
    );
    let container_log = log_lines(&logs.path().join("broken.log"));
    assert!(
        container_log.iter().all(|l| !l.contains("libcontainer")),
        "runtime lines in the container's log: {container_log:?}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// kubelet retries a create after its own timeout while the first call may still run: calls
/// with the same name wait for the one under way and get the object it made.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_creates_of_one_name_wait_for_the_first_and_return_its_object() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("twice", logs.path());
    let mut pods = Vec::new();
    for _ in 0..4 {
        let ch = h.channel().await;
        let cfg = cfg.clone();
        pods.push(tokio::spawn(async move {
            let mut rt = hako_proto::cri::runtime_service_client::RuntimeServiceClient::new(ch);
            run_pod(&mut rt, &cfg).await
        }));
    }
    let mut ids = Vec::new();
    for p in pods {
        ids.push(p.await.unwrap());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one sandbox for one name: {ids:?}");
    let pod = ids.pop().unwrap();
    let cc = container_config("c", &["sleep", "60"]);
    let mut creates = Vec::new();
    for _ in 0..4 {
        let ch = h.channel().await;
        let (pod, cfg, cc) = (pod.clone(), cfg.clone(), cc.clone());
        creates.push(tokio::spawn(async move {
            let mut rt = hako_proto::cri::runtime_service_client::RuntimeServiceClient::new(ch);
            rt.create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod,
                config: Some(cc),
                sandbox_config: Some(cfg),
            })
            .await
            .map(|r| r.into_inner().container_id)
        }));
    }
    let mut cids = Vec::new();
    for c in creates {
        cids.push(c.await.unwrap().expect("every concurrent create succeeds"));
    }
    cids.dedup();
    assert_eq!(cids.len(), 1, "one container for one name: {cids:?}");
    let mut rt = h.runtime().await;
    let listed = all_containers(&mut rt).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A daemon out of file descriptors cannot reach a pod's monitor, and cannot tell whether it
/// still listens either: that is no evidence the monitor is gone, so the pod stays Ready and
/// its containers run (taken for gone, the monitor's containers were killed: anyone able to
/// pin the daemon's descriptors, with port-forwards say, could kill other tenants' pods).
#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_out_of_descriptors_leaves_live_monitors_alone() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("nofile", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "600"]),
    )
    .await;
    let pid = container_pid(&mut rt, &id).await;
    assert_eq!(exec(&mut rt, &id, "echo up").await, "up");
    // The soft limit at the lowest free descriptor number: every new one fails with EMFILE.
    // Only the soft limit moves, so it can be put back without CAP_SYS_RESOURCE.
    let daemon = h.pid();
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: reads the daemon's limit into `old`.
    assert_eq!(
        unsafe { libc::prlimit(daemon, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) },
        0
    );
    // The daemon may open or close a descriptor between the reading and the limit: tried
    // until an exec is starved.
    let mut starved = None;
    for _ in 0..10 {
        let open: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{daemon}/fd"))
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
        let lowest_free = (0..).find(|n| !open.contains(n)).unwrap();
        let low = libc::rlimit {
            rlim_cur: lowest_free,
            rlim_max: old.rlim_max,
        };
        // SAFETY: sets the daemon's soft limit; put back below.
        assert_eq!(
            unsafe { libc::prlimit(daemon, libc::RLIMIT_NOFILE, &low, std::ptr::null_mut()) },
            0
        );
        let answer = rt
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.clone(),
                cmd: vec!["true".into()],
                timeout: 10,
            })
            .await;
        // SAFETY: puts the daemon's soft limit back.
        assert_eq!(
            unsafe { libc::prlimit(daemon, libc::RLIMIT_NOFILE, &old, std::ptr::null_mut()) },
            0
        );
        if let Err(e) = answer {
            starved = Some(e);
            break;
        }
    }
    assert!(starved.is_some(), "no exec was starved of descriptors");
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    assert_eq!(
        status(&mut rt, &id).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the container's init was killed"
    );
    assert_eq!(exec(&mut rt, &id, "echo still").await, "still");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A monitor that stops answering (here: SIGSTOPped) costs its callers a bounded wait and a
/// DEADLINE_EXCEEDED naming it, not a hang; once it answers again, so does the pod.
#[tokio::test(flavor = "multi_thread")]
async fn a_stuck_monitor_fails_calls_with_deadline_exceeded_instead_of_hanging() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("stuck", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "300"]),
    )
    .await;
    let monitor = monitor_pid(&mut rt, &pod).await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let e = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec!["true".into()],
            timeout: 1,
        })
        .await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGCONT).unwrap();
    let e = e.expect_err("a stopped monitor cannot answer");
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert!(
        e.message().contains("did not answer") && e.message().contains(&pod),
        "{e:?}"
    );
    assert_eq!(exec(&mut rt, &id, "echo back").await, "back");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A container's exit reaches the daemon when its monitor records it, without any call
/// asking for it: with no CRI call between the start and the monitor being stopped, lists
/// and ContainerStatus report the exit and its code (from the daemon's own state; a stopped
/// monitor answers nothing).
#[tokio::test(flavor = "multi_thread")]
async fn an_exit_reaches_lists_and_status_without_asking_the_monitor() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("told", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let monitor = monitor_pid(&mut rt, &pod).await;
    let running = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("running", &["sleep", "300"]),
    )
    .await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("ends", &["sh", "-c", "sleep 0.3; exit 7"]),
    )
    .await;
    support::wait_for(
        "the daemon to hear of the exit from the monitor",
        Duration::from_secs(30),
        || {
            h.log_text()
                .lines()
                .any(|l| l.contains("container exit reported by its monitor") && l.contains(&id))
        },
    )
    .await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let resume = Resume(monitor);
    let listed = all_containers(&mut rt).await;
    let state = |c: &str| listed.iter().find(|l| l.id == c).expect("listed").state;
    assert_eq!(state(&id), cri::ContainerState::ContainerExited as i32);
    assert_eq!(
        state(&running),
        cri::ContainerState::ContainerRunning as i32
    );
    let st = status(&mut rt, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.exit_code, 7);
    assert!(st.finished_at > st.started_at, "{st:?}");
    drop(resume);
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A monitor killed with SIGKILL turns its pod NotReady in ListPodSandbox, and its running
/// container Unknown in ListContainers, with no other call made (its watcher's connection
/// ends with it).
#[tokio::test(flavor = "multi_thread")]
async fn a_killed_monitor_turns_its_pod_not_ready_in_the_list() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("killed", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "302"]),
    )
    .await;
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    kill_monitor(&mut rt, &pod).await;
    wait_not_ready(&mut rt, &pod).await;
    let listed = all_containers(&mut rt).await;
    let c = listed.iter().find(|c| c.id == id).expect("listed");
    assert_eq!(c.state, cri::ContainerState::ContainerUnknown as i32);
    assert!(h.log_text().contains("pod monitor is gone"), "logged");
    support::wait_for(
        "the unwatched container process to be killed",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "302"]) == 0,
    )
    .await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// StopPodSandbox of a pod whose monitor hangs (SIGSTOPped: its socket still accepts, nothing
/// answers): the stop succeeds, and when it does the container's processes are gone, ended
/// through their cgroup, so the Exited it reports is true (kubelet unmounts a stopped pod's
/// volumes). Before, the container was recorded Exited 137 and left running.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_whose_monitor_hangs_is_stopped_through_its_cgroups() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    // PID namespaces of their own, as kubelet's default: nothing ends the container with its
    // monitor (a pod's shared PID namespace ends with it).
    let own = cri::NamespaceOption {
        pid: cri::NamespaceMode::Container as i32,
        ..Default::default()
    };
    let cfg = with_namespaces(pod_config("hung-stop", logs.path()), own.clone());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut c = container_config("c", &["sleep", "305"]);
    c.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            namespace_options: Some(own),
            ..Default::default()
        }),
        ..Default::default()
    });
    let id = run_container(&mut rt, &pod, &cfg, c).await;
    let monitor = monitor_pid(&mut rt, &pod).await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let resume = Resume(monitor);
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    })
    .await
    .unwrap();
    assert_eq!(
        processes_with_cmdline(&["sleep", "305"]),
        0,
        "the container still runs after its pod was stopped"
    );
    let st = status(&mut rt, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    drop(resume);
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The daemon restarts having lost its store while one of several pods' monitors is stuck
/// (SIGSTOPped): the start asks the monitors at once, so every other pod is adopted before
/// the stuck one's deadline runs out (its "did not answer" comes last in the log, though its
/// pod's directory is the first the start reads). Once it answers, the next start adopts it.
#[tokio::test(flavor = "multi_thread")]
async fn a_start_with_a_stuck_monitor_adopts_the_others_without_waiting_for_it() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let mut pods = Vec::new();
    for i in 0..4 {
        let cfg = pod_config(&format!("adopt-{i}"), logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        run_container(
            &mut rt,
            &pod,
            &cfg,
            container_config("c", &["sleep", "303"]),
        )
        .await;
        pods.push(pod);
    }
    pods.sort();
    let stuck = pods[0].clone();
    let monitor = monitor_pid(&mut rt, &stuck).await;
    h.kill9();
    std::fs::remove_file(h.root.join("meta.db")).unwrap();
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let resume = Resume(monitor);
    h.restart();
    let mut rt = h.runtime().await;
    let log = h.log_text();
    let line_of = |what: &str, pod: &str| {
        log.lines()
            .position(|l| l.contains(what) && l.contains(pod))
            .unwrap_or_else(|| panic!("no {what:?} for pod {pod} in the log:\n{log}"))
    };
    let silent = line_of("pod monitor did not answer at start", &stuck);
    for p in &pods[1..] {
        assert!(
            line_of("adopted a running pod whose record was lost", p) < silent,
            "pod {p} was adopted only after the stuck monitor's deadline:\n{log}"
        );
    }
    let listed = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    for p in &pods[1..] {
        let item = listed
            .iter()
            .find(|i| i.id == *p)
            .expect("adopted pod listed");
        assert_eq!(item.state, cri::PodSandboxState::SandboxReady as i32);
    }
    // Resumed, the stuck monitor's pod is adopted by the next start.
    drop(resume);
    h.kill9();
    h.restart();
    let mut rt = h.runtime().await;
    for p in &pods {
        assert_eq!(
            pod_state(&mut rt, p).await,
            cri::PodSandboxState::SandboxReady as i32
        );
    }
    for p in &pods {
        remove_pod(&mut rt, p).await;
    }
    for p in &pods {
        assert_no_leaks(&h, p);
    }
}

/// One stuck monitor among several pods: every list, status and stats call still answers for
/// all of them; the stuck pod is reported NotReady (the reason in its verbose status), its
/// containers as last recorded, the other pods Ready with their containers Running. Once the
/// monitor answers again, so is its pod Ready again.
#[tokio::test(flavor = "multi_thread")]
async fn a_stuck_monitor_reports_its_pod_not_ready_and_holds_up_no_other_pod() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let mut pods = Vec::new();
    let mut containers = Vec::new();
    for name in ["stuck", "fine-a", "fine-b"] {
        let cfg = pod_config(name, logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        // Two containers in each: a list must not wait on the stuck monitor per container.
        for c in ["one", "two"] {
            let id =
                run_container(&mut rt, &pod, &cfg, container_config(c, &["sleep", "300"])).await;
            containers.push((pod.clone(), id));
        }
        pods.push(pod);
    }
    let stuck = pods[0].clone();
    let monitor = monitor_pid(&mut rt, &stuck).await;
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let resume = Resume(monitor);

    let ready = |p: &str| {
        if *p == stuck {
            cri::PodSandboxState::SandboxNotready as i32
        } else {
            cri::PodSandboxState::SandboxReady as i32
        }
    };
    // Its watcher notices once the monitor misses its heartbeat; lists keep answering
    // meanwhile.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while pod_state(&mut rt, &stuck).await != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stuck pod was never reported NotReady"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let listed = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .expect("ListPodSandbox answers with a monitor stuck")
        .into_inner()
        .items;
    for p in &pods {
        let item = listed
            .iter()
            .find(|i| i.id == *p)
            .expect("every pod listed");
        assert_eq!(item.state, ready(p), "pod {p} in ListPodSandbox");
    }
    for p in &pods {
        let r = rt
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: p.clone(),
                verbose: true,
            })
            .await
            .expect("PodSandboxStatus answers with a monitor stuck")
            .into_inner();
        assert_eq!(r.status.unwrap().state, ready(p), "pod {p} status");
        let info: serde_json::Value = serde_json::from_str(&r.info["info"]).unwrap();
        let reason = info["notReadyReason"].as_str();
        if *p == stuck {
            assert!(
                reason.is_some_and(|r| r.contains("did not answer")),
                "the reason is in the verbose status: {info}"
            );
        } else {
            assert_eq!(reason, None, "{info}");
        }
    }
    let listed = rt
        .list_containers(cri::ListContainersRequest::default())
        .await
        .expect("ListContainers answers with a monitor stuck")
        .into_inner()
        .containers;
    // The stuck pod's containers as last recorded (Running), the others live.
    for (_, id) in &containers {
        let c = listed
            .iter()
            .find(|c| c.id == *id)
            .expect("every container listed");
        assert_eq!(
            c.state,
            cri::ContainerState::ContainerRunning as i32,
            "{c:?}"
        );
        assert_eq!(
            status(&mut rt, id).await.state,
            cri::ContainerState::ContainerRunning as i32
        );
        container_stats(&mut rt, id).await;
    }
    let stats = rt
        .list_container_stats(cri::ListContainerStatsRequest::default())
        .await
        .expect("ListContainerStats answers with a monitor stuck")
        .into_inner()
        .stats;
    for (_, id) in &containers {
        assert!(
            stats
                .iter()
                .any(|s| s.attributes.as_ref().unwrap().id == *id),
            "stats of {id}"
        );
    }
    let pod_stats = rt
        .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest::default())
        .await
        .expect("ListPodSandboxStats answers with a monitor stuck")
        .into_inner()
        .stats;
    for p in &pods {
        let s = pod_stats
            .iter()
            .find(|s| s.attributes.as_ref().unwrap().id == *p)
            .expect("stats of every pod");
        assert_eq!(s.linux.as_ref().unwrap().containers.len(), 2, "{s:?}");
        rt.pod_sandbox_stats(cri::PodSandboxStatsRequest {
            pod_sandbox_id: p.clone(),
        })
        .await
        .expect("PodSandboxStats answers with a monitor stuck");
    }
    assert!(
        h.log_text().contains("pod monitor did not answer"),
        "logged"
    );

    drop(resume);
    let mut back = false;
    for _ in 0..250 {
        let listed = rt
            .list_pod_sandbox(cri::ListPodSandboxRequest::default())
            .await
            .unwrap()
            .into_inner()
            .items;
        if listed
            .iter()
            .all(|i| i.state == cri::PodSandboxState::SandboxReady as i32)
        {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(back, "the pod is Ready again once its monitor answers");
    for p in &pods {
        remove_pod(&mut rt, p).await;
    }
    for p in &pods {
        assert_no_leaks(&h, p);
    }
}

/// A container that ignores SIGTERM, stopped with a long grace period: a later StopContainer
/// with a short one (kubelet's force delete) and the pod's stop do not wait for that grace
/// period to run out (containerd lets the later stop win).
#[tokio::test(flavor = "multi_thread")]
async fn a_long_grace_period_pins_neither_a_shorter_stop_nor_the_pods_stop() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("stubborn", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let stubborn = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config(
            "stubborn",
            &[
                "sh",
                "-c",
                "trap '' TERM; echo ready; while :; do sleep 1; done",
            ],
        ),
    )
    .await;
    // Stopped before its trap is set, SIGTERM would end it and test nothing here.
    support::wait_for("the trap to be set", Duration::from_secs(30), || {
        !log_lines(&logs.path().join("stubborn.log")).is_empty()
    })
    .await;
    let mut slow_rt = h.runtime().await;
    let id = stubborn.clone();
    let slow = tokio::spawn(async move {
        slow_rt
            .stop_container(cri::StopContainerRequest {
                container_id: id,
                timeout: 3600,
            })
            .await
    });
    // The long stop has sent its SIGTERM (ignored) and waits.
    support::wait_for(
        "the long stop to be under way",
        std::time::Duration::from_secs(10),
        || h.log_text().contains("StopContainer"),
    )
    .await;
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        rt.stop_container(cri::StopContainerRequest {
            container_id: stubborn.clone(),
            timeout: 1,
        }),
    )
    .await
    .expect("the short stop waited for the long one's grace period")
    .unwrap();
    let st = status(&mut rt, &stubborn).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    // Killed at the end of the short grace period, not ended by the SIGTERM it ignores.
    assert_eq!(st.exit_code, 137, "{st:?}");
    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    })
    .await
    .unwrap();
    // The long stop ends with the container, not with its grace period.
    let r = tokio::time::timeout(std::time::Duration::from_secs(60), slow)
        .await
        .expect("the long stop ended once the container was gone")
        .unwrap();
    r.unwrap();
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A runtime handler named in `runtime.handlers` (a RuntimeClass's handler, as Kubernetes'
/// node suite's `test-handler`) runs pods and pulls images as the default one, is listed in
/// Status and reported in the pod's status; any other name is still refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_configured_runtime_handler_serves_as_the_default_one() {
    let Some((_reg, h)) = ready_with_config("[runtime]\nhandlers = [\"test-handler\"]\n").await
    else {
        return;
    };
    let mut rt = h.runtime().await;
    let st = rt
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = st
        .runtime_handlers
        .iter()
        .map(|r| r.name.as_str())
        .collect();
    assert_eq!(names, ["", "test-handler"], "{:?}", st.runtime_handlers);
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("handler", logs.path());
    let pod = rt
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg.clone()),
            runtime_handler: "test-handler".into(),
        })
        .await
        .expect("a pod with the configured handler")
        .into_inner()
        .pod_sandbox_id;
    let status = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(status.runtime_handler, "test-handler");
    let c = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "300"]),
    )
    .await;
    assert_eq!(exec(&mut rt, &c, "echo up").await, "up");
    let mut im = h.images().await;
    let image = |handler: &str| cri::ImageStatusRequest {
        image: Some(cri::ImageSpec {
            image: IMAGE.into(),
            runtime_handler: handler.into(),
            ..Default::default()
        }),
        verbose: false,
    };
    let found = im.image_status(image("test-handler")).await.unwrap();
    assert!(found.into_inner().image.is_some(), "the default's images");
    let e = im.image_status(image("kata")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = rt
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod_config("kata", logs.path())),
            runtime_handler: "kata".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("\"kata\""), "{e:?}");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// ExecSync answers with what the command wrote by shortly after it exited, and then stops
/// reading: a process it left in the background holding its stdout open must not keep a
/// reader (and up to 16 MiB of output per stream) alive in the pod's monitor. Here the
/// background `yes` starts writing after the call has answered; with the read end closed it
/// dies of the broken pipe, where a reader still draining the pipe would keep it running.
#[tokio::test(flavor = "multi_thread")]
async fn exec_sync_stops_reading_what_its_background_processes_write() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("execbg", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "600"]),
    )
    .await;
    let out = exec(
        &mut rt,
        &id,
        "echo first; (sleep 1; touch /tmp/started; exec yes) & echo done",
    )
    .await;
    assert_eq!(out, "first\ndone");
    let exit_code = |script: &'static str| {
        let mut rt = rt.clone();
        let id = id.clone();
        async move {
            rt.exec_sync(cri::ExecSyncRequest {
                container_id: id,
                cmd: vec!["sh".into(), "-c".into(), script.into()],
                timeout: 10,
            })
            .await
            .unwrap()
            .into_inner()
            .exit_code
        }
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while exit_code("test -e /tmp/started").await != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the background process never started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The container's init does not reap, so the dead yes stays a zombie: only a live one
    // counts.
    let live_yes =
        "for p in $(pidof yes); do grep -q '^State:.*Z' /proc/$p/status || exit 0; done; exit 1";
    while exit_code(live_yes).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the background yes still runs long after ExecSync answered: its output is still read"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Container processes start with no signal ignored or blocked, as under runc: the monitor (a
/// Rust program) ignores SIGPIPE, glibc's posix_spawn leaves its internal signals 32 and 33
/// ignored in the monitor, and both dispositions and the blocked mask would otherwise be
/// inherited through libcontainer's forks and the exec into the container's command.
#[tokio::test(flavor = "multi_thread")]
async fn container_processes_start_with_no_signal_ignored() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("sigpipe", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "600"]),
    )
    .await;
    // SigIgn and SigBlk are hex masks, bit n-1 for signal n: SIGPIPE (13) is 0x1000.
    let masks = |status: &str| -> Vec<(String, u64)> {
        status
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(':')?;
                ["SigIgn", "SigBlk"]
                    .contains(&k)
                    .then(|| (k.to_string(), u64::from_str_radix(v.trim(), 16).unwrap()))
            })
            .collect()
    };
    let none = vec![("SigBlk".to_string(), 0), ("SigIgn".to_string(), 0)];
    let pid = container_pid(&mut rt, &id).await;
    let init = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(masks(&init), none, "the container's init");
    // The exec'd process itself, not a shell's child (busybox sh ignores SIGQUIT for those).
    let own = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec!["cat".into(), "/proc/self/status".into()],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        masks(&String::from_utf8_lossy(&own.stdout)),
        none,
        "an exec"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A container log on a full filesystem: the monitor logs the first failed write and the first
/// that succeeds again, not a line per failure (a full disk fails every write, and the
/// monitor's own log is in memory, under the state dir), and the container runs on.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_log_disk_is_logged_once_per_run_of_failures() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut mounts = support::HostMounts::default();
    mounts.tmpfs(logs.path(), Some("size=64k"));
    let mut rt = h.runtime().await;
    let cfg = pod_config("full-log-disk", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    // About 500 KiB of records into 64 KiB: many failed writes in a row; then, once told,
    // one more line.
    let script = "i=0; while [ $i -lt 10000 ]; do echo line-$i; i=$((i+1)); done; \
                  touch /tmp/flooded; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo after-the-flood; exec sleep 600";
    let id = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("flood", &["sh", "-c", script]),
    )
    .await;
    let monitor_log = h.state.join("pods").join(&pod).join("monitor.log");
    let read = || std::fs::read_to_string(&monitor_log).unwrap_or_default();
    let count = |text: &str, what: &str| text.lines().filter(|l| l.contains(what)).count();
    const FAILED: &str = "write container log (further failures not logged";
    const AGAIN: &str = "container log written again";
    let log_file = logs.path().join("flood.log");
    // The shell has written all 10 000 lines (the records that fit, and the failures).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let done = rt
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.clone(),
                cmd: vec!["test".into(), "-e".into(), "/tmp/flooded".into()],
                timeout: 10,
            })
            .await
            .unwrap()
            .into_inner()
            .exit_code
            == 0;
        if done {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the flood never ended"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Room again, for what the pipe may still hold too: the next write succeeds.
    nix::mount::mount(
        None::<&str>,
        logs.path(),
        None::<&str>,
        nix::mount::MsFlags::MS_REMOUNT,
        Some("size=4m"),
    )
    .unwrap();
    exec(&mut rt, &id, "touch /tmp/go").await;
    support::wait_for("the log written again", Duration::from_secs(30), || {
        count(&read(), AGAIN) == 1
    })
    .await;
    let text = read();
    assert_eq!(count(&text, FAILED), 1, "{text}");
    assert_eq!(count(&text, AGAIN), 1, "{text}");
    assert!(
        std::fs::read_to_string(&log_file)
            .unwrap()
            .contains("stdout F after-the-flood"),
        "{}",
        std::fs::read_to_string(&log_file).unwrap()
    );
    assert_eq!(
        status(&mut rt, &id).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A container's writable layer is mounted `volatile` unless `runtime.sync_writable_layers`
/// asks otherwise: removing a container then does not sync the whole filesystem under the
/// root (the kernel syncs it at a plain overlay's unmount), and its writes still land in its
/// layer. With the option the overlay is an ordinary one, as containerd mounts it.
#[tokio::test(flavor = "multi_thread")]
async fn writable_layers_are_volatile_unless_configured_otherwise() {
    for (config, volatile) in [
        ("", true),
        ("[runtime]\nsync_writable_layers = true\n", false),
    ] {
        let Some((_reg, h)) = ready_with_config(config).await else {
            return;
        };
        let mut rt = h.runtime().await;
        let logs = tempfile::tempdir().unwrap();
        let cfg = pod_config("volatile", logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        let c = run_container(
            &mut rt,
            &pod,
            &cfg,
            container_config("c", &["sleep", "300"]),
        )
        .await;
        // A container's own sync works either way (on a volatile overlay it does nothing).
        assert_eq!(
            exec(&mut rt, &c, "echo kept > /f && sync && cat /f").await,
            "kept"
        );
        let rootfs = h.state.join("containers").join(&c).join("rootfs");
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mountinfo
            .lines()
            .find(|l| l.split(' ').nth(4) == Some(rootfs.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{} not mounted:\n{mountinfo}", rootfs.display()));
        let options = line.split(" - ").nth(1).unwrap().split(' ').nth(2).unwrap();
        let is_volatile = options
            .split(',')
            .any(|o| o == "volatile" || o == "fsync=volatile");
        assert_eq!(is_volatile, volatile, "config {config:?}: {line}");
        let upper = h.root.join("containers").join(&c).join("upper/f");
        assert_eq!(std::fs::read_to_string(&upper).unwrap(), "kept\n");
        remove_pod(&mut rt, &pod).await;
        assert_no_leaks(&h, &pod);
    }
}

/// An exec into a container that has used up its CPU quota is slow to set up: libcontainer's
/// processes join the container's cgroup and wait for its quota (here 1 ms a second, shared
/// with eight busy loops) before the command runs. The pod's monitor serves meanwhile: the pod
/// stays Ready past the daemon's 6.5 s wait for a monitor's answer, and an exec in the pod's
/// other container runs at once. The slow exec's container is then killed mid-setup: its exit
/// is recorded (the exec's hold on its init released), the exec's failure is not taken for a
/// silent monitor, and the pod's removal leaves no cgroup (what the setup left in the
/// container's cgroup dies once its quota is lifted).
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_slowed_by_its_containers_cpu_quota_holds_up_nothing_else() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("throttled", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut busy = container_config(
        "busy",
        &[
            "sh",
            "-c",
            "for i in 1 2 3 4 5 6 7 8; do (while :; do :; done) & done; wait",
        ],
    );
    busy.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            cpu_period: 1_000_000,
            cpu_quota: 1_000,
            ..Default::default()
        }),
        ..Default::default()
    });
    let busy = run_container(&mut rt, &pod, &cfg, busy).await;
    let other = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("other", &["sleep", "60"]),
    )
    .await;
    let slow = {
        let (mut rt, busy) = (rt.clone(), busy.clone());
        tokio::spawn(async move {
            rt.exec_sync(cri::ExecSyncRequest {
                container_id: busy,
                cmd: vec!["echo".into(), "late".into()],
                timeout: 120,
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        !slow.is_finished(),
        "the throttled exec is still being set up"
    );
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    assert_eq!(exec(&mut rt, &other, "echo served").await, "served");
    rt.stop_container(cri::StopContainerRequest {
        container_id: busy.clone(),
        timeout: 0,
    })
    .await
    .unwrap();
    let st = wait_exited(&mut rt, &busy).await;
    assert_eq!(st.exit_code, 137, "{st:?}");
    // Killed with its container: an error, or the exit of a process that never ran `echo`.
    match tokio::time::timeout(Duration::from_secs(30), slow)
        .await
        .expect("the exec ends with its container")
        .unwrap()
    {
        Ok(r) => assert_ne!(r.into_inner().stdout, b"late\n"),
        Err(e) => assert_ne!(e.code(), tonic::Code::Ok),
    }
    // Neither while it was set up nor for its failure, which the monitor answered.
    assert!(
        !h.log_text().contains("pod monitor did not answer"),
        "{}",
        h.log_text()
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Two pods may share a cgroup parent (kubelet gives each its own, other CRI clients need not):
/// removing one leaves the containers of the other running, their cgroups in place.
#[tokio::test(flavor = "multi_thread")]
async fn removing_a_pod_spares_the_containers_of_a_pod_sharing_its_cgroup_parent() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let parent = format!("shared-parent-{}", std::process::id());
    let with_parent = |name: &str| {
        let mut cfg = pod_config(name, logs.path());
        cfg.linux.get_or_insert_with(Default::default).cgroup_parent = format!("/{parent}");
        cfg
    };
    let (cfg_a, cfg_b) = (with_parent("first"), with_parent("second"));
    let a = run_pod(&mut rt, &cfg_a).await;
    let b = run_pod(&mut rt, &cfg_b).await;
    let sleeper = |name| container_config(name, &["sleep", "60"]);
    let ca = run_container(&mut rt, &a, &cfg_a, sleeper("a")).await;
    let cb = run_container(&mut rt, &b, &cfg_b, sleeper("b")).await;
    let cgroups_of = |id: &str| -> Vec<std::path::PathBuf> {
        cgroup_mounts()
            .into_iter()
            .map(|m| m.join(&parent).join(format!("hako-{id}")))
            .filter(|d| d.is_dir())
            .collect()
    };
    assert!(!cgroups_of(&ca).is_empty() && !cgroups_of(&cb).is_empty());
    remove_pod(&mut rt, &a).await;
    assert!(cgroups_of(&ca).is_empty(), "{:?}", cgroups_of(&ca));
    assert_eq!(
        status(&mut rt, &cb).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    assert_eq!(exec(&mut rt, &cb, "echo alive").await, "alive");
    assert!(!cgroups_of(&cb).is_empty());
    assert!(
        !h.log_text().contains("whose create did not finish"),
        "{}",
        h.log_text()
    );
    remove_pod(&mut rt, &b).await;
    assert!(cgroups_of(&cb).is_empty(), "{:?}", cgroups_of(&cb));
    // The parent is the client's (kubelet's): hako leaves it, the test removes it.
    for m in cgroup_mounts() {
        let _ = std::fs::remove_dir(m.join(&parent));
    }
}

/// An ExecSync whose caller goes (crictl interrupted, a client's deadline) does not run on for
/// nobody: its process is killed, the container and its next execs are untouched.
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_whose_caller_went_is_killed() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("abandoned", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let cid = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("c", &["sleep", "600"]),
    )
    .await;
    let argv = ["sleep", "3141"];
    let call = {
        let (mut rt, cid) = (rt.clone(), cid.clone());
        tokio::spawn(async move {
            rt.exec_sync(cri::ExecSyncRequest {
                container_id: cid,
                cmd: argv.iter().map(|a| a.to_string()).collect(),
                timeout: 0,
            })
            .await
        })
    };
    support::wait_for("the exec's process", Duration::from_secs(20), || {
        processes_with_cmdline(&argv) == 1
    })
    .await;
    // Dropping the call cancels its HTTP/2 stream, as an interrupted client does.
    call.abort();
    support::wait_for(
        "the exec's process to be killed",
        Duration::from_secs(10),
        || processes_with_cmdline(&argv) == 0,
    )
    .await;
    assert_eq!(
        status(&mut rt, &cid).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    assert_eq!(exec(&mut rt, &cid, "echo next").await, "next");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// An Exec URL names the container its call found, not the prefix the call gave: used once that
/// container is gone, it fails, instead of opening the session in a newer container (of any pod)
/// whose id begins the same way.
#[tokio::test(flavor = "multi_thread")]
async fn an_exec_url_keeps_to_the_container_its_call_named() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let Some(client) = support::streaming_client() else {
        support::skip(
            "an_exec_url_keeps_to_the_container_its_call_named",
            "go is missing (tests/streaming-client is Go)",
        );
        return;
    };
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("prefixes", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let x = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("x", &["sleep", "600"]),
    )
    .await;
    let prefix = x[..1].to_string();
    let url = rt
        .exec(cri::ExecRequest {
            container_id: prefix.clone(),
            // Its container's cgroup names it (the pod's containers share a PID namespace).
            cmd: vec!["cat".into(), "/proc/self/cgroup".into()],
            stdout: true,
            stderr: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .url;
    remove_container(&mut rt, &x).await;
    // A new container whose id starts as x's did (1 in 16 do).
    let mut y = None;
    for i in 0..300 {
        let c = run_container(
            &mut rt,
            &pod,
            &cfg,
            container_config(&format!("y{i}"), &["sleep", "601"]),
        )
        .await;
        if c.starts_with(&prefix) {
            y = Some(c);
            break;
        }
        remove_container(&mut rt, &c).await;
    }
    let y = y.expect("a container id with the same first digit in 300 tries");
    let out = tokio::process::Command::new(&client)
        .args(["exec", &url])
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && !stdout.contains(&y),
        "the session ran in {y}: {:?} {stdout:?} {:?}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Mount propagation as CRI asks it: a host mount made under a volume after the containers
/// started reaches the container that mounted the volume HostToContainer (rslave), and not the
/// one that mounted it Private (rprivate, kubelet's default).
#[tokio::test(flavor = "multi_thread")]
async fn a_private_volume_does_not_receive_later_host_mounts() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    let vol = host.path().join("vol");
    std::fs::create_dir(&vol).unwrap();
    let mut mounts = support::HostMounts::default();
    mounts.shared(&vol);
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("propagation", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let with_volume = |name: &str, propagation: cri::MountPropagation| {
        let mut cc = container_config(name, &["sleep", "60"]);
        cc.mounts = vec![cri::Mount {
            container_path: "/vol".into(),
            host_path: vol.display().to_string(),
            propagation: propagation as i32,
            ..Default::default()
        }];
        cc
    };
    let private = with_volume("private", cri::MountPropagation::PropagationPrivate);
    let private = run_container(&mut rt, &pod, &cfg, private).await;
    let slave = with_volume("slave", cri::MountPropagation::PropagationHostToContainer);
    let slave = run_container(&mut rt, &pod, &cfg, slave).await;
    // Both in one container: the HostToContainer volume makes its root a slave, and
    // libcontainer would give the Private one the root's propagation.
    let mut both = with_volume("both", cri::MountPropagation::PropagationHostToContainer);
    both.mounts.push(cri::Mount {
        container_path: "/private".into(),
        host_path: vol.display().to_string(),
        propagation: cri::MountPropagation::PropagationPrivate as i32,
        ..Default::default()
    });
    let both = run_container(&mut rt, &pod, &cfg, both).await;
    let sub = vol.join("sub");
    std::fs::create_dir(&sub).unwrap();
    mounts.tmpfs(&sub, None);
    std::fs::write(sub.join("marker"), "from the host").unwrap();
    let read = "cat /vol/sub/marker 2>/dev/null || echo absent";
    assert_eq!(exec(&mut rt, &slave, read).await, "from the host");
    assert_eq!(exec(&mut rt, &private, read).await, "absent");
    assert_eq!(exec(&mut rt, &both, read).await, "from the host");
    assert_eq!(
        exec(
            &mut rt,
            &both,
            "cat /private/sub/marker 2>/dev/null || echo absent"
        )
        .await,
        "absent"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A plugin's shape: a HostToContainer volume with a Bidirectional one below it (kubelet's
/// directory and its pods' volumes). Each keeps its own propagation though libcontainer gives
/// both the root's: the inner one still sends the container's mounts to the host, the outer
/// one still receives the host's.
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_below_another_keeps_its_own_propagation() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    let outer = host.path().join("kubelet");
    let inner = outer.join("pods");
    let mut mounts = support::HostMounts::default();
    std::fs::create_dir(&outer).unwrap();
    // Shared mounts, as kubelet requires of a Bidirectional volume's source.
    for dir in [&outer, &inner] {
        std::fs::create_dir_all(dir).unwrap();
        mounts.shared(dir);
    }
    std::fs::create_dir(inner.join("made-inside")).unwrap();
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = pod_config("nested-propagation", logs.path());
    cfg.sc().privileged = true;
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = container_config("plugin", &["sleep", "60"]);
    cc.sc().privileged = true;
    cc.mounts = vec![
        cri::Mount {
            container_path: "/var/lib/kubelet".into(),
            host_path: outer.display().to_string(),
            propagation: cri::MountPropagation::PropagationHostToContainer as i32,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/var/lib/kubelet/pods".into(),
            host_path: inner.display().to_string(),
            propagation: cri::MountPropagation::PropagationBidirectional as i32,
            ..Default::default()
        },
    ];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    // The container's mount below the Bidirectional volume reaches the host.
    exec(
        &mut rt,
        &id,
        "mount -t tmpfs none /var/lib/kubelet/pods/made-inside && echo x > /var/lib/kubelet/pods/made-inside/marker",
    )
    .await;
    mounts.adopt(&inner.join("made-inside"));
    support::wait_for(
        "the container's mount to reach the host",
        Duration::from_secs(10),
        || inner.join("made-inside/marker").exists(),
    )
    .await;
    // The host's mount below the HostToContainer volume reaches the container.
    let sub = outer.join("sub");
    std::fs::create_dir(&sub).unwrap();
    mounts.tmpfs(&sub, None);
    std::fs::write(sub.join("marker"), "from the host").unwrap();
    assert_eq!(
        exec(&mut rt, &id, "cat /var/lib/kubelet/sub/marker").await,
        "from the host"
    );
    remove_pod(&mut rt, &pod).await;
    drop(mounts);
    assert_no_leaks(&h, &pod);
}

/// A pod with a user namespace of its own (kubelet's `hostUsers: false`, CRI mode POD): its
/// processes are the host IDs it maps, never the host's root; the image's files, its volumes
/// and hako's pod files are its root's through ID-mapped mounts, and what it writes to a volume
/// lands as the host's root's; exec runs in the same namespace; nothing is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_with_its_own_user_namespace_runs_as_the_host_ids_it_maps() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let mut rt = h.runtime().await;
    let status = rt
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    assert!(
        status
            .runtime_handlers
            .iter()
            .all(|h| h.features.as_ref().is_some_and(|f| f.user_namespaces)),
        "{:?}: {}",
        status.runtime_handlers,
        h.log_text()
            .lines()
            .filter(|l| l.contains("user namespaces"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let vol = tempfile::tempdir().unwrap();
    std::fs::write(vol.path().join("from-host"), "x").unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = pod_config("userns", logs.path());
    let map = vec![cri::IdMapping {
        container_id: 0,
        host_id: 165536,
        length: 65536,
    }];
    let ns = cri::NamespaceOption {
        userns_options: Some(cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids: map.clone(),
            gids: map,
        }),
        ..Default::default()
    };
    cfg.sc().namespace_options = Some(ns.clone());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = container_config("c", &["sleep", "600"]);
    cc.sc().namespace_options = Some(ns.clone());
    // CAP_SYS_ADMIN in its user namespace, which a pod may add: it may mount, but not make
    // a read-only volume writable.
    cc.sc().capabilities = Some(cri::Capability {
        add_capabilities: vec!["SYS_ADMIN".into()],
        ..Default::default()
    });
    let ro = tempfile::tempdir().unwrap();
    cc.mounts = vec![
        cri::Mount {
            container_path: "/vol".into(),
            host_path: vol.path().display().to_string(),
            ..Default::default()
        },
        cri::Mount {
            container_path: "/ro".into(),
            host_path: ro.path().display().to_string(),
            readonly: true,
            ..Default::default()
        },
    ];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    let remount = exec(
        &mut rt,
        &id,
        "mount -o remount,bind,rw /ro 2>/dev/null; touch /ro/x 2>/dev/null; echo $?",
    )
    .await;
    assert_eq!(remount, "1", "the read-only volume was made writable");
    assert!(!ro.path().join("x").exists());
    let uid_map = exec(&mut rt, &id, "cat /proc/self/uid_map /proc/self/gid_map").await;
    let fields: Vec<Vec<&str>> = uid_map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        fields,
        [["0", "165536", "65536"], ["0", "165536", "65536"]],
        "{uid_map}"
    );
    // Its root owns its image's files, its volume, the host's files in it and /etc/hosts.
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "stat -c %u:%g / /bin /vol /vol/from-host /etc/hosts"
        )
        .await,
        "0:0\n0:0\n0:0\n0:0\n0:0"
    );
    // It writes as its root: to its rootfs and its volume, which the host sees as root's.
    let wrote = exec(
        &mut rt,
        &id,
        "echo y > /vol/from-container && echo z > /written && id -u",
    )
    .await;
    // The exec's process is the namespace's root (the host's root, unmapped, would show as
    // 65534 and could not have written through the ID mapping).
    assert_eq!(wrote, "0");
    let meta = std::fs::metadata(vol.path().join("from-container")).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.gid()), (0, 0));
    // On the host, its processes are the mapped IDs.
    let pid = container_pid(&mut rt, &id).await;
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let ids = |key: &str| {
        st.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.split_whitespace().collect::<Vec<_>>())
            .unwrap()
    };
    assert_eq!(ids("Uid:"), ["165536"; 4], "{st}");
    assert_eq!(ids("Gid:"), ["165536"; 4], "{st}");
    // The daemon killed and started again: the pod's user namespace is still its containers',
    // for an exec and for a new container.
    h.kill9();
    h.restart();
    let mut rt = h.runtime().await;
    let uid_map = |out: String| {
        out.split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        uid_map(exec(&mut rt, &id, "cat /proc/self/uid_map").await),
        ["0", "165536", "65536"]
    );
    let mut cc = container_config("after-restart", &["sleep", "600"]);
    cc.sc().namespace_options = Some(ns.clone());
    let again = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(
        uid_map(exec(&mut rt, &again, "cat /proc/self/uid_map").await),
        ["0", "165536", "65536"]
    );
    // A container asking for another user namespace than its pod's, or none, is refused.
    for other in [None, Some(cri::NamespaceOption::default())] {
        let mut cc = container_config("other", &["sleep", "600"]);
        cc.sc().namespace_options = other;
        let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("is not its pod's"), "{e:?}");
    }
    // What cannot be ID-mapped here (an image volume's overlay, a mount on /dev made after
    // the create) is refused, naming it.
    for (m, why) in [
        (
            cri::Mount {
                container_path: "/img".into(),
                image: Some(cri::ImageSpec {
                    image: IMAGE.into(),
                    ..Default::default()
                }),
                readonly: true,
                ..Default::default()
            },
            "image volume /img",
        ),
        (
            cri::Mount {
                container_path: "/dev".into(),
                host_path: vol.path().display().to_string(),
                ..Default::default()
            },
            "a mount on /dev",
        ),
    ] {
        let mut cc = container_config("unmappable", &["sleep", "600"]);
        cc.sc().namespace_options = Some(ns.clone());
        cc.mounts = vec![m];
        let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(why), "{e:?}");
    }
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
    // As kubelet makes pods, each container with a PID namespace of its own (made in the
    // user namespace) instead of the pod's shared one.
    let mut ns = ns;
    ns.pid = cri::NamespaceMode::Container as i32;
    let mut cfg = pod_config("userns-pid", logs.path());
    cfg.sc().namespace_options = Some(ns.clone());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = container_config("c", &["sleep", "600"]);
    cc.sc().namespace_options = Some(ns);
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "cat /proc/self/uid_map; echo $$; stat -c %u /proc/1"
        )
        .await
        .split_whitespace()
        .collect::<Vec<_>>()[..3],
        ["0", "165536", "65536"]
    );
    let pid = container_pid(&mut rt, &id).await;
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        st.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["Uid:", "165536", "165536", "165536", "165536"]),
        "{st}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A volume below a Private one, in a container whose root is shared (it has a Bidirectional
/// volume): the inner volume is mounted into the outer one's mount in the container, and must
/// not be propagated to the outer volume's source on the host (which kubelet's hostPath may
/// have on a shared mount, as systemd makes `/`): there it would outlive the container.
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_inside_a_private_one_does_not_reach_the_host() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    let (outer, inner, bidir) = (
        host.path().join("outer"),
        host.path().join("inner"),
        host.path().join("bidir"),
    );
    let mut mounts = support::HostMounts::default();
    for dir in [&outer, &inner, &bidir] {
        std::fs::create_dir(dir).unwrap();
    }
    mounts.shared(&outer);
    mounts.shared(&bidir);
    std::fs::create_dir(outer.join("sub")).unwrap();
    std::fs::write(inner.join("marker"), "inner").unwrap();
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = pod_config("inner-volume", logs.path());
    cfg.sc().privileged = true;
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = container_config("c", &["sleep", "60"]);
    cc.sc().privileged = true;
    cc.mounts = vec![
        cri::Mount {
            container_path: "/bidir".into(),
            host_path: bidir.display().to_string(),
            propagation: cri::MountPropagation::PropagationBidirectional as i32,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/data".into(),
            host_path: outer.display().to_string(),
            ..Default::default()
        },
        cri::Mount {
            container_path: "/data/sub".into(),
            host_path: inner.display().to_string(),
            ..Default::default()
        },
    ];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(exec(&mut rt, &id, "cat /data/sub/marker").await, "inner");
    let leaked = |mountinfo: &str| {
        let sub = outer.join("sub").display().to_string();
        mountinfo
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(sub.as_str()))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let now = leaked(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    // Each one leaked is unmounted when the test ends, whatever it found.
    for _ in &now {
        mounts.adopt(&outer.join("sub"));
    }
    assert!(now.is_empty(), "the inner volume reached the host: {now:?}");
    // The copies the create bound from are gone from the host once it is made.
    let staged: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&format!("/{id}/staged/")))
        .map(str::to_string)
        .collect();
    assert!(
        staged.is_empty(),
        "staged copies left on the host: {staged:?}"
    );
    assert!(
        !outer.join("sub/marker").exists(),
        "the host sees the inner volume in the outer one's source"
    );
    remove_pod(&mut rt, &pod).await;
    drop(mounts);
    assert_no_leaks(&h, &pod);
}

/// The mounts on /dev made after the create, seen by a security review (each seen failing
/// before its fix): a /dev shared with the host (Bidirectional) does not get the
/// container's own shared memory, message queues and terminals moved onto it, which would
/// have been copied to the host's /dev; a read-only source below /dev takes no mount point
/// made in it on the host. And a private /dev under a shared root stays private (it lands on
/// libcontainer's /dev, which is not shared: were it, it would become shared there).
#[tokio::test(flavor = "multi_thread")]
async fn mounts_on_dev_keep_the_containers_own_off_the_host_and_read_only_sources_untouched() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    let mut mounts = support::HostMounts::default();
    let (dev, bidir, ro, empty) = (
        host.path().join("dev"),
        host.path().join("bidir"),
        host.path().join("ro"),
        host.path().join("empty"),
    );
    for d in [&dev, &bidir, &ro, &empty] {
        std::fs::create_dir(d).unwrap();
    }
    for d in ["shm", "pts", "mqueue"] {
        std::fs::create_dir(dev.join(d)).unwrap();
    }
    // Shared, as the host's /dev is under systemd.
    mounts.shared(&dev);
    mounts.shared(&bidir);
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let mut cfg = pod_config("devshared", logs.path());
    cfg.sc().privileged = true;
    let pod = run_pod(&mut rt, &cfg).await;
    let below_dev = |mountinfo: &str| -> Vec<String> {
        let prefix = format!("{}/", dev.display());
        mountinfo
            .lines()
            .filter(|l| l.split(' ').nth(4).is_some_and(|p| p.starts_with(&prefix)))
            .map(str::to_string)
            .collect()
    };

    let mut cc = container_config("shared", &["sleep", "60"]);
    cc.tty = true;
    cc.sc().privileged = true;
    cc.mounts = vec![cri::Mount {
        container_path: "/dev".into(),
        host_path: dev.display().to_string(),
        propagation: cri::MountPropagation::PropagationBidirectional as i32,
        ..Default::default()
    }];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    let leaked = below_dev(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
    for l in &leaked {
        mounts.adopt(std::path::Path::new(l.split(' ').nth(4).unwrap()));
    }
    assert!(
        leaked.is_empty(),
        "the container's own mounts reached the host: {leaked:?}"
    );
    // The /dev given is the container's, shared with the host both ways.
    exec(&mut rt, &id, "echo from-container > /dev/marker").await;
    assert_eq!(
        std::fs::read_to_string(dev.join("marker")).unwrap(),
        "from-container\n"
    );

    // A private /dev beside a Bidirectional volume (a shared root): private in the container.
    let mut cc = container_config("private", &["sleep", "60"]);
    cc.sc().privileged = true;
    cc.mounts = vec![
        cri::Mount {
            container_path: "/bidir".into(),
            host_path: bidir.display().to_string(),
            propagation: cri::MountPropagation::PropagationBidirectional as i32,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev".into(),
            host_path: empty.display().to_string(),
            ..Default::default()
        },
    ];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    let dev_line = exec(&mut rt, &id, "grep ' /dev ' /proc/self/mountinfo").await;
    assert!(!dev_line.contains("shared:"), "{dev_line}");
    assert!(exec(&mut rt, &id, "grep ' /bidir ' /proc/self/mountinfo")
        .await
        .contains("shared:"));

    // A read-only source below /dev: the termination log's mount point is not made in it.
    let log = host.path().join("ro.log");
    std::fs::write(&log, "").unwrap();
    let mut cc = container_config("readonly", &["sleep", "60"]);
    cc.mounts = vec![
        cri::Mount {
            container_path: "/dev".into(),
            host_path: empty.display().to_string(),
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/x".into(),
            host_path: ro.display().to_string(),
            readonly: true,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/x/nologin".into(),
            host_path: log.display().to_string(),
            ..Default::default()
        },
    ];
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert!(e.message().contains("/dev/x/nologin"), "{e:?}");
    assert!(
        !ro.join("nologin").exists(),
        "a mount point was made in the read-only source"
    );
    remove_pod(&mut rt, &pod).await;
    drop(mounts);
    assert_no_leaks(&h, &pod);
}

/// A host directory mounted on /dev (a CSI or device plugin's hostPath /dev), however spelt,
/// is what the container sees there, with the mounts below /dev on top of it (kubelet's
/// termination log); and what libcontainer makes in /dev (links, device nodes, `ptmx`) is not
/// made in it: not in a directory given, not in the host's own /dev.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_directory_on_dev_is_mounted_over_what_libcontainer_made() {
    use std::os::unix::fs::FileTypeExt;
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = pod_config("devmount", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let host = tempfile::tempdir().unwrap();
    let listing = |dir: &std::path::Path| {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    for (i, dest) in ["/dev", "//dev/.", "/tmp/../dev"].into_iter().enumerate() {
        let dev = host.path().join(format!("dev{i}"));
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(dev.join("marker"), dest).unwrap();
        let log = host.path().join(format!("log{i}"));
        std::fs::write(&log, "").unwrap();
        let mut cc = container_config(&format!("c{i}"), &["sleep", "60"]);
        cc.mounts = vec![
            // Given first, as kubelet does: it still lands on the /dev mount.
            cri::Mount {
                container_path: "/dev/termination-log".into(),
                host_path: log.display().to_string(),
                ..Default::default()
            },
            cri::Mount {
                container_path: dest.into(),
                host_path: dev.display().to_string(),
                ..Default::default()
            },
        ];
        let id = run_container(&mut rt, &pod, &cfg, cc).await;
        assert_eq!(exec(&mut rt, &id, "cat /dev/marker").await, dest);
        exec(&mut rt, &id, "echo done > /dev/termination-log").await;
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "done\n", "{dest}");
        // Besides the marker, only the mount points of the termination log and of the
        // container's own shared memory, as a bind on /dev gets from runc: no fd, stdin,
        // kcore, ptmx, null...
        assert_eq!(
            listing(&dev),
            ["marker", "shm", "termination-log"],
            "{dest}"
        );
        // The container's own shared memory, not the directory's.
        exec(&mut rt, &id, "echo x > /dev/shm/own").await;
        assert!(!dev.join("shm/own").exists(), "{dest}");
    }

    // A mount point that is a symlink in the directory given: refused with its reason, and
    // the container created meanwhile is gone with everything it had.
    let dev = host.path().join("linked");
    std::fs::create_dir(&dev).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", dev.join("termination-log")).unwrap();
    let log = host.path().join("linked.log");
    std::fs::write(&log, "").unwrap();
    let mut cc = container_config("linked", &["sleep", "60"]);
    cc.mounts = vec![
        cri::Mount {
            container_path: "/dev".into(),
            host_path: dev.display().to_string(),
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/termination-log".into(),
            host_path: log.display().to_string(),
            ..Default::default()
        },
    ];
    let before = all_containers(&mut rt).await.len();
    let sorted = |mut v: Vec<std::path::PathBuf>| {
        v.sort();
        v
    };
    let cgroups = sorted(container_cgroups(&pod));
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("/dev/termination-log is a symlink"),
        "{e:?}"
    );
    assert_eq!(all_containers(&mut rt).await.len(), before);
    assert_eq!(
        sorted(container_cgroups(&pod)),
        cgroups,
        "the failed container's cgroups are gone"
    );

    // The host's own /dev: its devices are there, and its ptmx is still its device.
    let ptmx = std::fs::symlink_metadata("/dev/ptmx").unwrap();
    assert!(ptmx.file_type().is_char_device());
    let before = listing(std::path::Path::new("/dev"));
    let log = host.path().join("hostdev.log");
    std::fs::write(&log, "").unwrap();
    let mut cc = container_config("hostdev", &["sleep", "60"]);
    // With a terminal: its pty and console are its own, over the host's.
    cc.tty = true;
    // Read-only, with kubelet's termination log below it (its mount point is made in the
    // host's /dev, as runc makes it).
    cc.mounts = vec![
        cri::Mount {
            container_path: "/dev".into(),
            host_path: "/dev".into(),
            readonly: true,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/termination-log".into(),
            host_path: log.display().to_string(),
            ..Default::default()
        },
    ];
    let had_log = std::path::Path::new("/dev/termination-log").exists();
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    exec(&mut rt, &id, "echo done > /dev/termination-log").await;
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "done\n");
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "test -c /dev/pts/0 && test -c /dev/console && ls /dev/pts"
        )
        .await,
        "0\nptmx"
    );
    // Its own shared memory, not the node's.
    exec(&mut rt, &id, "echo x > /dev/shm/hako-test-own-shm").await;
    assert!(!std::path::Path::new("/dev/shm/hako-test-own-shm").exists());
    assert_eq!(
        exec(&mut rt, &id, "test -c /dev/loop-control && echo yes").await,
        "yes"
    );
    assert_eq!(
        exec(&mut rt, &id, "touch /dev/x 2>&1 || echo refused")
            .await
            .lines()
            .last(),
        Some("refused"),
        "readOnly holds"
    );
    let mut after = listing(std::path::Path::new("/dev"));
    after.retain(|n| n != "termination-log" || had_log);
    assert_eq!(after, before);
    assert!(std::fs::symlink_metadata("/dev/ptmx")
        .unwrap()
        .file_type()
        .is_char_device());
    remove_pod(&mut rt, &pod).await;
    if !had_log {
        // Once no container has it as a mount point.
        let _ = std::fs::remove_file("/dev/termination-log");
    }
    assert_no_leaks(&h, &pod);
}
