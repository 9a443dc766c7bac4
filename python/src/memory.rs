//! KV memory from Python: an anonymous shared-memory file (memfd) laid out as slots, that the
//! daemon maps through its descriptor and Python views without copying (the buffer protocol:
//! `memoryview(mem)`, `numpy.frombuffer(mem, ...)`, `torch.frombuffer(mem, ...)`); and GPU memory
//! named by a CUDA IPC handle.

use std::ffi::{c_int, c_void};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use pyo3::exceptions::{PyBufferError, PyIndexError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes};
use pyo3::{IntoPyObjectExt, ffi};

use crate::types::{PyKvLayout, PySlotLayout};

/// The Python-visible mapping of a shared-memory file.
///
/// The bytes are shared with the daemon, which writes into them during loads, so Rust never
/// holds a reference into them: every access goes through the raw mapping (`MmapRaw`), as the
/// buffers handed to NumPy and torch do.
#[derive(Debug)]
struct Region {
    file: Arc<File>,
    map: memmap2::MmapRaw,
}

impl Region {
    fn of_file(file: File) -> std::io::Result<Self> {
        let len = file.metadata()?.len();
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "the memory file is empty"));
        }
        let map = memmap2::MmapOptions::new().map_raw(&file)?;
        Ok(Self { file: Arc::new(file), map })
    }

    fn len(&self) -> usize {
        self.map.len()
    }
}

/// An anonymous shared-memory file (memfd) of `size` bytes, zero-filled.
fn memfd(size: u64) -> std::io::Result<File> {
    // SAFETY: memfd_create with a NUL-terminated name; the descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"kvcached-kv".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}

fn os_err(e: std::io::Error) -> PyErr {
    PyOSError::new_err(e.to_string())
}

/// KV memory to register with the daemon: a shared-memory file and where its block slots lie.
///
/// Create it with `KvMemory.anonymous(layout, num_blocks)` (the layout's standard slots),
/// `KvMemory.with_slots(slots, size=None)` (any slots, e.g. where an engine's KV tensors are) or
/// `KvMemory.from_fd(fd, slots)` (a memfd or shared-memory file the engine already has). The
/// whole region supports the buffer protocol, writable and without copying:
/// `numpy.frombuffer(mem, dtype)` and `torch.frombuffer(mem, dtype=...)` view the same bytes the
/// daemon saves from and loads into; a view keeps the memory mapped as long as it lives.
#[pyclass(module = "kvcached", name = "KvMemory", frozen)]
#[derive(Debug)]
pub struct PyKvMemory {
    region: Arc<Region>,
    /// The client's registration of the same file (a second mapping of it, never touched here).
    pub mem: Arc<kvclient::KvMemory>,
    slots: PySlotLayout,
}

impl PyKvMemory {
    fn build(file: File, slots: PySlotLayout) -> PyResult<Self> {
        let extent = slots.checked_extent()?;
        let region = Region::of_file(file).map_err(os_err)?;
        if (region.len() as u64) < extent {
            return Err(PyValueError::new_err(format!(
                "the memory is {} bytes but its slots reach byte {extent}",
                region.len()
            )));
        }
        let dup = region.file.try_clone().map_err(os_err)?;
        let mem = kvclient::KvMemory::from_file(dup, slots.inner.clone()).map_err(os_err)?;
        Ok(Self { region: Arc::new(region), mem: Arc::new(mem), slots })
    }

    /// Byte ranges of slot `block`'s segments, checked against the region.
    fn ranges(&self, block: u32) -> PyResult<Vec<(usize, usize)>> {
        if block >= self.slots.inner.num_blocks {
            return Err(PyIndexError::new_err(format!(
                "slot {block} is out of range ({} slots)",
                self.slots.inner.num_blocks
            )));
        }
        // In range: `build` checked the slots' extent against the region's length.
        Ok(self.slots.inner.ranges(block).collect())
    }
}

#[pymethods]
impl PyKvMemory {
    /// Memory for `num_blocks` slots in the layout kind's standard arrangement, in a new memfd.
    #[staticmethod]
    fn anonymous(layout: &PyKvLayout, num_blocks: u32) -> PyResult<Self> {
        let slots = PySlotLayout { inner: kvproto::slots::SlotLayout::for_layout(&layout.inner, num_blocks) };
        let size = slots.checked_extent()?;
        Self::build(memfd(size).map_err(os_err)?, slots)
    }

    /// Memory laid out as `slots`, in a new memfd of `size` bytes (default: just enough for the
    /// slots), zero-filled.
    #[staticmethod]
    #[pyo3(signature = (slots, size = None))]
    fn with_slots(slots: &PySlotLayout, size: Option<u64>) -> PyResult<Self> {
        let slots = slots.clone();
        let size = match size {
            Some(s) => s,
            None => slots.checked_extent()?,
        };
        Self::build(memfd(size).map_err(os_err)?, slots)
    }

    /// Memory the engine already has open for reading and writing (a memfd or a file in a
    /// shared-memory filesystem), laid out as `slots`. The descriptor is duplicated: the caller
    /// keeps its own.
    #[staticmethod]
    fn from_fd(fd: i32, slots: &PySlotLayout) -> PyResult<Self> {
        let slots = slots.clone();
        if fd < 0 {
            return Err(PyValueError::new_err("not a file descriptor"));
        }
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on any integer: an fd that is not open fails with
        // EBADF; on success the new descriptor is ours alone.
        let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(os_err(std::io::Error::last_os_error()));
        }
        // SAFETY: `dup` is a fresh descriptor nobody else owns.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(dup) };
        Self::build(file, slots)
    }

    /// Bytes of the whole region (the buffer's length).
    #[getter]
    fn size(&self) -> usize {
        self.region.len()
    }
    #[getter]
    fn num_blocks(&self) -> u32 {
        self.slots.inner.num_blocks
    }
    #[getter]
    fn slots(&self) -> PySlotLayout {
        self.slots.clone()
    }
    /// Bytes of one block.
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.slots.inner.segment_bytes.saturating_mul(self.slots.inner.segments.len() as u64)
    }
    /// The region's descriptor (owned by this object: do not close it).
    #[getter]
    fn fd(&self) -> i32 {
        self.region.file.as_raw_fd()
    }

    /// `(offset, length)` of each segment of slot `block`, in block byte order.
    fn block_ranges(&self, block: u32) -> PyResult<Vec<(usize, usize)>> {
        self.ranges(block)
    }

    /// A copy of slot `block`'s bytes, in block order.
    fn read_block<'py>(&self, py: Python<'py>, block: u32) -> PyResult<Bound<'py, PyBytes>> {
        let ranges = self.ranges(block)?;
        let total: usize = ranges.iter().map(|(_, n)| n).sum();
        let base = self.region.map.as_ptr();
        PyBytes::new_with(py, total, |out| {
            let mut at = 0;
            for (off, n) in &ranges {
                // SAFETY: (off, n) lies inside the mapping (checked in `build`); `out` has
                // `total` bytes; the regions do not overlap (ours is the mapping, theirs a new
                // bytes object).
                unsafe { std::ptr::copy_nonoverlapping(base.add(*off), out[at..].as_mut_ptr(), *n) };
                at += n;
            }
            Ok(())
        })
    }

    /// Writes one block's bytes (in block order, exactly `block_bytes` of them) into slot
    /// `block`, as the engine's own KV writes would.
    fn write_block(&self, block: u32, data: std::borrow::Cow<'_, [u8]>) -> PyResult<()> {
        let ranges = self.ranges(block)?;
        let total: usize = ranges.iter().map(|(_, n)| n).sum();
        if data.len() != total {
            return Err(PyValueError::new_err(format!("a block is {total} bytes, got {}", data.len())));
        }
        let base = self.region.map.as_mut_ptr();
        let mut at = 0;
        for (off, n) in ranges {
            // SAFETY: as in read_block; `data` is a separate Python object.
            unsafe { std::ptr::copy_nonoverlapping(data[at..].as_ptr(), base.add(off), n) };
            at += n;
        }
        Ok(())
    }

    /// The whole region as a NumPy array of `dtype` (no copy; needs NumPy).
    #[pyo3(signature = (dtype = None))]
    fn numpy<'py>(slf: &Bound<'py, Self>, dtype: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let np = py.import("numpy")?;
        let dtype = match dtype {
            Some(d) => d,
            None => np.getattr("uint8")?,
        };
        np.call_method1("frombuffer", (slf, dtype))
    }

    /// The whole region as a 1-D torch tensor of `dtype` (no copy; needs torch). `dtype` is a
    /// `torch.dtype` or its name (`"bfloat16"`).
    #[pyo3(signature = (dtype = None))]
    fn torch<'py>(slf: &Bound<'py, Self>, dtype: Option<Bound<'py, PyAny>>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let torch = py.import("torch")?;
        let dtype = match dtype {
            Some(d) if d.is_instance_of::<pyo3::types::PyString>() => torch.getattr(d.extract::<String>()?.as_str())?,
            Some(d) => d,
            None => torch.getattr("uint8")?,
        };
        let kwargs = [("dtype", dtype)].into_py_dict(py)?;
        torch.call_method("frombuffer", (slf,), Some(&kwargs))
    }

    /// The buffer protocol: the whole region, writable, one byte per item.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("the buffer view is null"));
        }
        let region = &slf.get().region;
        let len = ffi::Py_ssize_t::try_from(region.len())
            .map_err(|_| PyBufferError::new_err("the region is larger than a Python buffer can be"))?;
        let ptr = region.map.as_mut_ptr().cast::<c_void>();
        // SAFETY: `view` is the interpreter's; PyBuffer_FillInfo stores a new reference to the
        // object in view.obj, so this object (and with it the mapping `ptr` points into) lives
        // as long as any view of it. The format, if asked for, is a static string: nothing to
        // release in __releasebuffer__.
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 0, flags) };
        if rc != 0 {
            return Err(PyErr::take(slf.py()).unwrap_or_else(|| PyBufferError::new_err("PyBuffer_FillInfo failed")));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.region.len()
    }

    fn __repr__(&self) -> String {
        format!("KvMemory(size={}, slots={})", self.region.len(), self.slots.__repr__())
    }
}

/// KV memory in GPU memory, shared with the daemon by a CUDA IPC handle (the 64-byte
/// `cuIpcGetMemHandle` of the allocation holding the KV tensors; slot offsets count from its
/// base). Registering it needs a CUDA driver and device on the daemon's node; without them the
/// registration raises `NoCudaDeviceError`.
#[pyclass(module = "kvcached", name = "GpuKvMemory", frozen)]
#[derive(Debug)]
pub struct PyGpuKvMemory {
    pub mem: Arc<kvclient::GpuKvMemory>,
    device: u32,
    size: u64,
    slots: PySlotLayout,
}

fn ipc_handle(handle: &[u8]) -> PyResult<[u8; 64]> {
    <[u8; 64]>::try_from(handle)
        .map_err(|_| PyValueError::new_err(format!("a CUDA IPC handle is 64 bytes, got {}", handle.len())))
}

#[pymethods]
impl PyGpuKvMemory {
    #[new]
    fn new(ipc_handle_bytes: &[u8], device: u32, size: u64, slots: &PySlotLayout) -> PyResult<Self> {
        let slots = slots.clone();
        let handle = ipc_handle(ipc_handle_bytes)?;
        let extent = slots.checked_extent()?;
        if size < extent {
            return Err(PyValueError::new_err(format!(
                "the allocation is {size} bytes but its slots reach byte {extent}"
            )));
        }
        let mem = kvclient::GpuKvMemory::with_slots(handle, device, size, slots.inner.clone());
        Ok(Self { mem: Arc::new(mem), device, size, slots })
    }

    /// vLLM-style tensors back to back in one allocation (`SlotLayout.layer_separate`).
    #[staticmethod]
    fn layer_separate(ipc_handle_bytes: &[u8], device: u32, layout: &PyKvLayout, num_blocks: u32) -> PyResult<Self> {
        let slots = PySlotLayout { inner: kvproto::slots::SlotLayout::layer_separate(&layout.inner, num_blocks) };
        let size = slots.checked_extent()?;
        Self::new(ipc_handle_bytes, device, size, &slots)
    }

    #[getter]
    fn device(&self) -> u32 {
        self.device
    }
    #[getter]
    fn size(&self) -> u64 {
        self.size
    }
    #[getter]
    fn slots(&self) -> PySlotLayout {
        self.slots.clone()
    }

    fn __repr__(&self) -> String {
        format!("GpuKvMemory(device={}, size={}, slots={})", self.device, self.size, self.slots.__repr__())
    }
}

/// Deterministic synthetic KV bytes for block `index` of a prompt (the client crate's
/// `synthetic_block`): tests in any language can regenerate and verify them.
#[pyfunction]
pub fn synthetic_block(py: Python<'_>, seed: u64, index: u32, length: usize) -> PyResult<Py<PyAny>> {
    PyBytes::new(py, &kvclient::synthetic_block(seed, index, length)).into_py_any(py)
}
