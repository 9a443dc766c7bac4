"""vLLM's KV-cache groups of real model architectures, from a config.json alone: vLLM builds the
model on torch's meta device (no weights, no tokenizer, nothing downloaded), its layers give
their KV-cache specs as the model runner collects them (`get_kv_cache_spec`), and vLLM's planner
groups them (`get_global_kv_cache_groups`) as the engine core does.

Run as a script (`python vllm_model_specs.py FAMILY ...`) it prints, as its last line, the
base64 of a pickled {family: (block_size, [(layer names, spec), ...])}: the test process asks a
child for them, so that the distributed state and model construction stay out of it. The specs
are those of vLLM's CPU platform (the machine the tests run on).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import base64  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

_COMMON = {"torch_dtype": "bfloat16", "vocab_size": 1000, "max_position_embeddings": 2048}

# Small configurations of each family's real architecture (hidden sizes cut down).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 6, "rms_norm_eps": 1e-6, "sliding_window": 128, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 32, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
    "gpt-oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 128,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2, "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": True, "swiglu_limit": 7.0,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "kv_lora_rank": 64,
        "q_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True, "rope_theta": 10000.0,
    },
    "llama4": {
        "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 128,
        "intermediate_size": 256, "intermediate_size_mlp": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_hidden_layers": 4, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "attention_chunk_size": 64, "no_rope_layers": [1, 1, 1, 0], "num_local_experts": 2,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "use_qk_norm": True, "attn_temperature_tuning": True,
        "floor_scale": 8192, "attn_scale": 0.1,
    },
    "jamba": {
        "architectures": ["JambaForCausalLM"], "model_type": "jamba", "hidden_size": 128, "intermediate_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "attn_layer_period": 4,
        "attn_layer_offset": 2, "expert_layer_period": 2, "expert_layer_offset": 1, "num_experts": 1,
        "num_experts_per_tok": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
        "mamba_conv_bias": True, "mamba_proj_bias": False, "use_mamba_kernels": False,
    },
    "qwen3-next": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True,
    },
    "nemotron-h": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_hidden_layers": 4, "layer_norm_epsilon": 1e-5, "hybrid_override_pattern": "M-M*",
        "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4,
        "expand": 2, "mamba_hidden_act": "silu", "use_conv_bias": True, "use_bias": False,
        "mlp_hidden_act": "relu2", "mlp_bias": False, "attention_bias": False, "residual_in_fp32": False,
        "rescale_prenorm_residual": True, "chunk_size": 128, "time_step_limit": [0.0, 1e9],
        "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
    },
}  # fmt: skip

# The block size asked for: vLLM's CPU attention takes sliding windows in blocks of 32, so a
# model with window layers beside full ones keeps one block size only at 32 (vLLM aligns
# hybrid Mamba models' blocks itself).
BLOCK_SIZES = {"gemma3": 32, "gpt-oss": 32}


def config_json(family: str) -> dict[str, Any]:
    return {**_COMMON, **CONFIGS[family]}


def kv_cache_groups(family: str) -> tuple[int, list[tuple[list[str], Any]]]:
    """vLLM's block size and KV-cache groups ([(layer names, spec)]) for `family`, derived by
    vLLM from its config.json alone, with prefix caching on (Mamba state in align mode)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.config.vllm import get_layers_from_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.platforms import current_platform
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config_json(family), f)
        args = EngineArgs(
            model=d, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
            block_size=BLOCK_SIZES.get(family, 16), enforce_eager=True, max_model_len=2048,
            enable_prefix_caching=True, mamba_cache_mode="align",
        )  # fmt: skip
        cfg = args.create_engine_config()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
            )
            ps.initialize_model_parallel(1, 1)
        try:
            with torch.device("meta"):
                model = initialize_model(cfg)
            current_platform.update_block_size_for_backend(cfg)
            specs = {}
            for name, layer in get_layers_from_vllm_config(cfg, AttentionLayerBase).items():
                if getattr(layer, "kv_sharing_target_layer_name", None):
                    continue
                spec = layer.get_kv_cache_spec(cfg)
                if not spec:
                    continue
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(layer.get_attn_backend(), spec)
                specs[name] = spec
            del model
            cfg.cache_config.kv_cache_layout = "LBHNC"  # the engine core resolves it (the CPU's)
            groups = get_global_kv_cache_groups(cfg, [specs])
            return cfg.cache_config.block_size, [(list(g.layer_names), g.kv_cache_spec) for g in groups]
        finally:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


if __name__ == "__main__":
    out = {family: kv_cache_groups(family) for family in sys.argv[1:]}
    print(base64.b64encode(pickle.dumps(out)).decode())
