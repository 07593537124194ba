//! A container's cgroup (v1, hybrid and v2): usage readings, read from the few files they
//! come from, and resource limits changed while it runs, through libcgroups.
//!
//! Why readings do not go through libcgroups: its manager finds each controller's mount by
//! parsing /proc/self/mountinfo again, once per controller, every time one is made, and a
//! node's mountinfo grows with its pods (overlays, namespace pins). At 250 pods a
//! ListContainerStats spent over a second there. The mounts are found once here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libcgroups::common::{create_cgroup_manager, CgroupConfig, CgroupManager, ControllerOpt};

use crate::error::{BoxError, Error, Result};

/// One reading of a cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sample {
    /// Cumulative CPU time, nanoseconds.
    pub cpu_usage_ns: u64,
    pub memory_usage: u64,
    /// Usage minus inactive file cache: what the kubelet's eviction looks at.
    pub working_set: u64,
    pub rss: u64,
    pub page_faults: u64,
    pub major_page_faults: u64,
    pub pids: u64,
    /// The cgroup's memory limit; None when unlimited (or the memory controller is absent).
    pub memory_limit: Option<u64>,
    /// Pressure stall information of the cgroup's CPU, memory and IO (`*.pressure`): cgroup v2
    /// only, and None where the kernel keeps none (v1, or PSI off).
    pub cpu_psi: Option<Psi>,
    pub memory_psi: Option<Psi>,
    pub io_psi: Option<Psi>,
    /// What only the metrics list reads ([`sample_detailed`]); None in a plain [`sample`].
    pub detail: Option<Detail>,
}

/// Readings the metrics list (ListPodSandboxMetrics, kubelet's `/metrics/cadvisor`) reports
/// beyond the stats RPCs. They take more files (five more on v1), read only when asked for:
/// kubelet lists stats every few seconds, metrics when scraped.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Detail {
    pub cpu_user_ns: u64,
    pub cpu_system_ns: u64,
    /// CFS bandwidth control: enforcement periods elapsed, those throttled, time throttled.
    pub cfs_periods: u64,
    pub cfs_throttled_periods: u64,
    pub cfs_throttled_ns: u64,
    /// Page cache, and the part of it mapped into processes.
    pub cache: u64,
    pub mapped_file: u64,
    pub swap: u64,
    /// The highest usage seen (v1 `max_usage_in_bytes`, v2 `memory.peak`); None where the
    /// kernel keeps none (v2 before 5.19).
    pub max_usage: Option<u64>,
    /// Times usage hit the limit (v1 `memory.failcnt`, v2 `memory.events` max).
    pub limit_hits: u64,
    /// Processes the OOM killer ended in this cgroup (`oom_kill` of v1 `memory.oom_control`,
    /// v2 `memory.events`).
    pub oom_kills: u64,
    /// Page faults of the cgroup's own tasks, children left out (v1 keeps both counts; on v2
    /// these equal the sample's hierarchical ones).
    pub own_page_faults: u64,
    pub own_major_page_faults: u64,
}

/// A cgroup's `<resource>.pressure`: the share of time some or all of its tasks stalled.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Psi {
    pub some: PsiLine,
    pub full: PsiLine,
}

/// One line of a pressure file: averages in percent over 10, 60 and 300 s, and the total
/// stall time (the file's microseconds, in nanoseconds here as the CRI counts it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PsiLine {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    pub total_ns: u64,
}

/// Parses a pressure file (`some avg10=0.00 avg60=0.00 avg300=0.00 total=0`, then `full`);
/// None when it has neither line or a field does not parse.
fn parse_psi(text: &str) -> Option<Psi> {
    let mut psi = Psi::default();
    let mut seen = false;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let to = match fields.next() {
            Some("some") => &mut psi.some,
            Some("full") => &mut psi.full,
            _ => continue,
        };
        // A field this does not know (a later kernel's) is skipped, not a reason to drop
        // the file; one it knows must parse.
        for (k, v) in fields.filter_map(|kv| kv.split_once('=')) {
            match k {
                "avg10" => to.avg10 = v.parse().ok()?,
                "avg60" => to.avg60 = v.parse().ok()?,
                "avg300" => to.avg300 = v.parse().ok()?,
                "total" => to.total_ns = v.parse::<u64>().ok()?.saturating_mul(1000),
                _ => {}
            }
        }
        seen = true;
    }
    seen.then_some(psi)
}

/// The pressure file `name` in `dir`; None when it cannot be read (absent, or PSI disabled,
/// where the kernel refuses the read): a reading without pressure, not a failed one.
fn read_psi(dir: &Path, name: &str) -> Option<Psi> {
    read_small(&dir.join(name)).ok().and_then(|t| parse_psi(&t))
}

/// v1 writes "no limit" as the largest page multiple (`9223372036854771712` with 4 KiB
/// pages); values above this are that (kubelet's cAdvisor path uses the same bound).
const V1_UNLIMITED: u64 = 1 << 62;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Whether the cgroup at `cgroups_path` exists under `root`: the directory itself on cgroup
/// v2, or in any of the usual v1 hierarchies.
pub fn cgroup_exists(root: &Path, cgroups_path: &str) -> bool {
    let rel = cgroups_path.trim_start_matches('/');
    if root.join("cgroup.controllers").exists() {
        return root.join(rel).is_dir();
    }
    ["memory", "cpu", "cpuacct", "pids", "unified"]
        .iter()
        .any(|h| root.join(h).join(rel).is_dir())
}

/// The error for a failed cgroup operation: [`Error::CgroupNotFound`] when the cgroup is not
/// there (libcgroups keeps that cause in its message only), else `op`'s own variant.
fn cgroup_error(
    cgroups_path: &str,
    source: impl Into<BoxError>,
    op: fn(String, BoxError) -> Error,
) -> Error {
    if cgroup_exists(Path::new(CGROUP_ROOT), cgroups_path) {
        op(cgroups_path.to_string(), source.into())
    } else {
        Error::CgroupNotFound {
            path: cgroups_path.to_string(),
        }
    }
}

fn read_error(path: String, source: BoxError) -> Error {
    Error::CgroupRead { path, source }
}

fn update_error(path: String, source: BoxError) -> Error {
    Error::CgroupUpdate { path, source }
}

fn manager(
    cgroups_path: &str,
    op: fn(String, BoxError) -> Error,
) -> Result<libcgroups::common::AnyCgroupManager> {
    create_cgroup_manager(CgroupConfig {
        cgroup_path: PathBuf::from(cgroups_path),
        systemd_cgroup: false,
        container_name: String::new(),
    })
    .map_err(|e| cgroup_error(cgroups_path, e, op))
}

/// Where the controllers a reading needs are mounted.
#[derive(Debug, Clone, PartialEq)]
enum Layout {
    /// Pure cgroup v2: one hierarchy.
    V2(PathBuf),
    /// v1 or hybrid (libcontainer puts containers in the v1 hierarchies there): the
    /// hierarchies of `cpu`, `cpuacct`, `memory` and `pids`, those mounted.
    V1(HashMap<String, PathBuf>),
}

/// The node's layout, found at the first reading (cgroup mounts do not move under a running
/// node; libcontainer relies on the same).
fn layout() -> &'static Layout {
    static LAYOUT: OnceLock<Layout> = OnceLock::new();
    LAYOUT.get_or_init(|| {
        let root = Path::new(CGROUP_ROOT);
        if root.join("cgroup.controllers").exists() {
            return Layout::V2(root.to_path_buf());
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        Layout::V1(v1_mounts(&mountinfo))
    })
}

/// The mount point of each v1 controller a reading uses, from mountinfo's text: the
/// `cgroup` mounts, by the controllers in their super options (`rw,cpu,cpuacct`).
fn v1_mounts(mountinfo: &str) -> HashMap<String, PathBuf> {
    let mut found = HashMap::new();
    for line in mountinfo.lines() {
        // ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS
        let Some((head, tail)) = line.split_once(" - ") else {
            continue;
        };
        let mut tail = tail.split(' ');
        let (Some("cgroup"), Some(_), Some(opts)) = (tail.next(), tail.next(), tail.next()) else {
            continue;
        };
        let Some(mount_point) = head.split(' ').nth(4) else {
            continue;
        };
        for c in opts.split(',') {
            if matches!(c, "cpu" | "cpuacct" | "memory" | "pids") {
                // The first mount of a hierarchy is the one libcontainer uses too.
                found
                    .entry(c.to_string())
                    .or_insert_with(|| PathBuf::from(unescape_mountinfo(mount_point)));
            }
        }
    }
    found
}

/// mountinfo writes space, tab, newline and backslash in paths as octal escapes (`\040`).
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|d| (b'0'..=b'7').contains(d))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads the cgroup at `cgroups_path` (as in the OCI spec, e.g. `/kubepods/pod1/hako-<id>`).
pub fn sample(cgroups_path: &str) -> Result<Sample> {
    read_sample(layout(), cgroups_path, false)
        .map_err(|e| cgroup_error(cgroups_path, e, read_error))
}

/// As [`sample`], with its [`Detail`].
pub fn sample_detailed(cgroups_path: &str) -> Result<Sample> {
    read_sample(layout(), cgroups_path, true).map_err(|e| cgroup_error(cgroups_path, e, read_error))
}

/// One reading under `layout`. A controller whose file is absent counts 0 (a v2 cgroup whose
/// parent does not delegate it, a v1 node without a pids hierarchy), as libcgroups reads only
/// what is enabled; a cgroup that is not there at all is an error.
fn read_sample(layout: &Layout, cgroups_path: &str, detailed: bool) -> std::io::Result<Sample> {
    let rel = cgroups_path.trim_start_matches('/');
    let mut psi = [None; 3];
    let mut detail = None;
    let (cpu_usage_ns, usage, stat, pids, memory_limit) = match layout {
        Layout::V2(root) => {
            let dir = root.join(rel);
            psi = ["cpu.pressure", "memory.pressure", "io.pressure"].map(|f| read_psi(&dir, f));
            // cpu.stat's usage_usec is there whether or not the cpu controller is enabled.
            let cpu = read_small(&dir.join("cpu.stat"))?;
            let usec = stat_value(&cpu, "usage_usec").unwrap_or(0);
            if detailed {
                detail = detail_or_none(cgroups_path, v2_detail(&dir, &cpu));
            }
            (
                usec.saturating_mul(1000),
                read_u64(&dir.join("memory.current"))?,
                read_optional(&dir.join("memory.stat"))?,
                read_u64(&dir.join("pids.current"))?,
                // "max" when unlimited; absent without the memory controller.
                read_optional(&dir.join("memory.max"))?.trim().parse().ok(),
            )
        }
        Layout::V1(mounts) => {
            let dir = |c: &str| mounts.get(c).map(|m| m.join(rel));
            let cpuacct = dir("cpuacct").ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "no cpuacct hierarchy")
            })?;
            let ns = read_small(&cpuacct.join("cpuacct.usage"))?;
            let memory = dir("memory");
            let pids = dir("pids");
            if detailed {
                detail = detail_or_none(
                    cgroups_path,
                    v1_detail(&cpuacct, dir("cpu"), memory.as_deref()),
                );
            }
            (
                ns.trim().parse().unwrap_or(0),
                match &memory {
                    Some(m) => read_u64(&m.join("memory.usage_in_bytes"))?,
                    None => 0,
                },
                match &memory {
                    Some(m) => read_optional(&m.join("memory.stat"))?,
                    None => String::new(),
                },
                match &pids {
                    Some(p) => read_u64(&p.join("pids.current"))?,
                    None => 0,
                },
                match &memory {
                    Some(m) => read_optional(&m.join("memory.limit_in_bytes"))?
                        .trim()
                        .parse()
                        .ok()
                        .filter(|&l: &u64| l <= V1_UNLIMITED),
                    None => None,
                },
            )
        }
    };
    // v1 names its hierarchical counters total_*; v2 has one set.
    let get = |v1: &str, v2: &str| {
        stat_value(&stat, v1)
            .or_else(|| stat_value(&stat, v2))
            .unwrap_or(0)
    };
    if let Some(d) = &mut detail {
        d.cache = get("total_cache", "file");
        d.mapped_file = get("total_mapped_file", "file_mapped");
        d.own_page_faults = stat_value(&stat, "pgfault").unwrap_or(0);
        d.own_major_page_faults = stat_value(&stat, "pgmajfault").unwrap_or(0);
        // v1 counts swap here (with swap accounting on); v2 in a file of its own.
        if let Some(swap) = stat_value(&stat, "total_swap") {
            d.swap = swap;
        }
    }
    Ok(Sample {
        cpu_usage_ns,
        memory_usage: usage,
        working_set: usage.saturating_sub(get("total_inactive_file", "inactive_file")),
        rss: get("total_rss", "anon"),
        page_faults: get("total_pgfault", "pgfault"),
        major_page_faults: get("total_pgmajfault", "pgmajfault"),
        pids,
        memory_limit,
        cpu_psi: psi[0],
        memory_psi: psi[1],
        io_psi: psi[2],
        detail,
    })
}

/// A detail reading that failed leaves the sample without detail, not without its reading.
fn detail_or_none(cgroups_path: &str, read: std::io::Result<Detail>) -> Option<Detail> {
    read.map_err(|e| tracing::debug!(cgroup = cgroups_path, error = %e, "no detailed reading"))
        .ok()
}

/// A v1 cgroup's [`Detail`] but for what memory.stat gives (filled by the caller): CPU time
/// by mode (`cpuacct.stat`, in clock ticks), CFS throttling (the cpu hierarchy's `cpu.stat`),
/// peak usage, limit hits and OOM kills. A hierarchy the node does not mount counts 0.
fn v1_detail(
    cpuacct: &Path,
    cpu: Option<PathBuf>,
    memory: Option<&Path>,
) -> std::io::Result<Detail> {
    let ticks = read_small(&cpuacct.join("cpuacct.stat"))?;
    let tick_ns = 1_000_000_000 / clock_ticks_per_second();
    let cfs = match &cpu {
        Some(c) => read_optional(&c.join("cpu.stat"))?,
        None => String::new(),
    };
    let (mut max_usage, mut limit_hits, mut oom_kills) = (None, 0, 0);
    if let Some(m) = memory {
        max_usage = read_optional(&m.join("memory.max_usage_in_bytes"))?
            .trim()
            .parse()
            .ok();
        limit_hits = read_u64(&m.join("memory.failcnt"))?;
        oom_kills =
            stat_value(&read_optional(&m.join("memory.oom_control"))?, "oom_kill").unwrap_or(0);
    }
    let get = |text: &str, key: &str| stat_value(text, key).unwrap_or(0);
    Ok(Detail {
        cpu_user_ns: get(&ticks, "user").saturating_mul(tick_ns),
        cpu_system_ns: get(&ticks, "system").saturating_mul(tick_ns),
        cfs_periods: get(&cfs, "nr_periods"),
        cfs_throttled_periods: get(&cfs, "nr_throttled"),
        cfs_throttled_ns: get(&cfs, "throttled_time"),
        max_usage,
        limit_hits,
        oom_kills,
        ..Detail::default()
    })
}

/// A v2 cgroup's [`Detail`] but for what memory.stat gives: `cpu.stat` (already read, as
/// `cpu`), `memory.swap.current`, `memory.peak` and `memory.events`.
fn v2_detail(dir: &Path, cpu: &str) -> std::io::Result<Detail> {
    let usec = |key: &str| stat_value(cpu, key).unwrap_or(0).saturating_mul(1000);
    let events = read_optional(&dir.join("memory.events"))?;
    let peak = read_optional(&dir.join("memory.peak"))?;
    Ok(Detail {
        cpu_user_ns: usec("user_usec"),
        cpu_system_ns: usec("system_usec"),
        cfs_periods: stat_value(cpu, "nr_periods").unwrap_or(0),
        cfs_throttled_periods: stat_value(cpu, "nr_throttled").unwrap_or(0),
        cfs_throttled_ns: usec("throttled_usec"),
        swap: read_u64(&dir.join("memory.swap.current"))?,
        max_usage: peak.trim().parse().ok(),
        limit_hits: stat_value(&events, "max").unwrap_or(0),
        oom_kills: stat_value(&events, "oom_kill").unwrap_or(0),
        ..Detail::default()
    })
}

/// USER_HZ, the unit of `cpuacct.stat` (100 on every Linux architecture hako builds for).
fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf reads a constant of the C library; it touches no memory of ours.
    match unsafe { libc::sysconf(libc::_SC_CLK_TCK) } {
        n if n > 0 => n as u64,
        _ => 100,
    }
}

/// A file's text; empty when the file is absent but its directory is there.
fn read_optional(path: &Path) -> std::io::Result<String> {
    match read_small(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir_exists(path) => Ok(String::new()),
        r => r,
    }
}

/// A cgroup file's text. Not `fs::read_to_string`, which asks the file's size first (a
/// statx and an lseek per file, though cgroup files all say 4096 or 0): at 250 containers
/// those were a sixth of a stats list's reading time.
fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    // Plain reads: `Read::read_to_string` and `read_to_end` on a File ask its size too
    // (statx and lseek).
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 4096];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(len * 2, 0);
        }
        match f.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// A file holding one number; 0 when the file is absent but its directory is there.
fn read_u64(path: &Path) -> std::io::Result<u64> {
    Ok(read_optional(path)?.trim().parse().unwrap_or(0))
}

fn dir_exists(file: &Path) -> bool {
    file.parent().is_some_and(Path::is_dir)
}

/// The value of `key` in a flat keyed file (`memory.stat`, `cpu.stat`: `key value` lines).
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Applies new limits to the cgroup at `cgroups_path` (UpdateContainerResources).
pub fn update(cgroups_path: &str, r: &crate::spec::Resources) -> Result<()> {
    let resources = crate::spec::limits(r);
    let cm = manager(cgroups_path, update_error)?;
    cm.apply(&ControllerOpt {
        resources: &resources,
        disable_oom_killer: false,
        oom_score_adj: None,
        freezer_state: None,
    })
    .map_err(|e| cgroup_error(cgroups_path, e, update_error))
}

/// Whether the node's cgroups can limit hugepages. kubelet sends a limit for every page size
/// the kernel knows whether or not the hugetlb controller is there, and libcontainer refuses
/// limits it cannot apply; runc skips them, and so does hako (see `drop_unsupported`).
pub fn hugetlb_available() -> bool {
    let root = std::path::Path::new("/sys/fs/cgroup");
    match std::fs::read_to_string(root.join("cgroup.controllers")) {
        // Pure cgroup v2: the root lists its controllers.
        Ok(list) => list.split_whitespace().any(|c| c == "hugetlb"),
        // v1 or hybrid: a hugetlb hierarchy of its own.
        Err(_) => root.join("hugetlb").is_dir(),
    }
}

/// Removes limits this node's cgroups cannot apply; returns what was dropped, for the log.
pub fn drop_unsupported(r: &mut crate::spec::Resources) -> Vec<String> {
    let mut dropped = Vec::new();
    if !r.hugepage_limits.is_empty() && !hugetlb_available() {
        dropped.extend(
            r.hugepage_limits
                .drain(..)
                .map(|(size, _)| format!("hugetlb {size}")),
        );
    }
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_cgroup_is_not_found() {
        let gone = "/hako-test/no-such-cgroup-4f1d";
        assert!(matches!(
            sample(gone),
            Err(Error::CgroupNotFound { ref path }) if path == gone
        ));
        let limits = crate::spec::Resources {
            pids_limit: Some(10),
            ..Default::default()
        };
        let e = update(gone, &limits).unwrap_err();
        assert!(matches!(e, Error::CgroupNotFound { .. }), "{e:?}");
        assert_eq!(e.to_string(), format!("cgroup {gone} does not exist"));
    }

    #[test]
    fn cgroup_exists_on_v1_and_v2_layouts() {
        let v2 = tempfile::tempdir().unwrap();
        std::fs::write(v2.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        std::fs::create_dir_all(v2.path().join("kubepods/pod1")).unwrap();
        assert!(cgroup_exists(v2.path(), "/kubepods/pod1"));
        assert!(!cgroup_exists(v2.path(), "/kubepods/pod2"));
        let v1 = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(v1.path().join("pids/kubepods/pod1")).unwrap();
        assert!(cgroup_exists(v1.path(), "/kubepods/pod1"));
        assert!(!cgroup_exists(v1.path(), "/kubepods/pod2"));
    }

    const MOUNTINFO: &str = "\
25 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
33 25 0:28 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
34 33 0:29 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
38 33 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:15 - cgroup cgroup rw,cpu,cpuacct
41 33 0:36 / /sys/fs/cgroup/memory rw,nosuid shared:18 - cgroup cgroup rw,memory
44 33 0:39 / /sys/fs/cgroup/my\\040pids rw,nosuid shared:21 - cgroup cgroup rw,pids
45 33 0:40 / /sys/fs/cgroup/memory2 rw,nosuid shared:22 - cgroup cgroup rw,memory
";

    #[test]
    fn v1_mounts_come_from_the_cgroup_lines_super_options() {
        let m = v1_mounts(MOUNTINFO);
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(m["cpu"], Path::new("/sys/fs/cgroup/cpu,cpuacct"));
        assert_eq!(m["cpuacct"], Path::new("/sys/fs/cgroup/cpu,cpuacct"));
        // The first mount of a hierarchy wins.
        assert_eq!(m["memory"], Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(m["pids"], Path::new("/sys/fs/cgroup/my pids"));
    }

    #[test]
    fn pressure_files_parse_into_percent_averages_and_nanosecond_totals() {
        let p = parse_psi("some avg10=12.34 avg60=1.00 avg300=0.01 total=5\n").unwrap();
        assert_eq!(
            (p.some.avg10, p.some.avg60, p.some.avg300, p.some.total_ns),
            (12.34, 1.0, 0.01, 5000)
        );
        // A file with only the `some` line (a root cgroup's cpu.pressure on older kernels).
        assert_eq!(p.full, PsiLine::default());
        for bad in [
            "",
            "nonsense\n",
            "some avg10=x total=1\n",
            "some total=-1\n",
        ] {
            assert_eq!(parse_psi(bad), None, "{bad:?}");
        }
        // A field a later kernel might add, with or without a value, is skipped.
        let p = parse_psi("some avg10=1.00 flag stalls=3 total=2\n").unwrap();
        assert_eq!((p.some.avg10, p.some.total_ns), (1.0, 2000));
    }

    fn write(dir: &Path, files: &[(&str, &str)]) {
        std::fs::create_dir_all(dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
    }

    #[test]
    fn v1_and_v2_readings_come_from_their_files() {
        let t = tempfile::tempdir().unwrap();
        let c = "kubepods/pod1/hako-c";
        write(
            &t.path().join("cpuacct").join(c),
            &[("cpuacct.usage", "123456789\n")],
        );
        write(
            &t.path().join("memory").join(c),
            &[
                ("memory.usage_in_bytes", "1000000\n"),
                ("memory.limit_in_bytes", "83886080\n"),
                (
                    "memory.stat",
                    "cache 7\nrss 1\ninactive_file 2\ntotal_rss 4000\ntotal_inactive_file 300000\ntotal_pgfault 55\ntotal_pgmajfault 5\n",
                ),
            ],
        );
        write(&t.path().join("pids").join(c), &[("pids.current", "3\n")]);
        let v1 = Layout::V1(
            ["cpuacct", "memory", "pids"]
                .iter()
                .map(|h| (h.to_string(), t.path().join(h)))
                .collect(),
        );
        let s = read_sample(&v1, &format!("/{c}"), false).unwrap();
        assert_eq!(
            s,
            Sample {
                cpu_usage_ns: 123456789,
                memory_usage: 1000000,
                working_set: 700000,
                rss: 4000,
                page_faults: 55,
                major_page_faults: 5,
                pids: 3,
                memory_limit: Some(83886080),
                ..Default::default()
            }
        );
        // No limit: v1 writes its largest value.
        write(
            &t.path().join("memory").join(c),
            &[("memory.limit_in_bytes", "9223372036854771712\n")],
        );
        assert_eq!(read_sample(&v1, c, false).unwrap().memory_limit, None);
        let v2 = tempfile::tempdir().unwrap();
        write(
            &v2.path().join(c),
            &[
                (
                    "cpu.stat",
                    "usage_usec 250\nuser_usec 200\nsystem_usec 50\n",
                ),
                ("memory.current", "2000\n"),
                ("memory.max", "max\n"),
                (
                    "memory.stat",
                    "anon 900\nfile 1000\ninactive_file 600\npgfault 9\npgmajfault 1\n",
                ),
                ("pids.current", "2\n"),
                (
                    "cpu.pressure",
                    "some avg10=1.50 avg60=0.25 avg300=0.05 total=1234\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n",
                ),
                (
                    "memory.pressure",
                    "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
                ),
            ],
        );
        let s = read_sample(&Layout::V2(v2.path().to_path_buf()), c, false).unwrap();
        let line = |avg10, avg60, avg300, total_ns| PsiLine {
            avg10,
            avg60,
            avg300,
            total_ns,
        };
        assert_eq!(
            s,
            Sample {
                cpu_usage_ns: 250_000,
                memory_usage: 2000,
                working_set: 1400,
                rss: 900,
                page_faults: 9,
                major_page_faults: 1,
                pids: 2,
                memory_limit: None,
                cpu_psi: Some(Psi {
                    some: line(1.5, 0.25, 0.05, 1_234_000),
                    full: line(0.0, 0.0, 0.0, 7_000),
                }),
                memory_psi: Some(Psi::default()),
                // No io.pressure (PSI off, or an older kernel): none, not an error.
                io_psi: None,
                detail: None,
            }
        );
        write(&v2.path().join(c), &[("memory.max", "4096\n")]);
        let s = read_sample(&Layout::V2(v2.path().to_path_buf()), c, false).unwrap();
        assert_eq!(s.memory_limit, Some(4096));
        // A v2 cgroup whose parent delegates no memory or pids controller: zeros, no error.
        write(&v2.path().join("bare"), &[("cpu.stat", "usage_usec 1\n")]);
        let s = read_sample(&Layout::V2(v2.path().to_path_buf()), "/bare", false).unwrap();
        assert_eq!((s.cpu_usage_ns, s.memory_usage, s.pids), (1000, 0, 0));
        // A cgroup that is not there is an error, on either layout.
        assert!(read_sample(&v1, "/kubepods/gone", true).is_err());
        assert!(read_sample(&Layout::V2(v2.path().to_path_buf()), "/gone", true).is_err());
    }

    #[test]
    fn detailed_readings_come_from_their_files_on_v1_and_v2() {
        let t = tempfile::tempdir().unwrap();
        let c = "kubepods/pod1/hako-c";
        // cpu and cpuacct co-mounted, as most v1 nodes have them.
        write(
            &t.path().join("cpu,cpuacct").join(c),
            &[
                ("cpuacct.usage", "123456789\n"),
                ("cpuacct.stat", "user 250\nsystem 75\n"),
                (
                    "cpu.stat",
                    "nr_periods 40\nnr_throttled 9\nthrottled_time 123000000\n",
                ),
            ],
        );
        write(
            &t.path().join("memory").join(c),
            &[
                ("memory.usage_in_bytes", "1000000\n"),
                ("memory.max_usage_in_bytes", "2500000\n"),
                ("memory.failcnt", "4\n"),
                (
                    "memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
                ),
                (
                    "memory.stat",
                    "cache 7\nmapped_file 1\nswap 3\npgfault 11\npgmajfault 1\ntotal_cache 6000\ntotal_mapped_file 500\ntotal_swap 4096\ntotal_pgfault 40\n",
                ),
            ],
        );
        let mounts = |hs: &[(&str, &str)]| {
            Layout::V1(
                hs.iter()
                    .map(|(c, h)| (c.to_string(), t.path().join(h)))
                    .collect(),
            )
        };
        let v1 = mounts(&[
            ("cpu", "cpu,cpuacct"),
            ("cpuacct", "cpu,cpuacct"),
            ("memory", "memory"),
        ]);
        let tick = 1_000_000_000 / clock_ticks_per_second();
        let want = Detail {
            cpu_user_ns: 250 * tick,
            cpu_system_ns: 75 * tick,
            cfs_periods: 40,
            cfs_throttled_periods: 9,
            cfs_throttled_ns: 123_000_000,
            cache: 6000,
            mapped_file: 500,
            swap: 4096,
            max_usage: Some(2_500_000),
            limit_hits: 4,
            oom_kills: 2,
            own_page_faults: 11,
            own_major_page_faults: 1,
        };
        assert_eq!(read_sample(&v1, c, true).unwrap().detail, Some(want));
        // A plain reading reads none of it.
        assert_eq!(read_sample(&v1, c, false).unwrap().detail, None);
        // Children count in the hierarchical figure, not in the cgroup's own.
        assert_eq!(read_sample(&v1, c, true).unwrap().page_faults, 40);
        // No cpu or memory hierarchy: their parts count 0.
        let bare = mounts(&[("cpuacct", "cpu,cpuacct")]);
        assert_eq!(
            read_sample(&bare, c, true).unwrap().detail,
            Some(Detail {
                cpu_user_ns: 250 * tick,
                cpu_system_ns: 75 * tick,
                ..Detail::default()
            })
        );

        let v2 = tempfile::tempdir().unwrap();
        write(
            &v2.path().join(c),
            &[
                (
                    "cpu.stat",
                    "usage_usec 250\nuser_usec 200\nsystem_usec 50\nnr_periods 12\nnr_throttled 3\nthrottled_usec 4500\n",
                ),
                ("memory.current", "2000\n"),
                (
                    "memory.stat",
                    "anon 900\nfile 1000\nfile_mapped 300\ninactive_file 600\npgfault 9\npgmajfault 2\n",
                ),
                ("memory.swap.current", "8192\n"),
                ("memory.peak", "7000\n"),
                (
                    "memory.events",
                    "low 0\nhigh 0\nmax 6\noom 1\noom_kill 1\noom_group_kill 0\n",
                ),
            ],
        );
        let v2 = Layout::V2(v2.path().to_path_buf());
        assert_eq!(
            read_sample(&v2, c, true).unwrap().detail,
            Some(Detail {
                cpu_user_ns: 200_000,
                cpu_system_ns: 50_000,
                cfs_periods: 12,
                cfs_throttled_periods: 3,
                cfs_throttled_ns: 4_500_000,
                cache: 1000,
                mapped_file: 300,
                swap: 8192,
                max_usage: Some(7000),
                limit_hits: 6,
                oom_kills: 1,
                own_page_faults: 9,
                own_major_page_faults: 2,
            })
        );
        // A detail file that cannot be read costs the detail, not the reading.
        std::fs::remove_file(t.path().join("cpu,cpuacct").join(c).join("cpuacct.stat")).unwrap();
        let s = read_sample(&v1, c, true).unwrap();
        assert_eq!((s.cpu_usage_ns, s.detail), (123456789, None));
        // v1 without a peak file: no peak, rather than 0.
        std::fs::write(
            t.path().join("cpu,cpuacct").join(c).join("cpuacct.stat"),
            "user 1\nsystem 1\n",
        )
        .unwrap();
        std::fs::remove_file(
            t.path()
                .join("memory")
                .join(c)
                .join("memory.max_usage_in_bytes"),
        )
        .unwrap();
        assert_eq!(
            read_sample(&v1, c, true).unwrap().detail.unwrap().max_usage,
            None
        );
        // A kernel without memory.peak (before 5.19) keeps no peak.
        let Layout::V2(root) = &v2 else {
            unreachable!()
        };
        std::fs::remove_file(root.join(c).join("memory.peak")).unwrap();
        assert_eq!(
            read_sample(&v2, c, true).unwrap().detail.unwrap().max_usage,
            None
        );
    }

    /// The files read here against libcgroups' own reading of a real cgroup of this node,
    /// holding one process.
    #[test]
    fn readings_match_libcgroups_on_a_real_cgroup() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED readings_match_libcgroups_on_a_real_cgroup: needs root");
            return;
        }
        let path = format!("/hako-stats-test-{}", std::process::id());
        let dirs: Vec<PathBuf> = match layout() {
            Layout::V2(root) => vec![root.join(&path[1..])],
            // libcgroups reads every v1 hierarchy: the cgroup is made in each.
            Layout::V1(_) => std::fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .lines()
                .filter_map(|l| {
                    let (head, tail) = l.split_once(" - ")?;
                    let mount_point = head.split(' ').nth(4)?;
                    tail.starts_with("cgroup ")
                        .then(|| Path::new(mount_point).join(&path[1..]))
                })
                .collect(),
        };
        // A shell that spins once it reads a line: it burns CPU in the cgroup, then is stopped
        // so that both readings see the same counters.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read x; while :; do :; done"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let read = match layout() {
            Layout::V2(root) => vec![root.join(&path[1..])],
            Layout::V1(m) => m.values().map(|h| h.join(&path[1..])).collect(),
        };
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        // Only where the readings come from (a cpuset cgroup takes no task before its cpus).
        for d in &read {
            std::fs::write(d.join("cgroup.procs"), child.id().to_string()).unwrap();
        }
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        // Until the CPU by mode shows it too: v1's cpuacct.stat counts in whole clock ticks
        // sampled at the scheduler tick, so 10 ms of usage may still read 0 there (CI saw it).
        let spun = |s: &Sample| {
            s.cpu_usage_ns >= 10_000_000
                && s.detail
                    .as_ref()
                    .is_some_and(|d| d.cpu_user_ns + d.cpu_system_ns > 0)
        };
        while !sample_detailed(&path).is_ok_and(|s| spun(&s)) {
            assert!(std::time::Instant::now() < deadline, "the shell never spun");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
        while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap()
            .rsplit_once(") ")
            .is_some_and(|(_, r)| r.starts_with('T'))
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the shell never stopped"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let ours = sample_detailed(&path);
        let theirs = manager(&path, read_error).unwrap().stats();
        let _ = child.kill();
        let _ = child.wait();
        for d in &dirs {
            let _ = std::fs::remove_dir(d);
        }
        let (ours, theirs) = (ours.unwrap(), theirs.unwrap());
        assert_eq!(ours.pids, theirs.pids.current);
        assert_eq!(ours.pids, 1);
        // Stopped: both read the same counter.
        let scale = if matches!(layout(), Layout::V2(_)) {
            1000
        } else {
            1
        };
        assert_eq!(ours.cpu_usage_ns, theirs.cpu.usage.usage_total * scale);
        assert_eq!(ours.memory_usage, theirs.memory.memory.usage);
        let m = &theirs.memory.stats;
        let rss = m
            .get("total_rss")
            .or_else(|| m.get("anon"))
            .copied()
            .unwrap_or(0);
        assert_eq!(ours.rss, rss);
        // The metrics' detail: CPU by mode (v1 in clock ticks, v2 in µs), CFS throttling,
        // page cache, peak usage and limit hits.
        let d = ours.detail.expect("a detailed reading");
        let (user_unit, throttle_unit) = if scale == 1 {
            (1_000_000_000 / clock_ticks_per_second(), 1)
        } else {
            (1000, 1000)
        };
        let cpu = &theirs.cpu;
        assert_eq!(d.cpu_user_ns, cpu.usage.usage_user * user_unit);
        assert_eq!(d.cpu_system_ns, cpu.usage.usage_kernel * user_unit);
        assert!(
            d.cpu_user_ns + d.cpu_system_ns > 0,
            "the shell spun in user or system mode: {d:?}"
        );
        assert_eq!(d.cfs_periods, cpu.throttling.periods);
        assert_eq!(d.cfs_throttled_periods, cpu.throttling.throttled_periods);
        assert_eq!(
            d.cfs_throttled_ns,
            cpu.throttling.throttled_time * throttle_unit
        );
        let mem = &theirs.memory;
        assert_eq!(d.max_usage.unwrap_or(0), mem.memory.max_usage);
        assert!(d.max_usage.unwrap_or(1) >= ours.memory_usage, "{d:?}");
        assert_eq!(d.limit_hits, mem.memory.fail_count);
        let cache = m
            .get("total_cache")
            .or_else(|| m.get("file"))
            .copied()
            .unwrap_or(0);
        assert_eq!(d.cache, cache);
    }
}
