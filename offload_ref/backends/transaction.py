"""The undo log of ``enable``: every mutation is a step that records its undo.

Note [Transactions]
    ``enable`` resolves the plan (pure), then prepares host masters and device copies off to the
    side, then commits (storage rebinds, hooks).  Every mutation goes through a
    :class:`Transaction` step that records its undo.  If any step raises, the undo log runs in
    reverse: every tensor is rebound to its original storage (same object, values, dtype, stride,
    sharing, device), every hook we installed is removed, every device and pinned byte we
    allocated is released, the backend is left disabled and retryable, and the error is raised
    as :class:`OffloadEnableError` chained to the cause.  The steps are enumerable (a dry run
    records their labels), which is how the conformance kit injects a fault at each one.

Note [Undo first]
    An exception can be raised at any line (tests/test_line_faults.py raises one at every line
    enable runs), so no mutation may sit on a line of its own before its undo is recorded: the
    undo is recorded first, written so that it does nothing for a mutation that has not
    happened (an allocation list that is still empty, a value set back to what it still is), or,
    where it cannot be (swapping a tensor's contents, removing a hook by name), the mutation and
    the recording share one line.  A platform allocation is counted in its ledger and returned
    on one line (``CpuPlatform.empty``), so it is either never made or received by the list its
    undo frees.

Converting inference tensors for a rebind and back is in inference.py (Note [Inference tensors]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..hooks import HookRegistry, ModelHook
from ..host import HostMaster, Layout
from ..platform import Platform
from .inference import normal_twin, swap_in
from .rebind_guard import get_data, guard_rebinds, set_data, unguard_rebinds

__all__ = ["FaultInjector", "Transaction"]

FaultInjector = Callable[[int, str], None]


class Transaction:
    """An undo log of enable's mutations; see Note [Transactions]."""

    def __init__(self, platform: Platform, registry: HookRegistry,
                 fault_injector: FaultInjector | None = None) -> None:
        self.platform = platform
        self.registry = registry
        self.fault_injector = fault_injector
        self.steps: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def step(self, label: str) -> None:
        self.steps.append(label)
        if self.fault_injector is not None:
            self.fault_injector(len(self.steps) - 1, label)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def host_master(self, label: str, layout: Layout, pin: bool) -> HostMaster:
        self.step(f"host master {label}")
        made: list[HostMaster] = []  # Note [Undo first]
        self.on_rollback(lambda: [m.release() for m in made])
        made.append(HostMaster(layout, self.platform, pin=pin))
        return made[0]

    def host_empty(self, label: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        self.step(f"host alloc {label} ({dtype}, {numel})")
        made: list[torch.Tensor] = []  # Note [Undo first]
        self.on_rollback(lambda: [self.platform.host_free(t) for t in made])
        made.append(self.platform.host_empty(numel, dtype, pin=pin))
        return made[0]

    def device_empty(self, label: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.step(f"device alloc {label} ({dtype}, {numel})")
        made: list[torch.Tensor] = []  # Note [Undo first]
        self.on_rollback(lambda: [self.platform.free(t) for t in made])
        made.append(self.platform.empty(numel, dtype))
        return made[0]

    def rebind(self, label: str, tensors: Sequence[torch.Tensor],
               new: Sequence[torch.Tensor]) -> None:
        self.step(f"rebind {label}")
        for t, n in zip(tensors, new):
            if t.is_inference():  # Note [Inference tensors] (inference.py)
                twin = normal_twin(t, n)  # after the swap it holds the original
                swap_in(label, t, twin); self.on_rollback(lambda t=t, o=twin: torch.utils.swap_tensors(t, o))  # noqa: E702,E501 (Note [Undo first])
                continue
            old = get_data(t)
            self.on_rollback(lambda t=t, old=old: set_data(t, old))  # Note [Undo first]
            set_data(t, n)

    def register_hook(self, module: nn.Module, name: str, hook: ModelHook, label: str) -> None:
        self.step(f"hook {name} on {label}")
        # One line (Note [Undo first]): the undo must not remove a hook of that name that
        # another registry installed, so it is recorded once ours is in place.
        self.registry.register_hook(module, name, hook); self.on_rollback(lambda: self.registry.remove_hook(module, name))  # noqa: E702,E501

    def add_handles(self, label: str, installs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Install torch hooks (each ``install()`` returns a removable handle) as one step."""
        self.step(f"hooks {label}")
        handles: list[Any] = []
        self.on_rollback(lambda: [h.remove() for h in handles])  # Note [Undo first]
        for install in installs:
            handles.append(install())
        return handles

    def guard_rebinds(self, named: Sequence[tuple[str, torch.Tensor]], owner: str
                      ) -> list[torch.Tensor]:
        """Note [Rebind guard] (rebind_guard.py) on every tensor the backend rebinds, as one
        step."""
        self.step(f"guard .data of {len(named)} rebound tensors")
        guarded: list[torch.Tensor] = []
        self.on_rollback(lambda: unguard_rebinds(guarded))
        guard_rebinds(named, owner, guarded)
        return guarded

    def set_attr(self, obj: Any, name: str, value: Any, label: str) -> None:
        self.step(f"set {label}.{name}")
        missing = object()
        old = obj.__dict__.get(name, missing)
        self.on_rollback(  # Note [Undo first]
            lambda: obj.__dict__.pop(name, None) if old is missing else obj.__dict__.__setitem__(
                name, old)
        )
        obj.__dict__[name] = value

    def rollback(self) -> None:
        errors = []
        undo, self._undo = self._undo, []
        for fn in reversed(undo):
            try:
                fn()
            except Exception as exc:  # undo everything we can before reporting
                errors.append(exc)
        if errors:
            raise RuntimeError(f"rollback left {len(errors)} change(s) undone: {errors}") \
                from errors[0]

    def commit(self) -> None:
        self._undo = []  # drops the references that kept the original storage alive
