"""Walks of module trees: the tensors of a pipeline, a component or a block (by identity, every
path included or each tensor once), read from the modules' registries directly, and the storage
key of a tensor.

Note [Wrapper subclasses]
    A quantized weight is often a wrapper subclass (torchao's ``Float8Tensor``, a GGUF or
    4-bit tensor): a tensor without storage of its own whose data lives in plain inner tensors
    it names in ``__tensor_flatten__`` (an FP8 payload and a scale), and which
    ``__tensor_unflatten__`` builds again around inner tensors.  Every walk here yields such a
    tensor's inner tensors in its place, under ``<path>.<inner name>`` (recursively, for an
    inner tensor that is itself a wrapper): host masters, slots, alignment, rebinds and device
    bytes are theirs, exactly as for a plain tensor, and the module keeps the wrapper object
    itself.  The wrapper's own device follows its inner tensors (:class:`WrapperSet` in
    ``backends/wrappers.py``): after every move of its inner tensors it is given the metadata of
    a wrapper built by ``__tensor_unflatten__`` around them, so a forward sees the type, dtype,
    shape and strides the module was built with, on the device its data is on.  A DTensor is a
    wrapper too, but its inner tensor is one rank's shard, not the weight: it is not looked
    into, and the resolver refuses it (as any tensor without readable storage).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..discovery import require_acyclic
from ..host import storage_key
from .declarations import OffloadTopologyError


def wrapper_inner(t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """The inner tensors of a wrapper subclass, ``(name, tensor)`` in ``__tensor_flatten__``
    order, or None for any other tensor (Note [Wrapper subclasses])."""
    cls = type(t)
    flattens = _FLATTENS.get(cls)
    if flattens is None:
        flattens = _FLATTENS[cls] = (
            cls is not torch.Tensor and cls is not nn.Parameter and is_traceable_wrapper_subclass(t)
            and not _is_dtensor_class(cls))
    if not flattens:
        return None
    names, _ = t.__tensor_flatten__()
    return [(name, getattr(t, name)) for name in names]


# class -> whether its tensors are looked into (Note [Wrapper subclasses])
_FLATTENS: dict[type, bool] = {}


def _is_dtensor_class(cls: type) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: no DTensor to meet
        return False
    return issubclass(cls, DTensor)


def tensor_leaves(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(name, t)]`` for a plain tensor; a wrapper subclass's inner tensors (each under
    ``name.<inner>``, recursively) for a wrapper (Note [Wrapper subclasses])."""
    inner = wrapper_inner(t)
    if inner is None:
        return [(name, t)]
    out = []
    for attr, it in inner:
        out += tensor_leaves(f"{name}.{attr}", it)
    return out


def wrappers_in(roots: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, wrapper)`` of the wrapper subclasses held by each ``(prefix, module)``
    of ``roots`` and their subtrees, each once (its first path), an inner wrapper before the one
    that holds it (Note [Wrapper subclasses])."""
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, root in roots:
        paths = _named_subtree(root, prefix) or list(root.named_modules(prefix=prefix))
        for path, m in paths:
            for registry in ("_parameters", "_buffers"):
                for name, t in m.__dict__.get(registry, {}).items():
                    if t is not None:
                        _add_wrappers(f"{path}.{name}" if path else name, t, seen, out)
    return out


def _add_wrappers(name: str, t: torch.Tensor, seen: set[int],
                  out: list[tuple[str, torch.Tensor]]) -> None:
    """:func:`wrappers_in` for one tensor, inner wrappers first (a module-level function: a
    recursive closure is a reference cycle that would hold the tensors until a collection)."""
    inner = wrapper_inner(t)
    if inner is None or id(t) in seen:
        return
    seen.add(id(t))
    for attr, it in inner:
        _add_wrappers(f"{name}.{attr}", it, seen, out)
    out.append((name, t))


def pipeline_state(pipeline: Any, exclude: Iterable[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers of ``pipeline`` outside the ``exclude`` subtrees (what no
    component owns: it stays on the device under every strategy)."""
    if isinstance(pipeline, nn.Module):
        require_acyclic(pipeline, error=OffloadTopologyError)  # the walk below is recursive
    excluded = {id(m) for root in exclude for m in root.modules()}
    out = []

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in excluded:
            return
        for registry in ("_parameters", "_buffers"):
            for name, t in module.__dict__.get(registry, {}).items():
                if t is not None:
                    out.extend(tensor_leaves(f"{prefix}{name}", t))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    if isinstance(pipeline, nn.Module):
        walk(pipeline, "")
    else:
        # A plain-object pipeline (diffusers-style): its nn.Module attributes are its tree, so
        # an undeclared module attribute is pipeline state too, as a child of an nn.Module
        # pipeline would be; skipping it would leave it on the host under every strategy.
        for name, module in _module_attributes(pipeline):
            if id(module) not in excluded:
                require_acyclic(module, f"{name}.", error=OffloadTopologyError)
                walk(module, f"{name}.")
    return out


def _module_attributes(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """The nn.Module attributes of a plain-object pipeline: instance attributes, then the values
    of its ``__slots__`` (discovery resolves both)."""
    out = [(n, v) for n, v in getattr(pipeline, "__dict__", {}).items()
           if isinstance(v, nn.Module)]
    seen = {n for n, _ in out}
    for cls in type(pipeline).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in seen and name not in ("__dict__", "__weakref__"):
                value = getattr(pipeline, name, None)
                if isinstance(value, nn.Module):
                    seen.add(name)
                    out.append((name, value))
    return out


def _tensors(*modules: nn.Module) -> list[torch.Tensor]:
    """The distinct parameters and buffers of ``modules``, in the order of ``parameters()``
    then ``buffers()`` per module.  The walk reads the modules' registries directly, as
    ``named_modules`` does: torch's generators cost several times more per module, and the
    resolver walks each component more than once."""
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for module in modules:
        subtree = _subtree(module)
        for registry in ("_parameters", "_buffers"):
            for m in subtree:
                for t in m.__dict__.get(registry, {}).values():
                    if t is None:
                        continue
                    if _FLATTENS.get(type(t)) is False:  # a plain tensor (the hot case)
                        if id(t) not in seen:
                            seen.add(id(t))
                            out.append(t)
                        continue
                    for _, leaf in tensor_leaves("", t):
                        if id(leaf) not in seen:
                            seen.add(id(leaf))
                            out.append(leaf)
    return out


def _subtree(module: nn.Module) -> list[nn.Module]:
    """``module.modules()``: each module of the subtree once, in pre-order."""
    out = [module]
    seen = {id(module)}
    stack = [iter(module._modules.values())]
    while stack:
        for child in stack[-1]:
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                out.append(child)
                stack.append(iter(child._modules.values()))
                break
        else:
            stack.pop()
    return out


def _nbytes_of(*modules: nn.Module) -> int:
    """Bytes of the distinct tensors of ``modules``."""
    return sum(t.numel() * t.element_size() for t in _tensors(*modules))


def named_tensors(module: nn.Module, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` then ``named_buffers`` of ``module`` under ``prefix``, every path
    to a tensor included (``remove_duplicate=False``), None entries skipped; read from the
    registries directly (see :func:`_tensors`)."""
    paths = _named_subtree(module, prefix)
    if paths is None:  # a cycle: torch's own walk reports it (RecursionError), as it did
        paths = list(module.named_modules(prefix=prefix, remove_duplicate=False))
    out = []
    for registry in ("_parameters", "_buffers"):
        for path, m in paths:
            for name, t in m.__dict__.get(registry, {}).items():
                if t is None:
                    continue
                if _FLATTENS.get(type(t)) is False:  # a plain tensor (the hot case)
                    out.append((f"{path}.{name}" if path else name, t))
                else:
                    out.extend(tensor_leaves(f"{path}.{name}" if path else name, t))
    return out


def _named_subtree(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]] | None:
    """``named_modules(prefix=prefix, remove_duplicate=False)`` as a list (a module reached by
    two paths is listed under each), or None if a module contains itself."""
    out = [(prefix, module)]
    ancestors = [id(module)]
    stack = [(prefix, iter(module._modules.items()))]
    while stack:
        path, children = stack[-1]
        for name, child in children:
            if child is None:
                continue
            if id(child) in ancestors:
                return None
            child_path = f"{path}.{name}" if path else name
            out.append((child_path, child))
            ancestors.append(id(child))
            stack.append((child_path, iter(child._modules.items())))
            break
        else:
            stack.pop()
            ancestors.pop()
    return out


def _has_readable_storage(t: torch.Tensor) -> bool:
    if t.is_meta:
        return True  # rejected later, with its own message (it was never materialized)
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    if t.is_meta:
        return ("meta", id(t))
    return storage_key(t)
