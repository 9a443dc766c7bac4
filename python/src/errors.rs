//! Python exceptions for the client's errors (`kvclient::ClientError`).
//!
//! Every error the package raises for a client call is a `KvcachedError`; the daemon's refusals
//! are `RpcError`s carrying the gRPC code (`err.code`, e.g. `"INVALID_ARGUMENT"`), the daemon's
//! machine-readable reason (`err.reason`, e.g. `"unknown-engine"`, or None) and its message, with
//! a subclass for each case an engine acts on differently.

use kvclient::ClientError;
use pyo3::IntoPyObjectExt;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(kvcached, KvcachedError, PyException, "Base class of every error of kvcached's client.");
create_exception!(
    kvcached,
    UnreachableError,
    KvcachedError,
    "The daemon could not be reached at its socket (after retrying with backoff)."
);
create_exception!(
    kvcached,
    RpcError,
    KvcachedError,
    "The daemon refused the call. Attributes: code (gRPC code name), reason (the daemon's \
     kvcached-reason, or None), message."
);
create_exception!(
    kvcached,
    InvalidArgumentError,
    RpcError,
    "The daemon refused a request field (INVALID_ARGUMENT): slots out of range, a layout that does \
     not match the memory, tokens that do not cover the blocks, ..."
);
create_exception!(
    kvcached,
    UnknownEngineError,
    RpcError,
    "The engine is not registered with the daemon (reason unknown-engine) and re-registering failed."
);
create_exception!(kvcached, UnknownOpError, RpcError, "The load id is unknown or expired (reason unknown-op).");
create_exception!(
    kvcached,
    LimitReachedError,
    RpcError,
    "A daemon limit was reached (RESOURCE_EXHAUSTED or reason limit-reached): engines, connections, \
     pending loads, a full tier."
);
create_exception!(kvcached, PermissionDeniedError, RpcError, "The daemon refused the caller (PERMISSION_DENIED).");
create_exception!(
    kvcached,
    AttachRefusedError,
    RpcError,
    "The daemon could not attach the engine's memory (FAILED_PRECONDITION)."
);
create_exception!(
    kvcached,
    NoCudaDeviceError,
    AttachRefusedError,
    "CUDA memory was registered (or asked for) where there is no CUDA driver or device."
);
create_exception!(
    kvcached,
    AttachError,
    KvcachedError,
    "Handing the memory's descriptors to the daemon (ATTACH) failed on the client's side."
);
create_exception!(
    kvcached,
    NotRegisteredError,
    KvcachedError,
    "The call needs a registered engine: call register first."
);
create_exception!(
    kvcached,
    LoadFailedError,
    KvcachedError,
    "A load finished with an error on the daemon. Attributes: op (the load id), error."
);
create_exception!(kvcached, ClientIOError, KvcachedError, "A local I/O error: the memory file, the runtime.");

/// The canonical name of a gRPC code (as in grpcio's `StatusCode`).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A Python object of `v` (None where the conversion fails: an attribute is not worth losing the
/// error it decorates).
fn obj<'py>(py: Python<'py>, v: impl IntoPyObject<'py>) -> Py<PyAny> {
    v.into_py_any(py).unwrap_or_else(|_| py.None())
}

/// Sets attributes on an exception; a failure to set one must not hide the error itself.
fn with_attrs(py: Python<'_>, err: PyErr, attrs: &[(&str, Py<PyAny>)]) -> PyErr {
    let value = err.value(py);
    for (name, v) in attrs {
        let _ = value.setattr(*name, v.bind(py));
    }
    err
}

/// The exception for a client error.
pub fn to_py(py: Python<'_>, e: ClientError) -> PyErr {
    let msg = e.to_string();
    match e {
        ClientError::Unreachable { .. } => UnreachableError::new_err(msg),
        ClientError::Rpc(status) => {
            use kvproto::reason::Reason;
            let reason = kvclient::error::reason_of(&status);
            let code = status.code();
            let err = match (reason, code) {
                (Some(Reason::UnknownEngine), _) => UnknownEngineError::new_err(msg),
                (Some(Reason::UnknownOp), _) => UnknownOpError::new_err(msg),
                (Some(Reason::LimitReached), _) | (_, tonic::Code::ResourceExhausted) => {
                    LimitReachedError::new_err(msg)
                }
                (_, tonic::Code::InvalidArgument) => InvalidArgumentError::new_err(msg),
                (_, tonic::Code::PermissionDenied) => PermissionDeniedError::new_err(msg),
                // The daemon gives no machine-readable reason for a missing CUDA device (it is
                // an attach failure like any other, FAILED_PRECONDITION); its message is fixed
                // text in tiers/src/cuda.rs.
                (_, tonic::Code::FailedPrecondition) if status.message().contains("no CUDA device") => {
                    NoCudaDeviceError::new_err(msg)
                }
                (_, tonic::Code::FailedPrecondition) => AttachRefusedError::new_err(msg),
                _ => RpcError::new_err(msg),
            };
            let attrs = [
                ("code", obj(py, code_name(code))),
                ("reason", obj(py, reason.map(|r| r.name()))),
                ("message", obj(py, status.message())),
            ];
            with_attrs(py, err, &attrs)
        }
        ClientError::NotRegistered => NotRegisteredError::new_err(msg),
        ClientError::LoadFailed { op, error } => {
            let err = LoadFailedError::new_err(msg);
            with_attrs(py, err, &[("op", obj(py, op)), ("error", obj(py, error))])
        }
        ClientError::Attach(_) => AttachError::new_err(msg),
        ClientError::Io(_) => ClientIOError::new_err(msg),
        // ClientError is non-exhaustive: a variant added later is still a KvcachedError.
        _ => KvcachedError::new_err(msg),
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvcachedError", py.get_type::<KvcachedError>())?;
    m.add("UnreachableError", py.get_type::<UnreachableError>())?;
    m.add("RpcError", py.get_type::<RpcError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("UnknownEngineError", py.get_type::<UnknownEngineError>())?;
    m.add("UnknownOpError", py.get_type::<UnknownOpError>())?;
    m.add("LimitReachedError", py.get_type::<LimitReachedError>())?;
    m.add("PermissionDeniedError", py.get_type::<PermissionDeniedError>())?;
    m.add("AttachRefusedError", py.get_type::<AttachRefusedError>())?;
    m.add("NoCudaDeviceError", py.get_type::<NoCudaDeviceError>())?;
    m.add("AttachError", py.get_type::<AttachError>())?;
    m.add("NotRegisteredError", py.get_type::<NotRegisteredError>())?;
    m.add("LoadFailedError", py.get_type::<LoadFailedError>())?;
    m.add("ClientIOError", py.get_type::<ClientIOError>())?;
    Ok(())
}
