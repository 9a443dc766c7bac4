//! `kvbench`: benchmarks of kvcached.
//!
//! # Layout
//! - `benches/tiers.rs`: criterion benches of G2 put/get and G3 write/read beside memcpy and
//!   raw O_DIRECT I/O on the same sizes, in the same run.
//! - [`cli`]: the command lines of `kvbench replay` and `kvbench many`; [`document`]: the
//!   replay's whole report (the replay's results and the peers' run beside them).
//! - [`child`]: a daemon or router process of a run, with its log, stopped and checked.
//! - [`g4`]: G4 against a real S3-compatible server beside raw `object_store` at the same
//!   concurrency; object granularity; the probe through a slow store (`kvbench g4`).
//! - [`many`]: many engines saving and loading at once on one daemon process, beside a 2-thread
//!   memcpy, and a lookup's latency meanwhile (`kvbench many`).
//! - [`peer`]: peer transfer (the pull of 2 MiB blocks G2 to G2) beside a raw TCP copy loop
//!   and HTTP/2 streaming between the same endpoints, on loopback or a shaped veth pair
//!   (`kvbench peer`).
//! - [`peers`]: the same blocks of a trace through kvcached, LMCache's multi-process server and
//!   Redis, beside memcpy and O_DIRECT read (`kvbench replay --lmcache --redis`).
//! - [`raw`]: the physical-limit baselines (memcpy, O_DIRECT pread/pwrite) those benches
//!   compare against.
//! - [`soak`]: a real daemon and router under sustained mixed load for minutes, sampling RSS,
//!   descriptors, threads, `/dev/shm` and latency; fails when one grows (`kvbench soak`,
//!   `scripts/soak`).
//! - [`socket`]: the daemon through its real socket (save/load throughput beside memcpy, lookup
//!   and small-batch latency), run by the `kvbench` binary (`src/bin/kvbench.rs`).
//! - [`replay`]: a Mooncake-format trace through real daemons (processes), engines and a real
//!   router, beside the router's simulation of it (`kvbench replay`; `tests/replay.rs` runs a
//!   short one).

pub mod bus;
pub mod child;
pub mod cli;
pub mod document;
pub mod g4;
pub mod many;
pub mod peer;
pub mod peers;
pub mod raw;
pub mod replay;
pub mod soak;
pub mod socket;
