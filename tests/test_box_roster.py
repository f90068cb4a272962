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
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.roster import RosterBox, RosterRefusal, decide_register, init_box, read_roster
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
    assert roster.gen == 4, "four CAS writes, none lost"
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
    assert again.secrets_key_fp == inits[0].secrets_key_fp
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
