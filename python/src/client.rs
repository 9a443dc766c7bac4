//! `Client`: the client crate's `Client` with blocking methods that release the GIL.
//!
//! Each method blocks its calling thread on the process's runtime (`runtime.rs`) with the GIL
//! released (`Python::detach`), so other Python threads run meanwhile and several threads can
//! call one client at once; `kvcached.aio.AsyncClient` builds asyncio coroutines on that.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tokio::runtime::Runtime;

use crate::errors::{KvcachedError, to_py};
use crate::memory::{PyGpuKvMemory, PyKvMemory};
use crate::types::{
    LoadStatus, LookupResult, PyEngineHashes, PyKeyContext, PyNamespace, Registration, SaveResult, stats_dict,
};

/// Token ids from a Python object: any buffer of unsigned 32-bit integers (a NumPy `uint32`
/// array, `array.array("I")`) is read directly; anything else must be a sequence of ints.
fn tokens_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(buf) = PyBuffer::<u32>::get(obj) {
        return buf.to_vec(obj.py());
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err("tokens must be a sequence of token ids (ints), not text"));
    }
    obj.extract::<Vec<u32>>()
}

/// A load started with `Client.load`; wait for it with `Client.wait` or `Client.poll`. A load
/// lost with a restarted daemon is started again by `wait`.
#[pyclass(module = "kvcached", name = "LoadOp", frozen)]
#[derive(Debug, Clone)]
pub struct PyLoadOp {
    op: kvclient::LoadOp,
}

#[pymethods]
impl PyLoadOp {
    /// The daemon's id of the load (changes if it had to be started again).
    #[getter]
    fn id(&self) -> u64 {
        self.op.id()
    }

    fn __repr__(&self) -> String {
        format!("LoadOp(id={})", self.op.id())
    }
}

/// A connection to the node's kvcached daemon over its Unix socket.
///
/// `Client(socket=None, *, reconnect_for=30.0, token_area_bytes=None)` connects at once
/// (`socket` defaults to `$KVCACHED_SOCKET`, then the daemon's default path). Register KV memory
/// once, then save, look up and load blocks by prompt tokens; calls retry with backoff for
/// `reconnect_for` seconds across a daemon restart and register again. Every method releases the
/// GIL while it waits. A client belongs to the process that made it: after a fork, make a new
/// one in the child.
#[pyclass(module = "kvcached", name = "Client", frozen)]
#[derive(Debug)]
pub struct PyClient {
    client: kvclient::Client,
    rt: Arc<Runtime>,
    pid: u32,
    socket: PathBuf,
}

impl PyClient {
    /// Runs `f(client)` on the runtime with the GIL released; maps its error.
    fn call<T, F, Fut>(&self, py: Python<'_>, f: F) -> PyResult<T>
    where
        F: FnOnce(kvclient::Client) -> Fut + Send,
        Fut: Future<Output = Result<T, kvclient::ClientError>> + Send,
        T: Send,
    {
        if std::process::id() != self.pid {
            return Err(KvcachedError::new_err(format!(
                "this Client was made in process {} and cannot be used after a fork: make a new Client in this process",
                self.pid
            )));
        }
        let client = self.client.clone();
        let rt = Arc::clone(&self.rt);
        py.detach(move || rt.block_on(f(client))).map_err(|e| to_py(py, e))
    }
}

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{what} must be a number of seconds >= 0")))
}

#[pymethods]
impl PyClient {
    #[new]
    #[pyo3(signature = (socket = None, *, reconnect_for = 30.0, token_area_bytes = None))]
    fn new(
        py: Python<'_>,
        socket: Option<PathBuf>,
        reconnect_for: f64,
        token_area_bytes: Option<usize>,
    ) -> PyResult<Self> {
        let socket = socket.unwrap_or_else(kvclient::default_socket);
        let reconnect_for = seconds("reconnect_for", reconnect_for)?;
        let rt = crate::runtime::runtime().map_err(|e| crate::errors::ClientIOError::new_err(e.to_string()))?;
        let connect = {
            let (rt, socket) = (Arc::clone(&rt), socket.clone());
            py.detach(move || rt.block_on(kvclient::Client::connect(&socket)))
        };
        let mut client = connect.map_err(|e| to_py(py, e))?;
        // Both setters only act before the client is cloned or registered, which it is not yet.
        client.set_reconnect_for(reconnect_for);
        if let Some(bytes) = token_area_bytes {
            if bytes as u64 > kvproto::limits::TOKEN_AREA_MAX_BYTES {
                return Err(PyValueError::new_err(format!(
                    "token_area_bytes is at most {}",
                    kvproto::limits::TOKEN_AREA_MAX_BYTES
                )));
            }
            client.set_token_area_bytes(bytes);
        }
        Ok(Self { client, rt, pid: std::process::id(), socket })
    }

    /// The daemon's socket.
    #[getter]
    fn socket(&self) -> PathBuf {
        self.socket.clone()
    }

    /// The engine id the daemon gave this client, or None before `register` (it changes when
    /// the client registers again after a daemon restart).
    #[getter]
    fn engine_id(&self) -> Option<u64> {
        self.client.engine_id_now()
    }

    /// Whether long prompts' tokens travel through the shared-memory token area.
    #[getter]
    fn token_area_active(&self) -> bool {
        self.client.token_area_active()
    }

    /// Registers the engine's KV memory with its namespace (the layout is checked against the
    /// memory) and starts heartbeats. Engine names are at most 128 bytes.
    fn register(
        &self,
        py: Python<'_>,
        name: String,
        namespace: &PyNamespace,
        memory: &PyKvMemory,
    ) -> PyResult<Registration> {
        self.register_worker(py, name, namespace, memory, String::new(), String::new())
    }

    /// `register` for an engine a cluster router places requests on: `address` is where the
    /// router sends them, `role` its role (`prefill`, `decode`, `both`).
    fn register_worker(
        &self,
        py: Python<'_>,
        name: String,
        namespace: &PyNamespace,
        memory: &PyKvMemory,
        address: String,
        role: String,
    ) -> PyResult<Registration> {
        let (ns, mem) = (namespace.inner.clone(), Arc::clone(&memory.mem));
        self.call(py, move |c| async move { c.register_worker(&name, &ns, &mem, &address, &role).await })
            .map(Registration::from)
    }

    /// Registers KV memory in GPU memory (a CUDA IPC handle). Raises `NoCudaDeviceError` where
    /// the daemon's node has no CUDA device.
    #[pyo3(signature = (name, namespace, memory, address = String::new(), role = String::new()))]
    fn register_gpu(
        &self,
        py: Python<'_>,
        name: String,
        namespace: &PyNamespace,
        memory: &PyGpuKvMemory,
        address: String,
        role: String,
    ) -> PyResult<Registration> {
        let (ns, mem) = (namespace.inner.clone(), Arc::clone(&memory.mem));
        self.call(py, move |c| async move { c.register_gpu(&name, &ns, &mem, &address, &role).await })
            .map(Registration::from)
    }

    /// Saves blocks `first_block .. first_block + len(slots)` of the prompt `tokens` from those
    /// slots of the registered memory. The daemon derives every key from the tokens (and the
    /// request's `context`, a `KeyContext`, when it has one), or from `hashes`, the engine's
    /// own page hashes (an `EngineHashes`; `tokens` empty when it holds them).
    #[pyo3(signature = (tokens, first_block, slots, *, context = None, hashes = None))]
    fn save(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        first_block: u32,
        slots: Vec<u32>,
        context: Option<&PyKeyContext>,
        hashes: Option<&PyEngineHashes>,
    ) -> PyResult<SaveResult> {
        let tokens = tokens_of(tokens)?;
        let src = key_source(context, hashes)?;
        self.call(py, move |c| async move { c.save_keyed(&tokens, &src, first_block, &slots).await })
            .map(SaveResult::from)
    }

    /// How many leading blocks of `tokens` are cached, and in which tier. Moves no block data.
    /// With `first_block` > 0: the cached run that starts at that block (a sliding-window
    /// group's window), `matched_blocks` its length and `matched_tokens` the tokens through its
    /// end.
    #[pyo3(signature = (tokens, *, context = None, first_block = 0, hashes = None))]
    fn lookup(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        context: Option<&PyKeyContext>,
        first_block: u32,
        hashes: Option<&PyEngineHashes>,
    ) -> PyResult<LookupResult> {
        let tokens = tokens_of(tokens)?;
        let src = key_source(context, hashes)?;
        // Over LOOKUP with blocking I/O on this thread (the GIL released) when it can (the plain
        // chain and engine hashes from the first block): no hop through the runtime's worker;
        // through the runtime otherwise.
        let blocking = first_block == 0 && !matches!(src, kvproto::KeySource::Context(_));
        if blocking && std::process::id() == self.pid {
            let client = self.client.clone();
            if let Some(r) = py.detach(|| client.lookup_blocking_keyed(&tokens, &src)) {
                return r.map(LookupResult::from).map_err(|e| to_py(py, e));
            }
        }
        self.call(py, move |c| async move { c.lookup_keyed(&tokens, &src, first_block).await }).map(LookupResult::from)
    }

    /// `lookup` for a request a router placed (`route_id` from its answer), with the prompt's
    /// leading blocks the engine already holds on its GPU.
    fn lookup_routed(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        route_id: u64,
        g1_blocks: u32,
    ) -> PyResult<LookupResult> {
        let tokens = tokens_of(tokens)?;
        self.call(py, move |c| async move { c.lookup_routed(&tokens, route_id, g1_blocks).await })
            .map(LookupResult::from)
    }

    /// Starts loading blocks `first_block .. first_block + len(slots)` of `tokens` into those
    /// slots; returns at once. The load stops at the first block not cached. `sources`: peer
    /// daemons that may hold the blocks this node lacks (as `load_from`).
    #[pyo3(signature = (tokens, first_block, slots, sources = Vec::new(), *, context = None, hashes = None))]
    #[allow(clippy::too_many_arguments)] // Python's keywords, one per argument
    fn load(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        first_block: u32,
        slots: Vec<u32>,
        sources: Vec<String>,
        context: Option<&PyKeyContext>,
        hashes: Option<&PyEngineHashes>,
    ) -> PyResult<PyLoadOp> {
        let tokens = tokens_of(tokens)?;
        let src = key_source(context, hashes)?;
        self.call(py, move |c| async move { c.load_op_keyed(&tokens, &src, first_block, &slots, &sources).await })
            .map(|op| PyLoadOp { op })
    }

    /// Loads and waits in one call. Raises `LoadFailedError` if the load failed.
    #[pyo3(signature = (tokens, first_block, slots, *, context = None, hashes = None))]
    fn load_now(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        first_block: u32,
        slots: Vec<u32>,
        context: Option<&PyKeyContext>,
        hashes: Option<&PyEngineHashes>,
    ) -> PyResult<LoadStatus> {
        let tokens = tokens_of(tokens)?;
        let src = key_source(context, hashes)?;
        self.call(py, move |c| async move { c.load_now_keyed(&tokens, &src, first_block, &slots).await })
            .map(LoadStatus::from)
    }

    /// `load_now` that may pull the blocks this node lacks from peer daemons: `sources` are
    /// their peer channels (`"host:port"`), as a router's split answer names them
    /// (`split.prefill_peer`). What does not arrive within the daemon's
    /// `peer.pull_deadline_ms` is a miss.
    fn load_from(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        first_block: u32,
        slots: Vec<u32>,
        sources: Vec<String>,
    ) -> PyResult<LoadStatus> {
        let tokens = tokens_of(tokens)?;
        self.call(py, move |c| async move { c.load_from(&tokens, first_block, &slots, &sources).await })
            .map(LoadStatus::from)
    }

    /// Waits up to `timeout` seconds for a load to end or, with `blocks`, until that many of its
    /// blocks are in the slots (the first, in order: usable while later ones still arrive); its
    /// status (state `"pending"` if it is still running). Raises `LoadFailedError` if the load
    /// failed.
    #[pyo3(signature = (op, timeout = 30.0, blocks = 0))]
    fn wait(&self, py: Python<'_>, op: &PyLoadOp, timeout: f64, blocks: u32) -> PyResult<LoadStatus> {
        let (op, timeout) = (op.op.clone(), seconds("timeout", timeout)?);
        self.call(py, move |c| async move { c.wait_for_blocks(&op, blocks, timeout).await }).map(LoadStatus::from)
    }

    /// A load's status without waiting.
    fn poll(&self, py: Python<'_>, op: &PyLoadOp) -> PyResult<LoadStatus> {
        self.wait(py, op, 0.0, 0)
    }

    /// The daemon's counters (see `kvcached.Client.stats` in the stubs for the keys).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, |c| async move { c.stats().await })?;
        stats_dict(py, &s)
    }

    /// `(ok, reasons)`: whether the daemon is healthy, and why not.
    fn health(&self, py: Python<'_>) -> PyResult<(bool, Vec<String>)> {
        self.call(py, |c| async move { c.health().await }).map(|h| (h.ok, h.reasons))
    }

    /// Reports that blocks `first_block ..` of `tokens` are now in the engine's GPU memory
    /// (published to routers as G1 blocks); returns their keys.
    fn gpu_stored<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        first_block: u32,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let tokens = tokens_of(tokens)?;
        let keys = self.call(py, move |c| async move { c.gpu_stored(&tokens, first_block).await })?;
        Ok(keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
    }

    /// Reports that blocks `first_block ..` of `tokens` left the engine's GPU memory.
    fn gpu_removed(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>, first_block: u32) -> PyResult<()> {
        let tokens = tokens_of(tokens)?;
        self.call(py, move |c| async move { c.gpu_removed(&tokens, first_block).await }).map(|_| ())
    }

    /// Reports that the engine's GPU memory holds no cached block any more.
    fn gpu_cleared(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |c| async move { c.gpu_cleared().await })
    }

    /// Reports the engine's load (requests running and waiting, KV blocks used of total).
    fn report_load(
        &self,
        py: Python<'_>,
        running: u32,
        waiting: u32,
        kv_used_blocks: u64,
        kv_total_blocks: u64,
    ) -> PyResult<()> {
        self.call(py, move |c| async move { c.report_load(running, waiting, kv_used_blocks, kv_total_blocks).await })
    }

    /// `report_load` with the prefill the engine computed since its last report: `prefill_tokens`
    /// tokens in `prefill_seconds` of compute. The daemon averages them into the engine's
    /// prefill rate, which routers weigh against link rates to decide prefill/decode splits.
    #[allow(clippy::too_many_arguments)]
    fn report_load_and_prefill(
        &self,
        py: Python<'_>,
        running: u32,
        waiting: u32,
        kv_used_blocks: u64,
        kv_total_blocks: u64,
        prefill_tokens: u64,
        prefill_seconds: f64,
    ) -> PyResult<()> {
        let took = seconds("prefill_seconds", prefill_seconds)?;
        self.call(py, move |c| async move {
            c.report_load_and_prefill(running, waiting, kv_used_blocks, kv_total_blocks, prefill_tokens, took).await
        })
    }

    /// Detaches the engine (the daemon unmaps its memory) and stops heartbeats.
    fn unregister(&self, py: Python<'_>) -> PyResult<()> {
        self.call(py, |c| async move { c.unregister().await })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving a `with` block unregisters the engine if it is registered.
    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        if self.client.engine_id_now().is_some() && std::process::id() == self.pid {
            self.unregister(py)?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("Client(socket={:?}, engine_id={:?})", self.socket.display().to_string(), self.client.engine_id_now())
    }
}

/// A request's key source from its keyword arguments: a key context or engine hashes, not both.
fn key_source(context: Option<&PyKeyContext>, hashes: Option<&PyEngineHashes>) -> PyResult<kvproto::KeySource> {
    match (context.filter(|c| !c.inner.is_empty()), hashes) {
        (Some(_), Some(_)) => Err(PyValueError::new_err(
            "context and hashes given together: an engine's page hashes already bind what its KV depends on",
        )),
        (Some(c), None) => Ok(kvproto::KeySource::Context(c.inner.clone())),
        (None, Some(h)) => Ok(kvproto::KeySource::Hashes(h.inner.clone())),
        (None, None) => Ok(kvproto::KeySource::Plain),
    }
}
