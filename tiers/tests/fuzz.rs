//! Property tests that feed arbitrary bytes to what the tiers read back from storage another
//! process (or a crash, or a failing disk) may have written: G3 index records, a G3 directory
//! whose index holds arbitrary records, and G4 object headers. Each must be refused (a miss),
//! never panic, and never serve bytes that are not a block that was put.
//!
//! A short run is part of `cargo test`; a long one: `PROPTEST_CASES=20000 cargo test -p kvtiers
//! --test fuzz --release` (docs/operations/security-limits.md, "Fuzzing").
#![allow(clippy::unwrap_used)]

use kvproto::fuzzing::{bytes, cases};
use kvproto::{BlockKey, NamespaceId};
use kvtiers::disk::index::{self, IndexEntry};
use kvtiers::object::format;
use kvtiers::{BlockBuf, BlockMeta, DiskTier, DiskTierConfig, SumKind, Tier, TierExt};
use proptest::prelude::*;

fn entry() -> impl Strategy<Value = IndexEntry> {
    (
        any::<[u8; 16]>(),
        proptest::option::of(any::<[u8; 16]>()),
        any::<u64>(),
        any::<u64>(),
        any::<bool>(),
        any::<u64>(),
        proptest::collection::vec((any::<u32>(), any::<u32>()), 0..6),
    )
        .prop_map(|(ns, parent, len, checksum, crc, tick, runs)| IndexEntry {
            meta: BlockMeta { namespace: NamespaceId(ns), parent: parent.map(BlockKey), len, owner: None },
            checksum,
            sum_kind: if crc { SumKind::Crc64 } else { SumKind::Xxh3 },
            tick,
            runs,
        })
}

const PAGE: usize = 4096;
const PAGES: u64 = 64;

fn disk_cfg(dir: &std::path::Path) -> DiskTierConfig {
    let mut c = DiskTierConfig::new(dir, PAGES * PAGE as u64);
    c.page_size = PAGE;
    c.fsync = false;
    c.high_watermark = 1.0;
    c.low_watermark = 1.0;
    c
}

fn block(i: u8, len: usize) -> (BlockKey, Vec<u8>) {
    (BlockKey([i; 16]), (0..len).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i)).collect())
}

proptest! {
    #![proptest_config(cases(512))]

    /// G3 index records from arbitrary bytes: refused, or exactly the record that encodes to them.
    #[test]
    fn index_records_from_bytes(b in bytes(120)) {
        if let Some(e) = index::decode(&b) {
            prop_assert_eq!(index::encode(&e), b);
        }
    }

    /// A valid record with a byte flipped or cut short: refused or another valid record.
    #[test]
    fn index_records_mutated(e in entry(), at in any::<usize>(), x in 1u8..=255, cut in any::<usize>()) {
        let mut b = index::encode(&e);
        let back = index::decode(&b);
        prop_assert_eq!(back.as_ref(), Some(&e));
        let i = at % b.len();
        b[i] ^= x;
        b.truncate(cut % (b.len() + 1));
        if let Some(d) = index::decode(&b) {
            prop_assert_eq!(index::encode(&d), b);
        }
    }

    /// G4 objects from arbitrary bytes (a header at least as long as one, half the time).
    #[test]
    fn object_headers_from_bytes(mut b in bytes(200), magic in any::<bool>()) {
        if magic && b.len() >= 8 {
            b[..4].copy_from_slice(&format::MAGIC);
            b[4..6].copy_from_slice(&format::VERSION.to_le_bytes());
            b[6..8].copy_from_slice(&(format::HEADER_BYTES as u16).to_le_bytes());
        }
        if let Ok((_, meta)) = format::parse_header(&b) {
            prop_assert!(meta.len <= format::MAX_DATA_BYTES);
        }
        let _ = format::verify(&BlockKey([0; 16]), &b);
    }

    /// A valid object with any byte flipped is never verified, whatever the flip.
    #[test]
    fn object_flips_are_caught(data in bytes(300), parent in proptest::option::of(any::<[u8; 16]>()),
                               at in any::<usize>(), x in 1u8..=255, cut in any::<usize>()) {
        let key = BlockKey([5; 16]);
        let meta = BlockMeta { namespace: NamespaceId([1; 16]), parent: parent.map(BlockKey), len: data.len() as u64, owner: None };
        let mut o = format::header(&key, &meta, &data).to_vec();
        o.extend_from_slice(&data);
        prop_assert!(format::verify(&key, &o).is_ok());
        let mut flipped = o.clone();
        let i = at % flipped.len();
        flipped[i] ^= x;
        prop_assert!(format::verify(&key, &flipped).is_err(), "flip at {} of {}", i, o.len());
        let short = cut % o.len();
        prop_assert!(format::verify(&key, &o[..short]).is_err());
    }
}

proptest! {
    // Each case opens a G3 directory twice (RocksDB and the data file): fewer cases.
    #![proptest_config(cases(12))]

    /// A G3 directory whose index gained arbitrary records (arbitrary keys and values, and
    /// valid records with fields changed) reopens without repair, and serves only blocks that
    /// were put, byte for byte.
    #[test]
    fn g3_reopens_over_arbitrary_index_records(
        raw in proptest::collection::vec((bytes(20), bytes(90)), 0..8),
        forged in proptest::collection::vec((any::<u8>(), entry()), 0..8),
        damaged in proptest::collection::vec((0u8..4, any::<usize>(), 1u8..=255), 0..4),
    ) {
        let d = tempfile::tempdir().unwrap();
        let cfg = disk_cfg(d.path());
        let blocks: Vec<(BlockKey, Vec<u8>)> = (0..4u8).map(|i| block(i, 3000 + 2500 * i as usize)).collect();
        {
            let t = DiskTier::open(&cfg).unwrap();
            for (k, data) in &blocks {
                let meta = BlockMeta { namespace: NamespaceId([9; 16]), parent: None, len: data.len() as u64, owner: None };
                t.put(kvtiers::BlockRef { key: *k, meta, data }).unwrap();
            }
            t.flush().unwrap();
        }
        {
            let db = rocksdb::DB::open_default(d.path().join("index")).unwrap();
            for (k, v) in &raw {
                db.put(k, v).unwrap();
            }
            for (k, e) in &forged {
                db.put([*k; 16], index::encode(e)).unwrap();
            }
            // Damage records of blocks that were put: a byte flipped in place.
            for &(which, at, x) in &damaged {
                let key = blocks[which as usize].0;
                if let Some(mut v) = db.get(key.0).unwrap() {
                    let i = at % v.len();
                    v[i] ^= x;
                    db.put(key.0, v).unwrap();
                }
            }
        }
        let t = DiskTier::open(&cfg).unwrap();
        let mut out = BlockBuf::new();
        for (k, _) in t.keys() {
            if let Ok(Some(_)) = t.get(&k, &mut out) {
                let served: &[u8] = &out;
                prop_assert!(blocks.iter().any(|(_, b)| b.as_slice() == served), "served bytes that were never put");
            }
        }
        // The tier still works: a new block goes in and comes back.
        let (k, data) = block(200, 5000);
        let meta = BlockMeta { namespace: NamespaceId([9; 16]), parent: None, len: data.len() as u64, owner: None };
        if t.put(kvtiers::BlockRef { key: k, meta, data: &data }).is_ok() {
            let got = t.get(&k, &mut out).unwrap();
            prop_assert!(got.is_some());
            prop_assert_eq!(&out[..], &data[..]);
        }
    }
}
