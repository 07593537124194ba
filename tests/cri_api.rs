//! What Kubernetes 1.37's CRI asks beyond 1.32's, end to end against a real hako: the
//! streamed lists (kubelet's CRIListStreaming), UpdatePodSandboxResources, mount options,
//! environment values as bytes, and clear refusals for what hako does not do (image volumes,
//! pod checkpoints).

mod support;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;

use futures::StreamExt;
use hako_proto::cri;
use support::cri::*;

/// Every item of a stream, checking that no response is empty.
async fn drain<T>(mut s: tonic::Streaming<T>, items: impl Fn(T) -> Vec<String>) -> Vec<String> {
    let mut all = Vec::new();
    while let Some(r) = s.next().await {
        let got = items(r.unwrap());
        assert!(!got.is_empty(), "a streamed list sent an empty response");
        all.extend(got);
    }
    all
}

/// `ids` as a set, checking that none came twice.
fn once(ids: Vec<String>) -> BTreeSet<String> {
    let set: BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(set.len(), ids.len(), "an item came twice: {ids:?}");
    set
}

#[tokio::test(flavor = "multi_thread")]
async fn streamed_lists_hold_exactly_what_the_lists_hold() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let mut pods = Vec::new();
    for name in ["stream-a", "stream-b"] {
        let cfg = pod_config(name, logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        for c in ["one", "two"] {
            run_container(&mut rt, &pod, &cfg, container_config(c, &["sleep", "600"])).await;
        }
        pods.push(pod);
    }

    let listed_pods = |f: Option<cri::PodSandboxFilter>| {
        let mut rt = rt.clone();
        async move {
            once(
                rt.list_pod_sandbox(cri::ListPodSandboxRequest { filter: f })
                    .await
                    .unwrap()
                    .into_inner()
                    .items
                    .into_iter()
                    .map(|p| p.id)
                    .collect(),
            )
        }
    };
    let streamed_pods = |f: Option<cri::PodSandboxFilter>| {
        let mut rt = rt.clone();
        async move {
            let s = rt
                .stream_pod_sandboxes(cri::StreamPodSandboxesRequest { filter: f })
                .await
                .unwrap()
                .into_inner();
            once(drain(s, |r| r.pod_sandboxes.into_iter().map(|p| p.id).collect()).await)
        }
    };
    let by_label = Some(cri::PodSandboxFilter {
        label_selector: [("app".to_string(), "stream-b".to_string())].into(),
        ..Default::default()
    });
    assert_eq!(streamed_pods(None).await, listed_pods(None).await);
    assert_eq!(streamed_pods(None).await.len(), 2);
    assert_eq!(
        streamed_pods(by_label.clone()).await,
        BTreeSet::from([pods[1].clone()])
    );

    let container_filter = Some(cri::ContainerFilter {
        pod_sandbox_id: pods[0].clone(),
        ..Default::default()
    });
    for f in [None, container_filter] {
        let listed = once(
            rt.list_containers(cri::ListContainersRequest { filter: f.clone() })
                .await
                .unwrap()
                .into_inner()
                .containers
                .into_iter()
                .map(|c| c.id)
                .collect(),
        );
        let s = rt
            .stream_containers(cri::StreamContainersRequest { filter: f.clone() })
            .await
            .unwrap()
            .into_inner();
        let streamed = once(drain(s, |r| r.containers.into_iter().map(|c| c.id).collect()).await);
        assert_eq!(streamed, listed, "filter {f:?}");
        assert_eq!(streamed.len(), if f.is_some() { 2 } else { 4 });

        let stats_filter = f.as_ref().map(|f| cri::ContainerStatsFilter {
            pod_sandbox_id: f.pod_sandbox_id.clone(),
            ..Default::default()
        });
        let s = rt
            .stream_container_stats(cri::StreamContainerStatsRequest {
                filter: stats_filter,
            })
            .await
            .unwrap()
            .into_inner();
        let stats = once(
            drain(s, |r| {
                r.container_stats
                    .into_iter()
                    .map(|s| s.attributes.unwrap().id)
                    .collect()
            })
            .await,
        );
        assert_eq!(stats, listed, "stats, filter {f:?}");
    }

    let s = rt
        .stream_pod_sandbox_stats(cri::StreamPodSandboxStatsRequest {
            filter: Some(cri::PodSandboxStatsFilter {
                id: pods[1].clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    let stats = drain(s, |r| {
        r.pod_sandbox_stats
            .into_iter()
            .map(|s| s.attributes.unwrap().id)
            .collect()
    })
    .await;
    assert_eq!(stats, vec![pods[1].clone()]);

    let mut images = h.images().await;
    let listed: BTreeSet<String> = images
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images
        .into_iter()
        .map(|i| i.id)
        .collect();
    assert!(!listed.is_empty());
    let s = images
        .stream_images(cri::StreamImagesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let streamed = once(drain(s, |r| r.images.into_iter().map(|i| i.id).collect()).await);
    assert_eq!(streamed, listed);

    // A filter that matches nothing: the stream ends without a response.
    let s = rt
        .stream_containers(cri::StreamContainersRequest {
            filter: Some(cri::ContainerFilter {
                id: "f".repeat(64),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        drain(s, |r| r.containers.into_iter().map(|c| c.id).collect())
            .await
            .is_empty()
    );

    for pod in &pods {
        remove_pod(&mut rt, pod).await;
    }
    for pod in &pods {
        assert_no_leaks(&h, pod);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_resources_updates_and_what_hako_does_not_do_get_clear_answers() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("resize", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;

    let resources = Some(cri::LinuxContainerResources {
        cpu_shares: 512,
        memory_limit_in_bytes: 256 << 20,
        ..Default::default()
    });
    rt.update_pod_sandbox_resources(cri::UpdatePodSandboxResourcesRequest {
        pod_sandbox_id: pod.clone(),
        overhead: None,
        resources: resources.clone(),
    })
    .await
    .unwrap();
    let missing = "0123456789abcdef".repeat(4);
    let e = rt
        .update_pod_sandbox_resources(cri::UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: missing.clone(),
            overhead: None,
            resources,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains(&missing), "{e:?}");

    let e = rt
        .checkpoint_pod(cri::CheckpointPodRequest {
            pod_sandbox_id: pod.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    assert!(e.message().contains("CheckpointPod"), "{e:?}");
    let e = rt
        .stream_pod_sandbox_metrics(cri::StreamPodSandboxMetricsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");

    // An image volume is refused at create with the mount named, and leaves nothing.
    let mut cc = container_config("imgvol", &["sleep", "60"]);
    cc.mounts = vec![cri::Mount {
        container_path: "/models".into(),
        image: Some(cri::ImageSpec {
            image: IMAGE.into(),
            ..Default::default()
        }),
        readonly: true,
        ..Default::default()
    }];
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(e.code(), tonic::Code::Unimplemented, "{e:?}");
    assert!(
        e.message().contains("image volume") && e.message().contains("/models"),
        "{e:?}"
    );

    // Environment values are bytes in this CRI; one that is not UTF-8 is refused, naming the
    // variable, and one that is arrives as sent.
    let mut cc = container_config("env", &["sleep", "60"]);
    cc.envs = vec![cri::KeyValue {
        key: "BAD".into(),
        value: vec![b'a', 0xff, b'b'],
    }];
    let e = create_container_err(&mut rt, &pod, &cfg, cc.clone()).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("BAD") && e.message().contains("UTF-8"),
        "{e:?}"
    );
    cc.envs = vec![cri::KeyValue {
        key: "GOOD".into(),
        value: "grüße".as_bytes().to_vec(),
    }];
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(exec(&mut rt, &id, "echo $GOOD").await, "grüße");
    let listed = rt
        .list_containers(cri::ListContainersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert_eq!(listed.len(), 1, "only the env container: {listed:?}");

    let features = rt
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner()
        .features
        .unwrap();
    assert!(features.mount_options && !features.user_namespaces_host_network);

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn mount_options_reach_the_bind_mount_and_only_restrict() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    let script = data.path().join("run.sh");
    std::fs::write(&script, "#!/bin/sh\necho ran\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("mountopts", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let with = |name: &str, options: &[&str]| {
        let mut cc = container_config(name, &["sleep", "600"]);
        cc.mounts = vec![cri::Mount {
            container_path: "/data".into(),
            host_path: data.path().display().to_string(),
            mount_options: options.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }];
        cc
    };
    // The mount's flags as the container's mount table shows them.
    let flags = |line: String| -> BTreeSet<String> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields[5].split(',').map(str::to_string).collect()
    };

    let plain = run_container(&mut rt, &pod, &cfg, with("plain", &[])).await;
    assert_eq!(exec(&mut rt, &plain, "/data/run.sh").await, "ran");
    let f = flags(exec(&mut rt, &plain, "grep ' /data ' /proc/self/mountinfo").await);
    assert!(!f.contains("noexec") && !f.contains("nodev"), "{f:?}");

    let strict = run_container(
        &mut rt,
        &pod,
        &cfg,
        with("strict", &["noexec", "nodev", "nosuid"]),
    )
    .await;
    let out = exec(&mut rt, &strict, "/data/run.sh 2>&1; echo rc=$?").await;
    assert!(out.ends_with("rc=126"), "noexec did not hold: {out}");
    let f = flags(exec(&mut rt, &strict, "grep ' /data ' /proc/self/mountinfo").await);
    for want in ["noexec", "nodev", "nosuid"] {
        assert!(f.contains(want), "{want} missing from {f:?}");
    }

    // An option that would give something the volume does not have is refused, naming it.
    let e = create_container_err(&mut rt, &pod, &cfg, with("loose", &["nodev", "suid"])).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("suid") && e.message().contains("/data"),
        "{e:?}"
    );
    let listed = rt
        .list_containers(cri::ListContainersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert_eq!(listed.len(), 2, "only plain and strict: {listed:?}");

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
