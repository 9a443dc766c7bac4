//! The router's Prometheus metrics, through the `metrics` crate and its Prometheus exporter (the
//! same system the daemon uses). Each router owns its recorder, so several routers in one
//! process (tests, simulations) each render their own.
//!
//! Most series are facts the router's state already counts ([`crate::health::Counters`], the
//! index, the workers): they are written into the recorder when `/metrics` is scraped. Series of
//! workers or publishers that are gone age out of the output ([`STALE_AFTER`]). Route latency is
//! a histogram recorded as each request is placed.

use std::collections::BTreeMap;
use std::time::Duration;

use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::MetricKindMask;

use crate::health::ConditionKind;
use crate::state::{PredictionStats, State};

/// A labelled counter or gauge not written for this long (its worker or publisher is gone) is
/// dropped from the output. Scrape-time series are rewritten on every scrape.
pub const STALE_AFTER: Duration = Duration::from_secs(2);

/// Buckets of `kvrouter_route_duration_seconds`: 10 us to 100 ms.
const ROUTE_BUCKETS: &[f64] = &[1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1];

/// Buckets of `kvrouter_bus_lag_seconds`: 1 ms to 10 s.
const LAG_BUCKETS: &[f64] = &[1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];

/// One router's recorder and its renderer.
pub struct RouterMetrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl std::fmt::Debug for RouterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterMetrics").finish_non_exhaustive()
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl RouterMetrics {
    pub fn new() -> Self {
        let builder = PrometheusBuilder::new()
            .idle_timeout(MetricKindMask::COUNTER | MetricKindMask::GAUGE, Some(STALE_AFTER))
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full("kvrouter_route_duration_seconds".into()),
                ROUTE_BUCKETS,
            )
            .and_then(|b| {
                b.set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full("kvrouter_bus_lag_seconds".into()),
                    LAG_BUCKETS,
                )
            })
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, describe);
        Self { recorder, handle }
    }

    /// A request was placed (`ok`) or refused, taking `took`.
    pub fn route_took(&self, took: Duration, ok: bool) {
        metrics::with_local_recorder(&self.recorder, || {
            histogram!("kvrouter_route_duration_seconds", "outcome" => if ok { "placed" } else { "error" })
                .record(took.as_secs_f64());
        });
    }

    /// A stream message was applied `seconds` after the stream stored it.
    pub fn bus_lag(&self, seconds: f64) {
        metrics::with_local_recorder(&self.recorder, || histogram!("kvrouter_bus_lag_seconds").record(seconds));
    }

    /// The Prometheus text of everything, with the state's facts as of now.
    pub fn render(&self, st: &State) -> String {
        metrics::with_local_recorder(&self.recorder, || write_state(st));
        self.handle.render()
    }
}

fn describe() {
    describe_histogram!("kvrouter_route_duration_seconds", Unit::Seconds, "Time to place a request, by outcome.");
    describe_histogram!(
        "kvrouter_bus_lag_seconds",
        Unit::Seconds,
        "From the NATS stream storing a message to this replica applying it."
    );
    for (name, help) in [
        ("kvrouter_routes_total", "Requests placed."),
        ("kvrouter_route_errors_total", "Requests that could not be placed."),
        ("kvrouter_events_total", "Events applied, per publisher."),
        ("kvrouter_duplicate_events_total", "Events skipped as already applied."),
        ("kvrouter_invalid_events_total", "Events rejected (holder does not fit the tier)."),
        ("kvrouter_event_gaps_total", "Gaps in event ids, per publisher."),
        ("kvrouter_recovery_failures_total", "Failed replay / snapshot recoveries."),
        ("kvrouter_vllm_batches_total", "vLLM ZMQ event batches received, per source."),
        ("kvrouter_vllm_orphan_blocks_total", "vLLM blocks whose parent was unknown."),
        (
            "kvrouter_vllm_source_failures_total",
            "vLLM source connections whose reader failed inside the ZMQ library (it reconnects).",
        ),
        ("kvrouter_gap_recoveries_total", "Gaps recovered, by method (replay or snapshot)."),
        ("kvrouter_mismatch_total", "Requests or publishers showing a mismatch, by kind."),
        ("kvrouter_health_transitions_total", "Conditions started or ended."),
        ("kvrouter_predicted_blocks_total", "Cached prefix blocks predicted for routed requests with an outcome."),
        ("kvrouter_actual_blocks_total", "Cached prefix blocks the worker reported finding."),
        ("kvrouter_prediction_abs_error_blocks_total", "Sum of |predicted - actual| blocks."),
        ("kvrouter_prediction_samples_total", "Outcomes compared with a prediction."),
        ("kvrouter_outcomes_total", "Outcome reports received."),
        ("kvrouter_outcomes_unknown_total", "Outcome reports with no pending prediction."),
        ("kvrouter_dropped_holders_total", "Workers dropped (silent, unlisted)."),
        ("kvrouter_dropped_facts_total", "Index facts dropped with dead holders or restarts."),
        ("kvrouter_prefetch_total", "Prefetch hints sent to daemons, by result (sent, failed)."),
        ("kvrouter_bus_messages_total", "NATS stream messages applied."),
        (
            "kvrouter_bus_refused_total",
            "NATS stream messages refused (not a publisher message of their subject's node).",
        ),
        ("kvrouter_bus_dropped_total", "NATS messages the server dropped because this replica's buffer was full."),
        ("kvrouter_bus_consumers_total", "Consumers of the stream created (the first, then one per resumption)."),
    ] {
        describe_counter!(name, help);
    }
    for (name, help) in [
        ("kvrouter_condition_active", "Active degrading conditions, by kind."),
        ("kvrouter_healthy", "1 when no condition is active."),
        ("kvrouter_worker_stale", "1 when the worker's publisher is overdue."),
        ("kvrouter_publisher_unrecovered_gap", "1 while a publisher has missed events that were not recovered."),
        ("kvrouter_prediction_error_ratio", "Moving average of |predicted - actual| / max(predicted, actual)."),
        ("kvrouter_index_blocks", "Distinct blocks in the index."),
        ("kvrouter_index_facts", "(block, holder, tier) facts in the index."),
        ("kvrouter_approx_facts", "Approximate-mode (block, worker) decisions remembered."),
        ("kvrouter_holders", "Live holders (workers, nodes, cluster)."),
        ("kvrouter_workers", "Known workers."),
        ("kvrouter_publishers", "Known publishers."),
        ("kvrouter_bus_pending_messages", "NATS stream messages this replica has not read yet."),
    ] {
        describe_gauge!(name, help);
    }
    describe_gauge!("kvrouter_index_bytes", Unit::Bytes, "Estimated heap bytes of the index.");
    kvnet::http::describe_metrics();
}

/// Writes the state's facts into the current (local) recorder.
fn write_state(st: &State) {
    let c = &st.counters;
    counter!("kvrouter_routes_total").absolute(c.routes);
    counter!("kvrouter_route_errors_total").absolute(c.route_errors);
    {
        use std::sync::atomic::Ordering::Relaxed;
        counter!("kvrouter_prefetch_total", "result" => "sent").absolute(st.prefetches.sent.load(Relaxed));
        counter!("kvrouter_prefetch_total", "result" => "failed").absolute(st.prefetches.failed.load(Relaxed));
    }
    let per_publisher: [(&'static str, &BTreeMap<String, u64>); 8] = [
        ("kvrouter_events_total", &c.events),
        ("kvrouter_duplicate_events_total", &c.duplicate_events),
        ("kvrouter_invalid_events_total", &c.invalid_events),
        ("kvrouter_event_gaps_total", &c.gaps),
        ("kvrouter_recovery_failures_total", &c.recovery_failures),
        ("kvrouter_vllm_batches_total", &c.vllm_batches),
        ("kvrouter_vllm_orphan_blocks_total", &c.vllm_orphan_blocks),
        ("kvrouter_vllm_source_failures_total", &c.vllm_source_failures),
    ];
    for (name, m) in per_publisher {
        for (publisher, v) in m {
            counter!(name, "publisher" => publisher.clone()).absolute(*v);
        }
    }
    for ((publisher, method), v) in &c.recoveries {
        counter!("kvrouter_gap_recoveries_total", "publisher" => publisher.clone(), "method" => method.to_string())
            .absolute(*v);
    }
    for k in [ConditionKind::NamespaceMismatch, ConditionKind::BlockSizeMismatch, ConditionKind::KeySchemeMismatch] {
        counter!("kvrouter_mismatch_total", "kind" => k.label())
            .absolute(c.mismatches.get(k.label()).copied().unwrap_or(0));
    }
    for k in ConditionKind::ALL {
        gauge!("kvrouter_condition_active", "kind" => k.label()).set(st.health.count(k) as f64);
    }
    gauge!("kvrouter_healthy").set(if st.health.healthy() { 1.0 } else { 0.0 });
    counter!("kvrouter_health_transitions_total").absolute(st.health.transitions());
    for w in st.workers.keys() {
        let stale = st.health.is_set(ConditionKind::StaleWorker, &w.0);
        gauge!("kvrouter_worker_stale", "worker" => w.0.clone()).set(if stale { 1.0 } else { 0.0 });
    }
    for p in st.publishers.keys() {
        let gap = st.health.is_set(ConditionKind::UnrecoveredGap, p);
        gauge!("kvrouter_publisher_unrecovered_gap", "publisher" => p.clone()).set(if gap { 1.0 } else { 0.0 });
    }
    for w in st.workers.values() {
        let s: &PredictionStats = &w.prediction;
        let worker = w.id.0.clone();
        counter!("kvrouter_predicted_blocks_total", "worker" => worker.clone()).absolute(s.predicted_blocks);
        counter!("kvrouter_actual_blocks_total", "worker" => worker.clone()).absolute(s.actual_blocks);
        counter!("kvrouter_prediction_abs_error_blocks_total", "worker" => worker.clone()).absolute(s.abs_error_blocks);
        counter!("kvrouter_prediction_samples_total", "worker" => worker.clone()).absolute(s.samples);
        gauge!("kvrouter_prediction_error_ratio", "worker" => worker).set(s.ewma_error);
    }
    counter!("kvrouter_outcomes_total").absolute(c.outcomes);
    counter!("kvrouter_outcomes_unknown_total").absolute(c.outcomes_unknown);
    gauge!("kvrouter_index_blocks").set(st.index.blocks() as f64);
    gauge!("kvrouter_index_facts").set(st.index.facts() as f64);
    gauge!("kvrouter_index_bytes").set(st.index.approx_bytes() as f64);
    gauge!("kvrouter_approx_facts").set(st.approx.len() as f64);
    gauge!("kvrouter_holders").set(st.holders.len() as f64);
    gauge!("kvrouter_workers").set(st.workers.len() as f64);
    gauge!("kvrouter_publishers").set(st.publishers.len() as f64);
    counter!("kvrouter_dropped_holders_total").absolute(c.dropped_holders);
    counter!("kvrouter_dropped_facts_total").absolute(c.dropped_facts);
    counter!("kvrouter_bus_messages_total").absolute(c.bus.messages);
    counter!("kvrouter_bus_refused_total").absolute(c.bus.refused);
    counter!("kvrouter_bus_dropped_total").absolute(c.bus.dropped);
    counter!("kvrouter_bus_consumers_total").absolute(c.bus.consumers);
    gauge!("kvrouter_bus_pending_messages").set(c.bus.pending as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two routers' recorders are their own, label values are escaped, and route latency is a
    /// histogram with buckets.
    #[test]
    fn each_router_renders_its_own_escaped_series() {
        let a = RouterMetrics::new();
        let b = RouterMetrics::new();
        a.route_took(Duration::from_micros(30), true);
        metrics::with_local_recorder(&a.recorder, || gauge!("kvrouter_worker_stale", "worker" => "a\"b").set(1.0));
        let text = a.handle.render();
        assert!(text.contains("kvrouter_worker_stale{worker=\"a\\\"b\"} 1"), "{text}");
        assert!(text.contains("kvrouter_route_duration_seconds_bucket{outcome=\"placed\",le=\"0.00005\"} 1"), "{text}");
        assert!(text.contains("# HELP kvrouter_route_duration_seconds"), "{text}");
        assert!(!b.handle.render().contains("kvrouter_worker_stale"));
    }
}
