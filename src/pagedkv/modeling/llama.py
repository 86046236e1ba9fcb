"""The Llama family over pagedkv: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k
RMSNorm). Sliding windows, per layer where ``layer_types`` says so, come from the layers'
specs (``ctx.attend``), not from this file. Parameter names follow the HF checkpoints.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from pagedkv.modeling.attention import GQAAttention
from pagedkv.modeling.decoder import DecoderLM, DecoderModel, PreNormLayer
from pagedkv.modeling.layers import GatedMLP, RMSNorm, Rope, head_dim


class LlamaDecoderLayer(PreNormLayer):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        qwen2 = config.model_type == "qwen2"  # q/k/v bias always, o_proj never
        qk_norm = (partial(RMSNorm, eps=config.rms_norm_eps)
                   if config.model_type == "qwen3" else None)
        self.self_attn = GQAAttention(config, f"model.layers.{index}.self_attn",
                                      bias=True if qwen2 else None, o_bias=False if qwen2 else None,
                                      qk_norm=qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(DecoderLM):
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM")

    def __init__(self, config: Any) -> None:
        norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        super().__init__(config, DecoderModel(config, LlamaDecoderLayer, norm,
                                              Rope(config, head_dim(config))))
