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
use hako::streaming::spdy::{self, Codec, Frame};
use hako::streaming::{
    AttachRequest, Backend, BoxRead, BoxWrite, ExecRequest, Owner, Session, Streaming, TermSize,
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

fn ready() -> Option<PathBuf> {
    let c = support::streaming_client();
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

/// The one pod these sessions belong to.
fn pod1() -> Owner {
    Owner {
        pod: "pod1".into(),
        namespace: "default".into(),
    }
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
    let mut child = tokio::process::Command::new(support::streaming_client().unwrap())
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
        pids.iter().all(|p| support::process_dead(*p as i32))
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
            .exec_url(
                pod1(),
                exec_req("echo out; echo err >&2; exit 7", false, false),
            )
            .unwrap();
        let out = run(&[&["exec"], t, &[&url]].concat(), b"").await;
        assert_eq!(
            (out.code, out.stdout.as_str(), out.stderr.as_str()),
            (7, "out\n", "err\n"),
            "{t:?}"
        );
        let url = server
            .exec_url(pod1(), exec_req("echo fine", false, false))
            .unwrap();
        let out = run(&[&["exec"], t, &[&url]].concat(), b"").await;
        assert_eq!((out.code, out.stdout.as_str()), (0, "fine\n"), "{t:?}");
        // A command the backend cannot start: a Failure status naming the cause.
        let mut req = exec_req("", false, false);
        req.cmd = vec!["/nonexistent/tool".into()];
        let url = server.exec_url(pod1(), req).unwrap();
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
            .exec_url(pod1(), exec_req("echo out; exit 7", false, false))
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
            .exec_url(pod1(), exec_req("cat; echo done", false, true))
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
        let url = server
            .exec_url(pod1(), exec_req(script, true, false))
            .unwrap();
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
            .attach_url(
                pod1(),
                AttachRequest {
                    container_id: "c1".into(),
                    tty: false,
                    stdin: true,
                    stdout: true,
                    stderr: true,
                },
            )
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
    let mut child = tokio::process::Command::new(support::streaming_client().unwrap())
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
        let url = server.port_forward_url(pod1()).unwrap();
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
            .attach_url(
                pod1(),
                AttachRequest {
                    container_id: "c1".into(),
                    tty: false,
                    stdin: true,
                    stdout: true,
                    stderr: false,
                },
            )
            .unwrap()
    };
    for t in TRANSPORTS {
        let cases = [
            (
                server
                    .exec_url(
                        pod1(),
                        exec_req("echo started; exec sleep 1000", false, true),
                    )
                    .unwrap(),
                "started",
            ),
            (
                server
                    .exec_url(
                        pod1(),
                        exec_req("echo started; exec sleep 1000", true, true),
                    )
                    .unwrap(),
                "started",
            ),
            (attach(), "attached"),
        ];
        for (url, first) in cases {
            let mut child = tokio::process::Command::new(support::streaming_client().unwrap())
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
            .exec_url(pod1(), exec_req("exec sleep 1000", false, false))
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
    let url = server
        .exec_url(pod1(), exec_req("true", false, false))
        .unwrap();
    let (code, head) = raw(port, &path_of(&url), &spdy).await;
    assert_eq!(code, 101, "{head}");
    assert!(
        head.contains("x-stream-protocol-version: v4.channel.k8s.io"),
        "{head}"
    );
    let (code, _) = raw(port, &path_of(&url), &spdy).await;
    assert_eq!(code, 404, "a token is good once");
    // A token for exec does not open a port-forward.
    let url = server
        .exec_url(pod1(), exec_req("true", false, false))
        .unwrap();
    let (code, _) = raw(
        port,
        &path_of(&url).replace("/exec/", "/portforward/"),
        &spdy,
    )
    .await;
    assert_eq!(code, 404);

    let expiring = start(&host, 3600, Duration::ZERO).await;
    let url = expiring
        .exec_url(pod1(), exec_req("true", false, false))
        .unwrap();
    let (code, _) = raw(expiring.addr().port(), &path_of(&url), &spdy).await;
    assert_eq!(code, 404, "an expired token");
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_versions_are_negotiated() {
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let port = server.addr().port();
    let url = || {
        server
            .exec_url(pod1(), exec_req("true", false, false))
            .unwrap()
    };
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
    let pf = server.port_forward_url(pod1()).unwrap();
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
            .exec_url(pod1(), exec_req("echo secret; exit 4", false, false))
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

/// A raw SPDY client: the upgrade by hand, then frames as the test writes them, as a hostile
/// client would send them. The server's frames are decoded by a task, in order.
struct RawSpdy {
    wr: tokio::net::tcp::OwnedWriteHalf,
    codec: Codec,
    /// Closed when the server closes the connection.
    frames: tokio::sync::mpsc::UnboundedReceiver<Frame>,
}

impl RawSpdy {
    async fn connect(url: &str, proto: &str) -> RawSpdy {
        let (mut rd, wr) = upgrade(
            url,
            &[
                ("Upgrade", "SPDY/3.1"),
                ("X-Stream-Protocol-Version", proto),
            ],
            None,
        )
        .await;
        let (tx, frames) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut codec = Codec::new();
            while let Ok(Some((h, p))) = spdy::read_frame(&mut rd).await {
                let Ok(f) = codec.decode(h, &p) else { break };
                if tx.send(f).is_err() {
                    break;
                }
            }
        });
        RawSpdy {
            wr,
            codec: Codec::new(),
            frames,
        }
    }

    async fn send(&mut self, f: Frame) -> std::io::Result<()> {
        let bytes = self.codec.encode(&f).unwrap();
        self.wr.write_all(&bytes).await
    }

    async fn open(&mut self, stream: u32, headers: &[(&str, &str)]) {
        let headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        self.send(Frame::SynStream {
            stream,
            associated: 0,
            priority: 0,
            flags: 0,
            headers,
        })
        .await
        .unwrap();
    }

    /// A port-forward stream (`error` or `data`) of request `id` to `port`.
    async fn open_forward(&mut self, stream: u32, kind: &str, id: &str, port: u16) {
        let port = port.to_string();
        self.open(
            stream,
            &[("streamtype", kind), ("requestid", id), ("port", &port)],
        )
        .await;
    }

    async fn data(&mut self, stream: u32, data: &[u8], fin: bool) {
        self.send(Frame::Data {
            stream,
            fin,
            data: bytes::Bytes::copy_from_slice(data),
        })
        .await
        .unwrap();
    }

    /// The next frame from the server; `None` once it closed the connection.
    async fn next(&mut self, what: &str) -> Option<Frame> {
        tokio::time::timeout(WAIT, self.frames.recv())
            .await
            .unwrap_or_else(|_| panic!("timed out after {WAIT:?} waiting for {what}"))
    }

    /// Reads frames until `done` says so; fails when the server closes first.
    async fn until(&mut self, what: &str, mut done: impl FnMut(&Frame) -> bool) {
        loop {
            match self.next(what).await {
                Some(f) if done(&f) => return,
                Some(_) => {}
                None => panic!("the server closed the connection while waiting for {what}"),
            }
        }
    }

    /// What the server sends on `stream` up to its end, and whether it was reset.
    async fn read_stream(&mut self, stream: u32, what: &str) -> (String, bool) {
        let mut text = Vec::new();
        let mut reset = false;
        self.until(what, |f| match f {
            Frame::Data {
                stream: s,
                fin,
                data,
            } if *s == stream => {
                text.extend_from_slice(data);
                *fin
            }
            Frame::RstStream { stream: s, .. } if *s == stream => {
                reset = true;
                true
            }
            _ => false,
        })
        .await;
        (String::from_utf8_lossy(&text).into(), reset)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_spdy_frames_close_the_connection() {
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let url = server.port_forward_url(pod1()).unwrap();
    let mut c = RawSpdy::connect(&url, "portforward.k8s.io").await;
    // A DATA frame announcing 16 MiB - 1 bytes (all SPDY's length field holds), the start of it.
    let mut frame = vec![0, 0, 0, 1, 0, 0xff, 0xff, 0xff];
    frame.extend(vec![0u8; 64 * 1024]);
    // The server may close before all is written.
    let _ = c.wr.write_all(&frame).await;
    // No frame comes back: the connection is closed.
    assert_eq!(c.next("the server to close the connection").await, None);
    drop(c);
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpaired_port_forward_streams_are_reset_after_the_pairing_timeout() {
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let (port, _) = echo_server().await;
    let url = server.port_forward_url(pod1()).unwrap();
    let mut c = RawSpdy::connect(&url, "portforward.k8s.io").await;
    // Request 1 sends only its error stream, request 2 only its data stream.
    c.open_forward(1, "error", "1", port).await;
    c.open_forward(3, "data", "2", port).await;
    // A complete pair beside them forwards as usual.
    c.open_forward(5, "error", "3", port).await;
    c.open_forward(7, "data", "3", port).await;
    c.data(7, b"hello", false).await;
    let mut echoed = Vec::new();
    c.until("the echo of the complete pair", |f| {
        if let Frame::Data {
            stream: 7, data, ..
        } = f
        {
            echoed.extend_from_slice(data);
        }
        echoed == b"hello"
    })
    .await;
    // After the pairing timeout (kubelet's 30 s): the error stream says why, both are reset.
    let (mut message, mut resets) = (Vec::new(), Vec::new());
    let wait = hako::streaming::STREAM_CREATION_TIMEOUT + WAIT;
    tokio::time::timeout(wait, async {
        while resets.len() < 2 {
            match c.frames.recv().await {
                Some(Frame::Data {
                    stream: 1, data, ..
                }) => message.extend_from_slice(&data),
                Some(Frame::RstStream { stream, .. }) => resets.push(stream),
                Some(_) => {}
                None => panic!("the server closed the connection"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("unpaired streams not reset after {wait:?}; resets {resets:?}"));
    resets.sort();
    assert_eq!(resets, [1, 3]);
    let message = String::from_utf8_lossy(&message);
    assert!(
        message.contains(&format!("error forwarding port {port} to pod pod1"))
            && message.contains("timed out")
            && message.contains("data stream of request 1"),
        "{message}"
    );
    // The complete pair still forwards.
    c.data(7, b"again", false).await;
    let mut echoed = Vec::new();
    c.until("the echo of the complete pair after the resets", |f| {
        if let Frame::Data {
            stream: 7, data, ..
        } = f
        {
            echoed.extend_from_slice(data);
        }
        echoed == b"again"
    })
    .await;
    drop(c);
    nothing_left(&host, &server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_port_forwards_are_limited_per_connection() {
    const MAX: usize = hako::streaming::MAX_FORWARDS;
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let (port, open) = echo_server().await;
    let url = server.port_forward_url(pod1()).unwrap();
    let mut c = RawSpdy::connect(&url, "portforward.k8s.io").await;
    let error_of = |i: usize| 4 * i as u32 + 1;
    let data_of = |i: usize| 4 * i as u32 + 3;
    for i in 0..MAX {
        c.open_forward(error_of(i), "error", &i.to_string(), port)
            .await;
        c.open_forward(data_of(i), "data", &i.to_string(), port)
            .await;
    }
    support::wait_for("every allowed forward to connect", WAIT, || {
        open.load(Ordering::SeqCst) == MAX
    })
    .await;
    // One more is refused: its error stream names the port and the cause, both are reset.
    c.open_forward(error_of(MAX), "error", "over", port).await;
    c.open_forward(data_of(MAX), "data", "over", port).await;
    let (message, reset) = c
        .read_stream(error_of(MAX), "the refused request's error stream")
        .await;
    assert!(reset, "the refused error stream is reset");
    assert!(
        message.contains(&format!("error forwarding port {port} to pod pod1"))
            && message.contains(&format!("{MAX} port forwards are open")),
        "{message}"
    );
    c.until(
        "the refused data stream's reset",
        |f| matches!(f, Frame::RstStream { stream, .. } if *stream == data_of(MAX)),
    )
    .await;
    assert_eq!(open.load(Ordering::SeqCst), MAX);
    // One forward ends (the client closes its data stream, the pod's side then closes): the
    // next request is served.
    c.data(data_of(0), b"", true).await;
    let (_, reset) = c.read_stream(error_of(0), "the first forward's end").await;
    assert!(!reset);
    c.open_forward(error_of(MAX + 1), "error", "next", port)
        .await;
    c.open_forward(data_of(MAX + 1), "data", "next", port).await;
    c.data(data_of(MAX + 1), b"hello", false).await;
    let mut echoed = Vec::new();
    c.until("the echo through the next forward", |f| {
        if let Frame::Data { stream, data, .. } = f {
            if *stream == data_of(MAX + 1) {
                echoed.extend_from_slice(data);
            }
        }
        echoed == b"hello"
    })
    .await;
    drop(c);
    support::wait_for("forwarded connections to close", WAIT, || {
        open.load(Ordering::SeqCst) == 0
    })
    .await;
    nothing_left(&host, &server).await;
}

/// An upgraded connection to `url` with `headers`, its halves. The socket's receive buffer is
/// `rcvbuf` bytes when given: a small one keeps the kernel (here up to 32 MiB) from absorbing
/// what a slow client does not read, so the server's own queue fills.
async fn upgrade(
    url: &str,
    headers: &[(&str, &str)],
    rcvbuf: Option<u32>,
) -> (
    tokio::net::tcp::OwnedReadHalf,
    tokio::net::tcp::OwnedWriteHalf,
) {
    let addr: std::net::SocketAddr = url.split('/').nth(2).unwrap().parse().unwrap();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    if let Some(n) = rcvbuf {
        socket.set_recv_buffer_size(n).unwrap();
    }
    let (mut rd, mut wr) = socket.connect(addr).await.unwrap().into_split();
    let mut req = format!(
        "POST {} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\n",
        path_of(url)
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    wr.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = rd.read(&mut b).await.unwrap();
        assert_eq!(
            n,
            1,
            "answer cut short: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    (rd, wr)
}

/// A client reading slower than the command writes, to the end (its receive buffer small, so
/// the kernel does not absorb the output): it still gets all the output, the exit status and
/// the end of the connection, over SPDY and WebSocket. The hang this once had (the last frame
/// queued while the writer was not polled) depends on the queue being exactly full at the
/// session's end, which the kernel's batched wakeups make rare here; the unit tests in
/// `conn.rs` and `remote.rs` reproduce it deterministically.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_still_gets_the_exit_status() {
    const SIZE: usize = 16 << 20;
    const RCVBUF: Option<u32> = Some(16 * 1024);
    let pause = || tokio::time::sleep(Duration::from_millis(2));
    let host = Arc::new(Host::default());
    let server = start(&host, 3600, hako::streaming::TOKEN_TTL).await;
    let cmd = format!("head -c {SIZE} /dev/zero; exit 5");
    let check = |what: &str, out: usize, status: &[u8]| {
        let status = String::from_utf8_lossy(status);
        assert_eq!(out, SIZE, "{what}: output");
        assert!(
            status.contains("NonZeroExitCode") && status.contains("exit status 5"),
            "{what}: {status}"
        );
    };

    // SPDY, v4: streams error, stdout, stderr; one frame read per pause.
    let url = server
        .exec_url(pod1(), exec_req(&cmd, false, false))
        .unwrap();
    let (mut rd, mut wr) = upgrade(
        &url,
        &[
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
        ],
        RCVBUF,
    )
    .await;
    let mut enc = Codec::new();
    for (stream, kind) in [(1, "error"), (3, "stdout"), (5, "stderr")] {
        let syn = enc
            .encode(&Frame::SynStream {
                stream,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: vec![("streamtype".into(), kind.into())],
            })
            .unwrap();
        wr.write_all(&syn).await.unwrap();
    }
    let (mut out, mut status) = (0, Vec::new());
    let mut dec = Codec::new();
    tokio::time::timeout(WAIT, async {
        while let Some((head, payload)) = spdy::read_frame(&mut rd).await.unwrap() {
            match dec.decode(head, &payload).unwrap() {
                Frame::Data {
                    stream: 3, data, ..
                } => out += data.len(),
                Frame::Data {
                    stream: 1, data, ..
                } => status.extend_from_slice(&data),
                _ => {}
            }
            pause().await;
        }
    })
    .await
    .expect("the slow SPDY client to get the session's end");
    check("spdy", out, &status);
    drop((rd, wr));

    // WebSocket, v5: one message read per pause.
    let url = server
        .exec_url(pod1(), exec_req(&cmd, false, false))
        .unwrap();
    let (mut rd, wr) = upgrade(
        &url,
        &[
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Version", "13"),
            ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
            ("Sec-WebSocket-Protocol", "v5.channel.k8s.io"),
        ],
        RCVBUF,
    )
    .await;
    let (mut out, mut status) = (0, Vec::new());
    tokio::time::timeout(WAIT, async {
        loop {
            let mut head = [0u8; 2];
            rd.read_exact(&mut head).await.unwrap();
            let len = match head[1] & 0x7f {
                126 => rd.read_u16().await.unwrap() as usize,
                127 => rd.read_u64().await.unwrap() as usize,
                n => n as usize,
            };
            let mut payload = vec![0u8; len];
            rd.read_exact(&mut payload).await.unwrap();
            match (head[0] & 0x0f, payload.split_first()) {
                (0x8, _) => return,
                (0x2, Some((1, data))) => out += data.len(),
                (0x2, Some((3, data))) => status.extend_from_slice(data),
                _ => {}
            }
            pause().await;
        }
    })
    .await
    .expect("the slow WebSocket client to get the session's end");
    check("websocket", out, &status);
    drop((rd, wr));
    nothing_left(&host, &server).await;
}

/// A `/proc/<pid>/status` figure, in bytes.
fn proc_status(pid: i32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

/// The real daemon: the streaming sessions of one namespace's pods stop at the namespace's
/// share (two pods' full shares here), the refusal naming the namespace and the pod; a pod of
/// another namespace still gets its session. That namespace, filling what is left but the
/// node's reserve, is refused then, and a third namespace still gets its first session.
#[tokio::test(flavor = "multi_thread")]
async fn one_namespace_holds_only_its_share_of_the_streaming_sessions() {
    use hako::streaming::{
        MAX_SESSIONS_PER_NAMESPACE, MAX_SESSIONS_PER_POD, MAX_TOKENS, RESERVED_FOR_NEW_NAMESPACES,
    };
    use hako_proto::cri;
    if !support::e2e_ready(&[]) {
        return;
    }
    let h = support::hako::Hako::start("");
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let mut pods = Vec::new();
    for (name, namespace) in [
        ("t0", "tenant"),
        ("t1", "tenant"),
        ("t2", "tenant"),
        ("o0", "other"),
        ("o1", "other"),
        ("n0", "newcomer"),
    ] {
        let mut cfg = support::cri::with_namespaces(
            support::cri::pod_config(name, logs.path()),
            cri::NamespaceOption {
                network: cri::NamespaceMode::Node as i32,
                ..Default::default()
            },
        );
        cfg.metadata.as_mut().unwrap().namespace = namespace.into();
        pods.push(support::cri::run_pod(&mut rt, &cfg).await);
    }
    async fn forward(rt: &mut support::cri::Rt, pod: &str) -> Result<String, tonic::Status> {
        rt.port_forward(cri::PortForwardRequest {
            pod_sandbox_id: pod.into(),
            port: vec![80],
        })
        .await
        .map(|r| r.into_inner().url)
    }
    let full = MAX_SESSIONS_PER_NAMESPACE / MAX_SESSIONS_PER_POD;
    for pod in &pods[..full] {
        for _ in 0..MAX_SESSIONS_PER_POD {
            forward(&mut rt, pod).await.unwrap();
        }
    }
    let err = forward(&mut rt, &pods[2])
        .await
        .expect_err("a third pod of a namespace whose share is full");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains(&format!(
            "namespace \"tenant\" hold {MAX_SESSIONS_PER_NAMESPACE} sessions"
        )) && err.message().contains(&format!("pod {} asked", pods[2])),
        "{err:?}"
    );
    forward(&mut rt, &pods[3])
        .await
        .expect("a pod of another namespace");
    // The other namespace takes what is left but the reserve, over its two pods. Every token
    // issued here waits for its client for TOKEN_TTL (60 s); these few hundred calls take a
    // fraction of that, so none expires and the counts hold.
    let left = MAX_TOKENS - RESERVED_FOR_NEW_NAMESPACES - MAX_SESSIONS_PER_NAMESPACE;
    for i in 1..left {
        forward(&mut rt, &pods[3 + i / MAX_SESSIONS_PER_POD])
            .await
            .unwrap_or_else(|e| panic!("session {i} of namespace other: {e:?}"));
    }
    let err = forward(&mut rt, &pods[4])
        .await
        .expect_err("a namespace holding sessions, at the node's reserve");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message()
            .contains("are kept for namespaces holding none, and the pods of namespace \"other\""),
        "{err:?}"
    );
    forward(&mut rt, &pods[5])
        .await
        .expect("a namespace holding none, from the reserve");
}

/// The real daemon: a client that pushes 200 MiB into port-forward streams the daemon cannot
/// deliver (their pairs never complete) is held back by the connection's budget (the daemon
/// stops reading), not buffered; the streams are reset at the pairing timeout, then the rest
/// is read and dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pushing_into_unpaired_streams_does_not_grow_the_daemon() {
    use hako_proto::cri;
    if !support::e2e_ready(&[]) {
        return;
    }
    const STREAMS: u32 = 64;
    const FRAME: usize = 1 << 20;
    const PUSH: usize = 200 << 20;
    const BOUND: u64 = 64 << 20;
    let h = support::hako::Hako::start("");
    let mut rt = h.runtime().await;
    let logs = tempfile::tempdir().unwrap();
    let cfg = support::cri::with_namespaces(
        support::cri::pod_config("pf-budget", logs.path()),
        cri::NamespaceOption {
            network: cri::NamespaceMode::Node as i32,
            ..Default::default()
        },
    );
    let pod = support::cri::run_pod(&mut rt, &cfg).await;
    let url = rt
        .port_forward(cri::PortForwardRequest {
            pod_sandbox_id: pod.clone(),
            port: vec![80],
        })
        .await
        .unwrap()
        .into_inner()
        .url;
    let mut c = RawSpdy::connect(&url, "portforward.k8s.io").await;
    for i in 0..STREAMS {
        c.open_forward(2 * i + 1, "data", &format!("r{i}"), 80)
            .await;
    }
    let pid = h.pid();
    let before = proc_status(pid, "VmRSS");
    // The peak from here on (5: reset the high-water mark to the current RSS).
    let base = match std::fs::write(format!("/proc/{pid}/clear_refs"), "5") {
        Ok(()) => before,
        Err(_) => proc_status(pid, "VmHWM"),
    };
    let chunk = bytes::Bytes::from(vec![7u8; FRAME]);
    let wait = hako::streaming::STREAM_CREATION_TIMEOUT + Duration::from_secs(120);
    tokio::time::timeout(wait, async {
        for n in 0..PUSH / FRAME {
            let stream = 2 * (n as u32 % STREAMS) + 1;
            c.send(Frame::Data {
                stream,
                fin: false,
                data: chunk.clone(),
            })
            .await
            .expect("the daemon keeps the connection");
        }
    })
    .await
    .unwrap_or_else(|_| panic!("pushing {PUSH} bytes did not end within {wait:?}"));
    let peak = proc_status(pid, "VmHWM");
    eprintln!(
        "daemon RSS {} MiB before the push, peak {} MiB after it",
        base >> 20,
        peak >> 20
    );
    assert!(
        peak < base + BOUND,
        "the daemon's peak RSS grew by {} MiB (from {} MiB) while a client pushed {} MiB",
        (peak.saturating_sub(base)) >> 20,
        base >> 20,
        PUSH >> 20
    );
    // Every unpaired stream was reset.
    let mut reset = std::collections::HashSet::new();
    c.until("every unpaired stream's reset", |f| {
        if let Frame::RstStream { stream, .. } = f {
            reset.insert(*stream);
        }
        reset.len() == STREAMS as usize
    })
    .await;
    drop(c);
    support::cri::remove_pod(&mut rt, &pod).await;
}
