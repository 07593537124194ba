//! Stand-ins for the images critest pulls by their public names, built here from Debian's
//! busybox and pushed to a local registry under the same repository paths. hako reaches them
//! through hosts.toml mirrors, so critest runs unchanged and offline.
//!
//! Each stand-in reproduces what critest's specs rely on (see shared/CRITEST-NOTES.md).

use super::oci::{self, Compression, Image, ImageConf, Layer, Pusher};

/// Registries critest names, each mirrored to the local registry.
pub const MIRRORED: &[&str] = &[
    "registry.k8s.io",
    "gcr.io",
    "docker.io",
    "public.ecr.aws",
    "quay.io",
];

const CRI_TOOLS: &str = "k8s-staging-cri-tools";

/// Builds and pushes every stand-in; returns the references pushed (public names).
pub async fn push_all(p: &Pusher) -> Vec<String> {
    let base = Layer::new(&oci::busybox_base_tar(), Compression::Gzip, false);
    let mut pushed = Vec::new();
    let with_marker = |path: &str, conf: &ImageConf| {
        Image::new(
            vec![
                base.clone(),
                Layer::new(&oci::marker_tar(path, b""), Compression::Gzip, false),
            ],
            conf,
            false,
        )
    };
    let plain = Image::new(vec![base.clone()], &ImageConf::default(), false);

    // The default test container image.
    p.push("e2e-test-images/busybox", "1.29-2", &plain).await;
    pushed.push("registry.k8s.io/e2e-test-images/busybox:1.29-2".to_string());

    // Image Manager specs.
    let mut push = async |repo: &str, tag: &str, img: &Image| {
        p.push(&format!("{CRI_TOOLS}/{repo}"), tag, img).await;
        pushed.push(format!("gcr.io/{CRI_TOOLS}/{repo}:{tag}"));
    };
    push(
        "test-image-tag",
        "test",
        &with_marker("test", &ImageConf::default()),
    )
    .await;
    push(
        "test-image-latest",
        "latest",
        &with_marker("test-image-latest", &ImageConf::default()),
    )
    .await;
    // Cannot carry upstream's pinned digest; pushed so the name resolves at all.
    push(
        "test-image-digest",
        "latest",
        &with_marker("test-image-digest", &ImageConf::default()),
    )
    .await;
    push(
        "test-image-tag",
        "all",
        &with_marker("all", &ImageConf::default()),
    )
    .await;
    for n in 1..=3 {
        let name = format!("test-image-{n}");
        push(
            &name,
            "latest",
            &with_marker(&format!("test-image-{n}"), &ImageConf::default()),
        )
        .await;
    }
    let same = with_marker("same-image", &ImageConf::default());
    for t in ["1", "2", "3"] {
        push("test-image-tags", t, &same).await;
    }
    for (repo, user) in [
        ("test-image-user-uid", "1002"),
        ("test-image-user-username", "www-data"),
        ("test-image-user-uid-group", "1003:1004"),
        ("test-image-user-username-group", "www-data:1004"),
    ] {
        push(
            repo,
            "latest",
            &with_marker(
                repo,
                &ImageConf {
                    user: user.into(),
                    ..Default::default()
                },
            ),
        )
        .await;
    }
    pushed
}

/// The hosts.toml that sends `registry` to the local registry at `addr`, keeping paths.
pub fn hosts_toml(registry: &str, addr: &str) -> String {
    let server = if registry == "docker.io" {
        "https://registry-1.docker.io".to_string()
    } else {
        format!("https://{registry}")
    };
    format!("server = \"{server}\"\n\n[host.\"http://{addr}\"]\n  capabilities = [\"pull\", \"resolve\"]\n")
}

/// critest's gcr.io repositories live under `k8s-staging-cri-tools/`, registry.k8s.io's under
/// `e2e-test-images/`: one local registry serves both with paths unchanged.
pub fn local_repo_of(public: &str) -> &str {
    public
        .split_once('/')
        .map(|(_, rest)| rest)
        .unwrap_or(public)
}
