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
from .inference import _swap_to_normal
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
        master = HostMaster(layout, self.platform, pin=pin)
        self.on_rollback(master.release)
        return master

    def host_empty(self, label: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        self.step(f"host alloc {label} ({dtype}, {numel})")
        t = self.platform.host_empty(numel, dtype, pin=pin)
        self.on_rollback(lambda: self.platform.host_free(t))
        return t

    def device_empty(self, label: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.step(f"device alloc {label} ({dtype}, {numel})")
        t = self.platform.empty(numel, dtype)
        self.on_rollback(lambda: self.platform.free(t))
        return t

    def rebind(self, label: str, tensors: Sequence[torch.Tensor],
               new: Sequence[torch.Tensor]) -> None:
        self.step(f"rebind {label}")
        for t, n in zip(tensors, new):
            if t.is_inference():  # Note [Inference tensors] (inference.py)
                original = _swap_to_normal(label, t, n)
                self.on_rollback(lambda t=t, o=original: torch.utils.swap_tensors(t, o))
                continue
            old = get_data(t)
            set_data(t, n)
            self.on_rollback(lambda t=t, old=old: set_data(t, old))

    def register_hook(self, module: nn.Module, name: str, hook: ModelHook, label: str) -> None:
        self.step(f"hook {name} on {label}")
        self.registry.register_hook(module, name, hook)
        self.on_rollback(lambda: self.registry.remove_hook(module, name))

    def add_handles(self, label: str, installs: Sequence[Callable[[], Any]]) -> list[Any]:
        """Install torch hooks (each ``install()`` returns a removable handle) as one step."""
        self.step(f"hooks {label}")
        handles = []
        for install in installs:
            handles.append(install())
            self.on_rollback(handles[-1].remove)
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
        obj.__dict__[name] = value
        self.on_rollback(
            lambda: obj.__dict__.pop(name, None) if old is missing else obj.__dict__.__setitem__(
                name, old)
        )

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
