//! `kvcached`: the per-node daemon.
//!
//! # Layout
//! - [`demo`]: a self-contained walk through the block store (save a prompt's blocks, look
//!   them up per tier, load and verify them, restart and find them in G3). The gRPC daemon,
//!   engine attach and `/metrics` build on the same `kvtiers::BlockStore`.

pub mod demo;
