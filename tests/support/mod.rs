//! Test support for end-to-end tests against a real hako, a real registry and real CRI tools.
#![allow(dead_code)]

pub mod cni;
pub mod cri;
pub mod disk;
pub mod hako;
pub mod oci;
pub mod proxy;
pub mod registry;
pub mod standins;

use std::path::PathBuf;

/// Whether missing prerequisites fail the test (CI) rather than skip it: `HAKO_E2E_REQUIRED`
/// read as a boolean (1/true/yes/on or 0/false/no/off/empty); any other value is a mistake.
pub fn required() -> bool {
    match std::env::var("HAKO_E2E_REQUIRED") {
        Err(_) => false,
        Ok(v) => parse_bool(&v).unwrap_or_else(|| {
            panic!("HAKO_E2E_REQUIRED={v:?} is not a boolean (1/true/yes/on or 0/false/no/off)")
        }),
    }
}

pub fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "" | "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Where skips are recorded for the run's summary (`scripts/test.sh` prints it): libtest
/// reports a test that returned early as passed and captures what it printed.
pub fn skip_log() -> PathBuf {
    std::env::var_os("HAKO_SKIP_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/hako-skips.log"))
}

/// Records that the running test (or a part of it, `what`) was skipped and why: on stderr
/// and in the skip log. Fails the test instead when prerequisites are required.
pub fn skip(what: &str, reason: &str) {
    if required() {
        panic!("{what}: {reason} (HAKO_E2E_REQUIRED is set, so this is a failure, not a skip)");
    }
    record_skip(what, reason);
}

/// As `skip`, for a part that is skipped on this machine by its nature (a controller the
/// kernel does not have), never a failure.
pub fn record_skip(what: &str, reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("(unnamed thread)")
        .to_string();
    let line = format!("SKIPPED {test}: {what}: {reason}");
    eprintln!("{line}");
    let path = skip_log();
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    use std::io::Write;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        let _ = writeln!(f, "{line}");
    }
}

/// Polls `cond` every 20 ms until it holds; fails the test naming `what` when `timeout` passes
/// first. Waiting for the event, never for a fixed time.
pub async fn wait_for(what: &str, timeout: std::time::Duration, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + timeout;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Whether process `pid` has died: a zombie waiting to be reaped, or gone. kill(2) only queues
/// a signal, so a test that killed a process waits for this before it acts on the death.
pub fn process_dead(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
    })
}

/// Returns false (after printing why) when the e2e prerequisites are missing; tests then skip.
pub fn e2e_ready(needs: &[&str]) -> bool {
    let mut missing = Vec::new();
    if !nix::unistd::Uid::effective().is_root() {
        missing.push("root".to_string());
    }
    for n in needs {
        if which(n).is_none() {
            missing.push(n.to_string());
        }
    }
    if missing.is_empty() {
        return true;
    }
    skip(
        "the whole test",
        &format!("e2e prerequisites missing: {}", missing.join(", ")),
    );
    false
}

/// Finds a tool: the repo's `.tools/` (built by .ci/build-cri-tools.sh), `$HAKO_TOOLS_DIR`, then PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    if name.starts_with('/') {
        let p = PathBuf::from(name);
        return p.exists().then_some(p);
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("HAKO_TOOLS_DIR") {
        dirs.push(d.into());
    }
    dirs.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools"));
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// tests/streaming-client: client-go's remotecommand and portforward, the code kubectl and the
/// API server talk to kubelet with. Built once per test binary; `None` (skipped) without Go.
#[allow(dead_code)]
pub fn streaming_client() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    static BUILT: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/streaming-client");
            let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/streaming-client");
            let newer = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
            if newer(&out).is_some() && newer(&out) >= newer(&src.join("main.go")) {
                return Some(out);
            }
            let st = std::process::Command::new(which("go")?)
                .args(["build", "-mod=mod", "-o"])
                .arg(&out)
                .arg(".")
                .current_dir(&src)
                .status()
                .expect("run go build");
            assert!(st.success(), "building tests/streaming-client failed");
            Some(out)
        })
        .clone()
}

/// Mounts a test makes on the host, detached (the last made first) when it ends, passed or
/// failed, so no mount outlives its test.
#[derive(Default)]
pub struct HostMounts(Vec<PathBuf>);

impl HostMounts {
    /// `dir` bound on itself and made a shared mount, as volumes are on a systemd host (and
    /// as kubelet requires of a Bidirectional volume's source): mounts below it propagate.
    pub fn shared(&mut self, dir: &std::path::Path) {
        use nix::mount::{mount, MsFlags};
        mount(Some(dir), dir, None::<&str>, MsFlags::MS_BIND, None::<&str>).unwrap();
        self.adopt(dir);
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .unwrap();
    }

    /// A tmpfs on `dir`, with mount data `data` (`size=64k`).
    pub fn tmpfs(&mut self, dir: &std::path::Path, data: Option<&str>) {
        use nix::mount::{mount, MsFlags};
        mount(Some("tmpfs"), dir, Some("tmpfs"), MsFlags::empty(), data).unwrap();
        self.adopt(dir);
    }

    /// A mount made otherwise (one a container's propagated to the host).
    pub fn adopt(&mut self, dir: &std::path::Path) {
        self.0.push(dir.to_path_buf());
    }
}

impl Drop for HostMounts {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}
