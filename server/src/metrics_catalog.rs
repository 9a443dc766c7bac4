//! Every `kvcached_*` metric: its help text, unit and buckets (latencies are Prometheus
//! histograms, so they aggregate across a fleet), and the request-level series the service
//! records ([`Rpc`]). docs/operations/metrics.md lists them for operators.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use kvproto::NamespaceId;

use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Buckets of every `*_seconds` histogram: 20 us to 10 s.
pub const LATENCY_BUCKETS: &[f64] =
    &[2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Buckets of `kvcached_lookup_hit_blocks` (blocks of a prompt found, 16 tokens each by default).
pub const HIT_BLOCK_BUCKETS: &[f64] = &[0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];
/// Buckets of `kvcached_g4_probe_rounds`.
pub const ROUND_BUCKETS: &[f64] = &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0];

/// KV namespaces with series of their own; the ones seen later share `kv_namespace="other"`, so
/// that tenants coming and going cannot grow the daemon's series without bound.
pub const MAX_KV_NAMESPACES: usize = 64;

/// The `kv_namespace` label of a namespace's per-namespace series (prefill tokens saved,
/// lookups): its id (32 hex digits, as logs and hit reports name it) for the first
/// [`MAX_KV_NAMESPACES`] namespaces this process has seen, else `other`. When a namespace gets a
/// label of its own, `kvcached_kv_namespace_info{kv_namespace, model}` is set to 1, so that
/// dashboards can name it by model. A salted namespace's id is never exported (nor its salt):
/// its label is `salted-` and 16 hex digits of a hash of the id, which names it on a dashboard
/// and gives no one its keys (finding 2 of issue 35: `/metrics` listed salted namespaces' ids).
pub fn kv_namespace_label(id: NamespaceId, model: &str, salted: bool) -> String {
    static LABELS: OnceLock<Mutex<HashMap<NamespaceId, String>>> = OnceLock::new();
    let mut labels = LABELS.get_or_init(Mutex::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = labels.get(&id) {
        return l.clone();
    }
    if labels.len() >= MAX_KV_NAMESPACES {
        metrics::gauge!("kvcached_kv_namespace_info", "kv_namespace" => "other", "model" => "(namespaces past the first 64)")
            .set(1.0);
        return "other".into();
    }
    let label = if salted {
        let h = blake3::hash(&id.0);
        format!("salted-{}", &h.to_hex()[..16])
    } else {
        id.to_string()
    };
    let model = kvproto::limits::clip(model, 64).into_owned();
    metrics::gauge!("kvcached_kv_namespace_info", "kv_namespace" => label.clone(), "model" => model).set(1.0);
    labels.insert(id, label.clone());
    label
}

/// The exporter with histogram buckets for every histogram the daemon records.
pub fn builder() -> PrometheusBuilder {
    let b = PrometheusBuilder::new();
    let with = |b: PrometheusBuilder, m: Matcher, buckets: &[f64]| b.set_buckets_for_metric(m.clone(), buckets);
    let b = with(b, Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS);
    let b = b.and_then(|b| with(b, Matcher::Full("kvcached_lookup_hit_blocks".into()), HIT_BLOCK_BUCKETS));
    let b = b.and_then(|b| with(b, Matcher::Full("kvcached_g4_probe_rounds".into()), ROUND_BUCKETS));
    // The buckets above are non-empty constants: setting them cannot fail.
    b.unwrap_or_else(|_| PrometheusBuilder::new())
}

/// Describes every metric (HELP lines and units), on the installed recorder.
pub fn describe() {
    for (name, help) in [
        ("kvcached_rpc_requests_total", "gRPC calls answered, by method and status code."),
        ("kvcached_tier_hits_total", "Blocks read from a tier."),
        ("kvcached_tier_misses_total", "Reads of a tier that found no block."),
        ("kvcached_tier_evictions_total", "Blocks evicted from a tier to make room."),
        (
            "kvcached_tier_checksum_failures_total",
            "Blocks whose bytes failed verification (served as misses, removed).",
        ),
        ("kvcached_tier_put_errors_total", "Failed writes into a tier."),
        ("kvcached_tier_read_errors_total", "Block reads a lower tier failed (served as misses), by tier."),
        ("kvcached_writethrough_blocks_total", "Blocks written through to a lower tier."),
        (
            "kvcached_changes_queue_full_total",
            "Tier changes that waited for room on the queue to the hit reports and vLLM export.",
        ),
        ("kvcached_writethrough_dropped_total", "Write-throughs dropped, by tier and reason."),
        ("kvcached_writethrough_errors_total", "Write-throughs that failed, by tier."),
        ("kvcached_promotions_total", "Blocks promoted into G2 from a lower tier."),
        (
            "kvcached_g1_copy_failures_total",
            "Copies between a GPU engine's memory and G2 that failed (the block dropped or the load failed), by op.",
        ),
        (
            "kvcached_promotions_skipped_total",
            "Blocks a load read from G3 straight into a CPU engine not brought up into G2 after it (the engine's \
             slots no longer matched the block's checksum).",
        ),
        (
            "kvcached_prefill_tokens_saved_total",
            "Prompt tokens loaded into engines instead of recomputed, by the tier they came from and KV namespace.",
        ),
        ("kvcached_lookups_total", "Lookups, by whether they found at least one block, and KV namespace."),
        ("kvcached_load_mismatch_total", "Blocks of another namespace or size refused by a load."),
        ("kvcached_block_keys_total", "Block keys derived, reused by the key memo, or derived under a key context."),
        ("kvcached_limit_refusals_total", "Requests or connections refused by a limit."),
        ("kvcached_limit_refusals_by_limit_total", "Refusals by limit."),
        ("kvcached_tenant_salt_refused_total", "Registrations refused: their tenant salt is another tenant's."),
        (
            "kvcached_namespace_refused_total",
            "Registrations (op=register) and saves (op=save) refused: the caller's tenant may not read or write \
             the namespace ([[namespaces]]).",
        ),
        (
            "kvcached_tenant_quota_evictions_total",
            "Blocks a tenant at its quota removed of its own, by tenant and tier.",
        ),
        (
            "kvcached_tenant_quota_refused_total",
            "Blocks not stored in a tier because their tenant's quota there could not make room, by tenant and tier.",
        ),
        ("kvcached_accept_errors_total", "Failed accepts (out of descriptors, memory), by listener."),
        ("kvcached_g4_corrupt_deleted_total", "G4 objects that failed verification and were deleted."),
        ("kvcached_g4_stale_total", "G4 objects the index knew that the store no longer had."),
        ("kvcached_vllm_export_dropped_total", "vLLM-format export events dropped (queue full)."),
        ("kvcached_vllm_export_snapshots_total", "Snapshots sent to new vLLM-format subscribers."),
        ("kvcached_vllm_export_unknown_total", "Blocks not exported for want of a record of their tokens."),
        ("kvcached_vllm_export_unpersisted_total", "Export records not written to the origins log."),
        ("kvcached_g3_io_errors_total", "G3 block reads or writes that failed, by op."),
        ("kvcached_g3_slow_batches_total", "G3 I/O batches slower than 5 s."),
        ("kvcached_g3_injected_faults_total", "Faults injected into G3 by the fault suites (inject_faults), by fault."),
        ("kvcached_peer_pulled_blocks_total", "Blocks pulled from peer daemons, verified, into G2."),
        ("kvcached_peer_served_blocks_total", "Blocks sent to peer daemons that pulled them."),
        ("kvcached_peer_corrupt_blocks_total", "Blocks a peer sent that failed verification (a miss), by peer."),
        (
            "kvcached_peer_failures_total",
            "Times a peer was marked bad (unreachable, refused, stalled, wrong bytes), by peer.",
        ),
        ("kvcached_peer_refused_total", "Pulls this daemon refused, by reason."),
        ("kvcached_peer_pulls_refused_total", "Loads that could not start a pull (peer.max_pulls running)."),
        (
            "kvcached_peer_sources_refused_total",
            "Sources named by a load or a hint that are not in peer.peers or peer.allowed_sources (not dialed).",
        ),
        ("kvcached_prefetch_total", "Prefetch hints taken, by result (pulling, local)."),
    ] {
        describe_counter!(name, help);
    }
    describe_counter!("kvcached_peer_pulled_bytes_total", Unit::Bytes, "Bytes pulled from peer daemons.");
    describe_gauge!(
        "kvcached_peer_link_bytes_per_second",
        "Measured throughput of the link from a peer (bytes/s, moving average), by peer."
    );
    describe_histogram!("kvcached_peer_pull_duration_seconds", Unit::Seconds, "One pull from a peer, start to end.");
    kvnet::http::describe_metrics();
    describe_counter!("kvcached_tier_bytes_written_total", Unit::Bytes, "Bytes written into a tier.");
    describe_counter!("kvcached_tier_bytes_read_total", Unit::Bytes, "Bytes read from a tier.");
    for (name, help) in [
        ("kvcached_tier_blocks", "Blocks held by a tier."),
        ("kvcached_engines_attached", "Engines attached now."),
        ("kvcached_connections", "Client connections open now."),
        ("kvcached_writethrough_queue_depth", "Blocks waiting for write-through, by tier."),
        ("kvcached_g2_prefault_done", "1 once the G2 pool is mapped."),
        ("kvcached_g3_pool_registered", "1 once G3's io_uring rings use the G2 pool as registered buffers."),
        ("kvcached_kv_namespace_info", "1 per KV namespace with series of its own: its id and model."),
        ("kvcached_ready", "1 while this node can serve its engines (/healthz answers 200), else 0."),
        (
            "kvcached_degraded_neighbours",
            "Degraded neighbours now, by kind: peers marked failed (peer), the object store (g4), routers whose \
             last report failed (router).",
        ),
    ] {
        describe_gauge!(name, help);
    }
    describe_gauge!("kvcached_tier_used_bytes", Unit::Bytes, "Bytes a tier holds.");
    describe_gauge!("kvcached_tier_capacity_bytes", Unit::Bytes, "Bytes a tier may hold (0: no budget).");
    describe_gauge!(
        "kvcached_tenant_charged_bytes",
        Unit::Bytes,
        "Bytes of a tenant's blocks charged against its quota, by tenant and tier."
    );
    describe_gauge!("kvcached_g2_prefaulted_bytes", Unit::Bytes, "Bytes of the G2 pool mapped so far.");
    describe_gauge!(
        "kvcached_writethrough_lag_seconds",
        Unit::Seconds,
        "Age of the oldest block of the last write-through batch, by tier."
    );
    describe_histogram!("kvcached_rpc_duration_seconds", Unit::Seconds, "Time to answer a gRPC call, by method.");
    describe_histogram!("kvcached_tier_op_duration_seconds", Unit::Seconds, "Time of a tier's put or get, by tier.");
    describe_histogram!("kvcached_lookup_hit_blocks", "Leading blocks of a prompt a lookup found cached.");
    describe_histogram!("kvcached_g4_probe_rounds", "Round trips a lookup's G4 probe took.");
}

/// Series with a fixed set of labels, exported at zero from the start (so that a dashboard or
/// an alert sees 0, not nothing, before the first event): what the daemon has on. Series keyed
/// by what comes later (a KV namespace, a peer, a tenant, a gRPC method) appear with it;
/// histograms appear with their first sample.
pub fn zero_series(config: &crate::Config) {
    for name in [
        "kvcached_changes_queue_full_total",
        "kvcached_limit_refusals_total",
        "kvcached_load_mismatch_total",
        "kvcached_promotions_skipped_total",
        "kvcached_tenant_salt_refused_total",
        "kvcached_peer_pulled_blocks_total",
        "kvcached_peer_pulled_bytes_total",
        "kvcached_peer_pulls_refused_total",
        "kvcached_peer_served_blocks_total",
        "kvcached_peer_sources_refused_total",
    ] {
        metrics::counter!(name).absolute(0);
    }
    let lower: Vec<&'static str> = [(config.g3.enabled, "g3"), (config.g4.enabled, "g4")]
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, t)| t)
        .collect();
    for (name, key, values) in [
        ("kvcached_block_keys_total", "source", &["derived", "memo", "context"][..]),
        ("kvcached_namespace_refused_total", "op", &["register", "save"][..]),
        ("kvcached_g1_copy_failures_total", "op", &["save", "load"][..]),
        ("kvcached_prefetch_total", "result", &["pulling", "local"][..]),
        ("kvcached_tier_read_errors_total", "tier", &lower[..]),
    ] {
        for v in values {
            metrics::counter!(name, key => *v).absolute(0);
        }
    }
    for limit in crate::policy::limits::Limit::ALL {
        metrics::counter!("kvcached_limit_refusals_by_limit_total", "limit" => limit.label()).absolute(0);
    }
    if config.g3.enabled {
        metrics::counter!("kvcached_g3_slow_batches_total").absolute(0);
        for op in ["read", "write"] {
            metrics::counter!("kvcached_g3_io_errors_total", "op" => op).absolute(0);
        }
    }
    if config.peer.listen.is_some() {
        for why in crate::peer::server::REFUSALS {
            metrics::counter!("kvcached_peer_refused_total", "why" => *why).absolute(0);
        }
    }
    if !config.router.vllm_export.is_empty() {
        for name in [
            "kvcached_vllm_export_dropped_total",
            "kvcached_vllm_export_snapshots_total",
            "kvcached_vllm_export_unknown_total",
            "kvcached_vllm_export_unpersisted_total",
        ] {
            metrics::counter!(name).absolute(0);
        }
    }
    let mut listeners = vec!["unix"];
    if config.tcp.is_some() {
        listeners.push("tcp");
    }
    for l in listeners {
        metrics::counter!("kvcached_accept_errors_total", "listener" => l).absolute(0);
    }
    for name in ["kvcached_connections", "kvcached_engines_attached"] {
        metrics::gauge!(name).set(0.0);
    }
}

/// One gRPC call being answered: records its duration and outcome when finished.
#[derive(Debug)]
pub struct Rpc {
    name: &'static str,
    t0: Instant,
}

impl Rpc {
    pub fn start(name: &'static str) -> Self {
        Self { name, t0: Instant::now() }
    }

    /// Records the call's outcome and passes it on.
    pub fn done<T>(self, r: Result<T, tonic::Status>) -> Result<T, tonic::Status> {
        let code = match &r {
            Ok(_) => "ok",
            Err(s) => code_label(s.code()),
        };
        metrics::histogram!("kvcached_rpc_duration_seconds", "rpc" => self.name)
            .record(self.t0.elapsed().as_secs_f64());
        metrics::counter!("kvcached_rpc_requests_total", "rpc" => self.name, "code" => code).increment(1);
        r
    }
}

fn code_label(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "ok",
        InvalidArgument => "invalid_argument",
        NotFound => "not_found",
        FailedPrecondition => "failed_precondition",
        ResourceExhausted => "resource_exhausted",
        PermissionDenied => "permission_denied",
        OutOfRange => "out_of_range",
        Unavailable => "unavailable",
        DeadlineExceeded => "deadline_exceeded",
        Cancelled => "cancelled",
        _ => "other",
    }
}
