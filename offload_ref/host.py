"""Host masters: the one authoritative host copy of every offloaded tensor.

Note [Host master layout]
    Tensors are grouped by the storage they view.  Each storage contributes one *segment*: the
    span of elements ``[lo, hi)`` that its tensors touch.  Segments are packed into one flat buffer
    per dtype, allocated with exact sizes (pinned where the platform can pin).  Each tensor is
    recorded as ``(segment, shape, stride, storage_offset)``, so it is rebuilt with
    ``as_strided`` over any buffer with the same layout: the host master itself, a device copy,
    or a ring slot.  Views, transposed weights and tensors that share storage therefore keep
    their strides and their sharing through every move.  Masters are immutable: offloading
    rebinds a tensor to its master view and never copies device -> host during inference.

``nn.Parameter`` objects are never replaced; only their ``.data`` is rebound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .platform.base import Platform

__all__ = ["HostMaster", "Layout", "TensorRecord", "storage_key", "tensor_extent"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage a tensor views (device + base pointer)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the elements of its storage that ``t`` can touch."""
    lo = t.storage_offset()
    if t.numel() == 0:
        return lo, lo
    return lo, lo + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


@dataclass(frozen=True)
class _Segment:
    dtype: torch.dtype
    lo: int  # first element of the source storage that is used
    numel: int  # hi - lo
    offset: int  # position in the per-dtype flat buffer


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives inside a :class:`Layout`."""

    name: str
    segment: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # element offset inside the per-dtype flat buffer

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        # as_strided offsets count from the start of the storage, not of ``flat``.
        return torch.as_strided(flat, self.shape, self.stride, flat.storage_offset() + self.offset)


class Layout:
    """The packing of a set of tensors into one flat buffer per dtype (Note [Host master layout]).

    ``tensors`` is a sequence of ``(name, tensor)``; the same tensor object may appear once.
    """

    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        by_storage: dict[tuple[str, int], list[int]] = {}
        for i, (name, t) in enumerate(tensors):
            if t.device.type == "meta":
                raise ValueError(
                    f"cannot offload {name!r}: it is a meta tensor (never materialized); load its "
                    "weights before enabling offload"
                )
            if t.is_sparse or t.layout is not torch.strided:
                raise ValueError(f"cannot offload {name!r}: only strided dense tensors are supported")
            # An empty tensor touches no element: it shares nothing, whatever its data_ptr says
            # (every storage-less tensor reports 0), and it must not widen a neighbour's span.
            key = storage_key(t) if t.numel() else ("empty", i)
            by_storage.setdefault(key, []).append(i)
        self.segments: list[_Segment] = []
        self.numel: dict[torch.dtype, int] = {}
        records: list[TensorRecord | None] = [None] * len(tensors)
        self._sources: list[torch.Tensor] = []  # one tensor per segment, for copying
        for indices in by_storage.values():
            dtypes = {tensors[i][1].dtype for i in indices}
            if len(dtypes) != 1:
                names = [tensors[i][0] for i in indices]
                raise ValueError(
                    f"tensors {names} share one storage with different dtypes {sorted(map(str, dtypes))}; "
                    "offloading such reinterpreting views is not supported"
                )
            dtype = dtypes.pop()
            extents = [tensor_extent(tensors[i][1]) for i in indices]
            if all(tensors[i][1].numel() == 0 for i in indices):
                extents = [(0, 0)]
            lo = min(e[0] for e in extents)
            hi = max(e[1] for e in extents)
            offset = self.numel.get(dtype, 0)
            seg_index = len(self.segments)
            self.segments.append(_Segment(dtype, lo, hi - lo, offset))
            self.numel[dtype] = offset + (hi - lo)
            self._sources.append(tensors[indices[0]][1])
            for i in indices:
                name, t = tensors[i]
                local = t.storage_offset() - lo if t.numel() else 0
                records[i] = TensorRecord(
                    name, seg_index, tuple(t.shape), tuple(t.stride()), offset + local)
        self.records: tuple[TensorRecord, ...] = tuple(r for r in records if r is not None)

    @property
    def nbytes(self) -> int:
        return sum(n * _element_size(d) for d, n in self.numel.items())

    def views(self, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Rebuild every recorded tensor over ``flats`` (one flat buffer per dtype)."""
        return [r.view(flats[self.segments[r.segment].dtype]) for r in self.records]

    def pack_into(self, flats: dict[torch.dtype, torch.Tensor], copy) -> None:
        """Copy each segment of the source tensors into ``flats`` with ``copy(dst, src)``."""
        for seg, src in zip(self.segments, self._sources):
            if seg.numel == 0:
                continue
            span = torch.as_strided(src, (seg.numel,), (1,), seg.lo)
            copy(flats[seg.dtype].narrow(0, seg.offset, seg.numel), span)

    def drop_sources(self) -> None:
        self._sources = []


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class HostMaster:
    """An immutable host copy of the tensors of a :class:`Layout` (Note [Host master layout])."""

    def __init__(self, layout: Layout, platform: Platform, *, pin: bool) -> None:
        self.layout = layout
        self.platform = platform
        self.pinned = bool(pin and platform.pin_memory_supported)
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        try:
            for dtype, numel in layout.numel.items():
                self.flats[dtype] = platform.host_empty(numel, dtype, pin=self.pinned)
            # Setup copy (may be device -> host when the pipeline started on the device); never
            # part of an autograd graph.
            layout.pack_into(self.flats, lambda dst, src: dst.copy_(src.detach()))
        except BaseException:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def host_views(self) -> list[torch.Tensor]:
        return self.layout.views(self.flats)

    def release(self) -> None:
        flats, self.flats = self.flats, {}
        for flat in flats.values():
            self.platform.host_free(flat)


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """First name of every distinct tensor object (parameters and buffers can repeat)."""
    seen: set[int] = set()
    out = []
    for name, t in named:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out
