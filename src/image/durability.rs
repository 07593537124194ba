//! Layers synced to disk in the background.
//!
//! With `image.sync_layers` on and `image.wait_for_layer_sync` off (the defaults), a pull
//! records a layer as soon as it is in place, with an `unsynced` token in the same
//! transaction (`Store::put_snapshot`), and queues it here. One task syncs the image store's
//! filesystem for every layer queued, once no unpack runs on the node (a `syncfs` during an
//! unpack slows its file creates several times over, docs/BENCHMARKS.md), then ends the
//! layers' unsynced state. The pull answers without waiting for the disk: that wait was most
//! of a cold start's distance to containerd, which does not sync at all.
//!
//! What a crash leaves, and what the next start does with it (`Syncer::recover`):
//! - the daemon died and the machine did not (the token's boot id is this boot's): every
//!   byte is in the page cache or on disk; the layers are queued again.
//! - the machine went down (another boot id): a layer's files may be empty or missing. The
//!   layer is dropped with every image on it, which kubelet pulls again, and its files are
//!   moved aside (`move_aside`), to be deleted once no container is pinned to them.
//!
//! A failed sync drops its layers the same way at once. Limit: a start in the same boot
//! syncs through a descriptor opened then, so a writeback error that another process's sync
//! reported while no hako ran is not seen (the waited mode has no such window).
//!
//! A graceful stop waits for what is queued (`Syncer::flush`), so a clean reboot after it
//! drops nothing.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{chain, Error, Result};
use crate::store::Store;

/// How long the node must have had no pull and no unpack before a queued sync runs: a
/// `syncfs` holds up every `fsync` on the filesystem meanwhile (the store's commits among
/// them: the image record that answers the pull, the container records of the create and
/// start that follow), and slows file creates several times over.
const QUIET: Duration = Duration::from_secs(1);
/// The longest a queued sync waits for that pause: the kernel's own writeback of dirty data
/// starts after 30 s (`vm.dirty_expire_centisecs`).
const QUIET_WAIT: Duration = Duration::from_secs(30);
/// How often the syncer looks for that pause.
const QUIET_POLL: Duration = Duration::from_millis(25);

/// What the syncer waits to see end before it syncs.
pub(super) struct Activity {
    /// The node's unpack semaphore, `slots` permits free when no unpack runs.
    pub unpacks: Arc<tokio::sync::Semaphore>,
    pub slots: usize,
    /// Pulls in progress.
    pub pulls: Arc<std::sync::atomic::AtomicUsize>,
}

impl Activity {
    fn busy(&self) -> bool {
        self.unpacks.available_permits() < self.slots
            || self.pulls.load(std::sync::atomic::Ordering::Relaxed) > 0
    }
}

/// A layer recorded before its files were synced.
pub(super) struct Pending {
    pub chain_id: String,
    /// Its `unsynced` row's value, which the sync ends only while the row still holds it.
    pub token: String,
    /// The image store's directory, opened before the layer wrote its first byte: a
    /// writeback error since then is reported to this descriptor even when another sync saw
    /// it first (`syncfs` keeps a per-file error cursor).
    pub handle: std::fs::File,
    pub opened: Instant,
}

/// The handle pulls queue their layers through (cheap to clone).
#[derive(Clone)]
pub(super) struct Syncer {
    tx: tokio::sync::mpsc::UnboundedSender<Pending>,
    /// Layers queued and not yet synced (or dropped).
    queued: Arc<tokio::sync::watch::Sender<usize>>,
    boot_id: Arc<str>,
    /// Ends the wait for a pause (a flush).
    hurry: Arc<tokio::sync::Notify>,
}

impl Syncer {
    /// Starts the syncing task, which syncs once `activity` has paused (`QUIET`). `dropped`
    /// hears each time layers that could not be synced were dropped (their files wait for a
    /// collection); it closes when the task ends.
    pub fn start(
        store: Arc<Store>,
        snapshots_dir: PathBuf,
        activity: Activity,
        dropped: tokio::sync::mpsc::UnboundedSender<()>,
    ) -> Result<Syncer> {
        let boot_id = boot_id()?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let queued = Arc::new(tokio::sync::watch::channel(0).0);
        let hurry = Arc::new(tokio::sync::Notify::new());
        let task = Task {
            store,
            snapshots_dir,
            activity,
            queued: queued.clone(),
            dropped,
            hurry: hurry.clone(),
        };
        tokio::spawn(task.run(rx));
        Ok(Syncer {
            tx,
            queued,
            boot_id: boot_id.into(),
            hurry,
        })
    }

    /// A token no other record of this boot holds.
    pub fn token(&self) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        format!("{} {nanos}-{}", self.boot_id, super::pull::unique())
    }

    pub fn queue(&self, p: Pending) {
        self.queued.send_modify(|n| *n += 1);
        if self.tx.send(p).is_err() {
            // The task ended with the runtime; the row stays, and the next start syncs it.
            self.queued.send_modify(|n| *n -= 1);
        }
    }

    /// Syncs what is queued now, without waiting for a pause, and waits (at most `limit`)
    /// until every queued layer is synced; answers whether it was.
    pub async fn flush(&self, limit: Duration) -> bool {
        self.hurry.notify_one();
        let mut rx = self.queued.subscribe();
        tokio::time::timeout(limit, rx.wait_for(|n| *n == 0))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// At start, before the store is reconciled: queues the layers this boot left unsynced
    /// and drops those an earlier boot did (see the module doc). Answers the chain ids
    /// dropped.
    pub fn recover(&self, store: &Store, snapshots_dir: &Path) -> Result<Vec<String>> {
        let rows = store.unsynced()?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut lost = Vec::new();
        for (chain_id, token) in rows {
            if token.split(' ').next() == Some(&*self.boot_id) {
                // Opened now: an error reported before this start and seen by nobody is still
                // reported to it; one another process's sync saw first is not (see Pending).
                let handle = std::fs::File::open(snapshots_dir)
                    .map_err(|e| Error::io("open", snapshots_dir, e))?;
                tracing::info!(chain_id = %chain_id, "syncing a layer an earlier daemon of this boot recorded before its sync");
                self.queue(Pending {
                    chain_id,
                    token,
                    handle,
                    opened: Instant::now(),
                });
            } else {
                lost.push(chain_id);
            }
        }
        if lost.is_empty() {
            return Ok(lost);
        }
        move_aside(snapshots_dir, &lost)?;
        let images = store.drop_snapshots(&lost)?;
        for img in &images {
            tracing::warn!(image = %img.id, tags = ?img.repo_tags, "image removed: a layer of it was not yet on disk when the machine went down; pull it again");
        }
        tracing::warn!(layers = ?lost, "dropped layers recorded before their sync in an earlier boot");
        Ok(lost)
    }
}

/// Where a dropped layer's files go: `lost-<chain hex>-<n>` beside the snapshots.
const LOST: &str = "lost-";

/// The chain id (hex) of a dropped layer's directory name, if it is one.
pub(super) fn lost_chain_hex(name: &str) -> Option<&str> {
    name.strip_prefix(LOST)?.split('-').next()
}

/// Moves dropped layers' directories out of their place, before their records go: a pull of
/// the same layer must unpack it afresh, never adopt these files as a snapshot a container
/// still uses (`pull.rs`, `in_use`), even after a crash between the move and the records.
/// A container's overlay keeps reading them where they went, and a collection deletes them
/// once no container is pinned to their chain id.
fn move_aside(snapshots_dir: &Path, chain_ids: &[String]) -> Result<()> {
    for c in chain_ids {
        let hex = super::hex_of(c);
        let from = snapshots_dir.join(hex);
        let to = snapshots_dir.join(format!("{LOST}{hex}-{}", super::pull::unique()));
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("move aside", &from, e)),
        }
    }
    std::fs::File::open(snapshots_dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("sync", snapshots_dir, e))
}

/// This boot's id: it changes with every boot, and only then.
fn boot_id() -> Result<String> {
    let p = Path::new("/proc/sys/kernel/random/boot_id");
    let id = std::fs::read_to_string(p).map_err(|e| Error::io("read", p, e))?;
    let id = id.trim();
    if id.is_empty() || id.contains(' ') {
        return Err(Error::Internal(format!(
            "{} holds no boot id: {id:?}",
            p.display()
        )));
    }
    Ok(id.to_string())
}

struct Task {
    store: Arc<Store>,
    snapshots_dir: PathBuf,
    activity: Activity,
    queued: Arc<tokio::sync::watch::Sender<usize>>,
    dropped: tokio::sync::mpsc::UnboundedSender<()>,
    hurry: Arc<tokio::sync::Notify>,
}

impl Task {
    async fn run(self, mut rx: tokio::sync::mpsc::UnboundedReceiver<Pending>) {
        while let Some(first) = rx.recv().await {
            let waited = Instant::now();
            tokio::select! {
                () = self.pause() => {}
                () = self.hurry.notified() => {}
            }
            let mut batch = vec![first];
            while let Ok(more) = rx.try_recv() {
                batch.push(more);
            }
            let n = batch.len();
            self.sync(batch, waited).await;
            self.queued.send_modify(|q| *q -= n);
        }
    }

    /// Resolves once the node has had no pull and no unpack for `QUIET`, or after
    /// `QUIET_WAIT`.
    async fn pause(&self) {
        let asked = Instant::now();
        let mut quiet_since = None;
        while asked.elapsed() < QUIET_WAIT {
            if self.activity.busy() {
                quiet_since = None;
            } else if quiet_since.get_or_insert_with(Instant::now).elapsed() >= QUIET {
                return;
            }
            tokio::time::sleep(QUIET_POLL).await;
        }
    }

    async fn sync(&self, batch: Vec<Pending>, waited: Instant) {
        let n = batch.len();
        let done: Vec<(String, String)> = batch
            .iter()
            .map(|p| (p.chain_id.clone(), p.token.clone()))
            .collect();
        let started = Instant::now();
        // One sync covers every layer of the batch: all were in place before it began. It
        // goes through the descriptor opened first, whose error cursor is the oldest: an
        // error in any of their files is reported to it.
        let synced = tokio::task::spawn_blocking(move || {
            let oldest = batch
                .iter()
                .min_by_key(|p| p.opened)
                .expect("a batch has a layer");
            nix::unistd::syncfs(oldest.handle.as_raw_fd()).map_err(std::io::Error::from)
        })
        .await;
        let outcome = match synced {
            Ok(Ok(())) => self.store.mark_synced(&done),
            Ok(Err(e)) => Err(Error::io("sync snapshots in", &self.snapshots_dir, e)),
            Err(e) => Err(Error::Internal(format!("sync task: {e}"))),
        };
        let Err(e) = outcome else {
            tracing::debug!(
                layers = n,
                waited_ms = started.duration_since(waited).as_millis() as u64,
                sync_ms = started.elapsed().as_millis() as u64,
                "layers synced"
            );
            return;
        };
        // The data may never reach the disk: the layers and their images go now (a later
        // pull fetches them again), not at the next boot. A running container keeps its
        // files: they stay while it is pinned to them.
        let lost: Vec<String> = done.into_iter().map(|(c, _)| c).collect();
        tracing::error!(error = %chain(&e), layers = ?lost, "layers could not be synced; dropping them and their images");
        if let Err(e) = move_aside(&self.snapshots_dir, &lost) {
            // Left with their records: their rows stay, and the next boot drops them.
            tracing::error!(error = %chain(&e), "moving aside layers that could not be synced");
            return;
        }
        match self.store.drop_snapshots(&lost) {
            Ok(images) => {
                for img in images {
                    tracing::error!(image = %img.id, tags = ?img.repo_tags, "image removed: a layer of it could not be synced; pull it again");
                }
            }
            Err(e) => {
                tracing::error!(error = %chain(&e), "dropping layers that could not be synced")
            }
        }
        let _ = self.dropped.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ImageRecord, SnapshotRecord, RECORD_VERSION};

    fn snapshot(chain_id: &str) -> SnapshotRecord {
        SnapshotRecord {
            v: RECORD_VERSION,
            chain_id: chain_id.into(),
            diff_id: chain_id.into(),
            parent: None,
            usage_bytes: 0,
            usage_inodes: 0,
        }
    }

    fn image(id: &str, tag: &str, chain_ids: &[&str]) -> ImageRecord {
        ImageRecord {
            v: RECORD_VERSION,
            id: id.into(),
            repo_tags: vec![tag.into()],
            repo_digests: vec![],
            manifest_digest: "sha256:m".into(),
            size: 1,
            chain_ids: chain_ids.iter().map(|c| c.to_string()).collect(),
            user: String::new(),
            pulled_at: 0,
        }
    }

    /// A start finds one layer left unsynced by a daemon of this boot and one by an earlier
    /// boot: the first is synced and kept with its image, the second goes with its image,
    /// its files moved aside (seen failing with every row taken as this boot's, and with the
    /// earlier boot's files left in place).
    #[tokio::test]
    async fn a_start_syncs_this_boots_layers_and_drops_an_earlier_boots() {
        let dir = tempfile::tempdir().unwrap();
        let snaps = dir.path().join("snapshots");
        let store = Arc::new(Store::open(&dir.path().join("meta.db")).unwrap());
        let c_now = format!("sha256:{}", "a".repeat(64));
        let c_then = format!("sha256:{}", "b".repeat(64));
        for c in [&c_now, &c_then] {
            std::fs::create_dir_all(snaps.join(super::super::hex_of(c)).join("fs/bin")).unwrap();
        }
        let syncer = Syncer::start(
            store.clone(),
            snaps.clone(),
            activity().0,
            tokio::sync::mpsc::unbounded_channel().0,
        )
        .unwrap();
        store
            .put_snapshot(&snapshot(&c_now), Some(&syncer.token()))
            .unwrap();
        store
            .put_snapshot(&snapshot(&c_then), Some("0f0f0f0f-earlier-boot 7-1"))
            .unwrap();
        store
            .put_image(&image("sha256:i1", "r:now", &[&c_now]))
            .unwrap();
        store
            .put_image(&image("sha256:i2", "r:then", &[&c_now, &c_then]))
            .unwrap();

        let lost = syncer.recover(&store, &snaps).unwrap();
        assert_eq!(lost, vec![c_then.clone()]);
        assert!(syncer.flush(Duration::from_secs(10)).await);
        assert_eq!(store.unsynced().unwrap(), vec![]);
        assert!(store.snapshot(&c_now).unwrap().is_some());
        assert!(snaps
            .join(super::super::hex_of(&c_now))
            .join("fs/bin")
            .is_dir());
        assert!(store.snapshot(&c_then).unwrap().is_none());
        assert!(!snaps.join(super::super::hex_of(&c_then)).exists());
        let aside: Vec<String> = std::fs::read_dir(&snaps)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| lost_chain_hex(n) == Some(super::super::hex_of(&c_then)))
            .collect();
        assert_eq!(aside.len(), 1, "moved aside, not deleted under a pin");
        assert!(snaps.join(&aside[0]).join("fs/bin").is_dir());
        assert!(store.image("sha256:i1").unwrap().is_some());
        assert!(store.image("sha256:i2").unwrap().is_none());
        assert_eq!(store.image_id_by_name("r:then").unwrap(), None);
    }

    /// A node with two unpack slots, and its count of pulls.
    fn activity() -> (
        Activity,
        Arc<tokio::sync::Semaphore>,
        Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let unpacks = Arc::new(tokio::sync::Semaphore::new(2));
        let pulls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let a = Activity {
            unpacks: unpacks.clone(),
            slots: 2,
            pulls: pulls.clone(),
        };
        (a, unpacks, pulls)
    }

    /// A layer queued while an unpack or a pull runs is synced only once both have ended for
    /// `QUIET`; a flush syncs it at once (seen failing with each of the two checks taken out
    /// of `busy`, and with the flush not hurrying the task).
    #[tokio::test]
    async fn a_queued_sync_waits_for_a_pause_unless_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let snaps = dir.path().join("snapshots");
        std::fs::create_dir_all(&snaps).unwrap();
        let store = Arc::new(Store::open(&dir.path().join("meta.db")).unwrap());
        let (activity, unpacks, pulls) = activity();
        let syncer = Syncer::start(
            store.clone(),
            snaps.clone(),
            activity,
            tokio::sync::mpsc::unbounded_channel().0,
        )
        .unwrap();
        let queue = |c: char| {
            let c = format!("sha256:{}", c.to_string().repeat(64));
            let token = syncer.token();
            store.put_snapshot(&snapshot(&c), Some(&token)).unwrap();
            syncer.queue(Pending {
                chain_id: c,
                token,
                handle: std::fs::File::open(&snaps).unwrap(),
                opened: Instant::now(),
            });
        };
        let synced_within = |limit: Duration| {
            let mut rx = syncer.queued.subscribe();
            async move {
                tokio::time::timeout(limit, rx.wait_for(|n| *n == 0))
                    .await
                    .is_ok()
            }
        };

        let unpacking = unpacks.clone().acquire_owned().await.unwrap();
        queue('c');
        assert!(!synced_within(QUIET * 2).await, "synced during an unpack");
        drop(unpacking);
        pulls.store(1, std::sync::atomic::Ordering::Relaxed);
        assert!(!synced_within(QUIET * 2).await, "synced during a pull");
        pulls.store(0, std::sync::atomic::Ordering::Relaxed);
        assert!(synced_within(QUIET * 3).await);
        assert_eq!(store.unsynced().unwrap(), vec![]);

        pulls.store(1, std::sync::atomic::Ordering::Relaxed);
        queue('d');
        assert!(syncer.flush(QUIET / 2).await, "a flush waits for no pause");
        assert_eq!(store.unsynced().unwrap(), vec![]);
    }
}
