//! Images that try to reach the host through the files hako reads from a container's root
//! filesystem (its /etc/passwd and /etc/group): a symlinked /etc, account files that are a
//! character device or a FIFO. Each create fails with an error naming the image and the file,
//! or resolves inside the image, and never reads the host's files, blocks or balloons the
//! daemon. And an image whose /dev is a symlink out of its root: the container's setup makes
//! nothing on the host.

mod support;

use hako_proto::cri;
use support::cri::*;
use support::hako::Hako;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher};
use support::registry::Registry;

/// A tar with one entry of `kind` at `path` (devices as 1:5, /dev/zero's numbers).
fn special(path: &str, kind: tar::EntryType, link: Option<&str>) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(0);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    if kind == tar::EntryType::Char {
        h.set_device_major(1).unwrap();
        h.set_device_minor(5).unwrap();
    }
    if let Some(l) = link {
        h.set_link_name(l).unwrap();
    }
    b.append_data(&mut h, path, std::io::empty()).unwrap();
    b.into_inner().unwrap()
}

/// Pushes busybox with `top` as a second layer and pulls it into `h`; returns its name.
async fn push_and_pull(reg: &Registry, h: &Hako, repo: &str, top: Vec<u8>) -> String {
    let img = Image::new(
        vec![
            Layer::new(&oci::busybox_base_tar(), Compression::Gzip, false),
            Layer::new(&top, Compression::Gzip, false),
        ],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr)
        .push(&format!("e2e-test-images/{repo}"), "1", &img)
        .await;
    let name = format!("registry.k8s.io/e2e-test-images/{repo}:1");
    support::hako::pull(h, &name)
        .await
        .unwrap_or_else(|e| panic!("pull {name}: {e:?}"));
    name
}

async fn create_as(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    name: &str,
    image: &str,
    user: &str,
) -> Result<String, tonic::Status> {
    let mut cc = container_config(name, &["sleep", "60"]);
    cc.image = Some(cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    });
    cc.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            run_as_username: user.into(),
            ..Default::default()
        }),
        ..Default::default()
    });
    rt.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: pod.into(),
        config: Some(cc),
        sandbox_config: Some(cfg.clone()),
    })
    .await
    .map(|r| r.into_inner().container_id)
}

fn peak_rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

#[tokio::test(flavor = "multi_thread")]
async fn account_files_resolve_inside_the_image_and_only_as_regular_files() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    // On the host, where an /etc that escapes would lead: a passwd naming a user the image
    // does not have.
    let host = tempfile::tempdir().unwrap();
    std::fs::write(
        host.path().join("passwd"),
        "hostonly:x:4242:4242::/:/bin/sh\n",
    )
    .unwrap();
    let abs = host.path().display().to_string();
    let rel = format!("../../../../../../..{abs}");
    let images = [
        (
            "etc-abs",
            special("etc", tar::EntryType::Symlink, Some(&abs)),
        ),
        (
            "etc-rel",
            special("etc", tar::EntryType::Symlink, Some(&rel)),
        ),
        (
            "passwd-dev",
            special("etc/passwd", tar::EntryType::Char, None),
        ),
        (
            "passwd-fifo",
            special("etc/passwd", tar::EntryType::Fifo, None),
        ),
        (
            "group-fifo",
            special("etc/group", tar::EntryType::Fifo, None),
        ),
    ];
    let mut names = Vec::new();
    for (repo, top) in images {
        names.push((repo, push_and_pull(&reg, &h, repo, top).await));
    }
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("hostile", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let before = peak_rss_kib(h.pid());
    for (repo, image) in &names {
        let e = create_as(&mut rt, &pod, &cfg, repo, image, "hostonly")
            .await
            .expect_err("the host's user is never found");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{repo}: {e:?}");
        assert!(e.message().contains(image.as_str()), "{repo}: {e:?}");
        match *repo {
            "etc-abs" | "etc-rel" => assert!(
                e.message().contains("\"hostonly\" not found"),
                "{repo}: {e:?}"
            ),
            "group-fifo" => assert!(
                e.message().contains("/etc/group") && e.message().contains("not a regular file"),
                "{repo}: {e:?}"
            ),
            _ => assert!(
                e.message().contains("/etc/passwd") && e.message().contains("not a regular file"),
                "{repo}: {e:?}"
            ),
        }
    }
    // Reading a device that never ends did not balloon the daemon.
    let after = peak_rss_kib(h.pid());
    assert!(
        after < before + 64 * 1024,
        "the daemon's peak RSS grew from {before} to {after} KiB"
    );
    let listed = all_containers(&mut rt).await;
    assert!(
        listed.is_empty(),
        "refused creates leave nothing: {listed:?}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// An image whose /dev is a symlink out of its root (absolute, or climbing with `..`): the
/// container runs with a /dev of its own, and nothing is made where the link points on the
/// host (libcontainer makes /dev's default links through plain paths before its pivot_root).
#[tokio::test(flavor = "multi_thread")]
async fn an_image_whose_dev_is_a_symlink_makes_nothing_on_the_host() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    let host = tempfile::tempdir().unwrap();
    std::fs::write(host.path().join("ptmx"), "the host's own\n").unwrap();
    let abs = host.path().display().to_string();
    let rel = format!("../../../../../../..{abs}");
    let mut names = Vec::new();
    for (repo, target) in [("dev-abs", &abs), ("dev-rel", &rel)] {
        // The directory the link names, inside the image too: libcontainer's /dev mount,
        // resolved in the root, then lands.
        let mut top = oci::Tar::default();
        top.dir(&abs, 0o755).symlink("dev", target);
        names.push((repo, push_and_pull(&reg, &h, repo, top.finish()).await));
    }
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("devlink", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    for (repo, image) in &names {
        let mut cc = container_config(repo, &["sleep", "60"]);
        cc.image = Some(cri::ImageSpec {
            image: image.clone(),
            ..Default::default()
        });
        let id = run_container(&mut rt, &pod, &cfg, cc).await;
        let left: Vec<_> = std::fs::read_dir(host.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["ptmx"], "{repo}: made on the host");
        assert_eq!(
            std::fs::read_to_string(host.path().join("ptmx")).unwrap(),
            "the host's own\n"
        );
        assert_eq!(
            exec(
                &mut rt,
                &id,
                "[ -d /dev ] && [ ! -L /dev ] && [ -c /dev/null ] && [ -L /dev/fd ] && echo ok"
            )
            .await,
            "ok",
            "{repo}"
        );
    }
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// An image that links a volume's destination to /dev (`data -> /dev`): the create is refused,
/// naming the mount, and nothing is made in the volume (libcontainer would have bound it over
/// /dev and made /dev's links and device nodes in it, on the host).
#[tokio::test(flavor = "multi_thread")]
async fn a_volume_linked_onto_dev_by_the_image_is_refused() {
    let Some((reg, h)) = ready().await else {
        return;
    };
    let top = special("data", tar::EntryType::Symlink, Some("/dev"));
    let image = push_and_pull(&reg, &h, "data-dev", top).await;
    let volume = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("datadev", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = container_config("c", &["sleep", "60"]);
    cc.image = Some(cri::ImageSpec {
        image: image.clone(),
        ..Default::default()
    });
    cc.mounts = vec![cri::Mount {
        container_path: "/data".into(),
        host_path: volume.path().display().to_string(),
        ..Default::default()
    }];
    let e = create_container_err(&mut rt, &pod, &cfg, cc).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("/data") && e.message().contains("the image's /dev"),
        "{e:?}"
    );
    let made: Vec<_> = std::fs::read_dir(volume.path())
        .unwrap()
        .flatten()
        .collect();
    assert!(made.is_empty(), "made in the volume: {made:?}");
    assert!(all_containers(&mut rt).await.is_empty());
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
