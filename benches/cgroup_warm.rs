//! What keeping the kernel's cgroup-migration lock warm costs the rest of the node.
//!
//! `hako_runtime::cgroup_warm` keeps `cgroup_threadgroup_rwsem` in writer mode while holds are
//! alive (a no-op `cgroup.procs` write every 2 ms). Every fork and exit on the node takes that
//! lock for reading, so while it is warm they take its slow path. This measures a busy
//! neighbour — a process forking children that exit at once, as a shell script or a build
//! does — for a few seconds in each of these patterns, in turns:
//!
//! - `idle`: no hold (the lock cold);
//! - `held`: one hold for the whole window (what a burst of creates does);
//! - `probes`: a 10 ms hold every 100 ms (what ten exec probes a second would do if ExecSync
//!   took a hold, as it did before: the probe's exec holds while it runs).
//!
//! Run: `cargo bench --bench cgroup_warm` (as root, on the machine to measure; `-- --secs 5`
//! for longer windows, `--rounds N`). Prints forks per second per pattern and their ratio to
//! `idle`; figures in docs/BENCHMARKS.md.

use std::time::{Duration, Instant};

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Forks children that exit at once for `window`; returns forks per second. Runs in a child
/// process so the bench's own threads (the warming one) are not forked with it.
fn neighbour_rate(window: Duration) -> f64 {
    let (r, w) = nix::unistd::pipe().unwrap();
    // SAFETY: the child only forks, waits, writes to a pipe and exits.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            let start = Instant::now();
            let mut n: u64 = 0;
            while start.elapsed() < window {
                match unsafe { nix::unistd::fork() } {
                    Ok(nix::unistd::ForkResult::Child) => unsafe { libc::_exit(0) },
                    Ok(nix::unistd::ForkResult::Parent { child }) => {
                        let _ = nix::sys::wait::waitpid(child, None);
                        n += 1;
                    }
                    Err(_) => break,
                }
            }
            let rate = n as f64 / start.elapsed().as_secs_f64();
            let _ = nix::unistd::write(&w, &rate.to_ne_bytes());
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(w);
            let mut buf = [0u8; 8];
            let mut got = 0;
            while got < 8 {
                match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&r), &mut buf[got..]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            let _ = nix::sys::wait::waitpid(child, None);
            f64::from_ne_bytes(buf)
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    Idle,
    Held,
    Probes,
}

fn measure(p: Pattern, window: Duration) -> f64 {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver = {
        let stop = stop.clone();
        std::thread::spawn(move || match p {
            Pattern::Idle => {}
            Pattern::Held => {
                let _h = hako_runtime::cgroup_warm::hold();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            Pattern::Probes => {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    {
                        let _h = hako_runtime::cgroup_warm::hold();
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    std::thread::sleep(Duration::from_millis(90));
                }
            }
        })
    };
    // Let the pattern set in (a first grace period) before counting.
    std::thread::sleep(Duration::from_millis(50));
    let rate = neighbour_rate(window);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    driver.join().unwrap();
    // The warming thread stops within 2 ms of the last hold; the lock cools a grace period
    // later.
    std::thread::sleep(Duration::from_millis(200));
    rate
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("cgroup_warm bench: run as root (the no-op migration writes cgroup.procs)");
        return;
    }
    let window = Duration::from_secs(arg("--secs", 3));
    let rounds = arg("--rounds", 3) as usize;
    let patterns = [Pattern::Idle, Pattern::Held, Pattern::Probes];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); patterns.len()];
    for round in 0..rounds {
        for (i, p) in patterns.iter().enumerate() {
            let r = measure(*p, window);
            eprintln!("round {round}: {p:?}: {r:.0} forks/s");
            rates[i].push(r);
        }
    }
    let idle = median(rates[0].clone());
    println!(
        "neighbour forks+exits per second (median of {rounds} rounds of {} s):",
        window.as_secs()
    );
    for (i, p) in patterns.iter().enumerate() {
        let m = median(rates[i].clone());
        println!(
            "  {:<7} {:>8.0}/s  {:>5.1}% of idle",
            format!("{p:?}").to_lowercase(),
            m,
            100.0 * m / idle
        );
    }
}
