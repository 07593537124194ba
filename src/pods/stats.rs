//! The stats room: ContainerStats, ListContainerStats, PodSandboxStats and
//! ListPodSandboxStats, and the readings behind ListPodSandboxMetrics. Cgroup readings (with
//! CPU rates from the previous reading) and the disk use of a container's writable layer, read
//! off the async workers. The top room: it takes its views from the sandbox and container
//! rooms.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::AtFlags;
use nix::sys::stat::{FileStat, SFlag};

use hako_runtime::fsat::open_dir_nofollow;

use super::host::now_nanos;
use super::spec::pod_cgroup;
use super::{ContainerRecord, ContainerView, PodState, PodView, Runtime};
use crate::error::{Error, Result};

/// Resource usage of a container or pod, as the stats RPCs report it.
#[derive(Debug, Clone)]
pub struct Usage {
    pub timestamp: i64,
    pub sample: Option<hako_runtime::stats::Sample>,
    /// CPU use since the previous reading, in nanocores.
    pub nano_cores: Option<u64>,
    pub writable_bytes: u64,
    pub writable_inodes: u64,
    pub writable_mountpoint: PathBuf,
}

/// A pod's stats: its view, its cgroup's usage, its network's and its containers'.
pub struct PodStats {
    pub pod: PodView,
    /// The pod's cgroup (as the OCI spec names cgroups), which its usage is read from.
    pub cgroup: String,
    pub usage: Usage,
    /// The counters of the interfaces in the pod's network namespace (loopback aside); none
    /// for a pod on the host's network or when the namespace cannot be read.
    pub network: Option<Vec<NetCounters>>,
    pub containers: Vec<(ContainerView, Usage)>,
}

/// One interface's counters, from the kernel's `/proc/net/dev` as seen in the pod's netns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NetCounters {
    pub name: String,
    pub rx_bytes: u64,
    pub rx_packets: u64,
    pub rx_errors: u64,
    pub rx_dropped: u64,
    pub tx_bytes: u64,
    pub tx_packets: u64,
    pub tx_errors: u64,
    pub tx_dropped: u64,
}

/// Who a reading is for. The stats RPCs (kubelet's every few seconds) get CPU rates and the
/// writable layer's disk use; the metrics list (a scrape of `/metrics/cadvisor`) gets the
/// cgroups' detailed counters instead, and leaves the rates' previous readings alone, so that
/// a scrape between two stats lists does not shorten the window of their rate.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Purpose {
    Stats,
    Metrics,
}

/// Bounds of one walk of a writable layer. Its content is the container's to shape: millions
/// of entries, or a nesting deeper than the daemon's descriptors (one open directory per
/// level). Stats must stay cheap whatever it holds; past a bound the walk stops
/// and what it counted is reported (a lower bound).
#[derive(Debug, Clone, Copy)]
pub(super) struct WalkLimit {
    pub entries: u64,
    pub depth: usize,
    pub time: Duration,
}

/// A real layer of a million files is walked in well under a second with a warm cache; 64
/// levels hold 64 descriptors per walk, `USAGE_READS_AT_ONCE` walks at a time. Every
/// directory entry read counts (`.` and `..` too, and so does each read that fails).
const LAYER_WALK: WalkLimit = WalkLimit {
    entries: 1_000_000,
    depth: 64,
    time: Duration::from_secs(1),
};

/// Blocking tasks reading usage (cgroup files, a layer walk) at once for one list: the node
/// has few cores, and each walk holds descriptors.
const USAGE_READS_AT_ONCE: usize = 2;

/// What a walk counted: bytes of the blocks in use (each inode once, so hard links count
/// once), inodes, and the bound that stopped it, if one did.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct Walked {
    pub bytes: u64,
    pub inodes: u64,
    pub stopped: Option<&'static str>,
}

/// Last CPU reading per cgroup key (time, cumulative ns), for usage rates. Keys are container
/// ids and `pod/<id>`; each stats list forgets those of objects that are gone.
#[derive(Default)]
pub(super) struct CpuSamples(Mutex<HashMap<String, (i64, u64)>>);

impl CpuSamples {
    /// Records the reading `usage_ns` at `now` under `key`; the rate since the previous one,
    /// in nanocores.
    fn rate(&self, key: &str, now: i64, usage_ns: u64) -> Option<u64> {
        let mut m = self.0.lock().expect("cpu samples poisoned");
        let (t, u) = m.insert(key.to_string(), (now, usage_ns))?;
        let dt = (now - t) as f64;
        (dt > 0.0 && usage_ns >= u).then(|| ((usage_ns - u) as f64 * 1e9 / dt) as u64)
    }

    /// Keeps the readings of the `containers` and, when `pods` is given, of those pods (when
    /// not, every pod's): what is not in the lists just read was removed.
    fn keep_only(&self, pods: Option<&HashSet<&str>>, containers: &HashSet<&str>) {
        self.0
            .lock()
            .expect("cpu samples poisoned")
            .retain(|k, _| match k.strip_prefix("pod/") {
                Some(pod) => pods.is_none_or(|ps| ps.contains(pod)),
                None => containers.contains(k.as_str()),
            });
    }

    #[cfg(test)]
    fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.0.lock().unwrap().keys().cloned().collect();
        k.sort();
        k
    }
}

impl Runtime {
    /// ContainerStats.
    pub async fn container_stats(&self, id: &str) -> Result<(ContainerView, Usage)> {
        let v = self.container(id).await?;
        let u = self.container_usage(&v.record).await?;
        Ok((v, u))
    }

    /// ListContainerStats: the containers `keep` selects, with their usage. One round of
    /// monitor reads for all (see `survey`).
    pub async fn list_container_stats(
        &self,
        keep: impl Fn(&ContainerView) -> bool,
    ) -> Result<Vec<(ContainerView, Usage)>> {
        let all = self.containers().await?;
        self.prune_cpu_samples(None, &all);
        self.with_usage(
            all.into_iter().filter(|c| keep(c)).collect(),
            Purpose::Stats,
        )
        .await
    }

    /// PodSandboxStats.
    pub async fn pod_stats(&self, id: &str) -> Result<PodStats> {
        let pod = self.pod(id)?;
        let (pods, containers) = self.views_of(vec![Arc::new(pod)], true).await?;
        let pod = pods
            .into_iter()
            .next()
            .ok_or_else(|| Error::NotFound(format!("pod sandbox {id} not found")))?;
        let containers = containers
            .into_iter()
            .filter(|c| c.record.pod_id == pod.record.id)
            .collect();
        let mut stats = self
            .pods_with_usage(vec![pod], containers, Purpose::Stats)
            .await?;
        Ok(stats.remove(0))
    }

    /// ListPodSandboxStats: the pods `keep` selects, with their containers. One round of
    /// monitor reads for all.
    pub async fn list_pod_stats(&self, keep: impl Fn(&PodView) -> bool) -> Result<Vec<PodStats>> {
        self.list_pods_usage(keep, Purpose::Stats).await
    }

    /// Every ready pod with its containers, their cgroups read in detail (see [`Purpose`]),
    /// for ListPodSandboxMetrics. No CPU rates, no writable layer walks. A stopped sandbox is
    /// left out: its pod's cgroup is its replacement's too, and would count twice.
    pub async fn list_pod_metrics(&self) -> Result<Vec<PodStats>> {
        self.list_pods_usage(|p| p.state == PodState::Ready, Purpose::Metrics)
            .await
    }

    async fn list_pods_usage(
        &self,
        keep: impl Fn(&PodView) -> bool,
        purpose: Purpose,
    ) -> Result<Vec<PodStats>> {
        let (pods, containers) = self.views_of(self.pods()?, true).await?;
        if purpose == Purpose::Stats {
            self.prune_cpu_samples(Some(&pods), &containers);
        }
        let pods: Vec<PodView> = pods.into_iter().filter(|p| keep(p)).collect();
        let wanted: HashSet<&str> = pods.iter().map(|p| p.record.id.as_str()).collect();
        let containers: Vec<ContainerView> = containers
            .into_iter()
            .filter(|c| wanted.contains(c.record.pod_id.as_str()))
            .collect();
        self.pods_with_usage(pods, containers, purpose).await
    }

    /// The stats of `pods`, each with its own of `containers`. All cgroups are read in one
    /// round of at most `USAGE_READS_AT_ONCE` blocking tasks for the pods and one for the
    /// containers: a round per pod cost more in hand-offs than its reads.
    async fn pods_with_usage(
        &self,
        pods: Vec<PodView>,
        containers: Vec<ContainerView>,
        purpose: Purpose,
    ) -> Result<Vec<PodStats>> {
        let mut by_pod: HashMap<String, Vec<(ContainerView, Usage)>> = HashMap::new();
        for (c, u) in self.with_usage(containers, purpose).await? {
            by_pod
                .entry(c.record.pod_id.clone())
                .or_default()
                .push((c, u));
        }
        if pods.is_empty() {
            return Ok(Vec::new());
        }
        let share = pods.len().div_ceil(USAGE_READS_AT_ONCE);
        let tasks = pods.chunks(share).map(|chunk| {
            let jobs: Vec<(String, String, Option<String>)> = chunk
                .iter()
                .map(|p| {
                    let r = &p.record;
                    (r.id.clone(), pod_cgroup(r), r.namespaces.get("network").cloned())
                })
                .collect();
            blocking(move || {
                Ok(jobs
                    .into_iter()
                    .map(|(id, cgroup, netns)| {
                        // A pod has no process of its own for a stats reader to look through
                        // (kubelet's cAdvisor finds none): its network is read here, from its
                        // namespace.
                        let network = netns.and_then(|ns| match net_counters(Path::new(&ns)) {
                            Ok(n) => Some(n),
                            Err(e) => {
                                tracing::debug!(pod = %id, netns = %ns, error = %e, "no network stats");
                                None
                            }
                        });
                        let reading = cgroup_sample(&cgroup, purpose);
                        (cgroup, reading, network)
                    })
                    .collect::<Vec<_>>())
            })
        });
        let readings = futures::future::try_join_all(tasks).await?;
        Ok(pods
            .into_iter()
            .zip(readings.into_iter().flatten())
            .map(|(pod, (cgroup, (timestamp, sample), network))| {
                let key = format!("pod/{}", pod.record.id);
                let usage = Usage {
                    timestamp,
                    nano_cores: sample
                        .filter(|_| purpose == Purpose::Stats)
                        .and_then(|s| self.cpu_samples.rate(&key, timestamp, s.cpu_usage_ns)),
                    sample,
                    writable_bytes: 0,
                    writable_inodes: 0,
                    writable_mountpoint: PathBuf::new(),
                };
                let containers = by_pod.remove(&pod.record.id).unwrap_or_default();
                PodStats {
                    pod,
                    cgroup,
                    usage,
                    network,
                    containers,
                }
            })
            .collect())
    }

    /// Each view with its usage, in order. The readings run in at most
    /// `USAGE_READS_AT_ONCE` blocking tasks, each reading its share of the containers in turn:
    /// a task per container cost more in hand-offs between threads than its reads (a few
    /// hundred containers).
    async fn with_usage(
        &self,
        views: Vec<ContainerView>,
        purpose: Purpose,
    ) -> Result<Vec<(ContainerView, Usage)>> {
        if views.is_empty() {
            return Ok(Vec::new());
        }
        let share = views.len().div_ceil(USAGE_READS_AT_ONCE);
        let tasks = views.chunks(share).map(|chunk| {
            let jobs: Vec<(String, String, PathBuf)> = chunk
                .iter()
                .map(|v| {
                    let r = &v.record;
                    let upper = self.layer_dir(&r.id).join("upper");
                    (r.id.clone(), r.cgroups_path.clone(), upper)
                })
                .collect();
            blocking(move || {
                Ok(jobs
                    .iter()
                    .map(|(id, cgroup, upper)| read_usage(id, cgroup, upper, purpose))
                    .collect::<Vec<_>>())
            })
        });
        let readings = futures::future::try_join_all(tasks).await?;
        Ok(views
            .into_iter()
            .zip(readings.into_iter().flatten())
            .map(|(v, r)| {
                let u = self.usage_of(&v.record, r, purpose);
                (v, u)
            })
            .collect())
    }

    /// Current usage of a container: its cgroup and its writable layer, read off the async
    /// workers.
    async fn container_usage(&self, c: &ContainerRecord) -> Result<Usage> {
        let upper = self.layer_dir(&c.id).join("upper");
        let (cgroup, id) = (c.cgroups_path.clone(), c.id.clone());
        let reading =
            blocking(move || Ok(read_usage(&id, &cgroup, &upper, Purpose::Stats))).await?;
        Ok(self.usage_of(c, reading, Purpose::Stats))
    }

    /// A container's [`Reading`] as usage, its CPU rate from the reading before.
    fn usage_of(&self, c: &ContainerRecord, reading: Reading, purpose: Purpose) -> Usage {
        let Reading {
            timestamp,
            sample,
            walked,
        } = reading;
        if let Some(bound) = walked.stopped {
            tracing::info!(container = %c.id, bytes = walked.bytes, inodes = walked.inodes, bound, "writable layer walk stopped at a bound: its usage is a lower bound");
        }
        Usage {
            timestamp,
            nano_cores: sample
                .filter(|_| purpose == Purpose::Stats)
                .and_then(|s| self.cpu_samples.rate(&c.id, timestamp, s.cpu_usage_ns)),
            sample,
            writable_bytes: walked.bytes,
            writable_inodes: walked.inodes,
            writable_mountpoint: self.root_dir.join("containers"),
        }
    }

    /// Forgets the CPU readings of containers, and of pods when `pods` is given, that are not
    /// in the lists just read (removed since): the samples would otherwise only grow.
    fn prune_cpu_samples(&self, pods: Option<&[PodView]>, containers: &[ContainerView]) {
        let containers: HashSet<&str> = containers.iter().map(|c| c.record.id.as_str()).collect();
        let pods: Option<HashSet<&str>> =
            pods.map(|ps| ps.iter().map(|p| p.record.id.as_str()).collect());
        self.cpu_samples.keep_only(pods.as_ref(), &containers);
    }
}

/// Runs blocking reads (cgroup files, a directory walk) on the blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("stats task: {e}")))?
}

/// What one container's usage is read from.
struct Reading {
    timestamp: i64,
    sample: Option<hako_runtime::stats::Sample>,
    walked: Walked,
}

/// Reads a container's cgroup and, for the stats RPCs, walks its writable layer. Blocking.
fn read_usage(id: &str, cgroup: &str, upper: &Path, purpose: Purpose) -> Reading {
    let (timestamp, sample) = cgroup_sample(cgroup, purpose);
    if purpose == Purpose::Metrics {
        return Reading {
            timestamp,
            sample,
            walked: Walked::default(),
        };
    }
    let walked = match walk(upper, LAYER_WALK) {
        Ok(w) => w,
        Err(e) => {
            tracing::debug!(container = %id, layer = %upper.display(), error = %e, "writable layer not measured");
            Walked::default()
        }
    };
    Reading {
        timestamp,
        sample,
        walked,
    }
}

/// A cgroup's reading and its time; none when the cgroup cannot be read (gone, never made).
fn cgroup_sample(
    cgroups_path: &str,
    purpose: Purpose,
) -> (i64, Option<hako_runtime::stats::Sample>) {
    let now = now_nanos();
    let read = match purpose {
        Purpose::Stats => hako_runtime::stats::sample,
        Purpose::Metrics => hako_runtime::stats::sample_detailed,
    };
    match read(cgroups_path) {
        Ok(s) => (now, Some(s)),
        Err(e) => {
            tracing::debug!(cgroup = cgroups_path, error = %crate::error::chain(&e), "no cgroup stats");
            (now, None)
        }
    }
}

/// Interfaces reported per pod: the pod's own (`eth0`) and the first others the netns lists.
/// A pod with NET_ADMIN can make thousands, and each is eight metric series in kubelet's one
/// message of at most 16 MiB (and a stats entry).
pub const MAX_INTERFACES: usize = 16;

/// How much of `/proc/net/dev` is read: about 8000 interfaces' lines, past what any pod
/// network has, so that one with tens of thousands costs a bounded read.
const NET_DEV_READ_LIMIT: u64 = 1 << 20;

/// The counters of the interfaces in the network namespace bound at `netns`, loopback aside,
/// at most `MAX_INTERFACES` of them with the pod's own first. Read on a thread of its own that
/// joins the namespace and ends: /proc/thread-self/net/dev shows the reading thread's
/// namespace, and a pool thread must not be left in a pod's. Blocking.
pub(super) fn net_counters(netns: &Path) -> io::Result<Vec<NetCounters>> {
    use std::io::Read;
    let ns = File::open(netns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let mut text = Vec::new();
            File::open("/proc/thread-self/net/dev")?
                .take(NET_DEV_READ_LIMIT)
                .read_to_end(&mut text)?;
            Ok::<_, io::Error>(text)
        })
        .join()
        .map_err(|_| io::Error::other("the netns reader thread panicked"))?
    })
    // Interface names are bytes to the kernel: one that is not UTF-8 (a pod can make it) is
    // reported lossily rather than costing the pod its network readings.
    .map(|text| parse_net_dev(&String::from_utf8_lossy(&text)))
}

/// `/proc/net/dev`: two header lines, then `name: rx(bytes packets errs drop fifo frame
/// compressed multicast) tx(bytes packets errs drop fifo colls carrier compressed)`. The pod's
/// own interface first, then the others in the file's order, `MAX_INTERFACES` in all.
fn parse_net_dev(text: &str) -> Vec<NetCounters> {
    let mut out: Vec<NetCounters> = text
        .lines()
        .skip(2)
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|v| v.parse().ok())
                .collect::<Option<_>>()?;
            let name = name.trim();
            (f.len() >= 16 && name != "lo").then(|| NetCounters {
                name: name.to_string(),
                rx_bytes: f[0],
                rx_packets: f[1],
                rx_errors: f[2],
                rx_dropped: f[3],
                tx_bytes: f[8],
                tx_packets: f[9],
                tx_errors: f[10],
                tx_dropped: f[11],
            })
        })
        .collect();
    // A stable sort: the others keep the file's order behind it.
    out.sort_by_key(|n| n.name != crate::network::IFNAME);
    out.truncate(MAX_INTERFACES);
    out
}

/// The disk use of the tree at `root`, within `limit`. Never follows a symlink: one counts as
/// itself, and every directory is opened relative to its parent with O_NOFOLLOW, so a
/// directory swapped for a symlink during the walk fails to open instead of leading out of
/// the layer. Entries that vanish or cannot be read are skipped. Blocking.
pub(super) fn walk(root: &Path, limit: WalkLimit) -> io::Result<Walked> {
    let until = Instant::now() + limit.time;
    let mut seen = HashSet::new();
    let mut w = Walked::default();
    let mut count = |st: &FileStat, w: &mut Walked| {
        if seen.insert((st.st_dev, st.st_ino)) {
            w.bytes += st.st_blocks as u64 * 512;
            w.inodes += 1;
        }
    };
    let top = open_dir_nofollow(None::<&File>, root.as_os_str())?;
    count(&nix::sys::stat::fstat(top.as_raw_fd())?, &mut w);
    // One open directory, read through its own descriptor, per level of the current path.
    let mut stack = vec![listing(top)?];
    let mut visited = 0u64;
    loop {
        let depth = stack.len();
        let Some(dir) = stack.last_mut() else {
            break;
        };
        if visited >= limit.entries {
            w.stopped = Some("entries");
            break;
        }
        if Instant::now() >= until {
            w.stopped = Some("time");
            break;
        }
        visited += 1;
        // A directory that cannot be read on ends its listing: readdir would give the same
        // error again on every call (a failing disk), and the walk would never end.
        let Some(Ok(entry)) = dir.next() else {
            stack.pop();
            continue;
        };
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let Ok(st) =
            nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        else {
            continue;
        };
        count(&st, &mut w);
        if st.st_mode & SFlag::S_IFMT.bits() != SFlag::S_IFDIR.bits() {
            continue;
        }
        if depth >= limit.depth {
            w.stopped = Some("depth");
            continue;
        }
        let name = std::ffi::OsStr::from_bytes(name.to_bytes());
        let Ok(child) = open_dir_nofollow(Some(&*dir), name) else {
            continue;
        };
        if let Ok(l) = listing(child) {
            stack.push(l);
        }
    }
    Ok(w)
}

/// The entries of an open directory, read through that descriptor (no path walk).
fn listing(dir: File) -> io::Result<nix::dir::OwningIter> {
    Ok(nix::dir::Dir::from(dir)?.into_iter())
}

#[cfg(test)]
mod tests {
    use super::*;

    const WIDE: WalkLimit = WalkLimit {
        entries: u64::MAX,
        depth: usize::MAX,
        time: Duration::from_secs(3600),
    };

    /// A layer with a directory, two files and a hard link between them.
    fn layer() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("dir")).unwrap();
        std::fs::write(d.path().join("dir/a"), vec![1u8; 64 << 10]).unwrap();
        std::fs::write(d.path().join("b"), vec![2u8; 16 << 10]).unwrap();
        std::fs::hard_link(d.path().join("b"), d.path().join("dir/b-again")).unwrap();
        d
    }

    #[test]
    fn the_walk_counts_blocks_and_inodes_once() {
        let d = layer();
        let w = walk(d.path(), WIDE).unwrap();
        // The root, dir, a, b (its second name is the same inode).
        assert_eq!(w.inodes, 4, "{w:?}");
        assert!(w.bytes >= (64 + 16) << 10, "{w:?}");
        assert_eq!(w.stopped, None);
    }

    #[test]
    fn the_walk_follows_no_symlink() {
        // Bounded, so that a walk that does follow them ends (and fails here) instead of
        // walking the host.
        const WIDE: WalkLimit = WalkLimit {
            entries: 100_000,
            depth: 64,
            time: Duration::from_secs(20),
        };
        let d = layer();
        let before = walk(d.path(), WIDE).unwrap();
        // A big directory beside the layer, and the host's root, each behind a symlink.
        let big = tempfile::tempdir().unwrap();
        for i in 0..50 {
            std::fs::write(big.path().join(i.to_string()), vec![3u8; 64 << 10]).unwrap();
        }
        std::os::unix::fs::symlink(big.path(), d.path().join("big")).unwrap();
        std::os::unix::fs::symlink("/", d.path().join("dir/root")).unwrap();
        let after = walk(d.path(), WIDE).unwrap();
        // Each symlink counts as itself (a fast symlink: an inode, no block).
        assert_eq!(after.inodes, before.inodes + 2, "{after:?}");
        assert!(
            after.bytes < before.bytes + (64 << 10),
            "{after:?} {before:?}"
        );
        assert_eq!(after.stopped, None);
        // A layer root that is itself a symlink is not walked.
        let link = big.path().join("layer-link");
        std::os::unix::fs::symlink(d.path(), &link).unwrap();
        assert!(walk(&link, WIDE).is_err());
    }

    #[test]
    fn a_bounded_walk_stops_and_reports_what_it_counted() {
        let d = tempfile::tempdir().unwrap();
        for i in 0..100 {
            std::fs::write(d.path().join(i.to_string()), b"x").unwrap();
        }
        let w = walk(
            d.path(),
            WalkLimit {
                entries: 10,
                ..WIDE
            },
        )
        .unwrap();
        assert_eq!(w.stopped, Some("entries"));
        // The root and the ten entries visited.
        assert_eq!(w.inodes, 11, "{w:?}");
        let w = walk(
            d.path(),
            WalkLimit {
                time: Duration::ZERO,
                ..WIDE
            },
        )
        .unwrap();
        assert_eq!((w.stopped, w.inodes), (Some("time"), 1));
        // Walked two levels deep (the root's and 1's entries): 2 is counted, not entered.
        let deep = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(deep.path().join("1/2/3")).unwrap();
        std::fs::write(deep.path().join("1/2/3/f"), b"x").unwrap();
        let w = walk(deep.path(), WalkLimit { depth: 2, ..WIDE }).unwrap();
        assert_eq!((w.stopped, w.inodes), (Some("depth"), 3), "{w:?}");
        assert_eq!(walk(deep.path(), WIDE).unwrap().inodes, 5);
    }

    #[test]
    fn net_dev_counters_are_parsed_and_loopback_left_out() {
        let text = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     140       2    0    0    0     0          0         0      140       2    0    0    0     0       0          0
  eth0:    1706      19    3    2    0     0          0         0     1052      12    4    1    0     0       0          0
";
        assert_eq!(
            parse_net_dev(text),
            [NetCounters {
                name: "eth0".into(),
                rx_bytes: 1706,
                rx_packets: 19,
                rx_errors: 3,
                rx_dropped: 2,
                tx_bytes: 1052,
                tx_packets: 12,
                tx_errors: 4,
                tx_dropped: 1,
            }]
        );
    }

    #[test]
    fn net_dev_keeps_the_pods_interface_and_a_bounded_number_of_others() {
        let line = |n: &str| format!("{n}: 1 2 3 4 0 0 0 0 5 6 7 8 0 0 0 0\n");
        let mut text = String::from("h1\nh2\n");
        for i in 0..40 {
            text.push_str(&line(&format!("d{i}")));
        }
        text.push_str(&line("eth0"));
        let got = parse_net_dev(&text);
        assert_eq!(got.len(), MAX_INTERFACES);
        assert_eq!(got[0].name, "eth0");
        assert_eq!((got[1].name.as_str(), got[2].name.as_str()), ("d0", "d1"));
        // A name the kernel holds as bytes that are not UTF-8 costs only its own spelling.
        let raw = [
            b"h1\nh2\n".as_slice(),
            b"\xff\xfe: 1 2 3 4 0 0 0 0 5 6 7 8 0 0 0 0\n",
        ]
        .concat();
        let got = parse_net_dev(&String::from_utf8_lossy(&raw));
        assert_eq!((got.len(), got[0].rx_bytes), (1, 1));
    }

    #[test]
    fn net_counters_are_read_in_the_namespace_not_the_callers() {
        // This process's own namespace, through a path as a pod's bind mount would be: what is
        // read must be that namespace's interfaces, and the calling thread stays where it was.
        let before = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        let got = net_counters(Path::new("/proc/self/ns/net")).unwrap();
        let want = parse_net_dev(&std::fs::read_to_string("/proc/self/net/dev").unwrap());
        let names = |v: &[NetCounters]| v.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want));
        assert_eq!(
            std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
            before
        );
        assert!(net_counters(Path::new("/nonexistent/netns")).is_err());
    }

    #[test]
    fn cpu_rates_come_from_two_readings_and_gone_objects_are_forgotten() {
        let s = CpuSamples::default();
        assert_eq!(
            s.rate("a", 1_000_000_000, 0),
            None,
            "one reading is no rate"
        );
        // Half a core: 0.5 s of CPU in 1 s.
        assert_eq!(s.rate("a", 2_000_000_000, 500_000_000), Some(500_000_000));
        for k in ["b", "pod/p", "pod/q"] {
            s.rate(k, 1, 1);
        }
        // A container list: containers not in it go, pods stay.
        s.keep_only(None, &HashSet::from(["a"]));
        assert_eq!(s.keys(), ["a", "pod/p", "pod/q"]);
        // A pod list too: pods not in it go.
        s.keep_only(Some(&HashSet::from(["q"])), &HashSet::from(["a"]));
        assert_eq!(s.keys(), ["a", "pod/q"]);
    }
}
