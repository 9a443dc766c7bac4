//! The soak's engines and the latency recorder they write to.
//!
//! A prompt `p` has 2-12 blocks of 16 tokens; its first 1-3 blocks are those of its family
//! (`p % families`: eight prompts a family on average), the rest its own, so prompts share
//! prefixes as chat turns and system prompts do. A block's KV carries a 32-byte stamp at the
//! start of each of its segments (one per layer and K/V), derived from what the block's tokens
//! are: after every load the stamps of the blocks loaded are checked, so a block served for
//! another key is counted (`wrong_blocks`; the run fails on one).

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvclient::{Client, KvMemory};
use kvproto::Namespace;
use kvproto::pb::load_status::State;

/// The operations whose latency is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `POST /route` to the router.
    Route,
    Lookup,
    /// A load, waited for (`load_now`).
    Load,
    Save,
    /// Unregister and register again on the same connection.
    Register,
    /// A new connection and a registration on it.
    Reconnect,
}

/// Every [`Op`] with its name in the CSV and the report.
pub const OPS: [(Op, &str); 6] = [
    (Op::Route, "route"),
    (Op::Lookup, "lookup"),
    (Op::Load, "load"),
    (Op::Save, "save"),
    (Op::Register, "register"),
    (Op::Reconnect, "reconnect"),
];

/// Latencies in microseconds, per operation: those of the current interval, and all of them.
#[derive(Debug, Default)]
pub struct Recorder {
    interval: [Mutex<Vec<u32>>; 6],
    all: [Mutex<Vec<u32>>; 6],
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Recorder {
    pub fn record(&self, op: Op, d: Duration) {
        let us = u32::try_from(d.as_micros()).unwrap_or(u32::MAX);
        lock(&self.interval[op as usize]).push(us);
    }

    /// The samples since the last call, per operation (sorted); they join [`Recorder::all`].
    pub fn drain(&self) -> [Vec<u32>; 6] {
        std::array::from_fn(|i| {
            let mut v = std::mem::take(&mut *lock(&self.interval[i]));
            v.sort_unstable();
            lock(&self.all[i]).extend_from_slice(&v);
            v
        })
    }

    /// Every sample drained so far, per operation (sorted).
    pub fn all(&self) -> [Vec<u32>; 6] {
        std::array::from_fn(|i| {
            let mut v = lock(&self.all[i]).clone();
            v.sort_unstable();
            v
        })
    }
}

/// Counts over the whole run.
#[derive(Debug, Default)]
pub struct Counters {
    /// Lookups answered (each request is one).
    pub requests: AtomicU64,
    /// Requests routed through `POST /route` first.
    pub routed: AtomicU64,
    /// Calls that failed (the engine then connects again).
    pub errors: AtomicU64,
    /// Blocks loaded whose stamp was not the one their tokens give.
    pub wrong_blocks: AtomicU64,
    /// Blocks loaded and checked.
    pub checked_blocks: AtomicU64,
    /// Loads that brought fewer blocks than the lookup before them found (evicted meanwhile).
    pub short_loads: AtomicU64,
    pub saved_blocks: AtomicU64,
    /// Blocks a save could not store (`SaveResponse::failed`).
    pub save_failed_blocks: AtomicU64,
    /// Blocks asked for by lookups, and the cached prefix found.
    pub looked_blocks: AtomicU64,
    pub hit_blocks: AtomicU64,
    pub reregisters: AtomicU64,
    pub reconnects: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// splitmix64.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Blocks of prompt `p` (2-12).
fn prompt_blocks(p: u32) -> u32 {
    2 + (mix(u64::from(p) ^ 0xb10c) % 11) as u32
}

/// What block `b` of prompt `p` is: its family's block for the first 1-3, its own after.
fn block_id(p: u32, b: u32, families: u32) -> u64 {
    let f = p % families;
    if b < 1 + f % 3 { (1 << 40) | u64::from(f) } else { u64::from(p) }
}

fn prompt_tokens(p: u32, families: u32, tpb: u32) -> Vec<u32> {
    let n = prompt_blocks(p);
    let mut t = Vec::with_capacity((n * tpb) as usize);
    for b in 0..n {
        let id = block_id(p, b, families);
        for i in 0..tpb {
            t.push((mix(id.wrapping_mul(1_000_003) ^ (u64::from(b) << 20) ^ u64::from(i)) % 128_000) as u32);
        }
    }
    t
}

/// The stamp of segment `seg` of block `b` of a prompt whose block is `id`.
fn stamp(id: u64, b: u32, seg: usize) -> [u8; 32] {
    let mut s = [0u8; 32];
    s[..8].copy_from_slice(&id.to_le_bytes());
    s[8..16].copy_from_slice(&u64::from(b).to_le_bytes());
    s[16..24].copy_from_slice(&(seg as u64).to_le_bytes());
    s[24..].copy_from_slice(&mix(id ^ (u64::from(b) << 48) ^ seg as u64).to_le_bytes());
    s
}

/// Writes block `b`'s stamps into `slot` (`None`: zeroes them).
fn write_stamps(mem: &mut KvMemory, slot: u32, id_b: Option<(u64, u32)>) {
    for (seg, r) in mem.block_ranges(slot).into_iter().enumerate() {
        let s = id_b.map_or([0u8; 32], |(id, b)| stamp(id, b, seg));
        mem.bytes_mut()[r.start..r.start + 32].copy_from_slice(&s);
    }
}

fn stamps_match(mem: &KvMemory, slot: u32, id: u64, b: u32) -> bool {
    mem.block_ranges(slot)
        .into_iter()
        .enumerate()
        .all(|(seg, r)| mem.bytes()[r.start..r.start + 32] == stamp(id, b, seg))
}

/// The router's answer, as far as the soak needs it.
#[derive(Debug, serde::Deserialize)]
struct Routed {
    route_id: u64,
}

/// The sum of every sample of `series` (a prefix of metric lines) in a Prometheus text.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// One engine of the soak.
#[derive(Debug, Clone)]
pub struct Engine {
    pub index: usize,
    pub socket: PathBuf,
    /// Where even-numbered engines put their KV memory as named files (odd ones use memfds).
    pub shm: PathBuf,
    pub route_url: String,
    pub prompts: u32,
    pub think: Duration,
    pub seed: u64,
}

/// Slots of each engine: the longest prompt's blocks.
const SLOTS: u32 = 12;
/// Errors printed per engine (all are counted).
const PRINTED_ERRORS: u64 = 5;

impl Engine {
    fn name(&self) -> String {
        format!("engine-{}", self.index)
    }

    fn memory(&self, generation: u32) -> Result<KvMemory, String> {
        let l = super::layout();
        let m = if self.index.is_multiple_of(2) {
            KvMemory::create_layer_separate(self.shm.join(format!("{}-{generation}", self.name())), &l, SLOTS)
        } else {
            KvMemory::anonymous(&l, SLOTS)
        };
        m.map_err(|e| format!("engine memory: {e}"))
    }

    async fn register(&self, c: &Client, mem: &KvMemory) -> Result<(), String> {
        let ns = Namespace::new(super::MODEL_ID, super::layout());
        let address = format!("soak://{}", self.name());
        c.register_worker(&self.name(), &ns, mem, &address, "both").await.map_err(|e| format!("register: {e}"))?;
        Ok(())
    }

    async fn connect(&self, mem: &KvMemory) -> Result<Client, String> {
        let c = Client::connect(&self.socket).await.map_err(|e| format!("connect: {e}"))?;
        self.register(&c, mem).await?;
        Ok(c)
    }

    fn error(&self, counters: &Counters, e: &str) {
        let n = counters.errors.fetch_add(1, Ordering::Relaxed);
        if n < PRINTED_ERRORS * 4 {
            eprintln!("kvbench soak: {}: {e}", self.name());
        }
    }

    /// Requests until `stop`; unregisters at the end.
    pub async fn run(self, rec: &Recorder, counters: &Counters, stop: &AtomicBool) {
        let mut rng = Rng(self.seed);
        let http = reqwest::Client::new();
        let mut generation = 0u32;
        let mut mem: Option<KvMemory> = None;
        let mut client: Option<Client> = None;
        while !stop.load(Ordering::Relaxed) {
            if mem.is_none() {
                generation += 1;
                match self.memory(generation) {
                    Ok(m) => mem = Some(m),
                    Err(e) => {
                        self.error(counters, &e);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            let Some(m) = mem.as_mut() else { continue };
            if client.is_none() {
                let t0 = Instant::now();
                match self.connect(m).await {
                    Ok(c) => {
                        rec.record(Op::Reconnect, t0.elapsed());
                        client = Some(c);
                    }
                    Err(e) => {
                        self.error(counters, &e);
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            let Some(c) = client.as_ref() else { continue };
            // Popularity skewed towards low prompt numbers (u^2).
            let p = ((f64::from(self.prompts) * rng.unit().powi(2)) as u32).min(self.prompts - 1);
            let routed = rng.below(4) == 0;
            if let Err(e) = self.request(c, m, p, routed, &http, rec, counters).await {
                self.error(counters, &e);
                client = None;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            // Churn: about 1 request in 250 re-registers, 1 in 500 drops the connection (half
            // of those without unregistering; half of those with new KV memory too).
            match rng.below(1000) {
                0..=3 => {
                    let t0 = Instant::now();
                    let r = match c.unregister().await {
                        Ok(()) => self.register(c, m).await,
                        Err(e) => Err(format!("unregister: {e}")),
                    };
                    match r {
                        Ok(()) => {
                            rec.record(Op::Register, t0.elapsed());
                            add(&counters.reregisters, 1);
                        }
                        Err(e) => {
                            self.error(counters, &e);
                            client = None;
                        }
                    }
                }
                4 | 5 => {
                    if rng.below(2) == 0
                        && let Err(e) = c.unregister().await
                    {
                        self.error(counters, &format!("unregister: {e}"));
                    }
                    client = None;
                    if rng.below(2) == 0 {
                        mem = None;
                    }
                    add(&counters.reconnects, 1);
                }
                _ => {}
            }
            tokio::time::sleep(self.think).await;
        }
        if let Some(c) = client {
            let _ = c.unregister().await;
        }
    }

    /// One request: (route,) lookup, load the cached prefix and check it, save the rest.
    #[allow(clippy::too_many_arguments)]
    async fn request(
        &self,
        c: &Client,
        mem: &mut KvMemory,
        p: u32,
        routed: bool,
        http: &reqwest::Client,
        rec: &Recorder,
        counters: &Counters,
    ) -> Result<(), String> {
        let families = (self.prompts / 8).max(1);
        let tpb = super::layout().tokens_per_block;
        let n = prompt_blocks(p);
        let tokens = prompt_tokens(p, families, tpb);
        let t0 = Instant::now();
        let hit = if routed {
            let body = serde_json::json!({ "namespace": super::NAMESPACE, "tokens": &tokens, "split": false });
            let resp = http.post(&self.route_url).json(&body).send().await.map_err(|e| format!("POST /route: {e}"))?;
            if !resp.status().is_success() {
                let s = resp.status();
                return Err(format!("POST /route: {s}: {}", resp.text().await.unwrap_or_default()));
            }
            let r: Routed = resp.json().await.map_err(|e| format!("POST /route answer: {e}"))?;
            rec.record(Op::Route, t0.elapsed());
            add(&counters.routed, 1);
            let t1 = Instant::now();
            let hit = c.lookup_routed(&tokens, r.route_id, 0).await.map_err(|e| format!("lookup: {e}"))?;
            rec.record(Op::Lookup, t1.elapsed());
            hit
        } else {
            let hit = c.lookup(&tokens).await.map_err(|e| format!("lookup: {e}"))?;
            rec.record(Op::Lookup, t0.elapsed());
            hit
        };
        add(&counters.requests, 1);
        let m = hit.matched_blocks.min(n);
        add(&counters.looked_blocks, u64::from(n));
        add(&counters.hit_blocks, u64::from(m));
        let slots: Vec<u32> = (0..n).collect();
        let mut have = 0;
        if m > 0 {
            for s in 0..m {
                write_stamps(mem, s, None);
            }
            let t0 = Instant::now();
            let st = c.load_now(&tokens, 0, &slots[..m as usize]).await.map_err(|e| format!("load: {e}"))?;
            rec.record(Op::Load, t0.elapsed());
            if st.state == State::Failed as i32 {
                return Err(format!("load failed: {}", st.error));
            }
            have = st.loaded_blocks.min(m);
            if have < m {
                add(&counters.short_loads, 1);
            }
            for b in 0..have {
                if !stamps_match(mem, b, block_id(p, b, families), b) {
                    let w = counters.wrong_blocks.fetch_add(1, Ordering::Relaxed);
                    if w < PRINTED_ERRORS {
                        eprintln!("kvbench soak: {}: WRONG BYTES in block {b} of prompt {p}", self.name());
                    }
                }
            }
            add(&counters.checked_blocks, u64::from(have));
        }
        if have < n {
            // "Prefill" the rest, then save it.
            for b in have..n {
                write_stamps(mem, b, Some((block_id(p, b, families), b)));
            }
            let t0 = Instant::now();
            let r = c.save(&tokens, have, &slots[have as usize..]).await.map_err(|e| format!("save: {e}"))?;
            rec.record(Op::Save, t0.elapsed());
            add(&counters.saved_blocks, u64::from(r.stored));
            add(&counters.save_failed_blocks, u64::from(r.failed));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_share_their_family_blocks_only() {
        let f = 100;
        // Family 4 shares 2 blocks (1 + 4 % 3); two of its prompts with 3 blocks or more, and
        // one of family 6.
        let mut fam4 = (0..).map(|k| 4 + k * f).filter(|&p| prompt_blocks(p) >= 3);
        let (p, q) = (fam4.next().unwrap_or(0), fam4.next().unwrap_or(0));
        let (a, b, c) = (prompt_tokens(p, f, 16), prompt_tokens(q, f, 16), prompt_tokens(6, f, 16));
        assert_eq!(a[..32], b[..32]);
        assert_ne!(a[32..48], b[32..48]);
        assert_ne!(a[..16], c[..16]);
        assert_eq!(block_id(p, 1, f), block_id(q, 1, f));
        assert_ne!(block_id(p, 2, f), block_id(q, 2, f));
        assert!((0..1000).map(prompt_blocks).all(|n| (2..=12).contains(&n)));
    }

    #[test]
    fn stamps_are_checked() {
        let mut m = KvMemory::anonymous(&super::super::layout(), 2).expect("memfd");
        write_stamps(&mut m, 1, Some((7, 3)));
        assert!(stamps_match(&m, 1, 7, 3));
        assert!(!stamps_match(&m, 1, 8, 3));
        assert!(!stamps_match(&m, 0, 7, 3));
    }
}
