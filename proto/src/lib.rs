//! hako's own protocol messages, generated from `proto/*.proto`.

/// The daemon <-> pod monitor messages (framed by `hako_runtime::monitor::wire`).
#[allow(clippy::all)]
pub mod monitor {
    include!(concat!(env!("OUT_DIR"), "/hako.monitor.v1.rs"));
}
