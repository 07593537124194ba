//! CDI (Container Device Interface): device specs read from directories, fully qualified
//! device names (`vendor.com/class=name`) resolved against them, and their container edits
//! applied to a container's OCI spec (`oci_spec::runtime::Spec`).
//!
//! Spec files are read as upstream's Go library (`tags.cncf.io/container-device-interface`,
//! v1.1.0) reads them: JSON, or YAML as Go's YAML 1.1 parser reads it (unquoted `0640` is
//! octal), field names matched as Go's `encoding/json` matches them (case-insensitively, so
//! `additionalGids` and `additionalGIDs` are one field), `cdiVersion` 0.3.0 to 1.1.0 with
//! each field allowed from the version that added it. A file is parsed again whenever its
//! size, mtime or inode changes, so the next container sees a spec that was added, changed
//! or removed, without a restart. A broken file makes only its own devices unavailable; it is
//! logged once per version of the file and listed by [`Registry::report`].

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use oci_spec::runtime as oci;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{CdiNameDefect, Error, Result};
use crate::spec::{device_node, device_rule, Device};

/// What is wrong with a spec file, and where: `at` is the field's path (`devices[0].name`),
/// empty for the file as a whole. [`parse_spec`] names the file.
struct Bad {
    at: String,
    problem: String,
}

/// A [`Bad`] at `$at`, its problem as `format!` makes it.
macro_rules! bad {
    ($at:expr, $($fmt:tt)+) => {
        Bad {
            at: $at.to_string(),
            problem: format!($($fmt)+),
        }
    };
}

/// Every `cdiVersion` upstream knows, oldest first. 0.1.0 and 0.2.0 are known but upstream
/// requires at least [`EARLIEST`] of every spec, so they are refused with that reason.
const VERSIONS: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
];
const EARLIEST: &str = "0.3.0";

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
    #[serde(default)]
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
    #[serde(default)]
    pub host_path: String,
    #[serde(default)]
    pub container_path: String,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub options: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    #[serde(default)]
    pub hook_name: String,
    #[serde(default)]
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
    /// From cdiVersion 1.1.0.
    #[serde(default)]
    pub schemata: Option<Vec<String>>,
    /// From cdiVersion 1.1.0.
    #[serde(default)]
    pub enable_monitoring: Option<bool>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetDevice {
    #[serde(default)]
    pub host_interface_name: String,
    #[serde(default)]
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
    #[serde(default)]
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
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub container_edits: Edits,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    #[serde(default)]
    pub cdi_version: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    #[serde(default)]
    pub container_edits: Edits,
}

/// The objects of a spec file, for [`normalise`].
#[derive(Clone, Copy)]
enum Obj {
    Spec,
    Device,
    Edits,
    Node,
    Mount,
    Hook,
    Rdt,
    Net,
}

/// A field's type as upstream's Go types declare it.
#[derive(Clone, Copy)]
enum Ty {
    Str,
    Strs,
    U32,
    U32s,
    I64,
    Bool,
    StrMap,
    One(Obj),
    Many(Obj),
}

/// Field names and types exactly as upstream's `specs-go` spells them in its JSON tags.
fn fields(o: Obj) -> &'static [(&'static str, Ty)] {
    use Ty::*;
    match o {
        Obj::Spec => &[
            ("cdiVersion", Str),
            ("kind", Str),
            ("annotations", StrMap),
            ("devices", Many(Obj::Device)),
            ("containerEdits", One(Obj::Edits)),
        ],
        Obj::Device => &[
            ("name", Str),
            ("annotations", StrMap),
            ("containerEdits", One(Obj::Edits)),
        ],
        Obj::Edits => &[
            ("env", Strs),
            ("deviceNodes", Many(Obj::Node)),
            ("netDevices", Many(Obj::Net)),
            ("hooks", Many(Obj::Hook)),
            ("mounts", Many(Obj::Mount)),
            ("intelRdt", One(Obj::Rdt)),
            ("additionalGids", U32s),
        ],
        Obj::Node => &[
            ("path", Str),
            ("hostPath", Str),
            ("type", Str),
            ("major", I64),
            ("minor", I64),
            ("fileMode", U32),
            ("permissions", Str),
            ("uid", U32),
            ("gid", U32),
        ],
        Obj::Mount => &[
            ("hostPath", Str),
            ("containerPath", Str),
            ("options", Strs),
            ("type", Str),
        ],
        Obj::Hook => &[
            ("hookName", Str),
            ("path", Str),
            ("args", Strs),
            ("env", Strs),
            ("timeout", I64),
        ],
        Obj::Rdt => &[
            ("closID", Str),
            ("l3CacheSchema", Str),
            ("memBwSchema", Str),
            ("schemata", Strs),
            ("enableMonitoring", Bool),
        ],
        Obj::Net => &[("hostInterfaceName", Str), ("name", Str)],
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "a map".into(),
    }
}

/// An integer as Go's YAML 1.1 parser reads an unquoted scalar: underscores ignored, `0x`,
/// `0o`, `0b` and a leading `0` (octal) prefixes, a sign; all-digit text that is not valid
/// octal (`0680`) is read as a decimal number, as go-yaml falls back to a float for it.
fn go_yaml_int(s: &str) -> Option<i128> {
    let plain: String = s.chars().filter(|c| *c != '_').collect();
    let (neg, body) = match plain.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, plain.strip_prefix('+').unwrap_or(&plain)),
    };
    let lower = body.to_ascii_lowercase();
    let radix = |digits: &str, r: u32| -> Option<i128> {
        // from_str_radix would take a sign of its own.
        if digits.is_empty() || !digits.chars().all(|c| c.is_digit(r)) {
            return None;
        }
        i128::from_str_radix(digits, r).ok()
    };
    let n = if let Some(h) = lower.strip_prefix("0x") {
        radix(h, 16)
    } else if let Some(o) = lower.strip_prefix("0o") {
        radix(o, 8)
    } else if let Some(b) = lower.strip_prefix("0b") {
        radix(b, 2)
    } else if lower.len() > 1 && lower.starts_with('0') {
        radix(&lower[1..], 8).or_else(|| radix(&lower, 10))
    } else {
        radix(&lower, 10)
    }?;
    Some(if neg { -n } else { n })
}

/// A boolean as Go's YAML 1.1 parser reads an unquoted scalar.
fn go_yaml_bool(s: &str) -> Option<bool> {
    match s {
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True" | "TRUE" => {
            Some(true)
        }
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False" | "FALSE" => {
            Some(false)
        }
        _ => None,
    }
}

fn int_in(v: &Value, yaml: bool, min: i128, max: i128, at: &str) -> Result<Value, Bad> {
    let n = match v {
        Value::Number(n) => n
            .as_i64()
            .map(i128::from)
            .or_else(|| n.as_u64().map(i128::from)),
        // serde_yaml reads YAML 1.2: what Go's YAML 1.1 reads as a number (0640) arrives here
        // as text.
        Value::String(s) if yaml => go_yaml_int(s),
        _ => None,
    };
    match n {
        Some(n) if (min..=max).contains(&n) => Ok(json!(n as i64)),
        Some(n) => Err(bad!(at, "{n} is out of range ({min} to {max})")),
        None => Err(bad!(at, "expected an integer, found {}", describe(v))),
    }
}

fn scalar(v: Value, ty: Ty, yaml: bool, at: &str) -> Result<Value, Bad> {
    match ty {
        Ty::Str => match v {
            Value::String(_) => Ok(v),
            // Go's YAML reader turns a number or boolean into text where a string is wanted.
            Value::Number(n) if yaml => Ok(Value::String(n.to_string())),
            Value::Bool(b) if yaml => Ok(Value::String(b.to_string())),
            other => Err(bad!(at, "expected a string, found {}", describe(&other))),
        },
        Ty::U32 => int_in(&v, yaml, 0, u32::MAX.into(), at),
        Ty::I64 => int_in(&v, yaml, i64::MIN.into(), i64::MAX.into(), at),
        Ty::Bool => match &v {
            Value::Bool(_) => Ok(v),
            Value::String(s) if yaml => go_yaml_bool(s)
                .map(Value::Bool)
                .ok_or_else(|| bad!(at, "expected true or false, found {}", describe(&v))),
            other => Err(bad!(
                at,
                "expected true or false, found {}",
                describe(other)
            )),
        },
        _ => unreachable!("not a scalar type"),
    }
}

/// Checks a parsed document against upstream's types and rewrites it with their exact field
/// names, so that serde reads it as Go would: keys matched case-insensitively, nulls as
/// absent, YAML scalars read with YAML 1.1's rules. Errors name the field by its path.
fn normalise(v: Value, ty: Ty, yaml: bool, at: &str) -> Result<Value, Bad> {
    let list = |v: Value, each: Ty| -> Result<Value, Bad> {
        match v {
            Value::Array(items) => items
                .into_iter()
                .enumerate()
                .filter(|(_, x)| !x.is_null() || !matches!(each, Ty::One(_)))
                .map(|(i, x)| normalise(x, each, yaml, &format!("{at}[{i}]")))
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array),
            other => Err(bad!(at, "expected a list, found {}", describe(&other))),
        }
    };
    match ty {
        Ty::Strs => list(v, Ty::Str),
        Ty::U32s => list(v, Ty::U32),
        Ty::Many(o) => list(v, Ty::One(o)),
        Ty::StrMap => match v {
            Value::Object(m) => m
                .into_iter()
                .map(|(k, x)| {
                    let x = if x.is_null() { json!("") } else { x };
                    scalar(x, Ty::Str, yaml, &format!("{at}.{k}")).map(|x| (k, x))
                })
                .collect::<Result<Map<_, _>, _>>()
                .map(Value::Object),
            other => Err(bad!(at, "expected a map, found {}", describe(&other))),
        },
        Ty::One(o) => {
            let Value::Object(m) = v else {
                return Err(bad!(at, "expected a map, found {}", describe(&v)));
            };
            let known = fields(o);
            let mut out = Map::new();
            for (k, x) in m {
                // encoding/json: an exact match first, else one that differs only in case.
                let Some((name, fty)) = known
                    .iter()
                    .find(|(n, _)| *n == k)
                    .or_else(|| known.iter().find(|(n, _)| n.eq_ignore_ascii_case(&k)))
                else {
                    let place = if at.is_empty() { "spec" } else { at };
                    return Err(bad!(place, "unknown field {k:?}"));
                };
                if x.is_null() {
                    continue;
                }
                let here = if at.is_empty() {
                    name.to_string()
                } else {
                    format!("{at}.{name}")
                };
                let x = match fty {
                    Ty::Str | Ty::U32 | Ty::I64 | Ty::Bool => scalar(x, *fty, yaml, &here)?,
                    _ => normalise(x, *fty, yaml, &here)?,
                };
                out.insert(name.to_string(), x);
            }
            Ok(Value::Object(out))
        }
        Ty::Str | Ty::U32 | Ty::I64 | Ty::Bool => scalar(v, ty, yaml, at),
    }
}

fn alnum(c: u8) -> bool {
    c.is_ascii_alphanumeric()
}

/// Upstream's vendor and class rule: a letter first, a letter or digit last, `_ - .` between.
fn vendor_or_class_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphabetic()
        && alnum(b[b.len() - 1])
        && b.iter()
            .all(|c| alnum(*c) || matches!(c, b'.' | b'-' | b'_'))
}

fn vendor_ok(s: &str) -> bool {
    vendor_or_class_ok(s)
}

fn class_ok(s: &str) -> bool {
    vendor_or_class_ok(s)
}

fn name_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && alnum(b[0])
        && alnum(b[b.len() - 1])
        && b.iter()
            .all(|c| alnum(*c) || matches!(c, b'-' | b'_' | b'.' | b':'))
}

/// Splits `vendor.com/class=name` into (kind, name).
pub fn parse_qualified(name: &str) -> Result<(String, String)> {
    let refuse = |defect| Error::CdiName {
        name: name.to_string(),
        defect,
    };
    let (kind, dev) = name
        .split_once('=')
        .ok_or_else(|| refuse(CdiNameDefect::NotQualified))?;
    let (vendor, class) = kind
        .split_once('/')
        .ok_or_else(|| refuse(CdiNameDefect::NoVendorClass))?;
    if !vendor_ok(vendor) {
        return Err(refuse(CdiNameDefect::Vendor(vendor.into())));
    }
    if !class_ok(class) {
        return Err(refuse(CdiNameDefect::Class(class.into())));
    }
    if !name_ok(dev) {
        return Err(refuse(CdiNameDefect::Device(dev.into())));
    }
    Ok((kind.to_string(), dev.to_string()))
}

fn version_index(v: &str) -> Option<usize> {
    // Upstream reads "v1.1.0" as 1.1.0; patch releases it does not list are unknown to it.
    let v = v.strip_prefix('v').unwrap_or(v);
    VERSIONS.iter().position(|x| *x == v)
}

/// The version a field needs, for the error: (version, what) pairs, newest wins.
struct Needs<'a> {
    need: Option<(usize, String)>,
    at: &'a str,
}

impl Needs<'_> {
    fn field(&mut self, min: &str, what: &str) {
        let i = version_index(min).expect("known version");
        if self.need.as_ref().is_none_or(|(n, _)| i > *n) {
            let place = if self.at.is_empty() {
                what.to_string()
            } else {
                format!("{}.{what}", self.at)
            };
            self.need = Some((i, place));
        }
    }
}

/// The newest cdiVersion the edits' fields need, with the field that needs it, by upstream's
/// rules (specs-go's `requiresV*`).
fn edits_need(e: &Edits, at: &str) -> Option<(usize, String)> {
    let mut n = Needs { need: None, at };
    for (i, m) in e.mounts.iter().enumerate() {
        if m.kind.as_deref().is_some_and(|k| !k.is_empty()) {
            n.field("0.4.0", &format!("mounts[{i}].type"));
        }
    }
    for (i, d) in e.device_nodes.iter().enumerate() {
        if d.host_path.as_deref().is_some_and(|p| !p.is_empty()) {
            n.field("0.5.0", &format!("deviceNodes[{i}].hostPath"));
        }
    }
    if !e.additional_gids.is_empty() {
        n.field("0.7.0", "additionalGids");
    }
    if let Some(r) = &e.intel_rdt {
        n.field("0.7.0", "intelRdt");
        if r.schemata.is_some() {
            n.field("1.1.0", "intelRdt.schemata");
        }
        if r.enable_monitoring == Some(true) {
            n.field("1.1.0", "intelRdt.enableMonitoring");
        }
    }
    if !e.net_devices.is_empty() {
        n.field("1.1.0", "netDevices");
    }
    n.need
}

fn env_ok(v: &str) -> bool {
    // A NUL would make the container's init panic setting it.
    v.find('=').is_some_and(|i| i > 0) && !v.contains('\0')
}

fn check_edits(e: &Edits, at: &str) -> Result<(), Bad> {
    let at = |what: String| {
        if at.is_empty() {
            what
        } else {
            format!("{at}.{what}")
        }
    };
    for (i, v) in e.env.iter().enumerate() {
        if !env_ok(v) {
            return Err(bad!(at(format!("env[{i}]")), "{v:?} is not NAME=value"));
        }
    }
    for (i, d) in e.device_nodes.iter().enumerate() {
        let here = at(format!("deviceNodes[{i}]"));
        if !d.path.starts_with('/') {
            return Err(bad!(
                format!("{here}.path"),
                "{:?} is not an absolute path",
                d.path
            ));
        }
        if let Some(k) = d.kind.as_deref().filter(|k| !k.is_empty()) {
            if !matches!(k, "b" | "c" | "u" | "p") {
                return Err(bad!(format!("{here}.type"), "{k:?} is not b, c, u or p"));
            }
        }
        if let Some(p) = &d.permissions {
            if !p.chars().all(|c| "rwm".contains(c)) {
                return Err(bad!(
                    format!("{here}.permissions"),
                    "{p:?} is not made of r, w and m"
                ));
            }
        }
    }
    for (i, m) in e.mounts.iter().enumerate() {
        let here = at(format!("mounts[{i}]"));
        if m.host_path.is_empty() {
            return Err(bad!(format!("{here}.hostPath"), "missing"));
        }
        if !m.container_path.starts_with('/') {
            return Err(bad!(
                format!("{here}.containerPath"),
                "{:?} is not an absolute path",
                m.container_path
            ));
        }
    }
    for (i, h) in e.hooks.iter().enumerate() {
        let here = at(format!("hooks[{i}]"));
        if !HOOK_STAGES.contains(&h.hook_name.as_str()) {
            return Err(bad!(
                format!("{here}.hookName"),
                "{:?} is not an OCI hook ({})",
                h.hook_name,
                HOOK_STAGES.join(", ")
            ));
        }
        if !h.path.starts_with('/') {
            return Err(bad!(
                format!("{here}.path"),
                "{:?} is not an absolute path",
                h.path
            ));
        }
        if let Some((j, v)) = h.env.iter().enumerate().find(|(_, v)| !env_ok(v)) {
            return Err(bad!(format!("{here}.env[{j}]"), "{v:?} is not NAME=value"));
        }
    }
    if let Some(c) = e.intel_rdt.as_ref().and_then(|r| r.clos_id.as_deref()) {
        if c != "/" && (c.len() >= 4096 || c == "." || c == ".." || c.contains(['/', '\n'])) {
            return Err(bad!(
                at("intelRdt.closID".into()),
                "{c:?} is not a valid CLOS name"
            ));
        }
    }
    let (mut hosts, mut names) = (Vec::new(), Vec::new());
    for (i, n) in e.net_devices.iter().enumerate() {
        let here = at(format!("netDevices[{i}]"));
        if n.host_interface_name.is_empty() {
            return Err(bad!(format!("{here}.hostInterfaceName"), "missing"));
        }
        if n.name.is_empty() {
            return Err(bad!(format!("{here}.name"), "missing"));
        }
        if hosts.contains(&&n.host_interface_name) || names.contains(&&n.name) {
            return Err(bad!(here, "interface given twice"));
        }
        hosts.push(&n.host_interface_name);
        names.push(&n.name);
    }
    Ok(())
}

/// Parses and validates one spec file's text: [`Error::CdiSpec`], naming the field
/// (`devices[0].name`).
pub fn parse_spec(path: &Path, text: &str) -> Result<Spec> {
    parse(path, text).map_err(|b| Error::CdiSpec {
        file: path.to_path_buf(),
        at: b.at,
        problem: b.problem,
    })
}

fn parse(path: &Path, text: &str) -> Result<Spec, Bad> {
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    if text.trim().is_empty() {
        return Err(bad!(
            "",
            "the file is empty (no cdiVersion, kind or devices)"
        ));
    }
    // Go's sigs.k8s.io/yaml reads JSON files as YAML too; JSON is parsed strictly here so
    // that its errors keep JSON's line and column.
    let doc: Value = if yaml {
        let y: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| bad!("", "{e}"))?;
        serde_json::to_value(y).map_err(|e| bad!("", "{e}"))?
    } else {
        serde_json::from_str(text).map_err(|e| bad!("", "{e}"))?
    };
    let doc = normalise(doc, Ty::One(Obj::Spec), yaml, "")?;
    let spec: Spec = serde_json::from_value(doc).map_err(|e| bad!("", "{e}"))?;

    if spec.cdi_version.is_empty() {
        return Err(bad!("cdiVersion", "missing"));
    }
    let version = version_index(&spec.cdi_version).ok_or_else(|| {
        bad!(
            "cdiVersion",
            "{:?} is not a CDI version ({} to {})",
            spec.cdi_version,
            EARLIEST,
            VERSIONS[VERSIONS.len() - 1]
        )
    })?;
    let (vendor, class) = spec
        .kind
        .split_once('/')
        .ok_or_else(|| bad!("kind", "{:?} is not vendor/class", spec.kind))?;
    if !vendor_ok(vendor) {
        return Err(bad!(
            "kind",
            "invalid vendor {vendor:?} (a letter first, then letters, digits, '.', '-' or '_', ending in a letter or digit)"
        ));
    }
    if !class_ok(class) {
        return Err(bad!(
            "kind",
            "invalid class {class:?} (a letter first, then letters, digits, '.', '-' or '_', ending in a letter or digit)"
        ));
    }

    // The version the spec's contents need, by upstream's rules; 0.3.0 at the least.
    let mut need = Needs {
        need: Some((version_index(EARLIEST).expect("known"), "every spec".into())),
        at: "",
    };
    if !spec.annotations.is_empty() {
        need.field("0.6.0", "annotations");
    }
    if class.contains('.') {
        need.field("0.6.0", "kind (a '.' in the class)");
    }
    let mut needs = vec![
        need.need,
        edits_need(&spec.container_edits, "containerEdits"),
    ];
    for (i, d) in spec.devices.iter().enumerate() {
        let mut n = Needs { need: None, at: "" };
        if d.name.starts_with(|c: char| c.is_ascii_digit()) {
            n.field("0.5.0", &format!("devices[{i}].name (a digit first)"));
        }
        if !d.annotations.is_empty() {
            n.field("0.6.0", &format!("devices[{i}].annotations"));
        }
        needs.push(n.need);
        needs.push(edits_need(
            &d.container_edits,
            &format!("devices[{i}].containerEdits"),
        ));
    }
    if let Some((min, what)) = needs.into_iter().flatten().max_by_key(|(i, _)| *i) {
        if min > version {
            return Err(bad!(
                "cdiVersion",
                "{} is too old: {what} needs cdiVersion {} or later",
                spec.cdi_version,
                VERSIONS[min]
            ));
        }
    }

    check_edits(&spec.container_edits, "containerEdits")?;
    let mut seen = std::collections::HashSet::new();
    for (i, d) in spec.devices.iter().enumerate() {
        if !name_ok(&d.name) {
            return Err(bad!(
                format!("devices[{i}].name"),
                "invalid device name {:?} (a letter or digit first and last, letters, digits, '-', '_', '.' or ':' between)",
                d.name
            ));
        }
        if !seen.insert(d.name.as_str()) {
            return Err(bad!(
                format!("devices[{i}].name"),
                "device {:?} is defined twice",
                d.name
            ));
        }
        if d.container_edits.is_empty() {
            return Err(bad!(
                format!("devices[{i}].containerEdits"),
                "device {:?} has no edits",
                d.name
            ));
        }
        check_edits(&d.container_edits, &format!("devices[{i}].containerEdits"))?;
    }
    if spec.devices.is_empty() {
        return Err(bad!("devices", "the spec defines no devices"));
    }
    Ok(spec)
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
    spec: Result<Spec>,
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
    /// For each of `edits`, the device it is for (`vendor.com/class=name`; spec-level edits
    /// say so), to name it in errors.
    pub devices: Vec<String>,
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
        // Which files changed, under the lock; reading and parsing them outside it, so a slow
        // or hostile file holds up no resolve or Status for longer than it takes to read.
        let stale: Vec<(PathBuf, FileKey, usize)> = {
            let mut cache = self.cache.lock().expect("cdi cache poisoned");
            cache.retain(|p, _| present.contains_key(p));
            present
                .into_iter()
                .filter(|(p, (key, dir))| {
                    !cache.get(p).is_some_and(|l| l.key == *key && l.dir == *dir)
                })
                .map(|(p, (key, dir))| (p, key, dir))
                .collect()
        };
        for (p, key, dir) in stale {
            let text = read_spec_file(&p);
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
            self.cache.lock().expect("cdi cache poisoned").insert(
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
            .filter_map(|(p, l)| l.spec.as_ref().err().map(|e| (p.clone(), e.to_string())))
            .collect();
        errors.sort();
        (devices, errors)
    }

    /// Resolves fully qualified device names (duplicates dropped, order kept).
    pub fn resolve(&self, names: &[String]) -> Result<Resolved> {
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
            let (kind, dev) = parse_qualified(name)?;
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
                return Err(Error::CdiNotFound {
                    device: name.clone(),
                    dirs: self.dirs.clone(),
                    broken,
                });
            }
            let top = found.iter().map(|f| f.0).max().expect("not empty");
            let shadowed: Vec<String> = found
                .iter()
                .filter(|f| f.0 != top)
                .map(|f| f.1.display().to_string())
                .collect();
            found.retain(|f| f.0 == top);
            if !shadowed.is_empty() && found.len() == 1 {
                // A later directory overrides an earlier one (/var/run/cdi over /etc/cdi):
                // say which definition is used, since the other is silently not.
                tracing::info!(device = %name, used = %found[0].1.display(), overridden = %shadowed.join(", "), "CDI device defined in several spec directories; the later directory wins");
            }
            if found.len() > 1 {
                let mut files: Vec<String> =
                    found.iter().map(|f| f.1.display().to_string()).collect();
                files.sort();
                return Err(Error::CdiAmbiguous {
                    device: name.clone(),
                    files,
                });
            }
            let (_, path, spec, device) = found[0];
            if !spec_done.contains(path) {
                spec_done.push(path.clone());
                if !spec.container_edits.is_empty() {
                    out.edits.push((path.clone(), spec.container_edits.clone()));
                    out.devices.push(format!("{name} (spec-wide edits)"));
                }
            }
            out.edits
                .push((path.clone(), device.container_edits.clone()));
            out.devices.push(name.clone());
        }
        Ok(out)
    }
}

/// Applies resolved edits to a container's OCI spec (as `spec::generate` makes it): errors
/// are [`Error::CdiEdit`], naming the spec file and device.
///
/// Hooks that run in the runtime's namespaces (all but startContainer, which runs inside the
/// container after pivot_root, where no hako binary is) are run through `hako cdi-hook`
/// (this executable), which records a failure with the hook, device and spec; every CDI hook
/// is also listed in the [`HOOKS_ANNOTATION`] annotation.
pub fn apply(spec: &mut oci::Spec, resolved: &Resolved) -> Result<()> {
    let wrapper = std::env::current_exe().ok();
    let mut origins = Vec::new();
    for (i, (file, e)) in resolved.edits.iter().enumerate() {
        let device = resolved.devices.get(i).map(String::as_str).unwrap_or("?");
        apply_one(spec, e, file, device, wrapper.as_deref(), &mut origins)?;
    }
    if !origins.is_empty() {
        spec.annotations_mut()
            .get_or_insert_with(Default::default)
            .insert(
                HOOKS_ANNOTATION.into(),
                serde_json::to_string(&origins).expect("serialisable"),
            );
    }
    Ok(())
}

/// Mount options runc and libcontainer turn into mount flags; any other option is passed to
/// mount(2) as data, which the kernel ignores for a bind mount.
const MOUNT_FLAGS: &[&str] = &[
    "defaults",
    "ro",
    "rw",
    "suid",
    "nosuid",
    "dev",
    "nodev",
    "exec",
    "noexec",
    "sync",
    "async",
    "dirsync",
    "remount",
    "mand",
    "nomand",
    "atime",
    "noatime",
    "diratime",
    "nodiratime",
    "bind",
    "rbind",
    "unbindable",
    "runbindable",
    "private",
    "rprivate",
    "shared",
    "rshared",
    "slave",
    "rslave",
    "relatime",
    "norelatime",
    "strictatime",
    "nostrictatime",
    "rro",
    "rrw",
    "rnosuid",
    "rsuid",
    "rnodev",
    "rdev",
    "rnoexec",
    "rexec",
    "rnodiratime",
    "rdiratime",
    "rrelatime",
    "rnorelatime",
    "rnoatime",
    "ratime",
    "rstrictatime",
    "rnostrictatime",
    "rnosymfollow",
    "rsymfollow",
    "nosymfollow",
    "symfollow",
    "idmap",
    "ridmap",
    "tmpcopyup",
];

/// An OCI object with every field absent: oci-spec's `Default` for `Linux` and `Process` is
/// runc's example config, nothing to add to a container that lacks the object.
fn blank<T: serde::de::DeserializeOwned>() -> T {
    serde_json::from_str("{}").expect("an object whose fields are all optional")
}

fn apply_one(
    spec: &mut oci::Spec,
    e: &Edits,
    file: &Path,
    device: &str,
    wrapper: Option<&Path>,
    origins: &mut Vec<HookOrigin>,
) -> Result<()> {
    let refuse = |problem: String| Error::CdiEdit {
        file: file.to_path_buf(),
        device: device.to_string(),
        problem,
    };
    if !e.net_devices.is_empty() {
        return Err(refuse(
            "netDevices edits are not supported by hako's executor".into(),
        ));
    }
    if !e.env.is_empty() {
        let env = spec
            .process_mut()
            .as_mut()
            .and_then(|p| p.env_mut().as_mut())
            .ok_or_else(|| refuse("OCI spec has no process.env".into()))?;
        for kv in &e.env {
            let key = kv.split('=').next().unwrap_or_default();
            env.retain(|x| x.split('=').next() != Some(key));
            env.push(kv.clone());
        }
    }
    for d in &e.device_nodes {
        let access = d.permissions.clone().unwrap_or_else(|| "rwm".into());
        // Type and numbers as the spec gives them, else read from the host node; an empty
        // type is no type, as upstream reads it.
        let kind = d.kind.as_deref().filter(|k| !k.is_empty());
        let dev = match (kind, d.major, d.minor) {
            (Some(k), Some(major), Some(minor)) => Device {
                kind: k.to_string(),
                major,
                minor,
                ..Default::default()
            },
            (Some("p"), _, _) => Device {
                kind: "p".into(),
                ..Default::default()
            },
            _ => {
                let host = d.host_path.as_deref().unwrap_or(&d.path);
                let found = crate::devices::host_node(Path::new(host), &d.path, &access)
                    .map_err(|e| refuse(format!("device node {host}: {e}")))?
                    .ok_or_else(|| refuse(format!("{host} is not a device node")))?;
                Device {
                    kind: kind.map(str::to_string).unwrap_or(found.kind),
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
        let linux = spec.linux_mut().get_or_insert_with(blank);
        let nodes = linux.devices_mut().get_or_insert_with(Vec::new);
        nodes.retain(|n| n.path() != Path::new(&dev.path));
        nodes.push(device_node(&dev));
        // Privileged containers have no rules (everything allowed): nothing to add.
        if let (Some(rules), Some(rule)) = (
            linux
                .resources_mut()
                .as_mut()
                .and_then(|r| r.devices_mut().as_mut()),
            device_rule(&dev),
        ) {
            rules.push(rule);
        }
    }
    for m in &e.mounts {
        // It would replace libcontainer's /dev, which then makes its links and device nodes
        // in the mounted directory.
        if crate::spec::names_dev(&m.container_path) {
            return Err(refuse(format!(
                "a mount on {} is not supported (devices go in deviceNodes)",
                m.container_path
            )));
        }
        let mut options = m.options.clone();
        let kind = m.kind.clone().unwrap_or_else(|| "bind".into());
        // As runc does, an option that is no mount flag goes to mount(2) as data (tmpfs's
        // size=, mode=); for a bind mount the kernel ignores data, so say so rather than let
        // the option vanish.
        let data: Vec<&str> = options
            .iter()
            .map(String::as_str)
            .filter(|o| !MOUNT_FLAGS.contains(o))
            .collect();
        let bind = kind == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        if bind && !data.is_empty() {
            tracing::warn!(spec = %file.display(), device, mount = %m.container_path, options = ?data, "CDI bind mount options that are not mount flags are passed as mount data, which the kernel ignores for bind mounts");
        }
        if kind == "bind" && !options.iter().any(|o| o == "bind" || o == "rbind") {
            options.push("rbind".into());
        }
        let mounts = spec
            .mounts_mut()
            .as_mut()
            .ok_or_else(|| refuse("OCI spec has no mounts".into()))?;
        mounts.retain(|x| x.destination() != Path::new(&m.container_path));
        let mut mount = oci::Mount::default();
        mount.set_destination(PathBuf::from(&m.container_path));
        mount.set_source(Some(PathBuf::from(&m.host_path)));
        mount.set_typ(Some(kind));
        mount.set_options(Some(options));
        mounts.push(mount);
    }
    for h in &e.hooks {
        origins.push(HookOrigin {
            hook: h.hook_name.clone(),
            path: h.path.clone(),
            device: device.to_string(),
            spec: file.display().to_string(),
        });
        let mut hook = oci::Hook::default();
        hook.set_path(PathBuf::from(&h.path));
        hook.set_args((!h.args.is_empty()).then(|| h.args.clone()));
        let mut timeout = h.timeout;
        if let Some(exe) = wrapper.filter(|_| h.hook_name != "startContainer") {
            let mut args = vec!["hako".to_string(), "cdi-hook".into()];
            // The wrapper enforces the timeout itself, so it can kill the hook's whole process
            // group and say so; the OCI runtime's own (which SIGKILLs the wrapper alone) is a
            // little later, only a backstop.
            if let Some(t) = h.timeout.filter(|t| *t > 0) {
                args.extend(["--timeout".to_string(), t.to_string()]);
                timeout = Some(t.saturating_add(HOOK_TIMEOUT_MARGIN));
            }
            args.extend([
                h.hook_name.clone(),
                device.to_string(),
                file.display().to_string(),
                h.path.clone(),
            ]);
            if h.args.is_empty() {
                args.push(h.path.clone());
            }
            args.extend(h.args.iter().cloned());
            hook.set_path(exe.to_path_buf());
            hook.set_args(Some(args));
        }
        hook.set_env((!h.env.is_empty()).then(|| h.env.clone()));
        hook.set_timeout(timeout);
        let hooks = spec.hooks_mut().get_or_insert_with(Default::default);
        let stage = match h.hook_name.as_str() {
            "prestart" => hooks.prestart_mut(),
            "createRuntime" => hooks.create_runtime_mut(),
            "createContainer" => hooks.create_container_mut(),
            "startContainer" => hooks.start_container_mut(),
            "poststart" => hooks.poststart_mut(),
            "poststop" => hooks.poststop_mut(),
            // parse_spec refuses any other name.
            other => return Err(refuse(format!("{other:?} is not an OCI hook"))),
        };
        stage.get_or_insert_with(Vec::new).push(hook);
    }
    for g in &e.additional_gids {
        if *g == 0 {
            continue;
        }
        let user = spec
            .process_mut()
            .as_mut()
            .ok_or_else(|| refuse("OCI spec has no process".into()))?
            .user_mut();
        let gids = user.additional_gids_mut().get_or_insert_with(Vec::new);
        if !gids.contains(g) {
            gids.push(*g);
        }
    }
    if let Some(rdt) = &e.intel_rdt {
        if !Path::new("/sys/fs/resctrl/schemata").exists() {
            return Err(refuse(
                "intelRdt edits need resctrl mounted at /sys/fs/resctrl".into(),
            ));
        }
        let mut v = oci::LinuxIntelRdt::default();
        v.set_clos_id(rdt.clos_id.clone());
        v.set_l3_cache_schema(rdt.l3_cache_schema.clone());
        v.set_mem_bw_schema(rdt.mem_bw_schema.clone());
        v.set_schemata(rdt.schemata.clone());
        v.set_enable_monitoring(rdt.enable_monitoring);
        spec.linux_mut()
            .get_or_insert_with(blank)
            .set_intel_rdt(Some(v));
    }
    Ok(())
}

/// The OCI annotation listing where each CDI hook of a container came from, for the monitor
/// to name a failing one.
pub const HOOKS_ANNOTATION: &str = "io.hako.cdi.hooks";
/// The file in a container's bundle where `hako cdi-hook` records the hook it is running and,
/// when that hook fails, how.
pub const HOOK_REPORT: &str = "cdi-hook.json";
/// How much later than a wrapped hook's own timeout the OCI runtime's timeout is, in seconds:
/// enough for `hako cdi-hook` to kill the hook's group and record why first.
const HOOK_TIMEOUT_MARGIN: i64 = 2;
/// How much of a failing hook's stderr its error quotes.
const STDERR_QUOTED: usize = 512;

/// One CDI hook: the OCI hook name, its own path, and the device and spec file it came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct HookOrigin {
    pub hook: String,
    pub path: String,
    pub device: String,
    pub spec: String,
}

/// A CDI hook that is running or failed, as `hako cdi-hook` records it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, Deserialize)]
pub struct HookReport {
    #[serde(flatten)]
    pub origin: HookOrigin,
    /// How it ended ("exited with status 3"), or that it did not.
    pub status: String,
    /// The start of its stderr.
    #[serde(default)]
    pub stderr: String,
}

impl HookOrigin {
    pub fn describe(&self) -> String {
        format!(
            "{} hook {} of CDI device {} (spec {})",
            self.hook, self.path, self.device, self.spec
        )
    }
}

impl HookReport {
    pub fn describe(&self) -> String {
        let mut m = format!("{} {}", self.origin.describe(), self.status);
        if !self.stderr.is_empty() {
            m.push_str(&format!("; stderr: {}", self.stderr));
        }
        m
    }

    /// The report a failed create left in `bundle`, taken (removed) so it is read once.
    pub fn take(bundle: &Path) -> Option<HookReport> {
        let p = bundle.join(HOOK_REPORT);
        let text = std::fs::read_to_string(&p).ok()?;
        let _ = std::fs::remove_file(&p);
        serde_json::from_str(&text).ok()
    }
}

/// The CDI hooks of a container's OCI spec (`config.json` in `bundle`) at one OCI hook name.
pub fn hooks_of(bundle: &Path, hook: &str) -> Vec<HookOrigin> {
    let Ok(text) = std::fs::read_to_string(bundle.join("config.json")) else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return Vec::new();
    };
    v["annotations"][HOOKS_ANNOTATION]
        .as_str()
        .and_then(|s| serde_json::from_str::<Vec<HookOrigin>>(s).ok())
        .unwrap_or_default()
        .into_iter()
        .filter(|h| h.hook == hook)
        .collect()
}

/// `hako cdi-hook [--timeout SECS] HOOK DEVICE SPEC PATH ARG0 ARGS...`: runs one CDI hook for
/// the OCI runtime in its place, so that a failure says which hook it was. The container state
/// arrives on stdin and is passed on; the hook's stderr is passed through and its start kept.
/// The hook runs in its own process group, which is SIGKILLed when the hook exits (background
/// children it left), at its timeout (all of it, recorded as "timed out") or when the process
/// that runs this wrapper dies (the pod torn down during a create). While it runs,
/// and when it fails, `<bundle>/cdi-hook.json` says so (a wrapper killed from outside leaves
/// the "did not finish" record). Returns the hook's exit status (124 when it timed out).
pub fn hook_main(args: &[std::ffi::OsString]) -> i32 {
    use std::io::{Read, Write};
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    const USAGE: &str =
        "hako cdi-hook: usage: hako cdi-hook [--timeout SECS] HOOK DEVICE SPEC PATH [ARG0 ARGS...]";
    let (timeout, args) = match args {
        [flag, secs, rest @ ..] if flag == "--timeout" => {
            match secs.to_str().and_then(|t| t.parse::<u64>().ok()) {
                Some(t) => (Some(t), rest),
                None => {
                    eprintln!("{USAGE}");
                    return 2;
                }
            }
        }
        _ => (None, args),
    };
    // Who runs this wrapper, taken first: if it dies before the hook even starts, the hook is
    // still found abandoned below.
    let parent = nix::unistd::getppid();
    let s = |i: usize| args.get(i).map(|a| a.to_string_lossy().into_owned());
    let (Some(hook), Some(device), Some(spec), Some(path)) = (s(0), s(1), s(2), s(3)) else {
        eprintln!("{USAGE}");
        return 2;
    };
    let arg0 = args.get(4).cloned().unwrap_or_else(|| path.clone().into());
    let rest = args.get(5..).unwrap_or_default();
    let mut state = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut state);
    let report_file = serde_json::from_slice::<Value>(&state)
        .ok()
        .and_then(|v| v["bundle"].as_str().map(|b| Path::new(b).join(HOOK_REPORT)));
    let origin = HookOrigin {
        hook,
        path: path.clone(),
        device,
        spec,
    };
    let record = |status: String, stderr: String| {
        if let Some(f) = &report_file {
            let r = HookReport {
                origin: origin.clone(),
                status,
                stderr,
            };
            let tmp = f.with_extension("tmp");
            if std::fs::write(&tmp, serde_json::to_vec(&r).unwrap_or_default()).is_ok() {
                let _ = std::fs::rename(&tmp, f);
            }
        }
    };
    record(
        "did not finish (killed, or past its timeout)".into(),
        String::new(),
    );
    let child = std::process::Command::new(&path)
        .arg0(arg0)
        .args(rest)
        // Its own group, so that what it leaves running can be killed with it.
        .process_group(0)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            let e = std::io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0));
            record(format!("could not be run: {e}"), String::new());
            eprintln!(
                "hako cdi-hook: {}: could not be run: {e}",
                origin.describe()
            );
            return 127;
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        // A hook that does not read its state closes the pipe early: not an error. Written
        // beside the wait, so that a hook that neither reads nor exits still meets its timeout.
        std::thread::spawn(move || {
            let _ = stdin.write_all(&state);
        });
    }
    // stderr is read beside the wait, not to its end: a hook that leaves a background child
    // holding it open has still finished when it exits, and must not keep the runtime (and
    // the pod's monitor) waiting for that child.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    if let Some(mut err) = child.stderr.take() {
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = std::io::stderr().write_all(&buf[..n]);
                if tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
    } else {
        drop(tx);
    }
    // Its exit is seen without reaping it (WNOWAIT): until it is reaped its pid stays the
    // group's id, so the kill below reaches its group and nothing else.
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (exited_tx, exited_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        use nix::sys::wait::{waitid, Id, WaitPidFlag};
        while let Err(nix::errno::Errno::EINTR) =
            waitid(Id::Pid(pgid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT)
        {}
        let _ = exited_tx.send(());
    });
    // Waited for in steps: the runtime that runs this wrapper (the monitor's helper) may be
    // killed meanwhile (its pod torn down), which reparents this process; the hook is then
    // abandoned and goes with its group at once, not at its own end or timeout.
    let deadline = timeout.map(|t| std::time::Instant::now() + std::time::Duration::from_secs(t));
    let mut abandoned = false;
    let timed_out = loop {
        let step = std::time::Duration::from_millis(100);
        let step = deadline.map_or(step, |d| {
            step.min(d.saturating_duration_since(std::time::Instant::now()))
        });
        match exited_rx.recv_timeout(step) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            _ => break false,
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            break true;
        }
        if nix::unistd::getppid() != parent {
            abandoned = true;
            break false;
        }
    };
    // Whatever is left of its group goes: background children it left, or, at its timeout or
    // when abandoned, the hook and all it started. A child that made its own session escapes
    // this.
    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
    if abandoned {
        // No record: nobody waits for one, and the bundle may be being removed.
        let _ = child.wait();
        return 1;
    }
    let status = match child.wait() {
        Ok(s) => s,
        Err(e) => {
            record(format!("could not be waited for: {e}"), String::new());
            return 1;
        }
    };
    // What it wrote before it exited, and a moment for the pipe to drain; then done.
    let mut quoted = Vec::new();
    let until = std::time::Instant::now() + std::time::Duration::from_millis(200);
    while let Ok(chunk) =
        rx.recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
    {
        let room = STDERR_QUOTED.saturating_sub(quoted.len());
        quoted.extend_from_slice(&chunk[..chunk.len().min(room)]);
    }
    let stderr = String::from_utf8_lossy(&quoted).trim().to_string();
    if let Some(t) = timeout.filter(|_| timed_out) {
        record(format!("timed out after {t} s"), stderr);
        return 124;
    }
    match (status.code(), status.signal()) {
        (Some(0), _) => {
            if let Some(f) = &report_file {
                let _ = std::fs::remove_file(f);
            }
            0
        }
        (Some(code), _) => {
            record(format!("exited with status {code}"), stderr);
            code
        }
        (None, sig) => {
            let sig = sig.unwrap_or(0);
            record(format!("was killed by signal {sig}"), stderr);
            128 + sig
        }
    }
}

/// Gives the directories libcontainer made for nested device nodes (`/dev/dri/card0`,
/// `/dev/nvgpu/igpu0/ctrl`) mode 0755, as runc makes them: libcontainer creates them under
/// umask 0, so 0777. Called once the container is created and before it runs anything
/// (`pid` is its init), for every device of its `config.json`; a directory that is a symlink,
/// or not 0777, is left alone.
pub fn fix_device_dirs(pid: i32, bundle: &Path) {
    let Ok(text) = std::fs::read_to_string(bundle.join("config.json")) else {
        return;
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return;
    };
    // Every step is an openat with O_NOFOLLOW from the container's root, and the chmod is
    // an fchmod of the directory opened: a symlink swapped in by a process sharing a volume
    // under /dev can never redirect it to a host file. Only directories on the container's
    // own /dev (same st_dev) are touched, never a volume mounted below it.
    // /proc/<pid>/root is the kernel's link to the container's root: followed on purpose.
    let Ok(root) = std::fs::File::open(format!("/proc/{pid}/root")) else {
        return;
    };
    fix_device_dirs_under(&root, &v);
}

/// [`fix_device_dirs`] below `root` (the container's root), for the devices of `spec`.
fn fix_device_dirs_under(root: &std::fs::File, v: &Value) {
    let Ok(dev) = crate::fsat::open_dir_nofollow(Some(root), "dev".as_ref()) else {
        return;
    };
    let Ok(dev_st) = dev.metadata() else {
        return;
    };
    let mut done: Vec<PathBuf> = Vec::new();
    for d in v["linux"]["devices"].as_array().into_iter().flatten() {
        let Some(path) = d["path"].as_str() else {
            continue;
        };
        let Ok(rel) = Path::new(path).strip_prefix("/dev") else {
            continue;
        };
        let parts: Vec<_> = rel.components().collect();
        let mut at = PathBuf::new();
        let mut parent: Option<std::fs::File> = None;
        for part in parts.iter().take(parts.len().saturating_sub(1)) {
            let std::path::Component::Normal(part) = part else {
                break;
            };
            at.push(part);
            let Ok(dir) =
                crate::fsat::open_dir_nofollow(Some(parent.as_ref().unwrap_or(&dev)), part)
            else {
                break;
            };
            let Ok(md) = dir.metadata() else {
                break;
            };
            if md.dev() != dev_st.dev() {
                break;
            }
            if !done.contains(&at) && md.mode() & 0o7777 == 0o777 {
                if let Err(e) = nix::sys::stat::fchmod(
                    std::os::fd::AsRawFd::as_raw_fd(&dir),
                    nix::sys::stat::Mode::from_bits_truncate(0o755),
                ) {
                    tracing::warn!(dir = %Path::new("/dev").join(&at).display(), error = %e, "cannot make a device directory 0755");
                }
            }
            done.push(at.clone());
            parent = Some(dir);
        }
    }
}

/// The most a CDI spec file may hold: nvidia-ctk's largest (a Jetson spec with 418 mounts) is
/// well under 1 MiB.
const MAX_SPEC_BYTES: u64 = 4 << 20;

/// A spec file's text: a regular file of at most [`MAX_SPEC_BYTES`], opened non-blocking so a
/// file that never ends or blocks (a FIFO, a /proc file linked in) cannot hang the daemon.
fn read_spec_file(p: &Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    // The message alone, as for a parse error: the registry lists it beside the file.
    let refuse = |problem: String| Error::CdiSpec {
        file: p.to_path_buf(),
        at: String::new(),
        problem,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(p)
        .map_err(|e| refuse(e.to_string()))?;
    let md = f.metadata().map_err(|e| refuse(e.to_string()))?;
    if !md.is_file() {
        return Err(refuse("not a regular file".into()));
    }
    let mut text = String::new();
    f.take(MAX_SPEC_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| refuse(e.to_string()))?;
    if text.len() as u64 > MAX_SPEC_BYTES {
        return Err(refuse(format!("larger than {MAX_SPEC_BYTES} bytes")));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_dirs_are_made_0755_and_no_symlink_is_followed() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let outside = t.path().join("host");
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777;
        let open = |p: &Path| std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777));
        std::fs::create_dir_all(root.join("dev/vendor/sub")).unwrap();
        std::fs::create_dir_all(outside.join("x")).unwrap();
        for d in ["dev/vendor", "dev/vendor/sub"] {
            open(&root.join(d)).unwrap();
        }
        open(&outside).unwrap();
        open(&outside.join("x")).unwrap();
        // A directory on the way swapped for a link to a host directory.
        std::os::unix::fs::symlink(&outside, root.join("dev/link")).unwrap();
        let spec = json!({"linux": {"devices": [
            {"path": "/dev/vendor/sub/node0"},
            {"path": "/dev/link/x/node1"},
        ]}});
        fix_device_dirs_under(&std::fs::File::open(&root).unwrap(), &spec);
        assert_eq!(mode(&root.join("dev/vendor")), 0o755);
        assert_eq!(mode(&root.join("dev/vendor/sub")), 0o755);
        assert_eq!(
            mode(&outside),
            0o777,
            "the link's target is not the container's"
        );
        assert_eq!(mode(&outside.join("x")), 0o777);
    }

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
            .to_string()
            .contains("fully qualified"));
        assert!(parse_qualified("v/c@x=d")
            .unwrap_err()
            .to_string()
            .contains("class"));
        assert!(parse_qualified("v/c=-d")
            .unwrap_err()
            .to_string()
            .contains("device name"));
    }

    #[test]
    fn specs_are_validated_with_the_cause() {
        let p = Path::new("/x/a.json");
        let bad = |text: &str, want: &str| {
            let e = parse_spec(p, text).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        bad(
            r#"{"cdiVersion":"9.9.9","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["A=1"]}}]}"#,
            "is not a CDI version",
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
            "has no edits",
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
            r#"{"cdiVersion":"0.6.0","kind":"a.com/b","devices":[{"name":"d","containerEdits":{"env":["A=1\u0000"]}}]}"#,
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
        let m = e.to_string();
        assert!(
            matches!(&e, Error::CdiAmbiguous { .. })
                && m.contains("ambiguous")
                && m.contains("gpu2.json")
                && m.contains("gpu.yaml"),
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
            matches!(&e, Error::CdiNotFound { .. }) && e.to_string().contains("broken.json"),
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
            Err(Error::CdiNotFound { .. })
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
            let e = parse_qualified(bad).unwrap_err().to_string();
            assert!(e.contains(part), "{bad}: {e}");
        }
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
                "1.1.0",
                "1.0.0",
                r#"{"netDevices":[{"hostInterfaceName":"eth1","name":"net1"}]}"#,
            ),
            ("1.1.0", "1.0.0", r#"{"intelRdt":{"schemata":["L3:0=f"]}}"#),
            (
                "1.1.0",
                "1.0.0",
                r#"{"intelRdt":{"enableMonitoring":true}}"#,
            ),
        ] {
            assert!(
                parse_spec(p, &one_device(min, edits)).is_ok(),
                "{edits} at {min}"
            );
            let e = parse_spec(p, &one_device(before, edits))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("needs cdiVersion {min}")), "{e}");
        }
        // Only the versions upstream lists: no 1.0.x patch releases; a leading v is read.
        let e = parse_spec(p, &one_device("1.0.1", r#"{"env":["A=1"]}"#))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cdiVersion: \"1.0.1\" is not a CDI version"),
            "{e}"
        );
        assert!(parse_spec(p, &one_device("v1.1.0", r#"{"env":["A=1"]}"#)).is_ok());
        // Annotations, on the spec or on a device, from 0.6.0.
        let a = r#""annotations":{"x":"y"},"#;
        for (spec_level, device_level) in [(a, ""), ("", a)] {
            let text = |version: &str| {
                format!(
                    r#"{{"cdiVersion":"{version}","kind":"a.com/b",{spec_level}"devices":[{{"name":"d",{device_level}"containerEdits":{{"env":["A=1"]}}}}]}}"#
                )
            };
            let e = parse_spec(p, &text("0.5.0")).unwrap_err().to_string();
            assert!(e.contains("annotations needs cdiVersion 0.6.0"), "{e}");
            assert!(parse_spec(p, &text("0.6.0")).is_ok(), "{}", text("0.6.0"));
            assert!(parse_spec(p, &text("1.0.0")).is_ok(), "{}", text("1.0.0"));
        }
    }

    #[test]
    fn mounts_hooks_and_kinds_are_checked() {
        let p = Path::new("/x/a.json");
        let bad = |text: &str, want: &str| {
            let e = parse_spec(p, text).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        };
        bad(
            &one_device(
                "0.6.0",
                r#"{"mounts":[{"hostPath":"","containerPath":"/b"}]}"#,
            ),
            "devices[0].containerEdits.mounts[0].hostPath: missing",
        );
        bad(
            &one_device(
                "0.6.0",
                r#"{"mounts":[{"hostPath":"/a","containerPath":"b"}]}"#,
            ),
            "devices[0].containerEdits.mounts[0].containerPath: \"b\" is not an absolute path",
        );
        bad(
            &one_device(
                "0.6.0",
                r#"{"hooks":[{"hookName":"createRuntime","path":"bin/hook"}]}"#,
            ),
            "hooks[0].path: \"bin/hook\" is not an absolute path",
        );
        assert!(parse_spec(
            p,
            &one_device(
                "0.6.0",
                r#"{"hooks":[{"hookName":"createRuntime","path":"/bin/hook"}],"mounts":[{"hostPath":"/a","containerPath":"/b"}]}"#
            )
        )
        .is_ok());
        for (kind, what) in [
            ("a@com/b", "invalid vendor"),
            ("1a.com/b", "invalid vendor"),
            ("a.com/", "invalid class"),
            ("a.com/b/c", "invalid class"),
            ("a.com/-b", "invalid class"),
        ] {
            let text = one_device("0.6.0", r#"{"env":["A=1"]}"#).replace("a.com/b", kind);
            bad(&text, what);
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
            Err(e @ Error::CdiNotFound { .. }) => e.to_string(),
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
    fn a_spec_file_too_large_is_refused_unread() {
        let d = tempfile::tempdir().unwrap();
        let big = format!(
            "{{\"cdiVersion\": \"0.3.0\", \"kind\": \"big.com/x\", \"devices\": [], \"pad\": \"{}\"}}",
            "x".repeat(MAX_SPEC_BYTES as usize)
        );
        write(d.path(), "big.json", &big);
        let reg = Registry::new(vec![d.path().into()]);
        let (_, broken) = reg.report();
        assert_eq!(broken.len(), 1, "{broken:?}");
        assert!(broken[0].1.contains("larger than"), "{broken:?}");
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

    /// The device cgroup rules of `spec`.
    fn rules_of(spec: &oci::Spec) -> &[oci::LinuxDeviceCgroup] {
        spec.linux()
            .as_ref()
            .and_then(|l| l.resources().as_ref())
            .and_then(|r| r.devices().as_deref())
            .unwrap_or_default()
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
        let mut spec = crate::spec::generate(&Default::default());
        let default_rules = rules_of(&spec).len();
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
                ..Default::default()
            },
        )
        .unwrap();
        let linux = spec.linux().as_ref().unwrap();
        assert_eq!(
            serde_json::to_value(linux.devices()).unwrap(),
            json!([
                {"path": "/dev/absent-gpu", "type": "c", "major": 195, "minor": 7, "fileMode": 0o640, "uid": 1000, "gid": 44},
                {"path": "/dev/absent-fifo", "type": "p", "major": 0, "minor": 0, "fileMode": 0o666},
                {"path": "/dev/from-host", "type": "c", "major": 1, "minor": 3, "fileMode": 0o600},
            ])
        );
        assert_eq!(
            serde_json::to_value(&rules_of(&spec)[default_rules..]).unwrap(),
            json!([
                {"allow": true, "type": "c", "major": 195, "minor": 7, "access": "rwm"},
                {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"},
            ])
        );
    }

    #[test]
    fn mounts_and_hooks_are_written_as_given() {
        let mut spec = crate::spec::generate(&Default::default());
        let mut old = oci::Mount::default();
        old.set_destination("/b".into());
        old.set_typ(Some("bind".into()));
        old.set_source(Some("/old".into()));
        spec.set_mounts(Some(vec![old]));
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
                ..Default::default()
            },
        )
        .unwrap();
        // A bind mount gets rbind unless it names bind itself; another type is left alone; a
        // destination already mounted is replaced.
        assert_eq!(
            serde_json::to_value(spec.mounts()).unwrap(),
            json!([
                {"destination": "/a", "source": "/h", "type": "tmpfs", "options": ["nosuid"]},
                {"destination": "/b", "source": "/h", "type": "bind", "options": ["bind", "ro"]},
                {"destination": "/c", "source": "/h", "type": "bind", "options": ["rbind"]},
            ])
        );
        // Each runs through `hako cdi-hook` (here the test binary), which is told the hook's
        // name, device, spec and its own path and arguments; env stays the hook's.
        let exe = std::env::current_exe().unwrap();
        let wrapped = |stage: &str, args: &[&str]| {
            let mut a = vec!["hako", "cdi-hook", stage, "?", "/etc/cdi/m.json"];
            a.extend(args);
            json!({"path": exe, "args": a})
        };
        // A hook with a timeout: the wrapper enforces it, the runtime's is a backstop later.
        let mut poststop = json!({"path": exe, "args": [
            "hako", "cdi-hook", "--timeout", "5", "poststop", "?", "/etc/cdi/m.json", "/bin/b", "b", "-x"
        ]});
        poststop["env"] = json!(["K=v"]);
        poststop["timeout"] = json!(7);
        assert_eq!(
            serde_json::to_value(spec.hooks()).unwrap(),
            json!({
                "createRuntime": [wrapped("createRuntime", &["/bin/a", "/bin/a"]), wrapped("createRuntime", &["/bin/c", "/bin/c"])],
                "poststop": [poststop],
            })
        );
        // Where each came from, for the monitor.
        let origins: Vec<HookOrigin> =
            serde_json::from_str(&spec.annotations().as_ref().unwrap()[HOOKS_ANNOTATION]).unwrap();
        assert_eq!(origins.len(), 3);
        assert_eq!(
            origins[1],
            HookOrigin {
                hook: "poststop".into(),
                path: "/bin/b".into(),
                device: "?".into(),
                spec: "/etc/cdi/m.json".into()
            }
        );
    }

    #[test]
    fn edits_reach_the_oci_spec() {
        let mut spec = crate::spec::generate(&crate::spec::ContainerSpec {
            env: vec!["A=1".into(), "PATH=/bin".into()],
            ..Default::default()
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
                ..Default::default()
            },
        )
        .unwrap();
        let process = spec.process().as_ref().unwrap();
        assert_eq!(
            process.env().as_deref(),
            Some(&["PATH=/bin", "A=2"].map(String::from)[..])
        );
        let dev = &spec.linux().as_ref().unwrap().devices().as_ref().unwrap()[0];
        assert_eq!(
            (dev.path(), dev.typ(), dev.major(), dev.minor()),
            (&PathBuf::from("/dev/fake"), oci::LinuxDeviceType::C, 1, 3)
        );
        let rule = rules_of(&spec).last().unwrap().clone();
        assert_eq!(
            (rule.allow(), rule.typ(), rule.major(), rule.minor()),
            (true, Some(oci::LinuxDeviceType::C), Some(1), Some(3))
        );
        assert_eq!(rule.access().as_deref(), Some("rw"));
        let vendor = spec
            .mounts()
            .iter()
            .flatten()
            .find(|m| m.destination() == Path::new("/usr/lib/vendor"))
            .unwrap();
        assert_eq!(
            vendor.options().as_deref(),
            Some(&["ro", "rbind"].map(String::from)[..])
        );
        let hooks = spec.hooks().as_ref().unwrap();
        assert_eq!(
            hooks.create_runtime().as_ref().unwrap()[0]
                .args()
                .as_ref()
                .unwrap()[5],
            "/bin/true"
        );
        assert_eq!(process.user().additional_gids().as_deref(), Some(&[44][..]));

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
                ..Default::default()
            },
        )
        .unwrap_err()
        .to_string();
        let e = e.to_string();
        assert!(
            e.contains("/etc/cdi/y.json") && e.contains("/nonexistent"),
            "{e}"
        );

        // A mount on /dev would replace libcontainer's, which then fills the host directory.
        for dest in ["/dev", "/dev/", "/usr/../dev"] {
            let e = apply(
                &mut spec,
                &Resolved {
                    edits: vec![(
                        PathBuf::from("/etc/cdi/z.json"),
                        Edits {
                            mounts: vec![MountEdit {
                                host_path: "/dev".into(),
                                container_path: dest.into(),
                                ..Default::default()
                            }],
                            ..Default::default()
                        },
                    )],
                    ..Default::default()
                },
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains(&format!("a mount on {dest} is not supported")),
                "{e}"
            );
        }
    }

    #[test]
    fn field_names_are_upstreams_matched_as_go_matches_them() {
        let p = Path::new("/x/a.json");
        // specs-go spells it additionalGids; Go's JSON decoder ignores case, so the spelling
        // of SPEC.md's prose (additionalGIDs) is the same field.
        for key in ["additionalGids", "additionalGIDs", "ADDITIONALGIDS"] {
            let s = parse_spec(p, &one_device("0.7.0", &format!(r#"{{"{key}":[44,45]}}"#)))
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(
                s.devices[0].container_edits.additional_gids,
                [44, 45],
                "{key}"
            );
        }
        let s = parse_spec(
            p,
            r#"{"CDIVERSION":"0.3.0","Kind":"a.com/bb","devices":[{"Name":"d","containeredits":{"DeviceNodes":[{"PATH":"/dev/x"}]}}]}"#,
        )
        .unwrap();
        assert_eq!(s.devices[0].container_edits.device_nodes[0].path, "/dev/x");
        // Fields upstream does not have are refused, by their place in the file.
        let e = parse_spec(
            p,
            &one_device("0.7.0", r#"{"intelRdt":{"enableCMT":true}}"#),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            r#"devices[0].containerEdits.intelRdt: unknown field "enableCMT""#
        );
        let e = parse_spec(
            p,
            &one_device("0.7.0", r#"{"deviceNodes":[{"path":"/dev/x","mode":1}]}"#),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            r#"devices[0].containerEdits.deviceNodes[0]: unknown field "mode""#
        );
        let e = parse_spec(
            p,
            r#"{"cdiVersion":"0.3.0","kind":"a.com/bb","devices":[],"x":1}"#,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, r#"spec: unknown field "x""#);
        // Types are checked with the field named; null is absent, as in Go.
        let e = parse_spec(p, &one_device("0.7.0", r#"{"additionalGids":[-1]}"#))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("devices[0].containerEdits.additionalGids[0]: -1 is out of range"),
            "{e}"
        );
        let e = parse_spec(
            p,
            &one_device(
                "0.7.0",
                r#"{"deviceNodes":[{"path":"/dev/x","fileMode":"0640"}]}"#,
            ),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            r#"devices[0].containerEdits.deviceNodes[0].fileMode: expected an integer, found string "0640""#
        );
        assert!(parse_spec(p, &one_device("0.7.0", r#"{"env":["A=1"],"mounts":null}"#)).is_ok());
    }

    #[test]
    fn versions_are_upstreams_with_its_rule_for_each_field() {
        let p = Path::new("/x/a.yaml");
        let yaml = |version: &str, kind: &str, name: &str| {
            format!("cdiVersion: {version}\nkind: {kind}\ndevices:\n- name: {name}\n  containerEdits:\n    env: [A=1]\n")
        };
        for v in [
            "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
        ] {
            assert!(parse_spec(p, &yaml(v, "a.com/bb", "d")).is_ok(), "{v}");
        }
        // Known to upstream, but every spec needs 0.3.0 there.
        for v in ["0.1.0", "0.2.0"] {
            let e = parse_spec(p, &yaml(v, "a.com/bb", "d"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                e,
                format!("cdiVersion: {v} is too old: every spec needs cdiVersion 0.3.0 or later")
            );
        }
        for v in ["0.9.0", "1.2.0", "2", "1.0.1"] {
            let e = parse_spec(p, &yaml(v, "a.com/bb", "d"))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("is not a CDI version (0.3.0 to 1.1.0)"),
                "{v}: {e}"
            );
        }
        // A '.' in the class needs 0.6.0; a device name starting with a digit needs 0.5.0.
        let e = parse_spec(p, &yaml("0.5.0", "a.com/b.c", "d"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("kind (a '.' in the class) needs cdiVersion 0.6.0"),
            "{e}"
        );
        assert!(parse_spec(p, &yaml("0.6.0", "a.com/b.c", "d")).is_ok());
        let e = parse_spec(p, &yaml("0.4.0", "a.com/bb", "0"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("devices[0].name (a digit first) needs cdiVersion 0.5.0"),
            "{e}"
        );
        assert!(parse_spec(p, &yaml("0.5.0", "a.com/bb", "0")).is_ok());
        // The field that needs the newest version is the one named.
        let e = parse_spec(
            Path::new("/x/a.json"),
            &one_device(
                "0.6.0",
                r#"{"additionalGids":[1],"netDevices":[{"hostInterfaceName":"a","name":"b"}]}"#,
            ),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(e, "cdiVersion: 0.6.0 is too old: devices[0].containerEdits.netDevices needs cdiVersion 1.1.0 or later");
    }

    #[test]
    fn yaml_is_read_as_gos_yaml_reads_it() {
        let p = Path::new("/x/a.yaml");
        let node = |fields: &str| {
            let text = format!("cdiVersion: 0.7.0\nkind: a.com/bb\ndevices:\n- name: d\n  containerEdits:\n    deviceNodes:\n    - {{path: /dev/x, {fields}}}\n");
            parse_spec(p, &text).map(|s| s.devices[0].container_edits.device_nodes[0].clone())
        };
        for mode in ["0640", "0o640", "0x1a0", "416", "+0640", "0_640"] {
            assert_eq!(
                node(&format!("fileMode: {mode}")).unwrap().file_mode,
                Some(0o640),
                "{mode}"
            );
        }
        // Not octal: go-yaml reads it as a decimal number.
        assert_eq!(node("fileMode: 0680").unwrap().file_mode, Some(680));
        let n = node("uid: 1_000, gid: 0b101, major: 0x10, minor: -0").unwrap();
        assert_eq!(
            (n.uid, n.gid, n.major, n.minor),
            (Some(1000), Some(5), Some(16), Some(0))
        );
        let e = node("fileMode: rw").unwrap_err().to_string();
        assert_eq!(
            e,
            r#"devices[0].containerEdits.deviceNodes[0].fileMode: expected an integer, found string "rw""#
        );
        let e = node("fileMode: 0o8").unwrap_err().to_string();
        assert!(e.contains("fileMode: expected an integer"), "{e}");
        // Numbers and booleans where text is wanted become text, as Go's reader makes them.
        let s = parse_spec(
            p,
            "cdiVersion: 1.1.0\nkind: a.com/bb\ndevices:\n- name: 0\n  containerEdits:\n    intelRdt: {closID: 7, enableMonitoring: yes}\n",
        )
        .unwrap();
        assert_eq!(s.devices[0].name, "0");
        let rdt = s.devices[0].container_edits.intel_rdt.clone().unwrap();
        assert_eq!(
            (rdt.clos_id.as_deref(), rdt.enable_monitoring),
            (Some("7"), Some(true))
        );
        // A key given twice is an error, as in go-yaml's strict mode.
        assert!(parse_spec(
            p,
            "cdiVersion: 0.7.0\ncdiVersion: 0.6.0\nkind: a.com/bb\ndevices: []\n"
        )
        .is_err());
        // An empty file says so.
        assert_eq!(
            parse_spec(p, "\n").unwrap_err().to_string(),
            "the file is empty (no cdiVersion, kind or devices)"
        );
        assert_eq!(
            parse_spec(Path::new("/x/a.json"), "{}")
                .unwrap_err()
                .to_string(),
            "cdiVersion: missing"
        );
    }

    #[test]
    fn go_yaml_integers() {
        for (s, n) in [
            ("0", Some(0)),
            ("017", Some(15)),
            ("-017", Some(-15)),
            ("0o17", Some(15)),
            ("0X1f", Some(31)),
            ("0b11", Some(3)),
            ("1_0", Some(10)),
            ("09", Some(9)),
            ("0x", None),
            ("0x-1", None),
            ("--1", None),
            ("1.5", None),
            ("", None),
        ] {
            assert_eq!(go_yaml_int(s), n, "{s}");
        }
    }
}
