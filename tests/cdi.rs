//! CDI end to end: spec files the test writes (JSON and YAML, several versions) name fake
//! devices the test makes (character nodes with /dev/null's and /dev/zero's numbers); a real
//! hako injects them into busybox containers.

mod support;

use hako_proto::cri;
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

/// A Go module as the Go module proxy serves it, pinned by its `h1:` sum (the hash go.sum
/// records; checked again here over the unpacked files, as `go mod verify` does).
struct GoModule {
    path: &'static str,
    version: &'static str,
    h1: &'static str,
}

/// Upstream CDI's last release whose module still carries `schema/testdata` (good and bad
/// specs of the JSON schema).
const CDI_SCHEMA: GoModule = GoModule {
    path: "tags.cncf.io/container-device-interface",
    version: "v0.8.1",
    h1: "h1:c0jN4Mt6781jD67NdPajmZlD1qrqQyov/Xfoab37lj0=",
};

/// nvidia-container-toolkit: its tests hold the specs `nvidia-ctk cdi generate` writes.
const NVIDIA_CTK: GoModule = GoModule {
    path: "github.com/NVIDIA/nvidia-container-toolkit",
    version: "v1.19.1",
    h1: "h1:1sV4ddFrBccqL9Lbzcdu50w2j5FhyNJpN5hXTfCsjps=",
};

/// Go's dirhash "h1": sha256 over the sorted lines "<sha256 of file>  <module@version/path>".
fn h1_of_dir(dir: &std::path::Path, prefix: &str) -> String {
    use base64::Engine as _;
    use sha2::{Digest, Sha256};
    let mut files = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            if t.is_dir() {
                todo.push(e.path());
            } else {
                let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
                files.push((format!("{prefix}/{rel}"), e.path()));
            }
        }
    }
    files.sort();
    let mut summary = String::new();
    for (name, p) in files {
        let sum = Sha256::digest(std::fs::read(&p).unwrap());
        let hex: String = sum.iter().map(|b| format!("{b:02x}")).collect();
        summary.push_str(&format!("{hex}  {name}\n"));
    }
    format!(
        "h1:{}",
        base64::engine::general_purpose::STANDARD.encode(Sha256::digest(summary.as_bytes()))
    )
}

/// The module's files, downloaded by `go mod download` (into the Go module cache) and
/// verified against the pin; None (skipped) without go or the proxy.
fn go_module(m: &GoModule) -> Option<std::path::PathBuf> {
    let what = format!("{}@{}", m.path, m.version);
    let Some(go) = support::which("go") else {
        support::skip(
            &what,
            "go is not on PATH (it fetches the conformance specs)",
        );
        return None;
    };
    // Outside any module, so that no go.mod of the checkout is consulted.
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(go)
        .args(["mod", "download", "-json", &what])
        .current_dir(tmp.path())
        .env("GOFLAGS", "-mod=mod")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    if !out.status.success() || v.get("Error").is_some() {
        support::skip(
            &what,
            &format!(
                "go mod download failed (no module proxy?): {} {}",
                v["Error"],
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        );
        return None;
    }
    assert_eq!(
        v["Sum"], m.h1,
        "{what}: the proxy's sum is not the pinned one"
    );
    let dir = std::path::PathBuf::from(v["Dir"].as_str().expect("Dir"));
    assert_eq!(
        h1_of_dir(&dir, &what),
        m.h1,
        "{what}: the files in {} do not hash to the pinned sum",
        dir.display()
    );
    Some(dir)
}

/// The YAML specs in a Go test file's raw strings (`...`), template fields (`{{ .driverRoot }}`)
/// replaced by `root`.
fn go_raw_specs(text: &str, root: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.contains("cdiVersion:"))
        .map(|s| {
            let mut out = String::new();
            let mut rest = s;
            while let Some(i) = rest.find("{{") {
                out.push_str(&rest[..i]);
                let j = rest[i..].find("}}").expect("closed template field") + i + 2;
                out.push_str(root);
                rest = &rest[j..];
            }
            out.push_str(rest);
            out
        })
        .collect()
}

/// Every device of every good spec resolves and its edits apply to a generated OCI spec that
/// still types; the host's missing device nodes are stood in for by nodes the test makes.
fn apply_all(dir: &std::path::Path, nodes: &std::path::Path) -> usize {
    let reg = hako_runtime::cdi::Registry::new(vec![dir.to_path_buf()]);
    let (devices, errors) = reg.report();
    assert!(errors.is_empty(), "good specs rejected: {errors:#?}");
    for name in &devices {
        let mut r = reg
            .resolve(std::slice::from_ref(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (_, e) in &mut r.edits {
            for d in &mut e.device_nodes {
                let host = d.host_path.clone().unwrap_or_else(|| d.path.clone());
                let stand_in = nodes.join(host.trim_start_matches('/').replace('/', "_"));
                if !stand_in.exists() {
                    nix::sys::stat::mknod(
                        &stand_in,
                        nix::sys::stat::SFlag::S_IFCHR,
                        nix::sys::stat::Mode::from_bits_truncate(0o666),
                        nix::sys::stat::makedev(1, 3),
                    )
                    .unwrap();
                }
                d.host_path = Some(stand_in.display().to_string());
            }
        }
        let mut oci = hako_runtime::spec::generate(&hako_runtime::spec::ContainerSpec {
            args: vec!["true".into()],
            ..Default::default()
        });
        hako_runtime::cdi::apply(&mut oci, &r).unwrap_or_else(|e| panic!("{name}: {e}"));
        // What libcontainer reads back must be the spec that was edited.
        let text = serde_json::to_string(&oci).unwrap();
        let back: oci_spec::runtime::Spec =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(back, oci, "{name}");
    }
    devices.len()
}

#[test]
fn upstream_and_nvidia_ctk_specs_parse_apply_or_are_refused_by_field() {
    if !nix::unistd::Uid::effective().is_root() {
        support::skip("cdi corpus", "needs root to make stand-in device nodes");
        return;
    }
    let Some(cdi) = go_module(&CDI_SCHEMA) else {
        return;
    };
    let Some(ctk) = go_module(&NVIDIA_CTK) else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let (good, bad, nodes) = (
        work.path().join("good"),
        work.path().join("bad"),
        work.path().join("nodes"),
    );
    for d in [&good, &bad, &nodes] {
        std::fs::create_dir(d).unwrap();
    }
    // Each good spec alone in a directory: several define the same devices.
    let put_good = |name: &str, text: &str| {
        let d = good.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(name), text).unwrap();
    };
    // Upstream's schema test specs, good and bad.
    for kind in ["good", "bad"] {
        for e in std::fs::read_dir(cdi.join("schema/testdata").join(kind)).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&p).unwrap();
            if kind == "good" {
                put_good(&name, &text);
            } else {
                std::fs::write(bad.join(name), text).unwrap();
            }
        }
    }
    // nvidia-ctk's generated specs, as its tests expect them (all good to upstream's parser).
    let root = work.path().join("driver-root").display().to_string();
    let mut n = 0;
    let mut todo = vec![ctk.clone()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() && p.file_name() != Some("vendor".as_ref()) {
                todo.push(p);
            } else if p.to_string_lossy().ends_with("_test.go") {
                for spec in go_raw_specs(&std::fs::read_to_string(&p).unwrap(), &root) {
                    n += 1;
                    put_good(&format!("nvidia-ctk-{n:02}.yaml"), &spec);
                }
            }
        }
    }
    assert!(
        n >= 10,
        "only {n} nvidia-ctk specs found in {}",
        ctk.display()
    );
    for e in std::fs::read_dir(&good).unwrap() {
        let d = e.unwrap().path();
        let devices = apply_all(&d, &nodes);
        assert!(devices >= 1, "{}: no devices", d.display());
    }

    let reg = hako_runtime::cdi::Registry::new(vec![bad.clone()]);
    let (devices, errors) = reg.report();
    assert!(devices.is_empty(), "{devices:?}");
    let files: Vec<_> = std::fs::read_dir(&bad).unwrap().collect();
    assert_eq!(errors.len(), files.len(), "{errors:#?}");
    for (file, e) in &errors {
        assert!(file.starts_with(&bad), "{file:?}");
        assert!(e.contains("cdiVersion"), "{}: {e}", file.display());
    }
}

/// Specs as vendors write them: CDI 1.1.0, `additionalGids` as upstream's Go types spell it,
/// an unquoted YAML 1.1 octal fileMode, a node nested under /dev, a bind mount option that is
/// no mount flag, and one device defined in both spec directories.
#[tokio::test(flavor = "multi_thread")]
async fn vendor_written_specs_gids_octal_modes_nested_nodes_and_overrides() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let spec = |gid: u32| {
        format!(
            r#"---
cdiVersion: 1.1.0
kind: hako.test/vendor
devices:
    - name: "0"
      containerEdits:
        deviceNodes:
            - path: /dev/vendor/sub/node0
              type: c
              major: 1
              minor: 3
              fileMode: 0640
        additionalGids:
            - {gid}
        mounts:
            - hostPath: {data}
              containerPath: /opt/vendor
              options: [ro, nosuid, nodev, rbind, rprivate, x-vendor-option]
"#,
            data = cdi.path("data"),
        )
    };
    cdi.write("etc", "vendor.yaml", &spec(4343));
    cdi.write("run", "vendor.yaml", &spec(4344));
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-vendor", &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let id = create(
        &mut rt,
        &pod,
        &cfg,
        with_cdi(
            container_config("v", &["sleep", "60"]),
            &["hako.test/vendor=0"],
        ),
    )
    .await
    .unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    // /run's definition wins over /etc's, and the log says which file was used.
    let groups = exec(&mut rt, &id, "id -G").await;
    assert!(groups.split(' ').any(|g| g == "4344"), "{groups}");
    assert!(!groups.split(' ').any(|g| g == "4343"), "{groups}");
    let log = h.log_text();
    assert!(
        log.contains("the later directory wins") && log.contains(&cdi.path("run/vendor.yaml")),
        "{log}"
    );
    // 0640 is octal, as Go's YAML reads it; the directories above the node are 0755, as runc
    // makes them.
    assert_eq!(
        exec(
            &mut rt,
            &id,
            "stat -c '%a %t:%T' /dev/vendor/sub/node0; stat -c %a /dev/vendor /dev/vendor/sub | tr '\\n' ' '"
        )
        .await,
        "640 1:3\n755 755"
    );
    assert_eq!(
        exec(&mut rt, &id, "cat /opt/vendor/vendor.txt").await,
        "vendor-library"
    );
    // The option the kernel ignores on a bind mount is not dropped without a word.
    assert!(
        log.contains("x-vendor-option") && log.contains("ignores for bind mounts"),
        "{log}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A CDI hook that fails is named in the error with its device, spec file, exit status and
/// the start of its stderr; a failing startContainer hook fails StartContainer.
#[tokio::test(flavor = "multi_thread")]
async fn failing_cdi_hooks_are_named_in_create_and_start_errors() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let hook = |name: &str, stage: &str, path: &str, script: &str| {
        format!(
            "    - name: {name}\n      containerEdits:\n        hooks:\n          - hookName: {stage}\n            path: {path}\n            args: [sh, -c, '{script}']\n"
        )
    };
    let text = format!(
        "cdiVersion: 0.6.0\nkind: hako.test/hooks\ndevices:\n{}{}{}{}",
        hook(
            "exits",
            "createContainer",
            "/bin/sh",
            "echo the hook broke >&2; exit 3"
        ),
        hook("missing", "createRuntime", "/nonexistent/hook", "true"),
        hook(
            "start-fails",
            "startContainer",
            "/bin/sh",
            "echo start hook broke >&2; exit 4"
        ),
        hook("start-ok", "startContainer", "/bin/sh", "cat > /dev/null"),
    ) + &hook(
        "poststart-fails",
        "poststart",
        "/bin/sh",
        "echo late >&2; exit 5",
    ) + &hook(
        "lingers",
        "createContainer",
        "/bin/sh",
        "sleep 121 & echo left a child >&2; exit 0",
    );
    cdi.write("etc", "hooks.yaml", &text);
    let spec_file = cdi.path("etc/hooks.yaml");
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-hooks", &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let cc = |name: &str, dev: &str| {
        with_cdi(
            container_config(name, &["sleep", "60"]),
            &[&format!("hako.test/hooks={dev}")],
        )
    };

    let e = create(&mut rt, &pod, &cfg, cc("a", "exits"))
        .await
        .unwrap_err();
    assert!(
        e.message().contains(&format!(
            "createContainer hook /bin/sh of CDI device hako.test/hooks=exits (spec {spec_file}) exited with status 3; stderr: the hook broke"
        )),
        "{e:?}"
    );
    let e = create(&mut rt, &pod, &cfg, cc("b", "missing"))
        .await
        .unwrap_err();
    assert!(
        e.message().contains(&format!(
            "createRuntime hook /nonexistent/hook of CDI device hako.test/hooks=missing (spec {spec_file}) could not be run: No such file or directory"
        )),
        "{e:?}"
    );

    let id = create(&mut rt, &pod, &cfg, cc("c", "start-fails"))
        .await
        .unwrap();
    let e = rt
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        e.message().contains(&format!(
            "startContainer hook failed: startContainer hook /bin/sh of CDI device hako.test/hooks=start-fails (spec {spec_file})"
        )) && e.message().contains("exited with status 255"),
        "{e:?}"
    );
    // Its status says the start failed and why, as containerd reports it.
    let st = status(&mut rt, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(
        (st.reason.as_str(), st.exit_code),
        ("StartError", 128),
        "{st:?}"
    );
    assert!(st.message.contains("startContainer hook failed"), "{st:?}");
    // A startContainer hook that succeeds: the start does too, and the process runs.
    let id = create(&mut rt, &pod, &cfg, cc("d", "start-ok"))
        .await
        .unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    assert_eq!(exec(&mut rt, &id, "echo up").await, "up");
    // A failing poststart hook fails the start, named.
    let id = create(&mut rt, &pod, &cfg, cc("e", "poststart-fails"))
        .await
        .unwrap();
    let e = rt
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        e.message().contains(&format!(
            "poststart hook /bin/sh of CDI device hako.test/hooks=poststart-fails (spec {spec_file}) exited with status 5; stderr: late"
        )),
        "{e:?}"
    );

    // A hook that exits 0 but leaves a background child holding its stderr has finished: the
    // create does not wait for the child (it would, until the daemon's 60 s deadline).
    let lingered = create(&mut rt, &pod, &cfg, cc("f", "lingers")).await;
    let _ = std::process::Command::new("pkill")
        .args(["-x", "-f", "sleep 121"])
        .status();
    lingered.unwrap();

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Whether `ancestor` is among `pid`'s parents, up the chain of /proc/<pid>/stat.
fn descends_from(pid: i32, ancestor: i32) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            return false;
        };
        // The parent is the second field after the command, which is in parentheses.
        let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|f| f.parse::<i32>().ok())
        else {
            return false;
        };
        if ppid == ancestor {
            return true;
        }
        if ppid <= 1 {
            return false;
        }
        p = ppid;
    }
    false
}

/// Pids of processes with `arg` among their arguments (after the program).
fn procs_with_arg(arg: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        if cmdline
            .split(|b| *b == 0)
            .skip(1)
            .any(|a| a == arg.as_bytes())
        {
            pids.push(pid);
        }
    }
    pids
}

/// Waits (10 s at most) until no process has `arg` among its arguments; kills what is left
/// and fails the test if one stays.
async fn wait_none_with_arg(arg: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = procs_with_arg(arg);
        if left.is_empty() {
            return;
        }
        if std::time::Instant::now() > deadline {
            for pid in &left {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            panic!("processes with argument {arg} still run: {left:?}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A CDI hook runs in its own process group: what it leaves running is killed when it exits,
/// and at its timeout the hook and all it started are killed, the create failing with the
/// hook named and "timed out".
#[tokio::test(flavor = "multi_thread")]
async fn cdi_hooks_leave_no_processes_behind_and_meet_their_timeout() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let text = r#"cdiVersion: 0.6.0
kind: hako.test/pgroup
devices:
  - name: forks
    containerEdits:
      hooks:
        - hookName: createContainer
          path: /bin/sh
          args: [sh, -c, "sleep 100123 & exit 0"]
  - name: hangs
    containerEdits:
      hooks:
        - hookName: createContainer
          path: /bin/sh
          args: [sh, -c, "sleep 100124 & sleep 100125; true"]
          timeout: 1
"#;
    cdi.write("etc", "pgroup.yaml", text);
    let spec_file = cdi.path("etc/pgroup.yaml");
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-pgroup", &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let cc = |name: &str, dev: &str| {
        with_cdi(
            container_config(name, &["sleep", "60"]),
            &[&format!("hako.test/pgroup={dev}")],
        )
    };

    // The hook exited 0 leaving a background child: the create succeeds, the child is gone.
    create(&mut rt, &pod, &cfg, cc("a", "forks")).await.unwrap();
    wait_none_with_arg("100123").await;

    // The hook outlives its timeout: the create fails naming it, and nothing of it remains.
    let e = create(&mut rt, &pod, &cfg, cc("b", "hangs"))
        .await
        .unwrap_err();
    assert!(
        e.message().contains(&format!(
            "createContainer hook /bin/sh of CDI device hako.test/pgroup=hangs (spec {spec_file}) timed out after 1 s"
        )),
        "{e:?}"
    );
    wait_none_with_arg("100124").await;
    wait_none_with_arg("100125").await;

    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// Device `hako.test/slow=create`: a createRuntime hook that sleeps `secs` (a number no
/// other process has as an argument, for `procs_with_arg`), with no timeout of its own.
fn write_slow_spec(cdi: &Cdi, secs: &str) {
    let text = format!(
        "cdiVersion: 0.6.0\nkind: hako.test/slow\ndevices:\n  - name: create\n    containerEdits:\n      hooks:\n        - hookName: createRuntime\n          path: /bin/sh\n          args: [sh, -c, \"sleep {secs}; cat > /dev/null\"]\n"
    );
    cdi.write("etc", "slow.yaml", &text);
}

/// A slow create (a createRuntime hook with no timeout of its own, running longer than the
/// daemon's 60 s deadline for the monitor's create) holds nothing else of the pod up: the
/// monitor serves the pod meanwhile. The create fails DEADLINE_EXCEEDED, and what the monitor
/// finishes later leaves nothing in the pod; a pod removed while such a create is still under
/// way (kubelet gives up on it) leaves nothing either, its hook killed with it.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_create_holds_up_nothing_and_leaves_nothing_when_given_up() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    write_slow_spec(&cdi, "72");
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-slow", &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let cfg_removed = pod_config("cdi-slow-removed", &logs.path().join("r"));
    let removed = run_pod(&mut rt, &cfg_removed).await;
    let slow = with_cdi(
        container_config("slow", &["sleep", "60"]),
        &["hako.test/slow=create"],
    );
    let slow_create = |pod: &String, cfg: &cri::PodSandboxConfig| {
        let (mut rt, pod, cfg, slow) = (rt.clone(), pod.clone(), cfg.clone(), slow.clone());
        tokio::spawn(async move { create(&mut rt, &pod, &cfg, slow).await })
    };
    let (slow_create, slow_create_removed) =
        (slow_create(&pod, &cfg), slow_create(&removed, &cfg_removed));
    // Past the daemon's 6.5 s wait for an answer the pod is still Ready (kubelet restarts a
    // NotReady one), and another container is created, started and exec'd in.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    let meanwhile = create(
        &mut rt,
        &pod,
        &cfg,
        container_config("meanwhile", &["sleep", "60"]),
    )
    .await
    .unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: meanwhile.clone(),
    })
    .await
    .unwrap();
    let out = rt
        .exec_sync(cri::ExecSyncRequest {
            container_id: meanwhile.clone(),
            cmd: vec!["echo".into(), "served".into()],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(out.stdout, b"served\n");
    rt.remove_container(cri::RemoveContainerRequest {
        container_id: meanwhile.clone(),
    })
    .await
    .unwrap();
    assert!(
        !h.log_text().contains("pod monitor did not answer"),
        "{}",
        h.log_text()
    );
    for create in [slow_create, slow_create_removed] {
        let e = create.await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        assert!(
            e.message()
                .contains("did not answer CreateContainer within 60 s"),
            "{e:?}"
        );
    }
    // Its create still under way in the monitor (the hook has 12 s to go). Its hook is
    // abandoned with it: killed at once, not at its end.
    let removed_monitor = monitor_pid(&mut rt, &removed).await.as_raw();
    let removed_hook = procs_with_arg("72")
        .into_iter()
        .find(|&p| descends_from(p, removed_monitor))
        .expect("the removed pod's hook runs");
    remove_pod(&mut rt, &removed).await;
    support::wait_for(
        "the removed pod's hook to be killed",
        std::time::Duration::from_secs(4),
        || support::process_dead(removed_hook),
    )
    .await;
    assert!(
        !procs_with_arg("72").is_empty(),
        "the other pod's hook runs on: the removed one's was killed, not ended"
    );
    // The other pod's hook ends later, and the monitor's create with it.
    support::wait_for(
        "the hook to end",
        std::time::Duration::from_secs(30),
        || procs_with_arg("72").is_empty(),
    )
    .await;
    support::wait_for(
        "the abandoned container's cgroups to go",
        std::time::Duration::from_secs(10),
        || container_cgroups(&pod).is_empty(),
    )
    .await;
    let listed = all_containers(&mut rt).await;
    assert!(listed.is_empty(), "{listed:?}");
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
    assert_no_leaks(&h, &removed);
}

/// A container joining another's PID namespace (TARGET, as `kubectl debug --target` asks)
/// whose create is slow (a createRuntime hook of 14.5 s) holds the pod up no more than any
/// other create: the monitor serves meanwhile (the create joins the target's namespace
/// through a descriptor the monitor opened when it checked the target's pid, so the reaper
/// need not stop), and the container ends up in the target's PID namespace.
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_create_joining_a_pid_target_holds_up_nothing() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    write_slow_spec(&cdi, "14.5");
    let Some((_reg, h)) = setup(&cdi).await else {
        return;
    };
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config("cdi-slow-target", &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let target = run_container(
        &mut rt,
        &pod,
        &cfg,
        container_config("target", &["sleep", "61"]),
    )
    .await;
    let debug = in_pid_namespace_of(
        with_cdi(
            container_config("debug", &["sleep", "60"]),
            &["hako.test/slow=create"],
        ),
        &target,
    );
    let call = {
        let (mut rt, pod, cfg) = (rt.clone(), pod.clone(), cfg.clone());
        tokio::spawn(async move { create(&mut rt, &pod, &cfg, debug).await })
    };
    support::wait_for(
        "the hook to run",
        std::time::Duration::from_secs(10),
        || !procs_with_arg("14.5").is_empty(),
    )
    .await;
    // Past the daemon's 6.5 s wait for a monitor's answer: the pod is Ready, and an exec in
    // the target (whose end the monitor's reaper reports) is served.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    assert_eq!(
        pod_state(&mut rt, &pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    assert_eq!(exec(&mut rt, &target, "echo served").await, "served");
    assert!(
        !procs_with_arg("14.5").is_empty(),
        "the hook still runs: the calls above were served during the create"
    );
    assert!(
        !h.log_text().contains("pod monitor did not answer"),
        "{}",
        h.log_text()
    );
    let debug_id = call.await.unwrap().unwrap();
    rt.start_container(cri::StartContainerRequest {
        container_id: debug_id.clone(),
    })
    .await
    .unwrap();
    let procs = visible_processes(&mut rt, &debug_id).await;
    assert!(
        procs.contains("sleep 61"),
        "the target's processes are visible: {procs}"
    );
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A pod with a create under way in its monitor: a `slow` container whose createRuntime hook
/// sleeps `secs` (named by that argument), its CreateContainer call spawned, returned once the
/// hook runs.
struct SlowCreate {
    _reg: Registry,
    h: Hako,
    rt: Rt,
    cfg: cri::PodSandboxConfig,
    pod: String,
    call: tokio::task::JoinHandle<Result<String, tonic::Status>>,
    /// When the CreateContainer call was made.
    started: std::time::Instant,
    _logs: tempfile::TempDir,
}

async fn slow_create(cdi: &Cdi, secs: &str, pod_name: &str) -> Option<SlowCreate> {
    write_slow_spec(cdi, secs);
    let (reg, h) = setup(cdi).await?;
    let logs = tempfile::tempdir().unwrap();
    let mut rt = h.runtime().await;
    let cfg = pod_config(pod_name, &logs.path().join("p"));
    let pod = run_pod(&mut rt, &cfg).await;
    let slow = with_cdi(
        container_config("slow", &["sleep", "60"]),
        &["hako.test/slow=create"],
    );
    let call = {
        let (mut rt, pod, cfg) = (rt.clone(), pod.clone(), cfg.clone());
        tokio::spawn(async move { create(&mut rt, &pod, &cfg, slow).await })
    };
    let started = std::time::Instant::now();
    support::wait_for(
        "the hook to run",
        std::time::Duration::from_secs(10),
        || !procs_with_arg(secs).is_empty(),
    )
    .await;
    Some(SlowCreate {
        _reg: reg,
        h,
        rt,
        cfg,
        pod,
        call,
        started,
        _logs: logs,
    })
}

/// A daemon that dies while a create is under way in a monitor (a createRuntime hook of 12 s):
/// the restarted daemon finds the create listed as under way and keeps its files (and only
/// its: another create's leftovers go at that start), and when the monitor finishes it, the
/// answer finds no caller and the container is deleted, not left running in the pod,
/// unlisted; the daemon then releases its files without waiting for another start.
#[tokio::test(flavor = "multi_thread")]
async fn a_create_whose_daemon_died_is_not_left_in_the_pod() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let Some(SlowCreate {
        _reg,
        mut h,
        rt: _,
        cfg,
        pod,
        call,
        started,
        _logs,
    }) = slow_create(&cdi, "12.25", "cdi-orphaned-create").await
    else {
        return;
    };
    h.kill9();
    assert!(call.await.unwrap().is_err());
    // Another create's leftovers, cut short before its monitor was asked: no record owns them.
    let bundles = h.state.join("containers");
    let leftover = bundles.join("0".repeat(64));
    std::fs::create_dir_all(&leftover).unwrap();
    h.restart();
    assert!(
        h.log_text()
            .contains("creates under way in a pod monitor: their files are kept until they end"),
        "{}",
        h.log_text()
    );
    assert!(
        !leftover.exists(),
        "only the create under way keeps its files"
    );
    assert_eq!(
        support::hako::Hako::files_under(&bundles)
            .iter()
            .filter(|f| !f.contains('/'))
            .count(),
        1,
        "the create under way keeps its bundle"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(12),
        "the hook ended before the daemon restarted"
    );
    let mut rt = h.runtime().await;
    support::wait_for(
        "the hook to end",
        std::time::Duration::from_secs(30),
        || procs_with_arg("12.25").is_empty(),
    )
    .await;
    support::wait_for(
        "the container's cgroups to go",
        std::time::Duration::from_secs(10),
        || container_cgroups(&pod).is_empty(),
    )
    .await;
    let listed = all_containers(&mut rt).await;
    assert!(listed.is_empty(), "{listed:?}");
    // Deleted by its monitor, its files go too, without another start.
    let layers = h.root.join("containers");
    support::wait_for(
        "the ended create's files to be released",
        std::time::Duration::from_secs(30),
        || {
            support::hako::Hako::files_under(&bundles).is_empty()
                && support::hako::Hako::files_under(&layers).is_empty()
        },
    )
    .await;
    assert!(h
        .log_text()
        .contains("released the files of a create the last daemon left under way"));
    let monitor_log = h.state.join("pods").join(&pod).join("monitor.log");
    assert!(std::fs::read_to_string(&monitor_log)
        .unwrap()
        .contains("the caller of a create went while it was made: deleting the container"));
    // The pod goes on.
    let id = create(
        &mut rt,
        &pod,
        &cfg,
        container_config("after", &["sleep", "60"]),
    )
    .await
    .unwrap();
    rt.start_container(cri::StartContainerRequest { container_id: id })
        .await
        .unwrap();
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}

/// A create a crashed daemon left under way whose pod monitor then dies too (its helper with
/// it): what the create made is killed through its cgroup before its files are released.
#[tokio::test(flavor = "multi_thread")]
async fn a_create_left_under_way_whose_monitor_dies_leaves_nothing_running() {
    let Some(cdi) = Cdi::new() else {
        return;
    };
    let Some(SlowCreate {
        _reg,
        mut h,
        mut rt,
        cfg: _,
        pod,
        call,
        started: _,
        _logs,
    }) = slow_create(&cdi, "13.75", "cdi-orphaned-monitor").await
    else {
        return;
    };
    let monitor = monitor_pid(&mut rt, &pod).await;
    h.kill9();
    assert!(call.await.unwrap().is_err());
    h.restart();
    assert!(
        !container_cgroups(&pod).is_empty(),
        "the create made its cgroups"
    );
    nix::sys::signal::kill(monitor, nix::sys::signal::Signal::SIGKILL).unwrap();
    let bundles = h.state.join("containers");
    support::wait_for(
        "the create's processes and files to go",
        std::time::Duration::from_secs(30),
        || {
            container_cgroups(&pod).is_empty()
                && support::hako::Hako::files_under(&bundles).is_empty()
        },
    )
    .await;
    let mut rt = h.runtime().await;
    remove_pod(&mut rt, &pod).await;
    assert_no_leaks(&h, &pod);
}
