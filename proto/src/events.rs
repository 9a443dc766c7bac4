//! Hit reports: what a publisher (a node daemon, or an engine's event stream translated by the
//! router) tells routers about the blocks it gained and lost, per tier, and its load.
//!
//! Everything here is plain data with a JSON form (serde), so it travels over HTTP today and can be
//! mapped onto gRPC messages later without changing meaning. The router's documentation
//! (`docs/router.md`, "What a daemon publishes") describes the protocol around these types.
//!
//! - [`Holder`]: who holds a copy. G1 blocks belong to one worker (engine instance), G2/G3 blocks
//!   to a node (usable by every worker on it), G4 blocks to the cluster.
//! - [`Event`]: `Stored` / `Removed` / `Cleared`, each with a per-publisher monotonic id
//!   (first event of an epoch is 1, no holes): a router that sees a hole knows it missed something.
//! - [`LoadReport`]: periodic load (running / waiting requests, free capacity per tier, KV
//!   utilisation of each engine).
//! - [`PublisherMessage`]: one delivery (the body of `POST /events`).
//! - [`EventLog`]: the publisher side's bounded log of recent events, which answers a router's
//!   replay request; [`Snapshot`] is the full-state answer when the log no longer reaches back.

use std::collections::VecDeque;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{BlockKey, NamespaceId, TierKind};

/// Version of the event vocabulary in this file. A router refuses (and reports) a publisher whose
/// version it does not know.
pub const EVENTS_VERSION: u32 = 1;

/// Name of the key scheme of kvcached's 128-bit chained keys ([`crate::BlockKey`], encoding
/// version [`crate::namespace::ENCODING_VERSION`]).
pub const KEY_SCHEME_KVCACHED: &str = "kvcached-blake3-v2";
/// Name of the key scheme of Dynamo / RFC-1527 XXH3-64 chained hashes (seed 1337), carried in the
/// low 8 bytes of a [`BlockKey`] (little-endian), high 8 bytes zero.
pub const KEY_SCHEME_DYNAMO_XXH3_1337: &str = "dynamo-xxh3-1337";
/// Name of the key scheme of SGLang's page hashes as kvcached keys them (`docs/block-keys.md`
/// section 7, scheme "sglang"): what SGLang engines with kvcached's HiCache backend, and vLLM
/// engines with `kvcached.key_scheme: "sglang"`, save requests without a key context under.
pub const KEY_SCHEME_SGLANG_PAGES: &str = "sglang-pages-v1";

/// A 64-bit Dynamo sequence hash carried as a [`BlockKey`] (see [`KEY_SCHEME_DYNAMO_XXH3_1337`]).
pub fn key_from_u64(hash: u64) -> BlockKey {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&hash.to_le_bytes());
    BlockKey(b)
}

/// An engine instance a request can be sent to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerId(pub String);

/// A machine with one daemon (its G2 and G3 tiers are shared by every worker on it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub String);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Who holds a copy of a block.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Holder {
    /// One engine's GPU memory (G1).
    Worker(WorkerId),
    /// One node's daemon (G2, G3): usable by every worker on that node.
    Node(NodeId),
    /// The cluster's object store (G4): usable by every worker.
    Cluster,
}

impl Holder {
    /// Whether this holder can hold blocks of `tier` (G1: worker, G2/G3: node, G4: cluster).
    pub fn fits(&self, tier: TierKind) -> bool {
        matches!(
            (self, tier),
            (Holder::Worker(_), TierKind::G1Gpu)
                | (Holder::Node(_), TierKind::G2Host | TierKind::G3Disk)
                | (Holder::Cluster, TierKind::G4Object)
        )
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Worker(w) => write!(f, "worker:{w}"),
            Holder::Node(n) => write!(f, "node:{n}"),
            Holder::Cluster => f.write_str("cluster"),
        }
    }
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventBody {
    /// `keys` (a chain: each the child of the previous, the first the child of `parent`) are now
    /// held in `tier` by `holder`.
    Stored {
        #[serde(with = "ser::namespace_id")]
        namespace: NamespaceId,
        #[serde(with = "ser::opt_key", default)]
        parent: Option<BlockKey>,
        #[serde(with = "ser::keys")]
        keys: Vec<BlockKey>,
        #[serde(with = "ser::tier")]
        tier: TierKind,
        holder: Holder,
    },
    /// `keys` are no longer held in `tier` by `holder`.
    Removed {
        #[serde(with = "ser::keys")]
        keys: Vec<BlockKey>,
        #[serde(with = "ser::tier")]
        tier: TierKind,
        holder: Holder,
    },
    /// `holder` holds nothing in `tier` any more.
    Cleared {
        #[serde(with = "ser::tier")]
        tier: TierKind,
        holder: Holder,
    },
}

/// One event with its publisher-local id (1, 2, 3, ... within an epoch). Its body's fields sit
/// beside `id` (flattened); read by `event_de.rs`, which reads each field once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub id: u64,
    #[serde(flatten)]
    pub body: EventBody,
}

/// Free and total capacity of one tier, in blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierCapacity {
    #[serde(with = "ser::tier")]
    pub tier: TierKind,
    pub free_blocks: u64,
    pub total_blocks: u64,
}

/// Load of one engine (worker).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineLoad {
    pub worker: WorkerId,
    /// Requests being computed.
    pub running: u32,
    /// Requests queued.
    pub waiting: u32,
    /// KV blocks in use in the engine's GPU memory (its decode load).
    pub kv_used_blocks: u64,
    /// KV blocks the engine has in total.
    pub kv_total_blocks: u64,
    /// Prefill tokens the engine computes per second (a moving average of what it reported);
    /// absent until it reports any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_s: Option<f64>,
}

impl EngineLoad {
    /// `kv_used_blocks / kv_total_blocks` (0 when the total is unknown).
    pub fn kv_utilisation(&self) -> f64 {
        if self.kv_total_blocks == 0 { 0.0 } else { self.kv_used_blocks as f64 / self.kv_total_blocks as f64 }
    }
}

/// A periodic load report of a publisher.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct LoadReport {
    /// Per tier of the publisher's node (and G4 if it sees it).
    #[serde(default)]
    pub tiers: Vec<TierCapacity>,
    /// Per attached engine.
    #[serde(default)]
    pub engines: Vec<EngineLoad>,
    /// Links to peer daemons this publisher has pulled from, as measured.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub links: Vec<LinkReport>,
}

/// The measured throughput of the link from a peer daemon to the reporting one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkReport {
    /// The peer's `peer_url` (as its own [`PublisherInfo`] gives it).
    pub peer: String,
    /// Bytes a second, a moving average of real transfers and idle probes.
    pub bytes_per_s: f64,
    /// Transfers and probes averaged.
    pub samples: u64,
}

/// An engine attached to a publisher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    pub id: WorkerId,
    /// Where a router sends this worker's requests (e.g. `http://10.0.0.5:8000`).
    #[serde(default)]
    pub address: String,
    /// Free-form role for candidate restriction (`prefill`, `decode`, ...).
    #[serde(default)]
    pub role: Option<String>,
}

/// A namespace a publisher stores blocks of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInfo {
    #[serde(with = "ser::namespace_id")]
    pub id: NamespaceId,
    pub model_id: String,
    pub tokens_per_block: u32,
    /// [`KEY_SCHEME_KVCACHED`] or [`KEY_SCHEME_DYNAMO_XXH3_1337`].
    pub key_scheme: String,
}

/// Who a publisher is. Sent with its first message of an epoch and whenever it changes (sending
/// it with every message is allowed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublisherInfo {
    /// The node whose G2/G3 this publisher reports.
    pub node: NodeId,
    #[serde(default)]
    pub workers: Vec<WorkerInfo>,
    #[serde(default)]
    pub namespaces: Vec<NamespaceInfo>,
    /// [`EVENTS_VERSION`] of the publisher.
    pub events_version: u32,
    /// How often the publisher sends a [`LoadReport`] (or, with nothing else to say, an empty
    /// message): a router treats a publisher silent for several intervals as stale.
    pub report_interval_ms: u64,
    /// Base URL of the publisher's recovery API (`GET {url}/events/replay?after=N`,
    /// `GET {url}/events/snapshot`), if it has one.
    #[serde(default)]
    pub recovery_url: Option<String>,
    /// `host:port` of the publisher's peer channel (where other daemons pull its blocks), if it
    /// serves one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_url: Option<String>,
}

/// What a routed request actually found (the daemon reports it; the router compares it with its
/// prediction).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteOutcome {
    /// The `route_id` the router returned.
    pub route_id: u64,
    pub worker: WorkerId,
    /// Prefix blocks found, per tier (index = [`TierKind::index`]), i.e. `[g1, g2, g3, g4]`.
    pub found_blocks: [u32; 4],
}

/// One delivery from a publisher (the JSON body of the router's `POST /events`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublisherMessage {
    /// Stable name of the publisher (e.g. the node's daemon), unique in the cluster.
    pub publisher: String,
    /// Incarnation: changes whenever the publisher restarts (its event ids restart at 1).
    pub epoch: u64,
    #[serde(default)]
    pub info: Option<PublisherInfo>,
    /// Consecutive events, ascending ids.
    #[serde(default)]
    pub events: Vec<Event>,
    /// Id of the newest event the publisher had assigned when it sent this message (it may be
    /// beyond the last one carried). Lets a router detect lost events even when nothing follows
    /// them; heartbeats should carry it.
    #[serde(default)]
    pub last_event_id: Option<u64>,
    #[serde(default)]
    pub load: Option<LoadReport>,
    #[serde(default)]
    pub outcomes: Vec<RouteOutcome>,
}

impl PublisherMessage {
    /// An empty message (a heartbeat).
    pub fn new(publisher: impl Into<String>, epoch: u64) -> Self {
        Self {
            publisher: publisher.into(),
            epoch,
            info: None,
            events: Vec::new(),
            last_event_id: None,
            load: None,
            outcomes: Vec::new(),
        }
    }
}

/// One held chain in a [`Snapshot`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEntry {
    #[serde(with = "ser::namespace_id")]
    pub namespace: NamespaceId,
    #[serde(with = "ser::tier")]
    pub tier: TierKind,
    pub holder: Holder,
    #[serde(with = "ser::keys")]
    pub keys: Vec<BlockKey>,
}

/// The publisher's whole state as of event `last_event_id` (every later event applies on top).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub epoch: u64,
    pub last_event_id: u64,
    pub entries: Vec<SnapshotEntry>,
}

/// Answer to a replay request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Replay {
    /// Every event after the requested id, up to the newest the log holds.
    Events { epoch: u64, events: Vec<Event> },
    /// The log no longer reaches back (its oldest event is `oldest`): ask for a snapshot.
    TooOld { epoch: u64, oldest: u64 },
}

/// A publisher's bounded log of its most recent events. `push` assigns ids 1, 2, 3, ...;
/// `replay(after)` answers a router that missed events after `after`.
#[derive(Debug)]
pub struct EventLog {
    epoch: u64,
    capacity: usize,
    next_id: u64,
    events: VecDeque<Event>,
}

impl EventLog {
    /// A log that keeps the last `capacity` events (at least 1) of epoch `epoch`.
    pub fn new(epoch: u64, capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self { epoch, capacity, next_id: 1, events: VecDeque::with_capacity(capacity.min(4096)) }
    }

    /// The epoch the ids belong to.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Id of the newest event (0 before the first).
    pub fn last_id(&self) -> u64 {
        self.next_id - 1
    }

    /// Assigns the next id to `body`, keeps it (dropping the oldest beyond capacity) and returns it.
    pub fn push(&mut self, body: EventBody) -> Event {
        let ev = Event { id: self.next_id, body };
        self.next_id += 1;
        if self.events.len() == self.capacity {
            self.events.pop_front();
        }
        self.events.push_back(ev.clone());
        ev
    }

    /// Events with id > `after` (at most `limit`), or [`Replay::TooOld`] when some were dropped.
    pub fn replay(&self, after: u64, limit: usize) -> Replay {
        let oldest = self.events.front().map_or(self.next_id, |e| e.id);
        if after.saturating_add(1) < oldest {
            return Replay::TooOld { epoch: self.epoch, oldest };
        }
        let skip = (after + 1).saturating_sub(oldest) as usize;
        Replay::Events { epoch: self.epoch, events: self.events.iter().skip(skip).take(limit).cloned().collect() }
    }
}

/// Serde helpers: keys and namespace ids as lowercase hex strings, tiers as `g1`..`g4`.
pub mod ser {
    /// `TierKind` as `"g1"`..`"g4"`.
    pub mod tier {
        use serde::{Deserialize, Deserializer, Serializer, de::Error};

        use crate::TierKind;

        pub fn serialize<S: Serializer>(t: &TierKind, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(t.label())
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TierKind, D::Error> {
            let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
            parse(&s).ok_or_else(|| D::Error::custom(format!("unknown tier {s:?} (expected g1..g4)")))
        }
        /// Parses `g1`..`g4` (case-insensitive).
        pub fn parse(s: &str) -> Option<TierKind> {
            TierKind::ALL.into_iter().find(|t| t.label().eq_ignore_ascii_case(s))
        }
    }

    /// `NamespaceId` as 32 hex digits.
    pub mod namespace_id {
        use serde::{Deserialize, Deserializer, Serializer, de::Error};

        use crate::NamespaceId;

        pub fn serialize<S: Serializer>(id: &NamespaceId, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_str(&hex::encode(id.0))
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<NamespaceId, D::Error> {
            let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
            let mut out = [0u8; 16];
            hex::decode_to_slice(s.as_ref(), &mut out)
                .map_err(|_| D::Error::custom(format!("invalid namespace id {s:?}: expected 32 hex digits")))?;
            Ok(NamespaceId(out))
        }
    }

    /// `Vec<BlockKey>` as hex strings.
    pub mod keys {
        use serde::ser::SerializeSeq;
        use serde::{Deserialize, Deserializer, Serializer, de::Error};

        use crate::BlockKey;

        pub fn serialize<S: Serializer>(keys: &[BlockKey], s: S) -> Result<S::Ok, S::Error> {
            let mut seq = s.serialize_seq(Some(keys.len()))?;
            let mut buf = [0u8; 32];
            for k in keys {
                // 16 bytes always fit 32 hex digits, which are ASCII.
                hex::encode_to_slice(k.0, &mut buf).map_err(serde::ser::Error::custom)?;
                seq.serialize_element(std::str::from_utf8(&buf).map_err(serde::ser::Error::custom)?)?;
            }
            seq.end()
        }
        /// Each key decoded as it is read: no string or list in between (messages carry
        /// thousands of keys; this is most of a router's work on them).
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<BlockKey>, D::Error> {
            d.deserialize_seq(KeysVisitor)
        }

        struct KeysVisitor;

        /// One key, decoded from the string the deserializer lends (or owns).
        struct Key(BlockKey);

        impl<'de> Deserialize<'de> for Key {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl serde::de::Visitor<'_> for V {
                    type Value = Key;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a block key: 32 hex digits")
                    }
                    fn visit_str<E: Error>(self, s: &str) -> Result<Key, E> {
                        s.parse::<BlockKey>().map(Key).map_err(E::custom)
                    }
                }
                d.deserialize_str(V)
            }
        }

        impl<'de> serde::de::Visitor<'de> for KeysVisitor {
            type Value = Vec<BlockKey>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of block keys")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<BlockKey>, A::Error> {
                // The hint is the sender's word: bounded, so that a hostile one cannot make a
                // large allocation with a short list.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(Key(k)) = seq.next_element()? {
                    out.push(k);
                }
                Ok(out)
            }
        }
    }

    /// `Option<BlockKey>` as a hex string or null.
    pub mod opt_key {
        use serde::{Deserialize, Deserializer, Serializer, de::Error};

        use crate::BlockKey;

        pub fn serialize<S: Serializer>(k: &Option<BlockKey>, s: S) -> Result<S::Ok, S::Error> {
            match k {
                Some(k) => s.serialize_str(&hex::encode(k.0)),
                None => s.serialize_none(),
            }
        }
        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BlockKey>, D::Error> {
            let v = <Option<std::borrow::Cow<'de, str>>>::deserialize(d)?;
            v.map(|s| s.parse::<BlockKey>().map_err(D::Error::custom)).transpose()
        }
    }
}
