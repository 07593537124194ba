//! SPDY/3.1 framing, as kubelet's clients (moby/spdystream) speak it: the eight control frames,
//! data frames, and header blocks compressed with zlib over the SPDY/3 preset dictionary, one
//! compression context per direction for the whole connection.
//!
//! Flow control: frames are parsed (WINDOW_UPDATE included) but send windows are not enforced.
//! spdystream never sends WINDOW_UPDATE, so a sender that honoured the 64 KiB initial window
//! would stall every stream after 64 KiB; backpressure comes from TCP instead, as with kubelet.

use std::io;

use bytes::Bytes;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The dictionary of the SPDY/3 draft, section 2.6.10.1.
pub const DICTIONARY: &[u8; 1423] = include_bytes!("spdy3.dict");

pub const VERSION: u16 = 3;
pub const FLAG_FIN: u8 = 0x01;
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;
/// The largest payload the 24-bit length field can carry.
pub const MAX_PAYLOAD: usize = (1 << 24) - 1;
/// The largest frame read (client-go writes 32 KiB data frames).
pub const MAX_READ: usize = 1024 * 1024;
/// A decompressed header block larger than this is an error (a zlib bomb otherwise).
pub const MAX_HEADER_BLOCK: usize = 256 * 1024;

/// RST_STREAM status codes used here.
pub const PROTOCOL_ERROR: u32 = 1;
pub const REFUSED_STREAM: u32 = 3;
pub const CANCEL: u32 = 5;

/// Header names (lowercase, as SPDY/3 requires) and values (several values joined by NUL).
pub type Headers = Vec<(String, String)>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream: u32,
        fin: bool,
        data: Bytes,
    },
    SynStream {
        stream: u32,
        associated: u32,
        priority: u8,
        flags: u8,
        headers: Headers,
    },
    SynReply {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    RstStream {
        stream: u32,
        status: u32,
    },
    /// Entries are (flags, id, value).
    Settings {
        clear: bool,
        entries: Vec<(u8, u32, u32)>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream: u32,
        fin: bool,
        headers: Headers,
    },
    WindowUpdate {
        stream: u32,
        delta: u32,
    },
    /// A control frame type SPDY/3 does not define: the spec says to ignore it.
    Unknown {
        kind: u16,
    },
}

/// The first value of header `name` (names are compared lowercase).
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.split('\0').next().unwrap_or(""))
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("spdy: {}", msg.into()))
}

/// One direction's header compression state, or both (a connection has one of each).
pub struct Codec {
    deflate: Compress,
    inflate: Decompress,
}

impl Default for Codec {
    fn default() -> Self {
        Self::new()
    }
}

impl Codec {
    pub fn new() -> Codec {
        let mut deflate = Compress::new(Compression::default(), true);
        deflate
            .set_dictionary(DICTIONARY)
            .expect("a fresh deflate stream takes a dictionary");
        Codec {
            deflate,
            inflate: Decompress::new(true),
        }
    }

    /// The frame's bytes (header included).
    pub fn encode(&mut self, frame: &Frame) -> io::Result<Vec<u8>> {
        let control = |kind: u16, flags: u8, body: Vec<u8>| -> io::Result<Vec<u8>> {
            if body.len() > MAX_PAYLOAD {
                return Err(invalid("frame too large"));
            }
            let mut out = Vec::with_capacity(8 + body.len());
            out.extend_from_slice(&(0x8000 | VERSION).to_be_bytes());
            out.extend_from_slice(&kind.to_be_bytes());
            out.push(flags);
            out.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
            out.extend_from_slice(&body);
            Ok(out)
        };
        let fin = |f: bool| if f { FLAG_FIN } else { 0 };
        match frame {
            Frame::Data {
                stream,
                fin: f,
                data,
            } => {
                if data.len() > MAX_PAYLOAD {
                    return Err(invalid("data frame too large"));
                }
                let mut out = Vec::with_capacity(8 + data.len());
                out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
                out.push(fin(*f));
                out.extend_from_slice(&(data.len() as u32).to_be_bytes()[1..]);
                out.extend_from_slice(data);
                Ok(out)
            }
            Frame::SynStream {
                stream,
                associated,
                priority,
                flags,
                headers,
            } => {
                let mut body = Vec::new();
                body.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
                body.extend_from_slice(&(associated & 0x7fff_ffff).to_be_bytes());
                body.push((priority & 0x7) << 5);
                body.push(0); // slot
                body.extend(self.compress(headers)?);
                control(1, *flags, body)
            }
            Frame::SynReply {
                stream,
                fin: f,
                headers,
            } => {
                let mut body = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
                body.extend(self.compress(headers)?);
                control(2, fin(*f), body)
            }
            Frame::RstStream { stream, status } => {
                let mut body = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
                body.extend_from_slice(&status.to_be_bytes());
                control(3, 0, body)
            }
            Frame::Settings { clear, entries } => {
                let mut body = (entries.len() as u32).to_be_bytes().to_vec();
                for (flags, id, value) in entries {
                    body.push(*flags);
                    body.extend_from_slice(&(id & 0xff_ffff).to_be_bytes()[1..]);
                    body.extend_from_slice(&value.to_be_bytes());
                }
                control(4, u8::from(*clear), body)
            }
            Frame::Ping { id } => control(6, 0, id.to_be_bytes().to_vec()),
            Frame::GoAway { last_good, status } => {
                let mut body = (last_good & 0x7fff_ffff).to_be_bytes().to_vec();
                body.extend_from_slice(&status.to_be_bytes());
                control(7, 0, body)
            }
            Frame::Headers {
                stream,
                fin: f,
                headers,
            } => {
                let mut body = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
                body.extend(self.compress(headers)?);
                control(8, fin(*f), body)
            }
            Frame::WindowUpdate { stream, delta } => {
                let mut body = (stream & 0x7fff_ffff).to_be_bytes().to_vec();
                body.extend_from_slice(&(delta & 0x7fff_ffff).to_be_bytes());
                control(9, 0, body)
            }
            Frame::Unknown { kind } => control(*kind, 0, Vec::new()),
        }
    }

    /// Parses one frame: `head` is its first 8 bytes, `payload` the length they announce.
    pub fn decode(&mut self, head: [u8; 8], payload: &[u8]) -> io::Result<Frame> {
        let flags = head[4];
        let fin = flags & FLAG_FIN != 0;
        let word = |b: &[u8], at: usize| -> io::Result<u32> {
            b.get(at..at + 4)
                .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
                .ok_or_else(|| invalid("frame too short"))
        };
        if head[0] & 0x80 == 0 {
            return Ok(Frame::Data {
                stream: word(&head, 0)? & 0x7fff_ffff,
                fin,
                data: Bytes::copy_from_slice(payload),
            });
        }
        let version = u16::from_be_bytes([head[0], head[1]]) & 0x7fff;
        if version != VERSION {
            return Err(invalid(format!("unsupported version {version}")));
        }
        let kind = u16::from_be_bytes([head[2], head[3]]);
        let stream = || word(payload, 0).map(|w| w & 0x7fff_ffff);
        Ok(match kind {
            1 => {
                if payload.len() < 10 {
                    return Err(invalid("SYN_STREAM too short"));
                }
                Frame::SynStream {
                    stream: stream()?,
                    associated: word(payload, 4)? & 0x7fff_ffff,
                    priority: payload[8] >> 5,
                    flags,
                    headers: self.decompress(&payload[10..])?,
                }
            }
            2 => Frame::SynReply {
                stream: stream()?,
                fin,
                headers: self.decompress(payload.get(4..).unwrap_or_default())?,
            },
            3 => Frame::RstStream {
                stream: stream()?,
                status: word(payload, 4)?,
            },
            4 => {
                let n = word(payload, 0)? as usize;
                if payload.len() != 4 + n.saturating_mul(8) {
                    return Err(invalid("SETTINGS length does not match its entries"));
                }
                let entries = (0..n)
                    .map(|i| {
                        let at = 4 + i * 8;
                        Ok((
                            payload[at],
                            word(payload, at)? & 0xff_ffff,
                            word(payload, at + 4)?,
                        ))
                    })
                    .collect::<io::Result<_>>()?;
                Frame::Settings {
                    clear: flags & 1 != 0,
                    entries,
                }
            }
            6 => Frame::Ping {
                id: word(payload, 0)?,
            },
            7 => Frame::GoAway {
                last_good: stream()?,
                status: word(payload, 4).unwrap_or(0),
            },
            8 => Frame::Headers {
                stream: stream()?,
                fin,
                headers: self.decompress(payload.get(4..).unwrap_or_default())?,
            },
            9 => Frame::WindowUpdate {
                stream: stream()?,
                delta: word(payload, 4)? & 0x7fff_ffff,
            },
            kind => Frame::Unknown { kind },
        })
    }

    fn compress(&mut self, headers: &Headers) -> io::Result<Vec<u8>> {
        let mut block = (headers.len() as u32).to_be_bytes().to_vec();
        for (name, value) in headers {
            for s in [name, value] {
                block.extend_from_slice(&(s.len() as u32).to_be_bytes());
                block.extend_from_slice(s.as_bytes());
            }
        }
        let mut out = Vec::with_capacity(block.len() / 2 + 64);
        let start = self.deflate.total_in();
        loop {
            if out.capacity() - out.len() < 64 {
                out.reserve(out.capacity().max(256));
            }
            let done = (self.deflate.total_in() - start) as usize;
            self.deflate
                .compress_vec(&block[done..], &mut out, FlushCompress::Sync)
                .map_err(|e| invalid(format!("compress headers: {e}")))?;
            // A sync flush is complete when all input is taken and output space is left over.
            if (self.deflate.total_in() - start) as usize == block.len()
                && out.len() < out.capacity()
            {
                return Ok(out);
            }
        }
    }

    fn decompress(&mut self, input: &[u8]) -> io::Result<Headers> {
        let mut out = Vec::with_capacity(256);
        let start = self.inflate.total_in();
        loop {
            if out.capacity() - out.len() < 64 {
                if out.len() >= MAX_HEADER_BLOCK {
                    return Err(invalid("header block too large"));
                }
                out.reserve(out.capacity().max(256));
            }
            let done = (self.inflate.total_in() - start) as usize;
            let before = (self.inflate.total_in(), self.inflate.total_out());
            match self
                .inflate
                .decompress_vec(&input[done..], &mut out, FlushDecompress::Sync)
            {
                Ok(Status::StreamEnd) => return Err(invalid("header compression stream ended")),
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.inflate
                        .set_dictionary(DICTIONARY)
                        .map_err(|e| invalid(format!("header dictionary: {e}")))?;
                    continue;
                }
                Err(e) => return Err(invalid(format!("decompress headers: {e}"))),
            }
            let done = (self.inflate.total_in() - start) as usize;
            if done == input.len() && out.len() < out.capacity() {
                break;
            }
            if before == (self.inflate.total_in(), self.inflate.total_out())
                && out.len() < out.capacity()
            {
                return Err(invalid("header block does not decompress"));
            }
        }
        if out.len() > MAX_HEADER_BLOCK {
            return Err(invalid("header block too large"));
        }
        parse_block(&out)
    }
}

fn parse_block(b: &[u8]) -> io::Result<Headers> {
    let mut at = 0usize;
    let mut take = |n: usize| -> io::Result<&[u8]> {
        let s = b
            .get(
                at..at
                    .checked_add(n)
                    .ok_or_else(|| invalid("header block truncated"))?,
            )
            .ok_or_else(|| invalid("header block truncated"))?;
        at += n;
        Ok(s)
    };
    let len = |s: &[u8]| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize;
    let count = len(take(4)?);
    if count > b.len() / 8 {
        return Err(invalid("header block counts more pairs than it holds"));
    }
    let mut headers = Vec::with_capacity(count);
    for _ in 0..count {
        let mut pair = [String::new(), String::new()];
        for s in &mut pair {
            let n = len(take(4)?);
            *s =
                String::from_utf8(take(n)?.to_vec()).map_err(|_| invalid("header is not UTF-8"))?;
        }
        let [name, value] = pair;
        headers.push((name.to_ascii_lowercase(), value));
    }
    Ok(headers)
}

/// Reads one frame's head and payload; `None` at a clean end of stream (between frames).
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<([u8; 8], Vec<u8>)>> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        let n = r.read(&mut head[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
    // Refused before anything is allocated: a peer may not make us buffer 16 MiB frames.
    if len > MAX_READ {
        return Err(invalid(format!(
            "frame of {len} bytes is over the {MAX_READ} limit"
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Some((head, payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdrs(pairs: &[(&str, &str)]) -> Headers {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    fn round_trip(tx: &mut Codec, rx: &mut Codec, f: &Frame) -> Frame {
        let bytes = tx.encode(f).unwrap();
        let head: [u8; 8] = bytes[..8].try_into().unwrap();
        assert_eq!(
            u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize,
            bytes.len() - 8
        );
        rx.decode(head, &bytes[8..]).unwrap()
    }

    #[test]
    fn every_frame_round_trips_with_shared_compression_state() {
        let (mut tx, mut rx) = (Codec::new(), Codec::new());
        let frames = vec![
            Frame::SynStream {
                stream: 1,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: hdrs(&[("streamtype", "error"), ("port", "80")]),
            },
            Frame::SynStream {
                stream: 3,
                associated: 0,
                priority: 7,
                flags: FLAG_FIN | FLAG_UNIDIRECTIONAL,
                headers: hdrs(&[("streamtype", "stdout"), ("x", "a\0b")]),
            },
            Frame::SynReply {
                stream: 1,
                fin: false,
                headers: vec![],
            },
            Frame::Headers {
                stream: 5,
                fin: true,
                headers: hdrs(&[("a", "")]),
            },
            Frame::Data {
                stream: 3,
                fin: true,
                data: Bytes::from_static(b"hello"),
            },
            Frame::RstStream {
                stream: 3,
                status: CANCEL,
            },
            Frame::Settings {
                clear: true,
                entries: vec![(1, 7, 65536), (0, 4, 100)],
            },
            Frame::Ping { id: 0xdead_beef },
            Frame::GoAway {
                last_good: 9,
                status: 0,
            },
            Frame::WindowUpdate {
                stream: 1,
                delta: 4096,
            },
        ];
        for f in &frames {
            assert_eq!(&round_trip(&mut tx, &mut rx, f), f);
        }
        // The same headers again compress to fewer bytes: the context carries across frames.
        let f = &frames[0];
        let again = tx.encode(f).unwrap();
        assert!(again.len() < Codec::new().encode(f).unwrap().len());
        assert_eq!(header(&hdrs(&[("x", "a\0b")]), "X"), Some("a"));
    }

    /// A frame announcing more than `MAX_READ` bytes is refused before its payload is read.
    #[tokio::test]
    async fn oversized_frames_are_refused() {
        let data = Codec::new()
            .encode(&Frame::Data {
                stream: 1,
                fin: false,
                data: Bytes::from(vec![0u8; MAX_READ + 1]),
            })
            .unwrap();
        let err = read_frame(&mut &data[..]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let data = Codec::new()
            .encode(&Frame::Data {
                stream: 1,
                fin: false,
                data: Bytes::from(vec![0u8; MAX_READ]),
            })
            .unwrap();
        assert!(read_frame(&mut &data[..]).await.unwrap().is_some());
    }

    /// The dictionary and flush mode checked against another zlib, not only against ourselves.
    #[test]
    fn decodes_a_header_block_compressed_by_another_zlib() {
        // The zlib header must announce a preset dictionary whose Adler-32 is the SPDY/3 one.
        let bytes = Codec::new()
            .encode(&Frame::SynReply {
                stream: 1,
                fin: false,
                headers: vec![],
            })
            .unwrap();
        let zhead = &bytes[12..18];
        assert_eq!(zhead[1] & 0x20, 0x20, "FDICT set");
        assert_eq!(
            u32::from_be_bytes(zhead[2..6].try_into().unwrap()),
            0xe3c6_a7c2
        );
        // `streamtype: error`, compressed by CPython's zlib with the dictionary, sync-flushed.
        let block = hex("78bbe3c6a7c202a62346703a2b294a4dcc851625aca9a08006000000ffff");
        let mut payload = 1u32.to_be_bytes().to_vec();
        payload.extend(block);
        let head = [0x80, 3, 0, 2, 0, 0, 0, payload.len() as u8];
        assert_eq!(
            Codec::new().decode(head, &payload).unwrap(),
            Frame::SynReply {
                stream: 1,
                fin: false,
                headers: hdrs(&[("streamtype", "error")])
            }
        );
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut rx = Codec::new();
        let mut head = [0x80, 3, 0, 1, 0, 0, 0, 12];
        assert!(rx
            .decode(head, &[0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 2])
            .is_err());
        head[1] = 2;
        assert!(Codec::new().decode(head, &[]).is_err());
        assert!(parse_block(&[0, 0, 0, 2, 0, 0, 0, 9]).is_err());
        assert!(parse_block(&[0xff, 0xff, 0xff, 0xff]).is_err());
    }
}
