//! Per-tier counters, exported through the `metrics` facade and readable in-process.
//!
//! Every counter is an atomic (so tests and `stats()` can read it) mirrored into a `metrics`
//! handle registered once at tier construction. Install the recorder (e.g. the Prometheus
//! exporter) before opening the store, or the handles are no-ops.
//!
//! Metric names (all labelled `tier="g2"|"g3"|...`):
//! `kvcached_tier_hits_total`, `kvcached_tier_misses_total`, `kvcached_tier_bytes_written_total`,
//! `kvcached_tier_bytes_read_total`, `kvcached_tier_evictions_total`,
//! `kvcached_tier_checksum_failures_total`, `kvcached_tier_put_errors_total`,
//! `kvcached_tier_used_bytes`, `kvcached_tier_capacity_bytes`, `kvcached_tier_blocks`,
//! `kvcached_tier_op_duration_seconds{op="put"|"get"}`; store-wide:
//! `kvcached_writethrough_queue_depth`, `kvcached_writethrough_dropped_total{reason}`,
//! `kvcached_writethrough_blocks_total`, `kvcached_promotions_total`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvproto::TierKind;
use metrics::{Counter, Gauge, Histogram};

/// A counter readable in-process and exported.
#[derive(Debug)]
pub(crate) struct Count {
    value: AtomicU64,
    exported: Counter,
}

impl Count {
    fn new(name: &'static str, tier: TierKind) -> Self {
        Self { value: AtomicU64::new(0), exported: metrics::counter!(name, "tier" => tier.label()) }
    }
    /// A counter with arbitrary static labels.
    pub(crate) fn labelled(name: &'static str, labels: &[(&'static str, &'static str)]) -> Self {
        let labels: Vec<metrics::Label> = labels.iter().map(|(k, v)| metrics::Label::new(*k, *v)).collect();
        Self { value: AtomicU64::new(0), exported: metrics::counter!(name, labels) }
    }
    pub(crate) fn add(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
        self.exported.increment(n);
    }
    pub(crate) fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }
}

/// The counters and gauges of one tier.
#[derive(Debug)]
pub(crate) struct TierCounters {
    pub hits: Count,
    pub misses: Count,
    pub bytes_written: Count,
    pub bytes_read: Count,
    pub evictions: Count,
    pub checksum_failures: Count,
    pub put_errors: Count,
    used: Gauge,
    capacity: Gauge,
    blocks: Gauge,
    put_seconds: Histogram,
    get_seconds: Histogram,
}

impl TierCounters {
    pub(crate) fn new(tier: TierKind, capacity_bytes: u64) -> Self {
        let label = tier.label();
        let c = Self {
            hits: Count::new("kvcached_tier_hits_total", tier),
            misses: Count::new("kvcached_tier_misses_total", tier),
            bytes_written: Count::new("kvcached_tier_bytes_written_total", tier),
            bytes_read: Count::new("kvcached_tier_bytes_read_total", tier),
            evictions: Count::new("kvcached_tier_evictions_total", tier),
            checksum_failures: Count::new("kvcached_tier_checksum_failures_total", tier),
            put_errors: Count::new("kvcached_tier_put_errors_total", tier),
            used: metrics::gauge!("kvcached_tier_used_bytes", "tier" => label),
            capacity: metrics::gauge!("kvcached_tier_capacity_bytes", "tier" => label),
            blocks: metrics::gauge!("kvcached_tier_blocks", "tier" => label),
            put_seconds: metrics::histogram!("kvcached_tier_op_duration_seconds", "tier" => label, "op" => "put"),
            get_seconds: metrics::histogram!("kvcached_tier_op_duration_seconds", "tier" => label, "op" => "get"),
        };
        c.capacity.set(capacity_bytes as f64);
        c
    }

    pub(crate) fn set_usage(&self, used_bytes: u64, blocks: usize) {
        self.used.set(used_bytes as f64);
        self.blocks.set(blocks as f64);
    }

    pub(crate) fn put_took(&self, d: Duration) {
        self.put_seconds.record(d.as_secs_f64());
    }

    pub(crate) fn get_took(&self, d: Duration) {
        self.get_seconds.record(d.as_secs_f64());
    }

    pub(crate) fn snapshot(&self, usage: TierUsage) -> TierStats {
        TierStats {
            hits: self.hits.get(),
            misses: self.misses.get(),
            bytes_written: self.bytes_written.get(),
            bytes_read: self.bytes_read.get(),
            evictions: self.evictions.get(),
            checksum_failures: self.checksum_failures.get(),
            put_errors: self.put_errors.get(),
            usage,
        }
    }
}

/// How full a tier is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Bytes of allocated space (page-granular).
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    /// Committed (visible) blocks.
    pub blocks: usize,
}

/// A snapshot of a tier's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub evictions: u64,
    pub checksum_failures: u64,
    pub put_errors: u64,
    pub usage: TierUsage,
}
