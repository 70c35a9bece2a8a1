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

Note [Aligned layout]
    Kernels choose their code path by address alignment: MKL's matrix-vector product gives other
    last bits for a weight that is not 16-byte aligned, cuBLAS(Lt) and vectorized CUDA kernels
    prefer 256-byte alignment.  So every tensor an offloader rebinds keeps its *alignment phase*,
    ``phase(t) = t.data_ptr() % min(A, 64)``, and is placed at an address congruent to that phase
    modulo ``A``, the platform's ``alignment`` (64 bytes on the CPU platform, 256 on CUDA); 64 is
    the alignment every torch allocator gives a fresh storage.  The phase is the address's, the
    storage's own start included: a safetensors mmap view sits wherever its file put it (a
    storage 4 bytes past a boundary keeps those 4 bytes), and the kit's un-offloaded reference
    keeps it too (``move_to_device`` in contracts/case.py), so the two compute at one alignment
    (Note [Both alignment phases] in contracts/checks/distributed.py).  On the CPU platform the
    address modulo 64 is therefore unchanged, which is what makes bitwise parity hold on every
    CPU.  On
    CUDA a tensor keeps its address modulo 64 and never loses alignment: a host tensor that sits
    64 bytes into some 256-byte window (allocator chance) gets a 256-byte aligned device copy.

    Each segment gets a *region* of ``round_up(phase + bytes, A)`` bytes starting on an A-aligned
    offset of its dtype's flat buffer and begins ``phase`` bytes into it.  Every flat buffer starts
    A-aligned (the platforms guarantee it), so a tensor keeps its phase in the host master, in a
    device copy, in a ring slot (whose dtype sections start A-aligned, since regions are
    multiples of A) and in the storage ``disable`` rebuilds.  A region's size depends on its segment
    alone, so padded sizes add up over any grouping: the plan predicts them without building
    layouts (:func:`padded_span_bytes`).  Padding is held and copied but never counted as weight
    bytes: ``Layout.weight_bytes`` excludes it, ``Layout.padding_bytes`` is the rest.

    The phase and the region size are a :class:`LayoutRule`'s.  A platform may name another rule
    in its optional ``layout_rule`` attribute (:func:`layout_rule` reads it; the host masters,
    device copies and slots of a backend on that platform follow it).  offload-ref's platforms
    name none; the kit's mutants name broken ones (tensors packed back to back, or moved onto
    region boundaries).

``nn.Parameter`` objects are never replaced; only their ``.data`` is rebound (and, while a backend
is enabled, their class is a subclass guarding ``.data``: Note [Rebind guard] in
backends/rebind_guard.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ._interrupts import interruption_point
from .platform.base import Platform, aligned_empty

__all__ = [
    "ALLOCATOR_ALIGNMENT",
    "HostMaster",
    "Layout",
    "TensorRecord",
    "DEFAULT_LAYOUT_RULE",
    "LayoutRule",
    "address_phase",
    "aligned_empty",
    "layout_rule",
    "padded_span_bytes",
    "span_facts",
    "region_bytes",
    "storage_key",
    "tensor_extent",
]

#: The alignment every torch allocator gives a fresh storage (c10's CPU allocator; CUDA's caching
#: allocator gives 512).  Note [Aligned layout].
ALLOCATOR_ALIGNMENT = 64


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage a tensor views (device + base pointer)."""
    # ``is_cpu`` first: formatting ``t.device`` dominated enable's per-tensor cost.
    return ("cpu" if t.is_cpu else str(t.device), t.untyped_storage().data_ptr())


def tensor_extent(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the elements of its storage that ``t`` can touch."""
    lo = t.storage_offset()
    numel = t.numel()
    if numel == 0:
        return lo, lo
    if t.is_contiguous():  # the sum below, without a Python loop over the dimensions
        return lo, lo + numel
    return lo, lo + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def _storage_phase(storage_ptr: int, byte_offset: int, alignment: int) -> int:
    return (storage_ptr + byte_offset) % min(alignment, ALLOCATOR_ALIGNMENT)


def address_phase(t: torch.Tensor, alignment: int) -> int:
    """The alignment phase of ``t`` in bytes (Note [Aligned layout]): a tensor rebound by an
    offloader on a platform of this ``alignment`` sits at an address congruent to it modulo
    ``alignment``."""
    return _storage_phase(t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size(),
                          alignment)


def region_bytes(phase: int, nbytes: int, alignment: int) -> int:
    """Bytes of the aligned region that holds a segment of ``nbytes`` starting ``phase`` bytes
    past an ``alignment`` boundary (0 for an empty segment)."""
    if nbytes == 0:
        return 0
    return -(-(phase + nbytes) // alignment) * alignment


class LayoutRule:
    """Where a segment sits in its aligned region, and how large the region is (Note [Aligned
    layout]).

    Seams (a subclass may override):

    * :meth:`phase` ``(storage_ptr, byte_offset, alignment)`` -- the bytes past the region's
      aligned start at which the segment that starts ``byte_offset`` bytes into the storage at
      ``storage_ptr`` is placed.
    * :meth:`region_bytes` ``(phase, nbytes, alignment)`` -- the bytes of the region holding a
      segment of ``nbytes`` placed ``phase`` bytes past its start.
    """

    def phase(self, storage_ptr: int, byte_offset: int, alignment: int) -> int:
        """The segment's alignment phase: its address modulo ``min(alignment, 64)``."""
        return _storage_phase(storage_ptr, byte_offset, alignment)

    def region_bytes(self, phase: int, nbytes: int, alignment: int) -> int:
        """:func:`region_bytes`: ``phase + nbytes`` rounded up to ``alignment``."""
        return region_bytes(phase, nbytes, alignment)


#: The rule of Note [Aligned layout].
DEFAULT_LAYOUT_RULE = LayoutRule()


def layout_rule(platform: Platform) -> LayoutRule:
    """The rule layouts on ``platform`` follow: its optional ``layout_rule`` attribute, else
    :data:`DEFAULT_LAYOUT_RULE`."""
    rule = getattr(platform, "layout_rule", None)
    return DEFAULT_LAYOUT_RULE if rule is None else rule


# Note [Span facts]
#     One resolution asks for the span bytes of the same tensors several times (the device and
#     host predictions, each ring's slot size, the pipeline's other state), and a tensor's
#     storage key and extent were computed four to five times per resolution: a third of it on
#     the fixtures.  Inside ``span_facts()`` each tensor's (storage key, extent, element size) is
#     computed once and kept, with the tensor itself so that its id cannot be reused, until the
#     outermost block exits; outside one nothing is kept.  The tensors must not change storage
#     or shape inside the block (a resolution only reads them).


_FACTS: contextvars.ContextVar[dict[int, tuple] | None] = contextvars.ContextVar(
    "offload_ref_span_facts", default=None)


@contextlib.contextmanager
def span_facts() -> Iterator[None]:
    """Compute each tensor's span facts once inside the block (Note [Span facts])."""
    if _FACTS.get() is not None:
        yield
        return
    token = _FACTS.set({})
    try:
        yield
    finally:
        _FACTS.reset(token)


def _span_fact(t: torch.Tensor, facts: dict[int, tuple] | None) -> tuple:
    """``(tensor, storage key, lo, hi, element size)`` of ``t`` (lo == hi: empty)."""
    if facts is not None:
        fact = facts.get(id(t))
        if fact is not None:
            return fact
    lo, hi = tensor_extent(t)
    fact = (t, storage_key(t) if hi > lo else None, lo, hi, t.element_size())
    if facts is not None:
        facts[id(t)] = fact
    return fact


def padded_span_bytes(tensors: Iterable[torch.Tensor], alignment: int,
                      rule: LayoutRule = DEFAULT_LAYOUT_RULE) -> int:
    """Bytes a :class:`Layout` of ``tensors`` allocates: per storage, the aligned region of the
    span its tensors touch (Note [Aligned layout]; ``rule`` places them)."""
    spans: dict[tuple[str, int], list[int]] = {}
    facts = _FACTS.get()
    for t in tensors:
        _, key, lo, hi, size = _span_fact(t, facts)
        if hi == lo:
            continue
        span = spans.get(key)
        if span is None:
            spans[key] = [lo, hi, size]
            continue
        if lo < span[0]:
            span[0] = lo
        if hi > span[1]:
            span[1] = hi
    total = 0
    for (_, ptr), (lo, hi, size) in spans.items():
        total += rule.region_bytes(rule.phase(ptr, lo * size, alignment), (hi - lo) * size,
                                   alignment)
    return total


@dataclass(frozen=True)
class _Segment:
    dtype: torch.dtype
    lo: int  # first element of the source storage that is used
    numel: int  # hi - lo
    offset: int  # position in the per-dtype flat buffer (phase included)
    phase: int = 0  # elements between the region's aligned start and ``offset``
    region: int = 0  # elements of the aligned region (phase + numel + tail padding)

    @property
    def region_start(self) -> int:
        return self.offset - self.phase


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
    """The packing of a set of tensors into one flat buffer per dtype (Note [Host master layout]),
    each segment at its alignment phase modulo ``alignment`` bytes (Note [Aligned layout]).

    ``tensors`` is a sequence of ``(name, tensor)``; the same tensor object may appear once.
    ``rule`` places each segment in its region (:func:`layout_rule` of the platform).
    """

    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]], *,
                 alignment: int = ALLOCATOR_ALIGNMENT,
                 rule: LayoutRule = DEFAULT_LAYOUT_RULE) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.rule = rule
        by_storage: dict[tuple[str, int], list[int]] = {}
        for i, (name, t) in enumerate(tensors):
            if t.is_meta:  # a property read: formatting ``t.device`` costs ~1 µs per tensor
                raise ValueError(
                    f"cannot offload {name!r}: it is a meta tensor (never materialized); load its "
                    "weights before enabling offload (a model built under init_empty_weights, or "
                    "one that accelerate's cpu_offload / device_map hooks moved to the meta "
                    "device, must be loaded, or those hooks removed, first)"
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
            source = tensors[indices[0]][1]
            itemsize = source.element_size()
            if alignment % itemsize:
                raise ValueError(f"alignment {alignment} is not a multiple of {dtype}'s size")
            if hi > lo:
                phase_bytes = rule.phase(source.untyped_storage().data_ptr(), lo * itemsize,
                                         alignment)
                phase = phase_bytes // itemsize  # a storage base is element-aligned
                region = rule.region_bytes(phase_bytes, (hi - lo) * itemsize,
                                           alignment) // itemsize
            else:
                phase = region = 0
            start = self.numel.get(dtype, 0)  # a multiple of alignment / itemsize
            offset = start + phase
            seg_index = len(self.segments)
            self.segments.append(_Segment(dtype, lo, hi - lo, offset, phase, region))
            self.numel[dtype] = start + region
            self._sources.append(source)
            for i in indices:
                name, t = tensors[i]
                local = t.storage_offset() - lo if t.numel() else 0
                records[i] = TensorRecord(
                    name, seg_index, tuple(t.shape), tuple(t.stride()), offset + local)
        self.records: tuple[TensorRecord, ...] = tuple(r for r in records if r is not None)

    @cached_property  # segments are fixed at construction; read on every fill
    def nbytes(self) -> int:
        """Bytes of the flat buffers, alignment padding included."""
        return sum(n * _element_size(d) for d, n in self.numel.items())

    @cached_property  # segments are fixed at construction; read on every fill
    def weight_bytes(self) -> int:
        """Bytes of the segments themselves (what the tensors touch), padding excluded."""
        return sum(s.numel * _element_size(s.dtype) for s in self.segments)

    @cached_property
    def padding_bytes(self) -> int:
        return self.nbytes - self.weight_bytes

    def views(self, flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Rebuild every recorded tensor over ``flats`` (one flat buffer per dtype)."""
        return [r.view(flats[self.segments[r.segment].dtype]) for r in self.records]

    def pack_into(self, flats: dict[torch.dtype, torch.Tensor], copy) -> None:
        """Copy each segment of the source tensors into ``flats`` with ``copy(dst, src)``."""
        for seg, src in zip(self.segments, self._sources):
            if seg.numel == 0:
                continue
            interruption_point()  # Note [Deferred interrupts]: enable stops here on Ctrl-C
            span = torch.as_strided(src, (seg.numel,), (1,), seg.lo)
            copy(flats[seg.dtype].narrow(0, seg.offset, seg.numel), span)

    def drop_sources(self) -> None:
        self._sources = []


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no allocation: this runs on every fill (count_fill)


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
        for dtype in list(self.flats):  # each forgotten on the line that frees it: a retry
            self.platform.host_free(self.flats[dtype]); del self.flats[dtype]  # noqa: E702


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


# -- the host budget ---------------------------------------------------------------------------

# Note [Host budget]
#     Users of offloading run out of host memory before device memory: a container's limit
#     kills the process (the OOM killer, not an exception), and a caching pinned allocator
#     rounds each request up (five 1.20 GiB requests locked 10.01 GiB: sglang #39021).  So
#     ``enable()`` compares the host bytes its plan allocates (``ResolvedOffloadPlan.
#     host_allocations``, Note [Host bytes] in plan/prediction.py), each pinned one as the
#     platform locks it (``Platform.host_lock_bytes``, where a platform has it), with a budget,
#     before any allocation, and refuses with the numbers and the largest parts.  The budget is
#     ``OffloadConfig.host_budget_bytes``, or by default the room left in the process's memory
#     cgroup (v2 ``memory.max`` - ``memory.current``; v1 ``memory.limit_in_bytes`` -
#     ``memory.usage_in_bytes``) less a margin of 1/16 of the limit, when the process runs under
#     a limit; else there is none.  The margin leaves room for what enable does not predict
#     (activations, a staging pool, the allocator's own rounding); the masters are compared
#     with the room left, not the limit, because the pipeline's own weights are still in host
#     memory while enable copies them.


class HostBudgetError(RuntimeError):
    """``enable()`` would allocate more host bytes than ``OffloadConfig.host_budget_bytes`` (or
    the room left in the container's memory limit) allows; raised before any allocation."""


def container_memory(root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, int] | None:
    """``(limit, usage)`` in bytes of this process's memory cgroup (v2, else v1), or None when
    it has no limit or none can be read (Note [Host budget])."""
    import os

    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            candidates.append((os.path.join(root, rel, "memory.max"),
                               os.path.join(root, rel, "memory.current")))
        elif "memory" in controllers.split(","):
            base = os.path.join(root, "memory", rel)
            candidates.append((os.path.join(base, "memory.limit_in_bytes"),
                               os.path.join(base, "memory.usage_in_bytes")))
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path) as f:
                text = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        if limit >= 1 << 60:  # v1's "no limit" is a page-rounded LONG_MAX
            return None
        return limit, usage
    return None


def host_budget(configured: int | None) -> tuple[int, str] | None:
    """``(budget, where it comes from)`` for ``OffloadConfig.host_budget_bytes`` =
    ``configured`` (Note [Host budget]); None when there is none."""
    if configured is not None:
        return configured, "OffloadConfig.host_budget_bytes"
    room = container_memory()
    if room is None:
        return None
    limit, usage = room
    return (limit - usage - limit // 16,
            f"the room left in this container's memory limit ({limit} bytes, {usage} in use, "
            f"less a margin of {limit // 16}; set OffloadConfig.host_budget_bytes to choose)")


def require_host_budget(subject: str, allocations: Sequence[tuple[str, int]], platform: Platform,
                        pin: bool, configured: int | None) -> None:
    """Raise :class:`HostBudgetError` when ``allocations`` (``(what, requested bytes)``), each
    pinned one as ``platform`` locks it, exceed the budget (Note [Host budget])."""
    budget = host_budget(configured)
    if budget is None or not allocations:
        return
    limit, source = budget
    pinned = pin and bool(getattr(platform, "pin_memory_supported", False))
    lock = getattr(platform, "host_lock_bytes", None) if pinned else None
    need = [(what, lock(n) if lock is not None else n) for what, n in allocations]
    total = sum(n for _, n in need)
    if total <= limit:
        return
    parts: dict[str, int] = {}
    for what, n in need:
        part = what.rsplit(" (", 1)[0]
        parts[part] = parts.get(part, 0) + n
    largest = sorted(parts.items(), key=lambda item: -item[1])[:3]
    locked = (f", as {type(platform).__name__} locks pinned memory ({sum(n for _, n in allocations)}"
              " requested)") if lock is not None and total != sum(n for _, n in allocations) else ""
    raise HostBudgetError(
        f"{subject}: enable() would allocate {total} host bytes for its host masters"
        f"{locked}, over the host budget of {limit} bytes ({source}); nothing was allocated. "
        f"Largest parts: " + ", ".join(f"{p} {n}" for p, n in largest) + ".  Offload fewer "
        "components or blocks (layerwise masters only the streamed blocks; resident blocks "
        "need none), or raise the budget")
