//! CUDA, loaded at run time: page-locking host memory, and engines' device memory opened from
//! their IPC handles, copied to and from on streams.
//!
//! With no CUDA driver on the machine every function here returns a clear "no CUDA device"
//! error instead of panicking (cudarc's dynamic loader panics if the library is missing, so the
//! presence check comes first).

use cudarc::driver::sys;

use crate::copy::{Copy, CopyEngine, Direction, Fence, check_ranges};
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

/// Streams a region's copies are spread over: enough to keep both of a GPU's copy engines
/// busy (one each way) with blocks queued behind the one in flight.
pub const LANES: usize = 4;

/// A CUDA allocation of another process (an engine's KV memory), opened from its IPC handle
/// (`cuIpcGetMemHandle` in the engine). Copies in and out are DMA between that memory and host
/// memory (the G2 pool, page-locked when `g2.cuda_register` took effect), queued on the
/// region's own non-blocking streams ([`CopyEngine`]) and waited for by event. Closed on drop,
/// after every stream has finished.
#[derive(Debug)]
pub struct DeviceRegion {
    base: sys::CUdeviceptr,
    len: usize,
    ctx: usize,
    device: sys::CUdevice,
    /// The streams (`CUstream` as addresses), one per lane.
    streams: Vec<usize>,
    /// Events done with, for the next fences (`CUevent` as addresses).
    events: parking_lot::Mutex<Vec<usize>>,
}

// SAFETY: the region is a device address plus the primary context it was opened in, its
// streams and its events; every call makes that context current on the calling thread first,
// and the driver API is thread-safe.
unsafe impl Send for DeviceRegion {}
// SAFETY: as above; the event pool is behind a mutex.
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
            // From here on, drop undoes what was made (streams, the mapping, the context).
            let mut region =
                Self { base, len, ctx: ctx as usize, device, streams: Vec::new(), events: Default::default() };
            for _ in 0..LANES {
                let mut stream = std::ptr::null_mut();
                let flags = sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as std::ffi::c_uint;
                check(sys::cuStreamCreate(&mut stream, flags), "cuStreamCreate")?;
                region.streams.push(stream as usize);
            }
            Ok(region)
        }
    }

    /// The CUDA device the region lives on.
    pub fn cuda_device_ordinal(&self) -> i32 {
        self.device
    }

    fn current(&self) -> Result<()> {
        // SAFETY: the context was retained at open and is released only on drop.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx as sys::CUcontext) }, "cuCtxSetCurrent")
    }

    /// An event for a fence: one done with, or a new one.
    fn event(&self) -> Result<sys::CUevent> {
        if let Some(e) = self.events.lock().pop() {
            return Ok(e as sys::CUevent);
        }
        let mut e = std::ptr::null_mut();
        let flags = sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as std::ffi::c_uint;
        // SAFETY: the context is current (callers); a plain out-pointer.
        check(unsafe { sys::cuEventCreate(&mut e, flags) }, "cuEventCreate")?;
        Ok(e)
    }
}

impl CopyEngine for DeviceRegion {
    fn lanes(&self) -> usize {
        self.streams.len().max(1)
    }

    fn len(&self) -> usize {
        self.len
    }

    unsafe fn submit(&self, lane: usize, copies: &[Copy]) -> Result<Fence> {
        check_ranges(copies, self.len)?;
        self.current()?;
        let stream = self.streams[lane % self.streams.len()] as sys::CUstream;
        let queued = copies.iter().try_for_each(|c| {
            let dev = self.base + c.device as u64;
            // SAFETY: the device range is checked above, the host range is the caller's to keep
            // valid until the fence completes (this function's contract).
            unsafe {
                match c.dir {
                    Direction::ToHost => check(
                        sys::cuMemcpyDtoHAsync_v2(c.host as *mut std::ffi::c_void, dev, c.len, stream),
                        "cuMemcpyDtoHAsync",
                    ),
                    Direction::ToDevice => check(
                        sys::cuMemcpyHtoDAsync_v2(dev, c.host as *const std::ffi::c_void, c.len, stream),
                        "cuMemcpyHtoDAsync",
                    ),
                }
            }
        });
        let fenced = queued.and_then(|()| {
            let event = self.event()?;
            // SAFETY: an event and a stream of this context.
            match check(unsafe { sys::cuEventRecord(event, stream) }, "cuEventRecord") {
                Ok(()) => Ok(Fence(event as u64)),
                Err(e) => {
                    self.events.lock().push(event as usize);
                    Err(e)
                }
            }
        });
        if fenced.is_err() {
            // What was queued before the failure must not run into memory the caller frees
            // on this error: the stream is drained first.
            // SAFETY: a stream of this context.
            unsafe { sys::cuStreamSynchronize(stream) };
        }
        fenced.map_err(|e| TierError::Device(format!("{}: {e}", self.describe())))
    }

    fn wait(&self, fence: Fence) -> Result<()> {
        let event = fence.0 as sys::CUevent;
        let r = self.current().and_then(|()| {
            // SAFETY: an event this region recorded.
            check(unsafe { sys::cuEventSynchronize(event) }, "cuEventSynchronize")
        });
        self.events.lock().push(fence.0 as usize);
        r.map_err(|e| TierError::Device(format!("{}: {e}", self.describe())))
    }

    fn is_done(&self, fence: &Fence) -> bool {
        if self.current().is_err() {
            return true;
        }
        // SAFETY: an event this region recorded. Not ready: false; done or failed: true (the
        // failure is for `wait` to report).
        unsafe { sys::cuEventQuery(fence.0 as sys::CUevent) != sys::CUresult::CUDA_ERROR_NOT_READY }
    }

    fn describe(&self) -> String {
        format!("CUDA device {}", self.device)
    }
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        // SAFETY: everything here was made in `open_ipc` in this context; the streams finish
        // before the mapping they copy from closes.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx as sys::CUcontext);
            for s in self.streams.drain(..) {
                sys::cuStreamSynchronize(s as sys::CUstream);
                sys::cuStreamDestroy_v2(s as sys::CUstream);
            }
            for e in self.events.get_mut().drain(..) {
                sys::cuEventDestroy_v2(e as sys::CUevent);
            }
            let r = sys::cuIpcCloseMemHandle(self.base);
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(?r, "cuIpcCloseMemHandle failed");
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}
