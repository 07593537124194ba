use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use hako::config::{Config, DEFAULT_CONFIG_PATH};

#[derive(Parser)]
#[command(
    name = "hako",
    version,
    about = "A Kubernetes CRI runtime with an embedded OCI executor"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the CRI daemon.
    Serve {
        /// Config file [default: /etc/hako/config.toml, which may be absent].
        #[arg(long)]
        config: Option<PathBuf>,
        /// CRI socket path (overrides `listen`).
        #[arg(long)]
        listen: Option<PathBuf>,
        /// Persistent data directory (overrides `root`).
        #[arg(long)]
        root: Option<PathBuf>,
        /// Volatile state directory (overrides `state`).
        #[arg(long)]
        state: Option<PathBuf>,
        /// Log filter, e.g. `info` or `hako=debug` [default: $HAKO_LOG or info].
        #[arg(long)]
        log_level: Option<String>,
    },
    /// Configuration helpers.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Print the version.
    Version,
    /// A pod's monitor process (started by `hako serve`, not by hand).
    #[command(hide = true)]
    Monitor {
        /// The monitor options, as JSON.
        #[arg(long)]
        options: String,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print the full default config.
    Default,
}

fn main() -> ExitCode {
    // The daemon's exact form skips clap: its parser is ~200 KiB of code every monitor would
    // map for one parse. Any other form (`hako monitor --help`) goes through clap.
    let args: Vec<std::ffi::OsString> = std::env::args_os().take(5).collect();
    // A CDI hook run through hako (see hako_runtime::cdi::apply): its arguments are the
    // hook's own, never hako's options.
    if args.get(1).is_some_and(|a| a == "cdi-hook") {
        let all: Vec<std::ffi::OsString> = std::env::args_os().skip(2).collect();
        let code = hako_runtime::cdi::hook_main(&all);
        return ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    if args.len() == 4 && args[1] == "monitor" && args[2] == "--options" {
        return monitor(&args[3].to_string_lossy());
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Version => {
            println!("hako {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        Command::Monitor { options } => monitor(&options),
        Command::Config {
            command: ConfigCommand::Default,
        } => {
            print!("{}", Config::default_toml());
            ExitCode::SUCCESS
        }
        Command::Serve {
            config,
            listen,
            root,
            state,
            log_level,
        } => {
            init_logging(log_level);
            let explicit = config.is_some();
            let path = config.unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
            let mut cfg = match Config::load(&path, explicit) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("hako: {}", hako::error::chain(&e));
                    return ExitCode::from(2);
                }
            };
            if let Some(l) = listen {
                cfg.listen = l;
            }
            if let Some(r) = root {
                cfg.root = r;
            }
            if let Some(s) = state {
                cfg.state = s;
            }
            // Whatever umask the daemon was started with, what it creates is its own: the few
            // things others must read (the socket, CRI logs, a container's root and
            // /etc/hosts) get their modes set explicitly. Children (monitors, CNI plugins)
            // set theirs back to 022.
            nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
            limit_malloc_arenas();
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            // For tests: a pool this small stands for one that other work has filled.
            if let Some(n) = std::env::var("HAKO_MAX_BLOCKING_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n > 0)
            {
                rt.max_blocking_threads(n);
            }
            let rt = rt.enable_all().build().expect("tokio runtime");
            match rt.block_on(hako::daemon::serve(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %hako::error::chain(&e), "hako serve failed");
                    eprintln!("hako: {}", hako::error::chain(&e));
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// `hako monitor`: one pod's monitor, started by the daemon.
fn monitor(options: &str) -> ExitCode {
    // The daemon runs with umask 077; containers and what libcontainer makes inside their
    // root filesystems (mount targets, /dev) expect the usual 022, as under runc.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    // A session of its own: what is sent to the daemon's terminal or process group is not
    // the pod's business.
    let _ = nix::unistd::setsid();
    let ready = hako_runtime::monitor::take_ready_pipe();
    hako_runtime::monitor::log::init(&std::env::var("HAKO_LOG").unwrap_or_default());
    let opts: hako_runtime::monitor::Options = match serde_json::from_str(options) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("hako monitor: bad options: {e}");
            return ExitCode::from(2);
        }
    };
    match hako_runtime::monitor::run(opts, ready) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hako monitor: {}", e.chain());
            ExitCode::FAILURE
        }
    }
}

fn init_logging(level: Option<String>) {
    let filter = level
        .or_else(|| std::env::var("HAKO_LOG").ok())
        .unwrap_or_else(|| "info".into());
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// At most two glibc malloc arenas for the daemon, unless `MALLOC_ARENA_MAX` says otherwise.
/// glibc gives threads that allocate at the same time arenas of their own (up to 8 per core),
/// and the daemon's work moves between tokio's workers and its blocking threads, leaving freed
/// pages in each: with two, its RSS at 100 / 250 idle pods was 30.2 / 31.5 MiB instead of
/// 35.3 / 40.6 in one run (docs/BENCHMARKS.md). Called before any thread starts: arenas are
/// made as threads first allocate.
fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: mallopt only sets an allocator parameter; no other thread runs yet.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
    }
}
