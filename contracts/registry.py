"""The check catalogue: plain importable functions with stable public ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import difflib
import re
from collections.abc import Iterable

from offload_ref.config import OffloadStrategy

from . import severity as _severity
from . import traits as _traits

__all__ = ["ALL_STRATEGIES", "AREAS", "CATALOGUE", "DOCS", "CheckFailure", "CheckInfo",
           "CheckNotApplicable", "NotApplicable", "applicability", "check", "closest", "doc_for",
           "fail", "not_applicable", "one_line", "strategy_names"]


class CheckFailure(AssertionError):
    """A contract does not hold.  The message names the check, the object and both values;
    ``severity`` (a :class:`~.severity.Severity` or its name), when the failure site gives one,
    says how bad what it found is (else the check's default: :mod:`.severity`)."""

    def __init__(self, message: str = "", severity: Any = None) -> None:
        super().__init__(message)
        self.severity = None if severity is None else _severity.Severity.of(severity)


def fail(message: str, severity: Any = None) -> None:
    """Raise :class:`CheckFailure`; ``severity`` overrides the check's default level
    (``"wrong output"``, ``"error"``, ``"memory"``, ``"trace"``: :mod:`.severity`)."""
    raise CheckFailure(message, severity)


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception on one line (whitespace collapsed, at most 200
    characters of message), for reports that quote it."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class CheckNotApplicable(Exception):
    """Raised by a check body that finds, once it has looked, that the pipeline lacks what the
    check needs.  The report shows it as "not applicable: <reason>", never as a pass."""


def not_applicable(reason: str) -> None:
    raise CheckNotApplicable(reason)


class NotApplicable:
    """What an ``applies`` predicate returns when a check does not apply: false in a boolean
    context, with the reason the report prints (``applies`` may also return plain ``False``;
    the check's ``needs=`` text is the reason then)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"NotApplicable({self.reason!r})"


#: The contract areas, by section letter (docs/model-authors.md explains each).
AREAS = {
    "A": "plan",
    "B": "rollback",
    "C": "cycles",
    "D": "aliases",
    "E": "split models",
    "F": "residency",
    "G": "config",
    "H": "distributed",
    "J": "misuse",
    "S": "streams",
}


#: The strategies the kit checks: every one a backend of its own serves.
ALL_STRATEGIES = tuple(s.value for s in OffloadStrategy.served())

#: Where the repository's docs explain each section of the catalogue (``docs/`` path and heading
#: anchor).  A full section id (``"F.6"``) wins over its letter (``"F"``).
DOCS: dict[str, str] = {
    "A": "docs/architecture.md#the-lifecycle",
    "A.8": "docs/strategies.md#auto-mode-a-device-budget",
    "B": "docs/strategies.md#lifecycle-rules-both-strategies",
    "C": "docs/strategies.md#lifecycle-rules-both-strategies",
    "D": "docs/model-authors.md#2-declare-blocks-layerwise",
    "E": "docs/model-authors.md#3-split-models-cosmos3-shape",
    "F": "docs/strategies.md#strategies-model-level-and-layerwise",
    "F.1": "docs/strategies.md#model-level",
    "F.2": "docs/strategies.md#layerwise-blockwise",
    "F.4": "docs/strategies.md#the-ring",
    "F.5": "docs/strategies.md#layerwise-blockwise",
    "F.6": "docs/strategies.md#alignment",
    "F.7": "docs/strategies.md#a-resident-head",
    "G": "docs/strategies.md#configuration",
    "H": "docs/distributed.md#the-conformance-kit-h",
    "I": "docs/benchmarks.md#gpu-i",
    "J": "docs/strategies.md#next-to-a-generation-threads-autograd-weight-edits-state_dict",
    "J.1": "docs/strategies.md#interrupts-and-faults",
    "J.2": "docs/strategies.md#interrupts-and-faults",
    "J.7": "docs/model-authors.md#1-declare-components",
    "S": "docs/model-authors.md#reading-a-race-report",
}


def doc_for(section: str) -> str:
    """The doc (``docs/<file>.md#<anchor>``, relative to the repository root) that explains
    catalogue section ``section`` (``"F.6"``, or a letter ``"A"``-``"J"``)."""
    key = str(section).lstrip("§").strip()
    for candidate in (key, key.split(".")[0]):
        if candidate in DOCS:
            return DOCS[candidate]
    raise KeyError(f"no doc for catalogue section {section!r}; sections: "
                   f"{', '.join(sorted(k for k in DOCS if '.' not in k))}")


def closest(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest candidate, or ``""`` when none is near."""
    match = difflib.get_close_matches(str(name), list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def strategy_names(strategies: Iterable[Any], what: str = "strategy") -> tuple[str, ...]:
    """Normalise strategy names (strings or ``OffloadStrategy`` values) and reject unknown ones.

    An unknown name is an error, never a filter that quietly matches nothing: a misspelled
    strategy would otherwise drop every case of the strategy meant and still come out green.
    """
    if isinstance(strategies, (str, bytes)):
        raise ValueError(f"{what}: expected a tuple of strategy names, got the string "
                         f"{strategies!r}; valid names: {', '.join(ALL_STRATEGIES)}")
    names = tuple(str(getattr(s, "value", s)) for s in strategies)
    unknown = [n for n in names if n not in ALL_STRATEGIES]
    if unknown:
        hints = "; ".join(f"{n!r}{closest(n, ALL_STRATEGIES)}" for n in unknown)
        raise ValueError(f"{what}: unknown strategy name(s) {hints}; valid names: "
                         f"{', '.join(ALL_STRATEGIES)}")
    return names


@dataclass(frozen=True)
class CheckInfo:
    """One check of the catalogue.

    ``scope="spec"`` checks run once per pipeline spec and strategy, for the strategies the spec
    claims among ``strategies`` and never for one it does not claim; ``scope="global"`` checks need no pipeline and run once.
    ``requires`` names the traits (:mod:`.traits`) a spec check needs the pipeline to have, and
    ``applies(spec, strategy)`` (for checks registered outside the kit) narrows it further; a
    check that does not apply is reported "not applicable" with the reason (the unmet trait's,
    a :class:`NotApplicable` returned by ``applies``, else ``needs``), never run and never
    counted as a pass.
    """

    id: str
    func: Callable[[Any], None]
    section: str
    scope: str = "spec"
    strategies: tuple[str, ...] = ALL_STRATEGIES
    applies: Callable[[Any, str], bool] | None = None
    title: str = ""
    needs: str = ""
    requires: tuple[str, ...] = ()
    #: the level of a failure whose site says none (None: :data:`.severity.DEFAULTS`, else
    #: ``wrong output``)
    severity: Any = None
    #: the name of work it shares with other checks of one pipeline and strategy, in one
    #: process (the pytest route runs them on one pytest-xdist worker); "" for none
    shares: str = ""

    @property
    def area(self) -> str:
        return self.section[:1]

    def __call__(self, case: Any) -> None:
        self.func(case)


CATALOGUE: dict[str, CheckInfo] = {}


def check(
    section: str,
    *,
    scope: str = "spec",
    strategies: tuple[str, ...] = ALL_STRATEGIES,
    requires: Iterable[str] = (),
    applies: Callable[[Any, str], bool] | None = None,
    needs: str = "",
    severity: Any = None,
    shares: str = "",
) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register a check function; its name is its public id (``check_<subject>_<behaviour>``).

    ``requires`` names the traits the pipeline must have (:mod:`.traits`: ``"has_vae"``,
    ``"not delegates_model_level"``, ``"dit_blocks>=2"``); an unknown trait is a ``ValueError``
    here.  ``needs`` says what a pipeline must have (the reason printed when it does not); it
    defaults to the required traits' texts.  ``applies(spec, strategy)``, a predicate, is kept
    for checks registered outside the kit; a check with ``applies`` must state ``needs``.
    ``severity`` is the level of its failures where the failure site gives none
    (:mod:`.severity`; default: the kit's table, else ``"wrong output"``).  ``shares`` names
    work the check shares with the other checks of that name on one pipeline and strategy when
    they run in one process (Note [One fault sweep for two checks] in checks/lifecycle.py).
    """
    if isinstance(requires, (str, bytes)):
        raise ValueError(f"requires: expected a tuple of requirements, got the string "
                         f"{requires!r}")
    requires = tuple(requires)
    if applies is not None and not needs:
        raise ValueError("a check with applies= must say what it needs (needs=...)")
    if severity is not None:
        severity = _severity.Severity.of(severity)

    def register(func: Callable[[Any], None]) -> Callable[[Any], None]:
        name = func.__name__
        if not name.startswith("check_"):
            raise ValueError(f"check ids start with 'check_': {name}")
        _check_requirements(name, scope, requires)
        known = CATALOGUE.get(name)
        # The same function registered again is its module imported anew (pytester restores
        # sys.modules between in-process runs, importlib.reload): it replaces the old entry.
        # Another function under a taken id is a real clash.
        if known is not None and (known.func.__module__, known.func.__qualname__) != (
                func.__module__, func.__qualname__):
            raise ValueError(f"duplicate check id {name}: {func.__module__}.{func.__qualname__} "
                             f"and {known.func.__module__}.{known.func.__qualname__}")
        CATALOGUE[name] = CheckInfo(name, func, section, scope, tuple(strategies), applies,
                                    first_sentence(func.__doc__ or ""),
                                    needs or _traits.needs_of(requires), requires, severity,
                                    shares)
        _severity.declare(name, severity)
        return func

    return register


def _check_requirements(name: str, scope: str, requires: tuple[str, ...]) -> None:
    """Reject, naming the check, a requirement that is not one (an unknown trait, bad syntax) and
    a requirement of a global check (it has no pipeline)."""
    if requires and scope != "spec":
        raise ValueError(f"{name}: requires= is for spec checks; a {scope} check has no "
                         "pipeline to require anything of")
    for text in requires:
        try:
            _traits.parse(text)
        except (ValueError, TypeError) as exc:
            trait = _traits.name_in(text)
            hint = closest(trait, _traits.TRAITS) if trait and trait not in _traits.TRAITS else ""
            raise ValueError(f"{name}: {exc}{hint}") from None


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring, its lines joined (a check's contract line): up to the
    first period followed by a space or the end, or the first paragraph."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    match = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


def applicability(info: CheckInfo, spec: Any, strategy: str,
                  traits_of: Callable[[Any, str], Any] | None = None) -> str | None:
    """None when ``info`` applies to ``spec`` under ``strategy``; else the reason it does not.

    ``info.requires`` is judged on ``traits_of(spec, strategy)`` (the runner passes
    ``checks._traits.traits_of``, the record computed once per spec and strategy), then
    ``info.applies``, if any, is asked."""
    if info.requires:
        if traits_of is None:
            raise TypeError(f"{info.id} requires {list(info.requires)}: applicability() needs "
                            "traits_of")
        reason = _traits.unmet(traits_of(spec, strategy), info.requires, info.needs)
        if reason is not None:
            return reason
    if info.applies is None:
        return None
    verdict = info.applies(spec, strategy)
    if verdict:
        return None
    reason = getattr(verdict, "reason", "") or f"needs {info.needs}"
    return reason
