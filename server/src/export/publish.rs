//! Shipping hit reports to routers: [`HttpPublisher`] numbers events in a
//! [`MemoryPublisher`] (bounded log + state for snapshots) and ships them, with its info, load and
//! outcomes, to every router's `POST /events` once per report interval (or sooner when a batch is
//! full).
//!
//! Never blocks the caller and never queues without bound: `publish` appends to the log and
//! offers the event to a bounded channel; when the channel is full the event is not sent (counted
//! in [`HttpPublisher::dropped`]). A router that misses events, because of a drop, a failed POST
//! or its own restart, sees the gap in ids and replays them from the log through the recovery API
//! (the daemon serves them at `info.recovery_url`: [`crate::edge::http`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvnet::http::HttpClient;
use kvproto::events::{Event, EventBody, LoadReport, PublisherInfo, PublisherMessage, RouteOutcome};
use tokio::sync::mpsc;

use kvproto::publisher::MemoryPublisher;

/// How an [`HttpPublisher`] ships events.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// Base URLs of the routers (`http://host:port`, or `https://` with `auth.tls_ca`).
    pub routers: Vec<String>,
    /// What to present to the routers (TLS trust, client certificate, token), reloaded when
    /// its files change.
    pub auth: kvnet::ClientAuthConfig,
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
    routers: RouterHealth,
}

/// Per router: the last POST's failure (when and why), `None` after a success.
type RouterHealth = Arc<parking_lot::Mutex<HashMap<String, Option<(Instant, String)>>>>;

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Event(e) => write!(f, "Event({})", e.id),
            Item::Outcome(o) => write!(f, "Outcome({})", o.route_id),
        }
    }
}

impl HttpPublisher {
    /// Starts the shipping task on the current tokio runtime. `load` is called once per
    /// message (return `None` to send no load report). Fails when `cfg.auth`'s files cannot be
    /// read.
    pub fn spawn(
        log: Arc<MemoryPublisher>,
        cfg: PublishConfig,
        load: impl Fn() -> Option<LoadReport> + Send + 'static,
    ) -> Result<Self, kvnet::NetError> {
        let (tx, mut rx) = mpsc::channel::<Item>(cfg.max_pending.max(1));
        let dropped = Arc::new(AtomicU64::new(0));
        let failed_posts = Arc::new(AtomicU64::new(0));
        let interval = Duration::from_millis(cfg.info.report_interval_ms.max(1));
        let http = HttpClient::new(&cfg.auth, cfg.timeout)?;
        let name = log.name().to_string();
        let epoch = log.epoch();
        let failed = failed_posts.clone();
        let log_for_task = log.clone();
        let info = Arc::new(parking_lot::Mutex::new(cfg.info.clone()));
        let info_for_task = Arc::clone(&info);
        let routers: RouterHealth =
            Arc::new(parking_lot::Mutex::new(cfg.routers.iter().map(|r| (r.clone(), None)).collect()));
        let routers_for_task = Arc::clone(&routers);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
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
                while msg.events.len() < cfg.max_batch {
                    match rx.try_recv() {
                        Ok(i) => push(&mut msg, i),
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            open = false;
                            break;
                        }
                    }
                }
                msg.info = Some(info_for_task.lock().clone());
                // With an empty queue every assigned event was offered: announce the newest id so
                // routers notice events that were dropped with nothing after them. (A race with a
                // concurrent `publish` at worst triggers a harmless replay.)
                msg.last_event_id = match msg.events.last() {
                    Some(e) => Some(e.id),
                    None => Some(log_for_task.last_id()),
                };
                msg.load = load();
                for r in &cfg.routers {
                    let posted = http.post_json(&format!("{r}/events"), &msg).await;
                    let outcome = posted.as_ref().err().map(|e| (Instant::now(), e.to_string()));
                    if let Some(last) = routers_for_task.lock().get_mut(r) {
                        *last = outcome;
                    }
                    if let Err(e) = posted {
                        // The router replays what it missed once it is back.
                        if failed.fetch_add(1, Ordering::Relaxed).is_multiple_of(100) {
                            tracing::warn!(router = %r, "publishing to router failed: {e}");
                        }
                    }
                }
            }
        });
        Ok(Self { log, info, tx, dropped, failed_posts, routers })
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

    /// Routers whose last POST failed, with why and how long ago (for `/healthz`).
    pub fn failing_routers(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = self
            .routers
            .lock()
            .iter()
            .filter_map(|(r, last)| {
                last.as_ref().map(|(at, why)| (r.clone(), format!("{why} ({} s ago)", at.elapsed().as_secs())))
            })
            .collect();
        out.sort();
        out
    }

    /// The log (for the recovery API).
    pub fn log(&self) -> &Arc<MemoryPublisher> {
        &self.log
    }
}

fn push(msg: &mut PublisherMessage, i: Item) {
    match i {
        Item::Event(e) => msg.events.push(e),
        Item::Outcome(o) => msg.outcomes.push(o),
    }
}
