//! `kvbench`: benchmarks of kvcached.
//!
//! # Layout
//! - `benches/tiers.rs`: criterion benches of G2 put/get and G3 write/read beside memcpy and
//!   raw O_DIRECT I/O on the same sizes, in the same run.
//! - [`g4`]: G4 against a real S3-compatible server beside raw `object_store` at the same
//!   concurrency; object granularity; the probe through a slow store (`kvbench g4`).
//! - [`peer`]: peer transfer (the pull of 2 MiB blocks G2 to G2) beside a raw TCP copy loop
//!   and HTTP/2 streaming between the same endpoints, on loopback or a shaped veth pair
//!   (`kvbench peer`).
//! - [`raw`]: the physical-limit baselines (memcpy, O_DIRECT pread/pwrite) those benches
//!   compare against.
//! - [`socket`]: the daemon through its real socket (save/load throughput beside memcpy, lookup
//!   and small-batch latency), run by the `kvbench` binary (`src/bin/kvbench.rs`).

pub mod g4;
pub mod peer;
pub mod raw;
pub mod socket;
