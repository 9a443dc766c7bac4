//! The figures of a `kvbench bus` run and their Markdown.

use super::BusArgs;

/// Latency quantiles in milliseconds.
#[derive(Debug, Default, Clone)]
pub struct Quantiles {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// Samples that never completed (probes not seen within 10 s, failed sends).
    pub missing: usize,
}

pub(super) fn quantiles(mut ms: Vec<f64>, missing: usize) -> Quantiles {
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms.get(((ms.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(f64::NAN);
    Quantiles { n: ms.len(), p50: at(0.5), p99: at(0.99), max: ms.last().copied().unwrap_or(f64::NAN), missing }
}

/// One transport's figures.
#[derive(Debug, Default, Clone)]
pub struct TransportReport {
    pub name: String,
    /// Backlog keys per second applied by the slowest replica (from its start, or the first POST).
    pub backlog_keys_per_s: f64,
    /// NATS only: an ordered consumer alone reading the backlog (keys of it a second).
    pub drain_keys_per_s: Option<f64>,
    /// Offered block events a second during the load phase, and those the replicas applied.
    pub offered_keys_per_s: f64,
    pub lag: Quantiles,
    pub send: Quantiles,
    /// Router CPU seconds per million block events applied, each replica.
    pub cpu_s_per_m: Vec<f64>,
    /// Every replica applied every event published.
    pub complete: bool,
    pub bytes_per_block: f64,
}

/// The whole run.
#[derive(Debug, Default, Clone)]
pub struct BusReport {
    pub publishers: usize,
    pub backlog_keys: u64,
    pub index_keys_per_s: f64,
    pub router_keys_per_s: f64,
    /// Its parts: JSON decoding alone, ingest of decoded messages alone.
    pub decode_keys_per_s: f64,
    pub ingest_keys_per_s: f64,
    /// The same with reports in binary (`kvnet::bus_codec`): decode plus ingest, decode alone.
    pub router_bin_keys_per_s: f64,
    pub decode_bin_keys_per_s: f64,
    pub index_bytes_per_block: f64,
    pub transports: Vec<TransportReport>,
}

/// The report as Markdown.
pub fn markdown(r: &BusReport, args: &BusArgs) -> String {
    let mut s = format!(
        "{} publishers x {} block events/s (chains of {}, {} blocks held each), {} replicas, {} s per transport; \
         backlog {} keys ({} s of every publisher); reports on NATS in {}\n\n",
        r.publishers,
        args.events_per_s,
        args.chain,
        args.capacity,
        args.replicas,
        args.seconds,
        r.backlog_keys,
        args.backlog_s,
        args.nats_encoding,
    );
    s += "| ingest of the backlog | M keys/s | / index |\n|---|---|---|\n";
    let row = |label: String, keys_per_s: f64| {
        format!("| {label} | {:.2} | {:.2}x |\n", keys_per_s / 1e6, keys_per_s / r.index_keys_per_s)
    };
    s += &row("index in process (kvrouter-core store/remove)".into(), r.index_keys_per_s);
    s += &row("router in process (JSON decode + ingest)".into(), r.router_keys_per_s);
    s += &row("- of it, JSON decode alone".into(), r.decode_keys_per_s);
    s += &row("- of it, ingest of decoded messages alone".into(), r.ingest_keys_per_s);
    s += &row("router in process (binary decode + ingest)".into(), r.router_bin_keys_per_s);
    s += &row("- of it, binary decode alone".into(), r.decode_bin_keys_per_s);
    for t in &r.transports {
        if let Some(d) = t.drain_keys_per_s {
            s += &row(format!("an ordered consumer alone, reading ({})", t.name), d);
        }
        s += &row(format!("{} replicas, slowest ({})", args.replicas, t.name), t.backlog_keys_per_s);
    }
    s += "\n| at the offered load | keys/s offered | lag p50 / p99 / max ms (n, missing) | send p50 / p99 ms | router CPU s per M events | all applied | index bytes / block |\n|---|---|---|---|---|---|---|\n";
    for t in &r.transports {
        let cpu: Vec<String> = t.cpu_s_per_m.iter().map(|c| format!("{c:.3}")).collect();
        s += &format!(
            "| {} | {:.0} | {:.1} / {:.1} / {:.1} ({}, {}) | {:.1} / {:.1} | {} | {} | {:.1} |\n",
            t.name,
            t.offered_keys_per_s,
            t.lag.p50,
            t.lag.p99,
            t.lag.max,
            t.lag.n,
            t.lag.missing,
            t.send.p50,
            t.send.p99,
            cpu.join(" / "),
            if t.complete { "yes" } else { "NO" },
            t.bytes_per_block
        );
    }
    s += &format!("\nIn-process index: {:.1} bytes / block.\n", r.index_bytes_per_block);
    s
}
