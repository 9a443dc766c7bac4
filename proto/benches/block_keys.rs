//! Key derivation for one 128k-token prompt (131072 tokens): kvcached's keyed BLAKE3 block keys
//! vs the Dynamo-compatible XXH3-64 sequence hashes, at 16 and 256 tokens per block; and at 16
//! tokens per block the same prompt's keys under key contexts (`docs/block-keys.md` section 6):
//! a LoRA adapter (extras in block 0), and 32 images of 576 placeholder tokens (extras in the
//! 1184 blocks they overlap). Throughput is in blocks.
//!
//! ```text
//! cargo bench -p kvproto --bench block_keys -- --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvproto::dynamo::{DYNAMO_SEED, sequence_hashes};
use kvproto::{Adapter, KeyContext, KvLayout, MmInput, Namespace, block_keys, context_keys_le, tokens_to_le};

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
    let fp = namespace(16).fingerprint();
    let lora = KeyContext {
        adapter: Some(Adapter { name: "sql-lora".into(), content_hash: vec![7; 32] }),
        ..Default::default()
    };
    let images = KeyContext {
        mm: (0..32u32).map(|i| MmInput { hash: vec![i as u8; 32], offset: 1000 + i * 4000, length: 576 }).collect(),
        ..Default::default()
    };
    // As the daemon gets them: tokens in their wire form.
    let le = tokens_to_le(&tokens);
    g.throughput(Throughput::Elements((PROMPT_TOKENS / 16) as u64));
    for (name, ctx) in [("context_keys_lora", &lora), ("context_keys_32_images", &images)] {
        g.bench_with_input(BenchmarkId::new(name, 16), &le, |b, t| {
            b.iter(|| context_keys_le(black_box(&fp), 16, black_box(t), ctx));
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
