//! `kvproto`: the language every part of kvcached speaks. No I/O.
//!
//! # Layout
//! - [`namespace`]: the namespace that binds every key (model, KV layout, tenant salt, adapter,
//!   extra key bytes) and its fingerprint.
//! - [`key`]: 128-bit chained block keys (BLAKE3 keyed by the namespace fingerprint).
//! - [`dynamo`]: the Dynamo / RFC-1527 compatible XXH3-64 chained hash, for event interop.
//! - [`tier`]: the tiers G1-G4.
//! - [`error`]: the crate's error enum.
//!
//! The exact byte encodings are specified in `docs/block-keys.md`; test vectors live in
//! `proto/tests/data/` and are checked by `proto/tests/vectors.rs` and by an independent Python
//! implementation (`proto/tests/reference_keys.py`).

pub mod dynamo;
pub mod error;
pub mod key;
pub mod namespace;
pub mod tier;

pub use error::ProtoError;
pub use key::{BlockKey, BlockKeyBuildHasher, BlockKeyHasher, block_keys, next_block_key};
pub use namespace::{Dtype, KvLayout, LayoutKind, Namespace, NamespaceFingerprint, NamespaceId};
pub use tier::TierKind;
