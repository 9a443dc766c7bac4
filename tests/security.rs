//! The daemon (root, as in production) against hostile local clients: another uid on the Unix
//! socket (a child process of uid 65534, `src/bin/intruder.rs`), a TCP client, and floods of
//! connections and half-sent requests. Each test names the finding it closes
//! (docs/operations/security.md and the security pages it links).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use kvcached::Config;
use kvclient::{Client, KvMemory, synthetic_block};
use kvproto::Namespace;
use kvproto::pb;
use kvtests::fixture::small_layout as layout;
use kvtests::inproc::InProcess;
use kvtests::raw_grpc::{raw_client, raw_unary};
use tokio::io::AsyncWriteExt;

const NOBODY: u32 = 65534;

fn ns() -> Namespace {
    kvtests::fixture::small_namespace("m")
}

fn prompt(blocks: u32) -> Vec<u32> {
    kvtests::fixture::prompt(0, blocks)
}

/// Every line the daemons of this test binary log, at INFO and up as in production (one
/// subscriber for the process: the tests' daemons share it).
fn daemon_log() -> &'static std::sync::Mutex<Vec<u8>> {
    static LOG: std::sync::OnceLock<&'static std::sync::Mutex<Vec<u8>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let log: &'static std::sync::Mutex<Vec<u8>> = Box::leak(Box::default());
        struct Sink(&'static std::sync::Mutex<Vec<u8>>);
        impl std::io::Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .with_ansi(false)
            .with_writer(move || Sink(log))
            .try_init();
        log
    })
}

/// A root daemon in this process whose socket (mode 0666) and directory other uids can reach.
struct Daemon(InProcess);

impl std::ops::Deref for Daemon {
    type Target = InProcess;
    fn deref(&self) -> &InProcess {
        &self.0
    }
}

async fn start(tune: impl FnOnce(&mut Config)) -> Daemon {
    daemon_log();
    Daemon(InProcess::start(tune).await)
}

impl Daemon {
    async fn stop(self) {
        self.0.stop().await;
    }

    /// An engine of this (root) process with 8 slots, the first 2 filled and saved.
    async fn engine(&self) -> (Client, KvMemory) {
        let mut mem = KvMemory::anonymous(&layout(), 8).unwrap();
        let len = layout().block_bytes() as usize;
        for b in 0..2 {
            mem.write_block(b, &synthetic_block(7, b, len));
        }
        let c = Client::connect(&self.socket).await.unwrap();
        c.register("owner", &ns(), &mem).await.unwrap();
        c.save(&prompt(2), 0, &[0, 1]).await.unwrap();
        (c, mem)
    }

    /// `intruder ARGS` as uid 65534.
    fn intruder(&self, args: &[&str]) -> std::process::Child {
        let mut c = self.as_uid(Path::new(env!("CARGO_BIN_EXE_intruder")), NOBODY, args);
        c.stdout(std::process::Stdio::piped());
        kvtests::inproc::retry_busy(|| c.spawn()).unwrap()
    }

    fn intruder_says(&self, args: &[&str]) -> String {
        self.say_as(Path::new(env!("CARGO_BIN_EXE_intruder")), NOBODY, args)
    }
}

fn register_request(kind: pb::memory_region::Kind, token_area: Option<pb::TokenArea>) -> pb::RegisterRequest {
    let seg = layout().segment_bytes();
    pb::RegisterRequest {
        engine_name: "raw".into(),
        namespace: Some(pb::NamespaceSpec::from(&ns())),
        region: Some(pb::MemoryRegion { kind: Some(kind), size_bytes: 4 * 8 * seg, cuda_device: 0 }),
        segments: (0..4).map(|i| pb::Segment { offset: i * 8 * seg, block_stride: seg }).collect(),
        segment_bytes: seg,
        num_blocks: 8,
        token_area,
        ..Default::default()
    }
}

/// Findings 1 and 2: the daemon opened paths a client named (a token area of /etc/shadow became
/// a read oracle; a KV memory file of root's became a write primitive). It takes descriptors
/// only: a path is refused with an error that says what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(deprecated)]
async fn paths_are_refused_for_kv_memory_and_token_areas() {
    let d = start(|_| {}).await;
    let mut c = raw_client(&d.socket).await;
    let e =
        c.register(register_request(pb::memory_region::Kind::ShmPath("/etc/passwd".into()), None)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("paths are not accepted") && e.message().contains("ATTACH"), "{}", e.message());
    // A good KV memory descriptor, and a token area by path: registered, the area refused, and
    // the answer says why.
    let mem = KvMemory::anonymous(&layout(), 8).unwrap();
    let t = kvclient::attach::attach(&d.socket, &[mem.file()]).unwrap();
    let area = pb::TokenArea { shm_path: "/etc/shadow".into(), size_bytes: 4096, fd_ticket: Vec::new() };
    let r = c.register(register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), Some(area))).await.unwrap();
    let r = r.into_inner();
    assert!(!r.token_area_accepted);
    assert!(r.token_area_error.contains("paths are not accepted"), "{}", r.token_area_error);
    // A ticket is single-use: a second registration with it is refused.
    let e = c.register(register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), None)).await.unwrap_err();
    assert!(e.message().contains("fd ticket"), "{}", e.message());
    d.stop().await;
}

/// Finding 2: over TCP nothing proves who the client is; until authentication exists only
/// Health is served there, with a reason a client can act on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_serves_only_health() {
    let d = start(|c| c.tcp = Some("127.0.0.1:0".parse().unwrap())).await;
    let mut c = pb::kvcached_client::KvcachedClient::connect(format!("http://{}", d.tcp.unwrap())).await.unwrap();
    assert!(c.health(pb::Empty {}).await.unwrap().into_inner().ok);
    let mem = KvMemory::anonymous(&layout(), 8).unwrap();
    let t = kvclient::attach::attach(&d.socket, &[mem.file()]).unwrap();
    let refused = [
        c.register(register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), None)).await.map(|_| ()),
        c.stats(pb::Empty {}).await.map(|_| ()),
        c.lookup(pb::LookupRequest::default()).await.map(|_| ()),
        c.load(pb::LoadRequest::default()).await.map(|_| ()),
    ];
    for r in refused {
        let s = r.unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
        let reason = s.metadata().get(kvproto::reason::METADATA_KEY).unwrap().to_str().unwrap();
        assert_eq!(reason, "wrong-transport");
    }
    d.stop().await;
}

/// Finding 3: an engine id was a bearer token. An engine answers only the uid that registered
/// it: to another uid it does not exist, whatever it tries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_answer_only_the_uid_that_registered_them() {
    kvtests::require_root!("to run a client as another uid");
    let d = start(|_| {}).await;
    let (owner, mut mem) = d.engine().await;
    let id = owner.engine_id_now().unwrap().to_string();
    let said = d.intruder_says(&["use", &id]);
    assert_eq!(said, "heartbeat=NotFound load=NotFound wait=NotFound unregister=NotFound lookup=NotFound");
    // The owner's engine is untouched.
    let st = owner.load_now(&prompt(2), 0, &[4, 5]).await.unwrap();
    assert_eq!(st.loaded_blocks, 2);
    let len = layout().block_bytes() as usize;
    assert_eq!(mem.read_block(5), synthetic_block(7, 1, len));
    mem.write_block(5, &[0; 8]);
    d.stop().await;
}

/// Finding 3: one client could register engines up to `engines.max_engines` and lock everyone
/// out. A uid holds at most `limits.max_engines_per_uid`; the others are still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_uid_cannot_take_every_engine_slot() {
    kvtests::require_root!("to run a client as another uid");
    let d = start(|c| {
        c.limits.max_engines_per_uid = 3;
        c.engines.max_engines = 8;
    })
    .await;
    let said = d.intruder_says(&["register", "6"]);
    assert!(said.starts_with("registered=3 "), "{said}");
    assert!(said.contains("engines_per_uid"), "{said}");
    let (_owner, _mem) = d.engine().await;
    d.stop().await;
}

/// Finding 4: ~1100 idle connections used every descriptor and the accept loop spun; /healthz
/// and new clients hung. A uid holds at most `limits.max_connections_per_uid` connections (the
/// rest are closed at accept), a connection that says nothing is closed after the handshake
/// timeout, and other clients and /healthz are served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_of_one_uid_leave_the_others_served() {
    kvtests::require_root!("to run a client as another uid");
    let d = start(|c| {
        c.limits.max_connections_per_uid = 16;
        c.limits.handshake_timeout_ms = 500;
    })
    .await;
    let mut flood = d.intruder(&["hold", "300", "4"]);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Served meanwhile: a new engine, its save and load, and /healthz.
    let (owner, _mem) = d.engine().await;
    assert_eq!(owner.load_now(&prompt(2), 0, &[2, 3]).await.unwrap().loaded_blocks, 2);
    assert_eq!(d.healthz().await, 200);
    assert!(d.metric("kvcached_limit_refusals_total").await >= 1.0);
    assert!(d.metric("kvcached_connections").await <= 20.0, "the flood is bounded");
    // A connection that never sends a byte is closed after the handshake timeout.
    let mut silent = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    let mut buf = [0u8; 1];
    let closed =
        tokio::time::timeout(Duration::from_secs(5), tokio::io::AsyncReadExt::read(&mut silent, &mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    let _ = flood.kill();
    let _ = flood.wait();
    d.stop().await;
}

/// LOOKUP carries lookups without HTTP/2, so its bounds are its own: a request longer than
/// `limits.max_message_bytes` is refused from its length and one that does not decode is refused,
/// both closing the connection; a half-sent one is closed after `limits.request_timeout_ms`; a
/// hello of another version gets no hello back. Everyone else is served meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_lookup_connections_are_refused_and_closed() {
    use kvproto::lookup_wire;
    use kvtests::lookup_raw;
    let d = start(|c| {
        c.limits.request_timeout_ms = 500;
        c.limits.max_message_bytes = 1 << 20;
    })
    .await;
    let (owner, _mem) = d.engine().await;
    let id = owner.engine_id_now().unwrap();
    let ask =
        |engine_id| pb::LookupRequest { engine_id, tokens: kvproto::tokens_to_le(&prompt(2)), ..Default::default() };
    let soon = Duration::from_secs(5);

    let mut s = lookup_raw::open(&d.socket).await.unwrap();
    assert_eq!(lookup_raw::ask(&mut s, &ask(id)).await.unwrap().unwrap().matched_blocks, 2);
    // An engine this uid does not have: NOT_FOUND with its reason, and the connection goes on.
    let r = lookup_raw::ask(&mut s, &ask(id + 1000)).await.unwrap().unwrap_err();
    assert_eq!((r.code, r.reason.as_str()), (tonic::Code::NotFound as i32, "unknown-engine"), "{r:?}");
    assert_eq!(lookup_raw::ask(&mut s, &ask(id)).await.unwrap().unwrap().matched_blocks, 2);
    // Longer than the limit: refused before a byte of it is read (as gRPC refuses one), and closed.
    s.write_all(&(2u32 << 20).to_le_bytes()).await.unwrap();
    let r = lookup_raw::answer(&mut s).await.unwrap().unwrap_err();
    assert_eq!(r.code, tonic::Code::OutOfRange as i32, "{r:?}");
    assert!(r.message.contains("limits.max_message_bytes"), "{r:?}");
    assert!(lookup_raw::closed(&mut s, soon).await);
    // Bytes that are not a LookupRequest: refused, and closed.
    let mut s = lookup_raw::open(&d.socket).await.unwrap();
    s.write_all(&lookup_wire::request(&[0xff; 7])).await.unwrap();
    let r = lookup_raw::answer(&mut s).await.unwrap().unwrap_err();
    assert_eq!(r.code, tonic::Code::InvalidArgument as i32, "{r:?}");
    assert!(lookup_raw::closed(&mut s, soon).await);
    // Half a request: closed once the request timeout has passed (the idle one is 300 s).
    let mut s = lookup_raw::open(&d.socket).await.unwrap();
    let t = std::time::Instant::now();
    s.write_all(&[100, 0, 0, 0, 1, 2, 3]).await.unwrap();
    assert!(lookup_raw::closed(&mut s, soon).await, "a half-sent lookup held its connection");
    assert!(t.elapsed() >= Duration::from_millis(450), "closed before the request timeout: {:?}", t.elapsed());
    // A hello of another version: no hello back.
    let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    let mut hello = lookup_wire::hello();
    hello[4] = 9;
    s.write_all(&hello).await.unwrap();
    let mut back = Vec::new();
    let read = tokio::time::timeout(soon, tokio::io::AsyncReadExt::read_to_end(&mut s, &mut back)).await;
    assert!(matches!(read, Ok(Ok(_)) | Ok(Err(_))) && back.len() < lookup_wire::HELLO_BYTES, "{back:?}");
    // The owner is served throughout, over LOOKUP and over gRPC.
    assert_eq!(owner.lookup(&prompt(2)).await.unwrap().matched_blocks, 2);
    owner.set_lookup_wire(false);
    assert_eq!(owner.lookup(&prompt(2)).await.unwrap().matched_blocks, 2);
    d.stop().await;
}

/// A LOOKUP client that sends lookups and never reads the answers: once the socket's buffers
/// are full the daemon cannot write, and the request whose answer is stuck is given up at
/// `limits.request_timeout_ms` and the connection closed, instead of holding its slot and bytes
/// for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_client_that_never_reads_is_closed() {
    use kvtests::lookup_raw;
    let d = start(|c| c.limits.request_timeout_ms = 500).await;
    let (owner, _mem) = d.engine().await;
    let ask = pb::LookupRequest {
        engine_id: owner.engine_id_now().unwrap(),
        tokens: kvproto::tokens_to_le(&prompt(2)),
        ..Default::default()
    };
    let frame = kvproto::lookup_wire::request(&prost::Message::encode_to_vec(&ask));
    let mut s = lookup_raw::open(&d.socket).await.unwrap();
    let answer = lookup_raw::ask(&mut s, &ask).await.unwrap().unwrap();
    let answer_bytes = 5 + prost::Message::encoded_len(&answer);
    let (mut rd, mut wr) = s.into_split();
    // ~60k requests: far more answers than the socket buffers hold.
    let burst: Vec<u8> = frame.iter().copied().cycle().take(frame.len() * 60_000).collect();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&burst).await;
        wr
    });
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Reading now drains what was written; a daemon still waiting to write would go on
    // answering and then idle for 300 s.
    let mut sink = Vec::new();
    let drained =
        tokio::time::timeout(Duration::from_secs(20), tokio::io::AsyncReadExt::read_to_end(&mut rd, &mut sink)).await;
    assert!(drained.is_ok(), "the daemon kept a connection whose answers were not read");
    assert!(sink.len() < answer_bytes * 60_000, "every lookup was answered: the buffers never filled");
    let _ = writer.await;
    assert_eq!(owner.lookup(&prompt(2)).await.unwrap().matched_blocks, 2);
    d.stop().await;
}

/// Finding 4: 16 half-sent 60 MB messages on one connection raised RSS by 640 MB. A message
/// longer than `limits.max_message_bytes` is refused from its prefix, and the bytes of requests
/// still arriving are bounded per uid (`limits.max_buffered_bytes_per_uid`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_bounded() {
    let d = start(|c| {
        c.limits.max_message_bytes = 2 << 20;
        c.limits.max_buffered_bytes_per_uid = 4 << 20;
    })
    .await;
    let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    kvtests::h2raw::handshake(&mut s).await.unwrap();
    let chunk = vec![0x41u8; 16 << 10];
    // Eight streams, each announcing a 1.9 MB message and sending 1.5 MB of it: 12 MB in all,
    // three times the per-uid bound. The daemon refuses the stream that passes it (and may close
    // the connection): writes stop at the first error.
    let mut sent = 0usize;
    'streams: for i in 0..8u32 {
        let stream = 2 * i + 1;
        let mut first = kvtests::h2raw::grpc_prefix(1_900_000);
        first.extend_from_slice(&chunk[..chunk.len() - 5]);
        let mut frames = kvtests::h2raw::grpc_headers(stream, "/kvcached.v1.Kvcached/Save");
        frames.extend(kvtests::h2raw::data(stream, &first, false));
        if s.write_all(&frames).await.is_err() {
            break;
        }
        for _ in 1..96 {
            if s.write_all(&kvtests::h2raw::data(stream, &chunk, false)).await.is_err() {
                break 'streams;
            }
            sent += chunk.len();
        }
    }
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if d.metric("kvcached_limit_refusals_by_limit_total{limit=\"buffered_bytes_per_uid\"}").await >= 1.0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(refused.is_ok(), "the per-uid bound on bytes arriving was never reached ({sent} bytes of data sent)");
    // A message announced longer than the limit is refused from its prefix.
    let mut c = raw_client(&d.socket).await;
    let big = pb::SaveRequest { tokens: vec![0u8; 3 << 20].into(), ..Default::default() };
    let e = c.save(big).await.unwrap_err();
    assert!(matches!(e.code(), tonic::Code::OutOfRange | tonic::Code::ResourceExhausted), "{e:?}");
    // Served meanwhile.
    drop(s);
    let (owner, _mem) = d.engine().await;
    assert_eq!(owner.lookup(&prompt(2)).await.unwrap().matched_blocks, 2);
    drop((c, owner));
    d.stop().await;
}

/// Finding 4: a 16 MiB engine name was logged whole, twice, and a 100 KB path echoed in an error
/// overflowed the client's metadata limit. Names are bounded and what an error quotes is clipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_strings_are_refused_and_errors_stay_short() {
    let d = start(|_| {}).await;
    let mut c = raw_client(&d.socket).await;
    let mem = KvMemory::anonymous(&layout(), 8).unwrap();
    let t = kvclient::attach::attach(&d.socket, &[mem.file()]).unwrap();
    let mut req = register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), None);
    req.engine_name = "x".repeat(1 << 20);
    let e = c.register(req.clone()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("engine_name is 1048576 bytes") && e.message().len() < 512, "{}", e.message());
    req.engine_name = "ok".into();
    req.role = "r".repeat(100_000);
    let e = c.register(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().len() < 512, "{} bytes", e.message().len());
    // A name within its bound is logged; nothing the client sent is logged at length.
    req_ok(&mut c, &d.socket, &"n".repeat(128)).await;
    drop(c); // an open channel would hold the daemon's drain to its deadline
    d.stop().await;
    let log = daemon_log().lock().unwrap();
    let text = String::from_utf8_lossy(&log);
    assert!(text.contains(&"n".repeat(128)), "the registration was not logged:\n{text}");
    let longest = text.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2048, "a log line of {longest} bytes");
    assert!(!text.contains(&"x".repeat(200)) && !text.contains(&"r".repeat(200)), "a hostile string was logged whole");
}

/// Registers an engine named `name` and unregisters it.
async fn req_ok(c: &mut pb::kvcached_client::KvcachedClient<tonic::transport::Channel>, socket: &Path, name: &str) {
    let mem = KvMemory::anonymous(&layout(), 8).unwrap();
    let t = kvclient::attach::attach(socket, &[mem.file()]).unwrap();
    let mut req = register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), None);
    req.engine_name = name.into();
    let id = c.register(req).await.unwrap().into_inner().engine_id;
    c.unregister(pb::EngineRef { engine_id: id }).await.unwrap();
}

/// Finding 5: malformed protobuf was INTERNAL; a load with bad slots answered OK with a FAILED
/// status where a save said INVALID_ARGUMENT; a layout whose slots all alias was accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_everywhere() {
    let d = start(|_| {}).await;
    // A body that is not a RegisterRequest (a length-delimited field that runs past the end).
    let e = raw_unary(&d.socket, "/kvcached.v1.Kvcached/Register", vec![0x0a, 0x7f, 0x01]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("malformed request"), "{}", e.message());

    let (owner, _mem) = d.engine().await;
    let id = owner.engine_id_now().unwrap();
    let mut c = raw_client(&d.socket).await;
    let tokens = kvproto::tokens_to_le(&prompt(2));
    for (block_ids, why) in [(vec![0, 99], "out of range"), (vec![0, 1, 2], "full blocks"), (vec![1, 1], "named twice")]
    {
        let e = c
            .load(pb::LoadRequest {
                engine_id: id,
                tokens: tokens.clone(),
                block_ids,
                wait: true,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(why), "{}", e.message());
    }
    // Every segment at offset 0 with stride 0: every slot is the same bytes.
    let mem = KvMemory::anonymous(&layout(), 8).unwrap();
    let t = kvclient::attach::attach(&d.socket, &[mem.file()]).unwrap();
    let mut req = register_request(pb::memory_region::Kind::FdTicket(t[0].to_vec()), None);
    for s in &mut req.segments {
        (s.offset, s.block_stride) = (0, 0);
    }
    let e = c.register(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("overlap"), "{}", e.message());
    d.stop().await;
}

/// A TCP peer that accepts and never answers: a load naming it as a source stays pending until
/// the daemon's `peer.pull_deadline_ms` (or its request timeout).
fn stalled_peer() -> (std::net::TcpListener, String) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

/// Blocks no engine saved: loads of them go to the named sources.
fn unseen(blocks: u32) -> Vec<u32> {
    (0..blocks * 16).map(|i| 200_000 + i).collect()
}

/// Finding 4: loads in flight are bounded per uid over all its engines
/// (`limits.max_pending_loads_per_uid`): past it a load is refused `RESOURCE_EXHAUSTED`, reason
/// `limit-reached`, counted; when the pending ones end the uid loads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_loads_are_bounded_per_uid_over_its_engines() {
    let (_stall, src) = stalled_peer();
    let d = start(|c| {
        c.limits.max_pending_loads_per_uid = 2;
        c.peer.allowed_sources = vec!["127.0.0.0/8".into()];
        c.peer.pull_deadline_ms = 3000;
        c.peer.io_timeout_ms = 3000;
    })
    .await;
    let (a, _ma) = d.engine().await;
    let (b, _mb) = d.engine().await;
    let mut pending = Vec::new();
    for c in [a.clone(), b.clone()] {
        let src = src.clone();
        pending.push(tokio::spawn(async move { c.load_from(&unseen(2), 0, &[4, 5], &[src]).await }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for c in [&a, &b] {
        let e = c.load_now(&prompt(2), 0, &[2, 3]).await.unwrap_err();
        assert_eq!(e.reason(), Some(kvproto::reason::Reason::LimitReached), "{e}");
        assert!(e.to_string().contains("loads per uid"), "{e}");
    }
    assert!(d.metric("kvcached_limit_refusals_by_limit_total{limit=\"pending_loads_per_uid\"}").await >= 2.0);
    // The stalled pulls end as misses (never wrong bytes); then the uid loads again.
    for p in pending {
        let st = p.await.unwrap().unwrap();
        assert_eq!(st.loaded_blocks, 0, "{st:?}");
    }
    assert_eq!(a.load_now(&prompt(2), 0, &[2, 3]).await.unwrap().loaded_blocks, 2);
    d.stop().await;
}

/// `limits.idle_timeout_ms`: a connection past its handshake that then sends nothing is
/// closed; `limits.request_timeout_ms`: a request that runs longer is answered `CANCELLED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_and_long_requests_cancelled() {
    let (_stall, src) = stalled_peer();
    let d = start(|c| {
        c.limits.idle_timeout_ms = 1000;
        c.limits.request_timeout_ms = 500;
        c.peer.allowed_sources = vec!["127.0.0.0/8".into()];
        c.peer.pull_deadline_ms = 10_000;
        c.peer.io_timeout_ms = 10_000;
    })
    .await;
    let mut s = tokio::net::UnixStream::connect(&d.socket).await.unwrap();
    kvtests::h2raw::handshake(&mut s).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 4096];
        loop {
            match tokio::io::AsyncReadExt::read(&mut s, &mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "an idle connection stayed open past limits.idle_timeout_ms");

    let (a, _ma) = d.engine().await;
    let t = std::time::Instant::now();
    let e = a.load_from(&unseen(2), 0, &[4, 5], &[src]).await.unwrap_err();
    match &e {
        kvclient::ClientError::Rpc(s) => assert_eq!(s.code(), tonic::Code::Cancelled, "{e}"),
        other => panic!("expected CANCELLED, got {other}"),
    }
    assert!(t.elapsed() < Duration::from_secs(8), "the request ran to the pull deadline: {:?}", t.elapsed());
    d.stop().await;
}

/// An engine (or anyone reaching `POST /prefetch`) names the sources of its blocks; the daemon
/// dials only those in `peer.peers` / `peer.allowed_sources`. Otherwise an engine could make the
/// daemon connect anywhere and present the daemon's own peer credentials there. A refused
/// source is counted, never connected to, and leaves `/healthz` healthy; the load is a miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_outside_the_allowed_ones_are_never_dialed() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let src = listener.local_addr().unwrap().to_string();
    let dialed = || {
        let mut n = 0;
        while listener.accept().is_ok() {
            n += 1;
        }
        n
    };
    let body = serde_json::json!({
        "namespace": hex(&ns().id().0),
        "keys": ns().block_keys(&unseen(2)).iter().map(|k| hex(&k.0)).collect::<Vec<_>>(),
        "sources": [src.clone()],
    })
    .to_string();
    let prefetch = |http: std::net::SocketAddr| {
        let body = body.clone();
        async move {
            let r = reqwest::Client::new()
                .post(format!("http://{http}/prefetch"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };

    // Default: nothing beyond peer.peers (empty).
    // The HTTP port opened explicitly: this test is about which sources a hint may name.
    let d = start(|c| {
        c.peer.pull_deadline_ms = 1000;
        c.metrics_auth.open = true;
    })
    .await;
    let (a, _ma) = d.engine().await;
    let done = a.load_from(&unseen(2), 0, &[4, 5], std::slice::from_ref(&src)).await.unwrap();
    assert_eq!(done.loaded_blocks, 0, "{done:?}");
    let (status, answer) = prefetch(d.http).await;
    assert_eq!(status, 200, "{answer}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(dialed(), 0, "the daemon dialed a source no one allowed");
    assert!(d.metric("kvcached_peer_sources_refused_total").await >= 2.0);
    assert_eq!(d.healthz().await, 200, "a refused source is the client's fault, not the daemon's");
    drop(a);
    d.stop().await;

    // The same source allowed by network: dialed (so the check above can fail).
    let d = start(|c| {
        c.metrics_auth.open = true;
        c.peer.allowed_sources = vec!["127.0.0.0/8".into()];
        c.peer.pull_deadline_ms = 1000;
        c.peer.io_timeout_ms = 500;
    })
    .await;
    let (a, _ma) = d.engine().await;
    let done = a.load_from(&unseen(2), 0, &[4, 5], std::slice::from_ref(&src)).await.unwrap();
    assert_eq!(done.loaded_blocks, 0, "{done:?}");
    assert!(dialed() >= 1, "an allowed source was not dialed");
    drop(a);
    d.stop().await;
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
