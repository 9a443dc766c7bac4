//! The whole document `kvbench replay --out` writes: the replay's results and, when asked
//! for, the peers' run beside it. It sits above [`crate::replay`] and [`crate::peers`], which
//! both build on the replay's parts (the trace, the cluster, the distributions).

use serde::{Deserialize, Serialize};

use crate::replay::report::{Machine, TraceInfo, tiers_row};
use crate::replay::{ModelResult, ReplayConfig, ReplayResult, SweepPoint, TOKENS_PER_HASH};

/// The whole document `kvbench replay --out` writes (`scripts/plot_replay.py` reads it).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub trace: TraceInfo,
    pub machine: Machine,
    pub config: Option<ReplayConfig>,
    pub replay: Option<ReplayResult>,
    pub model: Option<ModelResult>,
    pub sweep: Vec<SweepPoint>,
    pub peers: Option<crate::peers::PeerReport>,
}

/// The report as Markdown.
pub fn markdown(r: &Report) -> String {
    let mut s = String::new();
    let m = &r.machine;
    s += &format!(
        "trace {} ({} requests, {} blocks of {TOKENS_PER_HASH} tokens, {:.0} s of trace time); {} cores, load average {:?} at start, {:?} at end\n\n",
        r.trace.path, r.trace.requests, r.trace.blocks, r.trace.duration_s, m.cores, m.loadavg_start, m.loadavg_end
    );
    if let (Some(c), Some(x)) = (&r.config, &r.replay) {
        s += &format!(
            "{} daemons x {} engines, G2 {} blocks/node{}{}, blocks of {} KiB, speed {}, concurrency {}, router {}\n\n",
            c.nodes,
            c.engines_per_node,
            c.g2_blocks,
            if c.g3_blocks > 0 { format!(", G3 {} blocks/node", c.g3_blocks) } else { String::new() },
            if c.g4 { ", G4 (SeaweedFS)" } else { "" },
            x.block_bytes >> 10,
            if c.speed > 0.0 { format!("{}x", c.speed) } else { "as fast as possible".into() },
            c.concurrency,
            if x.router_process { "process" } else { "in process" },
        );
        s += "| hit rate | G2 | G3 | G4 | peer | total |\n|---|---|---|---|---|---|\n";
        s += &format!("| replay (blocks loaded) | {} |\n", tiers_row(&x.hit_rate));
        if let Some(md) = &r.model {
            s += &format!(
                "| model (`kvrouter::sim`, {} workers x {} blocks) | | | | | **{:.4}** |\n| pooled LRU / infinite cache | | | | | {:.4} / {:.4} |\n",
                md.workers, md.capacity_blocks, md.kv_aware_hit_rate, md.pooled_hit_rate, md.infinite_hit_rate
            );
        }
        let t = &x.saved_prefill_tokens;
        s += &format!(
            "\nsaved prefill tokens: {:.0} (G2 {:.0}, G3 {:.0}, G4 {:.0}, peer {:.0}); prefilled {}; lookups found {:.4} of the blocks\n\n",
            t.total, t.g2, t.g3, t.g4, t.peer, x.prefill_tokens, x.lookup_hit_rate
        );
        s += "| latency (us) | n | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|\n";
        for (name, d) in [
            ("route (POST /route)", &x.latency.route),
            ("lookup", &x.latency.lookup),
            ("load", &x.latency.load),
            ("save", &x.latency.save),
        ] {
            s += &format!(
                "| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
                d.n, d.p50_us, d.p90_us, d.p99_us, d.max_us
            );
        }
        let th = &x.throughput;
        s += &format!(
            "\nthroughput: save {:.2} GB/s, load {:.2} GB/s (inside the calls); {:.2} GB/s and {:.0} requests/s over {:.1} s of wall time\n\n",
            th.save_gbs, th.load_gbs, th.aggregate_gbs, th.requests_per_s, x.wall_s
        );
        let p = &x.placement;
        s += &format!(
            "placement: predicted = found {} / over {} / under {} (mean |error| {:.2} blocks; router's own counters: {:.0} outcomes, {:.0} blocks of error); a shorter prefix than the best candidate's {} times ({} blocks forgone); requests per worker {:?}\n\n",
            p.exact,
            p.over,
            p.under,
            p.mean_abs_error_blocks,
            p.router_outcomes,
            p.router_abs_error_blocks,
            p.shorter_than_best,
            p.forgone_blocks,
            p.per_worker
        );
        s += &format!(
            "checked {} loaded blocks byte for byte: {} mismatches; {} failed requests {:?}\n",
            x.blocks_checked, x.mismatches, x.errors, x.first_errors
        );
    }
    if !r.sweep.is_empty() {
        s += "\n| G2 blocks / node | replay G2 | G3 | G4 | replay total | model | pooled | infinite |\n|---|---|---|---|---|---|---|---|\n";
        for p in &r.sweep {
            s += &format!(
                "| {} | {:.4} | {:.4} | {:.4} | **{:.4}** | {:.4} | {:.4} | {:.4} |\n",
                p.g2_blocks,
                p.replay_hit_rate.g2,
                p.replay_hit_rate.g3,
                p.replay_hit_rate.g4,
                p.replay_hit_rate.total,
                p.model_hit_rate,
                p.pooled_hit_rate,
                p.infinite_hit_rate
            );
        }
    }
    if let Some(p) = &r.peers {
        s += "\n";
        s += &crate::peers::markdown(p);
    }
    s
}
