"""Box init and the roster (issue 3 item 1) on the real stack."""

from __future__ import annotations

import asyncio
import re
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from bus.subjects import FACTS_STREAM, fact_subject
from events import Actor
from events.base import canonical
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.fence import decide_fence_roster
from services.box.roster import (
    BOXES_PREFIX,
    ROSTER_KEY,
    BoxRegistration,
    Roster,
    RosterBox,
    RosterRefusal,
    box_entry_key,
    decide_register,
    init_box,
    merge_roster,
    read_roster,
    update_roster,
)
from services.objstore.port import Got
from services.objstore.s3 import S3Store


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def parts(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    yield store, events
    await events.close()
    await store.close()


async def test_boxes_register_concurrently_with_their_key_fingerprint(
    parts: tuple[S3Store, NatsEventLog], unique: Callable[[str], str], tmp_path: Path
) -> None:
    store, events = parts
    bucket = unique("roster")
    await store.create_bucket(bucket)
    clock = ManualClock()
    actor = Actor(service="box-init", pid=1, nonce="n")
    labels = [unique("box") for _ in range(4)]
    inits = await asyncio.gather(*(
        init_box(root=tmp_path, label=label, region="ie" if i % 2 else "uk", store=store, bucket=bucket,
                 events=events, clock=clock, actor=actor)
        for i, label in enumerate(labels)
    ))
    roster, _ = await read_roster(store, bucket)
    assert roster is not None and sorted(b.label for b in roster.boxes) == sorted(labels)
    assert [i.roster_gen for i in inits] == [1, 1, 1, 1], "each box wrote its own object, none lost"
    assert sorted(await store.list_keys(bucket, BOXES_PREFIX)) == sorted(box_entry_key(lb) for lb in labels)
    assert not isinstance(await store.get(bucket, ROSTER_KEY), Got), "a registration never writes roster.json"
    fps = {b.secrets_key_fp for b in roster.boxes}
    assert len(fps) == 1 and re.fullmatch(r"sha256:[0-9a-f]{64}", fps.pop() or "")
    for init in inits:
        key = init.box_dir / "secrets.pem"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert roster.box(init.label) is not None and roster.box(init.label).moves_protocol == 1  # type: ignore[union-attr]
    facts = [m async for m in events.replay(FACTS_STREAM, subject=fact_subject("roster", labels[0]))]
    assert len(facts) == 1
    # re-init is idempotent; a region change is refused
    again = await init_box(root=tmp_path, label=labels[0], region=inits[0].region, store=store, bucket=bucket,
                           events=events, clock=clock, actor=actor)
    assert again.secrets_key_fp == inits[0].secrets_key_fp and again.roster_gen == 2
    with pytest.raises(RosterRefusal):
        await init_box(root=tmp_path, label=labels[0], region="us", store=store, bucket=bucket, events=events,
                       clock=clock, actor=actor)
    await store.delete_bucket(bucket)


def test_a_box_never_changes_region() -> None:
    entry = RosterBox(label="a", region="ie", moves_protocol=1, secrets_key_fp="sha256:" + "0" * 64, registered_at=1)
    roster = decide_register(None, entry)
    assert roster.gen == 1 and roster.in_region("ie") == [entry]
    with pytest.raises(RosterRefusal, match="never changes region"):
        decide_register(roster, RosterBox(label="a", region="uk", moves_protocol=1, secrets_key_fp="x",
                                          registered_at=2))


def _box(label: str, region: str = "ie", at: int = 1, fenced: int | None = None) -> RosterBox:
    return RosterBox(label=label, region=region, moves_protocol=1, secrets_key_fp="sha256:" + "0" * 64,
                     registered_at=at, fenced_at=fenced)


def test_the_roster_is_roster_json_and_each_box_s_own_entry() -> None:
    """Issue 14 (the roster write of a box): a fenced entry stands, a box's own object never changes its recorded
    region nor fences or unfences it, and otherwise the later registration wins."""
    listed = Roster(gen=3, boxes=(_box("a", at=5, fenced=9), _box("b", at=5), _box("c", at=5)))
    merged = merge_roster(listed, [_box("a", at=7), _box("b", region="uk", at=7), _box("c", at=8),
                                   _box("d", at=2, fenced=4)])
    assert merged is not None and merged.gen == 3
    assert merged.box("a") == _box("a", at=5, fenced=9), "a fenced box never comes back through its own object"
    assert merged.box("b") == _box("b", at=5), "a box never changes region"
    assert merged.box("c") == _box("c", at=8)
    assert merged.box("d") == _box("d", at=2), "only roster.json fences"
    assert merge_roster(None, []) is None
    assert merge_roster(None, [_box("e")]) == Roster(gen=1, boxes=(_box("e"),))


async def test_a_fence_marks_a_box_that_registered_itself_and_bad_entries_skip_only_their_box(
    parts: tuple[S3Store, NatsEventLog], unique: Callable[[str], str], tmp_path: Path
) -> None:
    store, events = parts
    bucket = unique("roster")
    await store.create_bucket(bucket)
    clock, actor = ManualClock(), Actor(service="box-init", pid=1, nonce="n")
    good, bad, liar, victim = (unique("box") for _ in range(4))
    await init_box(root=tmp_path, label=good, region="ie", store=store, bucket=bucket, events=events, clock=clock,
                   actor=actor, announce=False)
    await init_box(root=tmp_path, label=victim, region="uk", store=store, bucket=bucket, events=events, clock=clock,
                   actor=actor)
    await store.put(bucket, box_entry_key(bad), b"{not json")
    await store.put(bucket, box_entry_key(liar), canonical(BoxRegistration(gen=1, box=_box(victim, region="ie",
                                                                                           at=10**15))))
    roster, _ = await read_roster(store, bucket)
    assert roster is not None and sorted(b.label for b in roster.boxes) == sorted([good, victim])
    assert roster.box(victim) is not None and roster.box(victim).region == "uk", "an entry names its own box only"  # type: ignore[union-attr]
    assert not [m async for m in events.replay(FACTS_STREAM, subject=fact_subject("roster", good))]
    await update_roster(store, bucket, lambda cur: decide_fence_roster(cur, good, 77))
    with pytest.raises(RosterRefusal, match="fenced"):
        await init_box(root=tmp_path, label=good, region="ie", store=store, bucket=bucket, events=events,
                       clock=clock, actor=actor, announce=False)
    roster, _ = await read_roster(store, bucket)
    assert roster is not None and roster.box(good) is not None and roster.box(good).fenced_at == 77  # type: ignore[union-attr]
    await store.delete_bucket(bucket)
