//! The router's side of the NATS JetStream event plane (`[nats]`, docs/router.md "The event
//! plane on NATS"): every replica reads the stream with an ordered consumer of its own, from the
//! stream's first message, and applies each daemon's messages exactly as it applies a `POST
//! /events` ([`Router::ingest`]). A replica that starts late or restarts thus rebuilds its index
//! from the stream; what the stream no longer holds, or never got, shows as a gap in that
//! publisher's event ids and is recovered from the daemon (replay, else snapshot) as before.
//!
//! Bounded: the consumer pulls batches of [`PULL_BATCH`] messages and the client buffers at most
//! [`SUBSCRIPTION_CAPACITY`] (what the server sends beyond is dropped and counted, and the
//! consumer resumes from the last applied sequence), so a publisher flooding the stream fills
//! the stream's own limits, never the router's memory. A message that is not a publisher
//! message, or that names a publisher other than the node of its subject, is refused and counted.
//!
//! Two stages, so that a replica rebuilding from the stream uses two cores: the consumer's task
//! receives and decodes each message (JSON decoding is most of the work), a second task applies
//! them in stream order, [`APPLY_QUEUE`] decoded messages between them (a full queue stops the
//! pulls: the server keeps what is not read yet).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvnet::bus::{NatsConfig, token};
use kvnet::nats::BusState;
use kvnet::nats::async_nats::jetstream::{self, consumer};
use kvproto::events::PublisherMessage;
use tokio::sync::watch;

pub use crate::health::BusCounters;
use crate::health::ConditionKind;
use crate::router::Router;

/// Messages asked for per pull.
pub const PULL_BATCH: i64 = 256;
/// Messages the client buffers for the consumer.
pub const SUBSCRIPTION_CAPACITY: usize = 4096;
/// Decoded messages waiting to be applied.
pub const APPLY_QUEUE: usize = 64;
/// How often the bus's state is folded into `/healthz`.
const HEALTH_PERIOD: Duration = Duration::from_millis(500);

/// The node a publisher's messages must come from: the subject token of its name without the
/// `kvcached@` a daemon puts before its node.
fn publisher_token(publisher: &str) -> String {
    token(publisher.strip_prefix("kvcached@").unwrap_or(publisher))
}

/// Reads the stream until `stop` changes, reconnecting and resuming after the last applied
/// message whenever something fails. The condition `event_bus` is set while it cannot read.
pub async fn run(router: Arc<Router>, cfg: NatsConfig, mut stop: watch::Receiver<bool>) {
    let bus = Arc::new(BusState::default());
    let connected = match kvnet::nats::options(&cfg, "kvrouter", Arc::clone(&bus), SUBSCRIPTION_CAPACITY) {
        Ok(o) => kvnet::nats::connect(&cfg, o, &bus).await,
        Err(e) => Err(e),
    };
    let client = match connected {
        Ok(c) => c,
        Err(e) => {
            // A configuration that cannot work (a credentials file unreadable): say so and stay
            // degraded; the HTTP API keeps serving.
            set_condition(&router, &cfg, format!("cannot connect: {e}"));
            tracing::error!("kvrouter: NATS event plane: {e}");
            return;
        }
    };
    let js = jetstream::new(client);
    let (tx, rx) = tokio::sync::mpsc::channel(APPLY_QUEUE);
    let _applier = kvnet::process::AbortOnDrop(tokio::spawn(apply_loop(Arc::clone(&router), rx)));
    let mut last = 0u64;
    loop {
        let why = tokio::select! {
            r = consume(&router, &cfg, &js, &bus, &tx, &mut last) => r,
            _ = stop.changed() => return,
        };
        set_condition(&router, &cfg, why.clone());
        tracing::warn!(stream = %cfg.stream, "kvrouter: reading the event stream failed: {why}; resuming after {last}");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = stop.changed() => return,
        }
    }
}

fn set_condition(router: &Router, cfg: &NatsConfig, why: String) {
    router.with_state(|st| st.health.set(ConditionKind::EventBus, &cfg.stream, why, Instant::now()));
}

/// One consumer's life: returns why it ended.
async fn consume(
    router: &Arc<Router>,
    cfg: &NatsConfig,
    js: &jetstream::Context,
    bus: &BusState,
    apply: &tokio::sync::mpsc::Sender<Decoded>,
    last: &mut u64,
) -> String {
    let stream = match kvnet::nats::ensure_stream(js, cfg).await {
        Ok(s) => s,
        Err(e) => return e.to_string(),
    };
    let deliver_policy = match *last {
        0 => consumer::DeliverPolicy::All,
        n => consumer::DeliverPolicy::ByStartSequence { start_sequence: n + 1 },
    };
    let ordered = consumer::pull::OrderedConfig {
        filter_subject: cfg.filter(),
        deliver_policy,
        max_batch: PULL_BATCH,
        ..Default::default()
    };
    let mut messages = match stream.create_consumer(ordered).await {
        Ok(c) => match c.messages().await {
            Ok(m) => m,
            Err(e) => return format!("consumer: {e}"),
        },
        Err(e) => return format!("creating a consumer: {e}"),
    };
    router.with_state(|st| st.counters.bus.consumers += 1);
    let connects = bus.connects();
    let mut health = tokio::time::interval(HEALTH_PERIOD);
    loop {
        tokio::select! {
            item = messages.next() => match item {
                None => return "the consumer ended".into(),
                Some(Err(e)) => {
                    use consumer::pull::OrderedErrorKind as K;
                    if matches!(e.kind(), K::Recreate | K::PushBasedConsumer) {
                        return format!("consumer: {e}");
                    }
                    // Heartbeats missed, the server restarting: the consumer recreates itself
                    // after the last message it delivered.
                    tracing::debug!("kvrouter: event stream: {e}");
                }
                Some(Ok(m)) => {
                    if let Some(d) = decode(router, cfg, &m, last)
                        && apply.send(d).await.is_err()
                    {
                        return "the applying task ended".into();
                    }
                }
            },
            _ = health.tick() => {
                if bus.connects() != connects {
                    // A server that restarted lost this consumer (ephemeral, in memory): make a
                    // new one after the last applied message rather than wait for heartbeats.
                    return "reconnected to NATS".into();
                }
                let dropped = bus.slow_consumer_drops();
                router.with_state(|st| {
                    st.counters.bus.dropped = dropped;
                    match bus.problem() {
                        Some(why) => st.health.set(ConditionKind::EventBus, &cfg.stream, why, Instant::now()),
                        None => st.health.clear(ConditionKind::EventBus, &cfg.stream),
                    }
                });
            }
        }
    }
}

/// A stream message ready to apply, and when the stream stored it.
#[derive(Debug)]
pub struct Decoded {
    msg: PublisherMessage,
    /// When the stream stored it, on this process's clock.
    stored: Instant,
}

/// Decodes one stream message and checks it comes from its subject's node (skipping one already
/// taken: the ordered consumer may deliver again from the start after a recreation that found no
/// message yet). `None`: nothing to apply.
fn decode(router: &Arc<Router>, cfg: &NatsConfig, m: &jetstream::Message, last: &mut u64) -> Option<Decoded> {
    let info = m.info().ok()?;
    let (seq, pending, published) = (info.stream_sequence, info.pending, info.published);
    if seq <= *last {
        return None;
    }
    *last = seq;
    let msg: Option<PublisherMessage> = match kvnet::bus_codec::is_binary(&m.payload) {
        true => kvnet::bus_codec::decode(&m.payload).ok(),
        false => serde_json::from_slice(&m.payload).ok(),
    };
    let from = cfg.node_token(m.subject.as_str());
    let accepted = router.with_state(|st| {
        st.counters.bus.pending = pending;
        st.counters.bus.last_sequence = seq;
        match (&msg, from) {
            (Some(msg), Some(node)) if publisher_token(&msg.publisher) == node => {
                st.counters.bus.messages += 1;
                true
            }
            _ => {
                st.counters.bus.refused += 1;
                if st.counters.bus.refused.is_power_of_two() {
                    tracing::warn!(
                        subject = m.subject.as_str(),
                        seq,
                        "kvrouter: refused a stream message (not a publisher message of its subject's node)"
                    );
                }
                false
            }
        }
    });
    let age = Duration::from_secs_f64(kvnet::nats::age_s(published));
    let stored = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
    msg.filter(|_| accepted).map(|msg| Decoded { msg, stored })
}

/// Applies decoded messages in stream order, as `POST /events` applies a report, recovering a
/// gap each reveals on a task of its own.
async fn apply_loop(router: Arc<Router>, mut rx: tokio::sync::mpsc::Receiver<Decoded>) {
    let mut batch = Vec::with_capacity(APPLY_QUEUE);
    while rx.recv_many(&mut batch, APPLY_QUEUE).await > 0 {
        for d in batch.drain(..) {
            if let Some(task) = router.ingest(&d.msg) {
                let r = Arc::clone(&router);
                tokio::spawn(async move { r.recover(task).await });
            }
            router.bus_lag(d.stored.elapsed().as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publisher_speaks_for_its_own_node_only() {
        assert_eq!(publisher_token("kvcached@node-a"), "node-a");
        assert_eq!(publisher_token("kvcached@gpu.rack"), "gpu_rack");
        assert_eq!(publisher_token("sim-7"), "sim-7");
        assert_ne!(publisher_token("kvcached@node-b"), "node-a");
    }
}
