//! crictl (built from sigs.k8s.io/cri-tools) against a real hako: the image commands a node
//! operator uses, with the output a containerd user expects.

mod support;

use std::process::Command;

use support::hako::Hako;
use support::oci::{self, Compression, Image, ImageConf, Layer, Pusher};
use support::registry::Registry;

struct Crictl<'a> {
    bin: std::path::PathBuf,
    hako: &'a Hako,
}

impl Crictl<'_> {
    fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(&self.bin)
            .args([
                "--runtime-endpoint",
                &self.hako.endpoint(),
                "--image-endpoint",
                &self.hako.endpoint(),
                "--timeout",
                "60s",
            ])
            .args(args)
            .output()
            .expect("run crictl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    fn ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.run(args);
        assert!(ok, "crictl {args:?} failed: {err}\n{out}");
        out
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_image_commands() {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "crictl"]) {
        return;
    }
    let reg = Registry::start();
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf {
            user: "www-data".into(),
            ..Default::default()
        },
        false,
    );
    let digest = Pusher::new(&reg.addr)
        .push("ops/busybox", "1.36", &img)
        .await;
    let h = Hako::start("");
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };

    let v = c.ok(&["version"]);
    assert!(
        v.contains("RuntimeName:  hako") && v.contains("RuntimeApiVersion:  v1"),
        "{v}"
    );

    let info: serde_json::Value = serde_json::from_str(&c.ok(&["info"])).unwrap();
    let conds = info["status"]["conditions"].as_array().unwrap();
    assert!(
        conds
            .iter()
            .any(|c| c["type"] == "RuntimeReady" && c["status"] == true)
            && conds
                .iter()
                .any(|c| c["type"] == "NetworkReady" && c["status"] == true),
        "the harness's loopback CNI config makes the network ready: {info}"
    );
    assert!(
        info["cdi"]["errors"].as_array().unwrap().is_empty(),
        "{info}"
    );
    assert_eq!(info["config"]["listen"], h.socket.display().to_string());

    let name = format!("{}/ops/busybox:1.36", reg.addr);
    let out = c.ok(&["pull", &name]);
    assert_eq!(out.trim(), format!("Image is up to date for {}", img.id()));

    let out = c.ok(&["images"]);
    let row = out
        .lines()
        .find(|l| l.contains("ops/busybox"))
        .unwrap_or_else(|| panic!("{out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[0], format!("{}/ops/busybox", reg.addr));
    assert_eq!(cols[1], "1.36");
    assert_eq!(cols[2], &img.id()["sha256:".len().."sha256:".len() + 13]);
    let ids = c.ok(&["images", "-q"]);
    assert_eq!(ids.trim(), img.id());
    let digests = c.ok(&["images", "--digests"]);
    assert!(
        digests.contains(&digest["sha256:".len().."sha256:".len() + 13]),
        "{digests}"
    );

    let st: serde_json::Value = serde_json::from_str(&c.ok(&["inspecti", &name])).unwrap();
    assert_eq!(st["status"]["id"], img.id());
    assert_eq!(st["status"]["username"], "www-data");
    assert_eq!(st["status"]["repoTags"][0], name);
    assert_eq!(
        st["info"]["imageSpec"]["config"]["User"], "www-data",
        "{st}"
    );

    let fs: serde_json::Value = serde_json::from_str(&c.ok(&["imagefsinfo"])).unwrap();
    let usage = &fs["status"]["imageFilesystems"][0];
    assert!(
        usage["usedBytes"]["value"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 1_000_000,
        "{fs}"
    );
    assert!(
        usage["inodesUsed"]["value"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 10,
        "{fs}"
    );

    // rmi by the short id crictl shows.
    let short = &img.id()["sha256:".len().."sha256:".len() + 13];
    let out = c.ok(&["rmi", short]);
    assert!(out.contains("Deleted"), "{out}");
    assert!(!c.ok(&["images"]).contains("ops/busybox"));
    let (ok, _, err) = c.run(&["inspecti", &name]);
    assert!(!ok && err.contains("no such image"), "{err}");

    // A pull that fails says why, naming the image.
    let (ok, _, err) = c.run(&["pull", &format!("{}/ops/missing:1", reg.addr)]);
    assert!(
        !ok && err.contains("ops/missing") && err.contains("NotFound"),
        "{err}"
    );
}

/// A registry with busybox as `<registry>/ops/busybox:1`, and a hako (with `extra` config)
/// that has pulled it through crictl.
async fn busybox_and_hako(extra: &str) -> Option<(Registry, Hako, String)> {
    if !support::e2e_ready(&[support::registry::REGISTRY_BIN, "crictl"]) {
        return None;
    }
    let reg = Registry::start();
    let img = Image::new(
        vec![Layer::new(
            &oci::busybox_base_tar(),
            Compression::Gzip,
            false,
        )],
        &ImageConf::default(),
        false,
    );
    Pusher::new(&reg.addr).push("ops/busybox", "1", &img).await;
    let h = Hako::start(extra);
    let image = format!("{}/ops/busybox:1", reg.addr);
    Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    }
    .ok(&["pull", &image]);
    Some((reg, h, image))
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_pod_and_container_commands() {
    let Some((_reg, h, image)) = busybox_and_hako("").await else {
        return;
    };
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let pod_json = dir.path().join("pod.json");
    std::fs::write(
        &pod_json,
        serde_json::json!({
            "metadata": {"name": "ops-pod", "namespace": "default", "uid": "ops-uid", "attempt": 0},
            "hostname": "ops-host",
            "log_directory": logs,
            "labels": {"team": "ops"},
            "linux": {}
        })
        .to_string(),
    )
    .unwrap();
    let ctr_json = dir.path().join("ctr.json");
    std::fs::write(
        &ctr_json,
        serde_json::json!({
            "metadata": {"name": "greeter"},
            "image": {"image": image},
            "command": ["sh", "-c", "echo hello from $(hostname); sleep 300"],
            "log_path": "greeter.log",
            "linux": {}
        })
        .to_string(),
    )
    .unwrap();
    let pod = c
        .ok(&["runp", pod_json.to_str().unwrap()])
        .trim()
        .to_string();
    assert_eq!(pod.len(), 64, "{pod}");
    let pods = c.ok(&["pods"]);
    assert!(
        pods.lines()
            .any(|l| l.contains(&pod[..13]) && l.contains("Ready") && l.contains("ops-pod")),
        "{pods}"
    );
    let inspectp: serde_json::Value = serde_json::from_str(&c.ok(&["inspectp", &pod])).unwrap();
    assert_eq!(inspectp["status"]["state"], "SANDBOX_READY");
    assert_eq!(inspectp["status"]["metadata"]["name"], "ops-pod");

    let ctr = c
        .ok(&[
            "create",
            &pod,
            ctr_json.to_str().unwrap(),
            pod_json.to_str().unwrap(),
        ])
        .trim()
        .to_string();
    c.ok(&["start", &ctr]);
    let ps = c.ok(&["ps"]);
    assert!(
        ps.lines()
            .any(|l| l.contains(&ctr[..13]) && l.contains("Running") && l.contains("greeter")),
        "{ps}"
    );
    support::wait_for(
        "crictl logs to show the greeting",
        std::time::Duration::from_secs(30),
        || c.ok(&["logs", &ctr]).contains("hello"),
    )
    .await;
    let out = c.ok(&["logs", &ctr]);
    assert_eq!(out.trim(), "hello from ops-host");
    let inspect: serde_json::Value = serde_json::from_str(&c.ok(&["inspect", &ctr])).unwrap();
    assert_eq!(inspect["status"]["state"], "CONTAINER_RUNNING");
    assert_eq!(
        inspect["status"]["logPath"],
        logs.join("greeter.log").display().to_string()
    );

    c.ok(&["stop", "--timeout", "1", &ctr]);
    let inspect: serde_json::Value = serde_json::from_str(&c.ok(&["inspect", &ctr])).unwrap();
    assert_eq!(inspect["status"]["state"], "CONTAINER_EXITED");
    assert_eq!(inspect["status"]["exitCode"], 143, "{inspect}");
    let ps = c.ok(&["ps", "-a"]);
    assert!(ps.contains("Exited"), "{ps}");
    c.ok(&["rm", &ctr]);
    assert!(!c.ok(&["ps", "-a"]).contains(&ctr[..13]));
    c.ok(&["stopp", &pod]);
    assert!(c.ok(&["pods"]).contains("NotReady"));
    c.ok(&["rmp", &pod]);
    assert!(!c.ok(&["pods"]).contains(&pod[..13]));
    let (ok, _, err) = c.run(&["inspectp", &pod]);
    assert!(!ok && err.contains("NotFound"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn crictl_create_with_cdi_devices_and_annotations() {
    let cdi = tempfile::tempdir().unwrap();
    std::fs::write(
        cdi.path().join("crictl.yaml"),
        "cdiVersion: 0.6.0\nkind: hako.test/crictl\ndevices:\n\
         - name: 'null'\n  containerEdits:\n    deviceNodes: [{path: /dev/crictl-null, type: c, major: 1, minor: 3}]\n\
         - name: zero\n  containerEdits:\n    deviceNodes: [{path: /dev/crictl-zero, type: c, major: 1, minor: 5}]\n",
    )
    .unwrap();
    let extra = format!("[cdi]\nspec_dirs = [\"{}\"]\n", cdi.path().display());
    let Some((_reg, h, image)) = busybox_and_hako(&extra).await else {
        return;
    };
    let c = Crictl {
        bin: support::which("crictl").unwrap(),
        hako: &h,
    };
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let pod_json = dir.path().join("pod.json");
    std::fs::write(
        &pod_json,
        serde_json::json!({
            "metadata": {"name": "cdi-pod", "namespace": "default", "uid": "cdi-uid"},
            "log_directory": logs,
            "linux": {}
        })
        .to_string(),
    )
    .unwrap();
    let ctr_json = dir.path().join("ctr.json");
    std::fs::write(
        &ctr_json,
        serde_json::json!({
            "metadata": {"name": "devices"},
            "image": {"image": image},
            "command": ["sh", "-c", "stat -c '%n %t:%T' /dev/crictl-null /dev/crictl-zero; sleep 300"],
            "log_path": "devices.log",
            "CDI_devices": [{"name": "hako.test/crictl=null"}],
            "annotations": {"cdi.k8s.io/extra": "hako.test/crictl=zero"},
            "linux": {}
        })
        .to_string(),
    )
    .unwrap();
    let pod = c
        .ok(&["runp", pod_json.to_str().unwrap()])
        .trim()
        .to_string();
    let ctr = c
        .ok(&[
            "create",
            &pod,
            ctr_json.to_str().unwrap(),
            pod_json.to_str().unwrap(),
        ])
        .trim()
        .to_string();
    c.ok(&["start", &ctr]);
    support::wait_for(
        "two lines in crictl logs",
        std::time::Duration::from_secs(30),
        || c.ok(&["logs", &ctr]).lines().count() >= 2,
    )
    .await;
    let out = c.ok(&["logs", &ctr]);
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["/dev/crictl-null 1:3", "/dev/crictl-zero 1:5"],
        "{out}"
    );
    c.ok(&["stopp", &pod]);
    c.ok(&["rmp", &pod]);
}
