//! A container's cgroup through libcgroups (v1, hybrid and v2): usage readings, and resource
//! limits changed while it runs.

use std::path::PathBuf;

use libcgroups::common::{create_cgroup_manager, CgroupConfig, CgroupManager, ControllerOpt};

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

fn manager(cgroups_path: &str) -> Result<libcgroups::common::AnyCgroupManager, String> {
    create_cgroup_manager(CgroupConfig {
        cgroup_path: PathBuf::from(cgroups_path),
        systemd_cgroup: false,
        container_name: String::new(),
    })
    .map_err(|e| format!("cgroup {cgroups_path}: {e}"))
}

/// Reads the cgroup at `cgroups_path` (as in the OCI spec, e.g. `/kubepods/pod1/hako-<id>`).
pub fn sample(cgroups_path: &str) -> Result<Sample, String> {
    let cm = manager(cgroups_path)?;
    // libcgroups passes cgroup v2's cpu.stat usage_usec through as is (microseconds); v1's
    // cpuacct.usage is nanoseconds.
    let cpu_scale = match cm {
        libcgroups::common::AnyCgroupManager::V2(_) => 1000,
        _ => 1,
    };
    let st = cm
        .stats()
        .map_err(|e| format!("stats of cgroup {cgroups_path}: {e}"))?;
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
pub fn update(cgroups_path: &str, r: &crate::spec::Resources) -> Result<(), String> {
    let resources: oci_spec::runtime::LinuxResources =
        serde_json::from_value(crate::spec::limits(r))
            .map_err(|e| format!("resources for cgroup {cgroups_path}: {e}"))?;
    let cm = manager(cgroups_path)?;
    cm.apply(&ControllerOpt {
        resources: &resources,
        disable_oom_killer: false,
        oom_score_adj: None,
        freezer_state: None,
    })
    .map_err(|e| format!("update cgroup {cgroups_path}: {e}"))
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
