//! Cancellation and concurrency end to end: kubelet cancels calls on its own timeouts and
//! retries them under the same name, and asks for status while it removes. Whatever a client
//! does, a lifecycle change runs to completion (or is fully undone): the object is then listed
//! and removable, or gone with nothing left, and a retry succeeds. A removed container never
//! comes back.

mod support;

use std::future::Future;
use std::time::Duration;

use hako_proto::cri;
use support::cri::*;

/// Where the sweep cancels: densely while the call does its work (a RunPodSandbox or
/// CreateContainer takes some tens of ms here), sparser after.
fn delays() -> Vec<Duration> {
    (0..60)
        .chain([50, 65, 80, 100, 130, 170, 220, 300])
        .map(Duration::from_millis)
        .collect()
}

/// Runs `call` and gives up on it after `after`: round `i` even sends a gRPC deadline (the
/// server drops the handler), odd drops the call (the connection resets the stream), the two
/// ways kubelet's calls end early.
async fn cancel_after<T, F: Future<Output = Result<T, tonic::Status>>>(
    i: usize,
    after: Duration,
    call: impl FnOnce(Option<Duration>) -> F,
) -> Option<T> {
    if i % 2 == 0 {
        call(Some(after)).await.ok()
    } else {
        tokio::time::timeout(after, call(None)).await.ok()?.ok()
    }
}

/// Processes whose command line names the daemon's state dir: pod monitors (their options
/// name their pod's directory) and what they forked.
fn processes_naming(dir: &std::path::Path) -> Vec<String> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let c = std::fs::read(e.path().join("cmdline")).ok()?;
            let c = String::from_utf8_lossy(&c).replace('\0', " ");
            c.contains(&needle)
                .then(|| format!("{}: {c}", e.file_name().to_string_lossy()))
        })
        .collect()
}

/// Waits until no process names the daemon's state dir; fails naming what is left.
async fn wait_no_processes(h: &support::hako::Hako, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_naming(&h.state);
        if left.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: processes of the daemon's pods left after 10 s: {left:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn pods_named(rt: &mut Rt, name: &str) -> Vec<String> {
    rt.list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items
        .into_iter()
        .filter(|p| p.metadata.as_ref().is_some_and(|m| m.name == name))
        .map(|p| p.id)
        .collect()
}

async fn container_ids(rt: &mut Rt) -> Vec<String> {
    all_containers(rt).await.into_iter().map(|c| c.id).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_run_pod_sandbox_is_finished_or_undone_and_its_retry_succeeds() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cancelled", logs.path());
    for (i, d) in delays().into_iter().enumerate() {
        let first = cancel_after(i, d, |deadline| {
            let mut req = tonic::Request::new(cri::RunPodSandboxRequest {
                config: Some(cfg.clone()),
                runtime_handler: String::new(),
            });
            if let Some(t) = deadline {
                req.set_timeout(t);
            }
            let mut rt = rt.clone();
            async move { rt.run_pod_sandbox(req).await }
        })
        .await;
        // kubelet's retry: waits for the cancelled call's work and gets what it made.
        let id = run_pod(&mut rt, &cfg).await;
        if let Some(r) = first {
            assert_eq!(r.into_inner().pod_sandbox_id, id, "round {i} ({d:?})");
        }
        assert_eq!(
            pods_named(&mut rt, "cancelled").await,
            vec![id.clone()],
            "round {i} ({d:?}): one sandbox for the name"
        );
        remove_pod(&mut rt, &id).await;
        assert!(pods_named(&mut rt, "cancelled").await.is_empty());
        wait_no_processes(&h, &format!("round {i} ({d:?})")).await;
        assert_no_leaks(&h, &id);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cancelled_create_container_is_finished_or_undone_and_its_retry_succeeds() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("creates", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let cc = container_config("c", &["sleep", "60"]);
    let create = |rt: &Rt, deadline: Option<Duration>| {
        let mut req = tonic::Request::new(cri::CreateContainerRequest {
            pod_sandbox_id: pod.clone(),
            config: Some(cc.clone()),
            sandbox_config: Some(cfg.clone()),
        });
        if let Some(t) = deadline {
            req.set_timeout(t);
        }
        let mut rt = rt.clone();
        async move { rt.create_container(req).await }
    };
    for (i, d) in delays().into_iter().enumerate() {
        let first = cancel_after(i, d, |deadline| create(&rt, deadline)).await;
        let id = create(&rt, None)
            .await
            .unwrap_or_else(|e| panic!("round {i} ({d:?}): retry of the create: {e}"))
            .into_inner()
            .container_id;
        if let Some(r) = first {
            assert_eq!(r.into_inner().container_id, id, "round {i} ({d:?})");
        }
        assert_eq!(
            container_ids(&mut rt).await,
            vec![id.clone()],
            "round {i} ({d:?})"
        );
        // Exactly the listed container holds a cgroup in the pod: a create the cancel cut
        // short would have left one nobody lists.
        let cgroups = container_cgroups(&pod);
        assert!(
            cgroups.iter().all(|p| p.ends_with(format!("hako-{id}"))),
            "round {i} ({d:?}): cgroups of containers nobody lists: {cgroups:?}"
        );
        rt.remove_container(cri::RemoveContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
        assert!(container_ids(&mut rt).await.is_empty());
        support::wait_for(
            &format!("round {i} ({d:?}): the pod's container cgroups to go"),
            Duration::from_secs(10),
            || container_cgroups(&pod).is_empty(),
        )
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(&h.state.join("containers").display().to_string()),
            "round {i} ({d:?}): a container rootfs is still mounted"
        );
        for dir in [h.state.join("containers"), h.root.join("containers")] {
            let left = support::hako::Hako::files_under(&dir);
            assert!(
                left.is_empty(),
                "round {i} ({d:?}): {} left: {left:?}",
                dir.display()
            );
        }
    }
    remove_pod(&mut rt, &pod).await;
    wait_no_processes(&h, "at the end").await;
    assert_no_leaks(&h, &pod);
}

/// One call that may race a removal: NotFound is what it deserves once the removal won.
async fn racing(mut rt: Rt, id: String, kind: usize) -> Result<(), tonic::Status> {
    let r = match kind % 3 {
        0 => rt
            .list_containers(cri::ListContainersRequest::default())
            .await
            .map(|_| ()),
        1 => rt
            .container_status(cri::ContainerStatusRequest {
                container_id: id,
                verbose: false,
            })
            .await
            .map(|_| ()),
        _ => rt
            .update_container_resources(cri::UpdateContainerResourcesRequest {
                container_id: id,
                linux: Some(cri::LinuxContainerResources {
                    cpu_shares: 512,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .map(|_| ()),
    };
    match r {
        Err(e) if e.code() == tonic::Code::NotFound => Ok(()),
        r => r,
    }
}

/// Removes `ids` while other clients keep reading and updating them (ContainerStatus,
/// ListContainers and UpdateContainerResources write a record back), until every removal
/// answered; then none of them may be listed or found again.
async fn remove_while_racing(rt: &mut Rt, ids: &[String], round: usize) {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hammers = Vec::new();
    for (k, id) in ids
        .iter()
        .enumerate()
        .flat_map(|(n, id)| (0..3).map(move |k| (n * 3 + k, id)))
    {
        let (rt, id, stop) = (rt.clone(), id.clone(), stop.clone());
        hammers.push(tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                racing(rt.clone(), id.clone(), k).await?;
            }
            Ok::<_, tonic::Status>(())
        }));
    }
    let mut removals = Vec::new();
    for id in ids {
        let mut rt = rt.clone();
        let id = id.clone();
        removals.push(tokio::spawn(async move {
            rt.remove_container(cri::RemoveContainerRequest { container_id: id })
                .await
        }));
    }
    for r in removals {
        r.await.unwrap().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in hammers {
        h.await.unwrap().unwrap();
    }
    let listed = container_ids(rt).await;
    for id in ids {
        assert!(
            !listed.contains(id),
            "round {round}: removed container {id} is listed again"
        );
        let err = rt
            .container_status(cri::ContainerStatusRequest {
                container_id: id.clone(),
                verbose: false,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "round {round}: {err:?}");
    }
}

/// Status, list and update refresh or change a record and write it back; racing
/// RemoveContainer, that write must never bring the removed record back. In a running pod the
/// records are stale (the containers exited since their start), so reads have a change to
/// write; in a stopped pod nothing slows the read-modify-write of an update.
#[tokio::test(flavor = "multi_thread")]
async fn a_removed_container_never_comes_back_under_concurrent_status_calls() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("race", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    for round in 0..8 {
        let mut ids = Vec::new();
        for n in 0..4 {
            let cc = container_config(&format!("c{round}-{n}"), &["true"]);
            ids.push(run_container(&mut rt, &pod, &cfg, cc).await);
        }
        remove_while_racing(&mut rt, &ids, round).await;
    }
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
    for round in 8..16 {
        let mut cfg = pod_config("race-stopped", logs.path());
        cfg.metadata.as_mut().unwrap().attempt = round as u32;
        let pod = run_pod(&mut rt, &cfg).await;
        let mut ids = Vec::new();
        for n in 0..4 {
            let cc = container_config(&format!("c{n}"), &["true"]);
            ids.push(run_container(&mut rt, &pod, &cfg, cc).await);
        }
        rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
        remove_while_racing(&mut rt, &ids, round).await;
        remove_pod(&mut rt, &pod).await;
        assert_no_leaks(&h, &pod);
    }
}
