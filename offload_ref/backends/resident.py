"""The "none" choice of ``strategy="auto"``: every weight resident on the device.

Auto mode picks it when the whole pipeline fits the budget.  Unlike ``OffloadStrategy.NONE``
asked for explicitly (no backend at all: the caller places the pipeline), this backend places
every tensor of the pipeline on the device as one resident group, counts it in ``stats()``, and
``disable`` rebuilds every tensor at its original placement (Note [Original placement] in
groups.py), as the other backends do with their resident state.  Components the pipeline manages
itself (``OffloadPlan.on_demand_component_paths``) are left to it.
"""

from __future__ import annotations

from typing import Any

from ..config import OffloadStrategy
from ..plan import OffloadPlan, ResolvedOffloadPlan, resident_plan, resident_state
from ..discovery import get_submodule_path
from .base import OffloadBackend
from .groups import ComponentSwapper
from .transaction import Transaction

__all__ = ["ResidentBackend"]


class ResidentBackend(OffloadBackend):
    """Everything resident on the device (auto mode's "none"); see the module docstring."""

    strategy = OffloadStrategy.NONE
    hook_name = "offload_ref.resident"

    def __init__(self, config, platform) -> None:
        super().__init__(config, platform)
        self._resident: ComponentSwapper | None = None

    def resolve(self, pipeline: Any) -> ResolvedOffloadPlan:
        return resident_plan(pipeline, alignment=self.platform.alignment)

    def install(self, pipeline: Any, plan: ResolvedOffloadPlan, txn: Transaction) -> None:
        declared = getattr(pipeline, "_offload_plan", None)
        managed = []
        if isinstance(declared, OffloadPlan):
            managed = [m for m in (get_submodule_path(pipeline, p)
                                   for p in declared.on_demand_component_paths)
                       if hasattr(m, "modules")]
        resident = ComponentSwapper(self.platform, self._stats)
        self._resident = resident
        resident.prepare(txn, [], [("<resident>", resident_state(pipeline, managed))], pin=False)

    def uninstall(self, pipeline: Any) -> None:
        assert self._resident is not None
        self._resident.restore()
        self.platform.synchronize()

    def _reset(self) -> None:
        self._resident = None
