"""Who is to blame for a tensor on the wrong side: the offloader under test, or the pipeline.

The placement diagnosis (:mod:`.placement`) knows the operation that mixed devices and the
tensors it mixed.  Whether the pipeline or the offloader put a weight there is told here from
what the kit saw of the offloader itself, for any offloader (offload-ref's backends, or a
foreign one behind the protocol, whose hooks and moves the kit never wrote):

* :func:`observe_enable` runs ``enable()`` and records what it did: the hooks it added to each
  module (forward hooks and pre-hooks, a ``forward`` replaced on the instance, as accelerate and
  diffusers do) and the tensors it moved (device before and after), in an :class:`Installed`;
* :func:`running_hook` finds a module hook that is running now outside the module's own call
  window (a hook registered after the offloader's, running after its post-hook);
* :func:`offloader_cause` explains a weight found off the device while the offloader is enabled:
  a module entered around its hooks (the pipeline's doing), or the offloader never moving it,
  hooking nothing that holds it, having removed its own hooks, or running a module without
  loading it (the offloader's doing), naming the tensor, its kind and the offloader.

Every sentence here states what was observed; the blamed party is the one whose code did (or
failed to do) what the sentence says.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["Installed", "code_file", "hooks_of", "named_modules", "observe_enable", "offloader_cause",
           "race_party", "running_hook", "short_path", "tensor_kind", "where_code"]

#: the torch.nn.Module machinery a module's hooks and forward are called from
_CALL_MACHINERY = frozenset({"_call_impl", "_wrapped_call_impl", "inner", "__call__"})
_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")


def _within(path: str, owner: str) -> bool:
    return owner == "" or path == owner or path.startswith(owner + ".")


def short_path(filename: str) -> str:
    """``filename`` relative to the working folder or to site-packages (else as it is): how the
    kit writes a source file."""
    cwd = os.getcwd().rstrip(os.sep) + os.sep
    if filename.startswith(cwd):
        return filename[len(cwd):]
    if "site-packages" + os.sep in filename:
        return filename.split("site-packages" + os.sep, 1)[1]
    return filename


def where_code(code: CodeType, line: int | None = None) -> str:
    """``file:line`` of ``code`` (its first line unless ``line``), the file relative to the
    working folder or to site-packages."""
    return f"{short_path(code.co_filename)}:{code.co_firstlineno if line is None else line}"


def _callable_code(fn: Any) -> CodeType | None:
    fn = getattr(fn, "__func__", fn)
    while hasattr(fn, "func") and not hasattr(fn, "__code__"):  # functools.partial
        fn = fn.func
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code


def _describe(fn: Any) -> str:
    code = _callable_code(fn)
    name = getattr(getattr(fn, "__func__", fn), "__qualname__", None) or type(fn).__qualname__
    return f"{name} ({where_code(code)})" if code is not None else name


def hooks_of(module: nn.Module) -> dict[tuple[str, int], Any]:
    """What hooks ``module`` has now: (kind, key) -> the hook (``forward`` replaced on the
    instance counts, keyed by the identity of the replacement)."""
    out: dict[tuple[str, int], Any] = {}
    for kind, table in (("forward pre-hook", module._forward_pre_hooks),
                        ("forward hook", module._forward_hooks)):
        for key, hook in table.items():
            out[(kind, key)] = hook
    forward = module.__dict__.get("forward")
    if forward is not None:
        out[("forward replaced", id(forward))] = forward
    return out


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


def _tensor_places(pipeline: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for path, module in named_modules(pipeline):
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is not None:
                    out.setdefault(f"{path}.{name}" if path else name, str(t.device))
    return out


@dataclass
class Installed:
    """What one ``enable()`` of an offloader did to a pipeline, seen from outside it."""

    name: str  # the offloader, as the report names it (``--offloader`` reference)
    is_enabled: Callable[[], bool]
    device: torch.device  # where the offloader was told to compute
    #: module path -> {(kind, key): hook} the enable added
    hooks: dict[str, dict[tuple[str, int], Any]] = field(default_factory=dict)
    #: module path -> the hook keys it had before the enable (the pipeline's own)
    before: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    #: tensor path -> (device before, device after) for each tensor the enable moved
    moved: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: the code objects of the hooks the enable added (to tell its hooks from the pipeline's)
    codes: set[CodeType] = field(default_factory=set)

    def hooked(self, path: str) -> bool:
        return bool(self.hooks.get(path))

    def removed(self, path: str, module: nn.Module) -> list[str]:
        """The hooks the enable added to ``module`` that are gone now, described."""
        now = hooks_of(module)
        return [f"{kind} {_describe(hook)}" for (kind, key), hook in
                self.hooks.get(path, {}).items() if (kind, key) not in now]

    def describe_hooks(self, path: str, limit: int = 2) -> str:
        hooks = list(self.hooks.get(path, {}).items())
        shown = ", ".join(f"{kind} {_describe(h)}" for (kind, _), h in hooks[:limit])
        return shown + (f" and {len(hooks) - limit} more" if len(hooks) > limit else "")

    def hooked_paths(self) -> list[str]:
        return [p for p, h in self.hooks.items() if h]


def observe_enable(pipeline: Any, enable: Callable[[], None], *, name: str,
                   is_enabled: Callable[[], bool], device: torch.device,
                   ignore: frozenset[int] = frozenset()) -> Installed:
    """Run ``enable()`` and record the hooks it added and the tensors it moved.  ``ignore``:
    the handle ids of hooks that are not the offloader's (the kit's own module windows)."""
    modules = named_modules(pipeline)
    before = {p: set(hooks_of(m)) for p, m in modules}
    places = _tensor_places(pipeline)
    enable()
    installed = Installed(name, is_enabled, device, before=before)
    for path, module in named_modules(pipeline):
        added = {k: h for k, h in hooks_of(module).items()
                 if k not in before.get(path, set()) and k[1] not in ignore}
        if added:
            installed.hooks[path] = added
            for hook in added.values():
                code = _callable_code(hook)
                if code is not None:
                    installed.codes.add(code)
    for path, device_after in _tensor_places(pipeline).items():
        device_before = places.get(path)
        if device_before is not None and device_before != device_after:
            installed.moved[path] = (device_before, device_after)
    return installed


@dataclass(frozen=True)
class Hook:
    """A module hook running now outside its module's call window."""

    module: nn.Module
    kind: str  # "forward hook" or "forward pre-hook"
    qualname: str
    source: str  # file:line where the hook function is defined
    line: str  # file:line it runs now
    offloaders: bool  # the offloader's own hook


def running_hook(active: Callable[[nn.Module], bool],
                 installed: Installed | None = None) -> Hook | None:
    """The module hook on the stack now, when the innermost module call is running a hook of
    that module outside the module's window (``active`` False: before the kit's pre-hook or
    after its last post-hook, so a hook registered after the kit's, itself registered after
    the offloader's); None otherwise (inside a forward, or no module call)."""
    frame: FrameType | None = sys._getframe(1)
    child: FrameType | None = None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "inner" and code.co_filename.endswith(_MODULE_FILE):
            module = frame.f_locals.get("self")
            if not isinstance(module, nn.Module) or child is None or active(module):
                return None
            if child.f_locals.get("self") is module:  # its forward, not a hook
                return None
            hook_id = frame.f_locals.get("hook_id")
            kind = ("forward hook" if hook_id in module._forward_hooks else "forward pre-hook")
            hook_code = child.f_code
            reading = _innermost_line_of(hook_code)
            return Hook(module, kind, getattr(hook_code, "co_qualname", hook_code.co_name),
                        where_code(hook_code), reading or where_code(hook_code, child.f_lineno),
                        installed is not None and hook_code in installed.codes)
        child = frame
        frame = frame.f_back
    return None


def _innermost_line_of(code: CodeType) -> str | None:
    """``file:line`` of the innermost frame running ``code`` (the line of the hook that read)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return where_code(code, frame.f_lineno)
        frame = frame.f_back
    return None


def tensor_kind(module: nn.Module | None, name: str) -> str:
    """``parameter``, ``buffer`` or ``non-persistent buffer``."""
    if module is None:
        return "tensor"
    if name in module._parameters:
        return "parameter"
    if name in module._buffers:
        return ("non-persistent buffer" if name in module._non_persistent_buffers_set
                else "buffer")
    return "tensor"


def hook_cause(hook: Hook, path: str, modules: dict[str, nn.Module], state: str,
               offloader: str) -> str:
    """A hook registered after the offloader's ran outside its module's call and read
    ``path``."""
    module_path = next((p for p, m in modules.items() if m is hook.module), "?")
    if hook.offloaders:
        return (f"{offloader}'s own {hook.kind} {hook.qualname} ({hook.source}) on "
                f"{module_path} read {path} at {hook.line} while it was {state} (an offloader "
                "defect, not the pipeline's)")
    when = ("after" if hook.kind == "forward hook" else "before")
    return (f"the {hook.kind} {hook.qualname} ({hook.source}) of {module_path} read {path} "
            f"at {hook.line}, not {module_path}'s forward: the hook was "
            f"registered after {offloader}'s own hooks, so it ran {when} them, while {path} "
            f"was {state}. A module's own hooks are part of its call: an offloader should keep "
            f"its weights loaded until the last of them ran (offload-ref runs its hooks "
            f"outermost); with this one, register the hook before enable(), or read the weight "
            f"inside {module_path}'s forward")


def offloader_cause(path: str, t: torch.Tensor, reader: str, line: str, *,
                    installed: Installed, modules: dict[str, nn.Module],
                    active: Callable[[nn.Module], bool],
                    entry_point: Callable[[nn.Module], tuple[str, str] | None],
                    generation: int) -> str:
    """Why the weight ``path`` was on ``t.device``, not on the offloader's device, when
    ``reader`` (a module path; ``""``: the pipeline's own code outside any module call) read it
    at ``line`` while the offloader was enabled."""
    holder, _, name = path.rpartition(".")
    kind = tensor_kind(modules.get(holder), name)
    what = f"{path} ({kind}, on {t.device})"
    off = installed.name
    note = (" Non-persistent buffers are not in state_dict(): an offloader that moves "
            "state_dict() entries, or parameters only, misses them; move every registered "
            "buffer." if kind == "non-persistent buffer" else "")
    ancestry = [p for p in modules if _within(holder, p)]
    ancestry.sort(key=len, reverse=True)  # innermost first
    hooked = [p for p in ancestry if installed.hooked(p)]
    for p in hooked:
        gone = installed.removed(p, modules[p])
        if gone:
            return (f"{off} installed {', '.join(gone[:2])} on {p} at enable(), and "
                    f"{'it was' if len(gone) == 1 else 'they were'} "
                    f"gone in generation {generation} while it still said is_enabled() True: "
                    f"a hook that removes itself (after its first call, say) leaves {p}'s "
                    f"weights where they are, so {what} met tensors on {installed.device} "
                    "(an offloader defect, not the pipeline's)")
    if not reader:
        return (f"the pipeline's own code read {what} at {line}, outside any module call, "
                f"while {off} was enabled: an offloader places a module's weights for "
                f"that module's call. Fix: read weights only inside the forward of the module "
                f"that holds them (compute what you need there and return it)")
    for p in hooked:
        module = modules[p]
        if active(module):
            break  # entered through its __call__: the offloader's hooks on it ran
        entry = entry_point(module)
        if entry is not None and entry[0] not in _CALL_MACHINERY:
            how = (f"{p}.forward(...)" if entry[0] == "forward" else f"its method {entry[0]}()")
            return (f"the pipeline ran {p} through {how} (called at {entry[1]}), which bypasses "
                    f"the hooks {off} put on {p} ({installed.describe_hooks(p)}), so {what} was "
                    f"read by {reader} where the offloader had left it. Fix: call the module, "
                    f"{p}(...)")
        if _within(reader, p):
            return (f"{off} did not load {what} for a call of {reader} made on its own, "
                    f"outside a call of {p} (for example after a block loop): it loads {p}'s "
                    f"weights only in the hooks it put on {p} ({installed.describe_hooks(p)}). "
                    f"An offloader defect: every module call goes through that module's hooks, "
                    f"and offload-ref serves a part called on its own through the part's hooks. "
                    f"Workaround in the pipeline: call {reader} only inside {p}'s forward")
        return (f"the pipeline read {what}, which belongs to {p}, from {reader} at {line}, "
                f"outside {p}'s own call, the only time {off} loads it. Fix: read a module's "
                f"weights only inside its own forward (compute what others need there and "
                f"return it, or give the reader its own copy as a registered buffer)")
    if hooked:
        p = hooked[0]
        return (f"{off} did not load {what}, although {p} was called through its hooks "
                f"({installed.describe_hooks(p)}): it was still off {installed.device} inside "
                f"{p}'s forward (an offloader defect, not the pipeline's).{note}")
    moved = installed.moved.get(path)
    if moved is not None:
        return (f"{off} moved {what} from {moved[0]} to {moved[1]} at enable(), but it was on "
                f"{t.device} when {reader} read it at {line}, while the offloader was enabled "
                "and with no hook of it on any module that holds it: something moved it back, "
                "and the kit cannot tell whether the offloader or the pipeline did")
    hooks = installed.hooked_paths()
    shown = ", ".join(hooks[:3]) + (f" and {len(hooks) - 3} more" if len(hooks) > 3 else "")
    named = [p for p in ancestry if p]
    top = named[-1] if named else holder
    return (f"{off} neither moved {what} at enable() nor put a hook on any module that holds "
            f"it ({holder} or a parent of it); it hooked {shown or 'no module'}: {path} stayed "
            f"on {t.device} while {reader} computed on {installed.device} (an offloader defect, "
            f"not the pipeline's: {path} is state of {top} that the offloader does not "
            f"manage).{note}")


# -- stream races ------------------------------------------------------------------------------


def code_file(obj: Any) -> str | None:
    """The absolute source file of ``obj``: a function, method or ``functools.partial`` (its
    code), a class (its module), any other object (its class's module); None when unknown."""
    import inspect

    if not inspect.isclass(obj):
        code = _callable_code(obj) if callable(obj) else None
        if code is not None:
            return os.path.abspath(code.co_filename)
        obj = type(obj)
    module = sys.modules.get(getattr(obj, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    return os.path.abspath(path) if path else None


def _frame_file(frame: str) -> str:
    """The file of a frame as the stream sanitizer writes it: ``path/file.py:123 in forward``."""
    text = frame.rsplit(" in ", 1)[0] if " in " in frame else frame
    head, _, line = text.rpartition(":")
    return head if head and line.strip().isdigit() else text


def _known(frame: str, files: set[str]) -> bool:
    path = _frame_file(frame)
    return path in files or os.path.abspath(path) in files or any(
        short_path(f) == path for f in files)


def race_party(current: tuple[str, ...], previous: tuple[str, ...], offloader_files: set[str],
               pipeline_files: set[str], alone: bool | None = None) -> tuple[str, str]:
    """Who made a stream race, from the frames of its two accesses (innermost first, as the
    sanitizer records them) and, where the kit could tell, from ``alone``: whether the pipeline
    made the same race (same kind, same two source lines) when the kit ran it resident, with no
    offloader (None: not known).

    * a frame of either access in ``offloader_files``: ``("offloader", why)``;
    * ``alone`` True: ``("pipeline", why)``: the pipeline's code races on streams it drives
      itself, whatever the offloader;
    * ``alone`` False: ``("offloader", why)``: the same code did not race without the offloader,
      so it ran on streams the offloader made current or left unordered (its hooks switching
      streams around the pipeline's code, say), whoever's lines the two accesses are;
    * ``alone`` None: ``("pipeline", why)`` when both accesses were made in the pipeline's own
      code (the innermost frame of each in ``pipeline_files``); else ``("offloader", why)``: the
      streams that carry weights are the offloader's to order."""
    def in_pipeline(frames: tuple[str, ...]) -> bool:
        return bool(frames) and _known(frames[0], pipeline_files)

    def text(frame: str) -> str:
        path, sep, rest = frame.partition(":")
        return short_path(path) + sep + rest if sep else frame

    mine = [f for f in (*previous, *current) if _known(f, offloader_files)]
    if mine:
        return ("offloader", f"the offloader's code made the unordered access ({text(mine[0])}); "
                             "an offloader orders the streams it moves weights on")
    both = in_pipeline(current) and in_pipeline(previous)
    lines = (f"{text(current[0])}, {text(previous[0])}" if current and previous else
             ", ".join(text(f[0]) for f in (current, previous) if f) or "no source line captured")
    whose = ("both accesses are the pipeline's own code" if both else
             "neither access is in the offloader's files the kit knows")
    if alone is True:
        return ("pipeline", f"the pipeline races without any offloader: run resident (no "
                            f"offloader), it made the same two accesses ({lines}) unordered, on "
                            "streams its own code drives: order them there")
    if alone is False:
        return ("offloader", f"{whose} ({lines}), but run resident (no "
                             "offloader) the pipeline made them without a race: under the "
                             "offloader they ran on streams it made current or left unordered "
                             "(its hooks switching streams around the pipeline's code, say); an "
                             "offloader orders the streams it runs a pipeline's code on")
    if both:
        return ("pipeline", f"both accesses are the pipeline's own code ({lines}), on streams "
                            "it drives itself: order them there")
    if not current or not previous:
        return ("offloader", "no source line was captured for "
                             f"{'either access' if not current and not previous else 'one access'}"
                             ": the streams that move weights are the offloader's to order")
    return ("offloader", f"neither access is in the offloader's files the kit knows, nor are both "
                         f"the pipeline's own code ({lines}): the streams that move weights are "
                         "the offloader's to order")
