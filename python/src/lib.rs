//! `kvcached._native`: the client crate (`kvclient`) as a Python extension module (PyO3, the
//! stable ABI of CPython 3.11 and later). The `kvcached` package re-exports it; see
//! docs/python.md.
//!
//! # Layout
//! - [`client`]: `Client` (blocking calls that release the GIL) and `LoadOp`.
//! - [`memory`]: `KvMemory` (a memfd with its slots, viewable without copying through the buffer
//!   protocol) and `GpuKvMemory` (a CUDA IPC handle).
//! - [`types`]: `KvLayout`, `Namespace`, `SlotLayout` and the daemon's answers.
//! - [`errors`]: the exception classes and the mapping from `ClientError`.
//! - [`runtime`]: the process's tokio runtime.
//!
//! Nothing here panics across the boundary on a run-time path: every failure is a Python
//! exception (PyO3 also turns an unexpected panic into `PanicException` rather than unwinding
//! into the interpreter).

mod client;
mod errors;
mod memory;
mod runtime;
mod types;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<client::PyClient>()?;
    m.add_class::<client::PyLoadOp>()?;
    m.add_class::<memory::PyKvMemory>()?;
    m.add_class::<memory::PyGpuKvMemory>()?;
    m.add_class::<types::PyKvLayout>()?;
    m.add_class::<types::PyNamespace>()?;
    m.add_class::<types::PyKeyContext>()?;
    m.add_class::<types::PyEngineHashes>()?;
    m.add_class::<types::PySlotLayout>()?;
    m.add_class::<types::LookupResult>()?;
    m.add_class::<types::SaveResult>()?;
    m.add_class::<types::LoadStatus>()?;
    m.add_class::<types::Registration>()?;
    m.add_function(wrap_pyfunction!(memory::synthetic_block, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    errors::register(m)?;
    Ok(())
}

/// The socket the daemon listens on by default: `$KVCACHED_SOCKET` if set, else
/// `$XDG_RUNTIME_DIR/kvcached/kvcached.sock` (or the daemon's fallback).
#[pyfunction]
fn default_socket() -> std::path::PathBuf {
    kvclient::default_socket()
}
