"""pytest glue: one test per (check, spec, strategy), marked ``contract``."""

from __future__ import annotations

import importlib.util
import shlex
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pytest

from .case import DEFAULT_IMPLEMENTATION, Implementation
from .registry import AREAS, CheckFailure, CheckInfo, CheckNotApplicable, doc_for
from .runner import (CaseId, escaped_specs, expected_failures_for, failed_preflight,
                     message_of, offloader_ref, plan_cases, preflight_message, run_case,
                     unresolved_cases, unresolved_message)
from .spec import PipelineSpec

__all__ = ["BoundCheck", "check_params", "parametrize_with_checks"]


class BoundCheck:
    """A callable test body: runs one case and adds a reproduction line to a failure."""

    def __init__(self, info: CheckInfo, spec: PipelineSpec | None, strategy: str | None,
                 impl: Implementation, source: str | None = None) -> None:
        self.info, self.spec, self.strategy, self.impl = info, spec, strategy, impl
        self.id = CaseId(info.id, spec.name if spec else None, strategy, source,
                         offloader_ref(impl))
        #: the pytest node id of the test running this case (set by the plugin at collection)
        self.nodeid: str | None = None

    def repro(self) -> str:
        """The command that reruns exactly this case: ``offload-ref check`` when the spec's
        reference is known (a fixture, ``--offload-ref-spec REF``), else this pytest test."""
        from .runner import _is_fixture

        if self.id.source or not self.id.spec or _is_fixture(self.id.spec) or not self.nodeid:
            return self.id.repro()
        return f"python -m pytest {shlex.quote(self.nodeid)}"

    def __call__(self) -> None:
        try:
            run_case(self.info, self.spec, self.strategy, self.impl)
        except CheckNotApplicable as exc:
            pytest.skip(f"not applicable: {exc}")
        except CheckFailure as exc:
            raise CheckFailure(
                f"[{self.id.check}] on {self.id.spec or '-'} / {self.id.strategy or '-'} "
                f"(§{self.info.section} {AREAS.get(self.info.area, '')}; "
                f"{doc_for(self.info.section)}): {message_of(exc)}\n  reproduce: {self.repro()}"
            ) from None

    def report_fields(self) -> dict[str, Any]:
        """What the plugin's summary matrix needs of this case (JSON-able: it travels from
        pytest-xdist workers inside ``user_properties``)."""
        return {"check": self.info.id, "section": self.info.section, "pipeline": self.id.spec,
                "strategy": self.id.strategy, "repro": self.repro(),
                "title": self.info.title}

    def __repr__(self) -> str:
        return str(self.id)


class _PlanningError(BoundCheck):
    """A case whose ``applies`` raised: the test fails with that message (collection goes on)."""

    def __init__(self, bound: BoundCheck, message: str) -> None:
        super().__init__(bound.info, bound.spec, bound.strategy, bound.impl, bound.id.source)
        self.message = message

    def __call__(self) -> None:
        pytest.fail(f"[{self.id.check}] on {self.id.spec} / {self.id.strategy}: {self.message}",
                    pytrace=False)


class _PreflightFailure:
    """The test body of a spec that failed its preflight (or whose plan does not resolve under
    ``strategy``): fails with the problem lines."""

    def __init__(self, spec: PipelineSpec, problems: Sequence[str],
                 strategy: str | None = None) -> None:
        self.message = (preflight_message(spec, problems) if strategy is None else
                        unresolved_message(spec, strategy, problems[0]))
        self.id = CaseId("preflight", spec.name, strategy)

    def __call__(self) -> None:
        raise CheckFailure(self.message)

    def report_fields(self) -> dict[str, Any]:
        return {"check": "preflight", "section": "", "pipeline": self.id.spec,
                "strategy": self.id.strategy,
                "repro": "", "title": "the spec is usable by the kit"}

    def __repr__(self) -> str:
        return str(self.id)


def check_params(
    specs: Sequence[PipelineSpec],
    *,
    expected_failures: Mapping[str, str] | None = None,
    checks: Iterable[str] | None = None,
    strategies: Iterable[str] | None = None,
    include_global: bool = True,
    impl: Implementation = DEFAULT_IMPLEMENTATION,
    sources: Mapping[PipelineSpec, str] | None = None,
) -> list[Any]:
    """One ``pytest.param`` per planned case.  ``sources`` maps a spec to the ``offload-ref
    check`` arguments that select it (its reproduction lines use them)."""
    escaped = escaped_specs(specs)  # a SystemExit from a factory fails its preflight test
    specs = [spec for spec in specs if spec not in escaped]
    expected = expected_failures_for(specs, expected_failures)
    sources = sources or {}
    params = [pytest.param(_PreflightFailure(spec, problems), id=f"preflight-{spec.name}",
                           marks=[pytest.mark.contract])
              for spec, problems in [*((s, [line]) for s, line in escaped.items()),
                                     *failed_preflight(specs).items()]]
    params += [pytest.param(_PreflightFailure(spec, [why], strategy),
                            id=f"preflight-{spec.name}-{strategy}", marks=[pytest.mark.contract])
               for spec, strategy, why in unresolved_cases(specs, strategies)]
    for planned in plan_cases(specs, checks=checks, strategies=strategies,
                              include_global=include_global, impl=impl):
        info, spec, strategy = planned.info, planned.spec, planned.strategy
        bound = BoundCheck(info, spec, strategy, impl, sources.get(spec) if spec else None)
        marks = [pytest.mark.contract, *_process_marks(info, spec, strategy)]
        reason = expected.get(str(bound.id), expected.get(info.id))
        if planned.planning_error is not None:
            bound = _PlanningError(bound, planned.planning_error)
        elif planned.not_applicable is not None:
            # shown as a skip with its reason; an expected failure on it is not checked
            marks.append(pytest.mark.skip(reason=f"not applicable: {planned.not_applicable}"))
        elif reason:
            marks.append(pytest.mark.xfail(reason=reason, strict=True, raises=CheckFailure))
        params.append(pytest.param(bound, id=str(bound.id), marks=marks))
    return params


def parametrize_with_checks(
    specs: Sequence[PipelineSpec],
    *,
    expected_failures: Mapping[str, str] | None = None,
    checks: Iterable[str] | None = None,
    strategies: Iterable[str] | None = None,
    include_global: bool = False,
    offloader: str | Callable[..., Any] | None = None,
) -> Any:
    """Decorate a test taking ``check`` to run the kit against ``specs``::

        @parametrize_with_checks([MY_SPEC], expected_failures={"check_x": "why"})
        def test_offload_contracts(check):
            check()

    ``expected_failures`` (check id, or ``check-spec-strategy``) -> reason; strict.  An id that
    names no check and no generated case raises ``ValueError``, naming the closest id.
    ``offloader`` judges another offloader than offload-ref's backends: a ``"MODULE:ATTR"``
    reference or the factory itself (see :mod:`offload_ref.contracts.offloader`).
    """
    params = check_params(specs, expected_failures=expected_failures, checks=checks,
                          strategies=strategies, include_global=include_global,
                          impl=implementation_of(offloader))
    return pytest.mark.parametrize("check", params)


def implementation_of(offloader: str | Callable[..., Any] | None) -> Implementation:
    """offload-ref's backends (``None``), or the offloader a ``"MODULE:ATTR"`` reference or a
    factory names, validated (:class:`~.offloader.OffloaderError` otherwise)."""
    if offloader is None:
        return DEFAULT_IMPLEMENTATION
    from .offloader import load_offloader, offloader_implementation

    if isinstance(offloader, str):
        return load_offloader(offloader)
    return offloader_implementation(offloader)


def _process_marks(info: CheckInfo, spec: PipelineSpec | None,
                   strategy: str | None = None) -> list[Any]:
    """Checks that spawn ranks (CONTRACTS.md §H) are marked ``distributed``; the checks of one
    pipeline share one spawn (Note [One spawn per batch] in checks/distributed.py), so under
    pytest-xdist's ``--dist loadgroup`` they are grouped onto one worker.  Checks that share
    work (``CheckInfo.shares``) are grouped by pipeline and strategy the same way."""
    xdist = spec is not None and importlib.util.find_spec("xdist") is not None
    if info.shares and xdist and not info.section.startswith("H"):
        return [pytest.mark.xdist_group(
            name=f"offload_ref-shared-{info.shares}-{spec.name}-{strategy}")]
    if not info.section.startswith("H"):
        return []
    marks = [pytest.mark.distributed]
    if spec is not None and importlib.util.find_spec("xdist") is not None:
        marks.append(pytest.mark.xdist_group(name=f"offload_ref-distributed-{spec.name}"))
    return marks
