//! The prefill/decode split decision: after the router has chosen the decode worker `d`, should
//! the prompt be prefilled on another worker `p` and its KV handed off to `d`?
//!
//! Only the blocks `d` cannot get from any tier move: `move = blocks - prefix(d)`. Then
//!
//! ```text
//! saving(d)     = move * block_ms                          prefill time the split saves d
//! handoff(p, d) = latency(p, d) + move * block_bytes / throughput(p, d)
//! ```
//!
//! where `latency` / `throughput` are the same-node figures (a G2 hand-off through the node's
//! daemon) when `p` and `d` share a node and the cross-node figures otherwise, and `block_ms` is
//! `prefill_ms_per_block` or `tokens_per_block * prefill_ms_per_token`. Among the prefill
//! candidates, `p` is the one whose KV is ready first: lowest `cost(p) * block_ms + handoff(p, d)`
//! (`cost(p)` is the cost model's total for `p`, in blocks of prefill). The request is split when
//! `saving(d) - handoff(p, d) > min_gain_ms`. A short prompt (a handoff's fixed latency exceeds
//! its prefill), a slow link (bytes per token take longer to move than to recompute) or a decode
//! worker that already holds the prefix are not split.

use serde::{Deserialize, Serialize};

use crate::config::SplitConfig;
use crate::cost::{CostBreakdown, TierMatch};

/// The split section of a route answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SplitDecision {
    /// True: prefill on `prefill_worker`, hand the KV off, decode on the route's worker.
    pub split: bool,
    /// Why (or why not).
    pub reason: String,
    /// The best prefill worker (also when not split, for explanation).
    pub prefill_worker: Option<String>,
    pub prefill_address: Option<String>,
    pub prefill_node: Option<String>,
    /// Whether the prefill worker shares the decode worker's node (G2 hand-off, no network).
    pub same_node: bool,
    /// Prompt blocks the decode worker lacks: what the handoff moves.
    pub handoff_blocks: u64,
    pub handoff_bytes: u64,
    /// Estimated handoff time (ms).
    pub handoff_ms: f64,
    /// Prefill time the split saves the decode worker (ms).
    pub prefill_saving_ms: f64,
    /// What the prefill worker already holds of the prompt, per tier.
    pub prefill_cached_blocks: [u32; 4],
    /// The prefill worker's cost (the cost model's terms).
    pub prefill_cost: Option<CostBreakdown>,
}

/// What the decision needs to know about the request and the chosen decode worker.
#[derive(Debug, Clone, Copy)]
pub struct SplitInput<'a> {
    /// Full blocks of the prompt.
    pub blocks: usize,
    /// Prefix blocks the decode worker can get from any tier.
    pub decode_prefix: u32,
    pub decode_node: &'a str,
    pub tokens_per_block: Option<u32>,
    /// KV bytes of one block (from the namespace layout, else `default_block_bytes`).
    pub block_bytes: Option<u64>,
}

/// One worker that could take the prefill.
#[derive(Debug, Clone)]
pub struct PrefillCandidate {
    pub worker: String,
    pub address: String,
    pub node: String,
    pub cached: TierMatch,
    pub cost: CostBreakdown,
}

/// Prefill time of one block (ms), if it can be known.
pub fn block_ms(cfg: &SplitConfig, tokens_per_block: Option<u32>) -> Option<f64> {
    cfg.prefill_ms_per_block.or_else(|| tokens_per_block.map(|t| f64::from(t) * cfg.prefill_ms_per_token))
}

/// Handoff time (ms) of `bytes` between nodes (`same_node` or not).
pub fn handoff_ms(cfg: &SplitConfig, same_node: bool, bytes: u64) -> f64 {
    let (latency, gbps) = if same_node {
        (cfg.same_node_latency_ms, cfg.same_node_gbytes_per_s)
    } else {
        (cfg.cross_node_latency_ms, cfg.cross_node_gbytes_per_s)
    };
    latency + bytes as f64 / (gbps * 1e9) * 1e3
}

/// Decides whether to split, and with which prefill worker.
pub fn decide(cfg: &SplitConfig, input: &SplitInput<'_>, cands: &[PrefillCandidate]) -> SplitDecision {
    let move_blocks = (input.blocks as u64).saturating_sub(u64::from(input.decode_prefix));
    let no = |reason: String| SplitDecision { reason, handoff_blocks: move_blocks, ..SplitDecision::default() };
    if cands.is_empty() {
        return no(format!("no prefill worker (role in {:?}) serves the request", cfg.prefill_roles));
    }
    if move_blocks == 0 {
        return no(format!("the decode worker already holds the whole prefix ({} blocks)", input.blocks));
    }
    let Some(bytes_per_block) = input.block_bytes else {
        return no("KV bytes per block unknown (namespace given by id only; set split.default_block_bytes)".into());
    };
    let Some(bms) = block_ms(cfg, input.tokens_per_block) else {
        return no("block size unknown (set split.prefill_ms_per_block)".into());
    };
    let bytes = move_blocks.saturating_mul(bytes_per_block);
    let saving = move_blocks as f64 * bms;
    let ready = |c: &PrefillCandidate| c.cost.total * bms + handoff_ms(cfg, c.node == input.decode_node, bytes);
    let Some(best) = cands.iter().min_by(|a, b| ready(a).total_cmp(&ready(b))) else {
        return no("no prefill worker".into());
    };
    let same_node = best.node == input.decode_node;
    let handoff = handoff_ms(cfg, same_node, bytes);
    let split = saving - handoff > cfg.min_gain_ms;
    let reason = if split {
        format!(
            "handoff of {move_blocks} blocks ({bytes} bytes, {}) {handoff:.3} ms < prefill saved {saving:.3} ms",
            if same_node { "same node" } else { "cross node" }
        )
    } else {
        format!(
            "handoff of {move_blocks} blocks ({bytes} bytes, {}) {handoff:.3} ms does not pay: prefill saved \
             {saving:.3} ms (min gain {} ms)",
            if same_node { "same node" } else { "cross node" },
            cfg.min_gain_ms
        )
    };
    SplitDecision {
        split,
        reason,
        prefill_worker: Some(best.worker.clone()),
        prefill_address: Some(best.address.clone()),
        prefill_node: Some(best.node.clone()),
        same_node,
        handoff_blocks: move_blocks,
        handoff_bytes: bytes,
        handoff_ms: handoff,
        prefill_saving_ms: saving,
        prefill_cached_blocks: best.cached.blocks,
        prefill_cost: Some(best.cost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(worker: &str, node: &str, total: f64) -> PrefillCandidate {
        PrefillCandidate {
            worker: worker.into(),
            address: format!("http://{worker}"),
            node: node.into(),
            cached: TierMatch::default(),
            cost: CostBreakdown { total, ..CostBreakdown::default() },
        }
    }

    /// 64 blocks of 16 tokens, 2 MiB per block (Llama-3-8B bf16: 128 KiB/token).
    fn input(decode_prefix: u32) -> SplitInput<'static> {
        SplitInput {
            blocks: 64,
            decode_prefix,
            decode_node: "A",
            tokens_per_block: Some(16),
            block_bytes: Some(16 * 128 * 1024),
        }
    }

    #[test]
    fn splits_on_the_same_node_when_the_handoff_is_cheaper_than_the_prefill() {
        let cfg = SplitConfig::default();
        let d = decide(&cfg, &input(0), &[cand("p-remote", "B", 0.0), cand("p-local", "A", 0.0)]);
        assert!(d.split, "{d:?}");
        assert_eq!(d.prefill_worker.as_deref(), Some("p-local"));
        assert!(d.same_node);
        assert_eq!(d.handoff_blocks, 64);
        assert_eq!(d.handoff_bytes, 64 * 16 * 128 * 1024);
        // 64 * 16 tokens * 0.05 ms = 51.2 ms saved; 128 MiB at 20 GB/s + 0.2 ms = 6.9 ms.
        assert!((d.prefill_saving_ms - 51.2).abs() < 1e-9, "{d:?}");
        assert!((d.handoff_ms - (0.2 + 134_217_728.0 / 20e6)).abs() < 1e-9, "{d:?}");
    }

    #[test]
    fn a_slow_link_a_short_prompt_or_a_held_prefix_is_not_split() {
        // Cross node at 1 GB/s: 128 KiB per token takes 0.13 ms to move, 0.05 ms to recompute.
        let cfg = SplitConfig { cross_node_gbytes_per_s: 1.0, ..SplitConfig::default() };
        let d = decide(&cfg, &input(0), &[cand("p", "B", 0.0)]);
        assert!(!d.split && d.reason.contains("does not pay"), "{d:?}");
        assert!(d.handoff_ms > d.prefill_saving_ms);
        // One block: 0.8 ms of prefill saved against a 1 ms cross-node latency, even on a fast link.
        let fast = SplitConfig::default();
        let short = SplitInput { blocks: 1, ..input(0) };
        let d = decide(&fast, &short, &[cand("p", "B", 0.0)]);
        assert!(!d.split, "{d:?}");
        // The decode worker holds the prefix: nothing to save.
        let d = decide(&fast, &input(64), &[cand("p", "A", 0.0)]);
        assert!(!d.split && d.reason.contains("already holds"), "{d:?}");
        assert_eq!(d.prefill_worker, None);
        // No prefill worker; unknown block bytes.
        assert!(!decide(&fast, &input(0), &[]).split);
        let unknown = SplitInput { block_bytes: None, ..input(0) };
        assert!(decide(&fast, &unknown, &[cand("p", "A", 0.0)]).reason.contains("bytes per block unknown"));
        // A minimum gain above the saving stops the split.
        let picky = SplitConfig { min_gain_ms: 100.0, ..SplitConfig::default() };
        assert!(!decide(&picky, &input(0), &[cand("p", "A", 0.0)]).split);
    }

    #[test]
    fn the_prefill_worker_whose_kv_is_ready_first_is_chosen() {
        let cfg = SplitConfig::default();
        // The local worker is busy (cost 200 blocks = 160 ms); the remote one is idle and the
        // cross-node handoff (~27 ms) is cheaper than waiting.
        let d = decide(&cfg, &input(0), &[cand("busy-local", "A", 200.0), cand("idle-remote", "B", 0.0)]);
        assert_eq!(d.prefill_worker.as_deref(), Some("idle-remote"));
        assert!(!d.same_node);
        // Only the blocks the decode worker lacks move, and only they are saved.
        let d = decide(&cfg, &input(48), &[cand("p", "A", 0.0)]);
        assert_eq!(d.handoff_blocks, 16);
        assert!((d.prefill_saving_ms - 12.8).abs() < 1e-9);
        // A per-block time overrides the per-token one.
        let cfg = SplitConfig { prefill_ms_per_block: Some(2.0), ..SplitConfig::default() };
        assert_eq!(block_ms(&cfg, Some(16)), Some(2.0));
        assert_eq!(block_ms(&SplitConfig::default(), None), None);
    }
}
