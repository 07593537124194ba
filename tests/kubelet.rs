//! A real kubelet (built from k8s.io/kubernetes by .ci/build-kubelet.sh) drives hako: static
//! pods from a manifest dir, kubelet standalone (no API server), on a CNI network of the
//! test's own, with the local registry's busybox stand-in. Each check is made twice: as
//! kubelet reports it (its read-only port's `/pods` and `/stats/summary`, its log files) and as
//! hako does (its CRI, the cgroup and namespace files). And kubeadm's preflight against hako.

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hako_proto::cri;
use serde_json::Value;
use support::cni::{self, TestNet};
use support::cri::*;
use support::hako::Hako;
use support::registry::free_port;

const NODE: &str = "hako-node";

/// One kubelet at a time: each manages the node's `kubepods` cgroups and its pod log paths.
static ONE_KUBELET: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Deadlines for kubelet's reactions: they are paced by its own periods (PLEG relist 1 s,
/// static pod file check 1 s, back-off 10 s, container GC 1 min), not by hako.
const REACT: Duration = Duration::from_secs(90);
const GC: Duration = Duration::from_secs(180);

/// kubelet standalone on hako, stopped and cleaned when dropped.
struct Kubelet {
    child: Option<Child>,
    dir: tempfile::TempDir,
    manifests: PathBuf,
    pod_logs: PathBuf,
    root_dir: PathBuf,
    log: PathBuf,
    node_ip: String,
    read_only_port: u16,
    /// kubelet's authenticated port (10250 on a node): TLS with a self-signed certificate.
    port: u16,
}

impl Kubelet {
    /// Starts kubelet with its config written for `h` and `net`. The cgroup driver is not set:
    /// kubelet takes the one hako reports (RuntimeConfig).
    fn start(h: &Hako, net: &TestNet) -> Kubelet {
        Kubelet::start_with(h, net, "")
    }

    /// As [`Kubelet::start`], with `extra` (top-level KubeletConfiguration lines) appended.
    fn start_with(h: &Hako, net: &TestNet, extra: &str) -> Kubelet {
        let dir = tempfile::tempdir().unwrap();
        let manifests = dir.path().join("manifests");
        let pod_logs = dir.path().join("pod-logs");
        let root_dir = dir.path().join("root");
        for d in [&manifests, &pod_logs, &root_dir] {
            std::fs::create_dir_all(d).unwrap();
        }
        // kubelet refuses a loopback node IP; the test bridge's address is the host's own and
        // reaches the pods. The CNI plugin would make the bridge with the first pod; kubelet
        // binds to its address before that, so it is made here (the plugin takes it as is).
        let node_ip = net.gateway.clone();
        for args in [
            vec!["link", "add", &net.bridge, "type", "bridge"],
            vec!["addr", "add", &format!("{node_ip}/24"), "dev", &net.bridge],
            vec!["link", "set", &net.bridge, "up"],
        ] {
            let out = Command::new("ip").args(&args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        }
        let read_only_port = free_port();
        let port = free_port();
        let config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: {endpoint}
imageServiceEndpoint: {endpoint}
staticPodPath: {manifests}
fileCheckFrequency: 1s
address: {node_ip}
port: {port}
readOnlyPort: {read_only_port}
healthzPort: 0
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupRoot: /
failCgroupV1: false
failSwapOn: false
serializeImagePulls: false
podCIDR: {prefix}.0/24
podLogsDir: {pod_logs}
resolvConf: ""
featureGates:
  PodAndContainerStatsFromCRI: true
{extra}"#,
            endpoint = h.endpoint(),
            manifests = manifests.display(),
            prefix = net.prefix,
            pod_logs = pod_logs.display(),
        );
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let log = dir.path().join("kubelet.log");
        let child = Command::new(support::which("kubelet").unwrap())
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--root-dir={}", root_dir.display()))
            .arg(format!("--cert-dir={}", dir.path().join("pki").display()))
            .arg(format!("--hostname-override={NODE}"))
            .arg(format!("--node-ip={node_ip}"))
            .arg("--v=2")
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("start kubelet");
        Kubelet {
            child: Some(child),
            dir,
            manifests,
            pod_logs,
            root_dir,
            log,
            node_ip,
            read_only_port,
            port,
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().unwrap())
    }

    /// GET on the read-only port; the body, or None while kubelet does not answer.
    fn get(&self, path: &str) -> Option<Value> {
        let body = http_get(&format!("{}:{}", self.node_ip, self.read_only_port), path)?;
        serde_json::from_str(&body).ok()
    }

    /// The static pods kubelet reports (`/pods`), by pod name (without the node suffix).
    fn pods(&self) -> HashMap<String, Value> {
        let Some(list) = self.get("/pods") else {
            return HashMap::new();
        };
        list["items"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|p| {
                let name = p["metadata"]["name"].as_str()?;
                let name = name.strip_suffix(&format!("-{NODE}"))?.to_string();
                Some((name, p))
            })
            .collect()
    }

    fn pod(&self, name: &str) -> Option<Value> {
        self.pods().remove(name)
    }

    fn write_manifest(&self, name: &str, yaml: &str) {
        // Written beside the dir and renamed in: kubelet must never read half a file.
        let tmp = self.dir.path().join(format!("{name}.yaml.tmp"));
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.manifests.join(format!("{name}.yaml"))).unwrap();
    }

    fn remove_manifest(&self, name: &str) {
        std::fs::remove_file(self.manifests.join(format!("{name}.yaml"))).unwrap();
    }

    /// Waits for `cond` on kubelet's view of pod `name`; fails with what kubelet last said.
    async fn wait_pod(&mut self, what: &str, name: &str, cond: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + REACT;
        loop {
            let pod = self.pod(name);
            if let Some(p) = pod.as_ref().filter(|p| cond(p)) {
                return p.clone();
            }
            if let Some(status) = self.exited() {
                panic!("kubelet exited with {status}:\n{}", self.log_tail());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out after {REACT:?} waiting for {what}; kubelet reports {}\n{}",
                serde_json::to_string_pretty(&pod).unwrap(),
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- kubelet log (last 60 lines) ---\n{}",
            lines[lines.len().saturating_sub(60)..].join("\n")
        )
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            for _ in 0..250 {
                if c.try_wait().ok().flatten().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        let dir = self.dir.path().display().to_string();
        // kubelet links each container's log into /var/log/containers (a fixed path) and
        // removes the links of dead containers in its GC, a minute later: this kubelet's
        // links go with it.
        for e in std::fs::read_dir("/var/log/containers")
            .into_iter()
            .flatten()
            .flatten()
        {
            if std::fs::read_link(e.path()).is_ok_and(|t| t.starts_with(&self.pod_logs)) {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for m in mounts.lines().rev() {
            if let Some(point) = m.split(' ').nth(4).filter(|p| p.starts_with(&dir)) {
                let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        // kubelet's QoS cgroups (empty once its pods are gone); rmdir refuses a busy one.
        for m in cgroup_mounts() {
            for q in ["kubepods/besteffort", "kubepods/burstable", "kubepods"] {
                let _ = std::fs::remove_dir(m.join(q));
            }
        }
        if std::thread::panicking() {
            eprintln!("{}", self.log_tail());
        }
    }
}

/// An HTTP/1.0 GET (the server closes, no chunking); the body of a 200 answer.
fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().ok()?, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let (head, body) = out.split_once("\r\n\r\n")?;
    let code = head.split(' ').nth(1)?;
    (code == "200").then(|| body.to_string())
}

/// The series of a Prometheus text exposition: name, labels, value. (kubelet's label values
/// here hold no comma or quote.)
fn prom_series(text: &str) -> Vec<(String, HashMap<String, String>, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, rest) = l.split_once('}')?;
            let (name, label_text) = series.split_once('{')?;
            let labels = label_text
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_string(), v.trim_matches('"').to_string()))
                })
                .collect();
            let value = rest.split_whitespace().next()?.parse().ok()?;
            Some((name.to_string(), labels, value))
        })
        .collect()
}

/// The series `name` whose labels include `labels`: their labels and values.
fn prom_matching(
    text: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> Vec<(HashMap<String, String>, f64)> {
    prom_series(text)
        .into_iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).is_some_and(|got| got == v))
        })
        .map(|(_, l, v)| (l, v))
        .collect()
}

/// The values of the series `name` whose labels include `labels`.
fn prom_values(text: &str, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    prom_matching(text, name, labels)
        .into_iter()
        .map(|(_, v)| v)
        .collect()
}

/// Label `label` of each series `name` whose labels include `labels`.
fn prom_label(text: &str, name: &str, labels: &[(&str, &str)], label: &str) -> Vec<String> {
    prom_matching(text, name, labels)
        .into_iter()
        .map(|(l, _)| l.get(label).cloned().unwrap_or_default())
        .collect()
}

/// kubelet's status of container `name` (app, init or sidecar) in pod `p`.
fn container_status<'a>(p: &'a Value, name: &str) -> Option<&'a Value> {
    ["containerStatuses", "initContainerStatuses"]
        .iter()
        .filter_map(|k| p["status"][k].as_array())
        .flatten()
        .find(|c| c["name"] == name)
}

fn running(p: &Value, name: &str) -> bool {
    container_status(p, name).is_some_and(|c| c["state"]["running"].is_object())
}

fn restart_count(p: &Value, name: &str) -> i64 {
    container_status(p, name)
        .and_then(|c| c["restartCount"].as_i64())
        .unwrap_or(-1)
}

/// hako's containers of the pod kubelet calls `pod`, by (container name, attempt).
async fn hako_containers(rt: &mut Rt, pod: &str) -> Vec<cri::Container> {
    let sandboxes = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .items;
    let ids: Vec<String> = sandboxes
        .iter()
        .filter(|s| s.metadata.as_ref().unwrap().name == format!("{pod}-{NODE}"))
        .map(|s| s.id.clone())
        .collect();
    let mut cs: Vec<cri::Container> = rt
        .list_containers(cri::ListContainersRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .containers
        .into_iter()
        .filter(|c| ids.contains(&c.pod_sandbox_id))
        .collect();
    cs.sort_by_key(|c| {
        let m = c.metadata.clone().unwrap();
        (m.name, m.attempt)
    });
    cs
}

fn name_attempt(c: &cri::Container) -> (String, u32) {
    let m = c.metadata.as_ref().unwrap();
    (m.name.clone(), m.attempt)
}

/// hako's running container `name` of `pod`.
async fn hako_running(rt: &mut Rt, pod: &str, name: &str) -> cri::Container {
    hako_containers(rt, pod)
        .await
        .into_iter()
        .find(|c| {
            c.metadata.as_ref().unwrap().name == name
                && c.state == cri::ContainerState::ContainerRunning as i32
        })
        .unwrap_or_else(|| panic!("hako runs no container {name} of pod {pod}"))
}

/// The pod's sandbox id in hako.
async fn sandbox_id(rt: &mut Rt, pod: &str) -> String {
    rt.list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .items
        .into_iter()
        .find(|s| {
            s.metadata.as_ref().unwrap().name == format!("{pod}-{NODE}")
                && s.state == cri::PodSandboxState::SandboxReady as i32
        })
        .unwrap_or_else(|| panic!("hako has no ready sandbox for pod {pod}"))
        .id
}

/// A pod manifest with the busybox stand-in for every container.
fn manifest(name: &str, spec: &str) -> String {
    let spec = spec.replace("IMAGE", IMAGE);
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n{spec}"
    )
}

/// A web server with a native sidecar that fetches from it over the pod's loopback, after an
/// init container that writes what it serves. Requests and limits make it Burstable; a
/// readiness probe keeps kubelet calling into hako (ExecSync) for as long as it runs.
const WEB: &str = r#"  terminationGracePeriodSeconds: 2
  volumes:
  - name: www
    emptyDir: {}
  initContainers:
  - name: init
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo served-after-init > /www/index.html"]
    volumeMounts: [{name: www, mountPath: /www}]
  - name: sidecar
    image: IMAGE
    imagePullPolicy: IfNotPresent
    restartPolicy: Always
    command: ["sh", "-c", "trap 'exit 0' TERM; while true; do printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 2 127.0.0.1 8080 | tail -n 1; sleep 1; done"]
  containers:
  - name: web
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["httpd", "-f", "-p", "8080", "-h", "/www"]
    volumeMounts: [{name: www, mountPath: /www}]
    readinessProbe:
      exec: {command: ["true"]}
      periodSeconds: 1
    resources:
      requests: {cpu: 100m, memory: 32Mi}
      limits: {cpu: 200m, memory: 64Mi}
"#;

/// Healthy until /tmp/dead exists (a fresh container never has it).
const PROBED: &str = r#"  terminationGracePeriodSeconds: 1
  containers:
  - name: live
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo attempt-started; trap 'exit 0' TERM; while true; do sleep 1; done"]
    livenessProbe:
      exec: {command: ["sh", "-c", "test ! -e /tmp/dead"]}
      periodSeconds: 1
      failureThreshold: 1
"#;

const CRASHING: &str = r#"  terminationGracePeriodSeconds: 1
  containers:
  - name: crash
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo crash-run; exit 3"]
"#;

const NEVER: &str = r#"  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  containers:
  - name: once
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "echo bye; exit 7"]
"#;

/// A device or CSI node plugin's shape: privileged, the host's /dev mounted on /dev, and
/// kubelet's termination log below it.
const HOST_DEV: &str = r#"  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  volumes:
  - name: dev
    hostPath: {path: /dev}
  containers:
  - name: plugin
    image: IMAGE
    imagePullPolicy: IfNotPresent
    securityContext: {privileged: true}
    volumeMounts: [{name: dev, mountPath: /dev}]
    command: ["sh", "-c", "test -c /dev/loop-control && echo host-devices-seen > /dev/termination-log"]
"#;

/// The directory of `pid`'s cgroup for `controller` (a v1 hierarchy of that name, else the
/// v2 one), and whether it is v2.
fn cgroup_dir(pid: i32, controller: &str) -> (PathBuf, bool) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next(), parts.next().unwrap(), parts.next().unwrap());
        if ctrls.split(',').any(|c| c == controller) {
            let mount = cgroup_mounts()
                .into_iter()
                .find(|m| {
                    m.file_name()
                        .is_some_and(|n| n.to_str().unwrap().split(',').any(|c| c == controller))
                })
                .unwrap_or_else(|| PathBuf::from(format!("/sys/fs/cgroup/{controller}")));
            return (mount.join(path.trim_start_matches('/')), false);
        }
    }
    let path = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or_else(|| panic!("pid {pid} has no cgroup for {controller}: {text}"));
    let mount = cgroup_mounts()
        .into_iter()
        .find(|m| {
            std::fs::read_to_string(m.join("cgroup.controllers"))
                .is_ok_and(|c| c.contains(controller))
        })
        .unwrap_or_else(|| panic!("no cgroup v2 mount with {controller}"));
    (mount.join(path.trim_start_matches('/')), true)
}

fn read_trim(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

/// Lines of hako's log after byte `from` that mention `needle` (colours taken out).
fn hako_log_count(h: &Hako, from: usize, needle: &str) -> usize {
    let text = h.log_text();
    text.get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| without_colours(l).contains(needle))
        .count()
}

fn without_colours(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ parameters, up to the final letter.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// After hako came back (its log from byte `from`): kubelet has polled its status and probed
/// the web container through it a few times, so a restart it wanted to make would have been
/// made by now.
async fn wait_kubelet_resynced(h: &Hako, from: usize, web_id: &str) {
    support::wait_for(
        "kubelet to poll hako's status and probe the web container again",
        REACT,
        || {
            hako_log_count(h, from, "rpc=\"Status\"") >= 3
                && hako_log_count(h, from, &format!("rpc=\"ExecSync\" container={web_id}")) >= 5
        },
    )
    .await;
}

/// `s` percent-encoded for a URL's query.
fn query_escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// kubelet's streaming endpoints on its authenticated port (anonymous, AlwaysAllow in the
/// test; TLS with kubelet's self-signed certificate, not verified) reach hako: kubelet asks
/// hako for a stream URL (Exec, PortForward) and proxies the client's upgraded connection to
/// hako's streaming server, SPDY as is, WebSocket (v5 exec, tunnelled port-forward) translated
/// to SPDY; `/run` goes through ExecSync. The web pod must be running, serving on 8080.
async fn kubelet_streams_reach_hako(k: &Kubelet, h: &Hako) {
    let Some(client) = support::streaming_client() else {
        support::skip(
            "kubelet's /exec and /portForward checks",
            "go is missing (tests/streaming-client is Go)",
        );
        return;
    };
    let base = format!("https://{}:{}", k.node_ip, k.port);
    let pod = format!("default/web-{NODE}");
    let from = h.log_text().len();

    // /exec: the command's stdin, stdout, stderr and exit status, over both transports.
    let command: String = ["sh", "-c", "read l; echo out-$l; echo err >&2; exit 5"]
        .iter()
        .map(|c| format!("command={}&", query_escape(c)))
        .collect();
    let url = format!("{base}/exec/{pod}/web?{command}input=1&output=1&error=1");
    for transport in [&[][..], &["-ws"][..]] {
        let mut child = tokio::process::Command::new(&client)
            .args([&["exec", "-insecure", "-stdin"], transport, &[&url]].concat())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"in\n").await.unwrap();
        drop(stdin);
        let out = tokio::time::timeout(REACT, child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("exec through kubelet {transport:?}: no end in {REACT:?}"))
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert_eq!(
            (out.status.code(), stdout.as_ref()),
            (Some(5), "out-in\n"),
            "exec through kubelet {transport:?}; stderr: {stderr}"
        );
        assert!(
            stderr.lines().any(|l| l == "err"),
            "exec through kubelet {transport:?}: the command's stderr is not there: {stderr}"
        );
    }
    assert!(
        hako_log_count(h, from, "rpc=\"Exec\"") >= 2,
        "kubelet did not ask hako for the exec streams"
    );

    // /run: kubelet runs the command through ExecSync and answers its output.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::builder()
        .danger_accept_invalid_certs(true)
        .build()
        .unwrap();
    let resp = http
        .post(format!("{base}/run/{pod}/web?cmd=cat%20/www/index.html"))
        .send()
        .await
        .unwrap();
    let code = resp.status();
    let body = resp.text().await.unwrap();
    assert_eq!(
        (code.as_u16(), body.as_str()),
        (200, "served-after-init\n"),
        "/run through kubelet"
    );

    // /portForward: a local port of the client reaches the web server inside the pod.
    for transport in [&[][..], &["-ws"][..]] {
        let mut child = tokio::process::Command::new(&client)
            .args(
                [
                    &["portforward", "-insecure"],
                    transport,
                    &[&format!("{base}/portForward/{pod}"), "0:8080"],
                ]
                .concat(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let mut said = Vec::new();
        let local = tokio::time::timeout(REACT, async {
            while let Some(l) = lines.next_line().await.unwrap() {
                // "Forwarding from 127.0.0.1:NNNN -> 8080"
                if let Some(rest) = l.strip_prefix("Forwarding from 127.0.0.1:") {
                    return rest.split_whitespace().next()?.parse::<u16>().ok();
                }
                said.push(l);
            }
            None
        })
        .await
        .unwrap_or_else(|_| {
            panic!("port-forward through kubelet {transport:?}: not listening after {REACT:?}")
        })
        .unwrap_or_else(|| panic!("port-forward through kubelet {transport:?} ended: {said:?}"));
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let addr = format!("127.0.0.1:{local}");
        let body = tokio::task::spawn_blocking(move || http_get(&addr, "/"))
            .await
            .unwrap();
        assert_eq!(
            body.as_deref(),
            Some("served-after-init\n"),
            "the web server through kubelet's port-forward {transport:?}"
        );
        child.kill().await.unwrap();
    }
    assert!(
        hako_log_count(h, from, "rpc=\"PortForward\"") >= 2,
        "kubelet did not ask hako for the port-forward streams"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn kubelet_runs_static_pods_on_hako() {
    if !support::e2e_ready(&["kubelet", "crictl"]) || !cni::ready() {
        return;
    }
    let _one = ONE_KUBELET.lock().await;
    let net = TestNet::new();
    let Some((_reg, mut h)) = ready_with_config(&net.hako_config(30)).await else {
        return;
    };
    let mut rt = h.runtime().await;
    let mut k = Kubelet::start(&h, &net);

    // RuntimeConfig: the driver hako reports is the one kubelet runs with.
    support::wait_for("kubelet to take the cgroup driver from hako", REACT, || {
        k.log_text()
            .contains("Using cgroup driver setting received from the CRI runtime")
    })
    .await;
    let driver_line = k
        .log_text()
        .lines()
        .find(|l| l.contains("Using cgroup driver setting received from the CRI runtime"))
        .unwrap()
        .to_string();
    assert!(
        driver_line.contains("cgroupDriver=\"cgroupfs\""),
        "{driver_line}"
    );

    // A web server and its sidecar on the CNI network, after the init container.
    k.write_manifest("web", &manifest("web", WEB));
    let web = k
        .wait_pod("the web pod to run", "web", |p| {
            running(p, "web") && running(p, "sidecar") && p["status"]["podIP"].is_string()
        })
        .await;
    let pod_ip = web["status"]["podIP"].as_str().unwrap().to_string();
    assert!(pod_ip.starts_with(&format!("{}.", net.prefix)), "{pod_ip}");
    let web_sandbox = sandbox_id(&mut rt, "web").await;
    let net_status = rt
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: web_sandbox.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
        .network
        .unwrap();
    assert_eq!(net_status.ip, pod_ip, "hako's and kubelet's pod IP");
    let mut body = None;
    support::wait_for("the web server to answer on the pod IP", REACT, || {
        body = http_get(&format!("{pod_ip}:8080"), "/");
        body.is_some()
    })
    .await;
    assert_eq!(body.unwrap().trim(), "served-after-init");
    // The sidecar reached it over the pod's loopback: its log (kubelet's file) shows the body.
    let web_uid = web["metadata"]["uid"].as_str().unwrap().to_string();
    let pod_log_dir = k.pod_logs.join(format!("default_web-{NODE}_{web_uid}"));
    support::wait_for(
        "the sidecar to log what the web server served",
        REACT,
        || {
            std::fs::read_to_string(pod_log_dir.join("sidecar/0.log"))
                .is_ok_and(|l| l.contains("served-after-init"))
        },
    )
    .await;

    // The init container ran to completion, before the app containers (what they serve is
    // what it wrote), as kubelet and hako report it.
    let init = container_status(&web, "init").expect("init status");
    assert_eq!(init["state"]["terminated"]["exitCode"], 0, "{init}");
    assert_eq!(init["state"]["terminated"]["reason"], "Completed", "{init}");
    let web_ctr = container_status(&web, "web").unwrap();
    assert!(
        init["state"]["terminated"]["finishedAt"].as_str().unwrap()
            <= web_ctr["state"]["running"]["startedAt"].as_str().unwrap(),
        "init finished after web started: {init} {web_ctr}"
    );
    let cs = hako_containers(&mut rt, "web").await;
    let init_c = cs
        .iter()
        .find(|c| c.metadata.as_ref().unwrap().name == "init")
        .expect("hako lists the init container");
    let init_s = status(&mut rt, &init_c.id).await;
    assert_eq!(
        (init_s.state, init_s.exit_code),
        (cri::ContainerState::ContainerExited as i32, 0)
    );
    let web_c = hako_running(&mut rt, "web", "web").await;
    let web_s = status(&mut rt, &web_c.id).await;
    assert!(
        init_s.finished_at <= web_s.started_at,
        "hako: init finished at {} after web started at {}",
        init_s.finished_at,
        web_s.started_at
    );

    // Resources from the manifest reach the container's cgroup, under the Burstable QoS
    // parent kubelet chose.
    let web_pid = container_pid(&mut rt, &web_c.id).await;
    let (mem, v2) = cgroup_dir(web_pid, "memory");
    let parent = format!("kubepods/burstable/pod{web_uid}");
    assert!(
        mem.display().to_string().contains(&parent),
        "{} is not under {parent}",
        mem.display()
    );
    let (cpu, _) = cgroup_dir(web_pid, "cpu");
    if v2 {
        assert_eq!(
            read_trim(&mem.join("memory.max")),
            (64u64 << 20).to_string()
        );
        assert_eq!(read_trim(&cpu.join("cpu.max")), "20000 100000");
    } else {
        assert_eq!(
            read_trim(&mem.join("memory.limit_in_bytes")),
            (64u64 << 20).to_string()
        );
        assert_eq!(read_trim(&cpu.join("cpu.cfs_quota_us")), "20000");
        assert_eq!(read_trim(&cpu.join("cpu.cfs_period_us")), "100000");
        // 100m requested: 1024 * 0.1, as kubelet rounds it.
        assert_eq!(read_trim(&cpu.join("cpu.shares")), "102");
    }

    // kubelet's /exec, /run and /portForward (its authenticated port) reach hako.
    kubelet_streams_reach_hako(&k, &h).await;

    // /stats/summary: CPU, memory, rootfs, logs and network for the pod, the network close to
    // what hako and the netns counters say (read after it, so at least as much).
    let mut summary_pod = Value::Null;
    support::wait_for(
        "kubelet's summary to hold the web pod with its network",
        REACT,
        || {
            let Some(s) = k.get("/stats/summary") else {
                return false;
            };
            let found = s["pods"].as_array().into_iter().flatten().find(|p| {
                p["podRef"]["name"] == format!("web-{NODE}")
                    && p["network"]["interfaces"].is_array()
                    && p["containers"].as_array().is_some_and(|c| c.len() >= 2)
            });
            if let Some(p) = found {
                summary_pod = p.clone();
            }
            found.is_some()
        },
    )
    .await;
    let p = &summary_pod;
    assert!(
        p["cpu"]["usageCoreNanoSeconds"].as_u64().unwrap() > 0,
        "{p}"
    );
    assert!(p["memory"]["workingSetBytes"].as_u64().unwrap() > 0, "{p}");
    let web_stats = p["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "web")
        .unwrap_or_else(|| panic!("no web container in {p}"));
    assert!(web_stats["rootfs"]["usedBytes"].is_u64(), "{web_stats}");
    assert!(web_stats["logs"]["usedBytes"].is_u64(), "{web_stats}");
    assert!(
        web_stats["memory"]["workingSetBytes"].as_u64().unwrap() > 0,
        "{web_stats}"
    );
    let eth0 = p["network"]["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "eth0")
        .unwrap_or_else(|| panic!("no eth0 in {p}"))
        .clone();
    let summary_rx = eth0["rxBytes"].as_u64().unwrap();
    let summary_tx = eth0["txBytes"].as_u64().unwrap();
    assert!(summary_rx > 0 && summary_tx > 0, "{eth0}");
    let hako_net = rt
        .pod_sandbox_stats(cri::PodSandboxStatsRequest {
            pod_sandbox_id: web_sandbox.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .stats
        .unwrap()
        .linux
        .unwrap()
        .network
        .expect("hako reports the pod's network");
    let hako_eth0 = hako_net.default_interface.expect("a default interface");
    assert_eq!(hako_eth0.name, "eth0");
    let (ns_rx, ns_tx) = cni::netns_eth0(web_pid);
    let hako_rx = hako_eth0.rx_bytes.unwrap().value;
    let hako_tx = hako_eth0.tx_bytes.unwrap().value;
    assert!(
        summary_rx <= hako_rx && hako_rx <= ns_rx && summary_tx <= hako_tx && hako_tx <= ns_tx,
        "rx/tx: summary {summary_rx}/{summary_tx}, hako {hako_rx}/{hako_tx}, netns {ns_rx}/{ns_tx}"
    );

    // /metrics/cadvisor, which kubelet fills from hako's ListPodSandboxMetrics under
    // PodAndContainerStatsFromCRI: series named and labelled as cAdvisor's, with the limits
    // of the manifest and the pod's traffic.
    let pod_name = format!("web-{NODE}");
    let web_labels = [
        ("container", "web"),
        ("namespace", "default"),
        ("pod", pod_name.as_str()),
    ];
    let mut scrape = String::new();
    support::wait_for(
        "kubelet's /metrics/cadvisor to hold the web container",
        REACT,
        || {
            scrape = http_get(
                &format!("{}:{}", k.node_ip, k.read_only_port),
                "/metrics/cadvisor",
            )
            .unwrap_or_default();
            !prom_values(&scrape, "container_memory_working_set_bytes", &web_labels).is_empty()
        },
    )
    .await;
    let one = |name: &str, labels: &[(&str, &str)]| {
        let v = prom_values(&scrape, name, labels);
        assert_eq!(v.len(), 1, "{name} {labels:?} in /metrics/cadvisor: {v:?}");
        v[0]
    };
    assert_eq!(
        one("container_spec_memory_limit_bytes", &web_labels),
        (64u64 << 20) as f64
    );
    assert_eq!(one("container_spec_cpu_quota", &web_labels), 20000.0);
    assert!(one("container_memory_working_set_bytes", &web_labels) > 0.0);
    let pod_eth0 = [
        ("container", ""),
        ("interface", "eth0"),
        ("pod", pod_name.as_str()),
    ];
    let metrics_rx = one("container_network_receive_bytes_total", &pod_eth0);
    assert!(
        metrics_rx >= summary_rx as f64,
        "rx: metrics {metrics_rx}, earlier summary {summary_rx}"
    );

    // An exec liveness probe that starts failing restarts the container as attempt 1; the
    // first attempt's log stays readable.
    k.write_manifest("probed", &manifest("probed", PROBED));
    k.wait_pod("the probed pod to run", "probed", |p| running(p, "live"))
        .await;
    let first = hako_running(&mut rt, "probed", "live").await;
    assert_eq!(name_attempt(&first), ("live".into(), 0));
    exec(&mut rt, &first.id, "touch /tmp/dead").await;
    let probed = k
        .wait_pod("kubelet to restart the failing container", "probed", |p| {
            restart_count(p, "live") == 1 && running(p, "live")
        })
        .await;
    let last = &container_status(&probed, "live").unwrap()["lastState"]["terminated"];
    assert!(last.is_object(), "{probed}");
    let second = hako_running(&mut rt, "probed", "live").await;
    assert_eq!(name_attempt(&second), ("live".into(), 1));
    // /metrics/cadvisor has one `live` series, the running attempt's: the exited one's cgroup
    // stays until kubelet removes it, but it is not reported (a second series would count
    // twice in every sum by pod and container).
    let probed_live = [("container", "live"), ("pod", "probed-hako-node")];
    let mut names = Vec::new();
    support::wait_for(
        "/metrics/cadvisor to show the running attempt of `live`",
        REACT,
        || {
            let text = http_get(
                &format!("{}:{}", k.node_ip, k.read_only_port),
                "/metrics/cadvisor",
            )
            .unwrap_or_default();
            names = prom_label(&text, "container_memory_usage_bytes", &probed_live, "name");
            names.contains(&second.id)
        },
    )
    .await;
    assert_eq!(names, std::slice::from_ref(&second.id), "series of `live`");
    let first_s = status(&mut rt, &first.id).await;
    assert_eq!(first_s.state, cri::ContainerState::ContainerExited as i32);
    assert!(
        std::fs::read_to_string(&first_s.log_path).is_ok_and(|l| l.contains("attempt-started")),
        "the first attempt's log {} is not readable",
        first_s.log_path
    );
    let crictl = support::which("crictl").unwrap();
    let out = Command::new(&crictl)
        .args(["--runtime-endpoint", &h.endpoint(), "logs", &first.id])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("attempt-started"),
        "crictl logs of the first attempt: {out:?}"
    );
    k.remove_manifest("probed");

    // A container exiting non-zero is restarted; with restartPolicy Never it stays exited
    // with its code.
    k.write_manifest("crashing", &manifest("crashing", CRASHING));
    k.write_manifest("never", &manifest("never", NEVER));
    let crashing = k
        .wait_pod(
            "kubelet to restart the crashing container",
            "crashing",
            |p| {
                restart_count(p, "crash") >= 1
                    && container_status(p, "crash").unwrap()["lastState"]["terminated"]["exitCode"]
                        == 3
            },
        )
        .await;
    let attempts: Vec<(String, u32)> = hako_containers(&mut rt, "crashing")
        .await
        .iter()
        .map(name_attempt)
        .collect();
    assert!(
        attempts.contains(&("crash".into(), 1)),
        "hako's containers {attempts:?}; kubelet: {crashing}"
    );
    let never = k
        .wait_pod("the never-restarted pod to fail", "never", |p| {
            p["status"]["phase"] == "Failed"
        })
        .await;
    let once = container_status(&never, "once").unwrap();
    assert_eq!(once["state"]["terminated"]["exitCode"], 7, "{once}");
    assert_eq!(once["state"]["terminated"]["reason"], "Error", "{once}");
    assert_eq!(once["restartCount"], 0, "{once}");
    let cs = hako_containers(&mut rt, "never").await;
    assert_eq!(cs.len(), 1, "{cs:?}");
    let once_s = status(&mut rt, &cs[0].id).await;
    assert_eq!(
        (once_s.state, once_s.exit_code),
        (cri::ContainerState::ContainerExited as i32, 7)
    );
    k.remove_manifest("crashing");
    k.remove_manifest("never");

    // A plugin on the host's /dev sees the host's devices and reports through kubelet's
    // termination log, mounted on top of it.
    let had_log = Path::new("/dev/termination-log").exists();
    k.write_manifest("hostdev", &manifest("hostdev", HOST_DEV));
    let hostdev = k
        .wait_pod("the pod on the host's /dev to succeed", "hostdev", |p| {
            p["status"]["phase"] == "Succeeded"
        })
        .await;
    let plugin = container_status(&hostdev, "plugin").unwrap();
    assert_eq!(
        plugin["state"]["terminated"]["message"], "host-devices-seen\n",
        "{plugin}"
    );
    k.remove_manifest("hostdev");
    if !had_log {
        // The mount point made in the host's /dev, as runc makes it (the container has
        // exited: no namespace holds it).
        let _ = std::fs::remove_file("/dev/termination-log");
    }

    // Restarting hako, gracefully then with kill -9, under the running kubelet restarts no
    // container: the attempts hako runs and kubelet's restart counts stay as they were.
    let before: Vec<(String, u32)> = hako_containers(&mut rt, "web")
        .await
        .iter()
        .map(name_attempt)
        .collect();
    let web_id = web_c.id.clone();
    for graceful in [true, false] {
        let from = h.log_text().len();
        if graceful {
            assert!(h.stop().success());
        } else {
            h.kill9();
        }
        h.restart();
        rt = h.runtime().await;
        wait_kubelet_resynced(&h, from, &web_id).await;
        let after: Vec<(String, u32)> = hako_containers(&mut rt, "web")
            .await
            .iter()
            .map(name_attempt)
            .collect();
        assert_eq!(
            after, before,
            "hako's containers after a restart (graceful: {graceful})"
        );
        assert_eq!(hako_running(&mut rt, "web", "web").await.id, web_id);
        let web = k.pod("web").unwrap();
        for c in ["web", "sidecar"] {
            assert_eq!(
                restart_count(&web, c),
                0,
                "{c} (graceful: {graceful}): {web}"
            );
        }
    }

    // Deleting the manifests tears the pods down: nothing of them is left in hako, in the
    // kernel (mounts, netns, cgroups, IP leases) or in kubelet's dirs.
    let web_dir = k.root_dir.join("pods").join(&web_uid);
    assert!(web_dir.is_dir(), "{} while the pod runs", web_dir.display());
    let pod_cgroups: Vec<PathBuf> = cgroup_mounts()
        .into_iter()
        .map(|m| m.join(&parent))
        .filter(|d| d.is_dir())
        .collect();
    assert!(
        !pod_cgroups.is_empty(),
        "no cgroup dir {parent} while the pod runs"
    );
    assert!(!net.leased().is_empty());
    k.remove_manifest("web");
    support::wait_for(
        "kubelet to forget the pods and hako to remove them",
        GC,
        || {
            k.pods().is_empty()
                && std::fs::read_dir(h.state.join("pods")).is_ok_and(|mut d| d.next().is_none())
        },
    )
    .await;
    let deadline = std::time::Instant::now() + GC;
    loop {
        let sandboxes = rt
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .items;
        if sandboxes.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "kubelet left sandboxes in hako: {sandboxes:?}\n{}",
            k.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    support::wait_for("kubelet to remove the pod's cgroup and dir", GC, || {
        pod_cgroups.iter().all(|d| !d.exists()) && !web_dir.exists()
    })
    .await;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    // (kubelet's root dir is a bind mount of its own for as long as kubelet runs.)
    for dir in [h.dir.path(), &k.root_dir.join("pods")] {
        assert!(
            !mounts.contains(&dir.display().to_string()),
            "mounts left under {}:\n{mounts}",
            dir.display()
        );
    }
    assert!(cni::netns_mounts_under(h.dir.path()).is_empty());
    for d in watched_dirs(&h) {
        let left = Hako::files_under(&d);
        assert!(left.is_empty(), "{} left: {left:?}", d.display());
    }
    assert!(
        net.leased().is_empty(),
        "IP leases left: {:?}",
        net.leased()
    );
    assert!(net.veths().is_empty(), "veths left: {:?}", net.veths());
}

/// Host checks of `kubeadm init phase preflight` that cannot pass on a test machine and are
/// not the runtime's business; each is ignored by name, none of the runtime's (CRI,
/// ContainerRuntimeVersion, ImagePull) is.
const HOST_CHECKS: &[&str] = &[
    // No systemd as PID 1 on the e2e machines: the kubelet service cannot be checked.
    "Service-Kubelet",
    // kubeadm's system verifier rejects these machines' cgroup v1 hierarchies and kernel
    // config (it checks the host, not the runtime).
    "SystemVerification",
    // A CI machine may have swap on, fewer than 2 CPUs or 1700 MB.
    "Swap",
    "NumCPU",
    "Mem",
    // A host sysctl an admin sets before kubeadm init. A fresh machine has it off; the bridge
    // CNI plugin turns it on the first time it sets up a gateway, so without this the check's
    // result depended on whether another test had run first.
    "FileContent--proc-sys-net-ipv4-ip_forward",
];

/// A container that counts, one numbered line every 20 ms, on the host network.
const COUNTER: &str = r#"  terminationGracePeriodSeconds: 1
  hostNetwork: true
  containers:
  - name: counter
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "i=0; trap 'exit 0' TERM; while true; do i=$((i+1)); echo line-$i; sleep 0.02; done"]
"#;

/// The numbers of the `line-N` lines in a CRI log text, complete (`F`) lines only.
fn counted_lines(text: &str) -> Vec<u64> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(4, ' ');
            let (_ts, _stream, tag, msg) = (f.next()?, f.next()?, f.next()?, f.next()?);
            (tag == "F").then(|| msg.strip_prefix("line-")?.parse().ok())?
        })
        .collect()
}

/// The lines of a container's log dir in the order they were written: the rotated files
/// (`0.log.<time>`, gzipped as `.gz` by kubelet; a file and its `.gz` both there while
/// kubelet compresses, then the plain one counts) by time, then the live `0.log`. `None` when
/// kubelet rotated, compressed or removed a file while they were read (a file listed gone, or
/// the listing changed meanwhile): the caller reads again.
fn rotated_log_numbers(dir: &Path) -> Option<(Vec<u64>, usize)> {
    let listing = || -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "0.log")
            .collect();
        names.sort();
        names
    };
    let before = listing();
    let mut rotated: std::collections::BTreeMap<String, PathBuf> = Default::default();
    for name in &before {
        if !name.starts_with("0.log.") || name.ends_with(".tmp") {
            continue;
        }
        let stem = name.trim_end_matches(".gz").to_string();
        if name.ends_with(".gz") && rotated.contains_key(&stem) {
            continue;
        }
        rotated.insert(stem, dir.join(name));
    }
    let mut numbers = Vec::new();
    for path in rotated.values() {
        let bytes = std::fs::read(path).ok()?;
        let text = if path.extension().is_some_and(|x| x == "gz") {
            let mut out = String::new();
            use std::io::Read;
            flate2::read::GzDecoder::new(&bytes[..])
                .read_to_string(&mut out)
                .unwrap();
            out
        } else {
            String::from_utf8_lossy(&bytes).into_owned()
        };
        numbers.extend(counted_lines(&text));
    }
    let live = std::fs::read_to_string(dir.join("0.log")).unwrap_or_default();
    numbers.extend(counted_lines(&live));
    (listing() == before).then_some((numbers, rotated.len()))
}

/// kubelet rotates a container's log past `containerLogMaxSize`: it renames the file and asks
/// hako to reopen it (ReopenContainerLog); hako's writer must move to the new file at once, so
/// that across the rotated files and the live one every line the container wrote is there,
/// once, in order.
#[tokio::test(flavor = "multi_thread")]
async fn kubelet_rotates_container_logs_without_losing_a_line() {
    if !support::e2e_ready(&["kubelet"]) || !cni::ready() {
        return;
    }
    let _one = ONE_KUBELET.lock().await;
    let net = TestNet::new();
    let Some((_reg, h)) = ready_with_config(&net.hako_config(30)).await else {
        return;
    };
    let mut k = Kubelet::start_with(
        &h,
        &net,
        "containerLogMaxSize: 2Ki\ncontainerLogMaxFiles: 50\ncontainerLogMonitorInterval: 3s\n",
    );
    k.write_manifest("counter", &manifest("counter", COUNTER));
    let pod = k
        .wait_pod("the counter to run", "counter", |p| running(p, "counter"))
        .await;
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_string();
    let dir = k
        .pod_logs
        .join(format!("default_counter-{NODE}_{uid}"))
        .join("counter");
    let mut seen = (Vec::new(), 0);
    support::wait_for("kubelet to rotate the counter's log 3 times", GC, || {
        match rotated_log_numbers(&dir) {
            Some(s) => {
                seen = s;
                seen.1 >= 3
            }
            None => false,
        }
    })
    .await;
    let (numbers, rotated) = seen;
    // kubelet renames the file before it calls ReopenContainerLog: the last rotation's call
    // may not have reached hako's log when the rename is seen.
    let reopens = || h.log_text().matches("\"ReopenContainerLog\"").count();
    support::wait_for(
        "a ReopenContainerLog call in hako's log for each rotation",
        Duration::from_secs(30),
        || reopens() >= rotated,
    )
    .await;
    let last = *numbers.last().expect("lines in the log");
    let expected: Vec<u64> = (1..=last).collect();
    if numbers != expected {
        let gaps: Vec<(u64, u64)> = numbers
            .windows(2)
            .filter(|w| w[1] != w[0] + 1)
            .map(|w| (w[0], w[1]))
            .take(10)
            .collect();
        panic!(
            "lines lost, repeated or out of order across {rotated} rotations ({} lines, last {last}, first {:?}): jumps {gaps:?}",
            numbers.len(),
            numbers.first()
        );
    }
    k.remove_manifest("counter");
    support::wait_for(
        "kubelet to forget the counter and hako to remove it",
        GC,
        || {
            k.pods().is_empty()
                && std::fs::read_dir(h.state.join("pods")).is_ok_and(|mut d| d.next().is_none())
        },
    )
    .await;
}

/// A host-network container that sleeps, to keep its image in use.
const KEEPER: &str = r#"  terminationGracePeriodSeconds: 1
  hostNetwork: true
  containers:
  - name: keeper
    image: IMAGE
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done"]
"#;

/// hako's image of that name, if it has it.
async fn hako_image(h: &Hako, image: &str) -> Option<cri::Image> {
    h.images()
        .await
        .image_status(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: image.into(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .image
}

/// kubelet's error lines that say nothing against the runtime: its own expected ones, or
/// hako's right answers to questions it asks any runtime.
fn kubelet_error_expected(line: &str, hako_log: &str) -> bool {
    // The image GC kubelet runs as it starts, before cAdvisor has the filesystem's stats
    // (containerd's nodes log it too); the capacity is checked in the summary after.
    (line.contains("Image garbage collection failed once. Stats initialization may not have completed yet")
        && line.contains("invalid capacity 0 on image filesystem"))
        // kubelet's cAdvisor knows a container filesystem label for CRI-O only (containerd
        // gets the same); kubelet ignores it.
        || line.contains("no imagefs label for configured runtime")
        // kubelet's start-up probe whether the runtime implements PodSandboxStats: any answer
        // but UNIMPLEMENTED will do; hako's is NotFound for the empty ID.
        || (line.contains("PodSandbox from runtime service failed") && line.contains("podSandboxID=\"\""))
        // kubelet's container GC asks about the container of each dead symlink in
        // /var/log/containers, which other kubelets on the machine may have left: NotFound
        // for a container this hako never created.
        || (line.contains("ContainerStatus from runtime service failed")
            && line.contains("code = NotFound")
            && line
                .split("containerID=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
                .is_some_and(|id| !hako_log.contains(&format!("container created container={id}"))))
}

/// hako's (only) image filesystem, as ImageFsInfo answers it.
async fn hako_image_fs(h: &Hako) -> cri::FilesystemUsage {
    h.images()
        .await
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .image_filesystems
        .remove(0)
}

/// kubelet's eviction manager reads the image filesystem from hako (ImageFsInfo, through
/// `/stats/summary`'s `node.runtime.imageFs`) and, under image filesystem pressure (forced by a
/// 99 % `imagefs.available` threshold), has its image GC delete the unused image through hako
/// (ListImages, ListContainers' image refs for the images in use, RemoveImage) while the image
/// a running container uses stays; kubelet logs no error about the runtime or its images.
#[tokio::test(flavor = "multi_thread")]
async fn kubelet_collects_unused_images_through_hako() {
    if !support::e2e_ready(&["kubelet"]) || !cni::ready() {
        return;
    }
    let _one = ONE_KUBELET.lock().await;
    let net = TestNet::new();
    let Some((reg, h)) = ready_with_config(&net.hako_config(30)).await else {
        return;
    };
    // An image no pod uses, with 1 MiB of its own beside the busybox layer.
    const UNUSED: &str = "registry.k8s.io/e2e-test-images/unused:1";
    let img = support::oci::Image::new(
        vec![
            support::oci::Layer::new(
                &support::oci::busybox_base_tar(),
                support::oci::Compression::Gzip,
                false,
            ),
            support::oci::Layer::new(
                &support::oci::marker_tar("unused", &[7u8; 1 << 20]),
                support::oci::Compression::Gzip,
                false,
            ),
        ],
        &support::oci::ImageConf::default(),
        false,
    );
    support::oci::Pusher::new(&reg.addr)
        .push("e2e-test-images/unused", "1", &img)
        .await;
    support::hako::pull(&h, UNUSED)
        .await
        .expect("pull the unused image");
    let used_before = hako_image_fs(&h).await.used_bytes.unwrap().value;

    let mut k = Kubelet::start_with(
        &h,
        &net,
        // (0s would read as unset: kubelet's default age is 2 minutes.) The periodic image GC
        // only runs above 99 % (the shared machine's disk may be 90 % full).
        "imageMinimumGCAge: 1s\nimageGCHighThresholdPercent: 99\nimageGCLowThresholdPercent: 98\nevictionHard:\n  imagefs.available: \"99%\"\n",
    );
    k.write_manifest("keeper", &manifest("keeper", KEEPER));
    k.wait_pod("the keeper to run", "keeper", |p| running(p, "keeper"))
        .await;
    let from = h.log_text().len();
    let deadline = std::time::Instant::now() + GC;
    while hako_image(&h, UNUSED).await.is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {GC:?} waiting for kubelet to remove the unused image through hako\n{}",
            k.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        hako_log_count(&h, from, "rpc=\"RemoveImage\"") >= 1,
        "the unused image went without a RemoveImage"
    );
    // One more round of kubelet's image GC with the keeper running: its image stays.
    let rounds = |k: &Kubelet| {
        k.log_text()
            .matches("Attempting to delete unused images")
            .count()
    };
    let seen = rounds(&k);
    support::wait_for("another round of kubelet's image GC", GC, || {
        rounds(&k) > seen
    })
    .await;
    assert!(
        hako_image(&h, IMAGE).await.is_some(),
        "kubelet removed the image the keeper runs"
    );
    assert!(running(&k.pod("keeper").unwrap(), "keeper"));

    // The image filesystem as kubelet reports it: hako's usage, the capacity and free space of
    // the filesystem under hako's image root.
    let hako_fs = hako_image_fs(&h).await;
    let used_after = hako_fs.used_bytes.as_ref().unwrap().value;
    assert!(
        used_after + (1 << 20) <= used_before,
        "hako's image fs usage {used_before} -> {used_after} after the removal"
    );
    let mountpoint = PathBuf::from(&hako_fs.fs_id.as_ref().unwrap().mountpoint);
    assert!(mountpoint.starts_with(&h.root), "{}", mountpoint.display());
    let summary = k.get("/stats/summary").expect("kubelet's summary");
    let runtime = &summary["node"]["runtime"];
    let image_fs = &runtime["imageFs"];
    let st = nix::sys::statvfs::statvfs(&mountpoint).unwrap();
    let frsize = st.fragment_size() as u64;
    let field = |f: &str| {
        image_fs[f]
            .as_u64()
            .unwrap_or_else(|| panic!("no {f} in kubelet's imageFs: {runtime}"))
    };
    assert_eq!(field("usedBytes"), used_after, "{runtime}");
    assert_eq!(
        field("capacityBytes"),
        st.blocks() as u64 * frsize,
        "{runtime}"
    );
    assert_eq!(field("inodes"), st.files() as u64, "{runtime}");
    assert_eq!(
        field("inodesUsed"),
        hako_fs.inodes_used.as_ref().unwrap().value,
        "{runtime}"
    );
    // Free space moves with the other writers of the filesystem: within 1 % of it.
    let avail = st.blocks_available() as u64 * frsize;
    assert!(
        field("availableBytes").abs_diff(avail) < field("capacityBytes") / 100,
        "kubelet's availableBytes, statfs says {avail}: {runtime}"
    );
    assert!(field("inodesFree") > 0, "{runtime}");
    // kubelet counts containers on the image filesystem (no separate container filesystem).
    assert_eq!(runtime["containerFs"], runtime["imageFs"], "{runtime}");

    // No error of kubelet's about the runtime, its images, the image filesystem or its GC.
    let log = k.log_text();
    let hako_log = without_colours(&h.log_text());
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with('E'))
        .filter(|l| {
            let lower = l.to_lowercase();
            ["image", "rpc error", "runtime service"]
                .iter()
                .any(|w| lower.contains(w))
        })
        .filter(|l| !kubelet_error_expected(l, &hako_log))
        .collect();
    assert!(
        errors.is_empty(),
        "kubelet's errors about hako:\n{}",
        errors.join("\n")
    );

    k.remove_manifest("keeper");
    support::wait_for(
        "kubelet to forget the keeper and hako to remove it",
        GC,
        || {
            k.pods().is_empty()
                && std::fs::read_dir(h.state.join("pods")).is_ok_and(|mut d| d.next().is_none())
        },
    )
    .await;
}

/// kubeadm's preflight against hako passes its container runtime checks: the runtime answers
/// (CRI), implements RuntimeConfig (ContainerRuntimeVersion) and pulls the control plane
/// images (ImagePull; stand-ins under their public names, served by the local registry).
#[tokio::test(flavor = "multi_thread")]
async fn kubeadm_preflight_passes_the_runtime_checks() {
    if !support::e2e_ready(&["kubeadm"]) {
        return;
    }
    let Some((reg, h)) = ready().await else {
        return;
    };
    let kubeadm = support::which("kubeadm").unwrap();
    // The kubelet built beside kubeadm, for its KubeletVersion check.
    let path = format!(
        "{}:{}",
        kubeadm.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |args: &[&str]| {
        let out = Command::new(&kubeadm)
            .args(args)
            .env("PATH", &path)
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (ok, version) = run(&["version", "-o", "short"]);
    assert!(ok, "{version}");
    let version = version.trim().to_string();
    let (ok, images) = run(&["config", "images", "list", "--kubernetes-version", &version]);
    assert!(ok, "{images}");
    let base = support::oci::Layer::new(
        &support::oci::busybox_base_tar(),
        support::oci::Compression::Gzip,
        false,
    );
    let img = support::oci::Image::new(vec![base], &support::oci::ImageConf::default(), false);
    let pusher = support::oci::Pusher::new(&reg.addr);
    let images: Vec<&str> = images.lines().filter(|l| !l.is_empty()).collect();
    assert!(images.len() >= 5, "{images:?}");
    for image in &images {
        let path = image
            .strip_prefix("registry.k8s.io/")
            .unwrap_or_else(|| panic!("{image} is not on registry.k8s.io"));
        let (repo, tag) = path.rsplit_once(':').unwrap();
        pusher.push(repo, tag, &img).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kubeadm.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeadm.k8s.io/v1beta4\nkind: InitConfiguration\nnodeRegistration:\n  criSocket: {}\n---\napiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\nkubernetesVersion: {version}\n",
            h.endpoint()
        ),
    )
    .unwrap();
    let (ok, out) = run(&[
        "init",
        "phase",
        "preflight",
        "--config",
        config.to_str().unwrap(),
        "--ignore-preflight-errors",
        &HOST_CHECKS.join(","),
        "--v=1",
    ]);
    eprintln!("{out}");
    assert!(ok, "kubeadm preflight failed:\n{out}");
    for check in ["CRI", "ContainerRuntimeVersion", "ImagePull"] {
        assert!(
            !out.contains(&format!("[WARNING {check}]"))
                && !out.contains(&format!("[ERROR {check}]")),
            "kubeadm's {check} check complained:\n{out}"
        );
    }
    // The images were pulled through hako.
    let mut images_client = h.images().await;
    for image in &images {
        let st = images_client
            .image_status(cri::ImageStatusRequest {
                image: Some(cri::ImageSpec {
                    image: image.to_string(),
                    ..Default::default()
                }),
                verbose: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(
            st.image.is_some(),
            "hako does not have {image} after the preflight"
        );
    }
}
