//! LOOKUP on the daemon's side ([`kvproto::lookup_wire`]): a Unix-socket connection that sent
//! LOOKUP's hello carries lookups, one at a time, as length-framed protobuf messages.
//!
//! The caller is the connection's peer uid, as for gRPC; each lookup runs [`Daemon::lookup`] the
//! way the gRPC service does and is counted in the same `kvcached_rpc_*` series. A request is
//! bounded by `limits.max_message_bytes` and its bytes count against the uid's
//! `limits.max_buffered_bytes_per_uid` until it is answered. A request over the limit, one the
//! uid's budget cannot take, or one that does not decode is refused and the connection closed.
//! A connection quiet for `limits.idle_timeout_ms` is closed, and so is one whose request is
//! not read and answered within `limits.request_timeout_ms` (a client that sends and never
//! reads holds nothing past it). At shutdown a connection closes between requests, and the
//! drain waits for the lookups running ([`LookupWire::running`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvproto::lookup_wire::{self, HELLO_BYTES, Refusal};
use kvproto::pb;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::daemon::Daemon;
use crate::metrics_catalog::Rpc;
use crate::policy::limits::{Held, Principal};

/// A request body kept between requests at most this large (a long prompt inline is dropped).
const KEEP_BODY_BYTES: usize = 64 << 10;

/// What LOOKUP connections share: the daemon, and how many of their lookups run now.
#[derive(Debug)]
pub struct LookupWire {
    daemon: Arc<Daemon>,
    running: AtomicUsize,
}

/// One lookup counted in [`LookupWire::running`] until dropped.
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LookupWire {
    pub fn new(daemon: Arc<Daemon>) -> Arc<Self> {
        Arc::new(Self { daemon, running: AtomicUsize::new(0) })
    }

    /// Requests being read, looked up or answered now.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Serves one LOOKUP connection whose hello is waiting to be read (by `hello_by`), until the
    /// client closes it, breaks the exchange, idles or stalls past the limits, or the daemon
    /// stops.
    pub async fn serve(
        &self,
        mut stream: UnixStream,
        who: Principal,
        held: Held,
        hello_by: Instant,
        mut stop: watch::Receiver<bool>,
    ) {
        let cfg = &self.daemon.limits.cfg;
        let (idle, whole) = (Duration::from_millis(cfg.idle_timeout_ms), Duration::from_millis(cfg.request_timeout_ms));
        let mut hello = [0u8; HELLO_BYTES];
        let greeted = tokio::time::timeout_at(hello_by, async {
            stream.read_exact(&mut hello).await?;
            if lookup_wire::check_hello(&hello).is_err() {
                // Another version: no hello back, and the client looks up over gRPC.
                return Err(std::io::Error::other("not a hello of this version"));
            }
            stream.write_all(&lookup_wire::hello()).await
        })
        .await;
        if !matches!(greeted, Ok(Ok(()))) {
            return;
        }
        let mut body = Vec::new();
        loop {
            let mut len = [0u8; 4];
            let first = tokio::select! {
                r = tokio::time::timeout(idle, stream.read_exact(&mut len)) => r,
                _ = stop.wait_for(|s| *s) => break,
            };
            if !matches!(first, Ok(Ok(_))) {
                break; // closed, broken, or idle past limits.idle_timeout_ms
            }
            let _running = self.enter();
            let deadline = Instant::now() + whole;
            let kept =
                tokio::time::timeout_at(deadline, self.request(&mut stream, &mut body, u32::from_le_bytes(len), who))
                    .await
                    .unwrap_or(false); // not read and answered within limits.request_timeout_ms
            if body.capacity() > KEEP_BODY_BYTES {
                body = Vec::new();
            }
            if !kept {
                break;
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), stream.shutdown()).await;
        drop(held);
    }

    fn enter(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::Relaxed);
        Running(&self.running)
    }

    /// Reads a request of `n` bytes and writes its answer; false when the connection is to close
    /// (the request was refused before it was read, did not arrive whole or did not decode, or
    /// the answer could not be written).
    async fn request(&self, stream: &mut UnixStream, body: &mut Vec<u8>, n: u32, who: Principal) -> bool {
        let limits = &self.daemon.limits;
        let max = limits.cfg.max_message_bytes;
        if n as usize > max {
            // gRPC's answer to a message over the limit, from its length, before its body.
            let why = format!("a lookup of {n} bytes is over limits.max_message_bytes ({max})");
            let _ = stream.write_all(&refusal(&tonic::Status::out_of_range(why))).await;
            return false;
        }
        let _buffered = match limits.buffer_held(who, u64::from(n)) {
            Ok(held) => held,
            Err(e) => {
                let _ = stream.write_all(&refusal(&tonic::Status::from(e))).await;
                return false;
            }
        };
        body.resize(n as usize, 0);
        if stream.read_exact(body).await.is_err() {
            return false;
        }
        let rpc = Rpc::start("lookup");
        let (r, keep) = match pb::LookupRequest::decode(&body[..]) {
            Ok(req) => {
                let d = Arc::clone(&self.daemon);
                (crate::edge::caller::blocking(move || d.lookup(&req, who)).await, true)
            }
            Err(e) => (Err(tonic::Status::invalid_argument(format!("a lookup that does not decode: {e}"))), false),
        };
        let frame = match &rpc.done(r) {
            Ok(resp) => {
                let mut frame = lookup_wire::answer_frame(resp.encoded_len());
                resp.encode_raw(&mut frame);
                frame
            }
            Err(s) => refusal(s),
        };
        stream.write_all(&frame).await.is_ok() && keep
    }
}

/// The answer frame refusing a lookup with what the gRPC status `s` says.
fn refusal(s: &tonic::Status) -> Vec<u8> {
    let reason = s.metadata().get(kvproto::reason::METADATA_KEY).and_then(|v| v.to_str().ok()).unwrap_or_default();
    lookup_wire::refusal(&Refusal {
        code: s.code() as i32,
        reason: reason.to_string(),
        message: s.message().to_string(),
    })
}
