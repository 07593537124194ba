//! hako: a Kubernetes CRI runtime. This crate is the daemon (`hako serve`) and the CLI; the OCI
//! executor lives in `hako-runtime`. See docs/ARCHITECTURE.md for the code map.

pub mod config;
pub mod daemon;
pub mod error;
pub mod image;
pub mod inroot;
pub mod network;
mod notify;
pub mod pods;
pub mod server;
pub mod store;
pub mod streaming;
