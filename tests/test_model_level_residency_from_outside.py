"""Model-level residency of any offloader, judged from outside over two generations: an
offloader whose park hook (forward hook) removes itself after its first call parks every
component in the first generation and none from the second on (the text encoder and the DiT on
the device together: an OOM at the second generation of a real model).  One generation saw
nothing wrong: the peak check measured enable() through one generation, and the residency check
read offload-ref's platform only.  Now the residency check reads the tensors' devices at the end
of each swapped component's forward, in two generations, and the peak check measures two
generations; a correct foreign offloader (parking in its forward hook, or switching at the next
component's pre-hook as SimpleOffloader does) and offload-ref's own pass."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from offload_ref.contracts.mutants.protocol import park_hook_removes_itself
from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.contracts.simple_offloader import SimpleOffloader, simple_offloader
from offload_ref.fixtures import get_spec

from device_helpers import SIMULATED  # noqa: E402 (tests/ is on sys.path)

RESIDENCY = "check_model_level_keeps_the_other_components_off_the_device_in_every_generation"
PEAK = "check_peak_device_bytes_stay_within_the_plan_bound"

pytestmark = pytest.mark.skipif(not SIMULATED, reason="host and device are one: nothing an "
                                "offloader keeps on the device can be told apart")


class _ParksInItsForwardHook(SimpleOffloader):
    """Correct model level written the other common way: the forward pre-hook loads, the forward
    hook parks (SimpleOffloader parks at the next component's pre-hook instead)."""

    def _enter(self, unit: Any, args: Any, kwargs: Any) -> None:
        self.current = unit
        super()._enter(unit, args, kwargs)

    def _leave(self, unit: Any) -> None:
        super()._leave(unit)
        unit.park()


def parks_in_its_forward_hook(device: torch.device, strategy: str) -> SimpleOffloader:
    return _ParksInItsForwardHook(device, strategy)


def _run(factory: Any = None, pipelines: tuple[str, ...] = ("flux2", "wan22_t2v")
         ) -> dict[tuple[str, str], Any]:
    kwargs = {} if factory is None else {
        "impl": offloader_implementation(factory, name=f"tests:{factory.__name__}",
                                         validate=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_checks([get_spec(p) for p in pipelines], checks=[RESIDENCY, PEAK],
                             strategies=("model_level",), include_global=False, **kwargs)
    return {(r.id.check, r.id.spec): r for r in results}


def test_a_park_hook_that_removes_itself_fails_from_the_second_generation() -> None:
    results = _run(park_hook_removes_itself)
    assert len(results) == 4
    for (check, spec), r in results.items():
        assert r.outcome == "failed", (check, spec, r.outcome, r.message)
        assert r.severity == "memory"
        if check == RESIDENCY:
            assert "generation 2: " in r.message and "generation 1: " not in r.message, r.message
            assert "text_encoder" in r.message and "on hpu:" in r.message
        else:
            assert "through 2 generations" in r.message
            assert "from generation 2 on" in r.message, r.message


@pytest.mark.parametrize("factory", [None, simple_offloader, parks_in_its_forward_hook],
                         ids=["offload_ref", "simple_offloader", "parks_in_its_forward_hook"])
def test_correct_model_level_offloaders_pass(factory: Any) -> None:
    results = _run(factory)
    assert len(results) == 4
    for key, r in results.items():
        assert r.outcome == "passed", (key, r.outcome, r.message)
