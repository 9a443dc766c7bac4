"""torch helpers: where a tensor's memory is, for registering it with the daemon.

CPU: the daemon can only copy memory it can map, i.e. a shared-memory file handed over by
descriptor; `shared_empty` allocates a tensor in one (the vLLM connector allocates vLLM's KV cache
this way). CUDA: `cuda_ipc_region` names the allocation holding a tensor by its CUDA IPC handle,
for `kvcached.GpuKvMemory`. Where there is no CUDA device it raises `NoCudaDeviceError`.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import torch

from kvcached._native import NoCudaDeviceError


@dataclass
class SharedRegion:
    """A memfd mapped into this process; `tensor` (int8, the whole region) views it."""

    fd: int
    size: int
    map: mmap.mmap
    tensor: torch.Tensor

    def close(self) -> None:
        """Closes the descriptor (the mapping lives as long as the tensor and its views)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def shared_empty(size: int, name: str = "kvcached-kv") -> SharedRegion:
    """`size` zero bytes in an anonymous shared-memory file, as an int8 tensor (no copy)."""
    if size <= 0:
        raise ValueError("a shared region needs at least one byte")
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)  # MAP_SHARED, read-write: the daemon's loads land here
    except BaseException:
        os.close(fd)
        raise
    # torch keeps a reference to the mmap's buffer: the mapping outlives the region object as
    # long as a tensor views it.
    return SharedRegion(fd, size, m, torch.frombuffer(m, dtype=torch.int8, count=size))


@dataclass
class CudaIpcRegion:
    """The CUDA allocation holding a tensor: its IPC handle (64 bytes), device, where the
    tensor's storage starts in it and the bytes from the allocation's start to its end."""

    handle: bytes
    device: int
    storage_offset: int
    size: int
    base_ptr: int


def cuda_ipc_region(tensor: torch.Tensor) -> CudaIpcRegion:
    """The IPC handle of the CUDA allocation holding `tensor` (for `kvcached.GpuKvMemory`:
    slot offsets count from `base_ptr`). Raises NoCudaDeviceError without CUDA.

    Not exercised on a GPU yet: the machines these tests ran on have none.
    """
    if not torch.cuda.is_available():
        raise NoCudaDeviceError("no CUDA device: torch.cuda.is_available() is False on this machine")
    if tensor.device.type != "cuda":
        raise ValueError(f"the tensor is on {tensor.device}, not on a CUDA device")
    storage = tensor.untyped_storage()
    # (device, handle, storage size, offset of the storage in the allocation, ...): torch's
    # own sharing of CUDA storages between processes.
    device, handle, size, offset, *_ = storage._share_cuda_()
    if len(handle) != 64:
        raise RuntimeError(f"unexpected CUDA IPC handle of {len(handle)} bytes")
    offset, size = int(offset), int(size)
    return CudaIpcRegion(bytes(handle), int(device), offset, offset + size, storage.data_ptr() - offset)
