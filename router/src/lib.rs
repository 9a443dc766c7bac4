//! `kvrouter`: the cluster router.
//!
//! # Layout
//! Nothing yet: the event index, tier-weighted placement and prefill/decode splitting arrive
//! in a later change (see `docs/architecture.md`, "Status"). It will consume the block keys
//! and the Dynamo-compatible hashes of [`kvproto`].

pub use kvproto;
