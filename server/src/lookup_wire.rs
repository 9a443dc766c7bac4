//! LOOKUP on the daemon's side ([`kvproto::lookup_wire`]): a Unix-socket connection that sent
//! LOOKUP's hello carries lookups, one at a time, as length-framed protobuf messages.
//!
//! The caller is the connection's peer uid, as for gRPC; each lookup runs [`Daemon::lookup`] the
//! way the gRPC service does and is counted in the same `kvcached_rpc_*` series. A request is
//! bounded by `limits.max_message_bytes` and its bytes count against the uid's
//! `limits.max_buffered_bytes_per_uid` while it is read and answered. A request over the limit
//! or one that does not decode is refused and the connection closed; a connection quiet for
//! `limits.idle_timeout_ms`, or one whose request does not arrive whole within
//! `limits.request_timeout_ms`, is closed. At shutdown a connection closes between requests.

use std::sync::Arc;
use std::time::Duration;

use kvproto::lookup_wire::{self, HELLO_BYTES, Refusal};
use kvproto::pb;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::daemon::Daemon;
use crate::limits::{Held, Principal};
use crate::metrics_catalog::Rpc;

/// Serves one LOOKUP connection whose hello is waiting to be read, until the client closes it,
/// breaks the exchange, idles past the limit, or the daemon stops.
pub async fn serve(
    mut stream: UnixStream,
    who: Principal,
    held: Held,
    daemon: Arc<Daemon>,
    mut stop: watch::Receiver<bool>,
) {
    let cfg = &daemon.limits.cfg;
    let handshake = Duration::from_millis(cfg.handshake_timeout_ms);
    let (idle, whole) = (Duration::from_millis(cfg.idle_timeout_ms), Duration::from_millis(cfg.request_timeout_ms));
    let max = cfg.max_message_bytes;
    let mut hello = [0u8; HELLO_BYTES];
    match tokio::time::timeout(handshake, stream.read_exact(&mut hello)).await {
        Ok(Ok(_)) if lookup_wire::check_hello(&hello).is_ok() => {}
        _ => return, // a hello of another version, or none: the client falls back to gRPC
    }
    if stream.write_all(&lookup_wire::hello()).await.is_err() {
        return;
    }
    let mut body = Vec::new();
    loop {
        let mut len = [0u8; 4];
        let first = tokio::select! {
            r = tokio::time::timeout(idle, stream.read_exact(&mut len)) => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        match first {
            Ok(Ok(_)) => {}
            _ => break, // closed, broken, or idle past limits.idle_timeout_ms
        }
        let n = u32::from_le_bytes(len) as usize;
        if n > max {
            let why = format!("a lookup of {n} bytes is over limits.max_message_bytes ({max})");
            let _ = stream.write_all(&lookup_wire::refusal(&refusal_of(&tonic::Status::invalid_argument(why)))).await;
            break;
        }
        if let Err(e) = daemon.limits.buffer(who, n as u64) {
            let _ = stream.write_all(&lookup_wire::refusal(&refusal_of(&tonic::Status::from(e)))).await;
            break;
        }
        let answered = answer(&mut stream, &mut body, n, whole, who, &daemon).await;
        daemon.limits.unbuffer(who, n as u64);
        if body.capacity() > 1 << 20 {
            body = Vec::new(); // a long prompt inline: not kept for the connection's life
        }
        if !answered {
            break;
        }
    }
    let _ = stream.shutdown().await;
    drop(held);
}

/// Reads a request of `n` bytes and writes its answer; false when the connection is to close
/// (the request did not arrive whole, did not decode, or the answer could not be written).
async fn answer(
    stream: &mut UnixStream,
    body: &mut Vec<u8>,
    n: usize,
    whole: Duration,
    who: Principal,
    daemon: &Arc<Daemon>,
) -> bool {
    body.resize(n, 0);
    match tokio::time::timeout(whole, stream.read_exact(body)).await {
        Ok(Ok(_)) => {}
        _ => return false,
    }
    let rpc = Rpc::start("lookup");
    let (r, keep) = match pb::LookupRequest::decode(&body[..]) {
        Ok(req) => {
            let d = Arc::clone(daemon);
            (crate::service::blocking(move || d.lookup(&req, who)).await, true)
        }
        Err(e) => (Err(tonic::Status::invalid_argument(format!("a lookup that does not decode: {e}"))), false),
    };
    let frame = match &rpc.done(r) {
        Ok(resp) => lookup_wire::answer(&resp.encode_to_vec()),
        Err(s) => lookup_wire::refusal(&refusal_of(s)),
    };
    stream.write_all(&frame).await.is_ok() && keep
}

/// What a gRPC status says, as LOOKUP sends it.
fn refusal_of(s: &tonic::Status) -> Refusal {
    let reason = s.metadata().get(kvproto::reason::METADATA_KEY).and_then(|v| v.to_str().ok()).unwrap_or_default();
    Refusal { code: s.code() as i32, reason: reason.to_string(), message: s.message().to_string() }
}
