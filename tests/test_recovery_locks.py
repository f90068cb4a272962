"""The recovery's per-host look lock (issue 19 item 1, :class:`services.recovery.recovery.RecoveryPass`): looks at one
host run one at a time, and the map of locks holds only the hosts being looked at (it grew by every host ever seen).
The lock alone is exercised, without the pass's stores."""

from __future__ import annotations

import asyncio

from services.recovery.recovery import RecoveryPass


async def test_looks_at_one_host_are_serial_and_the_lock_is_dropped_after_the_last() -> None:
    rp = RecoveryPass.__new__(RecoveryPass)
    rp._locks = {}
    inside: list[str] = []
    order: list[str] = []

    async def look(host: str, name: str) -> None:
        async with rp._lock(host):
            inside.append(name)
            assert [n for n in inside if n.startswith(host)] == [name]  # alone on its host
            await asyncio.sleep(0.01)
            order.append(name)
            inside.remove(name)

    await asyncio.gather(look("a", "a1"), look("a", "a2"), look("b", "b1"), look("a", "a3"))
    assert order.index("b1") < order.index("a2")  # another host's look never waits for this one's
    assert sorted(order) == ["a1", "a2", "a3", "b1"]
    assert rp._locks == {}

    async def failing() -> None:
        async with rp._lock("c"):
            raise RuntimeError("the look failed")

    try:
        await failing()
    except RuntimeError:
        pass
    assert rp._locks == {}
