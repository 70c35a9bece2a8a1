"""What a pipeline returns, as the kit compares it: leaf by leaf.

A generation may return a tensor, a tuple or list, a mapping (diffusers' output classes are
``OrderedDict`` subclasses), a dataclass, or any nesting of them.  :func:`leaves` flattens such
an output into ``(path, leaf)`` pairs in a stable order, so that two outputs compare leaf by leaf
and a difference is reported at its path (``output['images'][0]``).  A numpy array or a PIL
image (diffusers' ``output_type="np"`` / ``"pil"``) is compared as the tensor of its values; a
leaf that is neither a container nor an array (a number, a string, ``None``) is compared with
``==``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["OutputStructureError", "leaves", "structure"]

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


class OutputStructureError(TypeError):
    """An output holds something the kit cannot compare (an object of an unknown type)."""


def leaves(output: Any, path: str = "output") -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every tensor or scalar in ``output``; containers are walked.

    Raises :class:`OutputStructureError` naming the path of a leaf of any other type (a PIL
    image, a numpy array, an object): the kit compares tensors bitwise and would otherwise
    have to guess what equality means for it.
    """
    if isinstance(output, torch.Tensor) or isinstance(output, _SCALARS):
        return [(path, output)]
    if hasattr(output, "__array_interface__") or hasattr(output, "__array__"):
        # numpy arrays and PIL images (diffusers' output_type="np" / "pil"): compared bitwise
        # as tensors of the same values
        return [(path, _as_tensor(output, path))]
    if isinstance(output, Mapping):
        out = []
        for key in output:
            out += leaves(output[key], f"{path}[{key!r}]")
        return out
    if isinstance(output, (tuple, list)):
        out = []
        for i, item in enumerate(output):
            out += leaves(item, f"{path}[{i}]")
        return out
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        out = []
        for f in dataclasses.fields(output):
            out += leaves(getattr(output, f.name), f"{path}.{f.name}")
        return out
    raise OutputStructureError(
        f"{path} is a {type(output).__module__}.{type(output).__qualname__}: the kit compares "
        f"tensors (and numbers, strings, None) inside tuples, lists, mappings and dataclasses; "
        f"return tensors (e.g. output_type='pt' for a diffusers pipeline)")


def _as_tensor(array: Any, path: str) -> torch.Tensor:
    import numpy as np

    values = np.asarray(array)
    if values.dtype == object or not values.dtype.isnative:
        raise OutputStructureError(
            f"{path} is an array of dtype {values.dtype}: the kit compares numeric arrays; "
            f"return tensors (e.g. output_type='pt' for a diffusers pipeline)")
    return torch.from_numpy(np.ascontiguousarray(values).copy())


def structure(output: Any) -> list[tuple[str, str]]:
    """``(path, kind)`` of every leaf: what two outputs must share before values are compared
    (a tensor's kind is its shape and dtype)."""
    out = []
    for path, leaf in leaves(output):
        if isinstance(leaf, torch.Tensor):
            out.append((path, f"tensor{tuple(leaf.shape)} {leaf.dtype}"))
        else:
            out.append((path, type(leaf).__name__))
    return out
