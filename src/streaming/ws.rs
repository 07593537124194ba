//! WebSocket (RFC 6455), server side, as much as the Kubernetes stream protocols use: the
//! handshake key, masked client frames in, unmasked frames out, fragments reassembled, ping
//! answered, close. Small enough that a crate (and its build) is not worth it.

use std::io;

use base64::Engine;
use tokio::io::{AsyncRead, AsyncReadExt};

pub const OP_CONT: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xa;

/// A whole message larger than this closes the connection (1009, "message too big").
pub const MAX_MESSAGE: usize = 1024 * 1024;

/// `Sec-WebSocket-Accept` for the client's `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA1_FOR_LEGACY_USE_ONLY);
    ctx.update(key.trim().as_bytes());
    ctx.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(ctx.finish().as_ref())
}

/// One frame as the server sends it (never masked, always final).
pub fn encode(opcode: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 10);
    out.push(0x80 | opcode);
    match payload.len() {
        n if n < 126 => out.push(n as u8),
        n if n <= 0xffff => {
            out.push(126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
    out
}

/// A close frame with `code`.
pub fn close(code: u16) -> Vec<u8> {
    encode(OP_CLOSE, &code.to_be_bytes())
}

#[derive(Debug, PartialEq, Eq)]
pub enum Message {
    /// Text or binary (the opcode), reassembled.
    Data(u8, Vec<u8>),
    Ping(Vec<u8>),
    Pong,
    Close,
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("websocket: {msg}"))
}

/// Reads client frames.
pub struct Reader<R> {
    r: R,
    partial: Option<(u8, Vec<u8>)>,
}

impl<R: AsyncRead + Unpin> Reader<R> {
    pub fn new(r: R) -> Self {
        Reader { r, partial: None }
    }

    /// The next message; `None` at end of stream. Control frames come between fragments.
    pub async fn next(&mut self) -> io::Result<Option<Message>> {
        loop {
            let mut head = [0u8; 2];
            match self.r.read_exact(&mut head).await {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
                Err(e) => return Err(e),
            }
            let fin = head[0] & 0x80 != 0;
            let opcode = head[0] & 0x0f;
            if head[0] & 0x70 != 0 {
                return Err(invalid("reserved bits set"));
            }
            if head[1] & 0x80 == 0 {
                return Err(invalid("client frame not masked"));
            }
            let len = match head[1] & 0x7f {
                126 => self.r.read_u16().await? as u64,
                127 => self.r.read_u64().await?,
                n => n as u64,
            };
            // RFC 6455 5.5: control frames are short and never fragmented.
            if opcode & 0x8 != 0 && (!fin || len > 125) {
                return Err(invalid("control frame fragmented or over 125 bytes"));
            }
            let have = self.partial.as_ref().map_or(0, |(_, b)| b.len()) as u64;
            if len.saturating_add(have) > MAX_MESSAGE as u64 {
                return Err(invalid("message too big"));
            }
            let mut mask = [0u8; 4];
            self.r.read_exact(&mut mask).await?;
            let mut payload = vec![0u8; len as usize];
            self.r.read_exact(&mut payload).await?;
            for (i, b) in payload.iter_mut().enumerate() {
                *b ^= mask[i % 4];
            }
            match opcode {
                OP_PING => return Ok(Some(Message::Ping(payload))),
                OP_PONG => return Ok(Some(Message::Pong)),
                OP_CLOSE => return Ok(Some(Message::Close)),
                OP_TEXT | OP_BINARY if self.partial.is_none() => {
                    if fin {
                        return Ok(Some(Message::Data(opcode, payload)));
                    }
                    self.partial = Some((opcode, payload));
                }
                OP_CONT if self.partial.is_some() => {
                    let (op, mut buf) = self.partial.take().unwrap_or_default();
                    buf.extend_from_slice(&payload);
                    if fin {
                        return Ok(Some(Message::Data(op, buf)));
                    }
                    self.partial = Some((op, buf));
                }
                _ => return Err(invalid("unexpected opcode")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client frame: masked.
    pub fn client_frame(fin: bool, opcode: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = encode(opcode, payload);
        if !fin {
            f[0] &= 0x7f;
        }
        let at = match payload.len() {
            n if n < 126 => 2,
            n if n <= 0xffff => 4,
            _ => 10,
        };
        f[1] |= 0x80;
        let mask = [1u8, 2, 3, 4];
        let body: Vec<u8> = payload
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ mask[i % 4])
            .collect();
        f.truncate(at);
        f.extend_from_slice(&mask);
        f.extend(body);
        f
    }

    #[test]
    fn accept_key_is_rfc6455s_example() {
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[tokio::test]
    async fn control_frames_over_125_bytes_or_fragmented_are_refused() {
        let ok = client_frame(true, OP_PING, &[1u8; 125]);
        assert!(Reader::new(&ok[..]).next().await.is_ok());
        let long = client_frame(true, OP_PING, &[1u8; 126]);
        assert!(Reader::new(&long[..]).next().await.is_err());
        let fragmented = client_frame(false, OP_PING, b"p");
        assert!(Reader::new(&fragmented[..]).next().await.is_err());
        let big = client_frame(true, OP_BINARY, &vec![0u8; MAX_MESSAGE + 1]);
        assert!(Reader::new(&big[..]).next().await.is_err());
    }

    #[tokio::test]
    async fn reads_fragments_control_frames_and_lengths() {
        let big = vec![7u8; 70000];
        let mut wire = client_frame(false, OP_BINARY, b"ab");
        wire.extend(client_frame(true, OP_PING, b"p"));
        wire.extend(client_frame(true, OP_CONT, b"cd"));
        wire.extend(client_frame(true, OP_TEXT, &big[..300]));
        wire.extend(client_frame(true, OP_BINARY, &big));
        wire.extend(client_frame(true, OP_CLOSE, &[3, 232]));
        let mut r = Reader::new(&wire[..]);
        assert_eq!(r.next().await.unwrap(), Some(Message::Ping(b"p".to_vec())));
        assert_eq!(
            r.next().await.unwrap(),
            Some(Message::Data(OP_BINARY, b"abcd".to_vec()))
        );
        assert_eq!(
            r.next().await.unwrap(),
            Some(Message::Data(OP_TEXT, big[..300].to_vec()))
        );
        assert_eq!(r.next().await.unwrap(), Some(Message::Data(OP_BINARY, big)));
        assert_eq!(r.next().await.unwrap(), Some(Message::Close));
        assert_eq!(r.next().await.unwrap(), None);
        // Unmasked client frames are refused.
        assert!(Reader::new(&encode(OP_BINARY, b"x")[..])
            .next()
            .await
            .is_err());
    }
}
