//! Talking to registries: one `oci_client::Client` per endpoint configuration, credentials from
//! the CRI request, registry errors classified into hako's error kinds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};

use super::hosts::{Endpoint, Scheme};
use super::Name;
use crate::error::{chain, Error, Result};

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
}

#[derive(Default)]
pub struct Clients {
    by_endpoint: Mutex<HashMap<Endpoint, Arc<Client>>>,
}

/// The request's view of one endpoint: client, reference rewritten for it, credentials.
pub struct Source {
    pub endpoint: Endpoint,
    pub client: Arc<Client>,
    pub reference: Reference,
    auth: RegistryAuth,
    /// The registry as the image name spells it, for messages.
    registry: String,
}

impl Clients {
    fn client(&self, ep: &Endpoint) -> Result<Arc<Client>> {
        let mut map = self.by_endpoint.lock().expect("client map poisoned");
        if let Some(c) = map.get(ep) {
            return Ok(c.clone());
        }
        let mut extra = Vec::new();
        for f in &ep.ca_files {
            let data =
                std::fs::read(f).map_err(|e| Error::io("read registry CA certificate", f, e))?;
            extra.push(Certificate {
                encoding: CertificateEncoding::Pem,
                data,
            });
        }
        if !ep.headers.is_empty() {
            tracing::warn!(host = %ep.host, "hosts.toml headers are not sent: unsupported by the registry client");
        }
        let config = ClientConfig {
            protocol: match ep.scheme {
                Scheme::Http => ClientProtocol::Http,
                Scheme::Https => ClientProtocol::Https,
            },
            accept_invalid_certificates: ep.skip_verify,
            extra_root_certificates: extra,
            connect_timeout: Some(Duration::from_secs(30)),
            user_agent: concat!("hako/", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        };
        let client = Arc::new(Client::new(config));
        map.insert(ep.clone(), client.clone());
        Ok(client)
    }

    /// Prepares `ep` for `name`: the reference as this endpoint serves it, and an authenticated
    /// client (bearer challenge answered, token cached by the client).
    pub async fn source(&self, ep: &Endpoint, name: &Name, creds: &Credentials) -> Result<Source> {
        let client = self.client(ep)?;
        let reference = match (ep.mirror, &name.digest, &name.tag) {
            (true, Some(d), _) => {
                let mut r = Reference::with_digest(
                    name.registry.clone(),
                    name.repository.clone(),
                    d.clone(),
                );
                r.set_mirror_registry(ep.host.clone());
                r
            }
            (true, None, tag) => {
                let mut r = Reference::with_tag(
                    name.registry.clone(),
                    name.repository.clone(),
                    tag.clone().unwrap_or_else(|| "latest".into()),
                );
                r.set_mirror_registry(ep.host.clone());
                r
            }
            (false, Some(d), _) => {
                Reference::with_digest(ep.host.clone(), name.repository.clone(), d.clone())
            }
            (false, None, tag) => Reference::with_tag(
                ep.host.clone(),
                name.repository.clone(),
                tag.clone().unwrap_or_else(|| "latest".into()),
            ),
        };
        let auth = if creds.is_empty() || !creds.applies_to(ep) {
            RegistryAuth::Anonymous
        } else {
            registry_auth(ep, &reference, creds).await?
        };
        let registry = name.registry.clone();
        client
            .auth(&reference, &auth, RegistryOperation::Pull)
            .await
            .map_err(|e| {
                classify(
                    e,
                    &format!("authenticate to registry {} ({})", registry, ep.url()),
                )
            })?;
        Ok(Source {
            endpoint: ep.clone(),
            client,
            reference,
            auth,
            registry,
        })
    }
}

impl Source {
    /// The same endpoint and credentials for another digest of the repository.
    pub fn at_digest(&self, digest: &str) -> Reference {
        self.reference.clone_with_digest(digest.to_string())
    }

    pub async fn manifest(
        &self,
        reference: &Reference,
        accept: &[&str],
    ) -> Result<(bytes::Bytes, String)> {
        self.client
            .pull_manifest_raw(reference, &self.auth, accept)
            .await
            .map_err(|e| {
                classify(
                    e,
                    &format!(
                        "fetch manifest {} from {}",
                        reference_text(reference),
                        self.what()
                    ),
                )
            })
    }

    pub async fn blob(
        &self,
        reference: &Reference,
        digest: &str,
        size: i64,
        media_type: &str,
        out: impl tokio::io::AsyncWrite,
    ) -> Result<()> {
        let desc = oci_client::manifest::OciDescriptor {
            media_type: media_type.to_string(),
            digest: digest.to_string(),
            size,
            ..Default::default()
        };
        self.client
            .pull_blob(reference, &desc, out)
            .await
            .map_err(|e| classify(e, &format!("fetch blob {digest} from {}", self.what())))
    }

    fn what(&self) -> String {
        format!("registry {} ({})", self.registry, self.endpoint.url())
    }
}

fn reference_text(r: &Reference) -> String {
    match (r.tag(), r.digest()) {
        (_, Some(d)) => format!("{}@{d}", r.repository()),
        (Some(t), None) => format!("{}:{t}", r.repository()),
        _ => r.repository().to_string(),
    }
}

async fn registry_auth(
    ep: &Endpoint,
    reference: &Reference,
    c: &Credentials,
) -> Result<RegistryAuth> {
    if !c.registry_token.is_empty() {
        return Ok(RegistryAuth::Bearer(c.registry_token.clone()));
    }
    if !c.identity_token.is_empty() {
        let token = exchange_identity_token(ep, reference, c).await?;
        return Ok(RegistryAuth::Bearer(token));
    }
    if !c.username.is_empty() || !c.password.is_empty() {
        return Ok(RegistryAuth::Basic(c.username.clone(), c.password.clone()));
    }
    use base64::Engine;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(c.auth.trim())
        .map_err(|e| {
            Error::InvalidArgument(format!(
                "auth for registry {}: invalid base64: {e}",
                ep.host
            ))
        })?;
    let text = String::from_utf8(decoded)
        .map_err(|_| Error::InvalidArgument(format!("auth for registry {}: not UTF-8", ep.host)))?;
    let (user, pass) = text.split_once(':').ok_or_else(|| {
        Error::InvalidArgument(format!(
            "auth for registry {}: expected base64 of user:password",
            ep.host
        ))
    })?;
    Ok(RegistryAuth::Basic(user.to_string(), pass.to_string()))
}

/// The OAuth2 refresh-token grant of the distribution token spec: find the realm from the
/// `/v2/` challenge, then POST `grant_type=refresh_token` for an access token.
async fn exchange_identity_token(
    ep: &Endpoint,
    reference: &Reference,
    c: &Credentials,
) -> Result<String> {
    let fail =
        |m: String| Error::Unauthenticated(format!("identity token for registry {}: {m}", ep.host));
    let http = reqwest::Client::builder()
        .danger_accept_invalid_certs(ep.skip_verify)
        .connect_timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| fail(chain(&e)))?;
    let probe = http
        .get(format!("{}/v2/", ep.url()))
        .send()
        .await
        .map_err(|e| Error::Unavailable(format!("registry {}: {}", ep.host, chain(&e))))?;
    let challenge = probe
        .headers()
        .get(reqwest::header::WWW_AUTHENTICATE)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| fail("the registry sent no bearer challenge".into()))?
        .to_string();
    let params = parse_bearer_challenge(&challenge)
        .ok_or_else(|| fail(format!("not a bearer challenge: {challenge}")))?;
    let realm = params
        .get("realm")
        .ok_or_else(|| fail("challenge without realm".into()))?;
    let scope = format!("repository:{}:pull", reference.repository());
    let mut form = vec![
        ("grant_type", "refresh_token".to_string()),
        ("refresh_token", c.identity_token.clone()),
        ("client_id", "hako".to_string()),
        ("scope", scope),
    ];
    if let Some(service) = params.get("service") {
        form.push(("service", service.clone()));
    }
    let body = form
        .iter()
        .map(|(k, v)| format!("{k}={}", urlencode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let resp = http
        .post(realm)
        .header(
            reqwest::header::CONTENT_TYPE,
            "application/x-www-form-urlencoded",
        )
        .body(body)
        .send()
        .await
        .map_err(|e| Error::Unavailable(format!("token realm {realm}: {}", chain(&e))))?;
    let status = resp.status();
    let text = resp.text().await.map_err(|e| fail(chain(&e)))?;
    if !status.is_success() {
        return Err(fail(format!(
            "token realm {realm} answered {status}: {}",
            text.trim()
        )));
    }
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| fail(format!("token response: {e}")))?;
    v.get("access_token")
        .or_else(|| v.get("token"))
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .ok_or_else(|| fail("token response has no access_token".into()))
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

/// Maps a registry client error to hako's kinds: 401 → Unauthenticated, 403/DENIED →
/// PermissionDenied, unknown manifest/blob/name → NotFound, transport failures → Unavailable.
pub fn classify(e: OciDistributionError, what: &str) -> Error {
    let msg = format!("{what}: {}", chain(&e));
    match &e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => Error::Unauthenticated(msg),
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<_> = envelope.errors.iter().map(|e| &e.code).collect();
            if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized))
            {
                Error::Unauthenticated(msg)
            } else if codes.iter().any(|c| matches!(c, OciErrorCode::Denied)) {
                Error::PermissionDenied(msg)
            } else if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                Error::NotFound(msg)
            } else {
                Error::Unavailable(msg)
            }
        }
        OciDistributionError::ServerError { code, .. } => match code {
            401 => Error::Unauthenticated(msg),
            403 => Error::PermissionDenied(msg),
            404 => Error::NotFound(msg),
            _ => Error::Unavailable(msg),
        },
        OciDistributionError::ImageManifestNotFoundError(_) => Error::NotFound(msg),
        OciDistributionError::DigestError(_) => Error::Internal(msg),
        OciDistributionError::RequestError(_) | OciDistributionError::IoError(_) => {
            Error::Unavailable(msg)
        }
        _ => Error::Internal(msg),
    }
}

#[cfg(test)]
mod tests {
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

    #[test]
    fn credentials_reach_mirrors_only_when_named() {
        let ep = |mirror: bool| Endpoint {
            scheme: Scheme::Https,
            host: "m.example:5000".into(),
            mirror,
            resolve: true,
            pull: true,
            skip_verify: false,
            ca_files: vec![],
            headers: vec![],
        };
        let mut c = Credentials {
            username: "u".into(),
            password: "p".into(),
            ..Default::default()
        };
        assert!(c.applies_to(&ep(false)));
        assert!(!c.applies_to(&ep(true)));
        c.server_address = "https://m.example:5000".into();
        assert!(c.applies_to(&ep(true)));
    }

    #[tokio::test]
    async fn auth_field_is_base64_user_colon_password() {
        let ep = Endpoint {
            scheme: Scheme::Http,
            host: "h".into(),
            mirror: false,
            resolve: true,
            pull: true,
            skip_verify: false,
            ca_files: vec![],
            headers: vec![],
        };
        let r = Reference::with_tag("h".into(), "a".into(), "t".into());
        let c = Credentials {
            auth: "dXNlcjpwYTpzcw==".into(),
            ..Default::default()
        }; // user:pa:ss
        match registry_auth(&ep, &r, &c).await.unwrap() {
            RegistryAuth::Basic(u, p) => assert_eq!((u.as_str(), p.as_str()), ("user", "pa:ss")),
            other => panic!("{other:?}"),
        }
        let bad = Credentials {
            auth: "!!".into(),
            ..Default::default()
        };
        let err = registry_auth(&ep, &r, &bad).await.unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(ref m) if m.contains("registry h")),
            "{err}"
        );
    }
}
