"""Concurrent passes (issue 19 item 3; spec §7.4: the cut window is per host): :mod:`kernel.passes`, bounded, one pass
at a time per host, a host owed a pass while its pass runs passed again after it, one host's error its own."""

from __future__ import annotations

import asyncio

import pytest

from kernel.passes import PassPool, PassSlots, bounded, workers_override


def test_the_slots_start_owed_hosts_in_order_within_the_bound_never_one_running() -> None:
    slots = PassSlots(2)
    slots.want(["c", "a", "b"])
    assert slots.take() == ["a", "b"] and slots.take() == []
    slots.want(["a"])  # dirtied while its pass runs: owed, not started twice
    slots.done("b")
    assert slots.take() == ["c"]
    assert slots.running == {"a", "c"} and list(slots.owed) == ["a"]
    slots.done("a")
    assert slots.take() == ["a"]
    slots.done("a")
    slots.done("c")
    assert slots.idle
    slots.want(["x", "y"])
    assert slots.withdraw() == {"x", "y"} and slots.idle
    slots.want(["b", "a"])
    assert slots.take() == ["a", "b"]
    slots.want(["d", "c"])
    slots.want(["a"])  # a dirtied again: owed after c and d, which waited first
    slots.done("a")
    slots.done("b")
    assert slots.take() == ["c", "d"] and slots.take() == []
    with pytest.raises(ValueError):
        PassSlots(0)


def test_the_workers_setting_is_a_positive_whole_number() -> None:
    assert workers_override(None) == 8 and workers_override(" ", 3) == 3 and workers_override("2") == 2
    for bad in ("0", "-1", "many", "1.5"):
        with pytest.raises(ValueError, match="HOSTMOVE_PASS_WORKERS"):
            workers_override(bad)


class Passes:
    """A pass per host that waits for the test's release of it, recording what runs at once."""

    def __init__(self) -> None:
        self.running: set[str] = set()
        self.most = 0
        self.started: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, host: str) -> asyncio.Event:
        return self.gates.setdefault(host, asyncio.Event())

    async def run(self, host: str) -> None:
        assert host not in self.running, f"two passes of {host} at once"
        self.running.add(host)
        self.most = max(self.most, len(self.running))
        self.started.append(host)
        try:
            await self.gate(host).wait()
            self.gate(host).clear()
            if host == "bad":
                raise RuntimeError("this host's pass fails")
        finally:
            self.running.discard(host)


async def until(what: str, check: object, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0)


async def test_the_pool_bounds_its_passes_runs_one_per_host_and_passes_a_redirtied_host_again() -> None:
    p = Passes()
    pool = PassPool(2, p.run)
    pool.submit({"h3", "h1", "h2"})
    await until("two passes run", lambda: p.running == {"h1", "h2"})
    assert p.started == ["h1", "h2"]  # sorted, within the bound: h3 waits
    pool.submit({"h1"})  # h1 dirtied while its pass runs
    p.gate("h1").set()
    await until("h3 starts once h1 ends", lambda: "h3" in p.running)
    assert p.running == {"h2", "h3"} and p.started == ["h1", "h2", "h3"]  # the bound holds: h1 waits its turn
    p.gate("h2").set()
    await until("h1 passed again", lambda: p.started.count("h1") == 2)
    p.gate("h1").set()
    p.gate("h3").set()
    await until("every pass ended", lambda: pool.idle)
    assert p.most == 2 and p.started == ["h1", "h2", "h3", "h1"]


async def test_a_failing_pass_never_stops_another_hosts_and_a_slow_one_delays_none() -> None:
    p = Passes()
    pool = PassPool(3, p.run)
    pool.submit({"bad", "slow", "quick"})
    await until("three run", lambda: len(p.running) == 3)
    p.gate("bad").set()
    await until("the failing pass ended", lambda: "bad" not in pool.running)
    p.gate("quick").set()
    await until("the quick pass ended while the slow one runs", lambda: pool.running == {"slow"})
    pool.submit({"quick", "bad"})  # passed again beside the slow one
    await until("both passed again", lambda: p.started.count("quick") == 2 and p.started.count("bad") == 2)
    for host in ("quick", "bad", "slow"):
        p.gate(host).set()
    await until("every pass ended", lambda: pool.idle)


async def test_drain_waits_for_the_running_and_starts_none_and_cancel_ends_them() -> None:
    p = Passes()
    pool = PassPool(1, p.run)
    pool.submit({"a", "b"})
    await until("a runs", lambda: p.running == {"a"})
    drained = asyncio.ensure_future(pool.drain())
    await asyncio.sleep(0)
    p.gate("a").set()
    await drained
    assert p.started == ["a"] and list(pool.slots.owed) == ["b"]  # b stays owed; nothing started while draining
    pool.submit(set())
    await until("b runs", lambda: p.running == {"b"})
    await pool.cancel()
    assert not p.running and pool.idle
    pool.submit({"c"})  # closed: nothing starts again
    await asyncio.sleep(0)
    assert p.started == ["a", "b"] and pool.running == set()


async def test_bounded_runs_items_in_order_at_most_workers_at_once_and_stops_starting_on_stop() -> None:
    p = Passes()
    stopped = False
    done = asyncio.ensure_future(bounded(["a", "b", "c", "d"], 2, p.run, stop=lambda: stopped))
    await until("two run", lambda: p.running == {"a", "b"})
    p.gate("b").set()
    await until("c starts", lambda: p.running == {"a", "c"})
    stopped = True
    p.gate("c").set()
    await until("c ended", lambda: p.running == {"a"})
    p.gate("a").set()
    await done
    assert p.started == ["a", "b", "c"] and p.most == 2  # d never started
