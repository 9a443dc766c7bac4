//! What a replay measured, aggregated: hit rate per tier (over the run, and per window of
//! requests over trace time), saved prefill tokens, latency percentiles and CDFs of route /
//! lookup / load / save, throughput, placement quality (the router's prediction against what the
//! engine found), byte-exact checks, the daemons' tier statistics; the model beside it; the JSON
//! document `kvbench replay` writes, and its Markdown summary.

use serde::{Deserialize, Serialize};

use super::drive::{Driven, Outcome};
use super::{ReplayConfig, TOKENS_PER_HASH};

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
pub(crate) fn metric_sum(text: &str, series: &str) -> f64 {
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

pub(crate) fn tiers_row(t: &Tiers) -> String {
    format!("{:.4} | {:.4} | {:.4} | {:.4} | **{:.4}**", t.g2, t.g3, t.g4, t.peer, t.total)
}
