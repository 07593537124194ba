//! The monitor's log: one line per event in the pod's `monitor.log`, filtered by level and
//! target. tracing-subscriber's registry and env filter cost each idle monitor ~35 KiB of heap
//! and their code; a monitor logs a handful of lines in its life.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::atomic::{AtomicI32, Ordering};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{span, Event, Level, Metadata, Subscriber};

struct MonitorLog {
    filter: Filter,
    out: fn(&[u8]),
}

/// The monitor's log file, as its own fd (close-on-exec): libcontainer logs from the helper,
/// intermediate and init processes it forks, and by the time init logs, fd 2 is the
/// container's stderr. Through this fd their lines reach `monitor.log`, not the container's
/// CRI log. -1 until `init`.
static LOG_FD: AtomicI32 = AtomicI32::new(-1);

fn to_log_fd(line: &[u8]) {
    match LOG_FD.load(Ordering::Relaxed) {
        fd if fd >= 0 => {
            // SAFETY: the fd was dup'ed for this purpose in `init` and is never closed here.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            let _ = nix::unistd::write(fd, line);
        }
        _ => {
            let _ = std::io::stderr().write_all(line);
        }
    }
}

/// The monitor log's fd, for the helpers that keep it (-1 before `init`).
pub(super) fn fd() -> i32 {
    LOG_FD.load(Ordering::Relaxed)
}

/// `HAKO_LOG` directives without spans or fields: `level` and `target=level`, comma
/// separated; the longest matching target prefix decides, then the bare level; with neither,
/// nothing. Targets matter: libcontainer logs from inside the processes it makes, whose stderr
/// is the container's, so its events must stay off unless asked for.
#[derive(Debug, PartialEq)]
struct Filter {
    default: Option<Level>,
    targets: Vec<(String, Option<Level>)>,
}

fn level(name: &str) -> Option<Level> {
    match name.trim().to_ascii_lowercase().as_str() {
        "trace" => Some(Level::TRACE),
        "debug" => Some(Level::DEBUG),
        "info" => Some(Level::INFO),
        "warn" => Some(Level::WARN),
        "error" => Some(Level::ERROR),
        _ => None,
    }
}

impl Filter {
    fn parse(spec: &str) -> Filter {
        let mut f = Filter {
            default: None,
            targets: Vec::new(),
        };
        for d in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            match d.split_once('=') {
                Some((target, l)) => f.targets.push((target.to_string(), level(l))),
                None => match level(d) {
                    Some(l) => f.default = Some(l),
                    // A bare target enables all of its levels.
                    None => f.targets.push((d.to_string(), Some(Level::TRACE))),
                },
            }
        }
        f
    }

    fn max(&self, target: &str) -> Option<Level> {
        self.targets
            .iter()
            .filter(|(t, _)| target.starts_with(t.as_str()))
            .max_by_key(|(t, _)| t.len())
            .map(|(_, l)| *l)
            .unwrap_or(self.default)
    }

    fn most_verbose(&self) -> LevelFilter {
        self.targets
            .iter()
            .map(|(_, l)| *l)
            .chain([self.default])
            .flatten()
            .max()
            .map(LevelFilter::from_level)
            .unwrap_or(LevelFilter::OFF)
    }
}

/// Installs the monitor's logger with the daemon's filter (`HAKO_LOG`; empty: `info`).
pub fn init(filter: &str) {
    let filter = if filter.trim().is_empty() {
        "info"
    } else {
        filter
    };
    // Above the fds the monitor and libcontainer hand around.
    if let Ok(fd) = nix::fcntl::fcntl(2, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(100)) {
        LOG_FD.store(fd, Ordering::Relaxed);
    }
    let _ = tracing::subscriber::set_global_default(MonitorLog {
        filter: Filter::parse(filter),
        out: to_log_fd,
    });
}

struct Line(String);

impl Visit for Line {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.0, " {value:?}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
}

impl Subscriber for MonitorLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        self.filter
            .max(metadata.target())
            .is_some_and(|max| metadata.level() <= &max)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.filter.most_verbose())
    }

    // Spans carry nothing the monitor's lines need.
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line(format!(
            "{} {:>5} {}:",
            crate::logs::rfc3339_nanos(std::time::SystemTime::now()),
            meta.level(),
            meta.target()
        ));
        event.record(&mut line);
        line.0.push('\n');
        (self.out)(line.0.as_bytes());
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    static CAPTURED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

    fn capture(line: &[u8]) {
        CAPTURED.lock().unwrap().extend_from_slice(line);
    }

    #[test]
    fn lines_have_time_level_target_message_and_fields_and_honour_the_level() {
        let log = MonitorLog {
            filter: Filter::parse("hako_runtime=warn,libcontainer=off"),
            out: capture,
        };
        tracing::subscriber::with_default(log, || {
            tracing::info!("dropped: below warn");
            tracing::error!(target: "libcontainer::process", "dropped: target off");
            tracing::warn!(container = "abc", code = 3, "container exited");
        });
        let text = String::from_utf8(CAPTURED.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let (time, rest) = lines[0].split_once(' ').unwrap();
        assert!(time.ends_with('Z') && time.contains('T'), "{time}");
        assert_eq!(
            rest,
            " WARN hako_runtime::monitor::log::tests: container exited container=\"abc\" code=3"
        );
    }

    #[test]
    fn the_longest_matching_target_decides_then_the_bare_level() {
        let f = Filter::parse("warn,hako=debug,hako::pods=error");
        assert_eq!(f.max("hako_runtime::monitor"), Some(Level::DEBUG));
        assert_eq!(f.max("hako::pods"), Some(Level::ERROR));
        assert_eq!(f.max("libcontainer"), Some(Level::WARN));
        assert_eq!(f.most_verbose(), LevelFilter::DEBUG);
        let only = Filter::parse("hako=debug");
        assert_eq!(only.max("libcontainer::process"), None);
        assert_eq!(Filter::parse("").most_verbose(), LevelFilter::OFF);
    }
}
