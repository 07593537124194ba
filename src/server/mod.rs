//! The CRI gRPC layer: the only code that names CRI types. Handlers convert requests to hako's
//! own types, call the domain, and convert back; errors become gRPC statuses in [`status`] only.

mod convert;
mod image;
mod metrics;
mod runtime;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hako_proto::cri::image_service_server::ImageServiceServer;
use hako_proto::cri::runtime_service_server::RuntimeServiceServer;

use crate::daemon::Daemon;
use crate::error::{chain, Error};

/// How long in-flight calls get to finish once shutdown is asked for.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Bytes of a message as an element of a repeated field: its tag, length prefix and body (what
/// it adds to a list response's encoding).
fn element_len(m: &impl prost::Message) -> usize {
    let len = m.encoded_len();
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

/// The CRI services over `daemon`, ready to add to a tonic server.
pub fn services(
    daemon: Arc<Daemon>,
) -> (
    RuntimeServiceServer<runtime::Runtime>,
    ImageServiceServer<image::ImageSvc>,
) {
    // Image configs and list responses of big nodes exceed tonic's 4 MiB default.
    const MAX_MSG: usize = 16 * 1024 * 1024;
    (
        RuntimeServiceServer::new(runtime::Runtime {
            daemon: daemon.clone(),
        })
        .max_decoding_message_size(MAX_MSG)
        .max_encoding_message_size(MAX_MSG),
        ImageServiceServer::new(image::ImageSvc { daemon })
            .max_decoding_message_size(MAX_MSG)
            .max_encoding_message_size(MAX_MSG),
    )
}

/// Serves CRI on `listener` until `shutdown` resolves; then in-flight calls get
/// `SHUTDOWN_GRACE` to finish. Tests call this directly with a temp socket.
pub async fn run(
    listener: tokio::net::UnixListener,
    daemon: Arc<Daemon>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> crate::error::Result<()> {
    let (runtime, image) = services(daemon);
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        let _ = signalled_tx.send(());
        let _ = stop_tx.send(());
    });
    let server = tonic::transport::Server::builder()
        .add_service(runtime)
        .add_service(image)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_rx.await;
        });
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r.map_err(|e| Error::Internal(format!("grpc server: {}", chain(&e)))),
        _ = signalled_rx => {}
    }
    tracing::info!("shutting down: finishing in-flight calls");
    match tokio::time::timeout(SHUTDOWN_GRACE, server).await {
        Ok(r) => r.map_err(|e| Error::Internal(format!("grpc server: {}", chain(&e)))),
        Err(_) => {
            tracing::warn!(
                grace_s = SHUTDOWN_GRACE.as_secs(),
                "in-flight calls still running at the end of the grace period"
            );
            Ok(())
        }
    }
}

/// The one place where error kinds become gRPC codes. Logged here, once, with the RPC name.
pub fn status(rpc: &str, e: Error) -> tonic::Status {
    use tonic::Code;
    let code = match &e {
        Error::NotFound(_) => Code::NotFound,
        Error::InvalidArgument(_) => Code::InvalidArgument,
        Error::AlreadyExists(_) => Code::AlreadyExists,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::Unauthenticated(_) => Code::Unauthenticated,
        Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::DeadlineExceeded(_) => Code::DeadlineExceeded,
        Error::Unavailable(_) => Code::Unavailable,
        Error::Unimplemented(_) => Code::Unimplemented,
        Error::Io { .. } | Error::Store(_) | Error::Internal(_) => Code::Internal,
    };
    let message = chain(&e);
    match code {
        Code::NotFound | Code::Unimplemented => {
            tracing::debug!(rpc, code = ?code, error = %message)
        }
        Code::Internal => tracing::error!(rpc, code = ?code, error = %message),
        _ => tracing::warn!(rpc, code = ?code, error = %message),
    }
    tonic::Status::new(code, message)
}

/// UNIMPLEMENTED naming the RPC: an honest answer for what is not built yet.
fn unimplemented<T>(rpc: &str) -> Result<tonic::Response<T>, tonic::Status> {
    Err(status(
        rpc,
        Error::Unimplemented(format!("{rpc} in hako {}", env!("CARGO_PKG_VERSION"))),
    ))
}

/// Current time in nanoseconds since the epoch, as CRI timestamps are.
fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
