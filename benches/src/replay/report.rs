//! What a replay measured, aggregated: hit rate per tier (over the run, and per window of
//! requests over trace time), saved prefill tokens, latency percentiles and CDFs of route /
//! lookup / load / save, throughput, placement quality (the router's prediction against what the
//! engine found), byte-exact checks, the daemons' tier statistics; the model beside it; the JSON
//! document `kvbench replay` writes, and its Markdown summary.

use serde::{Deserialize, Serialize};

use super::drive::{Driven, Outcome};
use super::{ReplayConfig, TOKENS_PER_HASH};

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

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TraceInfo {
    pub path: String,
    pub requests: usize,
    pub blocks: u64,
    /// Trace time covered (s).
    pub duration_s: f64,
}

/// The conditions of the run: other work on a 2-core machine moves every figure.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    pub cores: usize,
    /// `/proc/loadavg` (1, 5, 15 min) when the run started and when it ended.
    pub loadavg_start: Option<[f64; 3]>,
    pub loadavg_end: Option<[f64; 3]>,
    pub kvbench_version: String,
    /// Seconds since the Unix epoch at the start.
    pub started_unix_s: u64,
}

/// Blocks (or rates) per tier a hit came from.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Tiers {
    pub g2: f64,
    pub g3: f64,
    pub g4: f64,
    /// Pulled from another daemon.
    pub peer: f64,
    pub total: f64,
}

/// A latency distribution in microseconds, with its CDF (201 evenly spaced quantiles).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Dist {
    pub n: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// `[quantile, microseconds]` pairs.
    pub cdf: Vec<[f64; 2]>,
}

impl Dist {
    pub fn of(mut v: Vec<f64>) -> Self {
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Self {
            n: v.len(),
            mean_us: v.iter().sum::<f64>() / v.len() as f64,
            p50_us: at(0.5),
            p90_us: at(0.9),
            p99_us: at(0.99),
            max_us: at(1.0),
            cdf: (0..=200).map(|i| f64::from(i) / 200.0).map(|q| [q, at(q)]).collect(),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Latencies {
    pub route: Dist,
    pub lookup: Dist,
    /// Requests with a hit: load into the engine's slots, to completion.
    pub load: Dist,
    /// Requests with blocks to save.
    pub save: Dist,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Throughput {
    pub saved_bytes: u64,
    pub loaded_bytes: u64,
    /// Bytes over the time spent inside save (load) calls.
    pub save_gbs: f64,
    pub load_gbs: f64,
    /// Saved plus loaded bytes over the replay's wall time.
    pub aggregate_gbs: f64,
    pub requests_per_s: f64,
}

/// The router's placements against what the engines found.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Placement {
    /// Requests whose predicted cached prefix (all tiers) equals the one found.
    pub exact: u64,
    /// Predicted more than found (the index still held blocks the node had lost).
    pub over: u64,
    /// Predicted less than found (blocks the router had not heard of yet).
    pub under: u64,
    pub predicted_blocks: u64,
    pub found_blocks: u64,
    pub mean_abs_error_blocks: f64,
    /// Requests placed on a worker holding a shorter prefix than another candidate (in the
    /// router's view): the load terms outweighed the prefix.
    pub shorter_than_best: u64,
    /// Blocks those placements gave up.
    pub forgone_blocks: u64,
    /// Requests per worker.
    pub per_worker: Vec<u64>,
    /// The router's own counters (`/metrics`): outcomes received, and the predicted-vs-actual
    /// error it computed from them.
    pub router_outcomes: f64,
    pub router_abs_error_blocks: f64,
    pub router_prediction_samples: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TierStat {
    pub tier: String,
    pub blocks: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub checksum_failures: u64,
}

/// One daemon's own statistics at the end of the replay.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NodeStats {
    pub name: String,
    pub block_bytes: u64,
    pub tiers: Vec<TierStat>,
    pub writethrough_dropped: u64,
}

/// Hit rates of one window of consecutive requests.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Window {
    /// Requests `[first, end)` of the trace.
    pub first: usize,
    pub end: usize,
    /// Trace time of the window's last request (s from the first).
    pub trace_s: f64,
    pub hit_rate: Tiers,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ReplayResult {
    pub requests: usize,
    pub blocks: u64,
    pub block_bytes: u64,
    pub wall_s: f64,
    pub router_process: bool,
    /// Prefix blocks loaded into engines / blocks requested, by the tier they came from.
    pub hit_rate: Tiers,
    /// Prefix blocks the lookups found (a load can find fewer: evicted in between).
    pub lookup_hit_rate: f64,
    /// Prompt tokens not prefilled because their KV was loaded, by tier.
    pub saved_prefill_tokens: Tiers,
    pub prefill_tokens: u64,
    pub latency: Latencies,
    pub throughput: Throughput,
    pub placement: Placement,
    pub blocks_checked: u64,
    pub mismatches: u64,
    pub errors: u64,
    pub first_errors: Vec<String>,
    pub series: Vec<Window>,
    pub nodes: Vec<NodeStats>,
}

/// The simulation (`kvrouter::sim`) on the same trace and capacity.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ModelResult {
    pub workers: usize,
    pub capacity_blocks: u64,
    pub kv_aware_hit_rate: f64,
    pub pooled_hit_rate: f64,
    pub infinite_hit_rate: f64,
    pub per_worker: Vec<u64>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SweepPoint {
    pub g2_blocks: u64,
    pub replay_hit_rate: Tiers,
    pub model_hit_rate: f64,
    pub pooled_hit_rate: f64,
    pub infinite_hit_rate: f64,
    pub errors: u64,
}

fn hit_tiers(o: &Outcome) -> [u64; 4] {
    [o.from[0], o.from[1], o.from[2], o.from[3]].map(u64::from)
}

fn rates(hit: [u64; 4], blocks: u64) -> Tiers {
    let r = |x: u64| if blocks == 0 { 0.0 } else { x as f64 / blocks as f64 };
    Tiers { g2: r(hit[0]), g3: r(hit[1]), g4: r(hit[2]), peer: r(hit[3]), total: r(hit.iter().sum()) }
}

/// Sum of every sample of `series` (a metric name, with or without labels) in Prometheus text.
fn metric_sum(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(series).is_some_and(|r| r.starts_with(' ') || r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        // An empty sum of floats is -0.0.
        .fold(0.0, |a, x| a + x)
}

/// Aggregates a replay's outcomes.
pub fn aggregate(
    cfg: &ReplayConfig,
    trace: &[kvrouter::sim::TraceRequest],
    d: &Driven,
    nodes: Vec<NodeStats>,
    router_metrics: String,
) -> ReplayResult {
    let block = cfg.block_bytes();
    let done: Vec<&Outcome> = d.outcomes.iter().filter(|o| o.error.is_none()).collect();
    let blocks: u64 = done.iter().map(|o| u64::from(o.blocks)).sum();
    let mut hit = [0u64; 4];
    for o in &done {
        for (h, x) in hit.iter_mut().zip(hit_tiers(o)) {
            *h += x;
        }
    }
    let matched: u64 = done.iter().map(|o| u64::from(o.matched.min(o.blocks))).sum();
    let tokens = |x: u64| (x * u64::from(TOKENS_PER_HASH)) as f64;
    let saved_tokens = Tiers {
        g2: tokens(hit[0]),
        g3: tokens(hit[1]),
        g4: tokens(hit[2]),
        peer: tokens(hit[3]),
        total: tokens(hit.iter().sum()),
    };
    let lat = |f: &dyn Fn(&Outcome) -> Option<f64>| Dist::of(done.iter().filter_map(|o| f(o)).collect());
    let latency = Latencies {
        route: lat(&|o| Some(o.route_us)),
        lookup: lat(&|o| Some(o.lookup_us)),
        load: lat(&|o| o.load_us),
        save: lat(&|o| o.save_us),
    };
    let loaded: u64 = done.iter().map(|o| u64::from(o.loaded)).sum();
    let stored: u64 = done.iter().map(|o| u64::from(o.stored)).sum();
    let (load_s, save_s) = (
        done.iter().filter_map(|o| o.load_us).sum::<f64>() / 1e6,
        done.iter().filter_map(|o| o.save_us).sum::<f64>() / 1e6,
    );
    let gbs = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
    let throughput = Throughput {
        saved_bytes: stored * block,
        loaded_bytes: loaded * block,
        save_gbs: gbs(stored * block, save_s),
        load_gbs: gbs(loaded * block, load_s),
        aggregate_gbs: gbs((stored + loaded) * block, d.wall_s),
        requests_per_s: if d.wall_s > 0.0 { done.len() as f64 / d.wall_s } else { 0.0 },
    };
    let mut p = Placement { per_worker: vec![0; cfg.nodes * cfg.engines_per_node], ..Placement::default() };
    let mut abs_err = 0u64;
    for o in &done {
        let predicted: u32 = o.predicted.iter().sum();
        let found = o.matched.min(o.blocks);
        match predicted.cmp(&found) {
            std::cmp::Ordering::Equal => p.exact += 1,
            std::cmp::Ordering::Greater => p.over += 1,
            std::cmp::Ordering::Less => p.under += 1,
        }
        abs_err += u64::from(predicted.abs_diff(found));
        p.predicted_blocks += u64::from(predicted);
        p.found_blocks += u64::from(found);
        if o.best_candidate > predicted {
            p.shorter_than_best += 1;
            p.forgone_blocks += u64::from(o.best_candidate - predicted);
        }
        if let Some(w) = p.per_worker.get_mut(o.worker) {
            *w += 1;
        }
    }
    p.mean_abs_error_blocks = if done.is_empty() { 0.0 } else { abs_err as f64 / done.len() as f64 };
    p.router_outcomes = metric_sum(&router_metrics, "kvrouter_outcomes_total");
    p.router_abs_error_blocks = metric_sum(&router_metrics, "kvrouter_prediction_abs_error_blocks_total");
    p.router_prediction_samples = metric_sum(&router_metrics, "kvrouter_prediction_samples_total");

    // Windows of consecutive requests over the trace (about 100).
    let first_ts = trace.first().map_or(0, |r| r.timestamp);
    let per = d.outcomes.len().div_ceil(100).max(1);
    let series = d
        .outcomes
        .chunks(per)
        .map(|w| {
            let ok = w.iter().filter(|o| o.error.is_none());
            let (mut h, mut b) = ([0u64; 4], 0u64);
            for o in ok {
                b += u64::from(o.blocks);
                for (a, x) in h.iter_mut().zip(hit_tiers(o)) {
                    *a += x;
                }
            }
            let last = w.last().map_or(0, |o| o.ts_ms);
            Window {
                first: w.first().map_or(0, |o| o.idx),
                end: w.last().map_or(0, |o| o.idx + 1),
                trace_s: last.saturating_sub(first_ts) as f64 / 1e3,
                hit_rate: rates(h, b),
            }
        })
        .collect();
    ReplayResult {
        requests: d.outcomes.len(),
        blocks,
        block_bytes: block,
        wall_s: d.wall_s,
        router_process: d.router_process,
        hit_rate: rates(hit, blocks),
        lookup_hit_rate: if blocks == 0 { 0.0 } else { matched as f64 / blocks as f64 },
        saved_prefill_tokens: saved_tokens,
        prefill_tokens: (blocks - hit.iter().sum::<u64>()) * u64::from(TOKENS_PER_HASH),
        latency,
        throughput,
        placement: p,
        blocks_checked: d.outcomes.iter().map(|o| u64::from(o.checked)).sum(),
        mismatches: d.outcomes.iter().map(|o| u64::from(o.mismatches)).sum(),
        errors: d.outcomes.iter().filter(|o| o.error.is_some() || o.mismatches > 0).count() as u64,
        first_errors: d.outcomes.iter().filter_map(|o| o.error.clone()).take(5).collect(),
        series,
        nodes,
    }
}

fn tiers_row(t: &Tiers) -> String {
    format!("{:.4} | {:.4} | {:.4} | {:.4} | **{:.4}**", t.g2, t.g3, t.g4, t.peer, t.total)
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
