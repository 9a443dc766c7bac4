//! The embeddable publisher against a real router: events, load and outcomes arrive; events it
//! could not queue (bounded) or deliver (router down) are replayed by the router from its log.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use kvcached::edge::http::recovery_routes;
use kvcached::export::publish::{HttpPublisher, PublishConfig};
use kvproto::TierKind;
use kvproto::events::{EngineLoad, LoadReport, WorkerId};
use kvproto::publisher::MemoryPublisher;
use kvtests::router_harness::*;

async fn serve_recovery(p: Arc<MemoryPublisher>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, recovery_routes(p)).await.unwrap() });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_publisher_never_blocks_and_routers_catch_up_by_replay() {
    let cfg = config();
    let ns = resolved(&cfg);
    let router = Server::start(cfg.clone()).await;
    // A second router that is down at first: its port is bound (so no other test can take it)
    // but not listening, so connections are refused until it starts.
    let late_socket = tokio::net::TcpSocket::new_v4().unwrap();
    late_socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let late_addr = late_socket.local_addr().unwrap();

    let log = Arc::new(MemoryPublisher::new("daemon-a", 7, 10_000));
    let url = serve_recovery(log.clone()).await;
    let publisher = HttpPublisher::spawn(
        log.clone(),
        PublishConfig {
            routers: vec![router.base.clone(), format!("http://{late_addr}")],
            auth: Default::default(),
            nats: None,
            info: info("A", &["w1"], &ns, 50, Some(url)),
            max_pending: 8, // tiny: most of the burst below cannot be queued
            max_batch: 4,
            timeout: Duration::from_millis(500),
        },
        || {
            Some(LoadReport {
                links: vec![],
                tiers: vec![],
                engines: vec![EngineLoad {
                    worker: WorkerId("w1".into()),
                    running: 2,
                    waiting: 1,
                    kv_used_blocks: 10,
                    kv_total_blocks: 100,
                    prefill_tokens_per_s: None,
                }],
            })
        },
    )
    .unwrap();
    for i in 0..200 {
        let keys = ns.keys(&prompt(i, 2));
        publisher.publish(stored(&ns, &keys, TierKind::G2Host, node("A")));
    }
    assert!(publisher.dropped() > 100, "the queue is bounded: {}", publisher.dropped());
    let truth = log.held_facts() as u64;
    assert_eq!(truth, 400);
    router.wait_for(20, "catch-up", || async { router.router.index_stats().facts == truth }).await;
    let r = router.route(route_body(&prompt(150, 2))).await;
    assert_eq!(r.cached_blocks, [0, 2, 0, 0]);
    // Load arrived: 3 active requests (+ this route) weigh on the cost.
    assert!(r.cost.active_term >= 6.0, "{:?}", r.cost);

    // The second router comes up late on the address the publisher already targets.
    let listener = late_socket.listen(1024).unwrap();
    let late = kvrouter::Router::new(cfg).unwrap();
    let late2 = late.clone();
    tokio::spawn(async move { kvrouter::serve_router(listener, late2, std::future::pending()).await.unwrap() });
    // A fresh event makes the publisher post; the late router sees id 201 and replays 1..200.
    let keys = ns.keys(&prompt(999, 2));
    publisher.publish(stored(&ns, &keys, TierKind::G2Host, node("A")));
    let t0 = std::time::Instant::now();
    while late.index_stats().facts != 402 {
        assert!(t0.elapsed() < Duration::from_secs(20), "late router did not catch up: {:?}", late.index_stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(publisher.failed_posts() > 0);
    assert_eq!(router.healthz().await["status"], "ok");
    router.stop().await;
}
