//! What Kubernetes 1.37's CRI asks beyond 1.32's, end to end against a real hako: image
//! volumes and their sub paths, the streamed lists (kubelet's CRIListStreaming),
//! UpdatePodSandboxResources, mount options, environment values as bytes, and clear refusals
//! for what hako does not do (pod checkpoints).

mod support;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;

use futures::StreamExt;
use hako_proto::cri;
use support::cri::*;
use support::oci::{Compression, Image, ImageConf, Layer, Pusher, Tar};

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

/// Pods whose annotations add up to more than a client's default 4 MiB message limit: the
/// unary list cannot answer that client, the streamed one can, every pod once.
#[tokio::test(flavor = "multi_thread")]
async fn a_streamed_list_of_large_pods_fits_in_a_clients_message_limit() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let mut pods = BTreeSet::new();
    for i in 0..20 {
        let mut cfg = pod_config(&format!("annotated-{i}"), logs.path());
        // Within the 256 KiB Kubernetes allows a pod's annotations.
        cfg.annotations
            .insert("example.com/blob".into(), "x".repeat(250 << 10));
        pods.insert(run_pod(&mut rt, &cfg).await);
    }
    let e = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    let s = rt
        .stream_pod_sandboxes(cri::StreamPodSandboxesRequest { filter: None })
        .await
        .unwrap()
        .into_inner();
    let streamed = once(drain(s, |r| r.pod_sandboxes.into_iter().map(|p| p.id).collect()).await);
    assert_eq!(streamed, pods);
    for pod in &pods {
        remove_pod(&mut rt, pod).await;
    }
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
    // The metrics stream is built: kubelet's client takes an UNIMPLEMENTED from any Stream*
    // call as "no streamed lists here" for all of them.
    let metrics = rt
        .stream_pod_sandbox_metrics(cri::StreamPodSandboxMetricsRequest {})
        .await
        .unwrap()
        .into_inner();
    let streamed = drain(metrics, |r| {
        r.pod_sandbox_metrics
            .into_iter()
            .map(|m| m.pod_sandbox_id)
            .collect()
    })
    .await;
    assert!(streamed.contains(&pod), "{streamed:?}");

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
    let listed = all_containers(&mut rt).await;
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
    // A mount below the volume (exec, dev and suid allowed): the options hold there too.
    let sub = data.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let mut mounts = support::HostMounts::default();
    mounts.tmpfs(&sub, None);
    std::fs::copy(&script, sub.join("run.sh")).unwrap();
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
    assert_eq!(exec(&mut rt, &plain, "/data/sub/run.sh").await, "ran");
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
    let out = exec(&mut rt, &strict, "/data/sub/run.sh 2>&1; echo rc=$?").await;
    assert!(out.ends_with("rc=126"), "noexec did not hold below: {out}");
    for at in ["/data", "/data/sub"] {
        let line = exec(
            &mut rt,
            &strict,
            &format!("grep ' {at} ' /proc/self/mountinfo"),
        )
        .await;
        let f = flags(line);
        for want in ["noexec", "nodev", "nosuid"] {
            assert!(f.contains(want), "{want} missing at {at}: {f:?}");
        }
    }

    // An option that would give something the volume does not have is refused, naming it.
    let e = create_container_err(&mut rt, &pod, &cfg, with("loose", &["nodev", "suid"])).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("suid") && e.message().contains("/data"),
        "{e:?}"
    );
    let listed = all_containers(&mut rt).await;
    assert_eq!(listed.len(), 2, "only plain and strict: {listed:?}");

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// What a process cannot carry (a NUL byte in an environment value or an argument, an empty
/// or `=` name) is refused at create, INVALID_ARGUMENT naming the container or the image and
/// the variable, whether the pod spec or the image gave it; nothing is left behind. So are user
/// namespace options no runtime could honour, and sysctls outside the pod's namespaces.
#[tokio::test(flavor = "multi_thread")]
async fn strings_a_process_cannot_carry_and_user_namespaces_are_refused_naming_their_source() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    let bad_image = |name: &str, conf: ImageConf| {
        let img = Image::new(
            vec![Layer::new(
                &support::oci::busybox_base_tar(),
                Compression::Gzip,
                false,
            )],
            &conf,
            false,
        );
        let (addr, name) = (reg.addr.clone(), name.to_string());
        async move {
            Pusher::new(&addr)
                .push(&format!("e2e-test-images/{name}"), "1", &img)
                .await;
            format!("registry.k8s.io/e2e-test-images/{name}:1")
        }
    };
    let nameless = bad_image(
        "nameless-env",
        ImageConf {
            env: vec!["=x".into()],
            ..Default::default()
        },
    )
    .await;
    let nul_cmd = bad_image(
        "nul-cmd",
        ImageConf {
            cmd: vec!["sh".into(), "-c".into(), "echo a\0b".into()],
            ..Default::default()
        },
    )
    .await;
    for image in [&nameless, &nul_cmd] {
        support::hako::pull(&h, image).await.unwrap();
    }
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("strings", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let with_env = |key: &str, value: &[u8]| {
        let mut cc = container_config("env", &["sleep", "60"]);
        cc.envs = vec![cri::KeyValue {
            key: key.into(),
            value: value.to_vec(),
        }];
        cc
    };
    let from_image = |image: &str| {
        let mut cc = container_config("imaged", &[]);
        cc.command.clear();
        cc.image = Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        });
        cc
    };
    for (cc, want) in [
        (
            with_env("TOKEN", b"abc\0def"),
            "container env: environment variable \"TOKEN\"",
        ),
        (with_env("", b"v"), "empty name"),
        (with_env("A=B", b"v"), "\"A=B\""),
        (from_image(&nameless), "ENV entry \"\""),
        (from_image(&nul_cmd), "argument 2 of its command"),
    ] {
        let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(want), "want {want:?}: {e:?}");
        assert!(
            !e.message().contains("abc"),
            "a value is never quoted: {e:?}"
        );
    }
    assert!(all_containers(&mut rt).await.is_empty());
    let id = run_container(&mut rt, &pod, &cfg, with_env("TOKEN", b"abc=def")).await;
    assert_eq!(exec(&mut rt, &id, "echo $TOKEN").await, "abc=def");
    // An exec (a probe) with a NUL in an argument is refused, not run with that argument
    // emptied: `sh -c "exit 3\0"` would have been `sh -c ""`, exit 0.
    let e = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec!["sh".into(), "-c".into(), "exit 3\0".into()],
            timeout: 10,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains(&id) && e.message().contains("argument 2"),
        "{e:?}"
    );
    // A pod hostname the kernel or /etc/hosts cannot carry is refused before anything is made.
    for hostname in ["two\nlines", "nul\0", &"h".repeat(65)] {
        let mut bad = pod_config("badhost", logs.path());
        bad.hostname = hostname.to_string();
        let e = rt
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(bad),
                runtime_handler: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            tonic::Code::InvalidArgument,
            "{hostname:?}: {e:?}"
        );
        assert!(
            e.message().contains("badhost") && e.message().contains("hostname"),
            "{e:?}"
        );
    }
    // A user namespace no runtime could make is refused, never ignored (the pod would run as
    // the node's root).
    let map = |container_id, host_id, length| cri::IdMapping {
        container_id,
        host_id,
        length,
    };
    let pod_mode = |uids: Vec<cri::IdMapping>| cri::UserNamespace {
        mode: cri::NamespaceMode::Pod as i32,
        gids: uids.clone(),
        uids,
    };
    let cases = [
        (
            pod_mode(vec![map(1, 65536, 65536)]),
            tonic::Code::InvalidArgument,
            "container ID 0",
        ),
        (
            pod_mode(vec![map(0, 1000, 100000), map(0, 2000, 100000)]),
            tonic::Code::InvalidArgument,
            "exactly one",
        ),
        (
            cri::UserNamespace {
                mode: cri::NamespaceMode::Container as i32,
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "CONTAINER",
        ),
        (
            cri::UserNamespace {
                mode: cri::NamespaceMode::Target as i32,
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "TARGET",
        ),
    ];
    for (userns, code, why) in cases {
        let ns = cri::NamespaceOption {
            userns_options: Some(userns.clone()),
            ..Default::default()
        };
        let mut bad = pod_config("userns", logs.path());
        bad.sc().namespace_options = Some(ns.clone());
        let e = rt
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(bad),
                runtime_handler: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "pod with {userns:?}: {e:?}");
        assert!(
            e.message().contains("userns") && e.message().contains(why),
            "pod with {userns:?}: {e:?}"
        );
        // A container asks for it: refused the same way.
        let mut cc = container_config("userns-ctr", &["sleep", "60"]);
        cc.sc().namespace_options = Some(ns);
        let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
        assert_eq!(e.code(), code, "container with {userns:?}: {e:?}");
        assert!(
            e.message().contains("userns-ctr") && e.message().contains(why),
            "container with {userns:?}: {e:?}"
        );
    }
    // A container asking for a user namespace its pod does not have is refused.
    let mut cc = container_config("userns-ctr", &["sleep", "60"]);
    cc.sc().namespace_options = Some(cri::NamespaceOption {
        userns_options: Some(pod_mode(vec![map(0, 65536, 65536)])),
        ..Default::default()
    });
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("is not its pod's (none)"), "{e:?}");
    // A sysctl of no namespace the pod has of its own would be the node's: refused.
    for (key, host_network) in [
        ("vm.swappiness", false),
        ("kernel.core_pattern", false),
        ("net.ipv4.ip_forward", true),
    ] {
        let mut bad = pod_config("sysctl", logs.path());
        let linux = bad.linux.get_or_insert_with(Default::default);
        linux.sysctls.insert(key.to_string(), "1".to_string());
        if host_network {
            linux
                .security_context
                .get_or_insert_with(Default::default)
                .namespace_options
                .get_or_insert_with(Default::default)
                .network = cri::NamespaceMode::Node as i32;
        }
        let e = rt
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(bad),
                runtime_handler: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{key}: {e:?}");
        assert!(
            e.message().contains("sysctl") && e.message().contains(key),
            "{key}: {e:?}"
        );
    }
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .items;
    assert_eq!(pods.len(), 1, "only the good pod: {pods:?}");
    let ctrs = rt
        .list_containers(cri::ListContainersRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert!(
        ctrs.iter()
            .all(|c| c.metadata.as_ref().is_none_or(|m| m.name != "userns-ctr")),
        "a refused container was kept: {ctrs:?}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A container of `pod` with image volumes at `/vol<n>`: `(image, sub path)` each.
fn with_image_volumes(name: &str, vols: &[(&str, &str)]) -> cri::ContainerConfig {
    let mut cc = container_config(name, &["sleep", "600"]);
    cc.mounts = vols
        .iter()
        .enumerate()
        .map(|(n, (image, sub))| cri::Mount {
            container_path: format!("/vol{n}"),
            image: Some(cri::ImageSpec {
                image: image.to_string(),
                ..Default::default()
            }),
            image_sub_path: sub.to_string(),
            readonly: true,
            ..Default::default()
        })
        .collect();
    cc
}

#[tokio::test(flavor = "multi_thread")]
async fn image_volumes_mount_the_image_read_only_and_sub_paths_stay_inside_it() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    // Two layers: the second replaces a file of the first and adds a symlink that points at
    // the host's /etc from the host's point of view.
    let mut base = Tar::default();
    base.file("models/weights.bin", b"v1", 0o644)
        .file("models/config.json", b"{}", 0o644)
        .file("etc/marker", b"image etc", 0o644);
    let mut top = Tar::default();
    top.file("models/weights.bin", b"v2", 0o644)
        .symlink("escape", "/etc")
        .symlink("up", "../../../../../../etc");
    // A directory whose name is not UTF-8, reached through `data -> a\xff`, beside a symlink
    // to the host's root named as that name reads when made UTF-8 lossily (`a\u{FFFD}`): a
    // sub path carried as a lossy string would have named the host's root, and a bind with a
    // root that is not UTF-8 in mountinfo fails every later container create (libcontainer
    // reads mountinfo as UTF-8), so such a sub path is refused.
    top.raw(tar::EntryType::Directory, b"a\xff/", b"", b"", 0o755)
        .raw(
            tar::EntryType::Regular,
            b"a\xff/inside",
            b"",
            b"image dir",
            0o644,
        )
        .raw(tar::EntryType::Symlink, b"data", b"a\xff", b"", 0o777)
        .symlink("a\u{FFFD}", "/");
    let img = Image::new(
        vec![
            Layer::new(&base.finish(), Compression::Gzip, false),
            Layer::new(&top.finish(), Compression::Gzip, false),
        ],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr)
        .push("e2e-test-images/models", "1", &img)
        .await;
    let image = "registry.k8s.io/e2e-test-images/models:1";
    let image_ref = support::hako::pull(&h, image).await.unwrap();
    // A one-layer image too (overlay needs a second lower directory without an upper one).
    let one = Image::new(
        vec![Layer::new(
            &support::oci::marker_tar("only/file", b"one layer"),
            Compression::Gzip,
            false,
        )],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr)
        .push("e2e-test-images/onelayer", "1", &one)
        .await;
    let one_image = "registry.k8s.io/e2e-test-images/onelayer:1";
    support::hako::pull(&h, one_image).await.unwrap();

    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("imgvol", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;

    // Whole image (named by the ref kubelet got from its pull), a sub path, a sub path through
    // a symlink, and the one-layer image.
    let cc = with_image_volumes(
        "reader",
        &[
            (&image_ref, ""),
            (image, "models"),
            (image, "escape"),
            (one_image, ""),
            (image, "models"),
            (image, "models/config.json"),
        ],
    );
    let id = run_container(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(
        exec(&mut rt, &id, "cat /vol0/models/weights.bin").await,
        "v2"
    );
    assert_eq!(
        exec(&mut rt, &id, "cat /vol1/weights.bin /vol1/config.json").await,
        "v2{}"
    );
    // `escape -> /etc` is the image's /etc, not the host's.
    assert_eq!(exec(&mut rt, &id, "cat /vol2/marker").await, "image etc");
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "test -e /vol2/passwd && echo host || echo image"
        )
        .await,
        "image"
    );
    assert_eq!(exec(&mut rt, &id, "cat /vol3/only/file").await, "one layer");
    // Two sub paths of one image: one overlay, two binds.
    assert_eq!(exec(&mut rt, &id, "cat /vol4/weights.bin").await, "v2");
    // A sub path naming a file binds that file.
    assert_eq!(exec(&mut rt, &id, "cat /vol5").await, "{}");
    // Read-only, whatever the container's user.
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "touch /vol0/new 2>/dev/null && echo wrote || echo refused"
        )
        .await,
        "refused"
    );
    let mounts = exec(&mut rt, &id, "grep ' /vol1 ' /proc/self/mountinfo").await;
    assert!(
        mounts
            .split_whitespace()
            .nth(5)
            .unwrap()
            .split(',')
            .any(|o| o == "ro"),
        "{mounts}"
    );
    // The status names the image and sub path as kubelet sent them.
    let st = status(&mut rt, &id).await;
    let vol1 = st
        .mounts
        .iter()
        .find(|m| m.container_path == "/vol1")
        .unwrap();
    assert_eq!(vol1.image.as_ref().unwrap().image, image);
    assert_eq!(vol1.image_sub_path, "models");
    assert!(vol1.host_path.is_empty(), "{vol1:?}");

    // A sub path the image does not have, that climbs out through a symlink to somewhere the
    // image has nothing, that goes through a file, or that resolves to a name that is not
    // UTF-8, fails the create naming it, and leaves nothing behind.
    for (n, sub) in ["missing", "up/passwd", "models/weights.bin/x", "data"]
        .iter()
        .enumerate()
    {
        let e = create_container_err(
            &mut rt,
            &pod,
            &cfg,
            with_image_volumes(&format!("bad{n}"), &[(image, sub)]),
        )
        .await;
        assert!(
            matches!(
                e.code(),
                tonic::Code::NotFound | tonic::Code::InvalidArgument
            ),
            "{sub}: {e:?}"
        );
        assert!(
            e.message().contains(sub) && e.message().contains("/vol0"),
            "{e:?}"
        );
    }
    // More image volumes than a container may have.
    let many: Vec<(&str, &str)> = (0..65).map(|_| (image, "")).collect();
    let e = create_container_err(&mut rt, &pod, &cfg, with_image_volumes("many", &many)).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("65 image volumes"), "{e:?}");
    // An image the node does not have.
    let e = create_container_err(
        &mut rt,
        &pod,
        &cfg,
        with_image_volumes("absent", &[("registry.k8s.io/e2e-test-images/nope:1", "")]),
    )
    .await;
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("nope:1"), "{e:?}");
    let listed = all_containers(&mut rt).await;
    assert_eq!(listed.len(), 1, "only the reader: {listed:?}");

    // Removing the image while a container mounts it keeps the container's view whole.
    h.images()
        .await
        .remove_image(cri::RemoveImageRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    assert_eq!(exec(&mut rt, &id, "cat /vol1/weights.bin").await, "v2");

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
