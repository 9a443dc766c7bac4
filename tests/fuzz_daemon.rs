//! The daemon (in this process) against arbitrary input from other processes: generated gRPC
//! requests of every method (layouts, namespace specs, slot lists, token bytes and spans, block
//! ids, op ids, G1 reports), bodies that are not protobuf, garbage bytes on the Unix socket (also
//! after ATTACH's and LOOKUP's first bytes) and the TCP port (not HTTP/2), and HTTP/2 frames that
//! break the protocol. Nothing may panic (a panic hook counts them), no request is the daemon's
//! fault (INTERNAL / UNKNOWN), and the daemon still serves a real engine byte-exact afterwards.
//!
//! A short run is part of `cargo test`; a long one: `PROPTEST_CASES=5000 cargo test -p kvtests
//! --test fuzz_daemon --release` (docs/operations/security-limits.md, "Fuzzing").
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvcached::{Config, Listeners};
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::fuzzing::{bytes, case_count as cases};
use kvproto::pb;
use kvproto::{KvLayout, Namespace};
use kvtests::raw_grpc::{raw_client, raw_unary};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn layout() -> KvLayout {
    kvtests::fixture::small_layout()
}

fn prompt(blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(0, blocks)
}

struct Daemon {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    http: std::net::SocketAddr,
    tcp: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kvcached::ServerError>>,
}

async fn start() -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Config {
        socket: dir.path().join("kvcached.sock"),
        metrics_addr: "127.0.0.1:0".parse().unwrap(),
        tcp: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    c.g2.capacity_bytes = 32 << 20;
    c.g2.shm_dir = dir.path().to_path_buf();
    c.g3.enabled = false;
    let c = c.resolve().unwrap();
    let l = Listeners::bind(&c).await.unwrap();
    let http = l.http.as_ref().unwrap().local_addr().unwrap();
    let tcp = l.tcp.as_ref().unwrap().local_addr().unwrap();
    let socket = c.socket.clone();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvcached::serve(c, l, async move {
        let _ = rx.await;
    }));
    Daemon { _dir: dir, socket, http, tcp, stop, task }
}

/// One generated call (a test's values: their sizes do not matter).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
enum Call {
    Register(pb::RegisterRequest),
    Save(pb::SaveRequest),
    Lookup(pb::LookupRequest),
    Load(pb::LoadRequest),
    Wait(pb::WaitRequest),
    Gpu(pb::GpuBlocksRequest),
    ReportLoad(pb::EngineLoadRequest),
    Heartbeat(u64),
    Unregister(u64),
    /// Bytes sent as the body of a method (not a message of its type).
    RawBody(&'static str, Vec<u8>),
}

fn n32() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..10, Just(u32::MAX), any::<u32>()]
}

fn n64() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..4096, Just(u64::MAX), any::<u64>()]
}

/// The real engine's id half the time, else any id.
fn engine_id(real: u64) -> impl Strategy<Value = u64> {
    prop_oneof![Just(real), n64()]
}

/// Token bytes: a real prompt's (so lookups and loads find blocks), or arbitrary bytes.
fn tokens() -> impl Strategy<Value = bytes::Bytes> {
    prop_oneof![(0u32..4).prop_map(|b| kvproto::tokens_to_le(&prompt(b))), bytes(200).prop_map(bytes::Bytes::from)]
}

/// A key context: absent, empty, or with fields in and out of their bounds.
fn context() -> impl Strategy<Value = Option<pb::KeyContext>> {
    let mm = (bytes(70), n32(), n32()).prop_map(|(hash, offset, length)| pb::MmInput { hash, offset, length });
    let extra = (n32(), bytes(70)).prop_map(|(block, data)| pb::BlockExtra { block, data });
    proptest::option::of(
        (
            ".{0,8}",
            bytes(70),
            proptest::option::of(bytes(20)),
            proptest::collection::vec(mm, 0..4),
            proptest::collection::vec(extra, 0..4),
        )
            .prop_map(|(adapter_name, adapter_hash, cache_salt, mm, block_extras)| pb::KeyContext {
                adapter_name,
                adapter_hash,
                cache_salt,
                mm,
                block_extras,
            }),
    )
}

/// Engine page hashes: a known scheme or not, hashes of any length (0..=70: past both bounds),
/// sent beside tokens or a context or alone.
fn engine_hashes() -> impl Strategy<Value = Option<pb::EngineHashes>> {
    proptest::option::of(
        (prop_oneof!["sglang", "vllm", ".{0,8}"], proptest::collection::vec(bytes(70), 0..6))
            .prop_map(|(scheme, hashes)| pb::EngineHashes { scheme, hashes }),
    )
}

fn spec() -> impl Strategy<Value = pb::NamespaceSpec> {
    (
        ".{0,20}",
        proptest::option::of((
            n32(),
            n32(),
            n32(),
            prop_oneof![Just("bf16"), Just("f32"), Just("?")],
            n32(),
            prop_oneof![Just("layer_separate"), Just("contiguous")],
        )),
        proptest::option::of(bytes(40)),
        proptest::option::of(".{0,10}"),
        proptest::option::of(bytes(20)),
    )
        .prop_map(|(model_id, l, tenant_salt, adapter_id, extra)| pb::NamespaceSpec {
            model_id,
            layout: l.map(|(num_layers, kv_heads, head_dim, dtype, tokens_per_block, kind)| pb::Layout {
                num_layers,
                kv_heads,
                head_dim,
                dtype: dtype.into(),
                tokens_per_block,
                kind: kind.into(),
            }),
            tenant_salt,
            adapter_id,
            extra,
        })
}

fn register() -> impl Strategy<Value = pb::RegisterRequest> {
    (
        (".{0,20}", proptest::option::of(spec())),
        proptest::option::of((
            prop_oneof![
                bytes(20).prop_map(pb::memory_region::Kind::FdTicket),
                bytes(70).prop_map(pb::memory_region::Kind::CudaIpcHandle),
            ],
            n64(),
            n32(),
        )),
        proptest::collection::vec((n64(), n64()), 0..6),
        (n64(), n32(), ".{0,10}", prop_oneof![Just(String::new()), Just("decode".to_string()), ".{0,5}"]),
        proptest::option::of((n64(), bytes(20))),
    )
        .prop_map(
            |((engine_name, namespace), region, segs, (segment_bytes, num_blocks, worker_address, role), area)| {
                pb::RegisterRequest {
                    engine_name,
                    namespace,
                    region: region.map(|(kind, size_bytes, cuda_device)| pb::MemoryRegion {
                        kind: Some(kind),
                        size_bytes,
                        cuda_device,
                    }),
                    segments: segs
                        .into_iter()
                        .map(|(offset, block_stride)| pb::Segment { offset, block_stride })
                        .collect(),
                    segment_bytes,
                    num_blocks,
                    worker_address,
                    role,
                    #[allow(deprecated)]
                    token_area: area.map(|(size_bytes, fd_ticket)| pb::TokenArea {
                        shm_path: String::new(),
                        size_bytes,
                        fd_ticket,
                    }),
                }
            },
        )
}

const METHODS: &[&str] = &[
    "/kvcached.v1.Kvcached/Register",
    "/kvcached.v1.Kvcached/Save",
    "/kvcached.v1.Kvcached/Lookup",
    "/kvcached.v1.Kvcached/Load",
    "/kvcached.v1.Kvcached/Wait",
    "/kvcached.v1.Kvcached/ReportGpuBlocks",
    "/kvcached.v1.Kvcached/ReportLoad",
    "/kvcached.v1.Kvcached/Heartbeat",
];

fn call(real: u64) -> impl Strategy<Value = Call> {
    let ids = || proptest::collection::vec(prop_oneof![0u32..10, any::<u32>()], 0..6);
    prop_oneof![
        register().prop_map(Call::Register),
        (engine_id(real), tokens(), n32(), ids(), context(), engine_hashes()).prop_map(
            |(engine_id, tokens, first_block, block_ids, context, engine_hashes)| Call::Save(pb::SaveRequest {
                engine_id,
                tokens,
                first_block,
                block_ids,
                context,
                engine_hashes,
            })
        ),
        (
            engine_id(real),
            tokens(),
            proptest::option::of(n64()),
            n32(),
            proptest::option::of((n64(), n64())),
            context(),
            n32(),
            engine_hashes()
        )
            .prop_map(|(engine_id, tokens, route_id, g1_blocks, at, context, first_block, engine_hashes)| {
                Call::Lookup(pb::LookupRequest {
                    engine_id,
                    tokens,
                    route_id,
                    g1_blocks,
                    tokens_at: at.map(|(offset, len)| pb::TokenSpan { offset, len }),
                    context,
                    first_block,
                    engine_hashes,
                })
            }),
        (
            engine_id(real),
            tokens(),
            n32(),
            ids(),
            any::<bool>(),
            proptest::collection::vec(".{0,12}", 0..3),
            context(),
            engine_hashes()
        )
            .prop_map(|(engine_id, tokens, first_block, block_ids, wait, sources, context, engine_hashes)| {
                Call::Load(pb::LoadRequest {
                    engine_id,
                    tokens,
                    first_block,
                    block_ids,
                    wait,
                    sources,
                    context,
                    engine_hashes,
                })
            }),
        (engine_id(real), n64(), 0u32..20, n32()).prop_map(|(engine_id, op_id, timeout_ms, until_blocks)| Call::Wait(
            pb::WaitRequest { engine_id, op_id, timeout_ms, until_blocks }
        )),
        (engine_id(real), 0i32..4, tokens(), n32(), proptest::collection::vec(bytes(20), 0..4), context()).prop_map(
            |(engine_id, change, tokens, first_block, keys, context)| Call::Gpu(pb::GpuBlocksRequest {
                engine_id,
                change,
                tokens,
                first_block,
                keys,
                context
            })
        ),
        (engine_id(real), n32(), n32(), n64(), n64(), n64(), n64()).prop_map(
            |(engine_id, running, waiting, kv_used_blocks, kv_total_blocks, prefill_tokens, prefill_us)| {
                Call::ReportLoad(pb::EngineLoadRequest {
                    engine_id,
                    running,
                    waiting,
                    kv_used_blocks,
                    kv_total_blocks,
                    prefill_tokens,
                    prefill_us,
                })
            }
        ),
        engine_id(real).prop_map(Call::Heartbeat),
        n64().prop_filter("not the real engine", move |id| *id != real).prop_map(Call::Unregister),
        (proptest::sample::select(METHODS), bytes(300)).prop_map(|(m, b)| Call::RawBody(m, b)),
    ]
}

async fn send(
    c: &mut pb::kvcached_client::KvcachedClient<tonic::transport::Channel>,
    socket: &Path,
    call: Call,
) -> Result<(), tonic::Status> {
    match call {
        Call::Register(r) => c.register(r).await.map(drop),
        Call::Save(r) => c.save(r).await.map(drop),
        Call::Lookup(r) => c.lookup(r).await.map(drop),
        Call::Load(r) => c.load(r).await.map(drop),
        Call::Wait(r) => c.wait(r).await.map(drop),
        Call::Gpu(r) => c.report_gpu_blocks(r).await.map(drop),
        Call::ReportLoad(r) => c.report_load(r).await.map(drop),
        Call::Heartbeat(id) => c.heartbeat(pb::EngineRef { engine_id: id }).await.map(drop),
        Call::Unregister(id) => c.unregister(pb::EngineRef { engine_id: id }).await.map(drop),
        Call::RawBody(method, body) => raw_unary(socket, method, body).await,
    }
}

/// Garbage on a raw connection: the daemon answers or closes, within a bound.
async fn garbage<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(mut s: S, bytes: &[u8]) {
    let _ = s.write_all(bytes).await;
    let _ = s.shutdown().await;
    let mut sink = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut sink)).await;
    assert!(r.is_ok(), "the daemon neither answered nor closed a connection that sent garbage");
}

/// HTTP/2 with frames that break the protocol after a valid start.
fn h2_garbage(kind: u8, flags: u8, stream: u32, payload: &[u8], path: &str) -> Vec<u8> {
    let mut b = kvtests::h2raw::preface();
    b.extend(kvtests::h2raw::grpc_headers(1, path));
    b.extend(kvtests::h2raw::grpc_prefix(payload.len() as u32));
    let len = payload.len();
    b.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
    b.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    b.extend_from_slice(payload);
    b
}

#[test]
fn daemon_survives_arbitrary_input() {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        hook(info);
    }));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let d = rt.block_on(start());
    // A real engine with 2 blocks saved, checked again at the end.
    let (owner, mut mem, real) = rt.block_on(async {
        let mut mem = KvMemory::anonymous(&layout(), 8).unwrap();
        let len = layout().block_bytes() as usize;
        for b in 0..2 {
            mem.write_block(b, &synthetic_block(7, b, len));
        }
        let c = Client::connect(&d.socket).await.unwrap();
        c.register("owner", &Namespace::new("m", layout()), &mem).await.unwrap();
        c.save(&prompt(2), 0, &[0, 1]).await.unwrap();
        let id = c.engine_id_now().unwrap();
        (c, mem, id)
    });
    let client = rt.block_on(raw_client(&d.socket));

    let mut runner =
        TestRunner::new(RunnerConfig { cases: cases(200), failure_persistence: None, ..RunnerConfig::default() });
    runner
        .run(&proptest::collection::vec(call(real), 1..4), |calls| {
            rt.block_on(async {
                let mut client = client.clone();
                for c in calls {
                    let what = format!("{c:?}");
                    if let Err(s) = send(&mut client, &d.socket, c).await {
                        prop_assert!(
                            !matches!(s.code(), tonic::Code::Internal | tonic::Code::Unknown),
                            "{:?} {}: {}",
                            s.code(),
                            s.message(),
                            kvproto::limits::clip(&what, 400)
                        );
                    }
                }
                Ok(())
            })
        })
        .unwrap();

    // Garbage bytes on the Unix socket and the TCP port, and HTTP/2 broken after its preface.
    let mut runner =
        TestRunner::new(RunnerConfig { cases: cases(200) / 4, failure_persistence: None, ..RunnerConfig::default() });
    let strategy = (
        bytes(300),
        any::<bool>(),
        0u8..12,
        any::<u8>(),
        prop_oneof![Just(1u32), any::<u32>()],
        proptest::sample::select(METHODS),
    );
    runner
        .run(&strategy, |(b, h2, kind, flags, stream, method)| {
            rt.block_on(async {
                let input = if h2 { h2_garbage(kind, flags, stream, &b, method) } else { b.clone() };
                garbage(tokio::net::UnixStream::connect(&d.socket).await.unwrap(), &input).await;
                garbage(tokio::net::TcpStream::connect(d.tcp).await.unwrap(), &input).await;
                // "KVFD" starts an ATTACH exchange: garbage after it too.
                let mut attach = b"KVFD".to_vec();
                attach.extend_from_slice(&b);
                garbage(tokio::net::UnixStream::connect(&d.socket).await.unwrap(), &attach).await;
                // "KVLK" starts a LOOKUP connection: garbage in place of its hello, and after it.
                let mut lookup = b"KVLK".to_vec();
                lookup.extend_from_slice(&b);
                garbage(tokio::net::UnixStream::connect(&d.socket).await.unwrap(), &lookup).await;
                let mut framed = kvproto::lookup_wire::hello().to_vec();
                framed.extend_from_slice(&b);
                garbage(tokio::net::UnixStream::connect(&d.socket).await.unwrap(), &framed).await;
            });
            Ok(())
        })
        .unwrap();

    // Still serving: health, and the real engine's blocks byte-exact.
    rt.block_on(async {
        let r = reqwest::get(format!("http://{}/healthz", d.http)).await.unwrap();
        let status = r.status();
        assert!(status.is_success(), "{status}: {}", r.text().await.unwrap_or_default());
        let len = layout().block_bytes() as usize;
        for b in 2..4 {
            mem.write_block(b, &vec![0; len]);
        }
        let st = owner.load_now(&prompt(2), 0, &[2, 3]).await.unwrap();
        assert_eq!(st.loaded_blocks, 2, "{st:?}");
        for (slot, b) in [(2, 0), (3, 1)] {
            assert_eq!(mem.read_block(slot), synthetic_block(7, b, len));
        }
        let _ = d.stop.send(());
        d.task.await.unwrap().unwrap();
    });
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "the daemon panicked on input from a client");
}
