//! Key chains derived recently, reused by later requests that name the same prompt.
//!
//! An engine names a prompt several times: a lookup (repeated while the request waits to be
//! scheduled), a load of the matched prefix, a save after prefill; a decode engine then loads
//! what a prefill engine saved, and the next turn of a conversation extends the prompt. The keys
//! of a 128k-token prompt are 8192 sequential BLAKE3 compressions, a chain no core count speeds
//! up. The memo keeps the token bytes and keys of recent long
//! prompts per namespace. A request whose tokens start with full blocks of a remembered prompt
//! takes those blocks' keys and derives only the rest.
//!
//! It can never hand out a key that is not its tokens': a remembered key is reused only after an
//! exact byte comparison of every token before it, in the same namespace (fingerprint) and block
//! size. Bounded in bytes (token bytes + 16 per key); the least recently used prompt leaves first.

use std::collections::HashMap;
use std::sync::Arc;

use kvproto::{BlockKey, NamespaceFingerprint};
use lru::LruCache;
use parking_lot::Mutex;

use crate::engine::token_area::PromptTokens;

/// Prompts shorter than this many full blocks are derived directly: cheaper than the memo.
const MIN_BLOCKS: usize = 64;
/// Remembered prompts per first block (namespace, block size and first block's tokens), all
/// compared per request; many prompts share a system prompt, and each comparison stops at the
/// first difference. Older ones leave the memo.
const CANDIDATES: usize = 8;
/// Blocks derived at a time by [`KeyMemo::keys_while`] between two questions to its caller.
pub const LAZY_CHUNK: usize = 256;
/// Blocks compared per `memcmp` while looking for the first differing block.
const STRIDE_BLOCKS: usize = 64;

struct Prompt {
    fingerprint: [u8; 32],
    block_bytes: usize,
    /// Token bytes of the full blocks only.
    tokens: Vec<u8>,
    keys: Vec<BlockKey>,
}

impl std::fmt::Debug for Prompt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Neither the fingerprint (secret) nor the tokens (a user's prompt).
        f.debug_struct("Prompt").field("block_bytes", &self.block_bytes).field("blocks", &self.keys.len()).finish()
    }
}

impl Prompt {
    fn bytes(&self) -> usize {
        self.tokens.len() + 16 * self.keys.len()
    }
}

#[derive(Debug)]
struct State {
    /// Remembered prompts by id, in recency order.
    prompts: LruCache<u64, Arc<Prompt>>,
    /// Ids by the hash of (namespace, block size, first block), most recent last.
    by_first_block: HashMap<u64, Vec<u64>>,
    bytes: usize,
    next_id: u64,
}

/// The memo; see the module docs.
#[derive(Debug)]
pub struct KeyMemo {
    capacity_bytes: usize,
    state: Mutex<State>,
    reused: metrics::Counter,
    derived: metrics::Counter,
}

impl KeyMemo {
    /// A memo of at most `capacity_bytes` (0: off, every request derives its keys).
    pub fn new(capacity_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            state: Mutex::new(State {
                prompts: LruCache::unbounded(),
                by_first_block: HashMap::new(),
                bytes: 0,
                next_id: 0,
            }),
            reused: metrics::counter!("kvcached_block_keys_total", "source" => "memo"),
            derived: metrics::counter!("kvcached_block_keys_total", "source" => "derived"),
        }
    }

    /// Keys of every full block of `tokens` (little-endian u32 bytes, whole tokens: checked by
    /// the caller) in the namespace `fp` with `tokens_per_block`.
    pub fn keys(&self, fp: &NamespaceFingerprint, tokens_per_block: usize, tokens: &[u8]) -> Vec<BlockKey> {
        self.keys_while(fp, tokens_per_block, &mut PromptTokens::inline(tokens), |_| true)
    }

    /// The keys of the leading full blocks of `tokens`, derived only as far as `go_on` wants:
    /// it sees the keys so far after the reused ones and after each derived chunk of
    /// [`LAZY_CHUNK`] blocks, and derivation stops when it says no. A lookup passes "every block
    /// so far is cached", so a prompt whose first blocks are not cached costs one chunk, not the
    /// whole chain. What was derived is remembered; a later request derives the rest. Tokens
    /// from a token area are copied in a chunk at a time, as the chain reaches them.
    pub fn keys_while(
        &self,
        fp: &NamespaceFingerprint,
        tokens_per_block: usize,
        tokens: &mut PromptTokens<'_>,
        mut go_on: impl FnMut(&[BlockKey]) -> bool,
    ) -> Vec<BlockKey> {
        let block_bytes = 4 * tokens_per_block;
        let blocks = tokens.len().checked_div(block_bytes).unwrap_or(0);
        let derive_on =
            |keys: &mut Vec<BlockKey>, tokens: &mut PromptTokens<'_>, go_on: &mut dyn FnMut(&[BlockKey]) -> bool| {
                while keys.len() < blocks && (keys.is_empty() || go_on(keys)) {
                    let from = keys.len();
                    let to = (from + LAZY_CHUNK).min(blocks);
                    let more = kvproto::chain_keys_le(
                        fp,
                        keys.last(),
                        tokens_per_block,
                        &tokens.upto(to * block_bytes)[from * block_bytes..],
                    );
                    keys.extend(more);
                }
            };
        if self.capacity_bytes == 0 || blocks < MIN_BLOCKS {
            let mut keys = Vec::with_capacity(blocks);
            derive_on(&mut keys, tokens, &mut go_on);
            self.derived.increment(keys.len() as u64);
            return keys;
        }
        let bucket = bucket_of(fp, block_bytes, tokens.upto(block_bytes));

        // The candidates leave the lock as Arcs: comparing and deriving happen without it.
        let candidates: Vec<(u64, Arc<Prompt>)> = {
            let mut st = self.state.lock();
            let ids: Vec<u64> = st.by_first_block.get(&bucket).map(|v| v.to_vec()).unwrap_or_default();
            ids.iter().rev().filter_map(|id| st.prompts.get(id).map(|p| (*id, Arc::clone(p)))).collect()
        };
        let best = if candidates.is_empty() {
            None
        } else {
            // As far as the longest candidate reaches: comparing needs no more of the prompt.
            let longest = candidates.iter().map(|(_, p)| p.tokens.len()).max().unwrap_or(0);
            let all = &tokens.upto(longest.min(blocks * block_bytes));
            candidates
                .iter()
                .filter(|(_, p)| p.fingerprint == fp.0 && p.block_bytes == block_bytes)
                .map(|(id, p)| (*id, p, common_blocks(&p.tokens, all, block_bytes)))
                .max_by_key(|&(_, _, n)| n)
        };

        let (mut keys, reused_from) = match best {
            Some((id, p, n)) if n > 0 => (p.keys[..n].to_vec(), Some((id, p.keys.len(), n))),
            _ => (Vec::with_capacity(blocks), None),
        };
        let have = keys.len();
        if have < blocks && (have == 0 || go_on(&keys)) {
            derive_on(&mut keys, tokens, &mut go_on);
        }
        self.reused.increment(have as u64);
        self.derived.increment((keys.len() - have) as u64);

        if tokens.check().is_err() {
            return keys; // a copy that faulted is not the prompt: the request fails, nothing is kept
        }
        let known = tokens.upto(keys.len() * block_bytes);
        match reused_from {
            // Nothing new to remember: what was used is a prefix of a remembered prompt.
            Some((_, _, n)) if n == keys.len() => {}
            // The request extends a remembered prompt: it takes that prompt's place.
            Some((id, len, n)) if n == len => self.remember(bucket, fp, block_bytes, known, &keys, Some(id)),
            _ if keys.len() >= MIN_BLOCKS => self.remember(bucket, fp, block_bytes, known, &keys, None),
            _ => {}
        }
        keys
    }

    fn remember(
        &self,
        bucket: u64,
        fp: &NamespaceFingerprint,
        block_bytes: usize,
        tokens: &[u8],
        keys: &[BlockKey],
        replaces: Option<u64>,
    ) {
        let prompt = Prompt { fingerprint: fp.0, block_bytes, tokens: tokens.to_vec(), keys: keys.to_vec() };
        if prompt.bytes() > self.capacity_bytes {
            return;
        }
        let mut st = self.state.lock();
        if let Some(old) = replaces {
            forget(&mut st, bucket, old);
        }
        while st.bytes + prompt.bytes() > self.capacity_bytes {
            let Some((id, oldest)) = st.prompts.peek_lru().map(|(id, p)| (*id, Arc::clone(p))) else {
                break;
            };
            let bucket = bucket_of(&NamespaceFingerprint(oldest.fingerprint), oldest.block_bytes, &oldest.tokens);
            forget(&mut st, bucket, id);
        }
        let id = st.next_id;
        st.next_id += 1;
        st.bytes += prompt.bytes();
        st.prompts.put(id, Arc::new(prompt));
        let ids = st.by_first_block.entry(bucket).or_default();
        ids.push(id);
        // Only the newest CANDIDATES of a bucket are ever compared: an older one could never be
        // reused again, so it leaves the memo now (many prompts share a system prompt, and so a
        // first block).
        let dropped: Vec<u64> =
            if ids.len() > CANDIDATES { ids.drain(..ids.len() - CANDIDATES).collect() } else { Vec::new() };
        for old in dropped {
            if let Some(p) = st.prompts.pop(&old) {
                st.bytes -= p.bytes();
            }
        }
    }
}

fn forget(st: &mut State, bucket: u64, id: u64) {
    if let Some(p) = st.prompts.pop(&id) {
        st.bytes -= p.bytes();
    }
    if let Some(ids) = st.by_first_block.get_mut(&bucket) {
        ids.retain(|&i| i != id);
        if ids.is_empty() {
            st.by_first_block.remove(&bucket);
        }
    }
}

/// The bucket of a prompt: namespace, block size and first block (there is one: prompts here
/// have at least [`MIN_BLOCKS`] blocks).
fn bucket_of(fp: &NamespaceFingerprint, block_bytes: usize, tokens: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&fp.0);
    h.update(&(block_bytes as u64).to_le_bytes());
    h.update(&tokens[..block_bytes.min(tokens.len())]);
    h.digest()
}

/// Full blocks at the start of `a` and `b` that are byte-identical.
fn common_blocks(a: &[u8], b: &[u8], block_bytes: usize) -> usize {
    let n = a.len().min(b.len()) / block_bytes;
    let same = |i: usize, j: usize| a[i * block_bytes..j * block_bytes] == b[i * block_bytes..j * block_bytes];
    let mut done = 0;
    while done < n {
        let end = (done + STRIDE_BLOCKS).min(n);
        if same(done, end) {
            done = end;
            continue;
        }
        while same(done, done + 1) {
            done += 1;
        }
        return done;
    }
    n
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn le(tokens: &[u32]) -> Vec<u8> {
        kvproto::tokens_to_le(tokens).to_vec()
    }

    fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
        (0..blocks as u32 * 16).map(|i| seed.wrapping_mul(7919).wrapping_add(i.wrapping_mul(2_654_435_761))).collect()
    }

    /// Tokens copied from a token area that faulted (the engine truncated it) are not the
    /// prompt: the memo keeps nothing of them.
    #[test]
    fn a_faulted_copy_is_not_remembered() {
        let dir = tempfile::tempdir().unwrap();
        let fp = NamespaceFingerprint([8; 32]);
        for truncate in [false, true] {
            let path = dir.path().join(format!("tokens-{truncate}"));
            std::fs::write(&path, le(&prompt(3, 256))).unwrap();
            let file = std::fs::File::open(&path).unwrap();
            let area = crate::engine::token_area::TokenArea::map(&file, 16 << 10, "token area").unwrap();
            if truncate {
                std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(8 << 10).unwrap();
            }
            let memo = KeyMemo::new(1 << 22);
            let mut tokens = area.tokens(&kvproto::pb::TokenSpan { offset: 0, len: 16 << 10 }).unwrap();
            assert_eq!(memo.keys_while(&fp, 16, &mut tokens, |_| true).len(), 256);
            assert_eq!(tokens.check().is_err(), truncate);
            assert_eq!(memo.state.lock().prompts.len(), usize::from(!truncate), "truncated: {truncate}");
        }
    }

    #[test]
    fn memo_keys_equal_derived_keys_for_repeats_extensions_and_divergences() {
        let fp = NamespaceFingerprint([5; 32]);
        let memo = KeyMemo::new(1 << 20);
        let check = |t: &[u32]| assert_eq!(memo.keys(&fp, 16, &le(t)), kvproto::block_keys(&fp, 16, t));
        let base = prompt(1, 100);
        check(&base);
        check(&base); // repeat: all from the memo
        let mut longer = base.clone();
        longer.extend(prompt(2, 30));
        longer.push(7); // a partial block has no key
        check(&longer); // extension: 100 reused, 30 derived, replaces the shorter prompt
        check(&base[..70 * 16]); // a prefix
        let mut diverged = base.clone();
        diverged[40 * 16 + 3] ^= 1; // block 40 differs
        check(&diverged);
        diverged[0] ^= 1; // first block differs: another bucket
        check(&diverged);
        check(&prompt(3, 10)); // short: derived directly
        let st = memo.state.lock();
        assert_eq!(st.prompts.len(), 3, "base+extension, diverged at 40, diverged at 0");
    }

    #[test]
    fn keys_while_derives_only_what_is_wanted_and_a_later_request_derives_the_rest() {
        let fp = NamespaceFingerprint([6; 32]);
        let memo = KeyMemo::new(1 << 22);
        let t = prompt(8, 1000);
        let all = kvproto::block_keys(&fp, 16, &t);
        let mut asked = Vec::new();
        // "Only the first 300 blocks are cached": stop once past them.
        let got = memo.keys_while(&fp, 16, &mut PromptTokens::inline(&le(&t)), |k| {
            asked.push(k.len());
            k.len() < 300
        });
        assert_eq!(asked, [LAZY_CHUNK, 2 * LAZY_CHUNK]);
        assert_eq!(got, all[..2 * LAZY_CHUNK]);
        // The derived prefix is remembered; the whole prompt extends it and replaces it.
        assert_eq!(memo.keys(&fp, 16, &le(&t)), all);
        let st = memo.state.lock();
        assert_eq!(st.prompts.len(), 1);
        assert_eq!(st.bytes, 1000 * (64 + 16));
        drop(st);
        // A short prompt without the memo, and a memo that is off, stop the same way.
        for m in [KeyMemo::new(0), KeyMemo::new(1 << 22)] {
            let got = m.keys_while(&fp, 16, &mut PromptTokens::inline(&le(&t)), |_| false);
            assert_eq!(got, all[..LAZY_CHUNK]);
        }
    }

    #[test]
    fn prompts_sharing_a_first_block_keep_only_the_newest_candidates() {
        let fp = NamespaceFingerprint([7; 32]);
        let memo = KeyMemo::new(1 << 24);
        let system = prompt(1, 16);
        for user in 0..20 {
            let mut t = system.clone();
            t.extend(prompt(100 + user, 64));
            assert_eq!(memo.keys(&fp, 16, &le(&t)), kvproto::block_keys(&fp, 16, &t));
        }
        let st = memo.state.lock();
        assert_eq!(st.prompts.len(), CANDIDATES);
        assert_eq!(st.by_first_block.values().map(Vec::len).collect::<Vec<_>>(), [CANDIDATES]);
        assert_eq!(st.bytes, CANDIDATES * 80 * (64 + 16));
    }

    #[test]
    fn another_namespace_or_block_size_never_reuses_keys() {
        let (a, b) = (NamespaceFingerprint([1; 32]), NamespaceFingerprint([2; 32]));
        let memo = KeyMemo::new(1 << 20);
        let t = prompt(4, 128);
        assert_eq!(memo.keys(&a, 16, &le(&t)), kvproto::block_keys(&a, 16, &t));
        assert_eq!(memo.keys(&b, 16, &le(&t)), kvproto::block_keys(&b, 16, &t));
        assert_eq!(memo.keys(&a, 32, &le(&t)), kvproto::block_keys(&a, 32, &t));
    }

    #[test]
    fn the_byte_bound_holds_and_the_oldest_prompt_leaves_first() {
        let fp = NamespaceFingerprint([9; 32]);
        // One 64-block prompt is 64 * (64 + 16) = 5120 bytes: room for three.
        let memo = KeyMemo::new(3 * 5120 + 100);
        for seed in 0..10 {
            let t = prompt(100 + seed, 64);
            assert_eq!(memo.keys(&fp, 16, &le(&t)), kvproto::block_keys(&fp, 16, &t));
        }
        let st = memo.state.lock();
        assert_eq!(st.prompts.len(), 3);
        assert_eq!(st.bytes, 3 * 5120);
        assert_eq!(st.by_first_block.values().map(Vec::len).sum::<usize>(), 3);
        drop(st);
        let off = KeyMemo::new(0);
        let t = prompt(1, 64);
        assert_eq!(off.keys(&fp, 16, &le(&t)), kvproto::block_keys(&fp, 16, &t));
        assert_eq!(off.state.lock().prompts.len(), 0);
    }

    #[test]
    fn common_blocks_finds_the_first_differing_block() {
        let a: Vec<u8> = (0..200 * 64).map(|i| (i % 251) as u8).collect();
        for diff in [0, 1, 63, 64, 65, 130, 199] {
            let mut b = a.clone();
            b[diff * 64 + 5] ^= 0xFF;
            assert_eq!(common_blocks(&a, &b, 64), diff);
        }
        assert_eq!(common_blocks(&a, &a, 64), 200);
        assert_eq!(common_blocks(&a, &a[..130 * 64 + 10], 64), 130);
    }
}
