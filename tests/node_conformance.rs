//! Kubernetes' node conformance suite (`test/e2e_node`, the `NodeConformance` specs) against
//! hako. Ignored by `cargo test`: it takes long and needs `e2e_node.test` and `agnhost`, which
//! scripts/node-conformance.sh builds and then runs this with `--ignored`.
//!
//! What it sets up: the suite's images as busybox-based stand-ins in a local registry, served
//! under their registry.k8s.io names through hako's `hosts.toml` mirror; hako on a CNI bridge
//! network of its own; the suite's own etcd + API server (`e2e_node.test --run-services-mode`);
//! kubelet registered with that API server, on hako's socket; then the suite itself, its
//! JSON and junit reports written to `$HAKO_NODE_CONFORMANCE_REPORT`. The test fails only when
//! the suite could not run; what each spec did is in the report and the printed summary.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hako_proto::cri;
use support::cni::TestNet;
use support::cri::*;
use support::hako::Hako;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher, Tar};
use support::registry::free_port;

const NODE: &str = "hako-node";
const DEFAULT_LABELS: &str =
    "NodeConformance && !Serial && !Slow && !Flaky && !Disruptive && Feature: isEmpty";

/// A child process killed (SIGTERM, then SIGKILL) when dropped.
struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command, log: PathBuf) -> Proc {
        let out = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        Proc { name, child, log }
    }

    fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "--- {} log (last 40 lines) ---\n{}",
            self.name,
            lines[lines.len().saturating_sub(40)..].join("\n")
        )
    }

    fn check_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("{} exited with {status}\n{}", self.name, self.tail());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn layer_with(files: &[(&str, &[u8], u32)]) -> Layer {
    let mut t = Tar::default();
    for (path, data, mode) in files {
        t.file(path, data, *mode);
    }
    Layer::new(&t.finish(), Compression::Gzip, false)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// `curl [options] URL` as the specs use it: the body of a GET to stdout.
const CURL: &str = r#"#!/bin/sh
url=
for a in "$@"; do
  case $a in -*) ;; *) url=$a ;; esac
done
exec wget -q -O - "$url"
"#;

/// Pushes the stand-ins for the images the suite's specs use (test/utils/image/manifest.go at
/// v1.37.2), under their paths on registry.k8s.io. Returns the public names pushed.
async fn push_images(p: &Pusher, agnhost: &Path) -> Vec<String> {
    let base = Layer::new(&oci::busybox_base_tar(), Compression::Gzip, false);
    let mut pushed = Vec::new();
    let mut push = async |repo: &str, tags: &[&str], img: &Image| {
        for tag in tags {
            p.push(repo, tag, img).await;
            pushed.push(format!("registry.k8s.io/{repo}:{tag}"));
        }
    };
    let plain = |conf: &ImageConf| Image::new(vec![base.clone()], conf, false);
    // Upstream's busybox has the nmeter applet (the container lifecycle specs take their
    // millisecond timestamps from it, in busybox and in agnhost); Debian's has not: a stand-in
    // program.
    let nmeter = support::standins::go_binary("nmeter");
    let busybox = Image::new(
        vec![
            base.clone(),
            upstream_busybox_layer(),
            layer_with(&[("bin/nmeter", &nmeter, 0o755)]),
        ],
        &ImageConf::default(),
        false,
    );
    push(
        "e2e-test-images/busybox",
        &["1.37.0-2", "1.36.1-1", "1.29-2"],
        &busybox,
    )
    .await;
    // Images whose specs need only a shell and coreutils from them.
    for (repo, tag) in [
        ("e2e-test-images/ipc-utils", "1.4"),
        ("e2e-test-images/glibc-dns-testing", "2.1.1"),
        ("e2e-test-images/kitten", "1.8"),
        ("e2e-test-images/nautilus", "1.8"),
    ] {
        // A marker per image: distinct image IDs, as upstream's are.
        let mut marker = Tar::default();
        marker.file(&format!("{repo}-{tag}"), b"", 0o644);
        if repo.ends_with("/kitten") {
            // What the ImageVolume specs read from upstream's kitten (an Alpine image) when
            // they mount it as a volume.
            marker
                .file("data.json", br#"{"image": "kitten.jpg"}"#, 0o644)
                .file(
                    "etc/os-release",
                    b"NAME=\"Alpine Linux\"\nID=alpine\n",
                    0o644,
                );
        }
        let img = Image::new(
            vec![
                base.clone(),
                Layer::new(&marker.finish(), Compression::Gzip, false),
            ],
            &ImageConf::default(),
            false,
        );
        push(repo, &[tag], &img).await;
    }
    push(
        "e2e-test-images/nonroot",
        &["1.5"],
        &plain(&ImageConf {
            user: "1234".into(),
            ..Default::default()
        }),
    )
    .await;
    // agnhost as upstream runs it: /agnhost, `pause` by default.
    let agnhost_bin = std::fs::read(agnhost).unwrap_or_else(|e| panic!("{agnhost:?}: {e}"));
    // Upstream's agnhost is alpine with bash, curl and netcat-openbsd; specs run `/bin/bash -c`
    // scripts (busybox sh reads them), `curl URL` hooks (busybox wget fetches them) and
    // `nc -w 1 -u IP PORT` (a stand-in: Debian's busybox nc has no -u). Its https server
    // serves /localhost.crt and /localhost.key (a self-signed pair made here); some specs run
    // it as /agnhost-2.
    let (crt, key) = self_signed_localhost();
    let mut extra = Tar::default();
    extra
        .file("agnhost", &agnhost_bin, 0o755)
        .symlink("agnhost-2", "/agnhost")
        .file("localhost.crt", &crt, 0o644)
        .file("localhost.key", &key, 0o600)
        .file("bin/nmeter", &nmeter, 0o755)
        .file("bin/bash", b"#!/bin/sh\nexec /bin/sh \"$@\"\n", 0o755)
        .file("usr/bin/curl", CURL.as_bytes(), 0o755)
        .file("usr/bin/nc", &support::standins::go_binary("nc"), 0o755);
    let agnhost_img = Image::new(
        vec![
            base.clone(),
            Layer::new(&extra.finish(), Compression::Gzip, false),
        ],
        &ImageConf {
            entrypoint: strings(&["/agnhost"]),
            cmd: strings(&["pause"]),
            ..Default::default()
        },
        false,
    );
    push("e2e-test-images/agnhost", &["2.66.1", "2.55"], &agnhost_img).await;
    let web = support::standins::go_binary("webserver");
    let nginx = Image::new(
        vec![
            base.clone(),
            layer_with(&[
                ("usr/sbin/nginx", &web, 0o755),
                (
                    "usr/share/nginx/html/index.html",
                    b"<html><body><h1>Welcome to nginx!</h1></body></html>\n",
                    0o644,
                ),
            ]),
        ],
        &ImageConf {
            cmd: strings(&["/usr/sbin/nginx", "-g", "daemon off;"]),
            ..Default::default()
        },
        false,
    );
    push("e2e-test-images/nginx", &["1.27.0-2", "1.28.0-2"], &nginx).await;
    let nnp = Image::new(
        vec![
            base.clone(),
            layer_with(&[(
                "usr/local/bin/nnp",
                &support::standins::go_binary("nnp"),
                0o4755,
            )]),
        ],
        &ImageConf {
            entrypoint: strings(&["/usr/local/bin/nnp"]),
            ..Default::default()
        },
        false,
    );
    push("e2e-test-images/nonewprivs", &["1.4"], &nnp).await;
    let pause = Image::new(
        vec![layer_with(&[(
            "pause",
            &support::standins::go_binary("pause"),
            0o755,
        )])],
        &ImageConf {
            entrypoint: strings(&["/pause"]),
            user: "65535:65535".into(),
            ..Default::default()
        },
        false,
    );
    push("pause", &["3.10.2"], &pause).await;
    pushed
}

/// What the suite's busybox (docker's busybox 1.37) has and the Debian busybox base has not:
/// every applet in /bin (specs run `/bin/top`, `/bin/sysctl`). Still unlike upstream's:
/// Debian's busybox 1.35 ash drops environment variables whose names are no shell identifiers
/// (`data-1`, from a ConfigMap's EnvFrom) from what it passes on; bash as `sh` keeps them but
/// fails specs that expect ash's error messages.
fn upstream_busybox_layer() -> Layer {
    let mut t = Tar::default();
    let list = Command::new("/usr/bin/busybox")
        .arg("--list-full")
        .output()
        .expect("busybox --list-full");
    let list = String::from_utf8_lossy(&list.stdout);
    let applets: Vec<&str> = list.lines().map(str::trim).collect();
    let mut seen: std::collections::BTreeSet<&str> = applets
        .iter()
        .filter_map(|a| a.strip_prefix("bin/"))
        .collect();
    // pgrep and ipcs are procps' and util-linux' in the base (busybox's are missing).
    seen.extend(["", "busybox", "pgrep", "ipcs"]);
    for applet in applets {
        let name = applet.rsplit('/').next().unwrap_or("");
        if seen.insert(name) {
            t.symlink(&format!("bin/{name}"), "busybox");
        }
    }
    Layer::new(&t.finish(), Compression::Gzip, false)
}

/// A self-signed certificate and key for `localhost` (PEM), made with openssl.
fn self_signed_localhost() -> (Vec<u8>, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (crt, key) = (
        dir.path().join("localhost.crt"),
        dir.path().join("localhost.key"),
    );
    let out = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3650",
        ])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(out.status.success(), "openssl req: {out:?}");
    (std::fs::read(crt).unwrap(), std::fs::read(key).unwrap())
}

/// Waits until `addr` accepts TCP connections; fails naming `what` (with `proc`'s log).
async fn wait_listening(what: &str, addr: &str, proc: &mut Proc, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while std::net::TcpStream::connect(addr).is_err() {
        proc.check_running();
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what} on {addr}\n{}",
            proc.tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What ginkgo's JSON report says of one spec.
struct SpecResult {
    state: String,
    name: String,
    /// The failure message of its last attempt.
    message: String,
    /// How many times it ran (more than one when a failed attempt was retried).
    attempts: u64,
    seconds: f64,
}

/// Every spec in ginkgo's JSON report.
fn spec_results(report: &Path) -> Vec<SpecResult> {
    let text = std::fs::read_to_string(report).unwrap_or_else(|e| panic!("{report:?}: {e}"));
    let suites: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for suite in suites.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" {
                continue;
            }
            let mut name: Vec<String> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                // ginkgo leaves empty texts out of a spec's full text (its focus matches that).
                .filter(|t| !t.is_empty())
                .collect();
            name.push(spec["LeafNodeText"].as_str().unwrap_or("").to_string());
            out.push(SpecResult {
                state: spec["State"].as_str().unwrap_or("").to_string(),
                name: name.join(" "),
                message: spec["Failure"]["Message"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                attempts: spec["NumAttempts"].as_u64().unwrap_or(1),
                seconds: spec["RunTime"].as_f64().unwrap_or(0.0) / 1e9,
            });
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "runs Kubernetes' node conformance suite for a long time: scripts/node-conformance.sh"]
async fn node_conformance_suite() {
    let bin = PathBuf::from(
        std::env::var_os("HAKO_NODE_CONFORMANCE_BIN")
            .expect("HAKO_NODE_CONFORMANCE_BIN: the dir with e2e_node.test and agnhost"),
    );
    let report = PathBuf::from(
        std::env::var_os("HAKO_NODE_CONFORMANCE_REPORT")
            .expect("HAKO_NODE_CONFORMANCE_REPORT: where the reports go"),
    );
    std::fs::create_dir_all(&report).unwrap();
    let labels =
        std::env::var("HAKO_NODE_CONFORMANCE_LABELS").unwrap_or_else(|_| DEFAULT_LABELS.into());
    let focus = std::env::var("HAKO_NODE_CONFORMANCE_FOCUS").unwrap_or_default();
    // Specs left out by name (a ginkgo skip regexp): those that cannot pass on the machine, each
    // named with its reason where the caller sets this (scripts/test.sh).
    let skip = std::env::var("HAKO_NODE_CONFORMANCE_SKIP").unwrap_or_default();
    // A spec that fails is run again up to this many attempts in all; the summary names every
    // spec that needed more than one.
    let attempts: u32 = std::env::var("HAKO_NODE_CONFORMANCE_ATTEMPTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1);
    let suite = bin.join("e2e_node.test");
    assert!(suite.is_file(), "{suite:?} missing: build it first");
    let kubelet_bin = support::which("kubelet").expect("kubelet (build .ci/build-kubelet.sh)");

    let net = TestNet::new();
    // The suite's PodOverhead spec runs its pod with RuntimeClass handler `test-handler`, which
    // its CI configures in containerd.
    let hako_config = format!(
        "{}[runtime]\nhandlers = [\"test-handler\"]\n",
        net.hako_config(30)
    );
    let (reg, h) = ready_with_config(&hako_config)
        .await
        .expect("registry and hako");
    let pushed = push_images(&Pusher::new(&reg.addr), &bin.join("agnhost")).await;
    eprintln!("images served: {}", pushed.join(" "));

    // kubelet refuses a loopback node IP and the API server dials the node's IP: the test
    // bridge's address is the host's own (made before the first pod, as tests/kubelet.rs does).
    let node_ip = net.gateway.clone();
    for args in [
        vec!["link", "add", &net.bridge, "type", "bridge"],
        vec!["addr", "add", &format!("{node_ip}/24"), "dev", &net.bridge],
        vec!["link", "set", &net.bridge, "up"],
    ] {
        let out = Command::new("ip").args(&args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {out:?}");
    }

    let work = tempfile::tempdir().unwrap();
    let token = format!("hako-{}", std::process::id());
    // The suite's etcd and API server write into their working dir.
    let services_dir = work.path().join("services");
    std::fs::create_dir_all(&services_dir).unwrap();
    let mut services = Proc::spawn(
        "e2e services",
        Command::new(&suite)
            .arg("--run-services-mode")
            .arg(format!("--bearer-token={token}"))
            .current_dir(&services_dir),
        report.join("services.log"),
    );
    wait_listening(
        "the API server",
        "127.0.0.1:6443",
        &mut services,
        Duration::from_secs(120),
    )
    .await;

    let kdir = work.path().join("kubelet");
    let manifests = kdir.join("manifests");
    let root_dir = kdir.join("root");
    for d in [&manifests, &root_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    let kubeconfig = kdir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: e2e\n  cluster:\n    server: https://127.0.0.1:6443\n    insecure-skip-tls-verify: true\nusers:\n- name: e2e\n  user:\n    token: {token}\ncontexts:\n- name: e2e\n  context:\n    cluster: e2e\n    user: e2e\ncurrent-context: e2e\n"
        ),
    )
    .unwrap();
    let config = kdir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: {endpoint}
imageServiceEndpoint: {endpoint}
staticPodPath: {manifests}
fileCheckFrequency: 5s
address: {node_ip}
port: {port}
# The Summary API spec reads /stats/summary from the read-only port (at `address`), the
# device plugin specs wait for kubelet's healthz at its default, 127.0.0.1:10248.
readOnlyPort: 10255
healthzPort: 10248
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
enforceNodeAllocatable: []
podCIDR: {prefix}.0/24
# The shared machine's disk is fuller than kubelet's default thresholds (imagefs.available
# 15%): DiskPressure would reject every pod. Eviction is not what the suite tests here.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
featureGates:
  PodAndContainerStatsFromCRI: true
"#,
            endpoint = h.endpoint(),
            manifests = manifests.display(),
            port = free_port(),
            prefix = net.prefix,
        ),
    )
    .unwrap();
    // Declared before kubelet: dropped after it. Pod logs stay in kubelet's default dir: the
    // log path spec looks for them there.
    let kubelet_guard = KubeletDirs {
        root: kdir.clone(),
        pod_logs_made: !Path::new(POD_LOGS).exists(),
    };
    let mut kubelet = Proc::spawn(
        "kubelet",
        Command::new(&kubelet_bin)
            .arg(format!("--config={}", config.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--root-dir={}", root_dir.display()))
            .arg(format!("--cert-dir={}", kdir.join("pki").display()))
            .arg(format!("--hostname-override={NODE}"))
            .arg(format!("--node-ip={node_ip}"))
            .arg("--v=2"),
        report.join("kubelet.log"),
    );

    // Specs without the Serial label may share the node: several suite processes, each with
    // its part of the spec list, as ginkgo's parallel mode runs them.
    let selected = dry_run(&suite, &labels, &focus, &skip, work.path());
    let left_out: Vec<String> = if skip.is_empty() {
        Vec::new()
    } else {
        dry_run(&suite, &labels, &focus, "", work.path())
            .into_iter()
            .map(|s| s.name)
            .filter(|n| !selected.iter().any(|s| &s.name == n))
            .collect()
    };
    let parts = spec_parts(selected);
    let started = Instant::now();
    kubelet.check_running();
    let mut runs = Vec::new();
    for (i, part_focus) in parts.iter().enumerate() {
        let mut args = vec![
            format!("--ginkgo.label-filter={labels}"),
            format!("--ginkgo.focus={part_focus}"),
            "--ginkgo.no-color".into(),
            "--ginkgo.timeout=24h".into(),
            format!("--ginkgo.flake-attempts={attempts}"),
            format!(
                "--ginkgo.json-report={}",
                report.join(format!("report-{i}.json")).display()
            ),
            format!(
                "--ginkgo.junit-report={}",
                report.join(format!("junit-{i}.xml")).display()
            ),
            "--start-services=false".into(),
            format!("--bearer-token={token}"),
            "--prepull-images=false".into(),
            format!("--container-runtime-endpoint={}", h.endpoint()),
            format!("--image-service-endpoint={}", h.endpoint()),
            format!("--node-name={NODE}"),
            // kubelet's gates as the suite's skips see them: the /metrics/cadvisor spec is
            // skipped with CRI stats on (cAdvisor has no container of hako's to report).
            "--feature-gates=PodAndContainerStatsFromCRI=true".into(),
        ];
        args.push(format!(
            "--report-dir={}",
            report.join(format!("part-{i}")).display()
        ));
        let dir = work.path().join(format!("suite-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        let log = std::fs::File::create(report.join(format!("suite-{i}.log"))).unwrap();
        runs.push(
            Command::new(&suite)
                .args(&args)
                .current_dir(&dir)
                .stdout(Stdio::from(log.try_clone().unwrap()))
                .stderr(Stdio::from(log))
                .spawn()
                .expect("run e2e_node.test"),
        );
    }
    let statuses: Vec<String> = runs
        .iter_mut()
        .map(|c| c.wait().unwrap().to_string())
        .collect();
    let took = started.elapsed();
    std::fs::copy(&h.log, report.join("hako.log")).unwrap();
    let mut results = Vec::new();
    for i in 0..parts.len() {
        results.extend(spec_results(&report.join(format!("report-{i}.json"))));
    }
    // Each process's report lists every spec of the binary, those its focus and labels left
    // out as skipped without a message: only the others were run (or skipped by the suite).
    results.retain(|r| r.state != "skipped" || !r.message.is_empty());
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for r in &results {
        *counts.entry(r.state.as_str()).or_default() += 1;
    }
    let mut summary = format!(
        "{} suite process(es) exited {statuses:?} after {:.0} s; specs: {}; {counts:?}\n",
        parts.len(),
        took.as_secs_f64(),
        results.len()
    );
    for r in &results {
        if r.state != "passed" {
            let first = r.message.lines().next().unwrap_or("");
            summary.push_str(&format!("{}: {}\n    {first}\n", r.state, r.name));
        }
    }
    for r in results.iter().filter(|r| r.attempts > 1) {
        summary.push_str(&format!(
            "{} after {} attempts: {}\n",
            r.state, r.attempts, r.name
        ));
    }
    if !left_out.is_empty() {
        summary.push_str(&format!(
            "left out by HAKO_NODE_CONFORMANCE_SKIP ({}): {}\n",
            left_out.len(),
            left_out.join("; ")
        ));
    }
    std::fs::write(report.join("summary.txt"), &summary).unwrap();
    let mut durations: Vec<String> = results
        .iter()
        .filter(|r| r.state == "passed")
        .map(|r| format!("{:.1}\t{}\n", r.seconds, r.name))
        .collect();
    durations.sort_by(|a, b| {
        a.split_once('\t')
            .map(|x| x.1)
            .cmp(&b.split_once('\t').map(|x| x.1))
    });
    std::fs::write(report.join("durations.tsv"), durations.concat()).unwrap();
    eprintln!("{summary}");
    drop(kubelet);
    remove_all_pods(&h).await;
    drop(kubelet_guard);
    drop(services);
    assert!(
        !results.is_empty(),
        "the suite ran no spec: see {}",
        report.display()
    );
    // HAKO_NODE_CONFORMANCE_STRICT=1 (CI): every spec run passed, or the suite skipped it
    // with its reason.
    if std::env::var_os("HAKO_NODE_CONFORMANCE_STRICT").is_some_and(|v| v == "1") {
        let bad: Vec<&SpecResult> = results
            .iter()
            .filter(|r| r.state != "passed" && r.state != "skipped")
            .collect();
        assert!(
            bad.is_empty(),
            "{} spec(s) did not pass: {:?}\nsee {}",
            bad.len(),
            bad.iter()
                .map(|r| format!("{}: {}", r.state, r.name))
                .collect::<Vec<_>>(),
            report.display()
        );
    }
}

/// The specs the label filter, the focus and the skip regexp from the environment select (a
/// dry run of the suite lists them).
fn dry_run(suite: &Path, labels: &str, focus: &str, skip: &str, work: &Path) -> Vec<DrySpec> {
    let dry = work.join("dry-run.json");
    let mut dry_run = Command::new(suite);
    if !focus.is_empty() {
        dry_run.arg(format!("--ginkgo.focus={focus}"));
    }
    if !skip.is_empty() {
        dry_run.arg(format!("--ginkgo.skip={skip}"));
    }
    let out = dry_run
        .arg("--ginkgo.dry-run")
        .arg(format!("--ginkgo.label-filter={labels}"))
        .arg(format!("--ginkgo.json-report={}", dry.display()))
        .arg("--prepull-images=false")
        .current_dir(work)
        .output()
        .expect("list the specs");
    assert!(out.status.success(), "dry run: {out:?}");
    dry_run_specs(&dry)
}

/// The focus of each suite process: the selected specs narrowed to shard `i/n` of
/// `$HAKO_NODE_CONFORMANCE_SHARD` (so a caller can run the list in several sittings) and dealt
/// to `$HAKO_NODE_CONFORMANCE_PROCS` processes, each focused on its exact names.
fn spec_parts(selected: Vec<DrySpec>) -> Vec<String> {
    let (shard, shards) = match std::env::var("HAKO_NODE_CONFORMANCE_SHARD") {
        Ok(v) if !v.is_empty() => {
            let (i, n) = v.split_once('/').expect("HAKO_NODE_CONFORMANCE_SHARD: i/n");
            (i.parse::<usize>().unwrap(), n.parse::<usize>().unwrap())
        }
        _ => (1, 1),
    };
    assert!((1..=shards).contains(&shard), "shard {shard}/{shards}");
    let procs: usize = std::env::var("HAKO_NODE_CONFORMANCE_PROCS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    // The specs of an Ordered container share state (a pod made by the first, looked at by
    // the next) and must run in one process, as ginkgo keeps them. The dry run's report does
    // not say which containers are Ordered; among the selected specs (v1.37.2) only those of
    // container_lifecycle_test.go are: the specs of each of its innermost containers stay
    // together.
    let mut groups = std::collections::BTreeMap::<String, Vec<String>>::new();
    for spec in selected {
        let key = if spec.file.ends_with("/container_lifecycle_test.go") {
            spec.container
        } else {
            spec.name.clone()
        };
        let group = groups.entry(key).or_default();
        if !group.contains(&spec.name) {
            group.push(spec.name);
        }
    }
    let mine: Vec<Vec<String>> = groups
        .into_values()
        .enumerate()
        .filter(|(i, _)| i % shards == shard - 1)
        .map(|(_, g)| g)
        .collect();
    let mut parts = vec![Vec::new(); procs.min(mine.len()).max(1)];
    let n = parts.len();
    // The run ends with its slowest process, and the specs' times differ a hundredfold (a
    // device plugin spec waits 5 minutes): the longest groups first, each to the process with
    // the least time dealt so far, by the times of an earlier run.
    let durations = known_durations();
    let time_of = |g: &Vec<String>| -> f64 {
        g.iter()
            .map(|name| {
                durations
                    .get(name.as_str())
                    .copied()
                    .unwrap_or(UNKNOWN_DURATION)
            })
            .sum()
    };
    let mut mine: Vec<(f64, Vec<String>)> = mine.into_iter().map(|g| (time_of(&g), g)).collect();
    mine.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut dealt = vec![0.0f64; n];
    for (time, group) in mine {
        let least = (0..n)
            .min_by(|&a, &b| dealt[a].total_cmp(&dealt[b]))
            .unwrap();
        dealt[least] += time;
        parts[least].extend(group.iter().map(|name| regex_quote(name)));
    }
    parts
        .into_iter()
        // ginkgo matches the focus against "<suite description> <spec text>".
        .map(|p| format!(" (?:{})$", p.join("|")))
        .collect()
}

/// Seconds per spec, from an earlier run (`durations.tsv` of its report).
const DURATIONS: &str = include_str!("node-conformance-durations.tsv");
/// A spec not in that list: about what most take.
const UNKNOWN_DURATION: f64 = 30.0;

fn known_durations() -> std::collections::HashMap<&'static str, f64> {
    DURATIONS
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (secs, name) = l.split_once('\t')?;
            Some((name, secs.parse().ok()?))
        })
        .collect()
}

struct DrySpec {
    name: String,
    /// The texts of its containers.
    container: String,
    /// The source file of the spec.
    file: String,
}

/// The specs a dry run selected.
fn dry_run_specs(report: &Path) -> Vec<DrySpec> {
    let text = std::fs::read_to_string(report).unwrap_or_else(|e| panic!("{report:?}: {e}"));
    let suites: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for suite in suites.as_array().into_iter().flatten() {
        for spec in suite["SpecReports"].as_array().into_iter().flatten() {
            if spec["LeafNodeType"] != "It" || spec["State"] != "passed" {
                continue;
            }
            let containers: Vec<&str> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str())
                .filter(|t| !t.is_empty())
                .collect();
            let leaf = spec["LeafNodeText"].as_str().unwrap_or("");
            let name = containers
                .iter()
                .copied()
                .chain(std::iter::once(leaf))
                .collect::<Vec<_>>()
                .join(" ");
            out.push(DrySpec {
                name,
                container: containers.join(" "),
                file: spec["LeafNodeLocation"]["FileName"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            });
        }
    }
    out
}

/// `s` as a literal in an RE2 regexp (ginkgo's focus).
fn regex_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// What the suite left in hako once kubelet is gone (a spec that failed midway can leave pods).
async fn remove_all_pods(h: &Hako) {
    let mut rt = h.runtime().await;
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .map(|r| r.into_inner().items)
        .unwrap_or_default();
    for p in pods {
        let _ = rt
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await;
        let _ = rt
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: p.id,
            })
            .await;
    }
}

/// kubelet's mounts under its dirs and its QoS cgroups, removed once kubelet is gone.
struct KubeletDirs {
    root: PathBuf,
    pod_logs_made: bool,
}

const POD_LOGS: &str = "/var/log/pods";

impl Drop for KubeletDirs {
    fn drop(&mut self) {
        let dir = self.root.display().to_string();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for m in mounts.lines().rev() {
            if let Some(point) = m.split(' ').nth(4).filter(|p| p.starts_with(&dir)) {
                let _ = nix::mount::umount2(point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        for m in cgroup_mounts() {
            for q in ["kubepods/besteffort", "kubepods/burstable", "kubepods"] {
                let _ = std::fs::remove_dir(m.join(q));
            }
        }
        if self.pod_logs_made {
            let _ = std::fs::remove_dir_all(POD_LOGS);
        }
    }
}
