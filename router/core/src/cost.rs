//! The cost model: how much of a prompt each candidate worker would still have to prefill, and
//! which worker wins.
//!
//! For worker `w` on node `n`, walk the prompt's blocks in order. At each position the block is
//! credited at the best tier `w` can use: its own G1 (weight `g1`), else `n`'s G2 (`g2`), else
//! `n`'s G3 (`g3`), else the cluster's G4 (`g4`). The walk for `w` stops at the first block `w`
//! cannot get from any tier (a later block is useless without it). Then
//!
//! ```text
//! cost(w) = prefill * (blocks - credit(w)) + decode * kv_utilisation(w) + active * active_requests(w)
//!         + fill * g1_fill(w)
//! ```
//!
//! `g1_fill` is the fraction of the worker's KV capacity its indexed G1 blocks occupy: between
//! otherwise equal workers, a new prompt goes where it evicts the least.
//!
//! Lowest cost wins, ties broken at random; with `temperature > 0` the winner is sampled with
//! probability proportional to `exp(-(cost - min) / (temperature * blocks))`.

use kvproto::TierKind;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::config::CostWeights;
use crate::index::Slots;

/// One candidate's holders and load, as the cost model needs them.
#[derive(Debug, Clone, Copy)]
pub struct CandidateIn {
    /// The worker's G1 holder index.
    pub worker_holder: u32,
    /// Its node's holder index (G2/G3).
    pub node_holder: u32,
    /// KV utilisation 0..1.
    pub kv_utilisation: f64,
    /// Running + waiting as last reported, plus routed since.
    pub active: f64,
    /// Fraction (0..1) of the worker's GPU KV capacity its indexed G1 blocks fill.
    pub fill: f64,
}

/// Blocks of the prompt a worker can get, by the tier it gets each from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TierMatch {
    /// Blocks per tier, index = [`TierKind::index`].
    pub blocks: [u32; 4],
}

impl TierMatch {
    /// Length of the usable prefix in blocks.
    pub fn prefix(&self) -> u32 {
        self.blocks.iter().sum()
    }
    /// Weighted credit.
    pub fn credit(&self, w: &CostWeights) -> f64 {
        TierKind::ALL.iter().map(|t| w.tier(*t) * f64::from(self.blocks[t.index()])).sum()
    }
}

/// The cost of one candidate, term by term.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CostBreakdown {
    pub total: f64,
    /// Blocks of the prompt still to prefill after crediting cached ones (weighted).
    pub prefill_blocks: f64,
    pub prefill_term: f64,
    pub decode_term: f64,
    pub active_term: f64,
    pub fill_term: f64,
}

/// Best tier index by `g1 | g2 << 1 | g3 << 2 | g4 << 3` (which tiers offer the block); 4: none.
const BEST_TIER: [usize; 16] = [4, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0];

/// What [`match_candidates`] keeps between calls: its mark buffer, and the candidates indexed by
/// holder, rebuilt only when the candidates' holders change (a router asks for the same workers
/// request after request), so that a lookup visits the candidates that hold the prompt's first
/// blocks instead of all of them.
#[derive(Debug, Default)]
pub struct MatchScratch {
    /// Tier bits per holder index for the stretch being visited (all zero between calls).
    marks: Vec<u8>,
    /// The `(worker, node)` holders of the candidates the index below was built for.
    holders: Vec<(u32, u32)>,
    /// Candidates of holder `h` (as their worker or their node): `by_holder[start[h]..start[h + 1]]`.
    start: Vec<u32>,
    by_holder: Vec<u32>,
    /// False when a holder index was too large to index by ([`MAX_INDEXED_HOLDER`]): every
    /// candidate is then visited, as without the index.
    indexed: bool,
}

/// Largest holder index the candidate index is built for (its arrays have one entry per index
/// up to the largest; holder indices are dense, reused after release, so a real cluster stays
/// far below this).
const MAX_INDEXED_HOLDER: usize = 1 << 20;

impl MatchScratch {
    /// Indexes `cands` by holder unless they are the candidates of the last call.
    fn index(&mut self, cands: &[CandidateIn]) {
        let same = self.holders.len() == cands.len()
            && self.holders.iter().zip(cands).all(|(&(w, n), c)| w == c.worker_holder && n == c.node_holder);
        if same {
            return;
        }
        self.holders.clear();
        self.holders.extend(cands.iter().map(|c| (c.worker_holder, c.node_holder)));
        let top = self.holders.iter().map(|&(w, n)| w.max(n) as usize).max().map_or(0, |m| m + 1);
        self.start.clear();
        self.by_holder.clear();
        self.indexed = top <= MAX_INDEXED_HOLDER;
        if !self.indexed {
            return;
        }
        self.start.resize(top + 1, 0);
        for &(w, n) in &self.holders {
            for h in holders_of(w, n) {
                self.start[h as usize + 1] += 1;
            }
        }
        for h in 1..self.start.len() {
            self.start[h] += self.start[h - 1];
        }
        let mut next: Vec<u32> = self.start.clone();
        self.by_holder.resize(next[top] as usize, 0);
        for (c, &(w, n)) in self.holders.iter().enumerate() {
            for h in holders_of(w, n) {
                self.by_holder[next[h as usize] as usize] = c as u32;
                next[h as usize] += 1;
            }
        }
    }

    /// The candidates of holder `h`.
    fn candidates_of(&self, h: u32) -> &[u32] {
        match (self.start.get(h as usize), self.start.get(h as usize + 1)) {
            (Some(&a), Some(&b)) => &self.by_holder[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// The holders a candidate with worker holder `w` on node holder `n` is indexed under (each once).
fn holders_of(w: u32, n: u32) -> impl Iterator<Item = u32> {
    std::iter::once(w).chain((n != w).then_some(n))
}

/// Computes, for each candidate, the blocks it can get per tier. `positions` is called with a
/// callback `visit(len, slots) -> bool`; it must call it for the prompt's blocks in order, once
/// per stretch of `len` consecutive blocks that have the same holders, and stop when it returns
/// false (nothing more can match) or at the first block nobody holds.
pub fn match_candidates(
    cands: &[CandidateIn],
    scratch: &mut MatchScratch,
    positions: impl FnOnce(&mut dyn FnMut(u32, &Slots) -> bool),
) -> Vec<TierMatch> {
    let mut out = vec![TierMatch::default(); cands.len()];
    scratch.index(cands);
    let mut marks = std::mem::take(&mut scratch.marks);
    // Candidates still matching; filled by the first stretch.
    let mut alive: Vec<u32> = Vec::new();
    let mut first = true;
    let mut touched: Vec<u32> = Vec::with_capacity(16);
    let index = &*scratch;
    let mut visit = |len: u32, slots: &Slots| -> bool {
        let mut g4 = 0u8;
        for s in slots.iter() {
            let h = s.holder() as usize;
            if s.tier() == TierKind::G4Object {
                g4 = 8;
                continue;
            }
            if marks.len() <= h {
                marks.resize(h + 1, 0);
            }
            if marks[h] == 0 {
                touched.push(h as u32);
            }
            marks[h] |= 1 << s.tier().index();
        }
        // The tier a candidate gets a block from: its own G1, else its node's G2, G3, else G4.
        let tier_of = |c: &CandidateIn| -> usize {
            let own = marks.get(c.worker_holder as usize).copied().unwrap_or(0) & 1;
            let node = marks.get(c.node_holder as usize).copied().unwrap_or(0) & 6;
            BEST_TIER[usize::from(own | node | g4)]
        };
        if std::mem::take(&mut first) {
            if g4 != 0 || !index.indexed {
                // Every candidate can get the block from G4 (or there is no index to ask).
                alive.extend(0..cands.len() as u32);
            } else {
                // Only candidates whose worker or node holds the block.
                for &h in &touched {
                    alive.extend_from_slice(index.candidates_of(h));
                }
                alive.sort_unstable();
                alive.dedup();
            }
        }
        alive.retain(|&c| {
            let t = tier_of(&cands[c as usize]);
            if t < 4 {
                out[c as usize].blocks[t] += len;
            }
            t < 4
        });
        for h in touched.drain(..) {
            marks[h as usize] = 0;
        }
        !alive.is_empty()
    };
    positions(&mut visit);
    scratch.marks = marks;
    out
}

/// The cost of each candidate for a prompt of `blocks` blocks.
pub fn costs(w: &CostWeights, blocks: usize, cands: &[CandidateIn], matches: &[TierMatch]) -> Vec<CostBreakdown> {
    cands
        .iter()
        .zip(matches)
        .map(|(c, m)| {
            let prefill_blocks = (blocks as f64 - m.credit(w)).max(0.0);
            let prefill_term = w.prefill * prefill_blocks;
            let decode_term = w.decode * c.kv_utilisation.clamp(0.0, 1.0);
            let active_term = w.active * c.active.max(0.0);
            let fill_term = w.fill * c.fill.clamp(0.0, 1.0);
            CostBreakdown {
                total: prefill_term + decode_term + active_term + fill_term,
                prefill_blocks,
                prefill_term,
                decode_term,
                active_term,
                fill_term,
            }
        })
        .collect()
}

/// Picks the winner: lowest cost with ties at random, or a softmax sample when
/// `temperature > 0`. `None` only for an empty slice.
pub fn choose(costs: &[CostBreakdown], temperature: f64, blocks: usize, rng: &mut impl Rng) -> Option<usize> {
    let min = costs.iter().map(|c| c.total).fold(f64::INFINITY, f64::min);
    if !min.is_finite() {
        return None;
    }
    if temperature > 0.0 {
        let scale = temperature * (blocks.max(1) as f64);
        let weights: Vec<f64> = costs.iter().map(|c| (-(c.total - min) / scale).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let mut x = rng.random::<f64>() * sum;
        for (i, wt) in weights.iter().enumerate() {
            if x < *wt {
                return Some(i);
            }
            x -= wt;
        }
        return weights.iter().rposition(|w| *w > 0.0);
    }
    let eps = 1e-9 * (1.0 + min.abs());
    let ties: Vec<usize> = costs.iter().enumerate().filter(|(_, c)| c.total <= min + eps).map(|(i, _)| i).collect();
    Some(ties[rng.random_range(0..ties.len())])
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::index::Slot;

    fn cand(w: u32, n: u32) -> CandidateIn {
        CandidateIn { worker_holder: w, node_holder: n, kv_utilisation: 0.0, active: 0.0, fill: 0.0 }
    }

    /// Runs the matcher over positions given as lists of slots.
    fn run(cands: &[CandidateIn], positions: &[Vec<Slot>]) -> Vec<TierMatch> {
        let mut scratch = MatchScratch::default();
        let m = match_candidates(cands, &mut scratch, |visit| {
            for p in positions {
                if p.is_empty() || !visit(1, &p.iter().copied().collect()) {
                    break;
                }
            }
        });
        assert!(scratch.marks.iter().all(|x| *x == 0));
        m
    }

    #[test]
    fn each_block_is_credited_at_the_best_tier_the_worker_can_use() {
        // Workers 1, 2 on node 10; worker 3 on node 11.
        let cands = [cand(1, 10), cand(2, 10), cand(3, 11)];
        let g1 = |h| Slot::new(h, TierKind::G1Gpu);
        let g2 = |h| Slot::new(h, TierKind::G2Host);
        let g3 = |h| Slot::new(h, TierKind::G3Disk);
        let g4 = Slot::new(0, TierKind::G4Object);
        let positions =
            vec![vec![g1(1), g2(10), g4], vec![g1(1), g3(10), g4], vec![g3(10)], vec![g1(1), g1(3)], vec![g1(1)]];
        let m = run(&cands, &positions);
        assert_eq!(m[0].blocks, [4, 0, 1, 0]); // its own GPU, the node's disk at position 2
        assert_eq!(m[1].blocks, [0, 1, 2, 0]); // G2, G3, G3, then nothing at position 3
        assert_eq!(m[2].blocks, [0, 0, 0, 2]); // G4, G4, then stops
        let w = CostWeights::default();
        assert!((m[1].credit(&w) - (0.75 + 0.5)).abs() < 1e-12);
    }

    /// One scratch kept across calls whose candidates change (its holder index rebuilt, or
    /// reused when they are the same) answers as a per-candidate model does.
    #[test]
    fn a_kept_scratch_matches_a_per_candidate_model() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut kept = MatchScratch::default();
        let tiers = [TierKind::G1Gpu, TierKind::G2Host, TierKind::G3Disk, TierKind::G4Object];
        let mut cands: Vec<CandidateIn> = Vec::new();
        for round in 0..300 {
            if round % 3 == 0 {
                // Workers 1..=12, nodes 100..=103 (several workers per node).
                let n = rng.random_range(1..10);
                cands = (0..n).map(|_| cand(rng.random_range(1..=12), rng.random_range(100..=103))).collect();
            }
            let positions: Vec<Vec<Slot>> = (0..rng.random_range(1..8))
                .map(|_| {
                    (0..rng.random_range(1..6))
                        .map(|_| {
                            let kinds = if rng.random_bool(0.1) { 4 } else { 3 };
                            let t = tiers[rng.random_range(0..kinds)];
                            let h = if t == TierKind::G1Gpu {
                                rng.random_range(1..=12)
                            } else {
                                rng.random_range(100..=103)
                            };
                            Slot::new(h, t)
                        })
                        .collect()
                })
                .collect();
            let got = match_candidates(&cands, &mut kept, |visit| {
                for p in &positions {
                    if !visit(1, &p.iter().copied().collect()) {
                        break;
                    }
                }
            });
            assert!(kept.marks.iter().all(|x| *x == 0));
            for (c, m) in cands.iter().zip(&got) {
                let mut want = [0u32; 4];
                for p in &positions {
                    let has = |h: u32, t: TierKind| p.contains(&Slot::new(h, t));
                    let t = if has(c.worker_holder, TierKind::G1Gpu) {
                        0
                    } else if has(c.node_holder, TierKind::G2Host) {
                        1
                    } else if has(c.node_holder, TierKind::G3Disk) {
                        2
                    } else if p.iter().any(|s| s.tier() == TierKind::G4Object) {
                        3
                    } else {
                        break;
                    };
                    want[t] += 1;
                }
                assert_eq!(m.blocks, want, "round {round}: {c:?} over {positions:?}");
            }
        }
    }

    /// Holder indices past what the candidate index is built for: every candidate is visited,
    /// with the same answers.
    #[test]
    fn candidates_with_holders_too_large_to_index_are_all_visited() {
        let big = MAX_INDEXED_HOLDER as u32 + 5;
        let cands = [cand(1, 10), cand(big, 11), cand(3, big + 1)];
        let positions = vec![
            vec![Slot::new(big, TierKind::G1Gpu), Slot::new(big + 1, TierKind::G2Host), Slot::new(1, TierKind::G1Gpu)],
            vec![Slot::new(big + 1, TierKind::G3Disk)],
        ];
        let m = run(&cands, &positions);
        assert_eq!(m[0].blocks, [1, 0, 0, 0]);
        assert_eq!(m[1].blocks, [1, 0, 0, 0]);
        assert_eq!(m[2].blocks, [0, 1, 1, 0]);
    }

    #[test]
    fn lowest_cost_wins_and_load_terms_count() {
        let w = CostWeights { decode: 4.0, active: 1.0, ..CostWeights::default() };
        let mut cands = [cand(1, 10), cand(2, 10)];
        let m = [TierMatch { blocks: [3, 0, 0, 0] }, TierMatch::default()];
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let c = costs(&w, 4, &cands, &m);
        assert_eq!(c[0].prefill_blocks, 1.0);
        assert_eq!(choose(&c, 0.0, 4, &mut rng), Some(0));
        // Worker 1 busy: 1 + 4 * 0.5 + 1 * 2 = 5 > 4.
        cands[0].kv_utilisation = 0.5;
        cands[0].active = 2.0;
        let c = costs(&w, 4, &cands, &m);
        assert_eq!(c[0].total, 5.0);
        assert_eq!(choose(&c, 0.0, 4, &mut rng), Some(1));
    }

    #[test]
    fn ties_are_broken_at_random_and_temperature_samples_softly() {
        let w = CostWeights::default();
        let cands = [cand(1, 10), cand(2, 10), cand(3, 10)];
        let m = [TierMatch::default(); 3];
        let c = costs(&w, 4, &cands, &m);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = [0u32; 3];
        for _ in 0..300 {
            seen[choose(&c, 0.0, 4, &mut rng).unwrap_or(9)] += 1;
        }
        assert!(seen.iter().all(|n| *n > 60), "{seen:?}");
        // With a temperature, a slightly worse worker is sometimes chosen, a far worse one rarely.
        let m = [TierMatch { blocks: [4, 0, 0, 0] }, TierMatch { blocks: [3, 0, 0, 0] }, TierMatch::default()];
        let c = costs(&w, 4, &cands, &m);
        let mut seen = [0u32; 3];
        for _ in 0..2000 {
            seen[choose(&c, 0.25, 4, &mut rng).unwrap_or(9)] += 1;
        }
        assert!(seen[0] > seen[1] && seen[1] > seen[2] && seen[1] > 50, "{seen:?}");
        assert_eq!(choose(&[], 0.0, 4, &mut rng), None);
    }
}
