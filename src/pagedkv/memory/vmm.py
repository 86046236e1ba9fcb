"""CUDA virtual memory: each pool a reserved address range, 2 MiB pages mapped on demand.

Per pool, ``cuMemAddressReserve`` takes address space for the whole ceiling (nothing
physical); a physical page is ``cuMemCreate`` (pinned device memory), placed with
``cuMemMap`` and opened with ``cuMemSetAccess``; ``cuMemUnmap`` takes it out again and it
waits in the stock. Torch sees each range as one uint8 tensor through
``__cuda_array_interface__``; its address never changes, so views, kernels and CUDA graphs
captured before a page was mapped stay valid. ``cuMemUnmap`` does not wait for queued work:
:meth:`Backing.apply` makes an unmap wait for its step's CUDA event.

Needs torch with CUDA and the ``cuda-bindings`` package (``cuda.bindings.driver``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.blocks.ids import PoolId
from pagedkv.blocks.pages import PAGE_BYTES, PoolRange
from pagedkv.errors import DeviceMemoryError, InvalidArgumentError
from pagedkv.memory.backing import Backing
from pagedkv.memory.steps import CudaSteps


def cuda_driver() -> Any:
    """The CUDA driver bindings, or DeviceMemoryError naming the package to install."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.8
        except ImportError as exc:
            raise DeviceMemoryError(
                "CUDA virtual memory needs the cuda-bindings package (pip install "
                f"cuda-bindings): {exc}") from None
    return driver


class _Range:
    """What ``torch.as_tensor`` reads: one uint8 array at a fixed device address."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 2,
        }


class VmmBacking(Backing):
    """Pools over CUDA virtual memory on one device; see the module docstring."""

    def __init__(self, pools: Sequence[PoolRange], page_bytes: int = PAGE_BYTES,
                 device: Any = None, steps: Any = None) -> None:
        import torch

        self._torch = torch
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        torch.zeros(1, device=self.device)  # the primary context exists and is current
        super().__init__(pools, page_bytes, steps if steps is not None else CudaSteps(self.device))
        d = self._d = cuda_driver()
        self._call("cuInit", d.cuInit(0))
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self._prop = prop
        gran = self._call("cuMemGetAllocationGranularity", d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        if page_bytes % int(gran):
            raise InvalidArgumentError(
                f"page_bytes {page_bytes} is not a multiple of the device's granularity {gran}")
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._base: dict[PoolId, int] = {}
        self._tensors: dict[PoolId, Any] = {}
        for pid, n in self.num_pages.items():
            ptr = self._call("cuMemAddressReserve",
                             d.cuMemAddressReserve(n * page_bytes, page_bytes, 0, 0),
                             n * page_bytes)
            self._base[pid] = int(ptr)

    def _call(self, name: str, result: Any, *args: Any) -> Any:
        err = result[0]
        if err != self._d.CUresult.CUDA_SUCCESS:
            raise DeviceMemoryError(f"{name}{args}: {getattr(err, 'name', err)}")
        return result[1] if len(result) > 1 else None

    def address(self, pool_id: PoolId, page: int = 0) -> int:
        self._key(pool_id, page)
        return self._base[pool_id] + page * self.page_bytes

    def tensor(self, pool_id: PoolId) -> Any:
        t = self._tensors.get(pool_id)
        if t is None:
            nbytes = self.num_pages[pool_id] * self.page_bytes
            view = _Range(self.address(pool_id), nbytes)
            try:
                t = self._torch.as_tensor(view, device=self.device)
            except RuntimeError:
                # a torch that asks the driver about the pointer needs it backed: back the
                # first page for that moment (the address stays valid afterwards)
                if self.is_mapped(pool_id, 0):
                    raise
                self.map(pool_id, 0)
                try:
                    t = self._torch.as_tensor(view, device=self.device)
                finally:
                    self.unmap(pool_id, 0)
            self._tensors[pool_id] = t
        return t

    def _create(self) -> Any:
        return self._call("cuMemCreate", self._d.cuMemCreate(self.page_bytes, self._prop, 0))

    def _release(self, handle: Any) -> None:
        self._call("cuMemRelease", self._d.cuMemRelease(handle))

    def _attach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        d = self._d
        addr = d.CUdeviceptr(self.address(pool_id, page))
        self._call("cuMemMap", d.cuMemMap(addr, self.page_bytes, 0, handle, 0), pool_id, page)
        self._call("cuMemSetAccess", d.cuMemSetAccess(addr, self.page_bytes, self._access, 1),
                   pool_id, page)

    def _detach(self, pool_id: PoolId, page: int, handle: Any) -> None:
        d = self._d
        addr = d.CUdeviceptr(self.address(pool_id, page))
        self._call("cuMemUnmap", d.cuMemUnmap(addr, self.page_bytes), pool_id, page)

    def close(self) -> None:
        """Waits for the device, unmaps and releases every page, frees the ranges. Drop
        every tensor from :meth:`tensor` first."""
        self._torch.cuda.synchronize(self.device)
        self._tensors.clear()
        super().close()
        d = self._d
        for pid, base in self._base.items():
            size = self.num_pages[pid] * self.page_bytes
            self._call("cuMemAddressFree", d.cuMemAddressFree(d.CUdeviceptr(base), size), pid)
        self._base.clear()
