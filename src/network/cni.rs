//! A CNI client (spec up to 1.1): network configuration from a directory, plugins executed
//! from the configured binary directories with the CNI environment and JSON on stdin.
//!
//! The configuration is read again on every use, so a change in the directory applies to the
//! next pod without a restart. Each ADD result is cached on disk with the configuration it
//! was made with: DEL and CHECK use exactly that, after a daemon restart, after the directory
//! changed, and when the network namespace is already gone.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::error::{Error, Result};

/// A network configuration list, as loaded from `conf_dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetworkConfig {
    pub name: String,
    pub cni_version: String,
    pub plugins: Vec<Value>,
    pub disable_check: bool,
    /// The file it came from.
    pub source: PathBuf,
}

/// One pod's attachment to the network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Attachment {
    pub container_id: String,
    pub netns: PathBuf,
    pub ifname: String,
    /// CNI_ARGS pairs.
    pub args: Vec<(String, String)>,
    /// Everything the runtime can offer; each plugin gets the keys its `capabilities` names.
    pub runtime_config: Value,
}

/// What is cached per attachment: enough to DEL it with no other state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cached {
    pub config: NetworkConfig,
    pub attachment: Attachment,
    pub result: Value,
}

pub struct Cni {
    pub conf_dir: PathBuf,
    pub bin_dirs: Vec<PathBuf>,
    /// Where ADD results are kept (persistent: IPAM leases outlive reboots).
    pub cache_dir: PathBuf,
    /// Use the configuration of this name rather than the first file.
    pub network_name: Option<String>,
    pub plugin_timeout: Duration,
}

/// `a` >= `b` for dotted versions ("0.4.0", "1.1.0").
pub fn version_at_least(a: &str, b: &str) -> bool {
    let parse = |v: &str| -> Vec<u64> { v.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    parse(a) >= parse(b)
}

/// Parses one configuration file: a `.conflist`, or a single-plugin `.conf`/`.json`.
pub fn parse_config(path: &Path, text: &str) -> std::result::Result<NetworkConfig, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let name = v["name"]
        .as_str()
        .filter(|n| !n.is_empty())
        .ok_or("no network name")?
        .to_string();
    let cni_version = v["cniVersion"].as_str().unwrap_or("0.2.0").to_string();
    let plugins = match v.get("plugins") {
        Some(Value::Array(p)) => p.clone(),
        Some(_) => return Err("plugins is not a list".into()),
        None if v.get("type").is_some() => vec![v.clone()],
        None => return Err("neither plugins nor type".into()),
    };
    if plugins.is_empty() {
        return Err("no plugins".into());
    }
    for (i, p) in plugins.iter().enumerate() {
        if p["type"].as_str().is_none_or(str::is_empty) {
            return Err(format!("plugins[{i}] has no type"));
        }
    }
    Ok(NetworkConfig {
        name,
        cni_version,
        plugins,
        disable_check: v["disableCheck"].as_bool().unwrap_or(false),
        source: path.to_path_buf(),
    })
}

impl Cni {
    /// The network configuration in use: the one named, else the first valid file in lexical
    /// order. Files that do not parse are logged and passed over, as libcni does.
    pub fn load(&self) -> Result<NetworkConfig> {
        let mut files: Vec<PathBuf> = match std::fs::read_dir(&self.conf_dir) {
            Ok(rd) => rd
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    matches!(
                        p.extension().and_then(|e| e.to_str()),
                        Some("conf" | "conflist" | "json")
                    )
                })
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(Error::io("read CNI config dir", &self.conf_dir, e)),
        };
        files.sort();
        for f in &files {
            let Ok(text) = std::fs::read_to_string(f) else {
                continue;
            };
            match parse_config(f, &text) {
                Ok(c) => {
                    if self.network_name.as_ref().is_none_or(|n| *n == c.name) {
                        return Ok(c);
                    }
                }
                Err(e) => {
                    tracing::warn!(file = %f.display(), error = %e, "invalid CNI network config")
                }
            }
        }
        Err(Error::FailedPrecondition(match &self.network_name {
            Some(n) => format!(
                "no CNI network config named {n:?} in {}",
                self.conf_dir.display()
            ),
            None => format!("no CNI network config in {}", self.conf_dir.display()),
        }))
    }

    fn find_plugin(&self, kind: &str) -> Result<PathBuf> {
        if kind.contains('/') {
            return Err(Error::InvalidArgument(format!(
                "CNI plugin type {kind:?} is not a plain name"
            )));
        }
        self.bin_dirs
            .iter()
            .map(|d| d.join(kind))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "CNI plugin {kind} not found in {}",
                    self.bin_dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }

    /// Whether the network can take pods: a config, its plugins present, and (CNI 1.1) every
    /// plugin's STATUS answering success. The error says why not.
    pub async fn ready(&self) -> Result<()> {
        let cfg = self.load()?;
        for p in &cfg.plugins {
            self.find_plugin(p["type"].as_str().unwrap_or_default())?;
        }
        if version_at_least(&cfg.cni_version, "1.1.0") {
            for p in &cfg.plugins {
                self.exec(&cfg, p, "STATUS", None, None).await?;
            }
        }
        Ok(())
    }

    fn cache_path(&self, container_id: &str, ifname: &str) -> PathBuf {
        self.cache_dir.join(format!("{container_id}-{ifname}.json"))
    }

    /// Every cached attachment (for GC at start), and the (container id, ifname) of each entry
    /// that does not parse (a write torn by a power loss before this daemon synced them, or
    /// damage). A `.tmp` left by a crash between a write and its rename is removed: the entry
    /// it was replacing is still in place (the first write comes before any plugin runs), so
    /// it holds nothing DEL would need.
    pub fn cached(&self) -> (Vec<Cached>, Vec<(String, String)>) {
        let (mut out, mut unreadable) = (Vec::new(), Vec::new());
        for e in std::fs::read_dir(&self.cache_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = e.path();
            if path.extension().is_some_and(|x| x == "tmp") {
                tracing::info!(file = %path.display(), "removing a CNI result cache write a crash cut short");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            match std::fs::read(&path).map(|b| serde_json::from_slice::<Cached>(&b)) {
                Ok(Ok(c)) => out.push(c),
                _ => {
                    // `<container id>-<ifname>.json`; a pod id has no '-'.
                    let key = path
                        .file_stem()
                        .and_then(|n| n.to_str())
                        .and_then(|n| n.split_once('-'));
                    match key {
                        Some((id, ifname)) if path.extension().is_some_and(|x| x == "json") => {
                            unreadable.push((id.to_string(), ifname.to_string()))
                        }
                        _ => {
                            tracing::warn!(file = %path.display(), "stray file among the CNI result cache entries")
                        }
                    }
                }
            }
        }
        (out, unreadable)
    }

    /// ADD through every plugin of the list. On failure the plugins already run are undone
    /// (DEL) and nothing is cached.
    pub async fn add(&self, att: &Attachment) -> Result<Cached> {
        let cfg = self.load()?;
        // Cached before the first plugin runs: if the daemon dies midway, DEL still knows
        // what to undo.
        let mut cached = Cached {
            config: cfg.clone(),
            attachment: att.clone(),
            result: Value::Null,
        };
        self.save(&cached, true)?;
        let mut prev: Option<Value> = None;
        for p in &cfg.plugins {
            match self.exec(&cfg, p, "ADD", Some(att), prev.as_ref()).await {
                Ok(r) => prev = Some(r),
                Err(e) => {
                    if let Err(d) = self.del_cached(&cached).await {
                        tracing::warn!(pod = %att.container_id, error = %crate::error::chain(&d), "DEL after a failed ADD");
                    }
                    return Err(e);
                }
            }
        }
        cached.result = prev.unwrap_or(Value::Null);
        self.save(&cached, false)?;
        Ok(cached)
    }

    /// The first write of an attachment (before any plugin runs) is made durable as a name:
    /// the directory is synced, so after a power loss an attachment whose IPAM lease survived
    /// has its entry, and a missing one means nothing to release. Its contents are not synced:
    /// an entry a power loss left empty or torn is DELed through the current configuration
    /// (`del`), and a lost rewrite with the result leaves the first, which DEL can use without
    /// `prevResult`. (One sync per pod start: three cost about 1.7 ms here.)
    fn save(&self, c: &Cached, first: bool) -> Result<()> {
        std::fs::create_dir_all(&self.cache_dir)
            .map_err(|e| Error::io("create directory", &self.cache_dir, e))?;
        let path = self.cache_path(&c.attachment.container_id, &c.attachment.ifname);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(c).expect("cache entry serializes"))
            .map_err(|e| Error::io("write", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename", &path, e))?;
        if first {
            std::fs::File::open(&self.cache_dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io("sync", &self.cache_dir, e))?;
        }
        Ok(())
    }

    /// DEL of a cached attachment, plugins in reverse order, with the configuration ADD used.
    /// Every plugin runs even when one fails; the cache entry goes only when all succeeded.
    pub async fn del_cached(&self, c: &Cached) -> Result<()> {
        let prev = (!c.result.is_null()).then_some(&c.result);
        let mut first_err = None;
        for p in c.config.plugins.iter().rev() {
            if let Err(e) = self
                .exec(&c.config, p, "DEL", Some(&c.attachment), prev)
                .await
            {
                first_err.get_or_insert(e);
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let path = self.cache_path(&c.attachment.container_id, &c.attachment.ifname);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::io("remove", &path, e))
            }
            _ => Ok(()),
        }
    }

    /// DEL of the attachment `container_id`/`ifname`, if it has one: from its cache entry, or,
    /// when the entry is there but does not parse, through the current configuration with
    /// `fallback` (the attachment as it would be made now; a bare one without), as libcni does
    /// without a cache. Skipping it would leak the IPAM lease for good.
    pub async fn del(
        &self,
        container_id: &str,
        ifname: &str,
        fallback: Option<&Attachment>,
    ) -> Result<()> {
        let path = self.cache_path(container_id, ifname);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("read", &path, e)),
        };
        let err = match serde_json::from_slice::<Cached>(&bytes) {
            Ok(c) => return self.del_cached(&c).await,
            Err(e) => e,
        };
        let config = self.load().map_err(|e| {
            e.context(format!(
                "the CNI result cache entry {} does not parse ({err}), and DEL needs a network configuration instead",
                path.display()
            ))
        })?;
        tracing::warn!(file = %path.display(), error = %err, network = %config.name, "CNI result cache entry does not parse: DEL through the current network configuration");
        let attachment = fallback.cloned().unwrap_or_else(|| Attachment {
            container_id: container_id.to_string(),
            netns: PathBuf::new(),
            ifname: ifname.to_string(),
            args: vec![("IgnoreUnknown".into(), "1".into())],
            runtime_config: json!({}),
        });
        self.del_cached(&Cached {
            config,
            attachment,
            result: Value::Null,
        })
        .await
    }

    /// CHECK of a cached attachment (CNI 0.4.0 and later, unless the list disables it).
    pub async fn check(&self, c: &Cached) -> Result<()> {
        if c.config.disable_check || !version_at_least(&c.config.cni_version, "0.4.0") {
            return Ok(());
        }
        for p in &c.config.plugins {
            self.exec(&c.config, p, "CHECK", Some(&c.attachment), Some(&c.result))
                .await?;
        }
        Ok(())
    }

    /// CNI 1.1 GC: plugins release whatever is not one of `valid` (container id, ifname).
    pub async fn gc(&self, valid: &[(String, String)]) -> Result<()> {
        let cfg = self.load()?;
        if !version_at_least(&cfg.cni_version, "1.1.0") {
            return Ok(());
        }
        let list: Vec<Value> = valid
            .iter()
            .map(|(id, ifname)| json!({"containerID": id, "ifname": ifname}))
            .collect();
        for p in &cfg.plugins {
            let mut p = p.clone();
            p["cni.dev/valid-attachments"] = json!(list);
            self.exec(&cfg, &p, "GC", None, None).await?;
        }
        Ok(())
    }

    /// Runs one plugin. Errors name the plugin, the command, the plugin's message and stderr.
    async fn exec(
        &self,
        cfg: &NetworkConfig,
        plugin: &Value,
        command: &str,
        att: Option<&Attachment>,
        prev: Option<&Value>,
    ) -> Result<Value> {
        let kind = plugin["type"].as_str().unwrap_or_default().to_string();
        let bin = self.find_plugin(&kind)?;
        let mut conf = plugin.clone();
        conf["name"] = json!(cfg.name);
        conf["cniVersion"] = json!(cfg.cni_version);
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        if let Some(att) = att {
            let mut rc = serde_json::Map::new();
            if let Some(caps) = plugin["capabilities"].as_object() {
                for (k, on) in caps {
                    if on.as_bool() == Some(true) {
                        if let Some(v) = att.runtime_config.get(k) {
                            rc.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            if !rc.is_empty() {
                conf["runtimeConfig"] = Value::Object(rc);
            }
        }
        let path_var = self
            .bin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.env_clear()
            .env(
                "PATH",
                std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into()),
            )
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", &path_var)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // Its own process group: a plugin that is killed takes what it started with it.
            .process_group(0)
            .kill_on_drop(true);
        if let Some(att) = att {
            let args = att
                .args
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(";");
            cmd.env("CNI_CONTAINERID", &att.container_id)
                .env("CNI_NETNS", &att.netns)
                .env("CNI_IFNAME", &att.ifname)
                .env("CNI_ARGS", args);
        }
        let what = format!("CNI plugin {kind} ({command}, network {})", cfg.name);
        let started = std::time::Instant::now();
        // One deadline for the start and the run: a plugin gets `plugin_timeout` in all.
        let deadline = tokio::time::Instant::now() + self.plugin_timeout;
        let (mut child, group) = spawn_with_umask_022(cmd, deadline)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::TimedOut => {
                    Error::DeadlineExceeded(format!("{what}: run {}: {e}", bin.display()))
                }
                std::io::ErrorKind::WouldBlock => {
                    Error::Unavailable(format!("{what}: run {}: {e}", bin.display()))
                }
                _ => Error::Internal(format!("{what}: run {}: {e}", bin.display())),
            })?;
        let input = serde_json::to_vec(&conf).expect("plugin config serializes");
        let mut stdin = child.stdin.take().expect("piped stdin");
        let run = async {
            // A plugin may exit without reading its stdin; that is its answer, not ours to fail.
            let _ = stdin.write_all(&input).await;
            drop(stdin);
            child.wait_with_output().await
        };
        let out = match tokio::time::timeout_at(deadline, run).await {
            Ok(Ok(out)) => {
                group.disarm();
                out
            }
            Ok(Err(e)) => return Err(Error::Internal(format!("{what}: {e}"))),
            Err(_) => {
                return Err(Error::DeadlineExceeded(format!(
                    "{what}: no answer after {} s; killed",
                    self.plugin_timeout.as_secs()
                )))
            }
        };
        tracing::debug!(plugin = %kind, command, ms = started.elapsed().as_secs_f64() * 1e3, "CNI plugin ran");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            if stdout.trim().is_empty() {
                return Ok(Value::Null);
            }
            return serde_json::from_str(&stdout).map_err(|e| {
                Error::Internal(format!("{what}: unreadable result ({e}): {stdout}"))
            });
        }
        let detail = match serde_json::from_str::<Value>(&stdout) {
            Ok(v) if v.get("msg").is_some() => {
                let mut m = v["msg"].as_str().unwrap_or_default().to_string();
                if let Some(d) = v["details"].as_str().filter(|d| !d.is_empty()) {
                    m.push_str(": ");
                    m.push_str(d);
                }
                format!("{m} (code {})", v["code"])
            }
            _ => format!("{}, output {:?}", out.status, stdout.trim()),
        };
        let mut msg = format!("{what} failed: {detail}");
        if !stderr.trim().is_empty() {
            msg.push_str(&format!("; stderr: {}", stderr.trim()));
        }
        Err(Error::Internal(msg))
    }
}

/// The pod's IPs from an ADD result: the addresses on the sandbox interface named `ifname`
/// (as containerd picks them), IPv4 first, without prefix length. A result that names no
/// interfaces (older plugins) gives all its addresses.
pub fn pod_ips(result: &Value, ifname: &str) -> Vec<String> {
    let ifaces = result["interfaces"].as_array().cloned().unwrap_or_default();
    let mut ips: Vec<String> = result["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|ip| match ip["interface"].as_u64() {
            Some(i) => ifaces.get(i as usize).is_some_and(|f| {
                f["name"] == ifname && f["sandbox"].as_str().is_some_and(|s| !s.is_empty())
            }),
            None => ifaces.is_empty(),
        })
        .filter_map(|ip| ip["address"].as_str())
        .map(|a| a.split('/').next().unwrap_or(a).to_string())
        .collect();
    ips.sort_by_key(|ip| ip.contains(':'));
    ips
}

/// Plugin starts given up on whose spawning thread has not returned yet. A start stuck for
/// good (an exec on a hung filesystem) keeps its thread; past this many, CNI calls fail at
/// once instead of piling up threads and half-started children (STATUS runs behind every
/// Status RPC). Starts under way that nobody gave up on are not counted: a burst of pod
/// starts is no reason to refuse one.
const MAX_STUCK_SPAWNS: usize = 64;
static STUCK_SPAWNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A spawning thread's state, shared with its caller: whoever moves it out of `WAITING`
/// first decides whether the start counts as stuck.
const WAITING: u8 = 0;
const DONE: u8 = 1;
const ABANDONED: u8 = 2;

/// Starts `cmd` with umask 022: plugins write files others read (leases, iptables locks), and
/// the daemon's own umask is 077. Returns the child with the guard that kills its process
/// group unless disarmed.
///
/// The umask is set on a short-lived thread of its own, one per plugin: `unshare(CLONE_FS)`
/// gives that thread its own umask (with its own copy of cwd and root), leaving the daemon's
/// at 077, and a child started from there inherits it. So no `pre_exec` hook is needed, and
/// std starts the plugin with `posix_spawn` (a vfork) rather than a fork of the whole daemon,
/// whose page-table copy and copy-on-write faults were about a sixth of the daemon's CPU when
/// pods started ten at a time; a thread costs far less. Nothing but the spawn runs on it (a
/// thread it made would share its umask). Should the unshare fail, the child sets its umask
/// after a fork, as before. A spawn that does not return by `deadline` (an exec stuck on a
/// hung filesystem) fails this call only (`TimedOut`); the plugin, should it start after all,
/// is killed with its group, and so is one handed over to a caller that went away before
/// taking it. While `MAX_STUCK_SPAWNS` such starts have not returned, calls fail at once
/// (`WouldBlock`).
async fn spawn_with_umask_022(
    cmd: tokio::process::Command,
    deadline: tokio::time::Instant,
) -> std::io::Result<(tokio::process::Child, GroupKiller)> {
    use std::sync::atomic::{AtomicU8, Ordering};
    let stuck = STUCK_SPAWNS.load(Ordering::Acquire);
    if stuck >= MAX_STUCK_SPAWNS {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            format!("{stuck} earlier plugin starts never returned (an exec on a hung filesystem?)"),
        ));
    }
    let state = std::sync::Arc::new(AtomicU8::new(WAITING));
    let thread_state = state.clone();
    let runtime = tokio::runtime::Handle::current();
    let (tx, rx) =
        tokio::sync::oneshot::channel::<std::io::Result<(GroupKiller, tokio::process::Child)>>();
    std::thread::Builder::new()
        .name("cni-spawn".into())
        .spawn(move || {
            let mut cmd = cmd;
            match nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS) {
                Ok(()) => {
                    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "no umask of its own for a CNI plugin's spawning thread: the plugin starts through a fork");
                    // SAFETY: umask(2) is async-signal-safe and touches nothing shared with
                    // the parent.
                    unsafe {
                        cmd.pre_exec(|| {
                            libc::umask(0o022);
                            Ok(())
                        });
                    }
                }
            }
            // tokio registers the child with the runtime's process driver.
            let _in_runtime = runtime.enter();
            // The guard travels with the child: dropped unreceived (the caller gave up before
            // or after the send), it kills the plugin's group first (fields drop in order).
            let spawned = cmd.spawn().map(|child| (GroupKiller(child.id()), child));
            let _ = tx.send(spawned);
            if thread_state.swap(DONE, Ordering::AcqRel) == ABANDONED {
                STUCK_SPAWNS.fetch_sub(1, Ordering::AcqRel);
            }
        })?;
    match tokio::time::timeout_at(deadline, rx).await {
        Ok(Ok(spawned)) => spawned.map(|(group, child)| (child, group)),
        Ok(Err(_)) => Err(std::io::Error::other(
            "the spawning thread ended without a child",
        )),
        Err(_) => {
            if state
                .compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                STUCK_SPAWNS.fetch_add(1, Ordering::AcqRel);
            }
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "not started by the plugin deadline",
            ))
        }
    }
}

/// Kills a plugin's whole process group when the plugin is given up on (timeout, or the call
/// is dropped): `kill_on_drop` alone would leave what the plugin started running.
struct GroupKiller(Option<u32>);

impl GroupKiller {
    /// The plugin exited on its own: whatever it left in its group is its business (a plugin
    /// may start a daemon on purpose).
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for GroupKiller {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_files_parse_with_their_cause_on_error() {
        let p = Path::new("/x/10-a.conflist");
        let c = parse_config(
            p,
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"portmap"}]}"#,
        )
        .unwrap();
        assert_eq!((c.name.as_str(), c.plugins.len()), ("n", 2));
        let single = parse_config(p, r#"{"cniVersion":"0.4.0","name":"s","type":"ptp"}"#).unwrap();
        assert_eq!(single.plugins[0]["type"], "ptp");
        assert!(parse_config(p, r#"{"name":"n","plugins":[]}"#)
            .unwrap_err()
            .contains("no plugins"));
        assert!(parse_config(p, r#"{"name":"n","plugins":[{"x":1}]}"#)
            .unwrap_err()
            .contains("plugins[0] has no type"));
        assert!(parse_config(p, "{").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn pod_ips_come_from_sandbox_interfaces_ipv4_first() {
        let r = json!({
            "interfaces": [{"name": "cni0"}, {"name": "veth1"}, {"name": "eth0", "sandbox": "/var/run/netns/x"}],
            "ips": [
                {"address": "fd00::5/64", "interface": 2},
                {"address": "10.1.0.1/24", "interface": 0},
                {"address": "10.1.0.5/24", "interface": 2}
            ]
        });
        assert_eq!(pod_ips(&r, "eth0"), vec!["10.1.0.5", "fd00::5"]);
        // The loopback plugin's result: an address, but not the pod's.
        let lo = json!({
            "interfaces": [{"name": "lo", "sandbox": "/x"}],
            "ips": [{"address": "127.0.0.1/8", "interface": 0}]
        });
        assert!(pod_ips(&lo, "eth0").is_empty());
    }

    /// Whether a process whose command line contains `marker` is alive.
    fn alive(marker: &str) -> bool {
        std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(marker)
                })
                .unwrap_or(false)
        })
    }

    fn group_of_sleepers(marker: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("sh");
        // A child of the plugin, in its group: what a plugin starts must go with it.
        cmd.args(["-c", &format!("sleep {marker} & sleep {marker}; wait")])
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// One test: both parts read and write the count of spawns in flight.
    #[tokio::test]
    async fn plugin_starts_given_up_on_leave_nothing_and_stuck_ones_are_bounded() {
        use std::sync::atomic::Ordering;
        let marker = format!("1000.{}1", std::process::id());
        // A deadline already past: the start is given up on before the thread hands the
        // child over (or, rarely, the child is back first; then try again).
        let mut timed_out = false;
        for _ in 0..50 {
            match spawn_with_umask_022(group_of_sleepers(&marker), tokio::time::Instant::now())
                .await
            {
                Err(e) => {
                    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
                    timed_out = true;
                    break;
                }
                Ok((child, group)) => drop((group, child)),
            }
        }
        assert!(timed_out, "every start beat a deadline already past");
        // The thread is done once no start counts as stuck: the child it made is handed over
        // to no one by then.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while STUCK_SPAWNS.load(Ordering::Acquire) > 0 || alive(&format!("sleep {marker}")) {
            assert!(
                std::time::Instant::now() < until,
                "the plugin's group lives on"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // As if that many spawning threads were stuck in an exec.
        STUCK_SPAWNS.fetch_add(MAX_STUCK_SPAWNS, Ordering::AcqRel);
        let marker = format!("1000.{}2", std::process::id());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        let r = spawn_with_umask_022(group_of_sleepers(&marker), deadline).await;
        STUCK_SPAWNS.fetch_sub(MAX_STUCK_SPAWNS, Ordering::AcqRel);
        let e = r.err().expect("a start past the bound");
        assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
        assert!(e.to_string().contains("never returned"), "{e}");
        assert!(!alive(&format!("sleep {marker}")));
        // Below the bound again, a start goes ahead.
        let (mut child, group) = spawn_with_umask_022(group_of_sleepers(&marker), deadline)
            .await
            .unwrap();
        // posix_spawn returns while the exec is still under way (the vfork parent resumes
        // once the new image is mapped, before its name and arguments are set).
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while !alive(&format!("sleep {marker}")) {
            assert!(
                std::time::Instant::now() < until,
                "the start did not go ahead"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(group);
        let _ = child.wait().await;
    }

    #[test]
    fn versions_compare_numerically() {
        assert!(version_at_least("1.1.0", "1.1.0"));
        assert!(version_at_least("0.10.0", "0.4.0"));
        assert!(!version_at_least("1.0.0", "1.1.0"));
    }
}
