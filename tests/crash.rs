//! Crash loops of the real daemon: the `kvcached` binary (as `CARGO_BIN_EXE_daemon`, the same
//! `kvcached::cli::main`) with G3, two engines saving and loading under load and a third
//! checking, killed with SIGKILL at a random moment, cycle after cycle, and started again on the
//! same directories. Every block served, during the load and after each restart, is checked byte
//! for byte against the oracle (`kvtests::oracle`: engines know what they saved). After each
//! restart:
//! - G3 reopens without repair (no unusable index records) and holds at least every block it
//!   had made visible (indexed) before the kill;
//! - the prompts saved in the life that ended are loaded: what was written through is served,
//!   what was still only in G2 is counted as lost (a kill loses what was not yet on disk);
//! - prompts checked in earlier cycles still serve every block they served then;
//! - the engines, never re-created, reconnect and re-register by themselves.
//!
//! One cycle in five kills the daemon again right after it starts (a crash during or just after
//! recovery). The short version (10 cycles of 1-3.5 s) runs in the test command; the long one:
//! `KVCACHED_CRASH_CYCLES=100 cargo test -p kvtests --test crash -- --nocapture` (its last result:
//! docs/operations/health.md). `KVCACHED_CRASH_SEED` replays a run's timings.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvtests::node::{Node, g3_toml};
use kvtests::oracle::{Engine, ns};
// No lock is held across an await.
use std::sync::Mutex;

const G3_WRITTEN: &str = "kvcached_writethrough_blocks_total{tier=\"g3\"}";
const G3_BLOCKS: &str = "kvcached_tier_blocks{tier=\"g3\"}";
const G3_EVICTIONS: &str = "kvcached_tier_evictions_total{tier=\"g3\"}";
const G3_CHECKSUM: &str = "kvcached_tier_checksum_failures_total{tier=\"g3\"}";
/// Engines saving and loading under load (besides the checking one).
const WORKERS: usize = 2;
/// Old prompts checked again after each restart (all of them after the last).
const RECHECK: usize = 64;

/// xorshift64: the run's timings follow from one seed, printed, so that a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A prompt an engine saved (or tried to).
#[derive(Debug, Clone, Copy)]
struct Saved {
    seed: u64,
    blocks: u32,
    /// The daemon's life (restarts so far) when the save answered.
    life: u32,
    /// The save answered with every block stored.
    acked: bool,
    /// Blocks served by the first check after the life ended; every later check must serve as
    /// many.
    durable: Option<u32>,
}

#[derive(Default)]
struct Shared {
    saved: Mutex<Vec<Saved>>,
    life: AtomicU32,
    stop: AtomicBool,
    /// Blocks checked and found wrong by the engines under load.
    checked: AtomicU64,
    wrong: AtomicU64,
    /// Calls that failed (a call in flight when the daemon died, or made while it was down and
    /// not recovered within the client's reconnect window).
    errors: AtomicU64,
    /// Per worker: the last life in which one of its calls succeeded.
    alive_in: [AtomicU32; WORKERS],
    /// The first wrong block seen by a worker.
    first_wrong: Mutex<Option<String>>,
}

/// An engine under load: saves new prompts of 4-12 blocks and loads (and checks) earlier ones,
/// never re-created whatever happens to the daemon.
async fn worker(id: usize, mut e: Engine, sh: Arc<Shared>, seed: u64) {
    let mut rng = Rng(seed | 1);
    let mut n = 0u64;
    while !sh.stop.load(Ordering::Relaxed) {
        let seed = (id as u64 + 1) * 10_000_000 + n;
        n += 1;
        let blocks = 4 + rng.below(9) as u32;
        let r = e.save(seed, blocks, 0).await;
        let life = sh.life.load(Ordering::SeqCst);
        let acked = matches!(&r, Ok(r) if r.stored + r.already_present == blocks);
        if r.is_ok() {
            sh.alive_in[id].store(life, Ordering::SeqCst);
        } else {
            sh.errors.fetch_add(1, Ordering::Relaxed);
        }
        let pick = {
            let mut saved = sh.saved.lock().unwrap();
            saved.push(Saved { seed, blocks, life, acked, durable: None });
            let i = rng.below(saved.len() as u64) as usize;
            saved[i]
        };
        match e.load_checked(pick.seed, pick.blocks, 16).await {
            Ok((c, st)) => {
                sh.alive_in[id].store(sh.life.load(Ordering::SeqCst), Ordering::SeqCst);
                sh.checked.fetch_add(u64::from(c.loaded), Ordering::Relaxed);
                if c.wrong > 0 {
                    sh.wrong.fetch_add(u64::from(c.wrong), Ordering::Relaxed);
                    sh.first_wrong.lock().unwrap().get_or_insert(format!("prompt {pick:?}: {st:?}"));
                }
            }
            Err(_) => {
                sh.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(Duration::from_millis(20 + rng.below(20))).await;
    }
}

/// What the checks after restarts found.
#[derive(Debug, Default)]
struct Tally {
    checked: u64,
    wrong: u64,
    /// Blocks of acked prompts checked for the first time after their life ended, and of those
    /// the ones not served (not yet written through when the daemon died).
    acked: u64,
    lost: u64,
}

/// Loads (into the checker's slots) and checks every prompt of `which`; records first checks.
async fn check(v: &mut Engine, sh: &Shared, which: &[usize], life: u32, t: &mut Tally) {
    for &i in which {
        let p = sh.saved.lock().unwrap()[i];
        let (c, st) = v.load_checked(p.seed, p.blocks, 0).await.unwrap();
        t.checked += u64::from(c.loaded);
        t.wrong += u64::from(c.wrong);
        assert_eq!(c.wrong, 0, "wrong bytes served for {p:?} after restart {life}: {st:?}");
        match p.durable {
            Some(d) => assert!(c.loaded >= d, "{p:?} served {d} blocks once, {} now: {st:?}", c.loaded),
            None if p.life < life => {
                sh.saved.lock().unwrap()[i].durable = Some(c.loaded);
                if p.acked {
                    t.acked += u64::from(p.blocks);
                    t.lost += u64::from(p.blocks - c.loaded);
                }
            }
            None => {}
        }
    }
}

/// `blocks=N` of the log's "G3 opened" line, if G3 opened.
fn recovered(log: &str) -> Option<u64> {
    let line = log.lines().find(|l| l.contains("G3 opened"))?;
    let n = line.split("blocks=").nth(1).and_then(|r| r.split_whitespace().next());
    Some(n.and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("no block count in {line:?}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_random_moments_under_load() {
    let cycles: u32 = std::env::var("KVCACHED_CRASH_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(10);
    let seed: u64 = std::env::var("KVCACHED_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("crash loop: {cycles} cycles, KVCACHED_CRASH_SEED={seed}");
    let mut rng = Rng(seed | 1);
    let d = tempfile::tempdir().unwrap();
    // Room for every block of the run without eviction (~20 MiB a cycle here), so that "every
    // block G3 made visible survives" holds exactly. No fdatasync: a SIGKILL loses nothing the
    // kernel took.
    let capacity = (64u64 << 20) + u64::from(cycles) * (32 << 20);
    let toml = g3_toml(&d.path().join("g3"), capacity, false);
    let mut n = Node::start(Path::new(env!("CARGO_BIN_EXE_daemon")), d.path(), &toml, &[]);
    let namespace = ns("crash/model");
    let sh = Arc::new(Shared::default());
    let mut tasks = Vec::new();
    for id in 0..WORKERS {
        let e = Engine::attach(&n.socket(), &format!("w{id}"), &namespace, 32).await.unwrap();
        tasks.push(tokio::spawn(worker(id, e, Arc::clone(&sh), rng.next())));
    }
    let mut v = Engine::attach(&n.socket(), "checker", &namespace, 16).await.unwrap();
    let (mut t, mut written, mut early, mut restarts) = (Tally::default(), 0.0, 0u32, 0u32);
    let started = Instant::now();

    for cycle in 1..=cycles {
        tokio::time::sleep(Duration::from_millis(1000 + rng.below(2500))).await;
        // What G3 holds visibly now must all be there after the restart.
        let (visible, wrote) = (n.d().metric(G3_BLOCKS) as u64, n.d().metric(G3_WRITTEN));
        assert!(visible > 0, "cycle {cycle}: nothing reached G3\n{}", n.d().log());
        assert_eq!(n.d().metric(G3_EVICTIONS), 0.0, "G3 evicted: the run outgrew its capacity");
        assert_eq!(n.d().metric(G3_CHECKSUM), 0.0, "a G3 block failed verification\n{}", n.d().log());
        n.kill9();
        sh.life.fetch_add(1, Ordering::SeqCst);
        written += wrote;
        restarts += 1;
        if rng.below(5) == 0 {
            n.start_again_unready();
            // Killed again while it recovers or right after.
            tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
            let log = n.kill9();
            // Killed before G3 opened, or after: then it had everything.
            assert!(recovered(&log).is_none_or(|b| b >= visible), "{log}");
            sh.life.fetch_add(1, Ordering::SeqCst);
            early += 1;
            restarts += 1;
        }
        n.start_again();
        let log = n.d().log();
        let back = recovered(&log).unwrap_or_else(|| panic!("G3 did not open\n{log}"));
        assert!(back >= visible, "cycle {cycle}: G3 had {visible} blocks visible before the kill, {back} after\n{log}");
        assert!(!log.contains("unusable records"), "cycle {cycle}: G3 needed repair\n{log}");

        // The prompts of the life that ended, and a sample of older ones.
        let life = sh.life.load(Ordering::SeqCst);
        let (fresh, old): (Vec<usize>, Vec<usize>) = {
            let saved = sh.saved.lock().unwrap();
            (0..saved.len()).filter(|&i| saved[i].life < life).partition(|&i| saved[i].durable.is_none())
        };
        let sample: Vec<usize> =
            (0..RECHECK.min(old.len())).map(|_| old[rng.below(old.len() as u64) as usize]).collect();
        check(&mut v, &sh, &fresh, life, &mut t).await;
        check(&mut v, &sh, &sample, life, &mut t).await;

        // The engines came back by themselves.
        let deadline = Instant::now() + Duration::from_secs(30);
        while sh.alive_in.iter().any(|a| a.load(Ordering::SeqCst) < life) {
            assert!(Instant::now() < deadline, "cycle {cycle}: an engine did not reconnect\n{}", n.d().log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        eprintln!(
            "cycle {cycle}: G3 {back} blocks after the restart ({visible} visible before), {} prompts checked",
            fresh.len() + sample.len()
        );
    }

    sh.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    // Everything, once more, against the last daemon.
    let life = sh.life.load(Ordering::SeqCst);
    let all: Vec<usize> = (0..sh.saved.lock().unwrap().len()).collect();
    check(&mut v, &sh, &all, life, &mut t).await;
    let saved = sh.saved.lock().unwrap().clone();
    let served: u64 = saved.iter().filter_map(|p| p.durable).map(u64::from).sum();
    let under_load = sh.checked.load(Ordering::Relaxed);
    let wrong = t.wrong + sh.wrong.load(Ordering::Relaxed);
    eprintln!(
        "crash loop result: {cycles} cycles ({restarts} SIGKILLs, {early} of them right after a start) in {:.0} s; \
         blocks checked {} ({} after restarts, {under_load} under load), wrong {wrong}; \
         prompts saved {} ({} blocks acked); blocks written through to G3 {written:.0}; \
         blocks lost {} of {} acked before a kill (not yet written through), served at the end {served}; \
         failed calls {} (in flight at a kill)",
        started.elapsed().as_secs_f64(),
        t.checked + under_load,
        t.checked,
        saved.len(),
        saved.iter().filter(|p| p.acked).map(|p| u64::from(p.blocks)).sum::<u64>(),
        t.lost,
        t.acked,
        sh.errors.load(Ordering::Relaxed),
    );
    assert_eq!(wrong, 0, "wrong blocks served: {:?}", sh.first_wrong.lock().unwrap());
    assert!(t.checked > 0 && under_load > 0, "nothing was checked");
    drop(v);
    n.stop();
}
