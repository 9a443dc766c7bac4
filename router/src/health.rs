//! "Never fail silently": the conditions that make the router degraded, a log line on every change
//! of state, and the counters behind the `kvrouter_*` metrics ([`crate::metrics`] renders them).

use std::collections::BTreeMap;
use std::time::Instant;

use serde::Serialize;

/// The kinds of condition that degrade the router (docs/router.md, "Health signals").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConditionKind {
    /// A worker's publisher has been silent longer than its report interval says it should.
    StaleWorker,
    /// Event ids skipped and the missing events could not be recovered.
    UnrecoveredGap,
    /// A request's namespace is not served by any worker, though workers serve other namespaces.
    NamespaceMismatch,
    /// A worker serves the request's model with a different block size.
    BlockSizeMismatch,
    /// A publisher speaks a key scheme or event version the router does not know, or the same
    /// model under a different key scheme than the request.
    KeySchemeMismatch,
    /// A worker's predicted hits differ from the hits it reports.
    PredictionError,
    /// The NATS event plane cannot be read (no connection, no stream, a consumer failing).
    EventBus,
}

impl ConditionKind {
    /// Label used in metrics and `/healthz`.
    pub fn label(self) -> &'static str {
        match self {
            Self::StaleWorker => "stale_worker",
            Self::UnrecoveredGap => "unrecovered_gap",
            Self::NamespaceMismatch => "namespace_mismatch",
            Self::BlockSizeMismatch => "block_size_mismatch",
            Self::KeySchemeMismatch => "key_scheme_mismatch",
            Self::PredictionError => "prediction_error",
            Self::EventBus => "event_bus",
        }
    }
    /// Every kind.
    pub const ALL: [ConditionKind; 7] = [
        Self::StaleWorker,
        Self::UnrecoveredGap,
        Self::NamespaceMismatch,
        Self::BlockSizeMismatch,
        Self::KeySchemeMismatch,
        Self::PredictionError,
        Self::EventBus,
    ];
}

/// One active condition.
#[derive(Debug, Clone, Serialize)]
pub struct Condition {
    pub kind: ConditionKind,
    /// The worker, publisher or namespace it is about.
    pub subject: String,
    pub reason: String,
    #[serde(skip)]
    pub since: Instant,
    /// Last time the condition was (re)asserted.
    #[serde(skip)]
    pub last: Instant,
}

/// The set of active conditions.
#[derive(Debug, Default)]
pub struct Health {
    active: BTreeMap<(ConditionKind, String), Condition>,
    transitions: u64,
}

impl Health {
    /// Asserts a condition; logs once when it starts.
    pub fn set(&mut self, kind: ConditionKind, subject: &str, reason: String, now: Instant) {
        match self.active.get_mut(&(kind, subject.to_string())) {
            Some(c) => {
                c.last = now;
                c.reason = reason;
            }
            None => {
                tracing::warn!(condition = kind.label(), subject, %reason, "kvrouter degraded");
                self.transitions += 1;
                self.active.insert(
                    (kind, subject.to_string()),
                    Condition { kind, subject: subject.to_string(), reason, since: now, last: now },
                );
            }
        }
    }

    /// Clears a condition; logs once when it ends.
    pub fn clear(&mut self, kind: ConditionKind, subject: &str) {
        if let Some(c) = self.active.remove(&(kind, subject.to_string())) {
            self.transitions += 1;
            tracing::info!(
                condition = kind.label(),
                subject,
                after_s = c.since.elapsed().as_secs_f64(),
                "kvrouter condition cleared"
            );
        }
    }

    /// Clears conditions of `kind` not re-asserted for `hold` (for conditions that are observed
    /// per request rather than tracked as a state).
    pub fn expire(&mut self, kind: ConditionKind, hold: std::time::Duration, now: Instant) {
        self.expire_if(kind, hold, now, |_| true);
    }

    /// [`Health::expire`] for the subjects `expires` accepts.
    pub fn expire_if(
        &mut self,
        kind: ConditionKind,
        hold: std::time::Duration,
        now: Instant,
        expires: impl Fn(&str) -> bool,
    ) {
        let old: Vec<String> = self
            .active
            .values()
            .filter(|c| c.kind == kind && now.duration_since(c.last) >= hold && expires(&c.subject))
            .map(|c| c.subject.clone())
            .collect();
        for s in old {
            self.clear(kind, &s);
        }
    }

    /// Whether `kind` is active for `subject`.
    pub fn is_set(&self, kind: ConditionKind, subject: &str) -> bool {
        self.active.contains_key(&(kind, subject.to_string()))
    }

    /// Active conditions, in a stable order.
    pub fn conditions(&self) -> Vec<Condition> {
        self.active.values().cloned().collect()
    }

    /// Number of active conditions of `kind`.
    pub fn count(&self, kind: ConditionKind) -> usize {
        self.active.keys().filter(|(k, _)| *k == kind).count()
    }

    /// True when no condition is active.
    pub fn healthy(&self) -> bool {
        self.active.is_empty()
    }

    /// Times a condition started or ended.
    pub fn transitions(&self) -> u64 {
        self.transitions
    }
}

/// Monotonic counters (under the router's lock).
#[derive(Debug, Default)]
pub struct Counters {
    pub routes: u64,
    pub route_errors: u64,
    pub events: BTreeMap<String, u64>,
    pub duplicate_events: BTreeMap<String, u64>,
    pub invalid_events: BTreeMap<String, u64>,
    pub gaps: BTreeMap<String, u64>,
    pub recoveries: BTreeMap<(String, &'static str), u64>,
    pub recovery_failures: BTreeMap<String, u64>,
    pub mismatches: BTreeMap<&'static str, u64>,
    pub dropped_holders: u64,
    pub dropped_facts: u64,
    pub outcomes: u64,
    pub outcomes_unknown: u64,
    pub vllm_batches: BTreeMap<String, u64>,
    pub vllm_orphan_blocks: BTreeMap<String, u64>,
    pub vllm_source_failures: BTreeMap<String, u64>,
    /// The NATS event plane's consumer.
    pub bus: BusCounters,
}

/// What a replica's consumer of the NATS event stream has seen (`crate::nats`) (rendered as `kvrouter_bus_*`).
#[derive(Debug, Default, Clone)]
pub struct BusCounters {
    /// Messages applied.
    pub messages: u64,
    /// Messages refused: not a publisher message, or naming another node than their subject.
    pub refused: u64,
    /// Messages the server dropped because the client's buffer was full (slow consumer).
    pub dropped: u64,
    /// Messages in the stream this replica has not read yet.
    pub pending: u64,
    /// Stream sequence of the last message applied.
    pub last_sequence: u64,
    /// Consumers created (the first, and one per resumption after an error).
    pub consumers: u64,
}

/// Adds 1 to a labelled counter.
pub fn bump<K: Ord>(m: &mut BTreeMap<K, u64>, k: K) {
    *m.entry(k).or_default() += 1;
}

/// Adds `n` to `m[k]`, copying the name only for a new entry; nothing for `n` = 0.
pub fn add(m: &mut BTreeMap<String, u64>, k: &str, n: u64) {
    if n == 0 {
        return;
    }
    match m.get_mut(k) {
        Some(v) => *v += n,
        None => {
            m.insert(k.to_string(), n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_start_and_end_once() {
        let mut h = Health::default();
        let t0 = Instant::now();
        h.set(ConditionKind::StaleWorker, "w1", "silent 5s".into(), t0);
        h.set(ConditionKind::StaleWorker, "w1", "silent 6s".into(), t0);
        assert_eq!(h.transitions(), 1);
        assert!(!h.healthy() && h.is_set(ConditionKind::StaleWorker, "w1"));
        assert_eq!(h.conditions()[0].reason, "silent 6s");
        h.clear(ConditionKind::StaleWorker, "w1");
        h.clear(ConditionKind::StaleWorker, "w1");
        assert_eq!(h.transitions(), 2);
        assert!(h.healthy());
        h.set(ConditionKind::BlockSizeMismatch, "m", "16 vs 512".into(), t0);
        h.expire(ConditionKind::BlockSizeMismatch, std::time::Duration::from_secs(60), t0);
        assert!(!h.healthy());
        h.expire(ConditionKind::BlockSizeMismatch, std::time::Duration::ZERO, t0);
        assert!(h.healthy());
    }
}
