"""Mutants of the tensors that alias a block (§D): the checks they fail are in
checks/aliases.py."""

from __future__ import annotations

import dataclasses

from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing


class _NameBasedRing(BlockRing):
    def __init__(self, stack, *args, **kwargs):
        super().__init__(dataclasses.replace(stack, aliases=()), *args, **kwargs)

    def storage_keys(self):
        return set()  # non-block state is then chosen by module, not by storage


class _NameBasedPlacement(LayerWiseOffloadBackend):
    ring_class = _NameBasedRing


class _TwoMastersRing(BlockRing):
    def __init__(self, stack, *args, **kwargs):
        super().__init__(dataclasses.replace(stack, shared=()), *args, **kwargs)
