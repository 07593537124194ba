//! The daemon's own view of what the monitors know: for each Ready pod, a watcher keeps one
//! `Events` call outstanding on its monitor (a long poll, answered at the monitor's next
//! change or after [`EVENTS_HOLD`]), folds each answer into the container records and keeps
//! the states here. Lists and statuses read these and the store and ask no monitor, so a
//! relist costs the same at 250 pods as at 1.
//!
//! What the answers tell: an exit (the monitor records it, then wakes the call), a monitor
//! that no longer listens (the call fails; the pod's id goes to the daemon's `lost` channel
//! at once, and `Runtime::release_lost_monitor` hands the pod to `recovery.rs`), a
//! monitor that is stuck (the call misses its `answer_by` by more than the read deadline:
//! the pod is reported NotReady, with that reason, until it answers again), and a pod whose
//! PID namespace lost its init. Knowing no `Runtime`: watchers hold the store and this map
//! weakly, so they end when the daemon's runtime goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use hako_proto::monitor as pb;

use super::monitor_client::{MonitorClient, EVENTS_HOLD, READ_DEADLINE};
use super::{apply_state, ContainerRecord, ContainerState, PodRecord, PodState};
use crate::error::{chain, Error};
use crate::store::{Store, Table};

/// The watched pods, by id, and where watchers report a monitor that no longer listens.
pub(super) struct Live {
    pods: Mutex<HashMap<String, PodLive>>,
    lost: tokio::sync::mpsc::UnboundedSender<String>,
}

/// What a pod's watcher last learnt from its monitor.
#[derive(Default, Clone, Debug)]
pub(super) struct PodLive {
    /// The containers' states in the monitor's last answer, by id.
    pub states: HashMap<String, pb::ContainerState>,
    /// The monitor missed its answer's deadline: why the pod is NotReady until it answers.
    pub silent: Option<String>,
    /// The monitor no longer listens (the error that said so): recovery's to handle.
    pub gone: Option<String>,
    /// The pod's PID 1 exited: nothing can run in its PID namespace any more.
    pub pid_ns_gone: bool,
}

impl Live {
    /// The map, and the receiving end of its `lost` channel: the ids of pods whose monitor
    /// stopped listening, each once per loss.
    pub(super) fn new() -> (Live, tokio::sync::mpsc::UnboundedReceiver<String>) {
        let (lost, rx) = tokio::sync::mpsc::unbounded_channel();
        let live = Live {
            pods: Mutex::default(),
            lost,
        };
        (live, rx)
    }

    /// A copy of what is known of the pod; `None` when it is not watched.
    pub(super) fn get(&self, pod_id: &str) -> Option<PodLive> {
        self.pods
            .lock()
            .expect("live poisoned")
            .get(pod_id)
            .cloned()
    }

    /// Stops following the pod (stopped, lost or removed): its watcher ends at its next wake.
    pub(super) fn forget(&self, pod_id: &str) {
        self.pods.lock().expect("live poisoned").remove(pod_id);
    }

    /// Changes the pod's entry; false when it is no longer watched.
    fn with(&self, pod_id: &str, f: impl FnOnce(&mut PodLive)) -> bool {
        match self.pods.lock().expect("live poisoned").get_mut(pod_id) {
            Some(p) => {
                f(p);
                true
            }
            None => false,
        }
    }
}

/// Starts following a Ready pod through its monitor (once: a pod already watched is left as
/// it is).
pub(super) fn watch(live: &Arc<Live>, store: &Arc<Store>, pod: &PodRecord, client: MonitorClient) {
    {
        let mut m = live.pods.lock().expect("live poisoned");
        if m.contains_key(&pod.id) {
            return;
        }
        m.insert(pod.id.clone(), PodLive::default());
    }
    let w = Watcher {
        live: Arc::downgrade(live),
        store: Arc::downgrade(store),
        pod_id: pod.id.clone(),
        monitor_pid: pod.monitor_pid,
        client,
    };
    tokio::spawn(w.run());
}

struct Watcher {
    live: Weak<Live>,
    store: Weak<Store>,
    pod_id: String,
    monitor_pid: u32,
    client: MonitorClient,
}

fn now_millis() -> i64 {
    super::host::now_nanos() / 1_000_000
}

impl Watcher {
    async fn run(self) {
        // Any generation but the monitor's: the first call is answered at once.
        let mut since = u64::MAX;
        let mut states: HashMap<String, pb::ContainerState> = HashMap::new();
        // A monitor of a build before `Events` is read once a second instead.
        let mut polling = false;
        let mut pause = Duration::from_millis(20);
        loop {
            let answer = if polling {
                tokio::time::sleep(Duration::from_secs(1)).await;
                self.client.read_info().await
            } else {
                self.next_answer(since).await
            };
            let (Some(live), Some(store)) = (self.live.upgrade(), self.store.upgrade()) else {
                return;
            };
            // Another process on the socket is not this pod's monitor.
            let answer = answer.and_then(|info| {
                if self.monitor_pid != 0 && info.pid != self.monitor_pid {
                    return Err(Error::FailedPrecondition(format!(
                        "process {} answers on the socket of pod monitor {}",
                        info.pid, self.monitor_pid
                    )));
                }
                Ok(info)
            });
            let info = match answer {
                Ok(info) => info,
                Err(Error::Unimplemented(_)) if !polling => {
                    tracing::info!(pod = %self.pod_id, "pod monitor predates Events: polling it");
                    polling = true;
                    continue;
                }
                Err(e) => {
                    if !self.still_ready(&store) {
                        live.forget(&self.pod_id);
                        return;
                    }
                    let gone = !self.client.listening();
                    let msg = chain(&e);
                    let newly_gone = std::cell::Cell::new(false);
                    if !live.with(&self.pod_id, |p| {
                        if gone {
                            newly_gone.set(p.gone.is_none());
                            p.gone = Some(msg.clone());
                        } else {
                            p.silent = Some(msg.clone());
                        }
                    }) {
                        return;
                    }
                    // Released now, not at some later read: the pod's network and mounts are
                    // held until then, and a kubelet may not relist for a while.
                    if newly_gone.get() {
                        let _ = live.lost.send(self.pod_id.clone());
                    }
                    drop((live, store));
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            pause = Duration::from_millis(20);
            since = info.generation;
            // Only what changed since the last answer is written (a write transaction each).
            for s in &info.containers {
                if states.get(&s.id) == Some(s) {
                    continue;
                }
                // Read first: most answers change nothing the record lacks (the daemon wrote
                // Created and Running itself), and a write transaction waits for every other.
                let stale = match store.get::<ContainerRecord>(Table::Containers, &s.id) {
                    Ok(Some(mut c)) => c.pod_id == self.pod_id && apply_state(&mut c, s),
                    _ => false,
                };
                if !stale {
                    continue;
                }
                let pod_id = &self.pod_id;
                let exited = std::cell::Cell::new(false);
                let written = store.update(Table::Containers, &s.id, |c: &mut ContainerRecord| {
                    let was = c.state;
                    let changed = c.pod_id == *pod_id && apply_state(c, s);
                    exited.set(changed && was != c.state && c.state == ContainerState::Exited);
                    changed
                });
                match written {
                    Err(e) => {
                        tracing::warn!(pod = %self.pod_id, container = %s.id, error = %chain(&e), "recording a container's state")
                    }
                    Ok(_) if exited.get() => {
                        tracing::info!(pod = %self.pod_id, container = %s.id, code = s.exit_code, signal = s.signal, "container exit reported by its monitor")
                    }
                    Ok(_) => {}
                }
            }
            states = info
                .containers
                .iter()
                .map(|s| (s.id.clone(), s.clone()))
                .collect();
            let was_silent = std::cell::Cell::new(false);
            let watched = live.with(&self.pod_id, |p| {
                p.states = states.clone();
                was_silent.set(p.silent.take().is_some());
                p.gone = None;
                p.pid_ns_gone = info.pid_ns_gone;
            });
            if !watched {
                return;
            }
            if was_silent.get() {
                tracing::info!(pod = %self.pod_id, "pod monitor answers again");
            }
        }
    }

    /// The monitor's next answer. One that misses its deadline by more than the read
    /// deadline marks the pod silent (NotReady, logged) and is awaited on: a stopped monitor
    /// that resumes answers this same call at once.
    async fn next_answer(&self, since: u64) -> crate::error::Result<pb::InfoResponse> {
        let call = self
            .client
            .events(since, now_millis() + EVENTS_HOLD.as_millis() as i64);
        tokio::pin!(call);
        if let Ok(r) = tokio::time::timeout(EVENTS_HOLD + READ_DEADLINE, &mut call).await {
            return r;
        }
        let e = Error::DeadlineExceeded(format!(
            "pod monitor at {} did not answer within {} s",
            self.client.socket().display(),
            (EVENTS_HOLD + READ_DEADLINE).as_secs_f64()
        ));
        tracing::warn!(pod = %self.pod_id, error = %chain(&e), "pod monitor did not answer: pod reported not ready");
        let Some(live) = self.live.upgrade() else {
            return Err(e);
        };
        if !live.with(&self.pod_id, |p| p.silent = Some(chain(&e))) {
            return Err(e);
        }
        drop(live);
        call.await
    }

    /// Whether the pod's record still says Ready with this watcher's monitor.
    fn still_ready(&self, store: &Store) -> bool {
        matches!(
            store.get::<PodRecord>(Table::Pods, &self.pod_id),
            Ok(Some(p)) if p.state == PodState::Ready && p.monitor_pid == self.monitor_pid
        )
    }
}
