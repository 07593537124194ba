//! Stand-ins for the images critest pulls by their public names, built here from Debian's
//! busybox and pushed to a local registry under the same repository paths. hako reaches them
//! through hosts.toml mirrors, so critest runs unchanged and offline.
//!
//! Each stand-in reproduces what critest's specs rely on (see shared/CRITEST-NOTES.md).

use std::path::PathBuf;
use std::process::Command;

use super::oci::{self, Compression, Image, ImageConf, Layer, Pusher, Tar};

/// Builds one of the Go programs in tests/standins (static, stdlib only) and returns it.
pub fn go_binary(name: &str) -> Vec<u8> {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/standins");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/standins")
        .join(name);
    let go = super::which("go")
        .or_else(|| super::which("/usr/local/go/bin/go"))
        .expect("go is needed to build the stand-in images");
    let st = Command::new(go)
        .args(["build", "-trimpath", "-o"])
        .arg(&out)
        .arg(format!("./{name}"))
        .current_dir(&src)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-buildvcs=false")
        .output()
        .expect("run go build");
    assert!(
        st.status.success(),
        "go build {name}: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    std::fs::read(&out).unwrap()
}

fn layer_with(files: &[(&str, &[u8], u32)]) -> Layer {
    let mut t = Tar::default();
    for (path, data, mode) in files {
        t.file(path, data, *mode);
    }
    Layer::new(&t.finish(), Compression::Gzip, false)
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

const PATH_ENV: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Registries critest names, each mirrored to the local registry.
pub const MIRRORED: &[&str] = &[
    "registry.k8s.io",
    // Its predecessor: critest v1.36 pulls pause:3.9 from both to check one image gets both
    // tags.
    "k8s.gcr.io",
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

    // Web servers, the no-new-privileges probe and pause, from the Go programs here.
    let web = go_binary("webserver");
    let html: &[u8] = b"<html><body><h1>Welcome to nginx!</h1></body></html>\n";
    let nginx_layer = layer_with(&[
        ("usr/sbin/nginx", &web, 0o755),
        ("usr/share/nginx/html/index.html", html, 0o644),
    ]);
    let nginx = |env: &[&str]| {
        let conf = ImageConf {
            cmd: strings(&["/usr/sbin/nginx", "-g", "daemon off;"]),
            env: std::iter::once(PATH_ENV)
                .chain(env.iter().copied())
                .map(str::to_string)
                .collect(),
            ..Default::default()
        };
        Image::new(vec![base.clone(), nginx_layer.clone()], &conf, false)
    };
    p.push("e2e-test-images/nginx", "1.14-2", &nginx(&[])).await;
    pushed.push("registry.k8s.io/e2e-test-images/nginx:1.14-2".to_string());
    p.push(
        &format!("{CRI_TOOLS}/hostnet-nginx-amd64"),
        "latest",
        &nginx(&["LISTEN_PORT=12003"]),
    )
    .await;
    pushed.push(format!("gcr.io/{CRI_TOOLS}/hostnet-nginx-amd64:latest"));
    let httpd = Image::new(
        vec![
            base.clone(),
            layer_with(&[("usr/local/bin/httpd", &web, 0o755)]),
        ],
        &ImageConf {
            cmd: strings(&["/usr/local/bin/httpd"]),
            env: strings(&[PATH_ENV, "FLAVOR=httpd", "LISTEN_PORT=80"]),
            ..Default::default()
        },
        false,
    );
    p.push("e2e-test-images/httpd", "2.4.39-4", &httpd).await;
    pushed.push("registry.k8s.io/e2e-test-images/httpd:2.4.39-4".to_string());
    let nnp = Image::new(
        vec![
            base.clone(),
            layer_with(&[("usr/local/bin/nnp", &go_binary("nnp"), 0o4755)]),
        ],
        &ImageConf {
            entrypoint: strings(&["/usr/local/bin/nnp"]),
            cmd: strings(&[]),
            ..Default::default()
        },
        false,
    );
    p.push("e2e-test-images/nonewprivs", "1.3", &nnp).await;
    pushed.push("registry.k8s.io/e2e-test-images/nonewprivs:1.3".to_string());
    let pause = Image::new(
        vec![layer_with(&[("pause", &go_binary("pause"), 0o755)])],
        &ImageConf {
            entrypoint: strings(&["/pause"]),
            user: "65535:65535".into(),
            ..Default::default()
        },
        false,
    );
    for tag in ["3.6", "3.8", "3.9", "3.10"] {
        p.push("pause", tag, &pause).await;
        pushed.push(format!("registry.k8s.io/pause:{tag}"));
    }
    // A user whose groups come from the image (SupplementalGroups specs).
    let mut passwd = oci::PASSWD.to_string();
    passwd.push_str("default-user:x:1000:1000:Default User:/home/default-user:/bin/sh\n");
    let mut group = oci::GROUP.to_string();
    group.push_str("default-user:x:1000:\ngroup-defined-in-image:x:50000:default-user\n");
    let predefined = Image::new(
        vec![
            base.clone(),
            layer_with(&[
                ("etc/passwd", passwd.as_bytes(), 0o644),
                ("etc/group", group.as_bytes(), 0o644),
            ]),
        ],
        &ImageConf {
            user: "1000".into(),
            ..Default::default()
        },
        false,
    );
    p.push(
        &format!("{CRI_TOOLS}/test-image-predefined-group"),
        "latest",
        &predefined,
    )
    .await;
    pushed.push(format!(
        "gcr.io/{CRI_TOOLS}/test-image-predefined-group:latest"
    ));

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
