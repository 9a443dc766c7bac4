//! [`Event`]'s decoder. Derived, an event with its body flattened into it (`{"id": 1, "type":
//! "stored", "keys": [...], ...}`) is read twice: serde first copies every field, each key
//! string included, into a generic tree to find `type`, then reads the body from that tree. A
//! router spends most of its time on a report decoding it, and a report is mostly keys: this
//! reads each field once, in any order, each key straight into its 16 bytes. Same form, same
//! errors for what is missing or malformed, unknown fields ignored (as derived).

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, de::Error};

use crate::events::{Event, EventBody, Holder, ser};
use crate::{BlockKey, NamespaceId, TierKind};

#[derive(Deserialize)]
struct Ns(#[serde(with = "ser::namespace_id")] NamespaceId);
#[derive(Deserialize)]
struct Parent(#[serde(with = "ser::opt_key")] Option<BlockKey>);
#[derive(Deserialize)]
struct Keys(#[serde(with = "ser::keys")] Vec<BlockKey>);
#[derive(Deserialize)]
struct Tier(#[serde(with = "ser::tier")] TierKind);

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum Field {
    Id,
    Type,
    Namespace,
    Parent,
    Keys,
    Tier,
    Holder,
    #[serde(other)]
    Other,
}

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = Event;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an event: id, type and its fields")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Event, A::Error> {
        let (mut id, mut kind, mut namespace, mut parent, mut keys, mut tier, mut holder) =
            (None, None, None, None, None, None, None);
        fn once<T, E: Error>(slot: &mut Option<T>, v: T, name: &'static str) -> Result<(), E> {
            match slot.replace(v) {
                Some(_) => Err(E::duplicate_field(name)),
                None => Ok(()),
            }
        }
        while let Some(f) = map.next_key::<Field>()? {
            match f {
                Field::Id => once(&mut id, map.next_value::<u64>()?, "id")?,
                Field::Type => once(&mut kind, map.next_value::<Kind>()?, "type")?,
                Field::Namespace => once(&mut namespace, map.next_value::<Ns>()?.0, "namespace")?,
                Field::Parent => once(&mut parent, map.next_value::<Parent>()?.0, "parent")?,
                Field::Keys => once(&mut keys, map.next_value::<Keys>()?.0, "keys")?,
                Field::Tier => once(&mut tier, map.next_value::<Tier>()?.0, "tier")?,
                Field::Holder => once(&mut holder, map.next_value::<Holder>()?, "holder")?,
                Field::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let missing = |name: &'static str| A::Error::missing_field(name);
        let id = id.ok_or_else(|| missing("id"))?;
        let tier = tier.ok_or_else(|| missing("tier"))?;
        let holder = holder.ok_or_else(|| missing("holder"))?;
        let body = match kind.ok_or_else(|| missing("type"))? {
            Kind::Stored => EventBody::Stored {
                namespace: namespace.ok_or_else(|| missing("namespace"))?,
                parent: parent.flatten(),
                keys: keys.ok_or_else(|| missing("keys"))?,
                tier,
                holder,
            },
            Kind::Removed => EventBody::Removed { keys: keys.ok_or_else(|| missing("keys"))?, tier, holder },
            Kind::Cleared => EventBody::Cleared { tier, holder },
        };
        Ok(Event { id, body })
    }
}

impl<'de> de::Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(EventVisitor)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::events::{Event, EventBody, Holder, NodeId, WorkerId};
    use crate::{BlockKey, NamespaceId, TierKind};

    fn events() -> Vec<Event> {
        let k = |b: u8| BlockKey([b; 16]);
        vec![
            Event {
                id: 1,
                body: EventBody::Stored {
                    namespace: NamespaceId([7; 16]),
                    parent: Some(k(1)),
                    keys: vec![k(2), k(3)],
                    tier: TierKind::G2Host,
                    holder: Holder::Node(NodeId("n".into())),
                },
            },
            Event {
                id: 2,
                body: EventBody::Stored {
                    namespace: NamespaceId([7; 16]),
                    parent: None,
                    keys: vec![],
                    tier: TierKind::G1Gpu,
                    holder: Holder::Worker(WorkerId("w".into())),
                },
            },
            Event {
                id: 3,
                body: EventBody::Removed { keys: vec![k(9)], tier: TierKind::G4Object, holder: Holder::Cluster },
            },
            Event {
                id: 4,
                body: EventBody::Cleared { tier: TierKind::G3Disk, holder: Holder::Node(NodeId("n".into())) },
            },
        ]
    }

    #[test]
    fn events_read_back_what_they_wrote() {
        for e in events() {
            let json = serde_json::to_string(&e).unwrap();
            assert_eq!(serde_json::from_str::<Event>(&json).unwrap(), e, "{json}");
        }
    }

    #[test]
    fn fields_in_any_order_unknown_ones_ignored_and_parent_optional() {
        let j = r#"{"holder":{"node":"n"},"keys":["09090909090909090909090909090909"],"extra":[1,{"a":2}],
                    "tier":"g4","type":"removed","id":3}"#;
        let e: Event = serde_json::from_str(j).unwrap();
        assert_eq!(e.id, 3);
        assert!(matches!(e.body, EventBody::Removed { ref keys, .. } if keys.len() == 1));
        let j = r#"{"id":5,"type":"stored","namespace":"07070707070707070707070707070707","keys":[],"tier":"g2","holder":{"node":"n"},"parent":null}"#;
        assert!(matches!(serde_json::from_str::<Event>(j).unwrap().body, EventBody::Stored { parent: None, .. }));
    }

    #[test]
    fn missing_duplicate_and_malformed_fields_are_refused() {
        for (j, why) in [
            (r#"{"type":"removed","keys":[],"tier":"g1","holder":{"worker":"w"}}"#, "missing field `id`"),
            (r#"{"id":1,"keys":[],"tier":"g1","holder":{"worker":"w"}}"#, "missing field `type`"),
            (r#"{"id":1,"type":"removed","tier":"g1","holder":{"worker":"w"}}"#, "missing field `keys`"),
            (r#"{"id":1,"type":"stored","keys":[],"tier":"g1","holder":{"worker":"w"}}"#, "missing field `namespace`"),
            (r#"{"id":1,"id":2,"type":"cleared","tier":"g1","holder":{"worker":"w"}}"#, "duplicate field `id`"),
            (r#"{"id":1,"type":"moved","tier":"g1","holder":{"worker":"w"}}"#, "unknown variant `moved`"),
            (r#"{"id":1,"type":"removed","keys":["zz"],"tier":"g1","holder":{"worker":"w"}}"#, "zz"),
            (r#"{"id":1,"type":"removed","keys":[7],"tier":"g1","holder":{"worker":"w"}}"#, "a block key"),
            (r#"{"id":1,"type":"cleared","tier":"g9","holder":{"worker":"w"}}"#, "g9"),
            (r#"[1,2]"#, "an event"),
        ] {
            let e = serde_json::from_str::<Event>(j).unwrap_err().to_string();
            assert!(e.contains(why), "{j}: {e}");
        }
    }
}
