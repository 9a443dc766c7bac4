//! Hit reports on the NATS JetStream event plane (`[events] transport = "nats"`): each message
//! the publisher builds goes to `{subject_prefix}.{cluster}.{node}` with a message id naming the
//! publisher, its epoch and the event ids it carries, so a publish retried after a lost ack is
//! stored once (JetStream's duplicate window) and applied once (the routers' event ids).
//!
//! A message is retried until the stream takes it: while NATS is down the shipping task waits
//! here, new events queue up to `router.max_pending` and beyond that are dropped and counted,
//! and the routers recover them from this daemon's log when they see the gap in ids.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvnet::bus::NatsConfig;
use kvnet::nats::BusState;
use kvnet::nats::async_nats::jetstream::{self, message::PublishMessage};
use kvproto::events::PublisherMessage;

use crate::export::sink::{BoxFuture, Sink, TargetHealth};

/// Used when the server has not said its own limit yet.
const DEFAULT_MAX_PAYLOAD: usize = 1 << 20;

/// What a sink publishes as, and where it reports how that goes (the same before and after
/// connecting).
#[derive(Debug)]
struct Publisher {
    cfg: NatsConfig,
    subject: String,
    /// This sink's name in the publisher's [`TargetHealth`].
    target: String,
    health: TargetHealth,
    bus: Arc<BusState>,
    stopping: Arc<AtomicBool>,
    retry: Duration,
}

impl Publisher {
    fn record(&self, outcome: Option<String>) {
        if let Some(last) = self.health.lock().get_mut(&self.target) {
            *last = outcome.map(|why| (Instant::now(), why));
        }
    }
}

/// Ships messages to the stream.
pub struct NatsSink {
    client: kvnet::nats::async_nats::Client,
    js: jetstream::Context,
    me: Publisher,
    /// Messages without events (load, info, outcomes) get ids from this.
    beats: u64,
    stream_ready: bool,
}

impl std::fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSink").field("subject", &self.me.subject).finish_non_exhaustive()
    }
}

/// A [`NatsSink`] whose credentials are read but which has not connected yet (connecting
/// needs the runtime: it happens in the shipping task).
pub struct Prepared {
    options: kvnet::nats::async_nats::ConnectOptions,
    me: Publisher,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared").field("subject", &self.me.subject).finish_non_exhaustive()
    }
}

impl Prepared {
    /// `node`'s publisher on `cfg`'s stream; fails when a credentials file cannot be read.
    pub fn new(
        cfg: &NatsConfig,
        node: &str,
        health: TargetHealth,
        stopping: Arc<AtomicBool>,
        retry: Duration,
    ) -> Result<Self, kvnet::NetError> {
        let bus = Arc::new(BusState::default());
        let options = kvnet::nats::options(cfg, &format!("kvcached@{node}"), Arc::clone(&bus), 64)?;
        let target = format!("NATS stream {} ({})", cfg.stream, cfg.servers.join(","));
        health.lock().insert(target.clone(), None);
        let me = Publisher { cfg: cfg.clone(), subject: cfg.subject(node), target, health, bus, stopping, retry };
        Ok(Self { options, me })
    }

    /// The connection's state, for health reports.
    pub fn bus(&self) -> Arc<BusState> {
        Arc::clone(&self.me.bus)
    }

    /// Connects (the client keeps reconnecting in the background); `None` when the server
    /// addresses do not parse (recorded in the sink's health).
    pub async fn connect(self) -> Option<NatsSink> {
        match kvnet::nats::connect(&self.me.cfg, self.options, &self.me.bus).await {
            Ok(client) => Some(NatsSink {
                js: jetstream::new(client.clone()),
                client,
                me: self.me,
                beats: 0,
                stream_ready: false,
            }),
            Err(e) => {
                tracing::error!("kvcached: NATS event plane: {e}");
                self.me.record(Some(e.to_string()));
                None
            }
        }
    }
}

impl NatsSink {
    async fn publish_once(&mut self, payload: &[u8], id: &str) -> Result<(), String> {
        if !self.stream_ready {
            kvnet::nats::ensure_stream(&self.js, &self.me.cfg).await.map_err(|e| e.to_string())?;
            self.stream_ready = true;
        }
        let p = PublishMessage::build().payload(payload.to_vec().into()).message_id(id);
        let ack = self.js.send_publish(self.me.subject.clone(), p).await.map_err(|e| format!("publish: {e}"))?;
        match ack.await {
            Ok(_) => Ok(()),
            Err(e) => {
                use kvnet::nats::async_nats::jetstream::context::PublishErrorKind as K;
                if e.kind() == K::StreamNotFound {
                    self.stream_ready = false; // deleted, or a server that lost it: made again
                }
                Err(format!("no ack: {e}"))
            }
        }
    }

    async fn ship_part(&mut self, Part { msg: part, payload }: Part) {
        let id = match (part.events.first(), part.events.last()) {
            (Some(a), Some(b)) => format!("{}:{}:{}-{}", part.publisher, part.epoch, a.id, b.id),
            _ => {
                self.beats += 1;
                format!("{}:{}:{}+{}", part.publisher, part.epoch, part.last_event_id.unwrap_or(0), self.beats)
            }
        };
        let mut failures = 0u64;
        loop {
            match self.publish_once(&payload, &id).await {
                Ok(()) => {
                    self.me.record(None);
                    return;
                }
                Err(why) => {
                    let why = match self.me.bus.problem() {
                        Some(conn) => format!("{why}; {conn}"),
                        None => why,
                    };
                    if failures.is_multiple_of(50) {
                        tracing::warn!(stream = %self.me.cfg.stream, "publishing to NATS failed (retrying): {why}");
                    }
                    failures += 1;
                    self.me.record(Some(why));
                    if self.me.stopping.load(Ordering::Relaxed) {
                        return;
                    }
                    tokio::time::sleep(self.me.retry).await;
                }
            }
        }
    }
}

impl Sink for NatsSink {
    fn ship<'a>(&'a mut self, msg: &'a PublisherMessage) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let max = self.client.server_info().max_payload;
            let max = if max == 0 { DEFAULT_MAX_PAYLOAD } else { max };
            let binary = self.me.cfg.encoding == "binary";
            for part in split(msg.clone(), max, binary) {
                self.ship_part(part).await;
            }
        })
    }
}

/// One message to publish, with its payload (binary, `kvnet::bus_codec`, or JSON).
#[derive(Debug)]
pub struct Part {
    pub msg: PublisherMessage,
    pub payload: Vec<u8>,
}

/// `msg` in parts whose payload (`binary`, else JSON) fits `max` bytes (with room for the
/// headers): events halved until each part fits. The first part carries the outcomes, the last
/// the announced newest id (a router seeing it before the events would take them for a gap). A
/// message that does not serialise is logged and left out.
pub fn split(msg: PublisherMessage, max: usize, binary: bool) -> Vec<Part> {
    let budget = max.saturating_sub(1024).max(1024);
    let encoded = match binary {
        true => kvnet::bus_codec::encode(&msg).map_err(|e| e.to_string()),
        false => serde_json::to_vec(&msg).map_err(|e| e.to_string()),
    };
    let payload = match encoded {
        Ok(p) => p,
        Err(e) => {
            tracing::error!("kvcached: a report that does not serialise: {e}");
            return Vec::new();
        }
    };
    if payload.len() <= budget || msg.events.len() <= 1 {
        return vec![Part { msg, payload }];
    }
    let mut first = msg.clone();
    let mut second = msg;
    let half = first.events.len() / 2;
    second.events = first.events.split_off(half);
    first.last_event_id = None;
    second.outcomes.clear();
    let mut out = split(first, max, binary);
    out.extend(split(second, max, binary));
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use kvproto::events::{Event, EventBody, Holder, NodeId};
    use kvproto::{BlockKey, NamespaceId, TierKind};

    fn msg(n: u64) -> PublisherMessage {
        let mut m = PublisherMessage::new("kvcached@a", 7);
        for id in 1..=n {
            m.events.push(Event {
                id,
                body: EventBody::Stored {
                    namespace: NamespaceId([1; 16]),
                    parent: None,
                    keys: (0..16u8).map(|k| BlockKey([k ^ id as u8; 16])).collect(),
                    tier: TierKind::G2Host,
                    holder: Holder::Node(NodeId("a".into())),
                },
            });
        }
        m.last_event_id = Some(n);
        m
    }

    /// Parts fit, keep every event in order, and only the last announces the newest id.
    #[test]
    fn a_large_message_is_split_into_parts_that_fit() {
        for binary in [false, true] {
            let m = msg(200);
            let encode = |m: &PublisherMessage| match binary {
                true => kvnet::bus_codec::encode(m).unwrap(),
                false => serde_json::to_vec(m).unwrap(),
            };
            let whole = encode(&m).len();
            let parts = split(m, whole / 5, binary);
            assert!(parts.len() >= 5, "{}", parts.len());
            for p in &parts {
                assert_eq!(p.payload, encode(&p.msg));
                assert!(p.payload.len() <= whole / 5);
            }
            let ids: Vec<u64> = parts.iter().flat_map(|p| p.msg.events.iter().map(|e| e.id)).collect();
            assert_eq!(ids, (1..=200).collect::<Vec<_>>());
            assert!(parts[..parts.len() - 1].iter().all(|p| p.msg.last_event_id.is_none()));
            assert_eq!(parts.last().unwrap().msg.last_event_id, Some(200));
            assert_eq!(split(msg(3), 1 << 20, binary).len(), 1);
        }
    }
}
