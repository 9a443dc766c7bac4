"""`KvcachedConnector`: vLLM's v1 KV connector (`KVConnectorBase_V1`, vLLM 0.33) backed by
the node's kvcached daemon.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvcachedConnector",
        "kv_connector_module_path": "kvcached.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvcached.socket": "/run/kvcached/kvcached.sock"}}'

vLLM makes one instance per role: the scheduler's (`scheduler.py`: lookups, load and save
plans) and each worker's (`worker.py`: registration, loads, saves); they talk only through the
step's metadata (`meta.py`). Roles: `kv_producer` saves, `kv_consumer` loads, `kv_both` does
both. A prefill/decode hand-off goes through the same store: the prefill engine's requests carry
`{"do_remote_decode": true}` and their output's `kv_transfer_params` say how much was saved; the
decode engine finds the blocks by looking the prompt up. Settings: `config.ConnectorConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcached.vllm.config import ConnectorConfig
from kvcached.vllm.meta import KvcachedConnectorMetadata
from kvcached.vllm.scheduler import SchedulerSide
from kvcached.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch


class KvcachedConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for kvcached (see the module's docstring). It supports vLLM's hybrid
    KV-cache manager (`SupportsHMA`): full-attention and sliding-window groups, each saved and
    loaded in a namespace of its own."""

    # Hits come from the node's host-memory and disk tiers.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, self.config, self._kv_transfer_config)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.config, self._kv_transfer_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-by-layer waits and saves are Python calls inside attention, which a full CUDA
        # graph would skip.
        return ConnectorConfig.from_extra(extra_config).layerwise

    # -- scheduler side ------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on the worker's connector")
        return self.scheduler

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return self._sched().hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------------------------

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("a worker-side call on the scheduler's connector")
        return self.worker

    def get_mem_pool_context(self) -> Any:
        return self._work().mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def _meta(self) -> KvcachedConnectorMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcachedConnectorMetadata):
            raise TypeError(f"expected kvcached's connector metadata, got {type(meta).__name__}")
        return meta

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # The daemon reads the layer from the registered memory itself; kv_layer is that memory.
        self._work().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self._work().poll_async_loads()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self._work()
        done = w.poll_async_loads()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=w.take_failed_recving())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_invalid_blocks()

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
