"""The eager decode call's host shortcuts: kept launch plans (``DecodePlan``), the kept
split-KV workspace and the direct launch through the compiled kernel's launcher
(``pagedkv.launch``). A plan must never serve a call it was not made for, and a cached call
must compute what an uncached one does."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kernel_cases import EXACT, INTERPRETER_WARNINGS  # noqa: E402
from test_ops_paged_attention import DEVICE, make_scenario, reference  # noqa: E402

from pagedkv import launch as launch_mod  # noqa: E402
from pagedkv.ops import Mask  # noqa: E402
from pagedkv.ops.masks import CAUSAL  # noqa: E402
from pagedkv.ops.triton import attention, combine  # noqa: E402
from pagedkv.ops.triton.decode import launch_decode  # noqa: E402

pytestmark = INTERPRETER_WARNINGS
GPU = DEVICE.type == "cuda"


@pytest.fixture(autouse=True)
def fresh_caches():
    attention._PLANS.clear()
    combine._WORKSPACES.clear()
    yield
    attention._PLANS.clear()
    combine._WORKSPACES.clear()


def call(sc, **kw):
    kw.setdefault("max_query_len", max(q for _, q in sc.seqs))
    kw.setdefault("max_seq_len", max(s for s, _ in sc.seqs))
    return attention.paged_attention(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens,
                                     sc.table, **kw)


def check(got, sc, mask=CAUSAL, scale=None, **kw):
    dim = sc.q.shape[-1]
    want = reference(sc, mask, scale=dim**-0.5 if scale is None else scale, **kw)
    torch.testing.assert_close(got.cpu().double(), want, **EXACT["triton"])


def only_plan():
    (plan,) = attention._PLANS.values()
    return plan


def test_a_kept_plan_computes_what_an_uncached_launch_does():
    seqs = [(37, 1), (70, 1), (5, 1)]
    sc = make_scenario(seqs, 16, 8, 2, dtype=torch.float32, seed=101)
    first = call(sc)
    plan = only_plan()
    sc.q.normal_()  # fresh queries, same shapes: the kept plan serves them
    second = call(sc)
    assert len(attention._PLANS) == 1 and only_plan() is plan
    check(second, sc)
    assert not torch.equal(first, second)
    out = torch.full_like(second, float("nan"))
    launch_decode(sc.q, sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens, sc.table, out, None,
                  mask=Mask(), scale=8**-0.5, soft_cap=None, sinks=None, k_scale=1.0,
                  v_scale=1.0, max_query_len=1, max_seq_len=70,
                  f32=True)  # float32 queries (and the interpreter)
    assert torch.equal(out, second)
    # direct launches: none in the interpreter, every call after the first on a GPU
    assert plan.kernel.direct_calls == (1 if GPU else 0)


@pytest.mark.parametrize("change", ["batch", "lengths_bucket", "heads", "cache_dtype", "out_dtype", "scale",
                                    "soft_cap", "sinks", "mask", "block_size", "query_len"])
def test_a_changed_call_gets_its_own_plan(change):
    seqs = [(37, 2), (70, 1)]
    sc = make_scenario(seqs, 16, 4, 2, dtype=torch.float32, seed=111)
    check(call(sc), sc)
    kw, ref_kw, mask = {}, {}, Mask()
    if change == "batch":  # one more sequence; the same rows, blocks, table and max_query_len
        sc = make_scenario([(5, 1), (70, 1), (20, 1)], 16, 4, 2, dtype=torch.float32, seed=112)
        kw = dict(max_query_len=2)
    elif change == "lengths_bucket":  # a bound past 1023 keys: another split count on a GPU
        kw = dict(max_seq_len=1100)
    elif change == "heads":
        sc = make_scenario(seqs, 16, 8, 2, dtype=torch.float32, seed=113)
    elif change == "cache_dtype":
        sc = make_scenario(seqs, 16, 4, 2, dtype=torch.bfloat16, seed=114)
        sc.q = sc.q.to(torch.float32)
    elif change == "out_dtype":
        kw = dict(out_dtype=torch.float64)
    elif change == "scale":
        kw = ref_kw = dict(scale=0.9)
    elif change == "soft_cap":
        kw = ref_kw = dict(soft_cap=2.5)
    elif change == "sinks":
        kw = ref_kw = dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE))
    elif change == "mask":
        mask = Mask(window=20)
    elif change == "block_size":
        sc = make_scenario(seqs, 64, 4, 2, dtype=torch.float32, seed=115)
    elif change == "query_len":
        sc = make_scenario([(37, 3), (70, 2)], 16, 4, 2, dtype=torch.float32, seed=116)
        kw = dict(max_query_len=3)
    got = call(sc, mask=mask, **kw)
    assert len(attention._PLANS) == 2
    if change == "out_dtype":
        assert got.dtype == torch.float64
    ref_kw.setdefault("scale", None)
    check(got, sc, mask, **ref_kw)


@pytest.mark.parametrize("interpreter", [True, False])
def test_seq_len_key_holds_everything_the_split_count_reads(interpreter, monkeypatch):
    from pagedkv.ops.triton import decode
    monkeypatch.setattr(decode, "interpreting", lambda: interpreter)
    monkeypatch.setattr(decode, "_multiprocessors", lambda index: 132)
    dev = types.SimpleNamespace(index=0)
    for programs in (1, 6, 64, 500, 2048):
        for one_wave in (False, True):
            splits = {}
            for max_seq_len in list(range(0, 1100)) + list(range(1100, 40000, 97)):
                key = decode.seq_len_key(max_seq_len)
                got = decode.decode_splits(programs, max_seq_len, dev, one_wave)
                assert splits.setdefault(key, got) == got, (programs, max_seq_len, key)
            assert len(set(splits.values())) > 1 or programs >= 500


def test_growing_lengths_share_a_plan_and_read_the_new_lengths():
    # an engine's steps: max_seq_len grows by one per step; splits depend on it only through
    # seq_len_key, so every step of one batch shape uses one plan
    seqs = [(40, 1), (90, 1)]
    sc = make_scenario(seqs, 16, 4, 2, dtype=torch.float32, seed=121)
    full_lens = sc.seq_lens.clone()
    for step in range(3):
        sc.seq_lens.copy_(full_lens - (2 - step))
        sc.seqs = [(s - (2 - step), q) for s, q in seqs]
        sc.q.normal_()
        got = call(sc, max_seq_len=int(sc.seq_lens.max()))
        scn = type(sc)(**{**sc.__dict__})
        scn.keys = [k[: s] for k, (s, _) in zip(sc.keys, scn.seqs)]
        scn.values = [v[: s] for v, (s, _) in zip(sc.values, scn.seqs)]
        check(got, scn)
    assert len(attention._PLANS) == 1


def test_the_kept_workspace_is_rewritten_by_every_call():
    # several splits: the partial results go through the workspace kept per stream and shape
    seqs = [(300, 1), (129, 1), (77, 1)]
    sc = make_scenario(seqs, 16, 4, 2, dtype=torch.float32, seed=131)
    for _ in range(2):
        sc.q.normal_()
        check(call(sc, splits=3), sc)
    assert len(combine._WORKSPACES) == 1
    (ws,) = combine._WORKSPACES.values()
    assert ws[0].shape[2] == 3
    sc2 = make_scenario(seqs[:2], 16, 4, 2, dtype=torch.float32, seed=132)
    check(call(sc2, splits=3), sc2)  # another shape: its own workspace
    assert len(combine._WORKSPACES) == 2


def test_a_misaligned_query_after_an_aligned_one_is_right():
    # same shapes and strides (one plan) but q's address off by 4 bytes: the launch must not
    # reuse the kernel specialised on 16-byte aligned pointers
    seqs = [(37, 1), (70, 1)]
    sc = make_scenario(seqs, 16, 4, 2, dtype=torch.float32, seed=141)
    check(call(sc), sc)
    check(call(sc), sc)
    flat = torch.empty(sc.q.numel() + 1, device=DEVICE)
    shifted = flat[1:].view(sc.q.shape)
    shifted.copy_(torch.randn(sc.q.shape))
    assert shifted.data_ptr() % 16
    sc.q = shifted
    check(call(sc), sc)
    assert len(attention._PLANS) == 1


def test_checks_still_run_for_a_new_shape():
    seqs = [(37, 1), (70, 1)]
    sc = make_scenario(seqs, 16, 4, 2, dtype=torch.float32, seed=151)
    call(sc)
    from pagedkv.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="cannot share"):
        attention.paged_attention(sc.q[:, :3], sc.k_cache, sc.v_cache, sc.qsl, sc.seq_lens,
                                  sc.table, max_query_len=1, max_seq_len=70)


# ---- pagedkv.launch with a stand-in kernel (runs anywhere, no GPU needed)

class FakeTensor:
    def __init__(self, ptr, device="cuda"):
        self.ptr = ptr
        self.device = types.SimpleNamespace(type=device, index=0)

    def data_ptr(self):
        return self.ptr


class FakeCompiled:
    def __init__(self, calls):
        self.calls = calls
        self.function = "fn"
        self.packed_metadata = "meta"

    def run(self, *args):
        self.calls.append(("direct",) + args)


class FakeKernel:
    """Parameters: two pointers, one scalar, two constexprs."""
    arg_names = ["a", "b", "n", "X", "Y"]
    params = [types.SimpleNamespace(is_constexpr=c) for c in (False, False, False, True, True)]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.calls)
        return launch


@pytest.fixture
def on_fake_gpu(monkeypatch):
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launch_mod, "raw_stream", lambda index: 77)
    monkeypatch.setattr(launch_mod, "_get_device", lambda: 0)
    monkeypatch.setattr(launch_mod, "_hook_holder", lambda: hooks)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read by direct_allowed() only
    monkeypatch.delenv("PAGEDKV_TRITON_DIRECT", raising=False)
    return hooks


def test_direct_launch_passes_pointers_scalars_and_constexprs_in_order(on_fake_gpu):
    k = FakeKernel()
    launch = launch_mod.Launch(k, (3, 2), (5,), dict(X=1, Y=2, num_warps=4))
    a, b = FakeTensor(160), FakeTensor(320)
    launch(a, b)
    launch(FakeTensor(480), FakeTensor(640))
    assert k.calls[0] == ("triton", (3, 2, 1), (a, b, 5), dict(X=1, Y=2, num_warps=4))
    # grid, stream, function, packed metadata, no launch metadata or hooks, then every
    # parameter in order: raw addresses, scalars, constexprs (launch options are none)
    assert k.calls[1] == ("direct", 3, 2, 1, 77, "fn", "meta", None, None, None, 480, 640, 5, 1, 2)
    assert launch.direct_calls == 1


def test_direct_launch_falls_back_when_its_specialisation_does_not_hold(on_fake_gpu, monkeypatch):
    k = FakeKernel()
    launch = launch_mod.Launch(k, (1,), (5,), dict(X=1, Y=2))
    launch(FakeTensor(160), FakeTensor(320))
    launch(FakeTensor(168), FakeTensor(320))  # not 16-byte aligned: Triton picks the kernel
    assert k.calls[-1][0] == "triton"
    on_fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[print])  # a profiler's hook
    launch(FakeTensor(160), FakeTensor(320))
    assert k.calls[-1][0] == "triton"
    on_fake_gpu.launch_enter_hook = types.SimpleNamespace(calls=[])
    monkeypatch.setattr(launch_mod, "_get_device", lambda: 1)  # another current device
    launch(FakeTensor(160), FakeTensor(320))
    assert k.calls[-1][0] == "triton"
    monkeypatch.setattr(launch_mod, "_get_device", lambda: 0)
    launch(FakeTensor(160), FakeTensor(320))
    assert k.calls[-1][0] == "direct" and launch.direct_calls == 1


@pytest.mark.parametrize("why", ["env_off", "interpreter", "cpu_tensor", "missing_constexpr",
                                 "not_direct"])
def test_direct_launch_stays_off(why, on_fake_gpu, monkeypatch):
    k = FakeKernel()
    consts = dict(X=1, Y=2)
    device = "cuda"
    if why == "env_off":
        monkeypatch.setenv("PAGEDKV_TRITON_DIRECT", "0")
    elif why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif why == "cpu_tensor":
        device = "cpu"
    elif why == "missing_constexpr":
        consts = dict(X=1)  # Y left to its default: the tail is unknown
    launch = launch_mod.Launch(k, (1,), (5,), consts, direct=why != "not_direct")
    for _ in range(3):
        launch(FakeTensor(160, device), FakeTensor(320, device))
    assert [c[0] for c in k.calls] == ["triton"] * 3 and launch.direct_calls == 0
