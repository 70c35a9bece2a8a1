"""Observation helpers shared by the checks (snapshots, error expectations, topology probes)."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload_ref.config import OffloadConfig, OffloadStrategy
from offload_ref.discovery import discover_components, get_submodule_path
from offload_ref.hooks import HOOKS_ATTR
from offload_ref.plan.tree import tensor_leaves, wrapper_inner

from .registry import NotApplicable, fail
from .traits import needs_of, unmet

__all__ = [
    "Identities",
    "Snapshot",
    "count_forward_calls",
    "declare_no_dit",
    "expect_error",
    "first_dit",
    "hook_residue",
    "leaves_of",
    "module_attributes",
    "module_tensors",
    "module_view",
    "offload_attributes",
    "resident",
    "scalable",
    "snapshot",
    "tensors_equal",
]


class Identities:
    """Objects compared by identity, kept alive: ``x in ids`` is True only for those very
    objects.  A set of ``id()`` is not enough across a generation: a pipeline that makes a
    parameter anew at every call frees the old one, and the new one may be allocated at the
    freed address, so its ``id`` is a built parameter's (the kit then took the pipeline's own
    new weight for one it was built with, at random: a false verdict)."""

    def __init__(self, objects: Iterable[Any]) -> None:
        self._held = {id(o): o for o in objects}

    def __contains__(self, obj: Any) -> bool:
        return self._held.get(id(obj)) is obj


class PipelineView(nn.Module):
    """An ``nn.Module`` whose children are the ``nn.Module`` attributes of a pipeline that is not
    one (a diffusers-style plain object), under their attribute names (see :func:`module_view`).
    It registers nothing on the pipeline and holds no tensors of its own."""

    def __init__(self, pipeline: Any) -> None:
        super().__init__()
        self.__dict__["pipeline"] = pipeline  # not a child: the view is not part of the tree
        for name, module in module_attributes(pipeline):
            self._modules[name] = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipeline(*args, **kwargs)


def module_attributes(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """The ``nn.Module`` attributes of a plain-object pipeline, in definition order: instance
    attributes, then ``__slots__`` values (the library resolves both)."""
    out = [(n, v) for n, v in getattr(pipeline, "__dict__", {}).items()
           if isinstance(v, nn.Module)]
    seen = {n for n, _ in out}
    for cls in type(pipeline).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name in seen or name in ("__dict__", "__weakref__"):
                continue
            value = getattr(pipeline, name, None)
            if isinstance(value, nn.Module):
                seen.add(name)
                out.append((name, value))
    return out


def module_view(pipeline: Any) -> nn.Module:
    """The pipeline as an ``nn.Module`` tree, for the kit's walks (``named_parameters``,
    ``named_modules``, ``state_dict``...): the pipeline itself when it is an ``nn.Module``, else
    a :class:`PipelineView` whose children are its ``nn.Module`` attributes, so that dotted paths
    match the pipeline's own (``transformer.blocks.0``).  Built afresh on each call: attributes
    a check adds or removes are seen."""
    return pipeline if isinstance(pipeline, nn.Module) else PipelineView(pipeline)


def _attribute_dicts(pipeline: Any) -> list[tuple[str, dict[str, Any]]]:
    """``(path, __dict__)`` of the pipeline and of each of its modules; the root ``''`` is the
    pipeline's own (for a plain object, not its view's)."""
    out = [(path, module.__dict__)
           for path, module in module_view(pipeline).named_modules(remove_duplicate=False)]
    if not isinstance(pipeline, nn.Module):
        out[0] = ("", getattr(pipeline, "__dict__", {}))
    return out


def module_tensors(module: Any, *, recurse: bool = True, prefix: str = "",
                   remove_duplicate: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of the parameters, then the buffers, of ``module`` (or of a
    plain-object pipeline's modules), its submodules' too unless ``recurse=False``; each tensor
    once, under its first path, unless ``remove_duplicate=False``.  A wrapper subclass (a
    quantized weight) is given by its inner tensors, under ``path.<inner>``, recursively (Note
    [Wrapper subclasses] in offload_ref/plan/tree.py): they, not the wrapper, have a storage, an
    address, bytes and device placement, so every reading of those walks this.  (The wrapper
    answers ``data_ptr()`` with 0 and has no storage: read directly, each wrapper would sit at
    address 0, aligned, and never on the device.)  Only identity scans of parameters (a
    ``requires_grad`` scan, a tie) walk ``parameters()``."""
    module = module_view(module)
    named = list(module.named_parameters(prefix, recurse=recurse, remove_duplicate=False))
    named += [(n, b) for n, b in module.named_buffers(prefix, recurse=recurse,
                                                      remove_duplicate=False) if b is not None]
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, t in named:
        for leaf in tensor_leaves(name, t):
            if remove_duplicate:
                if id(leaf[1]) in seen:
                    continue
                seen.add(id(leaf[1]))
            out.append(leaf)
    return out


def named_module_tensors(module: Any) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by every path, a wrapper subclass by its inner tensors
    (:func:`module_tensors`)."""
    return module_tensors(module, remove_duplicate=False)


def leaves_of(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s data: ``[t]``, or a wrapper subclass's inner tensors (Note
    [Wrapper subclasses] in offload_ref/plan/tree.py)."""
    return [leaf for _, leaf in tensor_leaves("", t)]


def resident(platform: Any, t: torch.Tensor) -> bool:
    """``platform.is_resident(t)`` for any tensor: a wrapper subclass is device storage when
    every inner tensor is (its own storage is none: the platform would call it host)."""
    return all(platform.is_resident(leaf) for leaf in leaves_of(t))


def scalable(t: torch.Tensor) -> bool:
    """Whether the kit's weight edits (``t * s``, ``t.mul_(s)``, directly, through ``.data`` or
    by ``load_state_dict``) apply to ``t`` at all, offloaded or not: a non-empty floating
    tensor of two or more bytes per element.  Not a one-byte float (torch implements no
    arithmetic on float8 on the CPU) and not a wrapper subclass (a quantized weight: its
    ``mul`` runs on the dequantized value and returns a plain tensor, which its ``copy_``
    refuses, ``.data =`` would swap in, and ``mul_`` writes to a temporary).  The edit checks
    skip these in the pipeline and in the un-offloaded reference alike: like with like."""
    return (t.is_floating_point() and t.numel() > 0 and t.element_size() > 1
            and wrapper_inner(t) is None)


@dataclass
class Snapshot:
    """What "nothing changed" means for a pipeline, comparable with ``==``-style diffs."""

    #: name -> (id, device, data_ptr, dtype, shape, stride, offset, requires_grad, is_inference)
    tensors: dict[str, tuple]
    values: dict[str, torch.Tensor]  # name -> cloned values (only when asked)
    dict_keys: dict[str, tuple[str, ...]]  # module path -> sorted __dict__ keys
    hooks: dict[str, tuple[tuple[str, ...], ...]]  # module path -> registrants per HOOK_DICTS
    distributed: bool
    global_hooks: tuple[tuple[str, ...], ...] = ()  # torch's module-global hooks

    def diff(self, other: Snapshot, *, pointers: bool = True) -> list[str]:
        """What changed.  ``pointers=False`` ignores storage addresses (a restore may rebuild a
        tensor on new storage; identity, values, dtype, stride and sharing are what count)."""
        problems = []
        for name in sorted(set(self.tensors) | set(other.tensors)):
            a, b = self.tensors.get(name), other.tensors.get(name)
            if not pointers and a is not None and b is not None:
                a, b = a[:2] + a[3:], b[:2] + b[3:]
            if a != b:
                problems.append(f"tensor {name}: {a} -> {b}")
        for name, value in self.values.items():
            now = other.values.get(name)
            if now is None or not same_values(value, now):
                problems.append(f"values of {name} changed")
        for path in sorted(set(self.dict_keys) | set(other.dict_keys)):
            a, b = set(self.dict_keys.get(path, ())), set(other.dict_keys.get(path, ()))
            if a != b:
                problems.append(f"module {path or '<root>'} attributes: added {sorted(b - a)}, "
                                f"removed {sorted(a - b)}")
        for path in sorted(set(self.hooks) | set(other.hooks)):
            if self.hooks.get(path) != other.hooks.get(path):
                problems.append(f"module {path or '<root>'} hooks: "
                                f"{hook_changes(self.hooks.get(path), other.hooks.get(path))}")
        if self.global_hooks != other.global_hooks:
            problems.append(f"module-global hooks (register_module_forward_pre_hook, ...): "
                            f"{self.global_hooks} -> {other.global_hooks}")
        if self.distributed != other.distributed:
            problems.append("torch.distributed initialization state changed")
        return problems


def tensors_equal(a: torch.Tensor, b: torch.Tensor, *, nan_equal: bool = False) -> bool:
    """``torch.equal`` of two tensors' values wherever each lives (host or device); with
    ``nan_equal``, NaN equals NaN.  A wrapper subclass (a quantized weight) compares by its inner
    tensors (Note [Wrapper subclasses] in offload_ref/plan/tree.py), a one-byte float (float8,
    which ``torch.equal`` does not implement) by its bits."""
    pairs = list(zip(tensor_leaves("", a), tensor_leaves("", b)))
    if len(pairs) != len(tensor_leaves("", a)) or len(pairs) != len(tensor_leaves("", b)):
        return False
    for (_, x), (_, y) in pairs:
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.device != y.device:
            x, y = x.cpu(), y.cpu()
        if x.is_floating_point() and x.element_size() == 1:
            if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
                return False
        elif not torch.equal(x, y) and not (
                nan_equal and x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                and torch.equal(x.nan_to_num(), y.nan_to_num())):
            return False
    return True


def values_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of two tensors' values wherever each lives (host or device)."""
    return tensors_equal(a, b)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return tensors_equal(a, b, nan_equal=True)


def snapshot(pipeline: nn.Module, *, values: bool = False, live: bool = False) -> Snapshot:
    """What "nothing changed" means for ``pipeline`` now; ``values``: with every tensor's values,
    cloned, or (``live``) the tensors themselves, detached: for a snapshot that is compared with
    an earlier one at once and then dropped (no copy of every weight)."""
    tensors, vals = {}, {}
    for name, t in named_module_tensors(pipeline):
        if isinstance(t, nn.parameter.UninitializedTensorMixin):  # a lazy module before its run
            tensors[name] = (id(t), "uninitialized")
            continue
        tensors[name] = (id(t), str(t.device), t.untyped_storage().data_ptr() if t.numel() else 0,
                         t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
                         t.requires_grad, t.is_inference())
        if values:
            vals[name] = t.detach() if live else t.detach().clone()
    _note_wrappers(pipeline, tensors)
    dict_keys = {path: tuple(sorted(d)) for path, d in _attribute_dicts(pipeline)}
    hooks = {}
    for path, module in module_view(pipeline).named_modules(remove_duplicate=False):
        hooks[path] = tuple(tuple(sorted(map(hook_name, getattr(module, d, {}).values())))
                            for d in HOOK_DICTS)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return Snapshot(tensors, vals, dict_keys, hooks, distributed, _global_hooks())


def _note_wrappers(pipeline: Any, tensors: dict[str, tuple]) -> None:
    """Add each wrapper subclass of ``pipeline`` to a snapshot's ``tensors``, by every path:
    :func:`named_module_tensors` gives its inner tensors, and the wrapper itself is the object the
    module holds, with the device, dtype, shape and strides a forward sees (Note [Wrapper
    subclasses] in offload_ref/plan/tree.py); it has no address (0)."""
    view = module_view(pipeline)
    pending = [(name, t) for name, t in [*view.named_parameters(remove_duplicate=False),
                                         *view.named_buffers(remove_duplicate=False)]
               if t is not None]
    while pending:  # no recursive closure: a reference cycle holding tensors until a collection
        name, t = pending.pop()
        inner = wrapper_inner(t)
        if inner is None:
            continue
        tensors[name] = (id(t), str(t.device), 0, t.dtype, tuple(t.shape), tuple(t.stride()),
                         t.storage_offset(), t.requires_grad, t.is_inference())
        pending += [(f"{name}.{attr}", it) for attr, it in inner]


#: The hook dicts of an ``nn.Module`` the kit compares (forward pre-hooks and forward hooks
#: first, as check messages print them; then backward, state_dict and load_state_dict hooks).
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
              "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
              "_load_state_dict_post_hooks")


def hook_changes(before: tuple[tuple[str, ...], ...] | None,
                 after: tuple[tuple[str, ...], ...] | None) -> str:
    """Which hook dicts of one module differ, and how: ``_forward_hooks: () -> ('x.hook',)``."""
    before = before or ((),) * len(HOOK_DICTS)
    after = after or ((),) * len(HOOK_DICTS)
    return "; ".join(f"{name}: {a} -> {b}" for name, a, b in zip(HOOK_DICTS, before, after)
                     if a != b)


def _global_hooks() -> tuple[tuple[str, ...], ...]:
    """torch's module-global hooks (``register_module_forward_pre_hook`` and friends), by
    registrant."""
    m = nn.modules.module
    dicts = [getattr(m, name, {}) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
        "_global_backward_hooks", "_global_module_registration_hooks",
        "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")]
    return tuple(tuple(sorted(map(hook_name, d.values()))) for d in dicts)


def hook_name(hook: Any) -> str:
    """Who registered a hook, as ``module.qualname`` of its function (a bound method: of its
    class; a ``functools.partial``: of the function it wraps)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    owner = getattr(hook, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        hook = getattr(hook, "__func__", hook)
    module = getattr(hook, "__module__", None) or type(hook).__module__
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return f"{module}.{name}"


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """The storage ``t`` views, as the kit tells storages apart: its device and address (the kit
    keeps its own, apart from the library's ``offload_ref.host.storage_key``, so that its
    expectations stay an independent oracle)."""
    return str(t.device), t.untyped_storage().data_ptr()


def storage_groups(pipeline: nn.Module) -> list[tuple[str, ...]]:
    """Names of tensors grouped by shared storage (groups of two or more)."""
    groups: dict[tuple, list[str]] = {}
    for name, t in named_module_tensors(pipeline):
        if not isinstance(t, nn.parameter.UninitializedTensorMixin) and t.numel():
            groups.setdefault(storage_key(t), []).append(name)
    return sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1)


@contextmanager
def count_forward_calls() -> Iterator[list[str]]:
    """Every module forward call while inside (a global pre-hook)."""
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: calls.append(type(module).__name__))
    try:
        yield calls
    finally:
        handle.remove()


def expect_error(
    what: str,
    fn: Callable[[], Any],
    *,
    types: tuple[type[BaseException], ...] = (ValueError,),
    mentions: tuple[str, ...] = (),
) -> BaseException:
    """``fn()`` must raise one of ``types`` whose message contains every string of ``mentions``."""
    try:
        fn()
    except types as exc:
        message = str(exc)
        missing = [m for m in mentions if m not in message]
        if missing:
            fail(f"{what}: the error does not mention {missing}: {message!r}",
                 severity="error")
        return exc
    except Exception as exc:
        fail(f"{what}: expected {[t.__name__ for t in types]}, got "
             f"{type(exc).__name__}: {exc}", severity="error")
    fail(f"{what}: expected {[t.__name__ for t in types]}, nothing was raised")
    raise AssertionError  # unreachable


def declare_no_dit(pipeline: Any) -> None:
    """Make this pipeline instance one without a DiT, for the checks of such a topology: its
    ``_dit_modules`` emptied, and the resident head its ``OffloadPlan`` may declare dropped (a
    pipeline without a DiT could not declare one: the resolver refuses a head naming no DiT,
    which would blame the author for the kit's own edit).  The class keeps its declarations."""
    import dataclasses

    from offload_ref.plan import OffloadPlan

    pipeline.__dict__["_dit_modules"] = []
    plan = getattr(pipeline, "_offload_plan", None)
    if isinstance(plan, OffloadPlan) and (plan.layerwise_resident_layers
                                          or plan.layerwise_resident_policy):
        pipeline.__dict__["_offload_plan"] = dataclasses.replace(
            plan, layerwise_resident_layers={}, layerwise_resident_policy={})


def first_dit(pipeline: nn.Module) -> tuple[str, nn.Module]:
    found = discover_components(pipeline)
    if not found.dits:
        fail(f"{type(pipeline).__name__} has no discoverable DiT")
    return found.dits[0]


def dit_block_count(pipeline: Any, found: Any = None) -> tuple[str | None, int | None]:
    """``(path, number of blocks)`` of the first DiT, its blocks those its declared block
    containers hold; ``(None, None)`` when the pipeline has no DiT.  ``found``: the pipeline's
    ``discover_components``, if the caller has it."""
    dits = (found if found is not None else discover_components(pipeline)).dits
    return (dits[0][0], len(dit_blocks(pipeline, *dits[0]))) if dits else (None, None)


def dit_has_blocks(at_least: int = 2) -> Callable[[Any, str], Any]:
    """An ``applies`` predicate, for checks registered outside the kit with ``applies=``: the
    first DiT's declared block containers hold ``at_least`` blocks (the kit's own checks say
    ``requires=("dit_blocks>=N",)``, judged by the same rule, :mod:`..traits`).

    Checks that copy, split or alias the author's blocks need blocks to work on; on a DiT with
    fewer (none, one, or undeclared containers) they do not apply.  A layer strategy on such a
    DiT still fails, through the checks that resolve it and report the resolver's error.  No
    DiT at all: the predicate holds, and the check says so (first_dit fails naming the class).
    """
    cache: dict[str, Any] = {}
    requirement = (f"dit_blocks>={at_least}",)

    def applies(spec: Any, strategy: str) -> Any:
        if spec.name not in cache:
            path, count = dit_block_count(spec.build())
            reason = unmet({"dit_path": path, "dit_blocks": count}, requirement,
                           needs_of(requirement))
            cache[spec.name] = True if reason is None else NotApplicable(reason)
        return cache[spec.name]

    return applies


def offload_attributes(pipeline: nn.Module) -> list[str]:
    """Every ``_offload_ref_*`` attribute left on the pipeline or its modules."""
    out = []
    for path, attributes in _attribute_dicts(pipeline):
        for key in attributes:
            if key.startswith("_offload_ref"):
                out.append(f"{path or '<root>'}.{key}")
    return out


def hook_residue(pipeline: nn.Module) -> list[str]:
    out = []
    for path, attributes in _attribute_dicts(pipeline):
        if HOOKS_ATTR in attributes:
            out.append(f"{path or '<root>'}: {list(attributes[HOOKS_ATTR])}")
    return out


def weak_hooks(pipeline: nn.Module) -> list[weakref.ref]:
    refs = []
    for _, module in module_view(pipeline).named_modules():
        for entry in module.__dict__.get(HOOKS_ATTR, {}).values():
            refs.append(weakref.ref(entry.hook))
    return refs


def collected(refs: list[weakref.ref]) -> list[str]:
    gc.collect()
    return [repr(r()) for r in refs if r() is not None]


def layer_config(strategy: OffloadStrategy, **overrides: Any) -> OffloadConfig:
    fields = {"strategy": strategy, "components": ("dit",)}
    fields.update(overrides)
    return OffloadConfig(**fields)


def dit_containers(pipeline: nn.Module, dit_path: str, dit: nn.Module) -> tuple[str, ...]:
    plan = getattr(pipeline, "_offload_plan", None)
    if plan is not None and dit_path in plan.block_attrs:
        return tuple(plan.block_attrs[dit_path])
    names = getattr(dit, "_layerwise_offload_blocks_attrs", None) or ()
    return tuple([names] if isinstance(names, str) else names)


def dit_blocks(pipeline: nn.Module, dit_path: str, dit: nn.Module) -> list[nn.Module]:
    """The blocks the DiT's declared containers hold, in order.  A container that keeps the
    blocks of other pipeline-parallel stages as placeholders (modules without a parameter or a
    buffer, vLLM's ``PPMissingLayer``) holds only its blocks with tensors (Note
    [Pipeline-parallel stages] in offload_ref/plan/resolver.py): a stage streams, counts and
    keeps resident only its own."""
    blocks = []
    for name in dit_containers(pipeline, dit_path, dit):
        container = get_submodule_path(dit, name)
        if isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            held = list(container.values() if isinstance(container, nn.ModuleDict)
                        else container)
            own = [b for b in held if any(True for _ in (*b.parameters(), *b.buffers()))]
            blocks.extend(own or held)
        elif isinstance(container, nn.Module):
            blocks.append(container)
    return blocks
