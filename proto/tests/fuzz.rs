//! Property tests that feed arbitrary input to every decoder `kvproto` owns of bytes from another
//! process: the gRPC messages (prost) and their validated conversions (namespaces, layouts, slot
//! lists), the ATTACH headers, vLLM's msgpack event batches and the hit-report JSON. Each must
//! answer an error, never panic, and what it accepts must hold the invariants its users rely on.
//!
//! A short run is part of `cargo test`; a long one: `PROPTEST_CASES=100000 cargo test -p kvproto
//! --test fuzz --release` (docs/operations/security-limits.md, "Fuzzing").
#![allow(clippy::unwrap_used)]

use kvproto::events::PublisherMessage;
use kvproto::fuzzing::{bytes, cases, scalars};
use kvproto::slots::{Segment, SlotLayout};
use kvproto::{KvLayout, Namespace, pb, vllm};
use proptest::prelude::*;
use rmpv::Value;

/// Small and boundary numbers, where decoders go wrong, and any number.
fn num32() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..=4, Just(16), Just(u32::MAX), Just(u32::MAX / 2 + 1), any::<u32>()]
}

fn num64() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..=4, Just(4096), Just(u64::MAX), Just(1 << 63), any::<u64>()]
}

fn dtype() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("bf16".to_string()),
        Just("fp8_e4m3".to_string()),
        Just("f32".to_string()),
        Just(String::new()),
        ".{0,12}"
    ]
}

fn layout() -> impl Strategy<Value = pb::Layout> {
    (num32(), num32(), num32(), dtype(), num32(), prop_oneof![Just("layer_separate"), Just("contiguous"), Just("x")])
        .prop_map(|(num_layers, kv_heads, head_dim, dtype, tokens_per_block, kind)| pb::Layout {
            num_layers,
            kv_heads,
            head_dim,
            dtype,
            tokens_per_block,
            kind: kind.to_string(),
        })
}

fn spec() -> impl Strategy<Value = pb::NamespaceSpec> {
    (
        ".{0,40}",
        proptest::option::of(layout()),
        proptest::option::of(bytes(80)),
        proptest::option::of(".{0,20}"),
        proptest::option::of(bytes(40)),
    )
        .prop_map(|(model_id, layout, tenant_salt, adapter_id, extra)| pb::NamespaceSpec {
            model_id,
            layout,
            tenant_salt,
            adapter_id,
            extra,
        })
}

/// Any msgpack value, nested a few levels.
fn msgpack() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        1 => Just(Value::Nil),
        3 => scalars(),
        1 => any::<f64>().prop_map(Value::from),
        1 => prop_oneof![
            Just("BlockStored"),
            Just("BlockRemoved"),
            Just("AllBlocksCleared"),
            Just("token_ids"),
            Just("block_hashes"),
            Just("events"),
            Just("ts"),
            Just("type"),
            Just("medium"),
        ]
        .prop_map(Value::from),
        1 => bytes(40).prop_map(Value::Binary),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Map),
        ]
    })
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// A vLLM batch shaped like the real ones, with arbitrary values where vLLM puts its fields.
fn batch_like() -> impl Strategy<Value = Value> {
    let event = (
        prop_oneof![Just("BlockStored"), Just("BlockRemoved"), Just("AllBlocksCleared"), Just("Other")],
        proptest::collection::vec(msgpack(), 0..7),
    )
        .prop_map(|(tag, fields)| {
            let mut a = vec![Value::from(tag)];
            a.extend(fields);
            Value::Array(a)
        });
    (msgpack(), proptest::collection::vec(event, 0..4), proptest::option::of(msgpack())).prop_map(|(ts, ev, rank)| {
        let mut a = vec![ts, Value::Array(ev)];
        a.extend(rank);
        Value::Array(a)
    })
}

proptest! {
    #![proptest_config(cases(256))]

    /// Namespace specs and layouts: refused or valid, and a valid one's sizes and keys compute.
    #[test]
    fn namespace_specs(s in spec()) {
        if let Ok(ns) = Namespace::try_from(&s) {
            prop_assert!(ns.layout.block_bytes() > 0);
            let _ = (ns.fingerprint(), ns.id(), ns.canonical_bytes());
            let _ = ns.block_keys(&[1; 33]);
        }
    }

    /// Slot lists against a layout and a region: what `check` accepts lies inside the region and
    /// no two slots share a byte (the daemon copies into these ranges with raw pointers).
    #[test]
    fn slot_layouts(
        l in layout(),
        segs in proptest::collection::vec((num64(), num64()), 0..6),
        segment_bytes in num64(),
        num_blocks in prop_oneof![0u32..4, num32()],
        region in num64(),
    ) {
        let Ok(layout) = KvLayout::try_from(&l) else { return Ok(()) };
        let slots = SlotLayout {
            segments: segs.iter().map(|&(offset, stride)| Segment { offset, stride }).collect(),
            segment_bytes,
            num_blocks,
        };
        if slots.check(&layout, region).is_ok() {
            prop_assert_eq!(slots.segment_bytes * slots.segments.len() as u64, layout.block_bytes());
            let mut seen: Vec<(u64, u64)> = Vec::new();
            for b in [0, num_blocks / 2, num_blocks - 1] {
                for (o, n) in slots.ranges(b) {
                    prop_assert!(o as u64 + n as u64 <= region);
                    if !seen.contains(&(o as u64, n as u64)) {
                        seen.push((o as u64, n as u64));
                    }
                }
            }
            seen.sort_unstable();
            for w in seen.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "slots overlap: {:?}", w);
            }
            prop_assert_eq!(slots.extent().map(|e| e <= region), Some(true));
        }
    }

    /// Every request message the daemon's service decodes, from arbitrary bytes, and the
    /// conversions run on what decodes.
    #[test]
    fn grpc_messages_from_bytes(b in bytes(512)) {
        use prost::Message;
        if let Ok(r) = pb::RegisterRequest::decode(&b[..]) && let Some(s) = &r.namespace {
            let _ = Namespace::try_from(s);
        }
        let _ = pb::SaveRequest::decode(&b[..]);
        let _ = pb::LookupRequest::decode(&b[..]);
        let _ = pb::LoadRequest::decode(&b[..]);
        let _ = pb::WaitRequest::decode(&b[..]);
        let _ = pb::GpuBlocksRequest::decode(&b[..]);
        let _ = pb::EngineLoadRequest::decode(&b[..]);
        let _ = pb::EngineRef::decode(&b[..]);
    }

    /// A valid message with bytes flipped and cut: decodes or is refused.
    #[test]
    fn grpc_messages_mutated(s in spec(), at in any::<usize>(), x in 1u8..=255, cut in any::<usize>()) {
        use prost::Message;
        let r = pb::RegisterRequest { engine_name: "e".into(), namespace: Some(s), num_blocks: 8, ..Default::default() };
        let mut b = r.encode_to_vec();
        if !b.is_empty() {
            let i = at % b.len();
            b[i] ^= x;
            b.truncate(cut % (b.len() + 1));
        }
        if let Ok(r) = pb::RegisterRequest::decode(&b[..]) && let Some(s) = &r.namespace {
            let _ = Namespace::try_from(s);
        }
    }

    /// ATTACH headers, both directions.
    #[test]
    fn attach_headers(h in any::<[u8; kvproto::attach::HEADER_BYTES]>()) {
        if let Ok(n) = kvproto::attach::parse_request(&h) {
            prop_assert!((1..=kvproto::attach::MAX_FDS).contains(&n));
        }
        let _ = kvproto::attach::parse_reply(&h);
    }

    /// LOOKUP answers from arbitrary bytes; a refusal that parses is framed and parsed back the
    /// same.
    #[test]
    fn lookup_answers(b in bytes(300)) {
        use kvproto::lookup_wire::{parse_answer, refusal};
        if let Ok(Err(r)) = parse_answer(&b)
            && r.reason.len() <= 255 // bytes that are not UTF-8 come back longer, as U+FFFD
        {
            let framed = refusal(&r);
            prop_assert_eq!(parse_answer(&framed[4..]), Ok(Err(r)));
        }
    }

    /// vLLM event batches from arbitrary bytes.
    #[test]
    fn vllm_batches_from_bytes(b in bytes(256)) {
        let _ = vllm::decode_batch(&b);
    }

    /// vLLM event batches from arbitrary msgpack values, and from batch-shaped ones; what decodes
    /// encodes and decodes to the same batch.
    #[test]
    fn vllm_batches_from_values(v in prop_oneof![msgpack(), batch_like()]) {
        if let Ok(b) = vllm::decode_batch(&encode(&v)) {
            for enc in [vllm::Encoding::Tuple, vllm::Encoding::Map] {
                let again = vllm::decode_batch(&vllm::encode_batch(&b, enc)).unwrap();
                prop_assert_eq!(again.events, b.events.clone());
            }
        }
    }

    /// Hit reports (`POST /events` bodies) from arbitrary bytes and from a valid report with
    /// bytes flipped.
    #[test]
    fn hit_reports(b in bytes(256), at in any::<usize>(), x in 1u8..=255) {
        let _ = serde_json::from_slice::<PublisherMessage>(&b);
        let mut valid = VALID_REPORT.as_bytes().to_vec();
        let i = at % valid.len();
        valid[i] ^= x;
        let _ = serde_json::from_slice::<PublisherMessage>(&valid);
    }

    /// Quoted text is clipped on a character boundary, to at most `max` bytes (or the note of
    /// what was cut, when `max` is shorter than it), whatever the input.
    #[test]
    fn clipping(s in ".{0,200}", max in 0usize..300) {
        let c = kvproto::limits::clip(&s, max);
        if s.len() <= max {
            prop_assert_eq!(&*c, &*s);
        } else {
            let kept = c.rsplit_once("... (").map(|(k, _)| k).unwrap_or("");
            prop_assert!(s.starts_with(kept));
            prop_assert!(c.len() <= max.max(24), "{} bytes for max {}", c.len(), max);
        }
    }
}

const VALID_REPORT: &str = r#"{"publisher":"node-a","epoch":7,"last_event_id":2,"events":[
 {"id":1,"type":"stored","namespace":"00112233445566778899aabbccddeeff","parent":null,
  "keys":["00112233445566778899aabbccddeeff"],"tier":"g2","holder":{"node":"node-a"}},
 {"id":2,"type":"removed","keys":["00112233445566778899aabbccddeeff"],"tier":"g3","holder":{"node":"node-a"}}]}"#;

#[test]
fn the_valid_report_is_valid() {
    // The mutation base must decode, or the mutations above test nothing.
    let m: Result<PublisherMessage, _> = serde_json::from_str(VALID_REPORT);
    assert!(m.is_ok(), "{m:?}");
}

/// Regression: a batch nested to msgpack's depth limit is refused, not a stack overflow.
#[test]
fn deeply_nested_batch_is_refused() {
    let mut b = vec![0x91u8; 100_000];
    b.push(0xc0);
    assert!(vllm::decode_batch(&b).is_err());
}
