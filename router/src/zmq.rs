//! ZMQ transport for vLLM-format KV events (pure Rust `zeromq`, no system libzmq).
//!
//! - [`run_source`]: SUB to one vLLM engine, decode, recompute Dynamo hashes from `token_ids`,
//!   and apply as G1 (or, by `medium`, G2-G4) events of the configured worker / node.
//! - [`VllmExporter`] (in `zmq_export`): PUB our events in the same wire format (`medium` = tier),
//!   with a replay socket like vLLM's.
//!
//! A vLLM engine sends no heartbeat, so its worker is never marked stale for silence. A sequence
//! gap is asked for on the engine's replay socket when the source names one
//! ([`replay_from`]); what that cannot fill is reported as unrecovered for `gap_hold_s`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvproto::TierKind;
use kvproto::events::{
    EVENTS_VERSION, EventBody, Holder, KEY_SCHEME_DYNAMO_XXH3_1337, NamespaceInfo, NodeId, PublisherInfo, WorkerId,
    WorkerInfo, key_from_u64,
};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::RouterError;
use crate::config::{ResolvedNamespace, VllmSource};
use crate::health::{ConditionKind, bump};
use crate::router::Router;
use crate::state::{GapState, PublisherKind};
use crate::vllm::{self, VllmBatch, VllmEvent};
pub use crate::zmq_export::VllmExporter;

/// Most vLLM-hash -> Dynamo-hash mappings kept per source (they are removed with their blocks;
/// beyond this the map is reset and counted).
pub const MAX_HASH_MAP: usize = 8 << 20;

/// Translates one engine's vLLM events into our events.
#[derive(Debug)]
pub struct VllmIngest {
    ns: ResolvedNamespace,
    worker: WorkerId,
    node: NodeId,
    /// vLLM block hash digest -> Dynamo sequence hash.
    map: HashMap<u64, u64>,
    pub orphans: u64,
    pub invalid: u64,
    /// Last block size seen that differs from the namespace's.
    pub block_size_mismatch: Option<u32>,
    /// Why the batches before the first one heard could not be replayed (set by a replay that
    /// applied none of them; reported with the first batch applied).
    startup_replay_failed: Option<String>,
}

impl VllmIngest {
    pub fn new(ns: ResolvedNamespace, worker: WorkerId, node: NodeId) -> Self {
        Self {
            ns,
            worker,
            node,
            map: HashMap::new(),
            orphans: 0,
            invalid: 0,
            block_size_mismatch: None,
            startup_replay_failed: None,
        }
    }

    fn holder(&self, tier: TierKind) -> Holder {
        match tier {
            TierKind::G1Gpu => Holder::Worker(self.worker.clone()),
            TierKind::G2Host | TierKind::G3Disk => Holder::Node(self.node.clone()),
            TierKind::G4Object => Holder::Cluster,
        }
    }

    /// Our events for one batch.
    pub fn translate(&mut self, batch: &VllmBatch) -> Vec<EventBody> {
        let seed = kvproto::dynamo::DYNAMO_SEED;
        let mut out = vec![];
        for e in &batch.events {
            match e {
                VllmEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, .. } => {
                    let Some(tier) = vllm::tier_of(medium.as_deref()) else {
                        self.invalid += 1;
                        continue;
                    };
                    if *block_size != self.ns.tokens_per_block() {
                        self.block_size_mismatch = Some(*block_size);
                        continue;
                    }
                    let bs = *block_size as usize;
                    if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                        self.invalid += 1;
                        continue;
                    }
                    let mut parent = match parent_block_hash {
                        None => None,
                        Some(p) => match self.map.get(&p.digest()) {
                            Some(s) => Some(*s),
                            None => {
                                self.orphans += block_hashes.len() as u64;
                                continue;
                            }
                        },
                    };
                    if self.map.len() + block_hashes.len() > MAX_HASH_MAP {
                        self.map.clear();
                        self.invalid += 1;
                    }
                    let mut keys = Vec::with_capacity(block_hashes.len());
                    for (h, block) in block_hashes.iter().zip(token_ids.chunks_exact(bs)) {
                        let s = kvproto::dynamo::chain(parent, kvproto::dynamo::local_block_hash(block, seed), seed);
                        self.map.insert(h.digest(), s);
                        keys.push(key_from_u64(s));
                        parent = Some(s);
                    }
                    out.push(EventBody::Stored {
                        namespace: self.ns.id,
                        parent: None,
                        keys,
                        tier,
                        holder: self.holder(tier),
                    });
                }
                VllmEvent::BlockRemoved { block_hashes, medium } => {
                    let Some(tier) = vllm::tier_of(medium.as_deref()) else {
                        self.invalid += 1;
                        continue;
                    };
                    // A block may be held in several media: keep the mapping unless it left the GPU
                    // (vLLM's primary copy); a stale mapping only costs memory until cleared.
                    let keys: Vec<_> = block_hashes
                        .iter()
                        .filter_map(|h| {
                            if tier == TierKind::G1Gpu {
                                self.map.remove(&h.digest())
                            } else {
                                self.map.get(&h.digest()).copied()
                            }
                        })
                        .map(key_from_u64)
                        .collect();
                    if !keys.is_empty() {
                        out.push(EventBody::Removed { keys, tier, holder: self.holder(tier) });
                    }
                }
                VllmEvent::AllBlocksCleared => {
                    self.map.clear();
                    out.push(EventBody::Cleared { tier: TierKind::G1Gpu, holder: self.holder(TierKind::G1Gpu) });
                }
            }
        }
        out
    }
}

/// The publisher name of a vLLM source.
pub fn source_name(src: &VllmSource) -> String {
    format!("vllm:{}", src.endpoint)
}

/// Most batches one replay may bring (vLLM buffers its last 10,000 by default).
pub const MAX_REPLAY_BATCHES: usize = 100_000;

/// The end-of-replay marker's sequence frame: -1 as a big-endian i64.
pub(crate) const END_SEQ: u64 = u64::MAX;

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
                    Ok(batch) => apply_batch(router, src, ingest, s, &batch, last_seq),
                    Err(e) => {
                        router.with_state(|st| bump(&mut st.counters.invalid_events, name.clone()));
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
    router.with_state(|st| match &why {
        None => {
            bump(&mut st.counters.gaps, name.clone());
            bump(&mut st.counters.recoveries, (name.clone(), "replay"));
        }
        Some(_) => bump(&mut st.counters.recovery_failures, name.clone()),
    });
    match why {
        None => tracing::info!(endpoint = %src.endpoint, "replayed vLLM batches {from}..{}", seq - 1),
        Some(w) => tracing::warn!(endpoint = %src.endpoint, "vLLM batches {from}..{} not replayed: {w}", seq - 1),
    }
    answered
}

/// Counts a gap of vLLM source `name` that nothing will fill and reports it (`unrecovered_gap`
/// with `reason`, held for `gap_hold_s` from now).
fn unrecovered_gap(st: &mut crate::state::State, name: &str, reason: String, now: Instant) {
    bump(&mut st.counters.gaps, name.to_string());
    st.health.set(ConditionKind::UnrecoveredGap, name, reason, now);
    if let Some(p) = st.publishers.get_mut(name) {
        p.gap = GapState::Unrecovered { retry_at: None };
        p.gap_since = Some(now);
    }
}

/// Whether batch `seq` after batch `last` means the engine restarted (its numbers start again
/// from 0). A restart whose numbers have already passed `last` cannot be told from a gap: vLLM's
/// batches carry no epoch.
fn restarted(last: u64, seq: u64) -> bool {
    seq < last || seq == 0 && last > 0
}

/// Applies one decoded batch with sequence number `seq` from `src`.
pub fn apply_batch(
    router: &Router,
    src: &VllmSource,
    ingest: &mut VllmIngest,
    seq: u64,
    batch: &VllmBatch,
    last_seq: &mut Option<u64>,
) {
    let name = source_name(src);
    let bodies = ingest.translate(batch);
    let node = NodeId(src.node.clone());
    let ns = ingest.ns.clone();
    router.with_state(|st| {
        let now = Instant::now();
        st.touch_publisher(&name, PublisherKind::Vllm, 0, Some(&node), None, now);
        if st.publishers.get(&name).is_some_and(|p| p.info.is_none()) {
            let info = PublisherInfo {
                node: node.clone(),
                workers: vec![WorkerInfo {
                    id: WorkerId(src.worker.clone()),
                    address: src.address.clone(),
                    role: src.role.clone(),
                }],
                namespaces: vec![NamespaceInfo {
                    id: ns.id,
                    model_id: ns.namespace.model_id.clone(),
                    tokens_per_block: ns.tokens_per_block(),
                    key_scheme: KEY_SCHEME_DYNAMO_XXH3_1337.into(),
                }],
                events_version: EVENTS_VERSION,
                report_interval_ms: 0,
                recovery_url: None,
            };
            st.apply_info(&name, &info);
            if let Some(p) = st.publishers.get_mut(&name) {
                p.report_interval = None; // no heartbeat
            }
        }
        bump(&mut st.counters.vllm_batches, name.clone());
        match *last_seq {
            Some(last) if restarted(last, seq) => {
                // The engine restarted: what it said before is gone, in every tier it reported.
                st.publisher_restarted(&name);
                if seq > 0 {
                    unrecovered_gap(
                        st,
                        &name,
                        format!("missed vLLM batches 0..{} of the restarted engine", seq - 1),
                        now,
                    );
                }
            }
            Some(last) if seq > last + 1 => {
                let why = match src.replay_endpoint {
                    Some(_) => "replay could not fill them",
                    None => "no replay_endpoint for this source",
                };
                unrecovered_gap(st, &name, format!("missed vLLM batches {}..{} ({why})", last + 1, seq - 1), now);
            }
            // What the engine reported before this router subscribed (a router started after
            // the engine, or restarted) is unknown: its cached blocks are not in the index.
            None if seq > 0 => {
                let why = match (&src.replay_endpoint, ingest.startup_replay_failed.take()) {
                    (None, _) => "no replay_endpoint for this source".to_string(),
                    (Some(_), Some(failed)) => format!("replay failed: {failed}"),
                    (Some(_), None) => "the engine no longer buffers them".to_string(),
                };
                unrecovered_gap(
                    st,
                    &name,
                    format!("missed vLLM batches 0..{}, sent before this router subscribed ({why})", seq - 1),
                    now,
                );
            }
            _ => {}
        }
        *last_seq = Some(seq);
        if let Some(bs) = ingest.block_size_mismatch.take() {
            bump(&mut st.counters.mismatches, ConditionKind::BlockSizeMismatch.label());
            st.health.set(
                ConditionKind::BlockSizeMismatch,
                &src.worker,
                format!(
                    "vLLM engine sends {bs}-token blocks, namespace {} expects {}",
                    src.namespace,
                    ns.tokens_per_block()
                ),
                now,
            );
        }
        for b in &bodies {
            st.apply_body(&name, b);
            bump(&mut st.counters.events, name.clone());
        }
        let orphans = std::mem::take(&mut ingest.orphans);
        if orphans > 0 {
            *st.counters.vllm_orphan_blocks.entry(name.clone()).or_default() += orphans;
        }
        let invalid = std::mem::take(&mut ingest.invalid);
        if invalid > 0 {
            *st.counters.invalid_events.entry(name.clone()).or_default() += invalid;
        }
    });
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
                    apply_batch(&router, &src, &mut ingest, seq, &batch, &mut last_seq);
                }
                Err(e) => {
                    router.with_state(|st| bump(&mut st.counters.invalid_events, source_name(&src)));
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
                    router.with_state(|st| bump(&mut st.counters.vllm_source_failures, source_name(&src)));
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

/// A task aborted when its handle is dropped (a source's reader goes with the source, the
/// export's replay answerer with its server).
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

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
