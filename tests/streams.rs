//! The pods' side of the CRI streaming server (`hako::streaming::Backend`) end to end: real
//! pods made by a real `hako serve`, which is then stopped; a daemon opened in this process
//! over the same state (a restart: the streams' state lives in the pod monitors) serves the
//! exec, attach and port-forward sessions, driven through `Backend` directly (the HTTP side
//! has its own tests).

mod support;

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

use hako::daemon::Daemon;
use hako::pods::ContainerState;
use hako::streaming::{AttachRequest, Backend, BoxRead, ExecRequest, Session, TermSize};
use hako_proto::cri;
use support::cni::{self, TestNet};
use support::cri::*;
use support::hako::Hako;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEADLINE: Duration = Duration::from_secs(30);

/// Stops the CRI daemon (its pods run on) and opens one in this process over its state.
async fn restart_in_process(h: &mut Hako) -> std::sync::Arc<Daemon> {
    h.stop();
    let config = hako::config::Config::load(&h.config, true).expect("load hako's config");
    Daemon::open(config)
        .await
        .expect("open the daemon in-process")
}

async fn remove_pods(d: &Daemon, pods: &[&str]) {
    for p in pods {
        d.runtime.stop_pod(p).await.unwrap();
        d.runtime.remove_pod(p).await.unwrap();
    }
}

/// Reads until `needle` has arrived; what was read. Fails the test past the deadline.
async fn read_until(r: &mut BoxRead, needle: &str) -> String {
    let mut seen = Vec::new();
    let found = tokio::time::timeout(DEADLINE, async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains(needle) {
            let n = r.read(&mut buf).await.unwrap();
            if n == 0 {
                return false;
            }
            seen.extend_from_slice(&buf[..n]);
        }
        true
    })
    .await;
    let text = String::from_utf8_lossy(&seen).to_string();
    assert!(
        matches!(found, Ok(true)),
        "{needle:?} did not arrive (ended or timed out); read: {text:?}"
    );
    text
}

async fn read_to_end(r: Option<BoxRead>) -> String {
    let mut r = r.expect("stream asked for");
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, r.read_to_end(&mut out))
        .await
        .expect("output ends")
        .unwrap();
    String::from_utf8_lossy(&out).to_string()
}

async fn exit_of(s: Session) -> i32 {
    tokio::time::timeout(DEADLINE, s.exit)
        .await
        .expect("the session's exit")
        .unwrap()
}

fn processes_named(arg: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).split('\0').any(|a| a == arg))
        })
        .collect()
}

/// A process's open fds, as what they name. A socket is named without its inode: the
/// daemon's watcher makes a new connection for each `Events` call, one every 5 s at the
/// latest, so the monitor's one outstanding call moves between sockets on the same fd while
/// a test runs (CI saw fd 3 change sockets). A leaked session's socket still adds an entry.
fn fds(pid: u32) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .map(|e| {
            let to = std::fs::read_link(e.path()).unwrap_or_default();
            let to = to.to_string_lossy();
            let to = if to.starts_with("socket:[") {
                "socket".into()
            } else {
                to
            };
            format!("{} -> {to}", e.file_name().to_string_lossy())
        })
        .collect();
    v.sort();
    v
}

/// Waits until every fd the monitor holds was held before the sessions: a fd left over from
/// one (its pipes, its connection) fails the test. Not equality: a watcher connection open at
/// the first sample may be gone for good, and its going is no leak.
async fn fds_come_back(monitor: u32, before: &[String], whose: &str) {
    let deadline = std::time::Instant::now() + DEADLINE;
    loop {
        let now = fds(monitor);
        let kept: Vec<&String> = now.iter().filter(|f| !before.contains(f)).collect();
        if kept.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the monitor kept {whose} fds {kept:#?}: before {before:#?}, now {now:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn exec_req(cid: &str, cmd: &[&str], tty: bool, stdin: bool) -> ExecRequest {
    ExecRequest {
        container_id: cid.into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        tty,
        stdin,
        stdout: true,
        stderr: !tty,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_streams_stdio_and_exit_follows_resizes_and_dies_with_its_client() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("exec", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let cid = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("sleeper", &["sleep", "100000"]),
    )
    .await;
    drop(rt);
    let d = restart_in_process(&mut h).await;
    let monitor = d.runtime.pod(&pod).unwrap().monitor_pid;
    // The daemon's watcher replaces its Events connection now and then, and for a moment
    // holds two: the fewest fds of a few samples is the monitor at rest.
    let mut fds_before = fds(monitor);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = fds(monitor);
        if now.len() < fds_before.len() {
            fds_before = now;
        }
    }

    // Without a terminal: stdin in, stdout and stderr apart, the exit code.
    let mut s = d
        .exec(exec_req(
            &cid,
            &["sh", "-c", "cat; echo err >&2; exit 7"],
            false,
            true,
        ))
        .await
        .unwrap();
    assert!(s.resize.is_none());
    let mut stdin = s.stdin.take().unwrap();
    stdin.write_all(b"hello\nworld\n").await.unwrap();
    stdin.shutdown().await.unwrap();
    let (out, err) = tokio::join!(read_to_end(s.stdout.take()), read_to_end(s.stderr.take()));
    assert_eq!((out.as_str(), err.as_str()), ("hello\nworld\n", "err\n"));
    assert_eq!(exit_of(s).await, 7);

    // With one: `stty size` sees each resize. A resize travels apart from stdin (as kubelet's
    // does, on a stream of its own), so the line read may come first: the shell waits for
    // the size it was told of, and fails the test only by never seeing it.
    let wait_for_size = |size: &str| {
        format!(r#"while [ "$(stty size 2>/dev/null)" != "{size}" ]; do sleep 0.05; done"#)
    };
    let script = format!(
        "read a; {}; stty size; read b; {}; stty size; exit 3",
        wait_for_size("30 100"),
        wait_for_size("40 120")
    );
    let mut s = d
        .exec(exec_req(&cid, &["sh", "-c", &script], true, true))
        .await
        .unwrap();
    assert!(s.stderr.is_none(), "a terminal merges stderr into stdout");
    let resize = s.resize.clone().unwrap();
    let mut stdin = s.stdin.take().unwrap();
    let mut stdout = s.stdout.take().unwrap();
    resize
        .send(TermSize {
            width: 100,
            height: 30,
        })
        .await
        .unwrap();
    stdin.write_all(b"a\n").await.unwrap();
    read_until(&mut stdout, "30 100").await;
    resize
        .send(TermSize {
            width: 120,
            height: 40,
        })
        .await
        .unwrap();
    stdin.write_all(b"b\n").await.unwrap();
    read_until(&mut stdout, "40 120").await;
    assert_eq!(exit_of(s).await, 3);

    // A client gone mid-stream: its process is killed and the monitor's fds are back.
    let mut s = d
        .exec(exec_req(
            &cid,
            &["sh", "-c", "echo started; exec sleep 100123"],
            false,
            true,
        ))
        .await
        .unwrap();
    read_until(s.stdout.as_mut().unwrap(), "started").await;
    // `sh` prints before it execs `sleep`: the sleep shows up a moment after the line.
    support::wait_for("the exec'd sleep to run", DEADLINE, || {
        !processes_named("100123").is_empty()
    })
    .await;
    assert_eq!(processes_named("100123").len(), 1, "the exec'd sleep runs");
    assert!(
        fds(monitor).len() > fds_before.len(),
        "the session holds fds"
    );
    drop(s);
    support::wait_for("the exec'd process to be killed", DEADLINE, || {
        processes_named("100123").is_empty()
    })
    .await;
    fds_come_back(monitor, &fds_before, "the sessions'").await;
    // A client gone while its process's stdin is full (the process does not read it): the
    // monitor, blocked writing that stdin, still sees the hangup and kills the process.
    let mut s = d
        .exec(exec_req(
            &cid,
            &["sh", "-c", "echo started; exec sleep 100124"],
            false,
            true,
        ))
        .await
        .unwrap();
    read_until(s.stdout.as_mut().unwrap(), "started").await;
    support::wait_for("the exec'd sleep to run", DEADLINE, || {
        !processes_named("100124").is_empty()
    })
    .await;
    let sleeper = processes_named("100124");
    assert_eq!(sleeper.len(), 1, "the exec'd sleep runs");
    let mut stdin = s.stdin.take().unwrap();
    // More than the pipe, the socket and the session's buffers hold: the writer stays blocked.
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&vec![b'x'; 4 << 20]).await;
        stdin
    });
    // A reader of our own on the sleep's stdin pipe, to see it fill (nothing is read from it).
    let pipe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(format!("/proc/{}/fd/0", sleeper[0]))
        .unwrap();
    let queued = || {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int to the pointer, which outlives the call.
        unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut n) };
        n
    };
    // SAFETY: F_GETPIPE_SZ only reads the fd.
    let capacity = unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_GETPIPE_SZ) };
    support::wait_for("the sleep's stdin pipe to fill", DEADLINE, || {
        queued() >= capacity - 4096
    })
    .await;
    drop(pipe);
    writer.abort();
    drop(s);
    support::wait_for(
        "the exec'd process with a full stdin to be killed",
        DEADLINE,
        || processes_named("100124").is_empty(),
    )
    .await;
    fds_come_back(monitor, &fds_before, "the full-stdin session's").await;

    // The container itself runs on.
    assert_eq!(
        d.runtime.container(&cid).await.unwrap().state,
        ContainerState::Running
    );

    // Errors: an unknown container, a container that does not run.
    let e = d
        .exec(exec_req("nosuch", &["true"], false, false))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, hako::error::Error::NotFound(_)), "{e:?}");
    d.runtime
        .stop_container(&cid, Duration::ZERO)
        .await
        .unwrap();
    let e = d
        .exec(exec_req(&cid, &["true"], false, false))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, hako::error::Error::FailedPrecondition(ref m) if m.contains(&cid) && m.contains("not running")),
        "{e:?}"
    );
    remove_pods(&d, &[&pod]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_fans_output_out_takes_stdin_and_detaches() {
    let Some((_reg, mut h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("attach", logs.path());
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
                "while true; do echo tick; echo tock >&2; sleep 0.2; done",
            ],
        ),
    )
    .await;
    let mut cc = container_config("cat", &["cat"]);
    cc.stdin = true;
    let cat = run_container(&mut rt, &pod, &cfg, cc).await;
    let mut cc = container_config("cat-once", &["cat"]);
    cc.stdin = true;
    cc.stdin_once = true;
    let once = run_container(&mut rt, &pod, &cfg, cc).await;
    // Created and never started: its init, made after `cat-once`'s stdin, waits for its start
    // and must not hold that stdin's write end, or `cat-once` never sees its EOF below.
    create_container(&mut rt, &pod, &cfg, container_config("idle", &["true"])).await;
    drop(rt);
    // Attach after a daemon restart: the stdio lives in the monitor.
    let d = restart_in_process(&mut h).await;

    let attach = |id: &str, stdin: bool| AttachRequest {
        container_id: id.into(),
        tty: false,
        stdin,
        stdout: true,
        stderr: true,
    };
    // Two clients both see the output, each stream on its own.
    let mut a = d.attach(attach(&ticker, false)).await.unwrap();
    let mut b = d.attach(attach(&ticker, false)).await.unwrap();
    read_until(a.stdout.as_mut().unwrap(), "tick").await;
    read_until(a.stderr.as_mut().unwrap(), "tock").await;
    let seen = read_until(b.stdout.as_mut().unwrap(), "tick\ntick").await;
    assert!(!seen.contains("tock"), "{seen:?}");
    // One detaching leaves the other attached and the container running.
    drop(a);
    read_until(b.stdout.as_mut().unwrap(), "tick\ntick").await;
    drop(b);
    assert_eq!(
        d.runtime.container(&ticker).await.unwrap().state,
        ContainerState::Running
    );

    // stdin reaches a container created with stdin, and stays open across attaches.
    for word in ["ping", "pong"] {
        let mut s = d.attach(attach(&cat, true)).await.unwrap();
        let mut stdin = s.stdin.take().unwrap();
        stdin
            .write_all(format!("{word}\n").as_bytes())
            .await
            .unwrap();
        read_until(s.stdout.as_mut().unwrap(), word).await;
        drop(stdin);
        drop(s);
        assert_eq!(
            d.runtime.container(&cat).await.unwrap().state,
            ContainerState::Running,
            "a detach leaves it running"
        );
    }

    // stdin_once: the first attach's stdin closing closes the container's; cat exits, and
    // the session's exit is the container's.
    let mut s = d.attach(attach(&once, true)).await.unwrap();
    let mut stdin = s.stdin.take().unwrap();
    stdin.write_all(b"only\n").await.unwrap();
    read_until(s.stdout.as_mut().unwrap(), "only").await;
    stdin.shutdown().await.unwrap();
    assert_eq!(exit_of(s).await, 0);
    // An exited container takes no attach.
    let e = d.attach(attach(&once, false)).await.err().unwrap();
    assert!(
        matches!(e, hako::error::Error::FailedPrecondition(ref m) if m.contains(&once)),
        "{e:?}"
    );
    let e = d.attach(attach("nosuch", false)).await.err().unwrap();
    assert!(matches!(e, hako::error::Error::NotFound(_)), "{e:?}");
    remove_pods(&d, &[&pod]).await;
}

/// Connects through port-forward until the pod's listener answers; its page.
async fn fetch_through(d: &Daemon, pod: &str, port: u16) -> String {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match d.port_forward(pod, port).await {
            Ok(mut s) => {
                s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
                let mut page = String::new();
                s.read_to_string(&mut page).await.unwrap();
                return page;
            }
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "port-forward to {port}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_reaches_the_pods_loopback_on_a_cni_network_and_the_hosts() {
    if !cni::ready() {
        support::skip("port-forward on a CNI network", "no CNI plugins");
        return;
    }
    let net = TestNet::new();
    let Some((_reg, mut h)) = ready_with_config(&net.hako_config(30)).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let serve = |page: &str, addr: &str| {
        format!("mkdir -p /www && echo {page} > /www/index.html && exec httpd -f -p {addr} -h /www")
    };
    // On the CNI network: a listener on the pod's own loopback.
    let cfg = pod_config("pf-cni", logs.path());
    let cni_pod = run_pod(&mut rt, &cfg).await;
    run_container(
        &mut rt,
        &cni_pod,
        &cfg,
        container_config(
            "web",
            &["sh", "-c", &serve("from-the-pod", "127.0.0.1:8080")],
        ),
    )
    .await;
    // On the host's network: a free port of the host's loopback.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host_cfg = with_namespaces(
        pod_config("pf-host", logs.path()),
        cri::NamespaceOption {
            network: cri::NamespaceMode::Node as i32,
            ..Default::default()
        },
    );
    let host_pod = run_pod(&mut rt, &host_cfg).await;
    run_container(
        &mut rt,
        &host_pod,
        &host_cfg,
        container_config(
            "web",
            &[
                "sh",
                "-c",
                &serve("from-the-host-pod", &format!("127.0.0.1:{port}")),
            ],
        ),
    )
    .await;
    drop(rt);
    let d = restart_in_process(&mut h).await;

    assert!(fetch_through(&d, &cni_pod, 8080)
        .await
        .contains("from-the-pod"));
    assert!(fetch_through(&d, &host_pod, port)
        .await
        .contains("from-the-host-pod"));
    // Several connections at once.
    let (a, b) = tokio::join!(
        fetch_through(&d, &cni_pod, 8080),
        fetch_through(&d, &cni_pod, 8080)
    );
    assert!(a.contains("from-the-pod") && b.contains("from-the-pod"));
    // The pod's loopback, not the host's: the host-network pod's port is not in the pod.
    let e = d.port_forward(&cni_pod, port).await.unwrap_err();
    assert!(
        e.to_string().contains(&format!("port {port}")) && e.to_string().contains(&cni_pod),
        "{e}"
    );

    let e = d.port_forward("nosuch", 80).await.unwrap_err();
    assert!(matches!(e, hako::error::Error::NotFound(_)), "{e:?}");
    d.runtime.stop_pod(&host_pod).await.unwrap();
    let e = d.port_forward(&host_pod, port).await.unwrap_err();
    assert!(
        matches!(e, hako::error::Error::FailedPrecondition(ref m) if m.contains("not ready")),
        "{e:?}"
    );
    remove_pods(&d, &[&cni_pod, &host_pod]).await;
}
