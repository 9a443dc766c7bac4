//! Many engines at once on one daemon (`kvbench many`): N engines (8 by default), each its own
//! client connection and KV memory, saving fresh prompts and loading a cached one in a loop,
//! all at the same time, against one `kvcached` process; their aggregate throughput beside a
//! 2-thread memcpy of the same mix in the same run (and one engine alone, for the scaling), and
//! the latency of a lookup asked by another engine while they run, beside the same lookup on an
//! idle daemon. Then the request path under a bulk write: every engine looking its prompt up
//! from a thread of its own (as a scheduler does, `Client::lookup_blocking`), first alone, then
//! while one more engine saves 2 GiB.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory};
use kvproto::{KvLayout, Namespace};
use serde::{Deserialize, Serialize};

use crate::replay::cluster::DaemonProcess;
use crate::replay::report::Dist;

/// What to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManyConfig {
    pub engines: usize,
    /// Blocks per save or load call (2 MiB each).
    pub call_blocks: u32,
    /// Length of each timed phase.
    pub seconds: f64,
    /// The daemon's G2.
    pub g2_bytes: u64,
    /// The probing engine asks a lookup this often while the engines run.
    pub probe_interval_ms: u64,
    /// Lookups timed on the idle daemon.
    pub idle_samples: usize,
    /// Bytes the saving engine stores in each round of the lookups-beside-a-save phase.
    pub save_bytes: u64,
    /// Rounds of that phase (each one save of `save_bytes`).
    pub save_rounds: usize,
    /// Each engine asks a lookup this often in that phase.
    pub lookup_interval_ms: u64,
    pub kvcached_bin: PathBuf,
    pub dir: PathBuf,
    pub shm_dir: PathBuf,
}

/// Bytes moved by a set of engines (or threads) in a phase.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Moved {
    pub saved_bytes: u64,
    pub loaded_bytes: u64,
    pub seconds: f64,
    /// Saved plus loaded bytes per second (decimal GB/s).
    pub gbs: f64,
    pub calls: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ManyReport {
    pub config: Option<ManyConfig>,
    pub block_bytes: u64,
    pub call_bytes: u64,
    /// Every engine at once.
    pub all: Moved,
    /// Per engine, in the concurrent phase (GB/s).
    pub per_engine_gbs: Vec<f64>,
    /// One engine alone.
    pub one: Moved,
    /// Two threads copying the same mix (a save's copy into a rotating slot of a written
    /// region, a load's copy between two hot buffers), and one thread.
    pub memcpy2: Moved,
    pub memcpy1: Moved,
    pub lookup_idle: Dist,
    pub lookup_loaded: Dist,
    /// Every engine looking up from a thread of its own, nothing else running.
    pub lookups_alone: Dist,
    /// The same while one engine saves `save_bytes` (samples started within its saves).
    pub lookups_beside_save: Dist,
    /// Seconds each of those saves took.
    pub save_seconds: Vec<f64>,
    pub loadavg_start: Option<[f64; 3]>,
    pub loadavg_end: Option<[f64; 3]>,
}

fn layout() -> KvLayout {
    KvLayout::llama3_8b(16)
}

/// Tokens of prompt `p` (distinct per `p`) with `blocks` blocks of 16 tokens.
fn prompt(p: u64, blocks: u32) -> Vec<u32> {
    let mut t = Vec::with_capacity(blocks as usize * 16);
    crate::replay::block_tokens(p.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x6d61_6e79, blocks * 16, &mut t);
    t
}

fn moved(saved: u64, loaded: u64, calls: u64, d: Duration) -> Moved {
    let s = d.as_secs_f64();
    Moved {
        saved_bytes: saved,
        loaded_bytes: loaded,
        seconds: s,
        gbs: if s > 0.0 { (saved + loaded) as f64 / s / 1e9 } else { 0.0 },
        calls,
    }
}

/// An engine with `2 * call_blocks` slots: saves from the first half, loads into the second.
struct Engine {
    client: Client,
    _mem: KvMemory,
    id: u64,
    next: u64,
    cached: Vec<u32>,
}

impl Engine {
    async fn attach(socket: &Path, id: u64, call_blocks: u32) -> Result<Self, String> {
        let l = layout();
        let mut mem = KvMemory::anonymous(&l, call_blocks * 2).map_err(|e| format!("engine memory: {e}"))?;
        for b in 0..call_blocks * 2 {
            mem.write_block(b, &kvclient::synthetic_block(id, b, l.block_bytes() as usize));
        }
        let client = Client::connect(socket).await.map_err(|e| e.to_string())?;
        let name = format!("many-{id}");
        client.register(&name, &Namespace::new("kvbench/many", l), &mem).await.map_err(|e| e.to_string())?;
        let cached = prompt(id << 32, call_blocks);
        let slots: Vec<u32> = (0..call_blocks).collect();
        client.save(&cached, 0, &slots).await.map_err(|e| format!("save: {e}"))?;
        Ok(Self { client, _mem: mem, id, next: 1, cached })
    }

    /// Saves a fresh prompt; bytes stored.
    async fn save_fresh(&mut self, call_blocks: u32, block: u64) -> Result<u64, String> {
        let p = prompt((self.id << 32) | self.next, call_blocks);
        self.next += 1;
        let slots: Vec<u32> = (0..call_blocks).collect();
        let r = self.client.save(&p, 0, &slots).await.map_err(|e| format!("save: {e}"))?;
        if r.failed > 0 {
            return Err(format!("save: {}", r.error));
        }
        Ok(u64::from(r.stored) * block)
    }

    /// Loads its cached prompt into the second half of its slots (saved again if evicted).
    async fn load_cached(&mut self, call_blocks: u32, block: u64) -> Result<u64, String> {
        let slots: Vec<u32> = (call_blocks..call_blocks * 2).collect();
        let s = self.client.load_now(&self.cached, 0, &slots).await.map_err(|e| format!("load: {e}"))?;
        if s.loaded_blocks < call_blocks {
            // Evicted by the others' saves: an engine would prefill and save it again.
            let first: Vec<u32> = (0..call_blocks).collect();
            self.client.save(&self.cached, 0, &first).await.map_err(|e| format!("save: {e}"))?;
        }
        Ok(u64::from(s.loaded_blocks) * block)
    }

    /// Saves and loads in turn until `until`: (saved, loaded, calls).
    async fn run_until(&mut self, until: Instant, call_blocks: u32, block: u64) -> Result<(u64, u64, u64), String> {
        let (mut saved, mut loaded, mut calls) = (0, 0, 0);
        while Instant::now() < until {
            saved += self.save_fresh(call_blocks, block).await?;
            loaded += self.load_cached(call_blocks, block).await?;
            calls += 2;
        }
        Ok((saved, loaded, calls))
    }
}

/// `threads` threads copying the save/load mix for `secs`.
fn memcpy_mix(threads: usize, call_bytes: usize, secs: f64) -> Moved {
    let barrier = Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let src = kvclient::synthetic_block(t as u64, 0, call_bytes);
                let mut hot = vec![0u8; call_bytes];
                // A region written once, as a daemon's pool has been (docs/benchmarks.md).
                let mut region = vec![0x5au8; (512 << 20).max(call_bytes)];
                let slots = region.len() / call_bytes;
                barrier.wait();
                let start = Instant::now();
                let until = start + Duration::from_secs_f64(secs);
                let (mut bytes, mut i) = (0u64, 0usize);
                while Instant::now() < until {
                    let at = (i % slots) * call_bytes;
                    region[at..at + call_bytes].copy_from_slice(std::hint::black_box(&src));
                    hot.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box((&region[at], &hot));
                    bytes += 2 * call_bytes as u64;
                    i += 1;
                }
                (bytes, i as u64 * 2, start.elapsed())
            })
        })
        .collect();
    let (mut bytes, mut calls, mut longest) = (0, 0, Duration::ZERO);
    for h in handles {
        if let Ok((b, c, d)) = h.join() {
            bytes += b;
            calls += c;
            longest = longest.max(d);
        }
    }
    // Half of the copies are the save's, half the load's; the threads ran side by side (from
    // the barrier), so the aggregate is everything over the longest of them.
    moved(bytes / 2, bytes / 2, calls, longest)
}

/// Lookups of `tokens` by `c` every `interval` until `until`; their latencies (us).
async fn probe(c: &Client, tokens: &[u32], until: Instant, interval: Duration) -> Result<Vec<f64>, String> {
    let mut v = Vec::new();
    let mut tick = tokio::time::interval(interval);
    while Instant::now() < until {
        tick.tick().await;
        let t0 = Instant::now();
        c.lookup(tokens).await.map_err(|e| format!("probe lookup: {e}"))?;
        v.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(v)
}

/// A thread looking an engine's prompt up: each lookup's start and latency (us).
type Looker = std::thread::JoinHandle<Result<Vec<(Instant, f64)>, String>>;

/// Lookups of every engine's cached prompt, alone and beside a bulk save.
struct Beside {
    alone: Dist,
    saving: Dist,
    save_seconds: Vec<f64>,
}

/// Every engine of `engines` looking its cached prompt up from a thread of its own, once every
/// `interval`, until `stop`: each lookup's start and latency (us).
fn start_lookers(engines: &[Engine], interval: Duration, stop: &Arc<std::sync::atomic::AtomicBool>) -> Vec<Looker> {
    engines
        .iter()
        .map(|e| {
            let (client, tokens, stop) = (e.client.clone(), e.cached.clone(), Arc::clone(stop));
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let mut next = Instant::now();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t0 = Instant::now();
                    match client.lookup_blocking(&tokens) {
                        Some(Ok(_)) => v.push((t0, t0.elapsed().as_secs_f64() * 1e6)),
                        Some(Err(e)) => return Err(format!("lookup: {e}")),
                        None => return Err("lookup: no LOOKUP connection to the daemon".into()),
                    }
                    next += interval;
                    std::thread::sleep(next.saturating_duration_since(Instant::now()));
                }
                Ok(v)
            })
        })
        .collect()
}

/// Stops the lookers; the latencies of the lookups that started within `windows`.
async fn stop_lookers(
    lookers: Vec<Looker>,
    stop: &std::sync::atomic::AtomicBool,
    windows: &[(Instant, Instant)],
) -> Result<Vec<f64>, String> {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let joined = tokio::task::spawn_blocking(move || lookers.into_iter().map(|h| h.join()).collect::<Vec<_>>())
        .await
        .map_err(|e| e.to_string())?;
    let mut v = Vec::new();
    for j in joined {
        let samples = j.map_err(|_| "a lookup thread panicked".to_string())??;
        v.extend(samples.into_iter().filter(|(t, _)| windows.iter().any(|(a, b)| t >= a && t < b)).map(|(_, us)| us));
    }
    Ok(v)
}

/// The lookups of `engines` alone, then beside `saver` saving `cfg.save_bytes` of fresh
/// prompts, `cfg.save_rounds` times.
async fn lookups_beside_save(
    cfg: &ManyConfig,
    engines: &[Engine],
    saver: &mut Engine,
    n: u32,
    block: u64,
) -> Result<Beside, String> {
    let interval = Duration::from_millis(cfg.lookup_interval_ms.max(1));
    for e in engines {
        // Cached again where the concurrent phase's saves evicted it.
        let slots: Vec<u32> = (0..n).collect();
        e.client.save(&e.cached, 0, &slots).await.map_err(|e| format!("save: {e}"))?;
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lookers = start_lookers(engines, interval, &stop);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let alone = stop_lookers(lookers, &stop, &[(t0 + Duration::from_millis(100), Instant::now())]).await?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lookers = start_lookers(engines, interval, &stop);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (mut windows, mut save_seconds) = (Vec::new(), Vec::new());
    for _ in 0..cfg.save_rounds.max(1) {
        let t0 = Instant::now();
        let mut stored = 0;
        while stored < cfg.save_bytes {
            stored += saver.save_fresh(n, block).await?;
        }
        let t1 = Instant::now();
        windows.push((t0, t1));
        save_seconds.push((t1 - t0).as_secs_f64());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let saving = stop_lookers(lookers, &stop, &windows).await?;
    Ok(Beside { alone: Dist::of(alone), saving: Dist::of(saving), save_seconds })
}

/// Runs the whole measurement.
pub async fn run(cfg: &ManyConfig) -> Result<ManyReport, String> {
    let loadavg_start = crate::replay::loadavg();
    std::fs::create_dir_all(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
    let work = tempfile::tempdir_in(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
    let mut c = kvcached::Config::default();
    c.g2.capacity_bytes = cfg.g2_bytes;
    c.g2.shm_dir = cfg.shm_dir.clone();
    c.g3.enabled = false;
    // Every engine and the probe at once.
    c.limits.max_engines_per_uid = c.limits.max_engines_per_uid.max(cfg.engines + 2);
    let (bin, d) = (cfg.kvcached_bin.clone(), work.path().join("kvcached"));
    let daemon = DaemonProcess::start_prefaulted(bin, d, c).await?;
    let r = measure(cfg, &daemon.socket).await;
    let stopped = tokio::task::spawn_blocking(move || daemon.stop()).await.map_err(|e| e.to_string())?;
    let mut r = r?;
    stopped?;
    r.config = Some(cfg.clone());
    r.loadavg_start = loadavg_start;
    r.loadavg_end = crate::replay::loadavg();
    Ok(r)
}

async fn measure(cfg: &ManyConfig, socket: &Path) -> Result<ManyReport, String> {
    let block = layout().block_bytes();
    let n = cfg.call_blocks.max(1);
    let call_bytes = block * u64::from(n);
    let mut engines = Vec::with_capacity(cfg.engines);
    for i in 0..cfg.engines.max(1) {
        engines.push(Engine::attach(socket, i as u64 + 1, n).await?);
    }
    let prober = Engine::attach(socket, 0, n).await?;
    // Warm-up: the pool written about once over (memory written before is faster to write
    // again on these VMs: docs/benchmarks.md, "Save and load").
    let warm_calls = (cfg.g2_bytes / call_bytes).div_ceil(engines.len() as u64);
    for e in engines.iter_mut() {
        for _ in 0..warm_calls {
            e.save_fresh(n, block).await?;
        }
    }
    let mut idle = Vec::with_capacity(cfg.idle_samples);
    for _ in 0..cfg.idle_samples.max(1) {
        let t0 = Instant::now();
        prober.client.lookup(&prober.cached).await.map_err(|e| format!("lookup: {e}"))?;
        idle.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    let secs = cfg.seconds.max(0.5);
    // One engine alone.
    let t0 = Instant::now();
    let (s, l, calls) = engines[0].run_until(t0 + Duration::from_secs_f64(secs / 2.0), n, block).await?;
    let one = moved(s, l, calls, t0.elapsed());
    // Every engine at once, and the probe.
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = engines
        .into_iter()
        .map(|mut e| {
            tokio::spawn(async move {
                let t0 = Instant::now();
                let r = e.run_until(until, n, block).await;
                (r, t0.elapsed(), e)
            })
        })
        .collect();
    let probed =
        probe(&prober.client, &prober.cached, until, Duration::from_millis(cfg.probe_interval_ms.max(1))).await?;
    let (mut saved, mut loaded, mut calls, mut per_engine, mut done) = (0, 0, 0, Vec::new(), Vec::new());
    for t in tasks {
        let (r, d, e) = t.await.map_err(|e| format!("engine task: {e}"))?;
        let (s, l, c) = r?;
        per_engine.push((s + l) as f64 / d.as_secs_f64() / 1e9);
        saved += s;
        loaded += l;
        calls += c;
        done.push(e);
    }
    let all = moved(saved, loaded, calls, t0.elapsed());
    let mut prober = prober;
    let beside = lookups_beside_save(cfg, &done, &mut prober, n, block).await?;
    for e in done {
        let _ = e.client.unregister().await;
    }
    let _ = prober.client.unregister().await;
    // The memcpy baselines after the engines (not beside them: they would share the cores).
    let cb = call_bytes as usize;
    let (memcpy2, memcpy1) =
        tokio::task::spawn_blocking(move || (memcpy_mix(2, cb, secs / 2.0), memcpy_mix(1, cb, secs / 2.0)))
            .await
            .map_err(|e| e.to_string())?;
    Ok(ManyReport {
        config: None,
        block_bytes: block,
        call_bytes,
        all,
        per_engine_gbs: per_engine,
        one,
        memcpy2,
        memcpy1,
        lookup_idle: Dist::of(idle),
        lookup_loaded: Dist::of(probed),
        lookups_alone: beside.alone,
        lookups_beside_save: beside.saving,
        save_seconds: beside.save_seconds,
        loadavg_start: None,
        loadavg_end: None,
    })
}

/// The report as Markdown.
pub fn markdown(r: &ManyReport) -> String {
    let engines = r.config.as_ref().map_or(0, |c| c.engines);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let mut s = format!(
        "{} engines on one daemon, calls of {} MiB (blocks of {} MiB), half saves of fresh prompts, half loads of a cached one; load average {:?} -> {:?}\n\n",
        engines,
        r.call_bytes >> 20,
        r.block_bytes >> 20,
        r.loadavg_start,
        r.loadavg_end
    );
    s += "| what | GB/s | / 2-thread memcpy | calls |\n|---|---|---|---|\n";
    // One row a phase: its GB/s, that against the 2-thread memcpy's (`vs`), its calls.
    let row = |what: &str, m: &Moved, vs: String| format!("| {what} | {:.2} | {vs} | {} |\n", m.gbs, m.calls);
    let vs = |m: &Moved| format!("{:.2}x", ratio(m.gbs, r.memcpy2.gbs));
    s += &row(&format!("{engines} engines at once"), &r.all, vs(&r.all));
    s += &row("one engine alone", &r.one, vs(&r.one));
    s += &row("memcpy, 2 threads, same mix", &r.memcpy2, "1.00x".into());
    s += &row("memcpy, 1 thread, same mix", &r.memcpy1, vs(&r.memcpy1));
    s += &format!(
        "\nper engine (GB/s): {:?}\n\n| lookup of a cached {}-block prompt (us) | n | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|\n",
        r.per_engine_gbs.iter().map(|x| (x * 100.0).round() / 100.0).collect::<Vec<_>>(),
        r.call_bytes / r.block_bytes.max(1)
    );
    for (name, d) in
        [("idle daemon", &r.lookup_idle), (&*format!("while {engines} engines save and load"), &r.lookup_loaded)]
    {
        s += &format!("| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} |\n", d.n, d.p50_us, d.p90_us, d.p99_us, d.max_us);
    }
    let (interval, save_mib) = r.config.as_ref().map_or((0, 0), |c| (c.lookup_interval_ms, c.save_bytes >> 20));
    s += &format!(
        "\n{engines} engines each looking its prompt up every {interval} ms from a thread of its own (`lookup_blocking`); one more engine saving {save_mib} MiB of fresh prompts per round, rounds of {:?} s\n\n| lookups (us) | n | p50 | p90 | p99 | max | p99 / p50 |\n|---|---|---|---|---|---|---|\n",
        r.save_seconds.iter().map(|x| (x * 100.0).round() / 100.0).collect::<Vec<_>>()
    );
    for (name, d) in [("nothing else running", &r.lookups_alone), ("while one engine saves", &r.lookups_beside_save)] {
        s += &format!(
            "| {name} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}x |\n",
            d.n,
            d.p50_us,
            d.p90_us,
            d.p99_us,
            d.max_us,
            ratio(d.p99_us, d.p50_us)
        );
    }
    s
}
