//! Connecting to the NATS JetStream event plane ([`crate::bus::NatsConfig`]): credentials read
//! from their files, TLS through this crate's rustls configuration, reconnects forever with
//! backoff, and the stream made (or found) with the configured limits.
//!
//! The connection's state is kept in a [`BusState`] both the daemon's `/healthz` and the router's
//! read: whether it is up, and the last thing that went wrong.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use parking_lot::Mutex;

use crate::bus::NatsConfig;
use crate::error::NetError;

pub use async_nats;

/// What the event plane's connection is doing, shared with health reports.
#[derive(Debug, Default)]
pub struct BusState {
    inner: Mutex<BusInner>,
}

#[derive(Debug, Default)]
struct BusInner {
    connected: bool,
    /// Since when it is not connected, and why (the last event or error).
    down: Option<(Instant, String)>,
    slow_consumer: u64,
    connects: u64,
}

impl BusState {
    /// Records that the connection is up.
    pub fn up(&self) {
        let mut g = self.inner.lock();
        g.connected = true;
        g.down = None;
        g.connects += 1;
    }

    /// Connections made so far (a consumer on a server that restarted is gone: one that saw
    /// this number change makes a new one).
    pub fn connects(&self) -> u64 {
        self.inner.lock().connects
    }

    /// Records that it is down (or a request on it failed), keeping the first time.
    pub fn down(&self, why: impl Into<String>) {
        let mut g = self.inner.lock();
        g.connected = false;
        let why = why.into();
        match &mut g.down {
            Some((_, w)) => *w = why,
            None => g.down = Some((Instant::now(), why)),
        }
    }

    /// `None` when up; otherwise why, and for how long.
    pub fn problem(&self) -> Option<String> {
        let g = self.inner.lock();
        g.down.as_ref().map(|(at, why)| format!("{why} (for {} s)", at.elapsed().as_secs()))
    }

    /// Messages the server dropped because this client fell behind.
    pub fn slow_consumer_drops(&self) -> u64 {
        self.inner.lock().slow_consumer
    }
}

fn first_line(what: &'static str, path: &Path) -> Result<String, NetError> {
    let text = std::fs::read_to_string(path).map_err(|e| NetError::File {
        what,
        path: path.to_path_buf(),
        why: e.to_string(),
    })?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .ok_or_else(|| NetError::File { what, path: path.to_path_buf(), why: "is empty".into() })
}

/// Connection options from `cfg` (credentials read now, so a file that cannot be read fails
/// here). `name` is how the server lists this client; `state` follows the connection.
/// `subscription_capacity` bounds the messages a subscription buffers before the server's are
/// dropped (counted as slow-consumer events).
pub fn options(
    cfg: &NatsConfig,
    name: &str,
    state: Arc<BusState>,
    subscription_capacity: usize,
) -> Result<async_nats::ConnectOptions, NetError> {
    cfg.validate().map_err(NetError::Config)?;
    let a = &cfg.auth;
    let mut o = async_nats::ConnectOptions::new();
    if let (Some(user), Some(p)) = (&a.user, &a.password_file) {
        o = o.user_and_password(user.clone(), first_line("NATS password file", p)?);
    }
    if let Some(p) = &a.token_file {
        o = o.token(first_line("NATS token file", p)?);
    }
    if let Some(p) = &a.nkey_seed_file {
        o = o.nkey(first_line("NATS NKey seed file", p)?);
    }
    if let Some(p) = &a.credentials_file {
        let file = |why: String| NetError::File { what: "NATS credentials file", path: p.clone(), why };
        let text = std::fs::read_to_string(p).map_err(|e| file(e.to_string()))?;
        o = o.credentials(&text).map_err(|e| file(e.to_string()))?;
    }
    if let Some(ca) = &a.tls_ca {
        let mut paths = vec![ca.clone()];
        if let (Some(c), Some(k)) = (&a.tls_cert, &a.tls_key) {
            paths.push(c.clone());
            paths.push(k.clone());
        }
        let tls = crate::tls::client_config(&paths, &[])?;
        o = o.require_tls(true).tls_client_config((*tls).clone());
    }
    let events = Arc::clone(&state);
    Ok(o.name(name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_millis(cfg.connect_timeout_ms.max(1)))
        .request_timeout(Some(Duration::from_millis(cfg.request_timeout_ms.max(1))))
        .reconnect_delay_callback(|attempt| Duration::from_millis((100u64 << attempt.min(5)).min(2000)))
        .subscription_capacity(subscription_capacity.max(1))
        .event_callback(move |ev| {
            let s = Arc::clone(&events);
            async move {
                match ev {
                    async_nats::Event::Connected => s.up(),
                    async_nats::Event::SlowConsumer(_) => s.inner.lock().slow_consumer += 1,
                    async_nats::Event::Disconnected => s.down("disconnected from NATS"),
                    async_nats::Event::ServerError(e) => s.down(format!("NATS server: {e}")),
                    async_nats::Event::ClientError(e) => s.down(format!("NATS client: {e}")),
                    async_nats::Event::Closed => s.down("NATS connection closed"),
                    other => tracing::debug!("NATS: {other}"),
                }
            }
        }))
}

/// Connects with `options` (in the background: the client returned reconnects on its own
/// until dropped, and `state` says whether it is connected).
pub async fn connect(
    cfg: &NatsConfig,
    options: async_nats::ConnectOptions,
    state: &BusState,
) -> Result<async_nats::Client, NetError> {
    state.down("connecting to NATS");
    let servers: Vec<async_nats::ServerAddr> = cfg
        .servers
        .iter()
        .map(|s| s.parse().map_err(|e| NetError::Config(format!("NATS server {s:?}: {e}"))))
        .collect::<Result<_, _>>()?;
    options.connect(servers).await.map_err(|e| NetError::Bus(format!("NATS {:?}: {e}", cfg.servers)))
}

/// The stream's configuration from `cfg`.
pub fn stream_config(cfg: &NatsConfig) -> stream::Config {
    stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![format!("{}.>", cfg.subject_prefix)],
        max_age: Duration::from_secs(cfg.max_age_s),
        max_bytes: cfg.max_bytes,
        max_messages: cfg.max_messages,
        duplicate_window: Duration::from_secs(cfg.duplicate_window_s.max(1)),
        num_replicas: cfg.replicas.max(1),
        storage: if cfg.storage == "memory" { stream::StorageType::Memory } else { stream::StorageType::File },
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        description: Some("kvcached hit reports (docs/router.md, \"The event plane on NATS\")".into()),
        ..Default::default()
    }
}

/// The stream, made with `cfg`'s limits when it does not exist yet.
pub async fn ensure_stream(js: &jetstream::Context, cfg: &NatsConfig) -> Result<stream::Stream, NetError> {
    js.get_or_create_stream(stream_config(cfg)).await.map_err(|e| NetError::Bus(format!("stream {}: {e}", cfg.stream)))
}

/// Seconds since a message's `published` time (the server's clock; 0 if that is ahead of ours).
pub fn age_s(published: time::OffsetDateTime) -> f64 {
    (time::OffsetDateTime::now_utc() - published).as_seconds_f64().max(0.0)
}
