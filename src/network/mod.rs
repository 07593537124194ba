//! Pod networking: what a pod asks for (ports, DNS, bandwidth, the node's pod CIDR) turned into
//! a CNI attachment of the pod's pinned network namespace.

pub mod cni;

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{json, Value};

use crate::config::CniConfig;
use crate::error::{Error, Result};
use crate::pods::types::PodSpec;
pub use cni::{Attachment, Cached, Cni};

/// The pod's interface name, as every CRI runtime names it.
pub const IFNAME: &str = "eth0";

pub struct Network {
    pub cni: Cni,
    /// From UpdateRuntimeConfig: offered to IPAM as `ipRanges`. Kept on disk: kubelet sends
    /// it when it changes, not again because the runtime restarted.
    pod_cidr: Mutex<String>,
    pod_cidr_file: std::path::PathBuf,
}

impl Network {
    pub fn new(cfg: &CniConfig, root: &Path) -> Network {
        let pod_cidr_file = root.join("cni").join("pod-cidr");
        let pod_cidr = std::fs::read_to_string(&pod_cidr_file)
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        Network {
            cni: Cni {
                conf_dir: cfg.conf_dir.clone(),
                bin_dirs: cfg.bin_dirs.clone(),
                cache_dir: root.join("cni").join("results"),
                network_name: cfg.network_name.clone(),
                plugin_timeout: Duration::from_secs(cfg.plugin_timeout_secs.max(1)),
            },
            pod_cidr: Mutex::new(pod_cidr),
            pod_cidr_file,
        }
    }

    pub fn set_pod_cidr(&self, cidr: String) -> Result<()> {
        let mut current = self.pod_cidr.lock().expect("pod cidr poisoned");
        if *current == cidr {
            return Ok(());
        }
        if let Some(dir) = self.pod_cidr_file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        let tmp = self.pod_cidr_file.with_extension("tmp");
        std::fs::write(&tmp, &cidr).map_err(|e| Error::io("write", &tmp, e))?;
        std::fs::rename(&tmp, &self.pod_cidr_file)
            .map_err(|e| Error::io("rename", &self.pod_cidr_file, e))?;
        tracing::info!(pod_cidr = %cidr, "pod CIDR set");
        *current = cidr;
        Ok(())
    }

    /// The attachment of a pod whose network namespace is pinned at `netns`.
    pub fn attachment(&self, pod_id: &str, netns: &Path, spec: &PodSpec) -> Attachment {
        let cidr = self.pod_cidr.lock().expect("pod cidr poisoned").clone();
        Attachment {
            container_id: pod_id.to_string(),
            netns: netns.to_path_buf(),
            ifname: IFNAME.into(),
            args: vec![
                ("IgnoreUnknown".into(), "1".into()),
                ("K8S_POD_NAMESPACE".into(), spec.namespace.clone()),
                ("K8S_POD_NAME".into(), spec.name.clone()),
                ("K8S_POD_INFRA_CONTAINER_ID".into(), pod_id.to_string()),
                ("K8S_POD_UID".into(), spec.uid.clone()),
            ],
            runtime_config: runtime_config(spec, &cidr),
        }
    }

    /// ADD; the pod's IPs.
    pub async fn attach(&self, att: &Attachment) -> Result<Vec<String>> {
        let cached = self.cni.add(att).await?;
        Ok(cni::pod_ips(&cached.result, &att.ifname))
    }
}

/// Everything a plugin may ask for through `capabilities`.
fn runtime_config(spec: &PodSpec, pod_cidr: &str) -> Value {
    let ports: Vec<Value> = spec
        .port_mappings
        .iter()
        .filter(|p| p.host_port > 0)
        .map(|p| {
            let mut m = json!({
                "hostPort": p.host_port,
                "containerPort": p.container_port,
                "protocol": p.protocol.to_ascii_lowercase(),
            });
            if !p.host_ip.is_empty() {
                m["hostIP"] = json!(p.host_ip);
            }
            m
        })
        .collect();
    let mut rc = json!({ "portMappings": ports });
    if let Some(dns) = &spec.dns {
        rc["dns"] =
            json!({"servers": dns.servers, "searches": dns.searches, "options": dns.options});
    }
    if !pod_cidr.is_empty() {
        rc["ipRanges"] = json!([pod_cidr
            .split(',')
            .map(|c| json!({"subnet": c.trim()}))
            .collect::<Vec<_>>()]);
    }
    let bw = |key: &str| spec.annotations.get(key).and_then(|q| parse_quantity(q));
    let (ingress, egress) = (
        bw("kubernetes.io/ingress-bandwidth"),
        bw("kubernetes.io/egress-bandwidth"),
    );
    if ingress.is_some() || egress.is_some() {
        let mut b = json!({});
        // Burst as containerd and CRI-O set it: effectively unlimited.
        if let Some(r) = ingress {
            b["ingressRate"] = json!(r);
            b["ingressBurst"] = json!(u32::MAX);
        }
        if let Some(r) = egress {
            b["egressRate"] = json!(r);
            b["egressBurst"] = json!(u32::MAX);
        }
        rc["bandwidth"] = b;
    }
    if !spec.cgroup_parent.is_empty() {
        rc["cgroupPath"] = json!(spec.cgroup_parent);
    }
    rc
}

/// A Kubernetes quantity ("10M", "1Gi", "500k") as a number.
fn parse_quantity(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let n: f64 = num.parse().ok()?;
    let mult: f64 = match suffix {
        "" => 1.0,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024f64.powi(4),
        _ => return None,
    };
    Some((n * mult) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pods::types::{Dns, PortMapping};

    #[test]
    fn runtime_config_carries_ports_dns_bandwidth_and_ranges() {
        let mut spec = PodSpec {
            port_mappings: vec![
                PortMapping {
                    protocol: "TCP".into(),
                    container_port: 80,
                    host_port: 8080,
                    host_ip: String::new(),
                },
                // No host port: nothing for portmap to do.
                PortMapping {
                    protocol: "UDP".into(),
                    container_port: 53,
                    host_port: 0,
                    host_ip: String::new(),
                },
            ],
            dns: Some(Dns {
                servers: vec!["10.0.0.10".into()],
                searches: vec!["svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            ..Default::default()
        };
        spec.annotations
            .insert("kubernetes.io/ingress-bandwidth".into(), "10M".into());
        let rc = runtime_config(&spec, "10.244.0.0/24");
        assert_eq!(
            rc["portMappings"],
            json!([{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}])
        );
        assert_eq!(rc["dns"]["servers"][0], "10.0.0.10");
        assert_eq!(rc["ipRanges"][0][0]["subnet"], "10.244.0.0/24");
        assert_eq!(rc["bandwidth"]["ingressRate"], 10_000_000);
        assert!(rc["bandwidth"].get("egressRate").is_none());
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("1Mi"), Some(1 << 20));
        assert_eq!(parse_quantity("2.5k"), Some(2500));
        assert_eq!(parse_quantity("7"), Some(7));
        assert_eq!(parse_quantity("1X"), None);
    }
}
