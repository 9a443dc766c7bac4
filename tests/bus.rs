//! The event plane on NATS JetStream, across real processes: a real nats-server (users confined
//! to the subjects docs/router.md lists), kvcached daemons as processes publishing on it, router
//! replicas reading it. Replicas answer alike, a new replica rebuilds from the stream, the bus
//! killed and restarted loses and doubles nothing, a daemon's restart clears its node in every
//! replica, and a replica whose stream no longer holds a daemon's early events recovers them by
//! snapshot; `transport = "both"` posts to `router.urls` as well, `"nats"` does not.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use kvnet::bus::NatsConfig;
use kvrouter::config::RouterConfig;
use kvtests::cluster_harness::*;
use kvtests::fixture::{KillOnDrop, prompt};
use kvtests::nats::Nats;
use kvtests::proc::{free_port, http_get};
use serde_json::Value;

fn daemon(dir: &Path, http: &str, nats: &Nats, node: &str, extra: &str) -> KillOnDrop {
    let section = format!("node = \"{node}\"\nreport_interval_ms = 200\n{extra}{}", nats.daemon_toml(dir, node));
    spawn_daemon_at(env!("CARGO_BIN_EXE_daemon"), dir, http, &section)
}

fn replica_config(nats: &Nats, dir: &Path, tune: impl FnOnce(&mut NatsConfig)) -> RouterConfig {
    let mut c = router_config();
    c.nats = nats.router_config(dir);
    tune(&mut c.nats);
    c
}

/// The sum of every series of `name` (all labels).
async fn metric_sum(http: &reqwest::Client, base: &str, name: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(' ') || r.starts_with('{')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn healthz(http: &reqwest::Client, base: &str) -> Value {
    http.get(format!("{base}/healthz")).send().await.unwrap().json().await.unwrap()
}

/// Polls `f` (20 s).
async fn wait<F: AsyncFnMut() -> Option<String>>(what: &str, mut f: F) {
    let t0 = Instant::now();
    loop {
        let Some(why) = f().await else { return };
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}: {why}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The newest event id a daemon at `http` has published.
fn last_event_id(http: &str) -> u64 {
    let (status, body) = http_get(http, "/events/snapshot");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<Value>(&body).unwrap()["last_event_id"].as_u64().unwrap()
}

/// Waits until every replica says `tokens` go to `worker` with `blocks` cached per tier.
async fn all_answer(http: &reqwest::Client, replicas: &[&RouterProc], tokens: &[u32], worker: &str, blocks: [u64; 4]) {
    for r in replicas {
        wait_route(http, &r.base, tokens, &format!("{worker} {blocks:?} from {}", r.base), |v| {
            v["worker"] == worker && cached(v) == blocks
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemons_and_router_replicas_through_nats_through_restarts_of_each() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let d = tempfile::tempdir().unwrap();
    let mut nats = Nats::start(&d.path().join("nats"), &["node-a", "node-b", "node-c"]);
    let dirs: Vec<_> = ["a", "b", "c"].iter().map(|n| d.path().join(n)).collect();
    for x in &dirs {
        std::fs::create_dir_all(x).unwrap();
    }
    let ports: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let r1 = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |_| {})).await;
    let r2 = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |_| {})).await;
    let da = daemon(&dirs[0], &ports[0], &nats, "node-a", "");
    let db = daemon(&dirs[1], &ports[1], &nats, "node-b", "");
    let dc = daemon(&dirs[2], &ports[2], &nats, "node-c", "");
    let (ca, _ma) = engine(&dirs[0], "http://a:8000").await;
    let (cb, _mb) = engine(&dirs[1], "http://b:8000").await;
    let (cc, _mc) = engine(&dirs[2], "http://c:8000").await;

    // 1. Three nodes' reports reach both replicas through the stream alone (no router URL is
    //    configured on any daemon): both place every prompt alike.
    let (p, q, g) = (prompt(1, 16), prompt(2, 12), prompt(3, 6));
    ca.save(&p, 0, &(0..16).collect::<Vec<_>>()).await.unwrap();
    cb.save(&q, 0, &(0..12).collect::<Vec<_>>()).await.unwrap();
    cc.gpu_stored(&g, 0).await.unwrap();
    let expect =
        [(&p, "node-a/gpu0", [0, 16, 0, 0]), (&q, "node-b/gpu0", [0, 12, 0, 0]), (&g, "node-c/gpu0", [6, 0, 0, 0])];
    for (tokens, worker, blocks) in expect {
        all_answer(&http, &[&r1, &r2], tokens, worker, blocks).await;
    }
    for r in [&r1, &r2] {
        assert!(metric_sum(&http, &r.base, "kvrouter_bus_messages_total").await > 0.0);
        assert_eq!(metric_sum(&http, &r.base, "kvrouter_bus_refused_total").await, 0.0);
    }

    // 2. A replica stopped and a new one started: it rebuilds its index from the stream, with no
    //    call to any daemon's recovery API.
    r2.stop().await;
    let r3 = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |_| {})).await;
    for (tokens, worker, blocks) in expect {
        all_answer(&http, &[&r3], tokens, worker, blocks).await;
    }
    assert_eq!(metric_sum(&http, &r3.base, "kvrouter_gap_recoveries_total").await, 0.0);

    // 3. nats-server killed mid-run: daemons and replicas say so while it lasts; what was saved
    //    meanwhile arrives once it is back (the stream kept on disk), every event id applied once.
    nats.kill();
    let p2 = prompt(4, 8);
    ca.save(&p2, 0, &(16..24).collect::<Vec<_>>()).await.unwrap();
    wait("the daemon to name the outage", async || {
        let (_, body) = http_get(&ports[0], "/healthz");
        (!body.lines().any(|l| l.starts_with("warning: ") && l.contains("NATS"))).then_some(body)
    })
    .await;
    for r in [&r1, &r3] {
        wait("a replica to name the outage", async || {
            let h = healthz(&http, &r.base).await;
            (!h.to_string().contains("event_bus")).then(|| h.to_string())
        })
        .await;
    }
    nats.restart();
    all_answer(&http, &[&r1, &r3], &p2, "node-a/gpu0", [0, 8, 0, 0]).await;
    for r in [&r1, &r3] {
        wait("a replica's outage condition to clear", async || {
            let h = healthz(&http, &r.base).await;
            (h.to_string().contains("event_bus")).then(|| h.to_string())
        })
        .await;
    }
    wait("the daemon's warning to clear", async || {
        let (_, body) = http_get(&ports[0], "/healthz");
        body.lines().any(|l| l.starts_with("warning: ") && l.contains("NATS")).then_some(body)
    })
    .await;
    let last = last_event_id(&ports[0]) as f64;
    for r in [&r1, &r3] {
        let applied = metric_sum(&http, &r.base, "kvrouter_events_total{publisher=\"kvcached@node-a\"}").await;
        assert_eq!(applied, last, "node-a's events applied by {}: each id exactly once", r.base);
    }

    // 4. Daemon B restarts (a new epoch): every replica drops what it held in G2 and keeps what
    //    G3 announces again.
    signal_and_wait(db, libc::SIGTERM);
    let db = daemon(&dirs[1], &ports[1], &nats, "node-b", "");
    assert_eq!(cb.lookup(&q).await.unwrap().g3_blocks, 12, "the client re-registers with the new daemon");
    all_answer(&http, &[&r1, &r3], &q, "node-b/gpu0", [0, 0, 12, 0]).await;

    drop((ca, cb, cc));
    drop((da, db, dc));
    r1.stop().await;
    r3.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_stream_lost_early_events_recovers_them_by_snapshot() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let d = tempfile::tempdir().unwrap();
    let nats = Nats::start(&d.path().join("nats"), &["node-a"]);
    let dir = d.path().join("a");
    std::fs::create_dir_all(&dir).unwrap();
    let port = format!("127.0.0.1:{}", free_port());
    // A stream that keeps 4 messages, a daemon whose log keeps 4 events.
    let small = "max_messages = 4\n";
    let toml = nats.daemon_toml(&dir, "node-a").replace("[events.nats.auth]", &format!("{small}[events.nats.auth]"));
    let section = format!("node = \"node-a\"\nreport_interval_ms = 200\nevent_log = 4\n{toml}");
    let da = spawn_daemon_at(env!("CARGO_BIN_EXE_daemon"), &dir, &port, &section);
    let (ca, _ma) = engine(&dir, "http://a:8000").await;
    let prompts: Vec<Vec<u32>> = (10..20).map(|i| prompt(i, 2)).collect();
    for (i, p) in prompts.iter().enumerate() {
        let slot = i as u32 * 2;
        ca.save(p, 0, &[slot, slot + 1]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(last_event_id(&port) >= 10);
    // Heartbeats have pushed the saves' messages out of the stream.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let r = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |c| c.max_messages = 4)).await;
    for p in &prompts {
        all_answer(&http, &[&r], p, "node-a/gpu0", [0, 2, 0, 0]).await;
    }
    let text = http.get(format!("{}/metrics", r.base)).send().await.unwrap().text().await.unwrap();
    assert!(
        text.lines().any(|l| l.starts_with("kvrouter_gap_recoveries_total") && l.contains("method=\"snapshot\"")),
        "{text}"
    );
    drop(ca);
    drop(da);
    r.stop().await;
}

/// A daemon given another node's NATS user cannot publish as itself: NATS refuses the subject,
/// the daemon's `/healthz` says so, and no replica ever lists the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_publishes_only_on_the_subject_its_nats_user_is_granted() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let d = tempfile::tempdir().unwrap();
    let nats = Nats::start(&d.path().join("nats"), &["node-a"]);
    let dir = d.path().join("x");
    std::fs::create_dir_all(&dir).unwrap();
    let port = format!("127.0.0.1:{}", free_port());
    let r = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |_| {})).await;
    // node-x, with node-a's user and password.
    let toml = nats.daemon_toml(&dir, "node-a");
    let _dx = spawn_daemon_at(
        env!("CARGO_BIN_EXE_daemon"),
        &dir,
        &port,
        &format!("node = \"node-x\"\nreport_interval_ms = 200\n{toml}"),
    );
    wait("the daemon to warn that NATS refuses its reports", async || {
        let (_, body) = http_get(&port, "/healthz");
        (!body.lines().any(|l| l.starts_with("warning: ") && l.contains("NATS stream"))).then_some(body)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(healthz(&http, &r.base).await["publishers"], 0);
    r.stop().await;
}

/// `transport = "nats"` publishes on the stream only, whatever `router.urls` lists; `"both"`
/// (a cluster moving from one to the other) on the stream and to `router.urls`. Reports in JSON
/// and in binary on one stream are both read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_posts_to_router_urls_besides_nats_only_with_transport_both() {
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).build().unwrap();
    let d = tempfile::tempdir().unwrap();
    let nats = Nats::start(&d.path().join("nats"), &["node-a", "node-b"]);
    let pushed = start_router_with("127.0.0.1:0", router_config()).await;
    let replica = start_router_with("127.0.0.1:0", replica_config(&nats, d.path(), |_| {})).await;
    let mut daemons = vec![];
    // node-a also writes its reports as JSON, node-b in binary (the default): a replica reads both.
    for (node, transport, encoding) in [("node-a", "nats", "json"), ("node-b", "both", "binary")] {
        let dir = d.path().join(node);
        std::fs::create_dir_all(&dir).unwrap();
        let toml = nats
            .daemon_toml(&dir, node)
            .replace("transport = \"nats\"", &format!("transport = \"{transport}\""))
            .replace("[events.nats.auth]", &format!("encoding = \"{encoding}\"\n[events.nats.auth]"));
        let section = format!("node = \"{node}\"\nreport_interval_ms = 200\nurls = [\"{}\"]\n{toml}", pushed.base);
        daemons.push(spawn_daemon_at(
            env!("CARGO_BIN_EXE_daemon"),
            &dir,
            &format!("127.0.0.1:{}", free_port()),
            &section,
        ));
    }
    wait("the replica to hear both daemons on the stream", async || {
        let h = healthz(&http, &replica.base).await;
        (h["publishers"] != 2).then(|| h.to_string())
    })
    .await;
    wait("the pushed router to hear node-b", async || {
        let h = healthz(&http, &pushed.base).await;
        (h["publishers"] != 1).then(|| h.to_string())
    })
    .await;
    // A second of node-a's reports (every 200 ms) has gone by: none reached the pushed router.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let h = healthz(&http, &pushed.base).await;
    assert_eq!(h["publishers"], 1, "{h}");
    let text = http.get(format!("{}/metrics", pushed.base)).send().await.unwrap().text().await.unwrap();
    assert!(!text.contains("node-a"), "node-a posted to router.urls with transport \"nats\":\n{text}");
    drop(daemons);
    pushed.stop().await;
    replica.stop().await;
}
