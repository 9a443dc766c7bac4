//! `kvbench bus`: the event plane at the scale of a large cluster. `--publishers` simulated
//! daemons ([`workload`]), each reporting once a second what a node of the Mooncake replay
//! reports, into `--replicas` kvrouter processes, through a real nats-server with JetStream and,
//! beside it in the same run, by HTTP push (every publisher POSTing to every replica, as daemons
//! without NATS do). Measured:
//!
//! 1. **Ingest rate.** The same backlog of messages (`--backlog-s` seconds of every publisher)
//!    applied to the router's index in this process (`kvrouter_core`'s store and remove: the
//!    index's own rate), decoded from JSON and ingested by an in-process router
//!    (`Router::ingest`: what each transport ends in), then rebuilt by replicas started after
//!    the stream holds it (through NATS), and pushed to fresh replicas over HTTP.
//! 2. **At the offered load** (`--seconds` of it per transport): publish-to-applied lag, from
//!    the moment a probe publisher's message is handed to the transport until a replica routes
//!    the probe chain it carries to that publisher's worker (`POST /route` every millisecond);
//!    the publishers' completion latency (JetStream ack, or both POSTs answered); each
//!    replica's CPU time (from /proc) per million block events applied.
//! 3. **Index bytes per block** in the replicas (`kvrouter_index_bytes` / `kvrouter_index_blocks`)
//!    beside the in-process index of the same events.
//!
//! # Layout
//! - [`workload`]: the simulated publishers and their messages.
//! - `send.rs`: a message as it travels, and the two transports' sending ends.
//! - `report.rs`: the figures and their Markdown.
//! - this file: the phases and the measurements.

mod report;
mod send;
pub mod workload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use kvnet::nats::async_nats::jetstream;
use kvproto::events::{EventBody, PublisherMessage};
use kvrouter::index::{BlockIndex, Slot};
use parking_lot::Mutex;

use crate::replay::cluster::RouterHandle;
use report::quantiles;
pub use report::{BusReport, Quantiles, TransportReport, markdown};
use send::{Sender, Wire, drain, push_backlog, wire};
use workload::{Publisher, Shape};

/// `kvbench bus`.
#[derive(Debug, Clone, Args)]
pub struct BusArgs {
    /// Simulated publishers (nodes), each with its own subject.
    #[arg(long, default_value_t = 1000)]
    pub publishers: usize,
    /// Block events (stored plus removed keys) each publisher reports a second. The default is a
    /// node of the Mooncake replay: 288,500 blocks, 0.76 of them missed and stored, as many
    /// evicted past 8 x 2000 blocks, in 64 s on 8 nodes (docs/benchmarks.md): ~825.
    #[arg(long, default_value_t = 825)]
    pub events_per_s: usize,
    /// Blocks a stored chain (a request's new blocks) and a removal carry: the replay's mean.
    #[arg(long, default_value_t = 18)]
    pub chain: usize,
    /// Blocks each publisher holds (the replay's G2 blocks per node).
    #[arg(long, default_value_t = 2000)]
    pub capacity: usize,
    /// Seconds of offered load per transport.
    #[arg(long, default_value_t = 20)]
    pub seconds: u64,
    /// Seconds of every publisher's reports in the backlog the replicas rebuild from.
    #[arg(long, default_value_t = 5)]
    pub backlog_s: u64,
    /// Router replicas (kvrouter processes).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// NATS connections the publishers share (publishers are spread over them).
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// How publishers write their reports on NATS (as `events.nats.encoding`).
    #[arg(long, default_value = "binary", value_parser = ["binary", "json"])]
    pub nats_encoding: String,
    /// Publishers whose every message carries a probe chain for the lag.
    #[arg(long, default_value_t = 10)]
    pub probes: usize,
    /// Transports to measure, in this order.
    #[arg(long, value_delimiter = ',', default_value = "nats,http")]
    pub transports: Vec<String>,
    /// The kvrouter binary (default: beside this one).
    #[arg(long)]
    pub kvrouter: Option<PathBuf>,
    /// Where the stream's store and the routers' files go (default: a temp directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// What every transport's replicas are first given: the messages, the probe chain of the last
/// one, the keys in all.
struct Backlog {
    wires: Vec<Wire>,
    final_probe: Vec<kvproto::BlockKey>,
    keys: u64,
}

/// Runs the benchmark.
pub async fn run(args: &BusArgs) -> Result<BusReport, String> {
    let shape = Shape { events_per_s: args.events_per_s, chain: args.chain, capacity: args.capacity };
    let kvrouter = args
        .kvrouter
        .clone()
        .or_else(|| std::env::current_exe().ok().map(|p| p.with_file_name("kvrouter")))
        .filter(|p| p.is_file())
        .ok_or("no kvrouter binary: pass --kvrouter (cargo build --release -p kvrouter)")?;
    let tmp = tempfile::tempdir_in(args.dir.clone().unwrap_or_else(std::env::temp_dir)).map_err(|e| e.to_string())?;
    let nats_cfg = kvnet::bus::NatsConfig { cluster: "bench".into(), max_bytes: 4 << 30, ..Default::default() };
    let mut report = BusReport { publishers: args.publishers, ..Default::default() };

    // 1. The backlog, and the in-process rates on it.
    let (_, seconds) = backlog_publishers(args, shape);
    let mut backlog = vec![];
    let mut final_probe = None;
    for (i, s) in seconds {
        final_probe = s.probe.or(final_probe);
        backlog.push((i, s.message, s.keys, nats_cfg.subject(&workload::node(i))));
    }
    let final_probe = final_probe.ok_or("no probe in the backlog")?;
    report.backlog_keys = backlog.iter().map(|b| b.2).sum();
    let (rate, bytes) = index_rate(&backlog);
    report.index_keys_per_s = rate;
    report.index_bytes_per_block = bytes;
    let wires: Vec<Wire> =
        backlog.iter().map(|(i, m, k, subject)| wire(*i, m, *k, subject.clone())).collect::<Result<_, _>>()?;
    drop(backlog);
    (report.router_keys_per_s, report.decode_keys_per_s, report.ingest_keys_per_s) =
        router_rate(&wires, report.backlog_keys, decode_json)?;
    (report.router_bin_keys_per_s, report.decode_bin_keys_per_s, _) =
        router_rate(&wires, report.backlog_keys, decode_bin)?;
    eprintln!(
        "in process: index {:.2} M keys/s, router (JSON + ingest) {:.2} M keys/s on {} keys",
        report.index_keys_per_s / 1e6,
        report.router_keys_per_s / 1e6,
        report.backlog_keys
    );

    let backlog = Backlog { wires, final_probe, keys: report.backlog_keys };
    for t in &args.transports {
        let dir = tmp.path().join(t);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let r = match t.as_str() {
            "nats" => transport_run(args, shape, &kvrouter, &dir, Some(&nats_cfg), &backlog).await?,
            "http" => transport_run(args, shape, &kvrouter, &dir, None, &backlog).await?,
            other => return Err(format!("--transports: {other:?} is neither nats nor http")),
        };
        report.transports.push(r);
    }
    Ok(report)
}

/// The publishers after the backlog, and the backlog: `--backlog-s` seconds of each, then one
/// more second of publisher 0 carrying a probe chain (the last message: a replica that routes
/// the probe has applied everything before it).
fn backlog_publishers(args: &BusArgs, shape: Shape) -> (Vec<Publisher>, Vec<(usize, workload::Second)>) {
    let mut pubs: Vec<Publisher> = (0..args.publishers.max(1)).map(|i| Publisher::new(i, 1)).collect();
    let mut out = vec![];
    for _ in 0..args.backlog_s {
        for (i, p) in pubs.iter_mut().enumerate() {
            out.push((i, p.second(shape, false)));
        }
    }
    out.push((0, pubs[0].second(shape, true)));
    (pubs, out)
}

/// The index's own rate: every event of the backlog stored into or removed from a
/// `kvrouter_core` index in this thread. Also its bytes per block at the end.
fn index_rate(backlog: &[(usize, PublisherMessage, u64, String)]) -> (f64, f64) {
    let mut index = BlockIndex::new();
    let keys: u64 = backlog.iter().map(|b| b.2).sum();
    let t0 = Instant::now();
    for (i, m, _, _) in backlog {
        let h = *i as u32;
        for e in &m.events {
            match &e.body {
                EventBody::Stored { namespace, parent, keys, tier, .. } => {
                    index.store(*namespace, parent.as_ref(), keys, Slot::new(h, *tier))
                }
                EventBody::Removed { keys, tier, .. } => index.remove(None, keys, Slot::new(h, *tier)),
                EventBody::Cleared { .. } => {}
            }
        }
    }
    let s = t0.elapsed().as_secs_f64();
    (keys as f64 / s, index.approx_bytes() as f64 / index.blocks().max(1) as f64)
}

/// How the in-process router decodes the backlog: JSON or binary.
fn decode_json(w: &Wire) -> Result<PublisherMessage, String> {
    serde_json::from_slice(&w.json).map_err(|e| e.to_string())
}
fn decode_bin(w: &Wire) -> Result<PublisherMessage, String> {
    kvnet::bus_codec::decode(&w.bin).map_err(|e| e.to_string())
}

/// An in-process router's rate on the backlog, decoded by `decode` and ingested, as each
/// transport's receiving end does. Also the two parts apart: the decoding alone, and the ingest
/// of decoded messages alone (into a second router).
fn router_rate(
    wires: &[Wire],
    keys: u64,
    decode: fn(&Wire) -> Result<PublisherMessage, String>,
) -> Result<(f64, f64, f64), String> {
    let router = kvrouter::Router::new(bench_router_config(None)).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    for w in wires {
        let m = decode(w)?;
        if router.ingest(&m).is_some() {
            return Err(format!("{}: a gap in the backlog's event ids", m.publisher));
        }
    }
    let both = keys as f64 / t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let decoded: Vec<PublisherMessage> = wires.iter().map(decode).collect::<Result<_, _>>()?;
    let decode = keys as f64 / t0.elapsed().as_secs_f64();
    let router = kvrouter::Router::new(bench_router_config(None)).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    for m in &decoded {
        router.ingest(m);
    }
    let ingest = keys as f64 / t0.elapsed().as_secs_f64();
    Ok((both, decode, ingest))
}

/// The replicas' configuration: routes by cached prefix alone (the probes' check), publishers
/// reporting every second, the stream on `nats`.
fn bench_router_config(nats: Option<&kvnet::bus::NatsConfig>) -> kvrouter::RouterConfig {
    let mut c = kvrouter::RouterConfig::default();
    c.weights.decode = 0.0;
    c.weights.active = 0.0;
    c.weights.fill = 0.0;
    c.prefetch.enabled = false;
    c.health.default_report_interval_ms = 1000;
    c.max_body_bytes = 64 << 20;
    if let Some(n) = nats {
        c.nats = n.clone();
    }
    c
}

/// The sum of `name`'s samples in `r`'s `/metrics` (0 when it does not answer).
async fn metric_sum(r: &RouterHandle, name: &str) -> f64 {
    crate::replay::report::metric_sum(&r.metrics().await, name)
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_s(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return f64::NAN };
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
    // utime and stime are fields 14 and 15 of stat(5): 12 and 13 after the state field.
    (ticks(11) + ticks(12)) / hz
}

/// Waits until every replica applied `events` events.
async fn wait_applied(routers: &[RouterHandle], events: f64, within: Duration) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        let mut have = vec![];
        for r in routers {
            have.push(metric_sum(r, "kvrouter_events_total").await);
        }
        if have.iter().all(|h| *h >= events) {
            return Ok(());
        }
        if t0.elapsed() > within {
            return Err(format!("replicas applied {have:?} of {events} events after {within:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn start_routers(
    args: &BusArgs,
    kvrouter: &Path,
    dir: &Path,
    nats: Option<&kvnet::bus::NatsConfig>,
) -> Result<Vec<RouterHandle>, String> {
    let mut routers = vec![];
    for r in 0..args.replicas {
        let d = dir.join(format!("router{r}"));
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        routers.push(RouterHandle::start(Some(kvrouter), &d, bench_router_config(nats)).await?);
    }
    Ok(routers)
}

/// One transport: backlog, then the offered load.
async fn transport_run(
    args: &BusArgs,
    shape: Shape,
    kvrouter: &Path,
    dir: &Path,
    nats: Option<&kvnet::bus::NatsConfig>,
    backlog: &Backlog,
) -> Result<TransportReport, String> {
    let name = if nats.is_some() { "NATS JetStream" } else { "HTTP push" };
    let mut out = TransportReport { name: name.into(), ..Default::default() };
    let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().map_err(|e| e.to_string())?;
    let backlog_events: u64 = backlog.wires.iter().map(|w| w.events).sum();
    let (sender, routers, started, server) = match nats {
        Some(cfg) => {
            let (sender, routers, started, server, drained) = nats_backlog(args, kvrouter, dir, cfg, backlog).await?;
            out.drain_keys_per_s = Some(backlog.keys as f64 / drained);
            (sender, routers, started, Some(server))
        }
        None => {
            let routers = start_routers(args, kvrouter, dir, None).await?;
            let bases = Arc::new(routers.iter().map(|r| r.base().to_string()).collect::<Vec<_>>());
            let sender = Sender::Http(http.clone(), bases);
            let started = Instant::now();
            push_backlog(&sender, &backlog.wires).await?;
            (sender, routers, started, None)
        }
    };
    // Each replica applies a transport's messages in order: the final probe seen, all are.
    let mut slowest = 0.0f64;
    for r in &routers {
        let ms = probe(&http, r.base(), 0, &backlog.final_probe, started, Duration::from_secs(600), 5)
            .await
            .ok_or_else(|| format!("{name}: {} did not apply the backlog in 600 s", r.base()))?;
        slowest = slowest.max(ms / 1e3);
    }
    wait_applied(&routers, backlog_events as f64, Duration::from_secs(60)).await?;
    out.backlog_keys_per_s = backlog.keys as f64 / slowest;
    let cpu: Vec<String> = routers.iter().map(|r| format!("{:.2}", r.pid().map_or(f64::NAN, cpu_s))).collect();
    let server_cpu = server.as_ref().and_then(kvtests::nats::Nats::pid).map(cpu_s);
    eprintln!(
        "{name}: every replica applied the backlog in {slowest:.2} s (CPU s: replicas {}, nats-server {})",
        cpu.join(" / "),
        server_cpu.map_or("-".into(), |c| format!("{c:.2}"))
    );

    // 2. The offered load, the publishers continuing where the backlog left them.
    let (pubs, _) = backlog_publishers(args, shape);
    let cpu0: Vec<f64> = routers.iter().map(|r| r.pid().map_or(f64::NAN, cpu_s)).collect();
    let (sent_events, sent_keys, lag, send) = offered_load(args, shape, &sender, &routers, pubs).await?;
    let total = backlog_events + sent_events;
    out.complete = wait_applied(&routers, total as f64, Duration::from_secs(60)).await.is_ok();
    let cpu1: Vec<f64> = routers.iter().map(|r| r.pid().map_or(f64::NAN, cpu_s)).collect();
    out.offered_keys_per_s = sent_keys as f64 / args.seconds as f64;
    out.cpu_s_per_m = cpu0.iter().zip(&cpu1).map(|(a, b)| (b - a) / (sent_keys as f64 / 1e6)).collect();
    (out.lag, out.send) = (lag, send);
    let bytes = metric_sum(&routers[0], "kvrouter_index_bytes").await;
    let blocks = metric_sum(&routers[0], "kvrouter_index_blocks").await;
    out.bytes_per_block = bytes / blocks.max(1.0);
    for r in routers {
        r.stop().await?;
    }
    Ok(out)
}

/// NATS's first phase: a server, the publishers' connections and the stream; the backlog put
/// in it; an ordered consumer alone reading it (seconds, the last value); then the replicas,
/// started after the stream holds the backlog, so that they rebuild from it.
async fn nats_backlog(
    args: &BusArgs,
    kvrouter: &Path,
    dir: &Path,
    cfg: &kvnet::bus::NatsConfig,
    backlog: &Backlog,
) -> Result<(Sender, Vec<RouterHandle>, Instant, kvtests::nats::Nats, f64), String> {
    let server = kvtests::nats::Nats::start_open(&dir.join("nats"));
    let cfg = kvnet::bus::NatsConfig { servers: vec![server.url()], ..cfg.clone() };
    let mut js = vec![];
    for _ in 0..args.connections.max(1) {
        let c = kvnet::nats::async_nats::connect(cfg.servers[0].as_str()).await.map_err(|e| e.to_string())?;
        js.push(jetstream::new(c));
    }
    kvnet::nats::ensure_stream(&js[0], &cfg).await.map_err(|e| e.to_string())?;
    let first = js[0].clone();
    let sender = Sender::Nats(Arc::new(js), args.nats_encoding == "binary");
    let t0 = Instant::now();
    push_backlog(&sender, &backlog.wires).await?;
    eprintln!("NATS: backlog of {} keys in the stream in {:.1} s", backlog.keys, t0.elapsed().as_secs_f64());
    let drained = drain(&first, &cfg, backlog.wires.len()).await?;
    eprintln!("NATS: an ordered consumer alone read the backlog in {drained:.2} s");
    let started = Instant::now();
    let routers = start_routers(args, kvrouter, dir, Some(&cfg)).await?;
    Ok((sender, routers, started, server, drained))
}

type Offered = (u64, u64, Quantiles, Quantiles);

/// What the publishing tasks of the offered load share.
struct Load {
    shape: Shape,
    sender: Sender,
    bases: Vec<String>,
    http: reqwest::Client,
    cfg: kvnet::bus::NatsConfig,
    probes: usize,
    pubs: Mutex<Vec<Publisher>>,
    /// Sends and probes in flight at once (~2 s of them).
    limit: Arc<tokio::sync::Semaphore>,
    /// Latencies (ms) and failures: publish-to-applied, and the sends.
    lags: Mutex<(Vec<f64>, usize)>,
    sends: Mutex<(Vec<f64>, usize)>,
    /// Events and keys sent.
    counts: Mutex<(u64, u64)>,
}

/// `args.seconds` of every publisher's reports, publisher `i` at `i / publishers` into each
/// second; the first `args.probes` publishers' messages carry a probe chain that every replica
/// is polled for.
async fn offered_load(
    args: &BusArgs,
    shape: Shape,
    sender: &Sender,
    routers: &[RouterHandle],
    pubs: Vec<Publisher>,
) -> Result<Offered, String> {
    let n = args.publishers;
    let in_flight = 4 * n + 64;
    let load = Arc::new(Load {
        shape,
        sender: sender.clone(),
        bases: routers.iter().map(|r| r.base().to_string()).collect(),
        http: reqwest::Client::builder().pool_max_idle_per_host(64).build().map_err(|e| e.to_string())?,
        cfg: kvnet::bus::NatsConfig { cluster: "bench".into(), ..Default::default() },
        probes: args.probes,
        pubs: Mutex::new(pubs),
        limit: Arc::new(tokio::sync::Semaphore::new(in_flight)),
        lags: Mutex::default(),
        sends: Mutex::default(),
        counts: Mutex::default(),
    });
    let conns = args.connections.max(1);
    let t0 = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut tasks = vec![];
    for c in 0..conns {
        let load = Arc::clone(&load);
        let seconds = args.seconds;
        tasks.push(tokio::spawn(async move {
            for s in 0..seconds {
                for i in (c..n).step_by(conns) {
                    let due = t0 + Duration::from_secs(s) + Duration::from_secs_f64(i as f64 / n as f64);
                    tokio::time::sleep_until(due).await;
                    if !dispatch(&load, i).await {
                        return;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    // The last sends and probes.
    let _ = load.limit.acquire_many(in_flight as u32).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (events, keys) = *load.counts.lock();
    let (l, lm) = std::mem::take(&mut *load.lags.lock());
    let (s, sm) = std::mem::take(&mut *load.sends.lock());
    Ok((events, keys, quantiles(l, lm), quantiles(s, sm)))
}

/// Publisher `i`'s next second: sent, and its probe chain (if any) polled on every replica, on
/// tasks of their own. `false` once nothing more can be sent.
async fn dispatch(load: &Arc<Load>, i: usize) -> bool {
    let sec = load.pubs.lock()[i].second(load.shape, i < load.probes);
    let Ok(w) = wire(i, &sec.message, sec.keys, load.cfg.subject(&workload::node(i))) else { return true };
    {
        let mut k = load.counts.lock();
        k.0 += w.events;
        k.1 += w.keys;
    }
    let Ok(permit) = Arc::clone(&load.limit).acquire_owned().await else { return false };
    let at = Instant::now();
    let l = Arc::clone(load);
    tokio::spawn(async move {
        let r = l.sender.send(w.publisher, &w).await;
        let mut g = l.sends.lock();
        match r {
            Ok(()) => g.0.push(at.elapsed().as_secs_f64() * 1e3),
            Err(_) => g.1 += 1,
        }
        drop(permit);
    });
    for b in sec.probe.iter().flat_map(|chain| load.bases.iter().map(move |b| (chain.clone(), b.clone()))) {
        let l = Arc::clone(load);
        tokio::spawn(async move {
            let r = probe(&l.http, &b.1, i, &b.0, at, Duration::from_secs(10), 1).await;
            let mut g = l.lags.lock();
            match r {
                Some(ms) => g.0.push(ms),
                None => g.1 += 1,
            }
        });
    }
    true
}

/// Milliseconds from `at` until the replica at `base` routes `chain` to publisher `i`'s worker
/// with every block of it cached (asking every `every_ms`); `None` after `within`.
async fn probe(
    http: &reqwest::Client,
    base: &str,
    i: usize,
    chain: &[kvproto::BlockKey],
    at: Instant,
    within: Duration,
    every_ms: u64,
) -> Option<f64> {
    let keys: Vec<String> = chain.iter().map(ToString::to_string).collect();
    let body = serde_json::json!({"namespace_id": workload::NAMESPACE.to_string(), "keys": keys});
    let want = workload::worker(i);
    while at.elapsed() < within {
        if let Ok(r) = http.post(format!("{base}/route")).json(&body).send().await
            && let Ok(v) = r.json::<serde_json::Value>().await
            && v["worker"].as_str() == Some(want.as_str())
            && v["cached_blocks"][1].as_u64() == Some(chain.len() as u64)
        {
            return Some(at.elapsed().as_secs_f64() * 1e3);
        }
        tokio::time::sleep(Duration::from_millis(every_ms)).await;
    }
    None
}
