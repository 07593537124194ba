//! Seccomp filters in OCI form (`linux.seccomp`): hako's `RuntimeDefault` profile, the
//! conversion of docker-format (Localhost) profiles, and the one adaptation every profile gets
//! before libcontainer reads it.
//!
//! `RuntimeDefault` is an allow-list over a default of ERRNO(EPERM), equivalent in effect to
//! the default profiles of Docker and containerd: the syscalls ordinary programs make are
//! allowed; the ones that reach past the container (modules, kexec, the keyring, bpf, perf,
//! mounts, namespaces, clocks, ...) only when the container holds the capability the kernel
//! would check anyway; everything else, including every syscall newer than this table
//! (io_uring among them), is refused. Three rules look at arguments: `clone` may not create
//! namespaces, `socket` may not open AF_ALG or AF_VSOCK sockets, and `personality` may only
//! select the harmless personas. `clone3` passes its flags in memory that seccomp cannot read,
//! so it answers ENOSYS and libc falls back to `clone`. A container with CAP_SYS_ADMIN may do
//! all of that anyway, so it gets plain `clone`/`clone3`.
//!
//! Masked equality: runc, crun and containerd read `SCMP_CMP_MASKED_EQ` as
//! `(arg & value) == valueTwo`; libcontainer 0.7 hands `valueTwo` to libseccomp as the mask and
//! `value` as the datum. A rule written the usual way then has the mask 0, which libseccomp
//! compiles to no condition at all: the rule applies to every call (an ALLOW rule lets
//! namespaces through; an ERRNO one refuses every fork and thread). Profiles here are written
//! the usual way and [`for_libcontainer`] swaps the two where the spec is generated.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction as Action, LinuxSeccompArg, LinuxSeccompArgBuilder,
    LinuxSeccompBuilder, LinuxSeccompOperator as Op, LinuxSyscallBuilder,
};
use serde_json::{json, Value};

use crate::error::{Error, ProfileDefect, Result};

/// Allowed for every container, grouped by what they are for.
const ALLOWED: &[&[&str]] = &[
    // Processes, threads and their limits.
    &[
        "fork",
        "vfork",
        "execve",
        "execveat",
        "exit",
        "exit_group",
        "wait4",
        "waitid",
        "waitpid",
        "kill",
        "tkill",
        "tgkill",
        "getpid",
        "getppid",
        "gettid",
        "getpgid",
        "getpgrp",
        "setpgid",
        "getsid",
        "setsid",
        "set_tid_address",
        "set_robust_list",
        "get_robust_list",
        "get_thread_area",
        "set_thread_area",
        "rseq",
        "restart_syscall",
        "prctl",
        "capget",
        "capset",
        "pidfd_open",
        "pidfd_send_signal",
        "process_mrelease",
        "membarrier",
        "getcpu",
        "sysinfo",
        "uname",
        "times",
        "getrusage",
        "getrlimit",
        "ugetrlimit",
        "setrlimit",
        "prlimit64",
        "getpriority",
        "setpriority",
        "ioprio_get",
        "ioprio_set",
        "umask",
        "getrandom",
        "seccomp",
        "landlock_add_rule",
        "landlock_create_ruleset",
        "landlock_restrict_self",
        // Since Linux 4.8 a tracer cannot use ptrace to step around its tracee's filter, so
        // tracing within the container is allowed (the kernel still checks the tracer).
        "ptrace",
        "process_vm_readv",
        "process_vm_writev",
        // Called by the kernel's own return-probe trampoline (6.11+).
        "uretprobe",
        "riscv_hwprobe",
    ],
    // Credentials.
    &[
        "getuid",
        "getuid32",
        "geteuid",
        "geteuid32",
        "getgid",
        "getgid32",
        "getegid",
        "getegid32",
        "getresuid",
        "getresuid32",
        "getresgid",
        "getresgid32",
        "getgroups",
        "getgroups32",
        "setuid",
        "setuid32",
        "setgid",
        "setgid32",
        "setreuid",
        "setreuid32",
        "setregid",
        "setregid32",
        "setresuid",
        "setresuid32",
        "setresgid",
        "setresgid32",
        "setgroups",
        "setgroups32",
        "setfsuid",
        "setfsuid32",
        "setfsgid",
        "setfsgid32",
    ],
    // Scheduling.
    &[
        "sched_yield",
        "sched_getaffinity",
        "sched_setaffinity",
        "sched_getattr",
        "sched_setattr",
        "sched_getparam",
        "sched_setparam",
        "sched_getscheduler",
        "sched_setscheduler",
        "sched_get_priority_max",
        "sched_get_priority_min",
        "sched_rr_get_interval",
        "sched_rr_get_interval_time64",
    ],
    // Signals.
    &[
        "rt_sigaction",
        "rt_sigpending",
        "rt_sigprocmask",
        "rt_sigqueueinfo",
        "rt_sigreturn",
        "rt_sigsuspend",
        "rt_sigtimedwait",
        "rt_sigtimedwait_time64",
        "rt_tgsigqueueinfo",
        "sigaltstack",
        "sigreturn",
        "sigprocmask",
        "signalfd",
        "signalfd4",
        "pause",
        "alarm",
    ],
    // Clocks and timers (adjtimex and clock_adjtime only read without CAP_SYS_TIME).
    &[
        "clock_getres",
        "clock_getres_time64",
        "clock_gettime",
        "clock_gettime64",
        "clock_nanosleep",
        "clock_nanosleep_time64",
        "nanosleep",
        "gettimeofday",
        "time",
        "adjtimex",
        "clock_adjtime",
        "clock_adjtime64",
        "getitimer",
        "setitimer",
        "timer_create",
        "timer_delete",
        "timer_getoverrun",
        "timer_gettime",
        "timer_gettime64",
        "timer_settime",
        "timer_settime64",
        "timerfd_create",
        "timerfd_gettime",
        "timerfd_gettime64",
        "timerfd_settime",
        "timerfd_settime64",
    ],
    // Memory.
    &[
        "brk",
        "mmap",
        "mmap2",
        "munmap",
        "mremap",
        "mprotect",
        "madvise",
        "mincore",
        "msync",
        "mlock",
        "mlock2",
        "mlockall",
        "munlock",
        "munlockall",
        "memfd_create",
        "memfd_secret",
        "remap_file_pages",
        "pkey_alloc",
        "pkey_free",
        "pkey_mprotect",
        "map_shadow_stack",
        "mseal",
        "futex",
        "futex_time64",
        "futex_waitv",
        "futex_wait",
        "futex_wake",
        "futex_requeue",
    ],
    // File descriptors and I/O.
    &[
        "open",
        "openat",
        "openat2",
        "creat",
        "close",
        "close_range",
        "read",
        "readv",
        "pread64",
        "preadv",
        "preadv2",
        "write",
        "writev",
        "pwrite64",
        "pwritev",
        "pwritev2",
        "lseek",
        "_llseek",
        "dup",
        "dup2",
        "dup3",
        "fcntl",
        "fcntl64",
        "ioctl",
        "flock",
        "fsync",
        "fdatasync",
        "sync",
        "syncfs",
        "sync_file_range",
        "fallocate",
        "fadvise64",
        "fadvise64_64",
        "readahead",
        "cachestat",
        "copy_file_range",
        "sendfile",
        "sendfile64",
        "splice",
        "tee",
        "vmsplice",
        "pipe",
        "pipe2",
        "io_setup",
        "io_destroy",
        "io_submit",
        "io_cancel",
        "io_getevents",
        "io_pgetevents",
        "io_pgetevents_time64",
    ],
    // Waiting for events.
    &[
        "epoll_create",
        "epoll_create1",
        "epoll_ctl",
        "epoll_ctl_old",
        "epoll_pwait",
        "epoll_pwait2",
        "epoll_wait",
        "epoll_wait_old",
        "eventfd",
        "eventfd2",
        "poll",
        "ppoll",
        "ppoll_time64",
        "select",
        "_newselect",
        "pselect6",
        "pselect6_time64",
        "inotify_init",
        "inotify_init1",
        "inotify_add_watch",
        "inotify_rm_watch",
        "fanotify_mark",
    ],
    // Paths, metadata and extended attributes.
    &[
        "stat",
        "stat64",
        "lstat",
        "lstat64",
        "fstat",
        "fstat64",
        "fstatat64",
        "newfstatat",
        "statx",
        "statfs",
        "statfs64",
        "fstatfs",
        "fstatfs64",
        "statmount",
        "listmount",
        "access",
        "faccessat",
        "faccessat2",
        "chdir",
        "fchdir",
        "getcwd",
        "getdents",
        "getdents64",
        "mkdir",
        "mkdirat",
        "rmdir",
        "mknod",
        "mknodat",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "unlink",
        "unlinkat",
        "rename",
        "renameat",
        "renameat2",
        "readlink",
        "readlinkat",
        "truncate",
        "truncate64",
        "ftruncate",
        "ftruncate64",
        "chmod",
        "fchmod",
        "fchmodat",
        "fchmodat2",
        "chown",
        "chown32",
        "fchown",
        "fchown32",
        "fchownat",
        "lchown",
        "lchown32",
        "utime",
        "utimes",
        "utimensat",
        "utimensat_time64",
        "futimesat",
        "name_to_handle_at",
        "getxattr",
        "lgetxattr",
        "fgetxattr",
        "getxattrat",
        "setxattr",
        "lsetxattr",
        "fsetxattr",
        "setxattrat",
        "listxattr",
        "llistxattr",
        "flistxattr",
        "listxattrat",
        "removexattr",
        "lremovexattr",
        "fremovexattr",
        "removexattrat",
    ],
    // Sockets (`socket` itself is checked by address family) and System V / POSIX IPC.
    &[
        "socketpair",
        "socketcall",
        "bind",
        "connect",
        "listen",
        "accept",
        "accept4",
        "getsockname",
        "getpeername",
        "getsockopt",
        "setsockopt",
        "send",
        "sendto",
        "sendmsg",
        "sendmmsg",
        "recv",
        "recvfrom",
        "recvmsg",
        "recvmmsg",
        "recvmmsg_time64",
        "shutdown",
        "ipc",
        "msgget",
        "msgctl",
        "msgsnd",
        "msgrcv",
        "semget",
        "semctl",
        "semop",
        "semtimedop",
        "semtimedop_time64",
        "shmget",
        "shmctl",
        "shmat",
        "shmdt",
        "mq_open",
        "mq_unlink",
        "mq_getsetattr",
        "mq_notify",
        "mq_timedsend",
        "mq_timedsend_time64",
        "mq_timedreceive",
        "mq_timedreceive_time64",
    ],
];

/// Allowed on x86 only (the names do not exist elsewhere).
const ALLOWED_X86: &[&str] = &["arch_prctl", "modify_ldt"];
/// Allowed on arm and arm64 only.
const ALLOWED_ARM: &[&str] = &[
    "arm_fadvise64_64",
    "arm_sync_file_range",
    "sync_file_range2",
    "breakpoint",
    "cacheflush",
    "set_tls",
];

/// Allowed when the container holds the capability: the kernel checks it for these calls too,
/// and without it they only widen what a kernel bug could be reached through.
const BY_CAPABILITY: &[(&str, &[&str])] = &[
    ("CAP_DAC_READ_SEARCH", &["open_by_handle_at"]),
    (
        "CAP_SYS_ADMIN",
        &[
            "bpf",
            "clone",
            "clone3",
            "fanotify_init",
            "fsconfig",
            "fsmount",
            "fsopen",
            "fspick",
            "lookup_dcookie",
            "lsm_get_self_attr",
            "lsm_list_modules",
            "lsm_set_self_attr",
            "mount",
            "mount_setattr",
            "move_mount",
            "open_tree",
            "perf_event_open",
            "quotactl",
            "quotactl_fd",
            "setdomainname",
            "sethostname",
            "setns",
            "syslog",
            "umount",
            "umount2",
            "unshare",
        ],
    ),
    ("CAP_SYS_BOOT", &["reboot"]),
    ("CAP_SYS_CHROOT", &["chroot"]),
    (
        "CAP_SYS_MODULE",
        &["init_module", "finit_module", "delete_module"],
    ),
    ("CAP_SYS_PACCT", &["acct"]),
    (
        "CAP_SYS_PTRACE",
        &[
            "kcmp",
            "pidfd_getfd",
            "process_madvise",
            "process_vm_readv",
            "process_vm_writev",
            "ptrace",
        ],
    ),
    ("CAP_SYS_RAWIO", &["iopl", "ioperm"]),
    (
        "CAP_SYS_TIME",
        &["settimeofday", "stime", "clock_settime", "clock_settime64"],
    ),
    ("CAP_SYS_TTY_CONFIG", &["vhangup"]),
    (
        "CAP_SYS_NICE",
        &[
            "get_mempolicy",
            "mbind",
            "set_mempolicy",
            "set_mempolicy_home_node",
        ],
    ),
    ("CAP_SYSLOG", &["syslog"]),
    ("CAP_BPF", &["bpf"]),
    ("CAP_PERFMON", &["perf_event_open"]),
];

/// The flags that make `clone` create a namespace.
pub const CLONE_NAMESPACE_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// `personality` values a container may set: PER_LINUX, PER_LINUX32, each with or without
/// UNAME26, and 0xffffffff, which only reads the current persona. Anything else
/// (READ_IMPLIES_EXEC, ADDR_NO_RANDOMIZE, other ABIs) weakens the process's own protections.
pub const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Address families `socket` refuses: AF_ALG (the kernel's crypto API, a history of bugs
/// reachable by anyone) and AF_VSOCK (talks to the hypervisor, past the network namespace).
const AF_ALG: u64 = 38;
const AF_VSOCK: u64 = 40;

const EPERM: u32 = libc::EPERM as u32;
const ENOSYS: u32 = libc::ENOSYS as u32;

/// hako's RuntimeDefault profile for a container holding `caps`, for this machine: its
/// architectures, and only the syscall names the linked libseccomp can resolve (libcontainer
/// skips the others with a warning on every container start and exec; refused either way).
pub fn runtime_default(caps: &[String]) -> LinuxSeccomp {
    profile(caps, std::env::consts::ARCH, |name| {
        libseccomp::ScmpSyscall::from_name(name).is_ok()
    })
}

/// The RuntimeDefault profile for `caps` on `arch` (as `std::env::consts::ARCH` names it),
/// keeping the syscall names `known` accepts. Written the usual (runc) way; see
/// [`for_libcontainer`].
pub fn profile(caps: &[String], arch: &str, known: impl Fn(&str) -> bool) -> LinuxSeccomp {
    let holds = |cap: &str| caps.iter().any(|c| c == cap);
    let (architectures, arch_names): (&[Arch], &[&str]) = match arch {
        "x86_64" => (
            &[Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32],
            ALLOWED_X86,
        ),
        "x86" => (&[Arch::ScmpArchX86], ALLOWED_X86),
        "aarch64" => (&[Arch::ScmpArchAarch64, Arch::ScmpArchArm], ALLOWED_ARM),
        "arm" => (&[Arch::ScmpArchArm], ALLOWED_ARM),
        // Elsewhere the filter covers the native architecture only.
        _ => (&[], &[]),
    };
    let mut allowed: Vec<&str> = ALLOWED.iter().flat_map(|g| g.iter().copied()).collect();
    allowed.extend(arch_names);
    for (cap, names) in BY_CAPABILITY {
        if holds(cap) {
            allowed.extend(names.iter());
        }
    }
    allowed.retain(|n| known(n));
    allowed.sort_unstable();
    allowed.dedup();

    let rule = |names: Vec<String>, action: Action| {
        LinuxSyscallBuilder::default().names(names).action(action)
    };
    let arg0 = |op: Op, value: u64, value_two: Option<u64>| vec![arg(0, op, value, value_two)];
    let allow_if = |name: &str, op: Op, value: u64| {
        rule(vec![name.into()], Action::ScmpActAllow)
            .args(arg0(op, value, None))
            .build()
            .expect("a complete rule")
    };
    let allowed = allowed.into_iter().map(String::from).collect();
    let mut syscalls = vec![rule(allowed, Action::ScmpActAllow)
        .build()
        .expect("a complete rule")];
    // Rules on the same syscall are alternatives: any one that matches allows the call.
    syscalls.push(allow_if("socket", Op::ScmpCmpLt, AF_ALG));
    for family in AF_ALG + 1..AF_VSOCK {
        syscalls.push(allow_if("socket", Op::ScmpCmpEq, family));
    }
    syscalls.push(allow_if("socket", Op::ScmpCmpGt, AF_VSOCK));
    for &p in PERSONALITIES {
        syscalls.push(allow_if("personality", Op::ScmpCmpEq, p));
    }
    if !holds("CAP_SYS_ADMIN") {
        // (flags & CLONE_NAMESPACE_FLAGS) == 0: fork and threads, no namespaces.
        syscalls.push(
            rule(vec!["clone".into()], Action::ScmpActAllow)
                .args(arg0(Op::ScmpCmpMaskedEq, CLONE_NAMESPACE_FLAGS, Some(0)))
                .build()
                .expect("a complete rule"),
        );
        syscalls.push(
            rule(vec!["clone3".into()], Action::ScmpActErrno)
                .errno_ret(ENOSYS)
                .build()
                .expect("a complete rule"),
        );
    }
    let mut out = LinuxSeccompBuilder::default()
        .default_action(Action::ScmpActErrno)
        .default_errno_ret(EPERM)
        .syscalls(syscalls)
        .build()
        .expect("a complete profile");
    if !architectures.is_empty() {
        out.set_architectures(Some(architectures.to_vec()));
    }
    out
}

/// `profile` as libcontainer 0.7 must be given it: in every masked-equality comparison the
/// mask moves from `value` to `valueTwo` and the datum from `valueTwo` to `value` (see the
/// module docs). Everything else is unchanged.
pub fn for_libcontainer(mut profile: LinuxSeccomp) -> LinuxSeccomp {
    let Some(mut syscalls) = profile.syscalls().clone() else {
        return profile;
    };
    for rule in &mut syscalls {
        let Some(mut args) = rule.args().clone() else {
            continue;
        };
        for a in args.iter_mut().filter(|a| a.op() == Op::ScmpCmpMaskedEq) {
            let (mask, datum) = (a.value(), a.value_two().unwrap_or(0));
            *a = arg(a.index(), a.op(), datum, Some(mask));
        }
        rule.set_args(Some(args));
    }
    profile.set_syscalls(Some(syscalls));
    profile
}

fn arg(index: usize, op: Op, value: u64, value_two: Option<u64>) -> LinuxSeccompArg {
    let b = LinuxSeccompArgBuilder::default()
        .index(index)
        .op(op)
        .value(value);
    match value_two {
        Some(v) => b.value_two(v),
        None => b,
    }
    .build()
    .expect("a complete argument")
}

fn cap_name(c: &str) -> String {
    let up = c.to_ascii_uppercase();
    if up.starts_with("CAP_") {
        up
    } else {
        format!("CAP_{up}")
    }
}

/// The text of seccomp profile `name` (a Localhost profile's path) in the docker/Kubernetes
/// file format, in OCI form for a container holding `caps` (see [`profile_to_oci`]).
pub fn localhost_profile(name: &str, text: &[u8], caps: &[String]) -> Result<LinuxSeccomp> {
    let json: Value = serde_json::from_slice(text).map_err(|source| Error::SeccompSyntax {
        profile: name.to_string(),
        source,
    })?;
    profile_to_oci(name, &json, caps)
}

/// Seccomp profile `name` in the docker/Kubernetes file format (as Localhost profiles are
/// written) to OCI form: `archMap` flattened, `name` folded into `names`,
/// capability-conditional entries kept when the container holds the capability.
pub fn profile_to_oci(name: &str, profile: &Value, caps: &[String]) -> Result<LinuxSeccomp> {
    convert(profile, caps)
        .and_then(|v| {
            // What OCI cannot say (an unknown action, architecture or operator) is the
            // profile's defect, not the generated spec's.
            serde_json::from_value(v).map_err(|e| ProfileDefect::NotOci(e.to_string()))
        })
        .map_err(|defect| Error::SeccompProfile {
            profile: name.to_string(),
            defect,
        })
}

fn convert(profile: &Value, caps: &[String]) -> Result<Value, ProfileDefect> {
    let obj = profile.as_object().ok_or(ProfileDefect::NotAnObject)?;
    let default = obj
        .get("defaultAction")
        .and_then(|v| v.as_str())
        .ok_or(ProfileDefect::NoDefaultAction)?;
    let mut out = json!({"defaultAction": default});
    if let Some(e) = obj.get("defaultErrnoRet") {
        out["defaultErrnoRet"] = e.clone();
    }
    let mut arches: Vec<Value> = obj
        .get("architectures")
        .and_then(|a| a.as_array())
        .cloned()
        .unwrap_or_default();
    if let Some(map) = obj.get("archMap").and_then(|a| a.as_array()) {
        for m in map {
            if let Some(a) = m.get("architecture") {
                arches.push(a.clone());
            }
            arches.extend(
                m.get("subArchitectures")
                    .and_then(|s| s.as_array())
                    .cloned()
                    .unwrap_or_default(),
            );
        }
    }
    if !arches.is_empty() {
        out["architectures"] = Value::Array(arches);
    }
    let mut syscalls = Vec::new();
    for (i, sc) in obj
        .get("syscalls")
        .and_then(|s| s.as_array())
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .enumerate()
    {
        let needs_caps: Vec<String> = sc
            .pointer("/includes/caps")
            .and_then(|c| c.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str().map(cap_name)).collect())
            .unwrap_or_default();
        if !needs_caps.is_empty() && !needs_caps.iter().any(|c| caps.contains(c)) {
            continue;
        }
        let excluded: Vec<String> = sc
            .pointer("/excludes/caps")
            .and_then(|c| c.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str().map(cap_name)).collect())
            .unwrap_or_default();
        if excluded.iter().any(|c| caps.contains(c)) {
            continue;
        }
        let mut names: Vec<Value> = sc
            .get("names")
            .and_then(|n| n.as_array())
            .cloned()
            .unwrap_or_default();
        if let Some(n) = sc.get("name") {
            names.push(n.clone());
        }
        let action = sc
            .get("action")
            .and_then(|a| a.as_str())
            .ok_or(ProfileDefect::NoAction(i))?;
        if names.is_empty() {
            return Err(ProfileDefect::NoNames(i));
        }
        let mut e = json!({"names": names, "action": action});
        for k in ["args", "errnoRet"] {
            if let Some(v) = sc.get(k) {
                e[k] = v.clone();
            }
        }
        syscalls.push(e);
    }
    out["syscalls"] = Value::Array(syscalls);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(list: &[&str]) -> Vec<String> {
        list.iter().map(|c| c.to_string()).collect()
    }

    fn default_caps() -> Vec<String> {
        caps(crate::spec::DEFAULT_CAPABILITIES)
    }

    /// A profile as config.json holds it.
    fn v(p: &LinuxSeccomp) -> Value {
        serde_json::to_value(p).unwrap()
    }

    /// The names the profile allows without looking at arguments.
    fn allowed(p: &Value) -> Vec<String> {
        p["syscalls"][0]["names"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_string())
            .collect()
    }

    /// Every rule that names `name`.
    fn rules<'a>(p: &'a Value, name: &str) -> Vec<&'a Value> {
        p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["names"].as_array().unwrap().iter().any(|n| n == name))
            .collect()
    }

    #[test]
    fn default_is_an_allow_list_over_eperm() {
        let p = v(&profile(&default_caps(), "x86_64", |_| true));
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p["defaultErrnoRet"], 1);
        assert_eq!(
            p["architectures"],
            json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"])
        );
        let allowed = allowed(&p);
        for ordinary in [
            "read",
            "write",
            "openat",
            "mmap",
            "futex",
            "getrandom",
            "clock_gettime",
            "epoll_create1",
            "execve",
            "arch_prctl",
            "chroot", // CAP_SYS_CHROOT is a default capability
        ] {
            assert!(allowed.iter().any(|n| n == ordinary), "{ordinary} allowed");
        }
        for refused in [
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "keyctl",
            "add_key",
            "request_key",
            "bpf",
            "perf_event_open",
            "kexec_load",
            "kexec_file_load",
            "open_by_handle_at",
            "init_module",
            "mount",
            "unshare",
            "setns",
            "userfaultfd",
            "clone",
            "clone3",
            "personality",
            "socket",
            "set_tls",
        ] {
            assert!(!allowed.iter().any(|n| n == refused), "{refused} refused");
        }
        // Nothing is allowed that no rule names: every rule but clone3's allows.
        for r in p["syscalls"].as_array().unwrap() {
            if r["names"] != json!(["clone3"]) {
                assert_eq!(r["action"], "SCMP_ACT_ALLOW", "{r}");
            }
        }
        assert_eq!(
            rules(&p, "clone3"),
            vec![&json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})]
        );
        let personas: Vec<u64> = rules(&p, "personality")
            .iter()
            .map(|r| {
                assert_eq!(r["args"][0]["op"], "SCMP_CMP_EQ");
                r["args"][0]["value"].as_u64().unwrap()
            })
            .collect();
        assert_eq!(personas, PERSONALITIES);
        let families: Vec<(String, u64)> = rules(&p, "socket")
            .iter()
            .map(|r| {
                (
                    r["args"][0]["op"].as_str().unwrap().to_string(),
                    r["args"][0]["value"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            families,
            [
                ("SCMP_CMP_LT".to_string(), 38),
                ("SCMP_CMP_EQ".to_string(), 39),
                ("SCMP_CMP_GT".to_string(), 40)
            ]
        );
    }

    #[test]
    fn capabilities_open_the_syscalls_they_guard() {
        let with = |extra: &[&str]| {
            let mut c = default_caps();
            c.extend(caps(extra));
            v(&profile(&c, "x86_64", |_| true))
        };
        let admin = with(&["CAP_SYS_ADMIN"]);
        let names = allowed(&admin);
        for n in [
            "mount", "umount2", "unshare", "setns", "clone", "clone3", "bpf",
        ] {
            assert!(names.iter().any(|x| x == n), "CAP_SYS_ADMIN allows {n}");
        }
        assert!(!names.iter().any(|x| x == "init_module"));
        // With CAP_SYS_ADMIN clone and clone3 are plain allows, not conditional rules.
        assert_eq!(rules(&admin, "clone").len(), 1);
        assert_eq!(rules(&admin, "clone3").len(), 1);
        for (cap, call) in [
            ("CAP_SYS_PTRACE", "kcmp"),
            ("CAP_SYS_MODULE", "init_module"),
            ("CAP_SYS_BOOT", "reboot"),
            ("CAP_SYS_TIME", "settimeofday"),
            ("CAP_SYS_NICE", "mbind"),
            ("CAP_DAC_READ_SEARCH", "open_by_handle_at"),
            ("CAP_BPF", "bpf"),
            ("CAP_PERFMON", "perf_event_open"),
            ("CAP_SYSLOG", "syslog"),
        ] {
            assert!(!allowed(&with(&[])).iter().any(|x| x == call));
            assert!(allowed(&with(&[cap])).iter().any(|x| x == call), "{cap}");
        }
        // Dropping a default capability closes its syscall too.
        let no_chroot: Vec<String> = default_caps()
            .into_iter()
            .filter(|c| c != "CAP_SYS_CHROOT")
            .collect();
        assert!(!allowed(&v(&profile(&no_chroot, "x86_64", |_| true)))
            .iter()
            .any(|x| x == "chroot"));
    }

    #[test]
    fn architectures_and_their_own_syscalls() {
        let arm = v(&profile(&default_caps(), "aarch64", |_| true));
        assert_eq!(
            arm["architectures"],
            json!(["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"])
        );
        assert!(allowed(&arm).iter().any(|n| n == "set_tls"));
        assert!(!allowed(&arm).iter().any(|n| n == "arch_prctl"));
        // 32-bit hosts: their one architecture, and its own syscalls.
        let x86 = v(&profile(&default_caps(), "x86", |_| true));
        assert_eq!(x86["architectures"], json!(["SCMP_ARCH_X86"]));
        assert!(allowed(&x86).iter().any(|n| n == "modify_ldt"));
        let arm32 = v(&profile(&default_caps(), "arm", |_| true));
        assert_eq!(arm32["architectures"], json!(["SCMP_ARCH_ARM"]));
        assert!(allowed(&arm32).iter().any(|n| n == "cacheflush"));
        assert!(!allowed(&arm32).iter().any(|n| n == "modify_ldt"));
        let other = v(&profile(&default_caps(), "riscv64", |_| true));
        assert!(other.get("architectures").is_none(), "native only");
        // Names the resolver does not know are left out rather than warned about.
        let known = v(&profile(&default_caps(), "x86_64", |n| n != "mseal"));
        assert!(!allowed(&known).iter().any(|n| n == "mseal"));
        assert!(allowed(&v(&profile(&default_caps(), "x86_64", |_| true)))
            .iter()
            .any(|n| n == "mseal"));
    }

    /// Whether `rule`'s conditions hold for `arg0` as libcontainer 0.7 and libseccomp evaluate
    /// them: libcontainer passes `MaskedEqual(valueTwo)` with `value` as the datum
    /// (`src/seccomp/mod.rs`, `translate_op`), and libseccomp compares the masked argument with
    /// the masked datum (`seccomp_export_pfc` shows a 0 mask as no condition).
    fn libcontainer_matches(rule: &oci_spec::runtime::LinuxSyscall, arg0: u64) -> bool {
        use oci_spec::runtime::LinuxSeccompOperator as Op;
        rule.args().iter().flatten().all(|a| {
            assert_eq!(a.index(), 0);
            match a.op() {
                Op::ScmpCmpMaskedEq => {
                    let mask = a.value_two().unwrap_or(0);
                    arg0 & mask == a.value() & mask
                }
                Op::ScmpCmpEq => arg0 == a.value(),
                other => panic!("unexpected {other:?}"),
            }
        })
    }

    #[test]
    fn clone_rule_matches_as_libcontainer_reads_it() {
        let spec: oci_spec::runtime::LinuxSeccomp =
            for_libcontainer(runtime_default(&default_caps()));
        let clone: Vec<_> = spec
            .syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .filter(|r| r.names().iter().any(|n| n == "clone"))
            .collect();
        assert_eq!(clone.len(), 1);
        let allows = |flags: u64| libcontainer_matches(clone[0], flags);
        let sigchld = libc::SIGCHLD as u64;
        assert!(allows(sigchld), "fork");
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        assert!(allows(thread), "pthread_create");
        for ns in [
            libc::CLONE_NEWUSER,
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWUTS,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWCGROUP,
        ] {
            assert!(!allows(sigchld | ns as u64), "clone flag {ns:#x}");
        }
        // The rule as written for runc, read by libcontainer, would match every clone, with
        // namespace flags too.
        let unadapted: oci_spec::runtime::LinuxSeccomp = runtime_default(&default_caps());
        let rule = unadapted
            .syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .find(|r| r.names().iter().any(|n| n == "clone"))
            .unwrap();
        assert!(libcontainer_matches(
            rule,
            sigchld | libc::CLONE_NEWUSER as u64
        ));
    }

    #[test]
    fn masked_equality_is_swapped_and_nothing_else() {
        let p = json!({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
            {"names": ["a"], "action": "SCMP_ACT_ERRNO", "args": [
                {"index": 0, "value": 12, "op": "SCMP_CMP_MASKED_EQ"},
                {"index": 1, "value": 3, "valueTwo": 4, "op": "SCMP_CMP_MASKED_EQ"},
                {"index": 2, "value": 5, "op": "SCMP_CMP_EQ"}]},
            {"names": ["b"], "action": "SCMP_ACT_ERRNO"}]});
        let out = v(&for_libcontainer(
            serde_json::from_value(p.clone()).unwrap(),
        ));
        assert_eq!(
            out["syscalls"][0]["args"],
            json!([
                {"index": 0, "value": 0, "valueTwo": 12, "op": "SCMP_CMP_MASKED_EQ"},
                {"index": 1, "value": 4, "valueTwo": 3, "op": "SCMP_CMP_MASKED_EQ"},
                {"index": 2, "value": 5, "op": "SCMP_CMP_EQ"}])
        );
        assert_eq!(out["syscalls"][1], p["syscalls"][1]);
    }

    /// Runs the probes of [`libcontainer_enforces_the_default_profile`] in a child process
    /// (this test binary again, this test only): a filter cannot be taken off once loaded.
    const PROBE_CHILD: &str = "HAKO_SECCOMP_PROBE_CHILD";

    fn errno_of(ret: libc::c_long) -> i32 {
        if ret == -1 {
            std::io::Error::last_os_error().raw_os_error().unwrap()
        } else {
            0
        }
    }

    /// In the child: loads the default profile through libcontainer, as a container's init
    /// does, and checks what the kernel answers.
    fn probe_under_filter() {
        let filter: oci_spec::runtime::LinuxSeccomp =
            for_libcontainer(runtime_default(&default_caps()));
        nix::sys::prctl::set_no_new_privs().unwrap();
        libcontainer::seccomp::initialize_seccomp(&filter).unwrap();
        // SAFETY: raw syscalls with valid (or null) arguments; a clone child only `_exit`s.
        unsafe {
            let clone = |flags: libc::c_int| {
                libc::syscall(
                    libc::SYS_clone,
                    flags as libc::c_ulong,
                    0usize,
                    0usize,
                    0usize,
                    0usize,
                )
            };
            assert_eq!(
                errno_of(libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER)),
                libc::EPERM,
                "unshare(CLONE_NEWUSER)"
            );
            let r = clone(libc::CLONE_NEWUSER | libc::SIGCHLD);
            if r == 0 {
                libc::_exit(0);
            }
            assert_eq!(errno_of(r), libc::EPERM, "clone(CLONE_NEWUSER)");
            let child = clone(libc::SIGCHLD);
            if child == 0 {
                libc::_exit(7);
            }
            assert!(child > 0, "clone(SIGCHLD): errno {}", errno_of(child));
            let mut status = 0;
            assert_eq!(
                libc::waitpid(child as libc::pid_t, &mut status, 0),
                child as libc::pid_t
            );
            assert_eq!(libc::WEXITSTATUS(status), 7);
            let args = [0u64; 11];
            assert_eq!(
                errno_of(libc::syscall(libc::SYS_clone3, args.as_ptr(), 88usize)),
                libc::ENOSYS,
                "clone3"
            );
            let params = [0u8; 120];
            assert_eq!(
                errno_of(libc::syscall(
                    libc::SYS_io_uring_setup,
                    1u32,
                    params.as_ptr()
                )),
                libc::EPERM,
                "io_uring_setup"
            );
            assert!(libc::syscall(libc::SYS_personality, 0xffff_ffffu64) >= 0);
            assert_eq!(
                errno_of(libc::syscall(libc::SYS_personality, 0x0040_0000u64)),
                libc::EPERM,
                "personality(READ_IMPLIES_EXEC)"
            );
            assert_eq!(errno_of(libc::syscall(1000)), libc::EPERM, "syscall 1000");
            assert_eq!(
                errno_of(libc::syscall(libc::SYS_getpid)),
                0,
                "getpid is allowed"
            );
        }
        println!("seccomp probes passed");
    }

    #[test]
    fn libcontainer_enforces_the_default_profile() {
        if std::env::var_os(PROBE_CHILD).is_some() {
            probe_under_filter();
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "seccomp::tests::libcontainer_enforces_the_default_profile",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(PROBE_CHILD, "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("seccomp probes passed"),
            "{text}"
        );
    }

    #[test]
    fn docker_format_profiles_convert_to_oci() {
        let p = json!({
            "defaultAction": "SCMP_ACT_ERRNO",
            "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
            "syscalls": [
                {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
                {"name": "chmod", "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                {"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            ]
        });
        let typed = profile_to_oci("p.json", &p, &["CAP_CHOWN".into()]).unwrap();
        let oci = v(&typed);
        assert_eq!(
            oci["architectures"],
            json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"])
        );
        assert_eq!(
            oci["syscalls"].as_array().unwrap().len(),
            2,
            "mount needs CAP_SYS_ADMIN"
        );
        assert_eq!(
            oci["syscalls"][1],
            json!({"names": ["chmod"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1})
        );
        let with_admin = v(&profile_to_oci("p.json", &p, &["CAP_SYS_ADMIN".into()]).unwrap());
        assert_eq!(with_admin["syscalls"].as_array().unwrap().len(), 3);
        // Refusals name the profile and what is wrong with it.
        for (bad, defect) in [
            (json!([]), ProfileDefect::NotAnObject),
            (json!({"syscalls": []}), ProfileDefect::NoDefaultAction),
            (
                json!({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["a"], "action": "SCMP_ACT_ERRNO"}, {"names": ["b"]}]}),
                ProfileDefect::NoAction(1),
            ),
            (
                json!({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"action": "SCMP_ACT_ERRNO"}]}),
                ProfileDefect::NoNames(0),
            ),
        ] {
            match profile_to_oci("/p.json", &bad, &[]) {
                Err(Error::SeccompProfile { profile, defect: d }) => {
                    assert_eq!((profile.as_str(), &d), ("/p.json", &defect), "{bad}")
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let e = profile_to_oci("/p.json", &json!({"syscalls": []}), &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "seccomp profile /p.json: profile has no defaultAction"
        );
        match localhost_profile("/p.json", b"{not json", &[]) {
            Err(e @ Error::SeccompSyntax { .. }) => {
                let source = std::error::Error::source(&e).expect("the parser's error");
                assert!(source.to_string().contains("line 1"), "{source}");
                assert_eq!(e.to_string(), "seccomp profile /p.json");
            }
            other => panic!("{other:?}"),
        }
        assert!(localhost_profile("/p.json", p.to_string().as_bytes(), &[]).is_ok());
        assert_eq!(typed.syscalls().as_ref().map(Vec::len), Some(2));
        // What OCI has no word for is the profile's defect.
        let unknown = json!({"defaultAction": "SCMP_ACT_BOGUS"});
        match profile_to_oci("/p.json", &unknown, &[]) {
            Err(Error::SeccompProfile {
                defect: ProfileDefect::NotOci(m),
                ..
            }) => assert!(m.contains("SCMP_ACT_BOGUS"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
