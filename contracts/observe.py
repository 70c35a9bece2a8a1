"""Watching a pipeline while it runs: observer hooks, copy-direction spying, residency probes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from offload_ref.hooks import after_offload

from .diagnosis import leaf_difference
from .outputs import leaves
from .registry import fail

__all__ = [
    "CopySpy",
    "compare_outputs",
    "calls_in_a_fresh_generation",
    "observe",
    "output_mismatch",
    "resident_fraction",
    "tensors_of",
]


def calls_in_a_fresh_generation(
        case: Any, select: Callable[[Any], Sequence[tuple[str, nn.Module]]]) -> list[str]:
    """The calls, in order, of the modules ``select(pipeline)`` names (``(path, module)``) in a
    fresh pipeline of ``case`` during one generation, not offloaded (on the host); the run is
    forgotten (it is no output a diagnosis reruns)."""
    fresh = case.build()
    with observe(select(fresh)) as calls:
        case.run(fresh)
    case.forget_runs()
    return calls


def tensors_of(module: Any) -> list[torch.Tensor]:
    """The distinct non-empty tensors of a module (or of a plain-object pipeline's modules), a
    wrapper subclass by its inner tensors (:func:`.facts.module_tensors`)."""
    from .facts import module_tensors

    return [t for _, t in module_tensors(module) if t.numel()]


def resident_fraction(platform: Any, module: nn.Module) -> float:
    """Share of ``module``'s tensors whose storage is device storage (1.0: fully resident)."""
    ts = tensors_of(module)
    if not ts:
        return 1.0
    return sum(platform.is_resident(t) for t in ts) / len(ts)


def is_resident(platform: Any, module: nn.Module) -> bool:
    return all(platform.is_resident(t) for t in tensors_of(module))


def is_offloaded(platform: Any, module: nn.Module) -> bool:
    return not any(platform.is_resident(t) for t in tensors_of(module))


def tensor_bytes(tensors: list[torch.Tensor], alignment: int | None = None) -> int:
    """Bytes an offloader must hold for ``tensors``: per storage, the span they touch; with an
    ``alignment`` (the platform's), each span in its aligned region as the library documents it
    (a span starting ``phase = address % min(alignment, 64)`` bytes past an ``alignment``
    boundary takes ``round_up(phase + span, alignment)`` bytes).

    Computed here, not with the library's helper: the kit's expectations stay an independent
    oracle for the bytes the backends report.  A wrapper subclass counts its inner tensors'
    bytes (Note [Wrapper subclasses] in offload_ref/plan/tree.py)."""
    from .facts import leaves_of

    spans: dict[int, list[int]] = {}
    for t in (leaf for t in tensors for leaf in leaves_of(t)):
        if not t.numel():
            continue
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        key = t.untyped_storage().data_ptr()
        span = spans.setdefault(key, [lo, hi, t.element_size()])
        span[0], span[1] = min(span[0], lo), max(span[1], hi)
    total = 0
    for key, (lo, hi, size) in spans.items():
        nbytes = (hi - lo) * size
        if alignment:
            phase = (key + lo * size) % min(alignment, 64)
            nbytes = -(-(phase + nbytes) // alignment) * alignment
        total += nbytes
    return total


def module_bytes(module: nn.Module, alignment: int | None = None) -> int:
    return tensor_bytes(tensors_of(module), alignment)


@contextmanager
def observe(
    modules: Sequence[tuple[str, nn.Module]],
    before: Callable[[str, nn.Module], None] | None = None,
    after: Callable[[str, nn.Module], None] | None = None,
) -> Iterator[list[str]]:
    """Call ``before(path, module)`` / ``after(...)`` around each forward of ``modules``.

    Installed after the offloader's hooks, so ``before`` sees the state the offloader prepared
    for the forward, and ``after`` the state it left.  Yields the list of observed calls.
    """
    calls: list[str] = []
    handles = []
    refused: dict[int, str] = {}  # modules that refuse hooks: watched through global hooks

    def pre(mod: nn.Module, args: Any, path: str) -> None:
        calls.append(path)
        if before is not None:
            before(path, mod)

    try:
        for path, module in modules:
            try:
                handles.append(module.register_forward_pre_hook(
                    lambda mod, args, path=path: pre(mod, args, path)))
                if after is not None:  # after the offloader's post-hook, whenever registered
                    handles.append(module.register_forward_hook(after_offload(
                        lambda mod, args, out, path=path: after(path, mod))))
            except Exception:  # noqa: BLE001 - a module that refuses hooks (compiled, scripted)
                refused[id(module)] = path
        if refused:
            # The offloader cannot hook such a module either, so running before its own hooks
            # (which is where global hooks run) observes the same state.
            handles.append(nn.modules.module.register_module_forward_pre_hook(
                lambda mod, args: pre(mod, args, refused[id(mod)]) if id(mod) in refused
                else None))
            if after is not None:
                handles.append(nn.modules.module.register_module_forward_hook(
                    lambda mod, args, out: after(refused[id(mod)], mod) if id(mod) in refused
                    else None))
        yield calls
    finally:
        for h in handles:
            h.remove()


class CopySpy:
    """A platform proxy that records the direction and size of every ``copy_``."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform
        self.copies: list[tuple[str, int]] = []  # ("h2d" | "d2h" | "d2d" | "h2h", bytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        from .facts import leaves_of, resident

        d, s = resident(self._platform, dst), resident(self._platform, src)
        kind = {(True, False): "h2d", (False, True): "d2h", (True, True): "d2d",
                (False, False): "h2h"}[(d, s)]
        self.copies.append((kind, sum(t.numel() * t.element_size() for t in leaves_of(dst))))
        self._platform.copy_(dst, src)

    def bytes(self, kind: str) -> int:
        return sum(n for k, n in self.copies if k == kind)


def compare_outputs(what: str, got: Any, want: Any, *, case: Any = None,
                    reference: str = "the un-offloaded reference") -> None:
    """Bitwise equality (NaNs equal), leaf by leaf (:mod:`offload_ref.contracts.outputs`), with a
    message naming the path of the first differing leaf, how many elements differ, the max abs
    diff and the first differing elements by index.  With ``case`` (a :class:`CheckCase` whose
    :meth:`~CheckCase.run` produced both outputs), a mismatch also gets the case's diagnosis
    (:mod:`offload_ref.contracts.diagnosis`); nothing of it runs when the outputs are equal.
    ``reference`` is what the message calls ``want``.  A mismatch is ``wrong output`` in any
    check (:mod:`.severity`)."""
    message = output_mismatch(what, got, want, reference)
    if message is None:
        return
    if case is not None:
        message += case.diagnose(got, want)
    fail(message, severity="wrong output")  # whatever the check's default (a trace, say)


def output_mismatch(what: str, got: Any, want: Any,
                    reference: str = "the un-offloaded reference") -> str | None:
    """The message :func:`compare_outputs` fails with (the first line and the differing
    elements, no diagnosis), or None when ``got`` equals ``want`` bitwise."""
    want_leaves, got_leaves = leaves(want), leaves(got)
    want_paths = [p for p, _ in want_leaves]
    got_paths = [p for p, _ in got_leaves]
    if want_paths != got_paths:
        missing = [p for p in want_paths if p not in got_paths]
        extra = [p for p in got_paths if p not in want_paths]
        return (f"{what}: output structure differs from {reference} (missing {missing[:4]}, "
                f"unexpected {extra[:4]})")
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        why = leaf_difference(g, w)
        if why is None:
            continue
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and (
                g.shape == w.shape and g.dtype == w.dtype):
            return f"{what}: {path} differs from {reference}: {why}"
        return f"{what}: {path} {why}"
    return None
