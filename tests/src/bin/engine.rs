//! An engine in a process of its own, for the cross-process tests and for trying kvcached by
//! hand.
//!
//! ```text
//! cargo run --release -p kvcached &                     # the daemon, embedded defaults
//! cargo run -p kvtests --bin engine -- save 7 64        # prefill: fill 64 blocks, save them
//! cargo run -p kvtests --bin engine -- load 7 64        # decode: look up, load, verify
//! cargo run -p kvtests --bin engine -- load 7 64 HOST:PORT  # pull from another node's daemon
//! ```
//!
//! `save SEED BLOCKS` allocates shared-memory KV, fills slots 0..BLOCKS with deterministic
//! synthetic KV for prompt SEED and saves it. `load SEED BLOCKS` (another process) allocates its
//! own KV, looks the prompt up, loads it into slots BLOCKS..2*BLOCKS and checks every byte; with
//! a peer daemon's `HOST:PORT` (its `peer.listen`), it loads every block, pulling from that peer
//! what this node lacks. The
//! socket is `KVCACHED_SOCKET` or the daemon's default. Exit status 0 only when all is right.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvclient::{BlockingClient, KvMemory, synthetic_block};
use kvproto::{KvLayout, Namespace};

fn layout() -> KvLayout {
    KvLayout::qwen3_0_6b(16)
}

fn tokens(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 151_936).collect()
}

fn shm(role: &str) -> PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    dir.join(format!("kvclient-example-{role}-{}", std::process::id()))
}

fn run(mode: &str, seed: u32, blocks: u32, peer: Option<&str>) -> Result<bool, Box<dyn std::error::Error>> {
    let layout = layout();
    let ns = Namespace::new("Qwen/Qwen3-0.6B", layout);
    let len = layout.block_bytes() as usize;
    let prompt = tokens(seed, blocks);
    let client = BlockingClient::connect(kvclient::default_socket())?;
    match mode {
        "save" => {
            let mut kv = KvMemory::create_layer_separate(shm("save"), &layout, blocks)?;
            for b in 0..blocks {
                kv.write_block(b, &synthetic_block(u64::from(seed), b, len));
            }
            client.register("example-prefill", &ns, &kv)?;
            let t0 = Instant::now();
            let r = client.save(&prompt, 0, &(0..blocks).collect::<Vec<_>>())?;
            println!(
                "saved {} blocks ({} already cached, {} failed) of {} KiB in {:.1} ms",
                r.stored,
                r.already_present,
                r.failed,
                len / 1024,
                t0.elapsed().as_secs_f64() * 1e3
            );
            client.unregister()?;
            Ok(r.failed == 0 && r.stored + r.already_present == blocks)
        }
        "load" => {
            let kv = KvMemory::create_layer_separate(shm("load"), &layout, blocks * 2)?;
            client.register("example-decode", &ns, &kv)?;
            let hit = client.lookup(&prompt)?;
            println!(
                "lookup: {} of {blocks} blocks cached (G2 {}, G3 {})",
                hit.matched_blocks, hit.g2_blocks, hit.g3_blocks
            );
            let done = match peer {
                // The peer may hold more than this node: every block is asked for.
                Some(p) => client.load_from(&prompt, 0, &(blocks..blocks * 2).collect::<Vec<_>>(), &[p.to_string()])?,
                None => {
                    let slots: Vec<u32> = (blocks..blocks + hit.matched_blocks).collect();
                    let op = client.load(&prompt, 0, &slots)?;
                    client.wait(&op, Duration::from_secs(30))?
                }
            };
            let exact = (0..done.loaded_blocks)
                .filter(|&i| kv.read_block(blocks + i) == synthetic_block(u64::from(seed), i, len))
                .count() as u32;
            println!(
                "loaded {} blocks (G2 {}, G3 {}, peer {}); {exact} byte-exact",
                done.loaded_blocks, done.from_g2, done.from_g3, done.from_peer
            );
            client.unregister()?;
            Ok(exact == blocks && done.loaded_blocks == blocks)
        }
        other => Err(format!("unknown mode {other:?}: use save or load").into()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [mode, seed, blocks, rest @ ..] if rest.len() <= 1 && (rest.is_empty() || mode == "load") => seed
            .parse::<u32>()
            .ok()
            .zip(blocks.parse::<u32>().ok())
            .map(|(s, b)| (mode.as_str(), s, b, rest.first().map(String::as_str))),
        _ => None,
    };
    if args.is_empty() {
        // `cargo test --all-targets` runs examples without arguments: say how to use it.
        println!("usage: engine save|load SEED BLOCKS [PEER] (see the top of tests/src/bin/engine.rs)");
        return ExitCode::SUCCESS;
    }
    let Some((mode, seed, blocks, peer)) = parsed else {
        eprintln!("usage: engine save SEED BLOCKS | engine load SEED BLOCKS [PEER_HOST:PORT]");
        return ExitCode::from(2);
    };
    match run(mode, seed, blocks.max(1), peer) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("engine {mode}: not every block came through");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("engine {mode}: {e}");
            ExitCode::FAILURE
        }
    }
}
