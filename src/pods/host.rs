//! What the pods rooms ask of the host kernel directly: cgroups (kill, remove), the
//! oom_score_adj floor, processes and directories. The bottom room: it knows no record,
//! no store and no `Runtime` (only how to name a pod's monitor through its socket).

use std::path::{Path, PathBuf};

use super::monitor_client::MonitorClient;

pub(crate) fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Whether containers must not get a lower oom_score_adj than ours: asked for, or forced
/// because without CAP_SYS_RESOURCE the kernel refuses to lower it.
pub(super) fn oom_floor(restrict: bool, caps: &[String]) -> Option<i32> {
    let forced = !caps.iter().any(|c| c == "CAP_SYS_RESOURCE");
    if !(restrict || forced) {
        return None;
    }
    let own = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    if forced && !restrict {
        tracing::warn!(
            floor = own,
            "no CAP_SYS_RESOURCE: container oom_score_adj is clamped to the daemon's own"
        );
    }
    Some(own)
}

/// SIGKILLs a pod's monitor, found as the process listening on the pod's monitor socket (in
/// `pod_dir`): no command line is read and no other process can pass for it. The pod's init
/// dies with its monitor (PR_SET_PDEATHSIG, see hako_runtime's infra), and containers'
/// processes are in their cgroups, which the callers kill ([`kill_cgroup`]).
pub(super) fn kill_pod_processes(pod_dir: &Path) {
    let client = MonitorClient::new(pod_dir.join("monitor.sock"));
    let Some(pid) = client.listener_pid() else {
        return;
    };
    // Held through a pidfd, then checked to be the listener still: a pid reused in between
    // would not be.
    let Some(fd) = super::monitor_client::Pidfd::open(pid) else {
        return;
    };
    if client.listener_pid() != Some(pid) {
        return;
    }
    tracing::warn!(pod_dir = %pod_dir.display(), pid, "killing a pod monitor that did not shut down");
    fd.kill();
}

/// The names of the directories in `dir` (none when it does not exist).
pub(super) fn dir_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Waits, at most `limit`, for the monitor `pid` to be gone (exited; a zombie counts), as
/// [`monitor_alive`] sees it. Woken by the exit itself through a pidfd, so a stop does not
/// pay half a polling period on average; polled every 10 ms where pidfds are missing.
pub(super) async fn monitor_gone(pid: u32, limit: std::time::Duration) {
    if !monitor_alive(pid) {
        return;
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd >= 0 {
        // SAFETY: the syscall just returned this fd; nothing else owns it.
        let fd =
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        // A pidfd polls readable once its process has exited.
        // SAFETY: an OwnedFd is valid and stays the same fd until the AsyncFd drops it.
        let exit = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        };
        if let Ok(exit) = exit {
            let _ = tokio::time::timeout(limit, exit.readable()).await;
            return;
        }
    }
    let deadline = tokio::time::Instant::now() + limit;
    while monitor_alive(pid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Whether process `pid` still runs (exists and is not a zombie). Only for waiting on a
/// monitor known to be `pid` (it was the listener on its pod's socket) to finish exiting;
/// whether some pid is a given pod's monitor is [`MonitorClient::listener_pid`]'s to say.
pub(super) fn monitor_alive(pid: u32) -> bool {
    // The state is the field after the parenthesised command name.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| !matches!(state, "Z" | "X"))
    })
}

/// Where a container's cgroup may be: v1's pids and memory hierarchies (every process is in
/// both when they are mounted), the v2 hierarchy of a hybrid host, or a pure v2 one.
const CGROUP_BASES: [&str; 4] = [
    "/sys/fs/cgroup/pids",
    "/sys/fs/cgroup/memory",
    "/sys/fs/cgroup/unified",
    "/sys/fs/cgroup",
];

/// The processes of a container's cgroup and of the cgroups below it (a privileged container
/// may make its own), from every hierarchy that may hold them.
fn cgroup_pids(cgroups_path: &str) -> Vec<i32> {
    let rel = cgroups_path.trim_start_matches('/');
    if rel.is_empty() {
        // The root cgroup is the whole node, never a container's.
        return Vec::new();
    }
    let mut pids = Vec::new();
    for dir in CGROUP_BASES
        .iter()
        .flat_map(|b| cgroup_tree(&Path::new(b).join(rel)))
    {
        let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) else {
            continue;
        };
        // pid 0 would signal the daemon's own process group.
        pids.extend(
            procs
                .lines()
                .filter_map(|l| l.trim().parse::<i32>().ok())
                .filter(|p| *p > 0),
        );
    }
    pids
}

/// A cgroup directory and every cgroup below it, parents first; only directories of a cgroup
/// filesystem (a privileged container could mount something else below its cgroup, with a
/// `cgroup.procs` of its choosing).
fn cgroup_tree(top: &Path) -> Vec<PathBuf> {
    use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
    let on_cgroupfs = |d: &Path| {
        statfs(d).is_ok_and(|s| {
            s.filesystem_type() == CGROUP_SUPER_MAGIC || s.filesystem_type() == CGROUP2_SUPER_MAGIC
        })
    };
    let mut found = Vec::new();
    let mut stack = vec![top.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if !on_cgroupfs(&dir) {
            continue;
        }
        stack.extend(
            std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path()),
        );
        found.push(dir);
    }
    found
}

/// SIGKILLs every process in a container's cgroup (v1 controllers or v2).
pub(super) fn kill_cgroup(cgroups_path: &str) {
    kill_all(&cgroup_pids(cgroups_path));
}

fn kill_all(pids: &[i32]) {
    for pid in pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// Thaws a container's cgroup: a monitor killed in the middle of a kill through the cgroup
/// can leave it frozen, and on cgroup v1 a frozen process does not die of SIGKILL until thawed.
fn thaw_cgroup(cgroups_path: &str) {
    let rel = cgroups_path.trim_start_matches('/');
    if rel.is_empty() {
        return;
    }
    // Below it too: a cgroup that froze itself stays frozen when its parent thaws.
    for dir in cgroup_tree(&Path::new("/sys/fs/cgroup/freezer").join(rel)) {
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
    }
    for base in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        for dir in cgroup_tree(&Path::new(base).join(rel)) {
            let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        }
    }
}

/// Lifts the CPU quota of a container's cgroup that is being emptied: a process dies only once
/// it runs its exit, which a quota already used up (a busy container with a tight limit) puts
/// off to the next period, a second or more later. Left set, the cgroup outlives its removal.
pub(super) fn lift_cpu_quota(cgroups_path: &str) {
    let rel = cgroups_path.trim_start_matches('/');
    if rel.is_empty() {
        return;
    }
    let _ = std::fs::write(
        Path::new("/sys/fs/cgroup/cpu")
            .join(rel)
            .join("cpu.cfs_quota_us"),
        "-1",
    );
    for base in ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"] {
        let _ = std::fs::write(Path::new(base).join(rel).join("cpu.max"), "max");
    }
}

/// SIGKILLs a container's cgroup (thawed and its CPU quota lifted first) until no process is
/// left in it, for up to two seconds; whether it emptied (a process in uninterruptible sleep
/// can outlast that).
pub(super) async fn end_cgroup(cgroups_path: &str) -> bool {
    // One reading of the cgroups per round: 100 rounds of SIGKILL 20 ms apart.
    for round in 0..=100 {
        let pids = cgroup_pids(cgroups_path);
        if pids.is_empty() {
            return true;
        }
        if round == 100 {
            break;
        }
        if round == 0 {
            thaw_cgroup(cgroups_path);
            lift_cpu_quota(cgroups_path);
        }
        kill_all(&pids);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    false
}

/// The ids of the container cgroups (`hako-<id>`) under a pod's cgroup, in any hierarchy.
pub(super) fn container_cgroup_ids(pod_cgroup: &str) -> std::collections::BTreeSet<String> {
    let rel = pod_cgroup.trim_start_matches('/');
    let mut bases: Vec<PathBuf> = std::fs::read_dir("/sys/fs/cgroup")
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    bases.push(PathBuf::from("/sys/fs/cgroup"));
    let mut ids = std::collections::BTreeSet::new();
    for base in bases {
        for e in std::fs::read_dir(base.join(rel))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_prefix("hako-") {
                if e.path().is_dir() {
                    ids.insert(id.to_string());
                }
            }
        }
    }
    ids
}

/// Kills and removes the container cgroups `hako-<id>` of `ids` under a pod's cgroup: ones no
/// record names any more (see `Runtime::remove_leftover_container_cgroups`).
pub(super) async fn remove_container_cgroups(pod_cgroup: &str, ids: &[String]) {
    let rel = pod_cgroup.trim_start_matches('/');
    for id in ids {
        let path = format!("/{rel}/hako-{id}");
        tracing::warn!(cgroup = %path, "removing the cgroup of a container whose create did not finish");
        end_cgroup(&path).await;
        remove_cgroup(&path);
    }
}

/// Removes an empty cgroup from every hierarchy it exists in; true when none is left.
pub(super) fn remove_cgroup(cgroups_path: &str) -> bool {
    let rel = cgroups_path.trim_start_matches('/');
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return true;
    };
    let mut bases: Vec<PathBuf> = hierarchies.flatten().map(|e| e.path()).collect();
    bases.push(PathBuf::from("/sys/fs/cgroup"));
    let mut all_gone = true;
    for base in bases {
        let p = base.join(rel);
        if p.is_dir() && std::fs::remove_dir(&p).is_err() {
            all_gone = false;
        }
    }
    all_gone
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_for_a_monitor_ends_when_it_has_exited() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        // Reaped by this thread once it is a zombie; monitor_alive counts a zombie as gone.
        let killer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            child.kill().unwrap();
            child.wait().unwrap();
        });
        assert!(monitor_alive(pid));
        monitor_gone(pid, std::time::Duration::from_secs(60)).await;
        assert!(!monitor_alive(pid), "returned while {pid} still ran");
        killer.join().unwrap();
        // A process already gone: at once.
        monitor_gone(pid, std::time::Duration::from_secs(60)).await;
    }
}
