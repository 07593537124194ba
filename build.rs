//! Links `hako` as a fixed-address executable. Every pod runs a `hako monitor`; in a
//! position-independent executable the loader writes ~0.8 MiB of relocated pointers
//! (.data.rel.ro) into private pages of every such process, whereas a fixed-address image
//! keeps them clean, file-backed and shared by all monitors. Debian's containerd, its shim and
//! runc are fixed-address executables too.
fn main() {
    println!("cargo:rustc-link-arg-bins=-no-pie");
}
