//! The HTTP/1.1 server behind the URLs Exec, Attach and PortForward return: single-use tokens,
//! the upgrade handshake (SPDY/3.1 or WebSocket, with the protocol version negotiated as
//! kubelet's server does), then the session in `remote`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderMap, HeaderValue, CONNECTION, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};

use super::remote::{self, Version, Want};
use super::{AttachRequest, Backend, ExecRequest, Session};
use crate::config::StreamingConfig;
use crate::error::{Error, Result};

/// A token is good for this long (containerd's and kubelet's figure).
pub const TOKEN_TTL: Duration = Duration::from_secs(60);
/// Tokens waiting at once (kubelet's bound on in-flight requests).
pub const MAX_TOKENS: usize = 1000;
/// Sessions running at once, node-wide: each holds a connection, its buffers and, for a
/// port-forward, up to `MAX_FORWARDS` sockets, so without a bound a user allowed to stream to
/// one pod could exhaust the daemon's descriptors for every pod.
pub const MAX_SESSIONS: usize = 1024;
/// Sessions one pod may hold, running or waiting for their client: a quarter of the node's, so
/// one pod's users (or clients that never hang up) cannot take every other pod's. kubectl opens
/// one session per exec, attach or port-forward command: this is many terminals' worth.
pub const MAX_SESSIONS_PER_POD: usize = 256;
/// Sessions the pods of one namespace may hold together: half the node's, so the users of one
/// namespace, however many pods they run, leave the other half to the rest of the node.
pub const MAX_SESSIONS_PER_NAMESPACE: usize = 512;
/// The node's last sessions, and its last waiting tokens, go only to namespaces holding none:
/// two or three namespaces together could otherwise fill the node, each within its share, and
/// leave every other namespace none. With this, each namespace's first session finds a place
/// unless this many other namespaces took one of the reserve first.
pub const RESERVED_FOR_NEW_NAMESPACES: usize = 128;
/// A client has this long to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

const STREAM_PROTOCOL: &str = "x-stream-protocol-version";
const WS_PROTOCOL: &str = "sec-websocket-protocol";
const PORT_FORWARD: &str = "portforward.k8s.io";
const PORT_FORWARD_TUNNEL: &str = "SPDY/3.1+portforward.k8s.io";

/// Whom a session is counted to: its pod (the full id) and the pod's namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub pod: String,
    pub namespace: String,
}

/// A session waiting for its client, and whom it is counted to.
#[derive(Debug, Clone)]
struct Pending {
    owner: Owner,
    what: What,
}

/// Running sessions per pod and per namespace, for their shares.
#[derive(Debug, Default)]
struct Held {
    pods: HashMap<String, usize>,
    namespaces: HashMap<String, usize>,
}

impl Held {
    fn of(&self, owner: &Owner) -> (usize, usize) {
        (
            self.pods.get(&owner.pod).copied().unwrap_or(0),
            self.namespaces.get(&owner.namespace).copied().unwrap_or(0),
        )
    }
}

/// Takes one from `key`'s count, forgetting the key at zero.
fn release(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            counts.remove(key);
        }
    }
}

#[derive(Debug, Clone)]
enum What {
    Exec(ExecRequest),
    Attach(AttachRequest),
    PortForward,
}

impl Pending {
    fn kind(&self) -> &'static str {
        match self.what {
            What::Exec(_) => "exec",
            What::Attach(_) => "attach",
            What::PortForward => "portforward",
        }
    }
}

struct Inner {
    backend: Arc<dyn Backend>,
    tokens: Mutex<HashMap<String, (Instant, Pending)>>,
    base_url: String,
    idle: Duration,
    ttl: Duration,
    sessions: AtomicUsize,
    /// Running sessions per pod and namespace, for `MAX_SESSIONS_PER_POD` and
    /// `MAX_SESSIONS_PER_NAMESPACE`.
    held: Mutex<Held>,
}

/// The running server; dropping it stops accepting (sessions in progress run to their end).
pub struct Streaming {
    inner: Arc<Inner>,
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Drop for Streaming {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// A placeholder until the pods' backend is wired in: every session fails UNIMPLEMENTED.
pub struct NoBackend;

#[tonic::async_trait]
impl Backend for NoBackend {
    async fn exec(&self, _: ExecRequest) -> Result<Session> {
        Err(Error::Unimplemented("exec sessions in this build".into()))
    }
    async fn attach(&self, _: AttachRequest) -> Result<Session> {
        Err(Error::Unimplemented("attach sessions in this build".into()))
    }
    async fn port_forward(&self, _: &str, _: u16) -> Result<tokio::net::TcpStream> {
        Err(Error::Unimplemented("port-forward in this build".into()))
    }
}

impl Streaming {
    /// Binds `config.address` (port 0: a free port) and serves, with TLS when a certificate
    /// and key are configured.
    pub async fn start(config: &StreamingConfig, backend: Arc<dyn Backend>) -> Result<Streaming> {
        Self::start_with_ttl(config, backend, TOKEN_TTL).await
    }

    /// As `start`, with tokens good for `ttl` (tests).
    pub async fn start_with_ttl(
        config: &StreamingConfig,
        backend: Arc<dyn Backend>,
        ttl: Duration,
    ) -> Result<Streaming> {
        let addr: SocketAddr = config.address.parse().map_err(|e| {
            Error::InvalidArgument(format!(
                "streaming.address {:?} is not an address:port: {e}",
                config.address
            ))
        })?;
        let tls = match (&config.tls_cert_file, &config.tls_key_file) {
            (Some(cert), Some(key)) => Some(tls_acceptor(cert, key)?),
            (None, None) => None,
            _ => {
                return Err(Error::InvalidArgument(
                    "streaming.tls_cert_file and streaming.tls_key_file go together".into(),
                ))
            }
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io("bind streaming server to", Path::new(&config.address), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::Internal(format!("streaming server address: {e}")))?;
        if tls.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(
                address = %addr,
                "streaming server listens beyond loopback without TLS: \
                 exec/attach/port-forward traffic is unencrypted"
            );
        }
        let scheme = if tls.is_some() { "https" } else { "http" };
        let inner = Arc::new(Inner {
            backend,
            tokens: Mutex::new(HashMap::new()),
            base_url: format!("{scheme}://{addr}"),
            idle: Duration::from_secs(config.idle_timeout_secs.max(1)),
            ttl,
            sessions: AtomicUsize::new(0),
            held: Mutex::new(Held::default()),
        });
        tracing::info!(url = %inner.base_url, "streaming server listening");
        let accept = tokio::spawn(accept_loop(listener, tls, inner.clone()));
        Ok(Streaming {
            inner,
            addr,
            accept,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Upgraded sessions running now (each holds its connection and any backend session).
    pub fn sessions(&self) -> usize {
        self.inner.sessions.load(Ordering::SeqCst)
    }

    /// The URL for an exec in a container of `owner`'s pod (sessions are counted per pod and
    /// per namespace); the request's streams are checked as kubelet checks them.
    pub fn exec_url(&self, owner: Owner, req: ExecRequest) -> Result<String> {
        if req.cmd.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "exec in container {}: no command given",
                req.container_id
            )));
        }
        check_streams(
            &req.container_id,
            req.stdin,
            req.stdout,
            req.stderr,
            req.tty,
        )?;
        self.inner.issue(owner, What::Exec(req))
    }

    /// As `exec_url`, for an attach.
    pub fn attach_url(&self, owner: Owner, req: AttachRequest) -> Result<String> {
        check_streams(
            &req.container_id,
            req.stdin,
            req.stdout,
            req.stderr,
            req.tty,
        )?;
        self.inner.issue(owner, What::Attach(req))
    }

    /// The URL for a port-forward to `owner`'s pod.
    pub fn port_forward_url(&self, owner: Owner) -> Result<String> {
        self.inner.issue(owner, What::PortForward)
    }
}

fn check_streams(id: &str, stdin: bool, stdout: bool, stderr: bool, tty: bool) -> Result<()> {
    if !(stdin || stdout || stderr) {
        return Err(Error::InvalidArgument(format!(
            "stream to container {id}: one of stdin, stdout or stderr must be set"
        )));
    }
    if tty && stderr {
        return Err(Error::InvalidArgument(format!(
            "stream to container {id}: tty and stderr cannot both be set (a terminal has one output)"
        )));
    }
    Ok(())
}

impl Inner {
    /// A URL for `what` in `owner`'s pod, its request kept under a fresh token.
    fn issue(&self, owner: Owner, what: What) -> Result<String> {
        let pending = Pending { owner, what };
        let mut raw = [0u8; 24];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut raw)
            .map_err(|_| Error::Internal("streaming token: the OS random source failed".into()))?;
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw);
        let kind = pending.kind();
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        tokens.retain(|_, (at, _)| now.duration_since(*at) < self.ttl);
        let running = self.sessions.load(Ordering::SeqCst);
        if running >= MAX_SESSIONS {
            return Err(Error::Unavailable(format!(
                "streaming server: {running} sessions are running already, the most it serves at once"
            )));
        }
        if tokens.len() >= MAX_TOKENS {
            return Err(Error::Unavailable(format!(
                "streaming server: {MAX_TOKENS} requests are waiting for their client already"
            )));
        }
        let owner = &pending.owner;
        let (mut pod_held, mut ns_held) = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .of(owner);
        for (_, p) in tokens.values() {
            pod_held += usize::from(p.owner.pod == owner.pod);
            ns_held += usize::from(p.owner.namespace == owner.namespace);
        }
        if pod_held >= MAX_SESSIONS_PER_POD {
            return Err(Error::Unavailable(format!(
                "streaming server: pod {} holds {pod_held} sessions (running or waiting for their client) already, the most one pod may hold",
                owner.pod
            )));
        }
        if ns_held >= MAX_SESSIONS_PER_NAMESPACE {
            return Err(Error::Unavailable(format!(
                "streaming server: the pods of namespace {:?} hold {ns_held} sessions (running or waiting for their client) already, the most one namespace may hold; pod {} asked",
                owner.namespace, owner.pod
            )));
        }
        if ns_held > 0
            && (running >= MAX_SESSIONS - RESERVED_FOR_NEW_NAMESPACES
                || tokens.len() >= MAX_TOKENS - RESERVED_FOR_NEW_NAMESPACES)
        {
            return Err(Error::Unavailable(format!(
                "streaming server: {running} sessions are running and {} waiting for their client; the node's last {RESERVED_FOR_NEW_NAMESPACES} of each are kept for namespaces holding none, and the pods of namespace {:?} hold {ns_held}; pod {} asked",
                tokens.len(),
                owner.namespace,
                owner.pod
            )));
        }
        tokens.insert(token.clone(), (now, pending));
        Ok(format!("{}/{kind}/{token}", self.base_url))
    }

    /// A place for a session of `owner`, node-wide and in its pod's and namespace's shares;
    /// none when any is full.
    fn place(self: &Arc<Self>, owner: &Owner) -> Option<Place> {
        // The shares first, under their lock: an owner over its share takes no node-wide
        // place, even for a moment, from another.
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let (pod_held, ns_held) = held.of(owner);
        if pod_held >= MAX_SESSIONS_PER_POD || ns_held >= MAX_SESSIONS_PER_NAMESPACE {
            return None;
        }
        // A namespace already running a session stays out of the reserve.
        let most = if ns_held > 0 {
            MAX_SESSIONS - RESERVED_FOR_NEW_NAMESPACES
        } else {
            MAX_SESSIONS
        };
        self.sessions
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < most).then_some(n + 1)
            })
            .ok()?;
        *held.pods.entry(owner.pod.clone()).or_insert(0) += 1;
        *held.namespaces.entry(owner.namespace.clone()).or_insert(0) += 1;
        Some(Place(self.clone(), owner.clone()))
    }

    /// The request behind a token, once (a second use or an expired token finds nothing),
    /// and its session's place, taken in the same step: between the two the session would be
    /// counted neither as waiting nor as running, and `issue` could let its owner past a share.
    fn claim(self: &Arc<Self>, kind: &str, token: &str) -> Claim {
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        let Some((at, pending)) = tokens.remove(token) else {
            return Claim::Unknown;
        };
        if at.elapsed() >= self.ttl || pending.kind() != kind {
            return Claim::Unknown;
        }
        // `tokens`, then `held`: the order `issue` takes them in.
        match self.place(&pending.owner) {
            Some(place) => Claim::Granted(pending, place),
            None => Claim::Full,
        }
    }
}

/// What a token's use finds.
enum Claim {
    Unknown,
    /// The node, the pod or its namespace holds as many sessions as it may.
    Full,
    Granted(Pending, Place),
}

fn tls_acceptor(cert: &Path, key: &Path) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| {
            Error::InvalidArgument(format!("streaming TLS certificate {}: {e}", cert.display()))
        })?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| Error::InvalidArgument(format!("streaming TLS key {}: {e}", key.display())))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
    .map_err(|e| Error::InvalidArgument(format!("streaming TLS: {e}")))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    inner: Arc<Inner>,
) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of fds and the like: wait instead of spinning.
                tracing::warn!(error = %e, "streaming server: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let inner = inner.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                Some(tls) => {
                    let handshake = tokio::time::timeout(HEADER_TIMEOUT, tls.accept(tcp)).await;
                    match handshake {
                        Ok(Ok(s)) => serve_http(s, inner).await,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "streaming TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "streaming TLS handshake timed out"),
                    }
                }
                None => serve_http(tcp, inner).await,
            }
        });
    }
}

async fn serve_http<IO>(io: IO, inner: Arc<Inner>)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let inner = inner.clone();
        async move { Ok::<_, Infallible>(handle(inner, req)) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "streaming connection ended");
    }
}

fn plain(code: StatusCode, msg: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(format!("{msg}\n"))));
    *r.status_mut() = code;
    r
}

/// Every value of `name`, comma lists split.
fn values(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

/// The first protocol the client offers that the server knows (kubelet's order: the client's).
fn negotiate<T: Copy>(offered: &[String], known: &[(&str, T)]) -> Option<(String, T)> {
    offered.iter().find_map(|o| {
        known
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(o))
            .map(|(k, t)| (k.to_string(), *t))
    })
}

#[derive(Clone, Copy)]
enum Proto {
    Spdy(Version),
    Ws(Version, bool),
    PortForwardSpdy,
    PortForwardTunnel,
}

fn handle(inner: Arc<Inner>, mut req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().trim_start_matches('/').to_string();
    let Some((kind, token)) = path.split_once('/') else {
        return plain(StatusCode::NOT_FOUND, "not found");
    };
    // The session's place, taken now: tokens issued before the sessions filled up, upgraded
    // at once, must not take them past the bound. Given back when the session (or a failed
    // upgrade) ends, or when this request goes no further.
    let (pending, place) = match inner.claim(kind, token) {
        Claim::Granted(pending, place) => (pending, place),
        Claim::Unknown => {
            return plain(StatusCode::NOT_FOUND, "unknown or expired streaming token");
        }
        Claim::Full => {
            return plain(
                StatusCode::SERVICE_UNAVAILABLE,
                "the streaming server runs as many sessions as it serves at once, or as the pod or its namespace may hold",
            );
        }
    };
    let headers = req.headers();
    let upgrade = headers
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let forward = matches!(pending.what, What::PortForward);
    let mut resp = plain(StatusCode::SWITCHING_PROTOCOLS, "");
    let (chosen, proto) = if upgrade == "websocket" {
        let Some(key) = headers
            .get("sec-websocket-key")
            .and_then(|v| v.to_str().ok())
        else {
            return plain(StatusCode::BAD_REQUEST, "websocket upgrade without a key");
        };
        let offered = values(headers, WS_PROTOCOL);
        let known: &[(&str, Proto)] = if forward {
            &[(PORT_FORWARD_TUNNEL, Proto::PortForwardTunnel)]
        } else {
            &[
                ("v5.channel.k8s.io", Proto::Ws(Version::V5, false)),
                ("v4.channel.k8s.io", Proto::Ws(Version::V4, false)),
                ("v4.base64.channel.k8s.io", Proto::Ws(Version::V4, true)),
                ("channel.k8s.io", Proto::Ws(Version::V1, false)),
                ("base64.channel.k8s.io", Proto::Ws(Version::V1, true)),
            ]
        };
        let chosen = match negotiate(&offered, known) {
            Some((name, p)) => (Some(name), p),
            None if offered.is_empty() && !forward => (None, Proto::Ws(Version::V1, false)),
            None => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "unable to negotiate a websocket protocol: client offers {offered:?}, server supports {:?}",
                        known.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                    ),
                )
            }
        };
        let h = resp.headers_mut();
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        if let Ok(v) = HeaderValue::from_str(&super::ws::accept_key(key)) {
            h.insert("sec-websocket-accept", v);
        }
        if let Some(name) = &chosen.0 {
            if let Ok(v) = HeaderValue::from_str(name) {
                h.insert(WS_PROTOCOL, v);
            }
        }
        chosen
    } else if upgrade.starts_with("spdy/3.1") {
        let offered = values(headers, STREAM_PROTOCOL);
        let known: &[(&str, Proto)] = if forward {
            &[(PORT_FORWARD, Proto::PortForwardSpdy)]
        } else {
            &[
                ("v4.channel.k8s.io", Proto::Spdy(Version::V4)),
                ("v3.channel.k8s.io", Proto::Spdy(Version::V3)),
                ("v2.channel.k8s.io", Proto::Spdy(Version::V2)),
                ("channel.k8s.io", Proto::Spdy(Version::V1)),
            ]
        };
        let chosen = match negotiate(&offered, known) {
            Some((name, p)) => (Some(name), p),
            // A client that names no version speaks the first one.
            None if offered.is_empty() => (None, known[known.len() - 1].1),
            None => {
                return plain(
                    StatusCode::FORBIDDEN,
                    &format!(
                        "unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports {:?}",
                        known.iter().map(|(k, _)| *k).collect::<Vec<_>>()
                    ),
                )
            }
        };
        let h = resp.headers_mut();
        h.insert(UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        if let Some(name) = &chosen.0 {
            if let Ok(v) = HeaderValue::from_str(name) {
                h.insert(STREAM_PROTOCOL, v);
            }
        }
        chosen
    } else {
        return plain(
            StatusCode::BAD_REQUEST,
            "expected an upgrade to SPDY/3.1 or websocket",
        );
    };
    tracing::debug!(kind, protocol = ?chosen, "streaming upgrade");
    resp.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    *resp.body_mut() = Full::new(Bytes::new());
    let upgraded = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let io = match upgraded.await {
            Ok(u) => TokioIo::new(u),
            Err(e) => {
                tracing::debug!(error = %e, "streaming upgrade failed");
                return;
            }
        };
        let _place = place;
        run_session(&inner, io, pending, proto).await;
    });
    resp
}

/// A place among the `MAX_SESSIONS` sessions and in its pod's and namespace's shares, given
/// back when dropped.
struct Place(Arc<Inner>, Owner);

impl Drop for Place {
    fn drop(&mut self) {
        let mut held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        release(&mut held.pods, &self.1.pod);
        release(&mut held.namespaces, &self.1.namespace);
        drop(held);
        self.0.sessions.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn run_session(
    inner: &Arc<Inner>,
    io: TokioIo<hyper::upgrade::Upgraded>,
    pending: Pending,
    proto: Proto,
) {
    let backend = inner.backend.clone();
    let idle = inner.idle;
    let pod = pending.owner.pod;
    match (pending.what, proto) {
        (What::PortForward, Proto::PortForwardSpdy) => {
            remote::port_forward(io, idle, backend, pod).await
        }
        (What::PortForward, Proto::PortForwardTunnel) => {
            remote::ws_tunnel(io, idle, |pipe| {
                remote::port_forward(pipe, idle, backend, pod)
            })
            .await
        }
        (What::Exec(r), p) => {
            let want = Want {
                stdin: r.stdin,
                stdout: r.stdout,
                stderr: r.stderr,
                tty: r.tty,
            };
            session(io, idle, p, want, async move { backend.exec(r).await }).await
        }
        (What::Attach(r), p) => {
            let want = Want {
                stdin: r.stdin,
                stdout: r.stdout,
                stderr: r.stderr,
                tty: r.tty,
            };
            session(io, idle, p, want, async move { backend.attach(r).await }).await
        }
        (What::PortForward, _) => {}
    }
}

async fn session(
    io: TokioIo<hyper::upgrade::Upgraded>,
    idle: Duration,
    proto: Proto,
    want: Want,
    start: impl std::future::Future<Output = Result<Session>> + Send,
) {
    match proto {
        Proto::Spdy(v) => remote::spdy_session(io, idle, v, want, start).await,
        Proto::Ws(v, b64) => remote::ws_session(io, idle, v, b64, want, start).await,
        Proto::PortForwardSpdy | Proto::PortForwardTunnel => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pod `pod`, alone in a namespace of its own.
    fn own(pod: &str) -> Owner {
        in_namespace(pod, &format!("ns-{pod}"))
    }

    fn in_namespace(pod: &str, namespace: &str) -> Owner {
        Owner {
            pod: pod.into(),
            namespace: namespace.into(),
        }
    }

    fn server_inner(ttl: Duration) -> Inner {
        Inner {
            backend: Arc::new(NoBackend),
            tokens: Mutex::new(HashMap::new()),
            base_url: "http://127.0.0.1:1".into(),
            idle: Duration::from_secs(1),
            ttl,
            sessions: AtomicUsize::new(0),
            held: Mutex::new(Held::default()),
        }
    }

    #[test]
    fn tokens_are_single_use_random_kind_bound_and_bounded() {
        let inner = Arc::new(server_inner(TOKEN_TTL));
        let url = inner.issue(own("p"), What::PortForward).unwrap();
        let token = url.rsplit('/').next().unwrap().to_string();
        // 24 random bytes, base64url: 192 bits.
        assert_eq!(token.len(), 32);
        let other = inner.issue(own("p"), What::PortForward).unwrap();
        assert_ne!(url, other);
        assert!(
            matches!(inner.claim("exec", &token), Claim::Unknown),
            "kind must match"
        );
        let url = inner.issue(own("p"), What::PortForward).unwrap();
        let token = url.rsplit('/').next().unwrap();
        assert!(matches!(
            inner.claim("portforward", token),
            Claim::Granted(..)
        ));
        assert!(
            matches!(inner.claim("portforward", token), Claim::Unknown),
            "second use"
        );
        let waiting = inner.tokens.lock().unwrap().len();
        // Spread over pods, each within its share.
        for i in waiting..MAX_TOKENS {
            inner
                .issue(own(&format!("p{i}")), What::PortForward)
                .unwrap();
        }
        match inner.issue(own("q"), What::PortForward) {
            Err(Error::Unavailable(m)) => assert!(m.contains("requests are waiting"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_more_sessions_are_issued_than_run_at_once() {
        let inner = server_inner(TOKEN_TTL);
        inner.sessions.store(MAX_SESSIONS - 1, Ordering::SeqCst);
        inner.issue(own("p"), What::PortForward).unwrap();
        inner.sessions.store(MAX_SESSIONS, Ordering::SeqCst);
        match inner.issue(own("p"), What::PortForward) {
            Err(Error::Unavailable(m)) => assert!(m.contains("1024 sessions are running"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_pod_holds_only_its_share_of_the_sessions() {
        let inner = Arc::new(server_inner(TOKEN_TTL));
        // Waiting tokens count: the pod's share fills with them, another pod's is untouched.
        for _ in 0..MAX_SESSIONS_PER_POD {
            inner.issue(own("greedy"), What::PortForward).unwrap();
        }
        match inner.issue(own("greedy"), What::PortForward) {
            Err(Error::Unavailable(m)) => assert!(m.contains("pod greedy holds 256"), "{m}"),
            other => panic!("{other:?}"),
        }
        inner.issue(own("other"), What::PortForward).unwrap();
        // Running ones count too, and a refused place takes nothing node-wide.
        inner.tokens.lock().unwrap().clear();
        let places: Vec<Place> = (0..MAX_SESSIONS_PER_POD)
            .map(|_| {
                inner
                    .place(&own("greedy"))
                    .expect("a place within the share")
            })
            .collect();
        assert!(inner.place(&own("greedy")).is_none());
        assert!(inner.issue(own("greedy"), What::PortForward).is_err());
        assert_eq!(inner.sessions.load(Ordering::SeqCst), MAX_SESSIONS_PER_POD);
        let other = inner.place(&own("other")).expect("another pod's place");
        drop(places);
        drop(other);
        assert_all_given_back(&inner);
        inner.issue(own("greedy"), What::PortForward).unwrap();
    }

    #[test]
    fn the_nodes_last_places_are_kept_for_namespaces_holding_none() {
        let inner = Arc::new(server_inner(TOKEN_TTL));
        // Within each pod's share: the `i`th session of a namespace goes to pod `i / 256`.
        let owner =
            |ns: &str, i: usize| in_namespace(&format!("{ns}-{}", i / MAX_SESSIONS_PER_POD), ns);
        // Waiting tokens: two namespaces fill all but the reserve.
        let issued = |ns: &str| {
            (0..)
                .take_while(|&i| inner.issue(owner(ns, i), What::PortForward).is_ok())
                .count()
        };
        assert_eq!(issued("a"), MAX_SESSIONS_PER_NAMESPACE);
        let b = MAX_TOKENS - RESERVED_FOR_NEW_NAMESPACES - MAX_SESSIONS_PER_NAMESPACE;
        assert_eq!(issued("b"), b);
        match inner.issue(owner("b", b), What::PortForward) {
            Err(Error::Unavailable(m)) => assert!(
                m.contains("last 128 of each are kept for namespaces holding none")
                    && m.contains("namespace \"b\" hold 360"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        // Each newcomer gets its first one, no more.
        assert_eq!(issued("c"), 1);
        assert_eq!(issued("d"), 1);
        // Running sessions: the same, with the node's bound.
        inner.tokens.lock().unwrap().clear();
        let mut places = Vec::new();
        let mut placed = |ns: &str| {
            let before = places.len();
            while let Some(p) = inner.place(&owner(ns, places.len() - before)) {
                places.push(p);
            }
            places.len() - before
        };
        assert_eq!(placed("a"), MAX_SESSIONS_PER_NAMESPACE);
        assert_eq!(
            placed("b"),
            MAX_SESSIONS - RESERVED_FOR_NEW_NAMESPACES - MAX_SESSIONS_PER_NAMESPACE
        );
        assert_eq!(placed("c"), 1);
        assert_eq!(placed("d"), 1);
        // And no token for a namespace running sessions, with the node in its reserve.
        match inner.issue(owner("b", 383), What::PortForward) {
            Err(Error::Unavailable(m)) => assert!(
                m.contains("898 sessions are running and 0 waiting")
                    && m.contains("namespace \"b\" hold 384"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
        inner.issue(owner("e", 0), What::PortForward).unwrap();
        drop(places);
        assert_all_given_back(&inner);
    }

    /// No session counted and no pod or namespace left holding a place.
    fn assert_all_given_back(inner: &Inner) {
        assert_eq!(inner.sessions.load(Ordering::SeqCst), 0);
        let held = inner.held.lock().unwrap();
        assert!(
            held.pods.is_empty() && held.namespaces.is_empty(),
            "{held:?}"
        );
    }

    #[test]
    fn the_pods_of_one_namespace_hold_only_its_share_of_the_sessions() {
        let inner = Arc::new(server_inner(TOKEN_TTL));
        let pods = MAX_SESSIONS_PER_NAMESPACE / MAX_SESSIONS_PER_POD;
        // Each pod within its own share, the namespace's filling with waiting tokens.
        for p in 0..pods {
            for _ in 0..MAX_SESSIONS_PER_POD {
                inner
                    .issue(in_namespace(&format!("p{p}"), "tenant"), What::PortForward)
                    .unwrap();
            }
        }
        match inner.issue(in_namespace("one-more", "tenant"), What::PortForward) {
            Err(Error::Unavailable(m)) => {
                assert!(m.contains("namespace \"tenant\" hold 512"), "{m}");
                assert!(m.contains("pod one-more asked"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        inner
            .issue(in_namespace("p0", "elsewhere"), What::PortForward)
            .expect_err("pod p0's own share is full, whatever namespace it names");
        inner.issue(own("other"), What::PortForward).unwrap();
        // Running ones count too: a namespace's places stop at its share, another's do not,
        // and a refused place takes nothing node-wide.
        inner.tokens.lock().unwrap().clear();
        let places: Vec<Place> = (0..MAX_SESSIONS_PER_NAMESPACE)
            .map(|i| {
                let pod = format!("q{}", i % (pods + 1));
                inner
                    .place(&in_namespace(&pod, "tenant"))
                    .expect("a place within the namespace's share")
            })
            .collect();
        assert!(inner.place(&in_namespace("fresh", "tenant")).is_none());
        assert!(inner
            .issue(in_namespace("fresh", "tenant"), What::PortForward)
            .is_err());
        assert_eq!(
            inner.sessions.load(Ordering::SeqCst),
            MAX_SESSIONS_PER_NAMESPACE
        );
        let other = inner
            .place(&own("other"))
            .expect("another namespace's place");
        drop(places);
        drop(other);
        assert_all_given_back(&inner);
        inner
            .issue(in_namespace("fresh", "tenant"), What::PortForward)
            .unwrap();
    }

    #[test]
    fn a_token_used_when_its_pods_share_is_full_gets_no_place() {
        let inner = Arc::new(server_inner(TOKEN_TTL));
        let url = inner.issue(own("p"), What::PortForward).unwrap();
        let places: Vec<Place> = (0..MAX_SESSIONS_PER_POD)
            .map(|_| inner.place(&own("p")).unwrap())
            .collect();
        let token = url.rsplit('/').next().unwrap();
        assert!(matches!(inner.claim("portforward", token), Claim::Full));
        assert_eq!(inner.sessions.load(Ordering::SeqCst), MAX_SESSIONS_PER_POD);
        drop(places);
        assert!(
            matches!(inner.claim("portforward", token), Claim::Unknown),
            "a refused token is spent"
        );
    }

    #[test]
    fn expired_tokens_are_refused_and_make_room() {
        let inner = Arc::new(server_inner(Duration::ZERO));
        let url = inner.issue(own("p"), What::PortForward).unwrap();
        assert!(matches!(
            inner.claim("portforward", url.rsplit('/').next().unwrap()),
            Claim::Unknown
        ));
        for _ in 0..MAX_TOKENS + 5 {
            inner.issue(own("p"), What::PortForward).unwrap();
        }
    }

    #[test]
    fn stream_flags_are_checked_as_kubelet_does() {
        assert!(check_streams("c", false, false, false, false).is_err());
        assert!(check_streams("c", true, true, true, true).is_err());
        assert!(check_streams("c", true, true, false, true).is_ok());
        assert!(check_streams("c", false, false, true, false).is_ok());
    }
}
