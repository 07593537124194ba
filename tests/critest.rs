//! The CRI conformance suite (critest, from sigs.k8s.io/cri-tools) against a real hako, with
//! every spec it runs accounted for.
//!
//! Stand-ins for critest's images are built from Debian's busybox and served by a local
//! registry under their public repository paths; hako reaches them through hosts.toml mirrors.
//! The whole suite runs, and every spec in critest's JUnit report must be either passed and on
//! `tests/critest/must-pass.txt`, or named in the table of docs/CRITEST.md as a known failure
//! or a known skip with its reason (the doc is the only place those are listed; this test
//! parses it). The run fails when:
//! - a spec fails, or is skipped, and the table does not name it as such;
//! - a must-pass spec does not pass, or does not run;
//! - a spec passes that is not on must-pass.txt, including one the table calls a known failure
//!   or skip (move it onto the list: otherwise nothing stops it from regressing);
//! - a name appears twice in must-pass.txt, in the table, or across both; a table row names a
//!   spec critest no longer reports;
//! - critest ends any other way than "only documented specs failed": a non-zero exit with no
//!   failed spec, a crash or signal, no end within its deadline, a missing or truncated
//!   report, a suite-level node ([BeforeSuite], [AfterSuite]…) that did not pass, a suite
//!   failure ginkgo reports (its own timeout), or a spec that panicked, timed out or was
//!   interrupted;
//! - a spec that was ever on must-pass.txt (in the file's git history) is no longer on it and
//!   is not retired in the table with a reason. Without git history that one check is skipped
//!   through `support::skip`, which fails under HAKO_E2E_REQUIRED.
//!
//! `HAKO_CRITEST_FOCUS` narrows the run to a ginkgo focus regex for local iteration; specs it
//! leaves out are not counted. It is refused (the test panics) under CI or HAKO_E2E_REQUIRED,
//! so CI always runs and accounts for the whole suite.
//!
//! The parsing and the accounting are plain functions with unit tests below (fake reports).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use support::cni;
use support::hako::Hako;
use support::oci::Pusher;
use support::registry::Registry;
use support::standins;

const MUST_PASS: &str = "tests/critest/must-pass.txt";
const DOC: &str = "docs/CRITEST.md";
const TABLE_BEGIN: &str = "<!-- critest-accounting:begin -->";
const TABLE_END: &str = "<!-- critest-accounting:end -->";
/// ginkgo interrupts the suite itself at `-ginkgo.timeout=45m`; this bounds a critest that
/// hangs past that.
const CRITEST_DEADLINE: Duration = Duration::from_secs(50 * 60);

fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

// ---------------------------------------------------------------------------------------------
// critest's JUnit report (ginkgo v2's reporters/junit_report.go, written by Go's encoding/xml)

/// One `<testcase>`: a spec or a suite-level node.
#[derive(Debug, Clone, PartialEq)]
struct Case {
    name: String,
    /// ginkgo's spec state: passed, failed, skipped, pending, panicked, interrupted, aborted,
    /// timedout.
    status: String,
    /// The `<skipped message>`: "skipped" for a spec the run's filters left out, "skipped -
    /// <reason>" for one that called Skip(reason), "pending" for a pending one.
    skip_message: Option<String>,
}

#[derive(Debug, Default)]
struct Report {
    /// `[It]` specs, names without that prefix, in report order.
    specs: Vec<Case>,
    /// Everything else: [BeforeSuite], [AfterSuite], [ReportAfterSuite], [DeferCleanup (Suite)].
    suite_nodes: Vec<Case>,
    /// ginkgo's SpecialSuiteFailureReason property ("Suite Timeout Elapsed", "Interrupted by
    /// User", "Suite skipped in BeforeSuite"…); empty when there is none.
    suite_failure: String,
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let Some(semi) = rest.find(';') else { break };
        let entity = &rest[1..semi];
        let ch = match entity {
            "amp" => Some('&'),
            "lt" => Some('<'),
            "gt" => Some('>'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .map(|h| u32::from_str_radix(h, 16))
                .or_else(|| entity.strip_prefix('#').map(str::parse))
                .and_then(Result::ok)
                .and_then(char::from_u32),
        };
        match ch {
            Some(c) => {
                out.push(c);
                rest = &rest[semi + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The `key="value"` attributes of a start tag (the text between `<element` and `>`).
fn attrs(tag: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = tag;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq]
            .split_whitespace()
            .last()
            .unwrap_or("")
            .to_string();
        let after = &rest[eq + 2..];
        let Some(end) = after.find('"') else { break };
        out.insert(key, unescape(&after[..end]));
        rest = &after[end + 1..];
    }
    out
}

/// Byte offsets and start tags (without `<element` and `>`) of every `<element …>` in `xml`.
fn start_tags<'a>(xml: &'a str, element: &str) -> Vec<(usize, &'a str)> {
    let open = format!("<{element}");
    xml.match_indices(&open)
        .filter_map(|(at, _)| {
            let rest = &xml[at + open.len()..];
            // `<testsuite` must not match `<testsuites`.
            if !rest.starts_with(|c: char| c.is_whitespace() || c == '>' || c == '/') {
                return None;
            }
            Some((at, &rest[..rest.find('>')?]))
        })
        .collect()
}

/// Reads a ginkgo JUnit report. A report that is cut short, or whose testcases do not add up
/// to the count ginkgo declared, is an error, never a shorter list.
fn parse_junit(xml: &str) -> Result<Report, String> {
    if !xml.trim_end().ends_with("</testsuites>") {
        return Err("the report is truncated: it does not end with </testsuites>".into());
    }
    let suites = start_tags(xml, "testsuite");
    let [(_, suite)] = suites[..] else {
        return Err(format!("expected one <testsuite>, found {}", suites.len()));
    };
    let declared: usize = attrs(suite)
        .get("tests")
        .and_then(|n| n.parse().ok())
        .ok_or("<testsuite> has no tests=\"N\" count")?;
    let mut report = Report::default();
    for (_, tag) in start_tags(xml, "property") {
        let a = attrs(tag);
        if a.get("name").map(String::as_str) == Some("SpecialSuiteFailureReason") {
            report.suite_failure = a.get("value").cloned().unwrap_or_default();
        }
    }
    let cases = start_tags(xml, "testcase");
    for (at, tag) in &cases {
        let a = attrs(tag);
        let (Some(name), Some(status)) = (a.get("name"), a.get("status")) else {
            return Err(format!(
                "a <testcase> without name or status: <testcase{tag}>"
            ));
        };
        let Some(len) = xml[*at..].find("</testcase>") else {
            return Err(format!("the report is truncated inside testcase {name:?}"));
        };
        let body = &xml[*at..*at + len];
        let skip_message = start_tags(body, "skipped")
            .first()
            .map(|(_, t)| attrs(t).get("message").cloned().unwrap_or_default());
        let mut case = Case {
            name: name.clone(),
            status: status.clone(),
            skip_message,
        };
        match name.strip_prefix("[It] ") {
            Some(spec) => {
                case.name = spec.to_string();
                report.specs.push(case);
            }
            None => report.suite_nodes.push(case),
        }
    }
    if cases.len() != declared {
        return Err(format!(
            "the report holds {} testcases but declares tests=\"{declared}\"",
            cases.len()
        ));
    }
    Ok(report)
}

// ---------------------------------------------------------------------------------------------
// The lists: must-pass.txt and the table in docs/CRITEST.md

fn parse_must_pass(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Runs and fails, for the reason given.
    Failed,
    /// Runs and is skipped (by critest itself or by the filters it sets).
    Skipped,
    /// Was on must-pass.txt and critest no longer reports it under that name.
    Retired,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Failed => "failed",
            Kind::Skipped => "skipped",
            Kind::Retired => "retired",
        }
    }

    fn known(self) -> &'static str {
        match self {
            Kind::Failed => "a known failure",
            Kind::Skipped => "a known skip",
            Kind::Retired => "retired",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Row {
    kind: Kind,
    name: String,
    reason: String,
}

/// Splits a Markdown table row on its unescaped `|`s; `\|` is a literal `|` (spec names
/// have them).
fn split_row(line: &str) -> Vec<String> {
    let inner = line.trim().strip_prefix('|').unwrap_or(line.trim());
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cell.push('|');
                chars.next();
            }
            '|' => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    if !cell.trim().is_empty() {
        cells.push(cell);
    }
    cells.into_iter().map(|c| c.trim().to_string()).collect()
}

/// The accounting table of docs/CRITEST.md: rows `| failed/skipped/retired | `spec` | reason |`
/// between the begin and end markers. Anything else there is an error, so a typo cannot turn
/// a row into prose.
fn parse_doc_table(md: &str) -> Result<Vec<Row>, String> {
    let start = md
        .find(TABLE_BEGIN)
        .ok_or(format!("no {TABLE_BEGIN} marker"))?;
    let len = md[start..]
        .find(TABLE_END)
        .ok_or(format!("no {TABLE_END} marker after {TABLE_BEGIN}"))?;
    let first_line = md[..start].lines().count() + 1;
    let mut rows = Vec::new();
    for (i, line) in md[start..start + len].lines().enumerate().skip(1) {
        let at = format!("{DOC}:{}", first_line + i);
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if !line.starts_with('|') {
            return Err(format!("{at}: not a table row: {line}"));
        }
        let cells = split_row(line);
        let is_rule = cells
            .iter()
            .all(|c| !c.is_empty() && c.chars().all(|ch| ch == '-' || ch == ':'));
        if is_rule || cells.first().map(String::as_str) == Some("status") {
            continue;
        }
        let [kind, name, reason] = &cells[..] else {
            return Err(format!(
                "{at}: expected 3 cells (status, spec, why), found {}",
                cells.len()
            ));
        };
        let kind = match kind.as_str() {
            "failed" => Kind::Failed,
            "skipped" => Kind::Skipped,
            "retired" => Kind::Retired,
            other => {
                return Err(format!(
                    "{at}: status {other:?} is none of failed, skipped, retired"
                ))
            }
        };
        let name = name
            .strip_prefix('`')
            .and_then(|n| n.strip_suffix('`'))
            .unwrap_or(name);
        if name.is_empty() || reason.is_empty() {
            return Err(format!("{at}: a row needs a spec name and a reason"));
        }
        rows.push(Row {
            kind,
            name: name.to_string(),
            reason: reason.clone(),
        });
    }
    Ok(rows)
}

/// Names given twice: in must-pass.txt, in the table, or across both.
fn duplicate_problems(must_pass: &[String], rows: &[Row]) -> Vec<String> {
    let mut seen: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for name in must_pass {
        seen.entry(name).or_default().push(MUST_PASS.to_string());
    }
    for row in rows {
        let place = format!("{DOC} ({})", row.kind.word());
        seen.entry(&row.name).or_default().push(place);
    }
    seen.into_iter()
        .filter(|(_, places)| places.len() > 1)
        .map(|(name, places)| {
            format!(
                "duplicate: listed {}x ({}): {name}",
                places.len(),
                places.join(", ")
            )
        })
        .collect()
}

/// Every name that was ever on must-pass.txt must still be there or be retired in the table.
/// `versions` are (commit, file text), newest first.
fn history_problems(
    versions: &[(String, String)],
    must_pass: &[String],
    rows: &[Row],
) -> Vec<String> {
    let kept: BTreeSet<&str> = must_pass
        .iter()
        .map(String::as_str)
        .chain(
            rows.iter()
                .filter(|r| r.kind == Kind::Retired)
                .map(|r| r.name.as_str()),
        )
        .collect();
    let mut last_seen: BTreeMap<String, &str> = BTreeMap::new();
    for (commit, text) in versions {
        for name in parse_must_pass(text) {
            last_seen.entry(name).or_insert(commit);
        }
    }
    last_seen
        .into_iter()
        .filter(|(name, _)| !kept.contains(name.as_str()))
        .map(|(name, commit)| {
            format!(
                "dropped from must-pass: on {MUST_PASS} as of commit {commit} and no longer; put it back, or retire it in {DOC} with a reason: {name}"
            )
        })
        .collect()
}

/// Every committed version of must-pass.txt, newest first; Err says why there is no history
/// to read.
fn must_pass_history() -> Result<Vec<(String, String)>, String> {
    let git = |args: &[&str]| -> Result<String, String> {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .map_err(|e| format!("cannot run git: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "git {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    if git(&["rev-parse", "--is-shallow-repository"])?.trim() == "true" {
        return Err("the checkout is a shallow clone, so the file's history is incomplete".into());
    }
    // Hash, blank line, the file's path at that commit (--follow tracks renames).
    let log = git(&[
        "log",
        "--follow",
        "--format=%H",
        "--name-only",
        "--",
        MUST_PASS,
    ])?;
    let mut versions = Vec::new();
    let mut commit = None;
    for line in log.lines().filter(|l| !l.is_empty()) {
        if line.len() == 40 && line.chars().all(|c| c.is_ascii_hexdigit()) {
            commit = Some(line.to_string());
        } else if let Some(c) = commit.take() {
            // A commit that deleted the file has no version of it; older ones hold its text.
            if let Ok(text) = git(&["show", &format!("{c}:{line}")]) {
                versions.push((c[..12].to_string(), text));
            }
        }
    }
    Ok(versions)
}

fn history_check(must_pass: &[String], rows: &[Row]) -> Vec<String> {
    match must_pass_history() {
        Ok(versions) => history_problems(&versions, must_pass, rows),
        Err(why) => {
            support::skip(
                "the check that no spec was dropped from must-pass.txt",
                &format!("no git history: {why}"),
            );
            Vec::new()
        }
    }
}

fn load_lists() -> (Vec<String>, Vec<Row>) {
    let must_pass = parse_must_pass(&std::fs::read_to_string(repo_path(MUST_PASS)).unwrap());
    let doc = std::fs::read_to_string(repo_path(DOC)).unwrap();
    let rows = parse_doc_table(&doc).unwrap_or_else(|e| panic!("{DOC}: {e}"));
    (must_pass, rows)
}

// ---------------------------------------------------------------------------------------------
// The accounting

/// How critest ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exit {
    Code(i32),
    Signal(i32),
    /// Still running at CRITEST_DEADLINE, and killed.
    TimedOut,
}

/// The focus to pass to ginkgo: none unless HAKO_CRITEST_FOCUS is set, and never in CI (`CI`
/// set to anything but a false boolean) or when e2e prerequisites are required.
fn focus_setting(
    focus: Option<String>,
    ci: Option<String>,
    required: bool,
) -> Result<Option<String>, String> {
    let Some(focus) = focus else { return Ok(None) };
    let ci = ci.is_some_and(|v| support::parse_bool(&v) != Some(false));
    if ci || required {
        return Err(format!(
            "HAKO_CRITEST_FOCUS={focus:?} is set {}: CI runs and accounts for the whole suite; unset it",
            if ci { "under CI" } else { "with HAKO_E2E_REQUIRED" }
        ));
    }
    Ok(Some(focus))
}

/// Everything wrong with a run: each problem is one line, and none means every spec is
/// accounted for. `focused`: HAKO_CRITEST_FOCUS narrowed the run, so specs it left out
/// (skipped with no reason) and listed specs that did not run are not counted.
fn account(
    report: &Report,
    exit: Exit,
    must_pass: &[String],
    rows: &[Row],
    focused: bool,
) -> Vec<String> {
    let mut p = duplicate_problems(must_pass, rows);
    let must: BTreeSet<&str> = must_pass.iter().map(String::as_str).collect();
    let doc: BTreeMap<&str, Kind> = rows.iter().map(|r| (r.name.as_str(), r.kind)).collect();
    let failed = report.specs.iter().filter(|c| c.status == "failed").count();

    match exit {
        Exit::TimedOut => p.push(format!(
            "critest ran past its deadline ({CRITEST_DEADLINE:?}) and was killed"
        )),
        Exit::Signal(s) => p.push(format!("critest was killed by signal {s}")),
        Exit::Code(0) if failed > 0 => p.push(format!(
            "critest exited 0 but its report has {failed} failed specs"
        )),
        Exit::Code(0) => {}
        // ginkgo fails the Go test, which exits 1; that is expected only with failed specs.
        Exit::Code(1) if failed > 0 => {}
        Exit::Code(1) => p.push(
            "critest exited 1 with no failed spec in its report (a suite-level failure or a setup error)"
                .into(),
        ),
        Exit::Code(n) => p.push(format!(
            "critest exited {n}, which is not how a run whose only problems are failed specs ends (a Go panic exits 2)"
        )),
    }
    if !report.suite_failure.is_empty() {
        p.push(format!(
            "ginkgo reports a suite failure: {}",
            report.suite_failure
        ));
    }
    for node in &report.suite_nodes {
        if node.status != "passed" {
            p.push(format!("suite node {} {}", node.name, node.status));
        }
    }
    if report.specs.is_empty() {
        p.push("the report has no specs".into());
    }

    let mut counted: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &report.specs {
        *counted.entry(&c.name).or_default() += 1;
    }
    for (name, n) in &counted {
        if *n > 1 {
            p.push(format!(
                "critest reports {n} specs named the same, so they cannot be told apart: {name}"
            ));
        }
    }

    for c in &report.specs {
        let name = c.name.as_str();
        let listed = must.contains(name);
        let row = doc.get(name).copied();
        if focused && c.status == "skipped" && c.skip_message.as_deref() == Some("skipped") {
            continue; // left out by HAKO_CRITEST_FOCUS (or critest's own filters)
        }
        if row == Some(Kind::Retired) {
            p.push(format!(
                "retired in {DOC} but critest still reports it ({}); retire only names critest no longer has: {name}",
                c.status
            ));
            continue;
        }
        match c.status.as_str() {
            "passed" => match row {
                Some(kind) => p.push(format!(
                    "now passes but {DOC} lists it as {}: move it from the table onto {MUST_PASS}: {name}",
                    kind.known()
                )),
                None if !listed => p.push(format!(
                    "passes but is not on {MUST_PASS}: add it there: {name}"
                )),
                None => {}
            },
            "failed" if listed => p.push(format!("must-pass spec failed: {name}")),
            "failed" if row != Some(Kind::Failed) => p.push(format!(
                "failed and {DOC} does not list it as a known failure: {name}"
            )),
            "failed" => {}
            "skipped" | "pending" if listed => {
                p.push(format!("must-pass spec did not run ({}): {name}", c.status))
            }
            "skipped" | "pending" if row != Some(Kind::Skipped) => p.push(format!(
                "{} and {DOC} does not list it as a known skip ({}): {name}",
                c.status,
                c.skip_message.as_deref().unwrap_or("")
            )),
            "skipped" | "pending" => {}
            other => p.push(format!(
                "ended {other} (neither passed, failed nor skipped; the run broke): {name}"
            )),
        }
    }

    if !focused {
        for name in must_pass {
            if !counted.contains_key(name.as_str()) {
                p.push(format!(
                    "must-pass spec is not in the report (renamed by critest? retire it with a reason): {name}"
                ));
            }
        }
        for row in rows {
            if row.kind != Kind::Retired && !counted.contains_key(row.name.as_str()) {
                p.push(format!(
                    "{DOC} lists {} that critest did not report (renamed?): {}",
                    row.kind.known(),
                    row.name
                ));
            }
        }
    }
    p
}

fn summary(
    report: &Report,
    exit: Exit,
    must_pass: &[String],
    rows: &[Row],
    problems: &[String],
) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &report.specs {
        *counts.entry(c.status.as_str()).or_default() += 1;
    }
    let known = |k: Kind| rows.iter().filter(|r| r.kind == k).count();
    let section = |title: &str, items: Vec<String>| -> String {
        let mut out = format!("{title} ({}):\n", items.len());
        for i in items {
            out.push_str(&format!("  {i}\n"));
        }
        out
    };
    let by_status = |s: &str| -> Vec<String> {
        report
            .specs
            .iter()
            .filter(|c| c.status == s)
            .map(|c| match &c.skip_message {
                Some(m) => format!("{} ({m})", c.name),
                None => c.name.clone(),
            })
            .collect()
    };
    format!(
        "critest {exit:?}: {} specs: {counts:?}\n\
         lists: {} must-pass, {} known failures, {} known skips, {} retired\n{}{}{}",
        report.specs.len(),
        must_pass.len(),
        known(Kind::Failed),
        known(Kind::Skipped),
        known(Kind::Retired),
        section("failed", by_status("failed")),
        section("skipped", by_status("skipped")),
        section("problems", problems.to_vec()),
    )
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// The run

/// Starts a registry with the stand-ins, a pod network and a hako, runs critest against it
/// (with `focus` and `extra` arguments) and reads its report. Logs go to target/`name`*.
async fn run_critest(
    focus: Option<&str>,
    extra: &[&str],
    name: &str,
) -> (Exit, Report, String, PathBuf) {
    let reg = Registry::start();
    let pushed = standins::push_all(&Pusher::new(&reg.addr)).await;
    eprintln!("pushed {} stand-in images to {}", pushed.len(), reg.addr);
    // A real pod network (bridge, host-local, portmap) for the Networking specs.
    let net = cni::TestNet::new();
    let h = Hako::start(&net.hako_config(60));
    for r in standins::MIRRORED {
        h.hosts_toml(r, &standins::hosts_toml(r, &reg.addr));
    }
    let report_path = h.dir.path().join("junit.xml");
    // Kept in target/ for reading after the run (the daemon's temp dir goes with it).
    let target = repo_path("target");
    std::fs::create_dir_all(&target).unwrap();
    let log_path = target.join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut cmd = tokio::process::Command::new(support::which("critest").unwrap());
    cmd.arg(format!("-runtime-endpoint={}", h.endpoint()))
        .arg(format!("-image-endpoint={}", h.endpoint()))
        .arg(format!("-ginkgo.junit-report={}", report_path.display()))
        .args([
            "-ginkgo.no-color",
            "-ginkgo.timeout=45m",
            "-runtime-service-timeout=60s",
            "-image-service-timeout=120s",
        ])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true);
    if let Some(f) = focus {
        cmd.arg(format!("-ginkgo.focus={f}"));
    }
    let mut child = cmd.spawn().expect("run critest");
    let exit = match tokio::time::timeout(CRITEST_DEADLINE, child.wait()).await {
        Ok(status) => {
            use std::os::unix::process::ExitStatusExt;
            let status = status.expect("wait for critest");
            match (status.code(), status.signal()) {
                (Some(c), _) => Exit::Code(c),
                (None, s) => Exit::Signal(s.unwrap_or(0)),
            }
        }
        Err(_) => {
            let _ = child.kill().await;
            Exit::TimedOut
        }
    };
    let _ = std::fs::copy(&h.log, target.join(format!("{name}-hako.log")));
    let _ = std::fs::copy(&report_path, target.join(format!("{name}-junit.xml")));
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    let xml = std::fs::read_to_string(&report_path).unwrap_or_else(|e| {
        panic!(
            "critest ({exit:?}) wrote no report ({e}); the last lines of {}:\n{}",
            log_path.display(),
            tail(&output, 80)
        )
    });
    let report = parse_junit(&xml).unwrap_or_else(|e| {
        panic!(
            "critest's report ({exit:?}): {e}; the last lines of {}:\n{}",
            log_path.display(),
            tail(&output, 80)
        )
    });
    (exit, report, output, log_path)
}

/// The streaming specs again, with critest's clients on WebSocket (exec and attach on
/// `v5.channel.k8s.io`, port-forward as SPDY tunnelled in WebSocket) instead of SPDY: kubelet
/// and crictl speak both. Every streaming spec on must-pass.txt must pass this way too. Run
/// after the full suite, in the same test, so two critest runs never share the machine.
async fn websocket_streaming_problems(must_pass: &[String]) -> Vec<String> {
    let streaming: Vec<&String> = must_pass
        .iter()
        .filter(|n| n.starts_with("[k8s.io] Streaming "))
        .collect();
    if streaming.is_empty() {
        return vec![format!("no streaming spec on {MUST_PASS}")];
    }
    let (exit, report, output, log_path) = run_critest(
        Some("Streaming"),
        &[
            "-websocket-exec",
            "-websocket-attach",
            "-websocket-portforward",
        ],
        "critest-websocket",
    )
    .await;
    let mut problems: Vec<String> = streaming
        .iter()
        .filter_map(
            |name| match report.specs.iter().find(|c| &&c.name == name) {
                Some(c) if c.status == "passed" => None,
                Some(c) => Some(format!("over WebSocket, {}: {name}", c.status)),
                None => Some(format!("over WebSocket, not in the report: {name}")),
            },
        )
        .collect();
    if exit != Exit::Code(0) {
        problems.push(format!(
            "critest over WebSocket ended {exit:?} (see {}); last lines:\n{}",
            log_path.display(),
            tail(&output, 40)
        ));
    }
    problems
}

#[tokio::test(flavor = "multi_thread")]
async fn critest_accounts_for_every_spec() {
    let focus = focus_setting(
        std::env::var("HAKO_CRITEST_FOCUS").ok(),
        std::env::var("CI").ok(),
        support::required(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    // The lists are read and checked first: a broken table fails before a long run.
    let (must_pass, rows) = load_lists();
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "critest"]) || !cni::ready() {
        return;
    }
    let (exit, report, output, _) = run_critest(focus.as_deref(), &[], "critest").await;
    let mut problems = account(&report, exit, &must_pass, &rows, focus.is_some());
    problems.extend(history_check(&must_pass, &rows));
    if focus.is_none() {
        problems.extend(websocket_streaming_problems(&must_pass).await);
    }
    let summary = summary(&report, exit, &must_pass, &rows, &problems);
    eprintln!("{summary}");
    std::fs::write(repo_path("target").join("critest-summary.txt"), &summary).unwrap();
    if !problems.is_empty() {
        panic!(
            "critest: {} specs not accounted for (see target/critest-summary.txt):\n  {}\n--- critest output (last lines) ---\n{}",
            problems.len(),
            problems.join("\n  "),
            tail(&output, 80)
        );
    }
}

/// The lists alone, with no critest: they parse, hold no duplicates, and keep every spec the
/// history of must-pass.txt ever had.
#[test]
fn critest_lists_are_consistent() {
    let (must_pass, rows) = load_lists();
    assert!(!must_pass.is_empty(), "{MUST_PASS} is empty");
    let mut problems = duplicate_problems(&must_pass, &rows);
    problems.extend(history_check(&must_pass, &rows));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Unit tests of the parsing and the accounting, on fake reports

const A: &str = "[k8s.io] Suite A should pass [Conformance]";
const B: &str = "[k8s.io] Suite B should fail on purpose";
const C: &str = "[k8s.io] Suite C should be skipped";

fn testcase(name: &str, status: &str) -> String {
    let inner = match status {
        "failed" => r#"<failure message="boom" type="failed">at x.go:1</failure>"#.to_string(),
        "skipped" => r#"<skipped message="skipped - not on this platform"></skipped>"#.to_string(),
        "panicked" => r#"<error message="nil" type="panicked"></error>"#.to_string(),
        _ => String::new(),
    };
    let name = name
        .replace('&', "&amp;")
        .replace('\'', "&#39;")
        .replace('"', "&#34;");
    format!(
        "      <testcase name=\"{name}\" classname=\"CRI\" status=\"{status}\" time=\"0.1\">{inner}\n          <system-err>&lt;testcase name=&#34;fake&#34;&gt;</system-err>\n      </testcase>\n"
    )
}

/// A report as ginkgo writes it, with a passing [BeforeSuite] unless `cases` holds one.
fn junit(cases: &[(&str, &str)], special: &str) -> String {
    let mut body = String::new();
    let mut all: Vec<(String, &str)> = Vec::new();
    if !cases
        .iter()
        .any(|(n, _)| n.starts_with('[') && !n.starts_with("[k8s"))
    {
        all.push(("[BeforeSuite]".into(), "passed"));
    }
    for (n, s) in cases {
        if n.starts_with("[k8s") {
            all.push((format!("[It] {n}"), s));
        } else {
            all.push((n.to_string(), s));
        }
    }
    for (n, s) in &all {
        body.push_str(&testcase(n, s));
    }
    format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n  <testsuites tests=\"{n}\" disabled=\"0\" errors=\"0\" failures=\"0\" time=\"1\">\n      <testsuite name=\"CRI validation\" package=\"/x\" tests=\"{n}\" disabled=\"0\" skipped=\"0\" errors=\"0\" failures=\"0\" time=\"1\" timestamp=\"2025-01-01T00:00:00\">\n          <properties>\n              <property name=\"SuiteSucceeded\" value=\"false\"></property>\n              <property name=\"SpecialSuiteFailureReason\" value=\"{special}\"></property>\n          </properties>\n{body}      </testsuite>\n  </testsuites>",
        n = all.len()
    )
}

fn row(kind: Kind, name: &str) -> Row {
    Row {
        kind,
        name: name.into(),
        reason: "why".into(),
    }
}

/// A's on must-pass, B is a known failure, C a known skip.
fn lists() -> (Vec<String>, Vec<Row>) {
    (
        vec![A.to_string()],
        vec![row(Kind::Failed, B), row(Kind::Skipped, C)],
    )
}

fn problems_for(cases: &[(&str, &str)], exit: Exit) -> Vec<String> {
    let (must, rows) = lists();
    let report = parse_junit(&junit(cases, "")).unwrap();
    account(&report, exit, &must, &rows, false)
}

#[track_caller]
fn assert_problem(problems: &[String], needle: &str) {
    assert!(
        problems.iter().any(|p| p.contains(needle)),
        "expected a problem containing {needle:?}, got {problems:#?}"
    );
}

const EXPECTED: &[(&str, &str)] = &[(A, "passed"), (B, "failed"), (C, "skipped")];

#[test]
fn junit_parsing_reads_names_states_and_skip_reasons() {
    let r = parse_junit(&junit(
        &[
            ("[k8s.io] Runtime info should return 'x' & \"y\"", "failed"),
            (C, "skipped"),
            (A, "passed"),
        ],
        "",
    ))
    .unwrap();
    assert_eq!(r.suite_nodes.len(), 1);
    assert_eq!(r.suite_nodes[0].name, "[BeforeSuite]");
    let names: Vec<_> = r
        .specs
        .iter()
        .map(|c| (c.name.as_str(), c.status.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("[k8s.io] Runtime info should return 'x' & \"y\"", "failed"),
            (C, "skipped"),
            (A, "passed")
        ]
    );
    assert_eq!(
        r.specs[1].skip_message.as_deref(),
        Some("skipped - not on this platform")
    );
    assert_eq!(r.specs[2].skip_message, None);
    assert_eq!(r.suite_failure, "");
    assert_eq!(
        unescape("a&#x9;b&#39;&lt;&amp;lt;&bogus;"),
        "a\tb'<&lt;&bogus;"
    );
}

#[test]
fn junit_parsing_rejects_a_truncated_report() {
    let xml = junit(EXPECTED, "");
    // Cut after the last testcase: every case is whole, the end is missing.
    let cut = &xml[..xml.rfind("</testcase>").unwrap() + "</testcase>".len()];
    let e = parse_junit(cut).unwrap_err();
    assert!(e.contains("does not end with </testsuites>"), "{e}");
    // Cut between testcases, then closed again by hand: the declared count gives it away.
    let first_end = xml.find("</testcase>").unwrap() + "</testcase>".len();
    let second_end =
        first_end + xml[first_end..].find("</testcase>").unwrap() + "</testcase>".len();
    let mut spliced = xml[..first_end].to_string();
    spliced.push_str(&xml[second_end..]);
    let e = parse_junit(&spliced).unwrap_err();
    assert!(e.contains("declares"), "{e}");
}

#[test]
fn a_fully_accounted_run_has_no_problems() {
    let p = problems_for(EXPECTED, Exit::Code(1));
    assert!(p.is_empty(), "{p:#?}");
    let (must, rows) = lists();
    let s = summary(
        &parse_junit(&junit(EXPECTED, "")).unwrap(),
        Exit::Code(1),
        &must,
        &rows,
        &p,
    );
    assert!(s.contains("3 specs"), "{s}");
}

#[test]
fn an_undocumented_failure_fails_the_run() {
    let p = problems_for(
        &[(A, "passed"), (B, "failed"), (C, "failed")],
        Exit::Code(1),
    );
    assert_problem(&p, &format!("does not list it as a known failure: {C}"));
}

#[test]
fn an_undocumented_skip_fails_the_run() {
    let p = problems_for(
        &[(A, "passed"), (B, "skipped"), (C, "skipped")],
        Exit::Code(0),
    );
    assert_problem(
        &p,
        &format!("does not list it as a known skip (skipped - not on this platform): {B}"),
    );
}

#[test]
fn a_must_pass_spec_that_fails_or_is_skipped_fails_the_run() {
    let p = problems_for(
        &[(A, "failed"), (B, "failed"), (C, "skipped")],
        Exit::Code(1),
    );
    assert_problem(&p, &format!("must-pass spec failed: {A}"));
    let p = problems_for(
        &[(A, "skipped"), (B, "failed"), (C, "skipped")],
        Exit::Code(1),
    );
    assert_problem(&p, &format!("must-pass spec did not run (skipped): {A}"));
}

#[test]
fn a_must_pass_spec_missing_from_the_report_fails_the_run() {
    let p = problems_for(&[(B, "failed"), (C, "skipped")], Exit::Code(1));
    assert_problem(&p, &format!("must-pass spec is not in the report (renamed by critest? retire it with a reason): {A}"));
}

#[test]
fn a_documented_spec_that_now_passes_fails_the_run() {
    let p = problems_for(
        &[(A, "passed"), (B, "passed"), (C, "skipped")],
        Exit::Code(0),
    );
    assert_problem(&p, &format!("now passes but {DOC} lists it as a known failure: move it from the table onto {MUST_PASS}: {B}"));
    let p = problems_for(
        &[(A, "passed"), (B, "failed"), (C, "passed")],
        Exit::Code(1),
    );
    assert_problem(&p, "lists it as a known skip: move it");
}

#[test]
fn a_passing_spec_on_no_list_fails_the_run() {
    let d = "[k8s.io] Suite D is new";
    let p = problems_for(
        &[(A, "passed"), (B, "failed"), (C, "skipped"), (d, "passed")],
        Exit::Code(1),
    );
    assert_problem(
        &p,
        &format!("passes but is not on {MUST_PASS}: add it there: {d}"),
    );
}

#[test]
fn a_documented_spec_critest_no_longer_reports_fails_the_run() {
    let p = problems_for(&[(A, "passed"), (C, "skipped")], Exit::Code(0));
    assert_problem(
        &p,
        &format!("lists a known failure that critest did not report (renamed?): {B}"),
    );
}

#[test]
fn duplicate_names_fail_the_run() {
    let (mut must, mut rows) = lists();
    let report = parse_junit(&junit(EXPECTED, "")).unwrap();
    must.push(A.to_string());
    assert_problem(
        &account(&report, Exit::Code(1), &must, &rows, false),
        &format!("listed 2x ({MUST_PASS}, {MUST_PASS}): {A}"),
    );
    must.pop();
    rows.push(row(Kind::Skipped, B));
    assert_problem(
        &account(&report, Exit::Code(1), &must, &rows, false),
        &format!("listed 2x ({DOC} (failed), {DOC} (skipped)): {B}"),
    );
    rows.pop();
    rows.push(row(Kind::Failed, A));
    assert_problem(
        &account(&report, Exit::Code(1), &must, &rows, false),
        &format!("listed 2x ({MUST_PASS}, {DOC} (failed)): {A}"),
    );
    // The report itself naming two specs the same.
    let twice = parse_junit(&junit(
        &[(A, "passed"), (A, "passed"), (B, "failed"), (C, "skipped")],
        "",
    ))
    .unwrap();
    assert_problem(
        &account(&twice, Exit::Code(1), &must, &lists().1, false),
        &format!("critest reports 2 specs named the same, so they cannot be told apart: {A}"),
    );
}

#[test]
fn critest_ending_for_another_cause_fails_the_run() {
    // Non-zero with no failed spec: something other than a spec failed.
    let p = problems_for(&[(A, "passed"), (C, "skipped")], Exit::Code(1));
    assert_problem(&p, "critest exited 1 with no failed spec");
    // A Go panic, a signal, no end: even with only documented failures in the report.
    assert_problem(&problems_for(EXPECTED, Exit::Code(2)), "critest exited 2");
    assert_problem(
        &problems_for(EXPECTED, Exit::Signal(9)),
        "killed by signal 9",
    );
    assert_problem(
        &problems_for(EXPECTED, Exit::TimedOut),
        "ran past its deadline",
    );
    // Exit 0 with a failed spec in the report: the two disagree.
    assert_problem(
        &problems_for(EXPECTED, Exit::Code(0)),
        "critest exited 0 but its report has 1 failed specs",
    );
}

#[test]
fn suite_level_failures_fail_the_run() {
    let p = problems_for(
        &[
            ("[BeforeSuite]", "failed"),
            (A, "skipped"),
            (B, "skipped"),
            (C, "skipped"),
        ],
        Exit::Code(1),
    );
    assert_problem(&p, "suite node [BeforeSuite] failed");
    let p = problems_for(
        &[
            ("[BeforeSuite]", "passed"),
            (A, "passed"),
            (B, "failed"),
            (C, "skipped"),
            ("[AfterSuite]", "panicked"),
        ],
        Exit::Code(1),
    );
    assert_problem(&p, "suite node [AfterSuite] panicked");
    let (must, rows) = lists();
    let timed_out = parse_junit(&junit(EXPECTED, "Suite Timeout Elapsed")).unwrap();
    assert_problem(
        &account(&timed_out, Exit::Code(1), &must, &rows, false),
        "ginkgo reports a suite failure: Suite Timeout Elapsed",
    );
}

#[test]
fn a_spec_that_panicked_or_was_interrupted_fails_the_run_even_when_documented() {
    let p = problems_for(
        &[(A, "passed"), (B, "panicked"), (C, "skipped")],
        Exit::Code(1),
    );
    assert_problem(
        &p,
        &format!("ended panicked (neither passed, failed nor skipped; the run broke): {B}"),
    );
    let p = problems_for(
        &[(A, "interrupted"), (B, "failed"), (C, "skipped")],
        Exit::Code(1),
    );
    assert_problem(
        &p,
        &format!("ended interrupted (neither passed, failed nor skipped; the run broke): {A}"),
    );
}

#[test]
fn an_empty_report_fails_the_run() {
    let (must, rows) = lists();
    let empty = parse_junit(&junit(&[], "")).unwrap();
    assert_problem(
        &account(&empty, Exit::Code(0), &must, &rows, false),
        "the report has no specs",
    );
}

#[test]
fn a_retired_spec_that_still_runs_fails_the_run() {
    let (must, mut rows) = lists();
    rows.push(row(Kind::Retired, "[k8s.io] Suite D old name"));
    let report = parse_junit(&junit(
        &[
            (A, "passed"),
            (B, "failed"),
            (C, "skipped"),
            ("[k8s.io] Suite D old name", "passed"),
        ],
        "",
    ))
    .unwrap();
    assert_problem(
        &account(&report, Exit::Code(1), &must, &rows, false),
        "retire only names critest no longer has: [k8s.io] Suite D old name",
    );
}

#[test]
fn a_focused_run_counts_only_the_specs_it_ran() {
    let (must, rows) = lists();
    // Only B was focused: A and C were left out ("skipped" with no reason), D too.
    let filtered = |n: &str| {
        testcase(&format!("[It] {n}"), "skipped")
            .replace("skipped - not on this platform", "skipped")
    };
    let xml = junit(&[(B, "failed")], "")
        .replace(
            "      </testsuite>",
            &format!(
                "{}{}{}      </testsuite>",
                filtered(A),
                filtered(C),
                filtered("[k8s.io] Suite D")
            ),
        )
        .replace("tests=\"2\"", "tests=\"5\"");
    let report = parse_junit(&xml).unwrap();
    let p = account(&report, Exit::Code(1), &must, &rows, true);
    assert!(p.is_empty(), "{p:#?}");
    // Unfocused, the same report is full of problems.
    let p = account(&report, Exit::Code(1), &must, &rows, false);
    assert_problem(&p, &format!("must-pass spec did not run (skipped): {A}"));
    // A spec that skipped itself is still counted when focused.
    let report = parse_junit(&junit(&[(A, "passed"), (B, "skipped")], "")).unwrap();
    assert_problem(
        &account(&report, Exit::Code(0), &must, &rows, true),
        &format!("known skip (skipped - not on this platform): {B}"),
    );
}

#[test]
fn focus_is_refused_in_ci_and_when_required() {
    let f = || Some("Image Manager".to_string());
    assert_eq!(focus_setting(None, Some("true".into()), true), Ok(None));
    assert_eq!(focus_setting(f(), None, false), Ok(f()));
    assert_eq!(focus_setting(f(), Some("false".into()), false), Ok(f()));
    let e = focus_setting(f(), Some("true".into()), false).unwrap_err();
    assert!(e.contains("under CI"), "{e}");
    let e = focus_setting(f(), Some("github-actions".into()), false).unwrap_err();
    assert!(e.contains("under CI"), "{e}");
    let e = focus_setting(f(), None, true).unwrap_err();
    assert!(e.contains("with HAKO_E2E_REQUIRED"), "{e}");
}

#[test]
fn doc_table_parsing() {
    let md = format!(
        "# critest\n\nprose | with a pipe\n\n{TABLE_BEGIN}\n| status | spec | why |\n|---|---|---|\n| failed | `{B}` | streaming is not built |\n| skipped | `[k8s.io] Image get fields should not have Uid\\|Username empty` | a reason, with `code` |\n| retired | [k8s.io] Old name | renamed by critest v1.35 |\n\n{TABLE_END}\n| failed | not in the table | ignored |\n"
    );
    let rows = parse_doc_table(&md).unwrap();
    assert_eq!(
        rows,
        [
            Row {
                kind: Kind::Failed,
                name: B.into(),
                reason: "streaming is not built".into()
            },
            Row {
                kind: Kind::Skipped,
                name: "[k8s.io] Image get fields should not have Uid|Username empty".into(),
                reason: "a reason, with `code`".into()
            },
            Row {
                kind: Kind::Retired,
                name: "[k8s.io] Old name".into(),
                reason: "renamed by critest v1.35".into()
            },
        ]
    );
    let bad =
        |row: &str| parse_doc_table(&format!("{TABLE_BEGIN}\n{row}\n{TABLE_END}")).unwrap_err();
    assert!(bad("| fialed | `x` | why |").contains("none of failed, skipped, retired"));
    assert!(bad("| failed | `x` |").contains("expected 3 cells"));
    assert!(bad("| failed | `x` |  |").contains("needs a spec name and a reason"));
    assert!(bad("| failed | `` | why |").contains("needs a spec name and a reason"));
    assert!(bad("failed: x").contains("not a table row"));
    assert!(parse_doc_table("no table")
        .unwrap_err()
        .contains("no <!-- critest-accounting:begin -->"));
    assert!(parse_doc_table(TABLE_BEGIN)
        .unwrap_err()
        .contains("no <!-- critest-accounting:end -->"));
}

#[test]
fn must_pass_parsing_skips_comments_and_blanks() {
    assert_eq!(
        parse_must_pass("# c\n\n  x y [Conformance]  \n#z\nw\n"),
        ["x y [Conformance]", "w"]
    );
}

#[test]
fn a_spec_dropped_from_must_pass_fails_unless_retired() {
    let old = format!("# list\n{A}\n[k8s.io] Suite D old name\n");
    let versions = vec![
        ("cccccccccccc".to_string(), format!("{A}\n")),
        ("bbbbbbbbbbbb".to_string(), old.clone()),
        ("aaaaaaaaaaaa".to_string(), old),
    ];
    let (must, mut rows) = lists();
    let p = history_problems(&versions, &must, &rows);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_problem(&p, "as of commit bbbbbbbbbbbb and no longer; put it back, or retire it in docs/CRITEST.md with a reason: [k8s.io] Suite D old name");
    rows.push(row(Kind::Retired, "[k8s.io] Suite D old name"));
    assert!(history_problems(&versions, &must, &rows).is_empty());
}
