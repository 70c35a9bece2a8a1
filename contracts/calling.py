"""How the kit calls what an author hands it: a ``"module:attr"`` reference imported
(:func:`load_object`), and a factory or inputs called for a seed, with ``seed=`` when it takes one
(:func:`takes_seed`, :func:`call_seeded`) and otherwise under a seeded, restored RNG
(:func:`call_unseeded`).

Below both :mod:`.spec` (a spec calls its factory and inputs) and :mod:`.refs` (a reference becomes a
spec), which is why it is a module of its own.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["RefError", "call_seeded", "call_unseeded", "load_object", "takes_seed"]


class RefError(ValueError):
    """A ``module:attr`` reference that cannot be used; the message is one line."""


def load_object(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """Import ``"package.module:attr"`` (dotted attrs allowed); callables pass through."""
    if callable(ref):
        return ref
    if not isinstance(ref, str) or ":" not in ref:
        raise ValueError(f"expected an importable reference 'package.module:attr', got {ref!r}")
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def takes_seed(func: Callable[..., Any], ref: str) -> bool:
    """Whether ``func`` is called ``func(seed=...)`` (else ``func()``); :class:`RefError` when it
    needs any other argument."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin): call it without arguments
        return False
    required = [p.name for p in params if p.default is p.empty and p.name != "seed"
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise RefError(f"{ref!r} needs argument(s) {', '.join(required)}: a factory must take "
                       f"no arguments or only seed= (wrap it in one that does)")
    return any(p.name == "seed" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD
               for p in params)


def call_unseeded(func: Callable[[], Any], seed: int) -> Any:
    """``func()`` under ``torch.manual_seed(seed)``; the caller's RNG state (the host's and every
    accelerator device's, which ``torch.manual_seed`` also reseeds) is restored after."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    devices = range(torch.accelerator.device_count()) if accelerator is not None else []
    with torch.random.fork_rng(devices=devices,
                               device_type=accelerator.type if accelerator else "cuda"):
        torch.manual_seed(seed)
        return func()


def call_seeded(func: Callable[..., Any], seed: int, ref: str) -> Any:
    """``func(seed=seed)``, or :func:`call_unseeded` for a callable taking no arguments
    (:func:`takes_seed`; ``ref`` names ``func`` in its :class:`RefError`)."""
    return func(seed=seed) if takes_seed(func, ref) else call_unseeded(func, seed)
