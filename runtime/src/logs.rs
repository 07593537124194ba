//! The CRI log format kubelet reads: one record per line,
//! `<RFC3339Nano time> <stdout|stderr> <P|F> <content>\n`. A line longer than `MAX_LINE` is
//! split into partial (`P`) records ending in a full (`F`) one, as containerd does. The file is
//! reopened on kubelet's `ReopenContainerLog` (after it renamed the old one for rotation).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// containerd's `max_container_log_line_size` default.
pub const MAX_LINE: usize = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// RFC 3339 with nanoseconds, UTC (`2026-11-21T21:30:00.123456789Z`).
pub fn rfc3339_nanos(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since the epoch (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
}

/// Writes both streams of one container to its CRI log file.
pub struct LogWriter {
    path: PathBuf,
    file: Option<File>,
    pending: [Vec<u8>; 2],
}

/// Opens (creating) a CRI log file: never through a symlink at its last component (the log
/// dir is the pod's; a link there must not make the monitor append to another file), 0640 as
/// containerd makes them. A file already there keeps its mode, as with containerd and CRI-O:
/// the path is the client's, and may name a file that is not a log.
fn open(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let open = |new: bool| {
        OpenOptions::new()
            .create_new(new)
            .append(true)
            .mode(0o640)
            // O_NONBLOCK: a FIFO placed there must not block the monitor in open.
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(path)
    };
    // O_EXCL first: a symlink there counts as existing, and O_NOFOLLOW then refuses it. A
    // file removed between the two opens (kubelet rotating) is created on the second round.
    let mut round = 0;
    let (f, created) = loop {
        round += 1;
        match open(true) {
            Ok(f) => break (f, true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => match open(false) {
                Ok(f) => break (f, false),
                Err(e) if e.kind() == io::ErrorKind::NotFound && round < 2 => {}
                Err(e) => return Err(e),
            },
            Err(e) => return Err(e),
        }
    };
    if !f.metadata()?.file_type().is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    if created {
        // Whatever the umask.
        f.set_permissions(std::fs::Permissions::from_mode(0o640))?;
    }
    Ok(f)
}

impl LogWriter {
    /// `path` empty: output is read and dropped.
    pub fn open(path: &Path) -> io::Result<LogWriter> {
        let file = if path.as_os_str().is_empty() {
            None
        } else {
            Some(open(path)?)
        };
        Ok(LogWriter {
            path: path.to_path_buf(),
            file,
            pending: [Vec::new(), Vec::new()],
        })
    }

    /// Reopens the file at the same path (kubelet rotated the old one away).
    pub fn reopen(&mut self) -> io::Result<()> {
        if self.file.is_some() {
            self.file = Some(open(&self.path)?);
        }
        Ok(())
    }

    /// Appends one record to `out`, stamped `ts`.
    fn record(out: &mut Vec<u8>, ts: &str, stream: Stream, tag: char, content: &[u8]) {
        out.extend_from_slice(ts.as_bytes());
        out.push(b' ');
        out.extend_from_slice(stream.name().as_bytes());
        out.push(b' ');
        out.push(tag as u8);
        out.push(b' ');
        out.extend_from_slice(content);
        out.push(b'\n');
    }

    /// Writes whole records in one system call: a reader never sees half a record, and a
    /// container printing short lines costs a write per read, not per line (`yes` made 16K
    /// writes for each 32 KiB read, on the monitor's CPU).
    fn emit(&mut self, out: &[u8]) -> io::Result<()> {
        match self.file.as_mut() {
            Some(f) if !out.is_empty() => f.write_all(out),
            _ => Ok(()),
        }
    }

    /// Takes output as it comes: complete lines become `F` records, over-long ones are cut
    /// into `P` records, an unfinished line waits for the rest. The records of one read share
    /// its time of arrival.
    pub fn write(&mut self, stream: Stream, data: &[u8]) -> io::Result<()> {
        let i = stream as usize;
        let mut buf = std::mem::take(&mut self.pending[i]);
        buf.extend_from_slice(data);
        let ts = rfc3339_nanos(SystemTime::now());
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &buf[start..start + nl];
            while line.len() > MAX_LINE {
                Self::record(&mut out, &ts, stream, 'P', &line[..MAX_LINE]);
                line = &line[MAX_LINE..];
            }
            Self::record(&mut out, &ts, stream, 'F', line);
            start += nl + 1;
        }
        let mut rest = &buf[start..];
        while rest.len() >= MAX_LINE {
            Self::record(&mut out, &ts, stream, 'P', &rest[..MAX_LINE]);
            rest = &rest[MAX_LINE..];
        }
        self.pending[i] = rest.to_vec();
        self.emit(&out)
    }

    /// The stream ended: an unfinished last line is written as a partial record, as containerd
    /// and CRI-O do. kubelet ends a line at an `F` record, so `F` would add a newline the
    /// container never wrote (`printf abcd` must read back as `abcd`).
    pub fn close_stream(&mut self, stream: Stream) -> io::Result<()> {
        let rest = std::mem::take(&mut self.pending[stream as usize]);
        let mut out = Vec::new();
        if !rest.is_empty() {
            let ts = rfc3339_nanos(SystemTime::now());
            Self::record(&mut out, &ts, stream, 'P', &rest);
        }
        self.emit(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(path: &Path) -> Vec<(String, String, String)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                let mut p = l.splitn(4, ' ');
                let _ts = p.next().unwrap();
                (
                    p.next().unwrap().into(),
                    p.next().unwrap().into(),
                    p.next().unwrap_or("").into(),
                )
            })
            .collect()
    }

    #[test]
    fn timestamps_are_rfc3339_nanos() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 5);
        assert_eq!(rfc3339_nanos(t), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(
            rfc3339_nanos(UNIX_EPOCH + std::time::Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000000000Z"
        );
        // Century and leap-year edges and the first day of months, checked against GNU date
        // (`date -u -d @SECS +%FT%T`).
        for (secs, want) in [
            (0, "1970-01-01T00:00:00"),
            (946_684_799, "1999-12-31T23:59:59"),
            (1_709_251_200, "2024-03-01T00:00:00"),
            (1_735_689_599, "2024-12-31T23:59:59"),
            (4_107_542_399, "2100-02-28T23:59:59"),
            (4_107_542_400, "2100-03-01T00:00:00"),
            (13_574_563_200, "2400-02-29T00:00:00"),
            (253_402_300_799, "9999-12-31T23:59:59"),
        ] {
            let t = UNIX_EPOCH + std::time::Duration::new(secs, 999_999_999);
            assert_eq!(rfc3339_nanos(t), format!("{want}.999999999Z"), "{secs}");
        }
    }

    #[test]
    fn a_long_line_in_one_write_is_cut_at_16_kib() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("0.log");
        let mut w = LogWriter::open(&p).unwrap();
        // containerd's default limit, spelled out: MAX_LINE itself is what is under test.
        let max = 16 * 1024;
        let mut data = vec![b'a'; max];
        data.push(b'\n');
        data.extend(vec![b'b'; 2 * max + 1]);
        data.push(b'\n');
        w.write(Stream::Stderr, &data).unwrap();
        let r: Vec<(String, usize)> = records(&p)
            .into_iter()
            .map(|(s, tag, content)| {
                assert_eq!(s, "stderr");
                (tag, content.len())
            })
            .collect();
        assert_eq!(
            r,
            [("F", max), ("P", max), ("P", max), ("F", 1)].map(|(t, n)| (t.to_string(), n))
        );
    }

    #[test]
    fn the_log_path_is_never_followed_through_a_symlink_or_a_fifo() {
        let d = tempfile::tempdir().unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::fs::write(&elsewhere, "untouched").unwrap();
        let link = d.path().join("0.log");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        assert!(LogWriter::open(&link).is_err(), "opened through a symlink");
        assert_eq!(std::fs::read_to_string(&elsewhere).unwrap(), "untouched");
        // A FIFO with no reader: opening it for writing must fail at once, not wait for one.
        let fifo = d.path().join("1.log");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(LogWriter::open(&fifo).map(|_| ()));
        });
        let res = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("opening a FIFO as the log blocked (not returned after 10 s)");
        assert!(res.is_err(), "a FIFO taken as the log file");
        // A regular file: created 0640.
        use std::os::unix::fs::PermissionsExt;
        let p = d.path().join("2.log");
        LogWriter::open(&p).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o640
        );
        // One already there (a client's path may name any file): appended to, mode kept.
        let p = d.path().join("3.log");
        std::fs::write(&p, "kept\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o604)).unwrap();
        let mut w = LogWriter::open(&p).unwrap();
        w.write(Stream::Stdout, b"new\n").unwrap();
        drop(w);
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o604);
        assert!(std::fs::read_to_string(&p).unwrap().starts_with("kept\n"));
    }

    #[test]
    fn lines_partials_and_streams() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c/0.log");
        let mut w = LogWriter::open(&p).unwrap();
        w.write(Stream::Stdout, b"hel").unwrap();
        w.write(Stream::Stderr, b"oops\n").unwrap();
        w.write(Stream::Stdout, b"lo\nnext").unwrap();
        let long = vec![b'x'; MAX_LINE + 10];
        w.write(Stream::Stdout, b"\n").unwrap();
        w.write(Stream::Stdout, &long).unwrap();
        w.write(Stream::Stdout, b"\n").unwrap();
        w.write(Stream::Stdout, b"tail").unwrap();
        w.close_stream(Stream::Stdout).unwrap();
        let r = records(&p);
        assert_eq!(r[0], ("stderr".into(), "F".into(), "oops".into()));
        assert_eq!(r[1], ("stdout".into(), "F".into(), "hello".into()));
        assert_eq!(r[2], ("stdout".into(), "F".into(), "next".into()));
        assert_eq!((r[3].1.as_str(), r[3].2.len()), ("P", MAX_LINE));
        assert_eq!((r[4].1.as_str(), r[4].2.len()), ("F", 10));
        assert_eq!(r[5], ("stdout".into(), "P".into(), "tail".into()));
    }

    #[test]
    fn an_unterminated_last_line_is_a_partial_record() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("0.log");
        let mut w = LogWriter::open(&p).unwrap();
        w.write(Stream::Stdout, b"abcd").unwrap();
        w.write(Stream::Stderr, b"whole\nhalf").unwrap();
        w.close_stream(Stream::Stdout).unwrap();
        w.close_stream(Stream::Stderr).unwrap();
        // Closing again, or a stream with nothing pending, writes nothing.
        w.close_stream(Stream::Stdout).unwrap();
        let r = records(&p);
        let want = [
            ("stderr", "F", "whole"),
            ("stdout", "P", "abcd"),
            ("stderr", "P", "half"),
        ]
        .map(|(s, t, c)| (s.to_string(), t.to_string(), c.to_string()));
        assert_eq!(r, want);
    }

    /// What `yes` writes, read 32 KiB at a time as the monitor's pump reads: every line a
    /// record, in order, lines split across reads joined. (`strace -c -e trace=write` of this
    /// test counts the writes: one per read, not one per line.)
    #[test]
    fn short_lines_in_many_reads_are_each_a_record() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("0.log");
        let mut w = LogWriter::open(&p).unwrap();
        let lines = 100_000;
        let out: Vec<u8> = (0..lines)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        for chunk in out.chunks(32 * 1024) {
            w.write(Stream::Stdout, chunk).unwrap();
        }
        let r = records(&p);
        assert_eq!(r.len(), lines);
        for (i, (stream, tag, content)) in r.iter().enumerate() {
            assert_eq!(
                (stream.as_str(), tag.as_str(), content.as_str()),
                ("stdout", "F", i.to_string().as_str())
            );
        }
    }

    #[test]
    fn reopen_continues_in_a_new_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("0.log");
        let mut w = LogWriter::open(&p).unwrap();
        w.write(Stream::Stdout, b"one\n").unwrap();
        std::fs::rename(&p, d.path().join("0.log.1")).unwrap();
        w.reopen().unwrap();
        w.write(Stream::Stdout, b"two\n").unwrap();
        assert_eq!(records(&d.path().join("0.log.1"))[0].2, "one");
        assert_eq!(records(&p)[0].2, "two");
    }
}
