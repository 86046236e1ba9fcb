"""The ledger and a backing, driven between steps.

The engine's loop, per step ``s``: the block manager allocates and frees (the ledger hears
``use`` / ``release``); :meth:`PhysicalMemory.between_steps` learns which steps finished,
applies the drained unmaps then maps, and tops the stock up; the engine launches step
``s``'s work and calls :meth:`PhysicalMemory.launched` right after (on the GPU this records
the event every later unmap of a page that step read will wait for).

:meth:`before_launch` / :meth:`after_launch` split the same work around the launch so that
only the maps the step needs stay on its critical path: unmaps (whose steps have finished)
and the stock's page creation run after the launch, while the device works. With
``ahead=n``, :meth:`after_launch` also maps each pool's ``n`` lowest unmapped pages from the
stock (:meth:`PageLedger.lowest_unmapped_pages`: where the next maps land, since elastic
pools take the lowest free ids), so a step whose new blocks land there finds their pages
mapped and its maps cost no driver call; a wrong guess costs a stock page's unmap, after a
launch or, when the stock runs dry, before one.
"""

from __future__ import annotations

from typing import Any

from pagedkv.blocks.pages import MapOp, PageLedger, PageOp
from pagedkv.errors import InvalidArgumentError


class PhysicalMemory:
    def __init__(self, ledger: PageLedger, backing: Any, ahead: int = 0) -> None:
        if ledger.page_bytes != backing.page_bytes:
            raise InvalidArgumentError(
                f"ledger pages of {ledger.page_bytes} bytes, backing pages of "
                f"{backing.page_bytes}")
        missing = [p for p in backing.pools if ledger.pool_range(p) != backing.pools[p]]
        if missing:
            raise InvalidArgumentError(f"pools {missing} differ between ledger and backing")
        if not isinstance(ahead, int) or ahead < 0:
            raise InvalidArgumentError(f"ahead must be an int >= 0, got {ahead!r}")
        self.ledger = ledger
        self.backing = backing
        self.ahead = ahead
        # pools that can grow past their floor: the only ones a map can land in
        self._growable = [p.pool_id for p in backing.pools.values()
                          if p.ceiling_blocks > p.floor_blocks]
        self._deferred: list[PageOp] = []
        self.between_steps()  # the floors

    def between_steps(self) -> list[PageOp]:
        """Apply what the ledger decided since the last call; returns the ops applied."""
        led = self.ledger
        done = min(self.backing.steps.finished(), led.launched)
        if done > led.finished:
            led.step_finished(done)
        ops = self._deferred + led.drain()
        self._deferred = []
        self.backing.apply(ops)
        self.backing.set_stock(led.stock_wanted())
        return ops

    def launched(self, step: int) -> None:
        """Step ``step``'s work was just queued on the device."""
        self.backing.steps.record(step)
        self.ledger.step_launched(step)

    # ---- the same work split around the launch: only maps before it ----------------

    def before_launch(self) -> list[PageOp]:
        """What must happen before the step is queued: its maps (from the stock). Unmaps
        wait for :meth:`after_launch` unless the stock is short of pages for the maps."""
        led = self.ledger
        done = min(self.backing.steps.finished(), led.launched)
        if done > led.finished:
            led.step_finished(done)
        ops = led.drain()
        maps = [op for op in ops if isinstance(op, MapOp)]
        unmaps = [op for op in ops if not isinstance(op, MapOp)]
        # pages the maps can take without creating one: the stock, and pages mapped ahead
        # (the right ones cost nothing, the others are taken back)
        short = max(0, len(maps) - self.backing.stock - self.backing.ahead)
        self.backing.apply(unmaps[:short])  # their pages serve the maps: nothing created
        self.backing.apply(maps)
        self._deferred += unmaps[short:]
        return ops

    def after_launch(self, step: int) -> None:
        """Right after step ``step`` is queued, while the device works: record its event,
        apply the deferred unmaps (their steps have finished), top up the stock."""
        self.launched(step)
        deferred, self._deferred = self._deferred, []
        self.backing.apply(deferred)
        self.backing.set_stock(self.ledger.stock_wanted())
        if self.ahead:
            self._map_ahead()

    def _map_ahead(self) -> None:
        """Keep each growable pool's ``ahead`` lowest unmapped pages mapped, from the stock;
        pages mapped ahead that are no longer among them go back to the stock."""
        led, backing, n = self.ledger, self.backing, self.ahead
        stale = backing.ahead_pages()
        wanted = [(pid, pg) for pid in self._growable for pg in led.lowest_unmapped_pages(pid, n)]
        stale.difference_update(wanted)
        for key in stale:
            backing.drop_ahead(key)
        for pid, pg in wanted:
            if not backing.stock:
                break
            backing.map_ahead(pid, pg)
