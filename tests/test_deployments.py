"""Two deployments on one machine stay apart (issue 11 item 5; spec §5.3 strays and strict spawns).

A box's cgroup subtree, its agent's leaf and every process it may kill are keyed by the deployment's identity
(``control/deployment.json`` in its bucket) as well as the box's label: two deployments that both name their boxes
``ie-1`` and ``uk-1`` on one machine, each with its own root, deployment bucket and data buckets, run a move each at
the same time, and both end ``done``. With a layout keyed by the label alone each source's stop evidence would
count the other deployment's agent in ``hostmove/ie-1/@agent`` as a stray, and each agent's scrub would kill the
other's instances."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from events.base import DurableValueError, decode
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock, SeededRandom
from services.box.instance.proctree import AGENT_LEAF, leaf_name
from services.box.roster import DEPLOYMENT_KEY, DeploymentId, ensure_deployment, read_deployment, read_roster
from services.objstore.memory import MemoryStore
from services.objstore.port import Got
from tests.helpers.agents import AgentWorld, agent_world, data_buckets
from tests.test_agent import APP, assert_served_on_uk, create_and_write, moved, request_move, serving_port

LABELS = {"ie": "ie-1", "uk": "uk-1"}


async def test_the_identity_is_created_once_and_read_by_everyone() -> None:
    """Whoever first needs it creates it (If-None-Match); of two first readers at once one write wins and both
    answer it; every later reader, after any restart, reads the same; another deployment's bucket has another."""
    store, clock = MemoryStore(), ManualClock()
    for bucket in ("deploy-a", "deploy-b"):
        await store.create_bucket(bucket, versioned=True)
    assert await read_deployment(store, "deploy-a") is None
    first = await asyncio.gather(*(ensure_deployment(store, "deploy-a", rng=SeededRandom(seed), clock=clock)
                                   for seed in (1, 2)))
    assert first[0] == first[1] and leaf_name(first[0]) == first[0]
    assert await ensure_deployment(store, "deploy-a", rng=SeededRandom(3), clock=clock) == first[0]
    assert len(await store.list_versions("deploy-a", DEPLOYMENT_KEY)) == 1, "written once, never rewritten"
    got = await store.get("deploy-a", DEPLOYMENT_KEY)
    assert isinstance(got, Got) and decode(got.body, DeploymentId).id == first[0]
    assert await ensure_deployment(store, "deploy-b", rng=SeededRandom(9), clock=clock) != first[0]
    with pytest.raises(DurableValueError):  # never a path, whatever the bucket holds
        decode(b'{"created_at": 1, "id": "../ie-1"}', DeploymentId)


async def move_one(w: AgentWorld, host: str) -> str:
    """Create the host on ie-1, write, move it to uk-1: ``done``, with every check of §14.4."""
    await create_and_write(w, host)
    move_id = await request_move(w, host)
    await moved(w, host, move_id, timeout_s=150)
    await assert_served_on_uk(w, host, move_id)
    return move_id


@pytest.mark.asyncio(loop_scope="session")
async def test_two_deployments_with_the_same_labels_each_move_at_once(
        stack: StackInfo, unique: Callable[[str], str], tmp_path: Path) -> None:
    async with data_buckets(stack, unique, "dpa") as (store, events, prefix_a), \
            data_buckets(stack, unique, "dpb") as (_store_b, _events_b, prefix_b), \
            agent_world(stack, unique, tmp_path / "a", prefix_a, store=store, events=events, app_env=APP,
                        labels=LABELS) as a, \
            agent_world(stack, unique, tmp_path / "b", prefix_b, store=store, events=events, app_env=APP,
                        labels=LABELS) as b:
        assert a.labels == b.labels == LABELS and a.root != b.root and a.deploy != b.deploy
        assert a.deployment != b.deployment
        for w in (a, b):  # the identity is the deployment bucket's, the one each agent read at its start
            stored = await read_deployment(store, w.deploy)
            assert stored is not None and stored.id == w.deployment
            roster, _ = await read_roster(store, w.deploy)
            assert roster is not None and [x.label for x in roster.boxes] == ["ie-1", "uk-1"]
        groups = {w.deployment: (w.box_group("ie"), w.box_group("uk")) for w in (a, b)}
        assert all(g is not None for pair in groups.values() for g in pair)
        assert groups[a.deployment][0] != groups[b.deployment][0] and groups[a.deployment][1] != groups[b.deployment][1]

        hosts = {a.deploy: f"{unique('dpa')}.example.com", b.deploy: f"{unique('dpb')}.example.com"}
        done = await asyncio.gather(move_one(a, hosts[a.deploy]), move_one(b, hosts[b.deploy]))
        assert all(done)

        for w, other in ((a, b), (b, a)):  # each serves its own host on its own uk-1, in its own subtree
            host = hosts[w.deploy]
            await serving_port(w, "uk", host)
            group = w.box_group("uk")
            assert group is not None
            assert w.tree("uk-1").populated(host) and not other.tree("uk-1").populated(host)
            assert (group / AGENT_LEAF).is_dir() and (group / leaf_name(host)).is_dir()
            assert not (group / leaf_name(hosts[other.deploy])).exists()
            assert not w.tree("ie-1").populated(host), "the source's instance stopped"
        rcs = {w.deployment: w.stop() for w in (a, b)}
        assert all(rc == {"ie": 0, "uk": 0} for rc in rcs.values()), rcs
        for w in (a, b):  # each agent scrubbed its own subtree on its way out
            for region in ("ie", "uk"):
                group = w.box_group(region)
                assert group is not None and not group.exists(), group
