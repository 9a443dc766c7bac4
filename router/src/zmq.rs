//! ZMQ transport for vLLM-format KV events (pure Rust `zeromq`, no system libzmq).
//!
//! - [`run_source`]: SUB to one vLLM engine, decode, and hand each batch to the router
//!   ([`crate::vllm_ingest`] turns it into our events: Dynamo hashes recomputed from
//!   `token_ids`, G1 or, by `medium`, G2-G4 events of the configured worker / node).
//!
//! A vLLM engine sends no heartbeat, so its worker is never marked stale for silence. A sequence
//! gap is asked for on the engine's replay socket when the source names one
//! ([`replay_from`]); what that cannot fill is reported as unrecovered for `gap_hold_s`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvnet::process::AbortOnDrop;
use kvproto::events::{NodeId, WorkerId};
use kvproto::vllm;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::RouterError;
use crate::config::{ResolvedNamespace, VllmSource};
use crate::router::Router;
use crate::vllm_ingest::restarted;
pub use crate::vllm_ingest::{MAX_HASH_MAP, VllmIngest, source_name};

/// Most batches one replay may bring (vLLM buffers its last 10,000 by default).
pub const MAX_REPLAY_BATCHES: usize = 100_000;

/// The end-of-replay marker's sequence frame: -1 as a big-endian i64.
use kvproto::vllm::REPLAY_END_SEQ as END_SEQ;

/// Asks a vLLM engine's replay socket (a ZMQ ROUTER, `replay_endpoint` of its
/// `--kv-events-config`) for every batch it still buffers from sequence number `from` on:
/// the request is `[b"", from]`, each answer `[b"", seq, payload]` (or `[b"", topic, seq,
/// payload]`, as later vLLM versions send), the last `[b"", -1, b""]`. Returns `(seq, payload)`
/// in the order sent; fails after `timeout` or beyond [`MAX_REPLAY_BATCHES`].
pub async fn replay_from(endpoint: &str, from: u64, timeout: Duration) -> Result<Vec<(u64, Bytes)>, RouterError> {
    let ep = endpoint.to_string();
    let ask = async move {
        let endpoint = ep;
        let zmq = |e: zeromq::ZmqError| RouterError::Zmq(format!("replay from {endpoint}: {e}"));
        let mut sock = zeromq::DealerSocket::new();
        sock.connect(&endpoint).await.map_err(zmq)?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        sock.send(req).await.map_err(zmq)?;
        let mut out = Vec::new();
        loop {
            let m = sock.recv().await.map_err(zmq)?;
            match replay_reply(&m)? {
                None => return Ok(out),
                Some(b) if out.len() < MAX_REPLAY_BATCHES => out.push(b),
                Some(_) => {
                    return Err(RouterError::Zmq(format!(
                        "replay from {endpoint} sent more than {MAX_REPLAY_BATCHES} batches"
                    )));
                }
            }
        }
    };
    // On its own task: the `zeromq` crate's DEALER panics (`todo!`) when its peer drops the
    // connection mid-answer, and that must be a failed replay, not a dead source.
    let asked = tokio::spawn(tokio::time::timeout(timeout, ask));
    match asked.await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(RouterError::Zmq(format!("replay from {endpoint}: no end marker within {timeout:?}"))),
        Err(e) => Err(RouterError::Zmq(format!("replay from {endpoint}: the socket failed ({e})"))),
    }
}

/// One replay answer as a DEALER receives it: `Some((seq, payload))`, or `None` for the end
/// marker.
pub fn replay_reply(m: &ZmqMessage) -> Result<Option<(u64, Bytes)>, RouterError> {
    let frames: Vec<&Bytes> = m.iter().collect();
    let (seq, payload) = match frames.as_slice() {
        [delim, seq, payload] | [delim, _, seq, payload] if delim.is_empty() => (*seq, *payload),
        _ => return Err(RouterError::Decode(format!("replay answer of {} frames", frames.len()))),
    };
    let seq: [u8; 8] =
        seq.as_ref().try_into().map_err(|_| RouterError::Decode("replay sequence frame must be 8 bytes".into()))?;
    Ok(match u64::from_be_bytes(seq) {
        END_SEQ => None,
        s if s > i64::MAX as u64 => {
            return Err(RouterError::Decode(format!("replayed sequence number {s} out of range")));
        }
        s => Some((s, payload.clone())),
    })
}

/// Fills the batches `from..seq` from `src`'s replay socket: applies the replayed ones in order
/// (stopping at the first one missing) and counts the gap as recovered if they close it, as a
/// failed recovery otherwise (what is still missing is reported when batch `seq` is applied).
/// Returns whether the replay answered.
///
/// For the first batches a router hears (`last_seq` None), the replay may start later than
/// `from`: vLLM keeps only its last batches, and the ones it still has are true facts (what came
/// before them is reported as missed when the first of them is applied).
async fn replay_gap(
    router: &Router,
    src: &VllmSource,
    ingest: &mut VllmIngest,
    from: u64,
    seq: u64,
    last_seq: &mut Option<u64>,
) -> bool {
    let late_start_ok = last_seq.is_none();
    let Some(endpoint) = src.replay_endpoint.as_deref() else { return false };
    let name = source_name(src);
    let timeout = Duration::from_millis(router.config().recovery_timeout_ms.max(1));
    let (mut next, mut first) = (from, None);
    let (answered, why) = match replay_from(endpoint, from, timeout).await {
        Ok(batches) => {
            for (s, payload) in batches {
                if s < next || s >= seq {
                    continue;
                }
                if s > next && late_start_ok && first.is_none() {
                    next = s; // the oldest batch the engine still has
                }
                if s > next {
                    break; // batch `next` is not there: nothing after it may be applied
                }
                match vllm::decode_batch(&payload) {
                    Ok(batch) => router.ingest_vllm_batch(src, ingest, s, &batch, last_seq),
                    Err(e) => {
                        router.vllm_batch_undecodable(&name);
                        tracing::debug!(endpoint = %src.endpoint, "undecodable replayed vLLM batch: {e}");
                        break;
                    }
                }
                first.get_or_insert(s);
                next = s + 1;
            }
            let why = match first {
                Some(f) if f == from && next == seq => None,
                Some(f) if f > from && next == seq => {
                    Some(format!("{endpoint} no longer has batches {from}..{}", f - 1))
                }
                Some(f) => Some(format!("{endpoint} sent batches {f}..{} but not {next}", next - 1)),
                None => Some(format!("{endpoint} did not send batch {from}")),
            };
            (true, why)
        }
        Err(e) => (false, Some(e.to_string())),
    };
    if late_start_ok && first.is_none() {
        ingest.startup_replay_failed = why.clone();
    }
    router.vllm_replayed(&name, why.is_none());
    match why {
        None => tracing::info!(endpoint = %src.endpoint, "replayed vLLM batches {from}..{}", seq - 1),
        Some(w) => tracing::warn!(endpoint = %src.endpoint, "vLLM batches {from}..{} not replayed: {w}", seq - 1),
    }
    answered
}

/// Splits a vLLM multipart message into (topic, seq, payload).
pub fn split_message(m: &ZmqMessage) -> Result<(Bytes, u64, Bytes), RouterError> {
    let (Some(topic), Some(seq), Some(payload)) = (m.get(0), m.get(1), m.get(2)) else {
        return Err(RouterError::Decode(format!("expected 3 frames, got {}", m.len())));
    };
    let seq: [u8; 8] =
        seq.as_ref().try_into().map_err(|_| RouterError::Decode("sequence frame must be 8 bytes".into()))?;
    let seq = u64::from_be_bytes(seq);
    // vLLM numbers batches from 0 as a signed 64-bit value; -1 marks the end of a replay.
    if seq > i64::MAX as u64 {
        return Err(RouterError::Decode(format!("sequence number {seq} out of range")));
    }
    Ok((topic.clone(), seq, payload.clone()))
}

/// Subscribes to one vLLM engine until `stop` flips; reconnects after errors.
pub async fn run_source(router: Arc<Router>, _index: usize, src: VllmSource, stop: tokio::sync::watch::Receiver<bool>) {
    let Some(ns) = router.namespace(&src.namespace).cloned() else {
        tracing::error!(endpoint = %src.endpoint, "vLLM source names an unknown namespace");
        return;
    };
    run_source_in(router, src, ns, stop).await;
}

/// [`run_source`] with the namespace given (sources registered through the indexer API, whose
/// namespaces are not in the config).
///
/// The socket is read on a task of its own that forwards messages through a bounded channel,
/// and a fresh socket is connected whenever that task ends. It ends on an error, on a panic
/// inside the `zeromq` crate (which has `todo!`s on some peer behaviour: a panic must end one
/// connection, not the source), and after `idle_reconnect_s` without a message: that crate's SUB
/// socket neither reconnects nor reports a connection its peer dropped (an engine restarted on
/// the same endpoint would otherwise never be heard from again), and a vLLM engine sends nothing
/// while idle, so silence is the only sign. A batch published while the socket is replaced shows
/// as a sequence gap (replayed, or reported). The ingest state (vLLM hash map, last sequence
/// number) stays here across reconnections.
pub async fn run_source_in(
    router: Arc<Router>,
    src: VllmSource,
    ns: ResolvedNamespace,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut ingest = VllmIngest::new(ns, WorkerId(src.worker.clone()), NodeId(src.node.clone()));
    let mut last_seq = None;
    // After a replay that got no answer, gaps are only reported for a while: every replay
    // holds the ingest up for up to `recovery_timeout_ms`, and a source whose replay socket is
    // gone would otherwise fall further behind with each gap.
    let mut replay_after: Option<Instant> = None;
    let idle = Duration::from_secs_f64(src.idle_reconnect_s.clamp(0.05, crate::config::MAX_IDLE_RECONNECT_S));
    loop {
        let (tx, mut rx) = tokio::sync::mpsc::channel(READ_AHEAD);
        let mut reader = AbortOnDrop(tokio::spawn(read_source(
            src.endpoint.clone(),
            src.topic.clone(),
            src.worker.clone(),
            idle,
            tx,
        )));
        loop {
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = stop.changed() => return,
            };
            // `None`: the reader ended (a connect or receive error, or a panic).
            let Some(msg) = msg else { break };
            let decoded = split_message(&msg).and_then(|(_, seq, payload)| Ok((seq, vllm::decode_batch(&payload)?)));
            match decoded {
                Ok((seq, batch)) => {
                    let missing_from = match last_seq {
                        Some(l) if restarted(l, seq) => (seq > 0).then_some(0),
                        Some(l) if seq > l + 1 => Some(l + 1),
                        Some(_) => None,
                        // The first batch this router hears: the engine may have sent (and cached)
                        // a lot before it subscribed.
                        None => (seq > 0).then_some(0),
                    };
                    if let Some(from) = missing_from
                        && replay_after.is_none_or(|t| Instant::now() >= t)
                    {
                        let replay = replay_gap(&router, &src, &mut ingest, from, seq, &mut last_seq);
                        let answered = tokio::select! {
                            a = replay => a,
                            _ = stop.changed() => return,
                        };
                        replay_after = (!answered).then(|| Instant::now() + REPLAY_BACKOFF);
                    }
                    router.ingest_vllm_batch(&src, &mut ingest, seq, &batch, &mut last_seq);
                }
                Err(e) => {
                    router.vllm_batch_undecodable(&source_name(&src));
                    tracing::debug!(endpoint = %src.endpoint, "undecodable vLLM batch: {e}");
                }
            }
        }
        match (&mut reader.0).await {
            Ok(ReadEnd::Idle) => continue,
            Ok(ReadEnd::Failed) => {}
            Err(e) => {
                if e.is_panic() {
                    tracing::error!(endpoint = %src.endpoint, "vLLM source reader failed inside the ZMQ library; reconnecting");
                    router.vllm_source_failed(&source_name(&src));
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Messages read ahead of the ingest (a replay in progress holds it up).
const READ_AHEAD: usize = 256;

/// How long gaps are only reported after a replay that got no answer.
const REPLAY_BACKOFF: Duration = Duration::from_secs(30);

/// Why a source's reader ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadEnd {
    /// Nothing arrived for the idle interval: reconnect at once.
    Idle,
    /// Connect or receive failed (or the ingest is gone): reconnect after a pause.
    Failed,
}

/// Connects a SUB socket to `endpoint` and forwards what it receives until an error, `idle`
/// without a message, or the receiver is gone.
async fn read_source(
    endpoint: String,
    topic: String,
    worker: String,
    idle: Duration,
    tx: tokio::sync::mpsc::Sender<ZmqMessage>,
) -> ReadEnd {
    let mut sock = zeromq::SubSocket::new();
    let connected = async {
        sock.connect(&endpoint).await?;
        sock.subscribe(&topic).await
    };
    if let Err(e) = connected.await {
        tracing::warn!(endpoint = %endpoint, "vLLM source connect failed: {e}");
        return ReadEnd::Failed;
    }
    tracing::debug!(endpoint = %endpoint, worker = %worker, "subscribed to vLLM KV events");
    loop {
        match tokio::time::timeout(idle, sock.recv()).await {
            Err(_) => return ReadEnd::Idle,
            Ok(Ok(m)) => {
                if tx.send(m).await.is_err() {
                    return ReadEnd::Failed;
                }
            }
            Ok(Err(e)) => {
                tracing::warn!(endpoint = %endpoint, "vLLM source receive failed, reconnecting: {e}");
                return ReadEnd::Failed;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(frames: &[&[u8]]) -> ZmqMessage {
        let mut m = ZmqMessage::from(Bytes::copy_from_slice(frames[0]));
        for f in &frames[1..] {
            m.push_back(Bytes::copy_from_slice(f));
        }
        m
    }

    #[test]
    fn replay_answers_in_both_forms_and_the_end_marker() {
        let seq = 7u64.to_be_bytes();
        let end = (-1i64).to_be_bytes();
        let batch = Some(Some((7, Bytes::from_static(b"p"))));
        assert_eq!(replay_reply(&msg(&[b"", &seq, b"p"])).ok(), batch);
        assert_eq!(replay_reply(&msg(&[b"", b"topic", &seq, b"p"])).ok(), batch);
        assert_eq!(replay_reply(&msg(&[b"", &end, b""])).ok(), Some(None));
        assert_eq!(replay_reply(&msg(&[b"", b"", &end, b""])).ok(), Some(None));
        // No delimiter, a short sequence frame, too few or too many frames: errors, not panics.
        let bad: [&[&[u8]]; 4] =
            [&[b"x", &seq, b"p"], &[b"", b"\x01\x02", b"p"], &[b"", &seq], &[b"", b"", b"", &seq, b"p"]];
        for bad in bad {
            assert!(replay_reply(&msg(bad)).is_err(), "{bad:?}");
        }
    }

    /// An endpoint where nobody answers fails within the timeout instead of hanging the source.
    #[tokio::test]
    async fn replay_from_a_silent_endpoint_times_out() -> std::io::Result<()> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let endpoint = format!("tcp://{}", listener.local_addr()?);
        let t0 = std::time::Instant::now();
        let r = replay_from(&endpoint, 1, Duration::from_millis(300)).await;
        assert!(r.is_err());
        assert!(t0.elapsed() < Duration::from_secs(5));
        Ok(())
    }
}
