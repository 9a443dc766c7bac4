//! A peer daemon that speaks the peer protocol and misbehaves as told (wrong checksums, dying or
//! stalling mid-transfer): fault injection for the pulls of `peer.rs` and `g4.rs`.

use std::io::Write;
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvcached::peer::protocol::{self as p, BlockHeader};
use kvclient::synthetic_block;

/// What a fake peer does after the hello, per PULL.
#[derive(Debug, Clone, Copy)]
pub enum Fake {
    /// Every block, with a checksum that does not match its bytes.
    WrongChecksum,
    /// The first `n` blocks intact (synthetic KV of the seed, block `i` of the PULL), then the
    /// connection closes.
    DiesAfter(usize),
    /// The first `n` blocks intact, then nothing for a minute.
    StallsAfter(usize),
}

/// A peer speaking the protocol, misbehaving as told; counts its connections.
pub fn fake_peer(how: Fake, seed: u64, block_len: usize) -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = l.local_addr().expect("its address").to_string();
    let conns = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&conns);
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            counter.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                if p::read_hello(&mut s).is_err() {
                    return;
                }
                let _ = s.write_all(&[0, 0, 0]);
                while let Ok(op) = p::read_u8(&mut s) {
                    if op != p::OP_PULL {
                        return;
                    }
                    let Ok((_, keys)) = p::read_pull(&mut s) else { return };
                    for (i, k) in keys.iter().enumerate() {
                        let data = synthetic_block(seed, i as u32, block_len);
                        let good = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, &data);
                        let sum = match how {
                            Fake::WrongChecksum => good ^ 1,
                            Fake::DiesAfter(n) | Fake::StallsAfter(n) if i >= n => {
                                if let Fake::StallsAfter(_) = how {
                                    std::thread::sleep(Duration::from_secs(60));
                                }
                                return;
                            }
                            _ => good,
                        };
                        let h = BlockHeader { key: *k, parent: None, len: data.len() as u64 };
                        let sent = s
                            .write_all(&h.encode())
                            .and_then(|()| s.write_all(&data))
                            .and_then(|()| s.write_all(&sum.to_le_bytes()));
                        if sent.is_err() {
                            return;
                        }
                    }
                    let _ = p::write_end(&mut s, keys.len() as u32);
                }
            });
        }
    });
    (addr, conns)
}
