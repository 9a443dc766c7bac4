//! The G4 object format (docs/architecture.md, "G4 objects"): one object per block, a fixed
//! 96-byte header followed by the block's bytes. Every read verifies the whole header and the
//! data's checksum against what was asked for; anything else is a miss, never data.
//!
//! ```text
//! offset size  field
//!  0      4    magic "KVG4"
//!  4      2    format version (1), little-endian
//!  6      2    header length (96), little-endian
//!  8     16    namespace id (the public hash of the namespace's fingerprint)
//! 24     16    block key
//! 40     16    parent key (zeros when has_parent is 0)
//! 56      1    has_parent (0 or 1)
//! 57      7    reserved (zeros)
//! 64      8    data length, little-endian
//! 72      8    XXH3-64 of the data, little-endian
//! 80      8    XXH3-64 of bytes 0..80, little-endian
//! 88      8    reserved (zeros, checked)
//! 96      -    data
//! ```

use kvproto::{BlockKey, NamespaceId};
use xxhash_rust::xxh3::xxh3_64;

use crate::block::BlockMeta;

/// The first bytes of every object.
pub const MAGIC: [u8; 4] = *b"KVG4";
/// The format version written and read.
pub const VERSION: u16 = 1;
/// Bytes before the data.
pub const HEADER_BYTES: usize = 96;

/// The header of a block with `meta`, key `key` and data `data`.
pub fn header(key: &BlockKey, meta: &BlockMeta, data: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(HEADER_BYTES as u16).to_le_bytes());
    h[8..24].copy_from_slice(&meta.namespace.0);
    h[24..40].copy_from_slice(&key.0);
    if let Some(p) = meta.parent {
        h[40..56].copy_from_slice(&p.0);
        h[56] = 1;
    }
    h[64..72].copy_from_slice(&(data.len() as u64).to_le_bytes());
    h[72..80].copy_from_slice(&xxh3_64(data).to_le_bytes());
    let sum = xxh3_64(&h[..80]);
    h[80..88].copy_from_slice(&sum.to_le_bytes());
    h
}

/// Why an object is not the block asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    /// Shorter than a header, or its data is not the length the header says.
    Truncated { have: usize, want: usize },
    /// Not one of our objects, or a format version this build does not read.
    Format(String),
    /// The header's own checksum fails.
    HeaderChecksum,
    /// The header names another block.
    OtherKey,
    /// The data's checksum fails.
    DataChecksum,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Invalid::Truncated { have, want } => write!(f, "object is {have} bytes, its header says {want}"),
            Invalid::Format(why) => f.write_str(why),
            Invalid::HeaderChecksum => f.write_str("header checksum mismatch"),
            Invalid::OtherKey => f.write_str("the header names another block"),
            Invalid::DataChecksum => f.write_str("data checksum mismatch"),
        }
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// The largest block an object may hold (16 GiB): a header claiming more is not ours, whatever
/// its checksum says, and is never allocated for.
pub const MAX_DATA_BYTES: u64 = 16 << 30;

/// The data checksum a header records.
pub fn data_checksum(h: &[u8; HEADER_BYTES]) -> u64 {
    u64_at(h, 72)
}

/// The metadata of a header (not yet checked against data).
pub fn parse_header(h: &[u8]) -> Result<(BlockKey, BlockMeta), Invalid> {
    if h.len() < HEADER_BYTES {
        return Err(Invalid::Truncated { have: h.len(), want: HEADER_BYTES });
    }
    if h[0..4] != MAGIC {
        return Err(Invalid::Format("not a kvcached G4 object (magic)".into()));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    let hlen = u16::from_le_bytes([h[6], h[7]]);
    if version != VERSION || usize::from(hlen) != HEADER_BYTES {
        return Err(Invalid::Format(format!("G4 object format {version} (header {hlen} bytes) is not readable here")));
    }
    if xxh3_64(&h[..80]) != u64_at(h, 80) {
        return Err(Invalid::HeaderChecksum);
    }
    if h[88..HEADER_BYTES].iter().any(|&b| b != 0) {
        return Err(Invalid::Format("reserved header bytes are not zero".into()));
    }
    let mut ns = [0u8; 16];
    ns.copy_from_slice(&h[8..24]);
    let mut key = [0u8; 16];
    key.copy_from_slice(&h[24..40]);
    let parent = match h[56] {
        0 => None,
        1 => {
            let mut p = [0u8; 16];
            p.copy_from_slice(&h[40..56]);
            Some(BlockKey(p))
        }
        _ => return Err(Invalid::Format("has_parent is neither 0 nor 1".into())),
    };
    let len = u64_at(h, 64);
    if len > MAX_DATA_BYTES {
        return Err(Invalid::Format(format!("a block of {len} bytes is larger than any block this build reads")));
    }
    Ok((BlockKey(key), BlockMeta { namespace: NamespaceId(ns), parent, len, owner: None }))
}

/// Checks a whole object against the block `key` it was read for; returns its metadata and the
/// range of its data.
pub fn verify(key: &BlockKey, object: &[u8]) -> Result<(BlockMeta, std::ops::Range<usize>), Invalid> {
    let (k, meta) = parse_header(object)?;
    if k != *key {
        return Err(Invalid::OtherKey);
    }
    let want = (HEADER_BYTES as u64).saturating_add(meta.len);
    if object.len() as u64 != want {
        return Err(Invalid::Truncated { have: object.len(), want: usize::try_from(want).unwrap_or(usize::MAX) });
    }
    let data = HEADER_BYTES..object.len();
    if xxh3_64(&object[data.clone()]) != u64_at(object, 72) {
        return Err(Invalid::DataChecksum);
    }
    Ok((meta, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(data: &[u8], parent: Option<BlockKey>) -> Vec<u8> {
        let meta = BlockMeta { namespace: NamespaceId([3; 16]), parent, len: data.len() as u64, owner: None };
        let mut o = header(&BlockKey([7; 16]), &meta, data).to_vec();
        o.extend_from_slice(data);
        o
    }

    #[test]
    fn objects_round_trip_and_every_flipped_byte_is_caught() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 13) as u8).collect();
        for parent in [None, Some(BlockKey([9; 16]))] {
            let o = object(&data, parent);
            let (meta, range) = verify(&BlockKey([7; 16]), &o).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((meta.parent, meta.len, &o[range]), (parent, 1000, &data[..]));
            for at in (0..o.len()).step_by(7) {
                let mut bad = o.clone();
                bad[at] ^= 0x20;
                assert!(verify(&BlockKey([7; 16]), &bad).is_err(), "flip at {at} passed");
            }
            assert_eq!(verify(&BlockKey([8; 16]), &o), Err(Invalid::OtherKey));
            assert!(matches!(verify(&BlockKey([7; 16]), &o[..o.len() - 1]), Err(Invalid::Truncated { .. })));
            assert!(matches!(verify(&BlockKey([7; 16]), &o[..10]), Err(Invalid::Truncated { .. })));
        }
    }
}
