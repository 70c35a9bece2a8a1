"""Modeled device timelines: what a program's stream order would cost on a given GPU.

Note [Modeled timeline]
    A benchmark on this machine cannot say whether an offloader's copies would overlap its
    compute on a GPU: the simulated accelerator (``hpu``) runs every stream in program order,
    and a shared 2-core host measures noise.  What the program *asks for* is exact, though: the
    simulated device's stream sanitizer sees every op on its stream, every wait of one stream
    for another (an event wait, a copy between devices) and every time the host waits for the
    device (a synchronize, a blocking copy, a query that answered done), each with its vector
    clock (Note [Modeled timeline] in simdevice.cpp).  :func:`recording` keeps that record for a
    block of code, and :func:`replay` runs it on a :class:`DeviceModel`:

    * the host launches the ops in their order, ``launch_us`` apart, and stops at each of its
      waits until what it waits for has finished;
    * an op starts when the host has launched it, its stream's previous op has finished, what
      its stream was made to wait for has finished, and its engine is free; the engines are one
      compute engine (ops of every stream share it, one at a time) and a copy engine in each
      direction (``h2d_gbps``, ``d2h_gbps``; a non_blocking copy from pageable memory at
      ``pageable_fraction`` of the pinned rate);
    * a compute op lasts ``max(FLOPs / rate, bytes / memory bandwidth, kernel_min_us)``: FLOPs
      of matrix products, convolutions and attention from their operands' shapes, the rate by
      element size (``tflops_fp32``; ``tflops_16`` for 16-bit operands); every other op by the
      bytes it reads and writes.

    The result is deterministic: the same program gives the same modeled times on every run and
    every machine.  ``bound`` is ``max(compute, streamed bytes / h2d bandwidth)``: no offloader
    can finish a step sooner than its compute, nor sooner than its copies.  ``idle`` is the time
    no engine was busy, the device waiting for its host: a step whose work never overlaps takes
    exactly compute + copies (the serial sum) + idle, and an offloader that synchronizes the
    host on every copy (a blocking ``.to()``) exposes one launch after each of them there.  What the model
    leaves out (kernels of two streams running side by side, PCIe contention with other
    traffic, the host's own Python time beyond ``launch_us`` per op) is the same for every
    offloader it compares.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["MODELS", "DeviceModel", "Op", "Timeline", "model_named", "recording", "replay"]


@dataclass(frozen=True)
class DeviceModel:
    """A GPU as the timeline sees it.  Rates are sustained ones, not peaks where they differ
    (say which in ``sources``)."""

    name: str
    #: pinned host -> device and device -> host copy rates, GB/s (10^9 bytes per second)
    h2d_gbps: float
    d2h_gbps: float
    #: device memory bandwidth, GB/s: device-to-device copies and ops timed by their bytes
    memory_gbps: float
    #: dense FLOP rates, TFLOP/s: 32-bit operands (no TF32), 16-bit operands (tensor cores)
    tflops_fp32: float
    tflops_16: float
    #: host time to launch one op, and the shortest op the device runs, microseconds
    launch_us: float = 4.0
    kernel_min_us: float = 2.0
    #: a non_blocking copy from pageable host memory runs at this fraction of the pinned rate
    pageable_fraction: float = 0.5
    #: where each figure comes from
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("h2d_gbps", "d2h_gbps", "memory_gbps", "tflops_fp32", "tflops_16"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DeviceModel.{name} = {value!r}: a positive number")
        for name in ("launch_us", "kernel_min_us"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"DeviceModel.{name} = {value!r}: a number >= 0")
        if not 0 < self.pageable_fraction <= 1:
            raise ValueError(f"DeviceModel.pageable_fraction = {self.pageable_fraction!r}: in "
                             "(0, 1]")


_LAUNCH = ("launch_us 4 and kernel_min_us 2: the order of a PyTorch eager op's host cost and "
           "of the shortest kernel; an assumption, the same for every model")
_PCIE5 = ("host link PCIe 5.0 x16: 63 GB/s per direction after encoding (32 GT/s x 16 lanes x "
          "128/130); 80% of it (50 GB/s) assumed sustained for pinned copies")

#: The models ``offload-ref bench --model NAME`` knows.
MODELS: dict[str, DeviceModel] = {
    "h100-pcie": DeviceModel(
        "h100-pcie", h2d_gbps=50.0, d2h_gbps=50.0, memory_gbps=2000.0, tflops_fp32=51.0,
        tflops_16=756.0,
        sources=("NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column: FP32 51 TFLOPS, "
                 "BF16/FP16 tensor 1,513 TFLOPS with sparsity (756 dense), GPU memory "
                 "bandwidth 2 TB/s (HBM2e)", _PCIE5, _LAUNCH)),
    "h200": DeviceModel(
        "h200", h2d_gbps=50.0, d2h_gbps=50.0, memory_gbps=4800.0, tflops_fp32=67.0,
        tflops_16=989.0,
        sources=("NVIDIA H200 product page, H200 SXM column: FP32 67 TFLOPS, BF16/FP16 tensor "
                 "1,979 TFLOPS with sparsity (989 dense), 4.8 TB/s HBM3e", _PCIE5, _LAUNCH)),
    "rtx-4090": DeviceModel(
        "rtx-4090", h2d_gbps=25.0, d2h_gbps=25.0, memory_gbps=1008.0, tflops_fp32=82.6,
        tflops_16=165.2,
        sources=("NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: FP32 82.6 TFLOPS, "
                 "FP16/BF16 tensor with FP32 accumulate 165.2 TFLOPS dense, 1,008 GB/s GDDR6X",
                 "host link PCIe 4.0 x16: 31.5 GB/s per direction; 80% (25 GB/s) assumed "
                 "sustained for pinned copies", _LAUNCH)),
}


def model_named(text: str) -> DeviceModel:
    """A model of :data:`MODELS` by name, or one given as ``key=value`` pairs separated by
    commas (``h2d_gbps=25,tflops_fp32=80,...``: every field but ``name`` and ``sources``,
    missing ones taken from ``base=NAME``, default h100-pcie)."""
    if text in MODELS:
        return MODELS[text]
    if "=" not in text:
        raise ValueError(f"--model {text!r}: no model of that name (models: "
                         f"{', '.join(MODELS)}), and not key=value pairs")
    pairs = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--model {text!r}: {item!r} is not key=value")
        pairs[key.strip()] = value.strip()
    base = MODELS.get(pairs.pop("base", "h100-pcie"))
    if base is None:
        raise ValueError(f"--model {text!r}: base= names one of {', '.join(MODELS)}")
    fields = asdict(base)
    for key, value in pairs.items():
        if key not in fields or key in ("name", "sources"):
            raise ValueError(f"--model {text!r}: unknown field {key!r} (fields: "
                             f"{', '.join(k for k in fields if k not in ('name', 'sources'))})")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ValueError(f"--model {text!r}: {key}={value!r} is not a number") from None
    fields["name"] = f"custom ({text})"
    fields["sources"] = (f"given on the command line over {base.name}",)
    return DeviceModel(**fields)


@dataclass(frozen=True)
class Op:
    """One entry of a recorded timeline (Note [Modeled timeline] in simdevice.cpp)."""

    kind: str  # "op", "wait" (a stream waits for ``clock``), "host_wait" (the host does)
    stream: int  # the stream's key (device << 48 | stream id); the host's for "host_wait"
    seq: int = 0
    name: str = ""
    copy: str = ""  # "", "h2d", "d2h", "d2d", "h2d_pageable"
    bytes: int = 0
    flops: float = 0.0
    element_size: int = 0
    clock: dict[int, int] = field(default_factory=dict)


_COPY = {0: "", 1: "h2d", 2: "d2h", 3: "d2d", 4: "h2d_pageable"}
_KIND = {"o": "op", "w": "wait", "s": "host_wait"}


@contextlib.contextmanager
def recording() -> Iterator[list[Op]]:
    """Keep the simulated accelerator's record of ops, waits and host waits made inside the
    block; the list it yields holds them once the block ends.  Stream checking is on inside
    (the record is the sanitizer's); the previous setting is restored after."""
    from .platform import simulated

    if not simulated.available():
        raise RuntimeError(f"a modeled timeline needs offload-ref's simulated accelerator, which "
                           f"is unavailable here: {simulated.unavailable_reason()}")
    ext = simulated.load()
    out: list[Op] = []  # filled when the block ends
    with simulated.stream_checking(True):
        ext.trace(True)
        try:
            yield out
        finally:
            raw = ext.trace_entries()
            ext.trace(False)
            simulated.clear_races()
    for kind, stream, seq, name, copy, nbytes, flops, element, clock in raw:
        out.append(Op(_KIND[kind], int(stream), int(seq), str(name), _COPY[int(copy)],
                      int(nbytes), float(flops), int(element),
                      {int(k): int(v) for k, v in clock.items()}))


@dataclass
class Timeline:
    """:func:`replay`'s result; times in seconds."""

    model: str
    #: from the first launch until the host's last wait returned or the last op ended
    total_s: float
    #: the device's compute engine busy, the copy engines busy
    compute_s: float
    h2d_s: float
    d2h_s: float
    h2d_bytes: int
    d2h_bytes: int
    #: max(compute, streamed bytes / h2d bandwidth): no offloader does a step in less
    bound_s: float
    #: time compute ops waited for another stream's work beyond their own stream's order
    stall_s: float
    #: time the host spent waiting for the device
    host_wait_s: float
    ops: int
    host_waits: int
    #: ops x launch cost: the host's own floor (a step of many small ops is launch-bound when
    #: this exceeds the bound)
    launch_s: float = 0.0
    #: time within ``total_s`` when no engine of the device was busy: the device waiting for the
    #: host to launch (after each host wait, the next op's launch is exposed).  A timeline whose
    #: work never overlaps takes exactly compute + copies + this.
    idle_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Modeled time over the bound."""
        return self.total_s / self.bound_s if self.bound_s else float("inf")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 4)}


def _duration(op: Op, model: DeviceModel) -> tuple[float, str]:
    """(seconds, engine) of one op on ``model``."""
    if op.copy in ("h2d", "h2d_pageable"):
        rate = model.h2d_gbps * (model.pageable_fraction if op.copy == "h2d_pageable" else 1)
        return op.bytes / (rate * 1e9), "h2d"
    if op.copy == "d2h":
        return op.bytes / (model.d2h_gbps * 1e9), "d2h"
    memory = op.bytes / (model.memory_gbps * 1e9)
    if op.copy == "d2d":
        return memory, "compute"
    rate = model.tflops_16 if op.element_size == 2 else model.tflops_fp32
    return max(op.flops / (rate * 1e12), memory, model.kernel_min_us * 1e-6), "compute"


def replay(ops: list[Op], model: DeviceModel) -> Timeline:
    """Run a recorded timeline on ``model`` (Note [Modeled timeline])."""
    launch = model.launch_us * 1e-6
    host = 0.0
    ends: dict[tuple[int, int], float] = {}
    ready: dict[int, float] = defaultdict(float)  # stream -> its last op's end
    waited: dict[int, float] = defaultdict(float)  # stream -> what its next op waits for
    engines: dict[str, float] = defaultdict(float)
    busy: dict[str, float] = defaultdict(float)
    moved: dict[str, int] = defaultdict(int)
    stall = host_wait = 0.0
    n_ops = n_waits = 0
    last = 0.0
    spans: list[tuple[float, float]] = []

    def done(clock: dict[int, int]) -> float:
        return max((ends.get((key, seq), 0.0) for key, seq in clock.items()), default=0.0)

    for op in ops:
        if op.kind == "op":
            n_ops += 1
            host += launch
            seconds, engine = _duration(op, model)
            own = max(host, ready[op.stream])
            start = max(own, waited[op.stream], engines[engine])
            if engine == "compute" and not op.copy:
                stall += max(0.0, waited[op.stream] - max(own, engines[engine]))
            end = start + seconds
            spans.append((start, end))
            ends[(op.stream, op.seq)] = end
            ready[op.stream] = engines[engine] = end
            busy[engine if op.copy != "d2d" else "d2d"] += seconds
            if op.copy:
                moved[op.copy.replace("_pageable", "")] += op.bytes
            last = max(last, end)
        elif op.kind == "wait":
            waited[op.stream] = max(waited[op.stream], done(op.clock))
        else:
            n_waits += 1
            until = done(op.clock)
            if until > host:
                host_wait += until - host
                host = until
    total = max(host, last)
    compute = busy["compute"]
    streamed = moved["h2d"] / (model.h2d_gbps * 1e9)
    return Timeline(model.name, total, compute, busy["h2d"], busy["d2h"], moved["h2d"],
                    moved["d2h"], max(compute, streamed), stall, host_wait, n_ops, n_waits,
                    n_ops * launch, total - _covered(spans))


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``spans``: the time at least one engine was busy."""
    covered = 0.0
    reach = float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered
