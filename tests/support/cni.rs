//! A real CNI network for tests: Debian's bridge, host-local and portmap plugins on a bridge
//! and subnet of the test's own, with IPAM leases in a temp dir; removed on drop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// Where Debian (and upstream) install the plugins.
pub const PLUGIN_DIRS: &[&str] = &["/usr/lib/cni", "/opt/cni/bin"];

pub fn plugin_dir() -> Option<PathBuf> {
    PLUGIN_DIRS
        .iter()
        .map(PathBuf::from)
        .find(|d| d.join("bridge").is_file() && d.join("host-local").is_file())
}

/// True when the plugins and `ip`/`iptables` are here; otherwise says why (fails under
/// HAKO_E2E_REQUIRED).
pub fn ready() -> bool {
    if !super::e2e_ready(&["ip", "iptables"]) {
        return false;
    }
    if plugin_dir().is_some() {
        return true;
    }
    super::skip(
        "the whole test",
        &format!("CNI plugins (bridge, host-local) not found in {PLUGIN_DIRS:?}"),
    );
    false
}

pub struct TestNet {
    pub dir: tempfile::TempDir,
    pub bridge: String,
    /// e.g. "10.201.7"
    pub prefix: String,
    pub gateway: String,
    pub conf_dir: PathBuf,
    pub leases: PathBuf,
    /// Extra plugins the test provides (scripts), searched before the system's.
    pub bin_dir: PathBuf,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl TestNet {
    /// A bridge + host-local + portmap network on a /24 no other test uses.
    pub fn new() -> TestNet {
        let n = SEQ.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let bridge = format!("hk{}x{n}", pid % 100_000);
        let prefix = format!("10.{}.{}", 200 + (pid % 50), (n * 7 + pid / 50) % 250);
        let dir = tempfile::tempdir().unwrap();
        let conf_dir = dir.path().join("net.d");
        let bin_dir = dir.path().join("bin");
        let leases = dir.path().join("leases");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::create_dir_all(&bin_dir).unwrap();
        let net = TestNet {
            gateway: format!("{prefix}.1"),
            dir,
            bridge,
            prefix,
            conf_dir,
            leases,
            bin_dir,
        };
        net.write_conflist("10-test.conflist", &[]);
        net
    }

    /// The standard list (bridge, portmap) with `extra` plugin configs appended.
    pub fn write_conflist(&self, file: &str, extra: &[serde_json::Value]) {
        self.write_conflist_around(file, &[], extra)
    }

    /// The standard list with `first` before it and `extra` after it.
    pub fn write_conflist_around(
        &self,
        file: &str,
        first: &[serde_json::Value],
        extra: &[serde_json::Value],
    ) {
        let mut plugins: Vec<serde_json::Value> = first.to_vec();
        plugins.extend([
            serde_json::json!({
                "type": "bridge",
                "bridge": self.bridge,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": self.leases,
                    "ranges": [[{"subnet": format!("{}.0/24", self.prefix), "gateway": self.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}]
                }
            }),
            serde_json::json!({"type": "portmap", "capabilities": {"portMappings": true}}),
        ]);
        plugins.extend(extra.iter().cloned());
        let conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": format!("test-{}", self.bridge),
            "plugins": plugins,
        });
        std::fs::write(
            self.conf_dir.join(file),
            serde_json::to_vec_pretty(&conf).unwrap(),
        )
        .unwrap();
    }

    /// Installs a plugin script in the test's own bin dir.
    pub fn plugin_script(&self, name: &str, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        let p = self.bin_dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// hako config lines for this network.
    pub fn hako_config(&self, timeout_secs: u64) -> String {
        format!(
            "[cni]\nconf_dir = \"{}\"\nbin_dirs = [\"{}\", \"{}\"]\nplugin_timeout_secs = {timeout_secs}\n",
            self.conf_dir.display(),
            self.bin_dir.display(),
            plugin_dir().unwrap().display()
        )
    }

    /// IPs host-local has leased (its files named by address).
    pub fn leased(&self) -> Vec<String> {
        let dir = self.leases.join(format!("test-{}", self.bridge));
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&self.prefix))
            .collect()
    }

    /// veth interfaces attached to the test bridge.
    pub fn veths(&self) -> Vec<String> {
        let out = std::process::Command::new("ip")
            .args(["-o", "link", "show", "master", &self.bridge])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|s| s.trim().to_string())
            .collect()
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}

/// Network namespace bind mounts under `dir` still mounted.
pub fn netns_mounts_under(dir: &Path) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("nsfs") && l.contains(&dir.display().to_string()))
        .map(str::to_string)
        .collect()
}

/// (rx_bytes, tx_bytes) of eth0 as the kernel counts them in `pid`'s network namespace.
pub fn netns_eth0(pid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/dev")).unwrap();
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("eth0:"))
        .unwrap_or_else(|| panic!("no eth0 in the pod's netns: {text}"));
    let f: Vec<u64> = line
        .split_once(':')
        .unwrap()
        .1
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    (f[0], f[8])
}
