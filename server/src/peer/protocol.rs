//! The peer channel's wire format: how one daemon asks another for blocks and receives them.
//! A dedicated framing over TCP (or TLS) rather than gRPC: a block's bytes go from the sender's
//! G2 pages to the socket and from the socket into the receiver's G2 pages with no message
//! around them to encode, copy or decode (docs/architecture.md, "Peer transfer"; the measured
//! difference is in docs/benchmarks.md). All integers little-endian.
//!
//! ```text
//! hello    client: "KVP1" | token_len u16 | token           (token_len 0: none, or mTLS)
//!          server: status u8 (0 ok, 1 refused) | msg_len u16 | msg
//! PULL     client: 1 u8 | namespace [16] | n u32 | n keys [16 each]
//!          server, per key in order until the first it lacks:
//!                  BLOCK 1 u8 | key [16] | has_parent u8 | parent [16] | len u64 | data | crc64 u64
//!          then    END 9 u8 | blocks sent u32
//!          or      REFUSED 2 u8 | msg_len u16 | msg          (the namespace is not granted)
//! PROBE    client: 2 u8 | bytes u32                          (a link-rate measurement)
//!          server: bytes of zeros, then END 9 u8 | 0 u32
//! BYE      client: 3 u8
//! ```

use std::io::{self, Read, Write};

use kvproto::{BlockKey, NamespaceId};

/// First bytes of a client's hello.
pub const MAGIC: [u8; 4] = *b"KVP1";
/// Longest token a hello may carry.
pub const MAX_TOKEN: usize = 4096;
/// Most keys one PULL may ask for (a 256k-token prompt in 16-token blocks).
pub const MAX_KEYS: u32 = 16_384;
/// Largest block the channel carries.
pub const MAX_BLOCK: u64 = 1 << 30;
/// Largest PROBE.
pub const MAX_PROBE: u32 = 64 << 20;

pub const OP_PULL: u8 = 1;
pub const OP_PROBE: u8 = 2;
pub const OP_BYE: u8 = 3;
pub const TAG_BLOCK: u8 = 1;
pub const TAG_REFUSED: u8 = 2;
pub const TAG_END: u8 = 9;

fn bad(why: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.into())
}

pub fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_le_bytes(b))
}

pub fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_16(r: &mut impl Read) -> io::Result<[u8; 16]> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    Ok(b)
}

/// A short text (a refusal's reason), at most `u16::MAX` bytes, lossy UTF-8.
pub fn read_text(r: &mut impl Read) -> io::Result<String> {
    let n = read_u16(r)? as usize;
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

pub fn write_text(w: &mut impl Write, tag: Option<u8>, text: &str) -> io::Result<()> {
    let t = kvproto::limits::clip(text, 1024);
    let mut out = Vec::with_capacity(t.len() + 3);
    out.extend(tag);
    out.extend_from_slice(&(t.len() as u16).to_le_bytes());
    out.extend_from_slice(t.as_bytes());
    w.write_all(&out)
}

/// The client's hello.
pub fn write_hello(w: &mut impl Write, token: Option<&str>) -> io::Result<()> {
    let token = token.unwrap_or("").as_bytes();
    if token.len() > MAX_TOKEN {
        return Err(bad("token longer than 4096 bytes"));
    }
    let mut out = Vec::with_capacity(6 + token.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&(token.len() as u16).to_le_bytes());
    out.extend_from_slice(token);
    w.write_all(&out)?;
    w.flush()
}

/// The server reads a hello: the token, if one was sent.
pub fn read_hello(r: &mut impl Read) -> io::Result<Option<String>> {
    let mut m = [0u8; 4];
    r.read_exact(&mut m)?;
    if m != MAGIC {
        return Err(bad("not a kvcached peer (hello magic)"));
    }
    let n = read_u16(r)? as usize;
    if n > MAX_TOKEN {
        return Err(bad("token longer than 4096 bytes"));
    }
    let mut t = vec![0u8; n];
    r.read_exact(&mut t)?;
    if n == 0 {
        return Ok(None);
    }
    String::from_utf8(t).map(Some).map_err(|_| bad("token is not UTF-8"))
}

/// A PULL request.
pub fn write_pull(w: &mut impl Write, ns: &NamespaceId, keys: &[BlockKey]) -> io::Result<()> {
    let n = u32::try_from(keys.len()).ok().filter(|&n| n <= MAX_KEYS).ok_or_else(|| bad("too many keys"))?;
    let mut out = Vec::with_capacity(21 + 16 * keys.len());
    out.push(OP_PULL);
    out.extend_from_slice(&ns.0);
    out.extend_from_slice(&n.to_le_bytes());
    for k in keys {
        out.extend_from_slice(&k.0);
    }
    w.write_all(&out)?;
    w.flush()
}

/// The body of a PULL (after its op byte).
pub fn read_pull(r: &mut impl Read) -> io::Result<(NamespaceId, Vec<BlockKey>)> {
    let ns = NamespaceId(read_16(r)?);
    let n = read_u32(r)?;
    if n > MAX_KEYS {
        return Err(bad(format!("a PULL of {n} keys (at most {MAX_KEYS})")));
    }
    let mut raw = vec![0u8; n as usize * 16];
    r.read_exact(&mut raw)?;
    let keys = raw
        .chunks_exact(16)
        .map(|c| {
            let mut k = [0u8; 16];
            k.copy_from_slice(c);
            BlockKey(k)
        })
        .collect();
    Ok((ns, keys))
}

/// The header of one block sent. The data's CRC-64/NVME follows the data (a trailer), so that
/// the sender sums each piece while it is in cache on its way to the socket instead of reading
/// the whole block once more before sending it. CRC-64 rather than the XXH3 of G3 and G4: with
/// the carry-less multiply the CPU offers chosen at run time it sums ~28 GB/s here, XXH3 built
/// for baseline x86-64 ~12 GB/s, and on a link the checksum is paid twice (docs/benchmarks.md,
/// "Peer transfer").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub key: BlockKey,
    pub parent: Option<BlockKey>,
    pub len: u64,
}

pub const BLOCK_HEADER_BYTES: usize = 1 + 16 + 1 + 16 + 8;
/// Bytes hashed (and sent, and received) at a time: small enough to stay in cache between the
/// copy and the hash.
pub const HASH_STEP: usize = 256 << 10;

impl BlockHeader {
    pub fn encode(&self) -> [u8; BLOCK_HEADER_BYTES] {
        let mut h = [0u8; BLOCK_HEADER_BYTES];
        h[0] = TAG_BLOCK;
        h[1..17].copy_from_slice(&self.key.0);
        if let Some(p) = self.parent {
            h[17] = 1;
            h[18..34].copy_from_slice(&p.0);
        }
        h[34..42].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Reads a header after its tag byte.
    pub fn read(r: &mut impl Read) -> io::Result<Self> {
        let key = BlockKey(read_16(r)?);
        let has_parent = read_u8(r)?;
        let parent = read_16(r)?;
        let len = read_u64(r)?;
        if has_parent > 1 {
            return Err(bad("has_parent is neither 0 nor 1"));
        }
        if len > MAX_BLOCK {
            return Err(bad(format!("a block of {len} bytes")));
        }
        Ok(Self { key, parent: (has_parent == 1).then_some(BlockKey(parent)), len })
    }
}

/// The END of a reply.
pub fn write_end(w: &mut impl Write, blocks: u32) -> io::Result<()> {
    let mut out = [0u8; 5];
    out[0] = TAG_END;
    out[1..].copy_from_slice(&blocks.to_le_bytes());
    w.write_all(&out)?;
    w.flush()
}

/// The running checksum of a block on the wire.
pub fn block_sum() -> crc_fast::Digest {
    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme)
}

/// Reads and discards `n` bytes (a block the receiver cannot keep, to stay in step).
pub fn skip(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied != n {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed mid-block"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn frames_round_trip_and_bounds_hold() {
        let mut buf = Vec::new();
        write_hello(&mut buf, Some("tok")).unwrap();
        assert_eq!(read_hello(&mut &buf[..]).unwrap().as_deref(), Some("tok"));
        let keys = vec![BlockKey([1; 16]), BlockKey([2; 16])];
        let mut buf = Vec::new();
        write_pull(&mut buf, &NamespaceId([7; 16]), &keys).unwrap();
        assert_eq!(buf[0], OP_PULL);
        assert_eq!(read_pull(&mut &buf[1..]).unwrap(), (NamespaceId([7; 16]), keys));
        let h = BlockHeader { key: BlockKey([3; 16]), parent: Some(BlockKey([4; 16])), len: 10 };
        let e = h.encode();
        assert_eq!(BlockHeader::read(&mut &e[1..]).unwrap(), h);
        // Hostile sizes are refused before anything is allocated for them.
        let mut big = vec![OP_PULL];
        big.extend_from_slice(&[0; 16]);
        big.extend_from_slice(&(MAX_KEYS + 1).to_le_bytes());
        assert!(read_pull(&mut &big[1..]).is_err());
        let mut e = h.encode();
        e[34..42].copy_from_slice(&(MAX_BLOCK + 1).to_le_bytes());
        assert!(BlockHeader::read(&mut &e[1..]).is_err());
        assert!(read_hello(&mut &b"HTTP/1.1"[..]).is_err());
    }
}
