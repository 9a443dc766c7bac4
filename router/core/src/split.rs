//! The prefill/decode split decision: after the router has chosen the decode worker `d`, should
//! the prompt be prefilled on another worker `p` and its KV handed off to `d`?
//!
//! Only the blocks `d` cannot get from any tier move: `move = blocks - prefix(d)`. Then
//!
//! ```text
//! saving(d)     = move * block_ms(d)                          prefill time the split removes from d
//! queue(p)      = (cost(p) - prefill_term(p)) * block_ms(p)   what p is busy with first
//! handoff(p, d) = latency(p, d) + move * block_bytes / throughput(p, d)
//! split  <=>  queue(p) + handoff(p, d) < saving(d) - min_gain_ms
//! ```
//!
//! `throughput(p, d)` is the link rate `d`'s daemon measured pulling from `p`'s node (real
//! transfers and idle probes, reported in its hit reports); until one is measured, the
//! configured `cross_node_gbytes_per_s` (and `same_node_gbytes_per_s` for a G2 hand-off when `p`
//! and `d` share a node). `block_ms(w)` is `tokens_per_block * 1000 / rate(w)` where `rate(w)` is
//! the prefill rate engine `w` reports (tokens a second); until it reports one,
//! `prefill_ms_per_block` or `tokens_per_block * prefill_ms_per_token`. Among the prefill
//! candidates, `p` is the one whose KV is ready first: lowest `queue(p) + prefill(p) +
//! handoff(p, d)`. A short prompt (a handoff's fixed latency exceeds its prefill), a slow link
//! (bytes per token take longer to move than to recompute), a busy prefill pool or a decode
//! worker that already holds the prefix are not split. docs/router.md section 7 has the table
//! of decisions against prompt length and link rate (`kvrouter split-table` prints it).

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
    /// Time the prefill worker is busy before it starts this prefill (ms).
    #[serde(default)]
    pub prefill_queue_ms: f64,
    /// The link rate the handoff estimate used (GB/s) and whether it was measured (else the
    /// configured figure).
    #[serde(default)]
    pub link_gbytes_per_s: f64,
    #[serde(default)]
    pub link_measured: bool,
    /// Where the decode node's daemon pulls the handed-off blocks from: the prefill node's peer
    /// channel (`host:port`), passed by the engine as a load's `sources`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_peer: Option<String>,
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
    /// The decode worker's measured prefill rate (tokens a second), if it reported one.
    pub decode_prefill_tokens_per_s: Option<f64>,
}

/// One worker that could take the prefill.
#[derive(Debug, Clone)]
pub struct PrefillCandidate {
    pub worker: String,
    pub address: String,
    pub node: String,
    pub cached: TierMatch,
    pub cost: CostBreakdown,
    /// Its measured prefill rate (tokens a second), if it reported one.
    pub prefill_tokens_per_s: Option<f64>,
    /// The measured rate of the link from its node to the decode worker's (bytes a second).
    pub link_bytes_per_s: Option<f64>,
    /// Its node's peer channel, if the node's daemon serves one.
    pub peer: Option<String>,
}

/// Prefill time of one block (ms), if it can be known: from a measured rate, else configured.
pub fn block_ms(cfg: &SplitConfig, tokens_per_block: Option<u32>) -> Option<f64> {
    cfg.prefill_ms_per_block.or_else(|| tokens_per_block.map(|t| f64::from(t) * cfg.prefill_ms_per_token))
}

/// [`block_ms`] of a worker that reported `rate` tokens a second.
pub fn worker_block_ms(cfg: &SplitConfig, tokens_per_block: Option<u32>, rate: Option<f64>) -> Option<f64> {
    match (rate.filter(|r| *r > 0.0 && r.is_finite()), tokens_per_block) {
        (Some(r), Some(t)) => Some(f64::from(t) * 1000.0 / r),
        _ => block_ms(cfg, tokens_per_block),
    }
}

/// The link rate (GB/s) a handoff uses, and whether it was measured.
pub fn link_gbps(cfg: &SplitConfig, same_node: bool, measured: Option<f64>) -> (f64, bool) {
    if same_node {
        return (cfg.same_node_gbytes_per_s, false);
    }
    match measured.filter(|b| *b > 0.0 && b.is_finite()) {
        Some(b) => (b / 1e9, true),
        None => (cfg.cross_node_gbytes_per_s, false),
    }
}

/// Handoff time (ms) of `bytes` over a link of `gbps` GB/s.
pub fn handoff_ms(cfg: &SplitConfig, same_node: bool, gbps: f64, bytes: u64) -> f64 {
    let latency = if same_node { cfg.same_node_latency_ms } else { cfg.cross_node_latency_ms };
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
    let Some(decode_bms) = worker_block_ms(cfg, input.tokens_per_block, input.decode_prefill_tokens_per_s) else {
        return no("block size unknown (set split.prefill_ms_per_block)".into());
    };
    let bytes = move_blocks.saturating_mul(bytes_per_block);
    let saving = move_blocks as f64 * decode_bms;
    // Per candidate: (queue, its own prefill, handoff, link GB/s, measured).
    let terms = |c: &PrefillCandidate| {
        let bms = worker_block_ms(cfg, input.tokens_per_block, c.prefill_tokens_per_s).unwrap_or(decode_bms);
        let queue = (c.cost.total - c.cost.prefill_term).max(0.0) * bms;
        let prefill = c.cost.prefill_term.max(0.0) * bms;
        let same = c.node == input.decode_node;
        let (gbps, measured) = link_gbps(cfg, same, c.link_bytes_per_s);
        (queue, prefill, handoff_ms(cfg, same, gbps, bytes), gbps, measured)
    };
    let ready = |c: &PrefillCandidate| {
        let (q, p, h, _, _) = terms(c);
        q + p + h
    };
    let Some(best) = cands.iter().min_by(|a, b| ready(a).total_cmp(&ready(b))) else {
        return no("no prefill worker".into());
    };
    let same_node = best.node == input.decode_node;
    let (queue, _, handoff, gbps, measured) = terms(best);
    let split = queue + handoff < saving - cfg.min_gain_ms;
    let link = format!(
        "{}, {gbps:.2} GB/s {}",
        if same_node { "same node" } else { "cross node" },
        if measured { "measured" } else { "configured" }
    );
    let reason = if split {
        format!(
            "handoff of {move_blocks} blocks ({bytes} bytes, {link}) {handoff:.3} ms + queue {queue:.3} ms < prefill \
             saved {saving:.3} ms"
        )
    } else {
        format!(
            "handoff of {move_blocks} blocks ({bytes} bytes, {link}) {handoff:.3} ms + queue {queue:.3} ms does not \
             pay: prefill saved {saving:.3} ms (min gain {} ms)",
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
        prefill_queue_ms: queue,
        link_gbytes_per_s: gbps,
        link_measured: measured,
        prefill_peer: best.peer.clone(),
    }
}

/// One cell of the decision table: a prompt of `tokens` handed off over a link of `gbit` Gbit/s
/// to an idle decode worker holding none of it, from an idle prefill worker on another node.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TableCell {
    pub tokens: u32,
    pub gbit: f64,
    pub split: bool,
    pub handoff_ms: f64,
    pub saving_ms: f64,
}

/// The decisions [`decide`] makes for each prompt length and link rate, with KV of
/// `bytes_per_token` bytes, `tokens_per_block`-token blocks and engines prefilling
/// `prefill_tokens_per_s` tokens a second (measured rates, as reported).
pub fn decision_table(
    cfg: &SplitConfig,
    bytes_per_token: u64,
    tokens_per_block: u32,
    prefill_tokens_per_s: f64,
    prompts: &[u32],
    links_gbit: &[f64],
) -> Vec<TableCell> {
    let mut out = Vec::new();
    for &tokens in prompts {
        for &gbit in links_gbit {
            let input = SplitInput {
                blocks: (tokens / tokens_per_block.max(1)) as usize,
                decode_prefix: 0,
                decode_node: "decode-node",
                tokens_per_block: Some(tokens_per_block),
                block_bytes: Some(bytes_per_token * u64::from(tokens_per_block)),
                decode_prefill_tokens_per_s: Some(prefill_tokens_per_s),
            };
            let cand = PrefillCandidate {
                worker: "prefill".into(),
                address: String::new(),
                node: "prefill-node".into(),
                cached: TierMatch::default(),
                cost: CostBreakdown::default(),
                prefill_tokens_per_s: Some(prefill_tokens_per_s),
                link_bytes_per_s: Some(gbit * 1e9 / 8.0),
                peer: None,
            };
            let d = decide(cfg, &input, &[cand]);
            out.push(TableCell {
                tokens,
                gbit,
                split: d.split,
                handoff_ms: d.handoff_ms,
                saving_ms: d.prefill_saving_ms,
            });
        }
    }
    out
}

/// [`decision_table`] as Markdown: one row per prompt length, one column per link rate.
pub fn table_markdown(cells: &[TableCell], links_gbit: &[f64]) -> String {
    let mut out = String::from("| prompt tokens |");
    for g in links_gbit {
        out += &format!(" {g} Gbit/s |");
    }
    out += "\n|---|";
    out += &"---|".repeat(links_gbit.len());
    out += "\n";
    let mut tokens: Vec<u32> = cells.iter().map(|c| c.tokens).collect();
    tokens.dedup();
    for t in tokens {
        out += &format!("| {t} |");
        for c in cells.iter().filter(|c| c.tokens == t) {
            out += &format!(
                " {} ({:.1} vs {:.1} ms) |",
                if c.split { "split" } else { "local" },
                c.handoff_ms,
                c.saving_ms
            );
        }
        out += "\n";
    }
    out
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
            prefill_tokens_per_s: None,
            link_bytes_per_s: None,
            peer: Some(format!("{node}:7471")),
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
            decode_prefill_tokens_per_s: None,
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

    #[test]
    fn measured_rates_replace_the_configured_ones_and_queueing_counts() {
        let cfg = SplitConfig::default();
        // 1 KiB of KV per token, 16-token blocks, engines at 100k tokens/s (0.01 ms/token):
        // handoff 1 ms + n * 1024 B / link; saving n * 0.01 ms.
        let cells = decision_table(&cfg, 1024, 16, 100_000.0, &[256, 1024], &[1.0, 10.0]);
        let at =
            |t: u32, g: f64| cells.iter().find(|c| c.tokens == t && c.gbit == g).copied().expect("a cell of the table");
        // 256 tokens: 1 Gbit/s moves them in 1 + 2.10 ms against 2.56 ms saved (local); 10
        // Gbit/s in 1 + 0.21 ms (split).
        assert!(!at(256, 1.0).split && at(256, 10.0).split, "{cells:?}");
        assert!((at(256, 1.0).handoff_ms - (1.0 + 256.0 * 1024.0 / 125e6 * 1e3)).abs() < 1e-9);
        assert!((at(256, 1.0).saving_ms - 2.56).abs() < 1e-9);
        // 1024 tokens pay even at 1 Gbit/s (9.4 ms against 10.24 ms).
        assert!(at(1024, 1.0).split);
        // A busy prefill worker's queue is part of the handoff's cost.
        let input = SplitInput {
            blocks: 16,
            decode_prefix: 0,
            decode_node: "A",
            tokens_per_block: Some(16),
            block_bytes: Some(16 * 1024),
            decode_prefill_tokens_per_s: Some(100_000.0),
        };
        let mut busy = cand("p", "B", 40.0);
        busy.link_bytes_per_s = Some(1.25e9);
        busy.prefill_tokens_per_s = Some(100_000.0);
        let d = decide(&cfg, &input, &[busy.clone()]);
        assert!(!d.split, "{d:?}");
        assert!((d.prefill_queue_ms - 40.0 * 0.16).abs() < 1e-9, "{d:?}");
        assert!(d.link_measured && (d.link_gbytes_per_s - 1.25).abs() < 1e-12);
        assert_eq!(d.prefill_peer.as_deref(), Some("B:7471"));
        busy.cost.total = 0.0;
        assert!(decide(&cfg, &input, &[busy]).split);
    }
}
