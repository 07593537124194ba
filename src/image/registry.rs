//! Talking to registries over the distribution API (`/v2/<name>/manifests|blobs/<ref>`): one
//! HTTP client per endpoint configuration, hosts.toml headers on every request, credentials
//! from the CRI request given in answer to the registry's challenge, registry errors classified
//! into hako's error kinds.
//!
//! Nothing a registry sends is trusted for its size. A manifest or index is read into memory
//! only up to `MAX_MANIFEST_BYTES` (4 MiB, the limit containerd and containers/image apply), a
//! config likewise; a blob is streamed to its writer and stopped the moment it passes the size
//! its descriptor gives, and fails if it ends short; token responses and error bodies are capped
//! too. Digests are checked while streaming. (oci-client, used before, reads manifest and error
//! bodies whole whatever their size, and cannot send hosts.toml headers: hence this client.)

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue, ACCEPT, AUTHORIZATION};
use reqwest::{Response, StatusCode};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use super::hosts::Endpoint;
use super::{shown, Name};
use crate::error::{chain, Error, Result};

/// The most a manifest, an index or an image config may weigh.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// The most a token realm's answer may weigh.
const MAX_TOKEN_BYTES: u64 = 1 << 20;
/// How much of an error response is read for its message.
const MAX_ERROR_BYTES: u64 = 64 << 10;

/// Credentials as the CRI request gives them.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub username: String,
    pub password: String,
    /// base64 of `username:password`.
    pub auth: String,
    pub server_address: String,
    /// An OAuth2 refresh token, exchanged for an access token at the registry's token realm.
    pub identity_token: String,
    /// A bearer token sent as is.
    pub registry_token: String,
}

impl Credentials {
    pub fn is_empty(&self) -> bool {
        self.username.is_empty()
            && self.password.is_empty()
            && self.auth.is_empty()
            && self.identity_token.is_empty()
            && self.registry_token.is_empty()
    }

    /// Whether these credentials may be sent to `ep`: always to the registry's own server; to a
    /// mirror only when the request names that mirror, so a mirror never sees credentials that
    /// were meant for another host.
    fn applies_to(&self, ep: &Endpoint) -> bool {
        if !ep.mirror {
            return true;
        }
        let addr = self
            .server_address
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        addr.trim_end_matches('/') == ep.host
    }

    /// User and password, from the fields or from the base64 `auth`; None when neither is set.
    fn basic(&self, host: &str) -> Result<Option<(String, String)>> {
        if !self.username.is_empty() || !self.password.is_empty() {
            return Ok(Some((self.username.clone(), self.password.clone())));
        }
        if self.auth.is_empty() {
            return Ok(None);
        }
        use base64::Engine;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(self.auth.trim())
            .map_err(|e| {
                Error::InvalidArgument(format!("auth for registry {host}: invalid base64: {e}"))
            })?;
        let text = String::from_utf8(decoded)
            .map_err(|_| Error::InvalidArgument(format!("auth for registry {host}: not UTF-8")))?;
        let (user, pass) = text.split_once(':').ok_or_else(|| {
            Error::InvalidArgument(format!(
                "auth for registry {host}: expected base64 of user:password"
            ))
        })?;
        Ok(Some((user.to_string(), pass.to_string())))
    }
}

#[derive(Default)]
pub struct Clients {
    by_endpoint: Mutex<HashMap<Endpoint, reqwest::Client>>,
}

/// One pull's view of one endpoint: the client, where the repository lives there, and the
/// credentials that may be used there.
pub struct Source {
    pub endpoint: Endpoint,
    http: reqwest::Client,
    /// The endpoint's hosts.toml `header`s, sent with every request to it (token requests
    /// included, as containerd does).
    headers: Vec<(HeaderName, HeaderValue)>,
    /// `<scheme>://<host>/v2/<repository>`.
    base: String,
    /// A mirror is told which registry the repository comes from (`?ns=`), as containerd does.
    query: String,
    repository: String,
    /// The tag or digest the image name resolves through.
    pub reference: String,
    /// The registry as the image name spells it, for messages.
    registry: String,
    creds: Option<Credentials>,
    /// The `Authorization` value in use, learnt from the registry's challenge.
    authorization: Mutex<Option<String>>,
}

impl Clients {
    fn client(&self, ep: &Endpoint) -> Result<reqwest::Client> {
        let mut map = self.by_endpoint.lock().expect("client map poisoned");
        if let Some(c) = map.get(ep) {
            return Ok(c.clone());
        }
        // TLS needs a process-wide crypto provider; ring is the one built (idempotent).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .user_agent(concat!("hako/", env!("CARGO_PKG_VERSION")))
            .danger_accept_invalid_certs(ep.skip_verify);
        for f in &ep.ca_files {
            let data =
                std::fs::read(f).map_err(|e| Error::io("read registry CA certificate", f, e))?;
            let certs = reqwest::Certificate::from_pem_bundle(&data).map_err(|e| {
                Error::InvalidArgument(format!(
                    "registry CA certificate {}: {}",
                    f.display(),
                    chain(&e)
                ))
            })?;
            builder = builder.tls_certs_merge(certs);
        }
        let client = builder.build().map_err(|e| {
            Error::Internal(format!("registry client for {}: {}", ep.url(), chain(&e)))
        })?;
        map.insert(ep.clone(), client.clone());
        Ok(client)
    }

    /// Prepares `ep` for `name`. Nothing is sent yet: credentials go out only when the
    /// registry asks for them.
    pub fn source(&self, ep: &Endpoint, name: &Name, creds: &Credentials) -> Result<Source> {
        let headers = hosts_headers(ep)?;
        let http = self.client(ep)?;
        let reference = match (&name.digest, &name.tag) {
            (Some(d), _) => d.clone(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_string(),
        };
        let creds = (!creds.is_empty() && creds.applies_to(ep)).then(|| creds.clone());
        // A registry token is a bearer token already: sent from the first request.
        let authorization = creds
            .as_ref()
            .filter(|c| !c.registry_token.is_empty())
            .map(|c| format!("Bearer {}", c.registry_token));
        Ok(Source {
            base: format!("{}/v2/{}", ep.url(), name.repository),
            query: if ep.mirror {
                format!("?ns={}", name.registry)
            } else {
                String::new()
            },
            endpoint: ep.clone(),
            http,
            headers,
            repository: name.repository.clone(),
            reference,
            registry: name.registry.clone(),
            creds,
            authorization: Mutex::new(authorization),
        })
    }
}

/// An endpoint's hosts.toml headers as HTTP, each value its own header line.
fn hosts_headers(ep: &Endpoint) -> Result<Vec<(HeaderName, HeaderValue)>> {
    let bad = |m: String| Error::InvalidArgument(format!("registry host {}: {m}", ep.url()));
    ep.headers
        .iter()
        .map(|(k, v)| {
            let name = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| bad(format!("header name {} is not valid HTTP", shown(k))))?;
            let value = HeaderValue::from_str(v)
                .map_err(|_| bad(format!("header {k} has a value that is not valid HTTP")))?;
            Ok((name, value))
        })
        .collect()
}

impl Source {
    /// A request to this endpoint (or its token realm) with its hosts.toml headers.
    fn request(
        &self,
        method: reqwest::Method,
        url: impl reqwest::IntoUrl,
    ) -> reqwest::RequestBuilder {
        let mut req = self.http.request(method, url);
        for (k, v) in &self.headers {
            req = req.header(k, v);
        }
        req
    }

    fn what(&self) -> String {
        format!("registry {} ({})", self.registry, self.endpoint.url())
    }

    /// The manifest or index `reference` (a tag or a digest) names, and the digest of its bytes.
    /// `size` is what the descriptor that led here says, when one did.
    pub async fn manifest(
        &self,
        reference: &str,
        accept: &[&str],
        size: Option<u64>,
    ) -> Result<(Vec<u8>, String)> {
        let what = format!("manifest {}", shown(reference));
        if let Some(s) = size.filter(|s| *s > MAX_MANIFEST_BYTES) {
            return Err(self.too_big(&what, Some(s)));
        }
        let url = format!("{}/manifests/{reference}{}", self.base, self.query);
        let resp = self.get(&url, &accept.join(", "), &what).await?;
        if resp.status() != StatusCode::OK {
            return Err(self.status_error(resp, &what).await);
        }
        let announced = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = self.read_capped(resp, &what).await?;
        if let Some(s) = size.filter(|s| *s != body.len() as u64) {
            return Err(Error::InvalidArgument(format!(
                "{what} from {}: {} bytes, its descriptor says {s}",
                self.what(),
                body.len()
            )));
        }
        let digest = format!("sha256:{:x}", Sha256::digest(&body));
        let expected = reference
            .starts_with("sha256:")
            .then_some(reference)
            .or(announced.as_deref().filter(|d| d.starts_with("sha256:")));
        if let Some(e) = expected.filter(|e| *e != digest) {
            return Err(Error::InvalidArgument(format!(
                "{what} from {}: content digest is {digest}, expected {}",
                self.what(),
                shown(e)
            )));
        }
        Ok((body, digest))
    }

    /// Streams blob `digest` (a `kind`: layer, config) into `out`, stopping as soon as it
    /// passes `size` bytes; fails when it ends short or its bytes do not hash to `digest`.
    pub async fn blob<W: AsyncWrite + Unpin>(
        &self,
        kind: &str,
        digest: &str,
        size: u64,
        out: &mut W,
    ) -> Result<()> {
        let what = format!("{kind} {digest}");
        let url = format!("{}/blobs/{digest}{}", self.base, self.query);
        let mut resp = self.get(&url, "*/*", &what).await?;
        if resp.status() != StatusCode::OK {
            return Err(self.status_error(resp, &what).await);
        }
        if let Some(n) = resp.content_length().filter(|n| *n != size) {
            return Err(Error::InvalidArgument(format!(
                "{what} from {}: the registry announces {n} bytes, its descriptor says {size}",
                self.what()
            )));
        }
        let mut hasher = Sha256::new();
        let mut total: u64 = 0;
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.transport(e, &what))? {
            total += chunk.len() as u64;
            if total > size {
                return Err(Error::InvalidArgument(format!(
                    "{what} from {}: longer than the {size} bytes its descriptor says; stopped at {total}",
                    self.what()
                )));
            }
            hasher.update(&chunk);
            out.write_all(&chunk)
                .await
                .map_err(|e| Error::Internal(format!("write {what}: {e}")))?;
        }
        if total < size {
            return Err(Error::Unavailable(format!(
                "{what} from {}: ended after {total} of the {size} bytes its descriptor says",
                self.what()
            )));
        }
        out.flush()
            .await
            .map_err(|e| Error::Internal(format!("write {what}: {e}")))?;
        let actual = format!("sha256:{:x}", hasher.finalize());
        if actual != digest {
            return Err(Error::InvalidArgument(format!(
                "{what} from {}: content digest is {actual}",
                self.what()
            )));
        }
        Ok(())
    }

    /// A config into memory, refused above `MAX_MANIFEST_BYTES`.
    pub async fn config(&self, digest: &str, size: u64) -> Result<Vec<u8>> {
        if size > MAX_MANIFEST_BYTES {
            return Err(self.too_big(&format!("config {digest}"), Some(size)));
        }
        let mut buf = Vec::with_capacity(size as usize);
        self.blob("config", digest, size, &mut buf).await?;
        Ok(buf)
    }

    fn too_big(&self, what: &str, size: Option<u64>) -> Error {
        let size = size.map(|s| format!(" ({s} bytes)")).unwrap_or_default();
        Error::InvalidArgument(format!(
            "{what} from {}{size} is larger than {} MiB, the limit for manifests, indexes and configs",
            self.what(),
            MAX_MANIFEST_BYTES >> 20
        ))
    }

    /// The body of `resp`, refused as soon as it passes `MAX_MANIFEST_BYTES`.
    async fn read_capped(&self, mut resp: Response, what: &str) -> Result<Vec<u8>> {
        let announced = resp.content_length();
        if let Some(n) = announced.filter(|n| *n > MAX_MANIFEST_BYTES) {
            return Err(self.too_big(what, Some(n)));
        }
        let mut buf = Vec::with_capacity(announced.unwrap_or(0) as usize);
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.transport(e, what))? {
            if (buf.len() + chunk.len()) as u64 > MAX_MANIFEST_BYTES {
                return Err(self.too_big(what, None));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    }

    /// GET `url` with the current credentials; a 401 carrying a challenge is answered once
    /// (token fetched, or basic credentials) and the request retried.
    async fn get(&self, url: &str, accept: &str, what: &str) -> Result<Response> {
        let mut answered = false;
        loop {
            let sent = self
                .authorization
                .lock()
                .expect("authorization poisoned")
                .clone();
            let mut req = self
                .request(reqwest::Method::GET, url)
                .header(ACCEPT, accept);
            if let Some(a) = &sent {
                req = req.header(AUTHORIZATION, a);
            }
            let resp = req.send().await.map_err(|e| self.transport(e, what))?;
            if resp.status() != StatusCode::UNAUTHORIZED || answered {
                return Ok(resp);
            }
            let challenge = resp
                .headers()
                .get(reqwest::header::WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let Some(challenge) = challenge else {
                return Ok(resp);
            };
            let next = self.answer(&challenge).await?;
            if next.is_none() || next == sent {
                return Ok(resp);
            }
            *self.authorization.lock().expect("authorization poisoned") = next;
            answered = true;
        }
    }

    /// The `Authorization` value that answers `challenge`, if these credentials can.
    async fn answer(&self, challenge: &str) -> Result<Option<String>> {
        let host = &self.endpoint.host;
        let creds = self.creds.as_ref();
        if let Some(params) = parse_bearer_challenge(challenge) {
            if let Some(c) = creds.filter(|c| !c.registry_token.is_empty()) {
                return Ok(Some(format!("Bearer {}", c.registry_token)));
            }
            let fail = |m: String| Error::Unauthenticated(format!("registry {host}: {m}"));
            let realm = params
                .get("realm")
                .ok_or_else(|| fail("bearer challenge without realm".into()))?;
            let scope = format!("repository:{}:pull", self.repository);
            let token = match creds.filter(|c| !c.identity_token.is_empty()) {
                Some(c) => {
                    self.refresh_grant(realm, params.get("service"), &scope, &c.identity_token)
                        .await?
                }
                None => {
                    let basic = match creds {
                        Some(c) => c.basic(host)?,
                        None => None,
                    };
                    self.token(realm, params.get("service"), &scope, basic)
                        .await?
                }
            };
            return Ok(Some(format!("Bearer {token}")));
        }
        if challenge
            .trim_start()
            .to_ascii_lowercase()
            .starts_with("basic")
        {
            if let Some((u, p)) = creds.map(|c| c.basic(host)).transpose()?.flatten() {
                use base64::Engine;
                let b = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
                return Ok(Some(format!("Basic {b}")));
            }
        }
        Ok(None)
    }

    /// A token from the realm, for basic credentials or anonymously.
    async fn token(
        &self,
        realm: &str,
        service: Option<&String>,
        scope: &str,
        basic: Option<(String, String)>,
    ) -> Result<String> {
        let mut url = reqwest::Url::parse(realm).map_err(|e| {
            Error::Unauthenticated(format!(
                "registry {}: token realm {}: {e}",
                self.endpoint.host,
                shown(realm)
            ))
        })?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("scope", scope);
            if let Some(s) = service {
                q.append_pair("service", s);
            }
        }
        let mut req = self.request(reqwest::Method::GET, url);
        if let Some((u, p)) = basic {
            req = req.basic_auth(u, Some(p));
        }
        self.token_response(realm, req).await
    }

    /// The OAuth2 refresh-token grant of the distribution token spec: POST
    /// `grant_type=refresh_token` to the realm for an access token.
    async fn refresh_grant(
        &self,
        realm: &str,
        service: Option<&String>,
        scope: &str,
        refresh_token: &str,
    ) -> Result<String> {
        let mut form = vec![
            ("grant_type", "refresh_token".to_string()),
            ("refresh_token", refresh_token.to_string()),
            ("client_id", "hako".to_string()),
            ("scope", scope.to_string()),
        ];
        if let Some(s) = service {
            form.push(("service", s.clone()));
        }
        let body = form
            .iter()
            .map(|(k, v)| format!("{k}={}", urlencode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let req = self
            .request(reqwest::Method::POST, realm)
            .header(
                reqwest::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .body(body);
        self.token_response(realm, req).await
    }

    async fn token_response(&self, realm: &str, req: reqwest::RequestBuilder) -> Result<String> {
        let host = &self.endpoint.host;
        let realm = shown(realm);
        let fail = |m: String| {
            Error::Unauthenticated(format!("registry {host}: token realm {realm}: {m}"))
        };
        let mut resp = req.send().await.map_err(|e| {
            Error::Unavailable(format!(
                "registry {host}: token realm {realm}: {}",
                chain(&e)
            ))
        })?;
        let status = resp.status();
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| fail(chain(&e)))? {
            if (body.len() + chunk.len()) as u64 > MAX_TOKEN_BYTES {
                return Err(fail(format!(
                    "answer larger than {} KiB",
                    MAX_TOKEN_BYTES >> 10
                )));
            }
            body.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&body);
        if !status.is_success() {
            return Err(fail(format!("answered {status}: {}", shown(text.trim()))));
        }
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| fail(format!("token response: {e}")))?;
        v.get("access_token")
            .or_else(|| v.get("token"))
            .and_then(|t| t.as_str())
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .ok_or_else(|| fail("token response has no access_token".into()))
    }

    fn transport(&self, e: reqwest::Error, what: &str) -> Error {
        Error::Unavailable(format!("{what} from {}: {}", self.what(), chain(&e)))
    }

    /// A registry's refusal as hako's kinds: 401 → Unauthenticated, 403/DENIED →
    /// PermissionDenied, unknown manifest/blob/name → NotFound, anything else → Unavailable.
    async fn status_error(&self, mut resp: Response, what: &str) -> Error {
        let status = resp.status();
        let mut body = Vec::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            let room = (MAX_ERROR_BYTES as usize).saturating_sub(body.len());
            body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            if body.len() as u64 >= MAX_ERROR_BYTES {
                break;
            }
        }
        let (codes, detail) = registry_errors(&body);
        let msg = format!("{what} from {}: {status}{detail}", self.what());
        let has = |c: &str| codes.iter().any(|x| x == c);
        if status == StatusCode::UNAUTHORIZED || has("UNAUTHORIZED") {
            Error::Unauthenticated(msg)
        } else if status == StatusCode::FORBIDDEN || has("DENIED") {
            Error::PermissionDenied(msg)
        } else if status == StatusCode::NOT_FOUND
            || [
                "MANIFEST_UNKNOWN",
                "NAME_UNKNOWN",
                "BLOB_UNKNOWN",
                "NOT_FOUND",
            ]
            .iter()
            .any(|c| has(c))
        {
            Error::NotFound(msg)
        } else {
            Error::Unavailable(msg)
        }
    }
}

/// The codes and a readable summary of a registry error body (`{"errors":[{code, message}]}`);
/// any other body is quoted, shortened.
fn registry_errors(body: &[u8]) -> (Vec<String>, String) {
    let parsed: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let errors = parsed
        .as_ref()
        .and_then(|v| v.get("errors"))
        .and_then(|e| e.as_array());
    match errors {
        Some(list) => {
            let mut codes = Vec::new();
            let mut parts = Vec::new();
            for e in list {
                let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("");
                let message = e.get("message").and_then(|c| c.as_str()).unwrap_or("");
                codes.push(code.to_string());
                parts.push(
                    shown(&format!("{code}: {message}"))
                        .trim_matches('"')
                        .to_string(),
                );
            }
            let detail = if parts.is_empty() {
                String::new()
            } else {
                format!(": {}", parts.join("; "))
            };
            (codes, detail)
        }
        None => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            if text.is_empty() {
                (Vec::new(), String::new())
            } else {
                (Vec::new(), format!(": {}", shown(text)))
            }
        }
    }
}

/// `Bearer realm="…",service="…",scope="…"` → its parameters.
pub fn parse_bearer_challenge(h: &str) -> Option<HashMap<String, String>> {
    let rest = h
        .trim()
        .strip_prefix("Bearer ")
        .or_else(|| h.trim().strip_prefix("bearer "))?;
    let mut out = HashMap::new();
    let mut s = rest.trim();
    while !s.is_empty() {
        let (k, after) = s.split_once('=')?;
        let (v, tail) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (&q[..end], &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (&after[..end], &after[end..])
        };
        out.insert(k.trim().to_ascii_lowercase(), v.to_string());
        s = tail.trim_start_matches(',').trim();
    }
    Some(out)
}

fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::hosts::Scheme;
    use super::*;

    #[test]
    fn bearer_challenge_is_parsed() {
        let p = parse_bearer_challenge(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        )
        .unwrap();
        assert_eq!(p["realm"], "https://auth.example/token");
        assert_eq!(p["service"], "registry.example");
        assert_eq!(p["scope"], "repository:a/b:pull");
        assert!(parse_bearer_challenge("Basic realm=\"x\"").is_none());
    }

    fn endpoint(mirror: bool) -> Endpoint {
        Endpoint {
            scheme: Scheme::Https,
            host: "m.example:5000".into(),
            mirror,
            resolve: true,
            pull: true,
            skip_verify: false,
            ca_files: vec![],
            headers: vec![],
        }
    }

    #[test]
    fn credentials_reach_mirrors_only_when_named() {
        let mut c = Credentials {
            username: "u".into(),
            password: "p".into(),
            ..Default::default()
        };
        assert!(c.applies_to(&endpoint(false)));
        assert!(!c.applies_to(&endpoint(true)));
        c.server_address = "https://m.example:5000".into();
        assert!(c.applies_to(&endpoint(true)));
    }

    #[test]
    fn auth_field_is_base64_user_colon_password() {
        let c = Credentials {
            auth: "dXNlcjpwYTpzcw==".into(),
            ..Default::default()
        }; // user:pa:ss
        assert_eq!(
            c.basic("h").unwrap(),
            Some(("user".to_string(), "pa:ss".to_string()))
        );
        let bad = Credentials {
            auth: "!!".into(),
            ..Default::default()
        };
        let err = bad.basic("h").unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("registry h")),
            "{err}"
        );
        assert_eq!(Credentials::default().basic("h").unwrap(), None);
    }

    /// Credentials count as given when any one field is set (the server address names where
    /// they go, it is none itself); a user or a password alone is sent as given, the other
    /// part empty, before any `auth`.
    #[test]
    fn any_one_credential_field_counts() {
        assert!(Credentials::default().is_empty());
        let one = |set: fn(&mut Credentials)| {
            let mut c = Credentials::default();
            set(&mut c);
            c
        };
        for c in [
            one(|c| c.username = "u".into()),
            one(|c| c.password = "p".into()),
            one(|c| c.auth = "dTpw".into()),
            one(|c| c.identity_token = "i".into()),
            one(|c| c.registry_token = "r".into()),
        ] {
            assert!(!c.is_empty(), "{c:?}");
        }
        assert!(one(|c| c.server_address = "h".into()).is_empty());
        assert_eq!(
            one(|c| c.username = "u".into()).basic("h").unwrap(),
            Some(("u".to_string(), String::new()))
        );
        assert_eq!(
            one(|c| c.password = "p".into()).basic("h").unwrap(),
            Some((String::new(), "p".to_string()))
        );
    }

    /// Token request parameters: RFC 3986's unreserved bytes as they are, every other byte
    /// (each byte of a UTF-8 character too) as %XX.
    #[test]
    fn token_parameters_are_percent_encoded() {
        assert_eq!(urlencode("AZaz09-_.~"), "AZaz09-_.~");
        assert_eq!(
            urlencode("repository:team/app:pull"),
            "repository%3Ateam%2Fapp%3Apull"
        );
        assert_eq!(urlencode("a b&c=é"), "a%20b%26c%3D%C3%A9");
        assert_eq!(urlencode(""), "");
    }

    #[test]
    fn registry_error_bodies_are_summarised() {
        let (codes, detail) = registry_errors(
            br#"{"errors":[{"code":"DENIED","message":"requested access to the resource is denied"}]}"#,
        );
        assert_eq!(codes, vec!["DENIED"]);
        assert_eq!(
            detail,
            ": DENIED: requested access to the resource is denied"
        );
        let (codes, detail) = registry_errors(b"<html>oops</html>");
        assert!(codes.is_empty());
        assert!(detail.contains("oops"), "{detail}");
        assert_eq!(registry_errors(b"").1, "");
    }

    #[test]
    fn mirrors_are_told_the_upstream_registry() {
        let clients = Clients::default();
        let name = Name::parse("registry.k8s.io/pause:3.10").unwrap();
        let s = clients
            .source(&endpoint(true), &name, &Credentials::default())
            .unwrap();
        assert_eq!(s.base, "https://m.example:5000/v2/pause");
        assert_eq!(s.query, "?ns=registry.k8s.io");
        assert_eq!(s.reference, "3.10");
        let s = clients
            .source(&endpoint(false), &name, &Credentials::default())
            .unwrap();
        assert_eq!(s.query, "");
    }

    #[test]
    fn hosts_headers_must_be_valid_http() {
        let mut ep = endpoint(false);
        ep.headers = vec![("x-a".into(), "1".into()), ("x-a".into(), "2".into())];
        assert_eq!(hosts_headers(&ep).unwrap().len(), 2);
        ep.headers = vec![("bad header".into(), "v".into())];
        let err = hosts_headers(&ep).unwrap_err().to_string();
        assert!(
            err.contains("m.example:5000") && err.contains("bad header"),
            "{err}"
        );
        ep.headers = vec![("x-ok".into(), "line\nbreak".into())];
        let err = hosts_headers(&ep).unwrap_err().to_string();
        assert!(err.contains("x-ok"), "{err}");
    }
}
