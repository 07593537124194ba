//! Layer syncs off the pull's path (`image.sync_layers`). A layer is recorded as soon as it is
//! in place, marked unsynced with the boot it was written in, and a container may start on it
//! at once; one `syncfs` then covers every layer placed before it started and marks them
//! synced, so layers landing together share one. A daemon restarted in the same boot syncs
//! what is still marked before it serves. After another boot such a layer's files may be torn
//! (a power loss before the sync): it is dropped with its files, and so are the images using
//! it, to be pulled again. No process of the earlier boot can be using them.

use std::collections::HashSet;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::{Images, Inner};
use crate::error::{Error, Result};
use crate::store::Unsynced;

const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

pub(super) struct Syncer {
    /// This boot's id; None when the kernel does not tell it, and then each layer is synced
    /// before its record, as a later boot could not be told from this one.
    boot_id: Option<String>,
    next_token: AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Layers recorded and waiting for a sync, with the token of their mark.
    pending: Vec<(String, u64)>,
    /// Whether a task is syncing (it takes what is pending until nothing is).
    running: bool,
}

impl Syncer {
    pub(super) fn new() -> Syncer {
        Syncer::with_boot_id(
            std::fs::read_to_string(BOOT_ID)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty()),
        )
    }

    pub(super) fn with_boot_id(boot_id: Option<String>) -> Syncer {
        // Tokens differ from an earlier daemon's (whose marks a start settles anyway).
        let start = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        Syncer {
            boot_id,
            next_token: AtomicU64::new(start),
            state: Mutex::new(State::default()),
        }
    }

    /// The mark for a layer recorded before its sync; None when the sync must come first.
    pub(super) fn mark(&self) -> Option<Unsynced> {
        self.boot_id.clone().map(|boot_id| Unsynced {
            boot_id,
            token: self.next_token.fetch_add(1, Ordering::Relaxed),
        })
    }
}

/// Writes out everything of the filesystem holding `dir` (syncfs(2)): file data, inodes, and
/// the directory entries of its renames.
pub(super) fn sync_filesystem(dir: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(dir)?;
    nix::unistd::syncfs(f.as_raw_fd())?;
    Ok(())
}

/// Has `chain_id`, recorded with the mark `token`, synced and marked so soon.
pub(super) fn sync_later(inner: &Arc<Inner>, chain_id: String, token: u64) {
    let start = {
        let mut st = inner.syncer.state.lock().expect("syncer poisoned");
        st.pending.push((chain_id, token));
        !std::mem::replace(&mut st.running, true)
    };
    if start {
        tokio::spawn(sync_pending(inner.clone()));
    }
}

async fn sync_pending(inner: Arc<Inner>) {
    loop {
        let batch = {
            let mut st = inner.syncer.state.lock().expect("syncer poisoned");
            if st.pending.is_empty() {
                st.running = false;
                return;
            }
            std::mem::take(&mut st.pending)
        };
        let (store, dir) = (inner.store.clone(), inner.snapshots_dir.clone());
        let synced = tokio::task::spawn_blocking(move || -> Result<usize> {
            sync_filesystem(&dir).map_err(|e| Error::io("sync snapshots in", &dir, e))?;
            let mut marked = 0;
            for (chain_id, token) in &batch {
                // A layer collected meanwhile, or unpacked and recorded anew, is not marked.
                marked += usize::from(store.mark_snapshot_synced(chain_id, *token)?);
            }
            Ok(marked)
        })
        .await
        .map_err(|e| Error::Internal(format!("layer sync task: {e}")))
        .and_then(|r| r);
        match synced {
            Ok(marked) => tracing::debug!(layers = marked, "layers synced"),
            // Their marks stay: a start in this boot syncs them again, one after another boot
            // drops them.
            Err(e) => tracing::error!(error = %e, "cannot sync unpacked layers"),
        }
    }
}

impl Images {
    /// At start, before anything else looks at the snapshots: syncs and marks the layers an
    /// earlier daemon of this boot recorded before their sync, and drops (record and files)
    /// those of another boot. Answers the dropped chain ids.
    pub(super) fn settle_unsynced(&self) -> Result<HashSet<String>> {
        let store = &self.inner.store;
        let boot_id = self.inner.syncer.boot_id.as_deref();
        let mut this_boot = Vec::new();
        let mut dropped = HashSet::new();
        for s in store.snapshots()? {
            let Some(u) = &s.unsynced else {
                continue;
            };
            // Unknown now: no way to tell a reboot, so kept (a running container may use it).
            if boot_id.is_none_or(|b| b == u.boot_id) {
                this_boot.push((s.chain_id.clone(), u.token));
                continue;
            }
            tracing::error!(chain_id = %s.chain_id, boot_id = %u.boot_id, "layer recorded before its sync, in an earlier boot: its files may be torn; dropping it, pull its images again");
            store.remove_snapshot(&s.chain_id)?;
            let dir = self.snapshot_dir(&s.chain_id);
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &dir, e)),
            }
            dropped.insert(s.chain_id);
        }
        if !this_boot.is_empty() {
            let dir = &self.inner.snapshots_dir;
            sync_filesystem(dir).map_err(|e| Error::io("sync snapshots in", dir, e))?;
            for (chain_id, token) in &this_boot {
                store.mark_snapshot_synced(chain_id, *token)?;
            }
            tracing::info!(
                layers = this_boot.len(),
                "synced the layers an earlier daemon recorded before their sync"
            );
        }
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ImageConfig;
    use crate::store::{ImageRecord, SnapshotRecord, Store, RECORD_VERSION};

    fn digest(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn snapshot(chain_id: &str, unsynced: Option<Unsynced>) -> SnapshotRecord {
        SnapshotRecord {
            v: RECORD_VERSION,
            chain_id: chain_id.into(),
            diff_id: chain_id.into(),
            parent: None,
            usage_bytes: 4096,
            usage_inodes: 1,
            unsynced,
        }
    }

    async fn open(dir: &Path, store: &Arc<Store>) -> Images {
        Images::open(
            dir,
            store.clone(),
            dir.join("certs.d"),
            ImageConfig::default(),
        )
        .await
        .unwrap()
    }

    /// A start syncs and marks the layers recorded before their sync in this boot, and drops
    /// those of an earlier boot with their files (even one a container of that boot pinned)
    /// and the images using them.
    #[tokio::test]
    async fn a_start_syncs_this_boots_unsynced_layers_and_drops_an_earlier_boots() {
        let this_boot = std::fs::read_to_string(BOOT_ID).unwrap().trim().to_string();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("meta.db")).unwrap());
        let images = open(dir.path(), &store).await;
        let (torn, fresh, synced) = (digest('a'), digest('b'), digest('c'));
        let mark = |boot: &str, token| {
            Some(Unsynced {
                boot_id: boot.into(),
                token,
            })
        };
        store
            .put_snapshot(&snapshot(&torn, mark("an-earlier-boot", 1)))
            .unwrap();
        store
            .put_snapshot(&snapshot(&fresh, mark(&this_boot, 2)))
            .unwrap();
        store.put_snapshot(&snapshot(&synced, None)).unwrap();
        store
            .pin("c-of-the-earlier-boot", std::slice::from_ref(&torn))
            .unwrap();
        for (i, layer) in [&torn, &fresh, &synced].into_iter().enumerate() {
            std::fs::create_dir_all(images.snapshot_fs(layer)).unwrap();
            std::fs::write(images.snapshot_fs(layer).join("f"), b"x").unwrap();
            let id = digest(char::from(b'd' + i as u8));
            let manifest = digest(char::from(b'0' + i as u8));
            for d in [&id, &manifest] {
                std::fs::write(images.content_path(d), b"{}").unwrap();
            }
            store
                .put_image(&ImageRecord {
                    v: RECORD_VERSION,
                    id,
                    repo_tags: vec![format!("img/{i}:1")],
                    repo_digests: vec![],
                    manifest_digest: manifest,
                    size: 0,
                    chain_ids: vec![layer.clone()],
                    user: String::new(),
                    pulled_at: 0,
                })
                .unwrap();
        }
        drop(images);

        let _images = open(dir.path(), &store).await;
        assert!(store.snapshot(&torn).unwrap().is_none());
        assert!(
            !dir.path().join("snapshots").join(&torn[7..]).exists(),
            "the torn layer's files are gone, pinned as they were"
        );
        let left: Vec<String> = store
            .images()
            .unwrap()
            .into_iter()
            .map(|i| i.repo_tags[0].clone())
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert!(!left.contains(&"img/0:1".to_string()), "{left:?}");
        assert_eq!(store.snapshot(&fresh).unwrap().unwrap().unsynced, None);
        assert!(dir
            .path()
            .join("snapshots")
            .join(&fresh[7..])
            .join("fs/f")
            .exists());
        assert_eq!(store.snapshot(&synced).unwrap().unwrap().unsynced, None);
    }

    /// A layer handed to the syncer is marked synced soon; one recorded anew meanwhile (another
    /// token) is not marked by the earlier sync.
    #[tokio::test]
    async fn layers_recorded_before_their_sync_are_marked_once_synced() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(&dir.path().join("meta.db")).unwrap());
        let images = open(dir.path(), &store).await;
        let marks: Vec<Unsynced> = (0..3)
            .map(|_| images.inner.syncer.mark().unwrap())
            .collect();
        assert!(marks[0].token < marks[1].token && marks[1].token < marks[2].token);
        let (a, b) = (digest('a'), digest('b'));
        store
            .put_snapshot(&snapshot(&a, Some(marks[0].clone())))
            .unwrap();
        // b's record was written anew (token 2) after the request for token 1.
        store
            .put_snapshot(&snapshot(&b, Some(marks[2].clone())))
            .unwrap();
        sync_later(&images.inner, a.clone(), marks[0].token);
        sync_later(&images.inner, b.clone(), marks[1].token);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while store.snapshot(&a).unwrap().unwrap().unsynced.is_some()
            || images.inner.syncer.state.lock().unwrap().running
        {
            assert!(std::time::Instant::now() < deadline, "not synced in 30 s");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(
            store.snapshot(&b).unwrap().unwrap().unsynced,
            Some(marks[2].clone())
        );
    }
}
