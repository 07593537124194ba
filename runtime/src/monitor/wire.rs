//! The daemon ↔ monitor wire: the messages of `proto/monitor.proto` (prost), framed on the
//! monitor's unix socket, one call per connection.
//!
//! A call: the daemon connects, writes `u32 length (big-endian) | u8 method | message`, and
//! reads `u32 length | u8 code | body` back, where code 0 carries the response message and any
//! other code is a gRPC status code with a UTF-8 message as the body. Then both close.
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

/// The largest call the monitor reads: calls carry ids, paths and an exec's argv, never output.
pub const MAX_REQUEST: usize = 1 << 20;

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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(known, 11);
        assert_eq!(method(8), Some(Method::ExecSync));
        assert_eq!(method(12), None);
    }
}
