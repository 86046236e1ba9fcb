"""Physical memory under the pools: the ledger's map/unmap ops applied to real storage.

:class:`~pagedkv.memory.backing.TensorBacking` backs each pool with one ordinary tensor of
its ceiling (any device; map and unmap are emulated so behaviour is testable anywhere);
:class:`~pagedkv.memory.vmm.VmmBacking` reserves each pool's virtual range on a CUDA device
and maps 2 MiB physical pages on demand (needs torch and ``cuda-bindings``).
:class:`~pagedkv.memory.physical.PhysicalMemory` ties a backing to a
:class:`~pagedkv.blocks.pages.PageLedger` between steps. Importing this package imports
neither torch nor the CUDA bindings; the modules that need them import them when used.
"""
