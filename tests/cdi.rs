//! CDI end to end: spec files the test writes (JSON and YAML, several versions) name fake
//! devices the test makes (character nodes with /dev/null's and /dev/zero's numbers); a real
//! hako injects them into busybox containers.

mod support;

use k8s_cri::v1 as cri;
use support::cri::*;
use support::hako::Hako;
use support::registry::Registry;

struct Cdi {
    dir: tempfile::TempDir,
}

impl Cdi {
    /// Checks the e2e prerequisites first: nothing (device nodes included) is made for a test
    /// that is then skipped.
    fn new() -> Option<Cdi> {
        if !support::e2e_ready(&[support::registry::REGISTRY_BIN]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        for d in ["etc", "run", "dev", "data"] {
            std::fs::create_dir_all(dir.path().join(d)).unwrap();
        }
        for (name, minor) in [("fake-null", 3), ("fake-zero", 5)] {
            nix::sys::stat::mknod(
                &dir.path().join("dev").join(name),
                nix::sys::stat::SFlag::S_IFCHR,
                nix::sys::stat::Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(1, minor),
            )
            .unwrap();
        }
        std::fs::write(dir.path().join("data/vendor.txt"), "vendor-library\n").unwrap();
        Some(Cdi { dir })
    }

    fn path(&self, p: &str) -> String {
        self.dir.path().join(p).display().to_string()
    }

    fn write(&self, dir: &str, file: &str, text: &str) {
        std::fs::write(self.dir.path().join(dir).join(file), text).unwrap();
    }

    fn config(&self) -> String {
        format!(
            "[cdi]\nspec_dirs = [\"{}\", \"{}\"]\n",
            self.path("etc"),
            self.path("run")
        )
    }

    /// A 0.3.0 JSON spec: spec-level env, a node given by numbers, a mount.
    fn fake_json(&self, driver: &str) -> String {
        serde_json::json!({
            "cdiVersion": "0.3.0",
            "kind": "hako.test/fake",
            "containerEdits": {"env": [format!("FAKE_DRIVER={driver}")]},
            "devices": [{
                "name": "null",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/fake-null", "type": "c", "major": 1, "minor": 3, "permissions": "rw"}],
                    "mounts": [{"hostPath": self.path("data"), "containerPath": "/opt/fake", "options": ["ro", "bind"]}]
                }
            }]
        })
        .to_string()
    }

    /// A 0.7.0 YAML spec: a node taken from a host path (numbers read from it), env, an extra
    /// group and hooks at two stages.
    fn other_yaml(&self) -> String {
        format!(
            r#"cdiVersion: "0.7.0"
kind: hako.test/other
annotations:
  origin: test
devices:
  - name: zero
    containerEdits:
      env: ["FAKE_ZERO=yes"]
      deviceNodes:
        - path: /dev/fake-zero
          hostPath: {dev}
      additionalGIDs: [4242]
      hooks:
        - hookName: createRuntime
          path: /bin/sh
          args: ["sh", "-c", "cat > {marker}.create"]
        - hookName: poststart
          path: /bin/sh
          args: ["sh", "-c", "cat > {marker}.poststart"]
"#,
            dev = self.path("dev/fake-zero"),
            marker = self.path("hook"),
        )
    }
}

async fn create(
    rt: &mut Rt,
    pod: &str,
    cfg: &cri::PodSandboxConfig,
    cc: cri::ContainerConfig,
) -> Result<String, tonic::Status> {
    rt.create_container(cri::CreateContainerRequest {
        pod_sandbox_id: pod.into(),
        config: Some(cc),
        sandbox_config: Some(cfg.clone()),
    })
    .await
    .map(|r| r.into_inner().container_id)
}

fn with_cdi(mut cc: cri::ContainerConfig, names: &[&str]) -> cri::ContainerConfig {
    cc.cdi_devices = names
        .iter()
        .map(|n| cri::CdiDevice {
            name: n.to_string(),
        })
        .collect();
    cc
}

async fn setup(cdi: &Cdi) -> Option<(Registry, Hako)> {
    ready_with_config(&cdi.config()).await
}

#[tokio::test(flavor = "multi_thread")]
async fn cdi_devices_env_mounts_groups_and_hooks_reach_the_container() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    cdi.write("etc", "fake.json", &cdi.fake_json("1"));
    cdi.write("run", "other.yaml", &cdi.other_yaml());
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    // One device by cdi_devices, the other and the first again by a container annotation (the
    // repeat is dropped). The pod's own annotation asks for a device too: pod authors write
    // those, so it is never honoured.
    let mut cfg = pod_config("cdi", logs.path());
    cfg.annotations.insert(
        "cdi.k8s.io/pod-devices".into(),
        "hako.test/other=zero".into(),
    );
    let pod = run_pod(&mut rt, &cfg).await;
    let mut cc = with_cdi(
        container_config("dev", &["sleep", "60"]),
        &["hako.test/fake=null"],
    );
    cc.annotations.insert(
        "cdi.k8s.io/again".into(),
        "hako.test/fake=null,hako.test/other=zero".into(),
    );
    let id = create(&mut rt, &pod, &cfg, cc).await.unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();

    assert_eq!(
        exec(&mut rt, &id, "echo $FAKE_DRIVER $FAKE_ZERO").await,
        "1 yes"
    );
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "stat -c '%t:%T' /dev/fake-null /dev/fake-zero | tr '\\n' ' '"
        )
        .await,
        "1:3 1:5"
    );
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "echo gone > /dev/fake-null && head -c 3 /dev/fake-zero | od -An -tx1"
        )
        .await,
        "00 00 00"
    );
    assert_eq!(
        exec(&mut rt, &id, "cat /opt/fake/vendor.txt").await,
        "vendor-library"
    );
    assert!(exec(&mut rt, &id, "id -G")
        .await
        .split(' ')
        .any(|g| g == "4242"));
    // A node the container was not given is refused by the device cgroup.
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: id.clone(),
            cmd: vec![
                "sh".into(),
                "-c".into(),
                "mknod /tmp/mem c 1 1 && head -c1 /tmp/mem".into(),
            ],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(out.exit_code, 0);
    assert!(String::from_utf8_lossy(&out.stderr).contains("Operation not permitted"));
    // A container that asks for nothing gets nothing, whatever its pod's annotations say.
    let plain = create(
        &mut rt,
        &pod,
        &cfg,
        container_config("plain", &["sleep", "60"]),
    )
    .await
    .unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: plain.clone(),
    })
    .await
    .unwrap();
    assert_eq!(
        exec(
            &mut rt,
            &plain,
            "echo \"zero=$FAKE_ZERO\"; test -e /dev/fake-zero && echo has-node; true"
        )
        .await,
        "zero="
    );
    // Both hooks ran and got the container's state on stdin.
    for stage in ["create", "poststart"] {
        let state = std::fs::read_to_string(cdi.path(&format!("hook.{stage}"))).unwrap();
        assert!(state.contains(&id), "{stage} hook state: {state}");
    }

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_ambiguous_and_broken_specs_fail_cleanly_and_changes_apply_live() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    cdi.write("etc", "fake.json", &cdi.fake_json("1"));
    cdi.write(
        "etc",
        "broken.yaml",
        "cdiVersion: 0.6.0\nkind: hako.test/broken\ndevices:\n  - name: [unclosed\n",
    );
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-errors", logs.path());
    let pod = run_pod(&mut rt, &cfg).await;
    let bundles = || Hako::files_under(&h.dir.path().join("state/containers"));

    let e = create(
        &mut rt,
        &pod,
        &cfg,
        with_cdi(container_config("a", &["true"]), &["hako.test/fake=nope"]),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("hako.test/fake=nope"), "{e:?}");
    let e = create(
        &mut rt,
        &pod,
        &cfg,
        with_cdi(container_config("b", &["true"]), &["not-qualified"]),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    // A device of the broken spec: the error names the file.
    let e = create(
        &mut rt,
        &pod,
        &cfg,
        with_cdi(container_config("c", &["true"]), &["hako.test/broken=x"]),
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("broken.yaml"), "{e:?}");
    assert!(bundles().is_empty(), "failed creates left {:?}", bundles());
    // The broken spec is reported in Status, and logged.
    let info = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner()
        .info;
    let v: serde_json::Value = serde_json::from_str(&info["cdi"]).unwrap();
    assert!(
        v["errors"][0]["file"]
            .as_str()
            .unwrap()
            .ends_with("broken.yaml"),
        "{v}"
    );
    assert!(v["devices"]
        .as_array()
        .unwrap()
        .contains(&"hako.test/fake=null".into()));
    assert!(h.log_text().contains("CDI spec is invalid"));

    // It does not affect other devices; a live change is used by the next container.
    let run = |name: &str| {
        with_cdi(
            container_config(name, &["sh", "-c", "echo $FAKE_DRIVER; sleep 60"]),
            &["hako.test/fake=null"],
        )
    };
    let first = create(&mut rt, &pod, &cfg, run("first")).await.unwrap();
    cdi.write("etc", "fake.json", &cdi.fake_json("2"));
    let second = create(&mut rt, &pod, &cfg, run("second")).await.unwrap();
    for id in [&first, &second] {
        rt.start_container(cri::StartContainerRequest {
            container_id: id.to_string(),
        })
        .await
        .unwrap();
    }
    assert_eq!(exec(&mut rt, &first, "echo $FAKE_DRIVER").await, "1");
    assert_eq!(exec(&mut rt, &second, "echo $FAKE_DRIVER").await, "2");

    // The same device in two files of one directory: ambiguous, both named.
    cdi.write("etc", "again.json", &cdi.fake_json("3"));
    let e = create(&mut rt, &pod, &cfg, run("third")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().contains("fake.json") && e.message().contains("again.json"),
        "{e:?}"
    );
    // A later directory overrides: /run's copy wins over /etc's two.
    cdi.write("run", "fake.json", &cdi.fake_json("run"));
    let fourth = create(&mut rt, &pod, &cfg, run("fourth")).await.unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: fourth.clone(),
    })
    .await
    .unwrap();
    assert_eq!(exec(&mut rt, &fourth, "echo $FAKE_DRIVER").await, "run");
    // Removed everywhere: unknown again.
    for f in ["etc/fake.json", "etc/again.json", "run/fake.json"] {
        std::fs::remove_file(cdi.dir.path().join(f)).unwrap();
    }
    let e = create(&mut rt, &pod, &cfg, run("fifth")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
