//! `kvtests`: scenarios that span kvcached's parts (the daemon, the client engines link, the
//! router, the wire formats between them), with real processes and sockets.
//!
//! # Layout
//! - `daemon_e2e.rs`: the daemon through its real socket, in process (`serve` on temp sockets)
//!   and as a process, driven by the real client and by engines in processes of their own.
//! - `cluster.rs`: a router and two daemons as processes, engines attached; restarts of each.
//! - `router_*.rs`: a real router on port 0 fed by publishers (the daemon's own publishing side:
//!   [`kvcached::export::publish`], its recovery routes, its vLLM-format export) and by an independent
//!   Python encoder of vLLM's events (`py/`).
//! - [`router_harness`]: a router on port 0 and a JSON client of its API.
//! - [`cluster_harness`]: a router in process, daemons as processes publishing to it, engines.
//! - [`nats`]: a real NATS server with JetStream (users, permissions, restarts).
//! - `bus.rs`: daemons and router replicas through NATS JetStream.
//! - [`s3`]: a real S3-compatible server (SeaweedFS) on ports of its own.
//! - `g4.rs`: G4 against it: daemons sharing a bucket, tenants, faults, restarts.
//! - [`fake_peer`]: a peer daemon that misbehaves as told (fault injection for pulls).
//! - [`oracle`]: engines that know what they saved (prompts and KV from a seed), so every block
//!   served is checked byte for byte.
//! - [`node`]: a daemon process restarted (cleanly or by `kill -9`) with the same
//!   configuration, and a fault file switching injected faults while it runs.
//! - `crash.rs`: crash loops: the daemon killed at random moments under load, cycle after cycle.
//! - `faults.rs`, `faults_remote.rs`: faults injected into G3's I/O, a disk that fills up, G4 down,
//!   hung or slow, a peer stalling mid-stream.
//! - [`proc`]: a daemon as a process (optionally in a network namespace), and plain HTTP.
//! - [`netns`]: two "nodes" as network namespaces joined by a shaped veth pair.
//! - `peer.rs`: daemons pulling blocks from each other (handoff, prefetch, faults, credentials).
//! - `replay.rs`: a short `kvbench replay`: a trace through daemon processes and a router process.
//! - [`h2raw`]: HTTP/2 frames by hand, for requests no gRPC client would send.
//! - [`lookup_raw`]: LOOKUP connections by hand, for lookups no client would send.
//! - [`raw_grpc`]: the daemon's gRPC API over its socket without the client crate, raw bodies.
//! - [`fixture`]: the small layout, prompts, child processes killed when dropped.
//! - [`inproc`]: a root daemon in this process that other uids can reach.
//! - `security.rs`: the daemon against hostile local clients (another uid, TCP, floods).
//! - `security_floods.rs`: floods of idle or slow connections on `peer.listen`, the HTTP port and
//!   the TCP gRPC port; the real peer and the probes are still served.
//! - `shared_node.rs`: a node shared by users who do not trust each other: the trust model
//!   (who reads and writes a namespace), salts, fair shares, engine memory, bytes held.
//! - `tenants.rs`: tenant salts and quotas, a tenant of another uid beside.
//! - `src/bin/`: `daemon` and `router` (the real kvcached and kvrouter command lines) and `engine`, an engine in
//!   a process of its own.

pub mod cluster_harness;
pub mod fake_peer;
pub mod fixture;
pub mod h2raw;
pub mod inproc;
pub mod lookup_raw;
pub mod nats;
pub mod netns;
pub mod node;
pub mod oracle;
pub mod proc;
pub mod raw_grpc;
pub mod router_harness;
pub mod s3;

/// The layout of `tests/tenants.rs`'s engines (16 KiB blocks of 16 tokens).
pub fn tenant_layout() -> kvproto::KvLayout {
    fixture::small_layout()
}

/// The prompt of `tests/tenants.rs`: `blocks` blocks of 16 tokens.
pub fn tenant_prompt(blocks: u32) -> Vec<u32> {
    fixture::prompt(0, blocks)
}
