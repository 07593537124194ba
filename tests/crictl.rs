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
            && conds.iter().any(|c| c["type"] == "NetworkReady"
                && c["status"] == false
                && !c["reason"].as_str().unwrap().is_empty()),
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
