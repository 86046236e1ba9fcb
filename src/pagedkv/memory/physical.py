"""The ledger and a backing, driven between steps.

The engine's loop, per step ``s``: the block manager allocates and frees (the ledger hears
``use`` / ``release``); :meth:`PhysicalMemory.between_steps` learns which steps finished,
applies the drained unmaps then maps, and tops the stock up; the engine launches step
``s``'s work and calls :meth:`PhysicalMemory.launched` right after (on the GPU this records
the event every later unmap of a page that step read will wait for).
"""

from __future__ import annotations

from typing import Any

from pagedkv.blocks.pages import PageLedger, PageOp
from pagedkv.errors import InvalidArgumentError


class PhysicalMemory:
    def __init__(self, ledger: PageLedger, backing: Any) -> None:
        if ledger.page_bytes != backing.page_bytes:
            raise InvalidArgumentError(
                f"ledger pages of {ledger.page_bytes} bytes, backing pages of "
                f"{backing.page_bytes}")
        missing = [p for p in backing.pools if ledger.pool_range(p) != backing.pools[p]]
        if missing:
            raise InvalidArgumentError(f"pools {missing} differ between ledger and backing")
        self.ledger = ledger
        self.backing = backing
        self.between_steps()  # the floors

    def between_steps(self) -> list[PageOp]:
        """Apply what the ledger decided since the last call; returns the ops applied."""
        led = self.ledger
        done = min(self.backing.steps.finished(), led.launched)
        if done > led.finished:
            led.step_finished(done)
        ops = led.drain()
        self.backing.apply(ops)
        self.backing.set_stock(led.stock_wanted())
        return ops

    def launched(self, step: int) -> None:
        """Step ``step``'s work was just queued on the device."""
        self.backing.steps.record(step)
        self.ledger.step_launched(step)
