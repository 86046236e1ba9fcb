"""Weight bytes estimated from a config: parameter count by part, times bytes per parameter.

Counted: embeddings (and an untied LM head), each layer's token mixer (GQA/MHA, MLA incl.
its low-rank projections and the V3.2 indexer, Mamba-1/2, GatedDeltaNet, KDA, lightning),
dense MLPs and MoE layers (routed experts, shared experts, router). Norms, biases and
quantization scales are negligible and left out; vision towers of multimodal configs too.
Bytes per parameter: the model dtype (``torch_dtype``; float32 runs as bf16), except for
linear layers that ``quantization_config`` quantizes (:mod:`pagedkv.models.quantization`):
fp8 (1 byte plus an fp32 scale per ``weight_block_size`` block), mxfp4 (4 bits plus a
one-byte scale per 32), NVFP4 (4 bits plus an fp8 scale per 16), int-N GPTQ / AWQ /
compressed-tensors (N bits plus a 16-bit scale and an N-bit zero point per group).
Modules the config leaves unquantized (``modules_to_not_convert``, ``ignore``,
``exclude_modules``) stay in the model dtype; embeddings always do.

Structure no config field states is taken from the family: Llama 4 MoE layers have one
shared expert of ``intermediate_size``; ``relu2`` MLPs (Nemotron-H) have two matrices,
every other MLP three (gated). Drafters count what they own: EAGLE its layers, the fusion
``fc`` and a draft-vocabulary head; DFlash/DSpark their layers, ``fc`` over the target
layers they read and DSpark's Markov head (2 x vocab x markov_rank); both share the
target's embeddings (and DFlash/DSpark its LM head).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.models.attention import head_dim, is_mla, kv_heads, num_heads, value_head_dim
from pagedkv.models.drafters import (
    DFLASH,
    DSPARK,
    EAGLE,
    drafter_role,
    markov_rank,
    num_mtp_layers,
    target_layer_ids,
)
from pagedkv.models.fields import (
    first,
    int_list,
    model_type,
    need_int,
    opt_int,
    text_config,
)
from pagedkv.models.overrides import layer_fields
from pagedkv.models.pattern import (
    ATTENTION_KINDS,
    FULL,
    MLP,
    MOE,
    NO_CACHE_KINDS,
    RECURRENT,
    layer_pattern,
)
from pagedkv.models.quantization import (
    DENSE,
    EMBEDDING,
    EXPERTS,
    MIXER,
    OTHER,
    bytes_per_parameter,
)
from pagedkv.models.recurrent import (
    GDN,
    KDA,
    LIGHTNING,
    MAMBA1,
    MAMBA2,
    mamba1_dims,
    mamba2_dims,
    mamba_dt_rank,
    recurrent_family,
)


def _hidden(cfg: Mapping) -> int:
    return need_int(cfg, "hidden_size", why="the weight estimate")


def _attention_params(cfg: Mapping) -> int:
    h = _hidden(cfg)
    heads = num_heads(cfg)
    if not is_mla(cfg):
        dim = head_dim(cfg)
        v_dim = value_head_dim(cfg) or dim
        q, k, v = heads * dim, kv_heads(cfg) * dim, kv_heads(cfg) * v_dim
        return h * q + h * k + h * v + heads * v_dim * h
    why = "the MLA weight estimate"
    rank = need_int(cfg, "kv_lora_rank", why=why)
    rope = need_int(cfg, "qk_rope_head_dim", why=why, minimum=0)
    nope = need_int(cfg, "qk_nope_head_dim", why=why, minimum=0)
    v_dim = need_int(cfg, "v_head_dim", why=why)
    q_rank = opt_int(cfg, "q_lora_rank", minimum=1)
    q_out = heads * (nope + rope)
    q = h * q_rank + q_rank * q_out if q_rank else h * q_out
    params = q + h * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * h
    if cfg.get("mla_use_output_gate"):
        params += h * heads * v_dim
    if cfg.get("index_head_dim") is not None:  # V3.2 indexer: wq_b, wk, weights_proj
        dim = need_int(cfg, "index_head_dim", why="the indexer weights")
        n = need_int(cfg, "index_n_heads", why="the indexer weights")
        params += (q_rank or h) * n * dim + h * dim + h * n
    return params


def _recurrent_params(cfg: Mapping) -> int:
    h = _hidden(cfg)
    family = recurrent_family(cfg)
    if family == MAMBA1:
        inner, state, kernel = mamba1_dims(cfg)
        dt = mamba_dt_rank(cfg, h)
        return (h * 2 * inner + inner * kernel + inner * (dt + 2 * state) + dt * inner
                + inner * state + inner * h)
    if family == MAMBA2:
        heads, dim, state, groups, kernel = mamba2_dims(cfg)
        inner = heads * dim
        conv = inner + 2 * groups * state
        return h * (2 * inner + 2 * groups * state + heads) + conv * kernel + inner * h
    if family == GDN:
        why = "the GatedDeltaNet weights"
        kd = need_int(cfg, "linear_num_key_heads", why=why) * need_int(
            cfg, "linear_key_head_dim", why=why)
        v_heads = need_int(cfg, "linear_num_value_heads", why=why)
        vd = v_heads * need_int(cfg, "linear_value_head_dim", why=why)
        kernel = need_int(cfg, "linear_conv_kernel_dim", why=why)
        return h * (2 * kd + 2 * vd) + h * 2 * v_heads + (2 * kd + vd) * kernel + vd * h
    if family == KDA:
        lac = cfg["linear_attn_config"]
        why = "the KDA weights"
        heads, dim = need_int(lac, "num_heads", why=why), need_int(lac, "head_dim", why=why)
        kernel = need_int(lac, "short_conv_kernel_size", why=why)
        width = heads * dim
        # q, k, v, o projections; low-rank forget and output gates; beta; short convs
        return 4 * h * width + 2 * (h * dim + dim * width) + h * heads + 3 * width * kernel
    if family == LIGHTNING:  # qkv, output gate, out projection
        return 5 * h * num_heads(cfg) * head_dim(cfg)
    raise UnsupportedArchitectureError(f"no weight formula for recurrent family {family!r}")


def _mlp_matrices(cfg: Mapping) -> int:
    act = first(cfg, "mlp_hidden_act", "hidden_act", "hidden_activation")
    return 2 if act == "relu2" else 3


def _num_experts(cfg: Mapping) -> int:
    return opt_int(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0


def _is_moe_layer(cfg: Mapping, i: int) -> bool:
    """Whether decoder layer ``i`` has an MoE MLP, by the config's placement fields."""
    if not _num_experts(cfg):
        return False
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and i < len(types):
        return types[i] in ("sparse", "moe")
    moe_layers = int_list(cfg, "moe_layers")
    if moe_layers is not None:
        return i in moe_layers
    freq = cfg.get("moe_layer_freq")
    if isinstance(freq, list):  # MiMo-V2 / MiniMax-M3: one 0/1 flag per layer
        if i >= len(freq) or freq[i] not in (0, 1):
            raise ConfigError(f"moe_layer_freq must hold one 0/1 flag per layer, got {freq!r}")
        return bool(freq[i])
    if first(cfg, "first_k_dense_replace", "moe_layer_freq") is not None:
        k = opt_int(cfg, "first_k_dense_replace", default=0) or 0
        freq = opt_int(cfg, "moe_layer_freq", default=1, minimum=1) or 1
        return i >= k and i % freq == 0
    if cfg.get("expert_layer_period") is not None:
        period = need_int(cfg, "expert_layer_period", why="MoE placement")
        return i % period == (opt_int(cfg, "expert_layer_offset", default=0) or 0)
    if cfg.get("decoder_sparse_step") is not None:
        step = need_int(cfg, "decoder_sparse_step", why="MoE placement")
        return i not in (int_list(cfg, "mlp_only_layers") or []) and (i + 1) % step == 0
    if cfg.get("interleave_moe_layer_step") is not None:
        step = need_int(cfg, "interleave_moe_layer_step", why="MoE placement")
        return (i + 1) % step == 0
    return True


def _dense_params(cfg: Mapping) -> int:
    if cfg.get("block_configs") is not None and cfg.get("intermediate_size") == 0:
        h = _hidden(cfg)  # Nemotron NAS: a no-op FFN, or a single linear in its place
        return h * h if cfg.get("_ffn_linear") else 0
    size = need_int(cfg, "intermediate_size_mlp", "intermediate_size", why="dense MLP weights")
    return _mlp_matrices(cfg) * _hidden(cfg) * size


def _moe_params(cfg: Mapping) -> Counter:
    h, mats = _hidden(cfg), _mlp_matrices(cfg)
    experts = _num_experts(cfg)
    size = need_int(cfg, "moe_intermediate_size", "intermediate_size", why="expert weights")
    expert_hidden = opt_int(cfg, "routed_expert_hidden_size", "moe_latent_size", default=h,
                            minimum=1) or h
    out = Counter({EXPERTS: experts * mats * expert_hidden * size, OTHER: h * experts})
    if expert_hidden != h:  # latent MoE: experts run in a smaller space
        out[DENSE] += 2 * h * expert_hidden
    shared = opt_int(cfg, "n_shared_experts", "num_shared_experts", default=0) or 0
    shared_size = opt_int(
        cfg, "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", default=0
    ) or 0
    if shared_size:
        out[DENSE] += max(shared, 1) * mats * h * shared_size
    elif shared:
        out[DENSE] += shared * mats * h * size
    elif model_type(cfg).startswith("llama4"):
        out[DENSE] += mats * h * size
    return out


def _mlp_kind(cfg: Mapping, kind: str, index: int, sublayers: bool) -> str | None:
    """MOE, MLP (dense) or None: the MLP a layer of ``kind`` at ``index`` holds."""
    if sublayers:  # Nemotron-H: mixers and MLPs are separate layers
        return kind if kind in NO_CACHE_KINDS else None
    return MOE if _is_moe_layer(cfg, index) else MLP


def _layer_params(cfg: Mapping, kind: str, mlp: str | None) -> Counter:
    out = Counter()
    if kind in ATTENTION_KINDS:
        out[MIXER] += _attention_params(cfg)
    elif kind == RECURRENT:
        out[MIXER] += _recurrent_params(cfg)
    if mlp == MOE:
        out.update(_moe_params(cfg))
    elif mlp == MLP:
        out[DENSE] += _dense_params(cfg)
    return out


def _embedding_params(cfg: Mapping, head: bool = True) -> int:
    vocab = need_int(cfg, "vocab_size", why="the embedding weights")
    tied = bool(cfg.get("tie_word_embeddings", False))
    return vocab * _hidden(cfg) * (1 if tied or not head else 2)


def _decoder_params(cfg: Mapping) -> Counter:
    pattern = layer_pattern(cfg)
    sublayers = any(kind in NO_CACHE_KINDS for kind in pattern)
    out = Counter()
    for i, kind in enumerate(pattern):
        fields = layer_fields(cfg, i, kind)  # per-layer heads, dims, MLP widths
        out.update(_layer_params(fields, kind, _mlp_kind(cfg, kind, i, sublayers)))
    return out


def parameter_counts(config: Mapping) -> Counter:
    """Parameters by part (embedding / mixer / dense / experts / other) that the model a
    config describes owns; drafters count only what they do not share with the target."""
    cfg = text_config(config)
    if cfg.get("model_type") == "deepseek_v4":
        raise ConfigError(
            "DeepSeek-V4's weights are not estimated (hyper-connections, grouped output "
            "projection, compressors and indexers, expert_dtype "
            f"{cfg.get('expert_dtype')!r} experts are not counted)"
        )
    out = _decoder_params(cfg)
    role = drafter_role(cfg)
    h = _hidden(cfg)
    if role.kind == EAGLE:
        fused = len(target_layer_ids(cfg) or ()) or (3 if cfg.get("draft_vocab_size") else 2)
        out[DENSE] += fused * h * h
        if cfg.get("draft_vocab_size") is not None:
            out[EMBEDDING] += need_int(cfg, "draft_vocab_size", why="the EAGLE head") * h
    elif role.kind in (DFLASH, DSPARK):
        target_hidden = opt_int(cfg, "target_hidden_size", default=h, minimum=1) or h
        out[DENSE] += len(target_layer_ids(cfg) or ()) * target_hidden * h
        rank = markov_rank(cfg)
        if rank:
            out[OTHER] += 2 * need_int(cfg, "vocab_size", why="the Markov head") * rank
    else:
        out[EMBEDDING] += _embedding_params(cfg)
    return out


def estimate_parameters(config: Mapping) -> int:
    """Total parameter count (see :func:`parameter_counts`)."""
    return sum(parameter_counts(config).values())


def mtp_parameter_counts(config: Mapping) -> Counter:
    """Parameters of the target's MTP layers: a decoder block each (placed after the last
    layer, so MoE when the target's later layers are) plus the 2h -> h input projection."""
    cfg = text_config(config)
    depth, h = len(layer_pattern(cfg)), _hidden(cfg)
    out = Counter()
    for j in range(num_mtp_layers(cfg)):
        out.update(_layer_params(cfg, FULL, _mlp_kind(cfg, FULL, depth + j, False)))
        out[DENSE] += 2 * h * h
    return out


def _to_bytes(cfg: Mapping, counts: Counter) -> int:
    per = bytes_per_parameter(cfg)
    return math.ceil(sum(n * per[part] for part, n in counts.items()))


def estimate_weight_bytes(config: Mapping) -> int:
    """Bytes of the weights of the model ``config`` describes, all ranks together."""
    cfg = text_config(config)
    return _to_bytes(cfg, parameter_counts(cfg))


def mtp_weight_bytes(config: Mapping) -> int:
    """Bytes of the target's MTP layers (loaded only when they draft)."""
    cfg = text_config(config)
    return _to_bytes(cfg, mtp_parameter_counts(cfg))
