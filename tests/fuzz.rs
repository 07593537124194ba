//! Mutation fuzzing of hako's parsers, on stable Rust (docs/TESTING.md, "Fuzzing").
//!
//! cargo-fuzz needs a nightly toolchain, so this is a small fuzzer of its own: each target
//! replays its corpus (`tests/fuzz-corpus/<target>/`, seeds and earlier crashes), then runs
//! `HAKO_FUZZ_ITERS` inputs (default [`DEFAULT_ITERS`]) made by stacking random mutations on
//! corpus entries, from a seeded PRNG (`HAKO_FUZZ_SEED`, fixed by default so CI is
//! repeatable). Every run is under `catch_unwind` and checks the target's properties; the first
//! input that panics or breaks one is shrunk, written to
//! `tests/fuzz-corpus/<target>/crash-<hash>`, and fails the test. There is no coverage
//! instrumentation on stable: inputs that produce an outcome not seen before (an error of a new
//! kind) are kept as further bases, which is enough to get past the first parse error.
//!
//! A long run: `HAKO_FUZZ_ITERS=200000 HAKO_FUZZ_SEED=$RANDOM cargo test --release --test fuzz`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Inputs per target when `HAKO_FUZZ_ITERS` is unset: the whole file stays well under a minute
/// in a debug build on a 2-core machine (docs/TESTING.md has the figures).
const DEFAULT_ITERS: u64 = 10_000;
const DEFAULT_SEED: u64 = 0x6861_6b6f_6675_7a7a;

// ---------------------------------------------------------------------------------------------
// The engine.
// ---------------------------------------------------------------------------------------------

/// xorshift64*: tiny, fast, and the same sequence everywhere for a given seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// A format-aware mutator: the RNG, the input to change, the pool of inputs so far.
type Mutator = fn(&mut Rng, &mut Vec<u8>, &[Vec<u8>]);
/// The byte ranges of an input's records.
type Units = fn(&[u8]) -> Vec<(usize, usize)>;

/// What a target is fed: its corpus name, an input size cap, words of its format that random
/// bytes rarely spell, and optional record structure (block size, header length before the
/// first block, and the offsets of fields inside a block) to aim mutations at.
struct Target {
    name: &'static str,
    max_len: usize,
    tokens: &'static [&'static [u8]],
    blocks: Option<(usize, usize, &'static [usize])>,
    /// A mutator that knows the format, used for half the inputs.
    structured: Option<Mutator>,
    /// The byte ranges of an input's records (tar entries), which shrinking tries to drop whole
    /// before it cuts bytes.
    units: Option<Units>,
    /// Random bytes are mostly printable ASCII (text formats reject the rest at once).
    text: bool,
}

/// One run: `Ok(outcome)` names what happened (errors are normalized, so a new outcome means a
/// new path through the code); `Err` is a broken property, `"<property>: <details>"`.
type RunResult = Result<String, String>;

#[rustfmt::skip]
const INTERESTING: &[u64] = &[
    0, 1, 2, 0x7f, 0x80, 0xff, 0x100, 0x1ff, 0x200, 0x3fff, 0x4000, 0x4001, 0x7fff, 0x8000,
    0xffff, 0x10000, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff, 0x1_0000_0000,
    0x7fff_ffff_ffff_ffff, 0xffff_ffff_ffff_ffff,
];

/// Numbers as text: tar headers are octal ASCII, and TOML, YAML and JSON carry numbers too.
#[rustfmt::skip]
const INTERESTING_TEXT: &[&[u8]] = &[
    b"0", b"-1", b"1", b"7", b"0000777", b"0007777", b"77777777777", b"777777777777",
    b"00000001000", b"37777777777", b"99999999999999999999", b"18446744073709551615",
    b"4294967296", b"-9223372036854775808", b"1e308", b"0x10", b"1.5", b"NaN",
];

/// A random byte; for text formats, printable ASCII, a newline or a tab seven times in eight.
fn byte(rng: &mut Rng, t: &Target) -> u8 {
    if t.text && !rng.chance(8) {
        b" \n\t!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~"[rng.below(97)]
    } else {
        rng.next() as u8
    }
}

fn mutate(rng: &mut Rng, data: &mut Vec<u8>, pool: &[Vec<u8>], t: &Target) {
    // Often one change: most formats reject an input at the first broken thing.
    let rounds = if rng.chance(2) { 1 } else { 1 << rng.below(4) };
    for _ in 0..rounds {
        let len = data.len();
        match rng.below(14) {
            0 if len > 0 => {
                let i = rng.below(len);
                data[i] ^= 1 << rng.below(8);
            }
            13 if t.text && len > 0 => {
                // Empty a quoted string: empty names and paths are the classic edge.
                let from = rng.below(len);
                if let Some(open) = data[from..].iter().position(|&b| b == b'"') {
                    let open = from + open + 1;
                    if let Some(close) = data[open..].iter().position(|&b| b == b'"') {
                        data.drain(open..open + close);
                    }
                }
            }
            1 if len > 0 => {
                let i = rng.below(len);
                data[i] = if rng.chance(2) {
                    byte(rng, t)
                } else {
                    data[i].wrapping_add(rng.below(33) as u8).wrapping_sub(16)
                };
            }
            2 => {
                let at = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| byte(rng, t)).collect();
                data.splice(at..at, bytes);
            }
            3 if len > 0 => {
                let at = rng.below(len);
                let most = if rng.chance(4) {
                    len - at
                } else {
                    (len - at).min(16)
                };
                let n = 1 + rng.below(most);
                data.drain(at..at + n);
            }
            4 if len > 0 => {
                // Duplicate a range somewhere else (repeats records, lines, table headers).
                let from = rng.below(len);
                let most = (len - from).min(if rng.chance(4) { 4096 } else { 64 });
                let n = 1 + rng.below(most);
                let chunk = data[from..from + n].to_vec();
                let at = rng.below(len + 1);
                data.splice(at..at, chunk);
            }
            5 if !pool.is_empty() => {
                let other = &pool[rng.below(pool.len())];
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                data.truncate(cut);
                data.extend_from_slice(&other[from..]);
            }
            6 if len > 0 => {
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let width = 1 << rng.below(4);
                let bytes = if rng.chance(2) {
                    v.to_be_bytes()[8 - width..].to_vec()
                } else {
                    v.to_le_bytes()[..width].to_vec()
                };
                overwrite(data, at_field(rng, len, t), &bytes);
            }
            7 => {
                let text = INTERESTING_TEXT[rng.below(INTERESTING_TEXT.len())];
                if rng.chance(2) && len > 0 {
                    overwrite(data, at_field(rng, len, t), text);
                } else {
                    let at = rng.below(len + 1);
                    data.splice(at..at, text.iter().copied());
                }
            }
            8 if !t.tokens.is_empty() => {
                let tok = t.tokens[rng.below(t.tokens.len())];
                let at = rng.below(len + 1);
                data.splice(at..at, tok.iter().copied());
            }
            9 if !t.tokens.is_empty() && len > 0 => {
                let tok = t.tokens[rng.below(t.tokens.len())];
                overwrite(data, at_field(rng, len, t), tok);
            }
            10 if len > 0 => data.truncate(rng.below(len)),
            11 if len > 1 => {
                // Copy a range over another place (keeps the length: aligned formats stay aligned).
                let from = rng.below(len);
                let n = 1 + rng.below((len - from).min(64));
                let chunk = data[from..from + n].to_vec();
                overwrite(data, rng.below(len), &chunk);
            }
            12 if len > 0 => {
                let i = rng.below(len);
                data[i] = *[
                    b'\0', b'\n', b'/', b'.', b'"', b'=', b':', b'@', b' ', b'\\', 0xff,
                ]
                .get(rng.below(11))
                .unwrap();
            }
            _ => {}
        }
    }
    data.truncate(t.max_len);
}

/// Where to overwrite: often the start of a header field when the format has fixed blocks.
fn at_field(rng: &mut Rng, len: usize, t: &Target) -> usize {
    if let Some((block, skip, fields)) = t.blocks {
        if len > skip && rng.chance(2) {
            let blocks = (len - skip).div_ceil(block);
            let at = skip + rng.below(blocks) * block + fields[rng.below(fields.len())];
            if at < len {
                return at;
            }
        }
    }
    rng.below(len)
}

fn overwrite(data: &mut Vec<u8>, at: usize, bytes: &[u8]) {
    let end = at + bytes.len();
    if end > data.len() {
        data.resize(end, 0);
    }
    data[at..end].copy_from_slice(bytes);
}

/// Short text of an outcome with the specifics (quoted names, numbers) taken out, so that two
/// inputs failing the same way give the same outcome.
fn normalize(s: &str) -> String {
    let mut out = String::new();
    // The quote character being skipped (" with escapes, or serde's `).
    let mut quoted = None;
    let mut escaped = false;
    let mut last_digit = false;
    for c in s.chars() {
        if let Some(q) = quoted {
            match c {
                _ if escaped => escaped = false,
                '\\' if q == '"' => escaped = true,
                _ if c == q => quoted = None,
                _ => {}
            }
            continue;
        }
        match c {
            // Parsers quote the offending text after these.
            '|' | '\n' => break,
            '"' | '`' => {
                quoted = Some(c);
                out.push_str("\"…\"");
            }
            '0'..='9' => {
                if !last_digit {
                    out.push('#');
                }
            }
            _ => out.push(c),
        }
        last_digit = c.is_ascii_digit();
        if out.len() > 120 {
            break;
        }
    }
    out
}

thread_local! {
    /// Set while a fuzz input runs: a panic is expected to be caught and reported by the
    /// engine, so the hook records it instead of printing it.
    static QUIET: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if QUIET.with(Cell::get) {
                let msg = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".into());
                let at = info
                    .location()
                    .map(|l| format!(" at {}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{msg}{at}")));
            } else {
                previous(info);
            }
        }));
    });
}

fn exec(run: &mut dyn FnMut(&[u8]) -> RunResult, input: &[u8]) -> RunResult {
    QUIET.with(|q| q.set(true));
    let r = panic::catch_unwind(AssertUnwindSafe(|| run(input)));
    QUIET.with(|q| q.set(false));
    match r {
        Ok(r) => r,
        Err(_) => Err(format!(
            "panic: {}",
            LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_default()
        )),
    }
}

fn kind_of(failure: &str) -> &str {
    failure.split(':').next().unwrap_or(failure)
}

fn corpus_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz-corpus")
        .join(name)
}

fn env_u64(var: &str, default: u64) -> u64 {
    match std::env::var(var) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{var}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// Writes a failing input beside the corpus and returns its path.
fn save(name: &str, prefix: &str, input: &[u8]) -> PathBuf {
    let hash = format!("{:x}", Sha256::digest(input));
    let path = corpus_dir(name).join(format!("{prefix}-{}", &hash[..16]));
    if let Err(e) = std::fs::write(&path, input) {
        eprintln!("fuzz {name}: could not save {}: {e}", path.display());
    }
    path
}

/// Removes chunks of a failing input while it still fails the same way.
fn shrink(
    run: &mut dyn FnMut(&[u8]) -> RunResult,
    t: &Target,
    input: &[u8],
    kind: &str,
) -> Vec<u8> {
    let mut best = input.to_vec();
    let mut budget = 400;
    if let Some(units) = t.units {
        // Last record first, so the ranges of the ones before stay valid.
        for (a, b) in units(&best).into_iter().rev() {
            let mut cand = best.clone();
            cand.drain(a..b);
            budget -= 1;
            if let Err(f) = exec(run, &cand) {
                if kind_of(&f) == kind {
                    best = cand;
                }
            }
        }
    }
    let mut chunk = best.len().div_ceil(2);
    while chunk > 0 && budget > 0 {
        let mut at = 0;
        while at < best.len() && budget > 0 {
            budget -= 1;
            let mut cand = best.clone();
            cand.drain(at..(at + chunk).min(best.len()));
            match exec(run, &cand) {
                Err(f) if kind_of(&f) == kind => best = cand,
                _ => at += chunk,
            }
        }
        chunk /= 2;
    }
    best
}

/// Stops the process when one input runs for `HAKO_FUZZ_HANG_SECS` (default 300): a hang is a
/// finding like a panic, and the input is saved as `hang-<hash>` before aborting, since
/// nothing else would tell which input it was. This is not a speed check: inputs take
/// milliseconds and the limit is minutes.
struct Watchdog {
    current: Arc<Mutex<Vec<u8>>>,
    progress: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Watchdog {
    fn start(name: &'static str) -> Watchdog {
        let w = Watchdog {
            current: Arc::default(),
            progress: Arc::default(),
            stop: Arc::default(),
        };
        let (current, progress, stop) = (w.current.clone(), w.progress.clone(), w.stop.clone());
        let limit = Duration::from_secs(env_u64("HAKO_FUZZ_HANG_SECS", 300));
        std::thread::spawn(move || {
            let mut seen = (progress.load(Ordering::Relaxed), Instant::now());
            while !stop.load(Ordering::Relaxed) {
                std::thread::park_timeout(Duration::from_secs(1));
                let p = progress.load(Ordering::Relaxed);
                if p != seen.0 {
                    seen = (p, Instant::now());
                } else if seen.1.elapsed() > limit {
                    let input = current.lock().map(|c| c.clone()).unwrap_or_default();
                    let path = save(name, "hang", &input);
                    eprintln!(
                        "fuzz {name}: one input has run for {limit:?}; saved as {}",
                        path.display()
                    );
                    std::process::abort();
                }
            }
        });
        w
    }
    fn running(&self, input: &[u8]) {
        if let Ok(mut c) = self.current.lock() {
            c.clear();
            c.extend_from_slice(input);
        }
        self.progress.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn fuzz(t: Target, mut run: impl FnMut(&[u8]) -> RunResult) {
    install_panic_hook();
    let run: &mut dyn FnMut(&[u8]) -> RunResult = &mut run;
    let dir = corpus_dir(t.name);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("fuzz corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "fuzz corpus {} is empty", dir.display());
    let iters = env_u64("HAKO_FUZZ_ITERS", DEFAULT_ITERS);
    let seed = env_u64("HAKO_FUZZ_SEED", DEFAULT_SEED);
    let watchdog = Watchdog::start(t.name);
    let started = Instant::now();
    let mut outcomes: HashMap<String, u64> = HashMap::new();

    // The corpus first: seeds and every crash found before are regression inputs.
    let mut pool = Vec::new();
    for f in &files {
        let input = std::fs::read(f).expect("read corpus file");
        watchdog.running(&input);
        match exec(run, &input) {
            Ok(o) => *outcomes.entry(o).or_default() += 1,
            Err(failure) => panic!(
                "fuzz {}: corpus file {} fails: {failure}",
                t.name,
                f.display()
            ),
        }
        pool.push(input);
    }

    let mut rng =
        Rng::new(seed ^ u64::from_le_bytes(Sha256::digest(t.name)[..8].try_into().unwrap()));
    for i in 0..iters {
        // Half the time from the corpus as given: the pool fills with inputs that fail early.
        let base = if rng.chance(2) {
            rng.below(files.len())
        } else {
            rng.below(pool.len())
        };
        let mut input = pool[base].clone();
        match t.structured {
            Some(m) if rng.chance(2) => {
                m(&mut rng, &mut input, &pool);
                if rng.chance(4) {
                    mutate(&mut rng, &mut input, &pool, &t);
                }
                input.truncate(t.max_len);
            }
            _ => mutate(&mut rng, &mut input, &pool, &t),
        }
        watchdog.running(&input);
        match exec(run, &input) {
            Ok(o) => {
                let n = outcomes.entry(o).or_default();
                // A new outcome: this input reached somewhere new, keep mutating from it.
                if *n == 0 && pool.len() < 1024 {
                    pool.push(input);
                }
                *n += 1;
            }
            Err(failure) => {
                let small = shrink(run, &t, &input, kind_of(&failure));
                let failure = exec(run, &small).err().unwrap_or(failure);
                let path = save(t.name, "crash", &small);
                panic!(
                    "fuzz {}: input {i} (HAKO_FUZZ_SEED={seed}) breaks a property: {failure}\n\
                     saved ({} bytes, shrunk from {}) as {}; `cargo test --test fuzz` replays it",
                    t.name,
                    small.len(),
                    input.len(),
                    path.display()
                );
            }
        }
    }
    drop(watchdog);
    let mut top: Vec<_> = outcomes.iter().collect();
    top.sort_by(|a, b| b.1.cmp(a.1));
    eprintln!(
        "fuzz {}: {} corpus + {iters} mutated inputs in {:.1?}, {} distinct outcomes, seed {seed}; most frequent:",
        t.name,
        files.len(),
        started.elapsed(),
        outcomes.len(),
    );
    for (o, n) in top.iter().take(
        std::env::var("HAKO_FUZZ_TOP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(6),
    ) {
        eprintln!("  {n:>7}  {o}");
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The layer unpacker.
// ---------------------------------------------------------------------------------------------

/// tar header fields: name, mode, uid, gid, size, mtime, checksum, type, link name, magic,
/// device major/minor, prefix, GNU sparse map.
#[rustfmt::skip]
const TAR_FIELDS: &[usize] = &[
    0, 100, 108, 116, 124, 136, 148, 156, 157, 257, 329, 337, 345, 386, 482, 483,
];

/// Decompressed layers above this are not unpacked (the run is counted as skipped): the
/// fuzzer is after logic, not disk bandwidth.
const UNPACK_STREAM_CAP: u64 = 8 << 20;
/// Largest file the fuzz process may write (RLIMIT_FSIZE; a write beyond fails with EFBIG).
/// Twice the byte bound the unpacker is given, which counts what it writes as well as what it
/// reads: a write that reaches the guard is a small layer blown up past that bound (a GNU
/// sparse map can describe terabytes of holes in a few bytes).
const FILE_SIZE_GUARD: u64 = 16 << 20;

/// Lays out the run's directory: `canary`, lower layers `lower-a` (over) `lower-b`, and `root`
/// (the layer being unpacked, made empty for each input). `lower-a/up` points at this
/// directory's real absolute path, so following it on the host instead of inside the root
/// would land next to the canary.
fn unpack_workspace(w: &Path) {
    use std::os::unix::fs::symlink;
    std::fs::write(w.join("canary"), "canary").unwrap();
    let a = w.join("lower-a");
    for d in ["usr/lib", "usr/bin", "etc", "opq"] {
        std::fs::create_dir_all(a.join(d)).unwrap();
    }
    std::fs::write(a.join("usr/lib/libc.so"), "libc").unwrap();
    std::fs::write(a.join("usr/bin/sh"), "sh").unwrap();
    std::fs::write(a.join("etc/passwd"), "root:x:0:0::/root:/bin/sh\n").unwrap();
    std::fs::write(a.join("etc/hostname"), "lower\n").unwrap();
    std::fs::hard_link(a.join("etc/passwd"), a.join("hl")).unwrap();
    std::fs::write(a.join("opq/inner"), "inner").unwrap();
    xattr::set(a.join("opq"), "trusted.overlay.opaque", b"y").unwrap();
    symlink("usr/lib", a.join("lib")).unwrap();
    symlink("/usr", a.join("abs")).unwrap();
    symlink(w, a.join("up")).unwrap();
    symlink("../../..", a.join("dotdot")).unwrap();
    symlink("loop", a.join("loop")).unwrap();
    symlink("/etc/passwd", a.join("passwd-link")).unwrap();
    nix::sys::stat::mknod(
        &a.join("gone"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::empty(),
        0,
    )
    .unwrap();
    nix::unistd::mkfifo(
        &a.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    let b = w.join("lower-b");
    for d in ["gone/sub", "opq", "usr/lib/deep", "etc"] {
        std::fs::create_dir_all(b.join(d)).unwrap();
    }
    std::fs::write(b.join("opq/hidden"), "hidden").unwrap();
    std::fs::write(b.join("usr/lib/deep/x"), "x").unwrap();
    std::fs::write(b.join("etc/shadow"), "root:*:1::::::\n").unwrap();
}

/// The directory unpacks run in, and what it holds outside `root`.
struct Workspace {
    dir: tempfile::TempDir,
    before: BTreeMap<PathBuf, String>,
}

impl Workspace {
    fn new() -> Workspace {
        let dir = tempfile::tempdir().expect("tempdir");
        unpack_workspace(dir.path());
        let before = snapshot(dir.path());
        Workspace { dir, before }
    }

    /// Lays the workspace out again after an input changed it, so the next inputs (and the
    /// shrinking of this one) are judged against an intact one.
    fn reset(&mut self) {
        for e in std::fs::read_dir(self.dir.path()).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                std::fs::remove_dir_all(&p).unwrap();
            } else {
                std::fs::remove_file(&p).unwrap();
            }
        }
        unpack_workspace(self.dir.path());
        self.before = snapshot(self.dir.path());
    }
}

/// Everything under `dir` except `root`: type, mode, owner, size, mtime, content, link target
/// and xattrs of every entry, without following links.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if d == dir && p.file_name() == Some("root".as_ref()) {
                continue;
            }
            let md = std::fs::symlink_metadata(&p).unwrap();
            let ft = md.file_type();
            let what = if ft.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else if ft.is_symlink() {
                format!("link {:?}", std::fs::read_link(&p).unwrap())
            } else if ft.is_file() {
                format!("file {:x}", Sha256::digest(std::fs::read(&p).unwrap()))
            } else {
                format!("special {:o} {}", md.mode() & 0o170000, md.rdev())
            };
            let xattrs: Vec<String> = xattr::list(&p)
                .map(|l| {
                    l.map(|n| format!("{n:?}={:?}", xattr::get(&p, &n).ok().flatten()))
                        .collect()
                })
                .unwrap_or_default();
            out.insert(
                p,
                format!(
                    "{what} mode {:o} {}:{} size {} mtime {} xattrs {xattrs:?}",
                    md.mode(),
                    md.uid(),
                    md.gid(),
                    md.size(),
                    md.mtime()
                ),
            );
        }
    }
    out
}

/// Fixes the checksum of every header a tar reader would visit, so that mutations of header
/// fields reach the unpacker instead of all stopping at "checksum mismatch".
fn fix_tar_checksums(tar: &mut [u8]) {
    let mut at = 0;
    while at + 512 <= tar.len() {
        let h = &mut tar[at..at + 512];
        if h.iter().all(|&b| b == 0) {
            at += 512;
            continue;
        }
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let text = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(text.as_bytes());
        let Some(size) = tar_number(&h[124..136]) else {
            return;
        };
        let mut next = at + 512;
        // Old GNU sparse headers are followed by extension blocks while the flag is set.
        if h[156] == b'S' && h[482] != 0 {
            while next + 512 <= tar.len() && tar[next + 504] != 0 {
                next += 512;
            }
            next += 512;
        }
        let Some(end) = usize::try_from(size)
            .ok()
            .and_then(|s| next.checked_add(s.div_ceil(512) * 512))
        else {
            return;
        };
        at = end;
    }
}

fn tar_number(field: &[u8]) -> Option<u64> {
    if field[0] & 0x80 != 0 {
        let mut v: u64 = 0;
        for &b in &field[field.len() - 8..] {
            v = (v << 8) | u64::from(b);
        }
        return Some(v);
    }
    let text: String = field
        .iter()
        .map(|&b| b as char)
        .filter(|c| !matches!(c, '\0' | ' '))
        .collect();
    u64::from_str_radix(&text, 8)
        .ok()
        .or(Some(0).filter(|_| text.is_empty()))
}

/// Our own decode of a layer blob, as the unpacker should see it.
enum Decoded {
    Whole(Vec<u8>),
    /// The stream is corrupt after these bytes.
    Corrupt(Vec<u8>),
    TooLarge,
}

fn decode_layer(blob: &[u8]) -> Decoded {
    let mut out = Vec::new();
    // read_to_end keeps what it read before an error.
    let r = if blob.starts_with(&[0x1f, 0x8b]) {
        flate2::read::MultiGzDecoder::new(blob)
            .take(UNPACK_STREAM_CAP + 1)
            .read_to_end(&mut out)
    } else if blob.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        match zstd::stream::read::Decoder::new(blob) {
            Ok(d) => d.take(UNPACK_STREAM_CAP + 1).read_to_end(&mut out),
            Err(_) => return Decoded::Corrupt(out),
        }
    } else {
        out = blob.to_vec();
        Ok(out.len())
    };
    if out.len() as u64 > UNPACK_STREAM_CAP {
        Decoded::TooLarge
    } else if r.is_err() {
        Decoded::Corrupt(out)
    } else {
        Decoded::Whole(out)
    }
}

/// The entry names a tar reader sees, up to the first error.
fn entry_names(tar: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    let mut archive = tar::Archive::new(tar);
    let Ok(entries) = archive.entries() else {
        return names;
    };
    for e in entries {
        let Ok(e) = e else { break };
        let Ok(p) = e.path() else { break };
        names.push(p.to_string_lossy().into_owned());
    }
    names
}

/// The byte ranges of the entries of a tar (header, GNU sparse extension blocks, data), up to
/// the end marker or the first header it cannot follow.
fn tar_entries(tar: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 512 <= tar.len() {
        let h = &tar[at..at + 512];
        if h.iter().all(|&b| b == 0) {
            break;
        }
        let Some(size) = tar_number(&h[124..136]) else {
            break;
        };
        let mut next = at + 512;
        if h[156] == b'S' && h[482] != 0 {
            while next + 512 <= tar.len() && tar[next + 504] != 0 {
                next += 512;
            }
            next += 512;
        }
        let Some(end) = usize::try_from(size)
            .ok()
            .and_then(|s| next.checked_add(s.div_ceil(512) * 512))
            .filter(|&e| e <= tar.len())
        else {
            break;
        };
        out.push((at, end));
        at = end;
    }
    out
}

/// Path components that mean something to the unpacker or to the lower layers of the run.
#[rustfmt::skip]
const PATH_PARTS: &[&str] = &[
    "..", ".", "", "a", "b", "lib", "usr", "etc", "passwd", "up", "dotdot", "loop", "fifo",
    "gone", "opq", "inner", "hl", "abs", "passwd-link", ".wh.a", ".wh.gone", ".wh.etc",
    ".wh..wh..opq", ".wh.", "canary", "root", "tmp",
];

fn random_path(rng: &mut Rng) -> String {
    let n = 1 + rng.below(4);
    let parts: Vec<&str> = (0..n)
        .map(|_| PATH_PARTS[rng.below(PATH_PARTS.len())])
        .collect();
    let mut p = parts.join("/");
    if rng.chance(5) {
        p.insert(0, '/');
    }
    if rng.chance(5) {
        p.push('/');
    }
    p
}

/// The name in a tar header (the name field only; PAX and GNU long names are not followed).
fn tar_name(h: &[u8]) -> String {
    let name = &h[..100];
    let end = name.iter().position(|&b| b == 0).unwrap_or(100);
    String::from_utf8_lossy(&name[..end]).into_owned()
}

fn set_field(h: &mut [u8], at: usize, len: usize, value: &[u8]) {
    let n = value.len().min(len);
    h[at..at + len].fill(0);
    h[at..at + n].copy_from_slice(&value[..n]);
}

/// Edits a layer entry by entry: drops, repeats, moves or borrows entries, renames them and
/// retargets links with paths that mean something here, changes their type and mode; then
/// makes the checksums right. Byte mutations alone rarely get a tar past its parser.
fn mutate_tar(rng: &mut Rng, input: &mut Vec<u8>, pool: &[Vec<u8>]) {
    let Some(&ctl) = input.first() else { return };
    let tar = &input[1..];
    if tar.starts_with(&[0x1f, 0x8b]) || tar.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        return;
    }
    let mut entries: Vec<Vec<u8>> = tar_entries(tar)
        .into_iter()
        .map(|(a, b)| tar[a..b].to_vec())
        .collect();
    for _ in 0..1 + rng.below(3) {
        let n = entries.len();
        match rng.below(10) {
            0 if n > 0 => {
                entries.remove(rng.below(n));
            }
            1 if n > 0 => {
                let e = entries[rng.below(n)].clone();
                entries.insert(rng.below(n + 1), e);
            }
            2 if n > 1 => {
                let e = entries.remove(rng.below(n));
                entries.insert(rng.below(n), e);
            }
            3 => {
                let other = &pool[rng.below(pool.len())];
                if other.len() > 1 {
                    let theirs = tar_entries(&other[1..]);
                    if !theirs.is_empty() {
                        let (a, b) = theirs[rng.below(theirs.len())];
                        entries.insert(rng.below(n + 1), other[1 + a..1 + b].to_vec());
                    }
                }
            }
            4 if n > 1 => {
                // A path related to another entry's: its parent, or a child of it, so that
                // entries replace, nest in and shadow each other.
                let other = tar_name(&entries[rng.below(n)]);
                let path = match other.rfind('/') {
                    Some(i) if rng.chance(2) => other[..i].to_string(),
                    _ => format!("{}/{}", other.trim_end_matches('/'), random_path(rng)),
                };
                let h = &mut entries[rng.below(n)];
                set_field(h, 0, 100, path.as_bytes());
                set_field(h, 345, 155, b"");
            }
            5 if n > 0 => {
                let path = random_path(rng);
                let h = &mut entries[rng.below(n)];
                set_field(h, 0, 100, path.as_bytes());
                set_field(h, 345, 155, b"");
            }
            6 if n > 0 => {
                let path = random_path(rng);
                let h = &mut entries[rng.below(n)];
                set_field(h, 157, 100, path.as_bytes());
            }
            7 if n > 0 => {
                let h = &mut entries[rng.below(n)];
                h[156] = b"0123456LKxS"[rng.below(11)];
            }
            9 if n > 0 => {
                // A GNU sparse map whose last chunk starts further out, the real size to match.
                let h = &mut entries[rng.below(n)];
                if h[156] == b'S' {
                    let last = (0..4).rev().find(|k| h[386 + 24 * k] != 0).unwrap_or(0);
                    let at = 386 + 24 * last;
                    let len = tar_number(&h[at + 12..at + 24]).unwrap_or(0);
                    let off = [1u64 << 20, 1 << 30, (1 << 33) - 1][rng.below(3)];
                    set_field(h, at, 12, format!("{off:011o}").as_bytes());
                    set_field(h, 483, 12, format!("{:011o}", off + len).as_bytes());
                }
            }
            8 if n > 0 => {
                let h = &mut entries[rng.below(n)];
                let mode = [0o644, 0o755, 0o4755, 0o000, 0o7777, 0o1777][rng.below(6)];
                set_field(h, 100, 8, format!("{mode:07o}").as_bytes());
                let id = [0, 1, 65534, 65535, 2_097_151][rng.below(5)];
                set_field(h, 108 + 8 * rng.below(2), 8, format!("{id:07o}").as_bytes());
            }
            _ => {}
        }
    }
    let mut out = vec![ctl | 0x10];
    for e in &entries {
        out.extend_from_slice(e);
    }
    out.extend_from_slice(&[0; 1024]);
    fix_tar_checksums(&mut out[1..]);
    *input = out;
}

/// Input: one control byte, then the layer. Control bits 0-1: 1 = gzip the rest, 2 = zstd it,
/// 0 or 3 = the rest is the blob as is (plain, or compressed already); bit 2: lower layer A;
/// bit 3: lower layer B under it; bit 4: fix tar header checksums first.
fn unpack_one(ws: &mut Workspace, input: &[u8]) -> RunResult {
    let work = ws.dir.path().to_path_buf();
    use hako::image::unpack::{unpack_layer, Limits, UnpackError};
    // The daemon's bounds, scaled down: the byte bound is below FILE_SIZE_GUARD, so a write
    // that reaches the guard is the unpacker not counting what it writes.
    const UNPACK_LIMITS: Limits = Limits {
        max_bytes: UNPACK_STREAM_CAP,
        max_entries: 10_000,
    };
    let Some((&ctl, rest)) = input.split_first() else {
        return Ok("empty input".into());
    };
    let mut tar = rest.to_vec();
    if ctl & 0x10 != 0 {
        fix_tar_checksums(&mut tar);
    }
    let blob = match ctl & 3 {
        1 => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(&tar).unwrap();
            e.finish().unwrap()
        }
        2 => zstd::bulk::compress(&tar[..], 1).unwrap(),
        _ => tar,
    };
    let (stream, whole) = match decode_layer(&blob) {
        Decoded::TooLarge => return Ok("skipped: decompresses past the cap".into()),
        Decoded::Whole(t) => (t, true),
        Decoded::Corrupt(t) => (t, false),
    };
    let expected = if whole {
        format!("sha256:{:x}", Sha256::digest(&stream))
    } else {
        format!("sha256:{}", "0".repeat(64))
    };
    let mut lowers = Vec::new();
    if ctl & 4 != 0 {
        lowers.push(work.join("lower-a"));
    }
    if ctl & 8 != 0 {
        lowers.push(work.join("lower-b"));
    }
    let root = work.join("root");
    // A panic in an earlier run leaves its root behind.
    if root.exists() {
        std::fs::remove_dir_all(&root).expect("remove the unpacked root");
    }
    std::fs::create_dir(&root).unwrap();
    let result = unpack_layer(
        io::Cursor::new(&blob),
        &root,
        &lowers,
        &expected,
        UNPACK_LIMITS,
    );
    let after = snapshot(&work);
    std::fs::remove_dir_all(&root).expect("remove the unpacked root");
    let before = &ws.before;
    if after != *before {
        let changed: Vec<_> = after
            .iter()
            .filter(|(p, v)| before.get(*p) != Some(v))
            .map(|(p, _)| p.display().to_string())
            .chain(
                before
                    .keys()
                    .filter(|p| !after.contains_key(*p))
                    .map(|p| format!("{} (removed)", p.display())),
            )
            .collect();
        ws.reset();
        return Err(format!(
            "escape: unpacking changed {changed:?} outside its root"
        ));
    }
    match result {
        Ok(u) => {
            if !whole {
                return Err(
                    "accepted corrupt: the unpacker accepted a stream that does not decode".into(),
                );
            }
            if u.diff_id != expected {
                return Err(format!(
                    "digest: reported {} for a stream of {expected}",
                    u.diff_id
                ));
            }
            Ok("ok".into())
        }
        Err(e) => {
            let efbig = std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<io::Error>())
                .is_some_and(|s| s.raw_os_error() == Some(libc::EFBIG));
            if efbig {
                return Err(format!(
                    "amplification: a layer stream of {} bytes made the unpacker write a file of \
                     {FILE_SIZE_GUARD} bytes or more: {}",
                    stream.len(),
                    error_chain(&e)
                ));
            }
            if let UnpackError::Entry { entry, .. } | UnpackError::EntryIo { entry, .. } = &e {
                let names = entry_names(&stream);
                if !names.iter().any(|n| n == entry) {
                    return Err(format!(
                        "unnamed: error {:?} names {entry:?}, which is no entry of the layer ({} entries: {:?}…)",
                        error_chain(&e),
                        names.len(),
                        &names[..names.len().min(8)]
                    ));
                }
            }
            if let UnpackError::DiffIdMismatch { .. } = &e {
                if whole {
                    return Err(format!("digest: {}", error_chain(&e)));
                }
            }
            // Entry names appear unquoted in these messages: the outcome keeps only plain words.
            let chain = error_chain(&e);
            let words: Vec<&str> = chain
                .split_whitespace()
                .filter(|w| w.len() <= 12 && w.bytes().all(|b| b.is_ascii_lowercase()))
                .take(10)
                .collect();
            Ok(words.join(" "))
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

#[rustfmt::skip]
const UNPACK_TOKENS: &[&[u8]] = &[
    b"../", b"/", b"..", b".wh.", b".wh..wh..opq", b"lib/", b"up/", b"dotdot/", b"loop/",
    b"fifo/", b"gone/", b"opq/", b"hl", b"abs/", b"passwd-link", b"ustar\x0000",
    b"ustar  \x00", b"SCHILY.xattr.", b"SCHILY.xattr.trusted.overlay.opaque=y", b"path=",
    b"linkpath=", b"size=", b"uid=", b"gid=", b"mtime=", b"GNU.sparse.", b"0", b"1", b"2",
    b"3", b"4", b"5", b"6", b"7", b"L", b"K", b"x", b"g", b"S",
];

#[test]
fn fuzz_unpack_layer() {
    // SAFETY: ignoring SIGXFSZ and lowering RLIMIT_FSIZE affect only this test process; a
    // write past the limit then fails with EFBIG instead of killing it.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: FILE_SIZE_GUARD,
            rlim_max: FILE_SIZE_GUARD,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let mut ws = Workspace::new();
    fuzz(
        Target {
            name: "unpack",
            max_len: 64 * 1024,
            tokens: UNPACK_TOKENS,
            blocks: Some((512, 1, TAR_FIELDS)),
            structured: Some(mutate_tar),
            units: Some(|input| {
                input
                    .get(1..)
                    .map(tar_entries)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(a, b)| (a + 1, b + 1))
                    .collect()
            }),
            text: false,
        },
        |input| unpack_one(&mut ws, input),
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Image references.
// ---------------------------------------------------------------------------------------------

#[rustfmt::skip]
const NAME_TOKENS: &[&[u8]] = &[
    b"/", b":", b"@", b"sha256:", b"sha512:", b"docker.io/", b"index.docker.io/", b"library/",
    b"localhost", b"localhost:5000/", b"[::1]", b"__", b"--", b".", b"-", b"_", b"latest",
    b"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
];

#[test]
fn fuzz_image_name() {
    use hako::image::Name;
    fuzz(
        Target {
            name: "name",
            max_len: 512,
            tokens: NAME_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: true,
        },
        |input| {
            let s = String::from_utf8_lossy(input);
            match Name::parse(&s) {
                Ok(n) => {
                    let text = n.canonical();
                    match Name::parse(&text) {
                        Ok(again) if again == n => Ok(format!(
                            "ok tag={} digest={}",
                            n.tag.is_some(),
                            n.digest.is_some()
                        )),
                        other => Err(format!(
                            "round trip: {s:?} parses to {n:?}, whose text {text:?} parses to {other:?}"
                        )),
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    if !msg.contains(&format!("{s:?}")) {
                        return Err(format!("unnamed: error {msg:?} does not name {s:?}"));
                    }
                    Ok(normalize(&msg))
                }
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 3. hosts.toml.
// ---------------------------------------------------------------------------------------------

#[rustfmt::skip]
const HOSTS_TOKENS: &[&[u8]] = &[
    b"server = ", b"[host.\"", b"\"]\n", b"[host.\"https://m.io\".header]\n", b"\n",
    b"capabilities = [\"pull\", \"resolve\", \"push\"]\n", b"skip_verify = true\n", b"ca = ",
    b"client = ", b"header", b"override_path = true\n", b"[[", b"]]", b"{", b"}", b"=", b"\"",
    b"'''", b"\"\"\"", b"https://", b"http://", b"/v2", b"[", b"]", b",", b"#",
];

#[test]
fn fuzz_hosts_toml() {
    use hako::image::hosts::{endpoints, Endpoint};
    let dir = tempfile::tempdir().unwrap();
    let registry = "registry.example:5000";
    let file = dir.path().join(registry).join("hosts.toml");
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let shown = file.display().to_string();
    fuzz(
        Target {
            name: "hosts",
            max_len: 4096,
            tokens: HOSTS_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: true,
        },
        |input| {
            // Valid UTF-8 unless the input starts with 0xff: the unreadable file is one
            // outcome, the parser is the rest.
            if input.first() == Some(&0xff) {
                std::fs::write(&file, input).unwrap();
            } else {
                std::fs::write(&file, String::from_utf8_lossy(input).as_bytes()).unwrap();
            }
            match endpoints(dir.path(), registry) {
                Ok(eps) => {
                    let Some((server, mirrors)) = eps.split_last() else {
                        return Err("shape: no endpoints".into());
                    };
                    if server.mirror || mirrors.iter().any(|m| !m.mirror) {
                        return Err(format!("shape: the server is not last, alone: {eps:?}"));
                    }
                    for e in &eps {
                        if e.host.is_empty() || e.host.contains('/') {
                            return Err(format!(
                                "shape: host {:?} of {}",
                                e.host,
                                Endpoint::url(e)
                            ));
                        }
                        if let Some(ca) = e.ca_files.iter().find(|c| c.is_relative()) {
                            return Err(format!("shape: relative CA path {ca:?}"));
                        }
                    }
                    Ok(format!("ok {} endpoints", eps.len().min(4)))
                }
                Err(e) => {
                    let msg = error_chain(&e);
                    if !msg.contains(&shown) {
                        return Err(format!("unnamed: error {msg:?} does not name the file"));
                    }
                    Ok(normalize(&msg.replace(&shown, "FILE")))
                }
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 4. CDI specs and device names.
// ---------------------------------------------------------------------------------------------

/// Values that CDI fields (names, paths, versions, ids) are often wrong with.
const JSON_VALUES: &[&str] = &[
    r#""""#,
    r#""/""#,
    r#""a""#,
    r#""/dev/x""#,
    r#""A=1""#,
    r#""=""#,
    r#""vendor.com/class""#,
    r#""0.3.0""#,
    r#""0.6.0""#,
    r#""1.0.9""#,
    r#""2.0.0""#,
    r#""c""#,
    r#""rwm""#,
    r#""createContainer""#,
    "0",
    "-1",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "1.5",
    "true",
    "null",
    "[]",
    "{}",
    r#"["a"]"#,
    r#"{"a":"b"}"#,
];

/// Edits a JSON document node by node (a value replaced, an array element dropped or
/// repeated, a key dropped or renamed to a CDI field), keeping it valid JSON, which YAML
/// reads as well.
fn mutate_json(rng: &mut Rng, input: &mut Vec<u8>, _pool: &[Vec<u8>]) {
    use serde_json::Value;
    let Ok(mut doc) = serde_json::from_slice::<Value>(input) else {
        return;
    };
    // Count the nodes, pick one, then walk to it again to change it. Half the time only
    // strings are picked (names, paths, versions: where most checks are), and given a string.
    fn count(v: &Value, pick: fn(&Value) -> bool) -> usize {
        usize::from(pick(v))
            + match v {
                Value::Array(a) => a.iter().map(|c| count(c, pick)).sum(),
                Value::Object(o) => o.values().map(|c| count(c, pick)).sum(),
                _ => 0,
            }
    }
    fn nth<'a>(v: &'a mut Value, n: &mut usize, pick: fn(&Value) -> bool) -> Option<&'a mut Value> {
        if pick(v) {
            if *n == 0 {
                return Some(v);
            }
            *n -= 1;
        }
        match v {
            Value::Array(a) => a.iter_mut().find_map(|c| nth(c, n, pick)),
            Value::Object(o) => o.values_mut().find_map(|c| nth(c, n, pick)),
            _ => None,
        }
    }
    let strings = rng.chance(2);
    let pick: fn(&Value) -> bool = if strings { Value::is_string } else { |_| true };
    let total = count(&doc, pick);
    if total == 0 {
        return;
    }
    let mut n = rng.below(total);
    let Some(node) = nth(&mut doc, &mut n, pick) else {
        return;
    };
    match node {
        Value::Array(a) if !a.is_empty() && rng.chance(2) => {
            let i = rng.below(a.len());
            if rng.chance(2) {
                a.remove(i);
            } else {
                let e = a[i].clone();
                a.insert(rng.below(a.len() + 1), e);
            }
        }
        Value::Object(o) if !o.is_empty() && rng.chance(2) => {
            let key = o.keys().nth(rng.below(o.len())).cloned().unwrap();
            let v = o.remove(&key).unwrap();
            if rng.chance(2) {
                let fields = CDI_SPEC_TOKENS
                    .iter()
                    .filter(|t| t.iter().all(u8::is_ascii_alphabetic));
                let names: Vec<_> = fields.collect();
                let name = String::from_utf8_lossy(names[rng.below(names.len())]).into_owned();
                o.insert(name, v);
            }
        }
        _ => {
            let values: Vec<&str> = JSON_VALUES
                .iter()
                .copied()
                .filter(|v| !strings || v.starts_with('"'))
                .collect();
            *node = serde_json::from_str(values[rng.below(values.len())]).expect("a JSON value");
        }
    }
    *input = if rng.chance(2) {
        serde_json::to_vec_pretty(&doc).unwrap()
    } else {
        serde_json::to_vec(&doc).unwrap()
    };
}

#[rustfmt::skip]
const CDI_SPEC_TOKENS: &[&[u8]] = &[
    b"cdiVersion", b"\"1.0.0\"", b"0.3.0", b"0.7.0", b"kind", b"vendor.com/class", b"devices",
    b"containerEdits", b"deviceNodes", b"mounts", b"hooks", b"env", b"netDevices",
    b"additionalGIDs", b"intelRdt", b"annotations", b"hostPath", b"containerPath", b"hookName",
    b"path", b"name", b"type", b"permissions", b"fileMode", b"major", b"/dev/x",
    b"createContainer", b"{", b"}", b"[", b"]", b": ", b",", b"\n  - ", b"\n    ", b"&a ",
    b"*a", b"!!binary ", b"<<: ", b"---\n", b"null", b"~", b"true", b"\"", b"'",
];

#[test]
fn fuzz_cdi_spec() {
    use hako_runtime::cdi::{parse_qualified, parse_spec};
    fuzz(
        Target {
            name: "cdi_spec",
            max_len: 8192,
            tokens: CDI_SPEC_TOKENS,
            blocks: None,
            structured: Some(mutate_json),
            units: None,
            text: true,
        },
        |input| {
            let text = String::from_utf8_lossy(input);
            let mut outcome = String::new();
            // Every input through both parsers: YAML by extension, JSON otherwise.
            for file in ["spec.yaml", "spec.json"] {
                match parse_spec(Path::new(file), &text) {
                    Ok(spec) => {
                        for d in &spec.devices {
                            let q = format!("{}={}", spec.kind, d.name);
                            match parse_qualified(&q) {
                                Ok((k, n)) if k == spec.kind && n == d.name => {}
                                other => {
                                    return Err(format!(
                                        "names: device {q:?} of a valid spec parses as {other:?}"
                                    ))
                                }
                            }
                        }
                        outcome.push_str(&format!("{file} ok; "));
                    }
                    Err(e) => outcome.push_str(&format!("{file} {}; ", normalize(&e.to_string()))),
                }
            }
            Ok(outcome)
        },
    );
}

#[rustfmt::skip]
const CDI_NAME_TOKENS: &[&[u8]] = &[
    b"=", b"/", b".", b"-", b"_", b":", b"vendor.com", b"class", b"name",
];

#[test]
fn fuzz_cdi_name() {
    use hako_runtime::cdi::parse_qualified;
    fuzz(
        Target {
            name: "cdi_name",
            max_len: 256,
            tokens: CDI_NAME_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: true,
        },
        |input| {
            let s = String::from_utf8_lossy(input);
            match parse_qualified(&s).map_err(|e| e.to_string()) {
                Ok((kind, name)) => {
                    if format!("{kind}={name}") != s || kind.matches('/').count() != 1 {
                        return Err(format!(
                            "round trip: {s:?} splits into {kind:?} and {name:?}"
                        ));
                    }
                    Ok("ok".into())
                }
                Err(e) if e.contains(&format!("{s:?}")) => Ok(normalize(&e)),
                Err(e) => Err(format!("unnamed: error {e:?} does not name {s:?}")),
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Monitor wire framing.
// ---------------------------------------------------------------------------------------------

/// Records the largest single allocation a thread asks for while `WATCHING` is set.
struct WatchAlloc;

thread_local! {
    static WATCHING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = WATCHING.try_with(|w| {
        if w.get() {
            let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
        }
    });
}

// SAFETY: every call is passed on to the system allocator unchanged; the watch only reads the
// size into a thread-local that needs no allocation.
unsafe impl GlobalAlloc for WatchAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        note_alloc(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        note_alloc(l.size());
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        note_alloc(new);
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static ALLOC: WatchAlloc = WatchAlloc;

/// Polls a future to completion on this thread (the readers here never wait on anything).
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// A stream that hands out at most `chunk` bytes per read and, if `pending`, says "not yet"
/// every other time: reads split anywhere, as on a socket.
struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
    pending: bool,
    flip: bool,
}

impl tokio::io::AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pending {
            this.flip = !this.flip;
            if this.flip {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        let n = this.chunk.min(buf.remaining()).min(this.data.len());
        buf.put_slice(&this.data[..n]);
        this.data = &this.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Input: the max-size choice, the read pattern, a tag, then the byte stream.
fn wire_one(input: &[u8]) -> RunResult {
    use hako_runtime::monitor::wire::{read_frame_max, write_frame, MAX_FRAME, MAX_REQUEST};
    if input.len() < 3 {
        return Ok("short input".into());
    }
    let max = [0, 1, 2, 5, 16, 255, MAX_REQUEST, MAX_FRAME][input[0] as usize % 8];
    let chunk = (input[1] & 0x3f) as usize + 1;
    let pending = input[1] & 0x40 != 0;
    let tag = input[2];
    let stream = &input[3..];

    // Every frame in the stream, read the way the monitor and the daemon read, against the
    // format's definition.
    let mut r = Chunked {
        data: stream,
        chunk,
        pending,
        flip: false,
    };
    let mut at = 0;
    let mut frames = 0;
    loop {
        LARGEST.with(|m| m.set(0));
        WATCHING.with(|w| w.set(true));
        let got = block_on(read_frame_max(&mut r, max));
        WATCHING.with(|w| w.set(false));
        let largest = LARGEST.with(Cell::get);
        // The error text is a few dozen bytes; anything else is the frame buffer.
        if largest > max.max(128) {
            return Err(format!(
                "allocation: read_frame_max with max {max} allocated {largest} bytes at once"
            ));
        }
        let rest = &stream[at..];
        let expected = if rest.len() < 4 {
            Err(io::ErrorKind::UnexpectedEof)
        } else {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            if len == 0 || len > max {
                Err(io::ErrorKind::InvalidData)
            } else if rest.len() < 4 + len {
                Err(io::ErrorKind::UnexpectedEof)
            } else {
                Ok((rest[4], rest[5..4 + len].to_vec()))
            }
        };
        match (&got, &expected) {
            (Ok(g), Ok(e)) if g == e => {
                at += 4 + 1 + g.1.len();
                frames += 1;
            }
            (Err(g), Err(e)) if g.kind() == *e => {
                if *e == io::ErrorKind::InvalidData {
                    let len = u32::from_be_bytes(rest[..4].try_into().unwrap());
                    if !g.to_string().contains(&len.to_string()) {
                        return Err(format!("unnamed: refusal {g:?} does not give the length {len}"));
                    }
                }
                break;
            }
            _ => {
                return Err(format!(
                    "framing: at byte {at} with max {max}, read gave {got:?}, the format says {expected:?}"
                ))
            }
        }
    }

    // Round trip: what write_frame writes, read_frame_max gives back, exactly at its limit.
    let body = stream;
    let mut out = Vec::new();
    block_on(write_frame(&mut out, tag, body)).map_err(|e| format!("round trip: write: {e}"))?;
    let mut expected = ((body.len() + 1) as u32).to_be_bytes().to_vec();
    expected.push(tag);
    expected.extend_from_slice(body);
    if out != expected {
        return Err(format!(
            "round trip: write_frame wrote {} bytes, not the frame",
            out.len()
        ));
    }
    let read = |max| {
        block_on(read_frame_max(
            &mut Chunked {
                data: &out,
                chunk,
                pending,
                flip: false,
            },
            max,
        ))
    };
    match read(body.len() + 1) {
        Ok((t, b)) if t == tag && b == body => {}
        other => return Err(format!("round trip: read back {other:?}")),
    }
    if read(body.len()).is_ok() {
        return Err(format!(
            "round trip: a frame of {} bytes passed max {}",
            body.len() + 1,
            body.len()
        ));
    }
    Ok(format!(
        "{} frames then {}",
        frames.min(3),
        if at == stream.len() { "eof" } else { "refused" }
    ))
}

#[rustfmt::skip]
const WIRE_TOKENS: &[&[u8]] = &[
    b"\x00\x00\x00\x00", b"\x00\x00\x00\x01", b"\x00\x00\x00\x06", b"\xff\xff\xff\xff",
    b"\x02\x01\x00\x00", b"\x00\x10\x00\x01",
];

#[test]
fn fuzz_monitor_wire() {
    fuzz(
        Target {
            name: "wire",
            max_len: 4096,
            tokens: WIRE_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: false,
        },
        wire_one,
    );
}

// ---------------------------------------------------------------------------------------------
// 6. The CRI log writer.
// ---------------------------------------------------------------------------------------------

/// Input: a list of writes. Op byte bit 0: stream (stdout, stderr); bit 1: 0 = literal (next
/// byte: length, then the bytes), 1 = run (next two bytes: big-endian length, then the byte
/// repeated), which reaches the 16 KiB line limit from a small input.
fn log_ops(input: &[u8]) -> Vec<(usize, Vec<u8>)> {
    let mut ops = Vec::new();
    let mut i = 0;
    let mut total = 0;
    while i < input.len() && total < 128 << 10 {
        let op = input[i];
        let s = (op & 1) as usize;
        let data = if op & 2 == 0 {
            let n = *input.get(i + 1).unwrap_or(&0) as usize;
            let from = (i + 2).min(input.len());
            let to = (from + n).min(input.len());
            i = to;
            input[from..to].to_vec()
        } else {
            let n = u16::from_be_bytes([
                *input.get(i + 1).unwrap_or(&0),
                *input.get(i + 2).unwrap_or(&0),
            ]) as usize;
            let b = *input.get(i + 3).unwrap_or(&b'x');
            i += 4;
            vec![b; n]
        };
        total += data.len();
        ops.push((s, data));
    }
    ops
}

fn is_rfc3339_nanos(ts: &[u8]) -> bool {
    // 2026-11-21T21:30:00.123456789Z
    const PATTERN: &[u8] = b"dddd-dd-ddTdd:dd:dd.dddddddddZ";
    ts.len() == PATTERN.len()
        && ts.iter().zip(PATTERN).all(|(c, p)| {
            if *p == b'd' {
                c.is_ascii_digit()
            } else {
                c == p
            }
        })
}

fn logs_one(dir: &Path, input: &[u8]) -> RunResult {
    use hako_runtime::logs::{LogWriter, Stream, MAX_LINE};
    let path = dir.join("0.log");
    let _ = std::fs::remove_file(&path);
    let streams = [Stream::Stdout, Stream::Stderr];
    let mut written: [Vec<u8>; 2] = Default::default();
    let mut w = LogWriter::open(&path).map_err(|e| format!("open: {e}"))?;
    for (s, data) in log_ops(input) {
        w.write(streams[s], &data)
            .map_err(|e| format!("write: {e}"))?;
        written[s].extend_from_slice(&data);
    }
    for s in streams {
        w.close_stream(s).map_err(|e| format!("close: {e}"))?;
    }
    drop(w);
    let file = std::fs::read(&path).map_err(|e| format!("read: {e}"))?;
    if !file.is_empty() && !file.ends_with(b"\n") {
        return Err("format: the file does not end with a newline".into());
    }
    let mut back: [Vec<u8>; 2] = Default::default();
    let mut records = 0;
    for line in file.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        records += 1;
        let mut parts = line.splitn(4, |&b| b == b' ');
        let (ts, stream, tag, text) = (parts.next(), parts.next(), parts.next(), parts.next());
        let bad = || {
            format!(
                "format: record {records} {:?}",
                String::from_utf8_lossy(line)
            )
        };
        let (Some(ts), Some(stream), Some(tag), Some(text)) = (ts, stream, tag, text) else {
            return Err(bad());
        };
        if !is_rfc3339_nanos(ts) || text.len() > MAX_LINE {
            return Err(bad());
        }
        let s = match stream {
            b"stdout" => 0,
            b"stderr" => 1,
            _ => return Err(bad()),
        };
        back[s].extend_from_slice(text);
        match tag {
            b"F" => back[s].push(b'\n'),
            b"P" => {}
            _ => return Err(bad()),
        }
    }
    for s in 0..2 {
        if back[s] != written[s] {
            let i = back[s]
                .iter()
                .zip(&written[s])
                .position(|(a, b)| a != b)
                .unwrap_or(back[s].len().min(written[s].len()));
            let show = |v: &[u8]| {
                String::from_utf8_lossy(&v[i.saturating_sub(8)..(i + 8).min(v.len())]).into_owned()
            };
            return Err(format!(
                "round trip: {:?}: wrote {} bytes, the records give back {}; they differ from byte {i}: wrote …{:?}…, records give …{:?}…",
                streams[s],
                written[s].len(),
                back[s].len(),
                show(&written[s]),
                show(&back[s]),
            ));
        }
    }
    Ok(format!("ok, {} records", records.min(5)))
}

#[rustfmt::skip]
const LOGS_TOKENS: &[&[u8]] = &[
    b"\n", b"\r\n", b"\x02\x40\x00", b"\x03\x3f\xff", b"\x02\x40\x01", b"\x00\x01\n",
];

#[test]
fn fuzz_log_writer() {
    let dir = tempfile::tempdir().unwrap();
    fuzz(
        Target {
            name: "logs",
            max_len: 2048,
            tokens: LOGS_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: false,
        },
        |input| logs_one(dir.path(), input),
    );
}

// ---------------------------------------------------------------------------------------------
// 7. SPDY/3.1 frames (the streaming server's framing and header compression).
// ---------------------------------------------------------------------------------------------

#[rustfmt::skip]
const SPDY_TOKENS: &[&[u8]] = &[
    b"\x80\x03\x00\x01", b"\x80\x03\x00\x02", b"\x80\x03\x00\x03", b"\x80\x03\x00\x04",
    b"\x80\x03\x00\x06", b"\x80\x03\x00\x07", b"\x80\x03\x00\x08", b"\x80\x03\x00\x09",
    b"\x00\x00\x00\x01", b"\x78\xbb\xe3\xc6\xa7\xc2", b"\x00\x00\xff\xff", b"streamtype",
];

/// The stream is cut into frames as the connection reads it; every frame one codec (whose
/// compression state carries across frames) decodes must encode and decode back to itself.
#[test]
fn fuzz_spdy_frames() {
    use hako::streaming::spdy::{Codec, Frame};
    fuzz(
        Target {
            name: "spdy",
            max_len: 4096,
            tokens: SPDY_TOKENS,
            blocks: None,
            structured: None,
            units: None,
            text: false,
        },
        |input| {
            let mut rx = Codec::new();
            let (mut tx2, mut rx2) = (Codec::new(), Codec::new());
            let mut rest = input;
            let mut frames = 0;
            while rest.len() >= 8 {
                let head: [u8; 8] = rest[..8].try_into().unwrap();
                let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
                let Some(payload) = rest.get(8..8 + len) else {
                    return Ok(format!("truncated after {frames} frames"));
                };
                rest = &rest[8 + len..];
                let frame = match rx.decode(head, payload) {
                    Ok(f) => f,
                    // The connection ends at the first bad frame.
                    Err(e) => return Ok(normalize(&e.to_string())),
                };
                frames += 1;
                let bytes = tx2
                    .encode(&frame)
                    .map_err(|e| format!("encode: {frame:?} does not encode: {e}"))?;
                let again = rx2
                    .decode(bytes[..8].try_into().unwrap(), &bytes[8..])
                    .map_err(|e| {
                        format!("round trip: {frame:?} encodes to bytes that fail: {e}")
                    })?;
                if again != frame {
                    return Err(format!("round trip: {frame:?} comes back as {again:?}"));
                }
                if let Frame::Data { .. } = frame {
                    continue;
                }
            }
            Ok(format!("{frames} frames"))
        },
    );
}
