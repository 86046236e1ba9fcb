"""The engine: model + plan + block manager + scheduler + runner + sampler.

``Engine(source, options).generate(prompts, sampling)`` runs prompts (token ids, or text
when a tokenizer is known) to completion with continuous batching. A request that cannot
run (prompt too long, can never fit, out-of-vocabulary ids) gets its own error in its
output; the other requests finish. :meth:`Engine.add_request` raises those errors.
"""

from __future__ import annotations

import itertools
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.blocks import KVCacheManager, lookahead_tokens
from pagedkv.engine.loader import from_transformers, load_folder
from pagedkv.engine.request import Request, SamplingParams
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import sample
from pagedkv.engine.scheduler import Scheduler
from pagedkv.errors import (
    CheckpointError,
    DoesNotFitError,
    InvalidArgumentError,
    PagedKVError,
    RequestError,
    RequestTooLargeError,
)
from pagedkv.kvspec import LayerSpec
from pagedkv.kvspec.layout import bytes_per_request, bytes_per_token
from pagedkv.modeling.base import AttentionBackend, reference_attention
from pagedkv.plan import PlanOptions, make_plan
from pagedkv.plan.sizes import format_bytes

GREEDY = SamplingParams()
AUTO_REQUESTS = 4  # requests of max_model_len the default cache budget holds at once


@dataclass(frozen=True)
class EngineOptions:
    """``kv_cache_bytes``: cache budget (None: room for ``AUTO_REQUESTS`` requests of
    ``max_model_len``); ``max_model_len`` None:
    the config's ``max_position_embeddings``. Test aids: ``debug_nan`` NaN-fills the cache
    and every free page before each step, ``shuffle_seed`` shuffles the free lists,
    ``record_logits`` keeps every computed row's logits (:attr:`Engine.logits`).
    ``attention_backend`` (None: the torch reference ops) is the kernel seam of
    :mod:`pagedkv.modeling.base`. ``block_major_cache`` lays each pool out block by block
    (every layer of block b in one stretch: what the elastic page ledger counts) instead
    of layer by layer (:mod:`pagedkv.engine.cache`). ``metadata``: how the runner builds
    each step's attention metadata, ``"persistent"`` (one persistent builder fed with the
    tables' changes; ``derive_on_device``: its steady decode steps derived on the device,
    None: on CUDA) or ``"stateless"`` (``build_metadata`` from every block list, each step:
    the reference it is tested against; :mod:`pagedkv.engine.runner`)."""

    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_batched_tokens: int = 256
    max_running: int = 64
    kv_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    recurrent_checkpoint_every: int | None = None
    seed: int = 0
    debug_nan: bool = False
    shuffle_seed: int | None = None
    record_logits: bool = False
    checked: bool | None = None
    attention_backend: AttentionBackend | None = None
    spec_tokens: int = 0  # lookahead slots per decode for draft tokens (runner ``drafts``)
    block_major_cache: bool = False  # pools laid out block by block (engine/cache.py)
    metadata: str = "persistent"
    derive_on_device: bool | None = None

    def __post_init__(self) -> None:
        """Every count an integer in its range, the device one torch knows: a wrong kind
        failed deep in the planner, the allocator or torch (a TypeError, a MemoryError)."""
        for name, low, optional in _COUNTS:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidArgumentError(
                    f"EngineOptions.{name} must be an integer >= {low}"
                    f"{' or None' if optional else ''}, got {value!r}")
        if not isinstance(self.device, (str, torch.device)):
            raise InvalidArgumentError(f"EngineOptions.device must be a device name, got "
                                       f"{self.device!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise InvalidArgumentError(f"EngineOptions.device {self.device!r}: {exc}") from None


# (field, smallest value, None allowed) of EngineOptions' integer fields
_COUNTS = (("block_size", 1, False), ("max_model_len", 1, True),
           ("max_batched_tokens", 1, False), ("max_running", 1, False),
           ("kv_cache_bytes", 1, True), ("recurrent_checkpoint_every", 1, True),
           ("seed", -(1 << 63), False), ("shuffle_seed", -(1 << 63), True),
           ("spec_tokens", 0, False))


@dataclass
class RequestOutput:
    rid: object
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    error: PagedKVError | None = None


class Engine:
    def __init__(self, source: str | Path | Any, options: EngineOptions = EngineOptions(), *,
                 tokenizer: Any = None) -> None:
        self.options = options
        self.device = torch.device(options.device)
        if isinstance(source, (str, Path)):
            self.config, self.model = load_folder(source, device=self.device, dtype=options.dtype)
            if tokenizer is None:
                tokenizer = _folder_tokenizer(Path(source))
            generation = _folder_generation_config(Path(source))
        else:
            self.config, self.model = from_transformers(source, device=self.device,
                                                        dtype=options.dtype)
            generation = getattr(source, "generation_config", None)
        self.tokenizer = tokenizer
        self.dtype = next(self.model.parameters()).dtype
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.vocab_size = int(text.vocab_size)
        limit = int(getattr(text, "max_position_embeddings", 0) or 0) or None
        self.max_model_len = options.max_model_len or limit
        if self.max_model_len is None:
            raise InvalidArgumentError("max_model_len is unknown: the config has no "
                                       "max_position_embeddings; pass EngineOptions.max_model_len")
        if options.spec_tokens >= self.max_model_len:
            raise InvalidArgumentError(f"spec_tokens {options.spec_tokens} leave no room within "
                                       f"max_model_len {self.max_model_len}")
        self.specs = self.layer_specs()
        if options.kv_cache_bytes is None:
            plan_bytes = _room_for(self.specs, AUTO_REQUESTS, self.max_model_len,
                                   options.max_batched_tokens)
        else:
            plan_bytes = options.kv_cache_bytes
            if self.dtype == torch.float32:  # the planner sizes 16-bit KV; fp32 takes twice
                plan_bytes //= 2
        self.plan = make_plan(self.specs, PlanOptions(
            budget_bytes=plan_bytes, max_model_len=self.max_model_len,
            block_size=options.block_size, max_batched_tokens=options.max_batched_tokens))
        _check_memory(self.plan, self.device, 2 if self.dtype == torch.float32 else 1)
        # fixed pools: the cache tensors are the plan's pools, allocated once; an elastic
        # manager's ceilings (pools growing into each other's bytes) would hand out block
        # ids past them (the runner refuses such a manager)
        self.manager = KVCacheManager.from_plan(
            self.plan, elastic=False, enable_caching=options.enable_prefix_caching,
            checked=options.checked, recurrent_checkpoint_every=options.recurrent_checkpoint_every)
        self.runner = ModelRunner(self.model, self.plan, self.specs, self.manager,
                                  device=self.device, kv_dtype=self.dtype,
                                  debug_nan=options.debug_nan, shuffle_seed=options.shuffle_seed,
                                  backend=options.attention_backend or reference_attention,
                                  block_major=options.block_major_cache,
                                  metadata=options.metadata, max_batch=options.max_running,
                                  lookahead=lookahead_tokens(self.manager.groups,
                                                             options.spec_tokens),
                                  derive_on_device=options.derive_on_device)
        eos = getattr(generation, "eos_token_id", None)
        eos = eos if eos is not None else getattr(text, "eos_token_id", None)
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.scheduler = Scheduler(self.manager, max_running=options.max_running,
                                   eos_token_ids=eos_ids, max_model_len=self.max_model_len,
                                   spec_tokens=options.spec_tokens)
        self._ids = itertools.count()
        self._generators: dict[object, torch.Generator] = {}
        self._default_gen = torch.Generator(device=self.device).manual_seed(options.seed)
        self.requests: dict[object, Request] = {}
        self.logits: dict[object, list[tuple[int, torch.Tensor]]] = {}
        self.steps = 0
        self.tokens_generated = 0

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """Every layer the plan must hold: the model's (subclasses add a drafter's)."""
        return type(self.model).layer_specs(self.config)

    # --- requests --------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer; this model has none "
                                   "(pass token ids)")
            return list(self.tokenizer(prompt)["input_ids"])
        try:  # (operator.index: ints of any kind, tensors' and numpy's too; no 1.5, no "a")
            return [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError(
                f"a prompt is text or a sequence of token ids, got {prompt!r:.60}") from None

    def add_request(self, prompt: str | Sequence[int], sampling: SamplingParams = GREEDY,
                    rid: object = None) -> object:
        """Queue one request; raises RequestError / RequestTooLargeError for one that can
        never run."""
        rid = next(self._ids) if rid is None else rid
        ids = self.encode(prompt)
        if not ids:
            raise RequestError(f"request {rid!r}: empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"request {rid!r}: token ids {bad[:4]} outside the "
                               f"vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"request {rid!r}: prompt of {len(ids)} tokens leaves no room "
                               f"to generate within max_model_len {self.max_model_len}")
        if len(ids) + sampling.max_new_tokens > self.max_model_len:
            raise RequestTooLargeError(
                f"request {rid!r}: {len(ids)} prompt tokens + {sampling.max_new_tokens} new "
                f"tokens exceed max_model_len {self.max_model_len}")
        req = Request(rid, tuple(ids), sampling)
        self.scheduler.add(req)
        self.requests[rid] = req
        if sampling.seed is not None:
            self._generators[rid] = torch.Generator(device=self.device).manual_seed(sampling.seed)
        return rid

    def abort(self, rid: object) -> bool:
        return self.scheduler.abort(rid) is not None

    # --- stepping ----------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run and commit one step; returns the requests that finished."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        ops = self.manager.drain_copy_ops()
        out = self.runner.execute(plan.chunks, ops, all_rows=self.options.record_logits)
        sampled: dict[object, list[int]] = {}
        for chunk, rows in zip(plan.chunks, out.rows):
            rid = chunk.request.rid
            if self.options.record_logits:
                kept = self.logits.setdefault(rid, [])
                kept += [(chunk.num_computed + j, out.logits[r]) for j, r in enumerate(rows)]
            if chunk.samples and chunk.request.remaining > 0:
                gen = self._generators.get(rid, self._default_gen)
                sampled[rid] = [sample(out.logits[rows[-1]], chunk.request.sampling, gen)]
        before = {c.request.rid: c.request.num_generated for c in plan.chunks}
        done = self.scheduler.update(plan, sampled)
        self.tokens_generated += sum(c.request.num_generated - before[c.request.rid]
                                     for c in plan.chunks)
        self.steps += 1
        for req in done:
            self._generators.pop(req.rid, None)
        self.runner.release(req.rid for req in done)
        return done

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] = GREEDY, *,
                 progress: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A request that cannot
        run carries its error (``finish_reason == "error"``); the others finish.
        ``progress(n)`` is called with the tokens generated by each step."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise InvalidArgumentError(f"{len(prompts)} prompts but {len(params)} sampling params")
        outputs: list[RequestOutput] = []
        rids: list[object] = []
        for prompt, p in zip(prompts, params):
            try:
                rid = self.add_request(prompt, p)
            except PagedKVError as exc:
                try:  # the prompt's ids where it has some (none: text, or not ids at all)
                    ids = [] if isinstance(prompt, str) else self.encode(prompt)
                except PagedKVError:
                    ids = []
                outputs.append(RequestOutput(None, ids, finish_reason="error", error=exc))
                rids.append(None)
                continue
            outputs.append(RequestOutput(rid, list(self.requests[rid].prompt)))
            rids.append(rid)
        while self.scheduler.has_work():
            before = self.tokens_generated
            self.step()
            if progress is not None:
                progress(self.tokens_generated - before)
        for out, rid in zip(outputs, rids):
            if rid is None:
                continue
            req = self.requests[rid]
            out.token_ids = list(req.output)
            out.finish_reason = req.finish_reason
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(req.output)
        return outputs

    # --- statistics ----------------------------------------------------------------------
    @property
    def preemptions(self) -> int:
        return self.manager.preemptions

    @property
    def prefix_hit_rate(self) -> float:
        return self.scheduler.prefix_hit_rate


def _folder_tokenizer(folder: Path) -> Any:
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((folder / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder} has tokenizer files that cannot be read: {exc}") from None


def _folder_generation_config(folder: Path) -> Any:
    """The folder's generation_config.json (its EOS ids may differ from config.json's)."""
    if not (folder / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder}/generation_config.json cannot be read: {exc}") from None


def _check_memory(plan, device: torch.device, scale: int) -> None:  # noqa: ANN001
    """DoesNotFitError where the plan's pools (x ``scale``: an fp32 engine's cache is twice
    the planned 16-bit bytes) exceed the device's memory: a budget no machine holds would
    otherwise fail deep in the block manager or the allocator (MemoryError, no message)."""
    need = scale * sum(p.nbytes for p in plan.ranks[0].pools)
    if device.type == "cuda":
        have, what = torch.cuda.mem_get_info(device)[0], "free on " + str(device)
    else:
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError):  # no such query here: nothing to check
            return
        what = "this machine's memory"
    if need > have:
        raise DoesNotFitError(
            f"the KV cache needs {need} bytes ({format_bytes(need)}), more than "
            f"{what} ({format_bytes(have)}): lower the cache budget, max_batched_tokens or "
            "max_model_len")


def _room_for(specs: Sequence[LayerSpec], requests: int, max_model_len: int,
              step_tokens: int) -> int:
    """Planner bytes for ``requests`` requests of ``max_model_len`` tokens (every layer
    keeping every token: windows get slack), the step's tokens, and a quarter on top for
    null blocks and alignment."""
    per_token = sum(bytes_per_token(s.layout) for s in specs)
    per_request = sum(bytes_per_request(s.layout) for s in specs)
    need = requests * (per_token * max_model_len + per_request) + per_token * step_tokens
    return need + need // 4 + (1 << 20)
