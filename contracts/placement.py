"""Why a generation put a tensor on the wrong side of host and device: the placement diagnosis.

Where host and device differ (a GPU, or the simulated accelerator), a pipeline that takes its
device from an offloaded component, reads another component's weight, runs a component or block
around its hooks, or keeps a tensor across calls fails with torch's bare same-device error, or
(a generator on the wrong device, a view of a ring slot) with outputs that silently differ.  This
module reruns such a generation under a watch and says *why*: which tensor, which component or
block owns it, whether it was parked on the host or a placeholder at that moment, who read it
(the module, or the pipeline's own code line) and what to change.

Two entry points, both run only after something has already failed:

* :func:`diagnose_device_error` -- a case raised a device-mismatch error (:func:`is_device_error`):
  a fresh pipeline is enabled and driven through generate, generate, disable, generate, enable,
  generate under a :class:`PlacementWatch` until the error reproduces, and the watch's record of
  the failing operation is explained.
* :class:`PlacementWatch` inside the parity diagnosis (``contracts/diagnosis.py``): random draws
  whose generator device differs from the reference's, ``.device`` reads of parked weights, and
  tensors kept on modules that view offloaded storage.

The watch is a ``TorchFunctionMode`` plus hooks on every module (:class:`ModuleWindows`): it
costs a Python call per torch function, which is why the passing path never installs it.
"""

from __future__ import annotations

import os
import re
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offload_ref.plan.tree import tensor_leaves

from .blame import (Installed, hook_cause, named_modules, observe_enable, offloader_cause,
                    running_hook, where_code)

__all__ = ["ModuleWindows", "Owners", "PlacementWatch", "Read", "cached_tensors", "code_line",
           "entry_point",
           "diagnose_device_error", "is_device_error", "named_modules", "named_tensors",
           "watching"]

#: torch's messages for an operation whose tensors are on different devices (CPU kernels,
#: CUDA kernels, cuDNN and the convolution checks word it differently).
_DEVICE_ERROR = re.compile(
    r"Expected all tensors to be on the same device"
    r"|found at least two devices"
    r"|Expected .* to be on the same device"
    r"|Input and parameter tensors are not at the same device"
    r"|Expected .*device.* but got .*device"
    r"|is on .* device, but expected"
    r"|Tensor for argument #?\d* ?'?\w*'? is on (CPU|GPU|cpu|cuda)"
    r"|indices should be either on cpu or on the same device"
    r"|should be on the same device|must be on the same device|on different devices",
    re.IGNORECASE)


def is_device_error(message: str) -> bool:
    """Whether ``message`` is torch's complaint about tensors on different devices."""
    return bool(_DEVICE_ERROR.search(message))


# -- who owns what -----------------------------------------------------------------------------


def named_tensors(pipeline: Any) -> dict[int, str]:
    """id(parameter or buffer) -> its first dotted path in ``pipeline``."""
    return {id(t): name for name, t in _named_tensor_values(pipeline)}


def _named_tensor_values(pipeline: Any) -> list[tuple[str, torch.Tensor]]:
    """``(first dotted path, tensor)`` of every parameter and buffer of ``pipeline``."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for path, module in named_modules(pipeline):
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is not None:
                    out.setdefault(id(t), (f"{path}.{name}" if path else name, t))
    return list(out.values())


def _within(path: str, owner: str) -> bool:
    return path == owner or path.startswith(owner + ".")


@dataclass(frozen=True)
class Owners:
    """The offloaded components (path -> whether the strategy swaps it whole) and the streamed
    blocks of a resolved plan, for naming who owns a tensor or a module."""

    swapped: tuple[str, ...] = ()  # components parked on the host between their own forwards
    streamed: tuple[str, ...] = ()  # block paths whose tensors are placeholders between calls
    components: tuple[str, ...] = ()  # every component path of the plan
    strategy: str = ""

    @classmethod
    def of(cls, plan: Any) -> Owners:
        if plan is None:
            return cls()
        strategy = getattr(getattr(plan, "strategy", None), "value", str(plan.strategy))
        comps = tuple(c.path for c in plan.components)
        streamed = tuple(p for c in plan.components for s in c.rings
                         for p in s.streamed_paths)
        swapped = tuple(c.path for c in plan.components
                        if c.selected and not c.rings and c.role in ("dit", "encoder")
                        and not c.on_demand)
        return cls(swapped, streamed, comps, strategy)

    def component(self, path: str) -> str | None:
        return next((c for c in sorted(self.components, key=len, reverse=True)
                     if _within(path, c)), None)

    def block(self, path: str) -> str | None:
        return next((b for b in self.streamed if path.startswith(b + ".") or path == b), None)


# -- module windows -----------------------------------------------------------------------------


class ModuleWindows:
    """Hooks on every module of a pipeline that tell, at any moment of a generation, whose own
    forward is running and which modules are inside their ``__call__``.

    A module's window is open from the kit's pre-hook (registered after the offloader's) to the
    kit's first post-hook (before the offloader's): the offloader's own hook work is outside
    every window.  A module run through ``module.forward(...)`` or another method never opens a
    window, so the module around it stays current and it is not :meth:`active`."""

    def __init__(self, pipeline: Any,
                 on_pre: Callable[[nn.Module, str, int, Any, Any], None] | None = None,
                 on_post: Callable[[nn.Module, Any], None] | None = None) -> None:
        self.modules = named_modules(pipeline)
        self.path_of = {id(m): p for p, m in self.modules}
        self.counts: dict[str, int] = {}
        self._stack: list[tuple[str, int] | None] = [None]
        self._active: dict[int, int] = {}
        self._on_pre, self._on_post = on_pre, on_post
        self._handles: list[Any] = []

    def current(self) -> tuple[str, int] | None:
        """``(path, call number)`` of the module whose own forward runs now; ``("", 0)`` in the
        pipeline's own code outside every module; ``None`` inside the offloader's hooks."""
        return self._stack[-1] if len(self._stack) > 1 else ("", 0)

    def outermost_within(self, owner: str) -> str | None:
        """The outermost module now inside its call whose path lies within ``owner``: the one
        the caller called (its inner modules were called by it)."""
        for entry in self._stack:
            if entry is not None and _within(entry[0], owner):
                return entry[0]
        return None

    def active(self, module: nn.Module) -> bool:
        """Whether ``module`` is inside a ``__call__`` (its hooks ran) now."""
        return self._active.get(id(module), 0) > 0

    def __enter__(self) -> ModuleWindows:
        for path, module in self.modules:
            self._handles += [
                module.register_forward_pre_hook(self._enter_call, prepend=True,
                                                 with_kwargs=True),
                module.register_forward_pre_hook(
                    lambda m, a, k, path=path: self._pre(m, a, k, path), with_kwargs=True),
                module.register_forward_hook(self._post, prepend=True, with_kwargs=True),
                module.register_forward_hook(self._leave_call, with_kwargs=True,
                                             always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter_call(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        self._active[id(mod)] = self._active.get(id(mod), 0) + 1
        self._stack.append(None)  # the offloader's pre-hooks run now: no module window

    def _pre(self, mod: nn.Module, args: Any, kwargs: Any, path: str) -> None:
        self.counts[path] = self.counts.get(path, 0) + 1
        if self._on_pre is not None:
            self._on_pre(mod, path, self.counts[path], args, kwargs)
        self._stack[-1] = (path, self.counts[path])

    def _post(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._on_post is not None:
            self._on_post(mod, output)
        self._stack[-1] = None  # the offloader's post-hooks run next

    def _leave_call(self, mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self._active[id(mod)] = self._active.get(id(mod), 1) - 1
        if len(self._stack) > 1:
            self._stack.pop()


# -- where in the pipeline's code ---------------------------------------------------------------

_LIBRARY = ("torch", "offload_ref", "contextlib", "functools", "typing", "threading",
            "_pytest", "pluggy")


def _is_library(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__", "") or ""
    if name.startswith("offload_ref.fixtures"):
        return False  # the built-in pipelines are pipeline code
    return any(name == lib or name.startswith(lib + ".") for lib in _LIBRARY) or \
        name == __name__


def code_line(own: bool = False) -> str:
    """``file:line in function`` of the innermost frame of pipeline code on the stack; with
    ``own``, of the author's own code when there is some (not an installed library such as
    diffusers or transformers: ``self.unet.device`` reads the weight inside diffusers)."""
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame):
        frame = frame.f_back
    if frame is None:
        return "?"
    if own:
        mine = frame
        while mine is not None and (_is_library(mine) or _installed(mine)):
            if _the_kit(mine):  # the kit called the pipeline: no frame of the author's own
                mine = None
                break
            mine = mine.f_back
        if mine is not None:
            return _where(mine)
    return _where(frame)


def _the_kit(frame: FrameType) -> bool:
    """A frame of the kit (what calls the pipeline: nothing above it is pipeline code)."""
    name = frame.f_globals.get("__name__", "") or ""
    return name.startswith("offload_ref.contracts") or name.startswith("_pytest")


def _installed(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__", "") or ""
    if name.startswith("offload_ref.fixtures"):
        return False
    path = frame.f_code.co_filename
    return f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path


def _offloader_calls() -> bool:
    """Whether the torch call being watched comes from offload-ref's own code (its hooks may
    run after the kit's window hooks: a hook registered during a call comes last)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "") or ""
        if not (name == "torch" or name.startswith("torch.") or name == __name__):
            return name.startswith("offload_ref.") and not name.startswith(
                ("offload_ref.fixtures", "offload_ref.contracts"))
        frame = frame.f_back
    return False


def _where(frame: FrameType) -> str:
    return f"{where_code(frame.f_code, frame.f_lineno)} in {frame.f_code.co_name}"


def entry_point(module: nn.Module) -> tuple[str, str] | None:
    """How ``module`` was entered without its ``__call__``: the outermost method of it on the
    stack (``forward`` called directly, ``encode``, ``get_text_features``) and the line that
    called that method; None when no method of it is on the stack."""
    frame: FrameType | None = sys._getframe(1)
    frames: list[FrameType] = []
    while frame is not None:
        if frame.f_locals.get("self") is module and not _machinery(frame):
            frames.append(frame)
        frame = frame.f_back
    if not frames:
        return None
    # The outermost of its methods; a decorator's inner function (``wrapper``) is not a name
    # the caller wrote, so the outermost frame named like an attribute of the class wins.
    named = [f for f in frames if hasattr(type(module), f.f_code.co_name)]
    frame = (named or frames)[-1]
    name = frame.f_code.co_name
    caller = frame.f_back
    while caller is not None and (_is_library(caller) or caller.f_locals.get("self") is module):
        caller = caller.f_back  # past torch, offload-ref and the module's own decorators
    return name, (_where(caller) if caller is not None else "?")


def _machinery(frame: FrameType) -> bool:
    """A frame of torch's own module call (``_wrapped_call_impl``, ``_call_impl`` and its
    ``inner``): a module inside its ``__call__``, not a method the caller named."""
    return frame.f_globals.get("__name__") == "torch.nn.modules.module" and \
        frame.f_code.co_name in ("_wrapped_call_impl", "_call_impl", "inner", "__call__")


# -- what the watch records ---------------------------------------------------------------------


@dataclass
class Origin:
    """Where the pipeline made a tensor that is not one of its parameters or buffers."""

    what: str  # "torch.randn(...)", "Tensor.to(...)"
    device: str
    line: str
    generation: int
    root: Any = None  # weakref to the tensor the factory made (derived tensors share it)
    source: str | None = None  # the off-device parameter or buffer it was computed from
    state: str = ""  # what that tensor was then
    reader: tuple[str, int] = ("", 0)  # the module window that computed it


@dataclass
class Draw:
    """One random draw: which function, where, on which device, from which generator."""

    what: str
    line: str
    device: str
    generator: str | None  # the generator's device; None: the default generator


@dataclass
class Read:
    """A module's own forward (``reader``, call ``number``; ``""``: the pipeline's code) read a
    parameter or buffer while it was not device storage."""

    tensor: str
    reader: str
    number: int
    line: str
    state: str


@dataclass
class DeviceRead:
    """Pipeline code read ``.device`` of a parameter or buffer that was not on the device."""

    tensor: str
    line: str
    device: str
    state: str


@dataclass
class Failure:
    """The operation that mixed devices, and what the watch knew of each of its tensors."""

    op: str
    line: str
    reader: str  # "the pipeline's own code" or "module <path> (call n)"
    tensors: list[str]
    causes: list[str]
    generation: int


_FACTORIES = frozenset({
    "randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like", "randint_like",
    "bernoulli", "multinomial", "poisson", "zeros", "ones", "empty", "full", "arange",
    "linspace", "logspace", "eye", "tensor", "as_tensor", "zeros_like", "ones_like",
    "empty_like", "full_like", "empty_strided", "from_numpy"})
_RANDOM = frozenset({"randn", "rand", "randint", "randperm", "normal", "randn_like", "rand_like",
                     "randint_like", "bernoulli", "multinomial", "poisson", "normal_", "uniform_",
                     "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"})
_MOVES = frozenset({"to", "cuda", "cpu", "copy_"})
_DEVICE_GETTER = torch._C.TensorBase.device


def _flatten(value: Any, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flatten(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten(v, out)


def cached_tensors(pipeline: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted path, tensor)`` for every tensor kept on a module of ``pipeline`` (or on the
    pipeline object) as a plain attribute, not a registered parameter or buffer, including those
    inside a list, tuple or dict attribute."""
    holders: list[tuple[str, Any]] = list(named_modules(pipeline))
    if not isinstance(pipeline, nn.Module):
        holders.insert(0, ("", pipeline))
    # plain objects they hold (a scheduler, a cache object): one level down
    for path, holder in list(holders):
        for name, value in getattr(holder, "__dict__", {}).items():
            if not name.startswith("__") and not isinstance(value, (nn.Module, torch.Tensor)) \
                    and hasattr(value, "__dict__") and not isinstance(value, type) \
                    and type(value).__module__.split(".")[0] not in ("torch", "builtins"):
                holders.append((f"{path}.{name}" if path else name, value))
    for path, holder in holders:
        attrs = getattr(holder, "__dict__", {})
        for name, value in attrs.items():
            if name in ("_parameters", "_buffers", "_modules") or name.startswith("__"):
                continue
            base = f"{path}.{name}" if path else name
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield base, value
            elif isinstance(value, (tuple, list)):
                for i, v in enumerate(value):
                    if isinstance(v, torch.Tensor):
                        yield f"{base}[{i}]", v
            elif isinstance(value, dict):
                for k, v in value.items():
                    if isinstance(v, torch.Tensor):
                        yield f"{base}[{k!r}]", v


def _weak(t: torch.Tensor) -> Any:
    try:
        return weakref.ref(t)
    except TypeError:
        return None


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class PlacementWatch(TorchFunctionMode):
    """Watches the generations of one pipeline (use with :class:`ModuleWindows` installed):

    * every read of a parameter or buffer that is not device storage (``resident`` says), by a
      module's own forward or the pipeline's code (``reads``);
    * ``.device`` reads of such tensors by the pipeline's code (``device_reads``);
    * random draws and where the pipeline made or moved its own tensors (``draws``; origins);
    * the first operation that failed with tensors on two devices (``failure``), explained
      while the state that caused it still holds;
    * the storages the pipeline's tensors were bound to while device storage (``storages``), to
      tell later which kept tensors view offloaded storage.

    ``resident=None`` watches an un-offloaded run: only draws and origins."""

    def __init__(self, pipeline: Any, windows: ModuleWindows,
                 resident: Callable[[torch.Tensor], bool] | None, owners: Owners = Owners(),
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.pipeline, self.windows, self.resident, self.owners = pipeline, windows, resident, \
            owners
        self.device = device
        self.tensors = named_tensors(pipeline)
        self.modules = {p: m for p, m in windows.modules}
        self.generation = 0
        self.reads: list[Read] = []
        self._read_keys: set[tuple[str, str, int]] = set()
        self.device_reads: list[DeviceRead] = []
        self.draws: list[Draw] = []
        self.failure: Failure | None = None
        #: storage key -> {path: (storage offset, numel)} of the offloaded tensors bound to it
        self.storages: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}
        self._origins: dict[int, tuple[weakref.ref, Origin]] = {}
        self._cached: dict[int, str] | None = None
        #: the first error of the watch's own bookkeeping (a kit defect), if any
        self.internal_error: str | None = None
        self._added_cache: dict[int, str] | None = None
        #: whether an offloader owns the pipeline now (None: unknown, assumed)
        self.enabled: Callable[[], bool] | None = None
        #: what the offloader's enable() did, seen from outside (hooks added, tensors moved);
        #: None: not observed (the parity diagnosis)
        self.installed: Installed | None = None
        #: path -> the device of each parameter and buffer as the pipeline was built, before
        #: any enable() (its placement without offload); None: not recorded
        self.built_on: dict[str, torch.device] | None = None

    # -- the mode ---------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        where = self.windows.current()
        if name == "__get__":
            if where is not None and getattr(func, "__self__", None) is _DEVICE_GETTER and args:
                self._device_read(args[0])
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            if where is not None and isinstance(out, torch.Tensor) and args and \
                    isinstance(args[0], torch.Tensor):  # a view through a property (.T, .mT)
                attr = getattr(getattr(func, "__self__", None), "__name__", "attribute")
                self._guarded(lambda: self._note_output(f".{attr}", [args[0]], {}, out))
            return out
        if where is None or _offloader_calls():  # the offloader's own work
            return func(*args, **kwargs)
        found: list[torch.Tensor] = []
        _flatten(args, found)
        _flatten(kwargs, found)
        self._guarded(lambda: [self._note_read(t, where) for t in found])
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.failure is None and len({t.device for t in found}) > 1:
                self._guarded(lambda: setattr(self, "failure", self._explain(name, found, where)))
            raise
        self._guarded(lambda: self._note_output(name, found, kwargs, out))
        return out

    def _guarded(self, record: Callable[[], Any]) -> None:
        """Run a piece of bookkeeping; a defect in it must never change the generation (a
        TypeError raised inside ``Tensor.__add__`` would turn into NotImplemented)."""
        try:
            record()
        except Exception as exc:  # noqa: BLE001 - kept for the report
            if self.internal_error is None:
                self.internal_error = f"{type(exc).__name__}: {exc}"

    # -- recording --------------------------------------------------------------------------------

    def _state(self, path: str, t: torch.Tensor) -> str:
        """What a parameter or buffer was at this moment: on the device, a placeholder, or
        parked on the host."""
        if self.resident is None or self.resident(t):
            if self.device is not None and t.device != self.device:
                return f"on {t.device}: offload was disabled, the pipeline's own placement"
            return "on the device"
        if self._foreign():
            return (f"off the device, on {t.device}, with {self.installed.name} enabled"
                    if self.installed is not None else f"off the device, on {t.device}")
        block = self.owners.block(path)
        if block is not None:
            return f"a placeholder: block {block} was not loaded"
        comp = self.owners.component(path)
        if comp in self.owners.swapped:
            return f"parked on the host: {comp} was not loaded"
        return f"on {t.device}, not on the device"

    def _foreign(self) -> bool:
        """An offloader the kit knows from outside only (no plan of offload-ref's): where its
        tensors are is all the kit can say, not which blocks or components it swaps."""
        return self.installed is not None and not self.owners.components

    def _device_read(self, t: Any) -> None:
        path = self.tensors.get(id(t))
        if path is None or self.resident is None or self.resident(t):
            return
        line = code_line(own=True)
        if not any(r.tensor == path and r.line == line for r in self.device_reads):
            self.device_reads.append(DeviceRead(path, line, str(t.device), self._state(path, t)))

    def _note_read(self, t: torch.Tensor, where: tuple[str, int]) -> None:
        path = self.tensors.get(id(t))
        if path is None or self.resident is None:
            return
        if self.resident(t):
            block = self.owners.block(path)
            if block or self.owners.component(path) in self.owners.swapped:
                for _, leaf in tensor_leaves("", t):  # a wrapper: its inner tensors' storages
                    key = _storage_key(leaf)  # storage the offloader reuses or frees
                    if key is not None:
                        self.storages.setdefault(key, {}).setdefault(
                            path, (leaf.storage_offset(), leaf.numel()))
            module = self.modules.get(block) if block else None
            if module is not None and not self.windows.active(module) and \
                    not _within(where[0], block) and t.numel():
                # device storage now, but only by the ring's timing: a slot loaded or being
                # prefetched, which the block's hooks alone make safe to read
                self._add_read(path, where, "bound to a ring slot outside its block's call (its "
                                            "value depends on what the ring had loaded then)")
            return
        if not t.numel():
            return
        self._add_read(path, where, self._state(path, t))

    def _add_read(self, path: str, where: tuple[str, int], state: str) -> None:
        key = (path, where[0], where[1])
        if key not in self._read_keys:
            self._read_keys.add(key)
            self.reads.append(Read(path, where[0], where[1], code_line(), state))

    def _note_output(self, name: str, found: list[torch.Tensor], kwargs: dict[str, Any],
                     out: Any) -> None:
        outs: list[torch.Tensor] = []
        _flatten(out, outs)
        if not outs:
            return
        origin: Origin | None = None
        moved = name in _MOVES and not (found and outs[0].device == found[0].device)
        if name in _FACTORIES or moved:
            what = f"torch.{name}(...)" if name in _FACTORIES else f"Tensor.{name}(...)"
            origin = Origin(what, str(outs[0].device), code_line(own=True), self.generation,
                            _weak(outs[0]))
            if name in _RANDOM or "generator" in kwargs:
                gen = kwargs.get("generator")
                self.draws.append(Draw(what, origin.line, str(outs[0].device),
                                       None if gen is None else str(gen.device)))
        elif name in _RANDOM:
            gen = kwargs.get("generator")
            self.draws.append(Draw(f"Tensor.{name}(...)", code_line(), str(outs[0].device),
                                   None if gen is None else str(gen.device)))
        else:
            kept = self._kept()
            for t in found:
                path = self.tensors.get(id(t))
                if id(t) in kept:
                    origin = Origin(f"{name}(...) of {kept[id(t)]}", str(outs[0].device),
                                    code_line(), self.generation, _weak(t))
                    break
                if path is not None and self.resident is not None and not self.resident(t):
                    origin = Origin(f"{name}(...) of {path}", str(outs[0].device), code_line(),
                                    self.generation, source=path, state=self._state(path, t),
                                    reader=self.windows.current() or ("", 0))
                    break
                if path is None:
                    origin = self.origin(t)
                    if origin is not None:
                        break
        if origin is not None:
            for o in outs:
                if id(o) not in self.tensors:
                    try:
                        self._origins[id(o)] = (weakref.ref(o), origin)
                    except TypeError:
                        pass

    def begin_generation(self) -> None:
        """Count a new generation; tensors kept on modules are looked up anew."""
        self.generation += 1
        self._cached = None

    def origin(self, t: torch.Tensor) -> Origin | None:
        entry = self._origins.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1]

    # -- explaining a failure ---------------------------------------------------------------------

    def _kept(self) -> dict[int, str]:
        if self._cached is None:
            self._cached = {id(t): p for p, t in cached_tensors(self.pipeline)}
        return self._cached

    def _reader(self, where: tuple[str, int]) -> str:
        return ("the pipeline's own code" if not where[0] else
                f"module {where[0]} (call {where[1]})")

    def _explain(self, op: str, found: list[torch.Tensor], where: tuple[str, int]) -> Failure:
        line = code_line()
        kept = self._kept()
        self._added_cache = None
        described: list[str] = []
        causes: list[str] = []
        seen: set[int] = set()
        blamed: set[str] = set()
        for t in found:
            if id(t) in seen:
                continue
            seen.add(id(t))
            path = self.tensors.get(id(t))
            if path is not None:
                state = self._state(path, t)
                owner = self.owners.block(path) or self.owners.component(path) or "the pipeline"
                described.append(f"{path} ({state})" if not state.startswith("on ") else
                                 f"{path} ({state}; part of {owner})")
                if not state.startswith("on ") and owner not in blamed:
                    blamed.add(owner)
                    causes.append(self._weight_cause(path, t, where, line))
            elif id(t) in self._added():
                added = self._added()[id(t)]
                described.append(f"{added} (a parameter or buffer added after enable(), on "
                                 f"{t.device})")
                causes.append(f"{added} was added to the pipeline after enable() (an adapter "
                              f"attached while offloaded), so the offloader never placed it: it "
                              f"stays on {t.device} and meets weights on the other side. Fix: "
                              f"attach adapters inside `with backend.edit_weights(): ...`, or "
                              f"before enable()")
            elif id(t) in kept or self._kept_root(t) is not None:
                name, o = (kept[id(t)], self.origin(t)) if id(t) in kept else self._kept_root(t)
                made = (f", made by {o.what} at {o.line} in generation {o.generation}"
                        if o is not None else "")
                described.append(f"{'' if id(t) in kept else 'a tensor computed from '}{name} "
                                 f"(a tensor kept across calls as a plain attribute, on "
                                 f"{o.device if o is not None else t.device}{made})")
                if o is None or o.generation < self.generation:  # made by an earlier call
                    causes.append(self._kept_cause(name, o))
            elif (o := self.origin(t)) is not None and o.source is not None:
                described.append(f"a tensor on {t.device} computed by {o.what} at {o.line} "
                                 f"while {o.source} was {o.state}")
                causes.append(self._weight_cause(o.source, t, o.reader, o.line))
            else:
                o = self.origin(t)
                described.append(
                    f"a tensor on {t.device} made by {o.what} at {o.line}"
                    + (f" during generation {o.generation}" if o.generation > 1 else "")
                    if o is not None else f"a tensor on {t.device} (an input, or made outside "
                    "any torch call the kit saw)")
        if not causes:
            causes.append(self._input_cause(found))
        return Failure(op, line, self._reader(where), described, causes, self.generation)

    def _weight_cause(self, path: str, t: torch.Tensor, where: tuple[str, int],
                      line: str) -> str:
        name = self.installed.name if self.installed is not None else "the offloader"
        hook = running_hook(self.windows.active, self.installed)
        if hook is not None:
            state = (f"on {t.device}, not on {self.device}" if self._foreign() else
                     self._state(path, t))
            return hook_cause(hook, path, self.modules, state, name)
        if self._foreign():
            return offloader_cause(path, t, where[0], line, installed=self.installed,
                                   modules=self.modules, active=self.windows.active,
                                   entry_point=entry_point, generation=self.generation)
        reader_path = where[0]
        block = self.owners.block(path)
        if block is not None:
            module = self.modules.get(block)
            if module is not None and not self.windows.active(module):
                entry = entry_point(module)
                if entry is not None and entry[0] == "forward":
                    how = (f"{block} was run through {block}.forward(...) (called at "
                           f"{entry[1]}), which bypasses its hooks")
                elif entry is not None:
                    how = (f"{block} was run through its method {entry[0]}() (called at "
                           f"{entry[1]}), not through {block}(...)")
                elif reader_path and _within(reader_path, block):
                    return (f"{name} did not load block {block} for a call of its part "
                            f"{reader_path}: the hooks of block {block} did not run: its part "
                            f"{reader_path} was called on its own (through its __call__), "
                            f"outside a call of {block} (for example after the block loop), "
                            f"and the offloader loads the block only in the block's own hooks, "
                            f"so {path} was read as a placeholder (an offloader defect: "
                            f"offload-ref serves a part called on its own through the part's "
                            f"hooks, Note [Block parts]). Workaround in the pipeline: call the "
                            f"block itself, {block}(...), and compute with its parts only inside "
                            f"its forward")
                else:
                    how = (f"it was read by {self._reader(where)} at {line}, outside any call "
                           f"of {block}")
                return (f"the hooks of block {block} did not run: {how}. Between its calls a "
                        f"streamed block's tensors are placeholders on the host, so {path} was "
                        f"read as one. Fix: call the block itself, {block}(...), and compute "
                        "with its parts only inside its forward")
            if reader_path and _within(reader_path, block):
                return (f"block {block} was called through its hooks, yet {path} was still a "
                        f"placeholder inside its forward: the offloader did not load the block "
                        "before running it (an offloader defect, not the pipeline's)")
            return (f"{path} was read by {self._reader(where)} at {line} while block {block} "
                    f"was not loaded: a streamed block's tensors are placeholders outside its "
                    f"own forward. Fix: read them only inside {block}'s forward")
        comp = self.owners.component(path)
        module = self.modules.get(comp) if comp is not None else None
        if comp is not None and comp in self.owners.swapped:
            running = [c for c in self.owners.components if c != comp and
                       c in self.modules and self.windows.active(self.modules[c])]
            if reader_path and _within(reader_path, comp) and module is not None and \
                    not self.windows.active(module) and running:
                outer = self.windows.outermost_within(comp)
                return (f"{running[-1]} called {outer or reader_path}, a module of {comp}, from "
                        f"its own forward (through a reference it keeps): model-level offload "
                        f"loads one component at a time, so {comp} was parked on the host while "
                        f"{running[-1]} ran. Fix: do not call another component's modules from "
                        f"inside a component; compute that result in the pipeline before (and "
                        f"pass it in), or give {running[-1]} its own copy of the module")
            if reader_path and _within(reader_path, comp) and module is not None and \
                    not self.windows.active(module):
                entry = entry_point(module)
                outer = self.windows.outermost_within(comp)
                called = entry_point(self.modules[outer]) if outer in self.modules else None
                via = (f"{comp}.{entry[0]}(...) at {entry[1]}" if entry is not None else
                       f"a direct call of its submodule {outer}"
                       + (f" at {called[1]}" if called is not None else ""))
                return (f"the forward hook of {comp} never fired: it was run through {via}, "
                        f"not through {comp}(...), so model-level offload never loaded it and "
                        f"{reader_path} read {path} on the host. Fix: call the module, "
                        f"{comp}(...), or run the other entry point inside "
                        f"`with backend.use_component(\"{comp}\"):`")
            if reader_path and _within(reader_path, comp) and module is not None:
                return (f"{comp} was called through its hooks, yet {path} was still on the host "
                        f"inside its forward: the offloader did not load {comp} before running "
                        "it (an offloader defect, not the pipeline's)")
            return (f"{path} belongs to {comp}, which model-level offload keeps on the host "
                    f"except during {comp}'s own forward, and it was read by "
                    f"{self._reader(where)} at {line}. Fix: read a component's weights only "
                    f"inside its own forward (compute what others need there and return it, "
                    f"or give the reader its own copy as a registered buffer); a back "
                    f"reference to another component (object.__setattr__) reads it while it "
                    "is parked")
        return (f"{path} was on {t.device}, not on the device, when {self._reader(where)} read "
                f"it at {line}")

    def _added(self) -> dict[int, str]:
        """Parameters and buffers the pipeline holds now that it did not hold when the watch
        began (after enable()): id -> path."""
        if self._added_cache is None:
            now = named_tensors(self.pipeline)
            self._added_cache = {i: p for i, p in now.items() if i not in self.tensors}
        return self._added_cache

    def _kept_root(self, t: torch.Tensor) -> tuple[str, Origin] | None:
        """The kept attribute ``t`` was computed from (through its origin), if any."""
        o = self.origin(t)
        if o is None or o.root is None:
            return None
        root = o.root()
        name = self._kept().get(id(root)) if root is not None else None
        return (name, self.origin(root)) if name is not None else None

    def _kept_cause(self, path: str, o: Origin | None) -> str:
        holder = path.rsplit(".", 1)[0] if "." in path else ""
        on_module = isinstance(self.modules.get(holder), nn.Module) or (
            not holder and isinstance(self.pipeline, nn.Module))
        when = (f"made on {o.device} by generation {o.generation} and reused after the "
                f"placement changed" if o is not None and o.generation < self.generation else
                "made on one device and used with tensors on another")
        where = (f"a plain attribute of {holder}" if holder else "a plain attribute of the "
                 "pipeline") + (" (not a registered buffer)" if on_module else "")
        return (f"{path} is a tensor the pipeline keeps across calls as {where}, {when}; the "
                f"offloader cannot see or move it. Fix: "
                + ("register it with register_buffer(name, tensor, persistent=False) so it "
                   "moves with its module, or key the cache by device" if on_module else
                   "key the cache by device")
                + " (recompute it when its device differs from the input's)")

    def _input_cause(self, found: list[torch.Tensor]) -> str:
        """The cause when no weight was off its place and no kept tensor is to blame: a tensor
        the pipeline made or kept on the other side of the weights it met."""
        weights = [t for t in found if id(t) in self.tensors]
        others = [t for t in found if id(t) not in self.tensors]
        disabled = self.enabled is not None and not self.enabled()
        dev = self.device
        if dev is not None and disabled:
            # offload disabled: the pipeline computes where it keeps its weights without
            # offload; a device tensor made by an earlier generation (while enabled) is stale
            stale = [t for t in others if t.device == dev and (
                (o := self.origin(t)) is None or o.generation < self.generation)]
            homes = sorted({str(t.device) for t in found if t.device != dev})
            if stale and homes:
                made = [o for o in map(self.origin, stale) if o is not None]
                where = "; ".join(f"{o.what} at {o.line} in generation {o.generation}"
                                  for o in made)
                return (f"after disable() the pipeline computes on {', '.join(homes)} (where it "
                        f"keeps its weights without offload), but it used a tensor on {dev} "
                        f"({where or 'kept from an earlier call'}): a tensor kept across calls "
                        "(a cache on the pipeline, a module or a module-level object) from "
                        "while offload was enabled. Fix: key such caches by device, or clear "
                        "them when the placement changes")
        if disabled and self.built_on is not None:
            # offload disabled: every tensor should be back where the pipeline was built with
            # it; one that is not was left by the offloader (in this operation, or where the
            # pipeline took a device from)
            left = [(name, t.device) for name, t in _named_tensor_values(self.pipeline)
                    if self.built_on.get(name, t.device) != t.device]
            if left:
                name, where = left[0]
                more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
                return (f"after disable() {name}{more} is on {where}, but the pipeline was "
                        f"built with it on {self.built_on[name]} (its placement without "
                        f"offload): disable() did not put it back, and this operation met it "
                        f"or a tensor the pipeline placed by it. At fault: the offloader. "
                        "Fix: disable() restores every tensor it moved to where it found it")
        host = [t for t in others if dev is not None and t.device != dev]
        if host and all(t.device == dev for t in weights):
            made = [self.origin(t) for t in host]
            where = "; ".join(f"{o.what} on {o.device} at {o.line}" for o in made
                              if o is not None)
            text = (f"the pipeline made {'its tensor' if len(host) == 1 else 'tensors'} on "
                    f"{host[0].device} ({where or 'an input it did not move'}) while "
                    + ("the weights computing on it were on the device" if weights else
                       f"the tensors it met were on {dev}")
                    + (" (offload disabled: the pipeline's own placement)" if disabled else ""))
            if self.device_reads:
                reads = "; ".join(f"{r.line} read {r.tensor}.device -> {r.device} ({r.state})"
                                  for r in self.device_reads[:3])
                text += (f". Its device came from a weight the offloader had moved off the "
                         f"device: {reads}")
            return (text + ". Fix: take the execution device from offload_ref.execution_device("
                    "pipeline) or from a component the strategy keeps resident (the VAE), and "
                    "move every input, noise and timestep there")
        sides = "; ".join(
            f"{self.tensors.get(id(t)) or 'a tensor the pipeline made'} on {t.device}"
            for t in dict.fromkeys(found))
        return (f"the operation mixed {sides}, with offload "
                f"{'disabled' if disabled else 'enabled'}; no weight was off where the "
                "offloader keeps it and the kit saw no tensor kept across calls, so it cannot "
                "tell which party placed them")


# -- the error path: rerun until the device error reproduces ------------------------------------


_SCENARIO = (("generate", "enabled"), ("generate", "enabled, again"), ("disable", ""),
             ("generate", "after disable()"), ("enable", ""), ("generate", "re-enabled"))


def diagnose_device_error(case: Any) -> str:
    """Diagnosis lines for a case that raised a device-mismatch error: a fresh pipeline of the
    case's spec, enabled with the config the check last built a backend with (the case's own
    unless the check chose one: ``CheckCase.last_config``), is driven through the steps of
    ``_SCENARIO`` under a :class:`PlacementWatch` until the error reproduces."""
    from offload_ref.backends.base import backend_of

    from .facts import resident as on_platform

    config = getattr(case, "last_config", None)  # what the check enabled (auto, say)
    try:
        pipeline = case.build()
        platform = case.platform()
        backend = case.backend(config, platform=platform)
    except Exception as exc:  # noqa: BLE001 - the failure itself is already established
        return f"\n  diagnosis: not run: building the pipeline raised {type(exc).__name__}: {exc}"
    done: list[str] = []
    name = getattr(getattr(case, "impl", None), "name", None) or type(backend).__name__
    device = case.device

    def enabled() -> bool:
        # the offloader's own word: a foreign offloader is not offload-ref's backend_of()
        return bool(backend.is_enabled())

    def observed(ignore: frozenset[int] = frozenset()) -> Installed:
        return observe_enable(pipeline, lambda: backend.enable(pipeline), name=name,
                              is_enabled=enabled, device=device, ignore=ignore)

    built_on = {name: t.device for name, t in _named_tensor_values(pipeline)}
    try:
        installed = observed()
        inner = backend_of(pipeline)  # offload-ref's own backend, also behind the protocol
        plan = getattr(backend, "plan", None) or getattr(inner, "plan", None)
        owners = Owners.of(plan)

        def resident(t: torch.Tensor) -> bool:
            if not enabled():
                return True  # the pipeline's own placement
            now = backend_of(pipeline)  # offload-ref's platform knows its own storage
            if now is not None:  # a wrapper subclass: by its inner tensors
                return on_platform(getattr(now, "platform", platform), t)
            return t.device == device

        with ModuleWindows(pipeline) as windows:
            watch = PlacementWatch(pipeline, windows, resident, owners, device)
            watch.enabled = enabled
            watch.installed = installed
            watch.built_on = built_on
            kit_hooks = frozenset(h.id for h in windows._handles)  # not the offloader's
            for step, label in _SCENARIO:
                if step == "enable":
                    watch.installed = observed(kit_hooks)
                elif step == "disable":
                    backend.disable()
                else:
                    watch.begin_generation()
                    try:
                        with torch.inference_mode(), watch:
                            pipeline(**case.inputs())
                    except Exception as exc:  # noqa: BLE001 - what we came for
                        if watch.failure is None:
                            kit = (f" (the watch itself failed: {watch.internal_error})"
                                   if watch.internal_error else "")
                            return (f"\n  diagnosis: generation {watch.generation} ({label}) of "
                                    f"a fresh pipeline raised {type(exc).__name__}: {exc}, "
                                    f"outside any torch call the kit could watch{kit}")
                        return _render(watch.failure, label, done)
                done.append(f"{step} ({label})" if label else step)
        return ("\n  diagnosis: not reproduced: a fresh pipeline went through "
                f"{', '.join(done)} without a device error, so the error comes from what "
                "this check does beyond those steps (its contract line says what: a second "
                "thread, an interrupt, an edit); the check's own failure line names the party")
    except Exception as exc:  # noqa: BLE001
        return (f"\n  diagnosis: not run: {', '.join(done + ['...'])} raised "
                f"{type(exc).__name__}: {exc}")
    finally:
        try:
            backend.disable()
        except Exception:  # noqa: BLE001 - best effort; the case's own cleanup follows
            pass


def _render(failure: Failure, label: str, done: list[str]) -> str:
    lines = [f"placement: {failure.op} at {failure.line}, run by {failure.reader} in "
             f"generation {failure.generation} ({label}), mixed "
             + "; ".join(failure.tensors)]
    lines += [f"cause: {c}" for c in dict.fromkeys(failure.causes)]
    return "".join(f"\n  diagnosis: {line}" for line in lines)


@contextmanager
def watching(pipeline: Any, resident: Callable[[torch.Tensor], bool] | None,
             owners: Owners = Owners(), device: torch.device | None = None,
             on_pre: Callable[..., None] | None = None,
             on_post: Callable[..., None] | None = None) -> Iterator[PlacementWatch]:
    """Module windows and a :class:`PlacementWatch` over ``pipeline`` for one generation."""
    with ModuleWindows(pipeline, on_pre, on_post) as windows:
        watch = PlacementWatch(pipeline, windows, resident, owners, device)
        watch.begin_generation()
        with watch:
            yield watch
