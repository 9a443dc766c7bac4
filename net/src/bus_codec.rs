//! A [`PublisherMessage`] in binary, for the NATS event plane: keys as their 16 bytes rather
//! than 32 hex digits in JSON strings. A router decodes a report's keys with a copy each instead
//! of a string scan and a hex parse each (most of its work on a report), and the stream holds
//! about half the bytes. Everything but the events (publisher, epoch, info, load, outcomes) stays
//! JSON, in a header part: it is small and changes with the vocabulary.
//!
//! ```text
//! "KVE1" | u32 header length | header: the message's JSON without its events
//!        | u32 event count | events
//! event: u64 id | u8 kind (0 stored, 1 removed, 2 cleared) | u8 tier (0..3 = g1..g4)
//!        | holder: u8 (0 worker, 1 node, 2 cluster) [u16 length | UTF-8 name]
//!        | stored: 16-byte namespace | u8 has parent [16-byte parent]
//!        | stored, removed: u32 key count | 16 bytes a key
//! ```
//!
//! Integers little-endian. A payload that does not start with the magic is JSON. Every count
//! and length is checked against the bytes left before anything is allocated for it, so a
//! hostile payload costs at most its own size; a short or malformed one is an error, never a
//! panic.

use kvproto::events::{Event, EventBody, Holder, NodeId, PublisherMessage, WorkerId};
use kvproto::{BlockKey, NamespaceId, TierKind};

/// What is wrong with a report that cannot be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(String);

/// The first bytes of a binary report.
pub const MAGIC: &[u8; 4] = b"KVE1";

/// Whether `payload` is a binary report (else it is JSON).
pub fn is_binary(payload: &[u8]) -> bool {
    payload.starts_with(MAGIC)
}

/// `m` in binary.
pub fn encode(m: &PublisherMessage) -> Result<Vec<u8>, CodecError> {
    let header = PublisherMessage {
        publisher: m.publisher.clone(),
        epoch: m.epoch,
        info: m.info.clone(),
        events: Vec::new(),
        last_event_id: m.last_event_id,
        load: m.load.clone(),
        outcomes: m.outcomes.clone(),
    };
    let head = serde_json::to_vec(&header).map_err(|e| CodecError(format!("report header: {e}")))?;
    let keys: usize = m.events.iter().map(|e| keys_of(&e.body).map_or(0, <[BlockKey]>::len)).sum();
    let mut out = Vec::with_capacity(4 + 4 + head.len() + 4 + m.events.len() * 64 + keys * 16);
    out.extend_from_slice(MAGIC);
    put_len(&mut out, head.len())?;
    out.extend_from_slice(&head);
    put_len(&mut out, m.events.len())?;
    for e in &m.events {
        out.extend_from_slice(&e.id.to_le_bytes());
        let (kind, tier, holder) = match &e.body {
            EventBody::Stored { tier, holder, .. } => (0u8, tier, holder),
            EventBody::Removed { tier, holder, .. } => (1, tier, holder),
            EventBody::Cleared { tier, holder } => (2, tier, holder),
        };
        out.push(kind);
        out.push(tier.index() as u8);
        match holder {
            Holder::Worker(w) => put_name(&mut out, 0, &w.0)?,
            Holder::Node(n) => put_name(&mut out, 1, &n.0)?,
            Holder::Cluster => out.push(2),
        }
        if let EventBody::Stored { namespace, parent, .. } = &e.body {
            out.extend_from_slice(&namespace.0);
            match parent {
                Some(p) => {
                    out.push(1);
                    out.extend_from_slice(&p.0);
                }
                None => out.push(0),
            }
        }
        if let Some(keys) = keys_of(&e.body) {
            put_len(&mut out, keys.len())?;
            for k in keys {
                out.extend_from_slice(&k.0);
            }
        }
    }
    Ok(out)
}

fn keys_of(b: &EventBody) -> Option<&[BlockKey]> {
    match b {
        EventBody::Stored { keys, .. } | EventBody::Removed { keys, .. } => Some(keys),
        EventBody::Cleared { .. } => None,
    }
}

fn put_len(out: &mut Vec<u8>, n: usize) -> Result<(), CodecError> {
    let n = u32::try_from(n).map_err(|_| CodecError(format!("report part of {n} items or bytes")))?;
    out.extend_from_slice(&n.to_le_bytes());
    Ok(())
}

fn put_name(out: &mut Vec<u8>, tag: u8, name: &str) -> Result<(), CodecError> {
    let n = u16::try_from(name.len()).map_err(|_| CodecError(format!("holder name of {} bytes", name.len())))?;
    out.push(tag);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(name.as_bytes());
    Ok(())
}

/// Reads a binary report.
struct Reader<'a> {
    b: &'a [u8],
}

fn short(what: &str) -> CodecError {
    CodecError(format!("binary report ends inside {what}"))
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], CodecError> {
        if self.b.len() < n {
            return Err(short(what));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], CodecError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8, CodecError> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<usize, CodecError> {
        Ok(u32::from_le_bytes(self.array(what)?) as usize)
    }
    fn name(&mut self) -> Result<String, CodecError> {
        let n = u16::from_le_bytes(self.array("a holder name")?) as usize;
        let b = self.take(n, "a holder name")?;
        String::from_utf8(b.to_vec()).map_err(|_| CodecError("holder name is not UTF-8".into()))
    }
}

/// A binary report back as the message it was.
pub fn decode(payload: &[u8]) -> Result<PublisherMessage, CodecError> {
    let mut r = Reader { b: payload };
    if r.take(4, "its magic")? != MAGIC {
        return Err(CodecError("not a binary report (no KVE1 magic)".into()));
    }
    let n = r.u32("the header length")?;
    let head = r.take(n, "the header")?;
    let mut m: PublisherMessage =
        serde_json::from_slice(head).map_err(|e| CodecError(format!("report header: {e}")))?;
    let count = r.u32("the event count")?;
    // The smallest event is 11 bytes: no more events than the bytes left allow.
    if count > r.b.len() / 11 {
        return Err(short("its events"));
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        let id = u64::from_le_bytes(r.array("an event id")?);
        let kind = r.u8("an event kind")?;
        let tier =
            *TierKind::ALL.get(r.u8("a tier")? as usize).ok_or_else(|| CodecError("tier out of range".into()))?;
        let holder = match r.u8("a holder")? {
            0 => Holder::Worker(WorkerId(r.name()?)),
            1 => Holder::Node(NodeId(r.name()?)),
            2 => Holder::Cluster,
            t => return Err(CodecError(format!("holder kind {t}"))),
        };
        let body = match kind {
            0 => {
                let namespace = NamespaceId(r.array("a namespace")?);
                let parent = match r.u8("a parent flag")? {
                    0 => None,
                    1 => Some(BlockKey(r.array("a parent")?)),
                    f => return Err(CodecError(format!("parent flag {f}"))),
                };
                EventBody::Stored { namespace, parent, keys: keys(&mut r)?, tier, holder }
            }
            1 => EventBody::Removed { keys: keys(&mut r)?, tier, holder },
            2 => EventBody::Cleared { tier, holder },
            k => return Err(CodecError(format!("event kind {k}"))),
        };
        events.push(Event { id, body });
    }
    if !r.b.is_empty() {
        return Err(CodecError(format!("{} bytes after the last event", r.b.len())));
    }
    m.events = events;
    Ok(m)
}

fn keys(r: &mut Reader<'_>) -> Result<Vec<BlockKey>, CodecError> {
    let n = r.u32("a key count")?;
    let bytes = r.take(n.checked_mul(16).ok_or_else(|| short("its keys"))?, "its keys")?;
    Ok(bytes.chunks_exact(16).map(|c| BlockKey(c.try_into().unwrap_or([0; 16]))).collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn message() -> PublisherMessage {
        let k = |b: u8| BlockKey([b; 16]);
        let mut m = PublisherMessage::new("kvcached@node-a", 7);
        m.last_event_id = Some(4);
        m.events = vec![
            Event {
                id: 1,
                body: EventBody::Stored {
                    namespace: NamespaceId([3; 16]),
                    parent: Some(k(1)),
                    keys: vec![k(2), k(3)],
                    tier: TierKind::G2Host,
                    holder: Holder::Node(NodeId("node-a".into())),
                },
            },
            Event {
                id: 2,
                body: EventBody::Stored {
                    namespace: NamespaceId([3; 16]),
                    parent: None,
                    keys: vec![],
                    tier: TierKind::G1Gpu,
                    holder: Holder::Worker(WorkerId("node-a/gpu0".into())),
                },
            },
            Event {
                id: 3,
                body: EventBody::Removed { keys: vec![k(9)], tier: TierKind::G4Object, holder: Holder::Cluster },
            },
            Event {
                id: 4,
                body: EventBody::Cleared { tier: TierKind::G3Disk, holder: Holder::Node(NodeId("node-a".into())) },
            },
        ];
        m
    }

    #[test]
    fn a_report_reads_back_what_was_written_and_is_smaller_than_its_json() {
        let m = message();
        let b = encode(&m).unwrap();
        assert!(is_binary(&b) && !is_binary(&serde_json::to_vec(&m).unwrap()));
        assert_eq!(decode(&b).unwrap(), m);
        let mut big = PublisherMessage::new("p", 1);
        big.events = vec![Event {
            id: 1,
            body: EventBody::Removed {
                keys: (0..1000u32).map(|i| kvproto::events::key_from_u64(u64::from(i))).collect(),
                tier: TierKind::G2Host,
                holder: Holder::Node(NodeId("n".into())),
            },
        }];
        let (bin, json) = (encode(&big).unwrap().len(), serde_json::to_vec(&big).unwrap().len());
        assert!(bin * 2 < json, "{bin} bytes against JSON's {json}");
    }

    #[test]
    fn every_truncation_and_a_trailing_byte_are_errors_not_panics() {
        let b = encode(&message()).unwrap();
        for n in 0..b.len() {
            assert!(decode(&b[..n]).is_err(), "a report cut at {n} of {} bytes decoded", b.len());
        }
        let mut more = b.clone();
        more.push(0);
        assert!(decode(&more).unwrap_err().to_string().contains("after the last event"));
    }

    #[test]
    fn hostile_counts_and_codes_are_refused_before_allocating() {
        let mut b = MAGIC.to_vec();
        let head = serde_json::to_vec(&PublisherMessage::new("p", 1)).unwrap();
        b.extend_from_slice(&(head.len() as u32).to_le_bytes());
        b.extend_from_slice(&head);
        // Four billion events in a few bytes.
        let mut huge = b.clone();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&[0; 32]);
        assert!(decode(&huge).unwrap_err().to_string().contains("ends inside its events"));
        // One removal claiming four billion keys.
        let mut keys = b.clone();
        keys.extend_from_slice(&1u32.to_le_bytes());
        keys.extend_from_slice(&1u64.to_le_bytes());
        keys.extend_from_slice(&[1, 1, 2]);
        keys.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&keys).unwrap_err().to_string().contains("ends inside its keys"));
        for (at, bad, why) in [(8, 9u8, "event kind 9"), (9, 7, "tier out of range"), (10, 5, "holder kind 5")] {
            let mut e = b.clone();
            e.extend_from_slice(&1u32.to_le_bytes());
            let mut ev = vec![0u8; 8];
            ev.extend_from_slice(&[2, 1, 2]);
            ev.extend_from_slice(&[0; 8]);
            ev[at] = bad;
            e.extend_from_slice(&ev);
            let err = decode(&e).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
        assert!(decode(b"{\"publisher\":1}").unwrap_err().to_string().contains("no KVE1 magic"));
    }
}
