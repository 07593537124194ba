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
//! symlink targets are interpreted inside it (chroot semantics), `..` stops at the root, and
//! every directory we descend into has been checked with `lstat` to be a real directory of the
//! new layer, so no write can follow a link out. An entry whose own name climbs out with `..`
//! is rejected.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::fcntl::AtFlags;
use nix::sys::stat::{mknod, Mode, SFlag};
use nix::unistd::{fchownat, Gid, Uid};
use sha2::{Digest, Sha256};

const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const MAX_SYMLINK_HOPS: usize = 40;

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
    #[error("layer content digest is {actual}, the image config says {expected}")]
    DiffIdMismatch { expected: String, actual: String },
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
/// stream must hash to `expected_diff_id`.
pub fn unpack_layer(
    compressed: impl Read,
    dest: &Path,
    lowers: &[PathBuf],
    expected_diff_id: &str,
) -> Result<Unpacked, UnpackError> {
    let mut input = io::BufReader::with_capacity(256 * 1024, compressed);
    let magic = peek(&mut input, 4).map_err(UnpackError::Read)?;
    let decoded: Box<dyn Read> = if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::bufread::MultiGzDecoder::new(input))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(
            ruzstd::decoding::StreamingDecoder::new(input)
                .map_err(|e| UnpackError::Read(io::Error::new(io::ErrorKind::InvalidData, e)))?,
        )
    } else {
        Box::new(input)
    };
    let mut hashing = HashingReader {
        inner: decoded,
        hasher: Sha256::new(),
    };
    let mut unpacker = Unpacker::new(dest, lowers);
    {
        let mut archive = tar::Archive::new(&mut hashing);
        let entries = archive.entries().map_err(UnpackError::Read)?;
        for entry in entries {
            let mut entry = entry.map_err(UnpackError::Read)?;
            unpacker.entry(&mut entry)?;
        }
    }
    // The tar end-of-archive blocks and any padding are part of the digested stream.
    io::copy(&mut hashing, &mut io::sink()).map_err(UnpackError::Read)?;
    unpacker.finish()?;
    let diff_id = format!("sha256:{:x}", hashing.hasher.finalize());
    if diff_id != expected_diff_id {
        return Err(UnpackError::DiffIdMismatch {
            expected: expected_diff_id.into(),
            actual: diff_id,
        });
    }
    let (usage_bytes, usage_inodes) = disk_usage(dest).map_err(UnpackError::Read)?;
    Ok(Unpacked {
        diff_id,
        usage_bytes,
        usage_inodes,
    })
}

fn peek(r: &mut impl io::BufRead, n: usize) -> io::Result<Vec<u8>> {
    let buf = r.fill_buf()?;
    Ok(buf[..buf.len().min(n)].to_vec())
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Allocated bytes and inodes under `root`, each inode counted once (hard links).
pub fn disk_usage(root: &Path) -> io::Result<(u64, u64)> {
    let mut seen = std::collections::HashSet::new();
    let mut bytes = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let md = fs::symlink_metadata(&p)?;
        if seen.insert((md.dev(), md.ino())) {
            bytes += md.blocks() * 512;
        }
        if md.is_dir() {
            for e in fs::read_dir(&p)? {
                stack.push(e?.path());
            }
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

struct Unpacker<'a> {
    dest: &'a Path,
    lowers: &'a [PathBuf],
    /// Directory mtimes to set once everything inside is written.
    dir_times: Vec<(PathBuf, filetime::FileTime)>,
    /// Memo of lookups in the lower layers (they never change while we unpack).
    lower_memo: HashMap<PathBuf, Kind>,
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
    fn new(dest: &'a Path, lowers: &'a [PathBuf]) -> Self {
        Unpacker {
            dest,
            lowers,
            dir_times: Vec::new(),
            lower_memo: HashMap::new(),
        }
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let raw = entry.path().map_err(UnpackError::Read)?.into_owned();
        let name = raw.to_string_lossy().into_owned();
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

        if base == OPAQUE_MARKER {
            let dir = self.resolve_dir(parent, &name)?;
            return self.make_opaque(&dir, &name);
        }
        if let Some(hidden) = base.as_bytes().strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            let hidden = std::ffi::OsStr::from_bytes(hidden);
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(err(format!("invalid whiteout name {base:?}")));
            }
            let dir = self.resolve_dir(parent, &name)?;
            let target = dir.join(hidden);
            self.clear(&target, &name)?;
            mknod(&target, SFlag::S_IFCHR, Mode::empty(), 0).map_err(|e| UnpackError::EntryIo {
                entry: name.clone(),
                op: "create whiteout",
                path: target.clone(),
                source: e.into(),
            })?;
            return Ok(());
        }

        let dir = self.resolve_dir(parent, &name)?;
        let target = dir.join(base);
        let io_err = |op: &'static str, path: &Path| {
            let entry = name.clone();
            let path = path.to_path_buf();
            move |source: io::Error| UnpackError::EntryIo {
                entry,
                op,
                path,
                source,
            }
        };
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                let existing = fs::symlink_metadata(&target).ok();
                if !existing.as_ref().is_some_and(|m| m.is_dir()) {
                    let over_whiteout = self.clear(&target, &name)?;
                    fs::create_dir(&target).map_err(io_err("create directory", &target))?;
                    if over_whiteout {
                        self.make_opaque(&target, &name)?;
                    }
                }
                self.apply_meta(&target, &meta, false, &name)?;
                self.dir_times.push((target, meta.mtime));
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                self.clear(&target, &name)?;
                let mut f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o600)
                    .open(&target)
                    .map_err(io_err("create file", &target))?;
                copy_content(entry, &mut f).map_err(io_err("write file", &target))?;
                drop(f);
                self.apply_meta(&target, &meta, false, &name)?;
                set_times(&target, meta.mtime).map_err(io_err("set times of", &target))?;
            }
            T::Symlink => {
                let link = entry
                    .link_name()
                    .map_err(UnpackError::Read)?
                    .ok_or_else(|| err("symlink without a target".into()))?
                    .into_owned();
                self.clear(&target, &name)?;
                std::os::unix::fs::symlink(&link, &target)
                    .map_err(io_err("create symlink", &target))?;
                self.apply_meta(&target, &meta, true, &name)?;
                set_times(&target, meta.mtime).map_err(io_err("set times of", &target))?;
            }
            T::Link => {
                let link = entry
                    .link_name()
                    .map_err(UnpackError::Read)?
                    .ok_or_else(|| err("hard link without a target".into()))?
                    .into_owned();
                let lcomps =
                    clean_components(&link).map_err(|r| err(format!("hard link target: {r}")))?;
                let Some((lbase, lparent)) = lcomps.split_last() else {
                    return Err(err("hard link to the root directory".into()));
                };
                let ldir = self.resolve_dir(lparent, &name)?;
                let source = ldir.join(lbase);
                match fs::symlink_metadata(&source) {
                    Ok(md) if md.is_dir() => {
                        return Err(err(format!("hard link to directory {link:?}")))
                    }
                    Ok(md) if is_whiteout(&md) => {
                        return Err(err(format!("hard link target {link:?} does not exist")))
                    }
                    Ok(_) => {}
                    Err(_) => {
                        // The target is in a lower layer: copy it up, as overlayfs would.
                        let rel = source
                            .strip_prefix(self.dest)
                            .expect("resolved under dest")
                            .to_path_buf();
                        let lower = self.find_in_lowers(&rel).ok_or_else(|| {
                            err(format!("hard link target {link:?} does not exist"))
                        })?;
                        copy_up(&lower, &source)
                            .map_err(io_err("copy up hard link target", &source))?;
                    }
                }
                if source == target {
                    return Ok(());
                }
                self.clear(&target, &name)?;
                fs::hard_link(&source, &target).map_err(io_err("create hard link", &target))?;
            }
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
                self.clear(&target, &name)?;
                mknod(&target, flag, Mode::from_bits_truncate(0o600), dev)
                    .map_err(|e| io_err("create device node", &target)(e.into()))?;
                self.apply_meta(&target, &meta, false, &name)?;
                set_times(&target, meta.mtime).map_err(io_err("set times of", &target))?;
            }
            T::XGlobalHeader | T::XHeader | T::GNULongName | T::GNULongLink => {}
            other => {
                tracing::warn!(entry = %name, kind = ?other, "skipping layer entry of unsupported type");
            }
        }
        Ok(())
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
                if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                    meta.xattrs.push((name.into(), value.to_vec()));
                } else if key == "uid" || key == "gid" {
                    if let Some(v) = std::str::from_utf8(value).ok().and_then(|s| s.parse().ok()) {
                        if key == "uid" {
                            meta.uid = v;
                        } else {
                            meta.gid = v;
                        }
                    }
                } else if key == "mtime" {
                    if let Some(t) = std::str::from_utf8(value).ok().and_then(parse_pax_time) {
                        meta.mtime = t;
                    }
                }
            }
        }
        Ok(meta)
    }

    /// Owner, then mode (chown clears setuid bits, so the order matters), then xattrs.
    fn apply_meta(
        &self,
        path: &Path,
        meta: &Meta,
        symlink: bool,
        entry: &str,
    ) -> Result<(), UnpackError> {
        let ioe = |op: &'static str, source: io::Error| UnpackError::EntryIo {
            entry: entry.into(),
            op,
            path: path.to_path_buf(),
            source,
        };
        fchownat(
            None,
            path,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| ioe("change owner of", e.into()))?;
        if !symlink {
            fs::set_permissions(path, fs::Permissions::from_mode(meta.mode))
                .map_err(|e| ioe("change mode of", e))?;
        }
        for (name, value) in &meta.xattrs {
            // Overlay's own attributes in a layer would let it redirect or hide lower content.
            if name.as_bytes().starts_with(b"trusted.overlay.") {
                tracing::warn!(entry, xattr = ?name, "ignoring overlay xattr carried by a layer");
                continue;
            }
            if let Err(e) = xattr::set(path, name, value) {
                if e.raw_os_error() == Some(libc::ENOTSUP) {
                    tracing::warn!(entry, xattr = ?name, "filesystem does not support this xattr");
                    continue;
                }
                return Err(ioe("set xattr on", e));
            }
        }
        Ok(())
    }

    /// Removes what stands at `target` in this layer so an entry can take its place. Returns
    /// true when that was a whiteout: a directory created in its place must then be opaque, or
    /// the deleted lower directory's content would show through again.
    fn clear(&self, target: &Path, entry: &str) -> Result<bool, UnpackError> {
        match fs::symlink_metadata(target) {
            Ok(md) => {
                let r = if md.is_dir() {
                    fs::remove_dir_all(target)
                } else {
                    fs::remove_file(target)
                };
                r.map_err(|source| UnpackError::EntryIo {
                    entry: entry.into(),
                    op: "replace",
                    path: target.to_path_buf(),
                    source,
                })?;
                Ok(is_whiteout(&md))
            }
            Err(_) => Ok(false),
        }
    }

    fn make_opaque(&self, dir: &Path, entry: &str) -> Result<(), UnpackError> {
        xattr::set(dir, OPAQUE_XATTR, b"y").map_err(|source| UnpackError::EntryIo {
            entry: entry.into(),
            op: "set opaque xattr on",
            path: dir.to_path_buf(),
            source,
        })
    }

    /// Resolves directory components to a real directory of this layer, following symlinks of
    /// the merged view inside the root and creating missing directories (copying owner and mode
    /// from a lower layer's directory when there is one, as overlayfs copy-up would).
    fn resolve_dir(&mut self, comps: &[OsString], entry: &str) -> Result<PathBuf, UnpackError> {
        let mut queue: VecDeque<OsString> = comps.iter().cloned().collect();
        let mut cur = PathBuf::new();
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c == ".." {
                cur.pop();
                continue;
            }
            if c == "." || c.is_empty() {
                continue;
            }
            let rel = cur.join(&c);
            match self.lookup(&rel) {
                Kind::Dir | Kind::Missing => {
                    self.ensure_dir(&rel, entry)?;
                    cur = rel;
                }
                Kind::Symlink(target) => {
                    hops += 1;
                    if hops > MAX_SYMLINK_HOPS {
                        return Err(UnpackError::Entry {
                            entry: entry.into(),
                            reason: format!(
                                "too many levels of symbolic links at {}",
                                rel.display()
                            ),
                        });
                    }
                    if target.is_absolute() {
                        cur = PathBuf::new();
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
                        reason: format!("{} is not a directory", rel.display()),
                    })
                }
            }
        }
        Ok(self.dest.join(cur))
    }

    /// Makes `rel` a real directory in this layer (its parent already is one).
    fn ensure_dir(&mut self, rel: &Path, entry: &str) -> Result<(), UnpackError> {
        let path = self.dest.join(rel);
        let over_whiteout = match fs::symlink_metadata(&path) {
            Ok(md) if md.is_dir() => return Ok(()),
            Ok(_) => self.clear(&path, entry)?,
            Err(_) => false,
        };
        let ioe = |op: &'static str, source: io::Error| UnpackError::EntryIo {
            entry: entry.into(),
            op,
            path: path.clone(),
            source,
        };
        fs::create_dir(&path).map_err(|e| ioe("create directory", e))?;
        let (mode, uid, gid) = match self.find_in_lowers(rel).and_then(|p| fs::metadata(p).ok()) {
            Some(md) => (md.mode() & 0o7777, md.uid(), md.gid()),
            None => (0o755, 0, 0),
        };
        fchownat(
            None,
            &path,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| ioe("change owner of", e.into()))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(mode))
            .map_err(|e| ioe("change mode of", e))?;
        if over_whiteout {
            self.make_opaque(&path, entry)?;
        }
        Ok(())
    }

    /// What `rel` is in the merged view of this layer over the lower ones.
    fn lookup(&mut self, rel: &Path) -> Kind {
        match layer_lookup(self.dest, rel) {
            LayerHit::Found(k) => return k,
            LayerHit::Hidden => return Kind::Missing,
            LayerHit::Absent => {}
        }
        if let Some(k) = self.lower_memo.get(rel) {
            return k.clone();
        }
        let mut kind = Kind::Missing;
        for l in self.lowers {
            match layer_lookup(l, rel) {
                LayerHit::Found(k) => {
                    kind = k;
                    break;
                }
                LayerHit::Hidden => break,
                LayerHit::Absent => {}
            }
        }
        self.lower_memo.insert(rel.to_path_buf(), kind.clone());
        kind
    }

    /// The lower layer's path that is visible at `rel`, if any.
    fn find_in_lowers(&self, rel: &Path) -> Option<PathBuf> {
        for l in self.lowers {
            match layer_lookup(l, rel) {
                LayerHit::Found(_) => return Some(l.join(rel)),
                LayerHit::Hidden => return None,
                LayerHit::Absent => {}
            }
        }
        None
    }

    fn finish(&mut self) -> Result<(), UnpackError> {
        // Innermost directories first, so setting a parent's time is not undone by a child.
        while let Some((dir, t)) = self.dir_times.pop() {
            set_times(&dir, t).map_err(|source| UnpackError::EntryIo {
                entry: dir.to_string_lossy().into_owned(),
                op: "set times of",
                path: dir.clone(),
                source,
            })?;
        }
        Ok(())
    }
}

enum LayerHit {
    /// The layer has something at the path.
    Found(Kind),
    /// The layer hides the path from the layers below (whiteout, opaque or non-directory ancestor).
    Hidden,
    /// The layer says nothing about the path.
    Absent,
}

fn layer_lookup(layer: &Path, rel: &Path) -> LayerHit {
    match fs::symlink_metadata(layer.join(rel)) {
        Ok(md) if is_whiteout(&md) => LayerHit::Hidden,
        Ok(md) if md.is_dir() => LayerHit::Found(Kind::Dir),
        Ok(md) if md.file_type().is_symlink() => match fs::read_link(layer.join(rel)) {
            Ok(t) => LayerHit::Found(Kind::Symlink(t)),
            Err(_) => LayerHit::Found(Kind::Other),
        },
        Ok(_) => LayerHit::Found(Kind::Other),
        Err(_) => {
            // Absent here; an ancestor may still hide the lower layers' copy.
            let mut anc = rel.parent();
            while let Some(a) = anc {
                if a.as_os_str().is_empty() {
                    break;
                }
                match fs::symlink_metadata(layer.join(a)) {
                    Ok(md) if md.is_dir() => {
                        if is_opaque(&layer.join(a)) {
                            return LayerHit::Hidden;
                        }
                    }
                    Ok(_) => return LayerHit::Hidden,
                    Err(_) => {}
                }
                anc = a.parent();
            }
            LayerHit::Absent
        }
    }
}

fn is_whiteout(md: &fs::Metadata) -> bool {
    md.file_type().is_char_device() && md.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    matches!(xattr::get(dir, OPAQUE_XATTR), Ok(Some(v)) if v == b"y")
}

/// Splits an entry name into normal components. Leading `/` and `./` are dropped (absolute names
/// are taken relative to the layer root, as docker does); a `..` that would climb above the root
/// is an error.
fn clean_components(p: &Path) -> Result<Vec<OsString>, String> {
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

fn copy_content(r: &mut impl Read, f: &mut File) -> io::Result<()> {
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        f.write_all(&buf[..n])?;
    }
}

fn copy_up(from: &Path, to: &Path) -> io::Result<()> {
    let md = fs::symlink_metadata(from)?;
    if md.file_type().is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(from)?, to)?;
    } else if md.is_file() {
        fs::copy(from, to)?;
        fs::set_permissions(to, fs::Permissions::from_mode(md.mode() & 0o7777))?;
    } else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "cannot copy up a special file",
        ));
    }
    fchownat(
        None,
        to,
        Some(Uid::from_raw(md.uid())),
        Some(Gid::from_raw(md.gid())),
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    fs::set_permissions(to, fs::Permissions::from_mode(md.mode() & 0o7777)).or_else(|e| {
        if md.file_type().is_symlink() {
            Ok(())
        } else {
            Err(e)
        }
    })
}

fn set_times(path: &Path, t: filetime::FileTime) -> io::Result<()> {
    filetime::set_symlink_file_times(path, t, t)
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
