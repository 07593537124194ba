//! CDI (Container Device Interface): device specs read from directories, fully qualified
//! device names (`vendor.com/class=name`) resolved against them, and their container edits
//! applied to a container's OCI spec (as JSON, before it is typed).
//!
//! Spec files are JSON or YAML, `cdiVersion` 0.3.0 to 1.0.x. A file is parsed again whenever
//! its size, mtime or inode changes, so the next container sees a spec that was added, changed
//! or removed, without a restart. A broken file makes only its own devices unavailable; it is
//! logged once per version of the file and listed by [`Registry::report`].

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Deserialize;
use serde_json::{json, Value};

use crate::spec::{device_node, device_rule, Device};

/// The CDI versions this implementation reads.
const VERSIONS: &[&str] = &[
    "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0",
];

const HOOK_STAGES: &[&str] = &[
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    pub path: String,
    #[serde(default)]
    pub host_path: Option<String>,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub major: Option<i64>,
    #[serde(default)]
    pub minor: Option<i64>,
    #[serde(default)]
    pub file_mode: Option<u32>,
    #[serde(default)]
    pub permissions: Option<String>,
    #[serde(default)]
    pub uid: Option<u32>,
    #[serde(default)]
    pub gid: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MountEdit {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub options: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    pub hook_name: String,
    pub path: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub timeout: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IntelRdt {
    #[serde(default, rename = "closID")]
    pub clos_id: Option<String>,
    #[serde(default)]
    pub l3_cache_schema: Option<String>,
    #[serde(default)]
    pub mem_bw_schema: Option<String>,
    #[serde(default, rename = "enableCMT")]
    pub enable_cmt: Option<bool>,
    #[serde(default, rename = "enableMBM")]
    pub enable_mbm: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetDevice {
    pub host_interface_name: String,
    pub name: String,
}

/// What a spec or a device does to a container.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Edits {
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default)]
    pub mounts: Vec<MountEdit>,
    #[serde(default)]
    pub hooks: Vec<Hook>,
    #[serde(default, rename = "additionalGIDs")]
    pub additional_gids: Vec<u32>,
    #[serde(default)]
    pub intel_rdt: Option<IntelRdt>,
    #[serde(default)]
    pub net_devices: Vec<NetDevice>,
}

impl Edits {
    fn is_empty(&self) -> bool {
        *self == Edits::default()
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    pub container_edits: Edits,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    pub devices: Vec<DeviceSpec>,
    #[serde(default)]
    pub container_edits: Edits,
}

fn vendor_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

fn class_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

fn name_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
}

/// Splits `vendor.com/class=name` into (kind, name).
pub fn parse_qualified(name: &str) -> Result<(String, String), String> {
    let (kind, dev) = name.split_once('=').ok_or_else(|| {
        format!("CDI device {name:?} is not a fully qualified name (vendor.com/class=name)")
    })?;
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| format!("CDI device {name:?} has no vendor/class"))?;
    if !vendor_ok(vendor) {
        return Err(format!("CDI device {name:?}: invalid vendor {vendor:?}"));
    }
    if !class_ok(class) {
        return Err(format!("CDI device {name:?}: invalid class {class:?}"));
    }
    if !name_ok(dev) {
        return Err(format!("CDI device {name:?}: invalid device name {dev:?}"));
    }
    Ok((kind.to_string(), dev.to_string()))
}

fn version_index(v: &str) -> Option<usize> {
    // 1.0.x patch releases are 1.0.0 to us.
    let v = if v.starts_with("1.0.") { "1.0.0" } else { v };
    VERSIONS.iter().position(|x| *x == v)
}

fn check_edits(e: &Edits, version: usize, at: &str) -> Result<(), String> {
    let need = |min: &str, what: &str| -> Result<(), String> {
        if version < version_index(min).expect("known version") {
            Err(format!("{at}: {what} needs cdiVersion {min} or later"))
        } else {
            Ok(())
        }
    };
    for v in &e.env {
        if !v.contains('=') || v.starts_with('=') {
            return Err(format!("{at}: env entry {v:?} is not NAME=value"));
        }
    }
    for (i, d) in e.device_nodes.iter().enumerate() {
        if !d.path.starts_with('/') {
            return Err(format!(
                "{at}: deviceNodes[{i}] path {:?} is not absolute",
                d.path
            ));
        }
        if d.host_path.is_some() {
            need("0.5.0", "deviceNodes hostPath")?;
        }
        if let Some(k) = &d.kind {
            if !matches!(k.as_str(), "b" | "c" | "u" | "p") {
                return Err(format!("{at}: deviceNodes[{i}] type {k:?} (b, c, u or p)"));
            }
        }
        if let Some(p) = &d.permissions {
            if p.is_empty() || !p.chars().all(|c| "rwm".contains(c)) {
                return Err(format!(
                    "{at}: deviceNodes[{i}] permissions {p:?} (r, w, m)"
                ));
            }
        }
    }
    for (i, m) in e.mounts.iter().enumerate() {
        if m.host_path.is_empty() || !m.container_path.starts_with('/') {
            return Err(format!(
                "{at}: mounts[{i}] needs a hostPath and an absolute containerPath"
            ));
        }
        if m.kind.is_some() {
            need("0.4.0", "mount type")?;
        }
    }
    for (i, h) in e.hooks.iter().enumerate() {
        if !HOOK_STAGES.contains(&h.hook_name.as_str()) {
            return Err(format!(
                "{at}: hooks[{i}] hookName {:?} is not an OCI hook",
                h.hook_name
            ));
        }
        if !h.path.starts_with('/') {
            return Err(format!(
                "{at}: hooks[{i}] path {:?} is not absolute",
                h.path
            ));
        }
    }
    if !e.additional_gids.is_empty() {
        need("0.7.0", "additionalGIDs")?;
    }
    if e.intel_rdt.is_some() {
        need("0.7.0", "intelRdt")?;
    }
    if !e.net_devices.is_empty() {
        need("1.0.0", "netDevices")?;
    }
    Ok(())
}

/// Parses and validates one spec file's text.
pub fn parse_spec(path: &Path, text: &str) -> Result<Spec, String> {
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    let spec: Spec = if yaml {
        serde_yaml::from_str(text).map_err(|e| e.to_string())?
    } else {
        serde_json::from_str(text).map_err(|e| e.to_string())?
    };
    let version = version_index(&spec.cdi_version).ok_or_else(|| {
        format!(
            "cdiVersion {:?} is not supported (0.3.0 to 1.0.x)",
            spec.cdi_version
        )
    })?;
    let (vendor, class) = spec
        .kind
        .split_once('/')
        .ok_or_else(|| format!("kind {:?} is not vendor/class", spec.kind))?;
    if !vendor_ok(vendor) || !class_ok(class) {
        return Err(format!("kind {:?} is not a valid vendor/class", spec.kind));
    }
    if !spec.annotations.is_empty() && version < version_index("0.6.0").expect("known") {
        return Err("annotations need cdiVersion 0.6.0 or later".into());
    }
    if spec.devices.is_empty() {
        return Err("no devices".into());
    }
    check_edits(&spec.container_edits, version, "containerEdits")?;
    let mut seen = std::collections::HashSet::new();
    for d in &spec.devices {
        if !name_ok(&d.name) {
            return Err(format!("invalid device name {:?}", d.name));
        }
        if !seen.insert(d.name.as_str()) {
            return Err(format!("device {:?} is defined twice", d.name));
        }
        if !d.annotations.is_empty() && version < version_index("0.6.0").expect("known") {
            return Err(format!(
                "device {:?}: annotations need cdiVersion 0.6.0",
                d.name
            ));
        }
        if d.container_edits.is_empty() {
            return Err(format!("device {:?} has no containerEdits", d.name));
        }
        check_edits(&d.container_edits, version, &format!("device {:?}", d.name))?;
    }
    Ok(spec)
}

/// Why a device request failed; `NotFound` for unknown devices, `Invalid` for the rest.
#[derive(Debug, Clone, PartialEq)]
pub enum CdiError {
    NotFound(String),
    Invalid(String),
}

impl std::fmt::Display for CdiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CdiError::NotFound(m) | CdiError::Invalid(m) => f.write_str(m),
        }
    }
}

#[derive(Clone, PartialEq)]
struct FileKey {
    len: u64,
    mtime_ns: i64,
    ino: u64,
}

struct Loaded {
    key: FileKey,
    /// Index of the directory it came from: later directories win.
    dir: usize,
    spec: Result<Spec, String>,
    /// The kind, when the file got that far (to name broken specs in errors).
    kind_hint: Option<String>,
}

/// The CDI specs of a node, read from `dirs` (later ones override earlier ones).
pub struct Registry {
    dirs: Vec<PathBuf>,
    cache: Mutex<HashMap<PathBuf, Loaded>>,
}

/// Devices resolved for one container: the edits to apply, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolved {
    /// (spec file, edits): spec-level edits once per spec, then each device's.
    pub edits: Vec<(PathBuf, Edits)>,
}

fn kind_hint(text: &str) -> Option<String> {
    // Good enough for a file that does not parse: the first `kind` value, JSON or YAML.
    if let Some(i) = text.find("\"kind\"") {
        let rest = text[i + 6..].trim_start().strip_prefix(':')?.trim_start();
        let rest = rest.strip_prefix('"')?;
        return Some(rest[..rest.find('"')?].to_string());
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("kind:"))
        .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'').to_string())
        .find(|v| !v.is_empty())
}

impl Registry {
    pub fn new(dirs: Vec<PathBuf>) -> Registry {
        Registry {
            dirs,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Brings the cache up to date with the directories: new and changed files parsed, removed
    /// ones dropped. Parse errors are logged the first time each version of a file is seen.
    fn refresh(&self) {
        let mut present: HashMap<PathBuf, (FileKey, usize)> = HashMap::new();
        for (i, dir) in self.dirs.iter().enumerate() {
            let Ok(rd) = std::fs::read_dir(dir) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                if !matches!(
                    p.extension().and_then(|x| x.to_str()),
                    Some("json" | "yaml" | "yml")
                ) {
                    continue;
                }
                let Ok(md) = std::fs::metadata(&p) else {
                    continue;
                };
                if !md.is_file() {
                    continue;
                }
                let key = FileKey {
                    len: md.len(),
                    mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
                    ino: md.ino(),
                };
                present.insert(p, (key, i));
            }
        }
        let mut cache = self.cache.lock().expect("cdi cache poisoned");
        cache.retain(|p, _| present.contains_key(p));
        for (p, (key, dir)) in present {
            if cache.get(&p).is_some_and(|l| l.key == key && l.dir == dir) {
                continue;
            }
            let text = std::fs::read_to_string(&p).map_err(|e| e.to_string());
            let hint = text.as_deref().ok().and_then(kind_hint);
            let spec = text.and_then(|t| parse_spec(&p, &t));
            match &spec {
                Ok(s) => {
                    tracing::info!(file = %p.display(), kind = %s.kind, devices = s.devices.len(), "CDI spec loaded")
                }
                Err(e) => {
                    tracing::warn!(file = %p.display(), error = %e, "CDI spec is invalid; its devices are unavailable")
                }
            }
            cache.insert(
                p,
                Loaded {
                    key,
                    dir,
                    spec,
                    kind_hint: hint,
                },
            );
        }
    }

    /// Every device the registry can give (fully qualified), and the broken spec files with
    /// why: for `Status` and the start-up log. One look at the directories.
    pub fn report(&self) -> (Vec<String>, Vec<(PathBuf, String)>) {
        self.refresh();
        let cache = self.cache.lock().expect("cdi cache poisoned");
        let mut devices: Vec<String> = cache
            .values()
            .filter_map(|l| l.spec.as_ref().ok())
            .flat_map(|s| {
                s.devices
                    .iter()
                    .map(move |d| format!("{}={}", s.kind, d.name))
            })
            .collect();
        devices.sort();
        devices.dedup();
        let mut errors: Vec<_> = cache
            .iter()
            .filter_map(|(p, l)| l.spec.as_ref().err().map(|e| (p.clone(), e.clone())))
            .collect();
        errors.sort();
        (devices, errors)
    }

    /// Resolves fully qualified device names (duplicates dropped, order kept).
    pub fn resolve(&self, names: &[String]) -> Result<Resolved, CdiError> {
        if names.is_empty() {
            return Ok(Resolved::default());
        }
        self.refresh();
        let cache = self.cache.lock().expect("cdi cache poisoned");
        let mut out = Resolved::default();
        let mut spec_done: Vec<PathBuf> = Vec::new();
        let mut seen: Vec<&String> = Vec::new();
        for name in names {
            if seen.contains(&name) {
                continue;
            }
            seen.push(name);
            let (kind, dev) = parse_qualified(name).map_err(CdiError::Invalid)?;
            // Candidates: (dir index, file, spec, device).
            let mut found: Vec<(usize, &PathBuf, &Spec, &DeviceSpec)> = cache
                .iter()
                .filter_map(|(p, l)| l.spec.as_ref().ok().map(|s| (l.dir, p, s)))
                .filter(|(_, _, s)| s.kind == kind)
                .filter_map(|(d, p, s)| {
                    s.devices
                        .iter()
                        .find(|x| x.name == dev)
                        .map(|x| (d, p, s, x))
                })
                .collect();
            if found.is_empty() {
                let mut broken: Vec<String> = cache
                    .iter()
                    .filter(|(_, l)| l.spec.is_err())
                    .filter(|(_, l)| l.kind_hint.as_ref().is_none_or(|k| *k == kind))
                    .map(|(p, l)| {
                        format!("{} ({})", p.display(), l.spec.as_ref().expect_err("broken"))
                    })
                    .collect();
                broken.sort();
                let mut msg = format!(
                    "CDI device {name} not found in {}",
                    self.dirs
                        .iter()
                        .map(|d| d.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                if !broken.is_empty() {
                    msg.push_str(&format!(
                        "; it may be in a broken spec: {}",
                        broken.join("; ")
                    ));
                }
                return Err(CdiError::NotFound(msg));
            }
            let top = found.iter().map(|f| f.0).max().expect("not empty");
            found.retain(|f| f.0 == top);
            if found.len() > 1 {
                let mut files: Vec<String> =
                    found.iter().map(|f| f.1.display().to_string()).collect();
                files.sort();
                return Err(CdiError::Invalid(format!(
                    "CDI device {name} is ambiguous: defined in {}",
                    files.join(" and ")
                )));
            }
            let (_, path, spec, device) = found[0];
            if !spec_done.contains(path) {
                spec_done.push(path.clone());
                if !spec.container_edits.is_empty() {
                    out.edits.push((path.clone(), spec.container_edits.clone()));
                }
            }
            out.edits
                .push((path.clone(), device.container_edits.clone()));
        }
        Ok(out)
    }
}

fn push_unique(list: &mut Value, item: Value, key: &str) {
    let arr = list.as_array_mut().expect("array");
    arr.retain(|x| x.get(key) != item.get(key));
    arr.push(item);
}

/// Applies resolved edits to an OCI spec (JSON as `spec::generate_json` makes it). Errors name
/// the spec file.
pub fn apply(spec: &mut Value, resolved: &Resolved) -> Result<(), String> {
    for (file, e) in &resolved.edits {
        apply_one(spec, e).map_err(|m| format!("CDI spec {}: {m}", file.display()))?;
    }
    Ok(())
}

fn apply_one(spec: &mut Value, e: &Edits) -> Result<(), String> {
    if !e.net_devices.is_empty() {
        return Err("netDevices edits are not supported by hako's executor".into());
    }
    if !e.env.is_empty() {
        let env = spec["process"]["env"]
            .as_array_mut()
            .ok_or("OCI spec has no process.env")?;
        for kv in &e.env {
            let key = kv.split('=').next().unwrap_or_default();
            env.retain(|x| x.as_str().and_then(|s| s.split('=').next()) != Some(key));
            env.push(json!(kv));
        }
    }
    for d in &e.device_nodes {
        let access = d.permissions.clone().unwrap_or_else(|| "rwm".into());
        // Type and numbers as the spec gives them, else read from the host node.
        let dev = match (&d.kind, d.major, d.minor) {
            (Some(k), Some(major), Some(minor)) => Device {
                kind: k.clone(),
                major,
                minor,
                ..Default::default()
            },
            (Some(k), _, _) if k == "p" => Device {
                kind: "p".into(),
                ..Default::default()
            },
            _ => {
                let host = d.host_path.as_deref().unwrap_or(&d.path);
                let found = crate::devices::host_node(Path::new(host), &d.path, &access)
                    .map_err(|e| format!("device node {host}: {e}"))?
                    .ok_or_else(|| format!("{host} is not a device node"))?;
                Device {
                    kind: d.kind.clone().unwrap_or(found.kind),
                    major: d.major.unwrap_or(found.major),
                    minor: d.minor.unwrap_or(found.minor),
                    file_mode: found.file_mode,
                    ..Default::default()
                }
            }
        };
        let dev = Device {
            path: d.path.clone(),
            file_mode: Some(d.file_mode.or(dev.file_mode).unwrap_or(0o666)),
            uid: d.uid,
            gid: d.gid,
            access,
            ..dev
        };
        if spec["linux"].get("devices").is_none() {
            spec["linux"]["devices"] = json!([]);
        }
        push_unique(&mut spec["linux"]["devices"], device_node(&dev), "path");
        // Privileged containers have no rules (everything allowed): nothing to add.
        if let (Some(rules), Some(rule)) = (
            spec["linux"]["resources"]["devices"].as_array_mut(),
            device_rule(&dev),
        ) {
            rules.push(rule);
        }
    }
    for m in &e.mounts {
        let mut options = m.options.clone();
        let kind = m.kind.clone().unwrap_or_else(|| "bind".into());
        if kind == "bind" && !options.iter().any(|o| o == "bind" || o == "rbind") {
            options.push("rbind".into());
        }
        push_unique(
            spec.get_mut("mounts").ok_or("OCI spec has no mounts")?,
            json!({"destination": m.container_path, "source": m.host_path, "type": kind, "options": options}),
            "destination",
        );
    }
    for h in &e.hooks {
        let mut hook = json!({"path": h.path});
        if !h.args.is_empty() {
            hook["args"] = json!(h.args);
        }
        if !h.env.is_empty() {
            hook["env"] = json!(h.env);
        }
        if let Some(t) = h.timeout {
            hook["timeout"] = json!(t);
        }
        if spec.get("hooks").is_none() {
            spec["hooks"] = json!({});
        }
        if spec["hooks"].get(&h.hook_name).is_none() {
            spec["hooks"][&h.hook_name] = json!([]);
        }
        spec["hooks"][&h.hook_name]
            .as_array_mut()
            .expect("array")
            .push(hook);
    }
    for g in &e.additional_gids {
        if *g == 0 {
            continue;
        }
        let gids = &mut spec["process"]["user"]["additionalGids"];
        if !gids.is_array() {
            *gids = json!([]);
        }
        let arr = gids.as_array_mut().expect("array");
        if !arr.iter().any(|x| x.as_u64() == Some(*g as u64)) {
            arr.push(json!(g));
        }
    }
    if let Some(rdt) = &e.intel_rdt {
        if !Path::new("/sys/fs/resctrl/schemata").exists() {
            return Err("intelRdt edits need resctrl mounted at /sys/fs/resctrl".into());
        }
        let mut v = json!({});
        if let Some(x) = &rdt.clos_id {
            v["closID"] = json!(x);
        }
        if let Some(x) = &rdt.l3_cache_schema {
            v["l3CacheSchema"] = json!(x);
        }
        if let Some(x) = &rdt.mem_bw_schema {
            v["memBwSchema"] = json!(x);
        }
        if let Some(x) = rdt.enable_cmt {
            v["enableCMT"] = json!(x);
        }
        if let Some(x) = rdt.enable_mbm {
            v["enableMBM"] = json!(x);
        }
        spec["linux"]["intelRdt"] = v;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const JSON_SPEC: &str = r#"{
        "cdiVersion": "0.3.0",
        "kind": "example.com/gpu",
        "containerEdits": {"env": ["GPU_DRIVER=1"]},
        "devices": [
            {"name": "gpu0", "containerEdits": {"deviceNodes": [{"path": "/dev/gpu0", "type": "c", "major": 1, "minor": 3}]}},
            {"name": "gpu1", "containerEdits": {"env": ["GPU=1"]}}
        ]
    }"#;

    #[test]
    fn qualified_names() {
        assert_eq!(
            parse_qualified("vendor.com/class=dev-0").unwrap(),
            ("vendor.com/class".into(), "dev-0".into())
        );
        assert!(parse_qualified("dev0")
            .unwrap_err()
            .contains("fully qualified"));
        assert!(parse_qualified("v/c.x=d").unwrap_err().contains("class"));
        assert!(parse_qualified("v/c=-d")
            .unwrap_err()
            .contains("device name"));
    }

    #[test]
    fn specs_are_validated_with_the_cause() {
        let p = Path::new("/x/a.json");
        let bad = |text: &str, want: &str| {
            let e = parse_spec(p, text).unwrap_err();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        bad(
            r#"{"cdiVersion":"9.9.9","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["A=1"]}}]}"#,
            "not supported",
        );
        bad(
            r#"{"cdiVersion":"0.3.0","kind":"ab","devices":[{"name":"d","containerEdits":{"env":["A=1"]}}]}"#,
            "vendor/class",
        );
        bad(
            r#"{"cdiVersion":"0.3.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["A=1"]}},{"name":"d","containerEdits":{"env":["A=1"]}}]}"#,
            "defined twice",
        );
        bad(
            r#"{"cdiVersion":"0.3.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{}}]}"#,
            "no containerEdits",
        );
        bad(
            r#"{"cdiVersion":"0.3.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"deviceNodes":[{"path":"/dev/x","hostPath":"/dev/y"}]}}]}"#,
            "needs cdiVersion 0.5.0",
        );
        bad(
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"hooks":[{"hookName":"bogus","path":"/bin/true"}]}}]}"#,
            "not an OCI hook",
        );
        bad(
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["NOEQUALS"]}}]}"#,
            "NAME=value",
        );
        bad(
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"additionalGIDs":[5]}}]}"#,
            "0.7.0",
        );
        bad(
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"deviceNodes":[{"path":"/dev/x","permissions":"rwx"}]}}]}"#,
            "permissions",
        );
        bad(
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["A=1"]}}],"bogus":1}"#,
            "unknown field",
        );
        assert!(parse_spec(p, JSON_SPEC).is_ok());
        let yaml = "cdiVersion: 0.6.0\nkind: a.com/b\nannotations: {x: y}\ndevices:\n- name: d\n  containerEdits:\n    env: [A=1]\n";
        assert_eq!(
            parse_spec(Path::new("/x/a.yaml"), yaml).unwrap().devices[0].name,
            "d"
        );
    }

    #[test]
    fn resolution_overrides_conflicts_and_broken_specs() {
        let etc = tempfile::tempdir().unwrap();
        let run = tempfile::tempdir().unwrap();
        write(etc.path(), "gpu.json", JSON_SPEC);
        let reg = Registry::new(vec![etc.path().into(), run.path().into()]);
        let r = reg
            .resolve(&[
                "example.com/gpu=gpu0".into(),
                "example.com/gpu=gpu1".into(),
                "example.com/gpu=gpu0".into(),
            ])
            .unwrap();
        // Spec-level edits once, then each device once.
        assert_eq!(r.edits.len(), 3);
        assert_eq!(r.edits[0].1.env, vec!["GPU_DRIVER=1"]);

        // A later directory overrides an earlier one.
        write(run.path(), "gpu.yaml", "cdiVersion: 0.3.0\nkind: example.com/gpu\ndevices:\n- name: gpu1\n  containerEdits:\n    env: [GPU=run]\n");
        let r = reg.resolve(&["example.com/gpu=gpu1".into()]).unwrap();
        assert_eq!(r.edits[0].1.env, vec!["GPU=run"]);

        // Two files of one directory defining the same device: ambiguous, both named.
        write(
            run.path(),
            "gpu2.json",
            r#"{"cdiVersion":"0.3.0","kind":"example.com/gpu","devices":[{"name":"gpu1","containerEdits":{"env":["X=1"]}}]}"#,
        );
        let e = reg.resolve(&["example.com/gpu=gpu1".into()]).unwrap_err();
        assert!(
            matches!(&e, CdiError::Invalid(m) if m.contains("ambiguous") && m.contains("gpu2.json") && m.contains("gpu.yaml")),
            "{e:?}"
        );

        // A broken spec: its devices are unknown (the error names it), others still resolve.
        write(
            etc.path(),
            "broken.json",
            "{\"cdiVersion\": \"0.3.0\", \"kind\": \"broken.com/x\", \"devices\": [",
        );
        let e = reg.resolve(&["broken.com/x=a".into()]).unwrap_err();
        assert!(
            matches!(&e, CdiError::NotFound(m) if m.contains("broken.json")),
            "{e:?}"
        );
        assert!(reg.resolve(&["example.com/gpu=gpu0".into()]).is_ok());
        let (devices, errors) = reg.report();
        assert_eq!(devices, ["example.com/gpu=gpu0", "example.com/gpu=gpu1"]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, etc.path().join("broken.json"));
        assert!(errors[0].1.contains("EOF"), "{errors:?}");

        // Removed: unknown again.
        std::fs::remove_file(etc.path().join("gpu.json")).unwrap();
        assert!(matches!(
            reg.resolve(&["example.com/gpu=gpu0".into()]),
            Err(CdiError::NotFound(_))
        ));
    }

    #[test]
    fn qualified_name_parts_are_checked_one_by_one() {
        for ok in ["a/b=c", "nvidia.com/gpu=0", "v_1.x-y/c_1-2=n.a:b_c-d"] {
            assert!(parse_qualified(ok).is_ok(), "{ok}");
        }
        for (bad, part) in [
            ("/c=d", "vendor"),
            ("-v.com/c=d", "vendor"),
            ("v.com-/c=d", "vendor"),
            ("v@x.com/c=d", "vendor"),
            ("v/=d", "class"),
            ("v/-c=d", "class"),
            ("v/c-=d", "class"),
            ("v/c=", "device name"),
            ("v/c=d-", "device name"),
            ("v/c=d/e", "device name"),
        ] {
            let e = parse_qualified(bad).unwrap_err();
            assert!(e.contains(part), "{bad}: {e}");
        }
        assert_eq!(CdiError::NotFound("gone".into()).to_string(), "gone");
        assert_eq!(CdiError::Invalid("bad".into()).to_string(), "bad");
    }

    fn one_device(version: &str, edits: &str) -> String {
        format!(
            r#"{{"cdiVersion":"{version}","kind":"a.com/b","devices":[{{"name":"d","containerEdits":{edits}}}]}}"#
        )
    }

    #[test]
    fn each_feature_is_accepted_from_its_cdi_version_on() {
        let p = Path::new("/x/a.json");
        for (min, before, edits) in [
            (
                "0.4.0",
                "0.3.0",
                r#"{"mounts":[{"hostPath":"/a","containerPath":"/b","type":"tmpfs"}]}"#,
            ),
            (
                "0.5.0",
                "0.4.0",
                r#"{"deviceNodes":[{"path":"/dev/x","hostPath":"/dev/y"}]}"#,
            ),
            ("0.7.0", "0.6.0", r#"{"additionalGIDs":[5]}"#),
            ("0.7.0", "0.6.0", r#"{"intelRdt":{"closID":"c"}}"#),
            (
                "1.0.0",
                "0.8.0",
                r#"{"netDevices":[{"hostInterfaceName":"eth1","name":"net1"}]}"#,
            ),
        ] {
            assert!(
                parse_spec(p, &one_device(min, edits)).is_ok(),
                "{edits} at {min}"
            );
            let e = parse_spec(p, &one_device(before, edits)).unwrap_err();
            assert!(e.contains(&format!("needs cdiVersion {min}")), "{e}");
        }
        // 1.0.x patch releases read as 1.0.0.
        assert!(parse_spec(p, &one_device("1.0.1", r#"{"env":["A=1"]}"#)).is_ok());
        // Annotations, on the spec or on a device, from 0.6.0.
        let a = r#""annotations":{"x":"y"},"#;
        for (spec_level, device_level) in [(a, ""), ("", a)] {
            let text = |version: &str| {
                format!(
                    r#"{{"cdiVersion":"{version}","kind":"a.com/b",{spec_level}"devices":[{{"name":"d",{device_level}"containerEdits":{{"env":["A=1"]}}}}]}}"#
                )
            };
            let e = parse_spec(p, &text("0.5.0")).unwrap_err();
            assert!(e.contains("annotations need cdiVersion 0.6.0"), "{e}");
            assert!(parse_spec(p, &text("0.6.0")).is_ok(), "{}", text("0.6.0"));
            assert!(parse_spec(p, &text("1.0.0")).is_ok(), "{}", text("1.0.0"));
        }
    }

    #[test]
    fn mounts_hooks_and_kinds_are_checked() {
        let p = Path::new("/x/a.json");
        let bad = |text: &str, want: &str| {
            let e = parse_spec(p, text).unwrap_err();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        bad(
            &one_device(
                "0.6.0",
                r#"{"mounts":[{"hostPath":"","containerPath":"/b"}]}"#,
            ),
            "needs a hostPath and an absolute containerPath",
        );
        bad(
            &one_device(
                "0.6.0",
                r#"{"mounts":[{"hostPath":"/a","containerPath":"b"}]}"#,
            ),
            "needs a hostPath and an absolute containerPath",
        );
        bad(
            &one_device(
                "0.6.0",
                r#"{"hooks":[{"hookName":"createRuntime","path":"bin/hook"}]}"#,
            ),
            "is not absolute",
        );
        assert!(parse_spec(
            p,
            &one_device(
                "0.6.0",
                r#"{"hooks":[{"hookName":"createRuntime","path":"/bin/hook"}],"mounts":[{"hostPath":"/a","containerPath":"/b"}]}"#
            )
        )
        .is_ok());
        for kind in ["a.com/b.c", "a@com/b", "a.com/"] {
            let text = one_device("0.6.0", r#"{"env":["A=1"]}"#).replace("a.com/b", kind);
            bad(&text, "is not a valid vendor/class");
        }
    }

    #[test]
    fn a_broken_spec_is_named_only_for_its_own_kind() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "x.json",
            "{\"cdiVersion\": \"0.3.0\", \"kind\": \"broken.com/x\", \"devices\": [",
        );
        write(
            d.path(),
            "y.yaml",
            "cdiVersion: 0.3.0\nkind: 'other.com/y'\ndevices: [\n",
        );
        // No kind to be read: it may hold any device.
        write(d.path(), "nokind.json", "garbage");
        let reg = Registry::new(vec![d.path().into()]);
        let not_found = |name: &str| match reg.resolve(&[name.into()]) {
            Err(CdiError::NotFound(m)) => m,
            other => panic!("{name}: {other:?}"),
        };
        let m = not_found("broken.com/x=a");
        assert!(
            m.contains("x.json") && m.contains("nokind.json") && !m.contains("y.yaml"),
            "{m}"
        );
        let m = not_found("other.com/y=a");
        assert!(
            m.contains("y.yaml") && m.contains("nokind.json") && !m.contains("x.json"),
            "{m}"
        );
    }

    #[test]
    fn a_spec_rewritten_in_place_is_read_again() {
        use std::time::{Duration, SystemTime};
        let d = tempfile::tempdir().unwrap();
        let p = write(
            d.path(),
            "a.json",
            &one_device("0.3.0", r#"{"env":["V=1"]}"#),
        );
        let set_mtime = |t: SystemTime| {
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap()
        };
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        set_mtime(t);
        let reg = Registry::new(vec![d.path().into()]);
        let env = || {
            reg.resolve(&["a.com/b=d".into()]).unwrap().edits[0]
                .1
                .env
                .clone()
        };
        assert_eq!(env(), ["V=1"]);
        // Same length, same inode, and the mtime one second later to the nanosecond: only the
        // mtime's seconds tell the two versions apart.
        std::fs::write(&p, one_device("0.3.0", r#"{"env":["V=2"]}"#)).unwrap();
        set_mtime(t + Duration::from_secs(1));
        assert_eq!(env(), ["V=2"]);
    }

    #[test]
    fn device_nodes_take_numbers_and_modes_from_the_spec_or_the_host() {
        use nix::sys::stat::{makedev, mknod, Mode, SFlag};
        let d = tempfile::tempdir().unwrap();
        let host = d.path().join("node");
        mknod(
            &host,
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o600),
            makedev(1, 3),
        )
        .unwrap();
        let mut spec = json!({
            "process": {"env": []},
            "mounts": [],
            "linux": {"resources": {"devices": []}}
        });
        let edits = Edits {
            device_nodes: vec![
                // Everything given: the host is not looked at (it has no such node).
                DeviceNode {
                    path: "/dev/absent-gpu".into(),
                    kind: Some("c".into()),
                    major: Some(195),
                    minor: Some(7),
                    file_mode: Some(0o640),
                    uid: Some(1000),
                    gid: Some(44),
                    ..Default::default()
                },
                // A FIFO needs no numbers, and gets no cgroup rule.
                DeviceNode {
                    path: "/dev/absent-fifo".into(),
                    kind: Some("p".into()),
                    ..Default::default()
                },
                // The type only: numbers and mode from the host's node.
                DeviceNode {
                    path: "/dev/from-host".into(),
                    host_path: Some(host.display().to_string()),
                    kind: Some("c".into()),
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        apply(
            &mut spec,
            &Resolved {
                edits: vec![(PathBuf::from("/etc/cdi/d.json"), edits)],
            },
        )
        .unwrap();
        assert_eq!(
            spec["linux"]["devices"],
            json!([
                {"path": "/dev/absent-gpu", "type": "c", "major": 195, "minor": 7, "fileMode": 0o640, "uid": 1000, "gid": 44},
                {"path": "/dev/absent-fifo", "type": "p", "major": 0, "minor": 0, "fileMode": 0o666},
                {"path": "/dev/from-host", "type": "c", "major": 1, "minor": 3, "fileMode": 0o600},
            ])
        );
        assert_eq!(
            spec["linux"]["resources"]["devices"],
            json!([
                {"allow": true, "type": "c", "major": 195, "minor": 7, "access": "rwm"},
                {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
            ])
        );
    }

    #[test]
    fn mounts_and_hooks_are_written_as_given() {
        let mut spec = json!({
            "process": {"env": []},
            "mounts": [{"destination": "/b", "type": "bind", "source": "/old"}],
            "linux": {}
        });
        let mount = |c: &str, kind: Option<&str>, options: &[&str]| MountEdit {
            host_path: "/h".into(),
            container_path: c.into(),
            kind: kind.map(Into::into),
            options: options.iter().map(|o| o.to_string()).collect(),
        };
        let hook = |stage: &str, path: &str| Hook {
            hook_name: stage.into(),
            path: path.into(),
            ..Default::default()
        };
        let edits = Edits {
            mounts: vec![
                mount("/a", Some("tmpfs"), &["nosuid"]),
                mount("/b", None, &["bind", "ro"]),
                mount("/c", None, &[]),
            ],
            hooks: vec![
                hook("createRuntime", "/bin/a"),
                Hook {
                    args: vec!["b".into(), "-x".into()],
                    env: vec!["K=v".into()],
                    timeout: Some(5),
                    ..hook("poststop", "/bin/b")
                },
                hook("createRuntime", "/bin/c"),
            ],
            ..Default::default()
        };
        apply(
            &mut spec,
            &Resolved {
                edits: vec![(PathBuf::from("/etc/cdi/m.json"), edits)],
            },
        )
        .unwrap();
        // A bind mount gets rbind unless it names bind itself; another type is left alone; a
        // destination already mounted is replaced.
        assert_eq!(
            spec["mounts"],
            json!([
                {"destination": "/a", "source": "/h", "type": "tmpfs", "options": ["nosuid"]},
                {"destination": "/b", "source": "/h", "type": "bind", "options": ["bind", "ro"]},
                {"destination": "/c", "source": "/h", "type": "bind", "options": ["rbind"]},
            ])
        );
        assert_eq!(
            spec["hooks"],
            json!({
                "createRuntime": [{"path": "/bin/a"}, {"path": "/bin/c"}],
                "poststop": [{"path": "/bin/b", "args": ["b", "-x"], "env": ["K=v"], "timeout": 5}],
            })
        );
    }

    #[test]
    fn edits_reach_the_oci_spec() {
        let mut spec = json!({
            "process": {"env": ["A=1", "PATH=/bin"], "user": {"uid": 0, "gid": 0}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]}}
        });
        let edits = Edits {
            env: vec!["A=2".into()],
            device_nodes: vec![DeviceNode {
                path: "/dev/fake".into(),
                host_path: Some("/dev/null".into()),
                permissions: Some("rw".into()),
                ..Default::default()
            }],
            mounts: vec![MountEdit {
                host_path: "/opt/lib".into(),
                container_path: "/usr/lib/vendor".into(),
                kind: None,
                options: vec!["ro".into()],
            }],
            hooks: vec![Hook {
                hook_name: "createRuntime".into(),
                path: "/bin/true".into(),
                args: vec!["true".into()],
                ..Default::default()
            }],
            additional_gids: vec![0, 44],
            ..Default::default()
        };
        apply(
            &mut spec,
            &Resolved {
                edits: vec![(PathBuf::from("/etc/cdi/x.json"), edits)],
            },
        )
        .unwrap();
        assert_eq!(spec["process"]["env"], json!(["PATH=/bin", "A=2"]));
        let dev = &spec["linux"]["devices"][0];
        assert_eq!(
            (
                dev["path"].as_str(),
                dev["major"].as_i64(),
                dev["minor"].as_i64()
            ),
            (Some("/dev/fake"), Some(1), Some(3))
        );
        let rule = spec["linux"]["resources"]["devices"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        assert_eq!(
            rule,
            json!({"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rw"})
        );
        assert_eq!(spec["mounts"][1]["options"], json!(["ro", "rbind"]));
        assert_eq!(spec["hooks"]["createRuntime"][0]["path"], "/bin/true");
        assert_eq!(spec["process"]["user"]["additionalGids"], json!([44]));

        let e = apply(
            &mut spec,
            &Resolved {
                edits: vec![(
                    PathBuf::from("/etc/cdi/y.json"),
                    Edits {
                        device_nodes: vec![DeviceNode {
                            path: "/dev/none".into(),
                            host_path: Some("/nonexistent".into()),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                )],
            },
        )
        .unwrap_err();
        assert!(
            e.contains("/etc/cdi/y.json") && e.contains("/nonexistent"),
            "{e}"
        );
    }
}
