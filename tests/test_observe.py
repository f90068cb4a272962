"""The target's observations, the pure parts (issue 18; spec §7.3 T1, T2, T3; §10, §11): T3's comparison by class
against a real HMAC launch report, T2's sentence, T1's floor at boot, and the report's use of them."""

from __future__ import annotations

from kernel import rules
from services.box.artifacts.sealing import generate_private_key
from services.box.deployment import below_floor
from services.door.decide import Floor
from services.source.report import Verifier, build_report
from services.target.observe import compare_environment, key_detail
from services.target.readiness import Observations, assess
from tests.test_target import T0, good_obs, landing_record, moving_claim

HOST, MOVE = "a.example.com", "mv_" + "a" * 26


def verifier(env: dict[str, str]) -> Verifier:
    key = generate_private_key()
    report = build_report(key, host=HOST, move_id=MOVE, box="ie-1", at=1, env=env, inputs={})
    return Verifier(report, key, host=HOST, move_id=MOVE)


def test_t3_compares_each_variable_by_its_class_and_names_never_a_value() -> None:
    source = {"MODE": "standard", "WHERE": "ie", "DB": "/ie/data/a.db", "ONLY_SRC": "x", "TOKEN": "s3cret"}
    classes = {"MODE": "equal", "WHERE": "region", "DB": "layout", "ONLY_SRC": "equal", "TOKEN": "equal",
               "ONLY_TGT": "equal"}
    target = {"MODE": "strict", "WHERE": "uk", "DB": "/uk/data/a.db", "ONLY_TGT": "y", "TOKEN": "s3cret"}
    out = compare_environment(target, classes, verifier(source))  # type: ignore[arg-type]
    assert out == ["MODE", "ONLY_SRC (only on the source)", "ONLY_TGT (only on this box)"]
    assert not any("strict" in o or "standard" in o for o in out)
    same_region = {**target, "WHERE": "ie", "MODE": "standard", "ONLY_SRC": "x"}
    same_region.pop("ONLY_TGT")
    assert compare_environment(same_region, classes, verifier(source)) == [  # type: ignore[arg-type]
        "WHERE (the same in both regions, where it must differ)"]


def test_t2_names_the_box_and_the_remedy() -> None:
    want = "sha256:" + "a" * 64
    assert key_detail("uk-1", want, want) is None
    assert "uk-1 holds no secrets key" in (key_detail("uk-1", "", want) or "")
    assert (key_detail("uk-1", "sha256:" + "b" * 64, want) or "").startswith(
        "uk-1 holds the secrets key sha256:bbbbbbbbbbbbbbbb..., not the deployment's sha256:aaaaaaaaaaaaaaaa...")
    assert "hostmove deployment init" in (key_detail("uk-1", want, None) or "")
    bad = assess(good_obs(key_detail="uk-1 holds no secrets key"), moving_claim(), landing_record(state="preparing"),
                 T0)
    assert [(c.check, c.detail) for c in bad.failing()] == [("T2", "uk-1 holds no secrets key")]
    with rules.mutated(["readiness-key"]):
        assert assess(good_obs(key_detail="x"), moving_claim(), landing_record(state="preparing"), T0).ready


def test_t1_and_the_boot_check_read_the_floor() -> None:
    assert below_floor(None) is None and below_floor(Floor(min=1)) is None
    assert below_floor(Floor(min=2)) == "this box speaks moves protocol 1, below the deployment's floor 2"
    assert "below the floor's v99.0.0" in (below_floor(Floor(min=1, min_release="v99.0.0")) or "")
    assert below_floor(Floor(min=1, min_release="v0.0.1")) is None
    obs: Observations = good_obs(protocol_detail="this box runs release v0.1.0, below the floor's v9.0.0")
    bad = assess(obs, moving_claim(), landing_record(state="preparing"), T0)
    assert [(c.check, c.detail) for c in bad.failing()] == [
        ("T1", "this box runs release v0.1.0, below the floor's v9.0.0")]
