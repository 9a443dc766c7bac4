//! What the property tests of every crate share (feature `fuzzing`, for tests only): how many
//! cases a run tries and the arbitrary bytes fed to decoders
//! (docs/operations/security-limits.md, "Fuzzing").

use proptest::prelude::*;

/// Cases per property: `PROPTEST_CASES` when set, else `default` (kept small for `cargo test`).
pub fn case_count(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A configuration of [`case_count`] cases that writes no failure-persistence files.
pub fn cases(default: u32) -> ProptestConfig {
    ProptestConfig { cases: case_count(default), failure_persistence: None, ..ProptestConfig::default() }
}

/// A boolean, a `u64` or an `i64` (one as likely as another), any of each, as a value of type
/// `V` (a JSON or msgpack value): three leaves of a value strategy, as `3 => scalars()`.
pub fn scalars<V>() -> impl Strategy<Value = V>
where
    V: From<bool> + From<u64> + From<i64> + std::fmt::Debug + Clone,
{
    prop_oneof![any::<bool>().prop_map(V::from), any::<u64>().prop_map(V::from), any::<i64>().prop_map(V::from)]
}

/// Any bytes, fewer than `max` of them.
pub fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}
