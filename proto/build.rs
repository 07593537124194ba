//! Generates hako's own monitor protocol and the CRI v1 types and services.
//!
//! The CRI's `api.proto` is Kubernetes' own file: it is not kept in this repository but taken
//! at build time from the `k8s.io/cri-api` Go module at a pinned version, and refused unless its
//! SHA-256 is the pinned one. Where it comes from, first found wins:
//! - `HAKO_CRI_API_PROTO`: a path to the file (an offline build, a vendored copy);
//! - the Go module cache (`go env GOMODCACHE`), where `go mod download` puts it;
//! - `go mod download k8s.io/cri-api@<version>`, which checks the module against Go's checksum
//!   database as it fetches it.
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Kubernetes 1.37's CRI.
const CRI_API_VERSION: &str = "v0.37.2";
const CRI_API_PROTO_SHA256: &str =
    "381aab5cf67425b3c90ab016489de661ccb83ed9f21204066dc5df83b9b83360";
const PROTO_IN_MODULE: &str = "pkg/apis/runtime/v1/api.proto";

fn main() {
    prost_build::compile_protos(&["monitor.proto"], &["."])
        .expect("compile monitor.proto (protoc is needed: apt-get install protobuf-compiler)");

    // Printing any rerun-if line ends cargo's default of rerunning on every change in the
    // package, and prost-build prints none for monitor.proto: name what this script reads.
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=monitor.proto");
    println!("cargo:rerun-if-env-changed=HAKO_CRI_API_PROTO");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let source = cri_api_proto(&out);
    let text = std::fs::read(&source)
        .unwrap_or_else(|e| panic!("read the CRI api.proto at {}: {e}", source.display()));
    let sum = format!("{:x}", Sha256::digest(&text));
    if sum != CRI_API_PROTO_SHA256 {
        panic!(
            "{} is not k8s.io/cri-api {CRI_API_VERSION}'s {PROTO_IN_MODULE}: its SHA-256 is {sum}, \
             the pinned one {CRI_API_PROTO_SHA256}",
            source.display()
        );
    }
    // protoc names the file by its path under the include dir; a copy of our own keeps that
    // path short and fixed wherever the source lay.
    let dir = out.join("cri-api");
    std::fs::create_dir_all(&dir).expect("create OUT_DIR/cri-api");
    std::fs::write(dir.join("api.proto"), without_debug_redact(&text))
        .expect("copy api.proto into OUT_DIR");
    tonic_prost_build::configure()
        .emit_rerun_if_changed(false)
        // The credentials debug_redact marks get a Debug of our own (lib.rs) that hides them.
        .skip_debug(["runtime.v1.AuthConfig"])
        .compile_protos(&[dir.join("api.proto")], &[dir])
        .expect("compile the CRI api.proto (protoc is needed: apt-get install protobuf-compiler)");
}

fn cri_api_proto(out: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("HAKO_CRI_API_PROTO") {
        return PathBuf::from(p);
    }
    let in_cache = |root: &Path| {
        root.join(format!("k8s.io/cri-api@{CRI_API_VERSION}"))
            .join(PROTO_IN_MODULE)
    };
    if let Some(cache) = go(&["env", "GOMODCACHE"], out) {
        let p = in_cache(Path::new(cache.trim()));
        if p.is_file() {
            return p;
        }
    }
    let module = format!("k8s.io/cri-api@{CRI_API_VERSION}");
    let json = go(&["mod", "download", "-json", &module], out).unwrap_or_else(|| {
        panic!(
            "the CRI api.proto of {module} was not found: install Go (go mod download fetches \
             it) or set HAKO_CRI_API_PROTO to the file's path"
        )
    });
    // `go mod download -json` prints the module's extracted directory as "Dir": "<path>".
    let dir = json
        .lines()
        .find_map(|l| l.trim().strip_prefix("\"Dir\": \""))
        .and_then(|rest| rest.strip_suffix("\","))
        .unwrap_or_else(|| panic!("go mod download -json {module} printed no Dir:\n{json}"));
    Path::new(dir).join(PROTO_IN_MODULE)
}

/// Runs `go` with `args` outside any Go module; its stdout, or None when go is missing or fails.
fn go(args: &[&str], cwd: &Path) -> Option<String> {
    println!("cargo:rerun-if-env-changed=GO");
    // Go's own install path is often not on the PATH cargo runs build scripts with.
    let candidates = match std::env::var_os("GO") {
        Some(go) => vec![go],
        None => vec!["go".into(), "/usr/local/go/bin/go".into()],
    };
    let out = candidates.iter().find_map(|go| {
        Command::new(go)
            .args(args)
            .current_dir(cwd)
            .env("GO111MODULE", "on")
            .env("GOWORK", "off")
            .output()
            .ok()
    })?;
    if !out.status.success() {
        println!(
            "cargo:warning=go {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    String::from_utf8(out.stdout).ok()
}

/// The file without its `[debug_redact = true]` field options: Debian bookworm's protoc (3.21)
/// predates that option and refuses the file. It changes nothing on the wire; what it asks for,
/// credentials kept out of debug output, `skip_debug` and lib.rs do instead.
fn without_debug_redact(text: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(text).expect("api.proto is UTF-8");
    let out = text.replace(" [debug_redact = true];", ";");
    assert!(
        !out.contains("debug_redact"),
        "api.proto uses debug_redact in a form build.rs does not know"
    );
    out.into_bytes()
}
