//! Shared test helpers: a real router on port 0, a JSON client, publisher helpers.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvproto::events::{
    EVENTS_VERSION, EventBody, Holder, KEY_SCHEME_KVCACHED, NamespaceInfo, NodeId, PublisherInfo, PublisherMessage,
    WorkerId, WorkerInfo,
};
use kvproto::{BlockKey, TierKind};
use kvrouter::config::{NamespaceSpec, ResolvedNamespace, VllmSource};
use kvrouter::recovery::MemoryPublisher;
use kvrouter::{RouteResponse, Router, RouterConfig};
use serde_json::Value;

#[derive(Debug)]
pub struct Server {
    pub base: String,
    pub router: Arc<Router>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    pub http: reqwest::Client,
}

impl Server {
    pub async fn start(config: RouterConfig) -> Self {
        let router = Router::new(config).unwrap();
        Self::start_with(router).await
    }

    /// A router with [`config`], and its namespace `m`.
    pub async fn start_default() -> (Self, ResolvedNamespace) {
        let cfg = config();
        let ns = resolved(&cfg);
        (Self::start(cfg).await, ns)
    }

    /// [`Server::start_default`] and a publisher named `publisher` (epoch 1, a log of 100
    /// events) to feed it.
    pub async fn start_default_with(publisher: &str) -> (Self, ResolvedNamespace, MemoryPublisher) {
        let (srv, ns) = Self::start_default().await;
        (srv, ns, MemoryPublisher::new(publisher, 1, 100))
    }

    pub async fn start_with(router: Arc<Router>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let r = router.clone();
        let task = tokio::spawn(async move {
            kvrouter::serve_router(listener, r, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Self { base, router, stop: Some(tx), task: Some(task), http: reqwest::Client::new() }
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), t).await.unwrap().unwrap();
        }
    }

    pub async fn publish(&self, msg: &PublisherMessage) {
        let r = self.http.post(format!("{}/events", self.base)).json(msg).send().await.unwrap();
        assert_eq!(r.status(), 204, "{:?}", r.text().await);
    }

    /// POSTs `body` to `path`: (status, JSON answer or null).
    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    pub async fn route_json(&self, body: Value) -> (u16, Value) {
        let r = self.http.post(format!("{}/route", self.base)).json(&body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap())
    }

    pub async fn route(&self, body: Value) -> RouteResponse {
        let (s, v) = self.route_json(body).await;
        assert_eq!(s, 200, "{v}");
        serde_json::from_value(v).unwrap()
    }

    pub async fn healthz(&self) -> Value {
        self.http.get(format!("{}/healthz", self.base)).send().await.unwrap().json().await.unwrap()
    }

    /// The `/healthz` condition of `kind`; fails the test, printing the answer, where none is.
    pub async fn condition(&self, kind: &str) -> Value {
        let h = self.healthz().await;
        let found = h["conditions"].as_array().and_then(|cs| cs.iter().find(|c| c["kind"] == kind)).cloned();
        found.unwrap_or_else(|| panic!("no {kind} condition in {h}"))
    }

    pub async fn metrics(&self) -> String {
        self.http.get(format!("{}/metrics", self.base)).send().await.unwrap().text().await.unwrap()
    }

    /// The value of one sample line (`name{labels}`), or None.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = self.metrics().await;
        text.lines().find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')).map(|v| v.parse().unwrap()))
    }

    /// Polls `f` until it returns true (or panics after `secs`).
    pub async fn wait_for<F, Fut>(&self, secs: u64, what: &str, mut f: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let t0 = Instant::now();
        while !f().await {
            assert!(t0.elapsed() < Duration::from_secs(secs), "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A small namespace (4-token blocks) used by the tests.
pub fn spec(name: &str, model: &str, tokens_per_block: u32) -> NamespaceSpec {
    NamespaceSpec {
        name: Some(name.into()),
        model_id: model.into(),
        num_layers: 2,
        kv_heads: 1,
        head_dim: 8,
        dtype: "bf16".into(),
        tokens_per_block,
        layout_kind: "layer_separate".into(),
        tenant_salt_hex: None,
        adapter_id: None,
        extra_hex: None,
        key_scheme: KEY_SCHEME_KVCACHED.into(),
        expected_blocks: 0,
    }
}

/// Namespace `m` of model `model` with [`crate::fixture::small_layout`] (16-token blocks): the
/// namespace of the daemons' engines in the tests with real daemons.
pub fn small_spec(model: &str) -> NamespaceSpec {
    NamespaceSpec { kv_heads: 2, head_dim: 64, ..spec("m", model, 16) }
}

/// A vLLM event source at `endpoint`: worker `v1` of node `N1`, namespace `vllm`, its replay
/// socket `replay_endpoint`, reconnecting after `idle_reconnect_s` of silence.
pub fn vllm_source(endpoint: &str, replay_endpoint: Option<String>, idle_reconnect_s: f64) -> VllmSource {
    VllmSource {
        endpoint: endpoint.to_string(),
        topic: String::new(),
        worker: "v1".into(),
        node: "N1".into(),
        namespace: "vllm".into(),
        address: "http://v1.invalid".into(),
        role: None,
        replay_endpoint,
        idle_reconnect_s,
    }
}

pub fn config() -> RouterConfig {
    RouterConfig { namespaces: vec![spec("m", "test/model", 4)], seed: Some(1), ..RouterConfig::default() }
}

pub fn resolved(config: &RouterConfig) -> ResolvedNamespace {
    config.namespaces[0].resolve().unwrap()
}

/// `n` blocks of 4 tokens, prompt number `p`.
pub fn prompt(p: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4).map(|i| p * 100_000 + i).collect()
}

pub fn info(
    node: &str,
    workers: &[&str],
    ns: &ResolvedNamespace,
    interval_ms: u64,
    recovery: Option<String>,
) -> PublisherInfo {
    PublisherInfo {
        node: NodeId(node.into()),
        workers: workers
            .iter()
            .map(|w| WorkerInfo { id: WorkerId((*w).into()), address: format!("http://{w}.invalid"), role: None })
            .collect(),
        namespaces: vec![NamespaceInfo {
            id: ns.id,
            model_id: ns.namespace.model_id.clone(),
            tokens_per_block: ns.tokens_per_block(),
            key_scheme: KEY_SCHEME_KVCACHED.into(),
        }],
        events_version: EVENTS_VERSION,
        report_interval_ms: interval_ms,
        recovery_url: recovery,
        peer_url: None,
    }
}

pub fn stored(ns: &ResolvedNamespace, keys: &[BlockKey], tier: TierKind, holder: Holder) -> EventBody {
    EventBody::Stored { namespace: ns.id, parent: None, keys: keys.to_vec(), tier, holder }
}

pub fn worker(w: &str) -> Holder {
    Holder::Worker(WorkerId(w.into()))
}
pub fn node(n: &str) -> Holder {
    Holder::Node(NodeId(n.into()))
}

pub fn route_body(p: &[u32]) -> Value {
    serde_json::json!({"namespace": "m", "tokens": p, "explain": true})
}
