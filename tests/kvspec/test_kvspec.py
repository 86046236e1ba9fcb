"""Layout bytes, retention arithmetic, attention validation and block-table compatibility."""

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.errors import ConfigError, IncompatibleLayersError, InvalidArgumentError
from pagedkv.kvspec import (
    Attention,
    AttentionKV,
    ChunkedLocal,
    Compressed,
    Cross,
    DType,
    Full,
    IndexerKV,
    LayerSpec,
    MLALatent,
    Recurrent,
    RecurrentState,
    SharedKV,
    SlidingWindow,
    StateTensor,
    block_table_compatibility,
    blocks_per_request,
    bytes_per_request,
    bytes_per_token,
    require_block_table_compatible,
    step_blocks,
)

SIZES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@given(
    heads=st.integers(1, 64),
    head_dim=st.sampled_from([64, 80, 128, 256]),
    v_dim=st.none() | st.sampled_from([64, 128]),
    dtype=st.sampled_from(sorted(SIZES)),
)
def test_attention_kv_bytes(heads, head_dim, v_dim, dtype):
    layout = AttentionKV(heads, head_dim, dtype, v_head_dim=v_dim)
    expected = heads * (head_dim + (head_dim if v_dim is None else v_dim)) * SIZES[dtype]
    assert bytes_per_token(layout) == expected
    assert bytes_per_request(layout) == 0


def test_mla_formats_match_public_byte_counts():
    # model-facts.md: 576 values; bf16 1152 B, fp8 576 B, fp8_ds_mla 656 B
    assert bytes_per_token(MLALatent(512, 64, "bf16")) == (512 + 64) * 2
    assert bytes_per_token(MLALatent(512, 64, "fp16")) == 1152
    assert bytes_per_token(MLALatent(512, 64, "fp8")) == 576
    assert bytes_per_token(MLALatent(512, 64, "fp8_ds_mla")) == 512 + 4 * 4 + 64 * 2
    assert bytes_per_token(IndexerKV()) == 128 + 4


def test_recurrent_state_bytes_and_tp_shard():
    # Kimi-K3 KDA as the vLLM peer harness describes it: conv [3, 36864] + state [96,128,128] fp32
    state = RecurrentState(
        (StateTensor("conv", (3, 36864), "fp32", 1), StateTensor("ssm", (96, 128, 128), "fp32", 0)),
        "kda",
    )
    assert bytes_per_request(state) == 3 * 36864 * 4 + 96 * 128 * 128 * 4 == 6733824
    assert bytes_per_token(state) == 0
    assert bytes_per_request(state.shard(8)) == 6733824 // 8


@given(heads=st.sampled_from([1, 2, 4, 8, 16]), tp=st.sampled_from([1, 2, 4, 8, 16]))
def test_kv_heads_split_or_replicated(heads, tp):
    per_rank = AttentionKV(heads, 128).shard(tp).num_kv_heads
    assert per_rank == max(1, heads // tp)
    assert MLALatent().shard(tp) == MLALatent()


def test_uneven_tp_split_is_refused():
    with pytest.raises(InvalidArgumentError, match="6 heads"):
        AttentionKV(6, 128).shard(4)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: AttentionKV(0, 128),
        lambda: AttentionKV(8, 128, "int4"),
        lambda: MLALatent(500, 64, "fp8_ds_mla"),
        lambda: MLALatent(512, 64, "e5m2x"),
        lambda: SlidingWindow(0),
        lambda: ChunkedLocal(-1),
        lambda: Attention(causal=True, draft_block=7),
        lambda: StateTensor("s", (0, 4)),
        lambda: RecurrentState(()),
    ],
)
def test_bad_specs_raise_config_error(bad):
    with pytest.raises(ConfigError):
        bad()


def test_layer_needs_matching_layout_and_retention():
    with pytest.raises(ConfigError, match="recurrent"):
        LayerSpec("l0", AttentionKV(8, 128), Recurrent())
    with pytest.raises(ConfigError, match="window of 128"):
        LayerSpec("l1", AttentionKV(8, 64), SlidingWindow(128), Attention())  # would read freed KV
    LayerSpec("l2", AttentionKV(8, 64), SlidingWindow(128), Attention(window=128))


@given(
    n=st.integers(0, 200_000),
    bs=st.sampled_from([1, 16, 64, 128]),
    window=st.integers(1, 9000),
)
def test_window_blocks_cover_window_and_never_exceed_full(n, bs, window):
    sliding = blocks_per_request(SlidingWindow(window), n, bs)
    full = blocks_per_request(Full(), n, bs)
    assert full * bs >= n > (full - 1) * bs
    assert sliding <= full
    if n >= window:
        # the window's keys may start anywhere inside a block: they need this many blocks
        assert sliding * bs >= window - 1 + 1
    assert step_blocks(SlidingWindow(window), 2048, bs) * bs >= 2048
    assert step_blocks(Full(), 2048, bs) == 0


def test_chunked_and_cross_and_recurrent_blocks():
    assert blocks_per_request(ChunkedLocal(8192), 262144, 16) == 8192 // 16
    assert blocks_per_request(ChunkedLocal(100), 262144, 16) == 7 + 1
    assert blocks_per_request(Cross(1500), 10, 16) == 94
    assert blocks_per_request(Recurrent(), 10**6, 16) == 0


def _mla(name, model="target", attention=None, offset=0):
    return LayerSpec(name, MLALatent(), Full(), attention or Attention(), model, offset)


def test_target_and_drafter_share_whatever_their_masks():
    target = _mla("model.layers.3")
    draft = _mla("draft.layers.0", "draft", Attention(causal=False, draft_block=7))
    verdict = block_table_compatibility(target, draft, 64, 64)
    assert verdict.ok and bool(verdict)


def test_incompatibility_reasons():
    full = _mla("a")
    window = LayerSpec("b", AttentionKV(8, 64), SlidingWindow(128), Attention(window=128))
    eagle = _mla("c", "draft", offset=1)
    assert "window 128" in block_table_compatibility(full, window, 16, 16).reason
    assert not block_table_compatibility(full, full, 16, 64)
    assert "offset" in block_table_compatibility(full, eagle, 64, 64).reason
    with pytest.raises(IncompatibleLayersError, match="offset"):
        require_block_table_compatible(full, eagle, 64, 64)


def test_incompatible_layers_refused_under_python_O():
    code = textwrap.dedent(
        """
        import sys
        from pagedkv.errors import IncompatibleLayersError
        from pagedkv.kvspec import *
        assert False, "this assert must be stripped by -O"
        """
    )
    # first prove we really run with asserts stripped, then that the refusal still happens
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code2 = textwrap.dedent(
        """
        from pagedkv.errors import IncompatibleLayersError
        from pagedkv.kvspec import *
        a = LayerSpec("a", AttentionKV(8, 64), Full(), Attention())
        b = LayerSpec("b", AttentionKV(8, 64), SlidingWindow(128), Attention(window=128))
        try:
            require_block_table_compatible(a, b, 16, 16)
        except IncompatibleLayersError as e:
            print("refused:", e)
        else:
            raise SystemExit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code2], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused:")


def test_dtype_sizes():
    assert DType("bf16").itemsize == 2 and DType.FP32.itemsize == 4 and DType.FP8.itemsize == 1


# --- compressed retention, shared K=V, plain-dtype indexer keys (DeepSeek-V4, MiniMax-M3) -----


@pytest.mark.parametrize(
    "ratio, tokens, block_size, blocks",
    [
        (4, 131072, 16, 2048),  # 131072 // 4 = 32768 entries / 16 per block
        (128, 131072, 16, 64),  # 131072 // 128 = 1024 entries / 16
        (4, 7, 16, 1),  # 7 // 4 = 1 complete window -> 1 entry -> 1 block
        (4, 3, 16, 0),  # no complete window yet: nothing kept
        (128, 16 * 128 + 127, 16, 1),  # 16 entries fill one block; the open window is state
        (128, 17 * 128, 16, 2),  # 17 entries -> 2 blocks
    ],
)
def test_compressed_retention_keeps_one_entry_per_complete_window(ratio, tokens, block_size, blocks):
    assert blocks_per_request(Compressed(ratio), tokens, block_size) == blocks
    assert step_blocks(Compressed(ratio), 2048, block_size) == 0  # entries already counted


@pytest.mark.parametrize("ratio", [0, -4, 2.5, None])
def test_compressed_retention_needs_a_positive_ratio(ratio):
    with pytest.raises(ConfigError, match="ratio"):
        Compressed(ratio)


def test_compressed_layers_share_a_table_only_with_the_same_ratio():
    kv = SharedKV(512)
    a = LayerSpec("a", kv, Compressed(4))
    b = LayerSpec("b", IndexerKV(128, DType.BF16), Compressed(4))
    c = LayerSpec("c", kv, Compressed(128))
    assert block_table_compatibility(a, b, 16, 16)
    assert not block_table_compatibility(a, c, 16, 16)
    assert "compressed 1/4" in block_table_compatibility(a, c, 16, 16).reason


def test_shared_kv_is_one_tensor_replicated_over_ranks():
    kv = SharedKV(512)
    assert bytes_per_token(kv) == 512 * 2  # one bf16 tensor read as K and V
    assert bytes_per_token(kv.with_dtype(DType.FP8)) == 512
    assert kv.shard(8) == kv  # a single head: every rank keeps it whole


def test_indexer_key_in_a_plain_dtype_or_deepseek_packed_fp8():
    assert bytes_per_token(IndexerKV(128, DType.BF16)) == 128 * 2
    assert bytes_per_token(IndexerKV(128)) == 128 + 4  # fp8 values + one fp32 scale
    assert bytes_per_token(IndexerKV(64, "bfloat16")) == 64 * 2
    assert IndexerKV(128, DType.BF16).with_dtype(DType.FP8) == IndexerKV(128, DType.BF16)
