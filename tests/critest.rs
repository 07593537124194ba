//! The CRI conformance suite (critest, from sigs.k8s.io/cri-tools) against a real hako.
//!
//! Stand-ins for critest's images are built from Debian's busybox and served by a local
//! registry under their public repository paths; hako reaches them through hosts.toml mirrors.
//! The whole suite runs; this test fails if any spec on `tests/critest/must-pass.txt` does not
//! pass. Specs that pass but are not on the list are printed, so the list can grow.
//!
//! `HAKO_CRITEST_FOCUS` narrows the run to a ginkgo focus regex (for local iteration).

mod support;

use std::collections::BTreeMap;
use std::process::Command;

use support::cni;
use support::hako::Hako;
use support::oci::Pusher;
use support::registry::Registry;
use support::standins;

fn unescape(s: &str) -> String {
    s.replace("&#39;", "'")
        .replace("&quot;", "\"")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

fn attr(tag: &str, name: &str) -> Option<String> {
    let key = format!("{name}=\"");
    let start = tag.find(&key)? + key.len();
    let end = tag[start..].find('"')? + start;
    Some(unescape(&tag[start..end]))
}

/// Spec name → status (passed, failed, skipped, pending…) from a ginkgo JUnit report.
fn parse_junit(xml: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for chunk in xml.split("<testcase ").skip(1) {
        let tag = &chunk[..chunk.find('>').unwrap_or(chunk.len())];
        let (Some(name), Some(status)) = (attr(tag, "name"), attr(tag, "status")) else {
            continue;
        };
        // Suite-level nodes ([BeforeSuite] etc.) are not specs.
        if let Some(spec) = name.strip_prefix("[It] ") {
            out.insert(spec.to_string(), status);
        }
    }
    out
}

fn must_pass() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/critest/must-pass.txt");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn critest_must_pass_specs_pass() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "critest"]) || !cni::ready() {
        return;
    }
    let reg = Registry::start();
    let pushed = standins::push_all(&Pusher::new(&reg.addr)).await;
    eprintln!("pushed {} stand-in images to {}", pushed.len(), reg.addr);
    // A real pod network (bridge, host-local, portmap) for the Networking specs.
    let net = cni::TestNet::new();
    let h = Hako::start(&net.hako_config(60));
    for r in standins::MIRRORED {
        h.hosts_toml(r, &standins::hosts_toml(r, &reg.addr));
    }
    let report = h.dir.path().join("junit.xml");
    let mut cmd = Command::new(support::which("critest").unwrap());
    cmd.arg(format!("-runtime-endpoint={}", h.endpoint()))
        .arg(format!("-image-endpoint={}", h.endpoint()))
        .arg(format!("-ginkgo.junit-report={}", report.display()))
        .args([
            "-ginkgo.no-color",
            "-ginkgo.timeout=45m",
            "-runtime-service-timeout=60s",
            "-image-service-timeout=120s",
        ]);
    if let Ok(focus) = std::env::var("HAKO_CRITEST_FOCUS") {
        cmd.arg(format!("-ginkgo.focus={focus}"));
    }
    let out = cmd.output().expect("run critest");
    // Kept in target/ for reading after the run (the daemon's temp dir goes with it).
    let log = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/critest.log");
    std::fs::write(&log, [&out.stdout[..], &out.stderr[..]].concat()).unwrap();
    let _ = std::fs::copy(
        &h.log,
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/critest-hako.log"),
    );
    let xml = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        panic!(
            "critest wrote no report ({e}); its output:\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let results = parse_junit(&xml);
    assert!(!results.is_empty(), "no specs in the report");

    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for s in results.values() {
        *counts.entry(s.as_str()).or_default() += 1;
    }
    let required = must_pass();
    let focused = std::env::var("HAKO_CRITEST_FOCUS").is_ok();
    let mut broken = Vec::new();
    for spec in &required {
        match results.get(spec).map(String::as_str) {
            Some("passed") => {}
            Some(other) => broken.push(format!("{other}: {spec}")),
            None if focused => {}
            None => broken.push(format!("not run (renamed?): {spec}")),
        }
    }
    let extra: Vec<_> = results
        .iter()
        .filter(|(k, v)| v.as_str() == "passed" && !required.contains(k))
        .map(|(k, _)| k.clone())
        .collect();
    let failing: Vec<_> = results
        .iter()
        .filter(|(_, v)| v.as_str() == "failed")
        .map(|(k, _)| k.clone())
        .collect();
    let summary = format!(
        "critest: {} specs: {counts:?}\nmust-pass: {} listed, {} not passing\npassing but not listed ({}):\n  {}\nfailing ({}):\n  {}\n",
        results.len(),
        required.len(),
        broken.len(),
        extra.len(),
        extra.join("\n  "),
        failing.len(),
        failing.join("\n  ")
    );
    eprintln!("{summary}");
    let _ = std::fs::write(
        concat!(env!("CARGO_MANIFEST_DIR"), "/target/critest-summary.txt"),
        &summary,
    );
    if !broken.is_empty() {
        let tail: String = String::from_utf8_lossy(&out.stdout)
            .lines()
            .rev()
            .take(80)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        panic!(
            "must-pass specs failed:\n  {}\n--- critest output (last lines) ---\n{tail}",
            broken.join("\n  ")
        );
    }
}

#[test]
fn junit_parsing_reads_spec_names_and_status() {
    let xml = r#"<testsuite><testcase name="[BeforeSuite]" status="passed"></testcase>
<testcase name="[It] [sig-node] Image Manager public image with tag should be pulled and removed [Conformance]" classname="CRI" status="passed" time="1"></testcase>
<testcase name="[It] [sig-node] Runtime info runtime should return &#39;x&#39;" status="failed"><failure/></testcase></testsuite>"#;
    let r = parse_junit(xml);
    assert_eq!(r.len(), 2);
    assert_eq!(r["[sig-node] Image Manager public image with tag should be pulled and removed [Conformance]"], "passed");
    assert_eq!(
        r["[sig-node] Runtime info runtime should return 'x'"],
        "failed"
    );
}
