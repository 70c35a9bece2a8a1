"""How a pipeline tells the offloader what its components are.

A pipeline declares its components with :class:`SupportsComponentDiscovery` class variables (dotted
attribute paths).  A pipeline that declares nothing is scanned for well-known attribute names, with
a warning once per pipeline class: the scan guesses roles from names, and a guess is how other
offloaders end up moving the wrong module.

Everything here only reads the pipeline.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import nn

__all__ = [
    "ComponentSet",
    "FALLBACK_NAMES",
    "OffloadDeclarationWarning",
    "SupportsComponentDiscovery",
    "SupportsModelCpuOffload",
    "declares_components",
    "discover_components",
    "forget_scan_warnings",
    "get_submodule_path",
    "require_acyclic",
    "supports_model_cpu_offload",
]


class OffloadDeclarationWarning(UserWarning):
    """A pipeline relies on guessing (name scans) instead of declarations."""


class SupportsComponentDiscovery:
    """Mixin declaring a pipeline's components by dotted attribute path.

    ``_dit_modules``: denoisers (DiTs, UNets); ``_encoder_modules``: conditioning encoders that are
    swapped out while a DiT runs; ``_vae_modules``: decoders that stay on the device;
    ``_resident_modules``: small modules that must stay on the device (embedders, connectors).
    """

    _dit_modules: ClassVar[list[str]] = []
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []


@runtime_checkable
class SupportsModelCpuOffload(Protocol):
    """A split model that swaps its own components inside forward (the Cosmos3 shape).

    The model-level backend delegates to these two methods instead of installing its own hooks.
    """

    def enable_omni_model_cpu_offload(self, *, device: Any, pin_memory: bool, **kwargs: Any) -> Any:
        ...

    def disable_omni_model_cpu_offload(self) -> Any:
        ...


#: The legacy attribute scan, used only when a pipeline declares nothing.
FALLBACK_NAMES: dict[str, tuple[str, ...]] = {
    "dit": ("transformer", "transformer_2", "dit", "sr_dit", "language_model",
            "transformer_blocks", "model"),
    "encoder": ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder"),
    "vae": ("vae", "audio_vae"),
}

_warned_classes: set[type] = set()


def forget_scan_warnings() -> None:
    """Forget which pipeline classes the attribute scan has warned about: the next scan of each
    class warns again (the warning is given once per class and process)."""
    _warned_classes.clear()


def declares_components(pipeline: Any) -> bool:
    return isinstance(pipeline, SupportsComponentDiscovery) or any(
        hasattr(type(pipeline), name)
        for name in ("_dit_modules", "_encoder_modules", "_vae_modules")
    )


def supports_model_cpu_offload(pipeline: Any) -> bool:
    return callable(getattr(pipeline, "enable_omni_model_cpu_offload", None)) and callable(
        getattr(pipeline, "disable_omni_model_cpu_offload", None)
    )


_MISSING = object()


def get_submodule_path(root: Any, path: str) -> Any:
    """Follow a dotted path of attributes (integers index sequences); ``_MISSING`` if absent."""
    obj = root
    for part in path.split("."):
        if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)):
            index = int(part)
            if index >= len(obj):
                return _MISSING
            obj = obj[index]
            continue
        # Read through nn.Module's registries without triggering properties on the way.
        if isinstance(obj, nn.Module):
            for registry in ("_modules", "_parameters", "_buffers"):
                table = obj.__dict__.get(registry, {})
                if part in table:
                    obj = table[part]
                    break
            else:
                obj = _lookup_attribute(obj, part)
        else:
            obj = _lookup_attribute(obj, part)
        if obj is _MISSING:
            return _MISSING
    return obj


def _lookup_attribute(obj: Any, name: str) -> Any:
    if name in getattr(obj, "__dict__", {}):
        return obj.__dict__[name]
    try:
        # A class attribute (never a property: properties may run model code).
        attr = getattr(type(obj), name)
    except AttributeError:
        return _MISSING
    if isinstance(attr, property):
        return _MISSING
    if isinstance(attr, types.MemberDescriptorType):  # a __slots__ attribute: read its value
        try:
            return attr.__get__(obj, type(obj))
        except AttributeError:  # the slot was never set
            return _MISSING
    return attr


class ModuleCycleError(ValueError):
    """A module is registered as a child of its own descendant (the resolver reports it as an
    OffloadTopologyError)."""


def require_acyclic(root: nn.Module, prefix: str = "",
                    error: type[ValueError] = ModuleCycleError) -> None:
    """Raise ``error`` naming the back edge if ``root``'s module graph has a cycle.

    Every walk of a module tree (``named_modules(remove_duplicate=False)``, recursive
    ``_modules`` walks) recurses forever on a cycle, so this runs before them.  A module reachable
    under two parents is fine (each subtree is walked once); only a path back to an ancestor is
    a cycle.  Iterative, so a deep but acyclic tree does not hit the recursion limit either."""
    done: set[int] = set()
    on_path: dict[int, str] = {id(root): prefix.rstrip(".")}
    stack = [(root, iter(root._modules.items()))]
    while stack:
        module, children = stack[-1]
        for name, child in children:
            if child is None or id(child) in done:
                continue
            path = f"{on_path[id(module)]}.{name}".lstrip(".")
            if id(child) in on_path:
                ancestor = on_path[id(child)]
                shown = repr(ancestor) if ancestor else "'' (the pipeline)"
                raise error(
                    f"the module graph has a cycle: {path!r} -> {shown}; a module is registered "
                    f"as a child of its own descendant ({type(child).__name__} at {shown} "
                    "contains itself), and offloading walks modules as a tree.  Keep the back "
                    "reference out of the module tree (store it with object.__setattr__, or as a "
                    "weakref) so it is not a registered child"
                )
            on_path[id(child)] = path
            stack.append((child, iter(child._modules.items())))
            break
        else:
            stack.pop()
            done.add(id(module))
            on_path.pop(id(module), None)


@dataclass(frozen=True)
class ComponentSet:
    """Components of a pipeline by role: ``(path, module)`` pairs in declaration order."""

    dits: tuple[tuple[str, nn.Module], ...]
    encoders: tuple[tuple[str, nn.Module], ...]
    vaes: tuple[tuple[str, nn.Module], ...]
    residents: tuple[tuple[str, nn.Module], ...]
    declared: bool
    missing: tuple[tuple[str, str], ...]  # (role, path) declared but not found


def _declared_list(pipeline: Any, name: str) -> list[str]:
    value = getattr(pipeline, name, None)
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(
            f"{type(pipeline).__name__}.{name} must be a list of dotted attribute paths, "
            f"got {value!r}"
        )
    return list(value)


def discover_components(
    pipeline: Any, *, warn: Callable[[str], None] | None = None,
    check_acyclic: Callable[[nn.Module, str], None] | None = None,
) -> ComponentSet:
    """Find the pipeline's components; never mutates the pipeline.

    ``warn`` receives the scan's warning (default: :func:`warnings.warn`).  ``check_acyclic(root,
    prefix)`` is the cycle check run on the pipeline's module tree (an ``nn.Module`` pipeline) or
    on each found component's before anything walks it (default: :func:`require_acyclic`, which
    raises :class:`ModuleCycleError`); the resolver passes its own (``Resolver.check_acyclic``).
    """
    if check_acyclic is None:
        check_acyclic = require_acyclic
    missing: list[tuple[str, str]] = []
    seen: dict[int, str] = {}

    def collect(role: str, paths: list[str], *, scanned: bool = False) -> list[tuple[str, nn.Module]]:
        found = []
        for path in paths:
            module = get_submodule_path(pipeline, path)
            if module is _MISSING or module is None:
                missing.append((role, path))
                continue
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"{type(pipeline).__name__}: declared {role} path {path!r} is a "
                    f"{type(module).__name__}, not an nn.Module"
                )
            if id(module) in seen:
                # A scan finds names, not components: one module under two well-known names
                # (text_encoder = text_encoder_2) is one component, under its first name.  Two
                # explicit declarations of one module are a declaration error.
                if seen[id(module)] == path or scanned:
                    continue
                raise ValueError(
                    f"{type(pipeline).__name__}: the module at {path!r} is already declared as "
                    f"{seen[id(module)]!r}; declare each component once"
                )
            seen[id(module)] = path
            found.append((path, module))
        return found

    declared = declares_components(pipeline)
    if declared:
        dits = collect("dit", _declared_list(pipeline, "_dit_modules"))
        encoders = collect("encoder", _declared_list(pipeline, "_encoder_modules"))
        vaes = collect("vae", _declared_list(pipeline, "_vae_modules"))
        residents = collect("resident", _declared_list(pipeline, "_resident_modules"))
    else:
        cls = type(pipeline)
        if cls not in _warned_classes:
            _warned_classes.add(cls)
            message = (
                f"{cls.__module__}.{cls.__qualname__} declares no components; guessing them from "
                "attribute names. Declare _dit_modules, _encoder_modules and _vae_modules "
                "(offload_ref.SupportsComponentDiscovery) instead."
            )
            if warn is not None:
                warn(message)
            else:
                warnings.warn(message, OffloadDeclarationWarning, stacklevel=3)

        def scan(role: str) -> list[str]:
            return [
                name
                for name in FALLBACK_NAMES[role]
                if isinstance(get_submodule_path(pipeline, name), nn.Module)
            ]

        dits = collect("dit", scan("dit"), scanned=True)
        encoders = collect("encoder", scan("encoder"), scanned=True)
        vaes = collect("vae", scan("vae"), scanned=True)
        residents = []
        missing.clear()  # a scan reports what it finds, not what it looked for

    if isinstance(pipeline, nn.Module):
        check_acyclic(pipeline, "")
    else:
        for path, module in (*dits, *encoders, *vaes, *residents):
            check_acyclic(module, f"{path}.")
    dits = _outermost(dits)
    return ComponentSet(
        dits=tuple(dits),
        encoders=tuple(encoders),
        vaes=tuple(vaes),
        residents=tuple(residents),
        declared=declared,
        missing=tuple(missing),
    )


def _outermost(dits: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop a DiT nested inside another declared DiT (the split-model shape)."""
    kept = []
    for path, module in dits:
        nested = any(
            other is not module and any(sub is module for sub in other.modules())
            for _, other in dits
        )
        if not nested:
            kept.append((path, module))
    return kept
