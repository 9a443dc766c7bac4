//! Page-locking host memory for CUDA, loaded at run time.
//!
//! With no CUDA driver on the machine every function here returns a clear "no CUDA device"
//! error instead of panicking (cudarc's dynamic loader panics if the library is missing, so the
//! presence check comes first).

use cudarc::driver::sys;

use crate::error::{Result, TierError};

fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(TierError::NoCuda(format!("{what} failed: {r:?}"))) }
}

/// Whether a CUDA driver library can be loaded and reports at least one device.
pub fn cuda_available() -> bool {
    // SAFETY: only probes whether the library loads.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    let mut n = 0;
    // SAFETY: the library is present; cuInit and cuDeviceGetCount take plain out-pointers.
    unsafe {
        sys::cuInit(0) == sys::CUresult::CUDA_SUCCESS
            && sys::cuDeviceGetCount(&mut n) == sys::CUresult::CUDA_SUCCESS
            && n > 0
    }
}

/// A host range registered with CUDA (page-locked, portable across contexts). Unregistered on
/// drop.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: usize,
}

impl HostRegistration {
    /// Page-locks `[ptr, ptr+len)` for DMA from every CUDA context of the process.
    ///
    /// # Safety
    /// The range must be a live mapping that outlives the registration.
    pub unsafe fn register(ptr: *mut u8, len: usize) -> Result<Self> {
        if !cuda_available() {
            return Err(TierError::NoCuda("no CUDA driver or device on this machine".into()));
        }
        // SAFETY: the driver is loaded; the primary context of device 0 is retained and made
        // current because registration applies to the current context.
        unsafe {
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, 0), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            check(sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")?;
        }
        Ok(Self { ptr: ptr as usize })
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; the mapping is still live (owner drops us first).
        let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?r, "cuMemHostUnregister failed");
        }
    }
}
