"""Architecture name (a config's ``architectures[0]``) -> native model class.

Entries are ``"module:Class"`` strings, imported on first use, so that importing the
registry costs nothing and each model file is read only when its architecture is asked
for. Adding an architecture is one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pagedkv.errors import ConfigError, UnsupportedArchitectureError

_NATIVE: dict[str, str] = {
    "LlamaForCausalLM": "pagedkv.modeling.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedkv.modeling.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedkv.modeling.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedkv.modeling.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "pagedkv.modeling.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "pagedkv.modeling.gemma3:Gemma3ForCausalLM",
    "GptOssForCausalLM": "pagedkv.modeling.gpt_oss:GptOssForCausalLM",
    "Qwen3NextForCausalLM": "pagedkv.modeling.qwen3_next:Qwen3NextForCausalLM",
    "NemotronHForCausalLM": "pagedkv.modeling.nemotron_h:NemotronHForCausalLM",
    "DeepseekV3ForCausalLM": "pagedkv.modeling.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "pagedkv.modeling.deepseek_v3:DeepseekV3ForCausalLM",
    "KimiLinearForCausalLM": "pagedkv.modeling.kimi_linear:KimiLinearForCausalLM",
}

# model_types transformers registers no config class for, whose checkpoints name an
# architecture served by native code reading another model_type's config (Kimi K2 ships
# DeepSeek-V3's model with its own model_type and remote code)
_CONFIG_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def config_model_type(model_type: str) -> str:
    """The transformers model_type whose config class reads a ``model_type`` config."""
    return _CONFIG_ALIASES.get(model_type, model_type)


def native_architectures() -> tuple[str, ...]:
    """Architecture names with native model code, sorted."""
    return tuple(sorted(_NATIVE))


def architecture_of(config: Any) -> str:
    """``architectures[0]`` of a transformers config object or a config dict."""
    archs = config.get("architectures") if isinstance(config, Mapping) else getattr(
        config, "architectures", None)
    if not archs:
        raise ConfigError("config has no 'architectures' entry; cannot pick model code")
    return str(archs[0])


def model_class(architecture: str) -> type:
    """The native class serving ``architecture``; :class:`UnsupportedArchitectureError`
    (listing what is native) when there is none."""
    target = _NATIVE.get(architecture)
    if target is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} has no native model code in pagedkv.modeling; "
            f"native: {', '.join(native_architectures())}"
        )
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
