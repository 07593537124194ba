//! The `hako` command line, its config handling, systemd readiness and the systemd unit.

mod support;

use std::process::Command;
use std::time::Duration;

const HAKO: &str = env!("CARGO_BIN_EXE_hako");

fn hako(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(HAKO).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn version_and_default_config() {
    let (code, out, _) = hako(&["version"]);
    assert_eq!(code, 0);
    assert_eq!(out.trim(), format!("hako {}", env!("CARGO_PKG_VERSION")));
}

/// `hako config default` prints every key with the default docs/CONFIGURATION.md gives it, and
/// nothing the reference does not document. (A key missing from the output would still parse
/// to its default, so a round trip alone cannot see it.)
#[test]
fn config_default_prints_every_documented_key_with_its_documented_default() {
    let (code, out, err) = hako(&["config", "default"]);
    assert_eq!(code, 0, "{err}");
    let printed: toml::Table = toml::from_str(&out).expect("the default config parses");
    let mut flat = std::collections::BTreeMap::new();
    flatten("", &toml::Value::Table(printed), &mut flat);
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/CONFIGURATION.md"
    ))
    .unwrap();
    let documented = documented_keys(&doc);
    assert!(
        documented.len() >= 10,
        "doc table not found: {documented:?}"
    );
    for (key, default) in &documented {
        match (default.as_str(), flat.get(key)) {
            ("unset", None) => {}
            ("unset", Some(v)) => panic!("{key} is documented as unset but printed as {v}"),
            (_, None) => panic!("{key} is documented but not printed:\n{out}"),
            (d, Some(v)) => {
                // Paths and addresses are written bare in the table; lists and numbers as TOML.
                let want = toml::from_str::<toml::Table>(&format!("x = {d}"))
                    .map(|t| t["x"].clone())
                    .unwrap_or_else(|_| toml::Value::String(d.to_string()));
                assert_eq!(v, &want, "{key}: printed {v}, documented {d}");
            }
        }
    }
    for key in flat.keys() {
        assert!(
            documented.iter().any(|(k, _)| k == key),
            "{key} is printed but not documented in docs/CONFIGURATION.md"
        );
    }
}

fn flatten(
    prefix: &str,
    v: &toml::Value,
    out: &mut std::collections::BTreeMap<String, toml::Value>,
) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// `(key, default)` from the reference table's rows: `| `key` | `default` | meaning |`.
fn documented_keys(doc: &str) -> Vec<(String, String)> {
    doc.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let key = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let default = cells.get(2)?;
            let default = default
                .strip_prefix('`')
                .and_then(|d| d.strip_suffix('`'))
                .unwrap_or(default);
            Some((key.to_string(), default.to_string()))
        })
        .collect()
}

#[test]
fn e2e_required_is_read_as_a_boolean() {
    for (v, want) in [
        ("1", true),
        ("yes", true),
        ("TRUE", true),
        ("on", true),
        ("0", false),
        ("", false),
        ("off", false),
        ("false", false),
    ] {
        assert_eq!(support::parse_bool(v), Some(want), "{v:?}");
    }
    assert_eq!(support::parse_bool("maybe"), None);
}

#[test]
fn bad_configs_are_refused_with_the_cause_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("c.toml");
    std::fs::write(&cfg, "[cni]\nconf_dirs = \"/x\"\n").unwrap();
    let (code, _, err) = hako(&["serve", "--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("conf_dirs") && err.contains(cfg.to_str().unwrap()),
        "{err}"
    );
    let missing = dir.path().join("absent.toml");
    let (code, _, err) = hako(&["serve", "--config", missing.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("absent.toml"), "{err}");
}

#[test]
fn a_second_daemon_on_the_same_socket_is_refused() {
    if !support::e2e_ready(&[]) {
        return;
    }
    let h = support::hako::Hako::start("");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(HAKO)
        .args(["serve", "--listen"])
        .arg(&h.socket)
        .arg("--root")
        .arg(dir.path().join("root"))
        .arg("--state")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another process is serving on"), "{err}");
    assert!(
        h.socket.exists(),
        "the running daemon's socket is untouched"
    );
}

#[test]
fn readiness_is_notified_to_systemd() {
    if !support::e2e_ready(&[]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let listen = dir.path().join("hako.sock");
    let mut child = Command::new(HAKO)
        .args(["serve", "--listen"])
        .arg(&listen)
        .arg("--root")
        .arg(dir.path().join("root"))
        .arg("--state")
        .arg(dir.path().join("state"))
        .env("NOTIFY_SOCKET", &notify)
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    let n = sock.recv(&mut buf).expect("READY=1 within 30 s");
    assert_eq!(&buf[..n], b"READY=1");
    assert!(
        listen.exists(),
        "the socket is bound before readiness is announced"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let n = sock.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[test]
fn systemd_unit_verifies() {
    if !support::e2e_ready(&["systemd-analyze"]) {
        return;
    }
    let unit =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/systemd/hako.service"))
            .unwrap();
    for needed in [
        "Type=notify",
        "KillMode=process",
        "Delegate=yes",
        "ExecStart=/usr/local/bin/hako serve",
    ] {
        assert!(unit.contains(needed), "unit lacks {needed}");
    }
    // Verify against the binary just built (the installed path need not exist here).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hako.service");
    std::fs::write(&path, unit.replace("/usr/local/bin/hako", HAKO)).unwrap();
    let out = Command::new(support::which("systemd-analyze").unwrap())
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !err.contains("hako.service"),
        "systemd-analyze verify: {err}"
    );
}
