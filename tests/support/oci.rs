//! Builds OCI and Docker images from local files and pushes them to a registry with the
//! distribution API (monolithic blob uploads). Nothing is downloaded from outside: the base
//! image is Debian's dynamic busybox with its libraries, as critest's stand-ins need.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

/// A tar stream under construction, with deterministic headers.
pub struct Tar {
    b: tar::Builder<Vec<u8>>,
    dirs: BTreeSet<String>,
}

impl Default for Tar {
    fn default() -> Self {
        Tar {
            b: tar::Builder::new(Vec::new()),
            dirs: BTreeSet::new(),
        }
    }
}

impl Tar {
    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    }

    /// Adds parent directories of `path` not added yet (mode 0755).
    fn parents(&mut self, path: &str) {
        let mut acc = String::new();
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        for p in &parts[..parts.len().saturating_sub(1)] {
            acc.push_str(p);
            acc.push('/');
            if self.dirs.insert(acc.clone()) {
                let mut h = Self::header(tar::EntryType::Directory, 0o755, 0);
                self.b.append_data(&mut h, &acc, std::io::empty()).unwrap();
            }
        }
    }

    pub fn dir(&mut self, path: &str, mode: u32) -> &mut Self {
        self.parents(path);
        let p = format!("{}/", path.trim_matches('/'));
        if self.dirs.insert(p.clone()) {
            let mut h = Self::header(tar::EntryType::Directory, mode, 0);
            self.b.append_data(&mut h, &p, std::io::empty()).unwrap();
        }
        self
    }

    pub fn file(&mut self, path: &str, data: &[u8], mode: u32) -> &mut Self {
        self.file_owned(path, data, mode, 0, 0)
    }

    pub fn file_owned(
        &mut self,
        path: &str,
        data: &[u8],
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> &mut Self {
        self.parents(path);
        let mut h = Self::header(tar::EntryType::Regular, mode, data.len() as u64);
        h.set_uid(uid);
        h.set_gid(gid);
        self.b
            .append_data(&mut h, path.trim_start_matches('/'), data)
            .unwrap();
        self
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.parents(path);
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.b
            .append_link(&mut h, path.trim_start_matches('/'), target)
            .unwrap();
        self
    }

    pub fn hardlink(&mut self, path: &str, target: &str, mode: u32) -> &mut Self {
        self.parents(path);
        // The target's mode: extractors that apply the entry's mode must not change the inode.
        let mut h = Self::header(tar::EntryType::Link, mode, 0);
        self.b
            .append_link(
                &mut h,
                path.trim_start_matches('/'),
                target.trim_start_matches('/'),
            )
            .unwrap();
        self
    }

    /// An entry whose name (and link target) are raw bytes, which need not be UTF-8; no
    /// parent directories are added.
    pub fn raw(
        &mut self,
        kind: tar::EntryType,
        path: &[u8],
        target: &[u8],
        data: &[u8],
        mode: u32,
    ) -> &mut Self {
        use std::os::unix::ffi::OsStrExt;
        let path = Path::new(std::ffi::OsStr::from_bytes(path));
        let mut h = Self::header(kind, mode, data.len() as u64);
        if kind == tar::EntryType::Symlink {
            let target = Path::new(std::ffi::OsStr::from_bytes(target));
            self.b.append_link(&mut h, path, target).unwrap();
        } else {
            self.b.append_data(&mut h, path, data).unwrap();
        }
        self
    }

    /// Copies a host file (following symlinks) to `dest` with its mode.
    pub fn host_file(&mut self, host: &Path, dest: &str) -> &mut Self {
        use std::os::unix::fs::PermissionsExt;
        let data = std::fs::read(host).unwrap_or_else(|e| panic!("read {}: {e}", host.display()));
        let mode = std::fs::metadata(host).unwrap().permissions().mode() & 0o7777;
        self.file(dest, &data, mode)
    }

    pub fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub blob: Vec<u8>,
    pub digest: String,
    pub diff_id: String,
    pub media_type: String,
}

impl Layer {
    pub fn new(tar: &[u8], c: Compression, docker: bool) -> Layer {
        let (blob, mt) = match c {
            Compression::None => (
                tar.to_vec(),
                if docker {
                    "application/vnd.docker.image.rootfs.diff.tar"
                } else {
                    "application/vnd.oci.image.layer.v1.tar"
                },
            ),
            Compression::Gzip => {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(tar).unwrap();
                (
                    gz.finish().unwrap(),
                    if docker {
                        "application/vnd.docker.image.rootfs.diff.tar.gzip"
                    } else {
                        "application/vnd.oci.image.layer.v1.tar+gzip"
                    },
                )
            }
            Compression::Zstd => (
                zstd::bulk::compress(tar, 1).unwrap(),
                "application/vnd.oci.image.layer.v1.tar+zstd",
            ),
        };
        Layer {
            digest: sha256(&blob),
            diff_id: sha256(tar),
            blob,
            media_type: mt.into(),
        }
    }
}

/// What goes into an image config besides the layers.
#[derive(Clone, Debug, Default)]
pub struct ImageConf {
    pub user: String,
    pub cmd: Vec<String>,
    pub entrypoint: Vec<String>,
    pub env: Vec<String>,
    pub architecture: Option<String>,
    pub stop_signal: Option<String>,
}

pub struct Image {
    pub layers: Vec<Layer>,
    pub config: Vec<u8>,
    pub docker: bool,
}

impl Image {
    pub fn new(layers: Vec<Layer>, conf: &ImageConf, docker: bool) -> Image {
        let mut config = serde_json::json!({
            "architecture": conf.architecture.clone().unwrap_or_else(|| "amd64".into()),
            "os": "linux",
            "config": {
                "Env": if conf.env.is_empty() { vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()] } else { conf.env.clone() },
                "Cmd": if conf.cmd.is_empty() && conf.entrypoint.is_empty() { vec!["sh".to_string()] } else { conf.cmd.clone() },
            },
            "rootfs": { "type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>() },
        });
        if !conf.user.is_empty() {
            config["config"]["User"] = conf.user.clone().into();
        }
        if !conf.entrypoint.is_empty() {
            config["config"]["Entrypoint"] = conf.entrypoint.clone().into();
        }
        if let Some(sig) = &conf.stop_signal {
            config["config"]["StopSignal"] = sig.clone().into();
        }
        Image {
            layers,
            config: serde_json::to_vec(&config).unwrap(),
            docker,
        }
    }

    pub fn id(&self) -> String {
        sha256(&self.config)
    }

    pub fn manifest(&self) -> (Vec<u8>, &'static str) {
        let (mt, cfg_mt) = if self.docker {
            (
                "application/vnd.docker.distribution.manifest.v2+json",
                "application/vnd.docker.container.image.v1+json",
            )
        } else {
            (
                "application/vnd.oci.image.manifest.v1+json",
                "application/vnd.oci.image.config.v1+json",
            )
        };
        let m = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": mt,
            "config": { "mediaType": cfg_mt, "digest": self.id(), "size": self.config.len() },
            "layers": self.layers.iter().map(|l| serde_json::json!({
                "mediaType": l.media_type, "digest": l.digest, "size": l.blob.len()
            })).collect::<Vec<_>>(),
        });
        (serde_json::to_vec(&m).unwrap(), mt)
    }
}

/// A registry client for pushing (test side only).
pub struct Pusher {
    pub base: String,
    http: reqwest::Client,
    auth: Option<(String, String)>,
}

impl Pusher {
    pub fn new(addr: &str) -> Pusher {
        let _ = rustls::crypto::ring::default_provider().install_default();
        Pusher {
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
            auth: None,
        }
    }

    /// Over HTTPS, trusting any certificate (the test's own registry).
    pub fn new_tls(addr: &str) -> Pusher {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .danger_accept_invalid_certs(true)
            .build()
            .unwrap();
        Pusher {
            base: format!("https://{addr}"),
            http,
            auth: None,
        }
    }

    pub fn with_basic(mut self, user: &str, pass: &str) -> Pusher {
        self.auth = Some((user.into(), pass.into()));
        self
    }

    fn req(&self, m: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(m, url);
        match &self.auth {
            Some((u, p)) => r.basic_auth(u, Some(p)),
            None => r,
        }
    }

    pub async fn blob(&self, repo: &str, data: &[u8]) -> String {
        let digest = sha256(data);
        let head = self
            .req(
                reqwest::Method::HEAD,
                &format!("{}/v2/{repo}/blobs/{digest}", self.base),
            )
            .send()
            .await
            .unwrap();
        if head.status().is_success() {
            return digest;
        }
        let r = self
            .req(
                reqwest::Method::POST,
                &format!("{}/v2/{repo}/blobs/uploads/", self.base),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            202,
            "start upload to {repo}: {}",
            r.text().await.unwrap_or_default()
        );
        let loc = r.headers()["location"].to_str().unwrap().to_string();
        let loc = if loc.starts_with("http") {
            loc
        } else {
            format!("{}{loc}", self.base)
        };
        let sep = if loc.contains('?') { '&' } else { '?' };
        let r = self
            .req(reqwest::Method::PUT, &format!("{loc}{sep}digest={digest}"))
            .header("content-type", "application/octet-stream")
            .body(data.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            201,
            "upload blob to {repo}: {}",
            r.text().await.unwrap_or_default()
        );
        digest
    }

    pub async fn manifest(
        &self,
        repo: &str,
        reference: &str,
        body: &[u8],
        media_type: &str,
    ) -> String {
        let r = self
            .req(
                reqwest::Method::PUT,
                &format!("{}/v2/{repo}/manifests/{reference}", self.base),
            )
            .header("content-type", media_type)
            .body(body.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            201,
            "put manifest {repo}:{reference}: {}",
            r.text().await.unwrap_or_default()
        );
        sha256(body)
    }

    /// Pushes `image` as `repo:tag`; returns the manifest digest.
    pub async fn push(&self, repo: &str, tag: &str, image: &Image) -> String {
        for l in &image.layers {
            self.blob(repo, &l.blob).await;
        }
        self.blob(repo, &image.config).await;
        let (m, mt) = image.manifest();
        self.manifest(repo, tag, &m, mt).await
    }

    /// Pushes an index over already pushed manifests: (digest, size, arch).
    pub async fn push_index(
        &self,
        repo: &str,
        tag: &str,
        entries: &[(String, usize, &str)],
        docker: bool,
    ) -> String {
        let mt = if docker {
            "application/vnd.docker.distribution.manifest.list.v2+json"
        } else {
            "application/vnd.oci.image.index.v1+json"
        };
        let m_mt = if docker {
            "application/vnd.docker.distribution.manifest.v2+json"
        } else {
            "application/vnd.oci.image.manifest.v1+json"
        };
        let idx = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": mt,
            "manifests": entries.iter().map(|(d, s, arch)| serde_json::json!({
                "mediaType": m_mt, "digest": d, "size": s, "platform": {"os": "linux", "architecture": arch}
            })).collect::<Vec<_>>(),
        });
        self.manifest(repo, tag, &serde_json::to_vec(&idx).unwrap(), mt)
            .await
    }
}

/// Libraries a host binary needs, from `ldd`: (path in the host, path in the image).
fn libs_of(bin: &Path) -> Vec<String> {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let path = if let Some((_, rhs)) = line.split_once("=>") {
            rhs.split_whitespace().next().unwrap_or("")
        } else {
            line.split_whitespace().next().unwrap_or("")
        };
        if path.starts_with('/') {
            libs.push(path.to_string());
        }
    }
    libs
}

pub const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\ndaemon:x:1:1:daemon:/usr/sbin:/bin/false\nbin:x:2:2:bin:/bin:/bin/false\nsys:x:3:3:sys:/dev:/bin/false\nsync:x:4:100:sync:/bin:/bin/sync\nmail:x:8:8:mail:/var/spool/mail:/bin/false\nwww-data:x:33:33:www-data:/var/www:/bin/false\noperator:x:37:37:Operator:/var:/bin/false\nnobody:x:65534:65534:nobody:/home:/bin/false\n";
pub const GROUP: &str = "root:x:0:\ndaemon:x:1:\nbin:x:2:\nsys:x:3:\nadm:x:4:\ntty:x:5:\ndisk:x:6:\nlp:x:7:\nmail:x:8:\nkmem:x:9:\nwheel:x:10:root\ncdrom:x:11:\ndialout:x:18:\nfloppy:x:19:\nvideo:x:28:\naudio:x:29:\ntape:x:32:\nwww-data:x:33:\noperator:x:37:\nutmp:x:43:\nusers:x:100:\nstaff:x:50:\nnogroup:x:65534:\n";

/// The busybox base layer: Debian's dynamic busybox with its applets as hard links, its
/// libraries, `pgrep` and `ipcs` with theirs, and docker busybox's passwd and group.
pub fn busybox_base_tar() -> Vec<u8> {
    let bb = Path::new("/usr/bin/busybox");
    assert!(
        bb.exists(),
        "Debian's busybox package is needed: apt-get install busybox"
    );
    // A standalone build (busybox-static) runs its applets from sh without exec: critest's
    // MaskedPaths spec, which needs sh's exec of the masked /bin/ls to fail, cannot pass with
    // it. Such a sh finds `ls` with an empty PATH.
    let standalone = Command::new(bb)
        .args(["sh", "-c", "PATH=/nonexistent; ls / >/dev/null 2>&1"])
        .status()
        .expect("run busybox sh");
    assert!(
        !standalone.success(),
        "{} is a standalone busybox (busybox-static?): its sh runs applets without exec, \
         unlike the images the stand-ins replace; install Debian's dynamic busybox package",
        bb.display()
    );
    let mut t = Tar::default();
    for d in [
        "proc",
        "sys",
        "dev",
        "etc",
        "root",
        "home",
        "var",
        "var/run",
        "usr/local/bin",
    ] {
        t.dir(d, 0o755);
    }
    t.dir("tmp", 0o1777);
    t.host_file(bb, "bin/busybox");
    let list = Command::new(bb)
        .arg("--list-full")
        .output()
        .expect("busybox --list-full");
    let mut seen = BTreeSet::new();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        if applet.is_empty() || applet == "bin/busybox" || !seen.insert(applet.to_string()) {
            continue;
        }
        // procps' pgrep and util-linux' ipcs replace busybox's (Debian's busybox lacks them).
        if applet.ends_with("/pgrep") || applet.ends_with("/ipcs") {
            continue;
        }
        t.hardlink(applet, "bin/busybox", 0o755);
    }
    let mut libs = BTreeSet::new();
    libs.extend(libs_of(bb));
    for extra in ["/usr/bin/pgrep", "/usr/bin/ipcs"] {
        if Path::new(extra).exists() {
            t.host_file(Path::new(extra), extra);
            libs.extend(libs_of(Path::new(extra)));
        }
    }
    for lib in libs {
        t.host_file(Path::new(&lib), &lib);
    }
    t.file("etc/passwd", PASSWD.as_bytes(), 0o644);
    t.file("etc/group", GROUP.as_bytes(), 0o644);
    t.finish()
}

/// A one-file layer, to make images differ.
pub fn marker_tar(path: &str, content: &[u8]) -> Vec<u8> {
    let mut t = Tar::default();
    t.file(path, content, 0o644);
    t.finish()
}

/// `len` bytes no compressor can shrink (xorshift64 from `seed`), to make a layer's download
/// and unpack take as long as its size says.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}
