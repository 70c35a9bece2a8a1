"""Offloaders judged through the public protocol alone (any offloader's route): the plain,
correct offloader of contracts/simple_offloader.py with one defect each (``BROKEN`` there holds
each one's factory and defect).  The checks they fail are mostly the ones judged from outside
(checks/observable.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import simple_offloader
from ..offloader import offloader_implementation
from ._declare import PROTOCOL, declare


def _protocol(name: str, *, kills: Iterable[str], placement_kills: Iterable[str] = ()) -> None:
    """Declare the broken simple offloader ``name`` (its defect is ``BROKEN[name]``'s)."""
    factory, defect = simple_offloader.BROKEN[name]
    impl = offloader_implementation(factory, name=f"{simple_offloader.__name__}:{name}",
                                    validate=False)
    declare(name, defect, PROTOCOL, kills=kills, placement_kills=placement_kills, impl=impl)


_protocol(
    "simple_leaves_a_hook",
    kills={
        "check_disable_removes_every_trace",
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_second_enable_changes_nothing_observable",
    },
)

_protocol(
    "simple_keeps_everything",
    kills={"check_peak_device_bytes_stay_within_the_plan_bound",
           "check_model_level_keeps_the_other_components_off_the_device_in_every_generation"},
)

_protocol(
    "simple_copies_ties_apart",
    kills={"check_shared_storage_stays_shared_while_enabled"},
)

_protocol(
    "simple_forgets_a_device",
    kills={
        "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
        "check_every_disable_restores_tensors_and_frees_the_device",
        "check_generation_after_an_interrupt_is_exact",
        "check_second_enable_changes_nothing_observable",
    },
    # A weight the broken offloader leaves on the device after disable meets host tensors in
    # the next un-offloaded generation.
    placement_kills={
        "check_enable_disable_cycles_match_the_reference",
        "check_pipeline_built_under_inference_mode_matches_reference",
    },
)

_protocol(
    "simple_first_snapshot",
    kills={
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edit_between_cycles_takes_effect_and_survives_disable",
        "check_edits_through_data_are_exact_or_refused",
    },
)

_protocol(
    "simple_no_rollback",
    kills={"check_enable_failing_part_way_leaves_the_pipeline_as_it_was"},
)

_protocol(
    "simple_stacks_hooks",
    kills={"check_second_enable_changes_nothing_observable"},
)

_protocol(
    "simple_interrupt_leak",
    kills={"check_generation_after_an_interrupt_is_exact"},
)


class _IgnoresTheDeviceIndex(simple_offloader.SimpleOffloader):
    """Moves to the bare device type it was given (``hpu``, ``cuda``), which torch takes for
    device 0: right on device 0, wrong wherever the offloader is given another index."""

    def __init__(self, device, strategy: str) -> None:
        super().__init__(device, strategy)
        self.device = torch.device(self.device.type)


def ignores_the_device_index(device, strategy: str) -> simple_offloader.SimpleOffloader:
    """``factory(device, strategy)`` of an offloader that drops the device index."""
    return _IgnoresTheDeviceIndex(device, strategy)


declare(
    "simple_ignores_the_device_index",
    "moves every tensor to the bare device type (device 0), whatever index it was given",
    dict(pipelines=("flux2",), sections=("F",), strategies=("model_level", "layer_wise")),
    kills={"check_offloader_keeps_to_the_device_index_it_was_given"},
    impl=offloader_implementation(ignores_the_device_index,
                                  name=f"{__name__}:ignores_the_device_index", validate=False),
)


class _ParkHookRemovesItself(simple_offloader.SimpleOffloader):
    """Model level by a pair of hooks per component, as many offloaders are written: the forward
    pre-hook loads the component, the forward hook parks it -- and that forward hook removes
    itself after its first call.  The first generation parks every component; from the second
    on each stays on the device once loaded (the text encoder and the DiT together: an OOM at
    the second generation of a real model)."""

    def enable(self, pipeline) -> None:
        self.parked_once: set[int] = set()
        super().enable(pipeline)

    def _enter(self, unit, args, kwargs) -> None:
        self.current = unit  # no switch: the forward hook is what parks
        super()._enter(unit, args, kwargs)

    def _leave(self, unit) -> None:
        super()._leave(unit)
        if self.strategy == "model_level" and id(unit) not in self.parked_once:
            self.parked_once.add(id(unit))
            unit.park()
            self.handles[2 * self.units.index(unit) + 1].remove()  # its own forward hook


def park_hook_removes_itself(device, strategy: str) -> simple_offloader.SimpleOffloader:
    """``factory(device, strategy)`` of an offloader whose park hook removes itself."""
    if strategy != "model_level":
        raise NotImplementedError("park_hook_removes_itself swaps whole components only")
    return _ParkHookRemovesItself(device, strategy)


declare(
    "simple_park_hook_removes_itself",
    "model level whose park (forward) hook removes itself after its first call: from the second "
    "generation on every swapped component stays on the device",
    dict(pipelines=("flux2", "wan22_t2v"), sections=("F",), strategies=("model_level",)),
    kills={"check_peak_device_bytes_stay_within_the_plan_bound",
           "check_model_level_keeps_the_other_components_off_the_device_in_every_generation"},
    impl=offloader_implementation(park_hook_removes_itself,
                                  name=f"{__name__}:park_hook_removes_itself", validate=False),
)
