//! The connection loop behind [`crate::http::serve`]: hyper's HTTP/1.1 and HTTP/2 on every
//! connection a [`GuardedListener`] accepts, within [`HttpLimits`].
//!
//! Why not `axum::serve`: it has no connection cap, and hyper's header-read timeout needs a
//! timer that it does not set, so a client could hold a connection forever by sending nothing
//! or by sending headers a byte at a time. Here every connection holds one of
//! `max_connections` slots; a connection must send its first bytes within `header_timeout`
//! ([`FirstBytes`]), HTTP/1.1 headers must be complete within it (hyper's timer, which also
//! closes keep-alive connections idle that long), and HTTP/2 connections are pinged so that a
//! vanished peer frees its slot.
//!
//! When every slot is taken, a new connection takes the slot of the connection idle longest
//! with no request in flight, which is closed ([`crate::slots`], counted as
//! `kvnet_http_refusals_total{reason="evicted_idle"}`): a flood of half-open or idle
//! connections cannot keep a probe (`/healthz`) or a scrape (`/metrics`) out. A request is in
//! flight from the moment hyper hands it over until its answer's body has been sent (or
//! dropped); bytes read count as activity. Only when every connection has a request in flight
//! is the newcomer closed (`reason="max_connections"`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tower::Service;

use crate::config::HttpLimits;
use crate::http_accept::{GuardedListener, Quiet};
use crate::slots::{Activity, Busy, Slots};

/// How long shutdown waits for open connections to finish their requests.
const DRAIN: Duration = Duration::from_secs(10);

/// HTTP/2 keep-alive: a ping after this long without frames, the connection closed when the
/// answer takes longer than [`PING_TIMEOUT`].
const PING_INTERVAL: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Header bytes one HTTP/2 request may send (HTTP/1.1 is bounded by hyper's read buffer).
const MAX_HEADER_LIST: u32 = 64 << 10;

/// Headers one HTTP/1.1 request may send.
const MAX_HEADERS: usize = 100;

/// HELP lines of the series the connection loop records, on the installed recorder.
pub fn describe_metrics() {
    metrics::describe_gauge!("kvnet_http_connections", "HTTP connections open now, by endpoint.");
    metrics::describe_counter!(
        "kvnet_http_refusals_total",
        "HTTP connections closed by a bound, by endpoint and reason: max_connections (at accept, every \
         connection busy), evicted_idle (the idle longest, for a newcomer), handshake_evicted (the oldest TLS \
         handshake, for a newcomer)."
    );
}

fn builder(limits: &HttpLimits) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(limits.header_timeout_ms))
        .max_headers(MAX_HEADERS);
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(MAX_HEADER_LIST)
        .keep_alive_interval(PING_INTERVAL)
        .keep_alive_timeout(PING_TIMEOUT);
    b
}

/// Serves `app` on the connections `listener` accepts until `shutdown`, then lets open
/// connections finish their requests for up to [`DRAIN`]. Handlers see the connection as
/// `ConnectInfo<PeerInfo>`.
pub(crate) async fn serve_connections(
    mut listener: GuardedListener,
    app: axum::Router,
    limits: &HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let endpoint: Arc<str> = listener.endpoint().into();
    let slots: Slots<()> = Slots::new();
    let builder = Arc::new(builder(limits));
    let first_bytes = Duration::from_millis(limits.header_timeout_ms);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut refusals = Quiet::default();
    let open = metrics::gauge!("kvnet_http_connections", "endpoint" => endpoint.to_string());
    tokio::pin!(shutdown);
    loop {
        let (io, peer) = tokio::select! {
            accepted = axum::serve::Listener::accept(&mut listener) => accepted,
            () = &mut shutdown => break,
        };
        if slots.len() >= limits.max_connections {
            if slots.evict_idle().is_some() {
                metrics::counter!("kvnet_http_refusals_total", "endpoint" => endpoint.to_string(), "reason" => "evicted_idle")
                    .increment(1);
            } else {
                metrics::counter!("kvnet_http_refusals_total", "endpoint" => endpoint.to_string(), "reason" => "max_connections")
                    .increment(1);
                let why = format!(
                    "{} connections open (http_limits.max_connections), each with a request in flight",
                    limits.max_connections
                );
                refusals.note(&endpoint, &why);
                continue;
            }
        }
        let slot = slots.insert(());
        let app = app.clone();
        let info = ConnectInfo(peer);
        let activity = slot.activity();
        let service = tower::service_fn(move |req: hyper::Request<Incoming>| {
            let busy = activity.busy();
            let mut req = req.map(Body::new);
            req.extensions_mut().insert(info.clone());
            let answer = app.clone().call(req);
            async move {
                let resp = answer.await?;
                Ok::<_, std::convert::Infallible>(resp.map(|body| Body::new(InFlight { body, _busy: busy })))
            }
        });
        let (builder, mut stop, open) = (Arc::clone(&builder), stop_rx.clone(), open.clone());
        open.increment(1.0);
        tokio::spawn(async move {
            let io = TokioIo::new(FirstBytes::new(io, first_bytes, slot.activity()));
            let conn = builder.serve_connection(io, TowerToHyperService::new(service));
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    done = conn.as_mut() => {
                        if let Err(e) = done {
                            tracing::debug!("HTTP connection ended: {e}");
                        }
                        break;
                    }
                    _ = stop.changed() => conn.as_mut().graceful_shutdown(),
                    // Evicted for a newcomer: idle, nothing in flight; closed at once.
                    () = slot.closed() => break,
                }
            }
            open.decrement(1.0);
            drop((slot, stop));
        });
    }
    // Closes the listening socket before draining: a restarted server can bind it at once.
    drop((listener, stop_rx));
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(DRAIN, stop_tx.closed()).await;
    if drained.is_err() {
        tracing::warn!(
            endpoint = &*endpoint,
            "connections still open {} s after shutdown; closing them",
            DRAIN.as_secs()
        );
    }
    Ok(())
}

/// An answer's body, its request counted in flight until the body has been sent in full (or
/// dropped): a connection streaming an answer is not idle.
struct InFlight {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for InFlight {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection that must deliver its first bytes within a deadline: until it has, a read that
/// would wait past the deadline fails with `TimedOut` (and the connection closes). Every read
/// that brings bytes is noted as the connection's activity.
struct FirstBytes<S> {
    io: S,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    within: Duration,
    activity: Activity,
}

impl<S> FirstBytes<S> {
    fn new(io: S, within: Duration, activity: Activity) -> Self {
        Self { io, deadline: Some(Box::pin(tokio::time::sleep(within))), within, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstBytes<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    this.deadline = None;
                    this.activity.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                let expired = this.deadline.as_mut().is_some_and(|d| d.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no request within {} ms", this.within.as_millis()),
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstBytes<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
