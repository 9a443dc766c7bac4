//! `kvbench`: benchmarks of kvcached.
//!
//! # Layout
//! - `benches/tiers.rs`: criterion benches of G2 put/get and G3 write/read beside memcpy and
//!   raw O_DIRECT I/O on the same sizes, in the same run.
//! - [`raw`]: the physical-limit baselines (memcpy, O_DIRECT pread/pwrite) those benches
//!   compare against.
//!
//! Later: the `kvbench` load generator and trace replayer that drives real daemons and routers.

pub mod raw;
