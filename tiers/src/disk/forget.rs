//! Dropping blocks from G3: the index record goes first, then the pages. When the index cannot
//! delete (RocksDB refusing writes while its disk is full), the pages stay taken until a later
//! delete succeeds: reused under a record that still names them, they would leave a restart two
//! records for one page (the older one dropped then as unusable). Every put's `make_room` and
//! every flush retries the pending deletes first; while the index still refuses, a put fails
//! without evicting more blocks.

use std::sync::Arc;

use kvproto::BlockKey;

use super::{DiskSlot, DiskTier};
use crate::error::Result;
use crate::residency::{Residency, Resident};

impl DiskTier {
    /// Deletes the records of `dropped` (blocks already out of `st`), and of those whose
    /// delete failed before, then frees their pages; on failure they are kept for the next
    /// call. The caller holds the state lock, so that no block is stored or dropped meanwhile.
    pub(super) fn forget(&self, st: &Residency<DiskSlot>, dropped: Vec<(BlockKey, Arc<DiskSlot>)>) -> Result<()> {
        let mut all = std::mem::take(&mut *self.undeleted.lock());
        // A key stored again since has a newer record in place of the one that failed to go:
        // deleting the key now would delete that one.
        all.retain(|(k, _)| !st.contains(k));
        all.extend(dropped);
        if all.is_empty() {
            return Ok(());
        }
        let keys: Vec<BlockKey> = all.iter().map(|(k, _)| *k).collect();
        match self.index.write(&[], &keys, false) {
            Ok(()) => Ok(()),
            Err(e) => {
                // The failure reaches the caller (a put failing, counted and logged there).
                self.undeleted.lock().extend(all);
                Err(e)
            }
        }
    }
}

/// The slots of blocks dropped from a [`Residency`], for [`DiskTier::forget`].
pub(super) fn slots(
    dropped: impl IntoIterator<Item = (BlockKey, Resident<DiskSlot>)>,
) -> Vec<(BlockKey, Arc<DiskSlot>)> {
    dropped.into_iter().map(|(k, r)| (k, r.slot)).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::Ordering;

    use kvproto::NamespaceId;

    use super::*;
    use crate::{BlockMeta, BlockRef, DiskTierConfig, Tier, TierExt};

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 16])
    }

    /// With the index refusing writes, dropped blocks keep their pages, so nothing is stored
    /// over them while their records stand; once it writes again they are freed, and a restart
    /// finds every record whole.
    #[test]
    fn pages_of_blocks_whose_records_stay_are_not_reused() {
        let d = tempfile::tempdir().unwrap();
        let page = 64 << 10;
        let mut cfg = DiskTierConfig::new(d.path(), 6 * page as u64);
        cfg.fsync = false;
        cfg.high_watermark = 1.0;
        cfg.low_watermark = 1.0;
        let meta = BlockMeta { namespace: NamespaceId([3; 16]), parent: None, len: 2 * page as u64, owner: None };
        let data = vec![7u8; 2 * page];
        let other = vec![9u8; 2 * page];
        {
            let t = DiskTier::open(&cfg).unwrap();
            for i in 0..3 {
                assert!(t.put(BlockRef { key: key(i), meta, data: &data }).unwrap());
            }
            assert_eq!(t.pool.free_pages(), 0);
            t.index.fail_writes.store(true, Ordering::Relaxed);
            assert!(t.remove(&key(0)).is_err(), "the index refused the delete");
            assert!(!t.contains(&key(0)), "no longer served");
            assert_eq!(t.pool.free_pages(), 0, "its pages stay taken while its record stands");
            assert!(t.remove(&key(1)).is_err());
            // While the index refuses, a put finds no room and takes no other block out.
            assert!(t.put(BlockRef { key: key(9), meta, data: &data }).is_err());
            assert!(t.contains(&key(2)), "a live block stays while deletes are pending");
            t.index.fail_writes.store(false, Ordering::Relaxed);
            assert!(t.remove(&key(2)).unwrap(), "the retry deletes key 0's and key 1's records");
            assert_eq!(t.pool.free_pages(), 6);
            t.index.fail_writes.store(true, Ordering::Relaxed);
            assert!(t.put(BlockRef { key: key(3), meta, data: &data }).is_err());
            t.index.fail_writes.store(false, Ordering::Relaxed);
            assert!(t.put(BlockRef { key: key(4), meta, data: &data }).unwrap());
            t.index.fail_writes.store(true, Ordering::Relaxed);
            assert!(t.remove(&key(4)).is_err());
            t.index.fail_writes.store(false, Ordering::Relaxed);
            // The put retries the pending delete first, then writes key 4's new record.
            assert!(t.put(BlockRef { key: key(4), meta, data: &other }).unwrap(), "stored again");
            assert_eq!(t.pool.free_pages(), 4, "the old pages of key 4 freed by the retry");
            assert!(t.put(BlockRef { key: key(5), meta, data: &data }).unwrap());
            assert!(t.remove(&key(5)).unwrap());
            assert_eq!(t.pool.free_pages(), 4);
            t.flush().unwrap();
        }
        let t = DiskTier::open(&cfg).unwrap();
        for i in [0, 1, 2, 3, 5] {
            assert!(!t.contains(&key(i)), "key {i}");
        }
        let mut out = crate::BlockBuf::new();
        assert!(t.get(&key(4), &mut out).unwrap().is_some(), "key 4's new record survived the retried delete");
        assert_eq!(&out[..], &other[..]);
    }
}
