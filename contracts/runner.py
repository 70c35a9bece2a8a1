"""A pytest-free runner: generate (check, spec, strategy) cases, run them, return results."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offload_ref.config import OffloadStrategy

from .capabilities import inapplicable
from .case import DEFAULT_IMPLEMENTATION, CheckCase, Implementation
from .escapes import describe, is_users_interrupt, telling_interrupts_apart
from .placement import diagnose_device_error, is_device_error
from .preflight import failed_preflight, preflight, unresolved_strategies
from .severity import judge as judge_severity
from .registry import (CATALOGUE, CheckFailure, CheckInfo, CheckNotApplicable, applicability,
                       closest, strategy_names)
from .spec import PipelineSpec
from .streams import current_streams_kept, watching
from .traits import required_traits

__all__ = ["CaseId", "CheckResult", "PlannedCase", "RunObserver", "expected_failures_for",
           "failed_preflight", "iter_cases", "load_catalogue", "plan_cases", "preflight_message",
           "run_checks"]


def load_catalogue() -> dict[str, CheckInfo]:
    from . import checks  # noqa: F401  (registers every check)

    return CATALOGUE


@dataclass(frozen=True)
class CaseId:
    check: str
    spec: str | None
    strategy: str | None
    #: The ``offload-ref check`` arguments that select this spec again (``--spec my.mod:SPEC``,
    #: ``my.mod:build --inputs my.mod:inputs``, ...); None: a built-in fixture, by its name.
    source: str | None = field(default=None, compare=False)
    #: ``--offloader MODULE:ATTR`` of a foreign offloader under test; None: offload-ref's own.
    offloader: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return "-".join(p for p in (self.check, self.spec, self.strategy) if p)

    def repro(self) -> str:
        """The command that reruns exactly this case."""
        parts = ["offload-ref check"]
        if self.source:
            parts.append(self.source)
        elif self.spec:
            # an author's spec whose reference is unknown here: MODULE:ATTR is for them to fill
            parts.append(f"--pipeline {self.spec}" if _is_fixture(self.spec) else
                         f"--spec MODULE:ATTR --name {self.spec}")
        if self.check != "preflight":  # any selection of the spec reruns its preflight
            parts.append(f"--check {self.check}")
        if self.strategy:
            parts.append(f"--strategy {self.strategy}")
        if self.offloader:
            parts.append(f"--offloader {self.offloader}")
        return " ".join(parts)


def _is_fixture(name: str) -> bool:
    from offload_ref.fixtures import SPECS

    return any(spec.name == name for spec in SPECS)


@dataclass(frozen=True)
class CheckResult:
    id: CaseId
    #: "passed" | "failed" | "error" | "xfailed" | "xpassed" | "not_applicable" (the message
    #: says why: the pipeline lacks what the check needs; it ran nothing and passed nothing)
    outcome: str
    message: str = ""
    seconds: float = 0.0
    #: how bad a failure or error is (contracts/severity.py); None for any other outcome
    severity: str | None = None

    @property
    def ok(self) -> bool:
        """Nothing unexpected: passed, failed as expected, or not applicable."""
        return self.outcome in ("passed", "xfailed", "not_applicable")


@dataclass(frozen=True)
class PlannedCase:
    """A case the selection generates; ``not_applicable`` is the reason it will not run."""

    info: CheckInfo
    spec: PipelineSpec | None
    strategy: str | None
    not_applicable: str | None = None
    #: the kit could not decide whether the check applies (a probe of a trait it requires, or its
    #: ``applies``, raised): the case is reported as an error with this message, and not run
    planning_error: str | None = None


class RunObserver:
    """What :func:`run_checks` tells as it goes, before anything it starts can crash the process:
    ``offload-ref check`` writes it to a journal, so that the case a native crash killed is
    known (contracts/isolation.py).  The methods do nothing here; override the ones you need."""

    def phase(self, what: str, spec: PipelineSpec | None, strategy: str | None = None,
              check: str | None = None) -> None:
        """About to run ``spec``'s code outside a case: ``what`` is ``"preflight"`` (build and run
        it twice), ``"resolve"`` (resolve its plans) or ``"plan"`` (decide whether ``check``
        applies under ``strategy``)."""

    def planned(self, ids: Sequence[CaseId]) -> None:
        """The results about to come, in order: the preflight errors, then the cases (those in
        ``run_checks``'s ``skip`` left out)."""

    def started(self, cid: CaseId) -> None:
        """Case ``cid`` starts."""

    def result(self, result: CheckResult) -> None:
        """A result, preflight results included (``progress`` sees only the cases')."""


def plan_cases(
    specs: Sequence[PipelineSpec],
    *,
    checks: Iterable[str] | None = None,
    strategies: Iterable[str] | None = None,
    include_global: bool = True,
    impl: Implementation = DEFAULT_IMPLEMENTATION,
    observer: RunObserver | None = None,
) -> list[PlannedCase]:
    """Every case the selection generates, sorted (deterministic order for pytest-xdist), each
    with the reason it does not apply, if it does not.

    A spec check is generated only under the strategies the spec claims (``spec.strategies``):
    a spec that honestly supports model level alone gets no layerwise or distributed case, not
    even a resolution-only one, so it can be green.  Global checks need no pipeline and always
    run.  A check whose ``requires`` (judged on the spec's traits, computed once per spec and
    strategy: :func:`~.checks._traits.traits_of`) or ``applies`` does not hold for a spec is
    planned as not applicable, with the reason, so that a report shows it instead of letting it
    vanish.  A spec failing its preflight (:func:`failed_preflight`) gets no case at all (its one
    preflight result says so).
    A check that cannot judge ``impl`` (:func:`~.capabilities.inapplicable`), and a strategy
    ``impl`` does not offer, are planned as not applicable, with the reason.
    ``observer`` is told each applicability decision before it is made (it may run the spec's
    code).
    """
    catalogue = load_catalogue()
    observer = observer or RunObserver()
    from .checks._traits import traits_of  # the record the checks' `requires` are judged on

    wanted = None if checks is None else set(checks)
    if wanted is not None:
        unknown = sorted(wanted - set(catalogue))
        if unknown:
            raise KeyError(f"unknown check id(s) {unknown}; see `offload-ref check --list`")
    allowed = None if strategies is None else set(strategy_names(strategies, "strategies"))
    selected = [(info, inapplicable(info.id, info.section, impl.capabilities))
                for info in sorted(catalogue.values(), key=lambda i: i.id)
                if wanted is None or info.id in wanted]
    # Per strategy, every trait a selected check that judges ``impl`` requires: each
    # (spec, strategy) is probed once for them all, and for nothing else.
    required: dict[str, set[str]] = {}
    for info, cannot_judge in selected:
        if info.scope != "global" and not cannot_judge:
            for strategy in info.strategies:
                required.setdefault(strategy, set()).update(required_traits(info.requires))

    def traits(spec: PipelineSpec, strategy: str) -> Any:
        return traits_of(spec, strategy, required.get(strategy, ()))

    cases = []
    failed = failed_preflight(specs)  # reported once per spec by run_checks / check_params
    for info, cannot_judge in selected:
        if info.scope == "global":
            if include_global:
                cases.append(PlannedCase(info, None, None, cannot_judge))
            continue
        for spec in sorted(specs, key=lambda s: s.name):
            if spec in failed:  # its traits would build the pipeline, and crash
                continue
            for strategy in info.strategies:
                if allowed is not None and strategy not in allowed:
                    continue
                if not spec.supports(strategy):
                    continue
                not_offered = impl.unsupported(strategy)
                if cannot_judge or not_offered:
                    cases.append(PlannedCase(info, spec, strategy, cannot_judge or not_offered))
                    continue
                if strategy in unresolved_strategies(spec):
                    cases.append(PlannedCase(info, spec, strategy, (
                        f"not run: the {strategy} plan of {spec.name} does not resolve "
                        f"(preflight-{spec.name}-{strategy} says why)")))
                    continue
                observer.phase("plan", spec, strategy, info.id)
                try:
                    reason = applicability(info, spec, strategy, traits)
                except BaseException as exc:  # noqa: BLE001 - the pipeline broke the kit's probe
                    if is_users_interrupt(exc):  # Note [Escaping exceptions]
                        raise
                    raised = (f"{type(exc).__name__}: {exc}" if isinstance(exc, Exception)
                              else describe(exc))
                    cases.append(PlannedCase(info, spec, strategy, planning_error=(
                        f"deciding whether {info.id} applies to {spec.name} (it needs "
                        f"{info.needs}) raised {raised}")))
                else:
                    cases.append(PlannedCase(info, spec, strategy, reason))
    return cases


def iter_cases(
    specs: Sequence[PipelineSpec],
    *,
    checks: Iterable[str] | None = None,
    strategies: Iterable[str] | None = None,
    include_global: bool = True,
) -> list[tuple[CheckInfo, PipelineSpec | None, str | None]]:
    """The cases of :func:`plan_cases` that apply, as ``(info, spec, strategy)``."""
    return [(c.info, c.spec, c.strategy)
            for c in plan_cases(specs, checks=checks, strategies=strategies,
                                include_global=include_global)
            if c.not_applicable is None and c.planning_error is None]


def expected_failures_for(specs: Sequence[PipelineSpec],
                          expected_failures: Mapping[str, str] | None) -> dict[str, str]:
    """Validate ``expected_failures`` against ``specs`` and return it as a dict.

    Each key is a check id of the catalogue or a full case id ``check-spec-strategy`` that
    :func:`iter_cases` generates for ``specs`` (whatever checks or strategies a run selects);
    each reason is a non-empty string.  Anything else is a ``ValueError`` naming the closest id:
    a misspelled key would otherwise expect nothing, and the strict xfail it was meant to be
    would never be checked.
    """
    expected = dict(expected_failures or {})
    catalogue = load_catalogue()
    problems = []
    unknown = [k for k in expected if not (isinstance(k, str) and k in catalogue)]
    if unknown:
        # Full case ids are generated only when a key needs them (``applies`` may build pipelines).
        known = set(catalogue) | {str(CaseId(info.id, spec.name if spec else None, strategy))
                                  for info, spec, strategy in iter_cases(specs)}
        for key in unknown:
            if key not in known:
                problems.append(f"{key!r}{closest(str(key), known)}")
    empty = [k for k, why in expected.items() if not (isinstance(why, str) and why.strip())]
    if problems:
        raise ValueError(
            f"expected_failures: {'; '.join(problems)} is neither a check id of the catalogue "
            "nor a case id 'check-spec-strategy' generated for the pipeline specs "
            f"{sorted(s.name for s in specs)}; see `offload-ref check --list`")
    if empty:
        raise ValueError(f"expected_failures: the reason of {empty} must be a non-empty string")
    return expected


def unresolved_cases(specs: Sequence[PipelineSpec], strategies: Iterable[str] | None = None
                     ) -> list[tuple[PipelineSpec, str, str]]:
    """``(spec, strategy, why)`` for each strategy a spec claims (among ``strategies``) whose
    plan does not resolve (:func:`~.preflight.unresolved_strategies`)."""
    allowed = None if strategies is None else set(strategy_names(strategies, "strategies"))
    return [(spec, strategy, why) for spec in sorted(specs, key=lambda s: s.name)
            for strategy, why in unresolved_strategies(spec).items()
            if allowed is None or strategy in allowed]


def unresolved_message(spec: PipelineSpec, strategy: str, why: str) -> str:
    """The one result of a spec whose plan does not resolve under ``strategy``."""
    return (f"the {strategy} plan of {spec.name} does not resolve: {why}\nthe {strategy} checks "
            f"of {spec.name} were not run (they would all fail on this one cause)")


def preflight_message(spec: PipelineSpec, problems: Sequence[str]) -> str:
    """What a spec failing its preflight reports: its problem lines, then that its checks did not
    run."""
    return "\n".join([*problems, f"the checks of {spec.name} were not run"])


def run_case(info: CheckInfo, spec: PipelineSpec | None, strategy: str | None,
             impl: Implementation = DEFAULT_IMPLEMENTATION) -> None:
    """Run one case; raises :class:`CheckFailure` (or any error) when the contract does not hold."""
    case = CheckCase(spec, OffloadStrategy(strategy) if strategy else None, impl)
    # Note [Current device and streams between cases] in streams.py: no case changes what the
    # next one runs on
    kept = current_streams_kept()
    try:
        with kept:
            _run_watched(info, case, spec, strategy, impl)
    except BaseException as exc:
        if kept.changed:
            exc.add_note(_left_current(kept, case))
        raise
    if kept.changed:
        raise CheckFailure(_left_current(kept, case), "trace")


def _pipeline_leaves_current(case: CheckCase) -> bool | None:
    """Whether one generation of the pipeline resident, with no offloader, leaves another
    device or stream current (None: the kit cannot tell, no pipeline or the run failed)."""
    if case.spec is None:
        return None
    alone = current_streams_kept()
    try:
        with alone:
            pipeline = case.build_resident()
            import torch

            with torch.inference_mode():
                pipeline(**case.inputs())
    except Exception:  # noqa: BLE001 - then the kit says it could not tell
        return None
    return bool(alone.changed)


def _left_current(kept: Any, case: CheckCase) -> str:
    """The failure of a case that left another device or stream current, naming the party at
    fault by a run of the pipeline with no offloader."""
    alone = _pipeline_leaves_current(case)
    offloader = offloader_name(case.impl)
    if alone:
        who = ("the pipeline: one generation of it resident, with no offloader, leaves the same "
               "kind of change (a set_stream or set_device in its own code)")
    elif alone is False:
        who = (f"the offloader {offloader}: the pipeline resident, with no offloader, leaves "
               f"them as they were")
    else:
        who = (f"the offloader {offloader} or the pipeline's own code (a run of the pipeline "
               f"with no offloader could not tell which)")
    return (f"after the case, {'; '.join(kept.changed)}: work launched next (the user's, or the "
            f"next generation's) would run there. at fault: {who}. A set_stream or set_device "
            f"left unrestored is the usual cause (use the stream()/device() context managers, or "
            f"restore what was current). The kit made them current again, so later cases are "
            f"unaffected")


def _run_watched(info: CheckInfo, case: CheckCase, spec: PipelineSpec | None,
                 strategy: str | None, impl: Implementation) -> None:
    # Note [The kit's stream checking]: every case under the stream sanitizer; a race fails it
    with watching(case, offloader_name(impl)):
        try:
            info.func(case)
        except Exception as exc:
            if spec is not None and strategy is not None and is_device_error(str(exc)):
                # Once per (spec, strategy, implementation, config the check enabled with):
                # the same cause fails many checks.
                key = (spec, strategy, impl, repr(case.last_config))
                if key not in _PLACEMENT_DIAGNOSES:
                    fresh = CheckCase(spec, OffloadStrategy(strategy), impl)
                    fresh.last_config = case.last_config  # an auto budget, say
                    _PLACEMENT_DIAGNOSES[key] = diagnose_device_error(fresh)
                exc.add_note(_PLACEMENT_DIAGNOSES[key].lstrip("\n"))
            raise
        finally:
            case.close()


#: (spec, strategy, implementation, the check's config) -> the placement diagnosis of its
#: device errors.
_PLACEMENT_DIAGNOSES: dict[tuple[Any, str, Any, str], str] = {}


def offloader_ref(impl: Implementation) -> str | None:
    """What ``--offloader`` names ``impl`` by, in reproduction lines; None for offload-ref's own
    backends."""
    return None if impl.capabilities.internals else impl.name


def offloader_name(impl: Implementation) -> str:
    """How a message names the implementation under test: ``--offloader``'s reference, or
    offload-ref's backends."""
    return offloader_ref(impl) or f"offload-ref's backends ({impl.name})"


def message_of(exc: BaseException) -> str:
    """``str(exc)`` followed by the notes the kit added (a diagnosis)."""
    notes = getattr(exc, "__notes__", None) or ()
    return "\n".join([str(exc), *notes])


def _spec_escape(spec: PipelineSpec, what: str, exc: BaseException) -> str:
    """The message of a spec whose code raised a BaseException while the kit ran ``what``."""
    from .preflight import _name
    from .spec import load_object

    roles = []
    for role, ref in (("factory", spec.factory), ("inputs", spec.inputs)):
        try:
            obj = load_object(ref)
        except Exception:  # noqa: BLE001 - preflight has reported an unloadable reference
            continue
        codes = {getattr(f, "__code__", None) for f in (
            obj, getattr(obj, "__init__", None), getattr(obj, "__call__", None),
            getattr(obj, "__func__", None))} - {None}
        roles.append((role, _name(ref), codes))
    tb, by, fix = exc.__traceback__, "the pipeline's code", "the pipeline"
    while tb is not None and fix == "the pipeline":
        for role, name, codes in roles:
            if tb.tb_frame.f_code in codes:
                by, fix = f"its {role} {name}", f"the {role}"
                break
        tb = tb.tb_next
    return (f"spec {spec.name!r}: while the kit {what}, {by} raised {describe(exc)}; fix "
            f"{fix}: a spec's code returns, or raises an Exception")


_SPEC_PHASES = (("preflight", preflight,
                 "validated it (its preflight: building the pipeline and running it twice)"),
                ("resolve", unresolved_strategies, "resolved its plans"))


def escaped_specs(specs: Sequence[PipelineSpec], observer: RunObserver | None = None
                  ) -> dict[PipelineSpec, str]:
    """Run each spec's preflight and plan resolution (cached for the run that follows) and return
    the specs whose code raised a ``BaseException`` there (``SystemExit``, ``KeyboardInterrupt``
    the user did not cause, ...), each with its one problem line (Note [Escaping exceptions]):
    such a spec gets one preflight error and no case.  ``observer`` is told each phase first."""
    observer = observer or RunObserver()
    escaped: dict[PipelineSpec, str] = {}
    for what, run, doing in _SPEC_PHASES:
        for spec in specs:
            if spec in escaped:
                continue
            observer.phase(what, spec)
            try:
                run(spec)
            except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
                if is_users_interrupt(exc):
                    raise
                escaped[spec] = _spec_escape(spec, doing, exc)
    return escaped


# Note [Frozen heap]
# ~~~~~~~~~~~~~~~~~~
# Checks that read the device's allocated bytes first run ``gc.collect()`` (a tensor kept alive
# only by a reference cycle is no offloader's), several times a case.  A full collection walks
# every object the process holds: torch's and the pipelines' modules, and in a pytest session
# the items of every collected case.  Those live to the end of the run, so once the cases are
# planned the kit moves them to the permanent generation (``gc.freeze``): a collection then
# walks only what the run made since.  In this project's suite that took a collection from 64 ms
# to 8 ms and the contract gate from 400 s to 247 s.  Cyclic garbage among the frozen objects is
# not collected before the run ends (``gc.unfreeze``); objects freed by reference counting are
# freed as before.  ``gc.freeze`` does not nest, so where objects are frozen already (the
# process's own freeze, or an enclosing kit run: the pytest plugin's session, a pytester session
# inside a test) the kit changes nothing, and so never unfreezes what it did not freeze.
#
# What the run itself keeps for good is frozen too, as it goes: the freezing run (the plugin's
# session, before each test; ``run_checks``, before each case) collects and freezes again
# (:func:`refreeze_heap`), so a collection walks what the current test or case made, not what
# earlier ones left alive.  A run imports most of what it uses after its cases were planned (a
# model class of transformers or diffusers on its first build, torch's compiler on its first
# compile): in the project's suite that was 300,000 objects more, a collection took 150 ms, and
# the checks of an offloader judged through the protocol (which read device bytes most often)
# ran 5x slower late in the suite than alone (46 s against 7.5 s for one mutant).  Only what is
# alive between two tests is frozen, after a collection; what a test or case makes and drops is
# collected as before.


def freeze_heap() -> bool:
    """Collect, then freeze every object alive now (Note [Frozen heap]).  False, changing
    nothing, when objects are frozen already: whoever froze them unfreezes them."""
    if gc.get_freeze_count():
        return False
    refreeze_heap()
    return True


def refreeze_heap() -> None:
    """Collect, then freeze what is alive now, on top of what is frozen already: called by the
    run that froze the heap, between its tests or cases (Note [Frozen heap])."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def heap_frozen() -> Iterator[Callable[[], None]]:
    """The block runs with the heap frozen (:func:`freeze_heap`), unfrozen after if it froze.
    It gets the function to call between its cases: :func:`refreeze_heap` where this block
    froze the heap, else one that does nothing (the freeze is not this block's)."""
    froze = freeze_heap()
    try:
        yield refreeze_heap if froze else _leave_the_freeze
    finally:
        if froze:
            gc.unfreeze()


def _leave_the_freeze() -> None:
    """Between cases of a run that did not freeze the heap: whoever froze it refreezes it."""


def run_checks(
    specs: Sequence[PipelineSpec],
    *,
    checks: Iterable[str] | None = None,
    strategies: Iterable[str] | None = None,
    impl: Implementation = DEFAULT_IMPLEMENTATION,
    expected_failures: Mapping[str, str] | None = None,
    include_global: bool = True,
    sources: Mapping[PipelineSpec, str] | None = None,
    progress: Callable[[int, int, CheckResult], None] | None = None,
    observer: RunObserver | None = None,
    skip: Collection[str] = (),
) -> list[CheckResult]:
    """Run the catalogue against ``specs``.  ``expected_failures`` maps a check id (or a full case
    id ``check-spec-strategy``) to the reason; such cases must fail (strict).  An unknown key
    raises ``ValueError`` (:func:`expected_failures_for`).  ``sources`` maps a spec to the
    ``offload-ref check`` arguments that select it (see :attr:`CaseId.source`).  ``progress``
    is called as ``progress(done, total, result)`` after each case.

    A ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` that a spec's code raises
    is an error of the case it ran in (or of the spec's preflight), not the end of the run; only
    the user's own Ctrl-C stops it (Note [Escaping exceptions] in contracts/escapes.py).
    ``observer`` is told what is about to run (:class:`RunObserver`); a case or preflight result
    whose id (``str(CaseId)``) is in ``skip`` is neither run nor returned: ``offload-ref check``
    continues that way in a new process after a crash (contracts/isolation.py)."""
    with telling_interrupts_apart():
        return _run_checks(specs, checks, strategies, impl, expected_failures, include_global,
                           sources or {}, progress, observer or RunObserver(), set(skip))


# Note [Rank batches last]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The first case of a pipeline's section H starts its two-rank batch (Note [One spawn per batch]
# in checks/distributed.py), a second or more each, and "check_allgather_..." sorts before every
# other check: run in plan order, a run of the 13 fixtures spent its first 16 s on them (a first
# use, the 16 s after the build) with its progress at 0%.  They run after every other case, in
# plan order among themselves (a stable sort), so the progress moves from the first seconds.


def _run_checks(specs: Sequence[PipelineSpec], checks: Iterable[str] | None,
                strategies: Iterable[str] | None, impl: Implementation,
                expected_failures: Mapping[str, str] | None, include_global: bool,
                sources: Mapping[PipelineSpec, str],
                progress: Callable[[int, int, CheckResult], None] | None,
                observer: RunObserver, skip: set[str]) -> list[CheckResult]:
    escaped = escaped_specs(specs, observer)
    usable = [spec for spec in specs if spec not in escaped]
    expected = expected_failures_for(usable, expected_failures)
    results = [CheckResult(CaseId("preflight", spec.name, None, sources.get(spec)), "error",
                           preflight_message(spec, [line])) for spec, line in escaped.items()]
    results += [CheckResult(CaseId("preflight", spec.name, None, sources.get(spec)), "error",
                            preflight_message(spec, problems))
                for spec, problems in failed_preflight(usable).items()]
    results += [CheckResult(CaseId("preflight", spec.name, strategy, sources.get(spec)), "error",
                            unresolved_message(spec, strategy, why))
                for spec, strategy, why in unresolved_cases(usable, strategies)]
    results = [r for r in results if str(r.id) not in skip]
    planned = plan_cases(usable, checks=checks, strategies=strategies,
                         include_global=include_global, impl=impl, observer=observer)
    ids = [CaseId(c.info.id, c.spec.name if c.spec else None, c.strategy,
                  sources.get(c.spec) if c.spec else None, offloader_ref(impl)) for c in planned]
    todo = [(c, cid) for c, cid in zip(planned, ids) if str(cid) not in skip]
    todo.sort(key=lambda item: item[0].info.section.startswith("H"))  # Note [Rank batches last]
    observer.planned([r.id for r in results] + [cid for _, cid in todo])
    for result in results:
        observer.result(result)
    total = len(results) + len(todo)
    with heap_frozen() as between_cases:
        _run_planned(todo, results, total, impl, expected, progress, observer, between_cases)
    return results


def _run_planned(todo: list[tuple[PlannedCase, CaseId]], results: list[CheckResult], total: int,
                 impl: Implementation, expected: Mapping[str, str],
                 progress: Callable[[int, int, CheckResult], None] | None,
                 observer: RunObserver, between_cases: Callable[[], None]) -> None:
    """Run the planned cases ``todo`` in order, appending each result to ``results``;
    ``between_cases`` runs before each case that runs (Note [Frozen heap])."""
    for planned_case, cid in todo:
        info, spec, strategy = planned_case.info, planned_case.spec, planned_case.strategy
        if planned_case.planning_error is not None or planned_case.not_applicable is not None:
            results.append(
                CheckResult(cid, "error", planned_case.planning_error)
                if planned_case.planning_error is not None
                else CheckResult(cid, "not_applicable", planned_case.not_applicable))
            observer.result(results[-1])
            if progress is not None:
                progress(len(results), total, results[-1])
            continue
        xfail = expected.get(str(cid), expected.get(info.id))
        between_cases()
        observer.started(cid)
        start = time.perf_counter()
        stated = None  # the severity a CheckFailure's site gave (not the exception: its frames
        # hold tensors the next case's memory checks must not see)
        try:
            run_case(info, spec, strategy, impl)
        except CheckNotApplicable as exc:
            outcome, message = "not_applicable", str(exc)
        except CheckFailure as exc:
            outcome, message = (("xfailed", f"expected: {xfail}") if xfail else
                                ("failed", message_of(exc)))
            stated = getattr(exc, "severity", None)
        except Exception as exc:  # an error is a failure too, never an expected one
            tb = "".join(traceback.format_tb(exc.__traceback__)[-2:])
            outcome, message = "error", f"{type(exc).__name__}: {message_of(exc)}\n{tb}"
        except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
            if is_users_interrupt(exc):
                raise
            tb = "".join(traceback.format_tb(exc.__traceback__)[-2:])
            outcome, message = "error", f"{describe(exc, 'while this case ran')}\n{tb}"
        else:
            outcome, message = ("xpassed", f"expected to fail: {xfail}") if xfail else (
                "passed", "")
        level = judge_severity(info.id, outcome, message, stated)
        results.append(CheckResult(cid, outcome, message, time.perf_counter() - start,
                                   None if level is None else level.value))
        observer.result(results[-1])
        if progress is not None:
            progress(len(results), total, results[-1])
