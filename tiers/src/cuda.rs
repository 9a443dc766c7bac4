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

/// A CUDA allocation of another process (an engine's KV memory), opened from its IPC handle
/// (`cuIpcGetMemHandle` in the engine). Copies in and out are DMA between that memory and host
/// memory (the G2 pool, page-locked when `g2.cuda_register` took effect). Closed on drop.
#[derive(Debug)]
pub struct DeviceRegion {
    base: sys::CUdeviceptr,
    len: usize,
    ctx: usize,
    device: sys::CUdevice,
}

// SAFETY: the region is a device address plus the primary context it was opened in; every
// call makes that context current on the calling thread first, and the driver API is
// thread-safe.
unsafe impl Send for DeviceRegion {}
// SAFETY: as above; copies do not mutate the struct.
unsafe impl Sync for DeviceRegion {}

impl DeviceRegion {
    /// Opens the 64-byte IPC `handle` on device `ordinal`; the allocation must hold `len` bytes.
    pub fn open_ipc(handle: &[u8], ordinal: u32, len: usize) -> Result<Self> {
        let Ok(bytes) = <[u8; 64]>::try_from(handle) else {
            return Err(TierError::NoCuda(format!("a CUDA IPC handle has 64 bytes, got {}", handle.len())));
        };
        if !cuda_available() {
            return Err(TierError::NoCuda(
                "no CUDA device on this node: a CUDA IPC handle cannot be opened; register a shared-memory region"
                    .into(),
            ));
        }
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        // SAFETY: the driver is loaded (checked above); every call takes plain out-pointers.
        unsafe {
            let ordinal = i32::try_from(ordinal).map_err(|_| TierError::NoCuda(format!("device {ordinal}")))?;
            let mut device = 0;
            check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            check(sys::cuDevicePrimaryCtxRetain(&mut ctx, device), "cuDevicePrimaryCtxRetain")?;
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let mut base = 0;
            let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint;
            if let Err(e) = check(sys::cuIpcOpenMemHandle_v2(&mut base, h, flags), "cuIpcOpenMemHandle") {
                sys::cuDevicePrimaryCtxRelease_v2(device);
                return Err(e);
            }
            Ok(Self { base, len, ctx: ctx as usize, device })
        }
    }

    /// The CUDA device the region lives on.
    pub fn cuda_device_ordinal(&self) -> i32 {
        self.device
    }

    /// Bytes the engine registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn range(&self, offset: usize, n: usize) -> Result<sys::CUdeviceptr> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.base + offset as u64),
            _ => Err(TierError::NoCuda(format!("device range {offset}+{n} outside the {}-byte region", self.len))),
        }
    }

    /// Copies `n` bytes at `offset` of the region to host memory at `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for `n` bytes of writes.
    pub unsafe fn to_host(&self, offset: usize, dst: *mut u8, n: usize) -> Result<()> {
        let src = self.range(offset, n)?;
        // SAFETY: the context is ours; the ranges are checked (device) or guaranteed (host).
        unsafe {
            check(sys::cuCtxSetCurrent(self.ctx as sys::CUcontext), "cuCtxSetCurrent")?;
            check(sys::cuMemcpyDtoH_v2(dst.cast(), src, n), "cuMemcpyDtoH")
        }
    }

    /// Copies `n` bytes from host memory at `src` to `offset` of the region.
    ///
    /// # Safety
    /// `src` must be valid for `n` bytes of reads.
    pub unsafe fn from_host(&self, offset: usize, src: *const u8, n: usize) -> Result<()> {
        let dst = self.range(offset, n)?;
        // SAFETY: as in `to_host`.
        unsafe {
            check(sys::cuCtxSetCurrent(self.ctx as sys::CUcontext), "cuCtxSetCurrent")?;
            check(sys::cuMemcpyHtoD_v2(dst, src.cast(), n), "cuMemcpyHtoD")
        }
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        // SAFETY: opened in `open_ipc` in this context.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext);
            let r = sys::cuIpcCloseMemHandle(self.base);
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "cuIpcCloseMemHandle failed");
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}
