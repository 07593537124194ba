//! Registry host configuration in containerd's `hosts.toml` format, so an operator's existing
//! `certs.d` directory works unchanged:
//!
//! ```toml
//! # <config_path>/docker.io/hosts.toml
//! server = "https://registry-1.docker.io"
//!
//! [host."http://127.0.0.1:5000"]
//!   capabilities = ["pull", "resolve"]
//!   skip_verify = true
//!   ca = "/etc/hako/certs.d/docker.io/ca.crt"
//! ```
//!
//! Mirrors (`host` tables) are tried in file order, then the server. With no file for the
//! registry, `<config_path>/_default/hosts.toml` applies, else the registry itself over HTTPS
//! (plain HTTP for loopback hosts, as a local test registry has no certificate).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    Http,
    Https,
}

/// One place to fetch from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub scheme: Scheme,
    /// `host[:port]`.
    pub host: String,
    /// A mirror (any `host` entry) rather than the registry's own server.
    pub mirror: bool,
    /// May resolve tags to digests.
    pub resolve: bool,
    /// May serve content by digest.
    pub pull: bool,
    pub skip_verify: bool,
    pub ca_files: Vec<PathBuf>,
    pub headers: Vec<(String, String)>,
}

impl Endpoint {
    pub fn url(&self) -> String {
        let scheme = match self.scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
        };
        format!("{scheme}://{}", self.host)
    }
}

#[derive(Debug, Default, Deserialize)]
struct HostsFile {
    server: Option<String>,
    #[serde(flatten)]
    server_opts: HostOpts,
    #[serde(default)]
    host: toml::map::Map<String, toml::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct HostOpts {
    capabilities: Option<Vec<String>>,
    skip_verify: Option<bool>,
    ca: Option<StringOrList>,
    client: Option<toml::Value>,
    header: Option<toml::map::Map<String, toml::Value>>,
    override_path: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn into_vec(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// The endpoints for `registry` (as it appears in an image name: `docker.io`, `host:5000`), in
/// the order to try them.
pub fn endpoints(config_path: &Path, registry: &str) -> Result<Vec<Endpoint>> {
    let dir_name = registry;
    let mut file = config_path.join(dir_name).join("hosts.toml");
    if !file.exists() {
        file = config_path.join("_default").join("hosts.toml");
    }
    let default_server = default_server(registry);
    if !file.exists() {
        return Ok(vec![endpoint_from(
            &default_server,
            HostOpts::default(),
            false,
            &file,
        )?]);
    }
    let text = std::fs::read_to_string(&file)
        .map_err(|e| Error::io("read registry hosts file", &file, e))?;
    parse(&text, registry, &file)
}

fn default_server(registry: &str) -> String {
    if registry == "docker.io" {
        return "https://registry-1.docker.io".into();
    }
    let host = registry
        .rsplit_once(':')
        .map(|(h, _)| h)
        .unwrap_or(registry);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false);
    if loopback {
        format!("http://{registry}")
    } else {
        format!("https://{registry}")
    }
}

fn parse(text: &str, registry: &str, file: &Path) -> Result<Vec<Endpoint>> {
    let bad =
        |m: String| Error::InvalidArgument(format!("registry hosts file {}: {m}", file.display()));
    let hf: HostsFile =
        toml::from_str(text).map_err(|e| bad(e.to_string().trim().replace('\n', " ")))?;
    let mut out = Vec::new();
    for (url, value) in hf.host {
        let opts: HostOpts = value
            .try_into()
            .map_err(|e: toml::de::Error| bad(format!("host {url:?}: {}", e.to_string().trim())))?;
        match endpoint_from(&url, opts, true, file) {
            Ok(ep) => out.push(ep),
            Err(e) => return Err(e),
        }
    }
    let server = hf.server.unwrap_or_else(|| default_server(registry));
    out.push(endpoint_from(&server, hf.server_opts, false, file)?);
    Ok(out)
}

fn endpoint_from(url: &str, opts: HostOpts, mirror: bool, file: &Path) -> Result<Endpoint> {
    let bad =
        |m: String| Error::InvalidArgument(format!("registry hosts file {}: {m}", file.display()));
    let (scheme, rest) = if let Some(r) = url.strip_prefix("https://") {
        (Scheme::Https, r)
    } else if let Some(r) = url.strip_prefix("http://") {
        (Scheme::Http, r)
    } else {
        // containerd accepts a bare host and means HTTPS.
        (Scheme::Https, url)
    };
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let path = path.trim_end_matches('/');
    if host.is_empty() {
        return Err(bad(format!("host {url:?} has no host name")));
    }
    // The registry API lives at <host>/v2; a mirror under another path prefix cannot be
    // reached through our registry client.
    if !path.is_empty() && path != "v2" {
        return Err(bad(format!(
            "host {url:?}: path prefixes other than /v2 are not supported"
        )));
    }
    if opts.override_path == Some(true) && path.is_empty() {
        return Err(bad(format!(
            "host {url:?}: override_path needs the full API path"
        )));
    }
    if opts.client.is_some() {
        return Err(bad(format!(
            "host {url:?}: client certificates are not supported"
        )));
    }
    let caps = opts
        .capabilities
        .unwrap_or_else(|| vec!["pull".into(), "resolve".into()]);
    for c in &caps {
        if !matches!(c.as_str(), "pull" | "resolve" | "push") {
            return Err(bad(format!("host {url:?}: unknown capability {c:?}")));
        }
    }
    let ca_files = opts
        .ca
        .map(StringOrList::into_vec)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let p = PathBuf::from(p);
            // Relative CA paths are relative to the hosts.toml directory, as in containerd.
            if p.is_relative() {
                file.parent().map(|d| d.join(&p)).unwrap_or(p)
            } else {
                p
            }
        })
        .collect();
    let mut headers = Vec::new();
    for (k, v) in opts.header.unwrap_or_default() {
        match v {
            toml::Value::String(s) => headers.push((k, s)),
            toml::Value::Array(a) => {
                for item in a {
                    if let toml::Value::String(s) = item {
                        headers.push((k.clone(), s));
                    }
                }
            }
            _ => {
                return Err(bad(format!(
                    "host {url:?}: header {k:?} must be a string or list"
                )))
            }
        }
    }
    Ok(Endpoint {
        scheme,
        host: host.to_string(),
        mirror,
        resolve: caps.iter().any(|c| c == "resolve"),
        pull: caps.iter().any(|c| c == "pull"),
        skip_verify: opts.skip_verify.unwrap_or(false),
        ca_files,
        headers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, host: &str, text: &str) {
        std::fs::create_dir_all(dir.join(host)).unwrap();
        std::fs::write(dir.join(host).join("hosts.toml"), text).unwrap();
    }

    #[test]
    fn no_file_means_the_registry_itself() {
        let d = tempfile::tempdir().unwrap();
        let eps = endpoints(d.path(), "docker.io").unwrap();
        assert_eq!(eps.len(), 1);
        assert_eq!(eps[0].url(), "https://registry-1.docker.io");
        assert_eq!(
            endpoints(d.path(), "quay.io").unwrap()[0].url(),
            "https://quay.io"
        );
        assert_eq!(
            endpoints(d.path(), "127.0.0.1:5000").unwrap()[0].url(),
            "http://127.0.0.1:5000"
        );
        assert_eq!(
            endpoints(d.path(), "localhost:5000").unwrap()[0].url(),
            "http://localhost:5000"
        );
    }

    #[test]
    fn mirrors_in_file_order_then_server() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "registry.k8s.io",
            r#"
server = "https://registry.k8s.io"
[host."http://127.0.0.1:5001"]
  capabilities = ["pull", "resolve"]
[host."https://mirror.example:8443"]
  capabilities = ["pull"]
  skip_verify = true
  ca = "ca.pem"
  [host."https://mirror.example:8443".header]
    x-token = "abc"
"#,
        );
        let eps = endpoints(d.path(), "registry.k8s.io").unwrap();
        let urls: Vec<_> = eps.iter().map(Endpoint::url).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:5001",
                "https://mirror.example:8443",
                "https://registry.k8s.io"
            ]
        );
        assert!(eps[0].mirror && eps[0].resolve && eps[0].pull);
        assert!(!eps[1].resolve && eps[1].skip_verify);
        assert_eq!(
            eps[1].ca_files,
            vec![d.path().join("registry.k8s.io/ca.pem")]
        );
        assert_eq!(
            eps[1].headers,
            vec![("x-token".to_string(), "abc".to_string())]
        );
        assert!(!eps[2].mirror);
        assert!(eps[1].pull, "capabilities [\"pull\"]");
    }

    #[test]
    fn capabilities_and_header_lists() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "quay.io",
            r#"
[host."https://resolver.example"]
  capabilities = ["resolve"]
  [host."https://resolver.example".header]
    x-one = "1"
    x-many = ["a", "b"]
"#,
        );
        let eps = endpoints(d.path(), "quay.io").unwrap();
        assert!(eps[0].resolve && !eps[0].pull, "{:?}", eps[0]);
        assert_eq!(
            eps[0].headers,
            [("x-one", "1"), ("x-many", "a"), ("x-many", "b")]
                .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        // The server without a capabilities key: both.
        assert!(eps[1].resolve && eps[1].pull, "{:?}", eps[1]);
        write(
            d.path(),
            "e.io",
            "[host.\"https://m.io\".header]\nx-n = 1\n",
        );
        let err = endpoints(d.path(), "e.io").unwrap_err().to_string();
        assert!(
            err.contains("x-n") && err.contains("string or list"),
            "{err}"
        );
    }

    #[test]
    fn default_dir_applies_to_unlisted_registries() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "_default", "[host.\"http://127.0.0.1:9\"]\n");
        let eps = endpoints(d.path(), "gcr.io").unwrap();
        assert_eq!(eps[0].url(), "http://127.0.0.1:9");
        assert_eq!(eps[1].url(), "https://gcr.io");
    }

    #[test]
    fn errors_name_the_file_and_host() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "a.io", "[host.\"https://m.io/some/prefix\"]\n");
        let err = endpoints(d.path(), "a.io").unwrap_err().to_string();
        assert!(
            err.contains("a.io/hosts.toml") && err.contains("m.io/some/prefix"),
            "{err}"
        );
        write(
            d.path(),
            "b.io",
            "[host.\"https://m.io\"]\ncapabilities = [\"fly\"]\n",
        );
        let err = endpoints(d.path(), "b.io").unwrap_err().to_string();
        assert!(err.contains("fly"), "{err}");
        write(d.path(), "c.io", "server = [\n");
        assert!(endpoints(d.path(), "c.io")
            .unwrap_err()
            .to_string()
            .contains("c.io/hosts.toml"));
    }
}
