//! Engines that know what they saved, for the crash loops (`crash.rs`) and the fault suites
//! (`faults.rs`): prompt `seed`'s tokens and the KV of its blocks both follow from the seed
//! ([`prompt`], [`kvclient::synthetic_block`]), so every block a daemon serves can be checked
//! byte for byte without keeping a copy.

use std::path::Path;
use std::time::{Duration, Instant};

use kvclient::{Client, ClientError, KvMemory, synthetic_block};
use kvproto::pb;
use kvproto::{Dtype, KvLayout, LayoutKind, Namespace};

/// 2 layers x K and V x 1 head x 128 x bf16 x 16 tokens: 16 KiB blocks, so that hundreds of
/// cycles of blocks fit a small G3 (page size 8192), in segments of whole 4 KiB pages, so that
/// G3 hits are read straight into the engines' memory, as for real models' layouts.
pub fn layout() -> KvLayout {
    KvLayout {
        num_layers: 2,
        kv_heads: 1,
        head_dim: 128,
        dtype: Dtype::Bf16,
        tokens_per_block: 16,
        kind: LayoutKind::LayerSeparate,
    }
}

/// Bytes of one block of [`layout`].
pub fn block_len() -> usize {
    layout().block_bytes() as usize
}

/// The namespace of model `model` with [`layout`].
pub fn ns(model: &str) -> Namespace {
    Namespace::new(model, layout())
}

/// Prompt `seed`'s first `blocks` blocks of tokens. Different seeds share no first block (their
/// first tokens differ), so no two prompts share a key.
pub fn prompt(seed: u64, blocks: u32) -> Vec<u32> {
    (0..u64::from(blocks) * 16)
        .map(|i| {
            // splitmix64 of (seed, position)
            let mut z = (seed << 24 ^ i).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % 150_000) as u32
        })
        .collect()
}

/// Block `b` of prompt `seed`.
pub fn block(seed: u64, b: u32) -> Vec<u8> {
    synthetic_block(seed, b, block_len())
}

/// What a checked load found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checked {
    /// Blocks the daemon said it loaded.
    pub loaded: u32,
    /// Of those, blocks whose bytes were not the prompt's.
    pub wrong: u32,
}

/// A byte no synthetic block is made of alone: slots are filled with it before a load, so a
/// load that claims a block it did not write is caught.
const POISON: u8 = 0xA5;

/// An engine: a client registered over the daemon's socket with `slots` slots of KV memory.
#[derive(Debug)]
pub struct Engine {
    pub client: Client,
    pub mem: KvMemory,
}

impl Engine {
    /// Connects to `socket` and registers `name` in `namespace`.
    pub async fn attach(socket: &Path, name: &str, namespace: &Namespace, slots: u32) -> Result<Self, ClientError> {
        let mem = KvMemory::anonymous(&layout(), slots).map_err(ClientError::Io)?;
        let client = Client::connect(socket).await?;
        client.register(name, namespace, &mem).await?;
        Ok(Self { client, mem })
    }

    /// Writes prompt `seed`'s first `blocks` blocks into slots from `first_slot` on and saves
    /// them.
    pub async fn save(&mut self, seed: u64, blocks: u32, first_slot: u32) -> Result<pb::SaveResponse, ClientError> {
        for b in 0..blocks {
            self.mem.write_block(first_slot + b, &block(seed, b));
        }
        let slots: Vec<u32> = (first_slot..first_slot + blocks).collect();
        self.client.save(&prompt(seed, blocks), 0, &slots).await
    }

    /// Loads prompt `seed` (its first `blocks` blocks) into slots from `first_slot` on, filled
    /// with [`POISON`] first, and checks every block the daemon says it loaded.
    pub async fn load_checked(
        &mut self,
        seed: u64,
        blocks: u32,
        first_slot: u32,
    ) -> Result<(Checked, pb::LoadStatus), ClientError> {
        let poison = vec![POISON; block_len()];
        for b in 0..blocks {
            self.mem.write_block(first_slot + b, &poison);
        }
        let slots: Vec<u32> = (first_slot..first_slot + blocks).collect();
        let status = self.client.load_now(&prompt(seed, blocks), 0, &slots).await?;
        Ok((self.check(seed, status.loaded_blocks.min(blocks), first_slot), status))
    }

    /// Saves prompt `seed` (`blocks` blocks, from slot 0) within `bound`, all of it stored (the
    /// fault suites' saves: the fault must not hold them).
    pub async fn save_within(&mut self, seed: u64, blocks: u32, bound: Duration) {
        let t0 = Instant::now();
        let r = self.save(seed, blocks, 0).await.unwrap_or_else(|e| panic!("saving prompt {seed}: {e}"));
        assert_eq!(r.stored + r.already_present, blocks, "{r:?}");
        assert!(t0.elapsed() < bound, "a save took {:?}", t0.elapsed());
    }

    /// Loads prompt `seed` into slots 64.. (past the fault suites' saves) and checks it: (blocks
    /// loaded, status, took).
    pub async fn load_timed(&mut self, seed: u64, blocks: u32) -> (u32, pb::LoadStatus, Duration) {
        let t0 = Instant::now();
        let (c, st) =
            self.load_checked(seed, blocks, 64).await.unwrap_or_else(|e| panic!("loading prompt {seed}: {e}"));
        assert_eq!(c.wrong, 0, "wrong bytes served for prompt {seed}: {st:?}");
        (c.loaded, st, t0.elapsed())
    }

    /// Checks slots `first_slot..` against prompt `seed`'s first `loaded` blocks.
    pub fn check(&self, seed: u64, loaded: u32, first_slot: u32) -> Checked {
        let wrong = (0..loaded).filter(|&b| self.mem.read_block(first_slot + b) != block(seed, b)).count() as u32;
        Checked { loaded, wrong }
    }
}
