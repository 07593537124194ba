//! A real registry (Debian's `docker-registry`, distribution v2) on 127.0.0.1 at a free port,
//! storing into a temp dir, stopped when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

pub struct Registry {
    pub addr: String,
    child: Child,
    dir: tempfile::TempDir,
    pub log: PathBuf,
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Registry {
    pub fn start() -> Registry {
        Self::start_with_auth(None)
    }

    /// Where the registry keeps its blobs and manifests.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// With `htpasswd`, the registry demands HTTP basic auth checked against that bcrypt file.
    pub fn start_with_auth(htpasswd: Option<&Path>) -> Registry {
        Self::start_full(htpasswd, None)
    }

    /// Serves HTTPS with `tls = (certificate, key)`.
    pub fn start_tls(cert: &Path, key: &Path) -> Registry {
        Self::start_full(None, Some((cert, key)))
    }

    fn start_full(htpasswd: Option<&Path>, tls: Option<(&Path, &Path)>) -> Registry {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let auth = match htpasswd {
            Some(p) => format!(
                "auth:\n  htpasswd:\n    realm: hako-test\n    path: {}\n",
                p.display()
            ),
            None => String::new(),
        };
        let tls = match tls {
            Some((c, k)) => format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                c.display(),
                k.display()
            ),
            None => String::new(),
        };
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{tls}{auth}",
            dir.path().join("data").display()
        );
        let cfg = dir.path().join("config.yml");
        std::fs::write(&cfg, config).unwrap();
        let log = dir.path().join("registry.log");
        let child = Command::new(REGISTRY_BIN)
            .arg("serve")
            .arg(&cfg)
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::from(
                std::fs::File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("start docker-registry");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "registry did not listen on {addr}: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Registry {
            addr,
            child,
            dir,
            log,
        }
    }

    /// How many GET requests for `path_part` the registry has logged.
    pub fn count_requests(&self, path_part: &str) -> usize {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"GET ") && l.contains(path_part))
            .count()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A throw-away CA and a server certificate for 127.0.0.1 signed by it, made with openssl:
/// returns (ca.pem, server.pem, server.key).
pub fn make_tls(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=hako-test-ca",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}
