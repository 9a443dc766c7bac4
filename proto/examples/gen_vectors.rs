//! Regenerates the test vectors in `proto/tests/data/` from the Rust implementation.
//!
//! ```text
//! cargo run -p kvproto --example gen_vectors            # rewrite the JSON files
//! cargo run -p kvproto --example gen_vectors -- --check # fail if they would change
//! ```
//!
//! The checked-in JSON is the reference: regenerating must not change it unless the
//! encoding version changes (see `docs/block-keys.md`).

use std::error::Error;
use std::path::{Path, PathBuf};

use kvproto::dynamo::{DYNAMO_SEED, local_block_hash, request_seed, request_sequence_hashes, sequence_hashes};
use kvproto::engine_hash::{HashScheme, engine_hash_keys, sglang_page_hashes_le};
use kvproto::{block_keys, context_keys};

#[path = "../tests/common/schema.rs"]
mod schema;

use schema::{
    BlockExtraSpec, BlockKeyFile, BlockKeyVector, ContextFile, ContextRejection, ContextSpec, ContextVector,
    DynamoFile, DynamoSeedVector, DynamoVector, EngineHashFile, EngineHashVector, ExtrasOf, MmSpec, NamespaceSpec,
    RejectionVector, TOKEN_GENERATOR, TokenSegment, expand_tokens, to_context, to_namespace,
};

const LLAMA8B: &str = "meta-llama/Llama-3.1-8B-Instruct@0e9e39f249a16976918f6564b8830bc894c89659";
const QWEN: &str = "Qwen/Qwen3-0.6B@main";
const LLAMA70B: &str = "meta-llama/Llama-3.3-70B-Instruct";
/// Knuth's multiplicative constant: spreads ids over the whole u32 range (half are >= 2^31).
const GOLDEN: u64 = 2_654_435_761;
const VOCAB_LLAMA3: u64 = 128_256;
const U32_MAX: u64 = 0xFFFF_FFFF;

fn full(count: u64, start: u64, mul: u64) -> TokenSegment {
    TokenSegment::full(count, start, mul)
}

fn hex_bytes(n: usize, mul: usize, add: usize) -> String {
    hex::encode((0..n).map(|i| ((i * mul + add) % 256) as u8).collect::<Vec<u8>>())
}

#[allow(clippy::too_many_arguments)]
fn ns(
    model_id: &str,
    layers_heads_dim: (u32, u32, u32),
    dtype: &str,
    tokens_per_block: u32,
    layout_kind: &str,
    salt: Option<String>,
    adapter: Option<&str>,
    extra: Option<String>,
) -> NamespaceSpec {
    NamespaceSpec {
        model_id: model_id.to_string(),
        num_layers: layers_heads_dim.0,
        kv_heads: layers_heads_dim.1,
        head_dim: layers_heads_dim.2,
        dtype: dtype.to_string(),
        tokens_per_block,
        layout_kind: layout_kind.to_string(),
        tenant_salt_hex: salt,
        adapter_id: adapter.map(str::to_string),
        extra_hex: extra,
    }
}

fn key_vector(name: &str, spec: NamespaceSpec, tokens: Vec<TokenSegment>) -> Result<BlockKeyVector, Box<dyn Error>> {
    let ns = to_namespace(&spec).map_err(|(field, e)| format!("{name}: {field}: {e}"))?;
    let fp = ns.fingerprint();
    let toks = expand_tokens(&tokens);
    let keys = block_keys(&fp, spec.tokens_per_block as usize, &toks);
    Ok(BlockKeyVector {
        name: name.to_string(),
        canonical_hex: hex::encode(ns.canonical_bytes()),
        fingerprint_hex: hex::encode(fp.0),
        namespace_id_hex: ns.id().to_string(),
        token_count: toks.len() as u64,
        keys: keys.iter().map(ToString::to_string).collect(),
        namespace: spec,
        tokens,
    })
}

#[allow(clippy::vec_init_then_push)] // one `?` per vector reads better than a vec![] of Results
fn block_key_vectors() -> Result<Vec<BlockKeyVector>, Box<dyn Error>> {
    let l8 = (32, 8, 128);
    let q = (28, 8, 128);
    let l70 = (80, 8, 128);
    let salt_a = Some("a1b2c3d4e5f60718293a4b5c6d7e8f90".to_string());
    let salt_b = Some("a1b2c3d4e5f60718293a4b5c6d7e8f91".to_string());
    let image_hash = Some(hex_bytes(32, 37, 11));
    let lora = Some("sql-lora@v3");
    let system_prompt = full(3 * 16, 128_000, 7_919);
    let mut v = Vec::new();

    // --- 16 tokens per block (vLLM pages) ---
    v.push(key_vector(
        "worked_example",
        ns("Qwen/Qwen3-0.6B", q, "bf16", 16, "layer_separate", Some(hex::encode("salt")), None, None),
        vec![full(32, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_one_block_exact",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![full(16, 128_000, 1)],
    )?);
    v.push(key_vector(
        "bs16_partial_only_no_key",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![full(15, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_empty_prompt_no_key",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![],
    )?);
    v.push(key_vector(
        "bs16_two_blocks_plus_partial",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![full(32, 0, 1), full(9, 32, 1)],
    )?);
    v.push(key_vector(
        "bs16_100_blocks_plus_partial_vocab",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![TokenSegment::new(100 * 16 + 7, 128_000, 7_919, VOCAB_LLAMA3)],
    )?);
    v.push(key_vector(
        "bs16_salted",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", salt_a.clone(), None, None),
        vec![full(32, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_other_salt",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", salt_b.clone(), None, None),
        vec![full(32, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_empty_salt_is_not_no_salt",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", Some(String::new()), None, None),
        vec![full(32, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_salt_adapter_extra",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", salt_a.clone(), lora, image_hash.clone()),
        vec![full(5 * 16 + 3, 7, GOLDEN)],
    )?);
    v.push(key_vector(
        "bs16_empty_adapter_and_extra",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, Some(""), Some(String::new())),
        vec![full(32, 0, 1)],
    )?);
    v.push(key_vector(
        "bs16_shared_system_prompt_user_a",
        ns(QWEN, q, "bf16", 16, "contiguous", None, None, None),
        vec![system_prompt, full(2 * 16 + 5, 1_000, 3)],
    )?);
    v.push(key_vector(
        "bs16_shared_system_prompt_user_b",
        ns(QWEN, q, "bf16", 16, "contiguous", None, None, None),
        vec![system_prompt, full(2 * 16, 2_000, 3)],
    )?);
    v.push(key_vector(
        "bs16_sign_bit_tokens",
        ns(QWEN, q, "f16", 16, "contiguous", None, None, None),
        vec![full(16, 0x8000_0000, 0), full(16, 0x7FFF_FFFF, 0)],
    )?);

    // --- 256 tokens per block (LMCache chunks) ---
    v.push(key_vector(
        "bs256_one_block",
        ns(QWEN, q, "bf16", 256, "contiguous", None, None, None),
        vec![full(256, 0, 1)],
    )?);
    v.push(key_vector(
        "bs256_10_blocks_plus_255",
        ns(QWEN, q, "bf16", 256, "contiguous", None, None, None),
        vec![full(10 * 256 + 255, 0xFFFF_FFFF, GOLDEN)],
    )?);
    v.push(key_vector(
        "bs256_max_token_ids_descending",
        ns(LLAMA8B, l8, "f32", 256, "layer_separate", None, None, None),
        vec![full(4 * 256, U32_MAX, U32_MAX)],
    )?);
    v.push(key_vector(
        "bs256_all_ffffffff",
        ns(LLAMA8B, l8, "f32", 256, "layer_separate", None, None, None),
        vec![full(2 * 256, U32_MAX, 0)],
    )?);
    v.push(key_vector(
        "bs256_adapter",
        ns(QWEN, q, "bf16", 256, "contiguous", None, lora, None),
        vec![full(3 * 256, 0, 1)],
    )?);
    v.push(key_vector(
        "bs256_extra_300_bytes",
        ns(QWEN, q, "bf16", 256, "contiguous", None, None, Some(hex_bytes(300, 13, 5))),
        vec![full(3 * 256, 0, 1)],
    )?);
    v.push(key_vector(
        "bs256_fp8_e4m3_salted",
        ns(LLAMA70B, l70, "fp8_e4m3", 256, "contiguous", Some(hex_bytes(64, 29, 3)), None, None),
        vec![full(7 * 256 + 100, 42, GOLDEN)],
    )?);
    v.push(key_vector(
        "bs256_int8_mqa",
        ns(LLAMA70B, (80, 1, 256), "int8", 256, "layer_separate", None, None, None),
        vec![TokenSegment::new(5 * 256, 3, 104_729, VOCAB_LLAMA3)],
    )?);

    // --- 512 tokens per block (Mooncake) ---
    v.push(key_vector(
        "bs512_one_block",
        ns(LLAMA70B, l70, "bf16", 512, "layer_separate", None, None, None),
        vec![full(512, 0, 1)],
    )?);
    v.push(key_vector(
        "bs512_partial_only_no_key",
        ns(LLAMA70B, l70, "bf16", 512, "layer_separate", None, None, None),
        vec![full(511, 0, 1)],
    )?);
    v.push(key_vector(
        "bs512_100_blocks_full_range",
        ns(LLAMA70B, l70, "bf16", 512, "layer_separate", None, None, None),
        vec![full(100 * 512, 1, GOLDEN)],
    )?);
    v.push(key_vector(
        "bs512_fp8_e5m2_all_options",
        ns(
            "unicode/modèle-测试@v1",
            (61, 128, 56),
            "fp8_e5m2",
            512,
            "contiguous",
            salt_a,
            Some("lora/δ-adapter"),
            image_hash,
        ),
        vec![full(4 * 512 + 511, 0xFFFF_FF00, 1)],
    )?);
    v.push(key_vector(
        "bs512_large_layout_fields",
        ns(LLAMA70B, (0xFFFF_FFFF, 3, 0xABCD), "f16", 512, "contiguous", None, None, None),
        vec![full(2 * 512, 0, 1)],
    )?);

    // --- other block sizes (the algorithm is size-agnostic) ---
    v.push(key_vector(
        "bs1_every_token_a_block",
        ns(QWEN, q, "bf16", 1, "contiguous", None, None, None),
        vec![full(5, 0xFFFF_FFFE, 1)],
    )?);
    v.push(key_vector(
        "bs3_odd_block_size",
        ns(QWEN, q, "bf16", 3, "contiguous", salt_b, None, None),
        vec![full(10, 9, GOLDEN)],
    )?);
    // A 128k-token prompt: the longest chain an engine asks about in one lookup.
    v.push(key_vector(
        "bs16_8192_blocks_128k_prompt",
        ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None),
        vec![TokenSegment::new(8192 * 16, 128_000, 7_919, VOCAB_LLAMA3)],
    )?);
    Ok(v)
}

/// Namespaces the spec refuses, one per rule of section 2.
fn rejection_vectors() -> Result<Vec<RejectionVector>, Box<dyn Error>> {
    let l8 = (32, 8, 128);
    let good = || ns(LLAMA8B, l8, "bf16", 16, "layer_separate", None, None, None);
    let max = u32::MAX;
    let cases: Vec<(&str, NamespaceSpec, &str, &str)> = vec![
        ("empty_model_id", NamespaceSpec { model_id: String::new(), ..good() }, "model_id", "model_id is empty"),
        ("zero_num_layers", NamespaceSpec { num_layers: 0, ..good() }, "num_layers", "a layout field is 0"),
        ("zero_kv_heads", NamespaceSpec { kv_heads: 0, ..good() }, "kv_heads", "a layout field is 0"),
        ("zero_head_dim", NamespaceSpec { head_dim: 0, ..good() }, "head_dim", "a layout field is 0"),
        (
            "zero_tokens_per_block",
            NamespaceSpec { tokens_per_block: 0, ..good() },
            "tokens_per_block",
            "a layout field is 0",
        ),
        (
            "bytes_per_block_overflow",
            ns(LLAMA8B, (max, max, max), "f32", max, "layer_separate", None, None, None),
            "layout",
            "tokens_per_block * kv_heads * head_dim * dtype bytes * num_layers * 2 is above 2^64 - 1",
        ),
        (
            "bytes_per_block_overflow_by_one_factor",
            ns(LLAMA8B, (max, max, 2), "bf16", 1, "layer_separate", None, None, None),
            "layout",
            "2^32-1 * 2^32-1 * 2 * 2 * 2 is above 2^64 - 1 although each field fits in u32",
        ),
        ("unknown_dtype", NamespaceSpec { dtype: "f8".into(), ..good() }, "dtype", "not a name of the dtype table"),
        (
            "unknown_layout_kind",
            NamespaceSpec { layout_kind: "paged".into(), ..good() },
            "layout_kind",
            "not a name of the layout-kind table",
        ),
        (
            "salt_not_hex",
            NamespaceSpec { tenant_salt_hex: Some("zz".into()), ..good() },
            "tenant_salt_hex",
            "not hexadecimal",
        ),
        (
            "extra_odd_hex_length",
            NamespaceSpec { extra_hex: Some("abc".into()), ..good() },
            "extra_hex",
            "an odd number of hex digits",
        ),
    ];
    let mut out = Vec::new();
    for (name, spec, field, reason) in cases {
        match to_namespace(&spec) {
            Err((f, _)) if f == field => {}
            other => return Err(format!("rejection {name}: expected a refusal at {field}, got {other:?}").into()),
        }
        out.push(RejectionVector { name: name.into(), namespace: spec, field: field.into(), reason: reason.into() });
    }
    Ok(out)
}

fn dynamo_vector(name: &str, block_size: u32, seed: u64, tokens: Vec<TokenSegment>) -> DynamoVector {
    let toks = expand_tokens(&tokens);
    let seqs = sequence_hashes(&toks, block_size as usize, seed);
    let locals: Vec<u64> = toks.chunks_exact(block_size as usize).map(|b| local_block_hash(b, seed)).collect();
    DynamoVector {
        name: name.to_string(),
        block_size,
        seed,
        token_count: toks.len() as u64,
        local_hashes_hex: locals.iter().map(|h| format!("{h:016x}")).collect(),
        sequence_hashes_dec: seqs.iter().map(u64::to_string).collect(),
        sequence_hashes_hex: seqs.iter().map(|h| format!("{h:016x}")).collect(),
        tokens,
    }
}

fn dynamo_vectors() -> Vec<DynamoVector> {
    let s = DYNAMO_SEED;
    vec![
        dynamo_vector("bs16_two_blocks", 16, s, vec![full(32, 0, 1)]),
        dynamo_vector("bs16_one_block", 16, s, vec![full(16, 128_000, 1)]),
        dynamo_vector("bs16_partial_only_no_hash", 16, s, vec![full(15, 0, 1)]),
        dynamo_vector("bs16_empty", 16, s, vec![]),
        dynamo_vector(
            "bs16_100_blocks_plus_partial",
            16,
            s,
            vec![TokenSegment::new(100 * 16 + 7, 128_000, 7_919, VOCAB_LLAMA3)],
        ),
        dynamo_vector("bs16_sign_bit_tokens", 16, s, vec![full(16, 0x8000_0000, 0), full(16, 0x7FFF_FFFF, 0)]),
        dynamo_vector("bs64_10_blocks_large_ids", 64, s, vec![full(10 * 64 + 1, 0xFFFF_FFF0, GOLDEN)]),
        dynamo_vector("bs64_all_ffffffff", 64, s, vec![full(3 * 64, U32_MAX, 0)]),
        dynamo_vector("bs256_one_block", 256, s, vec![full(256, 0, 1)]),
        dynamo_vector("bs256_20_blocks_plus_partial", 256, s, vec![full(20 * 256 + 17, 5, GOLDEN)]),
        dynamo_vector("bs256_max_descending", 256, s, vec![full(4 * 256, U32_MAX, U32_MAX)]),
        dynamo_vector("bs512_3_blocks", 512, s, vec![full(3 * 512, 0, 1)]),
        dynamo_vector(
            "bs512_50_blocks_vocab",
            512,
            s,
            vec![TokenSegment::new(50 * 512 + 300, 11, 104_729, VOCAB_LLAMA3)],
        ),
        dynamo_vector("bs512_partial_only_no_hash", 512, s, vec![full(511, 0, 1)]),
        dynamo_vector("bs16_seed0_not_dynamo", 16, 0, vec![full(32, 0, 1)]),
    ]
}

fn context_vector(
    name: &str,
    spec: NamespaceSpec,
    context: ContextSpec,
    tokens: Vec<TokenSegment>,
) -> Result<ContextVector, Box<dyn Error>> {
    let ns = to_namespace(&spec).map_err(|(field, e)| format!("{name}: {field}: {e}"))?;
    let ctx = to_context(&context).map_err(|(field, e)| format!("{name}: {field}: {e}"))?;
    let toks = expand_tokens(&tokens);
    let tpb = spec.tokens_per_block as usize;
    let keys = context_keys(&ns.fingerprint(), tpb, &toks, &ctx);
    let extras = ctx.block_extras(tpb, toks.len() / tpb);
    Ok(ContextVector {
        name: name.to_string(),
        namespace: spec,
        context,
        token_count: toks.len() as u64,
        extras: extras.iter().map(|(b, e)| ExtrasOf { block: *b as u64, hex: hex::encode(e) }).collect(),
        keys: keys.iter().map(ToString::to_string).collect(),
        tokens,
    })
}

fn mm(hash: String, offset: u32, length: u32) -> MmSpec {
    MmSpec { hash_hex: hash, offset, length }
}

fn extra(block: u32, data: String) -> BlockExtraSpec {
    BlockExtraSpec { block, data_hex: data }
}

fn context_vectors() -> Result<Vec<ContextVector>, Box<dyn Error>> {
    let plain = || ns(LLAMA8B, (32, 8, 128), "bf16", 16, "layer_separate", None, None, None);
    let adapter = || ContextSpec {
        adapter_name: Some("sql-lora".into()),
        adapter_hash_hex: hex_bytes(32, 13, 5),
        ..Default::default()
    };
    let salt = Some(hex::encode("tenant-a"));
    let image = hex_bytes(32, 37, 11);
    let audio = hex_bytes(16, 101, 3);
    let vocab = |n: u64| vec![TokenSegment::new(n, 128_000, 7_919, VOCAB_LLAMA3)];
    Ok(vec![
        context_vector("empty_context_is_the_plain_chain", plain(), ContextSpec::default(), vocab(40))?,
        context_vector("adapter", plain(), adapter(), vocab(48))?,
        context_vector(
            "adapter_without_content_hash",
            plain(),
            ContextSpec { adapter_name: Some("sql-lora".into()), ..Default::default() },
            vocab(48),
        )?,
        context_vector(
            "adapter_other_weights",
            plain(),
            ContextSpec { adapter_hash_hex: hex_bytes(32, 13, 6), ..adapter() },
            vocab(48),
        )?,
        context_vector(
            "cache_salt",
            plain(),
            ContextSpec { cache_salt_hex: salt.clone(), ..Default::default() },
            vocab(48),
        )?,
        context_vector(
            "adapter_and_cache_salt",
            plain(),
            ContextSpec { cache_salt_hex: salt.clone(), ..adapter() },
            vocab(48),
        )?,
        context_vector(
            "image_mid_prompt",
            plain(),
            ContextSpec { mm: vec![mm(image.clone(), 40, 30)], ..Default::default() },
            vocab(128),
        )?,
        context_vector(
            "image_then_audio_sharing_a_block",
            plain(),
            ContextSpec { mm: vec![mm(image.clone(), 10, 10), mm(audio, 20, 20)], ..Default::default() },
            vocab(64),
        )?,
        context_vector(
            "image_into_the_partial_block",
            plain(),
            ContextSpec { mm: vec![mm(image.clone(), 60, 20)], ..Default::default() },
            vocab(70),
        )?,
        context_vector(
            "block_extras_and_one_past_the_prompt",
            plain(),
            ContextSpec {
                block_extras: vec![
                    extra(0, hex_bytes(32, 3, 1)),
                    extra(2, hex_bytes(32, 5, 2)),
                    extra(9, hex_bytes(8, 7, 3)),
                ],
                ..Default::default()
            },
            vocab(64),
        )?,
        context_vector(
            "everything_bs3_contiguous",
            ns(QWEN, (28, 8, 128), "bf16", 3, "contiguous", Some(hex::encode("ns")), None, None),
            ContextSpec {
                cache_salt_hex: Some("00".into()),
                mm: vec![mm(image.clone(), 0, 4), mm(hex_bytes(1, 1, 255), 7, 1)],
                block_extras: vec![extra(0, "ff".into()), extra(2, hex_bytes(64, 1, 0))],
                ..adapter()
            },
            vec![full(13, 0xFFFF_FFF0, GOLDEN)],
        )?,
        context_vector(
            "image_in_a_16k_prompt",
            plain(),
            ContextSpec { mm: vec![mm(image, 8_000, 576)], ..adapter() },
            vocab(16_384 + 9),
        )?,
    ])
}

fn context_rejections() -> Result<Vec<ContextRejection>, Box<dyn Error>> {
    let h = |n: usize| hex_bytes(n, 1, 0);
    let m = |hash: String, offset: u32, length: u32| MmSpec { hash_hex: hash, offset, length };
    let c = ContextSpec::default;
    let cases: Vec<(&str, ContextSpec, &str, &str)> = vec![
        (
            "adapter_name_empty",
            ContextSpec { adapter_name: Some(String::new()), ..c() },
            "adapter.name",
            "an adapter needs a name",
        ),
        (
            "adapter_name_too_long",
            ContextSpec { adapter_name: Some("a".repeat(1025)), ..c() },
            "adapter.name",
            "names are at most 1024 bytes",
        ),
        (
            "adapter_hash_too_long",
            ContextSpec { adapter_name: Some("x".into()), adapter_hash_hex: h(65), ..c() },
            "adapter.content_hash",
            "hashes are at most 64 bytes",
        ),
        (
            "adapter_hash_without_name",
            ContextSpec { adapter_hash_hex: h(32), ..c() },
            "adapter_hash",
            "no adapter to hash",
        ),
        (
            "cache_salt_empty",
            ContextSpec { cache_salt_hex: Some(String::new()), ..c() },
            "cache_salt",
            "a present salt is 1..4096 bytes",
        ),
        ("mm_hash_empty", ContextSpec { mm: vec![m(String::new(), 0, 1)], ..c() }, "mm.hash", "an input needs a hash"),
        ("mm_hash_too_long", ContextSpec { mm: vec![m(h(65), 0, 1)], ..c() }, "mm.hash", "hashes are at most 64 bytes"),
        ("mm_length_zero", ContextSpec { mm: vec![m(h(32), 5, 0)], ..c() }, "mm.length", "an input has tokens"),
        (
            "mm_end_past_u32",
            ContextSpec { mm: vec![m(h(32), u32::MAX, 1)], ..c() },
            "mm.length",
            "offset + length must fit in u32",
        ),
        (
            "mm_overlapping",
            ContextSpec { mm: vec![m(h(32), 0, 10), m(h(32), 9, 5)], ..c() },
            "mm.offset",
            "inputs overlap",
        ),
        (
            "mm_out_of_order",
            ContextSpec { mm: vec![m(h(32), 20, 1), m(h(32), 3, 1)], ..c() },
            "mm.offset",
            "inputs not in token order",
        ),
        (
            "block_extra_empty",
            ContextSpec { block_extras: vec![BlockExtraSpec { block: 0, data_hex: String::new() }], ..c() },
            "block_extras.data",
            "an extra is 1..64 bytes",
        ),
        (
            "block_extra_too_long",
            ContextSpec { block_extras: vec![BlockExtraSpec { block: 0, data_hex: h(65) }], ..c() },
            "block_extras.data",
            "an extra is 1..64 bytes",
        ),
        (
            "block_extras_not_increasing",
            ContextSpec {
                block_extras: vec![
                    BlockExtraSpec { block: 4, data_hex: h(4) },
                    BlockExtraSpec { block: 4, data_hex: h(4) },
                ],
                ..c()
            },
            "block_extras.block",
            "one extra per block, in block order",
        ),
    ];
    let mut out = Vec::new();
    for (name, context, field, reason) in cases {
        match to_context(&context) {
            Err((f, _)) if f == field => {}
            other => {
                return Err(format!("context rejection {name}: expected a refusal at {field}, got {other:?}").into());
            }
        }
        out.push(ContextRejection { name: name.into(), context, field: field.into(), reason: reason.into() });
    }
    Ok(out)
}

fn dynamo_seed_vectors() -> Vec<DynamoSeedVector> {
    let one = |name: &str, lora: Option<&str>, ns: Option<&str>| {
        let tokens = vec![full(48, 0, 1)];
        let toks = expand_tokens(&tokens);
        let seed = request_seed(lora.map(str::as_bytes), ns.map(str::as_bytes));
        DynamoSeedVector {
            name: name.into(),
            lora_name: lora.map(str::to_string),
            cache_namespace: ns.map(str::to_string),
            local_seed_dec: seed.to_string(),
            block_size: 16,
            token_count: toks.len() as u64,
            sequence_hashes_hex: request_sequence_hashes(&toks, 16, seed).iter().map(|h| format!("{h:016x}")).collect(),
            tokens,
        }
    };
    vec![
        one("base_model", None, None),
        one("empty_strings_are_absent", Some(""), Some("")),
        one("lora", Some("sql-lora"), None),
        one("cache_namespace", None, Some("tenant-a")),
        one("lora_and_cache_namespace", Some("sql-lora"), Some("tenant-a")),
    ]
}

fn engine_hash_vector(
    name: &str,
    spec: NamespaceSpec,
    scheme: HashScheme,
    tokens: Vec<TokenSegment>,
    given: Vec<Vec<u8>>,
) -> Result<EngineHashVector, Box<dyn Error>> {
    let ns = to_namespace(&spec).map_err(|(field, e)| format!("{name}: {field}: {e}"))?;
    let toks = expand_tokens(&tokens);
    let derived = given.is_empty();
    let hashes: Vec<Vec<u8>> = if derived {
        sglang_page_hashes_le(spec.tokens_per_block as usize, &kvproto::tokens_to_le(&toks))
            .iter()
            .map(|h| h.to_vec())
            .collect()
    } else {
        given
    };
    let keys = engine_hash_keys(&ns.fingerprint(), scheme, &hashes);
    Ok(EngineHashVector {
        name: name.to_string(),
        namespace: spec,
        scheme: scheme.name().to_string(),
        token_count: toks.len() as u64,
        tokens,
        derived,
        hashes_hex: hashes.iter().map(hex::encode).collect(),
        keys: keys.iter().map(ToString::to_string).collect(),
    })
}

fn engine_hash_vectors() -> Result<Vec<EngineHashVector>, Box<dyn Error>> {
    let qwen = || ns(QWEN, (28, 8, 128), "bf16", 16, "layer_separate", None, None, None);
    let vllm_key = |i: usize| {
        // A 32-byte block hash and a 4-byte big-endian group, as vLLM's make_offload_key.
        let mut k: Vec<u8> = (0..32).map(|j| (i * 31 + j * 7) as u8).collect();
        k.extend_from_slice(&(i as u32 % 3).to_be_bytes());
        k
    };
    Ok(vec![
        engine_hash_vector("sglang_derived_64_tokens", qwen(), HashScheme::Sglang, vec![full(64, 0, 1)], vec![])?,
        engine_hash_vector(
            "sglang_derived_partial_page",
            ns(QWEN, (28, 8, 128), "bf16", 4, "layer_separate", None, None, None),
            HashScheme::Sglang,
            vec![full(10, 1000, GOLDEN)],
            vec![],
        )?,
        engine_hash_vector(
            "sglang_derived_salted_namespace",
            ns(LLAMA8B, (32, 8, 128), "f16", 16, "layer_separate", Some(hex_bytes(16, 3, 1)), None, None),
            HashScheme::Sglang,
            vec![full(48, 7, GOLDEN)],
            vec![],
        )?,
        engine_hash_vector(
            "sglang_given",
            qwen(),
            HashScheme::Sglang,
            vec![],
            (0..3).map(|i| (0..32).map(|j| (i * 17 + j) as u8).collect()).collect(),
        )?,
        engine_hash_vector("vllm_offload_keys", qwen(), HashScheme::Vllm, vec![], (0..4).map(vllm_key).collect())?,
        engine_hash_vector(
            "vllm_short_and_long_hashes",
            ns(LLAMA70B, (80, 8, 128), "fp8_e4m3", 16, "contiguous", None, None, None),
            HashScheme::Vllm,
            vec![],
            vec![vec![0x01], vec![0xAB; 64]],
        )?,
    ])
}

fn write_or_check(path: &Path, json: &str, check: bool) -> Result<bool, Box<dyn Error>> {
    if check {
        let on_disk = std::fs::read_to_string(path)?;
        let same = on_disk == json;
        println!("{}: {}", path.display(), if same { "up to date" } else { "WOULD CHANGE" });
        Ok(same)
    } else {
        std::fs::write(path, json)?;
        println!("wrote {}", path.display());
        Ok(true)
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let check = std::env::args().any(|a| a == "--check");
    let dir: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "data"].iter().collect();
    std::fs::create_dir_all(&dir)?;

    let keys = BlockKeyFile {
        description: "kvcached block-key test vectors; the encoding is specified in docs/block-keys.md. \
                      Regenerate with `cargo run -p kvproto --example gen_vectors`."
            .to_string(),
        format_version: 1,
        token_generator: TOKEN_GENERATOR.to_string(),
        vectors: block_key_vectors()?,
        rejections: rejection_vectors()?,
    };
    let dynamo = DynamoFile {
        description: "Dynamo-compatible XXH3-64 chained block hashes (docs/block-keys.md, \
                      section \"Dynamo-compatible hash\"). Regenerate with \
                      `cargo run -p kvproto --example gen_vectors`."
            .to_string(),
        format_version: 1,
        token_generator: TOKEN_GENERATOR.to_string(),
        vectors: dynamo_vectors(),
    };
    let context = ContextFile {
        description: "kvcached key-context test vectors (docs/block-keys.md section 6) and Dynamo request seeds \
                      (section 9). Regenerate with `cargo run -p kvproto --example gen_vectors`."
            .to_string(),
        format_version: 1,
        token_generator: TOKEN_GENERATOR.to_string(),
        vectors: context_vectors()?,
        rejections: context_rejections()?,
        dynamo_seeds: dynamo_seed_vectors(),
    };
    let engine = EngineHashFile {
        description: "kvcached engine page-hash keys (docs/block-keys.md section 7): the keys of given hashes, \
                      or of SGLang's page hashes of tokens (derived). Regenerate with \
                      `cargo run -p kvproto --example gen_vectors`."
            .to_string(),
        format_version: 1,
        token_generator: TOKEN_GENERATOR.to_string(),
        vectors: engine_hash_vectors()?,
    };
    let mut ok = true;
    ok &= write_or_check(&dir.join("engine_hashes.json"), &(serde_json::to_string_pretty(&engine)? + "\n"), check)?;
    ok &= write_or_check(&dir.join("context_keys.json"), &(serde_json::to_string_pretty(&context)? + "\n"), check)?;
    ok &= write_or_check(&dir.join("block_keys.json"), &(serde_json::to_string_pretty(&keys)? + "\n"), check)?;
    ok &= write_or_check(&dir.join("dynamo_hashes.json"), &(serde_json::to_string_pretty(&dynamo)? + "\n"), check)?;
    if !ok {
        return Err("test vectors are out of date".into());
    }
    Ok(())
}
