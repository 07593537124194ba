//! The daemon ↔ monitor wire: the messages of `proto/monitor.proto` (prost), framed on the
//! monitor's unix socket, one call per connection.
//!
//! A call: the daemon connects, writes `u32 length (big-endian) | u8 method | message`, and
//! reads `u32 length | u8 code | body` back, where code 0 carries the response message and any
//! other code is a gRPC status code with a UTF-8 message as the body. Then both close.
//!
//! Streaming calls (`Exec`, `Attach`): after an OK answer the connection stays open and
//! carries stream frames both ways, `u8 stream | u32 length (big-endian) | bytes`, at most
//! [`STREAM_CHUNK`] bytes each:
//!
//! - [`stream::STDIN`] (daemon → monitor): bytes for the process's stdin; an empty frame is
//!   end of file (the monitor closes the stdin it holds for this call).
//! - [`stream::STDOUT`], [`stream::STDERR`] (monitor → daemon): output; an empty frame is that
//!   stream's end.
//! - [`stream::RESIZE`] (daemon → monitor): a terminal size, `u16 width | u16 height`.
//! - [`stream::EXIT`] (monitor → daemon): the exit code, `i32`, after every output's end;
//!   the last frame, then the monitor closes.
//!
//! Flow control is the socket's: the monitor reads a process's output only as fast as the
//! daemon takes the frames, and the daemon reads frames only as fast as its client takes the
//! bytes. The daemon closing the connection ends the call: an exec'd process is killed, an
//! attach detaches.
//!
//! Not gRPC: an idle monitor keeps no connection, and it runs none of h2, hyper and tonic.
//! With one monitor per pod that was ~40 % of each monitor's memory (docs/BENCHMARKS.md).
//! Unix socket connects cost microseconds, so a connection per call costs nothing that
//! matters, and concurrent calls (a long Wait beside others) need no multiplexing.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Output kept from one ExecSync stream; the rest is read and dropped (kubelet probes want the
/// start of the output, and a runaway command must not grow the monitor).
pub const EXEC_OUTPUT_CAP: usize = 16 * 1024 * 1024;

/// The largest frame either side accepts: two capped ExecSync outputs and change.
pub const MAX_FRAME: usize = 2 * EXEC_OUTPUT_CAP + 64 * 1024;

/// The calls, as numbered on the wire: the proto's `Method` enum, generated, so the numbers
/// are defined once (in `proto/monitor.proto`) and both sides use the same ones.
pub use hako_proto::monitor::Method;

/// The call a frame's method byte names; `None` for a number this build does not know (and
/// for 0, which names no call).
pub fn method(b: u8) -> Option<Method> {
    Method::try_from(i32::from(b))
        .ok()
        .filter(|m| *m != Method::Unspecified)
}

/// gRPC status codes the monitor answers with (the daemon maps them as it maps its own).
pub mod code {
    pub const OK: u8 = 0;
    pub const CANCELLED: u8 = 1;
    pub const INVALID_ARGUMENT: u8 = 3;
    pub const NOT_FOUND: u8 = 5;
    pub const ALREADY_EXISTS: u8 = 6;
    pub const FAILED_PRECONDITION: u8 = 9;
    pub const UNIMPLEMENTED: u8 = 12;
    pub const INTERNAL: u8 = 13;
    pub const UNAVAILABLE: u8 = 14;
}

/// A failed call: a gRPC status code and what failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    code: u8,
    message: String,
}

impl Status {
    pub fn new(code: u8, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
        }
    }
    pub fn internal(m: impl Into<String>) -> Status {
        Status::new(code::INTERNAL, m)
    }
    pub fn not_found(m: impl Into<String>) -> Status {
        Status::new(code::NOT_FOUND, m)
    }
    pub fn invalid_argument(m: impl Into<String>) -> Status {
        Status::new(code::INVALID_ARGUMENT, m)
    }
    pub fn already_exists(m: impl Into<String>) -> Status {
        Status::new(code::ALREADY_EXISTS, m)
    }
    /// The caller went first: the answer has no reader, it only ends the call.
    pub fn cancelled(m: impl Into<String>) -> Status {
        Status::new(code::CANCELLED, m)
    }
    pub fn failed_precondition(m: impl Into<String>) -> Status {
        Status::new(code::FAILED_PRECONDITION, m)
    }
    pub fn code(&self) -> u8 {
        self.code
    }
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// Writes one frame: length, tag, body.
pub async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    tag: u8,
    body: &[u8],
) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.extend_from_slice(&(body.len() as u32 + 1).to_be_bytes());
    frame.push(tag);
    frame.extend_from_slice(body);
    w.write_all(&frame).await?;
    w.flush().await
}

/// The largest record the daemon may have a monitor keep (KeepRecord); a larger one is refused
/// with INVALID_ARGUMENT.
pub const MAX_RECORD: usize = 1 << 20;
/// The most all of a pod's kept records may take together: an `Info` that carries them (adoption
/// at start) must fit in a frame the daemon reads, beside the containers' states.
pub const MAX_KEPT: usize = MAX_FRAME - (1 << 20);
/// The largest call the monitor reads: calls carry ids, paths, an exec's argv and kept records,
/// never output. Room for a KeepRecord of MAX_RECORD bytes beside its container id, so such a
/// call gets its answer rather than a dropped connection.
pub const MAX_REQUEST: usize = MAX_RECORD + (64 << 10);

/// Reads one frame: its tag and body.
pub async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<(u8, Vec<u8>)> {
    read_frame_max(r, MAX_FRAME).await
}

/// Reads one frame of at most `max` bytes; a larger length is refused before anything is
/// allocated for it.
pub async fn read_frame_max<R: AsyncReadExt + Unpin>(
    r: &mut R,
    max: usize,
) -> std::io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len == 0 || len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    let tag = buf.remove(0);
    Ok((tag, buf))
}

/// The streams of a streaming call's frames (see the module's text).
pub mod stream {
    pub const STDIN: u8 = 0;
    pub const STDOUT: u8 = 1;
    pub const STDERR: u8 = 2;
    pub const RESIZE: u8 = 3;
    pub const EXIT: u8 = 4;
}

/// The most bytes one stream frame carries.
pub const STREAM_CHUNK: usize = 32 * 1024;

/// Writes one stream frame (`bytes` at most [`STREAM_CHUNK`] long; longer is the caller's bug,
/// split by it).
pub async fn write_stream<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    stream: u8,
    bytes: &[u8],
) -> std::io::Result<()> {
    debug_assert!(bytes.len() <= STREAM_CHUNK);
    let mut frame = Vec::with_capacity(5 + bytes.len());
    frame.push(stream);
    frame.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
    frame.extend_from_slice(bytes);
    w.write_all(&frame).await?;
    w.flush().await
}

/// Reads one stream frame into `buf` (cleared first): its stream. A length over
/// [`STREAM_CHUNK`] is refused before anything is read into the buffer; a clean end of the
/// connection between frames is `UnexpectedEof` as any other.
pub async fn read_stream<R: AsyncReadExt + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> std::io::Result<u8> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head).await?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > STREAM_CHUNK {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("stream frame of {len} bytes"),
        ));
    }
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf).await?;
    Ok(head[0])
}

/// A resize frame's body.
pub fn resize_body(width: u16, height: u16) -> [u8; 4] {
    let (w, h) = (width.to_be_bytes(), height.to_be_bytes());
    [w[0], w[1], h[0], h[1]]
}

/// A resize frame's size (width, height); `None` when the body is not 4 bytes.
pub fn parse_resize(body: &[u8]) -> Option<(u16, u16)> {
    match body {
        [a, b, c, d] => Some((u16::from_be_bytes([*a, *b]), u16::from_be_bytes([*c, *d]))),
        _ => None,
    }
}

/// An exit frame's code; `None` when the body is not 4 bytes.
pub fn parse_exit(body: &[u8]) -> Option<i32> {
    <[u8; 4]>::try_from(body).ok().map(i32::from_be_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn stream_frames_round_trip_with_eof_resize_and_exit() {
        let (mut a, mut b) = tokio::io::duplex(256 * 1024);
        let big = vec![7u8; STREAM_CHUNK];
        write_stream(&mut a, stream::STDOUT, b"out").await.unwrap();
        write_stream(&mut a, stream::STDERR, &big).await.unwrap();
        write_stream(&mut a, stream::STDIN, b"").await.unwrap();
        write_stream(&mut a, stream::RESIZE, &resize_body(80, 24))
            .await
            .unwrap();
        write_stream(&mut a, stream::EXIT, &(-7i32).to_be_bytes())
            .await
            .unwrap();
        drop(a);
        let mut buf = Vec::new();
        assert_eq!(read_stream(&mut b, &mut buf).await.unwrap(), stream::STDOUT);
        assert_eq!(buf, b"out");
        assert_eq!(read_stream(&mut b, &mut buf).await.unwrap(), stream::STDERR);
        assert_eq!(buf, big);
        // End of file is an empty frame.
        assert_eq!(read_stream(&mut b, &mut buf).await.unwrap(), stream::STDIN);
        assert!(buf.is_empty());
        assert_eq!(read_stream(&mut b, &mut buf).await.unwrap(), stream::RESIZE);
        assert_eq!(parse_resize(&buf), Some((80, 24)));
        assert_eq!(read_stream(&mut b, &mut buf).await.unwrap(), stream::EXIT);
        assert_eq!(parse_exit(&buf), Some(-7));
        // The connection's end.
        let e = read_stream(&mut b, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(parse_resize(b"abc"), None);
        assert_eq!(parse_exit(b"abcde"), None);
    }

    #[tokio::test]
    async fn an_oversized_stream_frame_is_refused_unread() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let mut head = vec![stream::STDIN];
        head.extend_from_slice(&(STREAM_CHUNK as u32 + 1).to_be_bytes());
        a.write_all(&head).await.unwrap();
        let mut buf = Vec::new();
        let e = read_stream(&mut b, &mut buf).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(buf.is_empty(), "nothing allocated for it");
    }

    #[tokio::test]
    async fn frames_round_trip_and_bad_lengths_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        write_frame(&mut a, Method::Wait as u8, b"hello")
            .await
            .unwrap();
        write_frame(&mut a, code::OK, b"").await.unwrap();
        assert_eq!(read_frame(&mut b).await.unwrap(), (6, b"hello".to_vec()));
        assert_eq!(read_frame(&mut b).await.unwrap(), (0, Vec::new()));
        a.write_all(&0u32.to_be_bytes()).await.unwrap();
        assert!(read_frame(&mut b).await.is_err());
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&(MAX_FRAME as u32 + 1).to_be_bytes())
            .await
            .unwrap();
        assert!(read_frame(&mut b).await.is_err());
    }

    #[test]
    fn every_method_round_trips_and_unknown_numbers_are_refused() {
        let mut known = 0;
        for n in 0..=i32::from(u8::MAX) + 1 {
            match Method::try_from(n) {
                Ok(Method::Unspecified) => assert_eq!(method(n as u8), None, "0 names no call"),
                Ok(m) => {
                    // It fits the frame's byte and decodes back to itself.
                    assert!(
                        n <= i32::from(u8::MAX),
                        "{m:?} = {n} does not fit the method byte"
                    );
                    assert_eq!(m as u8 as i32, n);
                    assert_eq!(method(m as u8), Some(m));
                    known += 1;
                }
                Err(_) if n <= i32::from(u8::MAX) => assert_eq!(method(n as u8), None, "{n}"),
                Err(_) => {}
            }
        }
        // The calls the proto's service documents, each with a number.
        assert_eq!(known, 14);
        assert_eq!(method(8), Some(Method::ExecSync));
        assert_eq!(method(14), Some(Method::Attach));
        assert_eq!(method(15), None);
    }
}
