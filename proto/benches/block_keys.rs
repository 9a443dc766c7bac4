//! Key derivation for one 128k-token prompt (131072 tokens): kvcached's keyed BLAKE3 block keys
//! vs the Dynamo-compatible XXH3-64 sequence hashes, at 16 and 256 tokens per block.
//! Throughput is in blocks.
//!
//! ```text
//! cargo bench -p kvproto --bench block_keys -- --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvproto::dynamo::{DYNAMO_SEED, sequence_hashes};
use kvproto::{KvLayout, Namespace, block_keys};

const PROMPT_TOKENS: usize = 128 * 1024;

fn prompt() -> Vec<u32> {
    // Deterministic ids spread over Llama-3's vocabulary.
    (0..PROMPT_TOKENS as u64).map(|i| ((7 + i * 2_654_435_761) % 128_256) as u32).collect()
}

fn namespace(tokens_per_block: u32) -> Namespace {
    let mut ns = Namespace::new("meta-llama/Llama-3.1-8B-Instruct", KvLayout::llama3_8b(tokens_per_block));
    ns.tenant_salt = Some(b"bench-tenant-salt".to_vec());
    ns
}

fn bench(c: &mut Criterion) {
    let tokens = prompt();
    let mut g = c.benchmark_group("prompt_128k");
    for bs in [16u32, 256] {
        let blocks = PROMPT_TOKENS / bs as usize;
        g.throughput(Throughput::Elements(blocks as u64));
        let fp = namespace(bs).fingerprint();
        g.bench_with_input(BenchmarkId::new("blake3_block_keys", bs), &tokens, |b, t| {
            b.iter(|| block_keys(black_box(&fp), bs as usize, black_box(t)));
        });
        g.bench_with_input(BenchmarkId::new("dynamo_xxh3_seq_hashes", bs), &tokens, |b, t| {
            b.iter(|| sequence_hashes(black_box(t), bs as usize, DYNAMO_SEED));
        });
    }
    // The one-off per-namespace cost (done once per engine registration, not per prompt).
    g.throughput(Throughput::Elements(1));
    let ns = namespace(16);
    g.bench_function("namespace_fingerprint", |b| b.iter(|| black_box(&ns).fingerprint()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
