//! Unpacks one image layer (a tar stream, gzip/zstd/plain) into its own overlayfs-ready
//! directory.
//!
//! Each layer gets a directory of its own, which later becomes one `lowerdir` of a container's
//! overlay mount. Tar whiteouts become overlay whiteouts (`.wh.x` → a 0:0 character device `x`;
//! `.wh..wh..opq` → `trusted.overlay.opaque=y` on the directory).
//!
//! Paths are resolved in the *merged* view of this layer over the layers below it, the way the
//! kernel will see them once mounted: a symlink in a lower layer (`/lib -> usr/lib`) is followed,
//! so `lib/x` lands in `usr/lib/x` of this layer. Resolution never leaves the layer's root:
//! symlink targets are interpreted inside it (chroot semantics), `..` stops at the root, and an
//! entry whose own name climbs out with `..` is rejected.
//!
//! The kernel never resolves a path taken from a layer: every lookup, in this layer or in a
//! lower one, walks one component at a time from an open directory with `O_NOFOLLOW` (the `at`
//! module), so a lower layer's `a -> /etc` is data to interpret, never a way onto the host. A
//! lookup in one layer follows no symlink at all; only the merged-view resolution above does,
//! inside the root.
//!
//! A layer is bounded while it streams: its uncompressed size and the bytes it writes
//! (`image.max_layer_unpacked_bytes`), the files, directories and links it creates
//! (`image.max_layer_entries`), and the header bytes of one entry (pax records, long names),
//! which the tar reader holds in memory.

mod at;

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::rc::Rc;

use nix::sys::stat::{FileStat, SFlag};
use sha2::{Digest, Sha256};
use xattr::FileExt;

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const MAX_SYMLINK_HOPS: usize = 40;
/// Longest entry name or link target: what any path-based tool (and the kernel, PATH_MAX) can
/// use. It also bounds how deep one entry can nest directories.
const MAX_NAME_BYTES: usize = 4096;
/// Header bytes of one entry (pax records, GNU long names, sparse maps), which the tar reader
/// holds in memory whole. Go's archive/tar, which builds and reads most images, refuses more
/// than 1 MiB per such record; three of them fit here.
pub const MAX_ENTRY_HEADER_BYTES: u64 = 4 << 20;

/// Bounds on one layer's unpack; 0 means no bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Uncompressed bytes: of the tar stream, and of file content written (sparse files and
    /// hard-link copy-ups can write more than the stream holds).
    pub max_bytes: u64,
    /// Names created: files, directories, links, device nodes, whiteouts, including parent
    /// directories the tar leaves implied.
    pub max_entries: u64,
}

impl Limits {
    pub const UNLIMITED: Limits = Limits {
        max_bytes: 0,
        max_entries: 0,
    };
}

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("layer entry {entry:?}: {reason}")]
    Entry { entry: String, reason: String },
    #[error("layer entry {entry:?}: {op} {path}")]
    EntryIo {
        entry: String,
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading layer")]
    Read(#[source] io::Error),
    /// A filesystem operation on the layer directories themselves, not on an entry.
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The layers below, needed to place an entry, never came to be.
    #[error("layer entry {entry:?}: the layer below: {reason}")]
    Below { entry: String, reason: String },
    #[error("layer content digest is {actual}, the image config says {expected}")]
    DiffIdMismatch { expected: String, actual: String },
    #[error("layer unpacks to more than image.max_layer_unpacked_bytes = {limit} bytes{}", at_entry(.entry))]
    TooLarge { limit: u64, entry: Option<String> },
    #[error("layer creates more than image.max_layer_entries = {limit} files, directories and links{}", at_entry(.entry))]
    TooManyEntries { limit: u64, entry: Option<String> },
    #[error("layer entry headers (pax records, long names) exceed {limit} bytes{}", after_entry(.after))]
    HeaderTooLarge { limit: u64, after: Option<String> },
}

fn at_entry(entry: &Option<String>) -> String {
    entry
        .as_ref()
        .map(|e| format!(" (at entry {e:?})"))
        .unwrap_or_default()
}

fn after_entry(entry: &Option<String>) -> String {
    entry
        .as_ref()
        .map(|e| format!(" (after entry {e:?})"))
        .unwrap_or_else(|| " (at the first entry)".into())
}

/// What an unpacked layer is: its uncompressed digest, and what it occupies on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct Unpacked {
    pub diff_id: String,
    pub usage_bytes: u64,
    pub usage_inodes: u64,
}

/// Unpacks `compressed` (gzip, zstd or plain tar, told apart by their magic bytes) into `dest`,
/// an empty directory. `lowers` are the unpacked layers below, topmost first. The uncompressed
/// stream must hash to `expected_diff_id`. On error `dest` holds a partial layer: the caller
/// removes it.
///
/// Decompression and the diff-id hash run on threads of their own, a few chunks ahead of the
/// thread that writes the files: the parts of an unpack cost about the same, so a layer takes
/// about half the time on a machine with a core to spare.
pub fn unpack_layer(
    compressed: impl Read + Send,
    dest: &Path,
    lowers: &[PathBuf],
    expected_diff_id: &str,
    limits: Limits,
) -> Result<Unpacked, UnpackError> {
    unpack_layer_over(
        compressed,
        dest,
        lowers,
        &|| Ok(()),
        expected_diff_id,
        limits,
    )
}

/// [`unpack_layer`] on layers below that may still be unpacking: `lowers_ready` blocks until
/// they are all complete and in place (or says why they never will be), and is called once,
/// the first time an entry needs to look at them. Entries of well-formed layers rarely do (a
/// file whose parent directory has no entry of its own in this layer, a hard link to a lower
/// file, a directory that covers a lower one without its own entry), so most of a layer
/// unpacks while the layers below it still do.
pub fn unpack_layer_over(
    compressed: impl Read + Send,
    dest: &Path,
    lowers: &[PathBuf],
    lowers_ready: &dyn Fn() -> Result<(), String>,
    expected_diff_id: &str,
    limits: Limits,
) -> Result<Unpacked, UnpackError> {
    let mut input = io::BufReader::with_capacity(256 * 1024, compressed);
    let magic = peek(&mut input, 4).map_err(UnpackError::Read)?;
    let decoded: Box<dyn Read + Send + '_> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(input))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        // Every frame to the end of the blob, as the zstd tool decodes: a layer may be written
        // as several frames, and bytes after the last one are not a frame and fail the read.
        let mut d = zstd::stream::read::Decoder::with_buffer(input).map_err(UnpackError::Read)?;
        // A frame names the history its decoder must keep, up to 2 GiB: bounded here, before
        // anything is allocated, to what `zstd --long` writes (libzstd's own default, made
        // explicit so that it stays a decision).
        d.window_log_max(ZSTD_WINDOW_LOG_MAX)
            .map_err(UnpackError::Read)?;
        Box::new(d)
    } else {
        Box::new(input)
    };
    let (decoded_tx, decoded_rx) = std::sync::mpsc::sync_channel(CHUNKS_AHEAD / 2);
    let (tx, rx) = std::sync::mpsc::sync_channel(CHUNKS_AHEAD / 2);
    let (back_tx, back_rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let spawn_failed = |what: &'static str| {
            move |source| UnpackError::Io {
                op: what,
                path: dest.into(),
                source,
            }
        };
        let hasher = std::thread::Builder::new()
            .name("layer-hash".into())
            .spawn_scoped(s, move || hash(decoded_rx, tx))
            .map_err(spawn_failed("start the hashing thread for"))?;
        let decoder = std::thread::Builder::new()
            .name("layer-decode".into())
            .spawn_scoped(s, move || decode(decoded, decoded_tx, back_rx))
            .map_err(spawn_failed("start the decompression thread for"))?;
        let chunks = Chunks {
            rx,
            back: back_tx,
            cur: Vec::new(),
            pos: 0,
        };
        // `chunks` is dropped when this returns, error or not: the hasher then sees its channel
        // closed and stops, and so the decoder after it.
        let written = write_layer(chunks, dest, lowers, lowers_ready, limits);
        let digest = hasher.join();
        let ended = decoder.join();
        written?;
        let diff_id = match (ended, digest) {
            (Ok(true), Ok(Some(d))) => d,
            (Err(_), _) | (_, Err(_)) => {
                return Err(UnpackError::Read(io::Error::other(
                    "decompression or hashing thread panicked",
                )))
            }
            // The writer read to the end, so both finished; they cannot have stopped early.
            _ => {
                return Err(UnpackError::Read(io::Error::other(
                    "decompression stopped before the end of the layer",
                )))
            }
        };
        if diff_id != expected_diff_id {
            return Err(UnpackError::DiffIdMismatch {
                expected: expected_diff_id.into(),
                actual: diff_id,
            });
        }
        let (usage_bytes, usage_inodes) = disk_usage(dest).map_err(|source| UnpackError::Io {
            op: "measure",
            path: dest.into(),
            source,
        })?;
        Ok(Unpacked {
            diff_id,
            usage_bytes,
            usage_inodes,
        })
    })
}

/// The largest zstd window a layer may ask for: 2^27 bytes = 128 MiB per layer being unpacked.
pub const ZSTD_WINDOW_LOG_MAX: u32 = 27;

/// Decoded bytes the decompression and hashing threads may hold ahead of the writer:
/// `CHUNKS_AHEAD` chunks of `CHUNK` bytes in their two channels, one being filled, one being
/// hashed, one being read.
const CHUNK: usize = 256 * 1024;
const CHUNKS_AHEAD: usize = 8;

/// The decompression thread: reads `decoded` to its end in chunks and sends them on to the
/// hashing thread, reusing the chunks the writer sends back. Each chunk is what one read gave,
/// so bytes go on as soon as they are decoded (a layer may still be downloading). True once it
/// sent the whole stream; false when the chunks' readers are gone or after sending a read
/// error.
fn decode(
    mut decoded: impl Read,
    tx: std::sync::mpsc::SyncSender<io::Result<Vec<u8>>>,
    back: std::sync::mpsc::Receiver<Vec<u8>>,
) -> bool {
    loop {
        let mut buf = back.try_recv().unwrap_or_default();
        buf.resize(CHUNK, 0);
        match decoded.read(&mut buf) {
            Ok(0) => return true,
            Ok(n) => {
                buf.truncate(n);
                if tx.send(Ok(buf)).is_err() {
                    return false;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.send(Err(e));
                return false;
            }
        }
    }
}

/// The hashing thread, between the decoder and the writer, so that the diff-id hash and the
/// decompression each have a core (on zstd layers the decoder's thread was the slower half of
/// the unpack, a fifth of it the hash). The digest of everything passed on once the decoder's
/// channel closes (whether it sent the whole stream is the decoder's answer); None when the
/// writer stopped reading or after passing on a read error.
fn hash(
    rx: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    tx: std::sync::mpsc::SyncSender<io::Result<Vec<u8>>>,
) -> Option<String> {
    let mut hasher = Sha256::new();
    for chunk in rx {
        match chunk {
            Ok(buf) => {
                hasher.update(&buf);
                if tx.send(Ok(buf)).is_err() {
                    return None;
                }
            }
            Err(e) => {
                let _ = tx.send(Err(e));
                return None;
            }
        }
    }
    Some(format!("sha256:{:x}", hasher.finalize()))
}

/// The writer's side of the decompression thread: its chunks as one stream. The end of the
/// stream is the decoder closing the channel.
struct Chunks {
    rx: std::sync::mpsc::Receiver<io::Result<Vec<u8>>>,
    back: std::sync::mpsc::Sender<Vec<u8>>,
    cur: Vec<u8>,
    pos: usize,
}

impl Read for Chunks {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.cur.len() {
            match self.rx.recv() {
                Ok(Ok(next)) => {
                    let used = std::mem::replace(&mut self.cur, next);
                    self.pos = 0;
                    // The decoder may be gone already; the chunk is then just freed.
                    let _ = self.back.send(used);
                }
                Ok(Err(e)) => return Err(e),
                Err(_) => return Ok(0),
            }
        }
        let n = buf.len().min(self.cur.len() - self.pos);
        buf[..n].copy_from_slice(&self.cur[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Unpacks the uncompressed tar stream `decoded` into `dest` (see [`unpack_layer`]), bounded
/// by `limits`, and reads it to its end (the end-of-archive blocks and any padding are part
/// of the digested stream).
fn write_layer(
    decoded: impl Read,
    dest: &Path,
    lowers: &[PathBuf],
    lowers_ready: &dyn Fn() -> Result<(), String>,
    limits: Limits,
) -> Result<(), UnpackError> {
    let budget = Rc::new(StreamBudget::new(limits.max_bytes));
    let mut stream = Stream {
        inner: decoded,
        budget: budget.clone(),
    };
    let mut unpacker = Unpacker::new(dest, lowers, lowers_ready, limits)?;
    {
        let mut archive = tar::Archive::new(&mut stream);
        let mut entries = archive
            .entries()
            .map_err(|e| budget.explain(UnpackError::Read(e), None))?;
        let mut last: Option<String> = None;
        loop {
            // What the tar reader consumes here is one entry's headers, held in memory whole.
            budget.headers_begin();
            let next = entries.next();
            budget.headers_end();
            let Some(entry) = next else { break };
            let mut entry =
                entry.map_err(|e| budget.explain(UnpackError::Read(e), last.clone()))?;
            let r = unpacker.entry(&mut entry).and_then(|()| {
                // Skip what the entry did not consume now, so the next headers start clean.
                io::copy(&mut entry, &mut io::sink())
                    .map(drop)
                    .map_err(UnpackError::Read)
            });
            last = Some(unpacker.current.clone());
            r.map_err(|e| budget.explain(e, last.clone()))?;
        }
    }
    io::copy(&mut stream, &mut io::sink())
        .map_err(|e| budget.explain(UnpackError::Read(e), None))?;
    unpacker.finish()
}

fn peek(r: &mut impl io::BufRead, n: usize) -> io::Result<Vec<u8>> {
    // A read interrupted by a signal is retried, as the decompression thread retries it.
    loop {
        match r.fill_buf() {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let buf = r.fill_buf()?;
    Ok(buf[..buf.len().min(n)].to_vec())
}

/// The uncompressed stream, counted against the byte bound and, while the tar reader parses
/// an entry's headers, against the header bound (the decompression thread hashes it).
struct Stream<R> {
    inner: R,
    budget: Rc<StreamBudget>,
}

impl<R: Read> Read for Stream<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.budget.consume(n as u64)?;
        Ok(n)
    }
}

#[derive(Debug, Clone, Copy)]
enum Exceeded {
    Bytes,
    Headers,
}

/// Shared between the stream (which counts) and the unpack loop (which marks header parsing
/// and turns the reader's error into the bound that was hit).
struct StreamBudget {
    max_bytes: u64,
    read: Cell<u64>,
    headers_from: Cell<Option<u64>>,
    exceeded: Cell<Option<Exceeded>>,
}

impl StreamBudget {
    fn new(max_bytes: u64) -> StreamBudget {
        StreamBudget {
            max_bytes,
            read: Cell::new(0),
            headers_from: Cell::new(None),
            exceeded: Cell::new(None),
        }
    }

    fn consume(&self, n: u64) -> io::Result<()> {
        let read = self.read.get().saturating_add(n);
        self.read.set(read);
        let hit = if self.max_bytes > 0 && read > self.max_bytes {
            Some(Exceeded::Bytes)
        } else if matches!(self.headers_from.get(), Some(from) if read - from > MAX_ENTRY_HEADER_BYTES)
        {
            Some(Exceeded::Headers)
        } else {
            None
        };
        match hit {
            Some(hit) => {
                self.exceeded.set(Some(hit));
                Err(io::Error::other("layer bound exceeded"))
            }
            None => Ok(()),
        }
    }

    fn headers_begin(&self) {
        self.headers_from.set(Some(self.read.get()));
    }

    fn headers_end(&self) {
        self.headers_from.set(None);
    }

    /// `err`, or the bound that caused it (the reader's error may reach us wrapped).
    fn explain(&self, err: UnpackError, entry: Option<String>) -> UnpackError {
        match self.exceeded.get() {
            Some(Exceeded::Bytes) => UnpackError::TooLarge {
                limit: self.max_bytes,
                entry,
            },
            Some(Exceeded::Headers) => UnpackError::HeaderTooLarge {
                limit: MAX_ENTRY_HEADER_BYTES,
                after: entry,
            },
            None => err,
        }
    }
}

/// Allocated bytes and inodes under `root`, each inode counted once (hard links). Walks with
/// descriptors and never follows a symlink, so a tree deeper than PATH_MAX is measured and one
/// a container rewrites while we walk (its upper directory) cannot lead the walk elsewhere.
pub fn disk_usage(root: &Path) -> io::Result<(u64, u64)> {
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0u64;
    let mut count = |st: &FileStat| {
        if seen.insert((st.st_dev, st.st_ino)) {
            bytes += st.st_blocks as u64 * 512;
        }
    };
    let top = at::open_root(root)?;
    count(&at::fstat(&top)?);
    let listing = at::read_dir(&top)?;
    // One open directory (and its listing) per level of the current path.
    let mut stack = vec![(top, listing)];
    while let Some((dir, listing)) = stack.last_mut() {
        let Some(e) = listing.next() else {
            stack.pop();
            continue;
        };
        let name = e?.file_name();
        let Some(st) = at::stat(dir, &name)? else {
            continue; // removed meanwhile
        };
        count(&st);
        if at::is_type(&st, SFlag::S_IFDIR) {
            let child = at::open_dir(dir, &name)?;
            let listing = at::read_dir(&child)?;
            stack.push((child, listing));
        }
    }
    Ok((bytes, seen.len() as u64))
}

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Missing,
    Dir,
    Symlink(PathBuf),
    Other,
}

impl Kind {
    fn of(st: &FileStat, link: impl FnOnce() -> io::Result<PathBuf>) -> io::Result<Kind> {
        Ok(if at::is_type(st, SFlag::S_IFDIR) {
            Kind::Dir
        } else if at::is_type(st, SFlag::S_IFLNK) {
            Kind::Symlink(link()?)
        } else {
            Kind::Other
        })
    }
}

/// A real directory of the layer being written, open, with its path from the layer root.
struct Dir {
    fd: File,
    rel: PathBuf,
    /// This directory or one above it in this layer is opaque: nothing below shows through.
    opaque: bool,
}

/// Something a lower layer has at a path: the directory holding it, open, and its `lstat`.
struct Found {
    parent: File,
    name: OsString,
    st: FileStat,
    kind: Kind,
}

enum LayerHit {
    /// The layer has something at the path.
    Found(Found),
    /// The layer hides the path from the layers below (whiteout, opaque or non-directory ancestor).
    Hidden,
    /// The layer says nothing about the path.
    Absent,
}

struct Unpacker<'a> {
    dest: &'a Path,
    root: File,
    /// The layers below, opened the first time an entry needs them (see `open_lowers`).
    lowers: Vec<(File, &'a Path)>,
    lower_paths: &'a [PathBuf],
    lowers_ready: Option<&'a dyn Fn() -> Result<(), String>>,
    /// Directory mtimes to set once everything inside is written.
    dir_times: Vec<(PathBuf, filetime::FileTime)>,
    /// Memo of lookups in the lower layers (they never change while we unpack).
    lower_memo: HashMap<PathBuf, Kind>,
    limits: Limits,
    /// File content written so far (the stream is counted apart).
    written: u64,
    /// Names created so far.
    created: u64,
    /// The entry being unpacked, for errors raised outside it.
    current: String,
    /// The parent directory the last entry resolved, by its components in the entry's name,
    /// while only plain files and directories were unpacked since (see `parent_dir`).
    last_dir: Option<(Vec<OsString>, Dir)>,
    /// The buffer file contents are copied through, one for the layer.
    buf: Vec<u8>,
}

/// The metadata of one entry, from the header and its PAX records.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: filetime::FileTime,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

impl<'a> Unpacker<'a> {
    fn new(
        dest: &'a Path,
        lowers: &'a [PathBuf],
        lowers_ready: &'a dyn Fn() -> Result<(), String>,
        limits: Limits,
    ) -> Result<Self, UnpackError> {
        Ok(Unpacker {
            dest,
            root: open_layer_dir(dest)?,
            lowers: Vec::new(),
            lower_paths: lowers,
            lowers_ready: Some(lowers_ready),
            dir_times: Vec::new(),
            lower_memo: HashMap::new(),
            limits,
            written: 0,
            created: 0,
            current: String::new(),
            last_dir: None,
            buf: Vec::new(),
        })
    }

    /// `resolve_dir(comps)`, reusing the directory the previous entry resolved when its name
    /// had the same parent components. Only plain files and directories come here, and the
    /// cache is dropped on any other entry: such entries only add or replace names *inside*
    /// that directory, so nothing between two of them can change where its path leads (an
    /// entry replacing one of its ancestors has a different parent, which resolves afresh).
    /// Tars list a directory's files together: this saves walking the path for each.
    fn parent_dir(&mut self, comps: &[OsString], entry: &str) -> Result<Dir, UnpackError> {
        let copy = |d: &Dir| -> Result<Dir, UnpackError> {
            Ok(Dir {
                fd: d.fd.try_clone().map_err(|source| UnpackError::EntryIo {
                    entry: entry.into(),
                    op: "open",
                    path: self.dest.join(&d.rel),
                    source,
                })?,
                rel: d.rel.clone(),
                opaque: d.opaque,
            })
        };
        if let Some((key, d)) = &self.last_dir {
            if key.as_slice() == comps {
                return copy(d);
            }
        }
        let d = self.resolve_dir(comps, entry)?;
        self.last_dir = Some((comps.to_vec(), copy(&d)?));
        Ok(d)
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let raw = entry.path().map_err(UnpackError::Read)?.into_owned();
        let name = raw.to_string_lossy().into_owned();
        self.current = name.clone();
        let err = |reason: String| UnpackError::Entry {
            entry: name.clone(),
            reason,
        };
        let comps = clean_components(&raw).map_err(err)?;
        let Some((base, parent)) = comps.split_last() else {
            return Ok(()); // "./" or "/": the root itself; its metadata is ours to choose.
        };
        let meta = self.meta(entry).map_err(UnpackError::Read)?;
        let kind = entry.header().entry_type();
        use tar::EntryType as T;
        let plain = matches!(
            kind,
            T::Regular | T::Continuous | T::GNUSparse | T::Directory
        ) && !base.as_bytes().starts_with(WHITEOUT_PREFIX.as_bytes());
        if !plain {
            self.last_dir = None;
        }

        if base == OPAQUE_MARKER {
            let dir = self.resolve_dir(parent, &name)?;
            return self.make_opaque(&dir.fd, &self.shown(&dir, None), &name);
        }
        if let Some(hidden) = base.as_bytes().strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            let hidden = OsStr::from_bytes(hidden);
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(err(format!("invalid whiteout name {base:?}")));
            }
            let dir = self.resolve_dir(parent, &name)?;
            self.clear(&dir, hidden, &name)?;
            self.count(&name)?;
            return at::mknod(&dir.fd, hidden, SFlag::S_IFCHR, 0).map_err(io_at(
                &name,
                "create whiteout",
                &self.shown(&dir, Some(hidden)),
            ));
        }

        let dir = if plain {
            self.parent_dir(parent, &name)?
        } else {
            self.resolve_dir(parent, &name)?
        };
        let here = self.shown(&dir, Some(base));
        match kind {
            T::Directory => {
                let existing = self.stat(&dir, base, &name)?;
                let fd = if existing.is_some_and(|st| at::is_type(&st, SFlag::S_IFDIR)) {
                    at::open_dir(&dir.fd, base).map_err(io_at(&name, "open directory", &here))?
                } else {
                    let over_whiteout = self.clear(&dir, base, &name)?;
                    self.count(&name)?;
                    at::mkdir(&dir.fd, base).map_err(io_at(&name, "create directory", &here))?;
                    let fd = at::open_dir(&dir.fd, base).map_err(io_at(
                        &name,
                        "open directory",
                        &here,
                    ))?;
                    if over_whiteout {
                        self.make_opaque(&fd, &here, &name)?;
                    }
                    fd
                };
                self.apply_meta_fd(&fd, &meta, &name, &here)?;
                self.dir_times.push((dir.rel.join(base), meta.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                self.clear(&dir, base, &name)?;
                self.count(&name)?;
                let mut f =
                    at::create(&dir.fd, base).map_err(io_at(&name, "create file", &here))?;
                self.copy_data(entry, &mut f, &name, &here)?;
                self.apply_meta_fd(&f, &meta, &name, &here)?;
                at::set_fd_times(&f, meta.mtime).map_err(io_at(&name, "set times of", &here))?;
            }
            T::Symlink => {
                let link = entry
                    .link_name()
                    .map_err(UnpackError::Read)?
                    .ok_or_else(|| err("symlink without a target".into()))?
                    .into_owned();
                self.clear(&dir, base, &name)?;
                self.count(&name)?;
                at::symlink(&link, &dir.fd, base).map_err(io_at(&name, "create symlink", &here))?;
                self.apply_meta_at(&dir, base, &meta, true, &name)?;
            }
            T::Link => self.hard_link(entry, &dir, base, &name)?,
            T::Char | T::Block | T::Fifo => {
                let (flag, dev) = match kind {
                    T::Char | T::Block => {
                        let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                        let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                        let flag = if kind == T::Char {
                            SFlag::S_IFCHR
                        } else {
                            SFlag::S_IFBLK
                        };
                        (flag, nix::sys::stat::makedev(major.into(), minor.into()))
                    }
                    _ => (SFlag::S_IFIFO, 0),
                };
                self.clear(&dir, base, &name)?;
                self.count(&name)?;
                at::mknod(&dir.fd, base, flag, dev).map_err(io_at(
                    &name,
                    "create device node",
                    &here,
                ))?;
                self.apply_meta_at(&dir, base, &meta, false, &name)?;
            }
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => {}
            other => {
                tracing::warn!(entry = %name, kind = ?other, "skipping layer entry of unsupported type");
            }
        }
        Ok(())
    }

    /// A hard link `dir/base` to the entry's link target, resolved in the merged view; a
    /// target only a lower layer has is copied up first, as overlayfs would.
    fn hard_link<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        dir: &Dir,
        base: &OsStr,
        name: &str,
    ) -> Result<(), UnpackError> {
        let err = |reason: String| UnpackError::Entry {
            entry: name.into(),
            reason,
        };
        let link = entry
            .link_name()
            .map_err(UnpackError::Read)?
            .ok_or_else(|| err("hard link without a target".into()))?
            .into_owned();
        let lcomps = clean_components(&link).map_err(|r| err(format!("hard link target: {r}")))?;
        let Some((lbase, lparent)) = lcomps.split_last() else {
            return Err(err("hard link to the root directory".into()));
        };
        let ldir = self.resolve_dir(lparent, name)?;
        match self.stat(&ldir, lbase, name)? {
            Some(st) if at::is_type(&st, SFlag::S_IFDIR) => {
                return Err(err(format!("hard link to directory {link:?}")))
            }
            Some(st) if is_whiteout(&st) => {
                return Err(err(format!("hard link target {link:?} does not exist")))
            }
            Some(_) => {}
            None => {
                let rel = ldir.rel.join(lbase);
                let found = if ldir.opaque {
                    None
                } else {
                    self.find_in_lowers(&rel, name)?
                };
                let Some(found) = found else {
                    return Err(err(format!("hard link target {link:?} does not exist")));
                };
                if found.kind == Kind::Dir {
                    return Err(err(format!("hard link to directory {link:?}")));
                }
                self.copy_up(&found, &ldir, lbase, name)?;
            }
        }
        if ldir.rel.join(lbase) == dir.rel.join(base) {
            return Ok(());
        }
        self.clear(dir, base, name)?;
        self.count(name)?;
        at::link(&ldir.fd, lbase, &dir.fd, base).map_err(io_at(
            name,
            "create hard link",
            &self.shown(dir, Some(base)),
        ))
    }

    fn meta<R: Read>(&self, entry: &mut tar::Entry<'_, R>) -> io::Result<Meta> {
        let h = entry.header();
        let mut meta = Meta {
            mode: h.mode()? & 0o7777,
            uid: h.uid()? as u32,
            gid: h.gid()? as u32,
            mtime: filetime::FileTime::from_unix_time(h.mtime()? as i64, 0),
            xattrs: Vec::new(),
        };
        if let Some(pax) = entry.pax_extensions()? {
            for ext in pax {
                let ext = ext?;
                let Ok(key) = ext.key() else { continue };
                let value = ext.value_bytes();
                // Pax `uid` and `gid` records need nothing here: the tar reader writes them
                // into the header it hands out (pax_records_give_the_owner_and_the_mtime).
                if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                    meta.xattrs.push((name.into(), value.to_vec()));
                } else if key == "mtime" {
                    if let Some(t) = std::str::from_utf8(value).ok().and_then(parse_pax_time) {
                        meta.mtime = t;
                    }
                }
            }
        }
        Ok(meta)
    }

    /// Owner, then mode (chown clears setuid bits, so the order matters), then xattrs, on a
    /// file or directory we hold open.
    fn apply_meta_fd(
        &self,
        f: &File,
        meta: &Meta,
        entry: &str,
        shown: &Path,
    ) -> Result<(), UnpackError> {
        let ioe = |op: &'static str| {
            move |source: io::Error| UnpackError::EntryIo {
                entry: entry.into(),
                op,
                path: shown.to_path_buf(),
                source,
            }
        };
        std::os::unix::fs::fchown(f, Some(meta.uid), Some(meta.gid))
            .map_err(ioe("change owner of"))?;
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(meta.mode))
            .map_err(ioe("change mode of"))?;
        for (name, value) in &meta.xattrs {
            if !wanted_xattr(name, entry) {
                continue;
            }
            tolerate_unsupported(f.set_xattr(name, value), name, entry)
                .map_err(ioe("set xattr on"))?;
        }
        Ok(())
    }

    /// As `apply_meta_fd`, plus times, for what cannot be opened: symlinks and device nodes.
    fn apply_meta_at(
        &self,
        dir: &Dir,
        base: &OsStr,
        meta: &Meta,
        symlink: bool,
        entry: &str,
    ) -> Result<(), UnpackError> {
        let here = self.shown(dir, Some(base));
        at::chown(&dir.fd, base, meta.uid, meta.gid).map_err(io_at(
            entry,
            "change owner of",
            &here,
        ))?;
        if !symlink {
            at::chmod(&dir.fd, base, meta.mode).map_err(io_at(entry, "change mode of", &here))?;
        }
        for (name, value) in &meta.xattrs {
            if !wanted_xattr(name, entry) {
                continue;
            }
            tolerate_unsupported(at::set_xattr(&dir.fd, base, name, value), name, entry)
                .map_err(io_at(entry, "set xattr on", &here))?;
        }
        at::set_times(&dir.fd, base, meta.mtime).map_err(io_at(entry, "set times of", &here))
    }

    /// Copies `from` into `to`, counting the bytes against the layer's bound.
    fn copy_data(
        &mut self,
        from: &mut impl Read,
        to: &mut File,
        entry: &str,
        shown: &Path,
    ) -> Result<(), UnpackError> {
        if self.buf.is_empty() {
            self.buf = vec![0u8; 128 * 1024];
        }
        let mut buf = std::mem::take(&mut self.buf);
        let r = self.copy_through(&mut buf, from, to, entry, shown);
        self.buf = buf;
        r
    }

    fn copy_through(
        &mut self,
        buf: &mut [u8],
        from: &mut impl Read,
        to: &mut File,
        entry: &str,
        shown: &Path,
    ) -> Result<(), UnpackError> {
        let ioe = |op: &'static str| {
            move |source: io::Error| UnpackError::EntryIo {
                entry: entry.into(),
                op,
                path: shown.to_path_buf(),
                source,
            }
        };
        loop {
            let n = from.read(buf).map_err(ioe("read content for"))?;
            if n == 0 {
                return Ok(());
            }
            self.written = self.written.saturating_add(n as u64);
            if self.limits.max_bytes > 0 && self.written > self.limits.max_bytes {
                return Err(UnpackError::TooLarge {
                    limit: self.limits.max_bytes,
                    entry: Some(entry.into()),
                });
            }
            to.write_all(&buf[..n]).map_err(ioe("write file"))?;
        }
    }

    /// Counts one created name against the layer's bound.
    fn count(&mut self, entry: &str) -> Result<(), UnpackError> {
        self.created += 1;
        if self.limits.max_entries > 0 && self.created > self.limits.max_entries {
            return Err(UnpackError::TooManyEntries {
                limit: self.limits.max_entries,
                entry: Some(entry.into()),
            });
        }
        Ok(())
    }

    /// Where `dir/name` is, for messages only (nothing is opened by this path).
    fn shown(&self, dir: &Dir, name: Option<&OsStr>) -> PathBuf {
        let p = self.dest.join(&dir.rel);
        match name {
            Some(n) => p.join(n),
            None => p,
        }
    }

    fn io_err<'e>(
        &self,
        entry: &'e str,
        op: &'static str,
        dir: &Dir,
        name: &OsStr,
    ) -> impl FnOnce(io::Error) -> UnpackError + 'e {
        io_at(entry, op, &self.shown(dir, Some(name)))
    }

    fn stat(&self, dir: &Dir, name: &OsStr, entry: &str) -> Result<Option<FileStat>, UnpackError> {
        at::stat(&dir.fd, name).map_err(self.io_err(entry, "look up", dir, name))
    }

    /// Removes what stands at `dir/name` in this layer so an entry can take its place. Returns
    /// true when that was a whiteout: a directory created in its place must then be opaque, or
    /// the deleted lower directory's content would show through again.
    fn clear(&self, dir: &Dir, name: &OsStr, entry: &str) -> Result<bool, UnpackError> {
        let Some(st) = self.stat(dir, name, entry)? else {
            return Ok(false);
        };
        at::remove(&dir.fd, name, at::is_type(&st, SFlag::S_IFDIR))
            .map_err(self.io_err(entry, "replace", dir, name))?;
        Ok(is_whiteout(&st))
    }

    fn make_opaque(&self, dir: &File, shown: &Path, entry: &str) -> Result<(), UnpackError> {
        dir.set_xattr(OPAQUE_XATTR, b"y")
            .map_err(|source| UnpackError::EntryIo {
                entry: entry.into(),
                op: "set opaque xattr on",
                path: shown.to_path_buf(),
                source,
            })
    }

    fn root_dir(&self, entry: &str) -> Result<Dir, UnpackError> {
        let fd = self
            .root
            .try_clone()
            .map_err(|source| UnpackError::EntryIo {
                entry: entry.into(),
                op: "open",
                path: self.dest.to_path_buf(),
                source,
            })?;
        Ok(Dir {
            fd,
            rel: PathBuf::new(),
            opaque: false,
        })
    }

    /// Resolves directory components to a real directory of this layer, following symlinks of
    /// the merged view inside the root and creating missing directories (copying owner, mode
    /// and xattrs from a lower layer's directory when there is one, as overlayfs copy-up
    /// would).
    fn resolve_dir(&mut self, comps: &[OsString], entry: &str) -> Result<Dir, UnpackError> {
        let mut queue: VecDeque<OsString> = comps.iter().cloned().collect();
        let mut cur = self.root_dir(entry)?;
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c == ".." {
                let mut up = cur.rel.clone();
                if up.pop() {
                    cur = self.reopen(&up, entry)?;
                }
                continue;
            }
            if c == "." || c.is_empty() {
                continue;
            }
            match self.lookup(&cur, &c, entry)? {
                Kind::Dir | Kind::Missing => {
                    cur = self.ensure_dir(&cur, &c, entry)?;
                    // Symlinks can nest a path deeper than its name: keep it usable.
                    if cur.rel.as_os_str().len() > MAX_NAME_BYTES {
                        return Err(UnpackError::Entry {
                            entry: entry.into(),
                            reason: format!(
                                "resolves to a path longer than {MAX_NAME_BYTES} bytes"
                            ),
                        });
                    }
                }
                Kind::Symlink(target) => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(UnpackError::Entry {
                            entry: entry.into(),
                            reason: format!(
                                "too many levels of symbolic links at {}",
                                cur.rel.join(&c).display()
                            ),
                        });
                    }
                    if target.is_absolute() {
                        cur = self.root_dir(entry)?;
                    }
                    for t in target.components().rev() {
                        match t {
                            Component::Normal(n) => queue.push_front(n.to_os_string()),
                            Component::ParentDir => queue.push_front("..".into()),
                            _ => {}
                        }
                    }
                }
                Kind::Other => {
                    return Err(UnpackError::Entry {
                        entry: entry.into(),
                        reason: format!("{} is not a directory", cur.rel.join(&c).display()),
                    })
                }
            }
        }
        Ok(cur)
    }

    /// Opens `rel`, a path of real directories of this layer, from the root again.
    fn reopen(&self, rel: &Path, entry: &str) -> Result<Dir, UnpackError> {
        let mut cur = self.root_dir(entry)?;
        for c in rel.components() {
            let Component::Normal(c) = c else { continue };
            let fd =
                at::open_dir(&cur.fd, c).map_err(self.io_err(entry, "open directory", &cur, c))?;
            let opaque = cur.opaque || is_opaque(&fd);
            cur = Dir {
                fd,
                rel: cur.rel.join(c),
                opaque,
            };
        }
        Ok(cur)
    }

    /// Makes `parent/c` a real directory in this layer and opens it.
    fn ensure_dir(&mut self, parent: &Dir, c: &OsStr, entry: &str) -> Result<Dir, UnpackError> {
        let rel = parent.rel.join(c);
        let over_whiteout = match self.stat(parent, c, entry)? {
            Some(st) if at::is_type(&st, SFlag::S_IFDIR) => {
                let fd = at::open_dir(&parent.fd, c).map_err(self.io_err(
                    entry,
                    "open directory",
                    parent,
                    c,
                ))?;
                let opaque = parent.opaque || is_opaque(&fd);
                return Ok(Dir { fd, rel, opaque });
            }
            Some(_) => self.clear(parent, c, entry)?,
            None => false,
        };
        // The lower directory this one covers, unless this layer deleted or hides it.
        let lower = if over_whiteout || parent.opaque {
            None
        } else {
            self.find_in_lowers(&rel, entry)?
                .filter(|f| f.kind == Kind::Dir)
        };
        self.count(entry)?;
        at::mkdir(&parent.fd, c).map_err(self.io_err(entry, "create directory", parent, c))?;
        let fd =
            at::open_dir(&parent.fd, c).map_err(self.io_err(entry, "open directory", parent, c))?;
        let shown = self.shown(parent, Some(c));
        let ioe = |op: &'static str| io_at(entry, op, &shown);
        let (mode, uid, gid) = match &lower {
            Some(f) => (f.st.st_mode & 0o7777, f.st.st_uid, f.st.st_gid),
            None => (0o755, 0, 0),
        };
        std::os::unix::fs::fchown(&fd, Some(uid), Some(gid)).map_err(ioe("change owner of"))?;
        fd.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(mode))
            .map_err(ioe("change mode of"))?;
        if let Some(f) = &lower {
            let from = at::open_dir(&f.parent, &f.name).map_err(ioe("open lower directory of"))?;
            copy_xattrs(&from, &fd, entry).map_err(ioe("copy xattrs to"))?;
        }
        if over_whiteout {
            self.make_opaque(&fd, &shown, entry)?;
        }
        Ok(Dir {
            fd,
            rel,
            opaque: parent.opaque || over_whiteout,
        })
    }

    /// What `dir/c` is in the merged view of this layer over the lower ones.
    fn lookup(&mut self, dir: &Dir, c: &OsStr, entry: &str) -> Result<Kind, UnpackError> {
        match self.stat(dir, c, entry)? {
            Some(st) if is_whiteout(&st) => Ok(Kind::Missing),
            Some(st) => Kind::of(&st, || at::readlink(&dir.fd, c)).map_err(self.io_err(
                entry,
                "read symlink",
                dir,
                c,
            )),
            None if dir.opaque => Ok(Kind::Missing),
            None => self.lower_kind(&dir.rel.join(c), entry),
        }
    }

    /// What the lower layers show at `rel`.
    fn lower_kind(&mut self, rel: &Path, entry: &str) -> Result<Kind, UnpackError> {
        if let Some(k) = self.lower_memo.get(rel) {
            return Ok(k.clone());
        }
        let kind = self
            .find_in_lowers(rel, entry)?
            .map(|f| f.kind)
            .unwrap_or(Kind::Missing);
        self.lower_memo.insert(rel.to_path_buf(), kind.clone());
        Ok(kind)
    }

    /// What the topmost lower layer that says anything about `rel` has there.
    fn find_in_lowers(&mut self, rel: &Path, entry: &str) -> Result<Option<Found>, UnpackError> {
        self.open_lowers(entry)?;
        for (root, path) in &self.lowers {
            let hit = layer_lookup(root, rel).map_err(|source| UnpackError::EntryIo {
                entry: entry.into(),
                op: "look up in lower layer",
                path: path.join(rel),
                source,
            })?;
            match hit {
                LayerHit::Found(f) => return Ok(Some(f)),
                LayerHit::Hidden => return Ok(None),
                LayerHit::Absent => {}
            }
        }
        Ok(None)
    }

    /// Waits for the layers below to be in place, then opens them, once. The gate goes only
    /// when they are open: after a failed wait or open, the next entry that needs them asks
    /// again, rather than finding no layers below and unpacking as if there were none.
    fn open_lowers(&mut self, entry: &str) -> Result<(), UnpackError> {
        let Some(ready) = self.lowers_ready else {
            return Ok(());
        };
        if !self.lower_paths.is_empty() {
            ready().map_err(|reason| UnpackError::Below {
                entry: entry.into(),
                reason,
            })?;
            self.lowers = self
                .lower_paths
                .iter()
                .map(|l| Ok((open_layer_dir(l)?, l.as_path())))
                .collect::<Result<_, UnpackError>>()?;
        }
        self.lowers_ready = None;
        Ok(())
    }

    /// Copies a lower layer's `found` to `to/name` in this layer: content, owner, mode,
    /// xattrs and mtime, read only through descriptors opened inside that lower layer.
    fn copy_up(
        &mut self,
        found: &Found,
        to: &Dir,
        name: &OsStr,
        entry: &str,
    ) -> Result<(), UnpackError> {
        let st = &found.st;
        let shown = self.shown(to, Some(name));
        let ioe = |op: &'static str| io_at(entry, op, &shown);
        let mtime = filetime::FileTime::from_unix_time(st.st_mtime, st.st_mtime_nsec as u32);
        self.count(entry)?;
        if at::is_type(st, SFlag::S_IFLNK) {
            let target =
                at::readlink(&found.parent, &found.name).map_err(ioe("copy up symlink"))?;
            at::symlink(&target, &to.fd, name).map_err(ioe("copy up symlink"))?;
            at::chown(&to.fd, name, st.st_uid, st.st_gid).map_err(ioe("change owner of"))?;
            return at::set_times(&to.fd, name, mtime).map_err(ioe("set times of"));
        }
        if at::is_type(st, SFlag::S_IFREG) {
            let mut from =
                at::open_regular(&found.parent, &found.name).map_err(ioe("copy up file"))?;
            let mut dst = at::create(&to.fd, name).map_err(ioe("copy up file"))?;
            self.copy_data(&mut from, &mut dst, entry, &shown)?;
            std::os::unix::fs::fchown(&dst, Some(st.st_uid), Some(st.st_gid))
                .map_err(ioe("change owner of"))?;
            dst.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(
                st.st_mode & 0o7777,
            ))
            .map_err(ioe("change mode of"))?;
            copy_xattrs(&from, &dst, entry).map_err(ioe("copy xattrs to"))?;
            return at::set_fd_times(&dst, mtime).map_err(ioe("set times of"));
        }
        let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
        if ![
            SFlag::S_IFCHR,
            SFlag::S_IFBLK,
            SFlag::S_IFIFO,
            SFlag::S_IFSOCK,
        ]
        .contains(&kind)
        {
            return Err(UnpackError::Entry {
                entry: entry.into(),
                reason: "cannot copy up the hard link target: unknown file type".into(),
            });
        }
        at::mknod(&to.fd, name, kind, st.st_rdev).map_err(ioe("copy up device node"))?;
        at::chown(&to.fd, name, st.st_uid, st.st_gid).map_err(ioe("change owner of"))?;
        at::chmod(&to.fd, name, st.st_mode & 0o7777).map_err(ioe("change mode of"))?;
        at::set_times(&to.fd, name, mtime).map_err(ioe("set times of"))
    }

    fn finish(&mut self) -> Result<(), UnpackError> {
        // Innermost directories first, so setting a parent's time is not undone by a child.
        while let Some((rel, t)) = self.dir_times.pop() {
            let entry = rel.to_string_lossy().into_owned();
            let dir = match self.reopen(&rel, &entry) {
                Ok(d) => d,
                // Replaced by a later entry of this layer: its time is gone with it.
                Err(UnpackError::EntryIo { source, .. })
                    if matches!(
                        source.raw_os_error(),
                        Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e),
            };
            at::set_fd_times(&dir.fd, t).map_err(|source| UnpackError::EntryIo {
                entry,
                op: "set times of",
                path: self.dest.join(&rel),
                source,
            })?;
        }
        Ok(())
    }
}

/// A layer directory, opened as the root its entries resolve in.
fn open_layer_dir(p: &Path) -> Result<File, UnpackError> {
    at::open_root(p).map_err(|source| UnpackError::Io {
        op: "open layer directory",
        path: p.to_path_buf(),
        source,
    })
}

/// Names `entry`, the operation and the path (for messages) in an I/O error.
fn io_at<'e>(
    entry: &'e str,
    op: &'static str,
    path: &Path,
) -> impl FnOnce(io::Error) -> UnpackError + 'e {
    let path = path.to_path_buf();
    move |source| UnpackError::EntryIo {
        entry: entry.into(),
        op,
        path,
        source,
    }
}

/// What `layer` has at `rel`, looked up one component at a time from the layer's root without
/// following any symlink: a symlink, file or whiteout above `rel` hides it, as overlayfs does.
fn layer_lookup(root: &File, rel: &Path) -> io::Result<LayerHit> {
    let comps = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a clean relative path", rel.display()),
            )),
        })
        .collect::<io::Result<Vec<&OsStr>>>()?;
    let Some((last, parents)) = comps.split_last() else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
    };
    let mut dir = root.try_clone()?;
    let mut opaque = false;
    for c in parents {
        match at::stat(&dir, c)? {
            None => {
                return Ok(if opaque {
                    LayerHit::Hidden
                } else {
                    LayerHit::Absent
                })
            }
            Some(st) if at::is_type(&st, SFlag::S_IFDIR) => {
                dir = at::open_dir(&dir, c)?;
                opaque |= is_opaque(&dir);
            }
            Some(_) => return Ok(LayerHit::Hidden),
        }
    }
    match at::stat(&dir, last)? {
        None if opaque => Ok(LayerHit::Hidden),
        None => Ok(LayerHit::Absent),
        Some(st) if is_whiteout(&st) => Ok(LayerHit::Hidden),
        Some(st) => {
            let kind = Kind::of(&st, || at::readlink(&dir, last))?;
            Ok(LayerHit::Found(Found {
                parent: dir,
                name: last.to_os_string(),
                st,
                kind,
            }))
        }
    }
}

fn is_whiteout(st: &FileStat) -> bool {
    at::is_type(st, SFlag::S_IFCHR) && st.st_rdev == 0
}

fn is_opaque(dir: &File) -> bool {
    matches!(dir.get_xattr(OPAQUE_XATTR), Ok(Some(v)) if v == b"y")
}

/// Overlay's own attributes in a layer would let it redirect or hide lower content.
fn wanted_xattr(name: &OsStr, entry: &str) -> bool {
    if name.as_bytes().starts_with(b"trusted.overlay.") {
        tracing::warn!(entry, xattr = ?name, "ignoring overlay xattr carried by a layer");
        return false;
    }
    true
}

fn tolerate_unsupported(r: io::Result<()>, name: &OsStr, entry: &str) -> io::Result<()> {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => {
            tracing::warn!(entry, xattr = ?name, "filesystem does not support this xattr");
            Ok(())
        }
        r => r,
    }
}

/// Copies extended attributes between open files (overlay's own excepted), as copy-up does:
/// a hard-linked binary keeps its `security.capability`.
fn copy_xattrs(from: &File, to: &File, entry: &str) -> io::Result<()> {
    let names = match from.list_xattr() {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(e),
    };
    for name in names {
        if name.as_bytes().starts_with(b"trusted.overlay.") {
            continue;
        }
        if let Some(value) = from.get_xattr(&name)? {
            tolerate_unsupported(to.set_xattr(&name, &value), &name, entry)?;
        }
    }
    Ok(())
}

/// Splits an entry name into normal components. Leading `/` and `./` are dropped (absolute names
/// are taken relative to the layer root, as docker does); a `..` that would climb above the root
/// is an error.
fn clean_components(p: &Path) -> Result<Vec<OsString>, String> {
    if p.as_os_str().len() > MAX_NAME_BYTES {
        return Err(format!(
            "name is {} bytes long, more than {MAX_NAME_BYTES}",
            p.as_os_str().len()
        ));
    }
    let mut out: Vec<OsString> = Vec::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                if out.pop().is_none() {
                    return Err(format!("path {} climbs out of the layer", p.display()));
                }
            }
            Component::Normal(n) => out.push(n.to_os_string()),
        }
    }
    Ok(out)
}

fn parse_pax_time(s: &str) -> Option<filetime::FileTime> {
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    let mut nanos = 0u32;
    if !frac.is_empty() {
        let digits: String = frac.chars().take(9).collect();
        nanos = format!("{digits:0<9}").parse().ok()?;
    }
    Some(filetime::FileTime::from_unix_time(secs, nanos))
}

#[cfg(test)]
mod tests;
