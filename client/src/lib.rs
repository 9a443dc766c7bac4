//! `kvclient`: the crate engines link to use kvcached.
//!
//! # Layout
//! Nothing yet: attach, KV-memory registration, save / lookup / load over the daemon's Unix
//! socket arrive with the daemon (see `docs/architecture.md`, "Status"). Until then an engine
//! can derive the keys the daemon will use with [`kvproto`].

pub use kvproto;
