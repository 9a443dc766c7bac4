//! The gRPC `kvrouter.v1.Router/Route` with a real tonic client against `serve()` on port 0, on
//! the same listener as the HTTP API.
#![allow(clippy::unwrap_used)]

use kvproto::TierKind;
use kvproto::events::{NodeId, PublisherInfo, WorkerId, WorkerInfo};
use kvrouter::grpc::RouterClient;
use kvrouter::grpc::pb;
use kvrouter::recovery::MemoryPublisher;
use kvtests::router_harness::*;

fn by_name(name: &str, tokens: Vec<u32>) -> pb::RouteRequest {
    pb::RouteRequest {
        namespace: Some(pb::route_request::Namespace::NamespaceName(name.into())),
        tokens,
        explain: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_route_answers_like_post_route_on_the_same_port() {
    let cfg = config();
    let ns = resolved(&cfg);
    let srv = Server::start(cfg.clone()).await;
    let p = prompt(1, 10);
    let keys = ns.keys(&p);
    let a = MemoryPublisher::new("daemon-a", 1, 100);
    let ev = vec![
        a.publish(stored(&ns, &keys[..4], TierKind::G1Gpu, worker("w1"))),
        a.publish(stored(&ns, &keys[..8], TierKind::G2Host, node("A"))),
    ];
    srv.publish(&a.message(Some(info("A", &["w1", "w2"], &ns, 1000, None)), ev)).await;

    let mut client = RouterClient::connect(srv.base.clone()).await.unwrap();
    let r = client.route(by_name("m", p.clone())).await.unwrap().into_inner();
    assert_eq!((r.worker.as_str(), r.node.as_str(), r.address.as_str()), ("w1", "A", "http://w1.invalid"));
    assert_eq!(r.blocks, 10);
    assert_eq!(r.tokens_per_block, Some(4));
    assert_eq!(r.cached_blocks, Some(pb::TierBlocks { g1: 4, g2: 4, g3: 0, g4: 0 }));
    assert_eq!(r.cached_tokens, Some(32));
    assert_eq!(r.mode, "events");
    let cost = r.cost.unwrap();
    assert!((cost.prefill_blocks - 3.0).abs() < 1e-9, "{cost:?}"); // 10 - (4 + 4 * 0.75)
    let w2 = r.candidates.iter().find(|c| c.worker == "w2").unwrap();
    assert_eq!(w2.cached_blocks, Some(pb::TierBlocks { g1: 0, g2: 8, g3: 0, g4: 0 }));
    assert!(r.split.is_none(), "no prefill worker, no split section");

    // The same answer over HTTP/JSON on the same port.
    let j = srv.route(route_body(&p)).await;
    let w1 = j.candidates.iter().find(|c| c.worker == "w1").unwrap();
    assert_eq!(w1.cached_blocks, [4, 4, 0, 0]);
    assert!(j.route_id > r.route_id);

    // By namespace id + keys, with an inline spec, with candidates.
    let req = pb::RouteRequest {
        namespace_id: Some(ns.id.to_string()),
        keys: keys.iter().map(ToString::to_string).collect(),
        candidates: vec!["w2".into()],
        ..Default::default()
    };
    let r = client.route(req).await.unwrap().into_inner();
    assert_eq!((r.worker.as_str(), r.cached_blocks.unwrap().g2), ("w2", 8));
    let s = &cfg.namespaces[0];
    let spec = pb::NamespaceSpec {
        model_id: s.model_id.clone(),
        num_layers: s.num_layers,
        kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        dtype: s.dtype.clone(),
        tokens_per_block: s.tokens_per_block,
        ..Default::default()
    };
    let req = pb::RouteRequest {
        namespace: Some(pb::route_request::Namespace::NamespaceSpec(spec)),
        tokens: p.clone(),
        ..Default::default()
    };
    assert_eq!(client.route(req).await.unwrap().into_inner().cached_blocks.unwrap().g1, 4);

    // Errors map to gRPC codes: a bad request, no worker.
    let e = client.route(by_name("nope", p.clone())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("unknown namespace"), "{e:?}");
    let e = client.route(pb::RouteRequest { keys: vec!["00".into()], ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut req = by_name("m", p.clone());
    req.candidates = vec!["nobody".into()];
    let e = client.route(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");

    // HTTP keeps working next to gRPC; an unknown path is a JSON 404.
    let r = srv.http.get(format!("{}/nope", srv.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(srv.metric("kvrouter_route_errors_total").await, Some(3.0));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_route_carries_the_split_decision() {
    let (srv, ns, a) = Server::start_default_with("daemon-a").await;
    let mut inf = info("A", &[], &ns, 1000, None);
    for (w, role) in [("d1", "decode"), ("p1", "prefill")] {
        inf.workers.push(WorkerInfo {
            id: WorkerId(w.into()),
            address: format!("http://{w}.invalid"),
            role: Some(role.into()),
        });
    }
    let inf = PublisherInfo { node: NodeId("A".into()), ..inf };
    srv.publish(&a.message(Some(inf), vec![])).await;
    let mut client = RouterClient::connect(srv.base.clone()).await.unwrap();
    let mut req = by_name("m", prompt(2, 20));
    req.role = Some("decode".into());
    let r = client.route(req.clone()).await.unwrap().into_inner();
    assert_eq!(r.worker, "d1");
    let s = r.split.unwrap();
    assert!(s.split, "{s:?}");
    assert_eq!(s.prefill_worker.as_deref(), Some("p1"));
    assert_eq!(s.prefill_address.as_deref(), Some("http://p1.invalid"));
    assert!(s.same_node);
    assert_eq!(s.handoff_blocks, 20);
    assert!(s.prefill_saving_ms > s.handoff_ms);
    req.split = Some(false);
    assert!(client.route(req).await.unwrap().into_inner().split.is_none());
    srv.stop().await;
}
