"""vLLM 0.33's KV connector base names that `kvcached.vllm.connector` imports; the check drives
the worker half (`WorkerSide`) itself, as the connector forwards vLLM's model runner's calls."""

import enum


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:  # noqa: B903 - a marker base class, as in vLLM
    pass


class KVConnectorTransferResults:
    pass


class SupportsHMA:
    pass


class KVConnectorBase_V1:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._vllm_config = vllm_config
        self._role = role
        self._kv_transfer_config = vllm_config.kv_transfer_config
