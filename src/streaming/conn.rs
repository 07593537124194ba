//! One SPDY connection, server side: streams the client opens are answered (SYN_REPLY) and
//! handed to a handler with a channel of their incoming data and a writer.
//!
//! Everything a connection runs is one future (reader, writer, idle timer, handler): when the
//! client goes away or the connection idles out, dropping it drops the handler and with it the
//! backend's `Session` (the process is killed), the channels and the socket. No task is
//! spawned per stream, so nothing can outlive the connection.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::spdy::{self, Codec, Frame, Headers};

/// Streams open at once on one connection (port-forward opens two per TCP connection).
const MAX_STREAMS: usize = 2048;
/// Largest data frame written; kept well under the 24-bit limit so streams interleave.
const CHUNK: usize = 32 * 1024;
/// How long a finished connection waits for the client to close its side, so the last frames
/// are not lost to a reset of unread input.
pub const LINGER: Duration = Duration::from_secs(5);

/// The last time a frame went either way; the idle timeout counts from it.
#[derive(Clone)]
pub struct Activity(Arc<Mutex<Instant>>);

impl Activity {
    pub fn new() -> Activity {
        Activity(Arc::new(Mutex::new(Instant::now())))
    }
    pub fn touch(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }
    /// Resolves once nothing has moved for `idle`.
    pub async fn idle(&self, idle: Duration) {
        loop {
            let deadline = *self.0.lock().unwrap_or_else(|e| e.into_inner()) + idle;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

impl Default for Activity {
    fn default() -> Self {
        Self::new()
    }
}

/// A stream the client opened.
pub struct Stream {
    pub id: u32,
    pub headers: Headers,
    /// Its data; `None` once the client half-closed (FIN) or reset it.
    pub rx: mpsc::Receiver<Bytes>,
    pub tx: StreamTx,
}

/// Writes to one stream.
#[derive(Clone)]
pub struct StreamTx {
    id: u32,
    out: mpsc::Sender<Option<Frame>>,
}

impl StreamTx {
    /// False once the connection is going away.
    pub async fn write(&self, data: &[u8]) -> bool {
        for chunk in data.chunks(CHUNK) {
            let f = Frame::Data {
                stream: self.id,
                fin: false,
                data: Bytes::copy_from_slice(chunk),
            };
            if self.out.send(Some(f)).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Half-closes the stream (FIN).
    pub async fn close(&self) {
        let _ = self
            .out
            .send(Some(Frame::Data {
                stream: self.id,
                fin: true,
                data: Bytes::new(),
            }))
            .await;
    }
}

/// Serves one SPDY connection over `io` until the handler returns (then the queued frames are
/// written and the connection closed), the client goes away, or nothing moved for `idle`.
pub async fn serve<IO, H, F>(io: IO, idle: Duration, handler: H)
where
    IO: AsyncRead + AsyncWrite + Send,
    H: FnOnce(mpsc::Receiver<Stream>) -> F,
    F: Future<Output = ()>,
{
    let (r, w) = tokio::io::split(io);
    let activity = Activity::new();
    let (out_tx, out_rx) = mpsc::channel::<Option<Frame>>(64);
    let (streams_tx, streams_rx) = mpsc::channel::<Stream>(64);
    let reader = read_loop(r, out_tx.clone(), streams_tx, activity.clone());
    let writer = write_loop(w, out_rx, activity.clone());
    let handler = handler(streams_rx);
    tokio::pin!(reader, writer, handler);
    tokio::select! {
        r = &mut reader => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "spdy connection: read ended");
            }
            return;
        }
        r = &mut writer => {
            if let Err(e) = r {
                tracing::debug!(error = %e, "spdy connection: write ended");
            }
            return;
        }
        _ = activity.idle(idle) => {
            tracing::info!(idle_s = idle.as_secs(), "streaming connection idle: closed");
            return;
        }
        _ = &mut handler => {}
    }
    // Flush what the handler queued, then give the client a moment to close first.
    let _ = out_tx.send(None).await;
    drop(out_tx);
    let _ = tokio::time::timeout(LINGER, async {
        tokio::select! {
            _ = &mut writer => {}
            _ = &mut reader => return,
        }
        let _ = (&mut reader).await;
    })
    .await;
}

async fn read_loop<R: AsyncRead>(
    r: R,
    out: mpsc::Sender<Option<Frame>>,
    streams: mpsc::Sender<Stream>,
    activity: Activity,
) -> io::Result<()> {
    tokio::pin!(r);
    let mut codec = Codec::new();
    let mut open: HashMap<u32, mpsc::Sender<Bytes>> = HashMap::new();
    // Replies to the client; a send fails only once the writer is gone, which is ignored
    // here: the connection is ending and the reader only drains.
    let reply = |f: Frame| {
        let out = out.clone();
        async move {
            let _ = out.send(Some(f)).await;
        }
    };
    loop {
        let Some((head, payload)) = spdy::read_frame(&mut r).await? else {
            return Ok(());
        };
        activity.touch();
        match codec.decode(head, &payload)? {
            Frame::SynStream {
                stream,
                flags,
                headers,
                ..
            } => {
                if stream == 0 || stream % 2 == 0 || open.contains_key(&stream) {
                    reply(Frame::RstStream {
                        stream,
                        status: spdy::PROTOCOL_ERROR,
                    })
                    .await;
                    continue;
                }
                if open.len() >= MAX_STREAMS {
                    reply(Frame::RstStream {
                        stream,
                        status: spdy::REFUSED_STREAM,
                    })
                    .await;
                    continue;
                }
                reply(Frame::SynReply {
                    stream,
                    fin: false,
                    headers: vec![],
                })
                .await;
                let (dtx, drx) = mpsc::channel(16);
                if flags & spdy::FLAG_FIN == 0 {
                    open.insert(stream, dtx);
                }
                let s = Stream {
                    id: stream,
                    headers,
                    rx: drx,
                    tx: StreamTx {
                        id: stream,
                        out: out.clone(),
                    },
                };
                if streams.try_send(s).is_err() {
                    open.remove(&stream);
                    reply(Frame::RstStream {
                        stream,
                        status: spdy::REFUSED_STREAM,
                    })
                    .await;
                }
            }
            Frame::Data { stream, fin, data } => {
                if let Some(tx) = open.get(&stream) {
                    if !data.is_empty() && tx.send(data).await.is_err() {
                        open.remove(&stream);
                    }
                }
                if fin {
                    open.remove(&stream);
                }
            }
            Frame::Headers { stream, fin, .. } if fin => {
                open.remove(&stream);
            }
            Frame::RstStream { stream, .. } => {
                open.remove(&stream);
            }
            // Odd ids are the client's pings, to be echoed; even ones would answer ours.
            Frame::Ping { id } if id % 2 == 1 => reply(Frame::Ping { id }).await,
            Frame::GoAway { .. } => return Ok(()),
            _ => {}
        }
    }
}

async fn write_loop<W: AsyncWrite>(
    w: W,
    mut rx: mpsc::Receiver<Option<Frame>>,
    activity: Activity,
) -> io::Result<()> {
    tokio::pin!(w);
    let mut codec = Codec::new();
    while let Some(Some(f)) = rx.recv().await {
        w.write_all(&codec.encode(&f)?).await?;
        activity.touch();
        if rx.is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await?;
    w.shutdown().await
}
