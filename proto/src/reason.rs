//! Why the daemon refused a call, as a machine-readable detail beside the gRPC status: the
//! trailer [`METADATA_KEY`] carries one of [`Reason`]'s names. Clients act on it (re-register
//! after a daemon restart) instead of matching the message's text.

/// The gRPC metadata key of the reason.
pub const METADATA_KEY: &str = "kvcached-reason";

/// The reasons a client may act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The engine id is not registered with this daemon for this caller (a daemon restart, a
    /// missed heartbeat, or another uid's engine): register again.
    UnknownEngine,
    /// The load id is unknown or expired.
    UnknownOp,
    /// A limit was reached (engines, connections, pending loads, bytes in flight).
    LimitReached,
    /// Not served on this transport (e.g. engine calls over an unauthenticated TCP listener).
    WrongTransport,
    /// The caller's tenant may not read or write this namespace (another tenant's salt or
    /// blocks): use a salt of its own, or have the operator name it in `[[namespaces]]`.
    NotTrusted,
}

impl Reason {
    /// The value sent in [`METADATA_KEY`].
    pub fn name(self) -> &'static str {
        match self {
            Reason::UnknownEngine => "unknown-engine",
            Reason::UnknownOp => "unknown-op",
            Reason::LimitReached => "limit-reached",
            Reason::WrongTransport => "wrong-transport",
            Reason::NotTrusted => "not-trusted",
        }
    }

    /// The reason a metadata value names.
    pub fn from_name(s: &str) -> Option<Self> {
        [Reason::UnknownEngine, Reason::UnknownOp, Reason::LimitReached, Reason::WrongTransport, Reason::NotTrusted]
            .into_iter()
            .find(|r| r.name() == s)
    }
}
