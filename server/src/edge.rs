//! What every gRPC request passes before the service sees it: who sent it ([`principal`]), and
//! the bytes of requests still arriving, counted per principal and refused past
//! `limits.max_buffered_bytes_per_uid` ([`BufferedLayer`]), so that half-sent messages cannot pile
//! up in the daemon's memory.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tonic::transport::server::UdsConnectInfo;

use crate::limits::{Limits, Principal};

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
        let body = Counted { inner: body, limits: Arc::clone(&self.limits), who, held: 0 };
        self.inner.call(http::Request::from_parts(parts, tonic::body::Body::new(body)))
    }
}

/// A request body whose bytes count against its principal until it is dropped.
struct Counted {
    inner: tonic::body::Body,
    limits: Arc<Limits>,
    who: Principal,
    held: u64,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => f,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            let n = data.len() as u64;
            if let Err(e) = self.limits.buffer(self.who, n) {
                return Poll::Ready(Some(Err(tonic::Status::from(e))));
            }
            self.held += n;
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
    }
}
