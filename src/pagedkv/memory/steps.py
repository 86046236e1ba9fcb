"""Which launched steps have finished on the device: the only thing an unmap waits for.

``CudaSteps`` records one CUDA event on the current stream after each step's work;
``ManualSteps`` is told by the caller (tests, CPU runs). Both answer the same questions.
"""

from __future__ import annotations

from collections import deque

from pagedkv.errors import InvalidArgumentError

NO_STEP = -1


class ManualSteps:
    """Steps finish when :meth:`complete` says so (or at once with ``synchronous=True``)."""

    def __init__(self, synchronous: bool = False) -> None:
        self.synchronous = synchronous
        self.launched = NO_STEP
        self._finished = NO_STEP

    def record(self, step: int) -> None:
        if step <= self.launched:
            raise InvalidArgumentError(f"step {step} recorded after step {self.launched}")
        self.launched = step
        if self.synchronous:
            self._finished = step

    def complete(self, step: int) -> None:
        if step > self.launched:
            raise InvalidArgumentError(f"step {step} completed, last launched {self.launched}")
        self._finished = max(self._finished, step)

    def finished(self) -> int:
        """The last step known finished (all before it too)."""
        return self._finished

    def wait(self, step: int) -> bool:
        """Whether step ``step`` has finished; a manual tracker cannot wait, it only says."""
        return step <= self._finished


class CudaSteps:
    """One CUDA event per launched step, recorded on the current stream after its work."""

    def __init__(self, device=None) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.launched = NO_STEP
        self._finished = NO_STEP
        self._events: deque = deque()  # (step, event), oldest first

    def record(self, step: int) -> None:
        if step <= self.launched:
            raise InvalidArgumentError(f"step {step} recorded after step {self.launched}")
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        self._events.append((step, event))
        self.launched = step

    def finished(self) -> int:
        """Polls the events in launch order (a query, never a wait)."""
        events = self._events
        while events and events[0][1].query():
            self._finished = events.popleft()[0]
        return self._finished

    def wait(self, step: int) -> bool:
        """Blocks the host until step ``step`` finished; True once it has."""
        events = self._events
        while events and events[0][0] <= step:
            s, event = events.popleft()
            event.synchronize()
            self._finished = s
        return step <= self._finished
