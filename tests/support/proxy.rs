//! A small HTTP front for the real test registry, to put hako's client through what real
//! registries (and hostile ones) do that a bare local registry does not: a bearer-token
//! challenge with a token realm (basic credentials, OAuth2 refresh tokens, or a pre-issued
//! token); transfers that stall, or are held until the test lets them go; canned answers
//! (an oversized manifest, a hand-made manifest and config); blobs longer than their
//! descriptors and blobs that never end. Everything it does not intercept is forwarded to the
//! registry unchanged. Every request is recorded with its headers.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const GOOD_TOKEN: &str = "hako-test-access-token";
pub const REFRESH_TOKEN: &str = "hako-test-refresh-token";
/// An endless blob stops here, so a client that never stops reading cannot fill the disk.
pub const ENDLESS_CAP: u64 = 512 << 20;

/// What to answer instead of the registry.
#[derive(Clone, Debug)]
pub enum Canned {
    /// This body, with this Content-Type (and its Content-Length).
    Body(Vec<u8>, String),
    /// `len` bytes of filler, with a Content-Length header only when `announce`; without one
    /// the body ends when the connection closes, so the client cannot know its size up front.
    Filler { len: u64, announce: bool },
}

#[derive(Clone, Default)]
pub struct Behaviour {
    /// Demand `Bearer GOOD_TOKEN`; the realm issues it for these basic credentials or for
    /// `REFRESH_TOKEN`.
    pub bearer: Option<(String, String)>,
    /// Blob digests whose download sends a few bytes and then hangs.
    pub stall_blobs: Vec<String>,
    /// Answer every manifest request with 403 DENIED.
    pub deny: bool,
    /// Blob digests whose download is held until the test releases it (`Proxy::release`).
    pub gate_blobs: Vec<String>,
    /// GETs of a path ending in `.0` are answered with `.1`.
    pub canned: Vec<(String, Canned)>,
    /// Blob digests served with this many bytes more than the real blob, announced in the
    /// Content-Length.
    pub long_blobs: Vec<(String, usize)>,
    /// Blob digests whose download never ends (zeros, no Content-Length; `ENDLESS_CAP`).
    pub endless_blobs: Vec<String>,
    /// Blob digests served in two parts: their first `n` bytes, then the rest once the test
    /// lets a held download through (`Proxy::release`), one Content-Length for the whole.
    pub split_blobs: Vec<(String, usize)>,
}

/// A request as the proxy received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn headers_named(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

#[derive(Default)]
pub struct Stats {
    pub seen: Mutex<Vec<Seen>>,
    /// Downloads of `stall_blobs` that started.
    pub stalled: AtomicUsize,
    /// Downloads of `gate_blobs` waiting at the gate now, and the most there ever were at
    /// once. A client sends a download only when it may, so with the gate shut this is how
    /// many downloads it runs at the same time.
    pub held: AtomicUsize,
    pub max_held: AtomicUsize,
    /// Held downloads of `split_blobs` whose client hung up while held.
    pub hung_up: AtomicUsize,
    /// Bytes of canned filler and endless blobs written to clients.
    pub filler_sent: AtomicU64,
}

pub struct Proxy {
    pub addr: String,
    pub stats: Arc<Stats>,
    gate: Arc<tokio::sync::Semaphore>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        // Held downloads must not outlive the test's proxy.
        self.gate.close();
    }
}

struct Request {
    method: String,
    path: String,
    head: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    fn is_blob(&self, digests: &[String]) -> bool {
        self.method == "GET"
            && digests
                .iter()
                .any(|d| self.path.contains(&format!("/blobs/{d}")))
    }
}

async fn read_request(s: &mut TcpStream) -> Option<Request> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split_whitespace();
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        })
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.ok()?;
    Some(Request {
        method,
        path,
        head,
        headers,
        body,
    })
}

async fn respond(s: &mut TcpStream, status: &str, extra: &[(&str, String)], body: &[u8]) {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in extra {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    let _ = s.write_all(out.as_bytes()).await;
    let _ = s.write_all(body).await;
    let _ = s.shutdown().await;
}

/// Writes `len` bytes of zeros (or until the client goes away), counting them.
async fn filler(s: &mut TcpStream, len: u64, sent: &AtomicU64) {
    let chunk = vec![b' '; 64 << 10];
    let mut left = len;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        if s.write_all(&chunk[..n]).await.is_err() {
            return;
        }
        sent.fetch_add(n as u64, Ordering::SeqCst);
        left -= n as u64;
    }
    let _ = s.shutdown().await;
}

fn basic_of(header: &str) -> Option<(String, String)> {
    use base64::Engine;
    let b = header.strip_prefix("Basic ")?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b.trim())
        .ok()?;
    let text = String::from_utf8(raw).ok()?;
    let (u, p) = text.split_once(':')?;
    Some((u.to_string(), p.to_string()))
}

impl Proxy {
    pub async fn start(upstream: &str, behaviour: Behaviour) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stats = Arc::new(Stats::default());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (up, me, st, g) = (
            upstream.to_string(),
            addr.clone(),
            stats.clone(),
            gate.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (up, me, b, st, g) = (
                    up.clone(),
                    me.clone(),
                    behaviour.clone(),
                    st.clone(),
                    g.clone(),
                );
                tokio::spawn(async move { handle(sock, &up, &me, &b, &st, &g).await });
            }
        });
        Proxy {
            addr,
            stats,
            gate,
            task,
        }
    }

    /// How many requests had `part` in their request line (`GET /v2/...`).
    pub fn count(&self, part: &str) -> usize {
        self.seen(part).len()
    }

    /// The requests with `part` in their request line.
    pub fn seen(&self, part: &str) -> Vec<Seen> {
        self.stats
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|r| format!("{} {}", r.method, r.path).contains(part))
            .cloned()
            .collect()
    }

    /// Lets `n` held downloads through.
    pub fn release(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Lets every held download through, now and later.
    pub fn open(&self) {
        self.gate
            .add_permits(tokio::sync::Semaphore::MAX_PERMITS / 2);
    }

    pub fn held(&self) -> usize {
        self.stats.held.load(Ordering::SeqCst)
    }

    pub fn stalled(&self) -> usize {
        self.stats.stalled.load(Ordering::SeqCst)
    }

    pub fn hung_up(&self) -> usize {
        self.stats.hung_up.load(Ordering::SeqCst)
    }

    pub fn max_held(&self) -> usize {
        self.stats.max_held.load(Ordering::SeqCst)
    }

    pub fn filler_sent(&self) -> u64 {
        self.stats.filler_sent.load(Ordering::SeqCst)
    }
}

async fn handle(
    mut s: TcpStream,
    upstream: &str,
    me: &str,
    b: &Behaviour,
    stats: &Stats,
    gate: &tokio::sync::Semaphore,
) {
    let Some(req) = read_request(&mut s).await else {
        return;
    };
    stats.seen.lock().unwrap().push(Seen {
        method: req.method.clone(),
        path: req.path.clone(),
        headers: req.headers.clone(),
    });
    if let Some((user, pass)) = &b.bearer {
        if req.path.starts_with("/token") {
            let ok_basic = req
                .header("authorization")
                .and_then(basic_of)
                .is_some_and(|(u, p)| &u == user && &p == pass);
            let body = String::from_utf8_lossy(&req.body);
            let ok_refresh = req.method == "POST"
                && body.contains("grant_type=refresh_token")
                && body.contains(&format!("refresh_token={REFRESH_TOKEN}"));
            if ok_refresh {
                let body = format!("{{\"access_token\":\"{GOOD_TOKEN}\",\"expires_in\":300}}");
                return respond(
                    &mut s,
                    "200 OK",
                    &[("Content-Type", "application/json".into())],
                    body.as_bytes(),
                )
                .await;
            }
            if ok_basic {
                let body = format!("{{\"token\":\"{GOOD_TOKEN}\",\"expires_in\":300}}");
                return respond(
                    &mut s,
                    "200 OK",
                    &[("Content-Type", "application/json".into())],
                    body.as_bytes(),
                )
                .await;
            }
            return respond(
                &mut s,
                "401 Unauthorized",
                &[],
                b"{\"errors\":[{\"code\":\"UNAUTHORIZED\",\"message\":\"bad credentials\"}]}",
            )
            .await;
        }
        if req.header("authorization") != Some(&format!("Bearer {GOOD_TOKEN}")) {
            let challenge = format!("Bearer realm=\"http://{me}/token\",service=\"hako-test\"");
            return respond(
                &mut s,
                "401 Unauthorized",
                &[("WWW-Authenticate", challenge), ("Content-Type", "application/json".into())],
                b"{\"errors\":[{\"code\":\"UNAUTHORIZED\",\"message\":\"authentication required\"}]}",
            )
            .await;
        }
    }
    if b.deny && req.path.contains("/manifests/") {
        let body = br#"{"errors":[{"code":"DENIED","message":"requested access to the resource is denied"}]}"#;
        return respond(
            &mut s,
            "403 Forbidden",
            &[("Content-Type", "application/json".into())],
            body,
        )
        .await;
    }
    let path = req.path.split('?').next().unwrap_or("").to_string();
    if req.method == "GET" {
        if let Some((_, canned)) = b.canned.iter().find(|(p, _)| path.ends_with(p.as_str())) {
            match canned {
                Canned::Body(body, content_type) => {
                    return respond(
                        &mut s,
                        "200 OK",
                        &[("Content-Type", content_type.clone())],
                        body,
                    )
                    .await
                }
                Canned::Filler { len, announce } => {
                    let mut head = "HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\nConnection: close\r\n".to_string();
                    if *announce {
                        head.push_str(&format!("Content-Length: {len}\r\n"));
                    }
                    head.push_str("\r\n");
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    return filler(&mut s, *len, &stats.filler_sent).await;
                }
            }
        }
    }
    if req.is_blob(&b.stall_blobs) {
        stats.stalled.fetch_add(1, Ordering::SeqCst);
        // No Content-Length: the client cannot tell the body is short until it ends.
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n")
            .await;
        let _ = s.write_all(&[0u8; 64]).await;
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        return;
    }
    if req.is_blob(&b.endless_blobs) {
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n\r\n")
            .await;
        return filler(&mut s, ENDLESS_CAP, &stats.filler_sent).await;
    }
    if let Some((_, extra)) = b
        .long_blobs
        .iter()
        .find(|(d, _)| req.is_blob(std::slice::from_ref(d)))
    {
        let real = reqwest::get(format!("http://{upstream}{}", req.path))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let mut body = real.to_vec();
        body.extend(std::iter::repeat_n(0u8, *extra));
        return respond(
            &mut s,
            "200 OK",
            &[("Content-Type", "application/octet-stream".into())],
            &body,
        )
        .await;
    }
    if let Some((_, first)) = b
        .split_blobs
        .iter()
        .find(|(d, _)| req.is_blob(std::slice::from_ref(d)))
    {
        let real = reqwest::get(format!("http://{upstream}{}", req.path))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            real.len()
        );
        let first = (*first).min(real.len());
        if s.write_all(head.as_bytes()).await.is_err()
            || s.write_all(&real[..first]).await.is_err()
            || s.flush().await.is_err()
        {
            return;
        }
        let now = stats.held.fetch_add(1, Ordering::SeqCst) + 1;
        stats.max_held.fetch_max(now, Ordering::SeqCst);
        // The client sends nothing more after its request: a read that ends is its hang-up.
        let mut byte = [0u8; 1];
        let permit = tokio::select! {
            p = gate.acquire() => Some(p),
            Ok(0) | Err(_) = s.read(&mut byte) => None,
        };
        stats.held.fetch_sub(1, Ordering::SeqCst);
        match permit {
            Some(Ok(p)) => p.forget(),
            Some(Err(_)) => return,
            None => {
                stats.hung_up.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        let _ = s.write_all(&real[first..]).await;
        return;
    }
    if req.is_blob(&b.gate_blobs) {
        let now = stats.held.fetch_add(1, Ordering::SeqCst) + 1;
        stats.max_held.fetch_max(now, Ordering::SeqCst);
        let permit = gate.acquire().await;
        stats.held.fetch_sub(1, Ordering::SeqCst);
        match permit {
            Ok(p) => p.forget(),
            Err(_) => return,
        }
    }
    // Forward: same request line and headers, minus Authorization (the registry has no auth
    // of its own here) and with Connection: close so one exchange per connection.
    let Ok(mut up) = TcpStream::connect(upstream).await else {
        return respond(&mut s, "502 Bad Gateway", &[], b"").await;
    };
    let mut head = String::new();
    for (i, line) in req.head.split("\r\n").enumerate() {
        if line.is_empty() {
            continue;
        }
        let lower = line.to_ascii_lowercase();
        if i > 0 && (lower.starts_with("authorization:") || lower.starts_with("connection:")) {
            continue;
        }
        head.push_str(line);
        head.push_str("\r\n");
    }
    head.push_str("Connection: close\r\n\r\n");
    if up.write_all(head.as_bytes()).await.is_err() || up.write_all(&req.body).await.is_err() {
        return;
    }
    let _ = tokio::io::copy(&mut up, &mut s).await;
    let _ = s.shutdown().await;
}
