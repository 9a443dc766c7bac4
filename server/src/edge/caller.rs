//! What every gRPC request passes before the service sees it: who sent it ([`principal`]), and
//! the bytes of requests still arriving, counted per principal and refused past
//! `limits.max_buffered_bytes_per_uid` ([`BufferedLayer`]), so that half-sent messages cannot pile
//! up in the daemon's memory.
//!
//! What is counted is what the daemon holds, not only what arrived: each stream a fixed
//! [`STREAM_OVERHEAD`] (its headers and frames in flight), and each message the length its
//! 5-byte gRPC prefix announces, from the moment the prefix arrives (tonic reserves a buffer of
//! that length at once: counting the bytes as they came let a half-sent message hold up to
//! twice what was counted). When a body that held more than [`TRIM_AFTER`] ends, the
//! allocator is asked to give freed memory back to the system ([`trim`]), so the bytes of
//! refused or abandoned requests do not stay resident.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tonic::Status;
use tonic::transport::server::UdsConnectInfo;

use crate::error::ServerError;
use crate::policy::limits::{Limits, Principal};

/// The principal of a request: the uid of its Unix-socket peer, else a TCP client.
pub fn principal_of(ext: &http::Extensions) -> Principal {
    match ext.get::<UdsConnectInfo>().and_then(|i| i.peer_cred) {
        Some(c) => Principal::Uid(c.uid()),
        None => Principal::Tcp,
    }
}

/// [`principal_of`] a tonic request.
pub fn principal<T>(req: &tonic::Request<T>) -> Principal {
    principal_of(req.extensions())
}

/// The process id of a request's Unix-socket peer, where known.
pub fn peer_pid<T>(req: &tonic::Request<T>) -> Option<i32> {
    req.extensions().get::<UdsConnectInfo>().and_then(|i| i.peer_cred).and_then(|c| c.pid())
}

/// Counts request bytes per principal while they arrive.
#[derive(Debug, Clone)]
pub struct BufferedLayer {
    pub limits: Arc<Limits>,
}

impl<S> tower::Layer<S> for BufferedLayer {
    type Service = Buffered<S>;
    fn layer(&self, inner: S) -> Buffered<S> {
        Buffered { inner, limits: Arc::clone(&self.limits) }
    }
}

/// The service [`BufferedLayer`] makes.
#[derive(Debug, Clone)]
pub struct Buffered<S> {
    inner: S,
    limits: Arc<Limits>,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for Buffered<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let who = principal_of(req.extensions());
        let (parts, body) = req.into_parts();
        let mut body = Counted {
            inner: body,
            limits: Arc::clone(&self.limits),
            who,
            held: 0,
            prefix: Vec::with_capacity(PREFIX),
            left: 0,
            refused: None,
        };
        // The stream's own overhead, counted from its headers on: refused past the limit, the
        // body fails at its first poll.
        if let Err(e) = body.charge(STREAM_OVERHEAD) {
            body.refused = Some(e);
        }
        self.inner.call(http::Request::from_parts(parts, tonic::body::Body::new(body)))
    }
}

/// What one request stream is counted for beyond its messages: its header block, the frames
/// in flight and the decoder's state.
pub const STREAM_OVERHEAD: u64 = 16 << 10;

/// The gRPC message prefix: a flag byte and a big-endian u32 length.
const PREFIX: usize = 5;

/// A body that held at least this much asks the allocator to trim when it ends.
pub const TRIM_AFTER: u64 = 1 << 20;

/// A request body whose bytes count against its principal until it is dropped.
struct Counted {
    inner: tonic::body::Body,
    limits: Arc<Limits>,
    who: Principal,
    held: u64,
    /// The prefix of the next message, while it arrives.
    prefix: Vec<u8>,
    /// Bytes of the current message still to come (counted already).
    left: u64,
    /// A refusal to return at the first poll.
    refused: Option<tonic::Status>,
}

impl Counted {
    fn charge(&mut self, n: u64) -> Result<(), tonic::Status> {
        self.limits.buffer(self.who, n).map_err(tonic::Status::from)?;
        self.held += n;
        Ok(())
    }

    /// Counts a data frame: each message's announced length when its prefix is complete, and
    /// the prefix's own bytes.
    fn count(&mut self, mut data: &[u8]) -> Result<(), tonic::Status> {
        while !data.is_empty() {
            if self.left > 0 {
                let n = self.left.min(data.len() as u64);
                self.left -= n;
                data = &data[n as usize..];
                continue;
            }
            let take = (PREFIX - self.prefix.len()).min(data.len());
            self.prefix.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.prefix.len() == PREFIX {
                let len = u32::from_be_bytes([self.prefix[1], self.prefix[2], self.prefix[3], self.prefix[4]]);
                self.prefix.clear();
                self.charge(PREFIX as u64 + u64::from(len))?;
                self.left = u64::from(len);
            }
        }
        Ok(())
    }
}

impl Body for Counted {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(e) = self.refused.take() {
            return Poll::Ready(Some(Err(e)));
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            other => return other,
        };
        if let Some(data) = frame.data_ref()
            && let Err(e) = self.count(data)
        {
            return Poll::Ready(Some(Err(e)));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.held > 0 {
            self.limits.unbuffer(self.who, self.held);
        }
        if self.held >= TRIM_AFTER {
            trim();
        }
    }
}

/// Asks the allocator to give free memory back to the system, on a thread of its own (trimming
/// a large heap takes milliseconds) and at most every 100 ms: a call while a trim runs or waits
/// out its 100 ms is remembered, and one more trim follows, so the last request to end is
/// always followed by a trim. After large requests end, refused or abandoned ones included,
/// what they held does not stay resident.
pub fn trim() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static PENDING: AtomicBool = AtomicBool::new(false);
    static RUNNING: AtomicBool = AtomicBool::new(false);
    PENDING.store(true, Ordering::Release);
    if RUNNING.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new().name("kv-trim".into()).spawn(|| {
        loop {
            while PENDING.swap(false, Ordering::AcqRel) {
                // SAFETY: malloc_trim only returns free memory of glibc's heaps to the system.
                unsafe { libc::malloc_trim(0) };
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            RUNNING.store(false, Ordering::Release);
            // A call between the last check and the store above found RUNNING set: take it.
            if !PENDING.load(Ordering::Acquire) || RUNNING.swap(true, Ordering::AcqRel) {
                return;
            }
        }
    });
    if spawned.is_err() {
        RUNNING.store(false, Ordering::Release);
    }
}

/// Who is at the other end of a TCP connection: its address and the certificate it presented
/// in the TLS handshake (verified; none on a plain endpoint). gRPC requests carry it in their
/// extensions.
#[derive(Debug, Clone)]
pub struct TcpPeer {
    pub remote: SocketAddr,
    pub cert: kvnet::PeerCert,
}

/// Runs CPU-bound or lock-taking request work off the async path. On a multi-threaded runtime
/// it runs right here (`block_in_place` hands this worker's other tasks to another thread), so a
/// request does not pay a thread hop (about 50 us on a small VM) before its work starts; on a
/// current-thread runtime it goes to the blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServerError> + Send + 'static,
) -> Result<T, Status> {
    if tokio::runtime::Handle::current().runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
        return tokio::task::block_in_place(f).map_err(Status::from);
    }
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r.map_err(Status::from),
        Err(e) => Err(Status::internal(format!("worker failed: {e}"))),
    }
}
