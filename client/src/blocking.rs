//! [`BlockingClient`]: the async client behind a private runtime, for engines that are not
//! async.

use std::path::Path;
use std::time::Duration;

use kvproto::{Namespace, pb};

use crate::client::{Client, LoadOp};
use crate::error::ClientError;
use crate::memory::KvMemory;

/// A blocking client. Do not call it from inside an async runtime.
#[derive(Debug)]
pub struct BlockingClient {
    rt: tokio::runtime::Runtime,
    client: Client,
}

impl BlockingClient {
    pub fn connect(socket: impl AsRef<Path>) -> Result<Self, ClientError> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let client = rt.block_on(Client::connect(socket))?;
        Ok(Self { rt, client })
    }

    /// See [`Client::set_token_area_bytes`] (before registering).
    pub fn set_token_area_bytes(&mut self, bytes: usize) -> bool {
        self.client.set_token_area_bytes(bytes)
    }

    /// See [`Client::token_area_active`].
    pub fn token_area_active(&self) -> bool {
        self.client.token_area_active()
    }

    pub fn register(
        &self,
        engine_name: &str,
        ns: &Namespace,
        memory: &KvMemory,
    ) -> Result<pb::RegisterResponse, ClientError> {
        self.rt.block_on(self.client.register(engine_name, ns, memory))
    }

    /// See [`Client::register_worker`].
    pub fn register_worker(
        &self,
        engine_name: &str,
        ns: &Namespace,
        memory: &KvMemory,
        address: &str,
        role: &str,
    ) -> Result<pb::RegisterResponse, ClientError> {
        self.rt.block_on(self.client.register_worker(engine_name, ns, memory, address, role))
    }

    /// See [`Client::lookup_routed`].
    pub fn lookup_routed(
        &self,
        tokens: &[u32],
        route_id: u64,
        g1_blocks: u32,
    ) -> Result<pb::LookupResponse, ClientError> {
        self.rt.block_on(self.client.lookup_routed(tokens, route_id, g1_blocks))
    }

    /// See [`Client::gpu_stored`].
    pub fn gpu_stored(&self, tokens: &[u32], first_block: u32) -> Result<Vec<kvproto::BlockKey>, ClientError> {
        self.rt.block_on(self.client.gpu_stored(tokens, first_block))
    }

    /// See [`Client::gpu_removed_keys`].
    pub fn gpu_removed_keys(&self, keys: &[kvproto::BlockKey]) -> Result<(), ClientError> {
        self.rt.block_on(self.client.gpu_removed_keys(keys))
    }

    /// See [`Client::report_load`].
    pub fn report_load(&self, running: u32, waiting: u32, used: u64, total: u64) -> Result<(), ClientError> {
        self.rt.block_on(self.client.report_load(running, waiting, used, total))
    }

    pub fn save(&self, tokens: &[u32], first_block: u32, slots: &[u32]) -> Result<pb::SaveResponse, ClientError> {
        self.rt.block_on(self.client.save(tokens, first_block, slots))
    }

    /// See [`Client::lookup`]: over LOOKUP with blocking I/O on this thread
    /// ([`Client::lookup_blocking`]) when it can, through the runtime otherwise.
    pub fn lookup(&self, tokens: &[u32]) -> Result<pb::LookupResponse, ClientError> {
        self.client.lookup_blocking(tokens).unwrap_or_else(|| self.rt.block_on(self.client.lookup(tokens)))
    }

    pub fn load(&self, tokens: &[u32], first_block: u32, slots: &[u32]) -> Result<LoadOp, ClientError> {
        self.rt.block_on(self.client.load(tokens, first_block, slots))
    }

    pub fn load_now(&self, tokens: &[u32], first_block: u32, slots: &[u32]) -> Result<pb::LoadStatus, ClientError> {
        self.rt.block_on(self.client.load_now(tokens, first_block, slots))
    }

    /// [`Client::load_from`]: a load that may pull what this node lacks from `sources` (peer
    /// daemons' `host:port`), to its end.
    pub fn load_from(
        &self,
        tokens: &[u32],
        first_block: u32,
        slots: &[u32],
        sources: &[String],
    ) -> Result<pb::LoadStatus, ClientError> {
        self.rt.block_on(self.client.load_from(tokens, first_block, slots, sources))
    }

    pub fn wait(&self, op: &LoadOp, timeout: Duration) -> Result<pb::LoadStatus, ClientError> {
        self.rt.block_on(self.client.wait(op, timeout))
    }

    pub fn poll(&self, op: &LoadOp) -> Result<pb::LoadStatus, ClientError> {
        self.rt.block_on(self.client.poll(op))
    }

    pub fn stats(&self) -> Result<pb::StatsResponse, ClientError> {
        self.rt.block_on(self.client.stats())
    }

    pub fn unregister(&self) -> Result<(), ClientError> {
        self.rt.block_on(self.client.unregister())
    }

    /// The async client underneath.
    pub fn inner(&self) -> &Client {
        &self.client
    }
}
