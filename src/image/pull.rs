//! Pulling an image: resolve the reference through the configured endpoints, pick the node's
//! platform, then fetch and unpack every layer, sharing layer work between concurrent pulls.
//!
//! Each layer is one spawned task keyed by chain id in `Inner::inflight`: a second pull of the same
//! image (or of another image sharing a layer) awaits the same task instead of downloading again.
//! Downloads of one image run in parallel (bounded by `max_concurrent_downloads`), and so do the
//! unpacks of up to `max_concurrent_unpacks` layers, each reading its download as it arrives.
//! Across all pulls, downloads wait for one of `max_concurrent_downloads` slots and unpacks for one
//! of `max_node_unpacks`, asked for once the layer's download is under way. An unpack waits for the
//! layers below only when an entry's path must resolve through them (`unpack::unpack_layer_over`),
//! and a layer is put in place only once the one below is. The layer below need not be recorded
//! yet. A layer is recorded marked unsynced and synced in the background (`durability`), or,
//! with `image.wait_for_layer_sync`, recorded only after a sync that covers its files, which
//! overlaps the unpack above. A task runs to completion even if every pull that asked for it is
//! cancelled, so a half-written directory is never left to a dropped future.

use std::future::Future;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::{BoxFuture, FutureExt, Shared};
use futures::stream::{FuturesUnordered, StreamExt};
use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWrite;

use super::hosts::{self, Endpoint};
use super::registry::{Credentials, Source};
use super::{hex_of, valid_digest, Images, Name};
use crate::error::{chain, Error, Result};
use crate::store::{ImageRecord, SnapshotRecord, RECORD_VERSION};

pub(super) type LayerFuture = Shared<BoxFuture<'static, Result<(), Arc<Error>>>>;

/// A layer task's three milestones: `started` when its unpack holds one of the node's unpack
/// slots (`image.max_node_unpacks`), `placed` when its snapshot directory is complete and in
/// its final place (the layers above may unpack over it), `done` when it is also recorded
/// (after its sync with `image.wait_for_layer_sync`; otherwise the sync follows in the
/// background, `durability`). Each resolves with the task's error if it fails first.
#[derive(Clone)]
pub(super) struct LayerTask {
    pub(super) started: LayerFuture,
    pub(super) placed: LayerFuture,
    pub(super) done: LayerFuture,
}

const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const ACCEPT: &[&str] = &[
    MEDIA_OCI_INDEX,
    MEDIA_DOCKER_LIST,
    MEDIA_OCI_MANIFEST,
    MEDIA_DOCKER_MANIFEST,
];

/// Layer media types we can unpack (compression is detected from the bytes).
fn is_layer_media_type(mt: &str) -> bool {
    mt.starts_with("application/vnd.oci.image.layer.")
        || mt.starts_with("application/vnd.docker.image.rootfs.diff.tar")
        || mt.starts_with("application/vnd.docker.image.rootfs.foreign.diff.tar")
}

/// Bytes moved recently: a pull fails only when nothing moves for the configured time.
#[derive(Debug)]
pub(super) struct Progress {
    start: Instant,
    last_ms: AtomicU64,
}

impl Progress {
    fn new() -> Arc<Progress> {
        Arc::new(Progress {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        })
    }
    fn bump(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn idle(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Runs `fut` until it finishes or `progress` stays idle for `limit`.
async fn until_stalled<T>(
    fut: impl Future<Output = Result<T>>,
    progress: &Progress,
    limit: Duration,
    what: impl Fn() -> String,
) -> Result<T> {
    tokio::pin!(fut);
    loop {
        let idle = progress.idle();
        if idle >= limit {
            return Err(Error::DeadlineExceeded(format!(
                "{}: no progress for {} s",
                what(),
                limit.as_secs()
            )));
        }
        tokio::select! {
            r = &mut fut => return r,
            _ = tokio::time::sleep(limit - idle) => {}
        }
    }
}

/// An `AsyncWrite` that reports every byte written to a `Progress`.
struct ProgressWriter<W> {
    inner: W,
    progress: Arc<Progress>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for ProgressWriter<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            if n > 0 {
                self.progress.bump();
            }
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// `chainID(L0) = diffID(L0)`, `chainID(Ln) = sha256(chainID(Ln-1) + " " + diffID(Ln))`.
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => format!(
                "sha256:{:x}",
                Sha256::digest(format!("{prev} {d}").as_bytes())
            ),
        };
        out.push(next);
    }
    out
}

/// The node's platform in OCI terms.
fn node_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// Picks the manifest for linux/<node arch> from an index (amd64 has no variants to weigh;
/// for arm64, `v8` or no variant): its digest, checked, and its size.
fn select_platform(index: &ImageIndex, image: &str, index_digest: &str) -> Result<(String, u64)> {
    let arch = node_arch();
    let mut best: Option<&oci_spec::image::Descriptor> = None;
    for m in index.manifests() {
        let Some(p) = m.platform() else { continue };
        if p.os().to_string() != "linux" || p.architecture().to_string() != arch {
            continue;
        }
        let variant_ok = match (arch, p.variant().as_deref()) {
            ("arm64", Some(v)) => v == "v8",
            _ => true,
        };
        if variant_ok && best.is_none() {
            best = Some(m);
        }
    }
    let best = best.ok_or_else(|| {
        Error::NotFound(format!(
            "image {image} has no manifest for platform linux/{arch}"
        ))
    })?;
    let digest = best.digest().to_string();
    valid_digest(
        &format!("image index {index_digest}"),
        &format!("manifest for linux/{arch}"),
        &digest,
    )?;
    Ok((digest, best.size()))
}

struct Resolved {
    source: Arc<Source>,
    /// Digest of what the name resolved to (index or manifest): the repo digest.
    top_digest: String,
    manifest: ImageManifest,
    manifest_bytes: Vec<u8>,
    manifest_digest: String,
}

impl Images {
    /// Pulls `image` and returns its id. Fails with DEADLINE_EXCEEDED when a transfer makes no
    /// progress for `pull_progress_timeout_secs`; a failed pull leaves no files behind.
    pub async fn pull(&self, image: &str, creds: &Credentials) -> Result<String> {
        let name = Name::parse(image)?;
        let started = Instant::now();
        let lease = self.lease();
        let mut running = FuturesUnordered::new();
        let result = self.pull_inner(&name, creds, &lease, &mut running).await;
        match &result {
            Ok(id) => {
                drop(lease);
                tracing::info!(image = %name.canonical(), id = %id, elapsed_ms = started.elapsed().as_millis() as u64, "pulled image")
            }
            Err(e) => {
                tracing::warn!(image = %name.canonical(), error = %chain(e), "pull failed");
                // Layers this pull finished but no image references go now, not at next start.
                // Layers still running (one may wait for an unpack slot another pull holds)
                // are not waited for: the pull answers, and its lease keeps what they write
                // until they end and the cleanup sees it.
                let images = self.clone();
                let waits = !running.is_empty();
                let cleanup = async move {
                    while running.next().await.is_some() {}
                    drop(lease);
                    if let Err(gc) = images.gc().await {
                        tracing::warn!(error = %chain(&gc), "gc after failed pull");
                    }
                };
                if waits {
                    tokio::spawn(cleanup);
                } else {
                    cleanup.await;
                }
            }
        }
        result.map_err(|e| e.context(format!("pull image {}", name.canonical())))
    }

    async fn pull_inner(
        &self,
        name: &Name,
        creds: &Credentials,
        lease: &super::Lease,
        running: &mut FuturesUnordered<LayerFuture>,
    ) -> Result<String> {
        let endpoints = hosts::endpoints(&self.inner.hosts_dir, &name.registry)?;
        let resolved = self.resolve(name, &endpoints, creds).await?;
        let manifest = &resolved.manifest;
        let source = resolved.source.clone();
        let limit = Duration::from_secs(self.inner.config.pull_progress_timeout_secs);

        // Every digest the registry gave is checked before it names a file, a lease or a task.
        let in_manifest = format!("manifest {}", resolved.manifest_digest);
        let config_desc = manifest.config();
        let config_digest = config_desc.digest().to_string();
        valid_digest(&in_manifest, "config digest", &config_digest)?;
        let layers = manifest.layers();
        for (i, l) in layers.iter().enumerate() {
            valid_digest(
                &in_manifest,
                &format!("layers[{i}] digest"),
                l.digest().as_ref(),
            )?;
        }
        lease
            .add([config_digest.clone(), resolved.manifest_digest.clone()])
            .await;
        let config_bytes = {
            let progress = Progress::new();
            until_stalled(
                source.config(&config_digest, config_desc.size()),
                &progress,
                limit,
                || format!("fetch config {config_digest}"),
            )
            .await?
        };
        let config: ImageConfiguration = serde_json::from_slice(&config_bytes)
            .map_err(|e| Error::InvalidArgument(format!("image config {config_digest}: {e}")))?;
        let diff_ids: Vec<String> = config.rootfs().diff_ids().to_vec();
        for (i, d) in diff_ids.iter().enumerate() {
            valid_digest(
                &format!("image config {config_digest}"),
                &format!("rootfs.diff_ids[{i}]"),
                d,
            )?;
        }
        if diff_ids.len() != layers.len() {
            return Err(Error::InvalidArgument(format!(
                "image config {config_digest} lists {} layers, the manifest {}",
                diff_ids.len(),
                layers.len()
            )));
        }
        for l in layers {
            let mt = l.media_type().to_string();
            if !is_layer_media_type(&mt) {
                return Err(Error::InvalidArgument(format!(
                    "layer {} has unsupported media type {mt}",
                    l.digest()
                )));
            }
        }
        let chains = chain_ids(&diff_ids);
        lease.add(chains.iter().cloned()).await;

        let mut placed: Vec<LayerFuture> = Vec::with_capacity(layers.len());
        let mut started: Option<LayerFuture> = None;
        for (i, l) in layers.iter().enumerate() {
            let job = LayerJob {
                images: self.clone(),
                source: source.clone(),
                digest: l.digest().to_string(),
                size: l.size(),
                chain_id: chains[i].clone(),
                diff_id: diff_ids[i].clone(),
                lowers: chains[..i].iter().rev().cloned().collect(),
                parent: placed.last().cloned(),
                parent_started: started.take(),
                ahead: i
                    .checked_sub(self.inner.config.max_concurrent_unpacks)
                    .map(|below| placed[below].clone()),
            };
            let task = self.layer(job);
            placed.push(task.placed);
            started = Some(task.started);
            running.push(task.done);
        }
        // The first failed layer answers the pull; the others, left in `running`, end
        // without it (the downloads above a failed layer stop: `below_gone`).
        while let Some(r) = running.next().await {
            r.map_err(|e| duplicate(&e))?;
        }

        self.write_content(&resolved.manifest_digest, &resolved.manifest_bytes)?;
        self.write_content(&config_digest, &config_bytes)?;
        let size = resolved.manifest_bytes.len() as u64
            + config_bytes.len() as u64
            + layers.iter().map(|l| l.size()).sum::<u64>();
        let user = config
            .config()
            .as_ref()
            .and_then(|c| c.user().clone())
            .unwrap_or_default();
        let record = ImageRecord {
            v: RECORD_VERSION,
            id: config_digest.clone(),
            repo_tags: name
                .digest
                .is_none()
                .then(|| name.canonical())
                .into_iter()
                .collect(),
            repo_digests: vec![format!("{}@{}", name.repo(), resolved.top_digest)],
            manifest_digest: resolved.manifest_digest.clone(),
            size,
            chain_ids: chains,
            user,
            pulled_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0),
        };
        let orphans = self.inner.store.put_image(&record)?;
        for o in &orphans {
            tracing::info!(image = %o.id, "image lost its last name to a newer pull; removed");
        }
        if !orphans.is_empty() {
            self.gc().await?;
        }
        Ok(config_digest)
    }

    /// Finds the manifest: endpoints are tried in order (mirrors, then the server); one that
    /// fails is logged and the next tried; the last error is returned.
    async fn resolve(
        &self,
        name: &Name,
        endpoints: &[Endpoint],
        creds: &Credentials,
    ) -> Result<Resolved> {
        let limit = Duration::from_secs(self.inner.config.pull_progress_timeout_secs);
        let mut last_err = None;
        for ep in endpoints {
            let usable = if name.digest.is_some() {
                ep.pull
            } else {
                ep.resolve
            };
            if !usable {
                continue;
            }
            let progress = Progress::new();
            let attempt = until_stalled(self.resolve_at(ep, name, creds), &progress, limit, || {
                format!("resolve {} at {}", name.canonical(), ep.url())
            })
            .await;
            match attempt {
                Ok(r) => return Ok(r),
                Err(e) => {
                    tracing::debug!(endpoint = %ep.url(), error = %chain(&e), "endpoint failed; trying the next");
                    last_err = Some(e);
                }
            }
        }
        Err(last_err.unwrap_or_else(|| {
            Error::FailedPrecondition(format!(
                "no endpoint of registry {} may resolve {}",
                name.registry,
                name.canonical()
            ))
        }))
    }

    async fn resolve_at(
        &self,
        ep: &Endpoint,
        name: &Name,
        creds: &Credentials,
    ) -> Result<Resolved> {
        let source = Arc::new(self.inner.clients.source(ep, name, creds)?);
        let (bytes, top_digest) = source.manifest(&source.reference, ACCEPT, None).await?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| Error::InvalidArgument(format!("manifest {top_digest}: {e}")))?;
        if v.get("schemaVersion").and_then(|s| s.as_i64()) == Some(1) {
            return Err(Error::InvalidArgument(format!(
                "manifest {top_digest} is docker schema 1, which is not supported"
            )));
        }
        let media_type = v.get("mediaType").and_then(|m| m.as_str()).unwrap_or("");
        let is_index = media_type == MEDIA_OCI_INDEX
            || media_type == MEDIA_DOCKER_LIST
            || v.get("manifests").is_some();
        let (manifest_bytes, manifest_digest) = if is_index {
            let index: ImageIndex = serde_json::from_slice(&bytes)
                .map_err(|e| Error::InvalidArgument(format!("image index {top_digest}: {e}")))?;
            let (digest, size) = select_platform(&index, &name.canonical(), &top_digest)?;
            source
                .manifest(
                    &digest,
                    &[MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST],
                    Some(size),
                )
                .await?
        } else {
            (bytes, top_digest.clone())
        };
        let manifest: ImageManifest = serde_json::from_slice(&manifest_bytes)
            .map_err(|e| Error::InvalidArgument(format!("manifest {manifest_digest}: {e}")))?;
        Ok(Resolved {
            source,
            top_digest,
            manifest,
            manifest_bytes,
            manifest_digest,
        })
    }

    /// The shared task that makes `job.chain_id` exist as a snapshot.
    fn layer(&self, job: LayerJob) -> LayerTask {
        let mut inflight = self.inner.inflight.lock().expect("inflight poisoned");
        if let Some(t) = inflight.get(&job.chain_id) {
            return t.clone();
        }
        if matches!(self.inner.store.snapshot(&job.chain_id), Ok(Some(_)))
            && self.snapshot_fs(&job.chain_id).is_dir()
        {
            let ready = futures::future::ready(Ok(())).boxed().shared();
            return LayerTask {
                started: ready.clone(),
                placed: ready.clone(),
                done: ready,
            };
        }
        let chain_id = job.chain_id.clone();
        let images = self.clone();
        let (placed_tx, placed_rx) = tokio::sync::oneshot::channel();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let handle = tokio::spawn(async move {
            let chain_id = job.chain_id.clone();
            let mut milestones = Milestones {
                started: Some(started_tx),
                placed: Some(placed_tx),
            };
            let r = job.run(&mut milestones).await.map_err(Arc::new);
            // Failed before its unpack started or its snapshot was in place: the layers above
            // learn why.
            for tx in [milestones.started.take(), milestones.placed.take()]
                .into_iter()
                .flatten()
            {
                let _ = tx.send(r.clone());
            }
            images
                .inner
                .inflight
                .lock()
                .expect("inflight poisoned")
                .remove(&chain_id);
            r
        });
        let done = async move {
            match handle.await {
                Ok(r) => r,
                Err(e) => Err(Arc::new(Error::Internal(format!("layer task: {e}")))),
            }
        }
        .boxed()
        .shared();
        let milestone = |rx: tokio::sync::oneshot::Receiver<Result<(), Arc<Error>>>| {
            async move {
                match rx.await {
                    Ok(r) => r,
                    Err(_) => Err(Arc::new(Error::Internal(
                        "layer task ended without a result".into(),
                    ))),
                }
            }
            .boxed()
            .shared()
        };
        let task = LayerTask {
            started: milestone(started_rx),
            placed: milestone(placed_rx),
            done,
        };
        inflight.insert(chain_id, task.clone());
        task
    }
}

/// A copy of a shared error, same kind and message.
fn duplicate(e: &Error) -> Error {
    e.with_message(chain(e))
}

struct LayerJob {
    images: Images,
    source: Arc<Source>,
    digest: String,
    size: u64,
    chain_id: String,
    diff_id: String,
    /// Chain ids of the layers below, topmost first.
    lowers: Vec<String>,
    /// The layer below being in place (`LayerTask::placed`).
    parent: Option<LayerFuture>,
    /// The layer below holding, or having held, its unpack slot (`LayerTask::started`). A layer
    /// asks for a slot only after the one below has had one, so the lowest holder in any stack of
    /// layers never waits on a layer without a slot, and the node-wide bound cannot deadlock: were
    /// every slot held by layers waiting (`lowers_ready`) on layers still queued for one, no pull
    /// would ever finish.
    parent_started: Option<LayerFuture>,
    /// The layer `image.max_concurrent_unpacks` below this one being in place: this one's
    /// unpack starts then. A layer's unpack needs the layers below only for some entries
    /// (`unpack::unpack_layer_over`), but each one holds a decompressor's window (up to 128
    /// MiB for zstd) and three threads, so an image of many layers costs no more than that many.
    ahead: Option<LayerFuture>,
}

/// Removes a path when dropped unless disarmed: the undo of a step, registered right after it.
struct Cleanup(Option<PathBuf>);

impl Cleanup {
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let r = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            if let Err(e) = r {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %p.display(), error = %e, "cleanup failed");
                }
            }
        }
    }
}

impl LayerJob {
    /// Fetches, unpacks, syncs and records the layer; says so on `started` (taking it) once its
    /// unpack holds a slot, and on `placed` once the snapshot is complete and in place.
    async fn run(self, milestones: &mut Milestones) -> Result<()> {
        let inner = &self.images.inner;
        let queued = Instant::now();
        let limit = Duration::from_secs(inner.config.pull_progress_timeout_secs);
        let ingest = inner
            .ingest_dir
            .join(format!("{}-{}", hex_of(&self.digest), unique()));
        let _ingest_cleanup = Cleanup(Some(ingest.clone()));
        // Created before the download may start, so the unpack can open it as soon as the
        // layer below is in place and read it while it grows.
        let file = std::fs::File::create(&ingest).map_err(|e| Error::io("create", &ingest, e))?;
        let growth = Arc::new(Growth::default());
        let download = {
            let growth = growth.clone();
            // Says Failed to the reader on every way out but success, even when the download
            // is stopped (`below_gone`) before it was ever polled: made here, not inside.
            let outcome = GrowthGuard(growth.clone(), GrowthState::Failed);
            let (source, digest, size) = (&self.source, &self.digest, self.size);
            async move {
                // The whole guard moves in (a closure would capture only the field it sets).
                let mut outcome = outcome;
                let _permit = inner
                    .downloads
                    .acquire()
                    .await
                    .map_err(|_| Error::Internal("download semaphore closed".into()))?;
                growth.set(GrowthState::Running);
                let progress = Progress::new();
                let mut writer = ProgressWriter {
                    inner: tokio::io::BufWriter::with_capacity(
                        256 * 1024,
                        GrowingWriter {
                            inner: tokio::fs::File::from_std(file),
                            growth,
                        },
                    ),
                    progress: progress.clone(),
                };
                until_stalled(
                    source.blob("layer", digest, size, &mut writer),
                    &progress,
                    limit,
                    || format!("download layer {digest}"),
                )
                .await?;
                // `blob` flushed: every byte is in the file before the reader hears Done.
                drop(writer);
                outcome.1 = GrowthState::Done;
                Ok::<_, Error>(Instant::now())
            }
        };
        let final_dir = self.images.snapshot_dir(&self.chain_id);
        let tmp = inner.snapshots_dir.join(format!(
            "tmp-{}-{}",
            // Chain ids are checked digests; `get` keeps a bad one from panicking regardless.
            hex_of(&self.chain_id).get(..12).unwrap_or("layer"),
            unique()
        ));
        let mut tmp_cleanup = Cleanup(Some(tmp.clone()));
        // Opened before this layer writes a byte: syncfs reports a writeback error to every
        // descriptor opened before the error, but to one opened later only while nobody has
        // reported it yet. Opened after the unpack, the sync would miss an error in this
        // layer's files that another layer's sync (another pull's, even) had already seen,
        // and trust the layer as complete.
        let sync_handle = if inner.config.sync_layers {
            Some((
                std::fs::File::open(&inner.snapshots_dir)
                    .map_err(|e| Error::io("open", &inner.snapshots_dir, e))?,
                Instant::now(),
            ))
        } else {
            None
        };
        let below_failed =
            |e: Arc<Error>| duplicate(&e).context(format!("layer below {}", self.digest));
        // A layer is put in place only on top of the layer below: once that failed, nothing
        // will use this download, so it stops and frees its place (its reader, if running,
        // reads Failed and ends, giving its slot back).
        let below_gone = {
            let parent = self.parent.clone();
            async move {
                let failed = match parent {
                    Some(p) => p.await.is_err(),
                    None => false,
                };
                if !failed {
                    std::future::pending::<()>().await;
                }
            }
        };
        let download = async move {
            tokio::select! {
                r = download => r.map(Some),
                () = below_gone => Ok(None),
            }
        };
        let unpack = async {
            let ready = async {
                if let Some(ahead) = self.ahead.clone() {
                    ahead.await.map_err(below_failed)?;
                }
                if let Some(below) = self.parent_started.clone() {
                    below.await.map_err(below_failed)?;
                }
                // Only a download under way feeds an unpack: with fewer download places than
                // slots, threads parked on empty ingest files would hold the slots that layers
                // already downloaded wait for.
                let _ = growth
                    .phase
                    .subscribe()
                    .wait_for(|s| *s != GrowthState::Queued)
                    .await;
                let asked = Instant::now();
                // Held by the unpack thread until it ends: each unpack holds three threads and
                // a decompressor window (up to 128 MiB for zstd), so the number at once is
                // bounded on the node, not only per image.
                let slot = inner
                    .unpacks
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| Error::Internal("unpack semaphore closed".into()))?;
                Ok::<_, Error>((asked, slot))
            };
            let download_failed = async {
                let mut phase = growth.phase.subscribe();
                if phase.wait_for(|s| *s == GrowthState::Failed).await.is_err() {
                    std::future::pending::<()>().await;
                }
            };
            // A download that fails while its unpack still waits answers the pull now, not
            // once a slot frees up; no thread was started, so nothing is left running.
            let turn = tokio::select! {
                biased;
                // Never the pull's answer: the download's own error, or the layer below's when
                // it stopped the download, comes first below.
                () = download_failed => Err(Error::Internal(format!(
                    "download of layer {} failed before its unpack began",
                    self.digest
                ))),
                r = ready => r,
            };
            let (asked, slot) = turn?;
            if let Some(tx) = milestones.started.take() {
                let _ = tx.send(Ok(()));
            }
            let lowers: Vec<PathBuf> = self
                .lowers
                .iter()
                .map(|c| self.images.snapshot_fs(c))
                .collect();
            let fs_dir = tmp.join("fs");
            let diff_id = self.diff_id.clone();
            let digest = self.digest.clone();
            let limits = super::unpack::Limits {
                max_bytes: inner.config.max_layer_unpacked_bytes,
                max_entries: inner.config.max_layer_entries,
            };
            let ingest = ingest.clone();
            let growth = growth.clone();
            let parent = self.parent.clone();
            let runtime = tokio::runtime::Handle::current();
            let started = Instant::now();
            // A thread of its own, not tokio's blocking pool: the unpack may wait on the layer
            // below, and it waits for its download, whose file writes go through that pool. On
            // pool threads, enough pulls at once (a layer waiting on another per thread) would
            // leave the downloads no thread to write with, and every pull would stall.
            let (tx, rx) = tokio::sync::oneshot::channel();
            let work = move || -> Result<super::unpack::Unpacked> {
                std::fs::create_dir_all(&fs_dir)
                    .map_err(|e| Error::io("create directory", &fs_dir, e))?;
                let f = std::fs::File::open(&ingest).map_err(|e| Error::io("open", &ingest, e))?;
                let r = GrowingReader { file: f, growth };
                let lowers_ready = || match &parent {
                    Some(p) => runtime.block_on(p.clone()).map_err(|e| chain(&*e)),
                    None => Ok(()),
                };
                super::unpack::unpack_layer_over(
                    r,
                    &fs_dir,
                    &lowers,
                    &lowers_ready,
                    &diff_id,
                    limits,
                )
                .map_err(|e| {
                    Error::InvalidArgument(format!("unpack layer {digest}: {}", chain(&e)))
                })
            };
            let layer = self.digest.clone();
            std::thread::Builder::new()
                .name("unpack".into())
                .spawn(move || {
                    let _slot = slot;
                    // A panic is answered as an error naming it, not only as a lost answer.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work))
                        .unwrap_or_else(|p| {
                            let why = p
                                .downcast_ref::<&str>()
                                .map(|s| s.to_string())
                                .or_else(|| p.downcast_ref::<String>().cloned())
                                .unwrap_or_default();
                            Err(Error::Internal(format!(
                                "unpack of layer {layer} panicked: {why}"
                            )))
                        });
                    let _ = tx.send(r);
                })
                .map_err(|e| Error::Internal(format!("start the unpack thread: {e}")))?;
            let unpacked = rx.await.map_err(|_| {
                Error::Internal(format!(
                    "unpack of layer {} ended without an answer",
                    self.digest
                ))
            })?;
            // Put in place only on top of the layer below, even when nothing in this one
            // needed it; its failure explains this one's.
            if let Some(parent) = self.parent.clone() {
                parent.await.map_err(below_failed)?;
            }
            Ok::<_, Error>((asked, started, unpacked?))
        };
        // The unpack reads the download as it arrives; the layer's content is trusted only
        // once both finished: the download's digest check, then the unpack's diff-id check.
        // A failed download explains a failed unpack (it read a cut or foreign stream).
        let (downloaded, unpacked) = tokio::join!(download, unpack);
        let Some(downloaded) = downloaded? else {
            // Stopped because the layer below failed: that is the cause.
            let below = match self.parent.clone() {
                Some(p) => p.await.err().map(below_failed),
                None => None,
            };
            return Err(below.unwrap_or_else(|| {
                Error::Internal(format!("download of layer {} stopped", self.digest))
            }));
        };
        let (asked, started, unpacked) = unpacked?;
        // Files of an earlier copy whose sync failed, left in place by a move that failed
        // too: moved aside now, never adopted below. (Nothing in place, nothing to look up.)
        if final_dir.exists() {
            super::durability::retire(&inner.store, &inner.snapshots_dir, &self.chain_id)?;
        }
        let in_use = final_dir.exists() && inner.store.pinned()?.contains(&self.chain_id);
        if in_use {
            // A record-less snapshot a container still runs on (its record was adopted after
            // the store was lost): an overlay has it as a lower, so it stays, and ours, the
            // same content by chain id, goes.
            tracing::info!(layer = %self.digest, chain_id = %self.chain_id, "keeping the snapshot a running container uses");
        } else {
            if final_dir.exists() {
                // A record-less leftover of an earlier run: ours replaces it.
                std::fs::remove_dir_all(&final_dir)
                    .map_err(|e| Error::io("remove", &final_dir, e))?;
            }
            std::fs::rename(&tmp, &final_dir)
                .map_err(|e| Error::io("rename snapshot into", &final_dir, e))?;
            tmp_cleanup.disarm();
        }
        // A failure below removes what this pull put in place, never a snapshot in use.
        let mut final_cleanup = Cleanup((!in_use).then(|| final_dir.clone()));
        let unpacked_at = Instant::now();
        if let Some(tx) = milestones.placed.take() {
            let _ = tx.send(Ok(()));
        }
        let record = SnapshotRecord {
            v: RECORD_VERSION,
            chain_id: self.chain_id.clone(),
            diff_id: unpacked.diff_id,
            parent: self.lowers.first().cloned(),
            usage_bytes: unpacked.usage_bytes,
            usage_inodes: unpacked.usage_inodes,
        };
        match sync_handle {
            Some((handle, opened)) if !inner.config.wait_for_layer_sync => {
                // Recorded now and synced in the background: the token in the record's own
                // transaction has the next boot drop the layer if the machine goes down
                // before the sync (`durability`).
                let token = inner.syncer.token();
                inner.store.put_snapshot(&record, Some(&token))?;
                inner.syncer.queue(super::durability::Pending {
                    chain_id: self.chain_id.clone(),
                    token,
                    handle,
                    opened,
                });
            }
            Some((handle, _)) => {
                // The record below says the layer is complete: its files, and the rename
                // that put them in place, must be on disk first, or a power loss leaves a
                // "complete" layer of empty files. One syncfs per layer, as containerd's
                // image_pull_with_sync_fs does; fsync of every file cost more
                // (docs/BENCHMARKS.md).
                tokio::task::spawn_blocking(move || {
                    nix::unistd::syncfs(handle.as_raw_fd()).map_err(std::io::Error::from)
                })
                .await
                .map_err(|e| Error::Internal(format!("sync task: {e}")))?
                .map_err(|e| Error::io("sync snapshot", &final_dir, e))?;
                inner.store.put_snapshot(&record, None)?;
            }
            None => inner.store.put_snapshot(&record, None)?,
        }
        final_cleanup.disarm();
        let ms = |from: Instant, to: Instant| to.duration_since(from).as_millis() as u64;
        tracing::debug!(
            layer = %self.digest,
            chain_id = %self.chain_id,
            download_ms = ms(queued, downloaded),
            // The layers below and the download's place, before a slot was asked for.
            wait_turn_ms = ms(queued, asked),
            wait_slot_ms = ms(asked, started),
            unpack_ms = ms(started, unpacked_at),
            sync_and_record_ms = unpacked_at.elapsed().as_millis() as u64,
            "layer ready"
        );
        Ok(())
    }
}

type MilestoneTx = tokio::sync::oneshot::Sender<Result<(), Arc<Error>>>;

/// What a running layer task still has to say to the layers above (`LayerTask`).
struct Milestones {
    started: Option<MilestoneTx>,
    placed: Option<MilestoneTx>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum GrowthState {
    /// Waiting for one of the node's download places.
    Queued,
    Running,
    Done,
    Failed,
}

/// How far a layer's download into its ingest file is, for the unpack reading it meanwhile.
#[derive(Debug)]
struct Growth {
    state: std::sync::Mutex<GrowthState>,
    grew: std::sync::Condvar,
    /// The same state for async waiters: the unpack, before it asks for a slot.
    phase: tokio::sync::watch::Sender<GrowthState>,
}

impl Default for Growth {
    fn default() -> Self {
        Growth {
            state: std::sync::Mutex::new(GrowthState::Queued),
            grew: std::sync::Condvar::new(),
            phase: tokio::sync::watch::Sender::new(GrowthState::Queued),
        }
    }
}

impl Growth {
    fn set(&self, s: GrowthState) {
        *self.state.lock().expect("growth poisoned") = s;
        self.phase.send_replace(s);
        self.grew.notify_all();
    }
}

/// Sets the download's final state when dropped (Failed unless changed).
struct GrowthGuard(Arc<Growth>, GrowthState);

impl Drop for GrowthGuard {
    fn drop(&mut self) {
        self.0.set(self.1);
    }
}

/// The ingest file's writer: wakes the reader whenever bytes went out.
struct GrowingWriter {
    inner: tokio::fs::File,
    growth: Arc<Growth>,
}

impl AsyncWrite for GrowingWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(_))) {
            self.growth.grew.notify_all();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        if matches!(r, Poll::Ready(Ok(()))) {
            self.growth.grew.notify_all();
        }
        r
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Reads an ingest file while its download writes it: at its current end, waits for more
/// until the download is done (then the end is the end) or failed (an error).
struct GrowingReader {
    file: std::fs::File,
    growth: Arc<Growth>,
}

impl std::io::Read for GrowingReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = self.file.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            let state = self.growth.state.lock().expect("growth poisoned");
            match *state {
                // Everything was written before Done was said: what is left is in the file.
                GrowthState::Done => {
                    drop(state);
                    return self.file.read(buf);
                }
                GrowthState::Failed => {
                    return Err(std::io::Error::other("the layer's download failed"))
                }
                // The writer's file writes complete in the background, after its wake-up:
                // look again soon even without one.
                GrowthState::Queued | GrowthState::Running => {
                    let _ = self
                        .growth
                        .grew
                        .wait_timeout(state, Duration::from_millis(5))
                        .expect("growth poisoned");
                }
            }
        }
    }
}

/// A name part no other live writer uses.
pub(super) fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let ids = chain_ids(&[d('a'), d('b')]);
        assert_eq!(ids[0], d('a'));
        let expect = format!(
            "sha256:{:x}",
            Sha256::digest(format!("{} {}", d('a'), d('b')).as_bytes())
        );
        assert_eq!(ids[1], expect);
    }

    #[test]
    fn a_growing_ingest_file_is_read_to_the_end_of_its_download() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ingest");
        let mut file = std::fs::File::create(&path).unwrap();
        let growth = Arc::new(Growth::default());
        let mut r = GrowingReader {
            file: std::fs::File::open(&path).unwrap(),
            growth: growth.clone(),
        };
        let (ack, acked) = std::sync::mpsc::channel::<()>();
        let writer = std::thread::spawn({
            let growth = growth.clone();
            move || {
                for i in 0..20u8 {
                    // The reader asks for this chunk before it is written: it waits at the
                    // end of the file instead of calling it the end.
                    acked.recv().unwrap();
                    file.write_all(&[i; 1000]).unwrap();
                    growth.grew.notify_all();
                }
                acked.recv().unwrap();
                growth.set(GrowthState::Done);
            }
        });
        for i in 0..20u8 {
            ack.send(()).unwrap();
            let mut chunk = [0u8; 1000];
            r.read_exact(&mut chunk).unwrap();
            assert_eq!(chunk, [i; 1000]);
        }
        ack.send(()).unwrap();
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
        writer.join().unwrap();
    }

    #[test]
    fn a_failed_download_is_an_error_to_its_reader() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ingest");
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(b"partial").unwrap();
        let growth = Arc::new(Growth::default());
        let mut r = GrowingReader {
            file: std::fs::File::open(&path).unwrap(),
            growth: growth.clone(),
        };
        // Dropped without being told Done, as on every failure of the download.
        drop(GrowthGuard(growth, GrowthState::Failed));
        let mut got = Vec::new();
        let err = r.read_to_end(&mut got).unwrap_err();
        assert_eq!(got, b"partial");
        assert!(err.to_string().contains("download failed"), "{err}");
    }

    #[tokio::test]
    async fn stalled_future_fails_with_deadline_exceeded() {
        let p = Progress::new();
        let never = futures::future::pending::<Result<()>>();
        let err = until_stalled(never, &p, Duration::from_millis(50), || "x".into())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::DeadlineExceeded(ref m) if m.starts_with("x: no progress")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn progress_keeps_a_slow_future_alive() {
        let p = Progress::new();
        let p2 = p.clone();
        let slow = async move {
            for _ in 0..6 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                p2.bump();
            }
            Ok(7)
        };
        assert_eq!(
            until_stalled(slow, &p, Duration::from_millis(60), || "x".into())
                .await
                .unwrap(),
            7
        );
    }
}
