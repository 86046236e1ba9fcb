"""Checkpoint folders through the engine's loader: save_pretrained round trips (one file
and sharded with an index), tied embeddings absent from the file, dtype conversion."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_check import hf_greedy, max_logit_diff, options, prompts, run  # noqa: E402

from pagedkv.engine import Engine, SamplingParams  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402


@pytest.fixture
def saved(tmp_path, capsys):
    def save(arch, **kw):
        model = tiny_model(arch, seed=3)
        model.save_pretrained(tmp_path, **kw)
        capsys.readouterr()
        return model, tmp_path

    return save


def test_sharded_round_trip_equals_transformers(saved):
    hf, folder = saved("qwen3-8b", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    ps = prompts(hf.config.vocab_size, (9, 14), seed=1)
    engine = run(hf, ps, options(), new=4, engine=Engine(folder, options()))
    assert max_logit_diff(hf, engine) <= 1e-4
    for out, p in zip(engine.outputs, ps):
        assert out.token_ids == hf_greedy(hf, p, 4)


def test_tied_embeddings_need_no_lm_head_tensor(saved):
    from safetensors import safe_open

    hf, folder = saved("gemma-3-27b")  # ties lm_head to the embeddings
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    engine = Engine(folder, options())
    assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(engine.model.lm_head.weight, hf.lm_head.weight)


def test_dtype_conversion_on_load(saved):
    hf, folder = saved("llama-3-8b")
    engine = Engine(folder, options(dtype="bf16", debug_nan=False))
    w = engine.model.model.layers[0].self_attn.q_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, hf.model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16))
    k = engine.runner.caches["model.layers.0.self_attn"]["k"]
    assert k.dtype == torch.bfloat16


def test_bf16_checkpoint_loads_into_fp32(saved, tmp_path):
    hf, folder = saved("mistral-7b")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    engine = Engine(tmp_path / "bf16", options(dtype="fp32"))
    w = engine.model.model.embed_tokens.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, hf.model.embed_tokens.weight.float())


def test_folder_tokenizer_takes_text(saved):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    hf, folder = saved("llama-3-8b")
    words = ["<unk>", "the", "cache", "is", "paged", "and", "shared"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    engine = Engine(folder, options(record_logits=False))
    out = engine.generate(["the cache is paged"], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == [1, 2, 3, 4]
    assert out.token_ids == hf_greedy(hf, [1, 2, 3, 4], 3)
    assert out.text == engine.tokenizer.decode(out.token_ids)


def test_generation_config_eos_stops_generation(saved):
    hf, folder = saved("llama-3-8b")
    (p,) = [[3, 1, 4, 1, 5, 9, 2, 6]]
    free = hf_greedy(hf, p, 6)
    k = next(i for i in range(1, 6) if free[i] not in free[:i])
    hf.generation_config.eos_token_id = [free[k]]  # a later greedy token is an EOS now
    hf.generation_config.save_pretrained(folder)
    out = Engine(folder, options(record_logits=False)).generate([p], SamplingParams(max_new_tokens=6))[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop"


def test_bf16_caches_sit_at_the_plans_offsets():
    hf = tiny_model("gemma-3-27b")
    engine = Engine(hf, options(dtype="bf16"))  # NaN-filled pools, every row's logits kept
    rank = engine.plan.ranks[0]
    caches = engine.runner.caches
    for pool in rank.pools:
        views = [v for v in rank.views if v.pool == pool.id]
        base = None
        for v in views:
            t = caches[v.layer][v.tensor]
            assert t.dtype == torch.bfloat16 and tuple(t.shape) == tuple(v.shape)
            start = t.untyped_storage().data_ptr()
            base = start if base is None else base
            assert start == base  # one buffer per pool
            assert t.data_ptr() - start == v.offset
        assert base is not None
    out = engine.generate([[5, 6, 7, 8, 9] * 3], SamplingParams(max_new_tokens=4,
                                                                ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    rows = torch.stack([row for _, row in engine.logits[out.rid]])
    assert rows.shape[0] == 15 + 3 and bool(torch.isfinite(rows).all())
    with torch.no_grad():
        ref = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0, :-1]
    assert float((rows - ref).abs().max()) < 0.05 * float(ref.abs().max())  # bf16 vs fp32


def test_block_major_caches_hold_each_block_of_every_layer_in_one_stretch():
    # gemma-3 (sliding + full pools): block b of every layer lies in bytes
    # [b * page_bytes, (b + 1) * page_bytes) of its pool, layers do not overlap inside a
    # block, and generation through these strided views matches transformers (bf16)
    hf = tiny_model("gemma-3-27b")
    engine = Engine(hf, options(dtype="bf16", block_major_cache=True))
    rank = engine.plan.ranks[0]
    caches = engine.runner.caches
    for pool in rank.pools:
        spans = {}
        for v in (v for v in rank.views if v.pool == pool.id):
            t = caches[v.layer][v.tensor]
            assert tuple(t.shape) == tuple(v.shape)
            item = t.element_size()
            assert t.stride(0) * item == pool.page_bytes
            base = t.untyped_storage().data_ptr()
            last = t.data_ptr() + (t[0].numel()) * item - base  # end of block 0's bytes
            first = t.data_ptr() - base
            assert 0 <= first and last <= pool.page_bytes
            b = pool.num_pages - 1  # the last block too
            assert b * pool.page_bytes <= t[b].data_ptr() - base
            assert t[b].data_ptr() - base + t[b].numel() * item <= (b + 1) * pool.page_bytes
            spans[v.offset] = (first, last)
        ordered = sorted(spans.values())
        assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:]))  # no overlap
    out = engine.generate([[5, 6, 7, 8, 9] * 3], SamplingParams(max_new_tokens=4,
                                                                ignore_eos=True))[0]
    rows = torch.stack([row for _, row in engine.logits[out.rid]])
    assert rows.shape[0] == 15 + 3 and bool(torch.isfinite(rows).all())
    with torch.no_grad():
        ref = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0, :-1]
    assert float((rows - ref).abs().max()) < 0.05 * float(ref.abs().max())  # bf16 vs fp32


TEN = ["llama-3-8b", "qwen3-8b", "mistral-7b", "gemma-3-27b", "gpt-oss-20b", "deepseek-v3",
       "deepseek-v2-lite", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b"]


@pytest.mark.parametrize("arch", TEN)
def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_built(
        arch, saved, monkeypatch):
    """hidden_size doubled in config.json over the saved weights: a WeightError naming a
    tensor's two shapes, from the meta-device check, before the real build (which the
    test replaces by a failure); the intact folder passes the same check."""
    import json

    from pagedkv.engine import loader
    from pagedkv.errors import WeightError

    _, folder = saved(arch)
    config = loader.read_config(folder)
    shapes = loader.header_shapes(loader.weight_files(folder))
    loader._check_shapes(loader.model_class(loader.architecture_of(config)), config, shapes)

    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    text["hidden_size"] *= 2
    (folder / "config.json").write_text(json.dumps(raw))

    def built(*args, **kwargs):
        raise RuntimeError("the real model was built")

    monkeypatch.setattr(loader, "build_model", built)
    with pytest.raises(WeightError, match=r"has shape \(.*needs \("):
        loader.load_folder(folder, device=torch.device("cpu"))
