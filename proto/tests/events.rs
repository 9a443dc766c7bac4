//! The event vocabulary: JSON shape, holder rules, and the publisher's bounded replay log.
#![allow(clippy::unwrap_used)]

use kvproto::events::{Event, EventBody, EventLog, Holder, NodeId, PublisherMessage, Replay, WorkerId, key_from_u64};
use kvproto::{BlockKey, NamespaceId, TierKind};

fn stored(n: u8) -> EventBody {
    EventBody::Stored {
        namespace: NamespaceId([7; 16]),
        parent: Some(BlockKey([n; 16])),
        keys: vec![BlockKey([n + 1; 16]), BlockKey([n + 2; 16])],
        tier: TierKind::G2Host,
        holder: Holder::Node(NodeId("node-a".into())),
    }
}

#[test]
fn stored_event_has_the_documented_json_shape() {
    let ev = Event { id: 5, body: stored(1) };
    let v = serde_json::to_value(&ev).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "id": 5, "type": "stored", "namespace": "07".repeat(16), "parent": "01".repeat(16),
            "keys": ["02".repeat(16), "03".repeat(16)], "tier": "g2", "holder": {"node": "node-a"}
        })
    );
    let back: Event = serde_json::from_value(v).unwrap();
    assert_eq!(back, ev);
}

#[test]
fn every_event_kind_round_trips_inside_a_message() {
    let mut msg = PublisherMessage::new("daemon-a", 42);
    msg.events = vec![
        Event { id: 1, body: stored(10) },
        Event {
            id: 2,
            body: EventBody::Removed {
                keys: vec![BlockKey([3; 16])],
                tier: TierKind::G1Gpu,
                holder: Holder::Worker(WorkerId("w0".into())),
            },
        },
        Event { id: 3, body: EventBody::Cleared { tier: TierKind::G4Object, holder: Holder::Cluster } },
    ];
    let text = serde_json::to_string(&msg).unwrap();
    assert!(text.contains(r#""holder":"cluster""#), "{text}");
    assert!(text.contains(r#""holder":{"worker":"w0"}"#), "{text}");
    let back: PublisherMessage = serde_json::from_str(&text).unwrap();
    assert_eq!(back, msg);
    // A bare heartbeat needs only the two envelope fields.
    let hb: PublisherMessage = serde_json::from_str(r#"{"publisher":"p","epoch":1}"#).unwrap();
    assert!(hb.events.is_empty() && hb.load.is_none() && hb.info.is_none());
}

#[test]
fn malformed_keys_and_tiers_are_rejected() {
    let bad_key = r#"{"id":1,"type":"removed","keys":["zz"],"tier":"g1","holder":{"worker":"w"}}"#;
    assert!(serde_json::from_str::<Event>(bad_key).is_err());
    let bad_tier = r#"{"id":1,"type":"cleared","tier":"g9","holder":"cluster"}"#;
    assert!(serde_json::from_str::<Event>(bad_tier).is_err());
}

#[test]
fn holders_fit_only_their_tiers() {
    let w = Holder::Worker(WorkerId("w".into()));
    let n = Holder::Node(NodeId("n".into()));
    assert!(w.fits(TierKind::G1Gpu) && !w.fits(TierKind::G2Host));
    assert!(n.fits(TierKind::G2Host) && n.fits(TierKind::G3Disk) && !n.fits(TierKind::G1Gpu));
    assert!(Holder::Cluster.fits(TierKind::G4Object) && !Holder::Cluster.fits(TierKind::G3Disk));
}

#[test]
fn event_log_numbers_replays_and_reports_when_it_no_longer_reaches_back() {
    let mut log = EventLog::new(9, 3);
    assert_eq!(log.last_id(), 0);
    assert_eq!(log.replay(0, 10), Replay::Events { epoch: 9, events: vec![] });
    for i in 0..5 {
        assert_eq!(log.push(stored(i)).id, u64::from(i) + 1);
    }
    assert_eq!(log.last_id(), 5);
    // Holds 3, 4, 5.
    match log.replay(2, 10) {
        Replay::Events { events, .. } => assert_eq!(events.iter().map(|e| e.id).collect::<Vec<_>>(), [3, 4, 5]),
        other => panic!("{other:?}"),
    }
    match log.replay(3, 1) {
        Replay::Events { events, .. } => assert_eq!(events.iter().map(|e| e.id).collect::<Vec<_>>(), [4]),
        other => panic!("{other:?}"),
    }
    assert_eq!(log.replay(5, 10), Replay::Events { epoch: 9, events: vec![] });
    assert_eq!(log.replay(1, 10), Replay::TooOld { epoch: 9, oldest: 3 });
    assert_eq!(log.replay(0, 10), Replay::TooOld { epoch: 9, oldest: 3 });
}

#[test]
fn dynamo_hashes_travel_in_the_low_half_of_a_key() {
    let k = key_from_u64(0x0102_0304_0506_0708);
    assert_eq!(k.low64(), 0x0102_0304_0506_0708);
    assert_eq!(&k.0[8..], &[0u8; 8]);
}
