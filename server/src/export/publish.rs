//! Shipping hit reports: [`HttpPublisher`] numbers events in a [`MemoryPublisher`] (a bounded
//! log and the state for snapshots) and ships them, with its info, load and outcomes, once per report
//! interval (or sooner when a batch is full) through each of its [`Sink`]s: every router's
//! `POST /events` ([`HttpSink`]), or the NATS JetStream event plane ([`crate::export::bus`]).
//!
//! Never blocks the caller and never queues without bound: `publish` appends to the log and
//! offers the event to a bounded channel; when the channel is full the event is not sent (counted
//! in [`HttpPublisher::dropped`]). A router that misses events, because of a drop, a failed POST
//! or its own restart, sees the gap in ids and replays them from the log through the recovery API
//! (the daemon serves them at `info.recovery_url`: [`crate::edge::http`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvnet::http::HttpClient;
use kvproto::events::{Event, EventBody, LoadReport, PublisherInfo, PublisherMessage, RouteOutcome};
use tokio::sync::mpsc;

use kvproto::publisher::MemoryPublisher;

use crate::export::bus::Prepared;
pub use crate::export::sink::{BoxFuture, Sink, TargetHealth};

/// How an [`HttpPublisher`] ships events.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// Base URLs of the routers (`http://host:port`, or `https://` with `auth.tls_ca`).
    pub routers: Vec<String>,
    /// What to present to the routers (TLS trust, client certificate, token), reloaded when
    /// its files change.
    pub auth: kvnet::ClientAuthConfig,
    /// The NATS event plane to publish on as well (`None`: routers' `POST /events` only).
    pub nats: Option<kvnet::bus::NatsConfig>,
    /// Sent with every message (small), so a restarted router learns it at once.
    pub info: PublisherInfo,
    /// Events waiting to be sent; beyond this they are left to the routers' replay.
    pub max_pending: usize,
    /// Most events per message.
    pub max_batch: usize,
    /// Bound on one POST.
    pub timeout: Duration,
}

enum Item {
    Event(Event),
    Outcome(RouteOutcome),
}

/// A running publisher (the task stops when this is dropped or `shutdown` resolves).
#[derive(Debug)]
pub struct HttpPublisher {
    log: Arc<MemoryPublisher>,
    info: Arc<parking_lot::Mutex<PublisherInfo>>,
    tx: mpsc::Sender<Item>,
    dropped: Arc<AtomicU64>,
    failed_posts: Arc<AtomicU64>,
    targets: TargetHealth,
    stopping: Arc<AtomicBool>,
    bus: Option<Arc<kvnet::nats::BusState>>,
}

impl Drop for HttpPublisher {
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Event(e) => write!(f, "Event({})", e.id),
            Item::Outcome(o) => write!(f, "Outcome({})", o.route_id),
        }
    }
}

/// Every router's `POST /events`, once per message; a router that fails replays later.
#[derive(Debug)]
pub struct HttpSink {
    http: HttpClient,
    routers: Vec<String>,
    health: TargetHealth,
    failed: Arc<AtomicU64>,
}

impl HttpSink {
    /// A sink posting to `routers` with `auth`'s credentials, each POST bounded by `timeout`.
    pub fn new(
        routers: Vec<String>,
        auth: &kvnet::ClientAuthConfig,
        timeout: Duration,
        health: TargetHealth,
        failed: Arc<AtomicU64>,
    ) -> Result<Self, kvnet::NetError> {
        let http = HttpClient::new(auth, timeout)?;
        health.lock().extend(routers.iter().map(|r| (format!("router {r}"), None)));
        Ok(Self { http, routers, health, failed })
    }
}

impl Sink for HttpSink {
    fn ship<'a>(&'a mut self, msg: &'a PublisherMessage) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            for r in &self.routers {
                let posted = self.http.post_json(&format!("{r}/events"), msg).await;
                let outcome = posted.as_ref().err().map(|e| (Instant::now(), e.to_string()));
                if let Some(last) = self.health.lock().get_mut(&format!("router {r}")) {
                    *last = outcome;
                }
                if let Err(e) = posted {
                    // The router replays what it missed once it is back.
                    if self.failed.fetch_add(1, Ordering::Relaxed).is_multiple_of(100) {
                        tracing::warn!(router = %r, "publishing to router failed: {e}");
                    }
                }
            }
        })
    }
}

impl HttpPublisher {
    /// Starts the shipping task on the current tokio runtime. `load` is called once per
    /// message (return `None` to send no load report). Fails when `cfg.auth`'s files (or the
    /// NATS credentials) cannot be read.
    pub fn spawn(
        log: Arc<MemoryPublisher>,
        cfg: PublishConfig,
        load: impl Fn() -> Option<LoadReport> + Send + 'static,
    ) -> Result<Self, kvnet::NetError> {
        let (tx, rx) = mpsc::channel::<Item>(cfg.max_pending.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        let failed_posts = Arc::new(AtomicU64::new(0));
        let interval = Duration::from_millis(cfg.info.report_interval_ms.max(1));
        let targets: TargetHealth = Arc::default();
        let stopping = Arc::new(AtomicBool::new(false));
        let mut sinks: Vec<Box<dyn Sink>> = Vec::new();
        if !cfg.routers.is_empty() {
            let http =
                HttpSink::new(cfg.routers.clone(), &cfg.auth, cfg.timeout, Arc::clone(&targets), failed_posts.clone())?;
            sinks.push(Box::new(http));
        }
        let nats = match &cfg.nats {
            Some(n) => {
                let retry = interval.clamp(Duration::from_millis(100), Duration::from_secs(1));
                Some(Prepared::new(n, &cfg.info.node.0, Arc::clone(&targets), Arc::clone(&stopping), retry)?)
            }
            None => None,
        };
        let bus = nats.as_ref().map(Prepared::bus);
        let info = Arc::new(parking_lot::Mutex::new(cfg.info.clone()));
        let shipping = Shipping { log: Arc::clone(&log), info: Arc::clone(&info), max_batch: cfg.max_batch, interval };
        tokio::spawn(async move {
            if let Some(sink) = match nats {
                Some(p) => p.connect().await,
                None => None,
            } {
                sinks.push(Box::new(sink));
            }
            shipping.run(rx, sinks, load).await
        });
        Ok(Self { log, info, tx, dropped, failed_posts, targets, stopping, bus })
    }

    /// Replaces the info sent with every message from now on (workers attached or detached,
    /// namespaces added).
    pub fn set_info(&self, info: PublisherInfo) {
        *self.info.lock() = info;
    }

    /// The info sent with every message.
    pub fn info(&self) -> PublisherInfo {
        self.info.lock().clone()
    }

    /// Records an event (assigning its id) and offers it for shipping. Never blocks.
    pub fn publish(&self, body: EventBody) -> Event {
        let ev = self.log.publish(body);
        if self.tx.try_send(Item::Event(ev.clone())).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        ev
    }

    /// Reports what a routed request found. Never blocks (dropped when the queue is full).
    pub fn outcome(&self, o: RouteOutcome) {
        if self.tx.try_send(Item::Outcome(o)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Events and outcomes not sent because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// POSTs that failed (per router).
    pub fn failed_posts(&self) -> u64 {
        self.failed_posts.load(Ordering::Relaxed)
    }

    /// Targets (`router <url>`, `NATS stream <name> (<servers>)`) whose last attempt failed,
    /// with why and how long ago (for `/healthz`).
    pub fn failing_targets(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .targets
            .lock()
            .iter()
            .filter_map(|(r, last)| {
                last.as_ref().map(|(at, why)| (r.clone(), format!("{why} ({} s ago)", at.elapsed().as_secs())))
            })
            .collect();
        if let Some(b) = &self.bus
            && let Some(why) = b.problem()
            && out.is_empty()
        {
            out.push(("NATS".into(), why));
        }
        out.sort();
        out
    }

    /// The log (for the recovery API).
    pub fn log(&self) -> &Arc<MemoryPublisher> {
        &self.log
    }
}

/// The shipping task's own state.
struct Shipping {
    log: Arc<MemoryPublisher>,
    info: Arc<parking_lot::Mutex<PublisherInfo>>,
    max_batch: usize,
    interval: Duration,
}

impl Shipping {
    async fn run(
        self,
        mut rx: mpsc::Receiver<Item>,
        mut sinks: Vec<Box<dyn Sink>>,
        load: impl Fn() -> Option<LoadReport> + Send + 'static,
    ) {
        let name = self.log.name().to_string();
        let epoch = self.log.epoch();
        let mut tick = tokio::time::interval(self.interval);
        let mut open = true;
        while open {
            let mut msg = PublisherMessage::new(name.clone(), epoch);
            // Wait for the tick or a first item, then take what is ready up to a batch.
            tokio::select! {
                _ = tick.tick() => {}
                item = rx.recv() => match item {
                    Some(i) => push(&mut msg, i),
                    None => open = false,
                },
            }
            while msg.events.len() < self.max_batch {
                match rx.try_recv() {
                    Ok(i) => push(&mut msg, i),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            msg.info = Some(self.info.lock().clone());
            // With an empty queue every assigned event was offered: announce the newest id so
            // routers notice events that were dropped with nothing after them. (A race with a
            // concurrent `publish` at worst triggers a harmless replay.)
            msg.last_event_id = match msg.events.last() {
                Some(e) => Some(e.id),
                None => Some(self.log.last_id()),
            };
            msg.load = load();
            for s in &mut sinks {
                s.ship(&msg).await;
            }
        }
    }
}

fn push(msg: &mut PublisherMessage, i: Item) {
    match i {
        Item::Event(e) => msg.events.push(e),
        Item::Outcome(o) => msg.outcomes.push(o),
    }
}
