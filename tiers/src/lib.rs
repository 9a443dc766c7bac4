//! `kvtiers`: the kvcached block store as a library, with no networking.
//!
//! # Layout
//! - [`tier`]: the [`Tier`] trait every tier implements (G1-G4), small, with extension traits
//!   for what only some tiers do ([`DirectIo`], [`PrefixProbe`], [`Medium`], [`Reports`]) and
//!   [`TierExt`], the conveniences over them.
//! - [`host`]: G2, the shared-memory host pool ([`HostTier`]).
//! - [`disk`]: G3, blocks on NVMe via O_DIRECT (io_uring or pread/pwrite on named I/O
//!   threads) with a durable RocksDB index ([`DiskTier`]); checksums computed while the I/O
//!   runs (`disk/verify.rs`); pages freed only once their records are deleted
//!   (`disk/forget.rs`).
//! - [`object`]: G4, objects in S3-compatible stores or a shared filesystem through
//!   `object_store` ([`ObjectTier`]), probed in a few round trips, written through by a queue of
//!   its own.
//! - [`store`]: [`BlockStore`], G2 over the lower tiers: write-through, promotion, prefix
//!   lookup, leases.
//! - [`load`]: the store's one load operation, [`BlockStore::load_into`]: a chain's blocks,
//!   each from the fastest tier holding it, into a [`LoadSink`] (an engine's slots), straight
//!   into the sink's own memory where it offers some ([`Destination`]).
//! - [`writethrough`]: the background writers (one per lower tier) that copy G2 blocks down in
//!   batches.
//! - [`residency`]: reserve -> write -> commit states, child counts, leases and eviction
//!   choice, shared by every tier.
//! - `room`: capacity and watermarks (when an insert evicts, how much), what an eviction
//!   reports, a page pool's usage: one piece for G2, G3 and G4.
//! - [`eviction`] / [`lru_policy`]: recency order behind a small trait, LRU via the `lru`
//!   crate.
//! - [`quota`]: owners' quotas per tier (kvcached's tenants), applied by the tiers beside
//!   their eviction.
//! - [`pages`]: page-granular space allocation shared by G2 and G3.
//! - [`pieces`]: copies between block pieces (non-temporal stores into G2).
//! - `shm_pages`: whether the G2 pool's filesystem gives it huge pages.
//! - [`buf`]: [`BlockBuf`], the 4 KiB-aligned buffer blocks are read into.
//! - [`listener`]: [`TierListener`], what each tier gained and lost (for hit reports).
//! - [`block`]: block metadata, checksums, lease ids.
//! - [`stats`]: counters exported as `kvcached_*` metrics.
//! - [`copy`]: copies between an engine's device memory (G1) and host memory, queued on the
//!   device's streams with many blocks in flight ([`copy::CopyEngine`], [`copy::CopyQueue`]),
//!   and a fake device that runs the same contract on threads for tests.
//! - [`cuda`]: CUDA, loaded at run time: page-locking host memory, engines' device memory
//!   opened by IPC handle ([`cuda::DeviceRegion`], a [`copy::CopyEngine`]).
//! - [`error`]: [`TierError`], the crate's one error enum.

pub mod block;
pub mod buf;
pub mod copy;
pub mod cuda;
pub mod disk;
pub mod error;
pub mod eviction;
pub mod host;
pub mod listener;
pub mod load;
pub mod lru_policy;
pub mod object;
pub mod pages;
pub mod pieces;
pub mod quota;
pub(crate) mod residency;
pub(crate) mod room;
pub(crate) mod shm_pages;
pub mod stats;
pub mod store;
pub mod tier;
pub mod writethrough;

pub use block::{BlockMeta, LeaseId, SumKind, checksum, checksum_of};
pub use buf::BlockBuf;
pub use disk::{DiskTier, DiskTierConfig};
pub use error::{Result, TierError};
pub use host::{CudaRegister, Filling, HeldBlock, HostTier, HostTierConfig, POPULATE_STEP};
pub use listener::TierListener;
pub use load::{Destination, DirectRead, LoadEnd, LoadError, LoadOptions, LoadReport, LoadSink};
pub use object::{ObjectTier, ObjectTierConfig};
pub use quota::{OverQuota, Quota};
pub use stats::{TierStats, TierUsage};
pub use store::{BlockStore, BlockStoreConfig, Hit, PrefixMatch, StoreStats, WriteThroughPause};
pub use tier::{BlockRef, Delivered, DirectIo, Extensions, Medium, PartsRef, PrefixProbe, Reports, Tier, TierExt};
pub use writethrough::WriteThroughConfig;
