//! `kvclient`: the crate engines link to use kvcached.
//!
//! An engine registers its KV memory once (on CPU machines a memfd or shared-memory file, handed
//! to the daemon as a file descriptor; on GPU machines a CUDA IPC handle) with its namespace and
//! layout, then asks the daemon to save blocks, look up how much of a prompt is cached, and load
//! blocks into given slots. The daemon does every copy; the engine only names block slots and
//! tokens. The client reconnects with backoff and re-registers after a daemon restart, and sends
//! heartbeats so the daemon can drop it if it dies.
//!
//! ```no_run
//! use kvclient::{Client, KvMemory};
//! use kvproto::{Dtype, KvLayout, LayoutKind, Namespace};
//!
//! # async fn engine() -> Result<(), kvclient::ClientError> {
//! let layout = KvLayout { num_layers: 28, kv_heads: 8, head_dim: 128, dtype: Dtype::Bf16,
//!                         tokens_per_block: 16, kind: LayoutKind::LayerSeparate };
//! let ns = Namespace::new("Qwen/Qwen3-0.6B", layout);
//! // vLLM-style KV: one tensor per layer and K/V, 1024 block slots each.
//! let kv = KvMemory::anonymous(&layout, 1024)?;
//! let client = Client::connect("/run/user/1000/kvcached/kvcached.sock").await?;
//! client.register("engine-0", &ns, &kv).await?;
//! let tokens: Vec<u32> = (0..4096).collect();
//! let slots: Vec<u32> = (0..256).collect();
//! client.save(&tokens, 0, &slots).await?;             // after prefill
//! let hit = client.lookup(&tokens).await?;             // on a new request
//! let op = client.load(&tokens, 0, &slots[..hit.matched_blocks as usize]).await?;
//! // ... overlap with other work ...
//! let done = client.wait(&op, std::time::Duration::from_secs(1)).await?;
//! assert_eq!(done.loaded_blocks, hit.matched_blocks);
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`client`]: the async [`Client`] (connect, register, save, lookup, load, wait,
//!   reconnect, heartbeats).
//! - [`attach`]: handing the KV memory's and token area's descriptors to the daemon (ATTACH).
//! - `lookup_wire`: lookups over connections of their own, without HTTP/2 (LOOKUP), when the
//!   daemon serves them.
//! - [`blocking`]: [`BlockingClient`], the same API for engines without an async runtime.
//! - [`memory`]: [`KvMemory`], a shared-memory KV region (memfd or named file) and its slot
//!   layout; [`GpuKvMemory`], KV in GPU memory shared through a CUDA IPC handle.
//! - [`token_area`]: the memfd long prompts' tokens travel through to the daemon.
//! - [`error`]: the [`ClientError`] enum.

pub mod attach;
pub mod blocking;
pub mod client;
pub mod error;
mod lookup_wire;
pub mod memory;
pub mod token_area;

pub use blocking::BlockingClient;
pub use client::{Client, LoadOp};
pub use error::ClientError;
pub use kvproto;
pub use kvproto::pb::{LoadStatus, LookupResponse, SaveResponse};
pub use memory::{GpuKvMemory, KvMemory, synthetic_block};

/// The socket of the node's daemon: `KVCACHED_SOCKET` if set, else the daemon's default
/// ([`kvproto::paths::default_socket`]).
pub fn default_socket() -> std::path::PathBuf {
    std::env::var_os("KVCACHED_SOCKET").map_or_else(kvproto::paths::default_socket, Into::into)
}
