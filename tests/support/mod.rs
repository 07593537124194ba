//! Test support for end-to-end tests against a real hako, a real registry and real CRI tools.
#![allow(dead_code)]

pub mod cni;
pub mod cri;
pub mod hako;
pub mod oci;
pub mod proxy;
pub mod registry;
pub mod standins;

use std::path::PathBuf;

/// Whether missing prerequisites fail the test (CI) rather than skip it.
pub fn required() -> bool {
    std::env::var_os("HAKO_E2E_REQUIRED").is_some()
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
    let msg = format!("e2e prerequisites missing: {}", missing.join(", "));
    if required() {
        panic!("{msg} (HAKO_E2E_REQUIRED is set)");
    }
    eprintln!("skipping: {msg}");
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
