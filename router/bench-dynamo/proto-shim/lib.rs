//! `kvproto`'s pure modules, compiled from the main workspace's sources (see ../Cargo.toml).
#[path = "../../../proto/src/dynamo.rs"]
pub mod dynamo;
#[path = "../../../proto/src/error.rs"]
pub mod error;
#[path = "../../../proto/src/events.rs"]
pub mod events;
#[path = "../../../proto/src/key.rs"]
pub mod key;
#[path = "../../../proto/src/key_chain.rs"]
pub mod key_chain;
#[path = "../../../proto/src/namespace.rs"]
pub mod namespace;
#[path = "../../../proto/src/tier.rs"]
pub mod tier;

pub use error::ProtoError;
pub use key::{BlockKey, BlockKeyBuildHasher, BlockKeyHasher, block_keys, block_keys_le, next_block_key, tokens_to_le};
pub use namespace::{Dtype, KvLayout, LayoutKind, Namespace, NamespaceFingerprint, NamespaceId};
pub use tier::TierKind;
