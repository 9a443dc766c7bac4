"""vLLM 0.33's `CacheHitSource`, as far as `kvcached.vllm.connector` names it."""

from enum import Enum


class CacheHitSource(Enum):
    DEVICE = "device"
    HOST = "host"
    REMOTE = "remote"
