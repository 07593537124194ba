//! hako-runtime: the embedded OCI executor.
//!
//! This crate will hold OCI spec generation, CDI, the libcontainer calls, the per-pod monitor,
//! the CRI log writer and cgroup stats (see docs/ARCHITECTURE.md). None of that is built yet:
//! the daemon serves images only, and its RuntimeService answers UNIMPLEMENTED for pods and
//! containers. The crate exists now so the workspace has its final shape.
