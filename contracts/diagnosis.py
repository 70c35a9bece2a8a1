"""Why two outputs differ: element-level differences and a per-module rerun, on failure only.

:func:`leaf_difference` describes how two tensors differ (count, max abs diff, and the first
differing elements by their multi-dimensional indices).  :func:`diagnose` explains a parity
failure: it reruns the pipeline under test and a pipeline like the one that produced the
reference on the same inputs, both with forward hooks on every module, and names the first
module (dotted path, call number) whose output differs while every earlier module output
matched.  Under that rerun a torch function mode also watches every parameter and buffer the
compute reads: one read while the offloader had it off the device (a streamed block's placeholder
under layerwise) is named with the module that read it.

Nothing here runs unless a comparison has already failed: the passing path pays nothing.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .outputs import leaves
from .placement import (Owners, PlacementWatch, Read, _storage_key, cached_tensors, named_modules,
                        watching)

__all__ = ["Run", "diagnose", "leaf_difference", "named_modules", "nan_where_reference_has_none"]

#: How many differing elements a message lists.
SHOWN = 5


# -- element-level differences ----------------------------------------------------------------


def _same(g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Element-wise bitwise-style equality, NaN equal to NaN."""
    eq = g == w
    if g.dtype.is_floating_point or g.dtype.is_complex:
        eq |= g.isnan() & w.isnan()
    return eq


def tensors_equal(g: torch.Tensor, w: torch.Tensor) -> bool:
    g, w = g.detach().cpu(), w.detach().cpu()
    return bool(_same(g, w).all())


#: Significant digits that tell any two distinct values of a dtype apart.
_DIGITS = {torch.float16: 5, torch.bfloat16: 4, torch.float32: 9}


def _fmt(x: Any, dtype: torch.dtype) -> str:
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        digits = _DIGITS.get(dtype)
        return f"{x:.{digits}g}" if digits else repr(x)
    return repr(x)


def leaf_difference(got: Any, want: Any) -> str | None:
    """``None`` when ``got`` equals ``want`` (tensors bitwise, NaNs equal; other leaves ``==``),
    else what differs: type, shape/dtype, or the count of differing elements, the max abs diff
    and the first :data:`SHOWN` differing elements as ``[i, j, ...] got G, want W``."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        if type(got) is not type(want) or got != want:
            return f"is {got!r}, the reference has {want!r}"
        return None
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"is {tuple(got.shape)} {got.dtype}, the reference is "
                f"{tuple(want.shape)} {want.dtype}")
    g, w = got.detach().cpu(), want.detach().cpu()
    differs = ~_same(g, w)
    count = int(differs.sum())
    if not count:
        return None
    wide = torch.complex128 if g.dtype.is_complex else torch.float64
    diff = (g.to(wide) - w.to(wide)).abs().nan_to_num(float("inf"))
    where = differs.nonzero()[:SHOWN].tolist()
    shown = "; ".join(f"{idx} got {_fmt(g[tuple(idx)].item(), g.dtype)}, want "
                      f"{_fmt(w[tuple(idx)].item(), w.dtype)}" for idx in where)
    more = f" (and {count - len(where)} more)" if count > len(where) else ""
    return (f"{count} of {g.numel()} elements differ, max abs diff "
            f"{diff[differs].max().item():.3g}; first at {shown}{more}")


def nan_where_reference_has_none(got: Any, want: Any) -> bool:
    """Whether some tensor leaf of ``got`` is NaN where the same leaf of ``want`` is not."""
    try:
        pairs = zip(leaves(got), leaves(want))
    except TypeError:
        return False
    for (_, g), (_, w) in pairs:
        if (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.shape == w.shape
                and (g.dtype.is_floating_point or g.dtype.is_complex)):
            if bool((g.detach().cpu().isnan() & ~w.detach().cpu().isnan()).any()):
                return True
    return False


def _outputs_differ(got: Any, want: Any) -> bool:
    try:
        g, w = leaves(got), leaves(want)
    except TypeError:
        return True
    if [p for p, _ in g] != [p for p, _ in w]:
        return True
    return any(leaf_difference(a, b) is not None for (_, a), (_, b) in zip(g, w))


# -- runs ---------------------------------------------------------------------------------------


@dataclass
class Run:
    """One generation the kit ran: its output, the pipeline (weakly: a check may test that a
    pipeline is collected) and the inputs (``None``: the spec's own ``make_inputs()``)."""

    output: Any
    pipeline: Callable[[], Any] | None
    inputs: dict[str, Any] | None
    fresh: bool = False  # the case's reference: a fresh pipeline, built and run once

    @classmethod
    def of(cls, output: Any, pipeline: Any, inputs: dict[str, Any] | None,
           fresh: bool = False) -> Run:
        try:
            ref: Callable[[], Any] | None = weakref.ref(pipeline)
        except TypeError:
            ref = None
        return cls(output, ref, inputs, fresh)


def _label(path: str) -> str:
    return path or "the pipeline"


def _snapshot(value: Any) -> list[tuple[str, Any]]:
    """Leaves of ``value`` with tensors copied (later in-place updates must not change them);
    leaves the kit cannot compare become their type name."""
    out = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            out.append((path, v.detach().cpu().clone()))
        elif isinstance(v, (tuple, list)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}[{k!r}]")
        elif isinstance(v, (bool, int, float, complex, str, bytes, type(None))):
            out.append((path, v))
        else:
            out.append((path, f"<{type(v).__name__}>"))

    walk(value, "")
    return out


def _leaves_differ(got: list[tuple[str, Any]], want: list[tuple[str, Any]],
                   name: str) -> str | None:
    if [p for p, _ in got] != [p for p, _ in want]:
        return f"{name} differs in structure"
    for (path, g), (_, w) in zip(got, want):
        why = leaf_difference(g, w)
        if why is not None:
            return f"{name}{path}: {why}"
    return None


@dataclass
class _Call:
    path: str
    number: int  # 1 for the first call of this module in the run
    kind: str
    inputs: list[tuple[str, Any]]
    output: list[tuple[str, Any]] = field(default_factory=list)


def _traced_run(pipeline: Any, inputs: dict[str, Any],
                resident: Callable[[torch.Tensor], bool] | None, owners: Owners = Owners(),
                ) -> tuple[Any, list[_Call], PlacementWatch]:
    """Run ``pipeline(**inputs)`` with hooks on every module: each call's inputs and output in
    completion order (an inner module completes before its parent), and a
    :class:`~offload_ref.contracts.placement.PlacementWatch` over the run (with ``resident``:
    every off-device read of a pipeline tensor by a module's own forward or the pipeline's
    code; always: the random draws)."""
    calls: list[_Call] = []
    pending: dict[int, list[_Call]] = {}

    def on_pre(mod: nn.Module, path: str, number: int, args: Any, kwargs: Any) -> None:
        call = _Call(path, number, type(mod).__name__, _snapshot((args, kwargs)))
        pending.setdefault(id(mod), []).append(call)

    def on_post(mod: nn.Module, output: Any) -> None:
        open_calls = pending.get(id(mod))
        if open_calls:
            call = open_calls.pop()
            call.output = _snapshot(output)
            calls.append(call)

    with torch.inference_mode(), watching(pipeline, resident, owners, on_pre=on_pre,
                                          on_post=on_post) as watch:
        output = pipeline(**inputs)
    return output, calls, watch


# -- the diagnosis ------------------------------------------------------------------------------


def _describe_reads(reads: list[Read], limit: int = 4) -> str:
    parts = []
    for r in reads[:limit]:
        reader = f"{r.reader} (call {r.number})" if r.reader else "the pipeline's own code"
        parts.append(f"{r.tensor} was read by {reader} at {r.line} while it was {r.state}")
    more = f"; and {len(reads) - limit} more" if len(reads) > limit else ""
    return "; ".join(parts) + more


def diagnose(got: Run, want: Run, *, rebuild: Callable[[], Any],
             make_inputs: Callable[[], dict[str, Any]], resident: Callable[[torch.Tensor], bool],
             enabled: Callable[[Any], bool], owners: Callable[[Any], Owners]) -> str:
    """The diagnosis of a parity failure between the runs ``got`` and ``want``, as message lines.

    ``rebuild`` builds a fresh reference pipeline (used when ``want``'s pipeline is gone or was
    the case's reference), ``resident`` says whether a tensor is device storage, ``enabled``
    whether a pipeline is offloaded now, ``owners`` the offloaded components and streamed blocks
    of a pipeline."""
    pipeline = got.pipeline() if got.pipeline is not None else None
    if pipeline is None:
        return "\n  diagnosis: not run (the pipeline under test is no longer alive)"
    reference = None if want.fresh or want.pipeline is None else want.pipeline()
    rebuilt = reference is None
    try:
        if reference is None:
            reference = rebuild()
        want_inputs = want.inputs if want.inputs is not None else make_inputs()
        got_inputs = got.inputs if got.inputs is not None else make_inputs()
        want_out, want_calls, want_watch = _traced_run(reference, want_inputs, None)
        watching = enabled(pipeline)
        known = Owners()
        try:
            known = owners(pipeline)
        except Exception:  # noqa: BLE001 - only the wording depends on it
            pass
        got_out, got_calls, got_watch = _traced_run(pipeline, got_inputs,
                                                    resident if watching else None, known)
    except Exception as exc:  # noqa: BLE001 - the failure itself is already established
        return (f"\n  diagnosis: the rerun with hooks on every module raised "
                f"{type(exc).__name__}: {exc}")
    lines = []
    if _outputs_differ(want_out, want.output):
        source = "a fresh pipeline" if rebuilt else "the reference pipeline"
        return ("\n  diagnosis: not run: rerunning " + source + " did not reproduce the "
                "reference output, so a per-module comparison would compare against something "
                "else")
    if not _outputs_differ(got_out, want_out):
        if not watching:
            return ("\n  diagnosis: not run: no offload-ref backend owned the pipeline under "
                    "test when the difference was found (the check had disabled it, or a "
                    "foreign offloader offloads it, whose reads this rerun does not watch), and "
                    "the rerun matched the reference, so no module is named")
        outside = [r for r in got_watch.reads if "outside its block's call" in r.state]
        if outside:
            return ("\n  diagnosis: a rerun of the pipeline under test matched the reference, "
                    "but it read streamed block tensors outside their block's call, whose values "
                    "depend on the ring's timing: " + _describe_reads(outside) + ". Fix: read a "
                    "block's weights only inside its forward (call the block, or compute what "
                    "you need from it inside it)")
        return ("\n  diagnosis: a rerun of the pipeline under test with hooks on every module "
                "matched the reference: the difference did not reproduce (timing-dependent, or "
                "state the first run left behind), so no module is named")
    text, first = _first_divergence(got_calls, want_calls)
    lines.append(text)
    lines += _placement_lines(pipeline, got_watch, want_watch)
    reads = got_watch.reads
    # The reads of the first diverging call (and the modules inside it) come first.
    reads.sort(key=lambda r: 0 if first is not None and r.number and (r.reader, r.number) == first
               else 1)
    nan = nan_where_reference_has_none(got_out, want_out) or nan_where_reference_has_none(
        got.output, want.output)
    if watching and reads and nan:
        lines.append("NaN under offloading where the reference has none; tensors read outside "
                     "their block: " + _describe_reads(reads))
    elif nan:
        lines.append("NaN under offloading where the reference has none; no pipeline tensor "
                     "was read while off the device" if watching else
                     "NaN under offloading where the reference has none")
    return "".join(f"\n  diagnosis: {line}" for line in lines)


def _placement_lines(pipeline: Any, got: PlacementWatch, want: PlacementWatch) -> list[str]:
    """Placement causes of a difference that raised nothing: a random draw from a generator on
    another device than the reference's, and tensors kept on modules that view storage the
    offloader manages (a ring slot, a component's device copy)."""
    lines = []
    for g, w in zip(got.draws, want.draws):
        if (g.generator, g.device) != (w.generator, w.device):
            def gen(d: Any) -> str:
                return "the default generator" if d.generator is None else \
                    f"a generator on {d.generator}"
            text = (f"placement: the random draw {g.what} at {g.line} used {gen(g)} (result on "
                    f"{g.device}) in the run under test, but {gen(w)} (result on {w.device}) in the "
                    "un-offloaded reference: the noise depends on where the weights are")
            if got.device_reads:
                r = got.device_reads[0]
                text += (f"; the device came from {r.line}, which read {r.tensor}.device -> "
                         f"{r.device} ({r.state})")
            lines.append(text + ". Fix: draw noise from a host generator "
                         "(torch.Generator(\"cpu\").manual_seed(seed)) and move it to the "
                         "execution device (offload_ref.execution_device(pipeline))")
            break
    for path, t in cached_tensors(pipeline):
        key = _storage_key(t)
        if id(t) in got.tensors or key is None or key not in got.storages:
            continue
        holder = path.rsplit(".", 1)[0]
        inside = [p for p, (offset, numel) in got.storages[key].items()
                  if offset <= t.storage_offset() < offset + max(numel, 1)]
        viewed = max(inside or list(got.storages[key]),
                     key=lambda p: len(os.path.commonprefix([p, holder])))
        def owner(p: str) -> str:
            return got.owners.block(p) or p.rsplit(".", 1)[0]
        others = sorted({owner(p) for p in inside} - {owner(viewed)})
        also = (f" (the same device memory also held {', '.join(others[:3])} during the run)"
                if others else "")
        lines.append(f"placement: {path} is a tensor kept on a module across calls, a view of "
                     f"the device storage {viewed} was bound to during a call{also}: the "
                     "offloader reuses that memory for other weights (a ring slot) or frees it "
                     "after the call, so later calls read whatever it holds then. Fix: do not "
                     "keep views of weights on a module; take them inside forward on every "
                     "call")
    return lines


def _first_divergence(got_calls: list[_Call], want_calls: list[_Call]
                      ) -> tuple[str, tuple[str, int] | None]:
    """What first differs between the two runs' module calls, and the key (path, call number)
    of the first diverging module call (None: none is named)."""
    by_key = {(c.path, c.number): c for c in want_calls}
    got_keys = {(c.path, c.number) for c in got_calls}
    for call in got_calls:
        other = by_key.get((call.path, call.number))
        if other is None:
            n = sum(1 for c in want_calls if c.path == call.path)
            return (f"{_label(call.path)} ({call.kind}) was called {call.number} time(s) or more "
                    f"under offloading but {n} time(s) in the reference: the pipeline under test "
                    "took another path before any module output differed"), None
        why = _leaves_differ(call.output, other.output, "output")
        if why is None:
            continue
        inputs = _leaves_differ(call.inputs, other.inputs, "(args, kwargs)")
        status = ("its inputs were equal to the reference's, so the difference arises inside it"
                  if inputs is None else
                  f"its inputs were already different ({inputs}): they come from code outside "
                  "any module forward, or from a tensor read directly")
        return (f"first diverging module: {_label(call.path)} ({call.kind}, call {call.number}); "
                f"{status}; its {why}"), (call.path, call.number)
    for call in want_calls:
        if (call.path, call.number) not in got_keys:
            n = sum(1 for c in got_calls if c.path == call.path)
            return (f"{_label(call.path)} ({call.kind}) was called {call.number} time(s) or more "
                    f"in the reference but {n} time(s) under offloading"), None
    return ("every module output matched the reference: the difference arises in the "
            "pipeline's own code outside module forwards"), None
