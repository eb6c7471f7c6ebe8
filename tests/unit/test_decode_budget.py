"""The daemon's bound on pushes decoded at once (hetd.server.budget.DecodeBudget)."""

from __future__ import annotations

import asyncio

from hetd.server.budget import DecodeBudget


def test_at_most_max_decodes_and_max_bytes_at_once_and_one_alone_always() -> None:
    async def run() -> tuple[int, int, DecodeBudget]:
        budget = DecodeBudget(max_decodes=2, max_bytes=100)
        peak = peak_bytes = 0

        async def decode(nbytes: int) -> None:
            nonlocal peak, peak_bytes
            async with budget.hold(nbytes):
                peak = max(peak, budget.running)
                peak_bytes = max(peak_bytes, budget.bytes)
                await asyncio.sleep(0.01)

        await asyncio.gather(*(decode(40) for _ in range(8)))
        seen = peak, peak_bytes
        await decode(1000)  # over the byte bound, alone: it runs
        return *seen, budget

    peak, peak_bytes, budget = asyncio.run(run())
    assert peak == 2 and peak_bytes == 80
    assert budget.held == 9 and budget.waited >= 6
    assert (budget.running, budget.bytes) == (0, 0)


def test_a_big_frame_waits_until_the_bytes_fit() -> None:
    async def run() -> list[str]:
        budget = DecodeBudget(max_decodes=4, max_bytes=100)
        order: list[str] = []
        release = asyncio.Event()

        async def first() -> None:
            async with budget.hold(60):
                order.append("first in")
                await release.wait()
            order.append("first out")

        async def second() -> None:
            async with budget.hold(60):  # 120 > 100: waits for the first
                order.append("second in")

        t1 = asyncio.create_task(first())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(second())
        await asyncio.sleep(0.02)
        order.append("released")
        release.set()
        await asyncio.gather(t1, t2)
        return order

    assert asyncio.run(run()) == ["first in", "released", "first out", "second in"]
