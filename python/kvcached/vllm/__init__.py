"""kvcached's vLLM v1 KV connector: `kv_connector_module_path: "kvcached.vllm"`,
`kv_connector: "KvcachedConnector"`. See kvcached/vllm/connector.py and docs/python.md."""

try:
    import vllm  # noqa: F401
except ImportError as e:
    raise ImportError("kvcached.vllm is vLLM's KV connector and needs vLLM 0.33: pip install 'kvcached[vllm]'") from e

from kvcached.vllm.config import ConnectorConfig  # noqa: E402
from kvcached.vllm.connector import KvcachedConnector  # noqa: E402
from kvcached.vllm.meta import KvcachedConnectorMetadata, Transfer  # noqa: E402

__all__ = ["ConnectorConfig", "KvcachedConnector", "KvcachedConnectorMetadata", "Transfer"]
