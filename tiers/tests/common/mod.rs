//! Helpers shared by the tier tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;

use kvproto::{BlockKey, NamespaceId};
use kvtiers::disk::io::{IoBackend, engine_factory};
use kvtiers::{BlockMeta, DiskTier, DiskTierConfig, HostTier, HostTierConfig, Tier};

pub const PAGE: usize = 64 * 1024;
pub const NS: NamespaceId = NamespaceId([0x5a; 16]);

/// A distinct key per (chain, index).
pub fn key(chain: u32, i: u32) -> BlockKey {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&chain.to_le_bytes());
    k[4..8].copy_from_slice(&i.to_le_bytes());
    k[8] = 0xA5;
    BlockKey(k)
}

/// Meta of block `i` of `chain` (parent = block i-1).
pub fn meta(chain: u32, i: u32, len: usize) -> BlockMeta {
    BlockMeta { namespace: NS, parent: (i > 0).then(|| key(chain, i - 1)), len: len as u64, owner: None }
}

/// Deterministic content derived from the key, so any reader can verify every byte.
pub fn content(k: &BlockKey, len: usize) -> Vec<u8> {
    kvclient::synthetic_block(k.low64(), 0, len)
}

pub fn host_cfg(dir: &Path, capacity: u64) -> HostTierConfig {
    let mut c = HostTierConfig::with_capacity(capacity);
    c.shm_dir = dir.to_path_buf();
    c.page_size = PAGE;
    c.high_watermark = 1.0;
    c.low_watermark = 1.0;
    c
}

pub fn disk_cfg(dir: &Path, capacity: u64) -> DiskTierConfig {
    let mut c = DiskTierConfig::new(dir, capacity);
    c.page_size = PAGE;
    c.high_watermark = 1.0;
    c.low_watermark = 1.0;
    c.fsync = false;
    c
}

pub fn host(dir: &Path, capacity: u64) -> Arc<HostTier> {
    Arc::new(HostTier::open(&host_cfg(dir, capacity)).unwrap())
}

pub fn disk(dir: &Path, capacity: u64, backend: IoBackend) -> Arc<DiskTier> {
    let cfg = disk_cfg(dir, capacity);
    Arc::new(DiskTier::open_with_engine(&cfg, engine_factory(backend, 32)).unwrap())
}

pub fn as_tier<T: Tier + 'static>(t: Arc<T>) -> Arc<dyn Tier> {
    t
}
