//! hako's configuration: a TOML file in which every key is optional.
//!
//! Unknown keys are rejected (with the key named) rather than ignored, so that a typo in an
//! operator's config cannot silently fall back to a default.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Where `hako serve` looks for its config when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/hako/config.toml";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The CRI socket.
    pub listen: PathBuf,
    /// Persistent data: metadata store, image content and snapshots.
    pub root: PathBuf,
    /// Volatile state (tmpfs in production): sockets, per-pod runtime state.
    pub state: PathBuf,
    pub registry: RegistryConfig,
    pub image: ImageConfig,
    pub runtime: RuntimeConfig,
    pub cni: CniConfig,
    pub cdi: CdiConfig,
    pub streaming: StreamingConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RegistryConfig {
    /// containerd-style `certs.d` directory: `<config_path>/<host>/hosts.toml`.
    pub config_path: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ImageConfig {
    /// A pull that transfers no byte for this many seconds fails with DEADLINE_EXCEEDED.
    pub pull_progress_timeout_secs: u64,
    /// Layers downloaded at the same time, across all pulls on the node.
    pub max_concurrent_downloads: usize,
    /// Layers of one image unpacked at the same time (each still placed after the one below).
    pub max_concurrent_unpacks: usize,
    /// Layers unpacked at the same time across all pulls on the node.
    pub max_node_unpacks: usize,
    /// Bound on one layer's uncompressed size and on the bytes its unpack writes; 0 = none.
    pub max_layer_unpacked_bytes: u64,
    /// Bound on the files, directories and links one layer's unpack creates; 0 = none.
    pub max_layer_entries: u64,
    /// Flush each unpacked layer to disk (syncfs), so none is trusted across a power loss
    /// before it is on disk.
    pub sync_layers: bool,
    /// With `sync_layers`: record a layer only once it is on disk, and answer the pull after
    /// that. Off, layers are synced in the background and one not yet on disk when the
    /// machine went down is dropped at the next start (`image::durability`).
    pub wait_for_layer_sync: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    /// Never give a container a lower `oom_score_adj` than the daemon's own (containerd's
    /// option of the same name). Applied anyway when the daemon lacks CAP_SYS_RESOURCE, since
    /// the kernel would refuse the lower value.
    pub restrict_oom_score_adj: bool,
    /// Mount containers' writable layers without overlayfs' `volatile` option: a container's
    /// fsyncs then reach the disk, and each removal syncs the whole filesystem under the root
    /// dir (containerd's default). Off, as CRI-O has it: no container's layer is used again
    /// after a crash, and that sync would flush every other writer's data with it.
    pub sync_writable_layers: bool,
    /// The cgroup driver hako tells kubelet to use (the `RuntimeConfig` RPC).
    pub cgroup_driver: CgroupDriver,
    /// Runtime handler names (a RuntimeClass's `handler`) served as the default one; a pod
    /// naming any other handler is refused.
    pub handlers: Vec<String>,
}

/// How kubelet names the pods' cgroup parents. hako makes every cgroup itself, through
/// cgroupfs, either way: a systemd slice name (`kubepods-burstable-pod1.slice`) is read as its
/// path in systemd's layout (`/kubepods.slice/kubepods-burstable.slice/...`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    #[default]
    Cgroupfs,
    Systemd,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CniConfig {
    /// Network configurations; the first `.conflist`/`.conf`/`.json` in lexical order is used,
    /// read again for every pod (changes apply without a restart).
    pub conf_dir: PathBuf,
    /// Where plugin binaries are looked up, in order.
    pub bin_dirs: Vec<PathBuf>,
    /// Use the configuration with this network name instead of the first file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_name: Option<String>,
    /// A plugin that has not answered after this long is killed and its call fails.
    pub plugin_timeout_secs: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CdiConfig {
    /// Later directories override earlier ones.
    pub spec_dirs: Vec<PathBuf>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StreamingConfig {
    /// Address of the exec/attach/port-forward HTTP server.
    pub address: String,
    /// TLS certificate chain and key (PEM); both or neither.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// A streaming connection with no traffic this long is closed (containerd's
    /// stream_idle_timeout, 4 h).
    pub idle_timeout_secs: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "/run/hako/hako.sock".into(),
            root: "/var/lib/hako".into(),
            state: "/run/hako".into(),
            registry: RegistryConfig::default(),
            image: ImageConfig::default(),
            runtime: RuntimeConfig::default(),
            cni: CniConfig::default(),
            cdi: CdiConfig::default(),
            streaming: StreamingConfig::default(),
        }
    }
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            config_path: "/etc/hako/certs.d".into(),
        }
    }
}

impl Default for ImageConfig {
    fn default() -> Self {
        // containerd's image_pull_progress_timeout is 5 minutes, and its max_concurrent_downloads 3.
        ImageConfig {
            pull_progress_timeout_secs: 300,
            max_concurrent_downloads: 3,
            // Two: most of a layer unpacks without the one below (docs/BENCHMARKS.md); each
            // more holds a decompressor window and three threads.
            max_concurrent_unpacks: 2,
            // Each unpack holds three threads and a decompressor window (up to 128 MiB for
            // zstd): a thousand pulls at once must not mean six thousand threads. Eight keeps
            // four images unpacking two layers each, more than two cores can decompress.
            max_node_unpacks: 8,
            // Out of the way of very large real layers (ML and CUDA images), and a bound on
            // what a decompression bomb can write before it fails.
            max_layer_unpacked_bytes: 64 << 30,
            max_layer_entries: 4 << 20,
            // A layer recorded as complete must survive a power loss (docs/CONFIGURATION.md).
            sync_layers: true,
            // The pull answers without waiting for the disk; durability comes from the
            // background sync and the drop at the next boot instead (docs/CONFIGURATION.md).
            wait_for_layer_sync: false,
        }
    }
}

impl Default for CniConfig {
    fn default() -> Self {
        CniConfig {
            conf_dir: "/etc/cni/net.d".into(),
            bin_dirs: vec!["/opt/cni/bin".into(), "/usr/lib/cni".into()],
            network_name: None,
            plugin_timeout_secs: 60,
        }
    }
}

impl Default for CdiConfig {
    fn default() -> Self {
        CdiConfig {
            spec_dirs: vec!["/etc/cdi".into(), "/var/run/cdi".into()],
        }
    }
}

impl Default for StreamingConfig {
    fn default() -> Self {
        StreamingConfig {
            address: "127.0.0.1:0".into(),
            tls_cert_file: None,
            tls_key_file: None,
            idle_timeout_secs: 4 * 3600,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid config file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The most downloads or unpacks a config may allow at once. Each unpack holds three threads.
const MAX_SLOTS: usize = 1024;

impl Config {
    /// Loads the config. `explicit` is true when the operator named the file: then a missing file
    /// is an error; the default file may be absent.
    pub fn load(path: &Path, explicit: bool) -> Result<Config, ConfigError> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => {
                return Ok(Config::default());
            }
            Err(source) => {
                return Err(ConfigError::Read {
                    path: path.into(),
                    source,
                })
            }
        };
        let config = Self::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.into(),
            message,
        })?;
        config.validate().map_err(|message| ConfigError::Invalid {
            path: path.into(),
            message,
        })?;
        Ok(config)
    }

    /// Parses TOML text; the error names the offending key and line.
    pub fn parse(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().replace('\n', " "))
    }

    fn validate(&self) -> Result<(), String> {
        for (key, path) in [
            ("listen", &self.listen),
            ("root", &self.root),
            ("state", &self.state),
        ] {
            if !path.is_absolute() {
                return Err(format!(
                    "{key} must be an absolute path, got {}",
                    path.display()
                ));
            }
        }
        // The counts size semaphores and thread pools: a value past MAX_SLOTS is a typo, and
        // one past tokio's permit limit would panic at start instead of failing here.
        for (key, value) in [
            (
                "image.max_concurrent_downloads",
                self.image.max_concurrent_downloads,
            ),
            (
                "image.max_concurrent_unpacks",
                self.image.max_concurrent_unpacks,
            ),
            ("image.max_node_unpacks", self.image.max_node_unpacks),
        ] {
            if !(1..=MAX_SLOTS).contains(&value) {
                return Err(format!(
                    "{key} must be between 1 and {MAX_SLOTS}, got {value}"
                ));
            }
        }
        if self.image.pull_progress_timeout_secs == 0 {
            return Err("image.pull_progress_timeout_secs must be at least 1".into());
        }
        if self.streaming.idle_timeout_secs == 0 {
            return Err("streaming.idle_timeout_secs must be at least 1".into());
        }
        if self.streaming.idle_timeout_secs > 7 * 24 * 3600 {
            return Err("streaming.idle_timeout_secs must be at most 604800 (7 days)".into());
        }
        if self.streaming.tls_cert_file.is_some() != self.streaming.tls_key_file.is_some() {
            return Err("streaming.tls_cert_file and streaming.tls_key_file go together".into());
        }
        Ok(())
    }

    /// The full default config, as `hako config default` prints it.
    pub fn default_toml() -> String {
        toml::to_string_pretty(&Config::default()).expect("default config serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(Config::parse("").unwrap(), Config::default());
    }

    #[test]
    fn default_toml_round_trips() {
        let text = Config::default_toml();
        assert!(text.contains("[registry]"), "{text}");
        assert_eq!(Config::parse(&text).unwrap(), Config::default());
    }

    #[test]
    fn keys_override_defaults() {
        let c = Config::parse(
            "root = \"/tmp/r\"\n[cni]\nbin_dirs = [\"/x\"]\n[image]\npull_progress_timeout_secs = 7\n",
        )
        .unwrap();
        assert_eq!(c.root, PathBuf::from("/tmp/r"));
        assert_eq!(c.cni.bin_dirs, vec![PathBuf::from("/x")]);
        assert_eq!(c.cni.conf_dir, CniConfig::default().conf_dir);
        assert_eq!(c.image.pull_progress_timeout_secs, 7);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::parse("[registry]\nconfig_pth = \"/x\"\n").unwrap_err();
        assert!(err.contains("config_pth"), "{err}");
        let err = Config::parse("lisen = \"/x\"\n").unwrap_err();
        assert!(err.contains("lisen"), "{err}");
    }

    #[test]
    fn missing_default_file_is_fine_missing_explicit_is_not() {
        let p = Path::new("/nonexistent/hako/config.toml");
        assert_eq!(Config::load(p, false).unwrap(), Config::default());
        let err = Config::load(p, true).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/hako/config.toml"),
            "{err}"
        );
    }

    #[test]
    fn relative_root_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        std::fs::write(&p, "root = \"var/lib\"\n").unwrap();
        let err = Config::load(&p, true).unwrap_err().to_string();
        assert!(err.contains("root must be an absolute path"), "{err}");
    }

    #[test]
    fn slot_counts_out_of_range_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.toml");
        for (line, want) in [
            (
                "max_node_unpacks = 0",
                "image.max_node_unpacks must be between 1 and 1024, got 0",
            ),
            // Past tokio's permit limit: a panic at start before this was checked.
            (
                "max_concurrent_downloads = 2305843009213693952",
                "image.max_concurrent_downloads must be between 1 and 1024, got 2305843009213693952",
            ),
            (
                "max_concurrent_unpacks = 1025",
                "image.max_concurrent_unpacks must be between 1 and 1024, got 1025",
            ),
        ] {
            std::fs::write(&p, format!("[image]\n{line}\n")).unwrap();
            let err = Config::load(&p, true).unwrap_err().to_string();
            assert!(err.contains(want), "{line}: {err}");
        }
        std::fs::write(&p, "[image]\nmax_node_unpacks = 1024\n").unwrap();
        assert_eq!(Config::load(&p, true).unwrap().image.max_node_unpacks, 1024);
    }
}
