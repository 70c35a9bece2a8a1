"""Component swapping for split models (the Cosmos3 shape).

A split model runs mutually exclusive components in different phases of one forward pass (a
reasoner once per generation, a generator every denoising step).  It owns a
:class:`ComponentGroups` and wraps each phase in ``with groups.context(name):``; while enabled,
exactly the named group is device-resident and every other group lives in its host master.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
import weakref
from typing import Any

import torch
from torch import nn

from ._interrupts import deferred_interrupts, interruption_point
from .backends.call_guard import CallGuard
from .backends.groups import ComponentSwapper

__all__ = ["ComponentGroups"]


class ComponentGroups:
    """Named groups of modules of one model, at most one of which is device-resident.

    ``groups`` maps a component name to its modules; ``resident`` modules (e.g. the VAE the
    pipeline pins) are placed on the device while enabled and never swapped.

    Seams (a subclass may override):

    * :meth:`check_name` ``(name)`` -- refuse a name that is no group's (``context`` calls it
      before anything else).
    * :meth:`activated` ``(name)`` -- the context manager ``context(name)`` returns once the
      name is checked: while enabled, it enters the call guard, then calls :meth:`check_swap`
      and, out of inference mode, :meth:`swap_in`.
    * :meth:`check_swap` ``(name)`` -- the refusals before a swap (autograd, weight edits).
    * :meth:`swap_in` ``(name)`` -- the swap itself: ``name`` loaded, the other groups evicted.

    Policy classes (class attributes): :attr:`swapper_class`, the
    :class:`~offload_ref.backends.groups.ComponentSwapper` each enable moves the groups with;
    :attr:`call_guard_class`, the :class:`~offload_ref.backends.call_guard.CallGuard` the
    contexts of one enable enter (Note [One thread at a time] in backends/call_guard.py).
    """

    swapper_class: type[ComponentSwapper] = ComponentSwapper
    call_guard_class: type[CallGuard] = CallGuard

    def __init__(
        self,
        groups: Mapping[str, Sequence[nn.Module]],
        *,
        resident: Sequence[nn.Module] = (),
    ) -> None:
        if not groups:
            raise ValueError("ComponentGroups needs at least one named group")
        self._groups = {str(name): tuple(mods) for name, mods in groups.items()}
        self._resident = tuple(resident)
        self._swapper: Any = None  # set while enabled
        self._guarded: list[torch.Tensor] = []  # Note [Rebind guard] (backends/rebind_guard.py)
        self.stats: Any = None  # OffloadStats of the current (or last) enable
        # Note [One thread at a time] (backends/call_guard.py): the threads inside a context(),
        # one per enable.
        self._calls: Any = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def members(self, name: str) -> tuple[nn.Module, ...]:
        """The modules of group ``name``."""
        self.check_name(name)
        return self._groups[name]

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles of a disabled model are ordinary; an enabled one refuses (Note [No
        copies while enabled] in backends/refusals.py)."""
        if self.enabled:
            from .backends.refusals import refuse_copy

            refuse_copy(f"a model whose offload components {list(self._groups)} are enabled")
        return self.__dict__

    @property
    def enabled(self) -> bool:
        return self._swapper is not None

    def check_name(self, name: str) -> None:
        """Raise ValueError if ``name`` is no group's (a seam: see the class docstring)."""
        if name not in self._groups:
            raise ValueError(
                f"unknown offload component {name!r}; this model's components are "
                f"{list(self._groups)}"
            )

    def enable(
        self,
        *,
        device: Any = None,
        pin_memory: bool = True,
        platform: Any = None,
        resident: Sequence[nn.Module] = (),
    ) -> None:
        """Build a host master per group and place ``resident`` modules on the device.

        Every group starts on the host; the first ``context(name)`` loads it.  A failure rolls
        every change back (the same transaction as the model-level backend).
        """
        from .backends.base import OffloadEnableError
        from .backends.stats import OffloadStats
        from .backends.transaction import Transaction
        from .backends.wrappers import WrapperSet
        from .hooks import HookRegistry
        from .plan import named_tensors
        from .platform import get_platform

        if self._swapper is not None:
            return
        platform = platform if platform is not None else get_platform(device)
        stats = OffloadStats()
        swapper = self.swapper_class(platform, stats)
        # Note [Wrapper subclasses] (plan/tree.py): the wrappers follow every move of the groups
        swapper.wrappers = WrapperSet.of([("", m) for m in (
            *self._resident, *resident, *(m for mods in self._groups.values() for m in mods))])
        txn = Transaction(platform, HookRegistry())
        residents = [("resident", named_tensors(m)) for m in (*self._resident, *resident)]
        swappable = [
            (name, named_tensors(_Group(mods))) for name, mods in self._groups.items()
        ]
        with deferred_interrupts():  # Note [Deferred interrupts] in _interrupts.py
            guarded: list[torch.Tensor] = []
            try:
                # the last undo: after every rebind's
                txn.on_rollback(lambda: swapper.wrappers.follow(as_built=True))
                swapper.prepare(txn, swappable, residents, pin=pin_memory)
                swapper.wrappers.follow()
                # Note [Rebind guard] (backends/rebind_guard.py): an edit through .data is seen or
                # refused.
                guarded = txn.guard_rebinds(swapper.named_tensors(), type(self).__name__)
                interruption_point()  # a Ctrl-C during enable rolls it back
                platform.synchronize()
                # Enabled, then committed (one assignment), still inside the transaction: an
                # exception at any line rolls back (Note [Undo first] in backends/transaction.py).
                self._calls = self.call_guard_class(f"{type(self).__name__}{list(self._groups)}")
                self._guarded = guarded
                self.stats = stats
                # A model collected while enabled must not strand its device and host buffers.
                self._finalizer = weakref.finalize(self, swapper.release)
                self._swapper = _Active(swapper, tuple(self._groups))
                txn.commit()
            except BaseException as exc:  # KeyboardInterrupt too: nothing may stay half-applied
                self._swapper, self._guarded, self._calls = None, [], None
                finalizer = getattr(self, "_finalizer", None)
                if finalizer is not None:
                    finalizer.detach()
                try:
                    try:  # let in-flight copies land before their buffers are released
                        platform.synchronize()
                    except Exception:  # noqa: BLE001 - the original error is the one to report
                        pass
                finally:
                    txn.rollback()
                if not isinstance(exc, Exception):
                    raise
                raise OffloadEnableError(
                    f"ComponentGroups.enable failed: {exc}; every change was rolled back (enable "
                    "can be retried)") from exc

    def disable(self) -> None:
        """Rebuild every tensor at its original placement.  Idempotent."""
        with deferred_interrupts():  # Note [Deferred interrupts]: disable runs to its end
            self._disable_all()

    def _disable_all(self) -> None:
        import contextlib

        from .backends.rebind_guard import guard_rebinds, unguard_rebinds

        calls = self._calls
        # Note [One thread at a time]: wait until no other thread is inside a context(); one
        # that enters afterwards finds the groups disabled and leaves them alone.
        with calls.exclusive(close=True) if calls is not None else contextlib.nullcontext():
            self._restore(guard_rebinds, unguard_rebinds)

    def _restore(self, guard_rebinds: Any, unguard_rebinds: Any) -> None:
        active = self._swapper
        if active is None:
            return
        try:  # enabled until every step is done; each is idempotent, so a retry finishes it
            unguard_rebinds(self._guarded)
            active.swapper.restore()
        except Exception:
            unguard_rebinds(self._guarded)  # every one plain, then every one guarded again
            self._guarded = []
            guard_rebinds(active.swapper.named_tensors(), type(self).__name__, self._guarded)
            raise  # still enabled: the caller can retry
        self._finalizer.detach()
        self._guarded = []; self._swapper = None  # noqa: E702 (disabled on one line)

    def active(self) -> str | None:
        """The group currently on the device, if any."""
        if self._swapper is None:
            return None
        loaded = [n for n in self._groups if self._swapper.swapper.is_loaded(n)]
        return loaded[0] if loaded else None

    def context(self, name: str) -> AbstractContextManager[None]:
        """Make ``name`` the resident group for the duration of the block (no-op if disabled).

        An unknown name raises ValueError here, before the block is entered."""
        self.check_name(name)
        return self.activated(name)

    @contextmanager
    def activated(self, name: str) -> Iterator[None]:
        """Make the checked group ``name`` the resident one for the block (a seam: see the class
        docstring); a no-op while disabled."""
        calls = self._calls
        if self._swapper is None or calls is None:
            yield
            return
        # Note [One thread at a time] (backends/call_guard.py): the frame running the ``with``
        # (above contextlib's __enter__) stays on the stack for the whole block.  A second
        # thread gets OffloadConcurrencyError; two threads swapping at once lost a device copy.
        frame = sys._getframe(2)
        if not calls.enter(f"offload component {name!r}", frame):
            yield  # disabled meanwhile: leave the weights alone
            return
        try:
            if self._swapper is not None:
                self.check_swap(name)
                with torch.inference_mode(False):  # Note [Hooks leave inference mode]
                    self.swap_in(name)
            yield
        finally:
            calls.exit(frame)

    def check_swap(self, name: str) -> None:
        """Refuse what swapping group ``name`` in cannot honour: autograd through its weights and
        unhonoured in-place edits (Notes [Autograd], [Weight edits] in backends/refusals.py).
        Runs in the caller's grad mode, before :meth:`swap_in` (leaving inference mode turns
        grad mode on); a no-op while disabled."""
        active = self._swapper
        if active is not None:
            active.check(name)

    def swap_in(self, name: str) -> None:
        """Load group ``name`` onto the device, every other group moved to its host master first
        (the bound holds at every instant).  :meth:`activated` calls it inside the call guard and
        out of inference mode (Note [Hooks leave inference mode] in backends/layerwise.py); a
        no-op while disabled."""
        active = self._swapper
        if active is not None:
            active.activate(name)


class _Group(nn.Module):
    """A throwaway container so a group of several modules is one swappable unit."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(modules)


class _Active:
    def __init__(self, swapper: Any, names: tuple[str, ...]) -> None:
        self.swapper = swapper
        self.names = names

    def check(self, name: str) -> None:
        """Refuse autograd and unhonoured weight edits (Notes [Autograd], [Weight edits] in
        backends/refusals.py); called before leaving inference mode, which turns grad mode on."""
        from .backends.refusals import refuse_autograd

        group = self.swapper.swappable[name]
        refuse_autograd(name, [r.name for r in group.layout.records], group.tensors)
        self.swapper.check_edits(self.names)

    def activate(self, name: str) -> None:
        self.swapper.activate(name, self.names)
