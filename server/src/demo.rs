//! A walk through the block store with embedded defaults: no GPU, no config file.

use std::path::Path;
use std::time::Instant;

use kvproto::{Dtype, KvLayout, LayoutKind, Namespace, TierKind};
use kvtiers::{BlockBuf, BlockMeta, BlockStore, BlockStoreConfig, DiskTierConfig, HostTierConfig, TierError};

/// Deterministic synthetic KV for a block, so every byte can be verified after a load.
fn synthetic_kv(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn config(dir: &Path) -> BlockStoreConfig {
    let mut g2 = HostTierConfig::with_capacity(512 << 20);
    g2.populate = false;
    BlockStoreConfig { g2, g3: Some(DiskTierConfig::new(dir.join("g3"), 1 << 30)), write_through: Default::default() }
}

/// Saves a 4096-token prompt (Qwen3-0.6B-shaped KV, 16 tokens per block) into G2 with
/// write-through to G3, looks it up, loads it back byte-exact, restarts the store and loads it
/// from G3. Prints what happened at each step.
pub fn run(dir: &Path) -> Result<(), TierError> {
    let ns = Namespace::new(
        "Qwen/Qwen3-0.6B",
        KvLayout {
            num_layers: 28,
            kv_heads: 8,
            head_dim: 128,
            dtype: Dtype::Bf16,
            tokens_per_block: 16,
            kind: LayoutKind::LayerSeparate,
        },
    );
    let block_bytes = ns.layout.block_bytes() as usize;
    let tokens: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    let keys = ns.block_keys(&tokens);
    println!("namespace {} | {} blocks of {} KiB", ns.id(), keys.len(), block_bytes / 1024);

    let store = BlockStore::open(&config(dir))?;
    let t0 = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let meta = BlockMeta { namespace: ns.id(), parent: i.checked_sub(1).map(|p| keys[p]), len: block_bytes as u64 };
        store.put(*k, meta, &synthetic_kv(k.low64(), block_bytes))?;
    }
    println!("saved  {} blocks in {:.1} ms", keys.len(), t0.elapsed().as_secs_f64() * 1e3);
    let m = store.lookup(&keys);
    println!("lookup {} of {} blocks cached (G2 {})", m.blocks, keys.len(), m.fastest[TierKind::G2Host.index()]);
    store.flush()?;
    drop(store);

    let store = BlockStore::open(&config(dir))?;
    let m = store.lookup(&keys);
    println!("after restart: {} blocks cached (G3 {})", m.blocks, m.fastest[TierKind::G3Disk.index()]);
    let mut buf = BlockBuf::new();
    let (mut ok, mut from_g3) = (0, 0);
    let t0 = Instant::now();
    for k in &keys {
        if let Some(hit) = store.get(k, &mut buf)? {
            from_g3 += usize::from(hit.tier == TierKind::G3Disk);
            ok += usize::from(buf[..] == synthetic_kv(k.low64(), block_bytes)[..]);
        }
    }
    println!(
        "loaded {ok} blocks byte-exact ({from_g3} from G3, promoted to G2) in {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    for (tier, s) in store.stats().tiers {
        println!(
            "  {tier}: hits {} misses {} blocks {} used {} MiB / {} MiB, checksum failures {}",
            s.hits,
            s.misses,
            s.usage.blocks,
            s.usage.used_bytes >> 20,
            s.usage.capacity_bytes >> 20,
            s.checksum_failures
        );
    }
    if ok != keys.len() {
        return Err(TierError::Index(format!("only {ok} of {} blocks came back intact", keys.len())));
    }
    Ok(())
}
