//! The client's value types as Python classes: layouts, namespaces, slot layouts, and the
//! daemon's answers. All immutable.

use kvproto::slots::{Segment, SlotLayout};
use kvproto::{Adapter, EngineHashes, HashScheme, KeyContext, KvLayout, MmInput, Namespace, pb};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn invalid(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The KV layout of a model as the engine stores it: layers, KV heads, head dim, element type,
/// tokens per block, and how a block's bytes are arranged (`"layer_separate"`: one segment per
/// layer and K/V; `"contiguous"`: one run).
#[pyclass(module = "kvcached", name = "KvLayout", frozen, eq, hash)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PyKvLayout {
    pub inner: KvLayout,
}

#[pymethods]
impl PyKvLayout {
    #[new]
    #[pyo3(signature = (num_layers, kv_heads, head_dim, dtype = "bf16", tokens_per_block = 16, kind = "layer_separate"))]
    fn new(
        num_layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: &str,
        tokens_per_block: u32,
        kind: &str,
    ) -> PyResult<Self> {
        let inner =
            KvLayout::from_names(num_layers, kv_heads, head_dim, dtype, tokens_per_block, kind).map_err(invalid)?;
        inner.validate().map_err(invalid)?;
        Ok(Self { inner })
    }

    #[getter]
    fn num_layers(&self) -> u32 {
        self.inner.num_layers
    }
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.inner.kv_heads
    }
    #[getter]
    fn head_dim(&self) -> u32 {
        self.inner.head_dim
    }
    /// The element type's name (`"bf16"`, `"f16"`, `"f32"`, `"fp8_e4m3"`, `"fp8_e5m2"`, `"int8"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.tokens_per_block
    }
    /// `"layer_separate"` or `"contiguous"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.kind.name()
    }
    /// Bytes of K (or V) of one layer of one block.
    #[getter]
    fn segment_bytes(&self) -> u64 {
        self.inner.segment_bytes()
    }
    /// Bytes of one whole block (layers x 2 x segment).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes()
    }

    pub fn __repr__(&self) -> String {
        let l = &self.inner;
        format!(
            "KvLayout(num_layers={}, kv_heads={}, head_dim={}, dtype='{}', tokens_per_block={}, kind='{}')",
            l.num_layers,
            l.kv_heads,
            l.head_dim,
            l.dtype.name(),
            l.tokens_per_block,
            l.kind.name()
        )
    }
}

/// What a request's block keys bind besides its tokens (`docs/block-keys.md` section 6): a LoRA
/// adapter (name and a hash of its weights) and a cache salt bind every key; multimodal inputs
/// `(hash, offset, length)` (in token order, not overlapping) bind the blocks their placeholder
/// tokens overlap; `block_extras` `(block, bytes)` bind one block each (e.g. a hash of its
/// prompt embeddings). A request's lookups, loads and saves must pass the same context.
#[pyclass(module = "kvcached", name = "KeyContext", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyKeyContext {
    pub inner: KeyContext,
}

#[pymethods]
impl PyKeyContext {
    #[new]
    #[pyo3(signature = (*, adapter_name = None, adapter_hash = Vec::new(), cache_salt = None, mm = Vec::new(), block_extras = Vec::new()))]
    fn new(
        adapter_name: Option<String>,
        adapter_hash: Vec<u8>,
        cache_salt: Option<Vec<u8>>,
        mm: Vec<(Vec<u8>, u32, u32)>,
        block_extras: Vec<(u32, Vec<u8>)>,
    ) -> PyResult<Self> {
        if adapter_name.is_none() && !adapter_hash.is_empty() {
            return Err(invalid("adapter_hash given without an adapter_name"));
        }
        let inner = KeyContext {
            adapter: adapter_name.map(|name| Adapter { name, content_hash: adapter_hash }),
            cache_salt,
            mm: mm.into_iter().map(|(hash, offset, length)| MmInput { hash, offset, length }).collect(),
            block_extras,
        };
        inner.validate().map_err(invalid)?;
        Ok(Self { inner })
    }

    /// Whether the context adds nothing (the keys are the plain chain's).
    #[getter]
    fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The 16-byte keys of every full block of `tokens` in `namespace` under this context, as
    /// the daemon derives them.
    fn block_keys<'py>(&self, py: Python<'py>, namespace: &PyNamespace, tokens: Vec<u32>) -> Vec<Bound<'py, PyBytes>> {
        let ns = &namespace.inner;
        kvproto::context_keys(&ns.fingerprint(), ns.layout.tokens_per_block as usize, &tokens, &self.inner)
            .iter()
            .map(|k| PyBytes::new(py, &k.0))
            .collect()
    }

    fn __repr__(&self) -> String {
        // The salt is a secret: only whether there is one.
        format!(
            "KeyContext(adapter_name={:?}, cache_salt={}, mm={}, block_extras={})",
            self.inner.adapter.as_ref().map(|a| a.name.as_str()),
            if self.inner.cache_salt.is_some() { "<secret>" } else { "None" },
            self.inner.mm.len(),
            self.inner.block_extras.len()
        )
    }
}

/// A request's keys as its engine's own page hashes (docs/block-keys.md section 7): SGLang's
/// storage page hashes (scheme "sglang") or vLLM's block hashes as its offloading tiers see
/// them ("vllm"), one per block in order, 1..64 bytes each. With no hashes the daemon derives
/// the scheme's hashes from the request's tokens ("sglang" only): how a vLLM engine finds the
/// blocks an SGLang engine of the same model and layout saved. Raises ValueError out of bounds.
#[pyclass(module = "kvcached", name = "EngineHashes", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyEngineHashes {
    pub inner: EngineHashes,
}

#[pymethods]
impl PyEngineHashes {
    #[new]
    #[pyo3(signature = (scheme, hashes = Vec::new()))]
    fn new(scheme: &str, hashes: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        // `bytes` read in place (the generic Vec<u8> extraction goes element by element).
        let hashes = hashes
            .iter()
            .map(|h| match h.cast::<PyBytes>() {
                Ok(b) => Ok(b.as_bytes().to_vec()),
                Err(_) => h.extract::<Vec<u8>>(),
            })
            .collect::<PyResult<Vec<_>>>()?;
        let inner = EngineHashes { scheme: HashScheme::parse(scheme).map_err(invalid)?, hashes };
        inner.validate().map_err(invalid)?;
        Ok(Self { inner })
    }

    #[getter]
    fn scheme(&self) -> &'static str {
        self.inner.scheme.name()
    }

    fn __len__(&self) -> usize {
        self.inner.hashes.len()
    }

    /// The 16-byte keys of these hashes in `namespace` (of the scheme's hashes of `tokens` when
    /// there are none), as the daemon derives them.
    #[pyo3(signature = (namespace, tokens = Vec::new()))]
    fn block_keys<'py>(
        &self,
        py: Python<'py>,
        namespace: &PyNamespace,
        tokens: Vec<u32>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let ns = &namespace.inner;
        let le = kvproto::tokens_to_le(&tokens);
        let keys = self.inner.keys_le(&ns.fingerprint(), ns.layout.tokens_per_block as usize, &le).map_err(invalid)?;
        Ok(keys.iter().map(|k| PyBytes::new(py, &k.0)).collect())
    }

    /// SGLang's page hashes of the full pages of `tokens` (SHA-256 chained, 32 bytes each).
    #[staticmethod]
    fn sglang_page_hashes<'py>(py: Python<'py>, tokens: Vec<u32>, page_size: usize) -> Vec<Bound<'py, PyBytes>> {
        kvproto::engine_hash::sglang_page_hashes_le(page_size, &kvproto::tokens_to_le(&tokens))
            .iter()
            .map(|h| PyBytes::new(py, h))
            .collect()
    }

    fn __repr__(&self) -> String {
        format!("EngineHashes({:?}, {} hashes)", self.inner.scheme.name(), self.inner.hashes.len())
    }
}

/// Everything that binds a block key: two engines share KV only when every field is equal.
/// `tenant_salt` is a secret (never printed); `extra` is any further key material (e.g. the
/// engine's byte layout of a block, a multimodal input's hash).
#[pyclass(module = "kvcached", name = "Namespace", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyNamespace {
    pub inner: Namespace,
}

#[pymethods]
impl PyNamespace {
    #[new]
    #[pyo3(signature = (model_id, layout, *, tenant_salt = None, adapter_id = None, extra = None))]
    fn new(
        model_id: String,
        layout: &PyKvLayout,
        tenant_salt: Option<Vec<u8>>,
        adapter_id: Option<String>,
        extra: Option<Vec<u8>>,
    ) -> PyResult<Self> {
        let inner = Namespace { model_id, layout: layout.inner, tenant_salt, adapter_id, extra };
        inner.validate().map_err(invalid)?;
        if inner.model_id.len() > kvproto::limits::MODEL_ID_MAX_BYTES {
            return Err(invalid(format!("model_id is longer than {} bytes", kvproto::limits::MODEL_ID_MAX_BYTES)));
        }
        Ok(Self { inner })
    }

    #[getter]
    fn model_id(&self) -> &str {
        &self.inner.model_id
    }
    #[getter]
    fn layout(&self) -> PyKvLayout {
        PyKvLayout { inner: self.inner.layout }
    }
    #[getter]
    fn adapter_id(&self) -> Option<&str> {
        self.inner.adapter_id.as_deref()
    }
    #[getter]
    fn extra<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.extra.as_deref().map(|b| PyBytes::new(py, b))
    }
    /// Whether a tenant salt is set (its value is not readable back).
    #[getter]
    fn has_tenant_salt(&self) -> bool {
        self.inner.tenant_salt.is_some()
    }
    /// The public id of the namespace (hex), as the daemon logs and exports it.
    #[getter]
    fn id(&self) -> String {
        self.inner.id().to_string()
    }
    /// The 16-byte keys of every full block of `tokens` in this namespace (computed here, the
    /// same keys the daemon derives).
    fn block_keys<'py>(&self, py: Python<'py>, tokens: Vec<u32>) -> Vec<Bound<'py, PyBytes>> {
        self.inner.block_keys(&tokens).iter().map(|k| PyBytes::new(py, &k.0)).collect()
    }

    fn __repr__(&self) -> String {
        let n = &self.inner;
        format!(
            "Namespace(model_id={:?}, layout={}, tenant_salt={}, adapter_id={:?}, id={})",
            n.model_id,
            PyKvLayout { inner: n.layout }.__repr__(),
            if n.tenant_salt.is_some() { "<secret>" } else { "None" },
            n.adapter_id,
            n.id()
        )
    }
}

/// Where an engine's block slots lie in its KV memory: a block is `len(segments)` segments of
/// `segment_bytes` each, in block byte order; segment `i` of slot `b` starts at byte
/// `offset_i + b * stride_i`. `segments` is a list of `(offset, stride)` pairs.
#[pyclass(module = "kvcached", name = "SlotLayout", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PySlotLayout {
    pub inner: SlotLayout,
}

impl PySlotLayout {
    /// Bytes from the region's start to the end of its last slot, or a ValueError.
    pub fn checked_extent(&self) -> PyResult<u64> {
        self.inner.extent().ok_or_else(|| invalid("a slot layout of 0 slots, or one that reaches past 2^64 bytes"))
    }
}

#[pymethods]
impl PySlotLayout {
    #[new]
    fn new(segments: Vec<(u64, u64)>, segment_bytes: u64, num_blocks: u32) -> PyResult<Self> {
        if segments.is_empty() || segment_bytes == 0 {
            return Err(invalid("a slot layout needs at least one segment of at least one byte"));
        }
        let segments = segments.into_iter().map(|(offset, stride)| Segment { offset, stride }).collect();
        let s = Self { inner: SlotLayout { segments, segment_bytes, num_blocks } };
        s.checked_extent()?;
        Ok(s)
    }

    /// One tensor `[num_blocks, segment]` per layer and K/V, back to back (layer 0 K, layer 0 V,
    /// layer 1 K, ...).
    #[staticmethod]
    fn layer_separate(layout: &PyKvLayout, num_blocks: u32) -> Self {
        Self { inner: SlotLayout::layer_separate(&layout.inner, num_blocks) }
    }

    /// Fully contiguous blocks: slot `b` is bytes `[b * block, (b + 1) * block)`.
    #[staticmethod]
    fn contiguous(layout: &PyKvLayout, num_blocks: u32) -> Self {
        Self { inner: SlotLayout::contiguous(&layout.inner, num_blocks) }
    }

    /// The standard slots of the layout's kind.
    #[staticmethod]
    fn for_layout(layout: &PyKvLayout, num_blocks: u32) -> Self {
        Self { inner: SlotLayout::for_layout(&layout.inner, num_blocks) }
    }

    #[getter]
    fn segments(&self) -> Vec<(u64, u64)> {
        self.inner.segments.iter().map(|s| (s.offset, s.stride)).collect()
    }
    #[getter]
    fn segment_bytes(&self) -> u64 {
        self.inner.segment_bytes
    }
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.inner.num_blocks
    }
    /// Bytes of one block (all its segments).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.segment_bytes.saturating_mul(self.inner.segments.len() as u64)
    }
    /// Bytes from the region's start to the end of the last slot: the least a region holding
    /// these slots must have.
    #[getter]
    fn extent(&self) -> PyResult<u64> {
        self.checked_extent()
    }

    /// The daemon's own check of these slots against `layout` and a region of `region_bytes`
    /// (segment count and size, slots inside the region, no two slots overlapping); raises
    /// ValueError naming what is wrong.
    fn check(&self, layout: &PyKvLayout, region_bytes: u64) -> PyResult<()> {
        self.inner.check(&layout.inner, region_bytes).map_err(invalid)
    }

    /// `(offset, length)` of each segment of slot `block`, in block byte order.
    fn ranges(&self, block: u32) -> PyResult<Vec<(usize, usize)>> {
        if block >= self.inner.num_blocks {
            return Err(invalid(format!("slot {block} is out of range ({} slots)", self.inner.num_blocks)));
        }
        Ok(self.inner.ranges(block).collect())
    }

    pub fn __repr__(&self) -> String {
        format!(
            "SlotLayout(segments={:?}, segment_bytes={}, num_blocks={})",
            self.segments(),
            self.inner.segment_bytes,
            self.inner.num_blocks
        )
    }
}

/// What a lookup found: how many leading blocks (and tokens) of the prompt are cached, and in
/// which tier each block's fastest copy is.
#[pyclass(module = "kvcached", name = "LookupResult", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct LookupResult {
    pub matched_blocks: u32,
    pub matched_tokens: u32,
    pub g2_blocks: u32,
    pub g3_blocks: u32,
    pub g4_blocks: u32,
}

impl From<pb::LookupResponse> for LookupResult {
    fn from(r: pb::LookupResponse) -> Self {
        Self {
            matched_blocks: r.matched_blocks,
            matched_tokens: r.matched_tokens,
            g2_blocks: r.g2_blocks,
            g3_blocks: r.g3_blocks,
            g4_blocks: r.g4_blocks,
        }
    }
}

#[pymethods]
impl LookupResult {
    fn __repr__(&self) -> String {
        format!(
            "LookupResult(matched_blocks={}, matched_tokens={}, g2_blocks={}, g3_blocks={}, g4_blocks={})",
            self.matched_blocks, self.matched_tokens, self.g2_blocks, self.g3_blocks, self.g4_blocks
        )
    }
}

/// What a save did: blocks stored, already present, failed (with the first failure's error).
#[pyclass(module = "kvcached", name = "SaveResult", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct SaveResult {
    pub stored: u32,
    pub already_present: u32,
    pub failed: u32,
    pub error: String,
}

impl From<pb::SaveResponse> for SaveResult {
    fn from(r: pb::SaveResponse) -> Self {
        Self { stored: r.stored, already_present: r.already_present, failed: r.failed, error: r.error }
    }
}

#[pymethods]
impl SaveResult {
    fn __repr__(&self) -> String {
        format!(
            "SaveResult(stored={}, already_present={}, failed={}, error={:?})",
            self.stored, self.already_present, self.failed, self.error
        )
    }
}

/// The state of a load: `state` is `"pending"`, `"done"` or `"failed"`; `loaded_blocks` how far
/// it got (it stops at the first block not cached) and `from_g2` / `from_g3` / `from_g4` /
/// `from_peer` where the blocks came from.
#[pyclass(module = "kvcached", name = "LoadStatus", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct LoadStatus {
    pub op_id: u64,
    pub state: &'static str,
    pub loaded_blocks: u32,
    pub from_g2: u32,
    pub from_g3: u32,
    pub from_g4: u32,
    pub from_peer: u32,
    pub error: String,
}

impl From<pb::LoadStatus> for LoadStatus {
    fn from(s: pb::LoadStatus) -> Self {
        let state = match pb::load_status::State::try_from(s.state) {
            Ok(pb::load_status::State::Pending) => "pending",
            Ok(pb::load_status::State::Done) => "done",
            Ok(pb::load_status::State::Failed) | Err(_) => "failed",
        };
        Self {
            op_id: s.op_id,
            state,
            loaded_blocks: s.loaded_blocks,
            from_g2: s.from_g2,
            from_g3: s.from_g3,
            from_g4: s.from_g4,
            from_peer: s.from_peer,
            error: s.error,
        }
    }
}

#[pymethods]
impl LoadStatus {
    /// Whether the load has finished (successfully or not).
    #[getter]
    fn finished(&self) -> bool {
        self.state != "pending"
    }

    fn __repr__(&self) -> String {
        format!(
            "LoadStatus(op_id={}, state={:?}, loaded_blocks={}, from_g2={}, from_g3={}, from_g4={}, from_peer={}, \
             error={:?})",
            self.op_id,
            self.state,
            self.loaded_blocks,
            self.from_g2,
            self.from_g3,
            self.from_g4,
            self.from_peer,
            self.error
        )
    }
}

/// The daemon's answer to a registration.
#[pyclass(module = "kvcached", name = "Registration", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct Registration {
    pub engine_id: u64,
    /// The namespace's public id (hex).
    pub namespace_id: String,
    pub block_bytes: u64,
    pub heartbeat_ms: u32,
    pub lease_ms: u32,
    pub token_area_accepted: bool,
}

impl From<pb::RegisterResponse> for Registration {
    fn from(r: pb::RegisterResponse) -> Self {
        Self {
            engine_id: r.engine_id,
            namespace_id: r.namespace_id.iter().map(|b| format!("{b:02x}")).collect(),
            block_bytes: r.block_bytes,
            heartbeat_ms: r.heartbeat_ms,
            lease_ms: r.lease_ms,
            token_area_accepted: r.token_area_accepted,
        }
    }
}

#[pymethods]
impl Registration {
    fn __repr__(&self) -> String {
        format!(
            "Registration(engine_id={}, namespace_id={:?}, block_bytes={}, heartbeat_ms={}, lease_ms={}, \
             token_area_accepted={})",
            self.engine_id,
            self.namespace_id,
            self.block_bytes,
            self.heartbeat_ms,
            self.lease_ms,
            self.token_area_accepted
        )
    }
}

/// The daemon's counters as a dict: `engines`, `saves`, `loads`, `writethrough_dropped`, and
/// `tiers`, a dict per tier (`hits`, `misses`, `used_bytes`, `capacity_bytes`, `blocks`,
/// `evictions`, `checksum_failures`).
pub fn stats_dict<'py>(py: Python<'py>, s: &pb::StatsResponse) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("engines", s.engines)?;
    d.set_item("saves", s.saves)?;
    d.set_item("loads", s.loads)?;
    d.set_item("writethrough_dropped", s.writethrough_dropped)?;
    let tiers = PyDict::new(py);
    for t in &s.tiers {
        let td = PyDict::new(py);
        td.set_item("hits", t.hits)?;
        td.set_item("misses", t.misses)?;
        td.set_item("used_bytes", t.used_bytes)?;
        td.set_item("capacity_bytes", t.capacity_bytes)?;
        td.set_item("blocks", t.blocks)?;
        td.set_item("evictions", t.evictions)?;
        td.set_item("checksum_failures", t.checksum_failures)?;
        tiers.set_item(&t.tier, td)?;
    }
    d.set_item("tiers", tiers)?;
    Ok(d)
}
