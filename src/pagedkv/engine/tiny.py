"""Tiny random-weight transformers models of catalog architectures, built offline in fp32
(``pagedkv generate --tiny``): the catalog config keeps its architecture, layer pattern,
RoPE and masks, with every size shrunk and only as many layers as it takes to hold each
kind of layer once. A multimodal or wrapper config gives its text model: Gemma 3's, and
Kimi-K3's Kimi-Linear (KDA + NoPE MLA as transformers' ``kimi_linear`` builds it; K3's MLA
output gate, which transformers does not model, is left out)."""

from __future__ import annotations

from typing import Any

from pagedkv.engine.loader import transformers_config
from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.modeling.registry import model_class
from pagedkv.models import load_config

# sizes a tiny model takes wherever its config has the field
_SMALL = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "attention_head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
    "ssm_state_size": 16, "n_groups": 2, "chunk_size": 8, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "query_pre_attn_scalar": 16, "num_nextn_predict_layers": 0, "num_experts_per_token": 2,
}
_KDA = {"num_heads": 2, "head_dim": 16}  # Kimi-Linear's linear_attn_config, shrunk
# wrapper configs whose text model --tiny builds: model_type -> (text architecture, the
# text config's fields transformers does not model)
_TEXT_MODELS = {"gemma3": ("Gemma3ForCausalLM", ()),
                "kimi_k3": ("KimiLinearForCausalLM", ("mla_use_output_gate",))}
_WINDOW = 8  # sliding windows shrink too, so that short prompts cross them
_DROP = ("quantization_config", "_pagedkv", "torch_dtype", "dtype", "num_hidden_layers",
         "sliding_window_pattern", "mlp_only_layers")


def _layers(raw: dict) -> dict:
    """Fewest layers holding every kind of layer once, with the pattern fields cut to fit."""
    out: dict[str, Any] = {}
    types = raw.get("layer_types")
    pattern = raw.get("hybrid_override_pattern")
    linear = raw.get("linear_attn_config")
    if linear and not types:  # Kimi-Linear: 1-based layer numbers of each kind
        total = int(raw["num_hidden_layers"])
        full = set(linear.get("full_attn_layers", ()))
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(total)]
        n = max(types.index(t) for t in set(types)) + 1
        out["linear_attn_config"] = {
            **linear, **_KDA,
            "full_attn_layers": [i + 1 for i in range(n) if types[i] == "full_attention"],
            "kda_layers": [i + 1 for i in range(n) if types[i] == "linear_attention"]}
        out["num_hidden_layers"] = n
        return out
    if raw.get("sliding_window_pattern") and not types:
        p = int(raw["sliding_window_pattern"])
        total = int(raw.get("num_hidden_layers", p))
        types = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(total)]
    if types:
        n = max(max(types.index(t) for t in set(types)) + 1, 2)
        out["layer_types"] = list(types[:n])
    elif pattern:
        n = max(pattern.index(c) for c in set(pattern)) + 1
        out["hybrid_override_pattern"] = pattern[:n]
    elif raw.get("full_attention_interval"):
        n = int(raw["full_attention_interval"])
    elif raw.get("kv_lora_rank") is not None:
        n = 2  # one dense, one MoE layer
    else:
        n = 2
    out["num_hidden_layers"] = n
    return out


def tiny_config(name: str, *, mtp_layers: int = 0) -> Any:
    """A transformers config of catalog model ``name`` at toy size (fp32); ``mtp_layers``
    sets ``num_nextn_predict_layers`` where the config has MTP layers (0: none)."""
    raw = load_config(name)
    arch = (raw.get("architectures") or ["?"])[0]
    text = raw.get("text_config")
    lacks: tuple[str, ...] = ()
    if text is not None and raw.get("model_type") in _TEXT_MODELS:
        arch, lacks = _TEXT_MODELS[raw["model_type"]]
        raw = {**text, "architectures": [arch]}
    model_class(arch)  # no native code: refuse before building anything
    if "text_config" in raw:
        raise UnsupportedArchitectureError(
            f"--tiny builds text models; {name!r} ({arch}) nests a text_config pagedkv "
            "has no tiny recipe for")
    cfg = {k: v for k, v in raw.items() if k not in _DROP and k not in lacks}
    for key, value in _SMALL.items():
        if key in cfg or key == "head_dim" and cfg.get("kv_lora_rank") is None:
            cfg[key] = value
    if "num_nextn_predict_layers" in cfg:
        cfg["num_nextn_predict_layers"] = mtp_layers
    if cfg.get("kv_lora_rank") is not None:  # MLA: every head reads the one latent
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if any(k in cfg for k in ("n_routed_experts", "num_experts", "num_local_experts")):
        cfg.update(n_group=1, topk_group=1)  # expert groups must divide the 4 tiny experts
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = min(int(cfg["sliding_window"]), _WINDOW)
    cfg.update(_layers(raw))
    if cfg.get("model_type") == "kimi_linear":  # its defaults lie outside a tiny vocabulary
        cfg.update(pad_token_id=0, bos_token_id=1, eos_token_id=None)
    cfg["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    cfg["dtype"] = "float32"
    return transformers_config(cfg, f"catalog model {name!r}")


def tiny_model(name: str, seed: int = 0, *, mtp_layers: int = 0) -> Any:
    """Random fp32 transformers model of ``tiny_config(name)``; weights are perturbed so
    that no norm weight sits at its initial value."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(name, mtp_layers=mtp_layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


class ByteTokenizer:
    """Text <-> UTF-8 bytes (ids 0..255), for tiny models, which ship no tokenizer."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
