"""Mutants of the tensors that alias a block (§D): the checks they fail are in
checks/aliases.py."""

from __future__ import annotations

import dataclasses

from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing

from ._declare import LAYERWISE, backend_with, with_ring, declare


class _NameBasedRing(BlockRing):
    def __init__(self, ring_plan, *args, **kwargs):
        super().__init__(dataclasses.replace(ring_plan, aliases=()), *args, **kwargs)

    def storage_keys(self):
        return set()  # non-block state is then chosen by module, not by storage


class _NameBasedPlacement(LayerWiseOffloadBackend):
    ring_class = _NameBasedRing


declare(
    "alias_placed_as_non_block_state",
    "an alias of a block tensor gets its own device copy",
    LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=_NameBasedPlacement),
    kills={
        "check_resident_head_stays_put_unhooked_and_within_the_prediction",
        "check_block_alias_follows_its_block",
        "check_layerwise_keeps_at_most_two_blocks_resident",
        "check_peak_device_bytes_stay_within_the_plan_bound",
    },
)


class _TwoMastersRing(BlockRing):
    def __init__(self, ring_plan, *args, **kwargs):
        super().__init__(dataclasses.replace(ring_plan, shared=()), *args, **kwargs)


declare(
    "tied_parameter_two_masters", "a weight shared by two blocks streams with each", LAYERWISE,
    make_backend=backend_with(LayerWiseOffloadBackend=with_ring(_TwoMastersRing)),
    kills={"check_parameter_shared_by_two_blocks_is_never_copied_twice"},
)
