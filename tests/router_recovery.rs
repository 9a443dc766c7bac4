//! Event-id gaps and their recovery over the real transport: replay from the publisher's log,
//! snapshot when the log no longer reaches back, publisher restart, router restart, replicas.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use kvcached::edge::http::recovery_routes;
use kvproto::TierKind;
use kvproto::events::{Event, EventBody};
use kvproto::publisher::MemoryPublisher;
use kvrouter::router::IndexStats;
use kvtests::router_harness::*;

/// A publisher whose recovery API is served over HTTP on port 0.
async fn http_publisher(name: &str, epoch: u64, log: usize) -> (Arc<MemoryPublisher>, String) {
    let p = Arc::new(MemoryPublisher::new(name, epoch, log));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = recovery_routes(p.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (p, url)
}

/// Publishes `n` chains of 3 blocks for worker w1 / node A, returning the events.
fn churn(p: &MemoryPublisher, ns: &kvrouter::config::ResolvedNamespace, start: u32, n: u32) -> Vec<Event> {
    let mut out = vec![];
    for i in start..start + n {
        let keys = ns.keys(&prompt(i, 3));
        out.push(p.publish(stored(ns, &keys, TierKind::G1Gpu, worker("w1"))));
        out.push(p.publish(stored(ns, &keys, TierKind::G2Host, node("A"))));
        if i % 3 == 0 {
            out.push(p.publish(EventBody::Removed {
                keys: keys[1..].to_vec(),
                tier: TierKind::G1Gpu,
                holder: worker("w1"),
            }));
        }
    }
    out
}

fn stats_eq(a: IndexStats, b: IndexStats) -> bool {
    a.blocks == b.blocks && a.facts == b.facts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_from_the_publisher_log() {
    let cfg = config();
    let ns = resolved(&cfg);
    let srv = Server::start(cfg.clone()).await;
    let (p, url) = http_publisher("daemon-a", 1, 1000).await;
    let inf = info("A", &["w1"], &ns, 1000, Some(url));
    let evs = churn(&p, &ns, 0, 10);
    // Deliver the first 5 events, drop the next 7, deliver the rest.
    srv.publish(&p.message(Some(inf.clone()), evs[..5].to_vec())).await;
    srv.publish(&p.message(None, evs[12..].to_vec())).await;
    let expected = p.held_facts() as u64;
    srv.wait_for(10, "replay", || async { srv.router.index_stats().facts == expected }).await;
    assert_eq!(srv.metric("kvrouter_event_gaps_total{publisher=\"daemon-a\"}").await, Some(1.0));
    srv.wait_for(10, "recovery counted", || async {
        srv.metric("kvrouter_gap_recoveries_total{publisher=\"daemon-a\",method=\"replay\"}").await == Some(1.0)
    })
    .await;
    assert_eq!(srv.healthz().await["status"], "ok");
    // The index agrees with the publisher block by block: every prompt routes with the
    // publisher's truth.
    let r = srv.route(route_body(&prompt(8, 3))).await;
    assert_eq!(r.cached_blocks, [3, 0, 0, 0]);
    let r = srv.route(route_body(&prompt(3, 3))).await;
    assert_eq!(r.cached_blocks, [1, 2, 0, 0]);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_recovers_when_the_log_no_longer_reaches_back() {
    let (srv, ns) = Server::start_default().await;
    let (p, url) = http_publisher("daemon-a", 1, 4).await;
    let inf = info("A", &["w1"], &ns, 1000, Some(url));
    let evs = churn(&p, &ns, 0, 20);
    srv.publish(&p.message(Some(inf), evs[..3].to_vec())).await;
    srv.publish(&p.message(None, evs[evs.len() - 1..].to_vec())).await;
    let expected = p.held_facts() as u64;
    srv.wait_for(10, "snapshot", || async {
        srv.metric("kvrouter_gap_recoveries_total{publisher=\"daemon-a\",method=\"snapshot\"}").await == Some(1.0)
    })
    .await;
    assert_eq!(srv.router.index_stats().facts, expected);
    // Later events apply on top of the snapshot.
    let more = churn(&p, &ns, 100, 1);
    srv.publish(&p.message(None, more)).await;
    assert_eq!(srv.router.index_stats().facts, p.held_facts() as u64);
    assert_eq!(srv.healthz().await["status"], "ok");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_and_replicas_converge_on_the_same_index() {
    let cfg = config();
    let ns = resolved(&cfg);
    let (p, url) = http_publisher("daemon-a", 1, 8).await;
    let inf = info("A", &["w1"], &ns, 1000, Some(url));
    let evs = churn(&p, &ns, 0, 30);
    let truth = p.held_facts() as u64;

    // Replica 1 sees everything; replica 2 loses every third message; replica 3 starts (a router
    // restart) when the publisher is already far along.
    let r1 = Server::start(cfg.clone()).await;
    let r2 = Server::start(cfg.clone()).await;
    for (i, chunk) in evs.chunks(4).enumerate() {
        r1.publish(&p.message(Some(inf.clone()), chunk.to_vec())).await;
        if i % 3 != 1 {
            r2.publish(&p.message(Some(inf.clone()), chunk.to_vec())).await;
        }
    }
    let r3 = Server::start(cfg.clone()).await;
    let tail = churn(&p, &ns, 50, 1);
    for r in [&r1, &r2, &r3] {
        r.publish(&p.message(Some(inf.clone()), tail.clone())).await;
    }
    let truth_now = p.held_facts() as u64;
    assert!(truth_now > truth);
    for r in [&r1, &r2, &r3] {
        r.wait_for(10, "convergence", || async { r.router.index_stats().facts == truth_now }).await;
    }
    assert!(stats_eq(r1.router.index_stats(), r2.router.index_stats()));
    assert!(stats_eq(r1.router.index_stats(), r3.router.index_stats()));

    // The publisher restarts (new epoch, empty state, ids from 1): everything it said is dropped.
    let p2 = MemoryPublisher::new("daemon-a", 2, 8);
    let keys = ns.keys(&prompt(7, 3));
    let ev = vec![p2.publish(stored(&ns, &keys, TierKind::G2Host, node("A")))];
    for r in [&r1, &r2, &r3] {
        r.publish(&p2.message(Some(info("A", &["w1"], &ns, 1000, None)), ev.clone())).await;
        assert_eq!(r.router.index_stats().facts, 3);
        let route = r.route(route_body(&prompt(7, 3))).await;
        assert_eq!(route.cached_blocks, [0, 3, 0, 0]);
    }
    for r in [r1, r2, r3] {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_sources_and_unrecoverable_gaps() {
    let (srv, ns) = Server::start_default().await;
    // In-process source attached to the router (how an embedded publisher plugs in).
    let p = Arc::new(MemoryPublisher::new("embedded", 1, 100));
    srv.router.attach_recovery("embedded", p.clone());
    let evs = churn(&p, &ns, 0, 5);
    srv.publish(&p.message(Some(info("A", &["w1"], &ns, 1000, None)), vec![evs[0].clone(), evs[4].clone()])).await;
    srv.wait_for(10, "in-process replay", || async { srv.router.index_stats().facts == p.held_facts() as u64 }).await;

    // A publisher with no recovery API: the gap is loud and stays loud.
    let q = MemoryPublisher::new("no-log", 1, 100);
    let evs = churn(&q, &ns, 10, 3);
    srv.publish(&q.message(Some(info("B", &["w9"], &ns, 1000, None)), vec![evs[0].clone(), evs[3].clone()])).await;
    let h = srv.healthz().await;
    assert_eq!(h["status"], "degraded", "{h}");
    let c = &h["conditions"][0];
    assert_eq!(c["kind"], "unrecovered_gap");
    assert_eq!(c["subject"], "no-log");
    assert!(c["reason"].as_str().unwrap().contains("missed events 2..3"), "{h}");
    assert_eq!(srv.metric("kvrouter_publisher_unrecovered_gap{publisher=\"no-log\"}").await, Some(1.0));
    let strict = srv.http.get(format!("{}/healthz?strict=true", srv.base)).send().await.unwrap();
    assert_eq!(strict.status(), 503);
    // Duplicates are skipped, not applied twice.
    srv.publish(&q.message(None, vec![evs[3].clone()])).await;
    assert_eq!(srv.metric("kvrouter_duplicate_events_total{publisher=\"no-log\"}").await, Some(1.0));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trailing_loss_shows_in_the_announced_last_id() {
    // Without a recovery API: loud.
    let (srv, ns, q) = Server::start_default_with("no-log").await;
    let evs = churn(&q, &ns, 0, 2);
    let msg = q.message(Some(info("B", &["w9"], &ns, 1000, None)), evs[..2].to_vec());
    assert_eq!(msg.last_event_id, Some(evs.len() as u64));
    srv.publish(&msg).await;
    let h = srv.healthz().await;
    assert_eq!(h["conditions"][0]["kind"], "unrecovered_gap", "{h}");
    assert!(h["conditions"][0]["reason"].as_str().unwrap().contains(&format!("missed events 3..{}", evs.len())), "{h}");
    // With one: a heartbeat alone (no events) is enough to trigger the replay.
    let p = Arc::new(MemoryPublisher::new("embedded", 1, 100));
    srv.router.attach_recovery("embedded", p.clone());
    let evs = churn(&p, &ns, 10, 3);
    srv.publish(&p.message(Some(info("A", &["w1"], &ns, 1000, None)), evs[..1].to_vec())).await;
    srv.wait_for(10, "replay", || async {
        srv.metric("kvrouter_gap_recoveries_total{publisher=\"embedded\",method=\"replay\"}").await == Some(1.0)
    })
    .await;
    // Prompt 11 was stored in G1 and G2 by the replayed events (not removed: 11 % 3 != 0).
    let r = srv.route(route_body(&prompt(11, 3))).await;
    assert_eq!(r.cached_blocks, [3, 0, 0, 0]);
    srv.stop().await;
}
