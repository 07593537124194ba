//! A container's cgroup through libcgroups (v1, hybrid and v2): usage readings, and resource
//! limits changed while it runs.

use std::path::{Path, PathBuf};

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
}

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

/// Reads the cgroup at `cgroups_path` (as in the OCI spec, e.g. `/kubepods/pod1/hako-<id>`).
pub fn sample(cgroups_path: &str) -> Result<Sample> {
    let cm = manager(cgroups_path, read_error)?;
    // libcgroups passes cgroup v2's cpu.stat usage_usec through as is (microseconds); v1's
    // cpuacct.usage is nanoseconds.
    let cpu_scale = match cm {
        libcgroups::common::AnyCgroupManager::V2(_) => 1000,
        _ => 1,
    };
    let st = cm
        .stats()
        .map_err(|e| cgroup_error(cgroups_path, e, read_error))?;
    let m = &st.memory.stats;
    // v1 names its hierarchical counters total_*; v2 has one set.
    let get = |v1: &str, v2: &str| m.get(v1).or_else(|| m.get(v2)).copied().unwrap_or(0);
    let usage = st.memory.memory.usage;
    Ok(Sample {
        cpu_usage_ns: st.cpu.usage.usage_total * cpu_scale,
        memory_usage: usage,
        working_set: usage.saturating_sub(get("total_inactive_file", "inactive_file")),
        rss: get("total_rss", "anon"),
        page_faults: get("total_pgfault", "pgfault"),
        major_page_faults: get("total_pgmajfault", "pgmajfault"),
        pids: st.pids.current,
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
}
