"""The inference-tensor conversions: enable makes inference tensors ordinary, disable makes them
inference tensors again.

Note [Inference tensors]
    A pipeline built under ``torch.inference_mode()`` holds inference tensors.  Rebinding the
    ``.data`` of one to an ordinary tensor (a host master view, a device copy, a ring slot)
    leaves a tensor that every later op rejects ("Inference tensors do not track version
    counter"), in or out of inference mode.  So the first rebind of enable turns each inference
    tensor into an ordinary one in place (``torch.utils.swap_tensors``: the same Python object,
    class and attributes; undone exactly on rollback), and ``disable`` rebuilds the segments that
    held inference tensors as inference tensors again.  Forward works in or out of inference
    mode while enabled, and in the mode the pipeline was built for after disable.
"""

from __future__ import annotations

import torch

from .rebind_guard import set_data

__all__ = ["rebind_restored"]


def normal_twin(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """An ordinary tensor viewing ``data`` with ``t``'s class and attributes: what the inference
    tensor ``t`` becomes by :func:`swap_in` (Note [Inference tensors]).  Changes nothing."""
    fresh = data.detach()
    if type(t) is not torch.Tensor:  # nn.Parameter and its subclasses
        fresh = torch.Tensor._make_subclass(type(t), fresh, t.requires_grad)
    fresh.__dict__.update(t.__dict__)
    return fresh


def swap_in(label: str, t: torch.Tensor, twin: torch.Tensor) -> None:
    """Swap ``t`` with its :func:`normal_twin`, keeping the Python object: afterwards ``twin``
    holds the original."""
    try:
        torch.utils.swap_tensors(t, twin)
    except RuntimeError as exc:
        raise RuntimeError(
            f"{label}: a tensor created under torch.inference_mode() cannot be converted for "
            f"offloading ({exc}); drop the other references to it, or build the pipeline "
            "outside inference_mode"
        ) from exc


def rebind_restored(t: torch.Tensor, v: torch.Tensor) -> None:
    """Give ``t`` its restored storage ``v`` at disable; an inference ``v`` (from a segment that
    held inference tensors) makes ``t`` a genuine inference tensor again (Note [Inference
    tensors])."""
    if not v.is_inference():
        set_data(t, v)
        return
    with torch.inference_mode():
        fresh = v.detach()
        if type(t) is not torch.Tensor:
            fresh = torch.Tensor._make_subclass(type(t), fresh, t.requires_grad)
    fresh.__dict__.update(t.__dict__)
    torch.utils.swap_tensors(t, fresh)
