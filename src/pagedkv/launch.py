"""Launching a Triton kernel through its compiled launcher, past Triton's per-call Python.

``kernel[grid](*args)`` binds and specialises every argument, builds the cache key, looks
the compiled kernel up and builds launch metadata on every call: for a kernel of ~50
arguments that is tens of microseconds of host time, more than a short decode kernel runs
(docs/kernels-log.md, "Host time of one eager decode call"). A ``Launch`` fixes one
specialisation: grid, constexprs, launch options and scalar arguments, which the caller
keys its launches by. Its first call goes through ``kernel[grid]`` (compiling or finding
the kernel); later CUDA calls hand the tensors' raw addresses straight to the compiled
kernel's launcher, as long as every address keeps the 16-byte alignment it had on the
first call (Triton specialises pointers on it), the current device is the first call's and
no launch hook is set. Off under the interpreter and with ``PAGEDKV_TRITON_DIRECT=0``.

Relies on Triton 3.x's ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)`` with every kernel parameter in order (the
constexprs too); a Triton without those attributes keeps the normal launch. Used by the ops'
decode kernels and the batch package's derive kernel, hence this module's low rank.
"""

from __future__ import annotations

import os

import torch

raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def direct_allowed() -> bool:
    """Whether a ``Launch`` may take the direct path at all (read at its first call)."""
    return (os.environ.get("PAGEDKV_TRITON_DIRECT", "1") != "0"
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and raw_stream is not None and _get_device is not None)


def _hook_holder():
    try:
        from triton import knobs
        return knobs.runtime
    except ImportError:  # Triton before 3.4 kept the hooks on CompiledKernel
        from triton.compiler import CompiledKernel
        return CompiledKernel


def _idle(hook) -> bool:
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


class _Direct:
    __slots__ = ("run", "function", "packed", "device", "aligned", "tail", "hooks")

    def __init__(self, run, function, packed, device, aligned, tail, hooks):
        self.run, self.function, self.packed = run, function, packed
        self.device, self.aligned, self.tail, self.hooks = device, aligned, tail, hooks


def _aligned(ptrs) -> tuple[bool, ...]:
    return tuple(not p & 15 for p in ptrs)


class Launch:
    """One kernel specialisation: ``launch(*tensors)`` runs
    ``kernel[grid](*tensors, *scalars, **consts)``. The kernel's parameters must be the
    tensors, then the scalars, then the constexprs (all given in ``consts``, with launch
    options such as ``num_warps``); ``direct=False`` for a launch made once. The caller keys a ``Launch`` by everything that fixes
    the tensors' dtypes and the scalars; ``direct_calls`` counts the direct launches."""

    __slots__ = ("kernel", "grid", "scalars", "consts", "direct_calls", "_direct", "_tried")

    def __init__(self, kernel, grid, scalars=(), consts=None, direct: bool = True) -> None:
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.scalars = tuple(scalars)
        self.consts = dict(consts or {})
        self.direct_calls = 0
        self._direct = None
        self._tried = not direct  # a launch made once needs no direct path

    def __call__(self, *tensors) -> None:
        d = self._direct
        if d is not None:
            ptrs = [t.data_ptr() for t in tensors]
            if (_aligned(ptrs) == d.aligned and _get_device() == d.device
                    and _idle(d.hooks.launch_enter_hook) and _idle(d.hooks.launch_exit_hook)):
                g = self.grid
                d.run(g[0], g[1], g[2], raw_stream(d.device), d.function, d.packed, None, None,
                      None, *ptrs, *d.tail)
                self.direct_calls += 1
                return
        compiled = self.kernel[self.grid](*tensors, *self.scalars, **self.consts)
        if not self._tried:
            self._tried = True
            self._direct = self._setup(compiled, tensors)

    def _setup(self, compiled, tensors) -> _Direct | None:
        """The direct path after the first launch, or None where it cannot be used."""
        if not direct_allowed() or not tensors:
            return None
        device = tensors[0].device
        if any(t.device.type != "cuda" for t in tensors) or device.index != _get_device():
            return None  # (the launcher runs in the current device's context)
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        packed = getattr(compiled, "packed_metadata", None)
        names = list(getattr(self.kernel, "arg_names", ()))
        fixed = len(tensors) + len(self.scalars)
        rest = names[fixed:]
        params = getattr(self.kernel, "params", ())
        if run is None or function is None or packed is None or len(names) < fixed or any(
                n not in self.consts for n in rest) or any(
                getattr(p, "is_constexpr", False) for p in params[:fixed]):
            return None
        tail = self.scalars + tuple(self.consts[n] for n in rest)
        return _Direct(run, function, packed, device.index,
                       _aligned([t.data_ptr() for t in tensors]), tail, _hook_holder())
