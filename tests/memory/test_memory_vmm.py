"""CUDA virtual-memory backing (skipped without CUDA or cuda-bindings): reserving costs no
memory, map / write / read, indexing by block id, a page moved between pools keeps its
bytes, an unmap waits for the step that read the page, and a CUDA graph captured before
its pages were mapped replays correctly after."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.blocks.pages import PAGE_BYTES, PageLedger, PoolRange, UnmapOp  # noqa: E402
from pagedkv.errors import DeviceMemoryError  # noqa: E402
from pagedkv.memory.physical import PhysicalMemory  # noqa: E402
from pagedkv.memory.views import layer_view  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

P = PAGE_BYTES
POOLS = [PoolRange(0, block_bytes=P // 2, ceiling_blocks=64),  # 32 pages
         PoolRange(1, block_bytes=3 * P, ceiling_blocks=8)]  # a slot spans 3 pages


@pytest.fixture
def backing():
    from pagedkv.memory.vmm import VmmBacking, cuda_driver

    try:
        cuda_driver()
    except DeviceMemoryError as exc:
        pytest.skip(str(exc))
    b = VmmBacking(POOLS)
    yield b
    b.close()


def rand_bytes(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).cuda()


def test_reserving_a_huge_range_costs_no_memory_and_pages_cost_2_mib():
    from pagedkv.memory.vmm import VmmBacking, cuda_driver

    try:
        cuda_driver()
    except DeviceMemoryError as exc:
        pytest.skip(str(exc))
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    b = VmmBacking([PoolRange(0, block_bytes=P, ceiling_blocks=128 * 1024)])  # 256 GiB
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 < 64 * P  # a reservation is address space only
    for pg in range(0, 64 * 1024, 1024):  # 64 pages spread over the range
        b.map(0, pg)
    free2 = torch.cuda.mem_get_info()[0]
    assert free1 - free2 >= 64 * P
    b.close()


def test_map_write_read_and_index_by_block(backing):
    t = backing.tensor(0)
    assert t.is_cuda and t.dtype == torch.uint8 and t.numel() == 32 * P
    backing.map(0, 5)  # blocks 10 and 11
    data = rand_bytes(P, 0)
    t[5 * P:6 * P].copy_(data)
    torch.cuda.synchronize()
    assert torch.equal(t[5 * P:6 * P].cpu(), data.cpu())
    # a bf16 layer of 128 x 1024 values (P / 8 bytes) a quarter into each half-page block:
    # block 11 = bytes 5.5 P .. 6 P, its layer = page 5's bytes 0.75 P .. 0.875 P
    view = layer_view(t, P // 2, P // 4, (128, 1024), torch.bfloat16)
    assert view.shape == (64, 128, 1024)
    assert torch.equal(view[11].flatten().view(torch.uint8).cpu(),
                       data[3 * P // 4:7 * P // 8].cpu())
    view[10].fill_(1.5)  # block 10 = bytes 5 P .. 5.5 P
    torch.cuda.synchronize()
    assert bool((t[5 * P + P // 4:5 * P + 3 * P // 8].view(torch.bfloat16) == 1.5).all())
    assert torch.equal(t[5 * P:5 * P + P // 4].cpu(), data[:P // 4].cpu())


def test_a_page_moved_between_pools_keeps_its_bytes(backing):
    backing.map(0, 7)
    data = rand_bytes(P, 1)
    backing.tensor(0)[7 * P:8 * P].copy_(data)
    torch.cuda.synchronize()
    backing.unmap(0, 7)
    backing.map(1, 4)  # slot 1 spans pages 3, 4, 5
    torch.cuda.synchronize()
    assert torch.equal(backing.tensor(1)[4 * P:5 * P].cpu(), data.cpu())
    assert backing.physical_pages == 1


def test_an_unmap_waits_for_the_step_that_read_the_page(backing):
    led = PageLedger(POOLS, budget_bytes=16 * P, stock_pages=2)
    mem = PhysicalMemory(led, backing)
    led.use(1, [2])  # pages 6, 7, 8
    mem.between_steps()
    slot = backing.tensor(1)[6 * P:9 * P]
    data = rand_bytes(3 * P, 2)
    slot.copy_(data)
    out = torch.empty_like(slot)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time before the read
    out.copy_(slot)
    mem.launched(0)
    led.release(1, [2])
    mem.between_steps()
    assert backing.is_mapped(1, 7)  # the step has not finished: no unmap yet
    torch.cuda.synchronize()
    ops = mem.between_steps()
    assert ops == [UnmapOp(1, 6, 0), UnmapOp(1, 7, 0), UnmapOp(1, 8, 0)]
    assert not backing.is_mapped(1, 7)
    assert torch.equal(out.cpu(), data.cpu())
    # an unmap applied while its step still runs waits for the step's event
    led.use(1, [2])
    mem.between_steps()
    slot.copy_(data)
    out.zero_()
    torch.cuda._sleep(200_000_000)
    out.copy_(slot)
    mem.launched(1)
    backing.apply([UnmapOp(1, 6, 1)])  # as if the ledger had been told too early
    assert backing.stats["unmap_waits"] == 1
    assert torch.equal(out.cpu(), data.cpu())


def test_a_graph_captured_before_its_pages_were_mapped_replays_after(backing):
    # Kernels only: capturing a memcpy node (a same-dtype copy_) of an unmapped range fails
    # at capture with "invalid argument" (seen on the H200, 2026-12-03); a kernel's pointer
    # arguments are not checked until it runs. Paged-attention steps are kernels.
    t = backing.tensor(1)
    region = t[3 * P:6 * P]  # slot 1: nothing mapped yet
    out = torch.zeros(3 * P, dtype=torch.int16, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(region)  # uint8 -> int16: an elementwise kernel
        region.add_(1)
    for pg in (3, 4, 5):
        backing.map(1, pg)
    data = rand_bytes(3 * P, 3)
    region.copy_(data)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), data.cpu().to(torch.int16))
    assert torch.equal(region.cpu(), (data + 1).cpu())


def test_a_page_mapped_ahead_is_written_and_read_once_the_ledger_maps_it(backing):
    backing.set_stock(3)
    assert backing.map_ahead(0, 7) and backing.map_ahead(1, 0)
    backing.map(0, 7)  # the ledger's map: no driver call, the page is the one mapped ahead
    t = backing.tensor(0)
    data = rand_bytes(P, seed=7)
    t[7 * P:8 * P].copy_(data)
    backing.map(0, 8)  # from the stock
    t[8 * P:9 * P].copy_(rand_bytes(P, seed=8))
    torch.cuda.synchronize()
    assert torch.equal(t[7 * P:8 * P], data)
    assert backing.stats["ahead_hits"] == 1 and backing.ahead == 1
    backing.set_stock(0)  # the page still mapped ahead goes back and is released
    assert backing.ahead == 0 and backing.physical_pages == 2
    assert torch.equal(t[7 * P:8 * P], data)
