//! The durable G3 index in RocksDB: block key -> location, length, checksum, namespace,
//! parent, recency.
//!
//! An entry is written only after the block's bytes are on disk, so after any restart (clean or
//! `kill -9`) every indexed block is complete; bytes without an entry are free space. Record
//! format (little-endian):
//! `version u8 | namespace id [16] | has_parent u8 | parent [16] | len u64 | checksum u64 |
//!  tick u64 | n_runs u32 | (first_page u32, pages u32) * n_runs`.
//! Version 2 (written now): the checksum is CRC-64/NVME; version 1 (read): XXH3-64.
//! The record under [`META_KEY`] holds the page size the data file was laid out with.

use std::path::Path;

use kvproto::{BlockKey, NamespaceId};
use rocksdb::{DB, Options, WriteBatch, WriteOptions};

use crate::block::{BlockMeta, SumKind};
use crate::error::{Result, TierError};

/// Key of the layout record (not 16 bytes long, so it never collides with a block key).
pub const META_KEY: &[u8] = b"!kvcached-g3-meta";
const RECORD_VERSION: u8 = 2;
/// Records written before G3 summed with CRC-64: still read, verified with XXH3.
const RECORD_VERSION_XXH3: u8 = 1;
const META_VERSION: u8 = 1;
/// The index's memtable (RocksDB's default is 64 MiB). RocksDB keeps this much free space in
/// reserve: after a write fails for want of space it resumes by itself only once that much is
/// free again, so a small memtable lets G3 write again soon after space is freed on a full disk
/// (`tests/faults.rs`, `a_disk_that_fills_up`). 8 MiB holds ~100 000 records.
const INDEX_MEMTABLE_BYTES: usize = 8 << 20;

/// One decoded index entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub meta: BlockMeta,
    pub checksum: u64,
    /// What `checksum` is: the record's version says.
    pub sum_kind: SumKind,
    pub tick: u64,
    pub runs: Vec<(u32, u32)>,
}

fn index_err(e: rocksdb::Error) -> TierError {
    TierError::Index(e.to_string())
}

pub fn encode(e: &IndexEntry) -> Vec<u8> {
    let mut out = Vec::with_capacity(62 + 8 * e.runs.len());
    out.push(match e.sum_kind {
        SumKind::Crc64 => RECORD_VERSION,
        SumKind::Xxh3 => RECORD_VERSION_XXH3,
    });
    out.extend_from_slice(&e.meta.namespace.0);
    match e.meta.parent {
        Some(p) => {
            out.push(1);
            out.extend_from_slice(&p.0);
        }
        None => {
            out.push(0);
            out.extend_from_slice(&[0u8; 16]);
        }
    }
    out.extend_from_slice(&e.meta.len.to_le_bytes());
    out.extend_from_slice(&e.checksum.to_le_bytes());
    out.extend_from_slice(&e.tick.to_le_bytes());
    out.extend_from_slice(&(e.runs.len() as u32).to_le_bytes());
    for (first, n) in &e.runs {
        out.extend_from_slice(&first.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
    }
    out
}

fn take<const N: usize>(b: &[u8], at: &mut usize) -> Option<[u8; N]> {
    let s = b.get(*at..*at + N)?;
    *at += N;
    s.try_into().ok()
}

/// Decodes a record; `None` if it is malformed (treated as a lost block).
pub fn decode(b: &[u8]) -> Option<IndexEntry> {
    let mut at = 0;
    let sum_kind = match take::<1>(b, &mut at)?[0] {
        RECORD_VERSION => SumKind::Crc64,
        RECORD_VERSION_XXH3 => SumKind::Xxh3,
        _ => return None,
    };
    let namespace = NamespaceId(take::<16>(b, &mut at)?);
    let has_parent = take::<1>(b, &mut at)?[0];
    let parent = take::<16>(b, &mut at)?;
    // Exactly what `encode` writes: a damaged flag or a parent without its flag is a damaged
    // record, not a block without a parent (found by `tiers/tests/fuzz.rs`).
    if has_parent > 1 || (has_parent == 0 && parent != [0; 16]) {
        return None;
    }
    let len = u64::from_le_bytes(take::<8>(b, &mut at)?);
    let checksum = u64::from_le_bytes(take::<8>(b, &mut at)?);
    let tick = u64::from_le_bytes(take::<8>(b, &mut at)?);
    let n = u32::from_le_bytes(take::<4>(b, &mut at)?) as usize;
    if b.len() != at + 8 * n {
        return None;
    }
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let first = u32::from_le_bytes(take::<4>(b, &mut at)?);
        let count = u32::from_le_bytes(take::<4>(b, &mut at)?);
        runs.push((first, count));
    }
    Some(IndexEntry {
        meta: BlockMeta { namespace, parent: (has_parent == 1).then_some(BlockKey(parent)), len, owner: None },
        checksum,
        sum_kind,
        tick,
        runs,
    })
}

/// One record found by [`DiskIndex::scan`]: a decoded entry, or the raw key of a malformed one.
pub type ScannedRecord = std::result::Result<(BlockKey, IndexEntry), Vec<u8>>;

/// The RocksDB-backed index.
#[derive(Debug)]
pub struct DiskIndex {
    db: DB,
    /// Unit tests: every write fails, as when RocksDB's disk is full.
    #[cfg(test)]
    pub(super) fail_writes: std::sync::atomic::AtomicBool,
}

impl DiskIndex {
    /// Opens (or creates) the index at `path`; checks it was laid out with `page_size`.
    pub fn open(path: &Path, page_size: usize) -> Result<Self> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.set_max_open_files(64);
        opts.set_keep_log_file_num(2);
        opts.set_write_buffer_size(INDEX_MEMTABLE_BYTES);
        let db = DB::open(&opts, path).map_err(|e| {
            TierError::Index(format!(
                "cannot open the G3 index at {}: {e} (is another kvcached using this directory?)",
                path.display()
            ))
        })?;
        match db.get(META_KEY).map_err(index_err)? {
            Some(m) => {
                let ok = m.len() == 9 && m[0] == META_VERSION;
                let stored = ok.then(|| u64::from_le_bytes(m[1..9].try_into().unwrap_or([0; 8])));
                if stored != Some(page_size as u64) {
                    return Err(TierError::Config {
                        field: "g3 page_size",
                        reason: format!(
                            "{} was laid out with page size {:?}, configured {page_size}: set that page size or remove the directory",
                            path.display(),
                            stored
                        ),
                    });
                }
            }
            None => {
                let mut m = vec![META_VERSION];
                m.extend_from_slice(&(page_size as u64).to_le_bytes());
                db.put(META_KEY, m).map_err(index_err)?;
            }
        }
        Ok(Self {
            db,
            #[cfg(test)]
            fail_writes: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Every block entry; malformed records are returned as `Err(key bytes)` for removal.
    pub fn scan(&self) -> Result<Vec<ScannedRecord>> {
        let mut out = Vec::new();
        for item in self.db.iterator(rocksdb::IteratorMode::Start) {
            let (k, v) = item.map_err(index_err)?;
            if &*k == META_KEY {
                continue;
            }
            match (<[u8; 16]>::try_from(&*k), decode(&v)) {
                (Ok(key), Some(e)) => out.push(Ok((BlockKey(key), e))),
                _ => out.push(Err(k.to_vec())),
            }
        }
        Ok(out)
    }

    /// Commits entries and deletions in one atomic batch.
    pub fn write(&self, puts: &[(BlockKey, IndexEntry)], deletes: &[BlockKey], sync: bool) -> Result<()> {
        if puts.is_empty() && deletes.is_empty() {
            return Ok(());
        }
        #[cfg(test)]
        if self.fail_writes.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(TierError::Index("injected: no space left on device".into()));
        }
        let mut b = WriteBatch::default();
        for k in deletes {
            b.delete(k.0);
        }
        for (k, e) in puts {
            b.put(k.0, encode(e));
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(sync);
        self.db.write_opt(b, &wo).map_err(index_err)
    }

    /// Deletes raw keys (malformed records found at start).
    pub fn delete_raw(&self, keys: &[Vec<u8>]) -> Result<()> {
        let mut b = WriteBatch::default();
        for k in keys {
            b.delete(k);
        }
        self.db.write(b).map_err(index_err)
    }

    /// Records a new recency tick without the write-ahead log: losing it costs only LRU
    /// precision after a crash.
    pub fn touch(&self, entries: &[(BlockKey, IndexEntry)]) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut b = WriteBatch::default();
        for (k, e) in entries {
            b.put(k.0, encode(e));
        }
        let mut wo = WriteOptions::default();
        wo.disable_wal(true);
        self.db.write_opt(b, &wo).map_err(index_err)
    }

    /// Flushes memtables and the WAL.
    pub fn flush(&self) -> Result<()> {
        self.db.flush_wal(true).map_err(index_err)?;
        self.db.flush().map_err(index_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_roundtrip_and_rejects_garbage() {
        let e = IndexEntry {
            meta: BlockMeta {
                namespace: NamespaceId([7; 16]),
                parent: Some(BlockKey([9; 16])),
                len: 12345,
                owner: None,
            },
            checksum: 0xdead_beef,
            sum_kind: SumKind::Crc64,
            tick: 42,
            runs: vec![(3, 2), (10, 1)],
        };
        let b = encode(&e);
        assert_eq!(b[0], 2);
        assert_eq!(decode(&b), Some(e.clone()));
        assert_eq!(decode(&b[..b.len() - 1]), None);
        let root = IndexEntry { meta: BlockMeta { parent: None, ..e.meta }, ..e.clone() };
        assert_eq!(decode(&encode(&root)), Some(root));
        assert_eq!(decode(&[2, 0, 0]), None);
        assert_eq!(decode(&[3]), None);
        // A record of the XXH3 era (version 1) decodes as such, and round-trips.
        let old = IndexEntry { sum_kind: SumKind::Xxh3, ..e };
        let b = encode(&old);
        assert_eq!(b[0], 1);
        assert_eq!(decode(&b), Some(old));
    }
}
