//! ListMetricDescriptors and ListPodSandboxMetrics: the container metrics kubelet serves on
//! `/metrics/cadvisor` when `PodAndContainerStatsFromCRI` is on (beta in 1.37), in place of
//! those its built-in cAdvisor would read.
//!
//! Names, units and extra labels are cAdvisor's, and every metric starts with the labels
//! kubelet's cAdvisor path gives it (`container`, `id`, `image`, `name`, `namespace`, `pod`),
//! so that dashboards and alerts written against one path read the other: `id` is the cgroup,
//! `name` hako's ID, and a pod's own series have an empty `container` and `name`, as cAdvisor's
//! pod cgroups do. Only what has a live cgroup is reported, as with cAdvisor: ready pods, and
//! their created and running containers (an exited one keeps its cgroup, and its page cache
//! and limit, until it is removed; reported, it would count twice in a pod's sums). kubelet asks for the descriptors once, when it starts, and drops any metric
//! whose name they lack or whose label count differs; the tests below hold every metric to
//! its descriptor. The CRI carries integers: seconds are whole seconds (as in CRI-O and
//! containerd), and values are read when asked for (timestamp 0).

use hako_proto::cri;

use hako_runtime::stats::Detail;

use super::element_len;
use crate::pods::{ContainerState, ContainerView, PodStats, Usage};

/// The labels every metric starts with, in this order.
const BASE_LABELS: [&str; 6] = ["container", "id", "image", "name", "namespace", "pod"];

/// One metric family: what ListMetricDescriptors announces and each value is held to.
pub struct Desc {
    name: &'static str,
    help: &'static str,
    /// Labels after [`BASE_LABELS`].
    extra: &'static [&'static str],
    kind: cri::MetricType,
}

const fn counter(name: &'static str, extra: &'static [&'static str], help: &'static str) -> Desc {
    Desc {
        name,
        help,
        extra,
        kind: cri::MetricType::Counter,
    }
}

const fn gauge(name: &'static str, help: &'static str) -> Desc {
    Desc {
        name,
        help,
        extra: &[],
        kind: cri::MetricType::Gauge,
    }
}

const CPU_USAGE: Desc = counter(
    "container_cpu_usage_seconds_total",
    &["cpu"],
    "CPU time used, in seconds (cpu=\"total\": all CPUs).",
);
const CPU_USER: Desc = counter(
    "container_cpu_user_seconds_total",
    &[],
    "CPU time used in user mode, in seconds.",
);
const CPU_SYSTEM: Desc = counter(
    "container_cpu_system_seconds_total",
    &[],
    "CPU time used in kernel mode, in seconds.",
);
const CFS_PERIODS: Desc = counter(
    "container_cpu_cfs_periods_total",
    &[],
    "CPU quota enforcement periods elapsed.",
);
const CFS_THROTTLED_PERIODS: Desc = counter(
    "container_cpu_cfs_throttled_periods_total",
    &[],
    "CPU quota enforcement periods in which the cgroup was throttled.",
);
const CFS_THROTTLED: Desc = counter(
    "container_cpu_cfs_throttled_seconds_total",
    &[],
    "Time the cgroup was throttled by its CPU quota, in seconds.",
);
const MEMORY_USAGE: Desc = gauge(
    "container_memory_usage_bytes",
    "Memory charged to the cgroup, page cache included, in bytes.",
);
const WORKING_SET: Desc = gauge(
    "container_memory_working_set_bytes",
    "Memory usage less inactive file cache, in bytes: what eviction looks at.",
);
const RSS: Desc = gauge(
    "container_memory_rss",
    "Anonymous memory (and swap cache), in bytes.",
);
const CACHE: Desc = gauge("container_memory_cache", "Page cache, in bytes.");
const MAPPED_FILE: Desc = gauge(
    "container_memory_mapped_file",
    "Page cache mapped into processes, in bytes.",
);
const SWAP: Desc = gauge("container_memory_swap", "Swap in use, in bytes.");
const MAX_USAGE: Desc = gauge(
    "container_memory_max_usage_bytes",
    "The highest memory usage recorded, in bytes.",
);
const FAILCNT: Desc = counter(
    "container_memory_failcnt",
    &[],
    "Times memory usage reached the limit.",
);
const FAILURES: Desc = counter(
    "container_memory_failures_total",
    &["failure_type", "scope"],
    "Page faults (failure_type pgfault or pgmajfault), of the cgroup's own tasks (scope container) or with its children (scope hierarchy).",
);
const OOM_EVENTS: Desc = counter(
    "container_oom_events_total",
    &[],
    "Processes the OOM killer ended in the cgroup.",
);
const THREADS: Desc = gauge(
    "container_threads",
    "Tasks (threads) in the cgroup, as its pids controller counts them.",
);
const SPEC_MEMORY_LIMIT: Desc = gauge(
    "container_spec_memory_limit_bytes",
    "The cgroup's memory limit in bytes; 0 when unlimited.",
);
const SPEC_CPU_SHARES: Desc = gauge(
    "container_spec_cpu_shares",
    "The container's CPU shares, as requested.",
);
const SPEC_CPU_QUOTA: Desc = gauge(
    "container_spec_cpu_quota",
    "The container's CPU quota per period, in microseconds, when it has one.",
);
const SPEC_CPU_PERIOD: Desc = gauge(
    "container_spec_cpu_period",
    "The container's CPU quota period, in microseconds.",
);
const START_TIME: Desc = gauge(
    "container_start_time_seconds",
    "When the container started (a pod: when it was created), in seconds since the epoch.",
);
const CPU_WAITING: Desc = counter(
    "container_pressure_cpu_waiting_seconds_total",
    &[],
    "Time some tasks waited for CPU, in seconds (PSI, cgroup v2).",
);
const CPU_STALLED: Desc = counter(
    "container_pressure_cpu_stalled_seconds_total",
    &[],
    "Time no task could run for want of CPU, in seconds (PSI, cgroup v2).",
);
const MEMORY_WAITING: Desc = counter(
    "container_pressure_memory_waiting_seconds_total",
    &[],
    "Time some tasks waited for memory, in seconds (PSI, cgroup v2).",
);
const MEMORY_STALLED: Desc = counter(
    "container_pressure_memory_stalled_seconds_total",
    &[],
    "Time no task could run for want of memory, in seconds (PSI, cgroup v2).",
);
const IO_WAITING: Desc = counter(
    "container_pressure_io_waiting_seconds_total",
    &[],
    "Time some tasks waited for IO, in seconds (PSI, cgroup v2).",
);
const IO_STALLED: Desc = counter(
    "container_pressure_io_stalled_seconds_total",
    &[],
    "Time no task could run for want of IO, in seconds (PSI, cgroup v2).",
);
const RX_BYTES: Desc = counter(
    "container_network_receive_bytes_total",
    &["interface"],
    "Bytes received.",
);
const RX_PACKETS: Desc = counter(
    "container_network_receive_packets_total",
    &["interface"],
    "Packets received.",
);
const RX_DROPPED: Desc = counter(
    "container_network_receive_packets_dropped_total",
    &["interface"],
    "Packets dropped on receipt.",
);
const RX_ERRORS: Desc = counter(
    "container_network_receive_errors_total",
    &["interface"],
    "Errors on receipt.",
);
const TX_BYTES: Desc = counter(
    "container_network_transmit_bytes_total",
    &["interface"],
    "Bytes sent.",
);
const TX_PACKETS: Desc = counter(
    "container_network_transmit_packets_total",
    &["interface"],
    "Packets sent.",
);
const TX_DROPPED: Desc = counter(
    "container_network_transmit_packets_dropped_total",
    &["interface"],
    "Packets dropped on sending.",
);
const TX_ERRORS: Desc = counter(
    "container_network_transmit_errors_total",
    &["interface"],
    "Errors on sending.",
);

/// Every family, as ListMetricDescriptors lists them.
const ALL: &[&Desc] = &[
    &CPU_USAGE,
    &CPU_USER,
    &CPU_SYSTEM,
    &CFS_PERIODS,
    &CFS_THROTTLED_PERIODS,
    &CFS_THROTTLED,
    &MEMORY_USAGE,
    &WORKING_SET,
    &RSS,
    &CACHE,
    &MAPPED_FILE,
    &SWAP,
    &MAX_USAGE,
    &FAILCNT,
    &FAILURES,
    &OOM_EVENTS,
    &THREADS,
    &SPEC_MEMORY_LIMIT,
    &SPEC_CPU_SHARES,
    &SPEC_CPU_QUOTA,
    &SPEC_CPU_PERIOD,
    &START_TIME,
    &CPU_WAITING,
    &CPU_STALLED,
    &MEMORY_WAITING,
    &MEMORY_STALLED,
    &IO_WAITING,
    &IO_STALLED,
    &RX_BYTES,
    &RX_PACKETS,
    &RX_DROPPED,
    &RX_ERRORS,
    &TX_BYTES,
    &TX_PACKETS,
    &TX_DROPPED,
    &TX_ERRORS,
];

/// ListMetricDescriptors.
pub fn descriptors() -> Vec<cri::MetricDescriptor> {
    ALL.iter()
        .map(|d| cri::MetricDescriptor {
            name: d.name.into(),
            help: d.help.into(),
            label_keys: BASE_LABELS
                .iter()
                .chain(d.extra)
                .map(|k| k.to_string())
                .collect(),
        })
        .collect()
}

/// The metrics of one object (a pod's cgroup, or a container), all with its base labels.
struct Series {
    base: Vec<String>,
    out: Vec<cri::Metric>,
}

impl Series {
    fn new(container: &str, id: &str, image: &str, name: &str, pod: &PodStats) -> Series {
        let meta = &pod.pod.record.spec;
        Series {
            base: [container, id, image, name, &meta.namespace, &meta.name]
                .map(String::from)
                .into(),
            out: Vec::new(),
        }
    }

    fn put(&mut self, d: &Desc, extra: &[&str], value: u64) {
        debug_assert_eq!(d.extra.len(), extra.len(), "labels of {}", d.name);
        let mut label_values = self.base.clone();
        label_values.extend(extra.iter().map(|v| v.to_string()));
        self.out.push(cri::Metric {
            name: d.name.into(),
            timestamp: 0,
            metric_type: d.kind as i32,
            label_values,
            value: Some(cri::UInt64Value { value }),
        });
    }

    /// What a cgroup reading gives: CPU, memory, tasks and pressure. The CFS counters only
    /// for a cgroup with a CPU quota (`has_quota`), as cAdvisor.
    fn cgroup(&mut self, u: &Usage, has_quota: impl Fn(&Detail) -> bool) {
        let Some(s) = u.sample else { return };
        self.put(&CPU_USAGE, &["total"], secs(s.cpu_usage_ns));
        self.put(&MEMORY_USAGE, &[], s.memory_usage);
        self.put(&WORKING_SET, &[], s.working_set);
        self.put(&RSS, &[], s.rss);
        self.put(&FAILURES, &["pgfault", "hierarchy"], s.page_faults);
        self.put(&FAILURES, &["pgmajfault", "hierarchy"], s.major_page_faults);
        self.put(&THREADS, &[], s.pids);
        self.put(&SPEC_MEMORY_LIMIT, &[], s.memory_limit.unwrap_or(0));
        if let Some(d) = s.detail {
            self.put(&CPU_USER, &[], secs(d.cpu_user_ns));
            self.put(&CPU_SYSTEM, &[], secs(d.cpu_system_ns));
            if has_quota(&d) {
                self.put(&CFS_PERIODS, &[], d.cfs_periods);
                self.put(&CFS_THROTTLED_PERIODS, &[], d.cfs_throttled_periods);
                self.put(&CFS_THROTTLED, &[], secs(d.cfs_throttled_ns));
            }
            self.put(&FAILURES, &["pgfault", "container"], d.own_page_faults);
            self.put(
                &FAILURES,
                &["pgmajfault", "container"],
                d.own_major_page_faults,
            );
            self.put(&CACHE, &[], d.cache);
            self.put(&MAPPED_FILE, &[], d.mapped_file);
            self.put(&SWAP, &[], d.swap);
            if let Some(max) = d.max_usage {
                self.put(&MAX_USAGE, &[], max);
            }
            self.put(&FAILCNT, &[], d.limit_hits);
            self.put(&OOM_EVENTS, &[], d.oom_kills);
        }
        for (psi, waiting, stalled) in [
            (s.cpu_psi, &CPU_WAITING, &CPU_STALLED),
            (s.memory_psi, &MEMORY_WAITING, &MEMORY_STALLED),
            (s.io_psi, &IO_WAITING, &IO_STALLED),
        ] {
            if let Some(p) = psi {
                self.put(waiting, &[], secs(p.some.total_ns));
                self.put(stalled, &[], secs(p.full.total_ns));
            }
        }
    }
}

fn secs(ns: u64) -> u64 {
    ns / 1_000_000_000
}

/// Interfaces reported per pod (the reading keeps no more; bounded here too, as what a
/// message of kubelet's can hold is this file's concern).
use crate::pods::MAX_INTERFACES;

/// ListPodSandboxMetrics' entry for one (ready) pod: its cgroup's and network's series, and
/// those of each of its created or running containers whose cgroup could be read.
pub fn pod_metrics(p: &PodStats) -> cri::PodSandboxMetrics {
    let record = &p.pod.record;
    let mut pod = Series::new("", &p.cgroup, "", "", p);
    // A pod cgroup's quota is kubelet's: it has one when its periods count.
    pod.cgroup(&p.usage, |d| d.cfs_periods > 0);
    pod.put(&START_TIME, &[], secs(record.created_at.max(0) as u64));
    // The pod's own interface first, then the others the netns lists, up to the bound.
    let mut ifaces: Vec<_> = p.network.iter().flatten().collect();
    ifaces.sort_by_key(|n| n.name != crate::network::IFNAME);
    if ifaces.len() > MAX_INTERFACES {
        tracing::debug!(pod = %record.id, interfaces = ifaces.len(), "pod metrics report the first {MAX_INTERFACES} interfaces");
        ifaces.truncate(MAX_INTERFACES);
    }
    for n in ifaces {
        let i = [n.name.as_str()];
        pod.put(&RX_BYTES, &i, n.rx_bytes);
        pod.put(&RX_PACKETS, &i, n.rx_packets);
        pod.put(&RX_DROPPED, &i, n.rx_dropped);
        pod.put(&RX_ERRORS, &i, n.rx_errors);
        pod.put(&TX_BYTES, &i, n.tx_bytes);
        pod.put(&TX_PACKETS, &i, n.tx_packets);
        pod.put(&TX_DROPPED, &i, n.tx_dropped);
        pod.put(&TX_ERRORS, &i, n.tx_errors);
    }
    let mut answer = cri::PodSandboxMetrics {
        pod_sandbox_id: record.id.clone(),
        metrics: pod.out,
        container_metrics: Vec::new(),
    };
    // Within the pod's budget: the pod author picks the label values' lengths and the number
    // of containers, and kubelet takes the node's metrics in one 16 MiB message (or a streamed
    // pod in one), so one pod could otherwise cost every tenant their metrics.
    let mut bytes = prost::Message::encoded_len(&answer);
    let mut left_out = 0;
    for (c, u) in p.containers.iter().filter(|(c, u)| {
        matches!(c.state, ContainerState::Created | ContainerState::Running) && u.sample.is_some()
    }) {
        let m = container_metrics(c, u, p);
        let len = element_len(&m);
        if bytes + len > POD_METRICS_BUDGET {
            left_out += 1;
            continue;
        }
        bytes += len;
        answer.container_metrics.push(m);
    }
    if left_out > 0 {
        tracing::warn!(pod = %record.id, name = %record.spec.name, namespace = %record.spec.namespace, containers = left_out, "pod metrics over {POD_METRICS_BUDGET} bytes: containers left out");
    }
    answer
}

/// Encoded bytes of one pod's metrics. A container's series are about 20 KiB with labels of
/// the longest names Kubernetes allows, so a pod of 50 such containers fits. Streamed, each
/// pod is one item; a unary answer is fitted node-wide by [`fit_node_metrics`].
const POD_METRICS_BUDGET: usize = 1 << 20;

/// Fits a whole node's pod metrics into `limit` bytes of one ListPodSandboxMetrics answer.
///
/// A kubelet that does not stream reads the answer in one message of at most 16 MiB and gets
/// nothing at all past that, so a few pods at their own budget would cost every pod on the
/// node its metrics. Over the limit, every pod gets the same share (the largest one for which
/// all of them fit, so pods under it lose nothing) and a pod over it keeps its own series and
/// as many of its containers, in order, as the share holds. Returns how many containers were
/// left out.
pub fn fit_node_metrics(pods: &mut [cri::PodSandboxMetrics], limit: usize) -> usize {
    let sizes: Vec<usize> = pods.iter().map(element_len).collect();
    if sizes.iter().sum::<usize>() <= limit {
        return 0;
    }
    // The share: the largest `cap` with sum(min(size, cap)) <= limit, found over the sizes
    // sorted ascending (pods below the cap count whole, the rest count `cap` each).
    let mut sorted = sizes.clone();
    sorted.sort_unstable();
    let (mut below, mut cap) = (0usize, 0usize);
    for (i, &s) in sorted.iter().enumerate() {
        let rest = sorted.len() - i;
        if below + s * rest > limit {
            cap = (limit - below) / rest;
            break;
        }
        below += s;
    }
    let mut left_out = 0;
    for (pod, size) in pods.iter_mut().zip(sizes) {
        if size <= cap {
            continue;
        }
        // A message's length is the sum of its fields'.
        let mut body = prost::Message::encoded_len(pod)
            - pod.container_metrics.iter().map(element_len).sum::<usize>();
        let mut kept = 0;
        for c in &pod.container_metrics {
            let len = element_len(c);
            // The pod's element: its tag and a length prefix of at most 5 bytes, then body.
            if 1 + 5 + body + len > cap {
                break;
            }
            body += len;
            kept += 1;
        }
        left_out += pod.container_metrics.len() - kept;
        tracing::warn!(pod = %pod.pod_sandbox_id, containers = pod.container_metrics.len() - kept, "pod metrics over the node's share of one ListPodSandboxMetrics answer ({cap} bytes): containers left out");
        pod.container_metrics.truncate(kept);
    }
    left_out
}

fn container_metrics(c: &ContainerView, u: &Usage, p: &PodStats) -> cri::ContainerMetrics {
    let r = &c.record;
    let image = if r.spec.user_image.is_empty() {
        &r.spec.image
    } else {
        &r.spec.user_image
    };
    let limits = &r.spec.resources;
    // A quota of -1 (or none) is no quota.
    let quota = limits.cpu_quota.filter(|&q| q > 0);
    let mut s = Series::new(&r.spec.name, &r.cgroups_path, image, &r.id, p);
    s.cgroup(u, |_| quota.is_some());
    if let Some(shares) = limits.cpu_shares {
        s.put(&SPEC_CPU_SHARES, &[], shares);
    }
    if let Some(period) = limits.cpu_period {
        s.put(&SPEC_CPU_PERIOD, &[], period);
    }
    if let Some(quota) = quota {
        s.put(&SPEC_CPU_QUOTA, &[], quota as u64);
    }
    if c.started_at > 0 {
        s.put(&START_TIME, &[], secs(c.started_at as u64));
    }
    cri::ContainerMetrics {
        container_id: r.id.clone(),
        metrics: s.out,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Arc;

    use hako_runtime::stats::{Psi, PsiLine, Sample};

    use super::*;
    use crate::pods::{
        ContainerRecord, ContainerSpecReq, ContainerState, NetCounters, PodRecord, PodSpec,
        PodState, PodView,
    };

    fn usage(sample: Option<Sample>) -> Usage {
        Usage {
            timestamp: 1,
            sample,
            nano_cores: None,
            writable_bytes: 0,
            writable_inodes: 0,
            writable_mountpoint: Default::default(),
        }
    }

    fn container(
        name: &str,
        spec: ContainerSpecReq,
        state: ContainerState,
        started_at: i64,
    ) -> ContainerView {
        ContainerView {
            record: Arc::new(ContainerRecord {
                v: 1,
                id: format!("id-{name}"),
                pod_id: "p1".into(),
                spec: ContainerSpecReq {
                    name: name.into(),
                    ..spec
                },
                image_id: "sha256:abc".into(),
                image_ref: String::new(),
                created_at: 0,
                log_path: String::new(),
                state,
                started_at,
                exit: None,
                chain_ids: vec![],
                cgroups_path: format!("/kubepods/podu1/id-{name}"),
                stop_signal: None,
                user: None,
                start_error: None,
            }),
            state,
            started_at,
            exit: None,
            pid: 0,
        }
    }

    /// A pod `web` in `default` with a running container `app` (limits, a full v2 reading)
    /// and an exited one `done` whose cgroup is still there.
    fn stats() -> PodStats {
        let psi = Some(Psi {
            some: PsiLine {
                total_ns: 7_500_000_000,
                ..Default::default()
            },
            full: PsiLine {
                total_ns: 2_000_000_000,
                ..Default::default()
            },
        });
        let app = Sample {
            cpu_usage_ns: 3_900_000_000,
            memory_usage: 5000,
            working_set: 4000,
            rss: 3000,
            page_faults: 70,
            major_page_faults: 2,
            pids: 4,
            memory_limit: Some(64 << 20),
            cpu_psi: psi,
            memory_psi: psi,
            io_psi: psi,
            detail: Some(Detail {
                cpu_user_ns: 2_100_000_000,
                cpu_system_ns: 1_800_000_000,
                cfs_periods: 30,
                cfs_throttled_periods: 6,
                cfs_throttled_ns: 1_200_000_000,
                cache: 900,
                mapped_file: 100,
                swap: 8,
                max_usage: Some(6000),
                limit_hits: 3,
                oom_kills: 1,
                own_page_faults: 60,
                own_major_page_faults: 1,
            }),
        };
        let mut limits = ContainerSpecReq {
            user_image: "registry.example/app:1".into(),
            image: "sha256:abc".into(),
            ..Default::default()
        };
        limits.resources.cpu_shares = Some(102);
        limits.resources.cpu_quota = Some(20_000);
        limits.resources.cpu_period = Some(100_000);
        PodStats {
            pod: PodView {
                record: Arc::new(PodRecord {
                    v: 1,
                    id: "p1".into(),
                    spec: PodSpec {
                        name: "web".into(),
                        namespace: "default".into(),
                        ..Default::default()
                    },
                    state: PodState::Ready,
                    created_at: 1_700_000_000_500_000_000,
                    monitor_pid: 1,
                    namespaces: Default::default(),
                    ips: vec![],
                }),
                state: PodState::Ready,
                unanswered: None,
            },
            cgroup: "/kubepods/podu1".into(),
            // A v1 pod cgroup: no detail asked for here, no pressure.
            usage: usage(Some(Sample {
                cpu_usage_ns: 4_000_000_000,
                memory_usage: 9000,
                ..Default::default()
            })),
            network: Some(vec![NetCounters {
                name: "eth0".into(),
                rx_bytes: 1706,
                rx_packets: 19,
                rx_errors: 3,
                rx_dropped: 2,
                tx_bytes: 1052,
                tx_packets: 12,
                tx_errors: 4,
                tx_dropped: 1,
            }]),
            containers: vec![
                (
                    container(
                        "app",
                        limits,
                        ContainerState::Running,
                        1_700_000_001_000_000_000,
                    ),
                    usage(Some(app)),
                ),
                (
                    container("done", Default::default(), ContainerState::Exited, 5),
                    usage(Some(Sample::default())),
                ),
            ],
        }
    }

    /// Each metric by name and its extra label values, with its value; every metric checked
    /// against its descriptor on the way (as kubelet checks it).
    fn values(ms: &[cri::Metric]) -> HashMap<String, u64> {
        let descs: HashMap<String, cri::MetricDescriptor> = descriptors()
            .into_iter()
            .map(|d| (d.name.clone(), d))
            .collect();
        let mut out = HashMap::new();
        for m in ms {
            let d = descs
                .get(&m.name)
                .unwrap_or_else(|| panic!("{} has no descriptor", m.name));
            assert_eq!(
                m.label_values.len(),
                d.label_keys.len(),
                "{}: {:?} against {:?}",
                m.name,
                m.label_values,
                d.label_keys
            );
            assert_eq!(m.timestamp, 0, "{} is read live", m.name);
            let extra = m.label_values[BASE_LABELS.len()..].join(",");
            let key = if extra.is_empty() {
                m.name.clone()
            } else {
                format!("{}{{{extra}}}", m.name)
            };
            let old = out.insert(key.clone(), m.value.unwrap().value);
            assert!(old.is_none(), "{key} twice");
        }
        out
    }

    #[test]
    fn descriptors_are_unique_and_start_with_the_base_labels() {
        let ds = descriptors();
        assert_eq!(ds.len(), ALL.len());
        let mut names: Vec<_> = ds.iter().map(|d| d.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ds.len(), "a name twice");
        for d in &ds {
            assert!(d.name.starts_with("container_"), "{}", d.name);
            assert_eq!(d.label_keys[..6], BASE_LABELS, "{}", d.name);
            assert!(!d.help.is_empty(), "{}", d.name);
        }
    }

    #[test]
    fn a_pods_metrics_carry_its_readings_and_its_containers() {
        let m = pod_metrics(&stats());
        assert_eq!(m.pod_sandbox_id, "p1");
        // The pod's own series: empty container, image and name, and its cgroup.
        let labels = &m.metrics[0].label_values[..6];
        assert_eq!(labels, ["", "/kubepods/podu1", "", "", "default", "web"]);
        let pod = values(&m.metrics);
        assert_eq!(pod["container_cpu_usage_seconds_total{total}"], 4);
        assert_eq!(pod["container_memory_usage_bytes"], 9000);
        assert_eq!(pod["container_start_time_seconds"], 1_700_000_000);
        assert_eq!(pod["container_spec_memory_limit_bytes"], 0, "unlimited");
        assert_eq!(pod["container_network_receive_bytes_total{eth0}"], 1706);
        assert_eq!(pod["container_network_receive_packets_total{eth0}"], 19);
        assert_eq!(
            pod["container_network_receive_packets_dropped_total{eth0}"],
            2
        );
        assert_eq!(pod["container_network_receive_errors_total{eth0}"], 3);
        assert_eq!(pod["container_network_transmit_bytes_total{eth0}"], 1052);
        assert_eq!(pod["container_network_transmit_packets_total{eth0}"], 12);
        assert_eq!(
            pod["container_network_transmit_packets_dropped_total{eth0}"],
            1
        );
        assert_eq!(pod["container_network_transmit_errors_total{eth0}"], 4);
        // No detail and no pressure read: none reported, rather than zeros.
        assert!(!pod.contains_key("container_cpu_user_seconds_total"));
        assert!(!pod.contains_key("container_cpu_cfs_periods_total"));
        assert!(!pod.contains_key("container_pressure_cpu_waiting_seconds_total"));

        // Not the exited container, whose cgroup is left until it is removed.
        assert_eq!(m.container_metrics.len(), 1);
        let app = &m.container_metrics[0];
        assert_eq!(app.container_id, "id-app");
        assert_eq!(
            app.metrics[0].label_values[..6],
            [
                "app",
                "/kubepods/podu1/id-app",
                "registry.example/app:1",
                "id-app",
                "default",
                "web"
            ]
        );
        let c = values(&app.metrics);
        let want = [
            ("container_cpu_usage_seconds_total{total}", 3),
            ("container_cpu_user_seconds_total", 2),
            ("container_cpu_system_seconds_total", 1),
            ("container_cpu_cfs_periods_total", 30),
            ("container_cpu_cfs_throttled_periods_total", 6),
            ("container_cpu_cfs_throttled_seconds_total", 1),
            ("container_memory_usage_bytes", 5000),
            ("container_memory_working_set_bytes", 4000),
            ("container_memory_rss", 3000),
            ("container_memory_cache", 900),
            ("container_memory_mapped_file", 100),
            ("container_memory_swap", 8),
            ("container_memory_max_usage_bytes", 6000),
            ("container_memory_failcnt", 3),
            ("container_memory_failures_total{pgfault,hierarchy}", 70),
            ("container_memory_failures_total{pgmajfault,hierarchy}", 2),
            ("container_memory_failures_total{pgfault,container}", 60),
            ("container_memory_failures_total{pgmajfault,container}", 1),
            ("container_oom_events_total", 1),
            ("container_threads", 4),
            ("container_spec_memory_limit_bytes", 64 << 20),
            ("container_spec_cpu_shares", 102),
            ("container_spec_cpu_quota", 20_000),
            ("container_spec_cpu_period", 100_000),
            ("container_start_time_seconds", 1_700_000_001),
            ("container_pressure_cpu_waiting_seconds_total", 7),
            ("container_pressure_cpu_stalled_seconds_total", 2),
            ("container_pressure_memory_waiting_seconds_total", 7),
            ("container_pressure_memory_stalled_seconds_total", 2),
            ("container_pressure_io_waiting_seconds_total", 7),
            ("container_pressure_io_stalled_seconds_total", 2),
        ];
        for (k, v) in want {
            assert_eq!(c.get(k), Some(&v), "{k} in {c:?}");
        }
        assert_eq!(c.len(), want.len(), "{c:?}");
        // Every family is reported, by the pod or by its container.
        let used: std::collections::HashSet<&str> = m
            .metrics
            .iter()
            .chain(&app.metrics)
            .map(|m| m.name.as_str())
            .collect();
        for d in ALL {
            assert!(used.contains(d.name), "{} never reported", d.name);
        }
    }

    #[test]
    fn no_quota_reports_no_quota_and_no_cfs_counters() {
        let mut s = stats();
        let (c, _) = &mut s.containers[0];
        let mut r = (*c.record).clone();
        r.spec.resources.cpu_quota = Some(-1);
        c.record = Arc::new(r);
        let m = pod_metrics(&s);
        let c = values(&m.container_metrics[0].metrics);
        assert!(!c.contains_key("container_spec_cpu_quota"), "{c:?}");
        assert!(!c.contains_key("container_cpu_cfs_periods_total"), "{c:?}");
        assert!(
            !c.contains_key("container_cpu_cfs_throttled_seconds_total"),
            "{c:?}"
        );
        assert_eq!(c["container_spec_cpu_period"], 100_000);
        assert_eq!(c["container_spec_cpu_shares"], 102);
    }

    #[test]
    fn a_pods_metrics_stay_within_its_budget() {
        let mut s = stats();
        let (app, reading) = s.containers[0].clone();
        // Names as long as Kubernetes allows an image reference to be, 200 containers.
        let image = format!("registry.example/{}:tag", "x".repeat(400));
        s.containers = (0..200)
            .map(|i| {
                let mut r = (*app.record).clone();
                r.id = format!("c{i:03}");
                r.spec.name = format!("c{i:03}-{}", "n".repeat(58));
                r.spec.user_image = image.clone();
                let mut v = app.clone();
                v.record = Arc::new(r);
                (v, reading.clone())
            })
            .collect();
        let m = pod_metrics(&s);
        let bytes = prost::Message::encoded_len(&m);
        assert!(bytes <= POD_METRICS_BUDGET, "{bytes}");
        // The pod's own series are kept, and containers up to the budget, in order.
        assert!(!m.metrics.is_empty());
        let n = m.container_metrics.len();
        assert!((20..200).contains(&n), "{n} containers");
        assert_eq!(m.container_metrics[0].container_id, "c000");
        assert_eq!(
            m.container_metrics[n - 1].container_id,
            format!("c{:03}", n - 1)
        );
        // Below the budget nothing is left out.
        s.containers.truncate(5);
        assert_eq!(pod_metrics(&s).container_metrics.len(), 5);
    }

    /// A pod's metrics with one series of its own and `n` containers of one series each,
    /// label values `len` bytes long.
    fn fat_pod(id: &str, n: usize, len: usize) -> cri::PodSandboxMetrics {
        let metric = |v: &str| cri::Metric {
            name: "container_threads".into(),
            label_values: vec![v.repeat(len)],
            ..Default::default()
        };
        cri::PodSandboxMetrics {
            pod_sandbox_id: id.into(),
            metrics: vec![metric("p")],
            container_metrics: (0..n)
                .map(|i| cri::ContainerMetrics {
                    container_id: format!("{id}-c{i:03}"),
                    metrics: vec![metric("c")],
                })
                .collect(),
        }
    }

    #[test]
    fn a_nodes_metrics_fit_one_message_each_pod_its_share() {
        let size = |pods: &[cri::PodSandboxMetrics]| pods.iter().map(element_len).sum::<usize>();
        let node = || {
            vec![
                fat_pod("small", 2, 100),
                fat_pod("fat1", 300, 1000),
                fat_pod("mid", 20, 1000),
                fat_pod("fat2", 300, 1000),
            ]
        };
        let limit = 200_000;
        // Within the limit nothing is left out.
        let mut pods = node();
        let whole = size(&pods);
        assert_eq!(fit_node_metrics(&mut pods, whole), 0);
        assert_eq!(pods, node());

        let mut pods = node();
        let left_out = fit_node_metrics(&mut pods, limit);
        let after = size(&pods);
        assert!(after <= limit, "{after} > {limit}");
        let kept: Vec<usize> = pods.iter().map(|p| p.container_metrics.len()).collect();
        assert_eq!(left_out, 622 - kept.iter().sum::<usize>());
        // Pods under the share lose nothing; the two fat ones get the same, and each keeps
        // its own series and its first containers, in order.
        assert_eq!((kept[0], kept[2]), (2, 20), "{kept:?}");
        assert_eq!(kept[1], kept[3], "{kept:?}");
        assert!((50..300).contains(&kept[1]), "{kept:?}");
        for (p, want) in pods.iter().zip(node()) {
            assert_eq!(p.metrics, want.metrics);
            assert_eq!(
                p.container_metrics[..],
                want.container_metrics[..p.container_metrics.len()]
            );
        }
        // The share is the largest that fits: one more container each would not.
        let one = element_len(&node()[1].container_metrics[0]);
        assert!(after + 2 * one > limit, "{after} leaves room in {limit}");
    }

    #[test]
    fn a_pods_interfaces_are_bounded_its_own_first() {
        let mut s = stats();
        let mut ifaces: Vec<NetCounters> = (0..40)
            .map(|i| NetCounters {
                name: format!("dummy{i}"),
                ..Default::default()
            })
            .collect();
        ifaces.push(NetCounters {
            name: "eth0".into(),
            rx_bytes: 5,
            ..Default::default()
        });
        s.network = Some(ifaces);
        let m = pod_metrics(&s);
        let names: std::collections::BTreeSet<&str> = m
            .metrics
            .iter()
            .filter(|m| m.name == "container_network_receive_bytes_total")
            .map(|m| m.label_values[6].as_str())
            .collect();
        assert_eq!(names.len(), MAX_INTERFACES, "{names:?}");
        assert!(names.contains("eth0"), "{names:?}");
    }
}
