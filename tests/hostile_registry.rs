//! A hostile registry against a real `hako serve`: oversized manifests, indexes and configs,
//! blobs longer than their descriptors or endless, digests that are not digests (in a config's
//! `diff_ids`, in descriptors, in references). Each is served through the test proxy in front of
//! a real registry holding the genuine parts of the image. Every pull must fail with a clear
//! error naming the image and the entry, leave nothing behind (nothing listed, no download,
//! unpack or snapshot directory, no content, no file outside the store), and keep the daemon's
//! peak RSS within `RSS_GROWTH_BOUND` of what it was before.

mod support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use hako_proto::cri;
use support::hako::{pull, Hako};
use support::oci::{self, Compression, Layer, Pusher};
use support::proxy::{Behaviour, Canned, Proxy};
use support::registry::Registry;

/// How much the daemon's peak RSS (VmHWM) may grow across one hostile pull, once a first
/// pull has warmed it up (`warm_up`). The hostile answers are 64–512 MiB; hako holds at most
/// 4 MiB of a manifest or config in memory.
const RSS_GROWTH_BOUND: u64 = 24 << 20;
/// hako's cap on manifests, indexes and configs.
const CAP: u64 = 4 << 20;

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

fn base() -> &'static Layer {
    static BASE: OnceLock<Layer> = OnceLock::new();
    BASE.get_or_init(|| Layer::new(&oci::busybox_base_tar(), Compression::Gzip, false))
}

fn top(repo: &str) -> Layer {
    Layer::new(&oci::marker_tar(repo, b"x"), Compression::Gzip, false)
}

fn config_json(diff_ids: &[String]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Cmd": ["sh"] },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    }))
    .unwrap()
}

/// An OCI manifest over a config (digest, size) and layers (digest, size).
fn manifest_json(config: (&str, u64), layers: &[(String, u64)]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": { "mediaType": OCI_CONFIG, "digest": config.0, "size": config.1 },
        "layers": layers.iter().map(|(d, s)| serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": s
        })).collect::<Vec<_>>(),
    }))
    .unwrap()
}

fn layer_descs(layers: &[&Layer]) -> Vec<(String, u64)> {
    layers
        .iter()
        .map(|l| (l.digest.clone(), l.blob.len() as u64))
        .collect()
}

/// The base and `top` layers pushed to the registry, as genuine parts of a hostile image.
async fn push_layers(reg: &Registry, repo: &str, top: &Layer) {
    let p = Pusher::new(&reg.addr);
    p.blob(repo, &base().blob).await;
    p.blob(repo, &top.blob).await;
}

/// The daemon's peak resident set so far, in bytes.
fn vm_hwm(h: &Hako) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", h.pid())).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    kb * 1024
}

/// Pulls `image`, expecting INVALID_ARGUMENT with a message naming the image and each of
/// `names`; checks the daemon's peak RSS stayed within bounds and nothing is left behind.
async fn refused(h: &Hako, image: &str, names: &[&str]) -> String {
    refused_then(h, image, names, || {}).await
}

/// `refused`, with `first` checked right after the pull, before the error.
async fn refused_then(h: &Hako, image: &str, names: &[&str], first: impl FnOnce()) -> String {
    let before = vm_hwm(h);
    let err = pull(h, image).await.unwrap_err();
    first();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    let msg = err.message().to_string();
    assert!(msg.contains(image), "names the image {image}: {msg}");
    for n in names {
        assert!(msg.contains(n), "names {n:?}: {msg}");
    }
    assert_clean(h).await;
    // The peak after the clean-up, so layers still running when the pull answered count too.
    let after = vm_hwm(h);
    eprintln!(
        "{image}: daemon peak RSS {} KiB before, {} KiB after",
        before >> 10,
        after >> 10
    );
    assert!(
        after.saturating_sub(before) < RSS_GROWTH_BOUND,
        "peak RSS grew by {} MiB (from {} MiB)",
        (after - before) >> 20,
        before >> 20
    );
    msg
}

/// A first pull through `addr` (of an image that is not there): the daemon's registry client,
/// TLS roots and worker threads are set up, so the RSS measured after is the hostile pull's.
async fn warm_up(h: &Hako, addr: &str) {
    let err = pull(h, &format!("{addr}/warm/up:none")).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
}

/// Nothing listed, nothing half-written, nothing outside the store, no panic (once the failed
/// pull's layers still running have ended).
async fn assert_clean(h: &Hako) {
    let store_dirs = ["ingest", "snapshots", "content/sha256", "trash"];
    h.settle_store(&store_dirs).await;
    let mut c = h.images().await;
    let listed = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(listed.is_empty(), "{listed:?}");
    for d in store_dirs {
        let left = Hako::files_under(&h.root.join(d));
        assert!(left.is_empty(), "{d} left: {left:?}");
    }
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    let top = names(h.dir.path());
    for n in &top {
        assert!(
            [
                "certs.d",
                "cni",
                "config.toml",
                "hako.log",
                "hako.sock",
                "root",
                "state"
            ]
            .contains(&n.as_str()),
            "{n} appeared beside the store: {top:?}"
        );
    }
    let root = names(&h.root);
    for n in &root {
        assert!(
            [
                "meta.db",
                "content",
                "snapshots",
                "ingest",
                "trash",
                "containers",
                "cni"
            ]
            .contains(&n.as_str()),
            "{n} appeared in the store's root: {root:?}"
        );
    }
    let log = h.log_text();
    assert!(!log.contains("panicked"), "{log}");
}

/// A fresh registry, a proxy in front of it behaving as `b`, and a hako.
async fn setup(behaviour: Behaviour) -> (Registry, Proxy, Hako) {
    let reg = Registry::start();
    let proxy = Proxy::start(&reg.addr, behaviour).await;
    let h = Hako::start("");
    warm_up(&h, &proxy.addr).await;
    (reg, proxy, h)
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_manifests_are_refused_within_the_cap() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    // An index whose entry for this node says 5 MiB: refused before it is fetched.
    let big_digest = oci::sha256(b"never served");
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": big_digest, "size": 5u64 << 20,
            "platform": { "os": "linux", "architecture": "amd64" }
        }],
    }))
    .unwrap();
    let (_reg, proxy, h) = setup(Behaviour {
        canned: vec![
            (
                "/announced/img/manifests/1".into(),
                Canned::Filler {
                    len: 64 << 20,
                    announce: true,
                },
            ),
            (
                "/unannounced/img/manifests/1".into(),
                Canned::Filler {
                    len: 256 << 20,
                    announce: false,
                },
            ),
            (
                "/index/img/manifests/1".into(),
                Canned::Body(index, OCI_INDEX.into()),
            ),
        ],
        ..Default::default()
    })
    .await;
    for repo in ["announced/img", "unannounced/img"] {
        let name = format!("{}/{repo}:1", proxy.addr);
        let before = proxy.filler_sent();
        refused_then(&h, &name, &["manifest \"1\"", "larger than 4 MiB"], || {
            // Of the 64 or 256 MiB offered, hako took at most the cap's worth, plus what sat
            // in socket buffers.
            let sent = proxy.filler_sent() - before;
            eprintln!("{repo}: {} KiB of filler sent", sent >> 10);
            assert!(
                sent < CAP + (32 << 20),
                "{repo}: {} MiB of filler were taken",
                sent >> 20
            );
        })
        .await;
    }
    let name = format!("{}/index/img:1", proxy.addr);
    refused(
        &h,
        &name,
        &[&big_digest, "5242880 bytes", "larger than 4 MiB"],
    )
    .await;
    assert_eq!(proxy.count(&format!("/manifests/{big_digest}")), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn oversized_and_overlong_configs_are_refused() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let top = top("cfg");
    let diff_ids = vec![base().diff_id.clone(), top.diff_id.clone()];
    // A config descriptor of 8 MiB: refused before it is fetched.
    let big_config = oci::sha256(b"a big config");
    let big = manifest_json((&big_config, 8 << 20), &layer_descs(&[base(), &top]));
    // A genuine config served with extra bytes after it.
    let config = config_json(&diff_ids);
    let config_digest = oci::sha256(&config);
    let long = manifest_json(
        (&config_digest, config.len() as u64),
        &layer_descs(&[base(), &top]),
    );
    let (reg, proxy, h) = setup(Behaviour {
        canned: vec![
            (
                "/big/cfg/manifests/1".into(),
                Canned::Body(big, OCI_MANIFEST.into()),
            ),
            (
                "/long/cfg/manifests/1".into(),
                Canned::Body(long, OCI_MANIFEST.into()),
            ),
        ],
        long_blobs: vec![(config_digest.clone(), 1 << 20)],
        ..Default::default()
    })
    .await;
    push_layers(&reg, "long/cfg", &top).await;
    Pusher::new(&reg.addr).blob("long/cfg", &config).await;

    let name = format!("{}/big/cfg:1", proxy.addr);
    refused(
        &h,
        &name,
        &[
            &format!("config {big_config}"),
            "8388608 bytes",
            "larger than 4 MiB",
        ],
    )
    .await;
    assert_eq!(proxy.count(&format!("/blobs/{big_config}")), 0);

    let name = format!("{}/long/cfg:1", proxy.addr);
    let len = config.len();
    refused(
        &h,
        &name,
        &[
            &format!("config {config_digest}"),
            &format!(
                "announces {} bytes, its descriptor says {len}",
                len + (1 << 20)
            ),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_layer_longer_than_its_descriptor_is_refused() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let reg = Registry::start();
    let top = top("long/layer");
    let img = oci::Image::new(
        vec![base().clone(), top.clone()],
        &oci::ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr).push("long/layer", "1", &img).await;
    let proxy = Proxy::start(
        &reg.addr,
        Behaviour {
            long_blobs: vec![(top.digest.clone(), 64 << 20)],
            ..Default::default()
        },
    )
    .await;
    let h = Hako::start("");
    warm_up(&h, &proxy.addr).await;
    let name = format!("{}/long/layer:1", proxy.addr);
    let size = top.blob.len();
    refused(
        &h,
        &name,
        &[
            &format!("layer {}", top.digest),
            &format!("its descriptor says {size}"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_endless_blob_is_cut_at_its_descriptors_size() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let reg = Registry::start();
    let top = top("endless/layer");
    let img = oci::Image::new(
        vec![base().clone(), top.clone()],
        &oci::ImageConf::default(),
        false,
    );
    // Another config (another user) for the endless-config image.
    let other = oci::Image::new(
        vec![base().clone(), top.clone()],
        &oci::ImageConf {
            user: "7".into(),
            ..Default::default()
        },
        false,
    );
    Pusher::new(&reg.addr)
        .push("endless/layer", "1", &img)
        .await;
    Pusher::new(&reg.addr)
        .push("endless/config", "1", &other)
        .await;
    let proxy = Proxy::start(
        &reg.addr,
        Behaviour {
            endless_blobs: vec![top.digest.clone(), other.id()],
            ..Default::default()
        },
    )
    .await;
    let h = Hako::start("");
    warm_up(&h, &proxy.addr).await;
    // A layer: no Content-Length, zeros for ever (ENDLESS_CAP, for a client that never stops).
    let name = format!("{}/endless/layer:1", proxy.addr);
    let size = top.blob.len();
    let before = proxy.filler_sent();
    refused_then(
        &h,
        &name,
        &[
            &format!("layer {}", top.digest),
            &format!("longer than the {size} bytes its descriptor says"),
        ],
        || {
            // hako stopped reading at once: what left the proxy is the layer's size plus what
            // the socket buffers took, nowhere near the endless stream's cap.
            let sent = proxy.filler_sent() - before;
            eprintln!(
                "endless layer: {} KiB sent, the layer is {size} bytes",
                sent >> 10
            );
            assert!(
                sent < 64 << 20,
                "{} MiB of an endless layer were taken",
                sent >> 20
            );
        },
    )
    .await;
    // The config the same way.
    let name = format!("{}/endless/config:1", proxy.addr);
    let before = proxy.filler_sent();
    refused_then(
        &h,
        &name,
        &[
            &format!("config {}", other.id()),
            &format!("longer than the {} bytes", other.config.len()),
        ],
        || assert!(proxy.filler_sent() - before < 64 << 20),
    )
    .await;
}

/// `diff_ids` name snapshot directories (the first is the first layer's chain id): anything
/// but a digest is refused before it is used, naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn bad_diff_ids_are_refused_naming_the_field() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let top = top("diff");
    let unique = format!(
        "hako-escape-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let cases: Vec<(&str, String)> = vec![
        // Non-ASCII: byte 12 falls inside a character, where a name was once sliced.
        ("nonascii", format!("sha256:a{}", "é".repeat(63))),
        // A path: the snapshot would be <root>/snapshots/../../../../<unique>.
        ("path", format!("sha256:../../../../{unique}")),
        ("upper", format!("sha256:{}", "A".repeat(64))),
        ("sha512", format!("sha512:{}", "a".repeat(128))),
        ("empty", String::new()),
    ];
    let mut canned = Vec::new();
    for (repo, bad) in &cases {
        let config = config_json(&[bad.clone(), top.diff_id.clone()]);
        let digest = oci::sha256(&config);
        let manifest = manifest_json(
            (&digest, config.len() as u64),
            &layer_descs(&[base(), &top]),
        );
        canned.push((
            format!("/{repo}/diff/manifests/1"),
            Canned::Body(manifest, OCI_MANIFEST.into()),
        ));
        canned.push((
            format!("/blobs/{digest}"),
            Canned::Body(config, "application/octet-stream".into()),
        ));
    }
    let (reg, proxy, h) = setup(Behaviour {
        canned,
        ..Default::default()
    })
    .await;
    for (repo, _) in &cases {
        push_layers(&reg, &format!("{repo}/diff"), &top).await;
    }
    // Where the path case would land, from the snapshots directory and from an unpack
    // directory below it: outside the store either way.
    let landings: Vec<PathBuf> = [
        h.root.join("snapshots").join(&unique),
        Path::new("/").join(&unique),
        h.dir.path().join(&unique),
    ]
    .into();
    for (repo, _) in &cases {
        let name = format!("{}/{repo}/diff:1", proxy.addr);
        refused(&h, &name, &["image config sha256:", "rootfs.diff_ids[0]"]).await;
        for l in &landings {
            assert!(!l.exists(), "{repo}: {} exists", l.display());
        }
    }
    // No layer was fetched for any of them.
    assert_eq!(
        proxy.count(&format!("/blobs/{}", base().digest))
            + proxy.count(&format!("/blobs/{}", top.digest)),
        0
    );
}

/// Digests in descriptors (config, layers, an index's entries) and in references.
#[tokio::test(flavor = "multi_thread")]
async fn bad_descriptor_and_reference_digests_are_refused_naming_the_field() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
        return;
    }
    let top = top("desc");
    let config = config_json(&[base().diff_id.clone(), top.diff_id.clone()]);
    let config_digest = oci::sha256(&config);
    let good_layers = layer_descs(&[base(), &top]);
    // A layer digest of an algorithm hako does not address.
    let mut md5_layers = good_layers.clone();
    md5_layers[1].0 = "md5:0123456789abcdef0123456789abcdef".into();
    let bad_layer = manifest_json((&config_digest, config.len() as u64), &md5_layers);
    let sha512 = format!("sha512:{}", "b".repeat(128));
    let bad_config = manifest_json((&sha512, config.len() as u64), &good_layers);
    let bad_index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST, "digest": "foo:bar", "size": 100,
            "platform": { "os": "linux", "architecture": "amd64" }
        }],
    }))
    .unwrap();
    let (reg, proxy, h) = setup(Behaviour {
        canned: vec![
            (
                "/layer/desc/manifests/1".into(),
                Canned::Body(bad_layer, OCI_MANIFEST.into()),
            ),
            (
                "/config/desc/manifests/1".into(),
                Canned::Body(bad_config, OCI_MANIFEST.into()),
            ),
            (
                "/index/desc/manifests/1".into(),
                Canned::Body(bad_index, OCI_INDEX.into()),
            ),
        ],
        ..Default::default()
    })
    .await;
    for repo in ["layer/desc", "config/desc"] {
        push_layers(&reg, repo, &top).await;
        Pusher::new(&reg.addr).blob(repo, &config).await;
    }
    let at = |repo: &str| format!("{}/{repo}:1", proxy.addr);
    refused(&h, &at("layer/desc"), &["layers[1] digest", "\"md5:"]).await;
    refused(&h, &at("config/desc"), &["config digest", "\"sha512:"]).await;
    refused(
        &h,
        &at("index/desc"),
        &["manifest for linux/amd64", "\"foo:bar\""],
    )
    .await;
    assert_eq!(proxy.count("/blobs/"), 0, "nothing fetched by a bad digest");
    assert_eq!(proxy.count("/manifests/foo:bar"), 0);

    // In a reference: upper-case hex is not a digest (the registry is never asked).
    let upper = format!("{}/ref/desc@sha256:{}", proxy.addr, "A".repeat(64));
    let err = pull(&h, &upper).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains(&upper) && err.message().contains("digest"),
        "{}",
        err.message()
    );
    assert_eq!(proxy.count("/ref/desc/"), 0);
    assert_clean(&h).await;
}
