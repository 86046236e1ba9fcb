"""The bug that started pagedkv, as a test: a Kimi-K3-like target (causal MLA) and a
DSpark-like drafter (non-causal MLA, 7-token draft blocks) share ONE block table.

One step: the target runs short prefills, decodes and a causal verify block; the drafter
runs a draft block per request. Caches start NaN-filled, so a read of any slot this step
or an earlier one did not write shows up as NaN. Each attention group's rows are
dispatched by its own view (decode rows and prefill rows in separate calls, as kernels
that split do); both outputs must equal a dense float64 MLA computed here, in naive
(decompressed) form with masks written out by hand.
"""

from __future__ import annotations

import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")
ops = pytest.importorskip("pagedkv.ops")

from pagedkv.batch import AttentionGroup, ScheduledRequest, attention_view, build_metadata  # noqa: E402
from pagedkv.errors import UnsupportedCapabilityError  # noqa: E402
from pagedkv.kvspec import Attention, Full, LayerSpec, MLALatent  # noqa: E402
from pagedkv.plan.types import Group  # noqa: E402

DEVICE = torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))

R, P, DN, DV = 32, 8, 16, 16  # latent rank, rope dims, per-head nope/value dims (tiny)
DRAFT_BLOCK = 7
NUM_BLOCKS = 96
LATENT = MLALatent(kv_lora_rank=R, rope_dim=P)
TARGET_LAYERS = [LayerSpec(f"target.{i}", LATENT, Full(), Attention(), index=i) for i in range(2)]
DRAFT_LAYERS = [
    LayerSpec("dspark.0", LATENT, Full(), Attention(causal=False, draft_block=DRAFT_BLOCK), model="dspark")
]
HEADS = {"target.0": 4, "target.1": 4, "dspark.0": 2}
# target: its decode kernel takes one row; drafter: a kernel that folds up to 8 query rows
TARGET = AttentionGroup.from_layers("k3-mla", TARGET_LAYERS)
DRAFTER = AttentionGroup.from_layers(
    "dspark-mla", DRAFT_LAYERS, supports_non_causal=True, decode_threshold=8
)
# (id, tokens already computed, target query rows, of which drafts)
TARGET_STEP = [
    ("prefill-a", 0, 5, 0),  # short prefill
    ("decode-a", 13, 1, 0),
    ("prefill-b", 6, 3, 0),  # short chunked prefill
    ("verify", 9, 7, 6),  # last sampled token + 6 drafts, verified causally
    ("decode-b", 2, 1, 0),
]


def make_group(block_size: int) -> Group:
    layers = tuple(TARGET_LAYERS + DRAFT_LAYERS)
    return Group(
        id=0, layers=layers, retention=Full(), block_size=block_size, position_offset=0,
        models=("target", "dspark"), bytes_per_token=len(layers) * LATENT.entry_dim * 2,
        bytes_per_request=0, num_blocks=NUM_BLOCKS, blocks_per_request=0, step_blocks=0,
    )


def dense_mla(q_nope, q_rope, latent, w_uk, w_uv, q_pos, causal, anchor):
    """Naive MLA in float64 for one sequence: decompress keys/values per head, mask by hand.

    latent [N, R + P] for positions 0..N-1; q_* [Q, H, *] at positions q_pos. Causal rows
    see keys <= their position; a non-causal draft block sees keys before its anchor and
    every key of its own block (anchor .. anchor + DRAFT_BLOCK - 1).
    """
    c_kv, k_rope = latent[:, :R], latent[:, R:]
    k_nope = torch.einsum("hdr,nr->nhd", w_uk, c_kv)
    value = torch.einsum("hvr,nr->nhv", w_uv, c_kv)
    out = torch.zeros(len(q_pos), w_uk.shape[0], DV, dtype=torch.float64)
    for i, p in enumerate(q_pos):
        keys = [k for k in range(latent.shape[0]) if (k <= p if causal else k < anchor + DRAFT_BLOCK)]
        scores = (
            torch.einsum("hd,nhd->hn", q_nope[i], k_nope[keys])
            + torch.einsum("hd,nd->hn", q_rope[i], k_rope[keys])
        ) / math.sqrt(DN + P)
        out[i] = torch.einsum("hn,nhv->hv", torch.softmax(scores, dim=-1), value[keys])
    return out


class DecodeKernelRefused(Exception):
    """The stand-in decode kernel got more query rows per request than it can take."""


# what each layer's decode kernel can take, fixed by the kernel, not by any view: the
# target's is one row per request, the drafter's folds up to 8 rows
DECODE_CAPACITY = {"target.0": 1, "target.1": 1, "dspark.0": 8}


def run_view(view, cache, q_nope, q_rope, w_uk, w_uv, mask, decode_capacity):
    """Dispatch like a splitting backend: decode rows, then prefill rows, in separate calls
    over sub-batches picked by the view's index lists (rows stay where they are)."""
    meta = view.metadata
    qsl = meta.query_start_loc.tolist()
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], DV, dtype=torch.float64)
    for reqs, limit in ((view.decode_reqs_host, decode_capacity), (view.prefill_reqs_host, None)):
        if not reqs:
            continue
        rows = [r for i in reqs for r in range(qsl[i], qsl[i + 1])]
        lens = [qsl[i + 1] - qsl[i] for i in reqs]
        if limit is not None and max(lens) > limit:
            raise DecodeKernelRefused(f"decode kernel given queries of {lens} > {limit}")
        sub_qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
        picked = torch.tensor(list(reqs), dtype=torch.long, device=DEVICE)
        out[rows] = ops.paged_mla(
            q_nope[rows].to(DEVICE), q_rope[rows].to(DEVICE), cache, sub_qsl.to(DEVICE),
            meta.seq_lens[picked], meta.block_table[picked], w_uk=w_uk.to(DEVICE),
            w_uv=w_uv.to(DEVICE), mask=mask, compute_dtype=torch.float64,
        ).cpu()
    return out


class Scene:
    """Block lists, caches (NaN-filled, history written) and the truth of every entry."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.bs = block_size
        free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        self.blocks = {}
        for req_id, computed, new, _ in TARGET_STEP:
            # the drafter's block of 7 follows the target's tokens, in lookahead blocks
            need = -(-(computed + new + DRAFT_BLOCK) // block_size)
            self.blocks[req_id] = [free.pop() for _ in range(need)]
        self.caches = {
            name: ops.fill_nan_(
                torch.empty(NUM_BLOCKS, block_size, R + P, dtype=torch.bfloat16, device=DEVICE)
            )
            for name in HEADS
        }
        self.truth = {name: {r: {} for r in self.blocks} for name in HEADS}
        self.weights = {
            name: (self.randn(h, DN, R) / math.sqrt(R), self.randn(h, DV, R) / math.sqrt(R))
            for name, h in HEADS.items()
        }
        for req_id, computed, _, _ in TARGET_STEP:  # earlier steps wrote the history
            for name in HEADS:
                self.write(name, [(req_id, p) for p in range(computed)], None)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.rng, dtype=torch.float64)

    def write(self, layer, rows, slot_mapping):
        """Write fresh entries for (request, position) rows; slots from the metadata, or
        worked out here for the history."""
        latent = self.randn(len(rows), R + P).to(torch.bfloat16)
        if slot_mapping is None:
            slot_mapping = torch.tensor(
                [self.blocks[r][p // self.bs] * self.bs + p % self.bs for r, p in rows],
                dtype=torch.int64,
            )
        latent_dev = latent.to(DEVICE)
        ops.write_mla_latent(
            latent_dev[:, :R], latent_dev[:, R:], self.caches[layer], slot_mapping.to(DEVICE)
        )
        for (r, p), value in zip(rows, latent.double()):
            self.truth[layer][r][p] = value

    def invocation(self, spec, pad_batch_to=None, pad_tokens_to=None):
        reqs = [
            ScheduledRequest(r, c, n, {0: self.blocks[r]}, num_draft_tokens=d) for r, c, n, d in spec
        ]
        meta = build_metadata(
            reqs, [make_group(self.bs)], device=DEVICE, checked=True,
            pad_batch_to=pad_batch_to, pad_tokens_to=pad_tokens_to,
        )[0]
        rows = [(r, c + j) for r, c, n, _ in spec for j in range(n)]
        return meta, rows

    def forward(self, layer, meta, rows, view, mask):
        """Write this invocation's entries through the slot mapping, then attend."""
        total = meta.slot_mapping.shape[0]
        real = meta.num_tokens
        self.write(layer, rows, meta.slot_mapping[:real])
        h = HEADS[layer]
        q_nope, q_rope = self.randn(total, h, DN), self.randn(total, h, P)
        w_uk, w_uv = self.weights[layer]
        got = run_view(
            view, self.caches[layer], q_nope, q_rope, w_uk, w_uv, mask, DECODE_CAPACITY[layer]
        )
        return got, q_nope, q_rope

    def reference(self, layer, spec, q_nope, q_rope, causal):
        w_uk, w_uv = self.weights[layer]
        parts, row = [], 0
        for r, c, n, _ in spec:
            latent = torch.stack([self.truth[layer][r][p] for p in range(c + n)])
            q_pos = list(range(c, c + n))
            parts.append(
                dense_mla(q_nope[row : row + n], q_rope[row : row + n], latent, w_uk, w_uv, q_pos, causal, c)
            )
            row += n
        return torch.cat(parts)


@pytest.mark.parametrize(("block_size", "seed"), [(1, 0), (4, 1), (16, 2), (64, 3)])
def test_target_and_drafter_share_one_block_table(block_size, seed):
    scene = Scene(block_size, seed)
    target_meta, target_rows = scene.invocation(TARGET_STEP, pad_batch_to=8, pad_tokens_to=20)
    draft_step = [(r, c + n, DRAFT_BLOCK, DRAFT_BLOCK - 1) for r, c, n, _ in TARGET_STEP]
    draft_meta, draft_rows = scene.invocation(draft_step)

    # the drafter's view is built first: nothing of it may reach the target's
    draft_view = attention_view(draft_meta, DRAFTER, causal=False)
    target_view = attention_view(target_meta, TARGET, causal=True)
    assert draft_view.num_decodes == len(TARGET_STEP) and draft_view.num_prefills == 0
    assert [target_meta.req_ids[i] for i in target_view.decode_reqs_host] == ["decode-a", "decode-b"]
    assert [target_meta.req_ids[i] for i in target_view.prefill_reqs_host] == [
        "prefill-a", "prefill-b", "verify"
    ]

    n = target_meta.num_tokens
    for layer in ("target.0", "target.1"):
        got, q_nope, q_rope = scene.forward(layer, target_meta, target_rows, target_view, ops.CAUSAL)
        assert not got.isnan().any(), layer
        want = scene.reference(layer, TARGET_STEP, q_nope, q_rope, causal=True)
        torch.testing.assert_close(got[:n], want, rtol=1e-9, atol=1e-9)
        assert (got[n:] == 0).all()  # padding token rows: never part of a sequence

    # the drafter's context KV for the step's new tokens (projected from the target's hidden
    # states) goes through the target invocation's slots: the block table is shared
    scene.write("dspark.0", target_rows, target_meta.slot_mapping[:n])
    mask = ops.Mask(causal=False, draft_block=DRAFT_BLOCK)
    got, q_nope, q_rope = scene.forward("dspark.0", draft_meta, draft_rows, draft_view, mask)
    assert not got.isnan().any()
    want = scene.reference("dspark.0", draft_step, q_nope, q_rope, causal=False)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_drafter_flags_do_not_leak_into_the_target():
    scene = Scene(4, 7)
    target_meta, target_rows = scene.invocation(TARGET_STEP)
    # the target's own kernel cannot run non-causal: refused, not silently causal
    with pytest.raises(UnsupportedCapabilityError, match="supports_non_causal"):
        attention_view(target_meta, TARGET, causal=False)
    # the drafter's attention group on the target's invocation: ragged lengths, refused
    with pytest.raises(UnsupportedCapabilityError, match="draft block 7"):
        attention_view(target_meta, DRAFTER, causal=False)
    # a target group that merged the drafter's flags (what the original bug did) would split
    # differently: short prefills and the verify block would go down the decode path
    merged = AttentionGroup(
        "merged", "target", TARGET.layer_names, supports_non_causal=True,
        decode_threshold=DRAFTER.decode_threshold, draft_block=DRAFT_BLOCK,
    )
    bad = attention_view(target_meta, merged, causal=True)
    good = attention_view(target_meta, TARGET, causal=True)
    assert bad.decode_reqs_host != good.decode_reqs_host
    assert set(good.prefill_reqs_host) <= set(bad.decode_reqs_host)
    with pytest.raises(DecodeKernelRefused):
        scene.forward("target.0", target_meta, target_rows, bad, ops.CAUSAL)
    # and a non-causal mask on the target's rows gives different numbers than its reference
    got, q_nope, q_rope = scene.forward(
        "target.0", target_meta, target_rows, good, ops.Mask(causal=False)
    )
    want = scene.reference("target.0", TARGET_STEP, q_nope, q_rope, causal=True)
    assert not torch.allclose(got, want, rtol=1e-6, atol=1e-6)
