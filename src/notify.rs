//! systemd readiness (`Type=notify`): one datagram to `$NOTIFY_SOCKET`. Without the variable
//! (not started by systemd) this does nothing.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

fn send(msg: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let addr = match path.strip_prefix('@') {
        Some(abs) => SocketAddr::from_abstract_name(abs.as_bytes()),
        None => SocketAddr::from_pathname(&path),
    };
    let result = addr.and_then(|addr| {
        let sock = UnixDatagram::unbound()?;
        sock.send_to_addr(msg.as_bytes(), &addr)
    });
    if let Err(e) = result {
        tracing::warn!(socket = %path, error = %e, "cannot notify systemd");
    }
}

pub fn ready() {
    send("READY=1");
}

pub fn stopping() {
    send("STOPPING=1");
}
