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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .outputs import leaves

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


def named_modules(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """Every module of ``pipeline`` once (a module reachable at several paths: its first), with
    its dotted path (``""``: the pipeline itself when it is a module)."""
    if isinstance(pipeline, nn.Module):
        return list(pipeline.named_modules())
    out, seen = [], set()
    for name, value in vars(pipeline).items():
        if isinstance(value, nn.Module):
            for p, m in value.named_modules():
                if id(m) not in seen:
                    seen.add(id(m))
                    out.append((f"{name}.{p}" if p else name, m))
    return out


def _named_tensors(pipeline: Any) -> dict[int, str]:
    """id(parameter or buffer) -> its first dotted path in ``pipeline``."""
    out: dict[int, str] = {}
    for path, module in named_modules(pipeline):
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is not None:
                    out.setdefault(id(t), f"{path}.{name}" if path else name)
    return out


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


@dataclass
class _Read:
    tensor: str
    reader: str
    number: int


def _flatten_tensors(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flatten_tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten_tensors(v, out)


class _ReadWatch(TorchFunctionMode):
    """Records every parameter or buffer of the pipeline passed to a torch function while a
    module's own forward runs (not the offloader's hook work around it) and the platform says it
    is not device storage."""

    def __init__(self, tensors: dict[int, str], resident: Callable[[torch.Tensor], bool],
                 current: Callable[[], tuple[str, int] | None]) -> None:
        super().__init__()
        self.tensors, self.resident, self.current = tensors, resident, current
        self.reads: list[_Read] = []
        self._seen: set[tuple[str, str, int]] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = self.current()
        if where is not None and getattr(func, "__name__", "") not in ("__get__", "__set__"):
            found: list[torch.Tensor] = []
            _flatten_tensors(args, found)
            _flatten_tensors(kwargs, found)
            for t in found:
                path = self.tensors.get(id(t))
                if path is not None and t.numel() and not self.resident(t):
                    key = (path, where[0], where[1])
                    if key not in self._seen:
                        self._seen.add(key)
                        self.reads.append(_Read(path, where[0], where[1]))
        return func(*args, **kwargs)


def _traced_run(pipeline: Any, inputs: dict[str, Any],
                resident: Callable[[torch.Tensor], bool] | None) -> tuple[Any, list[_Call],
                                                                          list[_Read]]:
    """Run ``pipeline(**inputs)`` with hooks on every module: each call's inputs and output in
    completion order (an inner module completes before its parent), and, with ``resident``,
    every off-device read of a pipeline tensor by a module's own forward."""
    modules = named_modules(pipeline)
    calls: list[_Call] = []
    counts: dict[str, int] = {}
    # A module's window is open from our pre-hook (after the offloader's) to our first post-hook
    # (before the offloader's): the offloader's own hook work is outside every window.
    stack: list[tuple[str, int] | None] = [None]
    pending: dict[int, list[_Call]] = {}
    handles = []

    def enter_call(mod, args, kwargs):
        stack.append(None)  # the offloader's pre-hooks run now: no module window

    def pre(mod, args, kwargs, path):
        counts[path] = counts.get(path, 0) + 1
        call = _Call(path, counts[path], type(mod).__name__, _snapshot((args, kwargs)))
        pending.setdefault(id(mod), []).append(call)
        stack[-1] = (path, counts[path])

    def post(mod, args, kwargs, output):
        open_calls = pending.get(id(mod))
        if open_calls:
            call = open_calls.pop()
            call.output = _snapshot(output)
            calls.append(call)
        stack[-1] = None  # the offloader's post-hooks run next

    def leave_call(mod, args, kwargs, output):
        if len(stack) > 1:
            stack.pop()

    for path, module in modules:
        handles.append(module.register_forward_pre_hook(enter_call, prepend=True,
                                                        with_kwargs=True))
        handles.append(module.register_forward_pre_hook(
            lambda m, a, k, path=path: pre(m, a, k, path), with_kwargs=True))
        handles.append(module.register_forward_hook(post, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(leave_call, with_kwargs=True,
                                                    always_call=True))
    watch = None
    try:
        with torch.inference_mode():
            if resident is not None:
                watch = _ReadWatch(_named_tensors(pipeline), resident,
                                   lambda: stack[-1] if len(stack) > 1 else ("", 0))
                with watch:
                    output = pipeline(**inputs)
            else:
                output = pipeline(**inputs)
    finally:
        for h in handles:
            h.remove()
    return output, calls, (watch.reads if watch is not None else [])


# -- the diagnosis ------------------------------------------------------------------------------


def _block_of(path: str, blocks: list[str]) -> str | None:
    for b in blocks:
        if path.startswith(b + "."):
            return b
    return None


def _describe_reads(reads: list[_Read], blocks: list[str], limit: int = 4) -> str:
    parts = []
    for r in reads[:limit]:
        reader = f"{_label(r.reader)} (call {r.number})" if r.number else "the pipeline's own code"
        block = _block_of(r.tensor, blocks)
        if block is not None:
            parts.append(f"{r.tensor} was read by {reader} while its block {block} was not "
                         f"loaded (a placeholder, not device storage)")
        else:
            parts.append(f"{r.tensor} was read by {reader} while it was not on the device")
    more = f"; and {len(reads) - limit} more" if len(reads) > limit else ""
    return "; ".join(parts) + more


def diagnose(got: Run, want: Run, *, rebuild: Callable[[], Any],
             make_inputs: Callable[[], dict[str, Any]], resident: Callable[[torch.Tensor], bool],
             enabled: Callable[[Any], bool], blocks: Callable[[], list[str]]) -> str:
    """The diagnosis of a parity failure between the runs ``got`` and ``want``, as message lines.

    ``rebuild`` builds a fresh reference pipeline (used when ``want``'s pipeline is gone or was
    the case's reference), ``resident`` says whether a tensor is device storage, ``enabled``
    whether a pipeline is offloaded now, ``blocks`` the declared block paths."""
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
        want_out, want_calls, _ = _traced_run(reference, want_inputs, None)
        watching = enabled(pipeline)
        got_out, got_calls, reads = _traced_run(pipeline, got_inputs,
                                                resident if watching else None)
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
            return ("\n  diagnosis: not run: the pipeline under test was no longer offloaded "
                    "when the difference was found (the check had disabled it), and a rerun "
                    "without offload matched the reference, so no module is named")
        return ("\n  diagnosis: a rerun of the pipeline under test with hooks on every module "
                "matched the reference: the difference did not reproduce (timing-dependent, or "
                "state the first run left behind), so no module is named")
    text, first = _first_divergence(got_calls, want_calls)
    lines.append(text)
    # The reads of the first diverging call (and the modules inside it) come first.
    reads.sort(key=lambda r: 0 if first is not None and r.number and (r.reader, r.number) == first
               else 1)
    nan = nan_where_reference_has_none(got_out, want_out) or nan_where_reference_has_none(
        got.output, want.output)
    if watching and reads and nan:
        names = []
        try:
            names = blocks()
        except Exception:  # noqa: BLE001 - only the wording depends on it
            pass
        lines.append("NaN under offloading where the reference has none; tensors read outside "
                     "their block: " + _describe_reads(reads, names))
    elif nan:
        lines.append("NaN under offloading where the reference has none; no pipeline tensor "
                     "was read while off the device" if watching else
                     "NaN under offloading where the reference has none")
    return "".join(f"\n  diagnosis: {line}" for line in lines)


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
