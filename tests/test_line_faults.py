"""An exception at a line of ``enable()`` leaves no device byte and a retryable backend (issue 37,
item 6; Note [Undo first] in offload_ref/backends/transaction.py).

tests/line_faults.py lists every line of offload_ref that one ``enable()`` runs and raises at one
of them per trial; after each trial the backend is either disabled with nothing left on the
device, or enabled and whole (the exception came after the commit: a Ctrl-C delivered once
enable is done), and enable + a generation + disable then works on the same pipeline.  The same for
``disable()``.  The default run takes every second to sixth line (the stride in CASES; about
25 ms a line); set OFFLOAD_REF_FULL_LINE_FAULTS=1 for all of them."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from line_faults import InjectedFault, fault_at, lines_run  # noqa: E402 (tests/ is on sys.path)

FULL = os.environ.get("OFFLOAD_REF_FULL_LINE_FAULTS") == "1"

# (fixture, strategy, stride of the default run): one fixture per strategy and the split model
CASES = [("flux2", "layer_wise", 6), ("soulx_singer", "layer_wise", 6),
         ("flux2", "model_level", 3), ("cosmos3", "model_level", 2),
         ("cosmos3", "layer_wise", 6)]


def _fresh(spec, strategy: str):
    """A new platform, pipeline and backend (after a trial left the old ones unusable)."""
    platform = CpuPlatform()
    return (platform, spec.build(),
            get_offload_backend(OffloadConfig(strategy=strategy), platform=platform))


def _generate(spec, pipeline) -> None:
    with torch.inference_mode():
        pipeline(**spec.make_inputs())


@pytest.mark.parametrize("name,strategy,stride", CASES, ids=[f"{n}-{s}" for n, s, _ in CASES])
def test_an_exception_at_any_line_of_enable_leaves_nothing_behind(name, strategy, stride):
    spec = get_spec(name)
    platform, pipeline, backend = _fresh(spec, strategy)
    places = lines_run(lambda: backend.enable(pipeline))
    backend.disable()
    assert len(places) > 100 and platform.memory_allocated() == 0
    problems = []
    fired_count = 0
    for place in places[:: 1 if FULL else stride]:
        with fault_at(place, InjectedFault(f"at {place}")) as fired, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                backend.enable(pipeline)
            except BaseException as exc:  # noqa: BLE001 - every kind is a result here
                raised = exc
            else:
                raised = None
        fired_count += fired[0]
        left = platform.memory_allocated()
        if fired[0] and raised is not None and not backend.is_enabled() and left:
            problems.append(f"{place}: {left} device bytes left by a failed enable")
        try:
            backend.disable()
            assert platform.memory_allocated() == 0, \
                f"{platform.memory_allocated()} device bytes after disable"
            backend.enable(pipeline)
            _generate(spec, pipeline)
            backend.disable()
            assert platform.memory_allocated() == 0
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"{place}: not retryable: {exc!r}"[:300])
            platform.close()
            platform, pipeline, backend = _fresh(spec, strategy)
    platform.close()
    assert fired_count > 0
    assert not problems, f"{len(problems)} of {len(places[::1 if FULL else stride])} lines:\n" + \
        "\n".join(problems[:20])


@pytest.mark.parametrize("name,strategy,stride", CASES, ids=[f"{n}-{s}" for n, s, _ in CASES])
def test_an_exception_at_any_line_of_disable_leaves_a_backend_that_finishes_it(name, strategy,
                                                                               stride):
    """disable() that raised stays enabled (every step idempotent) or is done with nothing left
    on the device; either way disable() again frees everything and the pipeline generates
    offloaded again."""
    spec = get_spec(name)
    platform, pipeline, backend = _fresh(spec, strategy)
    backend.enable(pipeline)
    places = lines_run(backend.disable)
    assert len(places) > 50 and platform.memory_allocated() == 0
    problems = []
    for place in places[:: 1 if FULL else max(1, stride // 2)]:
        backend.enable(pipeline)
        _generate(spec, pipeline)
        with fault_at(place, InjectedFault(f"at {place}")) as fired, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                backend.disable()
            except BaseException as exc:  # noqa: BLE001
                raised = exc
            else:
                raised = None
        left = platform.memory_allocated()
        if fired[0] and raised is not None and not backend.is_enabled() and left:
            problems.append(f"{place}: disabled with {left} device bytes left")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                backend.disable()
            assert platform.memory_allocated() == 0, \
                f"{platform.memory_allocated()} device bytes after disable"
        except BaseException as exc:  # noqa: BLE001
            problems.append(f"{place}: not retryable: {exc!r}"[:300])
            platform.close()
            platform, pipeline, backend = _fresh(spec, strategy)
    platform.close()
    assert not problems, "\n".join(problems[:20])
