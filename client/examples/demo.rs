//! The demo: two engines on one running daemon hand a prompt's KV over through G2 (the
//! single-node prefill -> decode path), byte-exact, with hit counts printed.
//!
//! ```text
//! cargo run --release -p kvcached                    # the daemon, embedded defaults
//! cargo run --release -p kvclient --example demo     # in a second shell
//! ```
//!
//! The socket is `KVCACHED_SOCKET` or the daemon's default.

use std::path::Path;
use std::time::{Duration, Instant};

use kvclient::{Client, ClientError, KvMemory, synthetic_block};
use kvproto::{KvLayout, Namespace};

fn shm_path(name: &str) -> std::path::PathBuf {
    let dir = if Path::new("/dev/shm").is_dir() { "/dev/shm".into() } else { std::env::temp_dir() };
    dir.join(format!("kvcached-demo-{name}-{}", std::process::id()))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let socket = kvclient::default_socket();
    match run(&socket).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo: {e} (is kvcached running at {}?)", socket.display());
            std::process::ExitCode::FAILURE
        }
    }
}

/// Runs the demo against the daemon at `socket`.
async fn run(socket: &Path) -> Result<(), ClientError> {
    let layout = KvLayout::qwen3_0_6b(16);
    let ns = Namespace::new("Qwen/Qwen3-0.6B", layout);
    let blocks = 64u32; // a 1024-token prompt
    let tokens: Vec<u32> = (0..blocks * 16).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    let len = layout.block_bytes() as usize;

    // Prefill engine: computes KV into slots 0..64, saves it.
    let mut prefill_kv = KvMemory::create_layer_separate(shm_path("prefill"), &layout, 128)?;
    for b in 0..blocks {
        prefill_kv.write_block(b, &synthetic_block(7, b, len));
    }
    let prefill = Client::connect(socket).await?;
    prefill.register("demo-prefill", &ns, &prefill_kv).await?;
    let slots: Vec<u32> = (0..blocks).collect();
    let t0 = Instant::now();
    let saved = prefill.save(&tokens, 0, &slots).await?;
    println!(
        "prefill engine saved {} blocks ({} already cached) of {} KiB in {:.1} ms",
        saved.stored,
        saved.already_present,
        len / 1024,
        t0.elapsed().as_secs_f64() * 1e3
    );

    // Decode engine: a different process would do the same; it has its own KV memory and
    // loads into different slots (64..128).
    let decode_kv = KvMemory::create_layer_separate(shm_path("decode"), &layout, 128)?;
    let decode = Client::connect(socket).await?;
    decode.register("demo-decode", &ns, &decode_kv).await?;
    let hit = decode.lookup(&tokens).await?;
    println!(
        "decode engine lookup: {} of {blocks} blocks cached ({} tokens; G2 {}, G3 {})",
        hit.matched_blocks, hit.matched_tokens, hit.g2_blocks, hit.g3_blocks
    );
    let dst: Vec<u32> = (64..64 + hit.matched_blocks).collect();
    let t0 = Instant::now();
    let op = decode.load(&tokens, 0, &dst).await?;
    let done = decode.wait(&op, Duration::from_secs(10)).await?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let exact = (0..done.loaded_blocks).filter(|&i| decode_kv.read_block(64 + i) == synthetic_block(7, i, len)).count();
    println!(
        "decode engine loaded {} blocks (G2 {}, G3 {}) in {ms:.1} ms; {exact} byte-exact",
        done.loaded_blocks, done.from_g2, done.from_g3
    );
    let stats = decode.stats().await?;
    for t in &stats.tiers {
        println!(
            "  {}: hits {} misses {} blocks {} used {} MiB of {} MiB",
            t.tier,
            t.hits,
            t.misses,
            t.blocks,
            t.used_bytes >> 20,
            t.capacity_bytes >> 20
        );
    }
    prefill.unregister().await?;
    decode.unregister().await?;
    if exact as u32 != blocks {
        return Err(ClientError::LoadFailed {
            op: op.id(),
            error: format!("only {exact} of {blocks} blocks came back intact"),
        });
    }
    Ok(())
}
