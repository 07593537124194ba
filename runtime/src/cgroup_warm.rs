//! Takes the kernel's cgroup-migration lock ahead of a container create. (Not for ExecSync:
//! exec probes are steady load, and the warm lock slows every fork and exit on the node — see
//! `benches/cgroup_warm.rs` and docs/BENCHMARKS.md.)
//!
//! Every write to a `cgroup.procs` file (cgroup v1 and v2 alike) takes the global
//! `cgroup_threadgroup_rwsem` for writing. When nothing migrated in the last few
//! milliseconds that lock is in its reader-fast mode, and switching it costs one RCU grace
//! period: 5–25 ms measured on this project's machines, spent inside libcontainer's
//! intermediate process as it joins the container's cgroups. The lock stays in writer mode
//! for one more grace period after the last writer. So a no-op migration (the daemon into
//! the cgroup it is already in) started in parallel when a CreateContainer
//! arrives pays that grace period while the spec is written and libcontainer prepares, and
//! repeated every 2 ms for as long as such a call is under way (a [`Hold`] is alive) it keeps
//! the lock in writer mode, so the container's own migration finds it ready whenever it
//! comes.
//!
//! A RunPodSandbox takes a hold too, kept until the pod's first CreateContainer is done (at
//! most 1 s): kubelet creates the pod's containers right after it, so that create finds the
//! lock ready instead of paying the rest of a grace period.
//!
//! Costs: one thread while calls are under way, a no-op write every 2 ms; meanwhile forks and
//! exits on the node take the lock's slower reader path, as they do whenever anything
//! migrates between cgroups. Best effort: a failed write (even a refused one took the lock)
//! is ignored.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static HOLDS: AtomicUsize = AtomicUsize::new(0);
static RUNNING: AtomicBool = AtomicBool::new(false);

/// Keeps the lock warm while alive.
pub struct Hold(());

impl Drop for Hold {
    fn drop(&mut self) {
        HOLDS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Starts warming (unless already under way) and keeps it up until the returned hold, and
/// every other, is dropped; a call that never ends stops it after 10 s.
pub fn hold() -> Hold {
    HOLDS.fetch_add(1, Ordering::AcqRel);
    if !RUNNING.swap(true, Ordering::AcqRel) {
        let spawned = std::thread::Builder::new()
            .name("cgroup-warm".into())
            .spawn(warm_while_held);
        if spawned.is_err() {
            RUNNING.store(false, Ordering::Release);
        }
    }
    Hold(())
}

fn warm_while_held() {
    let started = Instant::now();
    loop {
        if let Some(procs) = own_procs_file() {
            let _ = std::fs::write(procs, std::process::id().to_string());
        }
        if started.elapsed() > Duration::from_secs(10) {
            RUNNING.store(false, Ordering::Release);
            return;
        }
        if HOLDS.load(Ordering::Acquire) == 0 {
            RUNNING.store(false, Ordering::Release);
            // A hold taken between the check and the store found RUNNING set and left the
            // warming to this thread: take it back unless another thread did.
            if HOLDS.load(Ordering::Acquire) == 0 || RUNNING.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The `cgroup.procs` of the cgroup this process is in, read now (the daemon may be moved):
/// the cgroup v2 one when a v2 hierarchy is mounted (pure v2 or hybrid), else a v1 one.
fn own_procs_file() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    candidates(&text).into_iter().find(|p| p.exists())
}

fn candidates(proc_self_cgroup: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if controllers.is_empty() {
            for mount in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
                out.insert(0, PathBuf::from(mount).join(rel).join("cgroup.procs"));
            }
        } else {
            let dir = controllers.strip_prefix("name=").unwrap_or(controllers);
            out.push(
                PathBuf::from("/sys/fs/cgroup")
                    .join(dir)
                    .join(rel)
                    .join("cgroup.procs"),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_comes_first_then_v1_hierarchies() {
        let hybrid = "2:cpu,cpuacct:/a\n1:name=systemd:/b\n0::/c\n";
        let c = candidates(hybrid);
        assert_eq!(c[0], PathBuf::from("/sys/fs/cgroup/c/cgroup.procs"));
        assert_eq!(c[1], PathBuf::from("/sys/fs/cgroup/unified/c/cgroup.procs"));
        assert_eq!(
            c[2],
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/a/cgroup.procs")
        );
        assert_eq!(c[3], PathBuf::from("/sys/fs/cgroup/systemd/b/cgroup.procs"));
        assert!(candidates("garbage").is_empty());
    }

    #[test]
    fn this_process_has_a_procs_file_listing_it() {
        let procs = own_procs_file().expect("a mounted cgroup hierarchy");
        let listed = std::fs::read_to_string(&procs).unwrap();
        assert!(
            listed
                .lines()
                .any(|l| l.trim() == std::process::id().to_string()),
            "{} does not list this process",
            procs.display()
        );
    }
}
