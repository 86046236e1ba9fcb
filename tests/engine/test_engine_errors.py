"""Bad requests and checkpoints raise specific pagedkv errors; in a batch, the other
requests still finish."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_check import options  # noqa: E402

from pagedkv.engine import Engine, EngineOptions, SamplingParams  # noqa: E402
from pagedkv.engine.tiny import tiny_model  # noqa: E402
from pagedkv.errors import (  # noqa: E402
    CheckpointError,
    InvalidArgumentError,
    RequestError,
    RequestTooLargeError,
    UnsupportedArchitectureError,
    WeightError,
)


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny_model("llama-3-8b"), options(max_model_len=32, record_logits=False))


def test_bad_requests_fail_alone(engine):
    good = [1, 2, 3, 4, 5]
    # (1.5 was truncated to token 1; "a", [1] and 7 were a ValueError/TypeError)
    outs = engine.generate([good, [7] * 30, [1, 999], [], "text", [1.5], ["a"], [[1]], 7,
                            torch.tensor(good)],
                           SamplingParams(max_new_tokens=4, ignore_eos=True))
    kinds = [type(o.error) if o.error else None for o in outs]
    assert kinds == [None, RequestTooLargeError] + [RequestError] * 7 + [None]
    assert [len(o.token_ids) for o in outs] == [4] + [0] * 8 + [4]
    assert outs[0].token_ids == outs[9].token_ids  # greedy, same prompt (a tensor's ids)
    assert "max_model_len 32" in str(outs[1].error)
    assert "999" in str(outs[2].error)
    assert sum(engine.manager.blocks_used()) == 0


def test_add_request_raises(engine):
    with pytest.raises(RequestTooLargeError, match="exceed max_model_len"):
        engine.add_request([1] * 20, SamplingParams(max_new_tokens=13))
    with pytest.raises(RequestError, match="tokenizer"):
        engine.add_request("no tokenizer here")


def test_checkpoint_errors(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="not a folder"):
        Engine(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="no config.json"):
        Engine(tmp_path)
    model = tiny_model("llama-3-8b")
    model.save_pretrained(tmp_path)
    capsys.readouterr()
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Engine(tmp_path)
    (tmp_path / "weights.bin").rename(tmp_path / "model.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="absent"):
        Engine(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Nope"]}))
    with pytest.raises(UnsupportedArchitectureError, match="Nope"):
        Engine(tmp_path)


def test_weight_errors_name_the_tensor():
    from pagedkv.modeling.llama import LlamaForCausalLM

    hf = tiny_model("llama-3-8b")
    state = dict(hf.state_dict())
    native = LlamaForCausalLM(hf.config)
    with pytest.raises(WeightError, match="model.norm.weight"):
        native.load_weights((k, v) for k, v in state.items() if k != "model.norm.weight")
    with pytest.raises(WeightError, match="shape"):
        native.load_weights([*state.items(), ("model.norm.weight", torch.zeros(5))])
    with pytest.raises(WeightError, match="matches no parameter"):
        native.load_weights([*state.items(), ("model.extra.weight", torch.zeros(5))])


def test_abort_mid_run_leaves_the_others_exact():
    from engine_check import max_logit_diff, prompts

    hf = tiny_model("gpt-oss-20b")
    engine = Engine(hf, options(max_batched_tokens=6))
    ps = prompts(hf.config.vocab_size, (7, 9, 5), seed=8)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in ps]
    for _ in range(3):  # the second request is mid-prefill or decoding
        engine.step()
    assert engine.abort(rids[1]) and not engine.abort(rids[1])
    while engine.scheduler.has_work():
        engine.step()
    reqs = [engine.requests[r] for r in rids]
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length"]
    assert sum(engine.manager.blocks_used()) == 0
    from pagedkv.engine import RequestOutput

    engine.outputs = [RequestOutput(r.rid, list(r.prompt), list(r.output)) for r in reqs
                      if r.finish_reason == "length"]
    assert max_logit_diff(hf, engine) <= 1e-4


def test_saved_rotary_buffers_are_skipped():
    from pagedkv.modeling.llama import LlamaForCausalLM

    hf = tiny_model("llama-3-8b")
    state = dict(hf.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # older checkpoints
    native = LlamaForCausalLM(hf.config)
    native.load_weights(state.items())
    assert torch.equal(native.model.norm.weight, hf.model.norm.weight)


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": "1"}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"stop_token_ids": "ab"}, "stop_token_ids"),
    ({"stop_token_ids": (1.5,)}, "stop_token_ids"),  # (was truncated to 1)
    ({"stop_token_ids": 5}, "stop_token_ids"),
])
def test_sampling_params_of_the_wrong_kind_raise(kwargs, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_numbers():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(temperature=np.float32(0.5), stop_token_ids=[np.int64(7), 9])
    assert sp.stop_token_ids == (7, 9) and all(type(t) is int for t in sp.stop_token_ids)


@pytest.mark.parametrize("kwargs, needle", [
    ({"block_size": 0}, "block_size"), ({"max_batched_tokens": None}, "max_batched_tokens"),
    ({"max_running": 1.5}, "max_running"), ({"kv_cache_bytes": "1GiB"}, "kv_cache_bytes"),
    ({"max_model_len": "64"}, "max_model_len"), ({"seed": None}, "seed"),
    ({"spec_tokens": -1}, "spec_tokens"), ({"device": "tpu"}, "device"),
    ({"device": None}, "device"),
])
def test_engine_options_of_the_wrong_kind_raise_at_once(kwargs, needle):
    # (were TypeErrors and RuntimeErrors from the planner, the allocator or torch)
    with pytest.raises(InvalidArgumentError, match=needle):
        EngineOptions(**kwargs)


def test_spec_tokens_must_leave_room_within_max_model_len():
    with pytest.raises(InvalidArgumentError, match="spec_tokens 64 leave no room"):  # (was a
        Engine(tiny_model("llama-3-8b"), options(max_model_len=64, spec_tokens=64))  # MemoryError
