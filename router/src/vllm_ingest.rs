//! vLLM engines' KV events into the router: [`VllmIngest`] translates one engine's batches into
//! our events (Dynamo XXH3-64 sequence hashes recomputed from `token_ids`; G1, or by `medium`
//! G2-G4, events of the configured worker / node), and the router's ingest methods apply them:
//! sequence gaps, engine restarts, block-size mismatches. No I/O: `zmq.rs` is the socket side.
//!
//! A block computed with a LoRA adapter or under a cache salt (vLLM 0.33's `lora_name` and
//! `extra_keys`) gets the hashes Dynamo 1.6.1 gives it, its local hashes seeded from the
//! adapter's name and the salt ([`kvproto::dynamo::request_seed`]); a chain continued by a later
//! event keeps its request's seed. A block that binds an image or prompt embeddings has no
//! Dynamo hash: it and the rest of its event are not indexed (as a daemon's export leaves them
//! out), rather than indexed under the hash of the same tokens without them.

use std::collections::HashMap;
use std::time::Instant;

use kvproto::TierKind;
use kvproto::events::{
    EVENTS_VERSION, EventBody, Holder, KEY_SCHEME_DYNAMO_XXH3_1337, NamespaceInfo, NodeId, PublisherInfo, WorkerId,
    WorkerInfo, key_from_u64,
};
use kvproto::vllm::{self, VllmBatch, VllmEvent};

use crate::config::{ResolvedNamespace, VllmSource};
use crate::health::{ConditionKind, bump};
use crate::router::Router;
use crate::state::{GapState, PublisherKind};

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
    /// vLLM block hash digest -> the local-hash seed of its request, where it is not Dynamo's
    /// default (an adapter or a salt): a later event continuing the chain keeps it.
    seeds: HashMap<u64, u64>,
    /// Blocks not indexed because they bind an image or prompt embeddings.
    pub unhashable: u64,
    pub orphans: u64,
    pub invalid: u64,
    /// Last block size seen that differs from the namespace's.
    pub block_size_mismatch: Option<u32>,
    /// Why the batches before the first one heard could not be replayed (set by a replay that
    /// applied none of them; reported with the first batch applied).
    pub(crate) startup_replay_failed: Option<String>,
}

impl VllmIngest {
    pub fn new(ns: ResolvedNamespace, worker: WorkerId, node: NodeId) -> Self {
        Self {
            ns,
            worker,
            node,
            map: HashMap::new(),
            seeds: HashMap::new(),
            unhashable: 0,
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
                VllmEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    medium,
                    lora_name,
                    extra_keys,
                    ..
                } => {
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
                        self.seeds.clear();
                        self.invalid += 1;
                    }
                    // The request's local seed: its chain's where it continues one, else from its
                    // adapter (else the namespace's: a publisher registered for one adapter) and
                    // its salt (in block 0's extra keys).
                    let lora = lora_name.as_deref().map(str::as_bytes);
                    let local = match parent_block_hash {
                        Some(p) => self.seeds.get(&p.digest()).copied(),
                        None => None,
                    }
                    .unwrap_or_else(|| {
                        let salt = extra_keys.first().filter(|_| parent_block_hash.is_none());
                        self.ns.dynamo_seed(lora, salt.and_then(|e| e.cache_salt.as_deref()).map(str::as_bytes))
                    });
                    let mut keys = Vec::with_capacity(block_hashes.len());
                    for (i, (h, block)) in block_hashes.iter().zip(token_ids.chunks_exact(bs)).enumerate() {
                        if extra_keys.get(i).is_some_and(|e| e.unhashable) {
                            self.unhashable += (block_hashes.len() - i) as u64;
                            break;
                        }
                        let s = kvproto::dynamo::chain(parent, kvproto::dynamo::local_block_hash(block, local), seed);
                        self.map.insert(h.digest(), s);
                        if local != seed {
                            self.seeds.insert(h.digest(), local);
                        }
                        keys.push(key_from_u64(s));
                        parent = Some(s);
                    }
                    if keys.is_empty() {
                        continue;
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
                                self.seeds.remove(&h.digest());
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
                    self.seeds.clear();
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
pub(crate) fn restarted(last: u64, seq: u64) -> bool {
    seq < last || seq == 0 && last > 0
}

impl Router {
    /// Applies one decoded batch with sequence number `seq` from `src`.
    pub fn ingest_vllm_batch(
        &self,
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
        self.with_state(|st| {
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
                    peer_url: None,
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

    /// A batch from `source` that could not be decoded.
    pub fn vllm_batch_undecodable(&self, source: &str) {
        self.with_state(|st| bump(&mut st.counters.invalid_events, source.to_string()));
    }

    /// `source`'s reader failed inside the ZMQ library (it reconnects).
    pub fn vllm_source_failed(&self, source: &str) {
        self.with_state(|st| bump(&mut st.counters.vllm_source_failures, source.to_string()));
    }

    /// A replay of `source`'s missed batches closed the gap (`recovered`) or did not.
    pub fn vllm_replayed(&self, source: &str, recovered: bool) {
        self.with_state(|st| {
            if recovered {
                bump(&mut st.counters.gaps, source.to_string());
                bump(&mut st.counters.recoveries, (source.to_string(), "replay"));
            } else {
                bump(&mut st.counters.recovery_failures, source.to_string());
            }
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kvproto::dynamo::{DYNAMO_SEED, request_seed, request_sequence_hashes, sequence_hashes};
    use kvproto::vllm::{BlockExtraKeys, ExtHash};

    use super::*;

    fn ingest() -> VllmIngest {
        let spec = kvrouter_core::NamespaceSpec {
            name: Some("vllm".into()),
            model_id: "m".into(),
            num_layers: 2,
            kv_heads: 1,
            head_dim: 8,
            dtype: "bf16".into(),
            tokens_per_block: 4,
            layout_kind: "layer_separate".into(),
            tenant_salt_hex: None,
            adapter_id: None,
            extra_hex: None,
            key_scheme: KEY_SCHEME_DYNAMO_XXH3_1337.into(),
            expected_blocks: 0,
        };
        VllmIngest::new(spec.resolve().unwrap(), WorkerId("w".into()), NodeId("n".into()))
    }

    fn stored(
        first: i128,
        parent: Option<i128>,
        tokens: &[u32],
        lora: Option<&str>,
        extra: Vec<BlockExtraKeys>,
    ) -> VllmEvent {
        VllmEvent::BlockStored {
            block_hashes: (0..tokens.len() as i128 / 4).map(|i| ExtHash::Int(first + i)).collect(),
            parent_block_hash: parent.map(ExtHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: lora.map(str::to_string),
            extra_keys: extra,
        }
    }

    fn keys(out: &[EventBody]) -> Vec<u64> {
        out.iter()
            .flat_map(|e| match e {
                EventBody::Stored { keys, .. } => keys.iter().map(|k| k.low64()).collect(),
                _ => vec![],
            })
            .collect()
    }

    fn batch(events: Vec<VllmEvent>) -> VllmBatch {
        VllmBatch { ts: 0.0, events, dp_rank: None }
    }

    /// A LoRA request's blocks, continued by a later event, and a salted request's: each under
    /// the hashes Dynamo 1.6.1 gives them, never under the base model's.
    #[test]
    fn adapters_and_salts_seed_the_hashes_as_dynamo_does() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut ing = ingest();
        let base = keys(&ing.translate(&batch(vec![stored(100, None, &tokens, None, vec![])])));
        let want = |seed| -> Vec<u64> {
            request_sequence_hashes(&tokens, 4, seed).iter().map(|h| key_from_u64(*h).low64()).collect()
        };
        assert_eq!(base, want(DYNAMO_SEED));
        assert_eq!(
            base,
            sequence_hashes(&tokens, 4, DYNAMO_SEED).iter().map(|h| key_from_u64(*h).low64()).collect::<Vec<_>>()
        );
        let lora_seed = request_seed(Some(b"sql"), None);
        let first = keys(&ing.translate(&batch(vec![stored(200, None, &tokens[..8], Some("sql"), vec![])])));
        let rest = keys(&ing.translate(&batch(vec![stored(202, Some(201), &tokens[8..], Some("sql"), vec![])])));
        assert_eq!([first, rest].concat(), want(lora_seed));
        let salted =
            vec![BlockExtraKeys { cache_salt: Some("tenant-a".into()), unhashable: false }, Default::default()];
        let s = keys(&ing.translate(&batch(vec![stored(300, None, &tokens[..8], None, salted)])));
        assert_eq!(s, want(request_seed(None, Some(b"tenant-a")))[..2]);
        assert_ne!(s[0], base[0]);
    }

    /// Chunks vLLM's native offloading stored below its CPU tier (medium STORAGE: its file tier,
    /// kvcached's tier) are indexed as the node's G3, its CPU tier's as G2.
    #[test]
    fn offloading_tiers_events_are_indexed() {
        let tokens: Vec<u32> = (0..8).collect();
        let mut ing = ingest();
        for (medium, tier) in [("STORAGE", TierKind::G3Disk), ("CPU", TierKind::G2Host)] {
            let mut ev = stored(600, None, &tokens, None, vec![]);
            if let VllmEvent::BlockStored { medium: m, .. } = &mut ev {
                *m = Some(medium.into());
            }
            let out = ing.translate(&batch(vec![ev]));
            assert!(
                matches!(&out[..], [EventBody::Stored { tier: t, keys, .. }] if *t == tier && keys.len() == 2),
                "{medium}: {out:?}"
            );
        }
    }

    /// A block that binds an image is not indexed, nor is the rest of its event.
    #[test]
    fn blocks_binding_images_are_not_indexed() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut ing = ingest();
        let extra = vec![Default::default(), BlockExtraKeys { cache_salt: None, unhashable: true }];
        let k = keys(&ing.translate(&batch(vec![stored(400, None, &tokens, None, extra)])));
        assert_eq!(k.len(), 1);
        assert_eq!(ing.unhashable, 3);
        // A later event continuing after the image block finds no parent: an orphan.
        assert!(ing.translate(&batch(vec![stored(500, Some(401), &tokens[..4], None, vec![])])).is_empty());
        assert_eq!(ing.orphans, 1);
    }
}
