//! What an unprivileged user on the node can reach of hako while a pod runs: nothing under its
//! root and state directories (no store, no container environment, no rootfs, no setuid binary a
//! container wrote), and a monitor socket that answers only root.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use hako_proto::cri;
use support::cri::*;

const NOBODY: &str = "65534";

/// Every path below `dir` (not into other filesystems' mount points: a container's rootfs is
/// walked from its overlay mount, which is one of them, on purpose).
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    out.push(dir.to_path_buf());
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&p, out),
            Ok(_) => out.push(p),
            Err(_) => {}
        }
    }
}

/// Runs a shell as nobody (no groups) that tries to list each directory and read each file in
/// `paths`, and asks the kernel whether it could execute each; returns what succeeded.
fn reachable_by_nobody(paths: &[PathBuf]) -> Vec<String> {
    let list = tempfile::NamedTempFile::new().unwrap();
    let text: String = paths.iter().map(|p| format!("{}\n", p.display())).collect();
    std::fs::write(list.path(), text).unwrap();
    std::fs::set_permissions(list.path(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let script = r#"
while IFS= read -r p; do
  if [ -d "$p" ]; then
    ls "$p" >/dev/null 2>&1 && echo "listed $p"
  elif [ -S "$p" ]; then
    :
  else
    head -c1 "$p" >/dev/null 2>&1 && echo "read $p"
    # access(2) as nobody: the path is reachable and the file executable for it. Nothing is
    # run (an image's binaries may never return).
    [ -x "$p" ] && echo "executable $p"
  fi
done < "$1"
true"#;
    let out = Command::new(support::which("setpriv").expect("setpriv"))
        .args([
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--",
            "sh",
            "-c",
            script,
            "probe",
        ])
        .arg(list.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "probe: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_user_reaches_nothing_of_hako_while_a_pod_runs() {
    if !support::e2e_ready(&["setpriv"]) {
        return;
    }
    let Some((_reg, h)) = ready().await else {
        return;
    };
    // The test's temp dir is owner only: open it as an install's /var/lib and /run are, so
    // hako's own modes are what stands between nobody and its files.
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("private", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    // A container that keeps a secret in its environment and leaves a setuid-root shell in
    // its root filesystem.
    let mut cc = container_config(
        "suid",
        &[
            "sh",
            "-c",
            "cp /bin/busybox /suid-sh && chmod 4755 /suid-sh && echo ready && sleep 600",
        ],
    );
    cc.envs = vec![cri::KeyValue {
        key: "API_TOKEN".into(),
        value: "s3cr3t-token".into(),
    }];
    let cid = run_container(&mut rt, &pod, &cfg, cc).await;
    support::wait_for(
        "the container to make its setuid copy",
        Duration::from_secs(30),
        || log_lines(&logs.path().join("suid.log")).contains(&"stdout F ready".to_string()),
    )
    .await;
    assert_traces_present(&h, &mut rt, &pod, &cid).await;

    // The probe itself can see what nobody may see (else an empty answer proves nothing).
    let open = tempfile::tempdir().unwrap();
    std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let control = open.path().join("public");
    std::fs::write(&control, "x").unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        reachable_by_nobody(std::slice::from_ref(&control)),
        vec![format!("read {}", control.display())]
    );

    let mut paths = Vec::new();
    walk(&h.root, &mut paths);
    walk(&h.state, &mut paths);
    let suid: Vec<&PathBuf> = paths.iter().filter(|p| p.ends_with("suid-sh")).collect();
    assert!(!suid.is_empty(), "the walk reaches the container's rootfs");
    assert!(
        paths.iter().any(|p| p.ends_with("meta.db")),
        "the walk reaches the store"
    );
    let reached = reachable_by_nobody(&paths);
    assert!(
        reached.is_empty(),
        "an unprivileged user reached {} of {} paths: {:#?}",
        reached.len(),
        paths.len(),
        &reached[..reached.len().min(40)]
    );
    // Owner-only modes themselves, not only a parent that happens to be closed.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&h.root), 0o700);
    assert_eq!(mode(&h.root.join("meta.db")), 0o600);
    assert_eq!(mode(&h.state.join("pods")), 0o700);
    // Traversable only (the root of a pod's user namespace reaches its bundle through it);
    // each bundle owner only.
    assert_eq!(mode(&h.state.join("containers")), 0o711);
    assert_eq!(mode(&h.state.join("containers").join(&cid)), 0o700);
    assert_eq!(
        mode(&logs.path().join("suid.log")),
        0o640,
        "CRI logs as containerd makes them"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Connects to `socket` as uid/gid 65534 (a forked child drops to it) and sends an Info call;
/// returns how many bytes of answer came back, or -1000 - errno when the read failed.
fn call_as_nobody(socket: &Path) -> isize {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(socket.as_os_str().as_bytes()).unwrap();
    let (r, w) = nix::unistd::pipe().unwrap();
    // SAFETY: the child only makes raw system calls and leaves with _exit.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => unsafe {
            use std::os::fd::AsRawFd;
            let mut got: isize = -1;
            if libc::setgroups(0, std::ptr::null()) == 0
                && libc::setgid(65534) == 0
                && libc::setuid(65534) == 0
            {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let mut addr: libc::sockaddr_un = std::mem::zeroed();
                addr.sun_family = libc::AF_UNIX as u16;
                let bytes = path.as_bytes_with_nul();
                if bytes.len() <= addr.sun_path.len() {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr() as *const libc::c_char,
                        addr.sun_path.as_mut_ptr(),
                        bytes.len(),
                    );
                    let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                    if libc::connect(fd, &addr as *const _ as *const libc::sockaddr, len) == 0 {
                        // A frame: length 1, method 1 (Info), empty message.
                        let frame = [0u8, 0, 0, 1, 1];
                        libc::write(fd, frame.as_ptr() as *const libc::c_void, frame.len());
                        let mut buf = [0u8; 64];
                        got = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
                        if got < 0 {
                            got = -1000 - *libc::__errno_location() as isize;
                        }
                    } else {
                        got = -2;
                    }
                }
            }
            libc::write(
                w.as_raw_fd(),
                &got as *const isize as *const libc::c_void,
                std::mem::size_of::<isize>(),
            );
            libc::_exit(0)
        },
        nix::unistd::ForkResult::Parent { child } => {
            drop(w);
            let mut buf = [0u8; std::mem::size_of::<isize>()];
            let n = nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&r), &mut buf).unwrap();
            nix::sys::wait::waitpid(child, None).unwrap();
            assert_eq!(n, buf.len(), "the child reported");
            isize::from_ne_bytes(buf)
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_monitor_answers_only_root() {
    let Some((_reg, h)) = ready().await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("peers", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let pod_dir = h.state.join("pods").join(&pod);
    let socket = pod_dir.join("monitor.sock");
    assert_eq!(
        std::fs::metadata(&pod_dir).unwrap().permissions().mode() & 0o777,
        0o700,
        "the monitor socket's directory is owner only"
    );
    // Its directory keeps others out; open the way (as an operator's mistake might) to see
    // that the monitor itself refuses them.
    let mut opened = Vec::new();
    let mut p = pod_dir.as_path();
    while p.starts_with(h.dir.path()) {
        let mode = std::fs::metadata(p).unwrap().permissions().mode();
        opened.push((p.to_path_buf(), mode));
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode | 0o011)).unwrap();
        p = p.parent().unwrap();
    }
    let sock_mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    let got = call_as_nobody(&socket);
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(sock_mode)).unwrap();
    for (p, mode) in opened {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    // Dropped unanswered: EOF, or a reset since the call was left unread.
    assert!(
        got == 0 || got == -1000 - libc::ECONNRESET as isize,
        "nobody connected and got no answer: {got}"
    );
    let monitor_log = std::fs::read_to_string(pod_dir.join("monitor.log")).unwrap();
    assert!(
        monitor_log.contains("refused a call from another user"),
        "{monitor_log}"
    );
    // The daemon (root) is still served.
    let id = run_container(&mut rt, &pod, &cfg, container_config("c", &["sleep", "60"])).await;
    assert_eq!(exec(&mut rt, &id, "echo ok").await, "ok");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
