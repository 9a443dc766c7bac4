//! The dispatcher and the engines of a replay. The dispatcher takes the trace in order, waits
//! for each request's (scaled) timestamp, asks the router where it goes (`POST /route`), and
//! hands it to that worker's engine; at most `concurrency` requests are in flight. Each engine is
//! a task with its own client connection and KV memory, serving its requests in order: lookup,
//! load (checked byte for byte), prefill (synthetic KV written into its slots), save, and a load
//! report from the service model.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvclient::{Client, KvMemory};
use kvproto::Namespace;
use kvrouter::sim::TraceRequest;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::cluster::Cluster;
use super::{MODEL_ID, NAMESPACE, ReplayConfig, block_kv, request_tokens};

/// What happened to one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Its position in the trace.
    pub idx: usize,
    pub ts_ms: u64,
    /// The engine (worker) it ran on: `node * engines_per_node + engine`.
    pub worker: usize,
    pub blocks: u32,
    /// The router's prediction of the chosen worker's cached prefix, per tier `[g1, g2, g3, g4]`.
    pub predicted: [u32; 4],
    /// The longest cached prefix the router saw on any candidate.
    pub best_candidate: u32,
    /// What the lookup found: prefix blocks, and of them in G2 / G3 / G4.
    pub matched: u32,
    pub lookup_tiers: [u32; 3],
    /// Blocks loaded into the engine's slots, and from where: G2, G3, G4, a peer.
    pub loaded: u32,
    pub from: [u32; 4],
    /// Blocks the save stored, and found already there (another engine saved them meanwhile).
    pub stored: u32,
    pub already_present: u32,
    pub route_us: f64,
    pub lookup_us: f64,
    pub load_us: Option<f64>,
    pub save_us: Option<f64>,
    /// Loaded blocks compared with their expected bytes, and how many differed.
    pub checked: u32,
    pub mismatches: u32,
    pub error: Option<String>,
}

/// The replay's raw results.
#[derive(Debug, Clone, Default)]
pub struct Driven {
    /// In trace order.
    pub outcomes: Vec<Outcome>,
    pub wall_s: f64,
    /// Whether the router ran as a process of its own.
    pub router_process: bool,
}

struct Job {
    idx: usize,
    ts_ms: u64,
    output_length: u32,
    ids: Arc<Vec<u64>>,
    tokens: Arc<Vec<u32>>,
    route_id: u64,
    predicted: [u32; 4],
    best_candidate: u32,
    route_us: f64,
    _permit: OwnedSemaphorePermit,
}

/// An engine: a client of one daemon, registered as worker `node-<n>/engine-<e>`.
struct Engine {
    client: Client,
    mem: KvMemory,
    worker: usize,
    block_bytes: usize,
    slots: Vec<u32>,
    verify: bool,
    /// The service model, in trace time: finish times (ms) and blocks of requests in flight.
    inflight: VecDeque<(f64, u64)>,
    kv_total_blocks: u64,
    prefill_ms_per_block: f64,
    decode_ms_per_token: f64,
}

fn us(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e6
}

impl Engine {
    async fn attach(
        cfg: &ReplayConfig,
        socket: &std::path::Path,
        node: usize,
        e: usize,
        slots: u32,
    ) -> Result<Self, String> {
        let layout = cfg.layout();
        let mem = KvMemory::anonymous(&layout, slots).map_err(|e| format!("engine memory: {e}"))?;
        let client = Client::connect(socket).await.map_err(|e| format!("node-{node}: connect: {e}"))?;
        let name = format!("engine-{e}");
        let address = format!("replay://node-{node}/{name}");
        client
            .register_worker(&name, &Namespace::new(MODEL_ID, layout), &mem, &address, "both")
            .await
            .map_err(|e| format!("node-{node}: register: {e}"))?;
        Ok(Self {
            client,
            mem,
            worker: node * cfg.engines_per_node + e,
            block_bytes: layout.block_bytes() as usize,
            slots: (0..slots).collect(),
            verify: cfg.verify,
            inflight: VecDeque::new(),
            kv_total_blocks: cfg.g2_blocks,
            prefill_ms_per_block: cfg.prefill_ms_per_block,
            decode_ms_per_token: cfg.decode_ms_per_token,
        })
    }

    async fn serve(&mut self, job: &Job) -> Outcome {
        let mut o = Outcome {
            idx: job.idx,
            ts_ms: job.ts_ms,
            worker: self.worker,
            blocks: job.ids.len() as u32,
            predicted: job.predicted,
            best_candidate: job.best_candidate,
            route_us: job.route_us,
            ..Outcome::default()
        };
        if let Err(e) = self.serve_into(job, &mut o).await {
            o.error = Some(format!("request {}: {e}", job.idx));
        }
        o
    }

    async fn serve_into(&mut self, job: &Job, o: &mut Outcome) -> Result<(), String> {
        let n = o.blocks;
        let t0 = Instant::now();
        let hit = self.client.lookup_routed(&job.tokens, job.route_id, 0).await.map_err(|e| format!("lookup: {e}"))?;
        o.lookup_us = us(t0);
        o.matched = hit.matched_blocks;
        o.lookup_tiers = [hit.g2_blocks, hit.g3_blocks, hit.g4_blocks];
        let m = hit.matched_blocks.min(n);
        let mut loaded = 0;
        if m > 0 {
            let t0 = Instant::now();
            let st = self
                .client
                .load_now(&job.tokens, 0, &self.slots[..m as usize])
                .await
                .map_err(|e| format!("load: {e}"))?;
            o.load_us = Some(us(t0));
            // A block evicted between the lookup and the load ends the load early: the rest is
            // prefilled, as an engine would.
            loaded = st.loaded_blocks.min(m);
            o.from = [st.from_g2, st.from_g3, st.from_g4, st.from_peer];
            if self.verify {
                for b in 0..loaded {
                    let expect = block_kv(job.ids[b as usize], self.block_bytes);
                    o.checked += 1;
                    if !slot_holds(&self.mem, b, &expect) {
                        o.mismatches += 1;
                    }
                }
            }
        }
        o.loaded = loaded;
        // "Prefill": the KV of the blocks not loaded, written by the engine into its slots.
        for b in loaded..n {
            self.mem.write_block(b, &block_kv(job.ids[b as usize], self.block_bytes));
        }
        if loaded < n {
            let t0 = Instant::now();
            let r = self
                .client
                .save(&job.tokens, loaded, &self.slots[loaded as usize..n as usize])
                .await
                .map_err(|e| format!("save: {e}"))?;
            o.save_us = Some(us(t0));
            o.stored = r.stored;
            o.already_present = r.already_present;
            if r.failed > 0 {
                return Err(format!("save: {} blocks failed: {}", r.failed, r.error));
            }
        }
        // The service model (the simulation's): the request occupies this engine for its
        // prefill and decode, in trace time; the router sees the queue through the daemon's next
        // load report.
        let now = job.ts_ms as f64;
        self.inflight.retain(|(finish, _)| *finish > now);
        let service =
            self.prefill_ms_per_block * f64::from(n - loaded) + self.decode_ms_per_token * f64::from(job.output_length);
        self.inflight.push_back((now + service.max(1.0), u64::from(n)));
        let used: u64 = self.inflight.iter().map(|(_, b)| b).sum();
        self.client
            .report_load(self.inflight.len() as u32, 0, used.min(self.kv_total_blocks), self.kv_total_blocks)
            .await
            .map_err(|e| format!("report_load: {e}"))?;
        Ok(())
    }
}

/// Whether slot `b` of `mem` holds `expect` (compared segment by segment, in block order).
fn slot_holds(mem: &KvMemory, b: u32, expect: &[u8]) -> bool {
    let bytes = mem.bytes();
    let mut at = 0;
    for r in mem.block_ranges(b) {
        let n = r.len();
        if at + n > expect.len() || bytes[r] != expect[at..at + n] {
            return false;
        }
        at += n;
    }
    at == expect.len()
}

/// The router's answer, as far as the replay needs it.
#[derive(Debug, serde::Deserialize)]
struct Routed {
    route_id: u64,
    worker: String,
    cached_blocks: [u32; 4],
    #[serde(default)]
    candidates: Vec<Candidate>,
}

#[derive(Debug, serde::Deserialize)]
struct Candidate {
    cached_blocks: [u32; 4],
}

fn progress_bar(cfg: &ReplayConfig, n: usize) -> ProgressBar {
    if !cfg.progress {
        return ProgressBar::hidden();
    }
    // indicatif draws only on a terminal: in a log or a pipe the bar stays silent.
    let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("replay {bar:40} {pos}/{len} requests  {per_sec}  elapsed {elapsed}  ETA {eta}")
    {
        pb.set_style(style);
    }
    pb
}

/// Replays `trace` on `cluster`.
pub async fn drive(cfg: &ReplayConfig, cluster: &Cluster, trace: &[TraceRequest]) -> Result<Driven, String> {
    let max_blocks = trace.iter().map(|r| r.hash_ids.len()).max().unwrap_or(1).max(1) as u32;
    let errors = Arc::new(AtomicUsize::new(0));
    let pb = progress_bar(cfg, trace.len());
    let mut senders: HashMap<String, mpsc::UnboundedSender<Job>> = HashMap::new();
    let mut tasks = Vec::new();
    for (node, d) in cluster.daemons.iter().enumerate() {
        for e in 0..cfg.engines_per_node {
            let mut engine = Engine::attach(cfg, &d.socket, node, e, max_blocks).await?;
            let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
            senders.insert(format!("node-{node}/engine-{e}"), tx);
            let (pb, errors) = (pb.clone(), Arc::clone(&errors));
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                while let Some(job) = rx.recv().await {
                    let o = engine.serve(&job).await;
                    if o.error.is_some() || o.mismatches > 0 {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                    pb.inc(1);
                    out.push(o);
                }
                let _ = engine.client.unregister().await;
                out
            }));
        }
    }
    cluster.router.wait_workers(senders.len(), Duration::from_secs(30)).await?;

    let http = reqwest::Client::new();
    let route_url = format!("{}/route", cluster.router.base());
    let sem = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let t0 = Instant::now();
    let first_ts = trace.first().map_or(0, |r| r.timestamp);
    let mut failure = None;
    for (idx, req) in trace.iter().enumerate() {
        if errors.load(Ordering::Relaxed) > cfg.max_errors {
            failure = Some(format!("stopped after {} failed requests", errors.load(Ordering::Relaxed)));
            break;
        }
        if cfg.speed > 0.0 {
            let at = Duration::from_secs_f64(req.timestamp.saturating_sub(first_ts) as f64 / 1e3 / cfg.speed);
            tokio::time::sleep_until((t0 + at).into()).await;
        }
        let permit = Arc::clone(&sem).acquire_owned().await.map_err(|e| e.to_string())?;
        let ids = Arc::new(req.hash_ids.clone());
        let tokens = Arc::new(request_tokens(&ids));
        let body = serde_json::json!({
            "namespace": NAMESPACE,
            "tokens": &*tokens,
            "explain": true,
            "split": false,
        });
        let r0 = Instant::now();
        let resp = http.post(&route_url).json(&body).send().await.map_err(|e| format!("POST /route: {e}"))?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.text().await.unwrap_or_default();
            failure = Some(format!("POST /route: {status}: {text}"));
            break;
        }
        let routed: Routed = resp.json().await.map_err(|e| format!("POST /route answer: {e}"))?;
        let route_us = us(r0);
        let Some(tx) = senders.get(&routed.worker) else {
            failure = Some(format!("the router chose {}, not an engine of this replay", routed.worker));
            break;
        };
        let best_candidate =
            routed.candidates.iter().map(|c| c.cached_blocks.iter().sum::<u32>()).max().unwrap_or_default();
        let job = Job {
            idx,
            ts_ms: req.timestamp,
            output_length: req.output_length,
            ids,
            tokens,
            route_id: routed.route_id,
            predicted: routed.cached_blocks,
            best_candidate,
            route_us,
            _permit: permit,
        };
        if tx.send(job).is_err() {
            failure = Some(format!("engine {} stopped", routed.worker));
            break;
        }
    }
    drop(senders);
    let mut outcomes = Vec::with_capacity(trace.len());
    for t in tasks {
        outcomes.extend(t.await.map_err(|e| format!("engine task: {e}"))?);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    pb.finish_and_clear();
    outcomes.sort_by_key(|o| o.idx);
    if let Some(f) = failure {
        let first: Vec<&str> = outcomes.iter().filter_map(|o| o.error.as_deref()).take(3).collect();
        return Err(format!("{f}; first errors: {first:?}"));
    }
    Ok(Driven { outcomes, wall_s, router_process: cluster.router.is_process() })
}
