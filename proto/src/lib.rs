//! hako's own protocols, generated from `proto/*.proto`.

/// The daemon <-> pod monitor API.
#[allow(clippy::all)]
pub mod monitor {
    tonic::include_proto!("hako.monitor.v1");
}
