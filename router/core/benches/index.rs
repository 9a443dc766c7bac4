//! The router index against NVIDIA Dynamo's (`dynamo-kv-router` 1.6.1 `RadixTree`, its default
//! KV indexer core) on the same event stream and the same queries, in one run: store rate
//! (blocks/s) building the index from empty, the steady-state rate (a new sequence stored while
//! the oldest is removed, the index staying at its size), lookup p50/p99 (per-worker overlap of a
//! 64-block prompt over 256 workers) and heap bytes per indexed block (a counting allocator around
//! the system one).
//!
//! ```text
//! cd router/bench-dynamo && cargo run --release -- --bench   # both, 1M blocks (own workspace)
//! cd router/bench-dynamo && cargo run --release -- --bench --blocks 4000000   # another size
//! cargo bench -p kvrouter-core --bench index                      # ours only
//! ```
//! Without `--bench` (as `cargo test --all-targets` runs it) it does a small smoke run. Each
//! store build prints its time and page faults to stderr; `KVBENCH_INDEX_REPS=n` sets how many
//! builds each side makes (3 with `--bench`; the fastest counts).
#![allow(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

use kvproto::events::key_from_u64;
use kvproto::{BlockKey, NamespaceId, TierKind};
use kvrouter_core::cost::{self, CandidateIn};
use kvrouter_core::index::{BlockIndex, Slot};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Minor page faults of this process so far (field 10 of /proc/self/stat; 0 where unreadable).
fn minflt() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it are plain.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    rest.split_whitespace().nth(7).and_then(|v| v.parse().ok()).unwrap_or(0)
}

const WORKERS: u64 = 256;
const SEQ_BLOCKS: usize = 64;
const SHARED_BLOCKS: usize = 16;
const GROUPS: u64 = 64;

/// One stored sequence: a worker, local hashes and chained sequence hashes.
struct Seq {
    worker: u64,
    #[cfg_attr(not(feature = "bench-dynamo"), allow(dead_code))]
    local: Vec<u64>,
    seq: Vec<u64>,
}

/// `n` sequences of 64 blocks: the first 16 shared within one of 64 groups (system prompts),
/// the other 48 unique; sequence `s` stored by worker `s % 256`.
fn stream(n: usize, seed: u64) -> Vec<Seq> {
    let mut rng = StdRng::seed_from_u64(seed);
    let shared: Vec<Vec<u64>> = (0..GROUPS).map(|_| (0..SHARED_BLOCKS).map(|_| rng.random()).collect()).collect();
    (0..n)
        .map(|s| {
            let mut local = shared[s % GROUPS as usize].clone();
            local.extend((SHARED_BLOCKS..SEQ_BLOCKS).map(|_| rng.random::<u64>()));
            let seed = kvproto::dynamo::DYNAMO_SEED;
            let mut parent = None;
            let seq = local
                .iter()
                .map(|l| {
                    let h = kvproto::dynamo::chain(parent, *l, seed);
                    parent = Some(h);
                    h
                })
                .collect();
            Seq { worker: s as u64 % WORKERS, local, seq }
        })
        .collect()
}

/// Store phases per side (fastest counts; the machine is shared and noisy): 3 with `--bench`.
fn reps() -> usize {
    if let Some(n) = std::env::var("KVBENCH_INDEX_REPS").ok().and_then(|v| v.parse().ok()) {
        return n;
    }
    if std::env::args().any(|a| a == "--bench") { 3 } else { 1 }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

struct Figures {
    store_blocks_per_s: f64,
    /// Steady state: each new sequence stored while the oldest one is removed (blocks stored +
    /// removed per second), the index staying at its size.
    churn_blocks_per_s: f64,
    lookup_p50_us: f64,
    lookup_p99_us: f64,
    bytes_per_block: f64,
    /// p50 / p99 over the queries of each query's best time over [`passes`] passes: the
    /// lookup's own cost. The slowest 1% of a single pass are other queries in each pass (the
    /// machine's interruptions, not the queries), so a single pass's p99 is mostly the machine's.
    lookup_best_p50_us: f64,
    lookup_best_p99_us: f64,
}

impl Figures {
    /// The figures of `seqs` sequences stored in `store` s, `churn` more each stored while the
    /// oldest went in `churned` s, lookups timed `lat` (one pass) and `best` (each query's best),
    /// `bytes_per_block` held.
    fn of(
        seqs: usize,
        store: f64,
        churn: usize,
        churned: f64,
        lat: &mut [f64],
        best: &mut [f64],
        bytes_per_block: f64,
    ) -> Self {
        Self {
            store_blocks_per_s: (seqs * SEQ_BLOCKS) as f64 / store,
            churn_blocks_per_s: (2 * churn * SEQ_BLOCKS) as f64 / churned,
            lookup_p50_us: pct(lat, 0.5),
            lookup_p99_us: pct(lat, 0.99),
            bytes_per_block,
            lookup_best_p50_us: pct(best, 0.5),
            lookup_best_p99_us: pct(best, 0.99),
        }
    }
}

/// Lookup passes over the query set: 5 with `--bench`, 1 otherwise.
fn passes() -> usize {
    if std::env::args().any(|a| a == "--bench") { 5 } else { 1 }
}

/// Asks every query `passes()` times; `ask(query, first)` answers it and returns the time it
/// took in us. Returns the first pass's times and each query's best.
fn time_queries(n: usize, mut ask: impl FnMut(usize, bool) -> f64) -> (Vec<f64>, Vec<f64>) {
    let mut first = Vec::with_capacity(n);
    let mut best = vec![f64::INFINITY; n];
    for pass in 0..passes() {
        for (q, b) in best.iter_mut().enumerate() {
            let us = ask(q, pass == 0);
            if pass == 0 {
                first.push(us);
            }
            *b = b.min(us);
        }
    }
    (first, best)
}

/// Our index built from empty; with `sized`, its namespace reserved for the blocks to come first
/// (a router configured with `expected_blocks`).
fn ours(seqs: &[Seq], churn: &[Seq], queries: &[usize], distinct: usize, sized: bool) -> (Figures, Vec<u32>) {
    let ns = NamespaceId([9; 16]);
    let to_keys = |v: &[Seq]| -> Vec<Vec<BlockKey>> {
        v.iter().map(|s| s.seq.iter().map(|h| key_from_u64(*h)).collect()).collect()
    };
    let keys = to_keys(seqs);
    let churn_keys = to_keys(churn);
    let mut store = f64::INFINITY;
    let mut bytes = 0.0;
    let mut ix = BlockIndex::new();
    for _ in 0..reps() {
        drop(ix);
        let before = live();
        ix = BlockIndex::new();
        if sized {
            ix.reserve(ns, distinct);
        }
        let (t0, f0) = (Instant::now(), minflt());
        for (s, k) in seqs.iter().zip(&keys) {
            ix.store(ns, None, k, Slot::new(s.worker as u32 + 1, TierKind::G1Gpu));
        }
        let t = t0.elapsed().as_secs_f64();
        eprintln!(
            "  ours{} store rep: {:.1} ms, {} page faults",
            if sized { " (sized)" } else { "" },
            t * 1e3,
            minflt() - f0
        );
        store = store.min(t);
        bytes = (live() - before) as f64;
    }
    assert_eq!(ix.blocks(), distinct);
    println!(
        "kvrouter_index_bytes estimate {:.1} bytes/block vs {:.1} counted by the allocator",
        ix.approx_bytes() as f64 / distinct as f64,
        bytes / distinct as f64
    );
    // Each worker on its own node (holder 1000 + w), as the router builds candidates.
    let cands: Vec<CandidateIn> = (0..WORKERS as u32)
        .map(|w| CandidateIn {
            worker_holder: w + 1,
            node_holder: 1000 + w,
            kv_utilisation: 0.0,
            active: 0.0,
            fill: 0.0,
        })
        .collect();
    let mut scratch = cost::MatchScratch::default();
    let mut sums = vec![];
    let (mut lat, mut best) = time_queries(queries.len(), |i, first| {
        let t = Instant::now();
        let m = cost::match_candidates(&cands, &mut scratch, |visit| {
            ix.walk(ns, &keys[queries[i]], |_, len, slots| visit(len as u32, slots));
        });
        let us = t.elapsed().as_secs_f64() * 1e6;
        if first {
            sums.push(m.iter().map(|m| m.prefix()).sum());
        }
        us
    });
    let slot = |s: &Seq| Slot::new(s.worker as u32 + 1, TierKind::G1Gpu);
    let t0 = Instant::now();
    for (i, (s, k)) in churn.iter().zip(&churn_keys).enumerate() {
        ix.store(ns, None, k, slot(s));
        ix.remove(Some(ns), &keys[i], slot(&seqs[i]));
    }
    let churned = t0.elapsed().as_secs_f64();
    let all: Vec<&Vec<BlockKey>> = keys.iter().chain(&churn_keys).collect();
    for q in queries {
        let m = cost::match_candidates(&cands, &mut scratch, |visit| {
            ix.walk(ns, all[*q + churn.len()], |_, len, slots| visit(len as u32, slots));
        });
        sums.push(m.iter().map(|m| m.prefix()).sum());
    }
    let figures = Figures::of(seqs.len(), store, churn.len(), churned, &mut lat, &mut best, bytes / distinct as f64);
    (figures, sums)
}

#[cfg(feature = "bench-dynamo")]
fn dynamo(seqs: &[Seq], churn: &[Seq], queries: &[usize], distinct: usize) -> (Figures, Vec<u32>) {
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    };
    use dynamo_kv_router::radix_tree::RadixTree;
    let stored = |seqs: &[Seq], first_id: usize| -> Vec<RouterEvent> {
        seqs.iter()
            .enumerate()
            .map(|(i, s)| {
                let blocks = s
                    .local
                    .iter()
                    .zip(&s.seq)
                    .map(|(l, h)| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(*h),
                        tokens_hash: LocalBlockHash(*l),
                        mm_extra_info: None,
                    })
                    .collect();
                let data = KvCacheStoreData { parent_hash: None, start_position: None, blocks };
                RouterEvent::new(
                    s.worker,
                    KvCacheEvent { event_id: (first_id + i) as u64, data: KvCacheEventData::Stored(data), dp_rank: 0 },
                )
            })
            .collect()
    };
    let events = stored(seqs, 0);
    let queries_local: Vec<Vec<LocalBlockHash>> =
        queries.iter().map(|q| seqs[*q].local.iter().map(|l| LocalBlockHash(*l)).collect()).collect();
    let mut store = f64::INFINITY;
    let mut naive = 0.0;
    let mut tree = RadixTree::new();
    for _ in 0..reps() {
        drop(tree);
        let events = events.clone();
        let before = live();
        tree = RadixTree::new();
        let (t0, f0) = (Instant::now(), minflt());
        for e in events {
            tree.apply_event(e).unwrap();
        }
        let t = t0.elapsed().as_secs_f64();
        eprintln!("  dynamo store rep: {:.1} ms, {} page faults", t * 1e3, minflt() - f0);
        store = store.min(t);
        // `apply_event` consumes the events, whose block vectors are freed inside the timed loop:
        // `live() - before` nets them out of the tree's size. Count what dropping the tree frees.
        naive = (live() - before) as f64;
    }
    let mut sums = vec![];
    let (mut lat, mut best) = time_queries(queries_local.len(), |i, first| {
        let q = queries_local[i].clone(); // find_matches takes the query by value
        let t = Instant::now();
        let m = tree.find_matches(q, false);
        let us = t.elapsed().as_secs_f64() * 1e6;
        if first {
            sums.push(m.scores.values().sum());
        }
        us
    });
    let with_tree = live();
    let mut churn_events = Vec::with_capacity(2 * churn.len());
    for (i, (new, old)) in stored(churn, seqs.len()).into_iter().zip(seqs).enumerate() {
        churn_events.push(new);
        let block_hashes = old.seq.iter().map(|h| ExternalSequenceBlockHash(*h)).collect();
        let data = KvCacheEventData::Removed(KvCacheRemoveData { block_hashes });
        let id = (seqs.len() + churn.len() + i) as u64;
        churn_events.push(RouterEvent::new(old.worker, KvCacheEvent { event_id: id, data, dp_rank: 0 }));
    }
    let t0 = Instant::now();
    for e in churn_events {
        tree.apply_event(e).unwrap();
    }
    let churned = t0.elapsed().as_secs_f64();
    for q in queries {
        // The live sequences are now seqs[churn.len()..] followed by churn.
        let i = *q + churn.len();
        let s = if i < seqs.len() { &seqs[i] } else { &churn[i - seqs.len()] };
        let local = s.local.iter().map(|l| LocalBlockHash(*l)).collect();
        sums.push(tree.find_matches(local, false).scores.values().sum());
    }
    drop(tree);
    let bytes = (with_tree - live()) as f64;
    println!(
        "dynamo RadixTree: {:.1} bytes/block freed by dropping it ({:.1} by live() - before, which nets out the consumed events)",
        bytes / distinct as f64,
        naive / distinct as f64
    );
    let figures = Figures::of(seqs.len(), store, churn.len(), churned, &mut lat, &mut best, bytes / distinct as f64);
    (figures, sums)
}

/// The overlaps a correct index gives: per query, the sum over workers of the blocks of the
/// query's prefix that the worker holds, from a set of (worker, block) pairs that applies the
/// same events (stores add, removals take away), before and after the churn.
fn model_sums(seqs: &[Seq], churn: &[Seq], queries: &[usize]) -> Vec<u32> {
    use std::collections::HashSet;
    let mut held: HashSet<(u64, u64)> = seqs.iter().flat_map(|s| s.seq.iter().map(|h| (s.worker, *h))).collect();
    let overlap = |held: &HashSet<(u64, u64)>, q: &Seq| -> u32 {
        (0..WORKERS).map(|w| q.seq.iter().take_while(|h| held.contains(&(w, **h))).count() as u32).sum()
    };
    let mut sums: Vec<u32> = queries.iter().map(|q| overlap(&held, &seqs[*q])).collect();
    for (new, old) in churn.iter().zip(seqs) {
        held.extend(new.seq.iter().map(|h| (new.worker, *h)));
        for h in &old.seq {
            held.remove(&(old.worker, *h));
        }
    }
    let live: Vec<&Seq> = seqs.iter().chain(churn).collect();
    sums.extend(queries.iter().map(|q| overlap(&held, live[*q + churn.len()])));
    sums
}

/// Both indexes answer the same question: total matched blocks over all workers per query,
/// before and after the churn. Ours must give the model's answer to every query (checked after
/// the timed phases, so that the model's memory does not change what the allocator hands out
/// to them).
fn check_overlaps(ours: &[u32], seqs: &[Seq], churn: &[Seq], queries: &[usize]) {
    assert_eq!(ours, model_sums(seqs, churn, queries), "the index disagrees with the model on overlaps");
}

fn print(name: &str, f: &Figures) {
    println!(
        "{name:<28} {:>14.0} {:>14.0} {:>12.2} {:>12.2} {:>14.1} {:>12.2} {:>12.2}",
        f.store_blocks_per_s,
        f.churn_blocks_per_s,
        f.lookup_p50_us,
        f.lookup_p99_us,
        f.bytes_per_block,
        f.lookup_best_p50_us,
        f.lookup_best_p99_us
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let full = args.iter().any(|a| a == "--bench");
    // `--blocks N`: the index size (distinct blocks) to measure at; 1M by default.
    let blocks = args
        .iter()
        .position(|a| a == "--blocks")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1_000_000)
        .max(GROUPS as usize * SHARED_BLOCKS + SEQ_BLOCKS);
    // 64 groups x 16 shared + n x 48 unique.
    let n = if full { (blocks - (GROUPS as usize * SHARED_BLOCKS)) / (SEQ_BLOCKS - SHARED_BLOCKS) } else { 500 };
    // Then as many sequences again, each stored while the oldest is removed: the index is
    // replaced once over at its size.
    let c = n;
    let all = stream(n + c, 42);
    let (seqs, churn) = all.split_at(n);
    let distinct = (GROUPS as usize).min(n) * SHARED_BLOCKS + n * (SEQ_BLOCKS - SHARED_BLOCKS);
    let mut rng = StdRng::seed_from_u64(7);
    let queries: Vec<usize> = (0..if full { 20_000 } else { 200 }).map(|_| rng.random_range(0..n)).collect();
    println!(
        "index bench: {} events, {} stored blocks, {distinct} distinct blocks, {WORKERS} workers, {} queries of {SEQ_BLOCKS} blocks",
        n,
        n * SEQ_BLOCKS,
        queries.len()
    );
    println!(
        "{:<28} {:>14} {:>14} {:>12} {:>12} {:>14} {:>12} {:>12}",
        "index",
        "store blk/s",
        "churn blk/s",
        "lookup p50us",
        "lookup p99us",
        "bytes/block",
        "best p50us",
        "best p99us"
    );
    let (a, sums_a) = ours(seqs, churn, &queries, distinct, false);
    print("kvrouter BlockIndex", &a);
    let (sized, sums_sized) = ours(seqs, churn, &queries, distinct, true);
    print("  ..with expected_blocks", &sized);
    assert_eq!(sums_a, sums_sized, "a sized index answers as the grown one");
    #[cfg(feature = "bench-dynamo")]
    {
        let (b, sums_b) = dynamo(seqs, churn, &queries, distinct);
        print("dynamo-kv-router RadixTree", &b);
        check_overlaps(&sums_a, seqs, churn, &queries);
        let truth = model_sums(seqs, churn, &queries);
        let differ = sums_b.iter().zip(&truth).filter(|(d, t)| d != t).count();
        if differ > 0 {
            println!(
                "dynamo-kv-router's overlaps differ from the model's in {differ} of {} queries (ours: in none)",
                truth.len()
            );
        }
        for (label, ours) in [("ratios (ours / dynamo)", &a), ("  with expected_blocks", &sized)] {
            println!(
                "{label}: store {:.2}x, churn {:.2}x, p50 {:.2}, p99 {:.2}, bytes/block {:.2}, best p50 {:.2}, best p99 {:.2}",
                ours.store_blocks_per_s / b.store_blocks_per_s,
                ours.churn_blocks_per_s / b.churn_blocks_per_s,
                ours.lookup_p50_us / b.lookup_p50_us,
                ours.lookup_p99_us / b.lookup_p99_us,
                ours.bytes_per_block / b.bytes_per_block,
                ours.lookup_best_p50_us / b.lookup_best_p50_us,
                ours.lookup_best_p99_us / b.lookup_best_p99_us
            );
        }
    }
    #[cfg(not(feature = "bench-dynamo"))]
    {
        check_overlaps(&sums_a, seqs, churn, &queries);
        println!("(router/bench-dynamo runs this side by side with dynamo-kv-router 1.6.1)");
    }
}
