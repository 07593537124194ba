//! Pod networks end to end: a real hako runs Debian's CNI plugins (bridge, host-local,
//! portmap) on a bridge and subnet each test makes and removes.

mod support;

use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use hako_proto::cri;
use support::cni::{self, TestNet};
use support::cri::*;
use support::hako::Hako;
use support::registry::Registry;

/// hako on a test network, busybox pulled.
async fn on_net(net: &TestNet, timeout_secs: u64) -> Option<(Registry, Hako)> {
    if !cni::ready() {
        return None;
    }
    ready_with_config(&net.hako_config(timeout_secs)).await
}

async fn pod_network(rt: &mut Rt, pod: &str) -> cri::PodSandboxNetworkStatus {
    rt.pod_sandbox_status(cri::PodSandboxStatusRequest {
        pod_sandbox_id: pod.into(),
        verbose: false,
    })
    .await
    .unwrap()
    .into_inner()
    .status
    .unwrap()
    .network
    .unwrap()
}

async fn pod_ip(rt: &mut Rt, pod: &str) -> String {
    pod_network(rt, pod).await.ip
}

async fn network_ready(rt: &mut Rt) -> cri::RuntimeCondition {
    rt.status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
        .conditions
        .into_iter()
        .find(|c| c.r#type == "NetworkReady")
        .unwrap()
}

/// A busybox httpd serving `body` on `port`.
fn web(name: &str, port: u16, body: &str) -> cri::ContainerConfig {
    let script = format!(
        "mkdir -p /www && echo {body} > /www/index.html && exec httpd -f -p {port} -h /www"
    );
    container_config(name, &["sh", "-c", &script])
}

fn http_get(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(s, "GET / HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

#[tokio::test(flavor = "multi_thread")]
async fn pods_reach_each_other_and_host_ports_reach_pods() {
    let net = TestNet::new();
    let Some((_reg, h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cond = network_ready(&mut rt).await;
    assert!(cond.status, "{cond:?}");

    let mut a_cfg = pod_config("server", logs.path());
    a_cfg.port_mappings = vec![cri::PortMapping {
        protocol: cri::Protocol::Tcp as i32,
        container_port: 8080,
        host_port: 18080 + (std::process::id() % 1000) as i32,
        host_ip: String::new(),
    }];
    let host_port = a_cfg.port_mappings[0].host_port;
    let a = run_pod(&mut rt, &a_cfg).await;
    let a_ip = pod_ip(&mut rt, &a).await;
    assert!(
        a_ip.starts_with(&net.prefix),
        "{a_ip} in {}.0/24",
        net.prefix
    );
    run_container(&mut rt, &a, &a_cfg, web("web", 8080, "hello-from-a")).await;
    assert_eq!(net.leased().len(), 1, "{:?}", net.leased());
    assert_eq!(net.veths().len(), 1);

    let b_cfg = pod_config("client", logs.path());
    let b = run_pod(&mut rt, &b_cfg).await;
    let b_ip = pod_ip(&mut rt, &b).await;
    assert_ne!(a_ip, b_ip);
    let b_ctr = run_container(
        &mut rt,
        &b,
        &b_cfg,
        container_config("c", &["sleep", "120"]),
    )
    .await;
    let mut got = String::new();
    for _ in 0..50 {
        let out = rt
            .exec_sync(cri::ExecSyncRequest {
                container_id: b_ctr.clone(),
                cmd: vec![
                    "sh".into(),
                    "-c".into(),
                    // Debian's static busybox wget crashes resolving; nc speaks HTTP/1.0 fine.
                    format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {a_ip} 8080 2>&1"),
                ],
                timeout: 10,
            })
            .await
            .unwrap()
            .into_inner();
        got = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if got.contains("hello-from-a") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        got.contains("hello-from-a"),
        "pod b reached pod a: {got:?}; web log: {:?}",
        log_lines(&logs.path().join("web.log"))
    );
    // The pod sees its own address on eth0.
    let addrs = exec(&mut rt, &b_ctr, "ip -o -4 addr show eth0").await;
    assert!(addrs.contains(&b_ip), "{addrs}");

    // The host port, from the host: by the bridge's address and by 127.0.0.1.
    for addr in [
        format!("{}:{host_port}", net.gateway),
        format!("127.0.0.1:{host_port}"),
    ] {
        let page = http_get(&addr).unwrap_or_default();
        assert!(page.contains("hello-from-a"), "{addr}: {page:?}");
    }

    remove_pod(&mut rt, &a).await;
    remove_pod(&mut rt, &b).await;
    assert!(net.leased().is_empty(), "leases left: {:?}", net.leased());
    assert!(net.veths().is_empty(), "veths left: {:?}", net.veths());
    assert!(
        http_get(&format!("127.0.0.1:{host_port}")).is_none(),
        "host port closed"
    );
    assert_no_leaks(&h, &a);
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_pods_leave_no_lease_veth_or_netns() {
    let net = TestNet::new();
    let Some((_reg, h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    for i in 0..50 {
        let cfg = pod_config(&format!("churn-{i}"), logs.path());
        let pod = run_pod(&mut rt, &cfg).await;
        assert!(pod_ip(&mut rt, &pod).await.starts_with(&net.prefix));
        remove_pod(&mut rt, &pod).await;
        assert_no_leaks(&h, &pod);
    }
    assert!(net.leased().is_empty(), "leases left: {:?}", net.leased());
    assert!(net.veths().is_empty(), "veths left: {:?}", net.veths());
    assert!(cni::netns_mounts_under(h.dir.path()).is_empty());
    assert!(Hako::files_under(&h.root.join("cni/results")).is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_daemon_killed_between_add_and_del_still_releases_the_lease() {
    let net = TestNet::new();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("survivor", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let ip = pod_ip(&mut rt, &pod).await;
    assert_eq!(net.leased(), vec![ip.clone()]);
    h.kill9();
    // A changed config dir must not change how the existing attachment is deleted.
    std::fs::remove_file(net.conf_dir.join("10-test.conflist")).unwrap();
    h.restart();
    let mut rt = h.runtime().await;
    assert_eq!(pod_ip(&mut rt, &pod).await, ip, "kept across the restart");
    let cond = network_ready(&mut rt).await;
    assert!(
        !cond.status && cond.message.contains("no CNI network config"),
        "{cond:?}"
    );
    remove_pod(&mut rt, &pod).await;
    assert!(net.leased().is_empty(), "leases left: {:?}", net.leased());
    assert!(net.veths().is_empty());
    // The config comes back: the next pod uses it without a restart.
    net.write_conflist("10-test.conflist", &[]);
    assert!(network_ready(&mut rt).await.status);
    let pod = run_pod(&mut rt, &pod_config("after", logs.path())).await;
    assert!(pod_ip(&mut rt, &pod).await.starts_with(&net.prefix));
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn failing_and_hanging_plugins_are_named_and_leave_nothing() {
    let net = TestNet::new();
    net.plugin_script(
        "failer",
        r#"cat >/dev/null
if [ "$CNI_COMMAND" = ADD ]; then
  echo "failer: no room at the inn" >&2
  echo '{"cniVersion":"1.0.0","code":11,"msg":"cannot attach","details":"quota exhausted"}'
  exit 1
fi
exit 0"#,
    );
    net.plugin_script(
        "hanger",
        r#"cat >/dev/null
[ "$CNI_COMMAND" = ADD ] && sleep 611
exit 0"#,
    );
    net.write_conflist("10-test.conflist", &[serde_json::json!({"type": "failer"})]);
    let Some((_reg, h)) = on_net(&net, 2).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let e = run_pod_err(&mut rt, &pod_config("unlucky", logs.path())).await;
    let m = e.message();
    assert!(
        m.contains("CNI plugin failer") && m.contains("cannot attach: quota exhausted"),
        "{m}"
    );
    assert!(m.contains("no room at the inn"), "stderr included: {m}");
    assert!(
        net.leased().is_empty(),
        "the bridge's lease was released: {:?}",
        net.leased()
    );
    assert!(net.veths().is_empty());
    assert!(cni::netns_mounts_under(h.dir.path()).is_empty());
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(pods.is_empty(), "{pods:?}");

    net.write_conflist("10-test.conflist", &[serde_json::json!({"type": "hanger"})]);
    let e = run_pod_err(&mut rt, &pod_config("stuck", logs.path())).await;
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("CNI plugin hanger"), "{e:?}");
    // The silent plugin was killed with what it started.
    support::wait_for(
        "the hung plugin's processes to be gone",
        Duration::from_secs(30),
        || processes_with_cmdline(&["sleep", "611"]) == 0,
    )
    .await;
    assert!(net.leased().is_empty(), "{:?}", net.leased());
    assert!(net.veths().is_empty());
    assert!(Hako::files_under(&h.root.join("cni/results")).is_empty());
}

/// kubelet retries StopPodSandbox until it succeeds; a DEL that fails must fail the stop (or
/// the attachment would be forgotten with its lease) and be run again on the retry.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_cni_del_fails_stop_pod_sandbox_and_the_retry_runs_it_again() {
    let net = TestNet::new();
    let refuse = net.dir.path().join("refuse-del");
    let calls = net.dir.path().join("delfailer.calls");
    net.plugin_script(
        "delfailer",
        &format!(
            r#"cat >/dev/null
echo "$CNI_COMMAND" >> {calls}
if [ "$CNI_COMMAND" = DEL ] && [ -e {refuse} ]; then
  echo '{{"cniVersion":"1.0.0","code":11,"msg":"detach refused","details":"fabric busy"}}'
  exit 1
fi
[ "$CNI_COMMAND" = ADD ] && echo '{{"cniVersion":"1.0.0"}}'
exit 0"#,
            calls = calls.display(),
            refuse = refuse.display()
        ),
    );
    // First in the list, so its DEL runs last: the bridge's DEL has released the lease by then.
    net.write_conflist_around(
        "10-test.conflist",
        &[serde_json::json!({"type": "delfailer"})],
        &[],
    );
    let Some((_reg, h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let pod = run_pod(&mut rt, &pod_config("sticky", logs.path())).await;
    assert_eq!(net.leased().len(), 1);
    std::fs::write(&refuse, "").unwrap();
    let dels = || {
        std::fs::read_to_string(&calls)
            .unwrap()
            .lines()
            .filter(|l| *l == "DEL")
            .count()
    };
    for attempt in 1..=2 {
        let e = rt
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await
            .unwrap_err();
        assert!(
            e.message().contains("CNI plugin delfailer") && e.message().contains("detach refused"),
            "attempt {attempt}: {e:?}"
        );
        assert_eq!(dels(), attempt, "each stop runs DEL again");
        assert!(
            h.root.join("cni/results").read_dir().unwrap().count() > 0,
            "the attachment is kept for the retry"
        );
    }
    // Still there for kubelet to retry: listed, and not removable as if stopped.
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(pods.iter().any(|p| p.id == pod), "{pods:?}");
    std::fs::remove_file(&refuse).unwrap();
    remove_pod(&mut rt, &pod).await;
    assert_eq!(dels(), 3);
    assert!(net.leased().is_empty(), "{:?}", net.leased());
    assert!(net.veths().is_empty(), "{:?}", net.veths());
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_config_network_is_not_ready_and_host_network_pods_still_run() {
    let empty = tempfile::tempdir().unwrap();
    let Some((_reg, h)) = ready_with_config(&format!(
        "[cni]\nconf_dir = \"{}\"\n",
        empty.path().display()
    ))
    .await
    else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cond = network_ready(&mut rt).await;
    assert!(!cond.status);
    assert_eq!(cond.reason, "NetworkPluginNotReady");
    assert!(
        cond.message.contains("no CNI network config in"),
        "{cond:?}"
    );
    let cfg = with_namespaces(
        pod_config("hostnet", logs.path()),
        cri::NamespaceOption {
            network: cri::NamespaceMode::Node as i32,
            ..Default::default()
        },
    );
    // A pod network cannot be made; the host's can.
    let e = run_pod_err(&mut rt, &pod_config("podnet", logs.path())).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("no CNI network config"), "{e:?}");
    let pod = run_pod(&mut rt, &cfg).await;
    assert_eq!(pod_ip(&mut rt, &pod).await, "");
    let c = run_container(&mut rt, &pod, &cfg, container_config("c", &["sleep", "60"])).await;
    let host_ns = std::fs::read_link("/proc/self/ns/net").unwrap();
    let in_ctr = exec(&mut rt, &c, "readlink /proc/self/ns/net").await;
    assert_eq!(in_ctr, host_ns.display().to_string());
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn plugins_get_the_cni_protocol_args_and_runtime_config() {
    let net = TestNet::new();
    // A plugin that records each call (command, environment, stdin) and claims an address.
    let log = net.dir.path().join("calls");
    net.plugin_script(
        "recorder",
        &format!(
            r#"{{ echo "== $CNI_COMMAND"; echo "args=$CNI_ARGS"; echo "netns=$CNI_NETNS"; echo "ifname=$CNI_IFNAME"; echo "id=$CNI_CONTAINERID"; echo "umask=$(umask)"; cat; echo; }} >> {log}
if [ "$CNI_COMMAND" = ADD ]; then
  printf '{{"cniVersion":"1.0.0","interfaces":[{{"name":"eth0","sandbox":"%s"}}],"ips":[{{"address":"10.9.9.9/24","interface":0}},{{"address":"fd00::9/64","interface":0}}]}}' "$CNI_NETNS"
fi"#,
            log = log.display()
        ),
    );
    std::fs::write(
        net.conf_dir.join("10-test.conflist"),
        serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "recorded",
            "plugins": [{"type": "recorder", "capabilities": {"portMappings": true, "dns": true, "ipRanges": true, "bandwidth": true}}]
        })
        .to_string(),
    )
    .unwrap();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    // kubelet passes the node's pod CIDR; the IPAM gets it as ipRanges.
    rt.update_runtime_config(cri::UpdateRuntimeConfigRequest {
        runtime_config: Some(cri::RuntimeConfig {
            network_config: Some(cri::NetworkConfig {
                pod_cidr: "10.244.1.0/24".into(),
            }),
        }),
    })
    .await
    .unwrap();
    let mut cfg = pod_config("recorded", logs.path());
    cfg.annotations
        .insert("kubernetes.io/egress-bandwidth".into(), "1M".into());
    cfg.dns_config = Some(cri::DnsConfig {
        servers: vec!["10.0.0.10".into()],
        searches: vec!["svc.cluster.local".into()],
        options: vec!["ndots:5".into()],
    });
    cfg.port_mappings = vec![cri::PortMapping {
        protocol: cri::Protocol::Udp as i32,
        container_port: 53,
        host_port: 5353,
        host_ip: String::new(),
    }];
    let pod = run_pod(&mut rt, &cfg).await;
    let st = pod_network(&mut rt, &pod).await;
    assert_eq!(st.ip, "10.9.9.9");
    assert_eq!(st.additional_ips[0].ip, "fd00::9");

    let calls = std::fs::read_to_string(&log).unwrap();
    let add = calls.split("== ").find(|c| c.starts_with("ADD")).unwrap();
    for want in [
        "IgnoreUnknown=1".to_string(),
        "K8S_POD_NAMESPACE=default".into(),
        "K8S_POD_NAME=recorded".into(),
        format!("K8S_POD_INFRA_CONTAINER_ID={pod}"),
        "K8S_POD_UID=uid-recorded".into(),
        format!("id={pod}"),
        "ifname=eth0".into(),
    ] {
        assert!(add.contains(&want), "{want} in {add}");
    }
    let netns = add
        .lines()
        .find_map(|l| l.strip_prefix("netns="))
        .unwrap()
        .to_string();
    assert!(
        netns.starts_with(&h.dir.path().display().to_string()),
        "{netns}"
    );
    let stdin: serde_json::Value = serde_json::from_str(add.lines().last().unwrap()).unwrap();
    assert_eq!(stdin["name"], "recorded");
    // Plugins write files other tools read with the usual umask; the daemon keeps its 077 on
    // every thread but the one that starts plugins.
    assert!(add.contains("umask=0022"), "{add}");
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{}/task", h.pid())).unwrap() {
        let t = t.unwrap().path();
        let comm = std::fs::read_to_string(t.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(t.join("status")).unwrap_or_default();
        if let Some(umask) = status.lines().find_map(|l| l.strip_prefix("Umask:")) {
            threads.push((comm.trim().to_string(), umask.trim().to_string()));
        }
    }
    assert!(threads.len() > 1, "{threads:?}");
    for (comm, umask) in &threads {
        let want = if comm == "cni-spawn" { "0022" } else { "0077" };
        assert_eq!(umask, want, "thread {comm}: {threads:?}");
    }
    assert_eq!(
        stdin["runtimeConfig"]["portMappings"],
        serde_json::json!([{"hostPort": 5353, "containerPort": 53, "protocol": "udp"}])
    );
    assert_eq!(stdin["runtimeConfig"]["dns"]["servers"][0], "10.0.0.10");
    assert_eq!(
        stdin["runtimeConfig"]["ipRanges"],
        serde_json::json!([[{"subnet": "10.244.1.0/24"}]])
    );
    assert_eq!(stdin["runtimeConfig"]["bandwidth"]["egressRate"], 1_000_000);
    assert!(
        stdin["runtimeConfig"].get("cgroupPath").is_none(),
        "not a capability it declared"
    );

    // After a restart the running pod's attachment is CHECKed with the ADD result.
    h.kill9();
    h.restart();
    // The pod CIDR is kept across the restart (kubelet only sends it when it changes).
    let mut rt = h.runtime().await;
    let again = run_pod(&mut rt, &pod_config("recorded-again", logs.path())).await;
    let calls = std::fs::read_to_string(&log).unwrap();
    let last_add = calls
        .split("== ")
        .filter(|c| c.starts_with("ADD"))
        .last()
        .unwrap();
    assert!(last_add.contains("10.244.1.0/24"), "{last_add}");
    remove_pod(&mut rt, &again).await;
    let calls = std::fs::read_to_string(&log).unwrap();
    let check = calls.split("== ").find(|c| c.starts_with("CHECK")).unwrap();
    assert!(check.contains("\"prevResult\""), "{check}");
    let mut rt = h.runtime().await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
    let calls = std::fs::read_to_string(&log).unwrap();
    let del = calls
        .split("== ")
        .filter(|c| c.starts_with("DEL"))
        .find(|c| c.contains(&format!("id={pod}")))
        .unwrap();
    assert!(
        del.contains("10.9.9.9") && del.contains(&netns),
        "DEL gets the ADD result: {del}"
    );
}

/// The daemon dies and its metadata is lost. A pod whose monitor still runs is adopted from
/// it (its network kept); one whose monitor is gone too is owned by nothing: its attachment,
/// namespaces, dirs and cgroup are released, logged.
#[tokio::test(flavor = "multi_thread")]
async fn attachments_no_pod_owns_are_released_at_start() {
    let net = TestNet::new();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let kept = run_pod(&mut rt, &pod_config("kept", logs.path())).await;
    let forgotten = run_pod(&mut rt, &pod_config("forgotten", logs.path())).await;
    assert_eq!(net.leased().len(), 2);
    let kept_lease = net.leased();
    kill_monitor(&mut rt, &forgotten).await;
    h.kill9();
    std::fs::remove_file(h.root.join("meta.db")).unwrap();
    // And its CNI result cache entry torn (below).
    tear_cni_cache_entry(&h, &forgotten);
    h.restart();
    // The running pod keeps its address; the other's is released.
    assert_eq!(
        net.leased().len(),
        1,
        "{:?} of {kept_lease:?}",
        net.leased()
    );
    assert!(h.log_text().contains(
        "released the network of a pod that no longer exists (its CNI result cache entry did not parse)"
    ));
    assert!(h
        .log_text()
        .contains("adopted a running pod whose record was lost"));
    assert!(h
        .log_text()
        .contains("releasing the files of a pod whose monitor is gone"));
    assert_no_leaks_of(&h, &forgotten);
    let mut rt = h.runtime().await;
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest::default())
        .await
        .unwrap()
        .into_inner()
        .items;
    assert_eq!(pods.len(), 1, "{pods:?}");
    assert_eq!(pods[0].id, kept);
    assert_eq!(pods[0].state, cri::PodSandboxState::SandboxReady as i32);
    remove_pod(&mut rt, &kept).await;
    assert!(net.leased().is_empty(), "{:?}", net.leased());
    assert!(net.veths().is_empty(), "{:?}", net.veths());
    assert!(cni::netns_mounts_under(h.dir.path()).is_empty());
    assert_no_leaks(&h, &kept);
}

/// The daemon dies, its metadata is lost, and a pod's monitor does not answer at the next start
/// (stopped): the pod is left running, and so is its network (the start's network GC must not
/// DEL an attachment whose pod it could not rule out); the next start adopts it.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_left_running_at_start_keeps_its_network() {
    let net = TestNet::new();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let pod = run_pod(&mut rt, &pod_config("silent", logs.path())).await;
    let lease = net.leased();
    assert_eq!(lease.len(), 1);
    let monitor = monitor_pid(&mut rt, &pod).await;
    h.kill9();
    std::fs::remove_file(h.root.join("meta.db")).unwrap();
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let resume = Resume(monitor);
    h.restart();
    assert!(
        h.log_text().contains("could not be adopted: left running"),
        "{}",
        h.log_text()
    );
    assert_eq!(net.leased(), lease, "{}", h.log_text());
    assert!(
        !h.log_text().contains("released the network of a pod"),
        "{}",
        h.log_text()
    );
    drop(resume);
    h.kill9();
    h.restart();
    let mut rt = h.runtime().await;
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    remove_pod(&mut rt, &pod).await;
    assert!(net.leased().is_empty(), "{:?}", net.leased());
    assert!(net.veths().is_empty(), "{:?}", net.veths());
    assert_no_leaks(&h, &pod);
}

/// What a power loss can leave of a file written and renamed but never synced: its name and
/// no data.
fn tear_cni_cache_entry(h: &Hako, pod: &str) {
    let entry = h.root.join("cni/results").join(format!("{pod}-eth0.json"));
    assert!(
        entry.exists(),
        "no CNI result cache entry {}",
        entry.display()
    );
    std::fs::write(&entry, b"").unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_torn_cni_result_cache_entry_still_releases_the_lease() {
    let net = TestNet::new();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let pod = run_pod(&mut rt, &pod_config("torn", logs.path())).await;
    assert_eq!(net.leased().len(), 1);
    assert_eq!(net.veths().len(), 1);
    h.kill9();
    tear_cni_cache_entry(&h, &pod);
    h.restart();
    let mut rt = h.runtime().await;
    // DEL through the current configuration with the pod's attachment, as libcni does
    // without a cache entry; skipping it would leak the lease for good.
    remove_pod(&mut rt, &pod).await;
    assert!(h.log_text().contains(
        "CNI result cache entry does not parse: DEL through the current network configuration"
    ));
    assert!(net.leased().is_empty(), "leases left: {:?}", net.leased());
    assert!(net.veths().is_empty(), "veths left: {:?}", net.veths());
    assert!(Hako::files_under(&h.root.join("cni/results")).is_empty());
    assert_no_leaks(&h, &pod);
}

/// What `assert_no_leaks` checks of one pod while another still runs: its dirs, mounts,
/// cgroups and processes.
fn assert_no_leaks_of(h: &support::hako::Hako, pod: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(pod), "a mount of pod {pod} is left");
    assert!(!h.state.join("pods").join(pod).exists());
    for cg in pod_cgroup_dirs(pod) {
        assert!(!cg.exists(), "cgroup left: {}", cg.display());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pod_whose_monitor_died_keeps_its_network_namespace_until_cni_del() {
    let net = TestNet::new();
    let Some((_reg, h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let pod = run_pod(&mut rt, &pod_config("orphaned", logs.path())).await;
    assert_eq!(net.leased().len(), 1);
    // The monitor dies; the daemon notices by itself (no call asks) and releases what the
    // pod held, but the network namespace's pin: StopPodSandbox's CNI DEL runs in it
    // (plugins clean up inside, some fail DEL without it).
    kill_monitor(&mut rt, &pod).await;
    support::wait_for(
        "the daemon to find the monitor gone",
        std::time::Duration::from_secs(20),
        || h.log_text().contains("pod monitor is gone"),
    )
    .await;
    wait_not_ready(&mut rt, &pod).await;
    assert_eq!(
        cni::netns_mounts_under(h.dir.path()).len(),
        1,
        "the network namespace was released before CNI DEL"
    );
    assert_eq!(net.leased().len(), 1, "still leased until StopPodSandbox");
    remove_pod(&mut rt, &pod).await;
    assert!(cni::netns_mounts_under(h.dir.path()).is_empty());
    assert!(net.leased().is_empty(), "{:?}", net.leased());
    assert!(net.veths().is_empty(), "{:?}", net.veths());
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn cni_1_1_status_feeds_network_ready_and_gc_names_the_valid_attachments() {
    let net = TestNet::new();
    let log = net.dir.path().join("calls");
    let ready = net.dir.path().join("ready");
    net.plugin_script(
        "status11",
        &format!(
            r#"stdin=$(cat); echo "== $CNI_COMMAND $stdin" >> {log}
case "$CNI_COMMAND" in
  STATUS) [ -e {ready} ] && exit 0
          echo '{{"cniVersion":"1.1.0","code":50,"msg":"plugin not available","details":"waiting for the fabric"}}'; exit 1 ;;
  ADD) printf '{{"cniVersion":"1.1.0","interfaces":[{{"name":"eth0","sandbox":"%s"}}],"ips":[{{"address":"10.8.8.8/24","interface":0}}]}}' "$CNI_NETNS" ;;
esac
exit 0"#,
            log = log.display(),
            ready = ready.display()
        ),
    );
    std::fs::write(
        net.conf_dir.join("10-test.conflist"),
        r#"{"cniVersion": "1.1.0", "name": "eleven", "plugins": [{"type": "status11"}]}"#,
    )
    .unwrap();
    let Some((_reg, mut h)) = on_net(&net, 30).await else {
        return;
    };
    let mut rt = h.runtime().await;
    let cond = network_ready(&mut rt).await;
    assert!(!cond.status, "{cond:?}");
    assert!(
        cond.message
            .contains("plugin not available: waiting for the fabric"),
        "{cond:?}"
    );
    std::fs::write(&ready, "").unwrap();
    assert!(network_ready(&mut rt).await.status);
    let logs = tempfile::tempdir().unwrap();
    let pod = run_pod(&mut rt, &pod_config("eleven", logs.path())).await;
    h.kill9();
    h.restart();
    let calls = std::fs::read_to_string(&log).unwrap();
    // The last GC: the one at the restart (the first start had no pods).
    let gc = calls
        .split("== ")
        .filter(|c| c.starts_with("GC"))
        .last()
        .unwrap();
    let stdin: serde_json::Value =
        serde_json::from_str(gc.trim_start_matches("GC ").trim()).unwrap();
    assert_eq!(
        stdin["cni.dev/valid-attachments"],
        serde_json::json!([{"containerID": pod, "ifname": "eth0"}])
    );
    let mut rt = h.runtime().await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The values of ListPodSandboxMetrics series named `name` whose labels include `want`
/// (label name and value pairs), each series' labels checked against its descriptor.
fn series(
    descs: &std::collections::HashMap<String, Vec<String>>,
    ms: &[cri::Metric],
    name: &str,
    want: &[(&str, &str)],
) -> Vec<u64> {
    let mut out = Vec::new();
    for m in ms.iter().filter(|m| m.name == name) {
        let keys = descs
            .get(name)
            .unwrap_or_else(|| panic!("{name} has no descriptor"));
        assert_eq!(keys.len(), m.label_values.len(), "{name}: {m:?}");
        let labels: std::collections::HashMap<&str, &str> = keys
            .iter()
            .map(String::as_str)
            .zip(m.label_values.iter().map(String::as_str))
            .collect();
        if want.iter().all(|(k, v)| labels.get(k) == Some(v)) {
            out.push(m.value.as_ref().unwrap().value);
        }
    }
    out
}

/// kubelet's `/metrics/cadvisor` with PodAndContainerStatsFromCRI: ListMetricDescriptors, then
/// ListPodSandboxMetrics (or its stream), series named as cAdvisor names them. Here against
/// the kernel's own counters: the pod's traffic, a CPU-bound container throttled by its quota,
/// its limits and its cgroup.
#[tokio::test(flavor = "multi_thread")]
async fn pod_metrics_count_the_pods_traffic_and_its_containers_cgroups() {
    let net = TestNet::new();
    let Some((_reg, h)) = on_net(&net, 30).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("metered", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let ip = pod_ip(&mut rt, &pod).await;
    let web_id = run_container(&mut rt, &pod, &cfg, web("web", 8080, "metered-body")).await;
    // Half a core at most, and it wants all of one: throttled every period it runs.
    let mut busy = container_config("busy", &["sh", "-c", "while :; do :; done"]);
    busy.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            cpu_period: 100_000,
            cpu_quota: 50_000,
            cpu_shares: 512,
            memory_limit_in_bytes: 48 << 20,
            ..Default::default()
        }),
        ..Default::default()
    });
    let busy_id = run_container(&mut rt, &pod, &cfg, busy).await;
    let mut page = None;
    for _ in 0..50 {
        page = http_get(&format!("{ip}:8080"));
        if page.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(page.unwrap_or_default().contains("metered-body"));

    let descs: std::collections::HashMap<String, Vec<String>> = rt
        .list_metric_descriptors(cri::ListMetricDescriptorsRequest {})
        .await
        .unwrap()
        .into_inner()
        .descriptors
        .into_iter()
        .map(|d| (d.name, d.label_keys))
        .collect();
    let metrics = |rt: &mut Rt| {
        let mut rt = rt.clone();
        let pod = pod.clone();
        async move {
            rt.list_pod_sandbox_metrics(cri::ListPodSandboxMetricsRequest {})
                .await
                .unwrap()
                .into_inner()
                .pod_metrics
                .into_iter()
                .find(|m| m.pod_sandbox_id == pod)
                .expect("the pod's metrics")
        }
    };
    let labels = |c: &'static str| {
        [
            ("container", c),
            ("namespace", "default"),
            ("pod", "metered"),
        ]
    };
    // One whole second of CPU (the CRI counts whole seconds), throttled on the way.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let m = loop {
        let m = metrics(&mut rt).await;
        let busy = m
            .container_metrics
            .iter()
            .find(|c| c.container_id == busy_id)
            .expect("the busy container's metrics");
        let cpu = series(
            &descs,
            &busy.metrics,
            "container_cpu_usage_seconds_total",
            &[("cpu", "total")],
        );
        let throttled = series(
            &descs,
            &busy.metrics,
            "container_cpu_cfs_throttled_periods_total",
            &labels("busy"),
        );
        let throttled_secs = series(
            &descs,
            &busy.metrics,
            "container_cpu_cfs_throttled_seconds_total",
            &labels("busy"),
        );
        if cpu.first().is_some_and(|&s| s >= 1)
            && throttled.first().is_some_and(|&n| n > 0)
            && throttled_secs.first().is_some_and(|&s| s >= 1)
        {
            break m;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no second of CPU and throttling: {cpu:?} {throttled:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let busy = m
        .container_metrics
        .iter()
        .find(|c| c.container_id == busy_id)
        .unwrap();
    let one = |name: &str, c: &'static str, ms: &[cri::Metric]| {
        let v = series(&descs, ms, name, &labels(c));
        assert_eq!(v.len(), 1, "{name} for {c:?}: {v:?}");
        v[0]
    };
    assert_eq!(
        one("container_spec_memory_limit_bytes", "busy", &busy.metrics),
        48 << 20
    );
    assert_eq!(
        one("container_spec_cpu_quota", "busy", &busy.metrics),
        50_000
    );
    assert_eq!(
        one("container_spec_cpu_period", "busy", &busy.metrics),
        100_000
    );
    assert_eq!(one("container_spec_cpu_shares", "busy", &busy.metrics), 512);
    assert!(one("container_cpu_cfs_periods_total", "busy", &busy.metrics) > 0);
    assert!(one("container_memory_usage_bytes", "busy", &busy.metrics) > 0);
    assert!(one("container_threads", "busy", &busy.metrics) >= 1);
    // Its `id` is its cgroup, as the kernel shows it for the process; `name` is hako's ID.
    let pid = container_pid(&mut rt, &busy_id).await;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let path = cgroups
        .lines()
        .find_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (ctrls, path) = rest.split_once(':')?;
            (ctrls.is_empty() || ctrls.split(',').any(|c| c == "memory")).then_some(path)
        })
        .unwrap();
    let by_id = series(
        &descs,
        &busy.metrics,
        "container_memory_working_set_bytes",
        &[("id", path), ("name", busy_id.as_str()), ("image", IMAGE)],
    );
    assert_eq!(
        by_id.len(),
        1,
        "no series with id {path} and name {busy_id}"
    );
    // The web container too, and the pod's own series (container "").
    let web = m
        .container_metrics
        .iter()
        .find(|c| c.container_id == web_id)
        .expect("the web container's metrics");
    assert!(one("container_memory_usage_bytes", "web", &web.metrics) > 0);
    assert!(
        one("container_cpu_usage_seconds_total", "", &m.metrics)
            >= one("container_cpu_usage_seconds_total", "busy", &busy.metrics)
    );
    // The pod's traffic: what the HTTP exchange moved, at most what the netns counted after.
    let (ns_rx, ns_tx) = cni::netns_eth0(pid);
    let eth0 = [("container", ""), ("interface", "eth0"), ("pod", "metered")];
    let rx = series(
        &descs,
        &m.metrics,
        "container_network_receive_bytes_total",
        &eth0,
    );
    let tx = series(
        &descs,
        &m.metrics,
        "container_network_transmit_bytes_total",
        &eth0,
    );
    assert_eq!((rx.len(), tx.len()), (1, 1), "{rx:?} {tx:?}");
    assert!(rx[0] > 0 && rx[0] <= ns_rx, "rx {} netns {ns_rx}", rx[0]);
    assert!(tx[0] > 0 && tx[0] <= ns_tx, "tx {} netns {ns_tx}", tx[0]);
    let packets = series(
        &descs,
        &m.metrics,
        "container_network_receive_packets_total",
        &eth0,
    );
    assert!(packets[0] > 0, "{packets:?}");

    // The stream holds the same pods and series.
    let mut stream = rt
        .stream_pod_sandbox_metrics(cri::StreamPodSandboxMetricsRequest {})
        .await
        .unwrap()
        .into_inner();
    let mut streamed = Vec::new();
    while let Some(r) = stream.message().await.unwrap() {
        streamed.extend(r.pod_sandbox_metrics);
    }
    let s = streamed
        .iter()
        .find(|p| p.pod_sandbox_id == pod)
        .expect("the pod in the stream");
    assert_eq!(s.container_metrics.len(), 2);
    assert_eq!(
        s.metrics.iter().map(|m| &m.name).collect::<Vec<_>>(),
        m.metrics.iter().map(|m| &m.name).collect::<Vec<_>>()
    );

    // An interface name is bytes to the kernel, and the pod can make one that is not UTF-8:
    // it costs that name its spelling, not the pod its network series.
    let made = std::process::Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["ip", "link", "add"])
        .arg(std::ffi::OsStr::from_bytes(b"\xff\xfe"))
        .args(["type", "veth", "peer", "name", "hk-peer"])
        .status()
        .unwrap();
    assert!(made.success(), "ip link add: {made}");
    let m = metrics(&mut rt).await;
    let names: std::collections::BTreeSet<String> = m
        .metrics
        .iter()
        .filter(|m| m.name == "container_network_receive_bytes_total")
        .map(|m| m.label_values[6].clone())
        .collect();
    assert!(
        names.contains("eth0") && names.contains("hk-peer"),
        "{names:?}"
    );

    // An exited container's cgroup stays until it is removed; its series go with its exit,
    // and a stopped pod's with its stop.
    rt.stop_container(cri::StopContainerRequest {
        container_id: busy_id.clone(),
        timeout: 0,
    })
    .await
    .unwrap();
    let m = metrics(&mut rt).await;
    let left: Vec<&str> = m
        .container_metrics
        .iter()
        .map(|c| c.container_id.as_str())
        .collect();
    assert_eq!(left, [web_id.as_str()], "series after busy exited");

    // crictl's view of the same.
    let crictl = support::which("crictl");
    if let Some(crictl) = crictl {
        let out = std::process::Command::new(crictl)
            .args(["--runtime-endpoint", &h.endpoint(), "metricdescs"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{out:?}");
        assert!(
            text.contains("container_cpu_cfs_throttled_periods_total"),
            "{text}"
        );
    } else {
        eprintln!("SKIPPED the crictl metricdescs check: no crictl");
    }

    rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
        pod_sandbox_id: pod.clone(),
    })
    .await
    .unwrap();
    let after = rt
        .list_pod_sandbox_metrics(cri::ListPodSandboxMetricsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pod_metrics;
    assert!(
        after.iter().all(|m| m.pod_sandbox_id != pod),
        "a stopped pod's series are still listed"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// The daemon is stopped (SIGTERM) while a RunPodSandbox waits on a CNI ADD that outlasts the
/// shutdown grace: the call is dropped with the runtime, and the pod's monitor goes with it
/// (an undo step), instead of running on with its socket removed with the pod dir, which no
/// later start could reach or stop.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_start_dropped_at_shutdown_leaves_no_monitor() {
    let net = TestNet::new();
    net.plugin_script(
        "slowadd",
        r#"cat > /dev/null
[ "$CNI_COMMAND" = ADD ] && exec sleep 61
[ "$CNI_COMMAND" = DEL ] && exit 0
echo '{"cniVersion":"1.0.0"}'"#,
    );
    net.write_conflist_around(
        "10-test.conflist",
        &[serde_json::json!({"type": "slowadd"})],
        &[],
    );
    let Some((_reg, mut h)) = on_net(&net, 120).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("dropped", logs.path());
    let call = tokio::spawn(async move {
        rt.run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(cfg),
            runtime_handler: String::new(),
        })
        .await
    });
    let monitors = |h: &support::hako::Hako| {
        let needle = h.state.display().to_string();
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| {
                std::fs::read(e.path().join("cmdline")).is_ok_and(|c| {
                    let c = String::from_utf8_lossy(&c);
                    c.contains(&needle) && c.contains("\0monitor\0")
                })
            })
            .count()
    };
    support::wait_for(
        "the pod's monitor to start",
        Duration::from_secs(20),
        || processes_with_cmdline(&["sleep", "61"]) > 0 && monitors(&h) == 1,
    )
    .await;
    let status = h.stop();
    assert!(status.success(), "{status:?}");
    let _ = call.await;
    support::wait_for(
        "the dropped pod's monitor to be gone",
        Duration::from_secs(5),
        || monitors(&h) == 0,
    )
    .await;
}
