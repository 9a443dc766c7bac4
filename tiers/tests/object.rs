//! G4 beyond the conformance suite: other daemons' objects found in a few round trips against a
//! slow store, corrupt objects, and G4 in a block store (write-through, promotion through G3).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvtiers::{BlockBuf, BlockRef, ObjectTier, ObjectTierConfig, Tier, TierExt};

fn shared(dir: &std::path::Path) -> ObjectTierConfig {
    ObjectTierConfig::new(format!("file://{}", dir.join("bucket").display()))
}

/// A chain of 8192 small blocks another daemon wrote, asked through a store answering in 10 ms
/// a request: found in at most 5 round trips; a chain with nothing in G4 costs one.
#[test]
fn a_long_prefix_is_found_in_a_few_round_trips() {
    let d = tempfile::tempdir().unwrap();
    let writer = ObjectTier::open(&shared(d.path())).unwrap();
    let keys: Vec<_> = (0..8192).map(|i| key(70, i)).collect();
    let data: Vec<Vec<u8>> = (0..8192).map(|i| content(&key(70, i), 64)).collect();
    for chunk in (0..8192u32).collect::<Vec<_>>().chunks(512) {
        let blocks: Vec<BlockRef<'_>> = chunk
            .iter()
            .map(|&i| BlockRef { key: key(70, i), meta: meta(70, i, 64), data: &data[i as usize] })
            .collect();
        assert!(writer.put_batch(&blocks).into_iter().all(|r| r.unwrap()));
    }
    let mut slow = shared(d.path());
    slow.inject_latency = Some(Duration::from_millis(10));
    let reader = ObjectTier::open(&slow).unwrap();
    let ns = meta(70, 0, 64).namespace;
    let t0 = Instant::now();
    let (n, rounds) = reader.probe_rounds(ns, &keys);
    assert_eq!(n, 8192);
    assert!(rounds <= 5, "{rounds} round trips");
    assert!(t0.elapsed() < Duration::from_millis(10 * 5 + 400), "{:?}", t0.elapsed());
    // Known now: asking again costs nothing.
    assert_eq!(reader.probe_rounds(ns, &keys), (8192, 0));
    // A chain with nothing in G4: one round trip.
    let none: Vec<_> = (0..8192).map(|i| key(71, i)).collect();
    assert_eq!(reader.probe_rounds(ns, &none), (0, 1));
    // Half of a chain: found exactly.
    let (n, rounds) = reader.probe_rounds(ns, &[&keys[..100], &none[..50]].concat());
    assert_eq!((n, rounds), (100, 0), "the first 100 are known already");
    // Reads come back byte-exact.
    let mut buf = BlockBuf::new();
    assert!(reader.get(&keys[4000], &mut buf).unwrap().is_some());
    assert_eq!(&buf[..], &data[4000][..]);
}

/// An object whose bytes changed is a miss, counted, and deleted; it never reaches the caller.
#[test]
fn a_corrupt_object_is_a_counted_miss_and_deleted() {
    let d = tempfile::tempdir().unwrap();
    let t = ObjectTier::open(&shared(d.path())).unwrap();
    let k = key(80, 0);
    let data = content(&k, 5000);
    t.put(BlockRef { key: k, meta: meta(80, 0, 5000), data: &data }).unwrap();
    let file = walk(&d.path().join("bucket")).into_iter().next().unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 1;
    bytes[at] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let mut buf = BlockBuf::new();
    assert!(t.get(&k, &mut buf).unwrap().is_none());
    assert_eq!(t.stats().checksum_failures, 1);
    assert!(!file.exists(), "the corrupt object is deleted");
    assert!(!t.contains(&k));
}

/// Every way an object can differ from the block asked for is a counted miss: cut short, longer
/// than its header says, a flipped header bit, another block's object in its place, empty.
#[test]
fn every_damaged_object_is_a_miss() {
    type Damage = fn(Vec<u8>, &[u8]) -> Vec<u8>;
    let cases: [(&str, Damage); 6] = [
        ("cut short", |b, _| b[..b.len() - 100].to_vec()),
        ("header only", |b, _| b[..96].to_vec()),
        ("longer", |mut b, _| {
            b.extend_from_slice(&[0u8; 10]);
            b
        }),
        ("header bit", |mut b, _| {
            b[30] ^= 4;
            b
        }),
        ("another block", |_, other| other.to_vec()),
        ("empty", |_, _| Vec::new()),
    ];
    for (n, (what, damage)) in cases.into_iter().enumerate() {
        let d = tempfile::tempdir().unwrap();
        let t = ObjectTier::open(&shared(d.path())).unwrap();
        let (k, other) = (key(81, n as u32), key(82, n as u32));
        for (key, len) in [(k, 70_000usize), (other, 70_000)] {
            let data = content(&key, len);
            t.put(BlockRef { key, meta: meta(81, 0, len), data: &data }).unwrap();
        }
        let files = walk(&d.path().join("bucket"));
        let path_of = |key: &kvproto::BlockKey| files.iter().find(|f| f.ends_with(key.to_string())).unwrap().clone();
        let (file, other_file) = (path_of(&k), path_of(&other));
        let damaged = damage(std::fs::read(&file).unwrap(), &std::fs::read(&other_file).unwrap());
        std::fs::write(&file, damaged).unwrap();
        let mut buf = BlockBuf::new();
        assert!(t.get(&k, &mut buf).unwrap().is_none(), "{what}: served");
        assert_eq!(t.stats().checksum_failures, 1, "{what}: not counted");
        assert!(!file.exists(), "{what}: the damaged object is deleted");
        assert!(t.get(&other, &mut buf).unwrap().is_some(), "{what}: the intact block still reads");
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}

/// In a block store with G2, G3 and G4: a save is written through to both lower tiers; a block
/// found only in G4 (another daemon's) is promoted into G2 and written into G3 on its way.
#[test]
fn a_store_writes_through_to_g4_and_promotes_through_g3() {
    let d = tempfile::tempdir().unwrap();
    let cfg = kvtiers::BlockStoreConfig {
        g2: host_cfg(d.path(), 16 << 20),
        g3: Some(disk_cfg(&d.path().join("g3"), 64 << 20)),
        write_through: kvtiers::WriteThroughConfig::default(),
        g4: Some(shared(d.path())),
        g4_write_through: kvtiers::WriteThroughConfig::default(),
    };
    let store = kvtiers::BlockStore::open(&cfg).unwrap();
    let k = key(90, 0);
    let data = content(&k, 70_000);
    store.put(k, meta(90, 0, 70_000), &data).unwrap();
    store.flush().unwrap();
    let g4 = store.lower().iter().find(|t| t.kind() == kvproto::TierKind::G4Object).unwrap();
    assert!(g4.contains(&k));
    // Another daemon's block, only in the bucket.
    let other = ObjectTier::open(&shared(d.path())).unwrap();
    let k2 = key(91, 0);
    let d2 = content(&k2, 9000);
    other.put(BlockRef { key: k2, meta: meta(91, 0, 9000), data: &d2 }).unwrap();
    assert_eq!(store.probe_lower(meta(91, 0, 9000).namespace, &[k2]), 1);
    let promoted = store.promote_batch(&[k2]).unwrap();
    assert_eq!(promoted, vec![(k2, kvproto::TierKind::G4Object)]);
    store.flush().unwrap();
    let g3 = &store.lower()[0];
    assert!(g3.contains(&k2), "a G4 hit lands in G3 too");
    let mut buf = BlockBuf::new();
    assert_eq!(store.get(&k2, &mut buf).unwrap().unwrap().tier, kvproto::TierKind::G2Host);
    assert_eq!(&buf[..], &d2[..]);
}
