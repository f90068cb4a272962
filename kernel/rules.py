"""Named rules: every guard the spec names is a named rule in the code (ARCHITECTURE §7; spec §14.2.1).

A guard site reads ``if rules.on("generation-conditional"): ...``. Production keeps every rule on:
nothing in production switches one off, and :func:`on` answers ``True`` unless the caller runs inside
:func:`mutated`. Only the deterministic simulation (``sim/``) enters :func:`mutated`, to prove that an
invariant catches the rule's absence (the mutation sweep of spec §14.2.1, model digest §1).

Every rule is registered here, once, with the spec section it comes from and the file that guards
it, so the sweep can list them and a misspelt name fails loudly instead of reading as "on".
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = [
    "ALIASES", "RULES", "Rule", "UnknownRule", "alias", "consulted", "load_all", "mutated", "off", "on", "parse",
    "register", "reset_consulted",
]


@dataclass(frozen=True)
class Rule:
    """A named guard: what it encodes, where the spec says so, and where the code checks it."""

    name: str
    section: str
    meaning: str
    site: str


class UnknownRule(KeyError):
    """A rule name nobody registered: a typo must never read as a rule that is on."""

    def __str__(self) -> str:
        return f"unknown rule {self.args[0]!r}; the registered rules are listed in kernel/rules.py"


RULES: dict[str, Rule] = {}
ALIASES: dict[str, str] = {}
"""An old name a test still reads -> the spec's name it was renamed to (:func:`alias`)."""
_OFF: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("hostmove_rules_off", default=frozenset())
_CONSULTED: Counter[str] = Counter()


def register(name: str, *, section: str, meaning: str, site: str) -> Rule:
    """Register a rule (once; the same definition again is a no-op)."""
    rule = Rule(name, section, meaning, site)
    existing = RULES.get(name)
    if existing is not None and existing != rule:
        raise ValueError(f"rule {name!r} is already registered with another definition")
    RULES[name] = rule
    return rule


def alias(old: str, new: str) -> None:
    """``old`` names the registered rule ``new`` (a project name the spec's name replaced, kept while a test reads
    it): switching either off switches the rule off."""
    if new not in RULES:
        raise UnknownRule(new)
    ALIASES[old] = new


def _canonical(name: str) -> str:
    name = ALIASES.get(name, name)
    if name not in RULES:
        raise UnknownRule(name)
    return name


def on(name: str) -> bool:
    """Is the rule in force? Always, outside a simulation that switched it off."""
    name = ALIASES.get(name, name)
    if name not in RULES:
        raise UnknownRule(name)
    _CONSULTED[name] += 1
    return name not in _OFF.get()


def off() -> frozenset[str]:
    """The rules switched off in the current context (empty in production)."""
    return _OFF.get()


@contextlib.contextmanager
def mutated(names: Iterable[str]) -> Iterator[frozenset[str]]:
    """Switch the named rules off inside the block (simulation only). Tasks created inside inherit it."""
    wanted = frozenset(_canonical(name) for name in names)
    token = _OFF.set(_OFF.get() | wanted)
    try:
        yield wanted
    finally:
        _OFF.reset(token)


def consulted() -> Counter[str]:
    """How often each guard was evaluated in this process since :func:`reset_consulted`."""
    return Counter(_CONSULTED)


def reset_consulted() -> None:
    _CONSULTED.clear()


def load_all(packages: Iterable[str] = ("services",)) -> list[str]:
    """Import every module of ``packages`` so that each registers its rules (a guard site registers
    its rule beside it). Answers the modules that could not be imported, with why."""
    import importlib
    import pkgutil

    failed: list[str] = []
    for package in packages:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # noqa: BLE001 - reported to the caller, never hidden
                failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    return failed


def parse(text: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``, each checked against the registry."""
    return tuple(sorted({_canonical(part.strip()) for part in text.split(",") if part.strip()}))


# -- the registry ---------------------------------------------------------------------------------
# Rules registered here guard real code at the site named; other modules register their own rules
# beside their guards (load_all imports them). A rule the simulation never consults is declared in
# sim/expected-outcomes.txt with its reason.

register(
    "publish-before-supersede",
    section="ARCHITECTURE §4 'Gapless, ordered history'; spec §14.2 history",
    meaning="before a writer supersedes gen N, gen N's event is on the stream (publish it first)",
    site="services/ledger/ledger.py Ledger.transition, the ensure_published call",
)
register(
    "ledger-cas",
    section="claim C3; ARCHITECTURE §4 (CAS with the ETag it read)",
    meaning="a claim or record is written If-Match the ETag read, or If-None-Match when absent",
    site="services/ledger/ledger.py Ledger.transition, the store.put call",
)
register(
    "generation-conditional",
    section="§5.1 markers; model 29",
    meaning="generation.json is written If-Match the marker it supersedes, or If-None-Match",
    site="services/box/artifacts/markers.py publish_generation_marker",
)
register(
    "exec-writer",
    section="§19.2 K1; claim 6.8.1; digest D§6 guards",
    meaning="the admission CAS requires op.exec to name the admitted box",
    site="services/box/instance/admission.py decide_admit_writer, the op.exec check",
)
register(
    "admit-bind-op",
    section="claim 6.9, R9-4; §5.1 step 9; digest D§6 'On conflict'",
    meaning="an admission is bound to the op.id and phase it observed (and kind, session, generation): it refuses "
            "when any moved",
    site="services/box/instance/admission.py decide_admit_writer, the observed != actual check",
)
register(
    "admission-kinds",
    section="digest D§3.7; INV-13",
    meaning="no writer is admitted while the claim is creating, deleting, parking, purging, placing or free",
    site="services/box/instance/admission.py decide_admit_writer, the REFUSED_KINDS check",
)
