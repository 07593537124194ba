//! The streaming server's protocols against a real client: tests/streaming-client, built on
//! client-go's remotecommand and portforward packages (what crictl, kubectl and kubelet's
//! callers run), given the URLs the server issues. The backend is a stand-in that runs host
//! processes (a pty for TTY) and connects to host ports, so the protocol side is tested on
//! its own, without containers; the pods' backend is tested with the pods.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hako::config::StreamingConfig;
use hako::error::{Error, Result};
use hako::streaming::{
    AttachRequest, Backend, BoxRead, BoxWrite, ExecRequest, Session, Streaming, TermSize,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(60);

/// Host processes for exec and attach, host ports for port-forward. Counts what it holds.
#[derive(Default)]
struct Host {
    live: Arc<AtomicUsize>,
    pids: Arc<Mutex<Vec<u32>>>,
}

struct Live(Arc<AtomicUsize>);

impl Drop for Live {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Host {
    fn spawn(
        &self,
        cmd: &[String],
        tty: bool,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> Result<Session> {
        let mut c = tokio::process::Command::new(&cmd[0]);
        c.args(&cmd[1..]).kill_on_drop(true);
        let pipe = |on: bool| if on { Stdio::piped() } else { Stdio::null() };
        let mut master = None;
        if tty {
            let pty = nix::pty::openpty(None, None)
                .map_err(|e| Error::Internal(format!("openpty: {e}")))?;
            let slave = || -> Result<Stdio> {
                Ok(Stdio::from(
                    pty.slave
                        .try_clone()
                        .map_err(|e| Error::Internal(e.to_string()))?,
                ))
            };
            c.stdin(slave()?).stdout(slave()?).stderr(slave()?);
            // SAFETY: only async-signal-safe calls between fork and exec.
            unsafe {
                c.pre_exec(|| {
                    libc::setsid();
                    libc::ioctl(0, libc::TIOCSCTTY, 0);
                    Ok(())
                });
            }
            master = Some(std::fs::File::from(pty.master));
        } else {
            c.stdin(pipe(stdin))
                .stdout(pipe(stdout))
                .stderr(pipe(stderr));
        }
        let mut child = c
            .spawn()
            .map_err(|e| Error::NotFound(format!("executable {}: {e}", cmd[0])))?;
        drop(c);
        let mut session = Session {
            stdin: child.stdin.take().map(|s| Box::new(s) as BoxWrite),
            stdout: child.stdout.take().map(|s| Box::new(s) as BoxRead),
            stderr: child.stderr.take().map(|s| Box::new(s) as BoxRead),
            resize: None,
            exit: Box::pin(std::future::pending()),
        };
        if let Some(m) = master {
            let clone = |m: &std::fs::File| tokio::fs::File::from_std(m.try_clone().unwrap());
            if stdin {
                session.stdin = Some(Box::new(clone(&m)) as BoxWrite);
            }
            session.stdout = Some(Box::new(clone(&m)) as BoxRead);
            let (tx, mut rx) = tokio::sync::mpsc::channel::<TermSize>(4);
            session.resize = Some(tx);
            tokio::spawn(async move {
                use std::os::fd::AsRawFd;
                while let Some(size) = rx.recv().await {
                    let ws = libc::winsize {
                        ws_row: size.height,
                        ws_col: size.width,
                        ws_xpixel: 0,
                        ws_ypixel: 0,
                    };
                    // SAFETY: TIOCSWINSZ reads one winsize through a valid pointer.
                    unsafe { libc::ioctl(m.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
                }
            });
        }
        self.live.fetch_add(1, Ordering::SeqCst);
        let live = Live(self.live.clone());
        self.pids.lock().unwrap().extend(child.id());
        session.exit = Box::pin(async move {
            let _live = live;
            let st = child
                .wait()
                .await
                .map_err(|e| Error::Internal(e.to_string()))?;
            use std::os::unix::process::ExitStatusExt;
            Ok(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)))
        });
        Ok(session)
    }
}

#[tonic::async_trait]
impl Backend for Host {
    async fn exec(&self, req: ExecRequest) -> Result<Session> {
        self.spawn(&req.cmd, req.tty, req.stdin, req.stdout, req.stderr)
    }
    async fn attach(&self, req: AttachRequest) -> Result<Session> {
        let cmd = ["sh", "-c", "echo attached; exec cat"].map(String::from);
        self.spawn(&cmd, req.tty, req.stdin, req.stdout, req.stderr)
    }
    async fn port_forward(&self, _pod: &str, port: u16) -> Result<tokio::net::TcpStream> {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| Error::Unavailable(format!("connect to port {port}: {e}")))
    }
}
/// The client, built once per test binary from tests/streaming-client (Go); `None` (skipped)
/// without Go.
fn client() -> Option<PathBuf> {
    static BUILT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/streaming-client");
            let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/streaming-client");
            let newer = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            if newer(&out).is_some() && newer(&out) >= newer(&src.join("main.go")) {
                return Some(out);
            }
            let go = support::which("go")?;
            let st = std::process::Command::new(go)
                .args(["build", "-mod=mod", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(&src)
                .status()
                .expect("run go build");
            assert!(st.success(), "building tests/streaming-client failed");
            Some(out)
        })
        .clone()
}

fn ready() -> Option<PathBuf> {
    let c = client();
    if c.is_none() {
        support::skip(
            "the whole test",
            "go is missing (tests/streaming-client is Go)",
        );
    }
    c
}

async fn start(host: &Arc<Host>, idle_secs: u64, ttl: Duration) -> Streaming {
    let config = StreamingConfig {
        idle_timeout_secs: idle_secs,
        ..Default::default()
    };
    Streaming::start_with_ttl(&config, host.clone(), ttl)
        .await
        .expect("start the streaming server")
}

fn exec_req(cmd: &str, tty: bool, stdin: bool) -> ExecRequest {
    ExecRequest {
        container_id: "c1".into(),
        cmd: vec!["sh".into(), "-c".into(), cmd.into()],
        tty,
        stdin,
        stdout: true,
        stderr: !tty,
    }
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the client to its end with `input` on its stdin.
async fn run(args: &[&str], input: &[u8]) -> Out {
    let mut child = tokio::process::Command::new(client().unwrap())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input).await.unwrap();
    drop(stdin);
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("client {args:?} did not finish in {WAIT:?}"))
        .unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

/// TCP connections established to `port` on this host, counted on the server's side.
fn established(port: u16) -> usize {
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && f.get(3) == Some(&"01") {
                n += 1;
            }
        }
    }
    n
}

fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
            state != Some("Z")
        })
        .unwrap_or(false)
}

/// Nothing left: no backend process, no session task, no connection to the server.
async fn nothing_left(host: &Host, server: &Streaming) {
    support::wait_for("backend sessions to end", WAIT, || {
        host.live.load(Ordering::SeqCst) == 0
    })
    .await;
    support::wait_for("streaming sessions to end", WAIT, || server.sessions() == 0).await;
    let port = server.addr().port();
    support::wait_for("connections to the streaming server to close", WAIT, || {
        established(port) == 0
    })
    .await;
    let pids = host.pids.lock().unwrap().clone();
    support::wait_for("backend processes to be gone", WAIT, || {
        pids.iter().all(|p| !running(*p))
    })
    .await;
}

const TRANSPORTS: [&[&str]; 2] = [&[], &["-ws"]];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_reports_exit_codes_and_outputs() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    for t in TRANSPORTS {
        let url = server
            .exec_url(exec_req("echo out; echo err >&2; exit 7", false, false))
            .unwrap();
        let out = run(&[&["exec"], t, &[&url]].concat(), b"").await;
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.as_str()),
            (7, "out\n", "err\n"),
            "{t:?}"
        );
        let url = server
            .exec_url(exec_req("echo fine", false, false))
            .unwrap();
        let out = run(&[&["exec"], t, &[&url]].concat(), b"").await;
        assert_eq!((out.code, out.stdout.as_str()), (0, "fine\n"), "{t:?}");
        // A command the backend cannot start: a Failure status naming the cause.
        let mut req = exec_req("", false, false);
        req.cmd = vec!["/nonexistent/tool".into()];
        let url = server.exec_url(req).unwrap();
        let out = run(&[&["exec"], t, &[&url]].concat(), b"").await;
        assert_eq!(out.code, 125, "{t:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("executable /nonexistent/tool"),
            "{}",
            out.stderr
        );
    }
    // Older versions: v4 over WebSocket, v3/v2 over SPDY (v2 has no exit code: text error).
    for (t, proto, code) in [
        (&["-ws"][..], "v4.channel.k8s.io", 7),
        (&[][..], "v3.channel.k8s.io", 125),
        (&[][..], "v2.channel.k8s.io", 125),
    ] {
        let url = server
            .exec_url(exec_req("echo out; exit 7", false, false))
            .unwrap();
        let out = run(&[&["exec", "-proto", proto], t, &[&url]].concat(), b"").await;
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (code, "out\n"),
            "{proto}: {}",
            out.stderr
        );
        if code == 125 {
            assert!(out.stderr.contains("non-zero exit code"), "{}", out.stderr);
        }
    }
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stdin_reaches_the_process_and_its_end_closes_it() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let big: String = (0..20000).map(|i| format!("line {i}\n")).collect();
    for t in TRANSPORTS {
        let url = server
            .exec_url(exec_req("cat; echo done", false, true))
            .unwrap();
        let out = run(&[&["exec", "-stdin"], t, &[&url]].concat(), big.as_bytes()).await;
        assert_eq!(out.code, 0, "{t:?}: {}", out.stderr);
        assert_eq!(out.stdout, format!("{big}done\n"), "{t:?}");
    }
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_with_a_tty_follows_resizes() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    // The shell waits for the last size (the test's deadline fails it if it never comes).
    let script = r#"while [ "$(stty size)" != "30 100" ]; do sleep 0.05; done; stty size; exit 3"#;
    for t in TRANSPORTS {
        let url = server.exec_url(exec_req(script, true, false)).unwrap();
        let out = run(
            &[&["exec", "-tty", "-resize", "80x24,100x30"], t, &[&url]].concat(),
            b"",
        )
        .await;
        assert_eq!(out.code, 3, "{t:?}: {}", out.stderr);
        assert!(out.stdout.contains("30 100"), "{t:?}: {:?}", out.stdout);
    }
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_joins_stdio() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    for t in TRANSPORTS {
        let url = server
            .attach_url(AttachRequest {
                container_id: "c1".into(),
                tty: false,
                stdin: true,
                stdout: true,
                stderr: true,
            })
            .unwrap();
        let out = run(&[&["exec", "-stdin"], t, &[&url]].concat(), b"typed\n").await;
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (0, "attached\ntyped\n"),
            "{t:?}: {}",
            out.stderr
        );
    }
    nothing_left(&host, &server).await;
}

/// An echo server on 127.0.0.1; counts the connections it holds open.
async fn echo_server() -> (u16, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let open = Arc::new(AtomicUsize::new(0));
    let count = open.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept().await.unwrap();
            count.fetch_add(1, Ordering::SeqCst);
            let _live = Live(count.clone());
            tokio::spawn(async move {
                let _live = _live;
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (port, open)
}

/// Starts the port-forward client; returns it and the local port it listens on.
async fn forward(url: &str, port: u16, t: &[&str]) -> (tokio::process::Child, u16) {
    let target = format!("0:{port}");
    let mut child = tokio::process::Command::new(client().unwrap())
        .args([&["portforward"], t, &[url, &target]].concat())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let local = tokio::time::timeout(WAIT, async {
        while let Some(l) = lines.next_line().await.unwrap() {
            // "Forwarding from 127.0.0.1:NNNN -> PORT"
            if let Some(rest) = l.strip_prefix("Forwarding from 127.0.0.1:") {
                return rest
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<u16>()
                    .unwrap();
            }
        }
        panic!("port-forward client ended before listening");
    })
    .await
    .expect("port-forward client listening");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, local)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_forward_carries_concurrent_connections() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let (port, open) = echo_server().await;
    for t in TRANSPORTS {
        let url = server.port_forward_url("pod1").unwrap();
        let (mut child, local) = forward(&url, port, t).await;
        let conns = (0..20).map(|i| async move {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", local))
                .await
                .unwrap();
            let msg = format!("connection {i} {}\n", "x".repeat(i * 5000));
            s.write_all(msg.as_bytes()).await.unwrap();
            s.shutdown().await.unwrap();
            let mut back = String::new();
            s.read_to_string(&mut back).await.unwrap();
            assert_eq!(back, msg, "{t:?}");
        });
        tokio::time::timeout(WAIT, futures::future::join_all(conns))
            .await
            .expect("forwarded connections answered");
        // A connection left open, then the client killed mid-stream: everything goes.
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", local))
            .await
            .unwrap();
        s.write_all(b"ping\n").await.unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        child.kill().await.unwrap();
        support::wait_for("forwarded connections to close", WAIT, || {
            open.load(Ordering::SeqCst) == 0
        })
        .await;
        nothing_left(&host, &server).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_clients_leave_nothing_behind() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let attach = || {
        server
            .attach_url(AttachRequest {
                container_id: "c1".into(),
                tty: false,
                stdin: true,
                stdout: true,
                stderr: false,
            })
            .unwrap()
    };
    for t in TRANSPORTS {
        let cases = [
            (
                server
                    .exec_url(exec_req("echo started; exec sleep 1000", false, true))
                    .unwrap(),
                "started",
            ),
            (
                server
                    .exec_url(exec_req("echo started; exec sleep 1000", true, true))
                    .unwrap(),
                "started",
            ),
            (attach(), "attached"),
        ];
        for (url, first) in cases {
            let mut child = tokio::process::Command::new(client().unwrap())
                .args([&["exec", "-stdin"], t, &[&url]].concat())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
            let line = tokio::time::timeout(WAIT, lines.next_line())
                .await
                .expect("first output")
                .unwrap()
                .unwrap_or_default();
            assert_eq!(line.trim_end(), first, "{t:?}");
            assert_eq!(host.live.load(Ordering::SeqCst), 1);
            child.kill().await.unwrap();
            nothing_left(&host, &server).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed() {
    if ready().is_none() {
        return;
    }
    let host = Arc::new(Host::default());
    let server = start(&host, 1, hako::streaming::TOKEN_TTL).await;
    for t in TRANSPORTS {
        let url = server
            .exec_url(exec_req("exec sleep 1000", false, false))
            .unwrap();
        // The client ends (it would wait for `sleep` otherwise): the server closed the idle
        // connection. client-go reports a closed connection without a status as success.
        run(&[&["exec"], t, &[&url]].concat(), b"").await;
        nothing_left(&host, &server).await;
    }
}

/// One raw HTTP request; the status code and the response head.
async fn raw(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut req = format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await.unwrap() == 0 {
            break;
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, head.to_ascii_lowercase())
}

fn path_of(url: &str) -> String {
    format!("/{}", url.splitn(4, '/').nth(3).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_are_single_use_and_expire() {
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let port = server.addr().port();
    let spdy = [
        ("Upgrade", "SPDY/3.1"),
        ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
    ];
    let url = server.exec_url(exec_req("true", false, false)).unwrap();
    let (code, head) = raw(port, &path_of(&url), &spdy).await;
    assert_eq!(code, 101, "{head}");
    assert!(
        head.contains("x-stream-protocol-version: v4.channel.k8s.io"),
        "{head}"
    );
    let (code, _) = raw(port, &path_of(&url), &spdy).await;
    assert_eq!(code, 404, "a token is good once");
    // A token for exec does not open a port-forward.
    let url = server.exec_url(exec_req("true", false, false)).unwrap();
    let (code, _) = raw(
        port,
        &path_of(&url).replace("/exec/", "/portforward/"),
        &spdy,
    )
    .await;
    assert_eq!(code, 404);

    let expiring = start(&host, 3600, Duration::ZERO).await;
    let url = expiring.exec_url(exec_req("true", false, false)).unwrap();
    let (code, _) = raw(expiring.addr().port(), &path_of(&url), &spdy).await;
    assert_eq!(code, 404, "an expired token");
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_versions_are_negotiated() {
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let port = server.addr().port();
    let url = || server.exec_url(exec_req("true", false, false)).unwrap();
    let (code, head) = raw(
        port,
        &path_of(&url()),
        &[
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v9.channel.k8s.io"),
        ],
    )
    .await;
    assert_eq!(code, 403, "{head}");
    // Several offers: the client's order.
    let (code, head) = raw(
        port,
        &path_of(&url()),
        &[
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v5.channel.k8s.io"),
            (
                "X-Stream-Protocol-Version",
                "v3.channel.k8s.io, v4.channel.k8s.io",
            ),
        ],
    )
    .await;
    assert_eq!(code, 101);
    assert!(
        head.contains("x-stream-protocol-version: v3.channel.k8s.io"),
        "{head}"
    );
    let ws = |proto: &'static str| {
        [
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Version", "13"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Protocol", proto),
        ]
    };
    let (code, head) = raw(port, &path_of(&url()), &ws("v4.base64.channel.k8s.io")).await;
    assert_eq!(code, 101);
    assert!(
        head.contains("sec-websocket-protocol: v4.base64.channel.k8s.io"),
        "{head}"
    );
    assert!(
        head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    let (code, _) = raw(port, &path_of(&url()), &ws("bogus")).await;
    assert_eq!(code, 400);
    let pf = server.port_forward_url("pod1").unwrap();
    let (code, head) = raw(port, &path_of(&pf), &ws("SPDY/3.1+portforward.k8s.io")).await;
    assert_eq!(code, 101, "{head}");
    let (code, _) = raw(port, "/exec/nonsense", &ws("v5.channel.k8s.io")).await;
    assert_eq!(code, 404);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_when_a_certificate_is_configured() {
    if ready().is_none() {
        return;
    }
    let Some(openssl) = support::which("openssl") else {
        support::skip(
            "the whole test",
            "openssl is missing (it makes the certificate)",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let st = std::process::Command::new(openssl)
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let host = Arc::new(Host::default());
    let config = StreamingConfig {
        tls_cert_file: Some(cert),
        tls_key_file: Some(key),
        ..Default::default()
    };
    let server = Streaming::start(&config, host.clone()).await.unwrap();
    for t in TRANSPORTS {
        let url = server
            .exec_url(exec_req("echo secret; exit 4", false, false))
            .unwrap();
        assert!(url.starts_with("https://127.0.0.1:"), "{url}");
        let out = run(&[&["exec", "-insecure"], t, &[&url]].concat(), b"").await;
        assert_eq!(
            (out.code, out.stdout.as_str()),
            (4, "secret\n"),
            "{t:?}: {}",
            out.stderr
        );
    }
    nothing_left(&host, &server).await;
}
