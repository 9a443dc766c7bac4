//! How `kvbench bus` hands messages to a transport: one message (a publisher's second) as it
//! travels, a JetStream publish or a POST to every replica, the backlog pushed in order, and the
//! stream read by a consumer that does nothing (the bus's own rate).

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use kvnet::nats::async_nats::jetstream::{self, message::PublishMessage};
use kvproto::events::PublisherMessage;

/// A message ready to send: subject, JetStream message id, JSON.
pub(super) struct Wire {
    pub(super) publisher: usize,
    pub(super) subject: String,
    pub(super) id: String,
    pub(super) json: bytes::Bytes,
    /// The same in binary (`kvnet::bus_codec`), as daemons publish it on NATS by default.
    pub(super) bin: bytes::Bytes,
    pub(super) events: u64,
    pub(super) keys: u64,
}

impl Wire {
    /// Its JetStream publish: binary or JSON, with its message id.
    fn publish(&self, binary: bool) -> PublishMessage {
        let payload = if binary { self.bin.clone() } else { self.json.clone() };
        PublishMessage::build().payload(payload).message_id(self.id.as_str())
    }
}

pub(super) fn wire(publisher: usize, m: &PublisherMessage, keys: u64, subject: String) -> Result<Wire, String> {
    let first = m.events.first().map_or(0, |e| e.id);
    let last = m.events.last().map_or(0, |e| e.id);
    let json = serde_json::to_vec(m).map_err(|e| e.to_string())?;
    let bin = kvnet::bus_codec::encode(m).map_err(|e| e.to_string())?;
    Ok(Wire {
        publisher,
        subject,
        id: format!("{}:{}:{first}-{last}", m.publisher, m.epoch),
        json: json.into(),
        bin: bin.into(),
        events: m.events.len() as u64,
        keys,
    })
}

/// How messages travel to the replicas.
#[derive(Clone)]
pub(super) enum Sender {
    /// The connections, and whether reports go in binary (else JSON).
    Nats(Arc<Vec<jetstream::Context>>, bool),
    Http(reqwest::Client, Arc<Vec<String>>),
}

impl Sender {
    /// Sends one message and waits until it is taken: acked by the stream, or answered by
    /// every replica.
    pub(super) async fn send(&self, conn: usize, w: &Wire) -> Result<(), String> {
        match self {
            Self::Nats(js, binary) => {
                // Publisher `conn`'s connection: one publisher's messages keep their order.
                let js = &js[conn % js.len()];
                let ack = js
                    .send_publish(w.subject.clone(), w.publish(*binary))
                    .await
                    .map_err(|e| format!("publish: {e}"))?;
                ack.await.map(|_| ()).map_err(|e| format!("ack: {e}"))
            }
            Self::Http(http, bases) => {
                let posts = bases.iter().map(|b| {
                    http.post(format!("{b}/events"))
                        .header("content-type", "application/json")
                        .body(w.json.clone())
                        .send()
                });
                for r in futures_util::future::join_all(posts).await {
                    let r = r.map_err(|e| format!("POST /events: {e}"))?;
                    if !r.status().is_success() {
                        return Err(format!("POST /events: {}", r.status()));
                    }
                }
                Ok(())
            }
        }
    }
}

/// Seconds an ordered consumer of the stream (as a replica's, pulling as many at a time) takes
/// to read `n` messages, doing nothing with them: the bus's own rate.
pub(super) async fn drain(js: &jetstream::Context, cfg: &kvnet::bus::NatsConfig, n: usize) -> Result<f64, String> {
    use kvnet::nats::async_nats::jetstream::consumer;
    let t0 = Instant::now();
    let stream = js.get_stream(&cfg.stream).await.map_err(|e| e.to_string())?;
    let ordered = consumer::pull::OrderedConfig {
        filter_subject: cfg.filter(),
        max_batch: kvrouter::nats::PULL_BATCH,
        ..Default::default()
    };
    let mut messages = stream
        .create_consumer(ordered)
        .await
        .map_err(|e| e.to_string())?
        .messages()
        .await
        .map_err(|e| e.to_string())?;
    let mut bytes = 0usize;
    for _ in 0..n {
        match messages.next().await {
            Some(Ok(m)) => bytes += m.payload.len(),
            Some(Err(e)) => return Err(format!("draining the stream: {e}")),
            None => return Err("the stream ended early".into()),
        }
    }
    let s = t0.elapsed().as_secs_f64();
    eprintln!("  ({n} messages, {:.0} MB)", bytes as f64 / 1e6);
    Ok(s)
}

/// Sends the backlog: every message but the last, then the last (whose probe says, once a
/// replica routes it, that the replica applied everything before it).
pub(super) async fn push_backlog(sender: &Sender, wires: &[Wire]) -> Result<(), String> {
    let (last, rest) = wires.split_last().ok_or("no backlog")?;
    push_all(sender, rest).await?;
    push_all(sender, std::slice::from_ref(last)).await
}

/// Sends every message as fast as the transport takes them, each publisher's in order: on NATS
/// each publisher's on one connection (which keeps their order), 256 acks awaited behind the
/// last publish; over HTTP 64 publishers at a time, each one message after the other.
async fn push_all(sender: &Sender, wires: &[Wire]) -> Result<(), String> {
    match sender {
        Sender::Nats(js, binary) => {
            let conns = js.len();
            let per_conn = (0..conns).map(|c| async move {
                let mut acks = std::collections::VecDeque::new();
                for w in wires.iter().filter(|w| w.publisher % conns == c) {
                    let ack = js[c].send_publish(w.subject.clone(), w.publish(*binary)).await;
                    acks.push_back(ack.map_err(|e| format!("publish: {e}"))?);
                    if acks.len() >= 256
                        && let Some(a) = acks.pop_front()
                    {
                        a.await.map_err(|e| format!("ack: {e}"))?;
                    }
                }
                for a in acks {
                    a.await.map_err(|e| format!("ack: {e}"))?;
                }
                Ok::<(), String>(())
            });
            futures_util::future::join_all(per_conn).await.into_iter().collect()
        }
        Sender::Http(..) => {
            let mut by_pub: std::collections::BTreeMap<usize, Vec<&Wire>> = Default::default();
            for w in wires {
                by_pub.entry(w.publisher).or_default().push(w);
            }
            let results: Vec<Result<(), String>> = futures_util::stream::iter(by_pub.into_values())
                .map(|ws| async move {
                    for w in ws {
                        sender.send(w.publisher, w).await?;
                    }
                    Ok(())
                })
                .buffer_unordered(64)
                .collect()
                .await;
            results.into_iter().collect()
        }
    }
}
