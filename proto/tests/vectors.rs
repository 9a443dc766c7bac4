//! Checks the reference test vectors in `proto/tests/data/` (spec: `docs/block-keys.md`) and the
//! properties the spec promises.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use kvproto::dynamo::{DYNAMO_SEED, chain, local_block_hash, sequence_hashes};
use kvproto::namespace::{ENCODING_VERSION, FINGERPRINT_CONTEXT, ID_CONTEXT};
use kvproto::{
    BlockKey, BlockKeyBuildHasher, Dtype, KvLayout, LayoutKind, Namespace, NamespaceFingerprint, block_keys,
    next_block_key,
};

#[path = "common/schema.rs"]
mod schema;

use schema::{BlockKeyFile, ContextFile, DynamoFile, NamespaceSpec, TokenSegment, expand_tokens};

fn data_path(name: &str) -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "tests", "data", name].iter().collect()
}

fn load_block_keys() -> BlockKeyFile {
    let text = std::fs::read_to_string(data_path("block_keys.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load_dynamo() -> DynamoFile {
    let text = std::fs::read_to_string(data_path("dynamo_hashes.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn namespace_of(spec: &NamespaceSpec) -> Namespace {
    let ns = schema::to_namespace(spec).unwrap();
    // Names round-trip, so the JSON names are exactly the spec's table names.
    assert_eq!(ns.layout.dtype.name(), spec.dtype);
    assert_eq!(ns.layout.kind.name(), spec.layout_kind);
    ns
}

// ---------------------------------------------------------------------------------------------
// Reference vectors
// ---------------------------------------------------------------------------------------------

#[test]
fn block_key_vectors() {
    let file = load_block_keys();
    assert_eq!(file.format_version, 1);
    assert!(file.vectors.len() >= 20, "only {} vectors", file.vectors.len());
    let mut names = BTreeSet::new();
    for v in &file.vectors {
        assert!(names.insert(v.name.clone()), "duplicate vector name {}", v.name);
        let ns = namespace_of(&v.namespace);
        let tokens = expand_tokens(&v.tokens);
        assert_eq!(tokens.len() as u64, v.token_count, "{}: token_count", v.name);

        assert_eq!(hex::encode(ns.canonical_bytes()), v.canonical_hex, "{}: canonical", v.name);
        let fp = ns.fingerprint();
        assert_eq!(hex::encode(fp.0), v.fingerprint_hex, "{}: fingerprint", v.name);
        assert_eq!(ns.id().to_string(), v.namespace_id_hex, "{}: id", v.name);
        assert_eq!(fp.id(), ns.id());

        let bs = v.namespace.tokens_per_block as usize;
        let keys = block_keys(&fp, bs, &tokens);
        assert_eq!(keys.len(), tokens.len() / bs, "{}: only full blocks have keys", v.name);
        let got: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(got, v.keys, "{}: keys", v.name);

        // The same chain, one block at a time, and every key parses back from the file.
        let mut parent: Option<BlockKey> = None;
        for (i, block) in tokens.chunks_exact(bs).enumerate() {
            let k = next_block_key(&fp, parent.as_ref(), block);
            assert_eq!(k, v.keys[i].parse::<BlockKey>().unwrap(), "{}: key {i}", v.name);
            parent = Some(k);
        }
    }
}

/// The vectors keep covering what the spec promises, even after a regeneration.
#[test]
fn block_key_vectors_cover_the_spec() {
    let file = load_block_keys();
    let vs = &file.vectors;
    let any = |f: &dyn Fn(&schema::BlockKeyVector) -> bool| vs.iter().any(f);
    for bs in [16, 256, 512] {
        assert!(any(&|v| v.namespace.tokens_per_block == bs && !v.keys.is_empty()), "bs {bs}");
        assert!(
            any(&|v| v.namespace.tokens_per_block == bs && v.token_count % u64::from(bs) != 0 && !v.keys.is_empty()),
            "trailing partial block at bs {bs}"
        );
    }
    assert!(any(&|v| v.namespace.tenant_salt_hex.is_some()));
    assert!(any(&|v| v.namespace.tenant_salt_hex.is_none()));
    assert!(any(&|v| v.namespace.tenant_salt_hex.as_deref() == Some("")));
    assert!(any(&|v| v.namespace.adapter_id.is_some()));
    assert!(any(&|v| v.namespace.extra_hex.is_some()));
    assert!(any(&|v| v.keys.is_empty() && v.token_count > 0), "a partial-only prompt");
    assert!(any(&|v| v.keys.len() == 1));
    assert!(any(&|v| v.keys.len() >= 100));
    assert!(any(&|v| v.keys.len() >= 8192), "a 128k-token chain");
    let dtypes: BTreeSet<&str> = vs.iter().map(|v| v.namespace.dtype.as_str()).collect();
    assert_eq!(dtypes.len(), 6, "every dtype: {dtypes:?}");
    let kinds: BTreeSet<&str> = vs.iter().map(|v| v.namespace.layout_kind.as_str()).collect();
    assert_eq!(kinds.len(), 2);
    let max_token = vs.iter().flat_map(|v| expand_tokens(&v.tokens)).max().unwrap();
    assert_eq!(max_token, u32::MAX);
    assert!(vs.iter().any(|v| expand_tokens(&v.tokens).contains(&0x8000_0000)));
}

/// Every rejection vector is refused, at the field it names; together they cover each rule of
/// section 2.
#[test]
fn rejection_vectors() {
    let file = load_block_keys();
    for r in &file.rejections {
        match schema::to_namespace(&r.namespace) {
            Err((field, why)) => assert_eq!(field, r.field, "{}: refused for {why}", r.name),
            Ok(_) => panic!("{}: accepted a namespace the spec refuses ({})", r.name, r.reason),
        }
    }
    let fields: BTreeSet<&str> = file.rejections.iter().map(|r| r.field.as_str()).collect();
    for f in [
        "model_id",
        "num_layers",
        "kv_heads",
        "head_dim",
        "tokens_per_block",
        "layout",
        "dtype",
        "layout_kind",
        "tenant_salt_hex",
        "extra_hex",
    ] {
        assert!(fields.contains(f), "no rejection vector for {f}");
    }
}

/// The worked example printed in docs/block-keys.md is the `worked_example` vector.
#[test]
fn doc_worked_example_matches_vectors() {
    let file = load_block_keys();
    let v = file.vectors.iter().find(|v| v.name == "worked_example").unwrap();
    let doc_path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "docs", "block-keys.md"].iter().collect();
    let doc = std::fs::read_to_string(doc_path).unwrap();
    for s in [&v.canonical_hex, &v.fingerprint_hex, &v.namespace_id_hex, &v.keys[0], &v.keys[1]] {
        assert!(doc.contains(s.as_str()), "docs/block-keys.md lacks {s}");
    }
    // The constants the doc quotes.
    assert!(doc.contains(&format!("`{FINGERPRINT_CONTEXT}`")));
    assert!(doc.contains(&format!("`{ID_CONTEXT}`")));
    assert_eq!(ENCODING_VERSION, 2);
    let d = load_dynamo();
    let dv = d.vectors.iter().find(|v| v.name == "bs16_two_blocks").unwrap();
    for s in dv.sequence_hashes_dec.iter().chain(&dv.local_hashes_hex) {
        assert!(doc.contains(s.as_str()), "docs/block-keys.md lacks {s}");
    }
}

#[test]
fn dynamo_vectors() {
    let file = load_dynamo();
    assert_eq!(file.format_version, 1);
    assert!(file.vectors.len() >= 10);
    for v in &file.vectors {
        let tokens = expand_tokens(&v.tokens);
        assert_eq!(tokens.len() as u64, v.token_count, "{}", v.name);
        let bs = v.block_size as usize;
        let seqs = sequence_hashes(&tokens, bs, v.seed);
        assert_eq!(seqs.len(), tokens.len() / bs, "{}", v.name);
        let dec: Vec<String> = seqs.iter().map(u64::to_string).collect();
        let hex: Vec<String> = seqs.iter().map(|h| format!("{h:016x}")).collect();
        assert_eq!(dec, v.sequence_hashes_dec, "{}: decimal", v.name);
        assert_eq!(hex, v.sequence_hashes_hex, "{}: hex", v.name);
        let locals: Vec<u64> = tokens.chunks_exact(bs).map(|b| local_block_hash(b, v.seed)).collect();
        let lhex: Vec<String> = locals.iter().map(|h| format!("{h:016x}")).collect();
        assert_eq!(lhex, v.local_hashes_hex, "{}: local", v.name);
        // Decimal and hex spell the same numbers; the chain rule holds step by step.
        for (i, (d, h)) in v.sequence_hashes_dec.iter().zip(&v.sequence_hashes_hex).enumerate() {
            assert_eq!(d.parse::<u64>().unwrap(), u64::from_str_radix(h, 16).unwrap());
            let parent = if i == 0 { None } else { Some(seqs[i - 1]) };
            assert_eq!(chain(parent, locals[i], v.seed), seqs[i]);
        }
    }
    let sizes: BTreeSet<u32> = file.vectors.iter().map(|v| v.block_size).collect();
    for bs in [16, 64, 256, 512] {
        assert!(sizes.contains(&bs), "block size {bs}");
    }
    assert!(file.vectors.iter().filter(|v| v.seed == DYNAMO_SEED).count() >= 10);
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

fn base() -> Namespace {
    Namespace::new("meta-llama/Llama-3.1-8B-Instruct", KvLayout::llama3_8b(16))
}

fn prompt(n: usize) -> Vec<u32> {
    TokenSegment::full(n as u64, 7, 2_654_435_761).expand()
}

fn keys_of(ns: &Namespace, tokens: &[u32]) -> Vec<BlockKey> {
    block_keys(&ns.fingerprint(), ns.layout.tokens_per_block as usize, tokens)
}

#[test]
fn deterministic_across_instances() {
    let t = prompt(16 * 20 + 3);
    let a = keys_of(&base(), &t);
    let b = keys_of(&base().clone(), &t.clone());
    assert_eq!(a.len(), 20);
    assert_eq!(a, b);
    assert_eq!(base().canonical_bytes(), base().canonical_bytes());
    assert_eq!(base().id(), base().id());
    // Keys of a prefix are a prefix of the keys: extending a prompt never changes old keys.
    for n in [0, 1, 15, 16, 17, 100, 16 * 20] {
        let k = keys_of(&base(), &t[..n]);
        assert_eq!(k[..], a[..n / 16]);
    }
}

#[test]
fn every_namespace_field_changes_every_key() {
    let t = prompt(16 * 4);
    let reference = keys_of(&base(), &t);
    let mut variants: Vec<(&str, Namespace)> = Vec::new();
    let mut v = base();
    v.model_id.push('x');
    variants.push(("model", v));
    for (what, f) in [
        ("layers", (|l: &mut KvLayout| l.num_layers += 1) as fn(&mut KvLayout)),
        ("kv_heads", |l| l.kv_heads += 1),
        ("head_dim", |l| l.head_dim += 1),
        ("dtype", |l| l.dtype = Dtype::F16),
        ("layout kind", |l| l.kind = LayoutKind::Contiguous),
    ] {
        let mut v = base();
        f(&mut v.layout);
        variants.push((what, v));
    }
    for (what, salt) in [("salt a", b"a".to_vec()), ("salt b", b"b".to_vec()), ("empty salt", vec![])] {
        let mut v = base();
        v.tenant_salt = Some(salt);
        variants.push((what, v));
    }
    for (what, adapter) in [("adapter", "lora-1"), ("other adapter", "lora-2"), ("empty adapter", "")] {
        let mut v = base();
        v.adapter_id = Some(adapter.to_string());
        variants.push((what, v));
    }
    for (what, extra) in [("extra", vec![1u8; 32]), ("other extra", vec![2u8; 32]), ("empty extra", vec![])] {
        let mut v = base();
        v.extra = Some(extra);
        variants.push((what, v));
    }
    // Length prefixes keep field boundaries unambiguous.
    let mut a = base();
    a.model_id = "ab".into();
    a.adapter_id = Some("c".into());
    let mut b = base();
    b.model_id = "a".into();
    b.adapter_id = Some("bc".into());
    variants.push(("boundary ab|c", a));
    variants.push(("boundary a|bc", b));
    // The same bytes as salt or as extra are different namespaces.
    let mut s = base();
    s.tenant_salt = Some(vec![9; 8]);
    let mut e = base();
    e.extra = Some(vec![9; 8]);
    variants.push(("bytes as salt", s));
    variants.push(("bytes as extra", e));

    let mut seen: HashMap<Vec<u8>, &str> = HashMap::new();
    seen.insert(base().canonical_bytes(), "base");
    let mut ids = BTreeSet::from([base().id()]);
    let mut all_keys: BTreeSet<BlockKey> = reference.iter().copied().collect();
    for (what, ns) in &variants {
        ns.validate().unwrap();
        if let Some(prev) = seen.insert(ns.canonical_bytes(), what) {
            panic!("{what} and {prev} encode the same");
        }
        assert!(ids.insert(ns.id()), "{what}: id collides");
        let k = keys_of(ns, &t);
        assert_eq!(k.len(), reference.len());
        for (i, key) in k.iter().enumerate() {
            assert_ne!(*key, reference[i], "{what}: key {i} unchanged");
            assert!(all_keys.insert(*key), "{what}: key {i} seen before");
        }
    }
}

#[test]
fn tokens_per_block_is_bound() {
    // 256 tokens as one 256-token block vs as sixteen 16-token blocks: no key in common, and
    // the namespaces differ too.
    let t = prompt(256);
    let ns16 = base();
    let mut ns256 = base();
    ns256.layout.tokens_per_block = 256;
    let k16 = keys_of(&ns16, &t);
    let k256 = keys_of(&ns256, &t);
    assert_eq!((k16.len(), k256.len()), (16, 1));
    assert!(!k16.contains(&k256[0]));
    // Even under one fingerprint, the token count field separates block sizes.
    let fp = ns16.fingerprint();
    let a = block_keys(&fp, 16, &t);
    let b = block_keys(&fp, 32, &t);
    assert!(a.iter().all(|k| !b.contains(k)));
}

#[test]
fn partial_blocks_have_no_key() {
    let ns = base();
    let fp = ns.fingerprint();
    let t = prompt(16 * 3);
    assert!(block_keys(&fp, 16, &[]).is_empty());
    assert!(block_keys(&fp, 16, &t[..1]).is_empty());
    assert!(block_keys(&fp, 16, &t[..15]).is_empty());
    assert_eq!(block_keys(&fp, 16, &t[..16]).len(), 1);
    let full = block_keys(&fp, 16, &t);
    assert_eq!(block_keys(&fp, 16, &t[..47]), full[..2]);
    // Whatever the trailing partial tokens are, the keys are the same.
    let mut other = t[..40].to_vec();
    other[39] ^= 0xFFFF_FFFF;
    assert_eq!(block_keys(&fp, 16, &other), full[..2]);
    // A zero block size yields nothing instead of panicking.
    assert!(block_keys(&fp, 0, &t).is_empty());
    assert!(sequence_hashes(&t, 0, DYNAMO_SEED).is_empty());
    assert!(sequence_hashes(&t[..15], 16, DYNAMO_SEED).is_empty());
}

#[test]
fn key_depends_on_parent_and_whole_prefix() {
    let ns = base();
    let fp = ns.fingerprint();
    let t = prompt(16 * 5);
    let keys = block_keys(&fp, 16, &t);

    // Changing one token of block j changes key j and every later key, and no earlier one.
    for j in 0..5 {
        let mut u = t.clone();
        u[16 * j + 3] = u[16 * j + 3].wrapping_add(1);
        let k = block_keys(&fp, 16, &u);
        for i in 0..5 {
            if i < j {
                assert_eq!(k[i], keys[i], "block {j} changed key {i}");
            } else {
                assert_ne!(k[i], keys[i], "block {j} did not change key {i}");
            }
        }
    }

    // Same block tokens, different parent: different key; root differs from any child.
    let block = &t[16..32];
    let with_parent = next_block_key(&fp, Some(&keys[0]), block);
    assert_eq!(with_parent, keys[1]);
    assert_ne!(next_block_key(&fp, Some(&keys[2]), block), keys[1]);
    assert_ne!(next_block_key(&fp, None, block), keys[1]);
    assert_ne!(next_block_key(&fp, Some(&BlockKey([0; 16])), block), next_block_key(&fp, None, block));
    // The spec's construction: a child's hash key is its parent key followed by the fingerprint's
    // second half, a root's is the whole fingerprint. So a child aliases a root only under a
    // parent key equal to the fingerprint's first half (a 128-bit preimage).
    let mut first_half = [0u8; 16];
    first_half.copy_from_slice(&fp.0[..16]);
    assert_eq!(next_block_key(&fp, Some(&BlockKey(first_half)), block), next_block_key(&fp, None, block));

    // Swapping two blocks changes keys (order matters).
    let mut swapped = t[16..32].to_vec();
    swapped.extend_from_slice(&t[..16]);
    let s = block_keys(&fp, 16, &swapped);
    assert_ne!(s[0], keys[0]);
    assert_ne!(s[1], keys[1]);

    // The Dynamo hash chains too.
    let seq = sequence_hashes(&t, 16, DYNAMO_SEED);
    let mut u = t.clone();
    u[0] ^= 1;
    let seq_u = sequence_hashes(&u, 16, DYNAMO_SEED);
    assert!(seq.iter().zip(&seq_u).all(|(a, b)| a != b));
    assert_eq!(seq[0], local_block_hash(&t[..16], DYNAMO_SEED));
}

#[test]
fn high_token_ids_are_unsigned() {
    let fp = base().fingerprint();
    // 0x8000_0000 and 0x7FFF_FFFF differ only in how a signed reader would see them.
    let a = block_keys(&fp, 16, &[0x8000_0000; 16]);
    let b = block_keys(&fp, 16, &[0x7FFF_FFFF; 16]);
    let c = block_keys(&fp, 16, &[0xFFFF_FFFF; 16]);
    let d = block_keys(&fp, 16, &[0; 16]);
    let all: BTreeSet<BlockKey> = [a[0], b[0], c[0], d[0]].into();
    assert_eq!(all.len(), 4);
}

#[test]
fn block_key_display_parse_roundtrip() {
    let keys = keys_of(&base(), &prompt(16 * 50));
    for k in &keys {
        let s = k.to_string();
        assert_eq!(s.len(), 32);
        assert!(s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_eq!(s, hex::encode(k.as_bytes()));
        assert_eq!(s.parse::<BlockKey>().unwrap(), *k);
        assert_eq!(s.to_uppercase().parse::<BlockKey>().unwrap(), *k);
        assert_eq!(format!("{k:?}"), format!("BlockKey({s})"));
        assert_eq!(k.low64(), u64::from_le_bytes(k.0[..8].try_into().unwrap()));
    }
    let k = BlockKey(*b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\xff");
    assert_eq!(k.to_string(), "000102030405060708090a0b0c0d0eff");
    for bad in ["", "00", &"0".repeat(31), &"0".repeat(33), &"g".repeat(32), &format!("{k} ")] {
        assert!(bad.parse::<BlockKey>().is_err(), "{bad:?} parsed");
    }
    // Keys work in maps with the identity hasher.
    let mut m: HashMap<BlockKey, usize, BlockKeyBuildHasher> = HashMap::default();
    for (i, k) in keys.iter().enumerate() {
        m.insert(*k, i);
    }
    assert_eq!(m.len(), keys.len());
    assert!(keys.iter().enumerate().all(|(i, k)| m[k] == i));
}

#[test]
fn debug_never_prints_salt_or_fingerprint() {
    let salt = b"TOPSECRET-tenant-salt-0123456789".to_vec();
    let mut ns = base();
    ns.tenant_salt = Some(salt.clone());
    ns.adapter_id = Some("lora".into());
    let fp = ns.fingerprint();
    let forbidden: Vec<String> = vec![
        "TOPSECRET".into(),
        hex::encode(&salt),
        hex::encode(&salt).to_uppercase(),
        format!("{:?}", salt),
        format!("{:?}", &salt[..4]).trim_end_matches(']').to_string(),
        hex::encode(fp.0),
        hex::encode(&fp.0[..8]),
        format!("{:?}", fp.0),
        format!("{:?}", &fp.0[..4]).trim_end_matches(']').to_string(),
    ];
    let outputs = [
        format!("{ns:?}"),
        format!("{ns:#?}"),
        format!("{fp:?}"),
        format!("{fp:#?}"),
        format!("{:?}", ns.id()),
        format!("{:?}", (ns.clone(), fp)),
    ];
    for out in &outputs {
        for f in &forbidden {
            assert!(!out.contains(f.as_str()), "{out:?} contains {f:?}");
        }
    }
    assert!(format!("{ns:?}").contains("<secret>"));
    assert_eq!(format!("{fp:?}"), "NamespaceFingerprint(<secret>)");
    // The public id is printed, and is not a prefix of the fingerprint.
    assert!(format!("{:?}", ns.id()).contains(&ns.id().to_string()));
    assert_ne!(&fp.0[..16], &ns.id().0);
    let _: &NamespaceFingerprint = &fp;
}

#[test]
fn canonical_bytes_layout() {
    // The field layout of docs/block-keys.md section 2, spelled out.
    let mut ns = Namespace::new(
        "m",
        KvLayout {
            num_layers: 0x0102_0304,
            kv_heads: 5,
            head_dim: 6,
            dtype: Dtype::Int8,
            tokens_per_block: 0xFFFF_FFFF,
            kind: LayoutKind::Contiguous,
        },
    );
    let head = "02 01000000 6d 04030201 05000000 06000000 06 ffffffff 02";
    let want = |tail: &str| format!("{head} {tail}").replace(' ', "");
    assert_eq!(hex::encode(ns.canonical_bytes()), want("00 00 00"));
    ns.tenant_salt = Some(vec![0xAA, 0xBB]);
    ns.adapter_id = Some(String::new());
    ns.extra = Some(vec![0xCC]);
    assert_eq!(hex::encode(ns.canonical_bytes()), want("01 02000000 aabb 01 00000000 01 01000000 cc"));
    for (d, code) in
        [(Dtype::F16, 1), (Dtype::Bf16, 2), (Dtype::F32, 3), (Dtype::Fp8E4m3, 4), (Dtype::Fp8E5m2, 5), (Dtype::Int8, 6)]
    {
        assert_eq!(d.code(), code);
        assert_eq!(Dtype::parse(d.name()).unwrap(), d);
    }
    assert_eq!((LayoutKind::LayerSeparate.code(), LayoutKind::Contiguous.code()), (1, 2));
}

#[test]
fn invalid_namespaces_are_rejected() {
    let mut ns = base();
    ns.model_id.clear();
    assert!(ns.validate().is_err());
    for f in [
        (|l: &mut KvLayout| l.num_layers = 0) as fn(&mut KvLayout),
        |l| l.kv_heads = 0,
        |l| l.head_dim = 0,
        |l| l.tokens_per_block = 0,
    ] {
        let mut ns = base();
        f(&mut ns.layout);
        assert!(ns.validate().is_err());
    }
    assert!(Dtype::parse("f8").is_err());
    assert!(LayoutKind::parse("paged").is_err());
}

// ---------------------------------------------------------------------------------------------
// Key contexts (section 6) and Dynamo request seeds
// ---------------------------------------------------------------------------------------------

fn load_contexts() -> ContextFile {
    let text = std::fs::read_to_string(data_path("context_keys.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn context_key_vectors() {
    let file = load_contexts();
    assert_eq!(file.format_version, 1);
    assert!(file.vectors.len() >= 10, "only {} vectors", file.vectors.len());
    for v in &file.vectors {
        let ns = namespace_of(&v.namespace);
        let ctx = schema::to_context(&v.context).unwrap();
        let tokens = expand_tokens(&v.tokens);
        assert_eq!(tokens.len() as u64, v.token_count, "{}: token_count", v.name);
        let tpb = v.namespace.tokens_per_block as usize;
        let extras: Vec<(u64, String)> =
            ctx.block_extras(tpb, tokens.len() / tpb).iter().map(|(b, e)| (*b as u64, hex::encode(e))).collect();
        let want: Vec<(u64, String)> = v.extras.iter().map(|e| (e.block, e.hex.clone())).collect();
        assert_eq!(extras, want, "{}: extras", v.name);
        let keys: Vec<String> =
            kvproto::context_keys(&ns.fingerprint(), tpb, &tokens, &ctx).iter().map(ToString::to_string).collect();
        assert_eq!(keys, v.keys, "{}: keys", v.name);
        // Blocks before the first with extras keep their plain keys; from it on, every key differs.
        let plain: Vec<String> = block_keys(&ns.fingerprint(), tpb, &tokens).iter().map(ToString::to_string).collect();
        let first = v.extras.first().map_or(keys.len(), |e| e.block as usize).min(keys.len());
        assert_eq!(keys[..first], plain[..first], "{}: shared prefix", v.name);
        for i in first..keys.len() {
            assert_ne!(keys[i], plain[i], "{}: block {i}", v.name);
        }
    }
}

#[test]
fn context_rejection_vectors() {
    let file = load_contexts();
    assert!(file.rejections.len() >= 10);
    for r in &file.rejections {
        match schema::to_context(&r.context) {
            Err((field, _)) => assert_eq!(field, r.field, "{}", r.name),
            Ok(c) => panic!("{}: accepted {c:?}", r.name),
        }
    }
}

#[test]
fn dynamo_request_seed_vectors() {
    use kvproto::dynamo::{request_seed, request_sequence_hashes};
    let file = load_contexts();
    for v in &file.dynamo_seeds {
        let seed =
            request_seed(v.lora_name.as_deref().map(str::as_bytes), v.cache_namespace.as_deref().map(str::as_bytes));
        assert_eq!(seed.to_string(), v.local_seed_dec, "{}", v.name);
        let tokens = expand_tokens(&v.tokens);
        let hashes: Vec<String> =
            request_sequence_hashes(&tokens, v.block_size as usize, seed).iter().map(|h| format!("{h:016x}")).collect();
        assert_eq!(hashes, v.sequence_hashes_hex, "{}", v.name);
    }
    // A base-model request is the plain Dynamo chain.
    let base = &file.dynamo_seeds[0];
    assert_eq!(base.local_seed_dec, DYNAMO_SEED.to_string());
    let tokens = expand_tokens(&base.tokens);
    let plain: Vec<String> = sequence_hashes(&tokens, 16, DYNAMO_SEED).iter().map(|h| format!("{h:016x}")).collect();
    assert_eq!(plain, base.sequence_hashes_hex);
}

// ---------------------------------------------------------------------------------------------
// Engine page hashes (section 7)
// ---------------------------------------------------------------------------------------------

#[test]
fn engine_hash_vectors() {
    use kvproto::engine_hash::{EngineHashes, HashScheme};
    let text = std::fs::read_to_string(data_path("engine_hashes.json")).unwrap();
    let file: schema::EngineHashFile = serde_json::from_str(&text).unwrap();
    assert_eq!(file.format_version, 1);
    assert!(file.vectors.len() >= 6, "only {} vectors", file.vectors.len());
    for v in &file.vectors {
        let ns = namespace_of(&v.namespace);
        let scheme = HashScheme::parse(&v.scheme).unwrap();
        let tokens = expand_tokens(&v.tokens);
        assert_eq!(tokens.len() as u64, v.token_count, "{}: token_count", v.name);
        let hashes: Vec<Vec<u8>> = v.hashes_hex.iter().map(|h| hex::decode(h).unwrap()).collect();
        let tpb = v.namespace.tokens_per_block as usize;
        let le = kvproto::tokens_to_le(&tokens);
        let keys = if v.derived {
            // The daemon's derivation from tokens gives the recorded hashes' keys.
            let derived = kvproto::engine_hash::sglang_page_hashes_le(tpb, &le);
            assert_eq!(derived.iter().map(hex::encode).collect::<Vec<_>>(), v.hashes_hex, "{}: hashes", v.name);
            EngineHashes { scheme, hashes: vec![] }.keys_le(&ns.fingerprint(), tpb, &le).unwrap()
        } else {
            EngineHashes { scheme, hashes }.keys_le(&ns.fingerprint(), tpb, &[]).unwrap()
        };
        let keys: Vec<String> = keys.iter().map(ToString::to_string).collect();
        assert_eq!(keys, v.keys, "{}: keys", v.name);
        // Never a token chain's key of the same namespace.
        let plain: Vec<String> = block_keys(&ns.fingerprint(), tpb, &tokens).iter().map(ToString::to_string).collect();
        assert!(keys.iter().all(|k| !plain.contains(k)), "{}", v.name);
    }
}
