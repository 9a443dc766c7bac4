//! vLLM's KV-event wire format, both directions.
//!
//! vLLM (`--kv-events-config`) publishes ZMQ multipart messages `[topic, seq (8 bytes,
//! big-endian), payload]`; the payload is msgpack of `KVEventBatch = [ts, [events], dp_rank]`
//! (msgspec, `array_like=True`, trailing defaults omitted). Each event is a tagged struct:
//! - tuple encoding (`array_like=True`, vLLM's own): `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, ...]`,
//!   `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
//! - tagged-map encoding (msgspec's default for tagged structs, used by other publishers):
//!   `{"type": "BlockStored", "block_hashes": [...], ...}`.
//!
//! Block hashes are ints or bytes (vLLM's own hash, which other processes cannot reproduce); the
//! router recomputes Dynamo XXH3-64 chained hashes from `token_ids` ([`crate::dynamo`]).

use std::io::Cursor;

use crate::TierKind;
use rmpv::Value;

use crate::ProtoError;

/// The sequence number a replay socket sends (as -1) after the last batch it replays.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// A vLLM block hash as sent: an integer or bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtHash {
    Int(i128),
    Bytes(Vec<u8>),
}

impl ExtHash {
    /// A 64-bit digest for map keys (ints as their value, bytes through XXH3-64).
    pub fn digest(&self) -> u64 {
        match self {
            ExtHash::Int(i) => xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()),
            ExtHash::Bytes(b) => xxhash_rust::xxh3::xxh3_64_with_seed(b, 1),
        }
    }
}

/// What one block's `extra_keys` entry of a vLLM 0.33 `BlockStored` says besides the adapter's
/// name: the request's cache salt (in block 0), and whether the block binds a multimodal input,
/// prompt embeddings or a value this decoder does not know (then no Dynamo hash names it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockExtraKeys {
    pub cache_salt: Option<String>,
    pub unhashable: bool,
}

/// One vLLM KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum VllmEvent {
    BlockStored {
        block_hashes: Vec<ExtHash>,
        parent_block_hash: Option<ExtHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        /// The LoRA adapter the blocks were computed with (vLLM 0.33's key of it).
        lora_name: Option<String>,
        /// Per block of `block_hashes`, what its `extra_keys` entry says (empty: none sent).
        extra_keys: Vec<BlockExtraKeys>,
    },
    BlockRemoved {
        block_hashes: Vec<ExtHash>,
        medium: Option<String>,
    },
    AllBlocksCleared,
}

/// One batch.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmBatch {
    pub ts: f64,
    pub events: Vec<VllmEvent>,
    pub dp_rank: Option<i64>,
}

/// How events are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `array_like=True` (vLLM's own).
    Tuple,
    /// Tagged maps (`{"type": ..., field: value}`).
    Map,
}

/// The `medium` string of a tier when we export (`GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`).
pub fn medium_of(tier: TierKind) -> &'static str {
    match tier {
        TierKind::G1Gpu => "GPU",
        TierKind::G2Host => "CPU_PINNED",
        TierKind::G3Disk => "DISK",
        TierKind::G4Object => "EXTERNAL",
    }
}

/// The tier of a `medium` string (absent = GPU). `None` for an unknown medium.
pub fn tier_of(medium: Option<&str>) -> Option<TierKind> {
    let Some(m) = medium else { return Some(TierKind::G1Gpu) };
    match m.to_ascii_uppercase().as_str() {
        "GPU" | "HBM" => Some(TierKind::G1Gpu),
        "CPU" | "CPU_PINNED" | "CPU_TIER" | "HOST" => Some(TierKind::G2Host),
        // STORAGE: vLLM 0.33's offloading tiers below its CPU tier (its file tier, kvcached's).
        "DISK" | "LOCAL_DISK" | "SSD" | "NVME" | "STORAGE" => Some(TierKind::G3Disk),
        "EXTERNAL" | "S3" | "OBJECT" | "REMOTE" => Some(TierKind::G4Object),
        _ => None,
    }
}

fn bad(what: impl Into<String>) -> ProtoError {
    ProtoError::Decode(what.into())
}

fn hash(v: &Value) -> Result<ExtHash, ProtoError> {
    match v {
        Value::Integer(i) => i
            .as_u64()
            .map(|u| ExtHash::Int(i128::from(u)))
            .or_else(|| i.as_i64().map(|s| ExtHash::Int(i128::from(s))))
            .ok_or_else(|| bad("hash integer out of range")),
        Value::Binary(b) => Ok(ExtHash::Bytes(b.clone())),
        other => Err(bad(format!("block hash must be int or bytes, got {other}"))),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<ExtHash>, ProtoError> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => Err(bad("block_hashes must be an array")),
    }
}

fn opt(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_nil())
}

/// A field of an event by name, in either encoding (`names`: the tuple order after the tag).
fn field<'a>(v: &'a Value, names: &[&str], f: &str) -> Option<&'a Value> {
    match v {
        Value::Array(a) => names.iter().position(|n| *n == f).and_then(|i| a.get(i + 1)),
        Value::Map(m) => m.iter().find(|(k, _)| k.as_str() == Some(f)).map(|(_, v)| v),
        _ => None,
    }
}

fn event(v: &Value) -> Result<VllmEvent, ProtoError> {
    const STORED: [&str; 8] = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ];
    const REMOVED: [&str; 2] = ["block_hashes", "medium"];
    let tag = match v {
        Value::Array(a) => {
            a.first().and_then(Value::as_str).ok_or_else(|| bad("event array must start with its tag"))?
        }
        Value::Map(_) => {
            field(v, &[], "type").and_then(Value::as_str).ok_or_else(|| bad("event map needs a \"type\" tag"))?
        }
        other => return Err(bad(format!("event must be an array or a map, got {other}"))),
    };
    let names: &[&str] = match tag {
        "BlockStored" => &STORED,
        "BlockRemoved" => &REMOVED,
        _ => &[],
    };
    let get = |f: &str| field(v, names, f);
    match tag {
        "BlockStored" => {
            let token_ids = match get("token_ids") {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|t| {
                        t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| bad("token id must be a u32"))
                    })
                    .collect::<Result<Vec<u32>, _>>()?,
                _ => return Err(bad("BlockStored.token_ids must be an array")),
            };
            let block_size = get("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or_else(|| bad("BlockStored.block_size must be an integer"))?;
            Ok(VllmEvent::BlockStored {
                block_hashes: hashes(get("block_hashes"))?,
                parent_block_hash: opt(get("parent_block_hash")).map(hash).transpose()?,
                token_ids,
                block_size,
                lora_id: opt(get("lora_id")).and_then(Value::as_i64),
                medium: opt(get("medium")).and_then(Value::as_str).map(str::to_string),
                lora_name: opt(get("lora_name")).and_then(Value::as_str).map(str::to_string),
                extra_keys: extra_keys(opt(get("extra_keys")), opt(get("lora_name")).and_then(Value::as_str))?,
            })
        }
        "BlockRemoved" => Ok(VllmEvent::BlockRemoved {
            block_hashes: hashes(get("block_hashes"))?,
            medium: opt(get("medium")).and_then(Value::as_str).map(str::to_string),
        }),
        "AllBlocksCleared" => Ok(VllmEvent::AllBlocksCleared),
        other => Err(bad(format!("unknown event type {other:?}"))),
    }
}

/// A `BlockStored`'s `extra_keys`: one entry per block, `None` or the values vLLM hashed into it,
/// untagged, in order: the adapter's name (when `lora_name` is set), `(mm_identifier, offset)`
/// pairs, the cache salt, prompt-embedding digests.
fn extra_keys(v: Option<&Value>, lora_name: Option<&str>) -> Result<Vec<BlockExtraKeys>, ProtoError> {
    let Some(v) = v else { return Ok(Vec::new()) };
    let Value::Array(blocks) = v else { return Err(bad("BlockStored.extra_keys must be an array")) };
    Ok(blocks
        .iter()
        .map(|b| {
            let mut out = BlockExtraKeys::default();
            let Value::Array(items) = b else {
                out.unhashable = !b.is_nil();
                return out;
            };
            let mut items = items.iter().peekable();
            if lora_name.is_some() && items.peek().and_then(|i| i.as_str()) == lora_name {
                items.next();
            }
            for item in items {
                match item.as_str() {
                    Some(s) if out.cache_salt.is_none() => out.cache_salt = Some(s.to_string()),
                    // An image's pair, an embeddings digest, anything else.
                    _ => out.unhashable = true,
                }
            }
            out
        })
        .collect())
}

/// Deepest msgpack nesting a batch may have. vLLM's are 4 deep (batch, events, event, hashes);
/// rmpv's own limit (1024) let a 1 KB payload of nested arrays overflow a 2 MiB thread stack
/// (found by `proto/tests/fuzz.rs`).
pub const MAX_DEPTH: usize = 16;

/// Decodes a msgpack `KVEventBatch` payload. Unknown event types fail the batch.
pub fn decode_batch(payload: &[u8]) -> Result<VllmBatch, ProtoError> {
    let v = rmpv::decode::read_value_with_max_depth(&mut Cursor::new(payload), MAX_DEPTH)
        .map_err(|e| bad(format!("msgpack: {e}")))?;
    let (ts, events, rank) = match &v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => {
            let f = |k: &str| m.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v);
            (f("ts"), f("events"), f("data_parallel_rank"))
        }
        _ => return Err(bad("batch must be an array or a map")),
    };
    let ts = ts.and_then(Value::as_f64).ok_or_else(|| bad("batch timestamp must be a number"))?;
    let events = match events {
        Some(Value::Array(a)) => a.iter().map(event).collect::<Result<Vec<_>, _>>()?,
        _ => return Err(bad("batch events must be an array")),
    };
    Ok(VllmBatch { ts, events, dp_rank: opt(rank).and_then(Value::as_i64) })
}

fn hash_value(h: &ExtHash) -> Value {
    match h {
        ExtHash::Int(i) => match (u64::try_from(*i), i64::try_from(*i)) {
            (Ok(u), _) => Value::from(u),
            (_, Ok(s)) => Value::from(s),
            _ => Value::Nil,
        },
        ExtHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn event_value(e: &VllmEvent, enc: Encoding) -> Value {
    let s = |x: &str| Value::from(x);
    let opt_str = |m: &Option<String>| m.as_deref().map_or(Value::Nil, Value::from);
    let (tag, fields): (&str, Vec<(&str, Value)>) = match e {
        VllmEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
        } => {
            let mut fields = vec![
                ("block_hashes", Value::Array(block_hashes.iter().map(hash_value).collect())),
                ("parent_block_hash", parent_block_hash.as_ref().map_or(Value::Nil, hash_value)),
                ("token_ids", Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect())),
                ("block_size", Value::from(*block_size)),
                ("lora_id", lora_id.map_or(Value::Nil, Value::from)),
                ("medium", opt_str(medium)),
            ];
            // vLLM 0.33's fields, written only when set (consumers of older vLLMs read six).
            if lora_name.is_some() || !extra_keys.is_empty() {
                fields.push(("lora_name", opt_str(lora_name)));
                let entry = |e: &BlockExtraKeys| {
                    let mut items: Vec<Value> = lora_name.iter().map(|l| Value::from(l.as_str())).collect();
                    items.extend(e.cache_salt.as_deref().map(Value::from));
                    if e.unhashable {
                        items.push(Value::Array(vec![Value::from("mm"), Value::from(0)]));
                    }
                    if items.is_empty() { Value::Nil } else { Value::Array(items) }
                };
                let keys = Value::Array(extra_keys.iter().map(entry).collect());
                fields.push(("extra_keys", if extra_keys.is_empty() { Value::Nil } else { keys }));
            }
            ("BlockStored", fields)
        }
        VllmEvent::BlockRemoved { block_hashes, medium } => (
            "BlockRemoved",
            vec![
                ("block_hashes", Value::Array(block_hashes.iter().map(hash_value).collect())),
                ("medium", opt_str(medium)),
            ],
        ),
        VllmEvent::AllBlocksCleared => ("AllBlocksCleared", vec![]),
    };
    match enc {
        Encoding::Tuple => {
            let mut a = vec![s(tag)];
            a.extend(fields.into_iter().map(|(_, v)| v));
            Value::Array(a)
        }
        Encoding::Map => {
            let mut m = vec![(s("type"), s(tag))];
            m.extend(fields.into_iter().map(|(k, v)| (s(k), v)));
            Value::Map(m)
        }
    }
}

/// Encodes a batch as msgpack (`[ts, [events], dp_rank]`, dp_rank omitted when `None`).
pub fn encode_batch(b: &VllmBatch, enc: Encoding) -> Vec<u8> {
    let mut top = vec![Value::F64(b.ts), Value::Array(b.events.iter().map(|e| event_value(e, enc)).collect())];
    if let Some(r) = b.dp_rank {
        top.push(Value::from(r));
    }
    let mut out = Vec::new();
    // Writing to a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &Value::Array(top));
    out
}

/// A `BlockStored` event of our own blocks for export: Dynamo XXH3-64 chained hashes (seed 1337)
/// of `token_ids` (whole blocks of `block_size`), chained from `parent_seq`, with `medium` set to
/// the tier.
pub fn stored_for_export(parent_seq: Option<u64>, token_ids: &[u32], block_size: u32, tier: TierKind) -> VllmEvent {
    let seed = crate::dynamo::DYNAMO_SEED;
    let bs = block_size.max(1) as usize;
    let mut parent = parent_seq;
    let mut hashes = vec![];
    for block in token_ids.chunks_exact(bs) {
        let h = crate::dynamo::chain(parent, crate::dynamo::local_block_hash(block, seed), seed);
        hashes.push(ExtHash::Int(i128::from(h)));
        parent = Some(h);
    }
    VllmEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent_seq.map(|p| ExtHash::Int(i128::from(p))),
        token_ids: token_ids[..token_ids.len() / bs * bs].to_vec(),
        block_size,
        lora_id: None,
        medium: Some(medium_of(tier).to_string()),
        lora_name: None,
        extra_keys: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> VllmBatch {
        VllmBatch {
            ts: 1.5,
            events: vec![
                VllmEvent::BlockStored {
                    block_hashes: vec![ExtHash::Int(-5), ExtHash::Bytes(vec![1, 2, 3])],
                    parent_block_hash: None,
                    token_ids: (0..8).collect(),
                    block_size: 4,
                    lora_id: Some(2),
                    medium: Some("GPU".into()),
                    lora_name: Some("sql".into()),
                    extra_keys: vec![
                        BlockExtraKeys { cache_salt: Some("tenant-a".into()), unhashable: false },
                        BlockExtraKeys { cache_salt: None, unhashable: true },
                    ],
                },
                VllmEvent::BlockRemoved { block_hashes: vec![ExtHash::Int(u64::MAX.into())], medium: None },
                VllmEvent::AllBlocksCleared,
            ],
            dp_rank: Some(1),
        }
    }

    #[test]
    fn both_encodings_round_trip() {
        for enc in [Encoding::Tuple, Encoding::Map] {
            assert_eq!(decode_batch(&encode_batch(&sample(), enc)).ok(), Some(sample()), "{enc:?}");
        }
    }

    #[test]
    fn trailing_defaults_may_be_omitted_and_garbage_is_rejected() {
        // ["BlockStored", hashes, parent, tokens, block_size] without lora_id and medium.
        let v = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![Value::Array(vec![
                Value::from("BlockStored"),
                Value::Array(vec![Value::from(7u64)]),
                Value::Nil,
                Value::Array((0..4u32).map(Value::from).collect()),
                Value::from(4u32),
            ])]),
        ]);
        let mut buf = vec![];
        rmpv::encode::write_value(&mut buf, &v).ok();
        let b = decode_batch(&buf).ok();
        assert!(matches!(&b, Some(VllmBatch { dp_rank: None, events, .. })
            if matches!(&events[0], VllmEvent::BlockStored { medium: None, lora_id: None, .. })));
        assert!(decode_batch(b"\xc1").is_err());
        assert!(
            decode_batch(&encode_batch(&VllmBatch { ts: 0.0, events: vec![], dp_rank: None }, Encoding::Tuple)).is_ok()
        );
    }

    #[test]
    fn export_uses_dynamo_hashes_and_tier_media() {
        let tokens: Vec<u32> = (0..10).collect();
        let VllmEvent::BlockStored { block_hashes, medium, token_ids, .. } =
            stored_for_export(None, &tokens, 4, TierKind::G3Disk)
        else {
            panic!("not stored")
        };
        let want = crate::dynamo::sequence_hashes(&tokens, 4, 1337);
        assert_eq!(block_hashes, want.iter().map(|h| ExtHash::Int(i128::from(*h))).collect::<Vec<_>>());
        assert_eq!(medium.as_deref(), Some("DISK"));
        assert_eq!(token_ids.len(), 8);
        for t in TierKind::ALL {
            assert_eq!(tier_of(Some(medium_of(t))), Some(t));
        }
        assert_eq!(tier_of(None), Some(TierKind::G1Gpu));
        assert_eq!(tier_of(Some("tape")), None);
        assert_eq!(tier_of(Some("STORAGE")), Some(TierKind::G3Disk));
    }
}
