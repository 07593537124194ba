//! hako-runtime: the embedded OCI executor — OCI spec generation ([`spec`]), the per-pod
//! monitor process ([`monitor`]) that creates containers through youki's libcontainer, and the
//! CRI log writer ([`logs`]), host device nodes ([`devices`]), CDI
//! device specs and edits ([`cdi`]), and [`cgroup_warm`], which readies the kernel's
//! cgroup-migration lock before a container joins its cgroups. [`seccomp`] holds the
//! default seccomp profile and the adaptation of every profile to libcontainer; [`apparmor`]
//! decides a container's AppArmor profile and loads the default one; [`fsat`] opens directories
//! never through a symlink. Fallible functions return
//! the crate's [`Error`].

pub mod apparmor;
pub mod cdi;
pub mod cgroup_warm;
pub mod devices;
pub mod error;
pub mod fsat;
pub mod logs;
pub mod monitor;
pub mod mountapi;
pub mod seccomp;
pub mod spec;
pub mod stats;

pub use error::{Error, Result};
