//! `kvbench`: drives a kvcached daemon through its real socket and prints Markdown tables.
//!
//! `cargo run --release -p kvbench -- socket` starts a daemon in this process on a temp socket
//! (G3 off unless `--g3`); `--socket PATH` measures a running daemon instead. `kvbench replay`
//! replays a Mooncake trace through real daemon processes and a real router (peers behind
//! `--lmcache`, `--redis`); `kvbench many` runs many engines at once on one daemon; `kvbench bus`
//! drives the event plane (NATS JetStream and HTTP push) at the scale of a large cluster.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvbench::cli::{ManyArgs, ReplayArgs};
use kvbench::socket::{SocketBench, markdown, run};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Save/load throughput beside memcpy, lookup latency of a 128k-token prompt, small-batch p50/p99.
    Socket {
        /// A running daemon's socket (default: start one in this process).
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
        /// Directory for shared-memory KV and the in-process daemon (default: /dev/shm).
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// Throughput calls per block size (32 MiB each).
        #[arg(long, default_value_t = 40)]
        calls: usize,
        /// Untimed calls per block size before the timed ones. The default, 72 calls of 32 MiB,
        /// writes the in-process daemon's 2 GiB G2 pool about once over (eviction reuses pages
        /// before the last ones are reached: hence the margin), so that the timed saves measure
        /// a daemon that has been serving for a while: on this VM the first write into memory
        /// populated earlier runs at a fraction of the speed of the writes after it
        /// (docs/benchmarks.md). With `--socket` the calls go to that daemon and evict ~7 GiB
        /// of its G2 per run; set it to what its pool needs.
        #[arg(long, default_value_t = 72)]
        warmup: usize,
        /// Latency samples per operation.
        #[arg(long, default_value_t = 200)]
        samples: usize,
        /// Let the in-process daemon write through to G3 as well.
        #[arg(long)]
        g3: bool,
        /// The in-process daemon's key memo in bytes (default: the daemon's default); 0 makes
        /// every request derive its keys, as the first request for a prompt does.
        #[arg(long)]
        key_memo_bytes: Option<u64>,
        /// The clients' shared-memory token area in bytes (default: the client's default, 4
        /// MiB); 0 sends every prompt's tokens inline in its request.
        #[arg(long)]
        token_area_bytes: Option<usize>,
    },
    /// Peer transfer of 2 MiB blocks beside a raw TCP copy loop and HTTP/2 streaming.
    Peer {
        /// Blocks pulled per round (2 MiB each).
        #[arg(long, default_value_t = 256)]
        blocks: u32,
        /// Run across two network namespaces joined by a veth pair shaped to this many Mbit/s
        /// (root only) instead of loopback.
        #[arg(long)]
        netns_mbit: Option<u64>,
    },
    /// G4 against a real S3-compatible server (SeaweedFS, started here) beside raw object_store.
    G4 {
        /// Blocks of each size (256 KiB and 2 MiB).
        #[arg(long, default_value_t = 128)]
        count: u32,
        /// Requests in flight.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
    },
    /// A Mooncake-format trace through real kvcached daemons (processes) and a real router,
    /// beside the router's simulation; peers (LMCache, Redis) on the same blocks behind flags.
    Replay(Box<ReplayArgs>),
    /// Many engines saving and loading at once on one daemon, beside a 2-thread memcpy.
    Many(ManyArgs),
    /// A real kvcached and kvrouter under sustained mixed load for minutes: RSS, descriptors,
    /// threads, /dev/shm and latency sampled; fails when one keeps growing (scripts/soak).
    Soak(kvbench::soak::SoakArgs),
    /// The event plane at scale: simulated publishers into kvrouter replicas through a real
    /// nats-server (JetStream) and by HTTP push, beside the index's own rate.
    Bus(kvbench::bus::BusArgs),
}

/// Runs an async command on a 2-thread runtime and prints its Markdown.
fn run_async<F>(f: F) -> ExitCode
where
    F: std::future::Future<Output = Result<String, String>>,
{
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(f) {
        Ok(md) => {
            print!("{md}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn g4(count: u32, concurrency: usize) -> ExitCode {
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvbench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let s3 = kvtests::s3::SeaweedFs::start(&dir.path().join("s3"));
    // SAFETY: set before any other thread exists (the server runs in its own process).
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", kvtests::s3::ACCESS_KEY);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", kvtests::s3::SECRET_KEY);
    }
    let report =
        kvbench::g4::run(&s3.endpoint, kvtests::s3::BUCKET, count.max(16), concurrency.max(1)).and_then(|mut r| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            r.prompt = Some(rt.block_on(kvbench::g4::prompt_from_g4(
                &s3.endpoint,
                kvtests::s3::BUCKET,
                dir.path(),
                concurrency.max(1),
            ))?);
            Ok(r)
        });
    match report {
        Ok(r) => {
            print!("{}", kvbench::g4::markdown(&r));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (socket, dir, calls, warmup, samples, g3, key_memo_bytes, token_area_bytes) = match cli.command {
        Command::Socket { socket, dir, calls, warmup, samples, g3, key_memo_bytes, token_area_bytes } => {
            (socket, dir, calls, warmup, samples, g3, key_memo_bytes, token_area_bytes)
        }
        Command::G4 { count, concurrency } => return g4(count, concurrency),
        Command::Replay(a) => return run_async(kvbench::cli::replay(&a)),
        Command::Many(a) => return run_async(kvbench::cli::many(&a)),
        Command::Soak(a) => return kvbench::soak::main(&a),
        Command::Bus(a) => {
            return run_async(async move { kvbench::bus::run(&a).await.map(|r| kvbench::bus::markdown(&r, &a)) });
        }
        Command::Peer { blocks, netns_mbit } => {
            return match kvbench::peer::run(blocks.max(8), netns_mbit) {
                Ok(r) => {
                    print!("{}", kvbench::peer::markdown(&r));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("kvbench: {e}");
                    ExitCode::FAILURE
                }
            };
        }
    };
    let base = dir.unwrap_or_else(|| {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() }
    });
    let tmp = match tempfile::tempdir_in(&base) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvbench: cannot create a directory in {}: {e}", base.display());
            return ExitCode::FAILURE;
        }
    };
    let cfg = SocketBench {
        socket,
        dir: tmp.path().to_path_buf(),
        calls: calls.max(1),
        warmup,
        samples: samples.max(1),
        g3,
        key_memo_bytes,
        token_area_bytes,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvbench: cannot start a runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&cfg)) {
        Ok(r) => {
            print!("{}", markdown(&r));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvbench: {e}");
            ExitCode::FAILURE
        }
    }
}
