//! A small HTTP front for the real test registry, to put hako's client through what real
//! registries do that a bare local registry does not: a bearer-token challenge with a token
//! realm (basic credentials, OAuth2 refresh tokens, or a pre-issued token), and transfers that
//! stall mid-blob. Everything it does not intercept is forwarded to the registry unchanged.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const GOOD_TOKEN: &str = "hako-test-access-token";
pub const REFRESH_TOKEN: &str = "hako-test-refresh-token";

#[derive(Clone, Default)]
pub struct Behaviour {
    /// Demand `Bearer GOOD_TOKEN`; the realm issues it for these basic credentials or for
    /// `REFRESH_TOKEN`.
    pub bearer: Option<(String, String)>,
    /// Blob digests whose download sends a few bytes and then hangs.
    pub stall_blobs: Vec<String>,
    /// Answer every manifest request with 403 DENIED.
    pub deny: bool,
    /// Blob digests whose download starts only after this delay.
    pub delay_blobs: Vec<String>,
    pub delay: std::time::Duration,
}

pub struct Proxy {
    pub addr: String,
    pub requests: Arc<Mutex<Vec<String>>>,
    pub stalled: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
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
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stalled = Arc::new(AtomicUsize::new(0));
        let (up, me) = (upstream.to_string(), addr.clone());
        let (reqs, st) = (requests.clone(), stalled.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (up, me, b, reqs, st) = (
                    up.clone(),
                    me.clone(),
                    behaviour.clone(),
                    reqs.clone(),
                    st.clone(),
                );
                tokio::spawn(async move { handle(sock, &up, &me, &b, &reqs, &st).await });
            }
        });
        Proxy {
            addr,
            requests,
            stalled,
            task,
        }
    }

    pub fn count(&self, part: &str) -> usize {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.contains(part))
            .count()
    }
}

async fn handle(
    mut s: TcpStream,
    upstream: &str,
    me: &str,
    b: &Behaviour,
    reqs: &Mutex<Vec<String>>,
    stalled: &AtomicUsize,
) {
    let Some(req) = read_request(&mut s).await else {
        return;
    };
    reqs.lock()
        .unwrap()
        .push(format!("{} {}", req.method, req.path));
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
    if b.stall_blobs
        .iter()
        .any(|d| req.path.contains(&format!("/blobs/{d}")))
        && req.method == "GET"
    {
        stalled.fetch_add(1, Ordering::SeqCst);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\nContent-Type: application/octet-stream\r\n\r\n").await;
        let _ = s.write_all(&[0u8; 64]).await;
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        return;
    }
    if b.delay_blobs
        .iter()
        .any(|d| req.path.contains(&format!("/blobs/{d}")))
    {
        stalled.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(b.delay).await;
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
