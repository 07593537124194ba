//! What runs over an upgraded connection: exec/attach (Kubernetes "remotecommand") and
//! port-forward, over SPDY streams or WebSocket channels.
//!
//! remotecommand: stdin, stdout, stderr, an error stream carrying the exit status, and (with a
//! TTY, protocol v3 and later) a resize stream of JSON `{"Width","Height"}` objects. Over SPDY
//! each is a stream named by its `streamtype` header; over WebSocket each is a channel, the
//! first byte of every message (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize; v5 adds
//! 255 + channel = "closed"). v4 and later send the status as a JSON metav1.Status, earlier
//! versions only a failure's message text.
//!
//! port-forward (SPDY): per connection to forward the client opens an `error` and a `data`
//! stream sharing a `requestid` and naming the `port`; up to `MAX_FORWARDS` pairs run at once,
//! and a pair still missing a stream after `STREAM_CREATION_TIMEOUT` is reset.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::conn::{self, Activity, DataRx, Stream, StreamTx};
use super::spdy::{self, header};
use super::{ws, Backend, Session, TermSize};
use crate::error::{chain, Result};

/// How long a client has to open the streams it announced, and the second stream of a
/// port-forward pair after the first (kubelet's default).
pub const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Port-forward pairs one connection holds at once, waiting for their second stream or
/// forwarding. kubectl opens one pair per local TCP connection (a browser makes about six at
/// once, a load test a few dozen), so this is far above real use, while one token can no longer
/// hold any number of sockets into a pod and tasks in the daemon.
pub const MAX_FORWARDS: usize = 256;
/// A longer `requestid` is refused: client-go sends a counter, and the id is kept as a key.
const MAX_REQUEST_ID: usize = 256;

/// remotecommand protocol versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    V1,
    V2,
    V3,
    V4,
    V5,
}

impl Version {
    pub fn json_status(self) -> bool {
        self >= Version::V4
    }
    pub fn resize(self) -> bool {
        self >= Version::V3
    }
}

/// The streams an exec or attach asked for (kept with its token).
#[derive(Debug, Clone, Copy)]
pub struct Want {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

/// Where one output goes.
#[derive(Clone)]
enum Sink {
    Spdy(StreamTx),
    Ws {
        channel: u8,
        base64: bool,
        out: mpsc::Sender<Vec<u8>>,
    },
}

impl Sink {
    async fn write(&self, data: &[u8]) -> bool {
        match self {
            Sink::Spdy(tx) => tx.write(data).await,
            Sink::Ws {
                channel,
                base64,
                out,
            } => out.send(ws_data(*channel, *base64, data)).await.is_ok(),
        }
    }
    async fn close(&self) {
        // A WebSocket channel ends with the connection.
        if let Sink::Spdy(tx) = self {
            tx.close().await
        }
    }
}

fn ws_data(channel: u8, base64: bool, data: &[u8]) -> Vec<u8> {
    if base64 {
        let mut text = vec![b'0' + channel];
        text.extend(
            base64::engine::general_purpose::STANDARD
                .encode(data)
                .into_bytes(),
        );
        ws::encode(ws::OP_TEXT, &text)
    } else {
        let mut bin = Vec::with_capacity(data.len() + 1);
        bin.push(channel);
        bin.extend_from_slice(data);
        ws::encode(ws::OP_BINARY, &bin)
    }
}

/// The client's side of a session, whichever the transport.
struct Wires {
    stdin: Option<DataRx>,
    resize: Option<DataRx>,
    stdout: Option<Sink>,
    stderr: Option<Sink>,
    error: Option<Sink>,
}

/// The status written on the error stream at the end.
fn status(version: Version, outcome: &Result<i32>) -> Option<Vec<u8>> {
    let (json, text) = match outcome {
        Ok(0) => (
            serde_json::json!({"metadata": {}, "status": "Success"}),
            None,
        ),
        Ok(code) => {
            let message = format!("command terminated with non-zero exit code: exit status {code}");
            (
                serde_json::json!({
                    "metadata": {},
                    "status": "Failure",
                    "message": message,
                    "reason": "NonZeroExitCode",
                    "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
                }),
                Some(message),
            )
        }
        Err(e) => {
            let message = chain(e);
            (
                serde_json::json!({
                    "metadata": {},
                    "status": "Failure",
                    "message": message,
                    "reason": "InternalError",
                    "code": 500,
                }),
                Some(message),
            )
        }
    };
    if version.json_status() {
        Some(json.to_string().into_bytes())
    } else {
        text.map(String::into_bytes)
    }
}

/// Runs a session between `wires` and what `start` opens, then writes the status.
async fn run(wires: Wires, version: Version, start: impl Future<Output = Result<Session>>) {
    let Wires {
        stdin: stdin_rx,
        resize: resize_rx,
        stdout: stdout_sink,
        stderr: stderr_sink,
        error,
    } = wires;
    let outcome = match start.await {
        Ok(session) => {
            let Session {
                stdin,
                stdout,
                stderr,
                resize,
                exit,
            } = session;
            let output = async {
                let (_, _, code) = tokio::join!(
                    pump_out(stdout, stdout_sink.as_ref()),
                    pump_out(stderr, stderr_sink.as_ref()),
                    exit
                );
                code
            };
            let input = async {
                tokio::join!(pump_in(stdin_rx, stdin), pump_resize(resize_rx, resize));
                std::future::pending::<()>().await
            };
            tokio::select! {
                code = output => code,
                _ = input => unreachable!("input never finishes on its own"),
            }
        }
        Err(e) => {
            // The streams still drain, so the client is not blocked writing.
            drop((stdin_rx, resize_rx));
            Err(e)
        }
    };
    if let Err(e) = &outcome {
        tracing::debug!(error = %chain(e), "streaming session failed");
    }
    if let (Some(error), Some(bytes)) = (&error, status(version, &outcome)) {
        error.write(&bytes).await;
    }
    for s in [&stdout_sink, &stderr_sink, &error].into_iter().flatten() {
        s.close().await;
    }
}

async fn pump_out(from: Option<super::BoxRead>, to: Option<&Sink>) {
    let Some(mut from) = from else { return };
    let mut buf = vec![0u8; 32 * 1024];
    let mut open = true;
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            // A gone client still has the output drained, so the process is not blocked.
            Ok(n) => {
                if open {
                    if let Some(to) = to {
                        open = to.write(&buf[..n]).await;
                    }
                }
            }
        }
    }
    if let Some(to) = to {
        to.close().await;
    }
}

async fn pump_in(from: Option<DataRx>, to: Option<super::BoxWrite>) {
    let Some(mut from) = from else { return };
    let mut to = to;
    while let Some(data) = from.recv().await {
        if let Some(w) = to.as_mut() {
            if w.write_all(&data).await.is_err() || w.flush().await.is_err() {
                to = None;
            }
        }
    }
    // The client closed stdin: the process sees EOF.
    if let Some(mut w) = to {
        let _ = w.shutdown().await;
    }
}

async fn pump_resize(from: Option<DataRx>, to: Option<mpsc::Sender<TermSize>>) {
    #[derive(serde::Deserialize)]
    struct Size {
        #[serde(rename = "Width")]
        width: u16,
        #[serde(rename = "Height")]
        height: u16,
    }
    let Some(mut from) = from else { return };
    let mut buf: Vec<u8> = Vec::new();
    while let Some(data) = from.recv().await {
        buf.extend_from_slice(&data);
        let mut it = serde_json::Deserializer::from_slice(&buf).into_iter::<Size>();
        let mut sizes = Vec::new();
        let mut consumed = 0;
        loop {
            match it.next() {
                Some(Ok(s)) => {
                    consumed = it.byte_offset();
                    sizes.push(TermSize {
                        width: s.width,
                        height: s.height,
                    });
                }
                Some(Err(e)) if e.is_eof() => break,
                Some(Err(_)) => {
                    // Not JSON: drop what came so far rather than wedge the stream.
                    consumed = buf.len();
                    break;
                }
                None => {
                    consumed = buf.len();
                    break;
                }
            }
        }
        buf.drain(..consumed);
        if buf.len() > 64 * 1024 {
            buf.clear();
        }
        if let Some(to) = &to {
            for s in sizes {
                let _ = to.send(s).await;
            }
        }
    }
}

/// Exec or attach over SPDY.
pub async fn spdy_session<IO, F>(io: IO, idle: Duration, version: Version, want: Want, start: F)
where
    IO: AsyncRead + AsyncWrite + Send,
    F: Future<Output = Result<Session>>,
{
    conn::serve(io, idle, |mut streams| async move {
        let mut expected = 1 + [want.stdin, want.stdout, want.stderr]
            .iter()
            .filter(|b| **b)
            .count();
        if want.tty && version.resize() {
            expected += 1;
        }
        let mut wires = Wires {
            stdin: None,
            resize: None,
            stdout: None,
            stderr: None,
            error: None,
        };
        let mut received = 0;
        let deadline = tokio::time::sleep(STREAM_CREATION_TIMEOUT);
        tokio::pin!(deadline);
        while received < expected {
            let s: Stream = tokio::select! {
                s = streams.recv() => match s { Some(s) => s, None => return },
                _ = &mut deadline => {
                    tracing::info!("streaming client did not open its streams in time");
                    return;
                }
            };
            let fresh = match header(&s.headers, "streamtype").unwrap_or("") {
                "error" => wires.error.replace(Sink::Spdy(s.tx)).is_none(),
                "stdin" => wires.stdin.replace(s.rx).is_none(),
                "stdout" => wires.stdout.replace(Sink::Spdy(s.tx)).is_none(),
                "stderr" => wires.stderr.replace(Sink::Spdy(s.tx)).is_none(),
                "resize" => wires.resize.replace(s.rx).is_none(),
                other => {
                    tracing::debug!(streamtype = other, "unexpected stream type ignored");
                    false
                }
            };
            if fresh {
                received += 1;
            }
        }
        // Streams opened later are refused (their receiver is dropped with `streams`).
        drop(streams);
        run(wires, version, start).await;
    })
    .await
}

/// Exec or attach over WebSocket (`channel.k8s.io` family).
pub async fn ws_session<IO, F>(
    io: IO,
    idle: Duration,
    version: Version,
    base64: bool,
    want: Want,
    start: F,
) where
    IO: AsyncRead + AsyncWrite + Send,
    F: Future<Output = Result<Session>>,
{
    let (r, w) = tokio::io::split(io);
    let activity = Activity::new();
    let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(64);
    // What the client sends and the session has not taken is bounded in bytes: the reader
    // stops reading the socket while it is spent (see `conn`).
    let budget = conn::Budget::new(conn::BUDGET);
    let (stdin_tx, stdin_rx) = conn::data_channel(&budget);
    let (resize_tx, resize_rx) = conn::data_channel(&budget);
    let sink = |channel: u8, on: bool| {
        on.then(|| Sink::Ws {
            channel,
            base64,
            out: out_tx.clone(),
        })
    };
    let wires = Wires {
        stdin: want.stdin.then_some(stdin_rx),
        resize: Some(resize_rx),
        stdout: sink(1, want.stdout),
        stderr: sink(2, want.stderr),
        error: sink(3, true),
    };
    // As kubelet: an empty message on the lowest writable channel tells the client the
    // connection is up.
    let first = if want.stdout {
        1
    } else if want.stderr {
        2
    } else {
        3
    };
    let _ = out_tx.send(ws_data(first, base64, &[])).await;
    // Weak: the writer ends when the session's senders are gone, whatever the reader holds.
    let pongs = out_tx.downgrade();
    let reader = async {
        let mut reader = ws::Reader::new(r);
        let mut stdin_tx = Some(stdin_tx);
        loop {
            let msg = match reader.next().await {
                Ok(Some(m)) => m,
                Ok(None) | Err(_) => return,
            };
            activity.touch();
            match msg {
                ws::Message::Data(op, data) => {
                    let Some((channel, payload)) = ws_payload(op, base64, data) else {
                        continue;
                    };
                    match channel {
                        0 => {
                            if let Some(tx) = &stdin_tx {
                                let _ = tx.send(payload).await;
                            }
                        }
                        4 => {
                            let _ = resize_tx.send(payload).await;
                        }
                        // v5: the client closed a channel; only stdin is the client's.
                        255 if version >= Version::V5 && payload.first() == Some(&0) => {
                            stdin_tx = None
                        }
                        _ => {}
                    }
                }
                ws::Message::Ping(p) => {
                    if let Some(tx) = pongs.upgrade() {
                        let _ = tx.send(ws::encode(ws::OP_PONG, &p)).await;
                    }
                }
                ws::Message::Pong => {}
                ws::Message::Close => return,
            }
        }
    };
    let writer = ws_writer(w, out_rx, activity.clone());
    let session = run(wires, version, start);
    tokio::pin!(reader, writer, session);
    tokio::select! {
        _ = &mut reader => return,
        _ = &mut writer => return,
        _ = activity.idle(idle) => {
            tracing::info!(idle_s = idle.as_secs(), "streaming connection idle: closed");
            return;
        }
        _ = &mut session => {}
    }
    conn::finish(
        out_tx,
        ws::close(1000),
        &mut writer,
        &mut reader,
        &activity,
        idle,
    )
    .await;
}

/// A client message's channel and payload.
fn ws_payload(op: u8, base64: bool, data: Vec<u8>) -> Option<(u8, Bytes)> {
    let (&first, rest) = data.split_first()?;
    if base64 || op == ws::OP_TEXT {
        let channel = first.checked_sub(b'0')?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        Some((channel, bytes.into()))
    } else {
        Some((first, Bytes::copy_from_slice(rest)))
    }
}

/// Writes queued frames; ends (flushed, shut down) when the queue closes.
async fn ws_writer<W: AsyncWrite>(
    w: W,
    mut rx: mpsc::Receiver<Vec<u8>>,
    activity: Activity,
) -> io::Result<()> {
    tokio::pin!(w);
    while let Some(frame) = rx.recv().await {
        w.write_all(&frame).await?;
        activity.touch();
        if rx.is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await?;
    w.shutdown().await
}

/// SPDY carried in WebSocket binary messages (`SPDY/3.1+portforward.k8s.io`, what client-go's
/// tunnelling dialer and `crictl port-forward --transport websocket` speak): the messages are
/// one byte stream, handed to `inner` as a duplex pipe. Closed after `idle` with nothing
/// read from the client or written to it: a client that neither sends nor reads would
/// otherwise hold the connection, its queue and the inner one for ever.
pub async fn ws_tunnel<IO, H, F>(io: IO, idle: Duration, inner: H)
where
    IO: AsyncRead + AsyncWrite + Send,
    H: FnOnce(tokio::io::DuplexStream) -> F,
    F: Future<Output = ()>,
{
    let (r, w) = tokio::io::split(io);
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (mut from_inner, mut to_inner) = tokio::io::split(theirs);
    let (out_tx, out_rx) = mpsc::channel::<Vec<u8>>(64);
    let pongs = out_tx.downgrade();
    let activity = Activity::new();
    let seen = activity.clone();
    let reader = async move {
        let mut reader = ws::Reader::new(r);
        while let Ok(Some(msg)) = reader.next().await {
            seen.touch();
            match msg {
                ws::Message::Data(_, data) => {
                    if to_inner.write_all(&data).await.is_err() {
                        break;
                    }
                }
                ws::Message::Ping(p) => {
                    if let Some(tx) = pongs.upgrade() {
                        let _ = tx.send(ws::encode(ws::OP_PONG, &p)).await;
                    }
                }
                ws::Message::Pong => {}
                ws::Message::Close => break,
            }
        }
        // The client is gone: the inner connection sees end of stream.
        let _ = to_inner.shutdown().await;
    };
    let outbound = async move {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match from_inner.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if out_tx
                        .send(ws::encode(ws::OP_BINARY, &buf[..n]))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        let _ = out_tx.send(ws::close(1000)).await;
    };
    let writer = ws_writer(w, out_rx, activity.clone());
    // The client going away ends the reader, the inner connection then sees EOF and ends,
    // which ends `outbound` and the writer. When the inner side ends first, the client gets
    // a moment to close.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let rest = async move {
        let _ = tokio::join!(inner(ours), outbound, writer);
        let _ = done_tx.send(());
    };
    let reader = async move {
        tokio::select! {
            _ = reader => {}
            _ = async {
                let _ = done_rx.await;
                tokio::time::sleep(conn::LINGER).await
            } => {}
        }
    };
    tokio::select! {
        _ = async { tokio::join!(rest, reader) } => {}
        _ = activity.idle(idle) => {
            tracing::info!(idle_s = idle.as_secs(), "port-forward tunnel idle: closed");
        }
    }
}

/// One port-forward request waiting for its second stream.
struct Unpaired {
    error: Option<Stream>,
    data: Option<Stream>,
    deadline: tokio::time::Instant,
}

/// The `port` header, as the error messages name it.
fn port_of(s: &Stream) -> &str {
    header(&s.headers, "port").unwrap_or("(none)")
}

/// Port-forward over SPDY: `error` + `data` stream pairs, each pair a connection to its port.
/// As kubelet: a pair whose second stream does not come within `STREAM_CREATION_TIMEOUT` is
/// given up (the error stream says so); unlike kubelet, its streams are reset, and at most
/// `MAX_FORWARDS` pairs are held at once.
pub async fn port_forward<IO>(io: IO, idle: Duration, backend: Arc<dyn Backend>, pod: String)
where
    IO: AsyncRead + AsyncWrite + Send,
{
    conn::serve(io, idle, |mut streams| async move {
        let mut pending: HashMap<String, Unpaired> = HashMap::new();
        let mut running = FuturesUnordered::new();
        loop {
            let next = pending.values().map(|p| p.deadline).min();
            let expiry = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                s = streams.recv() => {
                    let Some(s) = s else { break };
                    let kind = header(&s.headers, "streamtype").unwrap_or("").to_string();
                    if kind != "error" && kind != "data" {
                        tracing::debug!(streamtype = %kind, "port-forward: stream type refused");
                        s.tx.reset(spdy::PROTOCOL_ERROR).await;
                        continue;
                    }
                    // Clients before request ids paired streams by id: data = error + 2.
                    let id = match header(&s.headers, "requestid") {
                        Some(r) if r.len() > MAX_REQUEST_ID => {
                            s.tx.reset(spdy::PROTOCOL_ERROR).await;
                            continue;
                        }
                        Some(r) => r.to_string(),
                        None if kind == "data" => s.id.saturating_sub(2).to_string(),
                        None => s.id.to_string(),
                    };
                    if !pending.contains_key(&id) && pending.len() + running.len() >= MAX_FORWARDS {
                        let msg = format!(
                            "error forwarding port {} to pod {pod}: {MAX_FORWARDS} port \
                             forwards are open on this connection already",
                            port_of(&s)
                        );
                        tracing::info!(pod = %pod, "{msg}");
                        if kind == "error" {
                            s.tx.write(msg.as_bytes()).await;
                        }
                        s.tx.reset(spdy::REFUSED_STREAM).await;
                        continue;
                    }
                    let pair = pending.entry(id.clone()).or_insert_with(|| Unpaired {
                        error: None,
                        data: None,
                        deadline: tokio::time::Instant::now() + STREAM_CREATION_TIMEOUT,
                    });
                    let slot = if kind == "error" { &mut pair.error } else { &mut pair.data };
                    if slot.is_some() {
                        // kubelet keeps the first one too ("already assigned").
                        tracing::debug!(request = %id, streamtype = %kind, "port-forward: second stream of one type refused");
                        s.tx.reset(spdy::PROTOCOL_ERROR).await;
                        continue;
                    }
                    *slot = Some(s);
                    if let Some(Unpaired { error: Some(_), data: Some(_), .. }) = pending.get(&id) {
                        if let Some(Unpaired { error: Some(e), data: Some(d), .. }) = pending.remove(&id) {
                            running.push(forward(backend.clone(), pod.clone(), e, d));
                        }
                    }
                }
                Some(()) = running.next(), if !running.is_empty() => {}
                _ = expiry => {
                    let now = tokio::time::Instant::now();
                    let late: Vec<String> = pending
                        .iter()
                        .filter(|(_, p)| p.deadline <= now)
                        .map(|(id, _)| id.clone())
                        .collect();
                    for id in late {
                        let Some(p) = pending.remove(&id) else { continue };
                        let (missing, port) = match (&p.error, &p.data) {
                            (Some(e), None) => ("data", port_of(e)),
                            (None, Some(d)) => ("error", port_of(d)),
                            _ => ("", ""),
                        };
                        let msg = format!(
                            "error forwarding port {port} to pod {pod}: timed out after {}s \
                             waiting for the {missing} stream of request {id}",
                            STREAM_CREATION_TIMEOUT.as_secs()
                        );
                        tracing::info!(pod = %pod, "{msg}");
                        if let Some(e) = &p.error {
                            e.tx.write(msg.as_bytes()).await;
                        }
                        for s in [&p.error, &p.data].into_iter().flatten() {
                            s.tx.reset(spdy::CANCEL).await;
                        }
                    }
                }
            }
        }
        while running.next().await.is_some() {}
    })
    .await
}

async fn forward(backend: Arc<dyn Backend>, pod: String, error: Stream, data: Stream) {
    let port = header(&data.headers, "port").and_then(|p| p.parse::<u16>().ok());
    let Stream {
        rx: mut error_rx,
        tx: error_tx,
        ..
    } = error;
    let Stream {
        rx: mut data_rx,
        tx: data_tx,
        ..
    } = data;
    let fail = |msg: String| {
        let (error_tx, data_tx) = (&error_tx, &data_tx);
        async move {
            error_tx.write(msg.as_bytes()).await;
            data_tx.close().await;
            error_tx.close().await;
        }
    };
    let Some(port) = port.filter(|p| *p > 0) else {
        return fail("port-forward: missing or invalid port header".into()).await;
    };
    let tcp = match backend.port_forward(&pod, port).await {
        Ok(t) => t,
        Err(e) => {
            return fail(format!(
                "error forwarding port {port} to pod {pod}: {}",
                chain(&e)
            ))
            .await
        }
    };
    let (mut rd, mut wr) = tcp.into_split();
    let up = async {
        while let Some(b) = data_rx.recv().await {
            if wr.write_all(&b).await.is_err() {
                break;
            }
        }
        let _ = wr.shutdown().await;
        while data_rx.recv().await.is_some() {}
    };
    let down = async {
        let mut buf = vec![0u8; 32 * 1024];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !data_tx.write(&buf[..n]).await {
                        break;
                    }
                }
            }
        }
        data_tx.close().await;
    };
    let drain_errors = async { while error_rx.recv().await.is_some() {} };
    // Done when the pod's side has closed (as kubelet): the client's half may stay open.
    tokio::select! {
        _ = down => {}
        _ = async {
            tokio::join!(up, drain_errors);
            std::future::pending::<()>().await
        } => {}
    }
    error_tx.close().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads one server message: opcode and payload; `None` at the end.
    async fn message<R: AsyncRead + Unpin>(r: &mut R) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 2];
        r.read_exact(&mut head).await.ok()?;
        let len = match head[1] & 0x7f {
            126 => r.read_u16().await.ok()? as usize,
            127 => r.read_u64().await.ok()? as usize,
            n => n as usize,
        };
        let mut payload = vec![0u8; len];
        r.read_exact(&mut payload).await.ok()?;
        Some((head[0] & 0x0f, payload))
    }

    /// Output that gives a signal when the session has read all of it (the reader is dropped).
    struct Signalled(
        std::io::Cursor<Vec<u8>>,
        Option<tokio::sync::oneshot::Sender<()>>,
    );

    impl AsyncRead for Signalled {
        fn poll_read(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
        }
    }

    impl Drop for Signalled {
        fn drop(&mut self) {
            if let Some(tx) = self.1.take() {
                let _ = tx.send(());
            }
        }
    }

    /// A tunnel whose client neither sends nor reads while the inner side has output
    /// queued (the writer blocked on the full connection) is closed once idle.
    #[tokio::test]
    async fn a_tunnel_nobody_reads_is_closed_once_idle() {
        let (client, server) = tokio::io::duplex(4 * 1024);
        let (inner_done_tx, inner_done_rx) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(ws_tunnel(
            server,
            Duration::from_millis(300),
            |mut pipe| async move {
                // Far more than the connection, the queue and the pipe hold.
                let chunk = vec![1u8; 32 * 1024];
                for _ in 0..1024 {
                    if pipe.write_all(&chunk).await.is_err() {
                        break;
                    }
                }
                let _ = inner_done_tx.send(());
                std::future::pending::<()>().await
            },
        ));
        tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("the idle tunnel to be closed")
            .unwrap();
        // The inner side never got all its output out: the tunnel did not just end with it.
        assert!(inner_done_rx.await.is_err());
        drop(client);
    }

    /// The session's output outruns the client (the queue fills: the pipe holds the first
    /// message, one chunk and part of the next; 63 chunks and the status fill the 64 places)
    /// and the session ends: the client, reading only then, still gets every byte, the status
    /// and the close. (Current-thread runtime: the session runs to its end before the test
    /// reads.)
    #[tokio::test]
    async fn websocket_output_queued_behind_a_slow_client_is_all_delivered() {
        const CHUNK: usize = 32 * 1024;
        const TOTAL: usize = 65 * CHUNK;
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let output = Signalled(std::io::Cursor::new(vec![7u8; TOTAL]), Some(done_tx));
        let session = Session {
            stdin: None,
            stdout: Some(Box::new(output)),
            stderr: None,
            resize: None,
            exit: Box::pin(async { Ok(5) }),
        };
        let want = Want {
            stdin: false,
            stdout: true,
            stderr: false,
            tty: false,
        };
        let serving = tokio::spawn(ws_session(
            server,
            Duration::from_secs(3600),
            Version::V5,
            false,
            want,
            async move { Ok(session) },
        ));
        let (mut rd, mut wr) = tokio::io::split(client);
        tokio::time::timeout(Duration::from_secs(30), done_rx)
            .await
            .expect("the session to read all its output")
            .unwrap();
        let (got, status) = tokio::time::timeout(Duration::from_secs(30), async {
            let (mut got, mut status) = (0, Vec::new());
            loop {
                match message(&mut rd).await.expect("a message before the close") {
                    (ws::OP_CLOSE, _) => return (got, status),
                    (_, m) if m.first() == Some(&1) => got += m.len() - 1,
                    (_, m) if m.first() == Some(&3) => status.extend_from_slice(&m[1..]),
                    _ => {}
                }
            }
        })
        .await
        .expect("the connection to end with all output and the status delivered");
        assert_eq!(got, TOTAL);
        assert!(
            String::from_utf8_lossy(&status).contains("exit status 5"),
            "{}",
            String::from_utf8_lossy(&status)
        );
        wr.shutdown().await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), serving)
            .await
            .expect("the connection to be served to its end")
            .unwrap();
    }
}
