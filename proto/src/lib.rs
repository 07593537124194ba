//! hako's own protocol messages, generated from `proto/*.proto`.

/// The daemon <-> pod monitor messages (framed by `hako_runtime::monitor::wire`).
#[allow(clippy::all)]
pub mod monitor {
    include!(concat!(env!("OUT_DIR"), "/hako.monitor.v1.rs"));
}

/// The CRI v1 (`runtime.v1`): messages, and the RuntimeService and ImageService servers and
/// clients, generated from k8s.io/cri-api's `api.proto` at the version `build.rs` pins.
#[allow(clippy::all)]
pub mod cri {
    include!(concat!(env!("OUT_DIR"), "/runtime.v1.rs"));
}

/// Registry credentials stay out of logs and panics: api.proto marks these fields
/// `debug_redact`, which prost's derived Debug would ignore.
impl std::fmt::Debug for cri::AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |s: &str| if s.is_empty() { "" } else { "<redacted>" };
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("password", &redacted(&self.password))
            .field("auth", &redacted(&self.auth))
            .field("server_address", &self.server_address)
            .field("identity_token", &redacted(&self.identity_token))
            .field("registry_token", &redacted(&self.registry_token))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::cri;

    #[test]
    fn credentials_are_redacted_in_debug_output() {
        let a = cri::AuthConfig {
            username: "alice".into(),
            password: "hunter2".into(),
            auth: "YWxpY2U6aHVudGVyMg==".into(),
            server_address: "registry.example".into(),
            identity_token: "idtok".into(),
            registry_token: "regtok".into(),
        };
        let shown = format!(
            "{:?}",
            cri::PullImageRequest {
                auth: Some(a),
                ..Default::default()
            }
        );
        for secret in ["hunter2", "YWxpY2U6aHVudGVyMg==", "idtok", "regtok"] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert!(
            shown.contains("alice") && shown.contains("registry.example"),
            "{shown}"
        );
    }
}
