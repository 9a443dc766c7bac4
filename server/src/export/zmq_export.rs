//! Our events in vLLM's KV-event wire format: a ZMQ PUB socket ([`VllmExporter`]) and, like
//! vLLM's own publisher, an optional replay socket (a ROUTER: a subscriber that missed batches
//! asks `[b"", first seq]` and is sent every batch still buffered from there, `[b"", seq,
//! payload]`, then `[b"", -1, b""]`; kvrouter's ZMQ ingest is the asking side).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use parking_lot::Mutex;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use kvproto::vllm::{self, Encoding, REPLAY_END_SEQ as END_SEQ, VllmBatch, VllmEvent};

use kvnet::process::AbortOnDrop;

use crate::error::ServerError;

/// Publishes events in vLLM's wire format on a ZMQ PUB socket (for routers that consume vLLM
/// events, e.g. Dynamo or llm-d, to see our G2-G4 tiers).
pub struct VllmExporter {
    sock: zeromq::PubSocket,
    topic: Bytes,
    seq: u64,
    encoding: Encoding,
    endpoint: String,
    replay: Option<Replay>,
}

/// The batches kept for replay and the task serving them.
struct Replay {
    buffer: Arc<Mutex<Buffered>>,
    task: tokio::task::JoinHandle<()>,
    endpoint: String,
}

/// Bytes a kept batch costs beyond its payload (queue slot, shared buffer header, allocation):
/// counted so that a long run of tiny batches (the keepalives) stays within the bound too.
pub const REPLAY_ENTRY_OVERHEAD: usize = 96;

/// Most batches kept, whatever their size (vLLM keeps 10,000 by default).
const MAX_BATCHES: usize = 100_000;

/// How long one replay answer may take before the peer is given up on (a peer that asks and
/// does not read must not hold up the others).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Batches sent, oldest first, at most `max_bytes` counting [`REPLAY_ENTRY_OVERHEAD`] each and at
/// most [`MAX_BATCHES`].
#[derive(Debug, Default)]
struct Buffered {
    batches: VecDeque<(u64, Bytes)>,
    bytes: usize,
    max_bytes: usize,
}

impl Buffered {
    fn push(&mut self, seq: u64, payload: Bytes) {
        self.bytes += payload.len() + REPLAY_ENTRY_OVERHEAD;
        self.batches.push_back((seq, payload));
        while self.bytes > self.max_bytes || self.batches.len() > MAX_BATCHES {
            let Some((_, old)) = self.batches.pop_front() else { break };
            self.bytes -= old.len() + REPLAY_ENTRY_OVERHEAD;
        }
    }

    fn from(&self, start: u64) -> Vec<(u64, Bytes)> {
        self.batches.iter().filter(|(s, _)| *s >= start).cloned().collect()
    }
}

impl Drop for VllmExporter {
    fn drop(&mut self) {
        if let Some(r) = &self.replay {
            r.task.abort();
        }
    }
}

impl std::fmt::Debug for VllmExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmExporter")
            .field("endpoint", &self.endpoint)
            .field("seq", &self.seq)
            .field("replay", &self.replay_endpoint())
            .finish()
    }
}

impl VllmExporter {
    /// Binds a PUB socket (e.g. `tcp://127.0.0.1:0`; the bound endpoint is [`Self::endpoint`]).
    pub async fn bind(endpoint: &str, topic: &str, encoding: Encoding) -> Result<Self, ServerError> {
        let mut sock = zeromq::PubSocket::new();
        let ep = sock.bind(endpoint).await.map_err(|e| ServerError::Zmq(e.to_string()))?;
        Ok(Self {
            sock,
            topic: Bytes::from(topic.as_bytes().to_vec()),
            seq: 0,
            encoding,
            endpoint: ep.to_string(),
            replay: None,
        })
    }

    /// Binds a replay socket at `endpoint` (a ROUTER, e.g. `tcp://0.0.0.0:5558`) that serves
    /// the batches sent from now on, the most recent `max_bytes` of them, to subscribers that
    /// missed some. Returns the bound endpoint.
    pub async fn serve_replay(&mut self, endpoint: &str, max_bytes: usize) -> Result<String, ServerError> {
        let mut sock = zeromq::RouterSocket::new();
        let bound = sock.bind(endpoint).await.map_err(|e| ServerError::Zmq(e.to_string()))?.to_string();
        let buffer = Arc::new(Mutex::new(Buffered { max_bytes, ..Buffered::default() }));
        let task = tokio::spawn(serve_replays(sock, bound.clone(), Arc::clone(&buffer)));
        if let Some(old) = self.replay.replace(Replay { buffer, task, endpoint: bound.clone() }) {
            old.task.abort();
        }
        Ok(bound)
    }

    /// The replay socket's bound endpoint, if one is served.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay.as_ref().map(|r| r.endpoint.as_str())
    }

    /// The bound endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sets the encoding of later batches.
    pub fn set_encoding(&mut self, e: Encoding) {
        self.encoding = e;
    }

    /// A message when a subscriber connects (from the socket's monitor), and another `again`
    /// later, so that the publisher can send a newcomer what it already holds: a PUB socket
    /// drops what was sent before a subscriber joined, and the socket does not tell when the
    /// newcomer's subscription arrives (a peer slow to send it misses what goes out at once).
    pub fn subscriber_joins(&mut self, again: Duration) -> tokio::sync::mpsc::Receiver<()> {
        use tokio_stream::StreamExt;
        let mut events = self.sock.monitor();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                if !matches!(ev, zeromq::SocketEvent::Accepted(..)) {
                    continue;
                }
                if tx.send(()).await.is_err() {
                    break;
                }
                let later = tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(again).await;
                    let _ = later.send(()).await;
                });
            }
        });
        rx
    }

    /// Sends one batch (sequence numbers 0, 1, 2, ...). A batch that fails to go out still
    /// takes its number and its place in the replay buffer, so subscribers see a gap they can
    /// fill rather than a number reused for other events.
    pub async fn publish(&mut self, events: Vec<VllmEvent>, dp_rank: Option<i64>) -> Result<u64, ServerError> {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let payload = vllm::encode_batch(&VllmBatch { ts, events, dp_rank }, self.encoding);
        let seq = self.seq;
        let mut m = ZmqMessage::from(self.topic.clone());
        m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        let payload = Bytes::from(payload);
        m.push_back(payload.clone());
        // The `zeromq` crate's PUB send has a `todo!` for peer errors it does not expect: a
        // peer's failure must cost this batch (its number used, as vLLM does with a failed send,
        // and kept for replay, so subscribers can still fetch it), not the exporter.
        let sent = std::panic::AssertUnwindSafe(self.sock.send(m)).catch_unwind().await;
        if let Some(r) = &self.replay {
            r.buffer.lock().push(seq, payload);
        }
        self.seq += 1;
        match sent {
            Ok(Ok(())) => Ok(seq),
            Ok(Err(e)) => Err(ServerError::Zmq(format!("batch {seq} not sent: {e}"))),
            Err(_) => {
                Err(ServerError::Zmq(format!("batch {seq} not sent: the PUB socket failed inside the ZMQ library")))
            }
        }
    }
}

/// Serves replay requests on `sock` (bound at `endpoint`) for as long as the exporter lives
/// (aborting this task aborts the answering task with it). Requests are answered one at a time
/// on a task of their own, each within [`ANSWER_TIMEOUT`]: the `zeromq` crate's ROUTER panics
/// (`todo!`) on some peer behaviour (a ZMTP command after the handshake), and that must not take
/// the replay socket down for good; after such a panic the socket is bound again.
async fn serve_replays(sock: zeromq::RouterSocket, endpoint: String, buffer: Arc<Mutex<Buffered>>) {
    let mut sock = Some(sock);
    loop {
        let s = match sock.take() {
            Some(s) => s,
            None => {
                let mut s = zeromq::RouterSocket::new();
                if let Err(e) = s.bind(&endpoint).await {
                    tracing::warn!(endpoint = %endpoint, "vLLM export replay socket not bound again: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                s
            }
        };
        let mut served = AbortOnDrop(tokio::spawn(answer_replays(s, Arc::clone(&buffer))));
        match (&mut served.0).await {
            Ok(()) => return,
            Err(e) if e.is_panic() => {
                tracing::warn!(endpoint = %endpoint, "vLLM export replay socket failed inside the ZMQ library; binding it again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => return,
        }
    }
}

async fn answer_replays(mut sock: zeromq::RouterSocket, buffer: Arc<Mutex<Buffered>>) {
    loop {
        let m = match sock.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!("vLLM export replay receive failed: {e}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let frames: Vec<Bytes> = m.into_vec();
        // `[peer, b"", start]` from a DEALER (a REQ adds the empty frame itself).
        let (peer, start) = match frames.as_slice() {
            [peer, delim, start] if delim.is_empty() => match <[u8; 8]>::try_from(start.as_ref()) {
                Ok(s) => (peer.clone(), u64::from_be_bytes(s)),
                Err(_) => continue,
            },
            _ => continue,
        };
        let batches = buffer.lock().from(start);
        let frame = |parts: [Bytes; 4]| {
            let mut m = ZmqMessage::from(parts[0].clone());
            for p in &parts[1..] {
                m.push_back(p.clone());
            }
            m
        };
        let seq_bytes = |s: u64| Bytes::copy_from_slice(&s.to_be_bytes());
        let answer = async {
            for (s, payload) in batches {
                if sock.send(frame([peer.clone(), Bytes::new(), seq_bytes(s), payload])).await.is_err() {
                    return; // the peer left
                }
            }
            let _ = sock.send(frame([peer.clone(), Bytes::new(), seq_bytes(END_SEQ), Bytes::new()])).await;
        };
        if tokio::time::timeout(ANSWER_TIMEOUT, answer).await.is_err() {
            tracing::debug!("vLLM export replay: a peer did not take its answer within {ANSWER_TIMEOUT:?}");
        }
    }
}
