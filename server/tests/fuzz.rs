//! Property tests of the peer channel's frames (`server/src/peer/protocol.rs`): what another
//! daemon (or anything that reaches the peer port) sends is read by these functions before any
//! authentication beyond the hello. Arbitrary bytes must be refused with an error, never panic,
//! and never make the reader allocate more than the frame's limits allow.
//!
//! A short run is part of `cargo test`; a long one: `PROPTEST_CASES=100000 cargo test -p kvcached
//! --test fuzz --release` (docs/operations/security-limits.md, "Fuzzing").
#![allow(clippy::unwrap_used)]

use kvcached::peer::protocol::{self, BlockHeader};
use kvproto::fuzzing::{bytes, cases};
use kvproto::{BlockKey, NamespaceId};
use proptest::prelude::*;

/// Reads a whole server-side session the way `peer/server.rs` does: hello, then ops until BYE,
/// an error or the end of input. Returns how many frames were read.
fn read_session(mut r: &[u8]) -> usize {
    let mut frames = 0;
    if protocol::read_hello(&mut r).is_err() {
        return frames;
    }
    loop {
        frames += 1;
        let Ok(op) = protocol::read_u8(&mut r) else { return frames };
        let ok = match op {
            protocol::OP_PULL => {
                protocol::read_pull(&mut r).map(|(_, keys)| assert!(keys.len() as u32 <= protocol::MAX_KEYS)).is_ok()
            }
            protocol::OP_PROBE => protocol::read_u32(&mut r).is_ok(),
            _ => false,
        };
        if !ok {
            return frames;
        }
    }
}

/// Reads a reply the way `peer/pull.rs` does: blocks until END or REFUSED.
fn read_reply(mut r: &[u8]) {
    loop {
        let Ok(tag) = protocol::read_u8(&mut r) else { return };
        match tag {
            protocol::TAG_BLOCK => match BlockHeader::read(&mut r) {
                Ok(h) => {
                    assert!(h.len <= protocol::MAX_BLOCK);
                    if protocol::skip(&mut r, h.len).is_err() || protocol::read_u64(&mut r).is_err() {
                        return;
                    }
                }
                Err(_) => return,
            },
            protocol::TAG_REFUSED => {
                let _ = protocol::read_text(&mut r);
                return;
            }
            _ => {
                let _ = protocol::read_u32(&mut r);
                return;
            }
        }
    }
}

fn hello(token: &str) -> Vec<u8> {
    let mut b = Vec::new();
    protocol::write_hello(&mut b, Some(token)).unwrap();
    b
}

proptest! {
    #![proptest_config(cases(512))]

    /// Arbitrary bytes, with or without a valid hello in front.
    #[test]
    fn server_side_frames(b in bytes(300), with_hello in any::<bool>()) {
        let mut input = if with_hello { hello("t") } else { Vec::new() };
        input.extend_from_slice(&b);
        read_session(&input);
    }

    /// A valid PULL with a byte flipped or cut short.
    #[test]
    fn pulls_mutated(keys in proptest::collection::vec(any::<[u8; 16]>(), 0..20), at in any::<usize>(),
                     x in 1u8..=255, cut in any::<usize>()) {
        let keys: Vec<BlockKey> = keys.into_iter().map(BlockKey).collect();
        let mut b = hello("token");
        protocol::write_pull(&mut b, &NamespaceId([3; 16]), &keys).unwrap();
        let i = at % b.len();
        b[i] ^= x;
        b.truncate(cut % (b.len() + 1));
        read_session(&b);
    }

    /// Replies from a peer: arbitrary bytes, and valid block headers with a byte flipped.
    #[test]
    fn client_side_frames(b in bytes(300), key in any::<[u8; 16]>(), len in any::<u64>(), at in 0usize..protocol::BLOCK_HEADER_BYTES, x in 1u8..=255) {
        read_reply(&b);
        let h = BlockHeader { key: BlockKey(key), parent: None, len: len % 64 };
        let mut e = h.encode().to_vec();
        e[at] ^= x;
        e.extend_from_slice(&b);
        read_reply(&e);
        let _ = protocol::read_text(&mut &b[..]);
    }
}

/// Regression cases: sizes the frames announce beyond their limits are refused before anything
/// is allocated for them.
#[test]
fn hostile_sizes_are_refused_early() {
    let mut pull = vec![protocol::OP_PULL];
    pull.extend_from_slice(&[0; 16]);
    pull.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(protocol::read_pull(&mut &pull[1..]).is_err());
    let mut h = BlockHeader { key: BlockKey([1; 16]), parent: None, len: 0 }.encode();
    h[34..42].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(BlockHeader::read(&mut &h[1..]).is_err());
    let mut long = b"KVP1".to_vec();
    long.extend_from_slice(&u16::MAX.to_le_bytes());
    assert!(protocol::read_hello(&mut &long[..]).is_err());
}
