//! One SPDY connection, server side: streams the client opens are answered (SYN_REPLY) and
//! handed to a handler with a channel of their incoming data and a writer.
//!
//! Everything a connection runs is one future (reader, writer, idle timer, handler): when the
//! client goes away or the connection idles out, dropping it drops the handler and with it the
//! backend's `Session` (the process is killed), the channels and the socket. No task is
//! spawned per stream, so nothing can outlive the connection.
//!
//! Memory is bounded in bytes, not in messages. What the client sends and the session has not
//! taken yet (stream data, and the headers of streams it holds) is charged to the connection's
//! [`Budget`]; while the budget is spent the reader stops reading the socket, so TCP pushes
//! back on the client (as kubelet's spdystream does by blocking its frame reader) instead of
//! the daemon buffering. What goes out is bounded by the writer's queue: 64 frames of at most
//! [`CHUNK`] bytes.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::spdy::{self, Codec, Frame, Headers};

/// Streams open at once on one connection (port-forward opens two per TCP connection).
const MAX_STREAMS: usize = 2048;
/// Largest data frame written; kept well under the 24-bit limit so streams interleave.
const CHUNK: usize = 32 * 1024;
/// Bytes one connection holds for its session (received, not yet taken). Well above what a
/// session has in flight in practice (client-go writes 32 KiB frames and the consumers copy
/// straight on), and it must hold the largest frame read.
pub const BUDGET: usize = 4 * 1024 * 1024;
/// What one queued message costs beyond its bytes (its allocation and queue slot), so a flood
/// of 1-byte frames is bounded as well as a few big ones.
const MESSAGE_COST: usize = 128;
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
            let last = *self.0.lock().unwrap_or_else(|e| e.into_inner());
            // A timeout too large to add to an instant never fires (no overflow panic).
            let Some(deadline) = last.checked_add(idle) else {
                return std::future::pending().await;
            };
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

/// The bytes a connection may hold for its session: a semaphore with one permit per byte. A
/// queued message holds its permits until its consumer takes it (or the queue is dropped).
#[derive(Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    pub fn new(total: usize) -> Budget {
        Budget {
            bytes: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Waits until `n` bytes (at most the whole budget) are free and takes them.
    pub async fn take(&self, n: usize) -> OwnedSemaphorePermit {
        let n = u32::try_from(n.min(self.total)).unwrap_or(u32::MAX);
        self.bytes
            .clone()
            .acquire_many_owned(n)
            .await
            .expect("the budget's semaphore is never closed")
    }
}

/// A queue of received data whose bytes are charged to a connection's [`Budget`].
pub fn data_channel(budget: &Budget) -> (DataTx, DataRx) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        DataTx {
            tx,
            budget: budget.clone(),
        },
        DataRx(rx),
    )
}

pub struct DataTx {
    tx: mpsc::UnboundedSender<(Bytes, OwnedSemaphorePermit)>,
    budget: Budget,
}

impl DataTx {
    /// Queues `data` once the budget has room for it (the caller, a connection's reader, waits:
    /// that is the backpressure). False when the receiver is gone, at once even while the
    /// budget is spent.
    pub async fn send(&self, data: Bytes) -> bool {
        let permit = tokio::select! {
            p = self.budget.take(data.len() + MESSAGE_COST) => p,
            _ = self.tx.closed() => return false,
        };
        self.tx.send((data, permit)).is_ok()
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

pub struct DataRx(mpsc::UnboundedReceiver<(Bytes, OwnedSemaphorePermit)>);

impl DataRx {
    /// The next data; its bytes go back to the budget. `None` once the sender is gone.
    pub async fn recv(&mut self) -> Option<Bytes> {
        self.0.recv().await.map(|(data, _permit)| data)
    }
}

/// A stream the client opened.
pub struct Stream {
    pub id: u32,
    pub headers: Headers,
    /// Its data; `None` once the client half-closed (FIN) or reset it.
    pub rx: DataRx,
    pub tx: StreamTx,
    /// The headers' share of the budget, given back with the stream.
    _held: OwnedSemaphorePermit,
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

    /// Ends the stream abnormally (RST_STREAM with `status`).
    pub async fn reset(&self, status: u32) {
        let _ = self
            .out
            .send(Some(Frame::RstStream {
                stream: self.id,
                status,
            }))
            .await;
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
    let reader = read_loop(
        r,
        out_tx.clone(),
        streams_tx,
        activity.clone(),
        Budget::new(BUDGET),
    );
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
    finish(out_tx, None, &mut writer, &mut reader, &activity, idle).await;
}

/// Ends a connection whose session is over: `last` (the end marker) is queued while the
/// writer runs, since the queue may be full (output outran a slow client); the idle timeout
/// bounds a client that stops reading (every frame written counts as activity). Then the
/// client gets a moment to close first.
pub async fn finish<M>(
    out_tx: mpsc::Sender<M>,
    last: M,
    writer: impl Future + Unpin,
    mut reader: impl Future + Unpin,
    activity: &Activity,
    idle: Duration,
) {
    let flush = async move {
        tokio::join!(
            async move {
                let _ = out_tx.send(last).await;
            },
            writer
        )
    };
    tokio::select! {
        _ = flush => {}
        _ = &mut reader => return,
        _ = activity.idle(idle) => {
            tracing::info!(idle_s = idle.as_secs(), "streaming connection idle: closed");
            return;
        }
    }
    let _ = tokio::time::timeout(LINGER, reader).await;
}

async fn read_loop<R: AsyncRead>(
    r: R,
    out: mpsc::Sender<Option<Frame>>,
    streams: mpsc::Sender<Stream>,
    activity: Activity,
    budget: Budget,
) -> io::Result<()> {
    tokio::pin!(r);
    let mut codec = Codec::new();
    let mut open: HashMap<u32, DataTx> = HashMap::new();
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
                    // Streams the session dropped (refused, reset) no longer count.
                    open.retain(|_, tx| !tx.is_closed());
                }
                if open.len() >= MAX_STREAMS {
                    reply(Frame::RstStream {
                        stream,
                        status: spdy::REFUSED_STREAM,
                    })
                    .await;
                    continue;
                }
                let held = budget
                    .take(
                        headers
                            .iter()
                            .map(|(n, v)| n.len() + v.len() + MESSAGE_COST)
                            .sum::<usize>()
                            + MESSAGE_COST,
                    )
                    .await;
                reply(Frame::SynReply {
                    stream,
                    fin: false,
                    headers: vec![],
                })
                .await;
                let (dtx, drx) = data_channel(&budget);
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
                    _held: held,
                };
                if streams.send(s).await.is_err() {
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
                    if !data.is_empty() && !tx.send(data).await {
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    const DEADLINE: Duration = Duration::from_secs(30);

    /// A SYN_STREAM for stream 1 (client side of the connection).
    fn syn(codec: &mut Codec) -> Vec<u8> {
        codec
            .encode(&Frame::SynStream {
                stream: 1,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: vec![("streamtype".into(), "stdout".into())],
            })
            .unwrap()
    }

    /// The handler's output outruns the client (the queue fills) and the handler ends: the
    /// client, reading only then, still gets every byte and the end of the connection.
    #[tokio::test]
    async fn output_queued_behind_a_slow_client_is_all_delivered() {
        // Enough to fill the 64-frame queue once the writer holds what the 64 KiB pipe
        // takes (the reply, one chunk and a half-written one), not more: the handler must end.
        const TOTAL: usize = 66 * CHUNK;
        let (client, server) = tokio::io::duplex(64 * 1024);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let serving = tokio::spawn(serve(
            server,
            Duration::from_secs(3600),
            |mut streams| async move {
                let s = streams.recv().await.expect("a stream");
                assert!(s.tx.write(&vec![7u8; TOTAL]).await);
                let _ = done_tx.send(());
            },
        ));
        let (mut rd, mut wr) = tokio::io::split(client);
        let mut codec = Codec::new();
        wr.write_all(&syn(&mut codec)).await.unwrap();
        // Read nothing until the handler has finished.
        tokio::time::timeout(DEADLINE, done_rx)
            .await
            .expect("the handler to queue all its output")
            .unwrap();
        let got = tokio::time::timeout(DEADLINE, async {
            let mut got = 0;
            while let Some((head, payload)) = spdy::read_frame(&mut rd).await.unwrap() {
                if let Frame::Data { data, .. } = codec.decode(head, &payload).unwrap() {
                    got += data.len();
                }
            }
            got
        })
        .await
        .expect("the connection to end with all output delivered");
        assert_eq!(got, TOTAL);
        wr.shutdown().await.unwrap();
        tokio::time::timeout(DEADLINE, serving)
            .await
            .expect("the connection to be served to its end")
            .unwrap();
    }
}
