"""AdmitWriter (§5.1 step 9, §7.14) and the start check (§5.1, INV-4), pure and through the real ledger."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio

from bus.nats_log import NatsEventLog
from events import Actor, Claim
from events.base import canonical, decode
from events.claim import Admission, Holder, Op
from hostmove.stackinfo import StackInfo
from kernel.ports import ManualClock
from services.box.artifacts.markers import (
    FilesGen,
    GenerationMarker,
    Ready,
    Refused,
    RestoreCold,
    publish_generation_marker,
    read_files_gen,
    read_generation_marker,
    read_local_gen,
    start_check,
    write_files_gen,
    write_local_gen,
)
from services.box.instance.admission import AdmitRequest, decide_admit_writer
from services.hosts.create import decide_begin_create, decide_finish_create
from services.ledger import Committed, Ledger, Refusal
from services.objstore.port import Lost, Won
from services.objstore.s3 import S3Store

INC = "ab" * 32


def serving_claim(**holder_kw: object) -> Claim:
    holder = Holder(incarnation=INC, location=f"instances/h/{INC}/", **holder_kw)  # type: ignore[arg-type]
    return Claim(host="h", gen=2, holder=holder, op=Op(kind="serving", exec="ie-1", participants=("ie-1",)))


def request(claim: Claim, new_generation: str, **kw: object) -> AdmitRequest:
    assert claim.holder is not None
    base: dict[str, object] = dict(
        box="ie-1", region="ie", observed_op_id=claim.op.id, observed_phase=claim.op.phase,
        observed_kind=claim.op.kind, observed_session=claim.holder.session,
        observed_generation=claim.holder.generation, new_generation=new_generation,
    )
    base.update(kw)
    return AdmitRequest(**base)  # type: ignore[arg-type]


def admitted(claim: Claim, new_generation: str, **kw: object) -> Claim:
    out = decide_admit_writer(claim, request(claim, new_generation, **kw))
    assert isinstance(out, Claim), out
    return msgspec.structs.replace(out, gen=claim.gen + 1)  # what the ledger's CAS writes


def test_first_admission_into_an_empty_generation_declares_nothing() -> None:
    c = admitted(serving_claim(), "g1")
    h = c.holder
    assert h is not None and h.session == 3 and h.stamp == 3 and h.generation == "g1" and h.writer_box == "ie-1"
    rec = h.admissions[-1]
    assert rec.session == 3 and rec.region == "ie" and rec.mode == "cold"
    assert rec.predecessor is not None and rec.predecessor.box == "" and rec.writes_lost is None
    assert rec.predecessor_region == ""


def test_next_cold_admission_declares_the_predecessor_unless_covered() -> None:
    c1 = admitted(serving_claim(), "g1")
    c2 = admitted(c1, "g2", remote_max_txid=41)
    rec = c2.holder.admissions[-1]  # type: ignore[union-attr]
    assert rec.predecessor is not None and (rec.predecessor.box, rec.predecessor.session) == ("ie-1", 3)
    assert rec.predecessor_region == "ie"
    assert rec.writes_lost is not None and rec.writes_lost.remote_max_txid == 41
    assert (rec.writes_lost.box, rec.writes_lost.session, rec.writes_lost.generation) == ("ie-1", 3, "g1")
    covered = admitted(c1, "g2", coverage="sealed")
    assert covered.holder.admissions[-1].writes_lost is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(observed_session=99), "changed since it was read"),
        (dict(observed_phase="x"), "changed since it was read"),
        (dict(box="uk-1"), "does not hold execution"),
    ],
)
def test_stale_observations_and_wrong_box_refuse(change: dict, reason: str) -> None:
    c = serving_claim()
    out = decide_admit_writer(c, request(c, "g1", **change))
    assert isinstance(out, Refusal) and reason in out.reason


def test_refused_kinds_and_reentered_generations() -> None:
    c = msgspec.structs.replace(serving_claim(), op=Op(kind="creating", exec="ie-1"))
    assert isinstance(decide_admit_writer(c, request(c, "g1")), Refusal)
    c1 = admitted(serving_claim(), "g1")
    c2 = admitted(c1, "g2")
    out = decide_admit_writer(c2, request(c2, "g1"))
    assert isinstance(out, Refusal) and "never re-entered" in out.reason


def test_keep_stamp_only_when_the_stamp_is_newer_than_the_session() -> None:
    c = serving_claim(stamp=7, session=3)
    assert admitted(c, "g1", keep_stamp=True).holder.stamp == 7  # type: ignore[union-attr]
    c = serving_claim(stamp=2, session=3)
    assert admitted(c, "g1", keep_stamp=True).holder.stamp == 3  # type: ignore[union-attr]


def test_covered_records_are_trimmed_from_the_front_only() -> None:
    recs = tuple(
        Admission(session=i, box="ie-1", generation=f"g{i}", region="ie", covered=i != 3) for i in range(1, 11)
    )
    c = serving_claim(admissions=recs, generation="g10", session=10)
    out = admitted(c, "g11")
    gens = [a.generation for a in out.holder.admissions]  # type: ignore[union-attr]
    assert gens[0] == "g3", "trimming stops at the first uncovered record"
    assert gens[-1] == "g11"


def test_records_encode_without_their_defaults_and_decode_to_the_same_claim() -> None:
    """Issue 16: an admission record's fields at their defaults are left out of the claim's bytes (the optional
    ``writes_lost?`` and ``additional_writes_lost?`` of D§2.1, an empty coverage, covered false, mode cold), and a
    claim written with every field spelled out decodes to the same value."""
    c1 = admitted(serving_claim(), "g1")
    c2 = admitted(c1, "g2", remote_max_txid=41)
    body = canonical(c2)
    quiet = msgspec.json.decode(body)["holder"]["admissions"][0]
    assert set(quiet) == {"session", "box", "generation", "region", "predecessor"}, quiet
    declared = msgspec.json.decode(body)["holder"]["admissions"][1]
    assert declared["writes_lost"] == {"box": "ie-1", "session": 3, "generation": "g1", "remote_max_txid": 41}
    assert "additional_writes_lost" not in declared and "covered" not in declared and "mode" not in declared
    assert decode(body, Claim) == c2
    full = msgspec.json.decode(body)  # as a writer before issue 16 spelled every field

    def spell(rec: dict) -> dict:
        out = {"predecessor_region": "", "mode": "cold", "coverage": "", "covered": False, "writes_lost": None,
               "additional_writes_lost": [], **rec}
        out["predecessor"] = {"session": 0, "box": "", "generation": "", "stamp": 0, **rec["predecessor"]}
        if out["writes_lost"] is not None:
            out["writes_lost"] = {"local_txid": 0, **out["writes_lost"]}
        return out

    full["holder"]["admissions"] = [spell(r) for r in full["holder"]["admissions"]]
    spelled = msgspec.json.encode(full)
    assert b'"additional_writes_lost":[]' in spelled and len(spelled) > len(body)
    assert decode(spelled, Claim) == c2 and canonical(decode(spelled, Claim)) == body


# -- the start check ------------------------------------------------------------------------------


def marker(op: str, inc: str = INC) -> GenerationMarker:
    return GenerationMarker(op=op, incarnation=inc, host="h", box="ie-1", installed_at=1)


def test_start_check_rules() -> None:
    c1 = admitted(serving_claim(), "g1")
    c2 = admitted(c1, "g2")
    ok = start_check(c2, marker("g2"), FilesGen(op="g2", incarnation=INC), True, "g2")
    assert isinstance(ok, Ready)
    lagging = start_check(c2, marker("g1"), None, False, "g2")
    assert isinstance(lagging, Ready), "a marker lagging through the admissions chain is accepted"
    other_inc = start_check(c2, marker("g2", "cd" * 32), None, False, "g2")
    assert isinstance(other_inc, Refused) and "another incarnation" in other_inc.reason
    stranger = start_check(c2, marker("g9"), None, False, "g2")
    assert isinstance(stranger, Refused) and "g9" in stranger.reason
    files_pred = start_check(c2, marker("g2"), FilesGen(op="g1", incarnation=INC), True, "g2")
    assert isinstance(files_pred, Ready), "files of the cold predecessor count"
    files_old = start_check(c2, marker("g2"), FilesGen(op="", incarnation=INC), True, "g2")
    assert isinstance(files_old, Refused)
    files_inc = start_check(c2, marker("g2"), FilesGen(op="g2", incarnation="cd" * 32), True, "g2")
    assert isinstance(files_inc, Refused)
    assert isinstance(start_check(c2, marker("g2"), None, False, "g1"), RestoreCold)
    assert isinstance(start_check(c2, marker("g2"), None, False, None), RestoreCold)
    origin = serving_claim()
    assert isinstance(start_check(origin, None, None, True, ""), Ready), "absent everywhere means origin"


def test_local_markers_round_trip(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    assert read_local_gen(db) is None
    db.write_bytes(b"")
    assert read_local_gen(db) == ""
    write_local_gen(db, "g7")
    assert read_local_gen(db) == "g7" and (tmp_path / "h.gen").read_text() == "g7\n"
    files = tmp_path / "h"
    files.mkdir()
    assert read_files_gen(files) is None
    write_files_gen(files, "g7", INC)
    assert read_files_gen(files) == FilesGen(op="g7", incarnation=INC)


# -- against the real stack -----------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def parts(stack: StackInfo, unique: Callable[[str], str]) -> AsyncIterator[tuple[S3Store, NatsEventLog, str]]:
    store = await S3Store.open(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, stack.s3_region)
    events = await NatsEventLog.connect(stack.nats_url)
    bucket = unique("admission")
    await store.create_bucket(bucket)
    yield store, events, bucket
    await store.delete_bucket(bucket)
    await events.close()
    await store.close()


async def test_admission_through_the_ledger_on_the_real_stack(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, events, bucket = parts
    ledger = Ledger(store, events, ManualClock(), Actor(service="box", pid=1, nonce="n", box="ie-1"), bucket)
    host = f"{unique('adm')}.example.com"
    await ledger.transition("claim", host, "create-begin", functools.partial(
        decide_begin_create, host=host, incarnation=INC, box="ie-1", region="ie"))
    created = await ledger.transition("claim", host, "create-serving",
                                      functools.partial(decide_finish_create, incarnation=INC))
    assert isinstance(created, Committed)
    claim = created.state
    req = request(claim, "g-first")
    out = await ledger.transition("claim", host, "admit-writer", lambda c: decide_admit_writer(c, req))
    assert isinstance(out, Committed) and out.state.holder is not None
    assert out.state.holder.session == out.state.gen == 3
    # the same (now stale) observation refuses and writes nothing
    again = await ledger.transition("claim", host, "admit-writer", lambda c: decide_admit_writer(c, req))
    assert isinstance(again, Refusal)
    assert (await ledger.read_claim(host)).state.gen == 3  # type: ignore[union-attr]


async def test_generation_marker_is_written_conditionally(
    parts: tuple[S3Store, NatsEventLog, str], unique: Callable[[str], str]
) -> None:
    store, _, bucket = parts
    location = f"instances/{unique('mk')}/{INC}/"
    assert (await read_generation_marker(store, bucket, location)).marker is None
    first = await publish_generation_marker(store, bucket, location, marker("g1"), None)
    assert isinstance(first, Won)
    late_create = await publish_generation_marker(store, bucket, location, marker("g0"), None)
    assert isinstance(late_create, Lost), "If-None-Match: a late first publication cannot land"
    second = await publish_generation_marker(store, bucket, location, marker("g2"), first.etag)
    assert isinstance(second, Won)
    late = await publish_generation_marker(store, bucket, location, marker("g1b"), first.etag)
    assert isinstance(late, Lost), "If-Match the superseded marker: an older generation never comes back"
    read = await read_generation_marker(store, bucket, location)
    assert read.marker is not None and read.marker.op == "g2"
