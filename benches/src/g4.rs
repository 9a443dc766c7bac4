//! G4 against a real S3-compatible server (SeaweedFS started here, as in the tests): the tier's
//! writes and reads beside raw `object_store` puts and gets of the same bytes at the same
//! concurrency against the same server, in the same run; one object per block against one
//! object per run of 16 blocks (what each costs a whole-run read and a 4-block partial read);
//! the probe of a long prefix through a store made slow; and a whole prompt brought from G4
//! into G2 (what a load from G4 does before its copy into engine memory) against the same bytes
//! fetched raw.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use kvproto::{BlockKey, NamespaceId};
use kvtiers::{BlockBuf, BlockMeta, BlockRef, ObjectTier, ObjectTierConfig, Tier};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// One measured row: what, bytes moved, time, and the same through raw object_store.
#[derive(Debug, Clone)]
pub struct Row {
    pub what: String,
    pub ours_mbs: f64,
    pub raw_mbs: f64,
}

/// Everything measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub granularity: Vec<(String, f64)>,
    pub probe: Vec<(String, usize, f64)>,
    pub prompt: Option<PromptFromG4>,
}

/// A 128k-token prompt loaded from G4 into engine memory by a daemon that holds none of it.
#[derive(Debug, Clone)]
pub struct PromptFromG4 {
    pub blocks: u32,
    pub block_bytes: usize,
    /// Lookup (which probes G4) and load into the engine's slots, as the engine waits for it.
    pub lookup_ms: f64,
    pub load_ms: f64,
    /// The same objects fetched raw at the same concurrency (bytes in memory, nothing more).
    pub raw_ms: f64,
}

/// Rounds of each write / read measurement; the median is reported.
const ROUNDS: usize = 5;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn mbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

fn key(run: u32, i: u32) -> BlockKey {
    let mut k = [0u8; 16];
    k[..4].copy_from_slice(&run.to_le_bytes());
    k[4..8].copy_from_slice(&i.to_le_bytes());
    k[8] = 0xb4;
    BlockKey(k)
}

fn ns() -> NamespaceId {
    NamespaceId([0x6b; 16])
}

fn data(i: u32, len: usize) -> Vec<u8> {
    kvclient::synthetic_block(u64::from(i), i, len)
}

async fn raw_put_all(store: &Arc<dyn ObjectStore>, objs: &[(ObjPath, Bytes)], conc: usize) -> Duration {
    let t0 = Instant::now();
    let puts = objs.iter().map(|(p, b)| {
        let store = Arc::clone(store);
        let p = p.clone();
        let b = b.clone();
        async move { store.put(&p, PutPayload::from(b)).await.map(|_| ()) }
    });
    let r: Vec<_> = futures_util::stream::iter(puts).buffer_unordered(conc).collect().await;
    assert!(r.iter().all(Result::is_ok), "raw put failed: {:?}", r.iter().find(|x| x.is_err()));
    t0.elapsed()
}

async fn raw_get_all(store: &Arc<dyn ObjectStore>, paths: &[ObjPath], conc: usize) -> (Duration, usize) {
    let t0 = Instant::now();
    let gets = paths.iter().map(|p| {
        let store = Arc::clone(store);
        let p = p.clone();
        async move {
            match store.get(&p).await {
                Ok(g) => g.bytes().await.map(|b| b.len()).unwrap_or(0),
                Err(_) => 0,
            }
        }
    });
    let n: Vec<usize> = futures_util::stream::iter(gets).buffer_unordered(conc).collect().await;
    (t0.elapsed(), n.iter().sum())
}

/// The bucket `bucket` of the S3 server at `endpoint` (plain HTTP; credentials in the
/// environment), used directly.
fn s3_store(endpoint: &str, bucket: &str) -> Result<Arc<dyn ObjectStore>, String> {
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Arc::new(s3))
}

/// Runs every measurement against the server at `endpoint` (bucket `bucket`, credentials in the
/// environment), `count` blocks of each size.
pub fn run(endpoint: &str, bucket: &str, count: u32, concurrency: usize) -> Result<Report, String> {
    let mut report = Report::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let raw = s3_store(endpoint, bucket)?;
    let tier_cfg = |prefix: &str, latency: Option<Duration>| {
        let mut c = ObjectTierConfig::new(format!("s3://{bucket}/{prefix}"));
        c.endpoint = Some(endpoint.to_string());
        c.allow_http = true;
        c.concurrency = concurrency;
        c.inject_latency = latency;
        c
    };
    for (label, len) in [("256 KiB", 256usize << 10), ("2 MiB", 2 << 20)] {
        let blocks: Vec<Vec<u8>> = (0..count).map(|i| data(i, len)).collect();
        let total = blocks.iter().map(Vec::len).sum::<usize>();
        // The tier (its own runtime; blocking calls, as the write-through thread and a load make
        // them): writes in the write-through's batches of 16, reads of the whole set at once (a
        // load asks for all the blocks it lacks); the tier keeps `concurrency` in flight.
        let tier = ObjectTier::open(&tier_cfg(&format!("tier-{}", len), None)).map_err(|e| e.to_string())?;
        let refs: Vec<BlockRef<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| BlockRef {
                key: key(len as u32, i as u32),
                meta: BlockMeta { namespace: ns(), parent: None, len: b.len() as u64, owner: None },
                data: b,
            })
            .collect();
        // Raw object_store: the very objects the tier writes (same paths, header and data), so
        // the difference is the tier's own work.
        let objs: Vec<(ObjPath, Bytes)> = refs
            .iter()
            .map(|r| {
                let mut v = kvtiers::object::format::header(&r.key, &r.meta, r.data).to_vec();
                v.extend_from_slice(r.data);
                (ObjPath::from(tier.object_path(&r.meta.namespace, &r.key)), Bytes::from(v))
            })
            .collect();
        let keys: Vec<BlockKey> = refs.iter().map(|r| r.key).collect();
        let paths: Vec<ObjPath> = objs.iter().map(|(p, _)| p.clone()).collect();
        // ROUNDS rounds, raw and ours alternating; each figure is the median round. A write
        // round rewrites the same objects (the tier deletes them first, so it PUTs again).
        let (mut raw_puts, mut raw_gets, mut puts, mut gets) = (vec![], vec![], vec![], vec![]);
        // Buffers made once, as G2's pool is: the measured reads copy into memory already mapped.
        let mut outs: Vec<BlockBuf> = keys.iter().map(|_| BlockBuf::new()).collect();
        for _ in 0..ROUNDS {
            raw_puts.push(rt.block_on(raw_put_all(&raw, &objs, concurrency)));
            raw_gets.push(rt.block_on(raw_get_all(&raw, &paths, concurrency)).0);
            for k in &keys {
                tier.remove(k).map_err(|e| e.to_string())?;
            }
            let t0 = Instant::now();
            for chunk in refs.chunks(16) {
                if let Some(Err(e)) = tier.put_batch(chunk).into_iter().find(Result::is_err) {
                    return Err(e.to_string());
                }
            }
            puts.push(t0.elapsed());
            let t0 = Instant::now();
            tier.get_batch(&keys, &mut outs);
            gets.push(t0.elapsed());
            for (o, b) in outs.iter().zip(&blocks) {
                if o[..] != b[..] {
                    return Err("G4 returned other bytes".into());
                }
            }
        }
        let (put, get, raw_put, raw_get) = (median(puts), median(gets), median(raw_puts), median(raw_gets));
        report.rows.push(Row {
            what: format!("write {label}"),
            ours_mbs: mbs(total, put),
            raw_mbs: mbs(total, raw_put),
        });
        report.rows.push(Row {
            what: format!("read {label}"),
            ours_mbs: mbs(total, get),
            raw_mbs: mbs(total, raw_get),
        });

        // One object per block against one per run of 16: a whole run, and 4 blocks of it.
        let runs: Vec<(ObjPath, Bytes)> = blocks
            .chunks(16)
            .enumerate()
            .map(|(r, c)| (ObjPath::from(format!("runs-{len}/{r}")), Bytes::from(c.concat())))
            .collect();
        rt.block_on(raw_put_all(&raw, &runs, concurrency));
        let run_paths: Vec<ObjPath> = runs.iter().map(|(p, _)| p.clone()).collect();
        let (t_runs, _) = rt.block_on(raw_get_all(&raw, &run_paths, concurrency));
        report.granularity.push((format!("{label}: whole runs of 16, one object per run (MB/s)"), mbs(total, t_runs)));
        report
            .granularity
            .push((format!("{label}: whole runs of 16, one object per block (MB/s)"), mbs(total, raw_get)));
        // 4 blocks out of each run: 4 objects, or a range of the run's object.
        let t0 = Instant::now();
        let part: Vec<ObjPath> = (0..count).filter(|i| i % 16 < 4).map(|i| paths[i as usize].clone()).collect();
        rt.block_on(raw_get_all(&raw, &part, concurrency));
        let per_block = t0.elapsed();
        let t0 = Instant::now();
        rt.block_on(async {
            let gets = run_paths.iter().map(|p| {
                let raw = Arc::clone(&raw);
                let p = p.clone();
                async move { raw.get_range(&p, 0..(4 * len) as u64).await.map(|b| b.len()) }
            });
            let _: Vec<_> = futures_util::stream::iter(gets).buffer_unordered(concurrency).collect().await;
        });
        let ranged = t0.elapsed();
        let part_bytes = part.len() * len;
        report
            .granularity
            .push((format!("{label}: 4 of 16 blocks, one object per block (MB/s)"), mbs(part_bytes, per_block)));
        report
            .granularity
            .push((format!("{label}: 4 of 16 blocks, ranged read of a run (MB/s)"), mbs(part_bytes, ranged)));
    }
    // A long prefix found through a slow store (10 ms a request).
    let small: Vec<Vec<u8>> = (0..8192).map(|i| data(i, 64)).collect();
    let writer = ObjectTier::open(&tier_cfg("probe", None)).map_err(|e| e.to_string())?;
    let refs: Vec<BlockRef<'_>> = small
        .iter()
        .enumerate()
        .map(|(i, b)| BlockRef {
            key: key(99, i as u32),
            meta: BlockMeta { namespace: ns(), parent: None, len: 64, owner: None },
            data: b,
        })
        .collect();
    for chunk in refs.chunks(256) {
        writer.put_batch(chunk);
    }
    let keys: Vec<BlockKey> = refs.iter().map(|r| r.key).collect();
    for (what, n) in [("8192-block prefix, all in G4", 8192usize), ("nothing in G4", 0)] {
        let slow = ObjectTier::open(&tier_cfg("probe", Some(Duration::from_millis(10)))).map_err(|e| e.to_string())?;
        let asked: Vec<BlockKey> = if n == 0 { (0..8192).map(|i| key(98, i)).collect() } else { keys.clone() };
        let t0 = Instant::now();
        let (found, rounds) = slow.probe_rounds(ns(), &asked);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if found != n {
            return Err(format!("probe found {found} of {n}"));
        }
        report.probe.push((what.to_string(), rounds, ms));
    }
    Ok(report)
}

/// Daemon A (in this process, on `dir/a`) saves a 128k-token prompt (8192 blocks of 16 tokens,
/// 16 KiB each) and writes it through to G4; daemon B (`dir/b`, G2 only, nothing of its own)
/// is asked by its engine for the prompt: its lookup finds it in G4, its load brings it into
/// the engine's memory (checked byte for byte). Beside it, raw object_store GETs of the same
/// objects at the same concurrency.
pub async fn prompt_from_g4(
    endpoint: &str,
    bucket: &str,
    dir: &std::path::Path,
    concurrency: usize,
) -> Result<PromptFromG4, String> {
    use kvclient::{Client, KvMemory};
    use kvproto::Namespace;
    const BLOCKS: u32 = 8192;
    let layout = kvtests::fixture::small_layout();
    let block_bytes = layout.block_bytes() as usize;
    let namespace = Namespace::new("g4-bench/model", layout);
    let tokens: Vec<u32> = (0..BLOCKS * 16).map(|i| i.wrapping_mul(2_654_435_761) % 150_000).collect();
    let slots: Vec<u32> = (0..BLOCKS).collect();
    let prefix = "prompt";
    let start = |name: &str| -> Result<(kvcached::Config, std::path::PathBuf), String> {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
        let mut c = kvcached::Config {
            socket: d.join("kvcached.sock"),
            metrics_addr: "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?,
            ..Default::default()
        };
        c.g2.capacity_bytes = 512 << 20;
        c.g2.shm_dir = d.clone();
        c.g3.enabled = false;
        c.g4.enabled = true;
        c.g4.url = format!("s3://{bucket}/{prefix}");
        c.g4.endpoint = endpoint.to_string();
        c.g4.allow_http = true;
        c.g4.concurrency = concurrency;
        let c = c.resolve().map_err(|e| e.to_string())?;
        let socket = c.socket.clone();
        Ok((c, socket))
    };
    let mut stops = Vec::new();
    let mut daemons = Vec::new();
    let mut sockets = Vec::new();
    for name in ["a", "b"] {
        let (c, socket) = start(name)?;
        let listeners = kvcached::Listeners::bind(&c).await.map_err(|e| e.to_string())?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        daemons.push(tokio::spawn(kvcached::serve(c, listeners, async move {
            let _ = rx.await;
        })));
        stops.push(tx);
        sockets.push(socket);
    }
    let result = async {
        // A: save, then wait until every block is an object in the bucket.
        let mut mem_a = KvMemory::anonymous(&layout, BLOCKS).map_err(|e| e.to_string())?;
        for b in 0..BLOCKS {
            mem_a.write_block(b, &kvclient::synthetic_block(7, b, block_bytes));
        }
        let a = Client::connect(&sockets[0]).await.map_err(|e| e.to_string())?;
        a.register("a", &namespace, &mem_a).await.map_err(|e| e.to_string())?;
        let stored = a.save(&tokens, 0, &slots).await.map_err(|e| e.to_string())?.stored;
        if stored != BLOCKS {
            return Err(format!("daemon A stored {stored} of {BLOCKS} blocks"));
        }
        let raw = s3_store(endpoint, bucket)?;
        let t0 = Instant::now();
        let paths = loop {
            let listed: Vec<ObjPath> = raw
                .list(Some(&ObjPath::from(prefix)))
                .filter_map(|m| async move { m.ok().map(|m| m.location) })
                .collect()
                .await;
            if listed.len() >= BLOCKS as usize {
                break listed;
            }
            if t0.elapsed() > Duration::from_secs(300) {
                return Err(format!("daemon A wrote {} of {BLOCKS} blocks to G4 in 300 s", listed.len()));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // B: lookup and load into the engine's memory.
        let mem_b = KvMemory::anonymous(&layout, BLOCKS).map_err(|e| e.to_string())?;
        let b = Client::connect(&sockets[1]).await.map_err(|e| e.to_string())?;
        b.register("b", &namespace, &mem_b).await.map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let hit = b.lookup(&tokens).await.map_err(|e| e.to_string())?;
        let lookup = t0.elapsed();
        if hit.g4_blocks != BLOCKS {
            return Err(format!("daemon B's lookup found {} of {BLOCKS} blocks in G4", hit.g4_blocks));
        }
        let t0 = Instant::now();
        let done = b.load_now(&tokens, 0, &slots).await.map_err(|e| e.to_string())?;
        let load = t0.elapsed();
        if done.loaded_blocks != BLOCKS || done.from_g4 != BLOCKS {
            return Err(format!("daemon B loaded {done:?}"));
        }
        for s in 0..BLOCKS {
            if mem_b.read_block(s) != kvclient::synthetic_block(7, s, block_bytes) {
                return Err(format!("block {s} loaded from G4 differs"));
            }
        }
        let (raw_took, got) = raw_get_all(&raw, &paths, concurrency).await;
        if got < BLOCKS as usize * block_bytes {
            return Err(format!("raw GETs returned {got} bytes"));
        }
        Ok(PromptFromG4 {
            blocks: BLOCKS,
            block_bytes,
            lookup_ms: lookup.as_secs_f64() * 1e3,
            load_ms: load.as_secs_f64() * 1e3,
            raw_ms: raw_took.as_secs_f64() * 1e3,
        })
    }
    .await;
    for tx in stops {
        let _ = tx.send(());
    }
    for d in daemons {
        let _ = d.await;
    }
    result
}

/// The report as Markdown.
pub fn markdown(r: &Report) -> String {
    let mut out =
        String::from("| G4 (SeaweedFS, loopback) | ours MB/s | raw object_store MB/s | ratio |\n|---|---|---|---|\n");
    for row in &r.rows {
        out += &format!(
            "| {} | {:.0} | {:.0} | {:.2}x |\n",
            row.what,
            row.ours_mbs,
            row.raw_mbs,
            row.ours_mbs / row.raw_mbs
        );
    }
    out += "\n| object granularity (raw object_store) | MB/s |\n|---|---|\n";
    for (what, v) in &r.granularity {
        out += &format!("| {what} | {v:.0} |\n");
    }
    out += "\n| probe through a store answering in 10 ms | round trips | ms |\n|---|---|---|\n";
    for (what, rounds, ms) in &r.probe {
        out += &format!("| {what} | {rounds} | {ms:.0} |\n");
    }
    if let Some(p) = &r.prompt {
        let mb = (p.blocks as usize * p.block_bytes) as f64 / 1e6;
        out += &format!(
            "\n| 128k-token prompt ({} blocks of {} KiB) from G4 | ms | MB/s |\n|---|---|---|\n",
            p.blocks,
            p.block_bytes >> 10
        );
        out += &format!("| daemon B: lookup (probes G4) | {:.0} | |\n", p.lookup_ms);
        out += &format!("| daemon B: load into engine memory | {:.0} | {:.0} |\n", p.load_ms, mb / (p.load_ms / 1e3));
        out += &format!(
            "| daemon B: lookup + load | {:.0} | {:.0} |\n",
            p.lookup_ms + p.load_ms,
            mb / ((p.lookup_ms + p.load_ms) / 1e3)
        );
        out += &format!(
            "| raw object_store GETs of the same objects | {:.0} | {:.0} |\n",
            p.raw_ms,
            mb / (p.raw_ms / 1e3)
        );
        out += &format!("| load throughput / raw | | {:.2}x |\n", p.raw_ms / p.load_ms);
    }
    out
}
