//! crictl (built from sigs.k8s.io/cri-tools) against a real hako: the image commands a node
//! operator uses, with the output a containerd user expects.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::cni::TestNet;
use support::hako::Hako;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher};
use support::registry::Registry;

struct Crictl<'a> {
    bin: PathBuf,
    hako: &'a Hako,
}

impl Crictl<'_> {
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(&self.bin)
            .args([
                "--runtime-endpoint",
                &self.hako.endpoint(),
                "--image-endpoint",
                &self.hako.endpoint(),
                "--timeout",
                "60s",
            ])
            .args(args)
            .output()
            .expect("run crictl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "crictl {args:?} failed: {err}\n{out}");
        out
    }

    /// Writes the pod config `pod` to `dir/file` and runs `crictl runp` on it: the pod's id,
    /// and the file (`create_start` takes it too).
    fn runp(&self, dir: &Path, file: &str, pod: serde_json::Value) -> (String, PathBuf) {
        let json = dir.join(file);
        std::fs::write(&json, pod.to_string()).unwrap();
        let id = self
            .ok(&["runp", json.to_str().unwrap()])
            .trim()
            .to_string();
        (id, json)
    }

    /// Writes the container config `ctr` to `dir/file`, then `crictl create` in `pod` (whose
    /// config is `pod_json`) and `crictl start`: the container's id.
    fn create_start(
        &self,
        dir: &Path,
        file: &str,
        (pod, pod_json): (&str, &Path),
        ctr: serde_json::Value,
    ) -> String {
        let json = dir.join(file);
        std::fs::write(&json, ctr.to_string()).unwrap();
        let id = self
            .ok(&[
                "create",
                pod,
                json.to_str().unwrap(),
                pod_json.to_str().unwrap(),
            ])
            .trim()
            .to_string();
        self.ok(&["start", &id]);
        id
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_image_commands() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "crictl"]) {
        return;
    }
    let reg = Registry::start();
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf {
            user: "www-data".into(),
            ..Default::default()
        },
        false,
    );
    let digest = Pusher::new(&reg.addr)
        .push("ops/busybox", "1.36", &img)
        .await;
    let h = Hako::start("");
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };

    let v = c.ok(&["version"]);
    assert!(
        v.contains("RuntimeName:  hako") && v.contains("RuntimeApiVersion:  v1"),
        "{v}"
    );

    let info: serde_json::Value = serde_json::from_str(&c.ok(&["info"])).unwrap();
    let conds = info["status"]["conditions"].as_array().unwrap();
    assert!(
        conds
            .iter()
            .any(|c| c["type"] == "RuntimeReady" && c["status"] == true)
            && conds
                .iter()
                .any(|c| c["type"] == "NetworkReady" && c["status"] == true),
        "the harness's loopback CNI config makes the network ready: {info}"
    );
    assert!(
        info["cdi"]["errors"].as_array().unwrap().is_empty(),
        "{info}"
    );
    assert_eq!(info["config"]["listen"], h.socket.display().to_string());

    let name = format!("{}/ops/busybox:1.36", reg.addr);
    let out = c.ok(&["pull", &name]);
    assert_eq!(out.trim(), format!("Image is up to date for {}", img.id()));

    let out = c.ok(&["images"]);
    let row = out
        .lines()
        .find(|l| l.contains("ops/busybox"))
        .unwrap_or_else(|| panic!("{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[0], format!("{}/ops/busybox", reg.addr));
    assert_eq!(cols[1], "1.36");
    assert_eq!(cols[2], &img.id()["sha256:".len().."sha256:".len() + 13]);
    let ids = c.ok(&["images", "-q"]);
    assert_eq!(ids.trim(), img.id());
    let digests = c.ok(&["images", "--digests"]);
    assert!(
        digests.contains(&digest["sha256:".len().."sha256:".len() + 13]),
        "{digests}"
    );

    let st: serde_json::Value = serde_json::from_str(&c.ok(&["inspecti", &name])).unwrap();
    assert_eq!(st["status"]["id"], img.id());
    assert_eq!(st["status"]["username"], "www-data");
    assert_eq!(st["status"]["repoTags"][0], name);
    assert_eq!(
        st["info"]["imageSpec"]["config"]["User"], "www-data",
        "{st}"
    );

    let fs: serde_json::Value = serde_json::from_str(&c.ok(&["imagefsinfo"])).unwrap();
    let usage = &fs["status"]["imageFilesystems"][0];
    assert!(
        usage["usedBytes"]["value"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 1_000_000,
        "{fs}"
    );
    assert!(
        usage["inodesUsed"]["value"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 10,
        "{fs}"
    );

    // rmi by the short id crictl shows.
    let short = &img.id()["sha256:".len().."sha256:".len() + 13];
    let out = c.ok(&["rmi", short]);
    assert!(out.contains("Deleted"), "{out}");
    assert!(!c.ok(&["images"]).contains("ops/busybox"));
    let (ok, _, err) = c.run(&["inspecti", &name]);
    assert!(!ok && err.contains("no such image"), "{err}");

    // A pull that fails says why, naming the image.
    let (ok, _, err) = c.run(&["pull", &format!("{}/ops/missing:1", reg.addr)]);
    assert!(
        !ok && err.contains("ops/missing") && err.contains("NotFound"),
        "{err}"
    );
}

/// A registry with busybox as `<registry>/ops/busybox:1`, and a hako (with `extra` config)
/// that has pulled it through crictl.
async fn busybox_and_hako(extra: &str) -> Option<(Registry, Hako, String)> {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "crictl"]) {
        return None;
    }
    let reg = Registry::start();
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr).push("ops/busybox", "1", &img).await;
    let h = Hako::start(extra);
    let image = format!("{}/ops/busybox:1", reg.addr);
    Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    }
    .ok(&["pull", &image]);
    Some((reg, h, image))
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_pod_and_container_commands() {
    let Some((_reg, h, image)) = busybox_and_hako("").await else {
        return;
    };
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let (pod, pod_json) = c.runp(
        dir.path(),
        "pod.json",
        serde_json::json!({
            "metadata": {"name": "ops-pod", "namespace": "default", "uid": "ops-uid", "attempt": 0},
            "hostname": "ops-host",
            "log_directory": logs,
            "labels": {"team": "ops"},
            "linux": {}
        }),
    );
    assert_eq!(pod.len(), 64, "{pod}");
    let pods = c.ok(&["pods"]);
    assert!(
        pods.lines()
            .any(|l| l.contains(&pod[..13]) && l.contains("Ready") && l.contains("ops-pod")),
        "{pods}"
    );
    let inspectp: serde_json::Value = serde_json::from_str(&c.ok(&["inspectp", &pod])).unwrap();
    assert_eq!(inspectp["status"]["state"], "SANDBOX_READY");
    assert_eq!(inspectp["status"]["metadata"]["name"], "ops-pod");

    let ctr = c.create_start(
        dir.path(),
        "ctr.json",
        (&pod, &pod_json),
        serde_json::json!({
            "metadata": {"name": "greeter"},
            "image": {"image": image},
            "command": ["sh", "-c", "echo hello from $(hostname); sleep 300"],
            "log_path": "greeter.log",
            "linux": {}
        }),
    );
    let ps = c.ok(&["ps"]);
    assert!(
        ps.lines()
            .any(|l| l.contains(&ctr[..13]) && l.contains("Running") && l.contains("greeter")),
        "{ps}"
    );
    support::wait_for(
        "crictl logs to show the greeting",
        std::time::Duration::from_secs(30),
        || c.ok(&["logs", &ctr]).contains("hello"),
    )
    .await;
    let out = c.ok(&["logs", &ctr]);
    assert_eq!(out.trim(), "hello from ops-host");
    let inspect: serde_json::Value = serde_json::from_str(&c.ok(&["inspect", &ctr])).unwrap();
    assert_eq!(inspect["status"]["state"], "CONTAINER_RUNNING");
    assert_eq!(
        inspect["status"]["logPath"],
        logs.join("greeter.log").display().to_string()
    );

    c.ok(&["stop", "--timeout", "1", &ctr]);
    let inspect: serde_json::Value = serde_json::from_str(&c.ok(&["inspect", &ctr])).unwrap();
    assert_eq!(inspect["status"]["state"], "CONTAINER_EXITED");
    assert_eq!(inspect["status"]["exitCode"], 143, "{inspect}");
    let ps = c.ok(&["ps", "-a"]);
    assert!(ps.contains("Exited"), "{ps}");
    c.ok(&["rm", &ctr]);
    assert!(!c.ok(&["ps", "-a"]).contains(&ctr[..13]));
    c.ok(&["stopp", &pod]);
    assert!(c.ok(&["pods"]).contains("NotReady"));
    c.ok(&["rmp", &pod]);
    assert!(!c.ok(&["pods"]).contains(&pod[..13]));
    let (ok, _, err) = c.run(&["inspectp", &pod]);
    assert!(!ok && err.contains("NotFound"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_create_with_cdi_devices_and_annotations() {
    let cdi = tempfile::tempdir().unwrap();
    std::fs::write(
        cdi.path().join("crictl.yaml"),
        "cdiVersion: 0.6.0\nkind: hako.test/crictl\ndevices:\n\
         - name: 'null'\n  containerEdits:\n    deviceNodes: [{path: /dev/crictl-null, type: c, major: 1, minor: 3}]\n\
         - name: zero\n  containerEdits:\n    deviceNodes: [{path: /dev/crictl-zero, type: c, major: 1, minor: 5}]\n",
    )
    .unwrap();
    let extra = format!("[cdi]\nspec_dirs = [\"{}\"]\n", cdi.path().display());
    let Some((_reg, h, image)) = busybox_and_hako(&extra).await else {
        return;
    };
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let (pod, pod_json) = c.runp(
        dir.path(),
        "pod.json",
        serde_json::json!({
            "metadata": {"name": "cdi-pod", "namespace": "default", "uid": "cdi-uid"},
            "log_directory": logs,
            "linux": {}
        }),
    );
    let ctr = c.create_start(
        dir.path(),
        "ctr.json",
        (&pod, &pod_json),
        serde_json::json!({
            "metadata": {"name": "devices"},
            "image": {"image": image},
            "command": ["sh", "-c", "stat -c '%n %t:%T' /dev/crictl-null /dev/crictl-zero; sleep 300"],
            "log_path": "devices.log",
            "CDI_devices": [{"name": "hako.test/crictl=null"}],
            "annotations": {"cdi.k8s.io/extra": "hako.test/crictl=zero"},
            "linux": {}
        }),
    );
    support::wait_for(
        "two lines in crictl logs",
        std::time::Duration::from_secs(30),
        || c.ok(&["logs", &ctr]).lines().count() >= 2,
    )
    .await;
    let out = c.ok(&["logs", &ctr]);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["/dev/crictl-null 1:3", "/dev/crictl-zero 1:5"],
        "{out}"
    );
    c.ok(&["stopp", &pod]);
    c.ok(&["rmp", &pod]);
}

/// A crictl (or `script` around one) running in the background, its output collected as it comes.
struct Bg {
    child: std::process::Child,
    out: std::sync::Arc<std::sync::Mutex<String>>,
    err: std::sync::Arc<std::sync::Mutex<String>>,
    /// The threads filling `out` and `err`: done once they read EOF.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Bg {
    fn spawn(cmd: &mut Command) -> Bg {
        use std::process::Stdio;
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let mut readers = Vec::new();
        let mut collect = |mut r: Box<dyn std::io::Read + Send>| {
            let buf = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
            let b = buf.clone();
            readers.push(std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n @ 1..) = r.read(&mut chunk) {
                    b.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&chunk[..n]));
                }
            }));
            buf
        };
        let out = collect(Box::new(child.stdout.take().unwrap()));
        let err = collect(Box::new(child.stderr.take().unwrap()));
        Bg {
            child,
            out,
            err,
            readers,
        }
    }

    fn write(&mut self, s: &str) {
        use std::io::Write;
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(s.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    fn out(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn err(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    async fn wait_out(&self, what: &str, needle: &str) {
        let secs = std::time::Duration::from_secs(30);
        let mut last = (String::new(), String::new());
        let found = tokio::time::timeout(secs, async {
            loop {
                last = (self.out(), self.err());
                if last.0.contains(needle) {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            found.is_ok(),
            "timed out waiting for {what} ({needle:?}): stdout {:?}, stderr {:?}",
            last.0,
            last.1
        );
    }

    /// The exit status, waiting for it with a deadline.
    async fn exit(&mut self, what: &str) -> std::process::ExitStatus {
        let mut status = None;
        support::wait_for(what, std::time::Duration::from_secs(60), || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        })
        .await;
        // What it wrote last (crictl's "command terminated with exit code") may still be in
        // the pipes: the exit is known once the readers have it all.
        support::wait_for(what, std::time::Duration::from_secs(60), || {
            self.readers.iter().all(|r| r.is_finished())
        })
        .await;
        status.unwrap()
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Crictl<'_> {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["--runtime-endpoint", &self.hako.endpoint()])
            .args(args);
        cmd
    }

    fn line(&self, args: &[&str]) -> String {
        format!(
            "{} --runtime-endpoint {} {}",
            self.bin.display(),
            self.hako.endpoint(),
            args.join(" ")
        )
    }
}

/// Pids of the processes whose command line (arguments joined by spaces) starts with `prefix`.
fn procs_starting(prefix: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                String::from_utf8_lossy(&c)
                    .trim_end_matches('\0')
                    .replace('\0', " ")
                    .starts_with(prefix)
            })
        })
        .collect()
}

/// The pod monitor of `pod`: the `monitor` process whose options name the pod.
fn monitor_of(pod: &str) -> u32 {
    let found: Vec<u32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                let args: Vec<&str> = c.split('\0').collect();
                args.get(1) == Some(&"monitor") && c.contains(pod)
            })
        })
        .collect();
    // The monitor's forked helpers keep its command line: the monitor is the one whose parent
    // is not one of them.
    let ppid = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()?
                    .split_whitespace()
                    .nth(1)?
                    .parse()
                    .ok()
            })
            .unwrap_or(0u32)
    };
    let top: Vec<u32> = found
        .iter()
        .copied()
        .filter(|p| !found.contains(&ppid(*p)))
        .collect();
    assert_eq!(top.len(), 1, "one monitor for pod {pod}: {found:?}");
    top[0]
}

/// `s` without terminal colour escapes (the daemon's log has them).
fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for ch in s.chars() {
        match (esc, ch) {
            (false, '\x1b') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// Waits until the daemon's and the monitor's fd counts are back to `before`; failing, it lists
/// the fds they hold.
async fn fds_back(what: &str, pids: &[u32], before: &[usize]) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let now: Vec<usize> = pids.iter().map(|p| fd_count(*p)).collect();
        // At most the baseline: it may hold a connection of the previous crictl still closing.
        if now.iter().zip(before).all(|(n, b)| n <= b) {
            return;
        }
        if std::time::Instant::now() > deadline {
            let held: Vec<String> = pids
                .iter()
                .flat_map(|p| {
                    std::fs::read_dir(format!("/proc/{p}/fd"))
                        .unwrap()
                        .flatten()
                        .map(move |e| {
                            let to = std::fs::read_link(e.path()).unwrap_or_default();
                            format!(
                                "{p}: {} -> {}",
                                e.file_name().to_string_lossy(),
                                to.display()
                            )
                        })
                })
                .collect();
            panic!(
                "the daemon's and monitor's fds {pids:?} not back to {before:?} after {what} \
                 within 30s: now {now:?}; held: {held:#?}"
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A pod on the CNI test network with a shell container, a ticker, a `cat` with stdin open and
/// a busybox httpd; everything crictl's streaming commands need.
struct StreamPod<'a> {
    c: Crictl<'a>,
    pod: String,
    shell: String,
    ticker: String,
    cat: String,
    pids: Vec<u32>,
    _dir: tempfile::TempDir,
}

impl<'a> StreamPod<'a> {
    async fn start(h: &'a Hako, image: &str) -> StreamPod<'a> {
        let c = Crictl {
            bin: support::which("crictl").unwrap(),
            hako: h,
        };
        let dir = tempfile::tempdir().unwrap();
        let (pod, pod_json) = c.runp(
            dir.path(),
            "pod.json",
            serde_json::json!({
                "metadata": {"name": "stream-pod", "namespace": "default", "uid": "stream-uid"},
                "log_directory": dir.path().join("logs"),
                "linux": {}
            }),
        );
        let mut ids = Vec::new();
        for (name, command, stdin) in [
            ("shell", "exec sleep 100000", false),
            (
                "ticker",
                "i=0; while true; do echo tick-$i; i=$((i+1)); sleep 0.2; done",
                false,
            ),
            ("cat", "exec cat", true),
            (
                "web",
                "mkdir -p /www && echo served-by-httpd > /www/index.html && exec httpd -f -p 8080 -h /www",
                false,
            ),
        ] {
            ids.push(c.create_start(
                dir.path(),
                &format!("{name}.json"),
                (&pod, &pod_json),
                serde_json::json!({
                    "metadata": {"name": name},
                    "image": {"image": image},
                    "command": ["sh", "-c", command],
                    "stdin": stdin,
                    "log_path": format!("{name}.log"),
                    "linux": {}
                }),
            ));
        }
        // httpd listens once a request through an exec answers.
        support::wait_for(
            "httpd to answer in the pod",
            std::time::Duration::from_secs(30),
            || {
                c.run(&[
                    "exec",
                    &ids[3],
                    "wget",
                    "-q",
                    "-O",
                    "-",
                    "http://127.0.0.1:8080/",
                ])
                .1
                .contains("served-by-httpd")
            },
        )
        .await;
        let pids = vec![h.pid() as u32, monitor_of(&pod)];
        StreamPod {
            c,
            pod,
            shell: ids[0].clone(),
            ticker: ids[1].clone(),
            cat: ids[2].clone(),
            pids,
            _dir: dir,
        }
    }

    fn fds(&self) -> Vec<usize> {
        self.pids.iter().map(|p| fd_count(*p)).collect()
    }
}

async fn streaming_hako(net: &TestNet) -> Option<(Registry, Hako, String)> {
    if !support::cni::ready() || !support::e2e_ready(&["script"]) {
        return None;
    }
    busybox_and_hako(&net.hako_config(30)).await
}

/// crictl exec (TTY and not), attach and port-forward over SPDY and WebSocket against real
/// containers, and crictl killed mid-stream: no process or fd left behind.
#[tokio::test(flavor = "multi_thread")]
async fn crictl_exec_attach_port_forward() {
    let net = TestNet::new();
    let Some((_reg, h, image)) = streaming_hako(&net).await else {
        return;
    };
    let p = StreamPod::start(&h, &image).await;
    let c = &p.c;
    let before = p.fds();

    for transport in ["spdy", "websocket"] {
        // exec -it: a shell on a TTY whose size is the outer terminal's (script's pty, sized
        // before crictl starts); its exit code is crictl's.
        let inner = c.line(&["exec", "-r", transport, "-it", &p.shell, "sh"]);
        let mut tty = Bg::spawn(Command::new("script").args([
            "-qfec",
            &format!("stty rows 40 cols 120; exec {inner}"),
            "/dev/null",
        ]));
        tty.write("echo hi-$((6*7))\n");
        tty.wait_out("the shell's answer", "hi-42").await;
        tty.write("stty size\n");
        tty.wait_out("the TTY size", "40 120").await;
        tty.write("exit 3\n");
        // crictl exits 1 on a streamed exec's non-zero exit, naming the code the server sent
        // in the v4 status (client-go's message).
        let st = tty.exit("crictl exec -it to exit").await;
        assert!(
            st.code() == Some(1) && tty.out().contains("command terminated with exit code 3"),
            "{transport}: {st:?} {:?} {:?}",
            tty.out(),
            tty.err()
        );
        fds_back("exec -it", &p.pids, &before).await;

        // exec -i without a TTY: stdin reaches cat, stderr stays apart, the exit code is crictl's.
        let mut ex = Bg::spawn(&mut c.cmd(&[
            "exec",
            "-r",
            transport,
            "-i",
            &p.shell,
            "sh",
            "-c",
            "cat; echo to-stderr >&2; exit 5",
        ]));
        ex.write("piped-input\n");
        drop(ex.child.stdin.take());
        let st = ex.exit("crictl exec -i to exit").await;
        assert!(
            st.code() == Some(1) && ex.err().contains("command terminated with exit code 5"),
            "{transport}: {st:?} {:?}",
            ex.err()
        );
        assert_eq!(ex.out(), "piped-input\n", "{transport}");
        assert!(
            ex.err().contains("to-stderr") && !ex.out().contains("to-stderr"),
            "{transport}: {:?}",
            ex.err()
        );
        fds_back("exec -i", &p.pids, &before).await;

        // attach sees the ticker's output; killed, it leaves nothing behind.
        let mut at = Bg::spawn(&mut c.cmd(&["attach", "-r", transport, &p.ticker]));
        at.wait_out("the ticker's output through attach", "tick-")
            .await;
        at.kill9();
        fds_back("a killed attach", &p.pids, &before).await;

        // attach -i to a container with stdin open: cat echoes what crictl sends.
        let mut at = Bg::spawn(&mut c.cmd(&["attach", "-r", transport, "-i", &p.cat]));
        let line = format!("through-attach-{transport}\n");
        at.write(&line);
        at.wait_out("cat's echo through attach -i", &line).await;
        at.kill9();
        fds_back("a killed attach -i", &p.pids, &before).await;

        // port-forward to httpd: an HTTP request through the local port crictl picked.
        let mut pf = Bg::spawn(&mut c.cmd(&["port-forward", "-r", transport, &p.pod, "0:8080"]));
        pf.wait_out("crictl to say where it forwards from", "-> 8080")
            .await;
        let out = pf.out();
        let port: u16 = out
            .split("127.0.0.1:")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no local port in {out:?}"));
        for _ in 0..2 {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
                .unwrap();
            s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n").unwrap();
            let mut resp = String::new();
            s.read_to_string(&mut resp).unwrap();
            assert!(
                resp.starts_with("HTTP/1.") && resp.ends_with("served-by-httpd\n"),
                "{transport}: {resp:?}"
            );
        }
        // A connection left open while crictl is killed.
        let _open = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        pf.kill9();
        fds_back("a killed port-forward", &p.pids, &before).await;

        // exec killed mid-stream: the exec'd process goes with it.
        let marker = if transport == "spdy" { "1001" } else { "1002" };
        let mut ex = Bg::spawn(&mut c.cmd(&["exec", "-r", transport, &p.shell, "sleep", marker]));
        let sleep = format!("sleep {marker}");
        support::wait_for(
            "the exec'd sleep to run",
            std::time::Duration::from_secs(30),
            || !procs_starting(&sleep).is_empty(),
        )
        .await;
        ex.kill9();
        support::wait_for(
            "the exec'd sleep to be gone after crictl was killed",
            std::time::Duration::from_secs(30),
            || procs_starting(&sleep).is_empty(),
        )
        .await;
        fds_back("a killed exec", &p.pids, &before).await;
    }

    // 100 concurrent exec sessions, each with its own output; nothing left afterwards.
    let mut execs: Vec<Bg> = (0..100)
        .map(|n| {
            Bg::spawn(&mut c.cmd(&[
                "exec",
                &p.shell,
                "sh",
                "-c",
                "echo $0; sleep 1",
                &format!("session-{n}"),
            ]))
        })
        .collect();
    for (n, ex) in execs.iter_mut().enumerate() {
        let st = ex.exit("a concurrent crictl exec to exit").await;
        assert!(st.success(), "session {n}: {:?}", ex.err());
        assert_eq!(ex.out(), format!("session-{n}\n"), "{:?}", ex.err());
    }
    support::wait_for(
        "no exec'd process left in the container",
        std::time::Duration::from_secs(30),
        || procs_starting("sh -c echo $0; sleep 1").is_empty(),
    )
    .await;
    fds_back("100 concurrent execs", &p.pids, &before).await;

    // Both transports were spoken: the server logs each upgrade's protocol.
    let log = h.log_text();
    for proto in [
        r#"kind="exec" protocol=Some("v4.channel.k8s.io")"#,
        r#"kind="exec" protocol=Some("v5.channel.k8s.io")"#,
        r#"kind="attach" protocol=Some("v4.channel.k8s.io")"#,
        r#"kind="attach" protocol=Some("v5.channel.k8s.io")"#,
        r#"kind="portforward" protocol=Some("portforward.k8s.io")"#,
        r#"kind="portforward" protocol=Some("SPDY/3.1+portforward.k8s.io")"#,
    ] {
        assert!(
            log.lines()
                .any(|l| l.contains("streaming upgrade") && strip_ansi(l).contains(proto)),
            "no upgrade with {proto} in the daemon's log"
        );
    }
    c.ok(&["stopp", &p.pod]);
    c.ok(&["rmp", &p.pod]);
}

/// A pod with one `sleep` container, made through crictl: the pod's and the container's ids.
fn sleeping_pod(c: &Crictl, dir: &Path, name: &str, image: &str) -> (String, String) {
    let (pod, pod_json) = c.runp(
        dir,
        &format!("{name}-pod.json"),
        serde_json::json!({
            "metadata": {"name": name, "namespace": "default", "uid": format!("{name}-uid")},
            "log_directory": dir.join(name),
            "linux": {}
        }),
    );
    let ctr = c.create_start(
        dir,
        &format!("{name}-ctr.json"),
        (&pod, &pod_json),
        serde_json::json!({
            "metadata": {"name": "sleeper"},
            "image": {"image": image},
            "command": ["sleep", "100000"],
            "log_path": "sleeper.log",
            "linux": {}
        }),
    );
    (pod, ctr)
}

/// One pod's users hold at most a quarter of the node's streaming sessions: once a pod holds
/// 256 (here: URLs nobody has used yet), its next Exec, Attach and PortForward answer
/// UNAVAILABLE naming it, and another pod's sessions still run.
#[tokio::test(flavor = "multi_thread")]
async fn one_pod_cannot_take_every_streaming_session() {
    let Some((_reg, h, image)) = busybox_and_hako("").await else {
        return;
    };
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };
    let dir = tempfile::tempdir().unwrap();
    let (greedy, greedy_ctr) = sleeping_pod(&c, dir.path(), "greedy", &image);
    let (other, other_ctr) = sleeping_pod(&c, dir.path(), "other", &image);
    let mut rt = h.runtime().await;
    let exec = || hako_proto::cri::ExecRequest {
        container_id: greedy_ctr.clone(),
        cmd: vec!["true".into()],
        stdout: true,
        ..Default::default()
    };
    for n in 0..256 {
        rt.exec(exec())
            .await
            .unwrap_or_else(|e| panic!("exec URL {n} of the pod's share: {e}"));
    }
    let refused = [
        rt.exec(exec()).await.unwrap_err(),
        rt.attach(hako_proto::cri::AttachRequest {
            container_id: greedy_ctr.clone(),
            stdout: true,
            ..Default::default()
        })
        .await
        .unwrap_err(),
        rt.port_forward(hako_proto::cri::PortForwardRequest {
            pod_sandbox_id: greedy[..12].to_string(),
            port: vec![80],
        })
        .await
        .unwrap_err(),
    ];
    for e in refused {
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(
            e.message()
                .contains(&format!("pod {greedy} holds 256 sessions")),
            "{e}"
        );
    }
    assert_eq!(
        c.ok(&["exec", &other_ctr, "echo", "still-served"]).trim(),
        "still-served"
    );
    for pod in [&greedy, &other] {
        c.ok(&["stopp", pod]);
        c.ok(&["rmp", pod]);
    }
}

/// A tmux server on its own socket, without a status line (so a pane is the window's size);
/// killed with everything in it when dropped.
struct Tmux {
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmux {
    fn new() -> Tmux {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tmux.conf"), "set -g status off\n").unwrap();
        Tmux {
            sock: dir.path().join("tmux.sock"),
            _dir: dir,
        }
    }

    fn run(&self, args: &[&str]) -> String {
        let conf = self.sock.with_file_name("tmux.conf");
        let out = Command::new("tmux")
            .arg("-S")
            .arg(&self.sock)
            .arg("-f")
            .arg(&conf)
            .args(args)
            .output()
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Types `line` and Enter into the pane.
    fn type_line(&self, line: &str) {
        self.run(&["send-keys", "-t", "t", "-l", line]);
        self.run(&["send-keys", "-t", "t", "Enter"]);
    }

    /// The pane's text, scrollback included.
    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-J", "-t", "t", "-S", "-"])
    }

    /// Waits until a line of the pane starts with `prefix`; returns that line.
    async fn wait_line(&self, what: &str, prefix: &str) -> String {
        let mut line = None;
        let mut screen = String::new();
        let found = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            loop {
                screen = self.screen();
                line = screen
                    .lines()
                    .find(|l| l.starts_with(prefix))
                    .map(str::to_string);
                if line.is_some() {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            found.is_ok(),
            "timed out after 30s waiting for {what} (a line starting {prefix:?}); pane:\n{screen}"
        );
        line.unwrap()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(&self.sock)
            .arg("kill-server")
            .output();
    }
}

/// `crictl exec -it <ctr> sh` in a tmux window, as a person runs it: the shell answers, sees
/// the window's size, follows a resize of the window mid-session, and its exit code comes
/// back through crictl; over SPDY and WebSocket.
#[tokio::test(flavor = "multi_thread")]
async fn crictl_exec_tty_resize_in_tmux() {
    if !support::e2e_ready(&["tmux"]) {
        return;
    }
    let net = TestNet::new();
    let Some((_reg, h, image)) = streaming_hako(&net).await else {
        return;
    };
    let p = StreamPod::start(&h, &image).await;
    let before = p.fds();
    for transport in ["spdy", "websocket"] {
        let tmux = Tmux::new();
        let inner = p.c.line(&["exec", "-r", transport, "-it", &p.shell, "sh"]);
        // The pane lives on after crictl (a sleep) so its exit code can be read from it.
        tmux.run(&[
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "120",
            "-y",
            "40",
            &format!("{inner}; echo crictl-exit=$?; exec sleep 600"),
        ]);
        // The answers are computed in the shell, so the typed command line never matches.
        tmux.type_line("echo hi-$((6*7))");
        tmux.wait_line("the shell's answer", "hi-42").await;
        tmux.type_line("echo size0-$(stty size | tr ' ' x)");
        let first = tmux.wait_line("the first TTY size", "size0-").await;
        assert_eq!(first, "size0-40x120", "{transport}: {}", tmux.screen());

        tmux.run(&["resize-window", "-t", "t", "-x", "100", "-y", "30"]);
        // The new size reaches the shell's TTY some time after tmux resized crictl's: ask
        // again until it shows, or the deadline fails the test.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut n = 1;
        loop {
            tmux.type_line(&format!("echo size{n}-$(stty size | tr ' ' x)"));
            let line = tmux
                .wait_line("the TTY size after the resize", &format!("size{n}-"))
                .await;
            if line == format!("size{n}-30x100") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{transport}: the shell's TTY did not follow the window's resize to 30x100 \
                 within 30s: {line}; pane:\n{}",
                tmux.screen()
            );
            n += 1;
        }

        tmux.type_line("exit 7");
        let exit = tmux.wait_line("crictl to exit", "crictl-exit=").await;
        // crictl exits 1 on a streamed exec's non-zero exit, naming the code the server sent
        // (client-go's message).
        let screen = tmux.screen();
        assert!(
            exit == "crictl-exit=1" && screen.contains("command terminated with exit code 7"),
            "{transport}: {exit}; pane:\n{screen}"
        );
        drop(tmux);
        fds_back("exec -it in tmux", &p.pids, &before).await;
    }
    p.c.ok(&["stopp", &p.pod]);
    p.c.ok(&["rmp", &p.pod]);
}
