//! The image store: pulled images, their content (manifest and config) and their unpacked layers.
//!
//! On disk, under the root dir:
//! - `content/sha256/<hex>`: manifests and configs, written atomically (temp file + rename).
//! - `snapshots/<hex of chain id>/fs`: one unpacked layer each, overlay-ready.
//! - `ingest/`: layers being downloaded; `snapshots/tmp-*`: layers being unpacked. Both are
//!   emptied at start: whatever is there belongs to a pull that died.
//!
//! An image is recorded in the store only after every layer is unpacked and its content is
//! written, so a crash mid-pull never leaves a half image listed. Snapshots and content that no
//! image (and no pull in progress, through a lease) references are garbage-collected.

mod durability;
pub mod hosts;
mod pull;
pub mod registry;
pub mod unpack;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use oci_spec::image::ImageConfiguration;

use crate::config::ImageConfig;
use crate::error::{Error, Result};
use crate::store::{ImageRecord, Store};

pub use registry::Credentials;

/// A parsed image name, normalized as containerd does (`busybox` → `docker.io/library/busybox`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Name {
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl Name {
    /// Parses a reference by the distribution grammar (`[domain/]path[:tag][@digest]`, tags
    /// and names in ASCII as in docker/distribution's `reference` package), then normalizes
    /// it. Written out rather than through oci-spec's `Reference`: its regex (a Unicode `\w`
    /// repeated up to 128 times, for the tag) compiled to 4–5 MiB the daemon kept for good,
    /// plus a matching cache per thread: 11 MiB of RSS from the first image call on.
    pub fn parse(s: &str) -> Result<Name> {
        let bad =
            |why: &str| Error::InvalidArgument(format!("invalid image reference {s:?}: {why}"));
        if s.is_empty() {
            return Err(bad("repository name must have at least one component"));
        }
        // Neither a name nor a tag has an '@'; a tag follows the last ':' after the last '/'
        // (a ':' before a '/' starts a registry's port).
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(d)),
            None => (s, None),
        };
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if !valid_name(name) || tag.is_some_and(|t| !valid_tag(t)) {
            return Err(bad("invalid reference format"));
        }
        // A first component is a registry when it looks like a host (a dot, a port, or
        // `localhost`), whatever the grammar let it be.
        let (registry, repository) = match name.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => {
                (first, path.to_string())
            }
            _ => ("docker.io", name.to_string()),
        };
        let registry = if registry == "index.docker.io" {
            "docker.io"
        } else {
            registry
        };
        let repository = if registry == "docker.io" && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        // Path components are lowercase; a first component with upper case passes the grammar
        // as a domain (`E/y`) and lands here when it is not one.
        if repository.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(bad("repository name must be lowercase"));
        }
        if repository.len() > 255 {
            return Err(bad("repository name must not be more than 255 characters"));
        }
        if let Some(d) = digest {
            check_digest(d).map_err(|why| bad(&format!("digest {why}")))?;
        }
        Ok(Name {
            registry: registry.to_string(),
            repository,
            // A digest pins the content; a tag beside it says nothing more (docker drops it too).
            tag: match digest {
                Some(_) => None,
                None => Some(tag.unwrap_or("latest").to_string()),
            },
            digest: digest.map(str::to_string),
        })
    }

    /// `registry/repository`.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// The canonical text: `repo:tag` or `repo@digest`.
    pub fn canonical(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => format!("{}@{d}", self.repo()),
            (None, Some(t)) => format!("{}:{t}", self.repo()),
            (None, None) => format!("{}:latest", self.repo()),
        }
    }
}

/// `[domain/]component[/component...]`: every component a path component, or the first a
/// domain followed by at least one path component.
fn valid_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('/').collect();
    let path = |p: &[&str]| !p.is_empty() && p.iter().all(|c| path_component(c));
    path(&parts) || (parts.len() > 1 && domain(parts[0]) && path(&parts[1..]))
}

/// Runs of `[a-z0-9]` joined by one separator each: `.`, `_`, `__` or any number of `-`.
fn path_component(c: &str) -> bool {
    let b = c.as_bytes();
    let alnum = |x: &u8| x.is_ascii_lowercase() || x.is_ascii_digit();
    if !b.first().is_some_and(alnum) || !b.last().is_some_and(alnum) {
        return false;
    }
    c.split(|ch: char| ch.is_ascii_lowercase() || ch.is_ascii_digit())
        .all(|sep| matches!(sep, "" | "." | "_" | "__") || sep.bytes().all(|x| x == b'-'))
}

/// Host labels (`[A-Za-z0-9]`, inner `-`) joined by dots, then an optional `:port`.
fn domain(d: &str) -> bool {
    let (host, port) = match d.split_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (d, None),
    };
    let label = |l: &str| {
        let b = l.as_bytes();
        b.first().is_some_and(u8::is_ascii_alphanumeric)
            && b.last().is_some_and(u8::is_ascii_alphanumeric)
            && b.iter().all(|x| x.is_ascii_alphanumeric() || *x == b'-')
    };
    port.is_none_or(|p| !p.is_empty() && p.bytes().all(|x| x.is_ascii_digit()))
        && host.split('.').all(label)
}

/// `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
fn valid_tag(t: &str) -> bool {
    let word = |x: &u8| x.is_ascii_alphanumeric() || *x == b'_';
    let b = t.as_bytes();
    (1..=128).contains(&b.len())
        && word(&b[0])
        && b.iter().all(|x| word(x) || matches!(x, b'.' | b'-'))
}

/// What the CRI layer shows of an image.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInfo {
    pub id: String,
    pub repo_tags: Vec<String>,
    pub repo_digests: Vec<String>,
    pub size: u64,
    pub uid: Option<i64>,
    pub username: String,
}

/// Disk use of the image store.
#[derive(Debug, Clone, PartialEq)]
pub struct FsUsage {
    pub mountpoint: PathBuf,
    pub used_bytes: u64,
    pub inodes_used: u64,
}

impl ImageInfo {
    fn from_record(r: &ImageRecord) -> ImageInfo {
        let (uid, username) = user_of(&r.user);
        ImageInfo {
            id: r.id.clone(),
            repo_tags: r.repo_tags.clone(),
            repo_digests: r.repo_digests.clone(),
            size: r.size,
            uid,
            username,
        }
    }
}

/// Splits a config `User` into a numeric uid or a user name, as the CRI reports it: the group
/// part is dropped; `1002` is uid 1002, `www-data` is the name www-data; empty gives neither
/// (as containerd reports it).
pub fn user_of(user: &str) -> (Option<i64>, String) {
    let u = user.split(':').next().unwrap_or("");
    if u.is_empty() {
        return (None, String::new());
    }
    match u.parse::<i64>() {
        Ok(n) => (Some(n), String::new()),
        Err(_) => (None, u.to_string()),
    }
}

/// Image `name`'s config, typed. Docker's configs carry fields OCI's do not (ignored), and a
/// null or missing `Env`, `Cmd`, `Entrypoint` or `config` section reads as none. A document
/// that is not an image config (a field of the wrong type, a missing `rootfs`) is refused,
/// naming the image. Pulls check configs the same way, so a stored one that fails is corrupt.
pub fn parse_config(name: &str, bytes: &[u8]) -> Result<ImageConfiguration> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::Internal(format!(
            "image {name}: config is not a valid image config: {e}"
        ))
    })
}

#[derive(Clone)]
pub struct Images {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<Store>,
    content_dir: PathBuf,
    snapshots_dir: PathBuf,
    ingest_dir: PathBuf,
    hosts_dir: PathBuf,
    config: ImageConfig,
    clients: registry::Clients,
    /// Layers being fetched and unpacked, by chain id, shared by every pull that needs them.
    inflight: Mutex<HashMap<String, pull::LayerTask>>,
    /// Chain ids and content digests that pulls in progress hold against GC.
    leases: Mutex<HashMap<u64, Vec<String>>>,
    next_lease: AtomicU64,
    downloads: tokio::sync::Semaphore,
    /// Layer unpacks running on the node (`image.max_node_unpacks`).
    unpacks: Arc<tokio::sync::Semaphore>,
    /// Collections, one at a time, requests made while one waits answered together.
    gc: Coalesced,
    /// Where a collection moves what it removes, to delete it after giving its lock back.
    trash_dir: PathBuf,
    sweeps: AtomicU64,
    /// Syncs layers recorded before they were on disk (`durability`).
    syncer: durability::Syncer,
    /// Pulls in progress (their leases), which the syncer waits to see end.
    pulls: Arc<std::sync::atomic::AtomicUsize>,
}

/// Runs one job at a time, and a request is answered by the first run to start after it
/// (which may be its own): for GC, a collection's choice of what to keep follows every
/// request made before it started, so those need no run of their own (failed pulls sharing a
/// layer ask together when it ends). A run has two parts: the job, under the lock, and its
/// `then`, after the lock is given back (GC deletes there what its job moved aside); the
/// `then`s run one at a time in the order of their jobs.
struct Coalesced {
    /// Requests so far, numbered from 1.
    asked: AtomicU64,
    /// Held while a job runs: the number of the last request a finished job answered.
    answered: tokio::sync::Mutex<u64>,
    /// The number of the last request whose run has ended, its `then` too.
    finished: tokio::sync::watch::Sender<u64>,
}

impl Default for Coalesced {
    fn default() -> Coalesced {
        Coalesced {
            asked: AtomicU64::new(0),
            answered: tokio::sync::Mutex::new(0),
            finished: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Coalesced {
    /// Runs `job`, then `then` with its output once the lock is back, unless a run that
    /// started after this call answers it first: false then, once that run's `then` ended
    /// (a removal answers when its files are gone, as kubelet's disk accounting expects).
    async fn run<T, F, G>(&self, job: impl FnOnce() -> F, then: impl FnOnce(T) -> G) -> Result<bool>
    where
        F: Future<Output = Result<T>>,
        G: Future<Output = ()>,
    {
        let asked = self.asked.fetch_add(1, Ordering::SeqCst) + 1;
        let mut answered = self.answered.lock().await;
        if *answered >= asked {
            drop(answered);
            self.finished(asked).await;
            return Ok(false);
        }
        let before = *answered;
        let answers = self.asked.load(Ordering::SeqCst);
        let done = job().await?;
        tracing::debug!(requests = answers - before, "collected garbage");
        *answered = answers;
        drop(answered);
        // After the run before this one (which answered up to `before`) has ended.
        self.finished(before).await;
        then(done).await;
        self.finished.send_modify(|f| *f = (*f).max(answers));
        Ok(true)
    }

    /// Waits until the run answering request `n` has ended.
    async fn finished(&self, n: u64) {
        // The sender lives as long as `self`: the wait ends only by the value.
        let _ = self.finished.subscribe().wait_for(|f| *f >= n).await;
    }

    /// Waits for a run under way, and keeps the next from starting while held.
    async fn exclusive(&self) -> tokio::sync::MutexGuard<'_, u64> {
        self.answered.lock().await
    }
}

/// Holds names against GC until dropped.
struct Lease {
    inner: Arc<Inner>,
    id: u64,
}

impl Lease {
    /// Holds `items` from now on. Waits for a collection under way: it chose what to keep
    /// before this lease named them, and would remove a layer or a content file the pull finds
    /// in place meanwhile (a failed pull's collection runs after its answer, as its retry
    /// leases the same layers).
    async fn add(&self, items: impl IntoIterator<Item = String>) {
        let _collecting = self.inner.gc.exclusive().await;
        let mut leases = self.inner.leases.lock().expect("leases poisoned");
        leases.entry(self.id).or_default().extend(items);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.inner.pulls.fetch_sub(1, Ordering::Relaxed);
        self.inner
            .leases
            .lock()
            .expect("leases poisoned")
            .remove(&self.id);
    }
}

/// Deletes a directory of collected files; one already gone is fine, a failure is logged.
fn delete_collected(p: &Path) {
    match std::fs::remove_dir_all(p) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %p.display(), error = %e, "cannot delete collected files"),
    }
}

fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

/// Whether `d` is a digest the store can address: `sha256:` and 64 lowercase hex digits (the
/// OCI form of SHA-256; the store is laid out by SHA-256 only). Digests from a registry (in
/// descriptors, in a config's `diff_ids`, in references) become file names, map keys and
/// slices, so every one passes here before any use. Err says what is wrong.
pub fn check_digest(d: &str) -> std::result::Result<(), String> {
    let Some((algorithm, encoded)) = d.split_once(':') else {
        return Err("has no algorithm (expected sha256:<64 hex digits>)".into());
    };
    if algorithm != "sha256" {
        return Err(format!(
            "uses algorithm {}; only sha256 is supported",
            shown(algorithm)
        ));
    }
    if encoded.len() != 64
        || !encoded
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err("is not sha256: and 64 lowercase hex digits".into());
    }
    Ok(())
}

/// `check_digest`, as an error naming the object and the field the digest came from (the
/// pull adds the image).
pub(crate) fn valid_digest(object: &str, field: &str, d: &str) -> Result<()> {
    check_digest(d)
        .map_err(|why| Error::InvalidArgument(format!("{object}: {field} {} {why}", shown(d))))
}

/// An untrusted string for a message: quoted and escaped (control and non-ASCII characters
/// cannot garble a log line), and cut to a readable length.
pub(crate) fn shown(s: &str) -> String {
    const MAX: usize = 80;
    match s.char_indices().nth(MAX) {
        Some((end, _)) => format!("{:?}…", &s[..end]),
        None => format!("{s:?}"),
    }
}

impl Images {
    /// Opens the image store under `root` and reconciles it with the disk.
    pub async fn open(
        root: &Path,
        store: Arc<Store>,
        hosts_dir: PathBuf,
        config: ImageConfig,
    ) -> Result<Images> {
        let content_dir = root.join("content").join("sha256");
        let snapshots_dir = root.join("snapshots");
        let ingest_dir = root.join("ingest");
        let trash_dir = root.join("trash");
        // What an earlier daemon's collections had not finished deleting.
        delete_collected(&trash_dir);
        for d in [&content_dir, &snapshots_dir, &trash_dir] {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        // Leftovers of pulls that died with an earlier daemon.
        let _ = std::fs::remove_dir_all(&ingest_dir);
        std::fs::create_dir_all(&ingest_dir)
            .map_err(|e| Error::io("create directory", &ingest_dir, e))?;
        let unpacks = Arc::new(tokio::sync::Semaphore::new(config.max_node_unpacks));
        let (dropped_tx, mut dropped) = tokio::sync::mpsc::unbounded_channel();
        let pulls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let syncer = durability::Syncer::start(
            store.clone(),
            snapshots_dir.clone(),
            durability::Activity {
                unpacks: unpacks.clone(),
                slots: config.max_node_unpacks,
                pulls: pulls.clone(),
            },
            dropped_tx,
        );
        let images = Images {
            inner: Arc::new(Inner {
                store,
                content_dir,
                snapshots_dir,
                ingest_dir,
                hosts_dir,
                downloads: tokio::sync::Semaphore::new(config.max_concurrent_downloads),
                unpacks,
                config,
                clients: registry::Clients::default(),
                inflight: Mutex::new(HashMap::new()),
                leases: Mutex::new(HashMap::new()),
                next_lease: AtomicU64::new(1),
                gc: Coalesced::default(),
                trash_dir,
                sweeps: AtomicU64::new(0),
                syncer,
                pulls,
            }),
        };
        // Layers dropped because their sync failed leave files no record owns.
        let weak = Arc::downgrade(&images.inner);
        tokio::spawn(async move {
            while dropped.recv().await.is_some() {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                if let Err(e) = (Images { inner }).gc().await {
                    tracing::warn!(error = %crate::error::chain(&e), "collecting dropped layers");
                }
            }
        });
        images.remove_stale_unpacks()?;
        // Whatever the config says now: rows an earlier daemon left are resolved either way.
        let inner = &images.inner;
        inner.syncer.recover(&inner.store, &inner.snapshots_dir)?;
        images.reconcile().await?;
        Ok(images)
    }

    /// Waits (at most `limit`) for the layers recorded before their sync to be synced;
    /// answers whether they were. For a graceful stop: what it leaves, a start in the next
    /// boot drops.
    pub async fn flush_syncs(&self, limit: std::time::Duration) -> bool {
        self.inner.syncer.flush(limit).await
    }

    /// The daemon is stopping: layers queued for their sync no longer wait for a pause in the
    /// node's pulls and unpacks.
    pub fn stop_waiting_for_syncs(&self) {
        self.inner.syncer.stop_waiting();
    }

    fn lease(&self) -> Lease {
        self.inner.pulls.fetch_add(1, Ordering::Relaxed);
        Lease {
            inner: self.inner.clone(),
            id: self.inner.next_lease.fetch_add(1, Ordering::Relaxed),
        }
    }

    fn snapshot_dir(&self, chain_id: &str) -> PathBuf {
        self.inner.snapshots_dir.join(hex_of(chain_id))
    }

    /// The directory to use as an overlay lowerdir for a layer.
    pub fn snapshot_fs(&self, chain_id: &str) -> PathBuf {
        self.snapshot_dir(chain_id).join("fs")
    }

    fn content_path(&self, digest: &str) -> PathBuf {
        self.inner.content_dir.join(hex_of(digest))
    }

    pub fn read_content(&self, digest: &str) -> Result<Vec<u8>> {
        let p = self.content_path(digest);
        std::fs::read(&p).map_err(|e| Error::io("read content", &p, e))
    }

    fn write_content(&self, digest: &str, data: &[u8]) -> Result<()> {
        use std::io::Write;
        let path = self.content_path(digest);
        if path.exists() {
            return Ok(());
        }
        // Concurrent pulls of one image write the same content: each through its own temp file.
        let tmp =
            self.inner
                .ingest_dir
                .join(format!("content-{}-{}", hex_of(digest), pull::unique()));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(data)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            // The image record that follows names this file: its directory entry must be on
            // disk too.
            match path.parent() {
                Some(dir) => std::fs::File::open(dir)?.sync_all(),
                None => Ok(()),
            }
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io("write content", &path, e)
        })
    }

    /// Finds an image by id (full, or a unique prefix of at least 4 hex digits), repo tag or
    /// repo digest, in the forms kubelet and crictl use.
    pub fn find(&self, spec: &str) -> Result<Option<ImageRecord>> {
        let store = &self.inner.store;
        let spec = spec.trim();
        if spec.is_empty() {
            return Err(Error::InvalidArgument("image reference is empty".into()));
        }
        let is_hex = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        };
        let bare = spec.strip_prefix("sha256:").unwrap_or(spec);
        if is_hex(bare) && bare.len() == 64 {
            if let Some(r) = store.image(&format!("sha256:{bare}"))? {
                return Ok(Some(r));
            }
        }
        if let Ok(name) = Name::parse(spec) {
            if let Some(id) = store.image_id_by_name(&name.canonical())? {
                return store.image(&id);
            }
        }
        if is_hex(bare) && bare.len() >= 4 && bare.len() < 64 {
            let matches: Vec<_> = store
                .images()?
                .into_iter()
                .filter(|r| hex_of(&r.id).starts_with(bare))
                .collect();
            if matches.len() > 1 {
                return Err(Error::InvalidArgument(format!(
                    "image id prefix {spec} is ambiguous"
                )));
            }
            return Ok(matches.into_iter().next());
        }
        Ok(None)
    }

    pub fn list(&self, filter: Option<&str>) -> Result<Vec<ImageInfo>> {
        let mut out: Vec<ImageInfo> = match filter {
            Some(f) if !f.is_empty() => self.find(f)?.iter().map(ImageInfo::from_record).collect(),
            _ => self
                .inner
                .store
                .images()?
                .iter()
                .map(ImageInfo::from_record)
                .collect(),
        };
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// The image and, when `verbose`, a JSON document with its manifest digest, layers and config.
    pub fn status(&self, spec: &str, verbose: bool) -> Result<Option<(ImageInfo, Option<String>)>> {
        let Some(rec) = self.find(spec)? else {
            return Ok(None);
        };
        let info = if verbose {
            let config = self.config(&rec)?;
            Some(
                serde_json::json!({
                    "id": rec.id,
                    "manifestDigest": rec.manifest_digest,
                    "chainIDs": rec.chain_ids,
                    "snapshots": rec.chain_ids.iter().map(|c| self.snapshot_fs(c)).collect::<Vec<_>>(),
                    "pulledAt": rec.pulled_at,
                    "imageSpec": config,
                })
                .to_string(),
            )
        } else {
            None
        };
        Ok(Some((ImageInfo::from_record(&rec), info)))
    }

    /// The config of stored image `rec`, typed (see [`parse_config`]).
    pub fn config(&self, rec: &ImageRecord) -> Result<ImageConfiguration> {
        let name = match rec.repo_tags.first() {
            Some(tag) => format!("{tag} ({})", rec.id),
            None => rec.id.clone(),
        };
        parse_config(&name, &self.read_content(&rec.id)?)
    }

    /// Removes the image `spec` names, with all its tags and digests, as containerd does.
    /// An image that does not exist is already removed: success.
    pub async fn remove(&self, spec: &str) -> Result<()> {
        let Some(rec) = self.find(spec)? else {
            return Ok(());
        };
        self.inner.store.remove_image(&rec.id)?;
        tracing::info!(image = %rec.id, tags = ?rec.repo_tags, "removed image");
        self.gc().await
    }

    pub fn fs_usage(&self) -> Result<FsUsage> {
        let mut used_bytes = 0;
        let mut inodes_used = 0;
        for s in self.inner.store.snapshots()? {
            used_bytes += s.usage_bytes;
            inodes_used += s.usage_inodes;
        }
        let dir = &self.inner.content_dir;
        for e in std::fs::read_dir(dir).map_err(|e| Error::io("read directory", dir, e))? {
            let e = e.map_err(|e| Error::io("read directory", dir, e))?;
            if let Ok(md) = e.metadata() {
                use std::os::unix::fs::MetadataExt;
                used_bytes += md.blocks() * 512;
                inodes_used += 1;
            }
        }
        Ok(FsUsage {
            mountpoint: self.inner.snapshots_dir.clone(),
            used_bytes,
            inodes_used,
        })
    }

    /// Makes the store agree with the disk: drops records whose files are gone (logged), then
    /// collects files no record owns.
    async fn reconcile(&self) -> Result<()> {
        let store = &self.inner.store;
        let mut broken_snapshots = HashSet::new();
        for s in store.snapshots()? {
            if !self.snapshot_fs(&s.chain_id).is_dir() {
                tracing::error!(chain_id = %s.chain_id, "snapshot directory missing; dropping its record");
                store.remove_snapshot(&s.chain_id)?;
                broken_snapshots.insert(s.chain_id);
            }
        }
        for img in store.images()? {
            let missing_layer = img.chain_ids.iter().find(|c| {
                broken_snapshots.contains(*c) || store.snapshot(c).ok().flatten().is_none()
            });
            let missing_content = [&img.id, &img.manifest_digest]
                .into_iter()
                .find(|d| !self.content_path(d).exists());
            if let Some(what) = missing_layer.or(missing_content) {
                tracing::error!(image = %img.id, tags = ?img.repo_tags, missing = %what, "image incomplete on disk; removing it, pull it again");
                store.remove_image(&img.id)?;
            }
        }
        self.gc().await
    }

    /// Pins `chain_ids` for `owner` (a container being created), once each of `images` is
    /// still recorded. Under the collection lock, as a lease is taken: a collection that
    /// chose what to keep before the pin may be sweeping, and would remove layers the
    /// container then mounts; one after it sees the pin. Answers the config of the first of
    /// `images` (the container's own).
    pub async fn pin(
        &self,
        owner: &str,
        images: &[&ImageRecord],
        chain_ids: &[String],
    ) -> Result<ImageConfiguration> {
        let _collecting = self.inner.gc.exclusive().await;
        for img in images {
            if self.inner.store.image(&img.id)?.is_none() {
                return Err(Error::NotFound(format!(
                    "image {} was removed while container {owner} was being created: pull it again",
                    img.id
                )));
            }
        }
        // Read under the lock: the config file goes with its image's record, and a
        // collection between a read before and this check would turn NOT_FOUND into an I/O
        // error.
        let config = match images.first() {
            Some(img) => self.config(img)?,
            None => {
                return Err(Error::Internal(format!(
                    "container {owner}: no image to pin"
                )))
            }
        };
        self.inner.store.pin_recorded(owner, chain_ids)?;
        Ok(config)
    }

    /// Removes snapshots and content that no image and no pull in progress references (or
    /// leaves that to a collection that starts after this call, `Coalesced`).
    pub async fn gc(&self) -> Result<()> {
        // In a task of its own: a caller that goes away (a cancelled RPC) would otherwise
        // give the lock back while the sweep it started still runs on the blocking pool,
        // and a pull could then lease and find in place a layer that sweep removes.
        let images = self.clone();
        tokio::spawn(async move {
            let gc = &images.inner.gc;
            // Pulls and creates wait for the choice and the moves only, not for deleting a
            // big image's files, which follows once the lock is back.
            gc.run(|| images.collect(), |sweep| images.empty_trash(sweep))
                .await
                .map(drop)
        })
        .await
        .map_err(|e| Error::Internal(format!("gc task: {e}")))?
    }

    /// Deletes the trash of collection `sweep` and of those before it (what an earlier
    /// deletion failed at, or a collection that failed after moving some files, left).
    async fn empty_trash(&self, sweep: u64) {
        let trash = self.inner.trash_dir.clone();
        let deleted = tokio::task::spawn_blocking(move || {
            let Ok(entries) = std::fs::read_dir(&trash) else {
                return;
            };
            for e in entries.flatten() {
                if e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) > Some(sweep) {
                    continue;
                }
                delete_collected(&e.path());
            }
        })
        .await;
        if let Err(e) = deleted {
            tracing::warn!(error = %e, "trash deletion task failed");
        }
    }

    /// One collection, run by `gc` alone: removes the records of what nothing holds and moves
    /// its files into the trash directory of this collection, whose number it answers. What
    /// cannot be moved (the trash on another file system) is deleted in place.
    async fn collect(&self) -> Result<u64> {
        let mut keep: HashSet<String> = HashSet::new();
        for img in self.inner.store.images()? {
            keep.insert(img.id.clone());
            keep.insert(img.manifest_digest.clone());
            keep.extend(img.chain_ids.iter().cloned());
        }
        // Layers of images in use by containers stay even when the image is removed.
        let pinned = self.inner.store.pinned()?;
        let pinned_hex: HashSet<String> = pinned.iter().map(|d| hex_of(d).to_string()).collect();
        keep.extend(pinned);
        for items in self.inner.leases.lock().expect("leases poisoned").values() {
            keep.extend(items.iter().cloned());
        }
        keep.extend(
            self.inner
                .inflight
                .lock()
                .expect("inflight poisoned")
                .keys()
                .cloned(),
        );
        let keep_hex: HashSet<String> = keep.iter().map(|d| hex_of(d).to_string()).collect();

        let store = self.inner.store.clone();
        let snapshots_dir = self.inner.snapshots_dir.clone();
        let content_dir = self.inner.content_dir.clone();
        let sweep = self.inner.sweeps.fetch_add(1, Ordering::Relaxed);
        let trash = self.inner.trash_dir.join(sweep.to_string());
        tokio::task::spawn_blocking(move || -> Result<u64> {
            for s in store.snapshots()? {
                if !keep.contains(&s.chain_id) {
                    store.remove_snapshot(&s.chain_id)?;
                }
            }
            for (dir, is_snap) in [(&snapshots_dir, true), (&content_dir, false)] {
                for e in std::fs::read_dir(dir).map_err(|e| Error::io("read directory", dir, e))? {
                    let e = e.map_err(|e| Error::io("read directory", dir, e))?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    // tmp-* dirs belong to unpacks in progress; start-up removes stale ones.
                    if is_snap && name.starts_with("tmp-") || keep_hex.contains(&name) {
                        continue;
                    }
                    // A dropped layer's files stay while a container is pinned to its chain
                    // id (its overlay still reads them), out of the way of a pull of it.
                    if is_snap
                        && durability::lost_chain_hex(&name).is_some_and(|h| pinned_hex.contains(h))
                    {
                        continue;
                    }
                    let p = e.path();
                    let to = trash.join(format!("{}-{name}", if is_snap { "s" } else { "c" }));
                    if std::fs::create_dir_all(&trash)
                        .and_then(|()| std::fs::rename(&p, &to))
                        .is_ok()
                    {
                        tracing::debug!(path = %p.display(), "collected");
                        continue;
                    }
                    let r = if p.is_dir() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                    match r {
                        Ok(()) => tracing::debug!(path = %p.display(), "collected"),
                        Err(err) => {
                            tracing::warn!(path = %p.display(), error = %err, "cannot collect")
                        }
                    }
                }
            }
            Ok(sweep)
        })
        .await
        .map_err(|e| Error::Internal(format!("gc task: {e}")))?
    }

    /// Removes unpack directories left by a daemon that died mid-pull. Only at start: later,
    /// tmp-* directories belong to live unpacks.
    fn remove_stale_unpacks(&self) -> Result<()> {
        let dir = &self.inner.snapshots_dir;
        for e in std::fs::read_dir(dir).map_err(|e| Error::io("read directory", dir, e))? {
            let e = e.map_err(|e| Error::io("read directory", dir, e))?;
            if e.file_name().to_string_lossy().starts_with("tmp-") {
                tracing::info!(path = %e.path().display(), "removing an unpack left by an earlier daemon");
                std::fs::remove_dir_all(e.path())
                    .map_err(|err| Error::io("remove", e.path(), err))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test body that waits by polling, bounded: a broken `Coalesced` fails the test
    /// instead of keeping it spinning for ever.
    async fn bounded<T>(body: impl Future<Output = T>) -> T {
        tokio::time::timeout(std::time::Duration::from_secs(10), body)
            .await
            .expect("the test did not end within 10 s: one of its waits never ended")
    }

    /// The image store of a daemon whose root is `dir` and metadata store `store`.
    async fn open_images(dir: &Path, store: &Arc<crate::store::Store>) -> Images {
        Images::open(
            dir,
            store.clone(),
            dir.join("certs.d"),
            ImageConfig::default(),
        )
        .await
        .unwrap()
    }

    /// The image store of a daemon whose root is `dir`, with a new metadata store.
    async fn images_in(dir: &Path) -> (Arc<crate::store::Store>, Images) {
        let store = Arc::new(crate::store::Store::open(&dir.join("meta.db")).unwrap());
        let images = open_images(dir, &store).await;
        (store, images)
    }

    /// `sha256:` and 64 times `c`.
    fn digest(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    /// An image record: its config `id`, its `manifest` and its layers' chain ids.
    fn image_record(id: &str, manifest: &str, chain_ids: &[&str]) -> ImageRecord {
        ImageRecord {
            v: crate::store::RECORD_VERSION,
            id: id.into(),
            repo_tags: vec![],
            repo_digests: vec![],
            manifest_digest: manifest.into(),
            size: 0,
            chain_ids: chain_ids.iter().map(|c| c.to_string()).collect(),
            user: String::new(),
            pulled_at: 0,
        }
    }

    /// A container's pin waits for a collection under way, and refuses an image removed
    /// meanwhile: that collection may be sweeping its layers.
    #[tokio::test]
    async fn a_pin_waits_for_a_collection_and_refuses_a_removed_image() {
        bounded(async {
            let dir = tempfile::tempdir().unwrap();
            let (store, images) = images_in(dir.path()).await;
            let record =
                |id: &str| image_record(id, &format!("{id}-manifest"), &[&format!("{id}-layer")]);
            let (kept, removed) = (record("sha256:kept"), record("sha256:removed"));
            for img in [&kept, &removed] {
                for c in &img.chain_ids {
                    store
                        .put_snapshot(&crate::store::SnapshotRecord::bare(c), None)
                        .unwrap();
                }
            }
            store.put_image(&kept).unwrap();
            store.put_image(&removed).unwrap();
            std::fs::write(
                images.content_path(&kept.id),
                config_doc(Some(serde_json::json!({"User": "7"}))),
            )
            .unwrap();
            // A collection under way (its lock held), and the image removed meanwhile.
            let collecting = images.inner.gc.exclusive().await;
            let pin = tokio::spawn({
                let (images, removed) = (images.clone(), removed.clone());
                async move { images.pin("c1", &[&removed], &removed.chain_ids).await }
            });
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            assert!(!pin.is_finished(), "the pin waits for the collection");
            store.remove_image(&removed.id).unwrap();
            drop(collecting);
            // NOT_FOUND, not the I/O error of reading the config file its collection removed.
            match pin.await.unwrap() {
                Err(Error::NotFound(m)) => assert!(
                    m.contains("image sha256:removed was removed while container c1"),
                    "{m}"
                ),
                other => panic!("{other:?}"),
            }
            assert!(store.pinned().unwrap().is_empty());
            let config = images.pin("c2", &[&kept], &kept.chain_ids).await.unwrap();
            assert_eq!(
                config.config().as_ref().unwrap().user().as_deref(),
                Some("7")
            );
            assert_eq!(store.pinned().unwrap(), kept.chain_ids);
        })
        .await;
    }

    /// A collection holds its lock (which pulls and creates wait for) while it chooses and
    /// moves what it removes, not while it deletes it; its deletion also takes what earlier
    /// ones left, and what a daemon died before deleting goes at the next start.
    #[tokio::test]
    async fn a_collection_deletes_what_it_removed_after_giving_its_lock_back() {
        bounded(async {
            let dir = tempfile::tempdir().unwrap();
            let (store, images) = images_in(dir.path()).await;
            let layer = images.snapshot_fs(&digest('a'));
            std::fs::create_dir_all(layer.join("usr/bin")).unwrap();
            std::fs::write(layer.join("usr/bin/tool"), b"x").unwrap();
            let blob = images.content_path(&digest('b'));
            std::fs::write(&blob, b"blob").unwrap();
            let trash = images.inner.trash_dir.clone();
            let in_trash = || {
                let mut v: Vec<String> = std::fs::read_dir(&trash)
                    .unwrap()
                    .flat_map(|run| std::fs::read_dir(run.unwrap().path()).unwrap())
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect();
                v.sort();
                v
            };

            // The deletion held back: the lock is free while the files wait in the trash.
            let (go, hold) = tokio::sync::oneshot::channel::<()>();
            let run = tokio::spawn({
                let (a, b) = (images.clone(), images.clone());
                async move {
                    let gc = &a.inner.gc;
                    gc.run(
                        || a.collect(),
                        |sweep| async move {
                            hold.await.unwrap();
                            b.empty_trash(sweep).await
                        },
                    )
                    .await
                    .unwrap()
                }
            });
            while in_trash().len() < 2 || images.inner.gc.answered.try_lock().is_err() {
                tokio::task::yield_now().await;
            }
            assert!(!layer.exists() && !blob.exists());
            assert_eq!(
                in_trash(),
                [
                    format!("c-{}", "b".repeat(64)),
                    format!("s-{}", "a".repeat(64))
                ]
            );
            go.send(()).unwrap();
            assert!(run.await.unwrap());
            assert!(in_trash().is_empty(), "{:?}", in_trash());

            // A leftover of an earlier collection goes with the next one's deletion.
            std::fs::create_dir_all(trash.join("0/s-left")).unwrap();
            std::fs::write(&blob, b"blob").unwrap();
            images.gc().await.unwrap();
            assert!(!blob.exists());
            assert_eq!(std::fs::read_dir(&trash).unwrap().count(), 0);

            std::fs::create_dir_all(trash.join("7/s-left")).unwrap();
            drop(images);
            let _images = open_images(dir.path(), &store).await;
            assert!(
                !trash.join("7").exists(),
                "a start deletes an earlier daemon's trash"
            );
        })
        .await;
    }

    /// A collection takes only what nothing uses: the files and records of an image's layers,
    /// of a container's pinned layer and of an unpack under way stay, the rest goes.
    #[tokio::test]
    async fn a_collection_keeps_what_images_pins_and_unpacks_use() {
        bounded(async {
            let dir = tempfile::tempdir().unwrap();
            let (store, images) = images_in(dir.path()).await;
            store.pin("c1", &[digest('f')]).unwrap();
            for c in ['c', 'd', 'h'] {
                std::fs::write(images.content_path(&digest(c)), b"x").unwrap();
            }
            for c in ['e', 'f', 'g'] {
                std::fs::create_dir_all(images.snapshot_fs(&digest(c))).unwrap();
                store
                    .put_snapshot(&crate::store::SnapshotRecord::bare(&digest(c)), None)
                    .unwrap();
            }
            store
                .put_image(&image_record(&digest('c'), &digest('d'), &[&digest('e')]))
                .unwrap();
            let unpacking = images.inner.snapshots_dir.join("tmp-eeee-1");
            std::fs::create_dir_all(&unpacking).unwrap();

            images.gc().await.unwrap();
            for c in ['c', 'd'] {
                assert!(images.content_path(&digest(c)).exists(), "content {c}");
            }
            assert!(!images.content_path(&digest('h')).exists());
            for c in ['e', 'f'] {
                assert!(images.snapshot_fs(&digest(c)).exists(), "snapshot {c}");
            }
            assert!(!images.snapshot_dir(&digest('g')).exists());
            assert!(
                unpacking.exists(),
                "an unpack under way keeps its directory"
            );
            let mut recorded: Vec<String> = store
                .snapshots()
                .unwrap()
                .into_iter()
                .map(|s| s.chain_id)
                .collect();
            recorded.sort();
            assert_eq!(recorded, [digest('e'), digest('f')]);
        })
        .await;
    }

    /// A request answered by another run's job answers when that run's `then` has ended,
    /// and the lock is free meanwhile.
    #[tokio::test]
    async fn a_request_answered_by_another_run_waits_for_its_then() {
        bounded(async {
            let c = Arc::new(Coalesced::default());
            let (go_job, hold_job) = tokio::sync::oneshot::channel::<()>();
            let first = tokio::spawn({
                let c = c.clone();
                async move {
                    let job = move || async move {
                        hold_job.await.unwrap();
                        Ok(())
                    };
                    c.run(job, |()| async {}).await.unwrap()
                }
            });
            while c.asked.load(Ordering::SeqCst) < 1 || c.answered.try_lock().is_ok() {
                tokio::task::yield_now().await;
            }
            let (go_then, hold_then) = tokio::sync::oneshot::channel::<()>();
            let second = tokio::spawn({
                let c = c.clone();
                async move {
                    let then = move |()| async move { hold_then.await.unwrap() };
                    c.run(|| async { Ok(()) }, then).await.unwrap()
                }
            });
            while c.asked.load(Ordering::SeqCst) < 2 {
                tokio::task::yield_now().await;
            }
            let third = tokio::spawn({
                let c = c.clone();
                async move {
                    let job = || async { panic!("answered by the second run") };
                    c.run(job, |()| async {}).await.unwrap()
                }
            });
            while c.asked.load(Ordering::SeqCst) < 3 {
                tokio::task::yield_now().await;
            }
            go_job.send(()).unwrap();
            assert!(first.await.unwrap());
            // The second run's job answered the third request; its `then` is held.
            while *c.answered.lock().await < 3 {
                tokio::task::yield_now().await;
            }
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            assert!(c.answered.try_lock().is_ok(), "the lock is free");
            assert!(
                !third.is_finished(),
                "answered only once the then has ended"
            );
            go_then.send(()).unwrap();
            assert!(second.await.unwrap());
            assert!(!third.await.unwrap());
        })
        .await;
    }

    #[tokio::test]
    async fn requests_made_while_a_run_is_under_way_share_the_next_run() {
        bounded(async {
            let c = Arc::new(Coalesced::default());
            let runs = Arc::new(AtomicU64::new(0));
            let job = |runs: Arc<AtomicU64>, hold: Option<tokio::sync::oneshot::Receiver<()>>| {
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    if let Some(hold) = hold {
                        hold.await.unwrap();
                    }
                    Ok(())
                }
            };
            let (go, hold) = tokio::sync::oneshot::channel();
            let first = tokio::spawn({
                let (c, job) = (c.clone(), job(runs.clone(), Some(hold)));
                async move { c.run(job, |()| async {}).await.unwrap() }
            });
            while runs.load(Ordering::SeqCst) == 0 {
                tokio::task::yield_now().await;
            }
            let waiting: Vec<_> = (0..4)
                .map(|_| {
                    let (c, job) = (c.clone(), job(runs.clone(), None));
                    tokio::spawn(async move { c.run(job, |()| async {}).await.unwrap() })
                })
                .collect();
            while c.asked.load(Ordering::SeqCst) < 5 {
                tokio::task::yield_now().await;
            }
            go.send(()).unwrap();
            assert!(first.await.unwrap());
            let mut ran = 0;
            for w in waiting {
                ran += usize::from(w.await.unwrap());
            }
            assert_eq!(
                ran, 1,
                "one run answers the four requests made during the first"
            );
            assert_eq!(runs.load(Ordering::SeqCst), 2);
            // A failed run answers nothing: of two requests made while another run held the
            // lock, the first runs and fails (the lock is fair), and the second still runs.
            let (go, hold) = tokio::sync::oneshot::channel();
            let holder = tokio::spawn({
                let (c, job) = (c.clone(), job(runs.clone(), Some(hold)));
                async move { c.run(job, |()| async {}).await.unwrap() }
            });
            while c.asked.load(Ordering::SeqCst) < 6 {
                tokio::task::yield_now().await;
            }
            let failing = tokio::spawn({
                let c = c.clone();
                async move {
                    c.run(
                        || async { Err::<(), _>(Error::Internal("collection failed".into())) },
                        |()| async {},
                    )
                    .await
                }
            });
            while c.asked.load(Ordering::SeqCst) < 7 {
                tokio::task::yield_now().await;
            }
            let after = tokio::spawn({
                let (c, job) = (c.clone(), job(runs.clone(), None));
                async move { c.run(job, |()| async {}).await.unwrap() }
            });
            while c.asked.load(Ordering::SeqCst) < 8 {
                tokio::task::yield_now().await;
            }
            go.send(()).unwrap();
            assert!(holder.await.unwrap());
            assert!(failing.await.unwrap().is_err());
            assert!(after.await.unwrap(), "the request after the failed run ran");
            assert_eq!(runs.load(Ordering::SeqCst), 4);
        })
        .await;
    }

    /// An image config with `config` as its config section (`None`: no section at all).
    fn config_doc(config: Option<serde_json::Value>) -> Vec<u8> {
        let mut doc = serde_json::json!({
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": []},
        });
        if let Some(c) = config {
            doc["config"] = c;
        }
        serde_json::to_vec(&doc).unwrap()
    }

    #[test]
    fn image_configs_parse_typed_with_nulls_gaps_and_docker_extras() {
        // Null lists read as none.
        let c = parse_config(
            "img",
            &config_doc(Some(serde_json::json!({
                "Env": null, "Cmd": null, "Entrypoint": null, "Volumes": null,
                "WorkingDir": "", "Labels": null,
            }))),
        )
        .unwrap();
        let section = c.config().as_ref().unwrap();
        assert_eq!(section.env(), &None);
        assert_eq!(section.cmd(), &None);
        // No config section at all.
        let c = parse_config("img", &config_doc(None)).unwrap();
        assert!(c.config().is_none());
        // Docker's config: fields OCI does not define, at the top and in the section.
        let mut docker: serde_json::Value =
            serde_json::from_slice(&config_doc(Some(serde_json::json!({
                "Hostname": "", "Domainname": "", "User": "1000:50",
                "AttachStdin": false, "Tty": false, "OpenStdin": false,
                "ExposedPorts": {"80/tcp": {}},
                "Env": ["PATH=/bin"], "Cmd": ["sh"], "Image": "sha256:abc",
                "ArgsEscaped": true, "OnBuild": null, "StopSignal": "SIGQUIT",
                "Healthcheck": {"Test": ["CMD", "true"]},
            }))))
            .unwrap();
        docker["container_config"] = serde_json::json!({"Cmd": ["/bin/sh", "-c", "#(nop)"]});
        docker["docker_version"] = "20.10.7".into();
        docker["container"] = "abc".into();
        let c = parse_config("img", &serde_json::to_vec(&docker).unwrap()).unwrap();
        let section = c.config().as_ref().unwrap();
        assert_eq!(section.user().as_deref(), Some("1000:50"));
        assert_eq!(
            section.env().as_deref(),
            Some(&["PATH=/bin".to_string()][..])
        );
        assert_eq!(section.stop_signal().as_deref(), Some("SIGQUIT"));
        assert_eq!(
            section.exposed_ports().as_deref(),
            Some(&["80/tcp".to_string()][..])
        );
    }

    #[test]
    fn an_image_config_of_the_wrong_shape_is_refused_naming_the_image() {
        let name = "example.com/app:1 (sha256:abc)";
        for bad in [
            config_doc(Some(serde_json::json!({"Env": 7}))),
            config_doc(Some(serde_json::json!({"Cmd": "sh"}))),
            b"[1, 2]".to_vec(),
            b"{\"architecture\": \"amd64\", \"os\": \"linux\"}".to_vec(),
        ] {
            let e = parse_config(name, &bad).unwrap_err();
            let m = e.to_string();
            assert!(
                m.starts_with(&format!("image {name}: config is not a valid image config")),
                "{m}"
            );
        }
        let e = parse_config(name, &config_doc(Some(serde_json::json!({"Env": 7})))).unwrap_err();
        assert!(e.to_string().contains("invalid type: integer `7`"), "{e}");
    }

    #[test]
    fn names_are_normalized_like_containerd() {
        let n = Name::parse("busybox").unwrap();
        assert_eq!(n.canonical(), "docker.io/library/busybox:latest");
        assert_eq!(
            Name::parse("gcr.io/a/b:1").unwrap().canonical(),
            "gcr.io/a/b:1"
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let n = Name::parse(&format!("quay.io/x/y:tag@{d}")).unwrap();
        assert_eq!(n.canonical(), format!("quay.io/x/y@{d}"));
        assert_eq!(n.tag, None);
        assert_eq!(
            Name::parse("127.0.0.1:5000/t/i:v2").unwrap().repo(),
            "127.0.0.1:5000/t/i"
        );
        let err = Name::parse("BusyBox:1").unwrap_err().to_string();
        assert!(err.contains("BusyBox:1"), "{err}");
        // Upper case in the repository is refused: by oci-spec after a registry, by us where
        // oci-spec takes the first component as part of the repository.
        for (upper, why) in [
            ("E/y", "must be lowercase"),
            ("Team/app:1", "must be lowercase"),
            ("docker.io/library/Busybox", "invalid reference format"),
            ("gcr.io/A/b", "invalid reference format"),
        ] {
            match Name::parse(upper) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains(&format!("{upper:?}")) && m.contains(why), "{m}")
                }
                other => panic!("{upper:?}: {other:?}"),
            }
        }
        let n = Name::parse("Registry.Example:5000/a/b").unwrap();
        assert_eq!(Name::parse(&n.canonical()).unwrap(), n);
        // Digests in references: sha256 in lowercase hex only.
        let upper = format!("quay.io/x/y@sha256:{}", "A".repeat(64));
        let err = Name::parse(&upper).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains(&upper) && m.contains("lowercase hex")),
            "{err}"
        );
        let sha512 = format!("quay.io/x/y@sha512:{}", "a".repeat(128));
        assert!(Name::parse(&sha512)
            .unwrap_err()
            .to_string()
            .contains("only sha256"));
    }

    #[test]
    fn references_follow_the_distribution_grammar() {
        let d = format!("sha256:{}", "f".repeat(64));
        // (reference, registry, repository, tag, digest)
        for (r, registry, repository, tag, digest) in [
            (
                "busybox",
                "docker.io",
                "library/busybox",
                Some("latest"),
                None,
            ),
            (
                "test.com:tag",
                "docker.io",
                "library/test.com",
                Some("tag"),
                None,
            ),
            (
                "test.com:5000",
                "docker.io",
                "library/test.com",
                Some("5000"),
                None,
            ),
            ("test.com/repo:tag", "test.com", "repo", Some("tag"), None),
            ("test:5000/repo", "test:5000", "repo", Some("latest"), None),
            ("localhost/a", "localhost", "a", Some("latest"), None),
            (
                "localhost:5000/a/b:1",
                "localhost:5000",
                "a/b",
                Some("1"),
                None,
            ),
            (
                "index.docker.io/busybox",
                "docker.io",
                "library/busybox",
                Some("latest"),
                None,
            ),
            (
                "lowercase:Uppercase",
                "docker.io",
                "library/lowercase",
                Some("Uppercase"),
                None,
            ),
            (
                "sub-dom1.foo.com/bar/baz/quux:some-long-tag",
                "sub-dom1.foo.com",
                "bar/baz/quux",
                Some("some-long-tag"),
                None,
            ),
            (
                "b.gcr.io/test.example.com/my-app:test.example.com",
                "b.gcr.io",
                "test.example.com/my-app",
                Some("test.example.com"),
                None,
            ),
            (
                "foo/foo_bar.com:8080",
                "docker.io",
                "foo/foo_bar.com",
                Some("8080"),
                None,
            ),
            (
                "a/b--c__d.e_f:_t-1.x",
                "docker.io",
                "a/b--c__d.e_f",
                Some("_t-1.x"),
                None,
            ),
            (
                &format!("test:5000/repo@{d}"),
                "test:5000",
                "repo",
                None,
                Some(d.as_str()),
            ),
        ] {
            let n = Name::parse(r).unwrap_or_else(|e| panic!("{r}: {e}"));
            assert_eq!(
                (
                    n.registry.as_str(),
                    n.repository.as_str(),
                    n.tag.as_deref(),
                    n.digest.as_deref()
                ),
                (registry, repository, tag, digest),
                "{r}"
            );
        }
        let long_tag = format!("a:{}", "t".repeat(129));
        let long_repo = format!("a/{}", "b".repeat(254));
        for (r, why) in [
            ("", "at least one component"),
            (":justtag", "invalid reference format"),
            (&format!("@{d}"), "invalid reference format"),
            ("a..b", "invalid reference format"),
            ("a___b", "invalid reference format"),
            ("a-_b", "invalid reference format"),
            ("-a", "invalid reference format"),
            ("a-", "invalid reference format"),
            ("a/", "invalid reference format"),
            ("a//b", "invalid reference format"),
            ("host:/a", "invalid reference format"),
            ("host:x/a", "invalid reference format"),
            ("-host.com/a", "invalid reference format"),
            ("[::1]/a", "invalid reference format"),
            ("a:-t", "invalid reference format"),
            ("a:t:u", "invalid reference format"),
            ("a:tägg", "invalid reference format"),
            ("a é", "invalid reference format"),
            (&long_tag, "invalid reference format"),
            (&long_repo, "not be more than 255"),
            ("a@sha256:abc", "digest is not sha256"),
        ] {
            match Name::parse(r) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(
                        m.contains(&format!("{r:?}")) && m.contains(why),
                        "{r:?}: {m}"
                    )
                }
                other => panic!("{r:?}: {other:?}"),
            }
        }
        // 128 characters is the longest tag.
        assert!(Name::parse(&format!("a:{}", "t".repeat(128))).is_ok());
    }

    #[test]
    fn digests_are_validated_before_any_use() {
        let good = format!("sha256:{}", "0123456789abcdef".repeat(4));
        assert_eq!(check_digest(&good), Ok(()));
        for bad in [
            String::new(),
            "sha256".to_string(),
            "sha256:".to_string(),
            format!("sha256:{}", "a".repeat(63)),
            format!("sha256:{}", "a".repeat(65)),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:{}g", "a".repeat(63)),
            format!("sha512:{}", "a".repeat(128)),
            format!("SHA256:{}", "a".repeat(64)),
            format!(" sha256:{}", "a".repeat(64)),
            format!("sha256:{}\n", "a".repeat(63)),
            // Non-ASCII: 64 characters, more bytes; a byte slice of it would panic.
            format!("sha256:{}", "é".repeat(64)),
            format!("sha256:{}", "a".repeat(63) + "é"),
            "sha256:../../../../etc/passwd".to_string(),
            format!("sha256:{}/..", "a".repeat(61)),
            format!("sha256:{}\0", "a".repeat(63)),
        ] {
            assert!(check_digest(&bad).is_err(), "{bad:?} accepted");
        }
        let err = valid_digest(
            "config x",
            "diff_ids[1]",
            &format!("sha256:{}", "é".repeat(64)),
        )
        .unwrap_err();
        match err {
            Error::InvalidArgument(m) => {
                assert!(m.starts_with("config x: diff_ids[1] \"sha256:"), "{m}");
                assert!(m.contains("64 lowercase hex digits"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn untrusted_strings_are_quoted_and_cut() {
        assert_eq!(shown("a\nb"), "\"a\\nb\"");
        let long = "é".repeat(200);
        let s = shown(&long);
        assert!(s.ends_with('…') && s.chars().count() < 90, "{s}");
    }

    #[test]
    fn user_field_maps_to_uid_or_name() {
        assert_eq!(user_of(""), (None, String::new()));
        assert_eq!(user_of("1002"), (Some(1002), String::new()));
        assert_eq!(user_of("1003:1004"), (Some(1003), String::new()));
        assert_eq!(user_of("www-data"), (None, "www-data".to_string()));
        assert_eq!(user_of("www-data:1004"), (None, "www-data".to_string()));
    }
}
