//! The default seccomp profile, syscall by syscall, inside real containers. A small static C
//! program, compiled here with `cc -static`, tries each syscall of a table (each in a child of
//! its own, since some change the process) and prints `name errno` (0: it succeeded); busybox
//! containers run it from a read-only bind mount under RuntimeDefault, RuntimeDefault with
//! CAP_SYS_ADMIN, and Unconfined, both as the container's process and through ExecSync. The
//! same daemon shows how AppArmor requests fare on this host.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hako_proto::cri;
use nix::errno::Errno;
use support::cri::*;

const PROBE_C: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_io_uring_setup
#define SYS_io_uring_setup 425
#endif
#define CLONE_NEWUSER_ 0x10000000

static int err(long r) { return r < 0 ? errno : 0; }

/* A child that only exits, from fork-like calls; the caller reaps it. */
static int reap(long pid) {
    if (pid == 0) _exit(0);
    if (pid < 0) return errno;
    waitpid((pid_t)pid, NULL, 0);
    return 0;
}

static int p_getpid(void) { return err(syscall(SYS_getpid)); }
static int p_openat(void) { return err(syscall(SYS_openat, AT_FDCWD, "/", O_RDONLY | O_DIRECTORY)); }
static int p_write(void) {
    int fds[2];
    if (pipe(fds)) return errno;
    return err(syscall(SYS_write, fds[1], "x", 1));
}
static int p_read(void) {
    int fds[2];
    char c;
    if (pipe(fds) || write(fds[1], "x", 1) != 1) return errno;
    return err(syscall(SYS_read, fds[0], &c, 1));
}
static int p_mmap(void) {
    return err(syscall(SYS_mmap, NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
}
static int p_futex(void) { int w = 0; return err(syscall(SYS_futex, &w, 1 /* FUTEX_WAKE */, 1, NULL, NULL, 0)); }
static int p_clock_gettime(void) { struct timespec ts; return err(syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &ts)); }
static int p_epoll_create1(void) { return err(syscall(SYS_epoll_create1, 0)); }
static int p_getrandom(void) { char b[8]; return err(syscall(SYS_getrandom, b, sizeof b, 0)); }
static int p_fork(void) { return reap(fork()); }
static int p_clone(void) { return reap(syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0)); }
static int p_clone_newuser(void) { return reap(syscall(SYS_clone, CLONE_NEWUSER_ | SIGCHLD, 0, 0, 0, 0)); }
static int p_unshare_newuser(void) { return err(syscall(SYS_unshare, CLONE_NEWUSER_)); }
static int p_clone3(void) {
    uint64_t args[11];
    memset(args, 0, sizeof args);
    args[4] = SIGCHLD; /* exit_signal */
    return reap(syscall(SYS_clone3, args, sizeof args));
}
static int p_io_uring_setup(void) { unsigned char params[120]; memset(params, 0, sizeof params); return err(syscall(SYS_io_uring_setup, 1, params)); }
static int p_personality_linux(void) { return err(syscall(SYS_personality, 0x0)); }
static int p_personality_read_implies_exec(void) { return err(syscall(SYS_personality, 0x0400000)); }
static int p_keyctl(void) { return err(syscall(SYS_keyctl, 0 /* GET_KEYRING_ID */, -3 /* session */, 0)); }
static int p_add_key(void) { return err(syscall(SYS_add_key, "user", "hako-probe", "x", 1, -2 /* process */)); }
static int p_bpf(void) { return err(syscall(SYS_bpf, 0 /* MAP_CREATE */, NULL, 0)); }
static int p_perf_event_open(void) { return err(syscall(SYS_perf_event_open, NULL, 0, -1, -1, 0)); }
static int p_kexec_load(void) { return err(syscall(SYS_kexec_load, 0, 0, NULL, 0)); }
static int p_open_by_handle_at(void) { return err(syscall(SYS_open_by_handle_at, AT_FDCWD, NULL, O_RDONLY)); }
static int p_init_module(void) { return err(syscall(SYS_init_module, NULL, 0, "")); }
static int p_mount(void) { return err(syscall(SYS_mount, "none", "/dev/shm", "tmpfs", 0, "")); }
static int p_sethostname(void) { return err(syscall(SYS_sethostname, "probe", 5)); }
static int p_chroot(void) { return err(syscall(SYS_chroot, "/")); }
static int p_socket_inet(void) { return err(syscall(SYS_socket, AF_INET, SOCK_STREAM, 0)); }
static int p_socket_alg(void) { return err(syscall(SYS_socket, 38 /* AF_ALG */, SOCK_SEQPACKET, 0)); }
static int p_socket_vsock(void) { return err(syscall(SYS_socket, 40 /* AF_VSOCK */, SOCK_STREAM, 0)); }
/* A number no kernel has given a syscall yet. */
static int p_syscall_500(void) { return err(syscall(500)); }

struct probe { const char *name; int (*run)(void); };
static const struct probe probes[] = {
    {"getpid", p_getpid}, {"openat", p_openat}, {"read", p_read}, {"write", p_write},
    {"mmap", p_mmap}, {"futex", p_futex}, {"clock_gettime", p_clock_gettime},
    {"epoll_create1", p_epoll_create1}, {"getrandom", p_getrandom}, {"fork", p_fork},
    {"clone", p_clone}, {"clone_newuser", p_clone_newuser},
    {"unshare_newuser", p_unshare_newuser}, {"clone3", p_clone3},
    {"io_uring_setup", p_io_uring_setup}, {"personality_linux", p_personality_linux},
    {"personality_read_implies_exec", p_personality_read_implies_exec},
    {"keyctl", p_keyctl}, {"add_key", p_add_key}, {"bpf", p_bpf},
    {"perf_event_open", p_perf_event_open}, {"kexec_load", p_kexec_load},
    {"open_by_handle_at", p_open_by_handle_at}, {"init_module", p_init_module},
    {"mount", p_mount}, {"sethostname", p_sethostname}, {"chroot", p_chroot},
    {"socket_inet", p_socket_inet}, {"socket_alg", p_socket_alg},
    {"socket_vsock", p_socket_vsock}, {"syscall_500", p_syscall_500},
};

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++) {
        pid_t pid = fork();
        if (pid == 0) _exit(probes[i].run() & 0xff);
        if (pid < 0) { printf("%s fork-failed-%d\n", probes[i].name, errno); continue; }
        int st = 0;
        waitpid(pid, &st, 0);
        if (WIFEXITED(st)) printf("%s %d\n", probes[i].name, WEXITSTATUS(st));
        else printf("%s signal-%d\n", probes[i].name, WIFSIGNALED(st) ? WTERMSIG(st) : -1);
    }
    printf("done\n");
    return 0;
}
"#;

/// Compiles the probe into `dir`; `None` (after recording the skip) when this machine cannot.
fn build_probe(dir: &Path) -> Option<PathBuf> {
    let Some(cc) = support::which("cc") else {
        support::skip(
            "the syscall table",
            "cc is not installed (the probe is a static C program; install gcc and libc6-dev)",
        );
        return None;
    };
    let src = dir.join("probe.c");
    let bin = dir.join("probe");
    std::fs::write(&src, PROBE_C).unwrap();
    let out = std::process::Command::new(cc)
        .args(["-static", "-O1", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .unwrap();
    if !out.status.success() {
        support::skip(
            "the syscall table",
            &format!(
                "cc -static cannot build the probe (is libc6-dev installed?): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        );
        return None;
    }
    Some(bin)
}

/// `name errno` lines to a table; panics when the probe did not finish.
fn parse(lines: &[String], what: &str) -> BTreeMap<String, String> {
    assert!(
        lines.iter().any(|l| l.trim() == "done"),
        "the probe did not finish in {what}: {lines:?}"
    );
    lines
        .iter()
        .filter_map(|l| l.trim().split_once(' '))
        .map(|(n, e)| (n.to_string(), e.to_string()))
        .collect()
}

/// The probe's result for `name`, as an errno (0: success); a signal or a failed fork fails.
fn errno(t: &BTreeMap<String, String>, name: &str) -> i32 {
    let v = t
        .get(name)
        .unwrap_or_else(|| panic!("no result for {name}: {t:?}"));
    v.parse()
        .unwrap_or_else(|_| panic!("{name} did not return: {v} ({t:?})"))
}

fn expect(t: &BTreeMap<String, String>, what: &str, want: &[(&str, i32)]) {
    let wrong: Vec<String> = want
        .iter()
        .filter(|(n, e)| errno(t, n) != *e)
        .map(|(n, e)| {
            format!(
                "{n}: {} (expected {})",
                Errno::from_raw(errno(t, n)),
                Errno::from_raw(*e)
            )
        })
        .collect();
    assert!(wrong.is_empty(), "{what}: {wrong:?}\nall: {t:?}");
}

fn probe_container(
    name: &str,
    cmd: &[&str],
    probe_dir: &Path,
    seccomp: i32,
    caps: &[&str],
) -> cri::ContainerConfig {
    let mut c = container_config(name, cmd);
    c.mounts.push(cri::Mount {
        container_path: "/opt/probe".into(),
        host_path: probe_dir.display().to_string(),
        readonly: true,
        ..Default::default()
    });
    c.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            // A PID namespace of its own, as kubelet asks by default. (In the pod's shared
            // one, libcontainer's cgroup v1 mount looks its parent's pod-namespace pid up in
            // the host's /proc and fails once the pod has used pids the host has not.)
            namespace_options: Some(cri::NamespaceOption {
                pid: cri::NamespaceMode::Container as i32,
                ..Default::default()
            }),
            seccomp: Some(cri::SecurityProfile {
                profile_type: seccomp,
                ..Default::default()
            }),
            capabilities: Some(cri::Capability {
                add_capabilities: caps.iter().map(|c| c.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    c
}

/// A pod to run probes in, with the probe's directory and the pod's log directory.
struct Bench {
    rt: Rt,
    pod: String,
    cfg: cri::PodSandboxConfig,
    logs: PathBuf,
    probe_dir: PathBuf,
    /// The pod monitor's log, where libcontainer's errors land.
    monitor_log: PathBuf,
}

impl Bench {
    /// Runs the probe as container `name`'s process and returns its table.
    async fn run(&mut self, name: &str, seccomp: i32, caps: &[&str]) -> BTreeMap<String, String> {
        let c = probe_container(name, &["/opt/probe/probe"], &self.probe_dir, seccomp, caps);
        let id = self.start(c).await;
        let st = wait_exited(&mut self.rt, &id).await;
        let lines: Vec<String> = log_lines(&self.logs.join(format!("{name}.log")))
            .into_iter()
            .filter_map(|l| l.strip_prefix("stdout F ").map(str::to_string))
            .collect();
        assert_eq!(st.exit_code, 0, "{name}: {lines:?}");
        parse(&lines, name)
    }

    /// Creates and starts `c`; a failure shows the monitor's log.
    async fn start(&mut self, c: cri::ContainerConfig) -> String {
        let created = self
            .rt
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: self.pod.clone(),
                config: Some(c),
                sandbox_config: Some(self.cfg.clone()),
            })
            .await;
        let id = match created {
            Ok(r) => r.into_inner().container_id,
            Err(e) => panic!("create: {e}\nmonitor.log:\n{}", self.monitor_log_text()),
        };
        if let Err(e) = self
            .rt
            .start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await
        {
            panic!("start: {e}\nmonitor.log:\n{}", self.monitor_log_text());
        }
        id
    }

    fn monitor_log_text(&self) -> String {
        std::fs::read_to_string(&self.monitor_log).unwrap_or_default()
    }
}

const RUNTIME_DEFAULT: i32 = cri::security_profile::ProfileType::RuntimeDefault as i32;
const UNCONFINED: i32 = cri::security_profile::ProfileType::Unconfined as i32;

/// What RuntimeDefault must answer for a container with the default capabilities.
fn default_expectations() -> Vec<(&'static str, i32)> {
    let eperm = Errno::EPERM as i32;
    vec![
        // Ordinary programs work.
        ("getpid", 0),
        ("openat", 0),
        ("read", 0),
        ("write", 0),
        ("mmap", 0),
        ("futex", 0),
        ("clock_gettime", 0),
        ("epoll_create1", 0),
        ("getrandom", 0),
        ("fork", 0),
        ("clone", 0),
        ("socket_inet", 0),
        ("chroot", 0),
        ("personality_linux", 0),
        // No namespaces; clone3 sends libc back to clone.
        ("clone_newuser", eperm),
        ("unshare_newuser", eperm),
        ("clone3", Errno::ENOSYS as i32),
        // Refused outright, or for want of a capability the container lacks.
        ("io_uring_setup", eperm),
        ("personality_read_implies_exec", eperm),
        ("keyctl", eperm),
        ("add_key", eperm),
        ("bpf", eperm),
        ("perf_event_open", eperm),
        ("kexec_load", eperm),
        ("open_by_handle_at", eperm),
        ("init_module", eperm),
        ("mount", eperm),
        ("sethostname", eperm),
        ("socket_alg", eperm),
        ("socket_vsock", eperm),
        // The default action, for syscalls the profile has never heard of.
        ("syscall_500", eperm),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn runtime_default_seccomp_syscall_table() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let probe_dir = tempfile::tempdir().unwrap();
    if build_probe(probe_dir.path()).is_none() {
        return;
    }
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("syscalls", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut b = Bench {
        rt,
        pod: pod.clone(),
        cfg,
        logs: logs.path().to_path_buf(),
        probe_dir: probe_dir.path().to_path_buf(),
        monitor_log: h
            .dir
            .path()
            .join("state/pods")
            .join(&pod)
            .join("monitor.log"),
    };

    let t = b.run("default", RUNTIME_DEFAULT, &[]).await;
    expect(&t, "RuntimeDefault", &default_expectations());

    // An exec runs under its container's filter too.
    let sleeper = probe_container(
        "sleeper",
        &["sleep", "300"],
        &b.probe_dir,
        RUNTIME_DEFAULT,
        &[],
    );
    let sleeper = b.start(sleeper).await;
    let out =
        b.rt.exec_sync(cri::ExecSyncRequest {
            container_id: sleeper,
            cmd: vec!["/opt/probe/probe".into()],
            timeout: 30,
        })
        .await
        .unwrap()
        .into_inner();
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    expect(
        &parse(&lines, "exec"),
        "ExecSync under RuntimeDefault",
        &default_expectations(),
    );

    // CAP_SYS_ADMIN opens what it guards, as in Docker's profile: mounts, namespaces, clone3.
    let t = b.run("admin", RUNTIME_DEFAULT, &["SYS_ADMIN"]).await;
    let eperm = Errno::EPERM as i32;
    expect(
        &t,
        "RuntimeDefault with CAP_SYS_ADMIN",
        &[
            ("mount", 0),
            ("sethostname", 0),
            ("clone3", 0),
            ("unshare_newuser", 0),
            ("io_uring_setup", eperm),
            ("kexec_load", eperm),
        ],
    );

    // Unconfined: no filter at all. A syscall number nobody has is ENOSYS from the kernel
    // itself, and clone3 reaches the kernel. unshare(CLONE_NEWUSER) needs no capability, so
    // it succeeds here; whatever this host's own limits say, the filter's EPERM is not it.
    let t = b.run("unconfined", UNCONFINED, &[]).await;
    expect(
        &t,
        "Unconfined",
        &[
            ("syscall_500", Errno::ENOSYS as i32),
            ("clone3", 0),
            ("personality_read_implies_exec", 0),
            ("getpid", 0),
        ],
    );
    let unshare = errno(&t, "unshare_newuser");
    assert_ne!(
        unshare,
        eperm,
        "unshare(CLONE_NEWUSER) unconfined: {}",
        Errno::from_raw(unshare)
    );

    // AppArmor on this host: verbose Status says whether it is there, and where it is not, a
    // container asking for a profile is refused rather than run without it.
    let info =
        b.rt.status(cri::StatusRequest { verbose: true })
            .await
            .unwrap()
            .into_inner()
            .info;
    let apparmor: serde_json::Value = serde_json::from_str(&info["apparmor"]).unwrap();
    let host_has_apparmor = std::fs::read_to_string("/sys/module/apparmor/parameters/enabled")
        .is_ok_and(|v| v.starts_with('Y'));
    assert_eq!(apparmor["enabled"], host_has_apparmor, "{apparmor}");
    if host_has_apparmor {
        support::record_skip(
            "refusing AppArmor requests",
            "this host has AppArmor; the refusal applies to hosts without it",
        );
    } else {
        assert!(
            apparmor["detail"]
                .as_str()
                .unwrap()
                .contains("not available on this host"),
            "{apparmor}"
        );
        for (name, profile) in [
            (
                "aa-default",
                cri::SecurityProfile {
                    profile_type: RUNTIME_DEFAULT,
                    ..Default::default()
                },
            ),
            (
                "aa-local",
                cri::SecurityProfile {
                    profile_type: cri::security_profile::ProfileType::Localhost as i32,
                    localhost_ref: "some-profile".into(),
                },
            ),
        ] {
            let mut c = container_config(name, &["true"]);
            c.linux = Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    apparmor: Some(profile),
                    ..Default::default()
                }),
                ..Default::default()
            });
            let e =
                b.rt.create_container(cri::CreateContainerRequest {
                    pod_sandbox_id: b.pod.clone(),
                    config: Some(c),
                    sandbox_config: Some(b.cfg.clone()),
                })
                .await
                .expect_err("an apparmor profile on a host without apparmor");
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
            assert!(e.message().contains("apparmor is not enabled"), "{e}");
        }
    }

    let mut rt = b.rt;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
