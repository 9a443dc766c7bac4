//! How far a prefix reaches into G4, in a few round trips: blocks are written parent first and
//! deleted descendants first, so the blocks of a chain present in G4 form a prefix of it (up to
//! what a concurrent delete or a lost write leaves, which a load then finds as a miss). A k-ary
//! search asks `fanout` keys at once per round: the first round asks the first key too, so a
//! chain with nothing in G4 costs one round trip, and 8192 blocks take at most
//! `ceil(log_{fanout+1}(8192)) + 1` rounds (4 with 16).

use std::future::Future;

/// The length of the longest prefix of `0..n` for which `present` answers true, assuming the
/// present indices form a prefix. `present(batch)` answers for a batch of indices asked at
/// once (one round trip); `fanout` is the batch size (at least 1). Returns (length, rounds).
pub async fn longest_prefix<F, Fut>(n: usize, fanout: usize, mut present: F) -> (usize, usize)
where
    F: FnMut(Vec<usize>) -> Fut,
    Fut: Future<Output = Vec<bool>>,
{
    let fanout = fanout.max(1);
    // Invariant: every index < lo is present (as far as we know), every index >= hi is absent.
    let (mut lo, mut hi) = (0usize, n);
    let mut rounds = 0;
    while lo < hi {
        // Ask `lo` itself and up to fanout - 1 evenly spaced points above it.
        let span = hi - lo;
        let k = fanout.min(span);
        let mut asked: Vec<usize> = (0..k).map(|j| lo + j * span / k).collect();
        asked.dedup();
        let answers = present(asked.clone()).await;
        rounds += 1;
        // The highest asked index whose answer and all lower asked answers are present.
        let mut new_lo = lo;
        let mut new_hi = hi;
        for (i, ok) in asked.iter().zip(answers.iter().copied().chain(std::iter::repeat(false))) {
            if ok {
                new_lo = i + 1;
            } else {
                new_hi = *i;
                break;
            }
        }
        if new_lo == lo && new_hi == hi {
            break; // no progress possible (an empty answer)
        }
        (lo, hi) = (new_lo, new_hi);
    }
    (lo, rounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: usize, present_upto: usize, fanout: usize) -> (usize, usize) {
        let f = |asked: Vec<usize>| {
            let out: Vec<bool> = asked.iter().map(|&i| i < present_upto).collect();
            std::future::ready(out)
        };
        futures::executor::block_on(longest_prefix(n, fanout, f))
    }

    #[test]
    fn finds_every_prefix_length_in_a_few_rounds() {
        for n in [0usize, 1, 2, 17, 100, 8192] {
            for upto in [0, 1, n / 3, n.saturating_sub(1), n] {
                let (len, rounds) = run(n, upto, 16);
                assert_eq!(len, upto.min(n), "n {n} upto {upto}");
                assert!(rounds <= 5, "n {n} upto {upto}: {rounds} rounds");
            }
        }
        assert_eq!(run(8192, 0, 16), (0, 1), "nothing in G4: one round trip");
        assert_eq!(run(8192, 8192, 1).0, 8192);
    }
}
