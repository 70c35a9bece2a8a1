"""``offload-ref bench --peers``: offload-ref beside diffusers' and accelerate's offloaders, every
one of them copying to the same device (Note [Fair peers]).

Note [Fair peers]
    ``bench --peers`` times offload-ref and the other offloaders with every one of them copying
    the weights to the same device (``--device``; default: CUDA when present, else the kit's
    device, offload-ref's simulated accelerator ``hpu:0``), and offload-ref on the platform that
    device really uses (``get_platform(device)``: the accelerator platform on hpu and cuda).
    A peer that onloads to the host copies nothing and computes on the original storage: timed
    beside an offloader that copies, that is no race, so the bench refuses a device that is the
    host, and it counts what each row moves rather than trusting a configuration: one forward
    of each row runs under :class:`CopyCounter`, which adds the bytes of every copy op whose
    source and destination are on different devices.  Each row prints those bytes (host ->
    device, device -> host), and a ratio between two rows is printed only when both moved
    bytes host -> device and both outputs are bitwise equal to resident; otherwise the row
    says why it has none.  Rows are timed round-robin in one run per model (wall, this
    thread's CPU time, and the process's CPU time, which also counts work an offloader hands
    to other threads), each sample ending with the same device synchronize for every row.
"""

from __future__ import annotations

import contextlib
import os
import platform as pyplatform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .backends.base import OffloadBackend
from .backends.layerwise import LayerWiseOffloadBackend
from .config import OffloadConfig, OffloadStrategy
from .platform import get_platform

__all__ = ["PEER_LAYERWISE", "PEER_MODEL_LEVEL", "CopyCounter", "PeersDeviceError",
           "format_peers", "peers_device", "run_peers"]

#: Forwards per timed sample of the many-blocks DiT (as offload_ref/bench.py's per-block
#: overhead: a forward is about a millisecond).
_CALLS_PER_SAMPLE = 5


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None


#: torch ops that copy a tensor, and how to find (source, destination) in their arguments and
#: result; ``Tensor.to`` is seen whole (not as ``_to_copy``) under ``torch.inference_mode()``.
_COPY_OPS: dict[str, Callable[[tuple[Any, ...], Any], tuple[Any, Any]]] = {
    "copy_": lambda args, out: (args[1], args[0]),
    "copy": lambda args, out: (args[1], out),
    "_to_copy": lambda args, out: (args[0], out),
    "to": lambda args, out: (args[0], out),
    "_copy_from": lambda args, out: (args[0], args[1]),
    "_copy_from_and_resize": lambda args, out: (args[0], args[1]),
}


class CopyCounter:
    """Bytes copied between devices by the torch ops run on this thread inside ``with``:
    ``h2d`` (host -> device), ``d2h`` (device -> host), ``d2d`` (between two devices), and
    ``ops`` (each copy op's name -> calls).  Bytes are the destination's (elements x element
    size); copies to or from the meta device move no data and are not counted.  A copy issued
    from another thread is not seen (a dispatch mode is per thread): every offloader the bench
    runs issues its copies from the calling thread, and offload-ref's rows are checked against
    its backend's own count (Note [Fair peers])."""

    def __init__(self) -> None:
        self.h2d = self.d2h = self.d2d = 0
        self.ops: dict[str, int] = {}
        self._mode: Any = None

    def add(self, op: str, src: Any, dst: Any) -> None:
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return
        a, b = src.device, dst.device
        if a == b or "meta" in (a.type, b.type):
            return
        nbytes = dst.numel() * dst.element_size()
        if a.type == "cpu":
            self.h2d += nbytes
        elif b.type == "cpu":
            self.d2h += nbytes
        else:
            self.d2d += nbytes
        self.ops[op] = self.ops.get(op, 0) + 1

    def __enter__(self) -> CopyCounter:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                                   kwargs: dict[str, Any] | None = None) -> Any:
                out = func(*args, **(kwargs or {}))
                where = _COPY_OPS.get(func.overloadpacket.__name__)
                if where is not None:
                    counter.add(str(func), *where(args, out))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._mode.__exit__(*exc_info)
        self._mode = None


class PeersDeviceError(ValueError):
    """``bench --peers`` asked for a device the offloaders would not copy to (the host), or one
    that is not available; the message names the device and what to use instead."""


def peers_device(device: str | torch.device | None = None) -> torch.device:
    """The device ``bench --peers`` has every offloader copy to: ``device``, else CUDA when
    present, else the kit's device (offload-ref's simulated accelerator ``hpu:0``).  Raises
    :class:`PeersDeviceError` for the host (nothing would be copied) and for a device that is
    not available, with the reason."""
    from .contracts.case import kit_device
    from .platform import simulated

    if device is None:
        resolved = torch.device("cuda") if torch.cuda.is_available() else kit_device()
        if resolved.type == "cpu":
            raise PeersDeviceError(
                "bench --peers: no device other than the host here (no CUDA, and offload-ref's "
                f"simulated accelerator is not available: {simulated.unavailable_reason()}); "
                "every offloader must copy to a device for the side by side to be a fair one")
    else:
        resolved = torch.device(device)
    if resolved.type == "cpu":
        raise PeersDeviceError(
            f"bench --peers --device {device}: the CPU is the host, so no offloader would copy "
            "anything (a peer onloading to the host computes on its original storage); use "
            "hpu:0 (offload-ref's simulated accelerator) or cuda")
    try:
        return get_platform(resolved).device
    except (RuntimeError, ValueError) as exc:
        raise PeersDeviceError(f"bench --peers --device {device}: {exc}") from exc


class _AccelerateModelHooks:
    """accelerate's ``cpu_offload_with_hook`` as its documentation chains it: each offloaded
    component (text encoders, then DiTs) hooked with the previous one's hook, so calling a
    component offloads the one before; the rest of the pipeline moved to the device; after a
    generation the last hook's ``offload()`` (what the user is told to call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.hooks: list[Any] = []
        self.modules: list[torch.nn.Module] = []

    def enable(self, pipeline: Any) -> Callable[[dict[str, Any]], Any]:
        from accelerate import cpu_offload_with_hook

        from .discovery import discover_components

        found = discover_components(pipeline)
        self.modules = [m for _, m in (*found.encoders, *found.dits)]
        offloaded = {id(m) for m in self.modules}
        for _, module in pipeline.named_children():
            if id(module) not in offloaded:
                module.to(self.device)
        hook = None
        for module in self.modules:
            _, hook = cpu_offload_with_hook(module, self.device, prev_module_hook=hook)
            self.hooks.append(hook)

        def generate(inputs: dict[str, Any]) -> Any:
            out = pipeline(**inputs)
            self.hooks[-1].offload()
            return out

        return generate

    def disable(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


class _DiffusersComponent(torch.nn.Module):
    """A fixture module as a ``DiffusionPipeline`` component: the ``dtype`` and ``device``
    diffusers reads from its models (``ModelMixin`` has both), every other attribute the
    module's own (``vae.weight``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


class _DiffusersModelCpuOffload:
    """diffusers' ``DiffusionPipeline.enable_model_cpu_offload(device=...)`` on the heavy
    fixture: its components registered in a ``DiffusionPipeline`` whose ``__call__`` is the
    fixture's own forward followed by ``maybe_free_model_hooks()`` (as diffusers' pipelines end),
    with ``model_cpu_offload_seq`` text_encoder -> transformer and the VAE excluded from
    offloading (kept on the device, as offload-ref's model level keeps it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.wrapper: Any = None

    def enable(self, pipeline: Any) -> Callable[[dict[str, Any]], Any]:
        from diffusers import DiffusionPipeline

        forward = type(pipeline).forward

        class HeavyDiffusionPipeline(DiffusionPipeline):
            model_cpu_offload_seq = "text_encoder->transformer"
            _exclude_from_cpu_offload = ["vae"]

            def __init__(self, text_encoder: Any, transformer: Any, vae: Any) -> None:
                super().__init__()
                self.register_modules(text_encoder=text_encoder, transformer=transformer,
                                      vae=vae)

            def __call__(self, **inputs: Any) -> Any:
                out = forward(self, **inputs)
                self.maybe_free_model_hooks()
                return out

        self.wrapper = HeavyDiffusionPipeline(*(_DiffusersComponent(getattr(pipeline, n))
                                                for n in ("text_encoder", "transformer",
                                                          "vae")))
        self.wrapper.enable_model_cpu_offload(device=self.device)
        wrapper = self.wrapper
        return lambda inputs: wrapper(**inputs)

    def disable(self) -> None:
        if self.wrapper is not None:
            self.wrapper.remove_all_hooks()
            self.wrapper = None


#: The layerwise peers of ``bench --peers`` (factories of :mod:`offload_ref.peers`); the
#: ``*_stream`` rows run where diffusers accepts streams on the device.
PEER_LAYERWISE = ("diffusers_group_offload_block", "diffusers_group_offload_leaf",
                  "diffusers_group_offload_block_stream", "diffusers_group_offload_leaf_stream",
                  "accelerate_cpu_offload")
#: The model-level rows of ``bench --peers`` (a generation of the heavy fixture).
PEER_MODEL_LEVEL = ("offload_ref_model_level", "diffusers_model_cpu_offload",
                    "accelerate_cpu_offload_with_hook")


def _git_commit() -> str | None:
    """The checkout's commit, with the files of offload_ref/ and contracts/ that differ from it
    (what was measured is then not that commit), or None outside a git checkout."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "offload_ref", "contracts"],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    changed = sorted(line[3:] for line in dirty.stdout.splitlines() if line.strip())
    return head.stdout.strip() + (f" + uncommitted changes to {', '.join(changed)}"
                                  if changed else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return pyplatform.processor() or pyplatform.machine()


def _peers_machine(device: torch.device) -> dict[str, Any]:
    from .platform import describe_device

    machine: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "cpu": _cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "python": pyplatform.python_version(), "torch_threads": torch.get_num_threads(),
        "commit": _git_commit(), "device": str(device), "device_name": describe_device(device),
        "offload_ref_platform": type(get_platform(device)).__name__,
        "load_average_start": _load_average()}
    if device.type == "hpu":
        from .platform import simulated

        machine["stream_checking"] = simulated.check_streams()
    return machine


def _interleaved_times(fns: dict[str, Callable[[], Any]], repeats: int,
                       sync: Callable[[], None], *, calls: int = 1,
                       ) -> dict[str, dict[str, float]]:
    """Medians of wall, this thread's CPU and the process's CPU seconds per call of each
    function, sampled round-robin (``repeats`` samples of ``calls`` calls and one ``sync``),
    after two warm-up calls each."""
    keys = ("wall", "thread_cpu", "process_cpu")
    samples: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in fns}
    for fn in fns.values():
        fn()
        fn()
        sync()
    for _ in range(repeats):
        for name, fn in fns.items():
            c, p, start = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            s = samples[name]
            s["wall"].append((time.perf_counter() - start) / calls)
            s["thread_cpu"].append((time.thread_time() - c) / calls)
            s["process_cpu"].append((time.process_time() - p) / calls)
    return {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}


def _peer_layerwise(name: str, device: torch.device) -> Any:
    from . import peers

    return getattr(peers, name)(device, "layer_wise")


def _counted(fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, CopyCounter]:
    counter = CopyCounter()
    with counter:
        out = fn()
        sync()
    return out, counter


def _measure_model(model: str, build: Callable[[], Any], call: Callable[[Any], Any],
                   variants: dict[str, Callable[[Any], tuple[Callable[[], Any], Any]]],
                   device: torch.device, *, repeats: int, calls: int, blocks: int,
                   stats_of: Callable[[Any], int | None] | None = None,
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """One model's rows: ``variants[name](pipeline)`` enables the variant on a fresh pipeline
    and returns (the call to time, the object whose ``disable()`` undoes it).  Returns the rows
    and the variants skipped, with the reason.  ``stats_of(offloader)``: the offloader's own
    count of its host -> device bytes, recorded beside the counted ones (None: it keeps none)."""
    from .contracts.case import move_to_device

    def sync() -> None:
        torch.accelerator.synchronize(device)

    skipped: dict[str, str] = {}
    resident = move_to_device(build(), device)
    fns: dict[str, Callable[[], Any]] = {"resident": lambda: call(resident)}
    enabled: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name, enable in variants.items():
            try:
                fns[name], enabled[name] = enable(build())
            except NotImplementedError as exc:  # the peer's own API refused it here: say so
                skipped[name] = f"{model}: {exc}"
        with torch.inference_mode():
            for name, fn in fns.items():  # warm-up, then one counted call
                fn()
                sync()
                backend = enabled.get(name)
                before = stats_of(backend) if stats_of and backend is not None else None
                out, counter = _counted(fn, sync)
                rows[name] = {"output": out, "h2d_bytes_counted": counter.h2d,
                              "d2h_bytes_counted": counter.d2h, "d2d_bytes": counter.d2d,
                              "copy_ops": counter.ops}
                if before is not None:
                    rows[name]["backend_h2d_bytes"] = stats_of(backend) - before
            times = _interleaved_times(fns, repeats, sync, calls=calls)
            last = {name: fn() for name, fn in fns.items()}
            sync()
    finally:
        for backend in enabled.values():
            backend.disable()
    reference = rows["resident"]["output"]
    base_h2d, base_d2h = rows["resident"]["h2d_bytes_counted"], rows["resident"]["d2h_bytes_counted"]
    for name, row in rows.items():
        out = row.pop("output")
        row["bitwise_equal_to_resident"] = bool(torch.equal(out.cpu(), reference.cpu())
                                               and torch.equal(last[name].cpu(),
                                                               reference.cpu()))
        # the call's own copies (its inputs, its output) are the resident row's: the offloader's
        # bytes are what a row moved beyond them
        row["h2d_bytes"] = row["h2d_bytes_counted"] - base_h2d
        row["d2h_bytes"] = row["d2h_bytes_counted"] - base_d2h
        t, r = times[name], times["resident"]
        row.update(step_s=t["wall"], step_thread_cpu_s=t["thread_cpu"],
                   step_process_cpu_s=t["process_cpu"], blocks=blocks,
                   x_resident=t["wall"] / r["wall"],
                   x_resident_thread_cpu=t["thread_cpu"] / r["thread_cpu"],
                   per_block_overhead_us=(t["wall"] - r["wall"]) / blocks * 1e6,
                   per_block_overhead_thread_cpu_us=(t["thread_cpu"] - r["thread_cpu"])
                   / blocks * 1e6,
                   per_block_overhead_process_cpu_us=(t["process_cpu"] - r["process_cpu"])
                   / blocks * 1e6)
    return rows, skipped


def _ratios(rows: dict[str, dict[str, Any]], ours: str, key: str) -> dict[str, Any]:
    """``rows[ours][key] / rows[peer][key]`` for every peer, only where both rows moved bytes
    host -> device and both are bitwise equal to resident (else the reason, Note [Fair
    peers])."""
    out: dict[str, Any] = {}
    mine = rows.get(ours)
    for name, row in rows.items():
        if name in ("resident", ours) or mine is None:
            continue
        why = [f"{n} copied nothing host -> device" for n, r in ((ours, mine), (name, row))
               if r["h2d_bytes"] <= 0]
        why += [f"{n} is not bitwise equal to resident" for n, r in ((ours, mine), (name, row))
                if not r["bitwise_equal_to_resident"]]
        if row[key] <= 0:
            why.append(f"{name}'s {key} is not above resident's (noise)")
        out[name] = ("no ratio: " + "; ".join(why)) if why else mine[key] / row[key]
    return out


def run_peers(*, device: str | torch.device | None = None, blocks: int = 64, hidden: int = 512,
              heavy_blocks: int = 8, tokens: int = 32, steps: int = 2, repeats: int = 20,
              peers: tuple[str, ...] = PEER_LAYERWISE,
              model_level: tuple[str, ...] = PEER_MODEL_LEVEL,
              extra: dict[str, Callable[[torch.device], Any]] | None = None,
              ) -> dict[str, Any]:
    """The fair side by side (Note [Fair peers]): on ``device`` (:func:`peers_device`),
    offload-ref layerwise on ``get_platform(device)`` and the layerwise ``peers`` on the
    many-blocks DiT (``blocks`` tiny blocks: per-block overhead) and the heavy fixture's DiT
    step (``heavy_blocks`` blocks, ``hidden``, ``tokens``), and the ``model_level`` rows on a
    whole generation of the heavy fixture (``steps`` steps).  ``extra`` adds layerwise rows:
    name -> ``factory(device)`` returning an object with ``enable(pipeline)`` and
    ``disable()`` (the tests' offloader that copies nothing).  Each row: bytes counted per
    forward, wall / thread-CPU / process-CPU medians, per-block overhead, bitwise equality."""
    from offload_ref.fixtures.heavy import HeavyConfig
    from offload_ref.fixtures.heavy import build_pipeline as build_heavy
    from offload_ref.fixtures.heavy import make_inputs as heavy_inputs
    from offload_ref.fixtures.many_blocks import build_pipeline as build_many
    from offload_ref.fixtures.many_blocks import make_input

    dev = peers_device(device)
    platform = get_platform(dev)
    machine = _peers_machine(dev)
    heavy = HeavyConfig(hidden=hidden, blocks=heavy_blocks, tokens=tokens, steps=steps)
    g = torch.Generator().manual_seed(0)
    x_small = make_input(0).to(dev)
    x_heavy = torch.randn(tokens, hidden, generator=g).to(dev)
    t, context = torch.tensor([0.5]).to(dev), torch.randn(1, hidden, generator=g).to(dev)

    def ours_layerwise(pipe: Any) -> Any:
        backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                          platform)
        backend.enable(pipe)
        return backend

    def layerwise_variants(call: Callable[[Any], Any]
                           ) -> dict[str, Callable[[Any], tuple[Callable[[], Any], Any]]]:
        def wrap(make: Callable[[], Any]) -> Callable[[Any], tuple[Callable[[], Any], Any]]:
            def enable(pipe: Any) -> tuple[Callable[[], Any], Any]:
                offloader = make()
                offloader.enable(pipe)
                return (lambda: call(pipe)), offloader
            return enable

        out = {"offload_ref_layerwise": lambda pipe: ((lambda: call(pipe)), ours_layerwise(pipe))}
        for name in peers:
            out[name] = wrap(lambda name=name: _peer_layerwise(name, dev))
        for name, factory in (extra or {}).items():
            out[name] = wrap(lambda factory=factory: factory(dev))
        return out

    def stats_of(backend: Any) -> int | None:
        """offload-ref's own count of its host -> device bytes (None for a peer: it has none)."""
        if not isinstance(backend, OffloadBackend):
            return None
        return backend.stats().h2d_bytes + backend.stats().h2d_padding_bytes

    def skip_missing(names: tuple[str, ...]) -> dict[str, str]:
        reasons = {}
        for name in names:
            module = "accelerate" if name.startswith("accelerate") else \
                "diffusers" if name.startswith("diffusers") else None
            if module is None:
                continue
            try:
                __import__(module)
            except Exception as exc:  # noqa: BLE001 - any import failure is a reason to skip
                reasons[name] = f"{module} not importable: {exc}"
        return reasons

    skipped = skip_missing(peers + model_level)
    peers = tuple(p for p in peers if p not in skipped)
    model_level = tuple(p for p in model_level if p not in skipped)
    models: dict[str, Any] = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    machine["torch_threads"] = 1
    check = contextlib.nullcontext()
    if dev.type == "hpu":
        from .platform import simulated

        check = simulated.stream_checking(False)  # the kit's sanitizer costs every op
        machine["stream_checking"] = False
    try:
        with check:
            rows, why = _measure_model(
                "many_blocks", lambda: build_many(0, blocks), lambda p: p.transformer(x_small),
                layerwise_variants(lambda p: p.transformer(x_small)), dev, repeats=repeats,
                calls=_CALLS_PER_SAMPLE, blocks=blocks, stats_of=stats_of)
            models["many_blocks"] = {"what": f"many-blocks DiT, {blocks} blocks of "
                                             "nn.Linear(8, 8), batch 1: one DiT forward, "
                                             "layerwise", "rows": rows, "unit": "block"}
            skipped.update(why)
            heavy_step = lambda p: p.transformer(x_heavy, t, context)  # noqa: E731
            rows, why = _measure_model(
                "heavy_step", lambda: build_heavy(0, heavy), heavy_step,
                layerwise_variants(heavy_step), dev, repeats=max(3, repeats // 2), calls=1,
                blocks=heavy_blocks, stats_of=stats_of)
            models["heavy_step"] = {
                "what": f"heavy fixture, hidden {hidden}, {heavy_blocks} blocks of "
                        f"{heavy.block_bytes / 2**20:.1f} MiB, {tokens} tokens: one DiT step, "
                        "layerwise", "rows": rows, "unit": "block"}
            skipped.update(why)
            inputs = heavy_inputs(0, heavy)

            def model_variant(make: Callable[[], Any]
                              ) -> Callable[[Any], tuple[Callable[[], Any], Any]]:
                def enable(pipe: Any) -> tuple[Callable[[], Any], Any]:
                    offloader = make()
                    generate = offloader.enable(pipe)
                    return (lambda: generate(inputs)), offloader
                return enable

            def ours_model(pipe: Any) -> tuple[Callable[[], Any], Any]:
                from .backends import get_offload_backend

                backend = get_offload_backend(
                    OffloadConfig(strategy=OffloadStrategy.MODEL_LEVEL,
                                  components=("dit", "text_encoder")), platform=platform)
                backend.enable(pipe)
                return (lambda: pipe(**inputs)), backend

            makers = {"offload_ref_model_level": ours_model,
                      "diffusers_model_cpu_offload":
                          model_variant(lambda: _DiffusersModelCpuOffload(dev)),
                      "accelerate_cpu_offload_with_hook":
                          model_variant(lambda: _AccelerateModelHooks(dev))}
            rows, why = _measure_model(
                "heavy_generation", lambda: build_heavy(0, heavy), lambda p: p(**inputs),
                {n: makers[n] for n in model_level}, dev, repeats=max(3, repeats // 2),
                calls=1, blocks=1, stats_of=stats_of)
            models["heavy_generation"] = {
                "what": f"heavy fixture, a whole generation ({steps} steps; text encoder and "
                        "DiT offloaded, VAE on the device): model level", "rows": rows,
                "unit": "generation"}
            skipped.update(why)
    finally:
        torch.set_num_threads(previous)
    machine["load_average_end"] = _load_average()
    for entry, ours in (("many_blocks", "offload_ref_layerwise"),
                        ("heavy_step", "offload_ref_layerwise"),
                        ("heavy_generation", "offload_ref_model_level")):
        rows = models[entry]["rows"]
        models[entry]["ratios"] = {
            "per_block_overhead_thread_cpu": _ratios(rows, ours,
                                                     "per_block_overhead_thread_cpu_us"),
            "per_block_overhead_wall": _ratios(rows, ours, "per_block_overhead_us"),
            "step_thread_cpu": _ratios(rows, ours, "step_thread_cpu_s"),
        }
    return {"machine": machine, "repeats": repeats, "models": models, "skipped": skipped}


def format_peers(result: dict[str, Any]) -> str:
    m = result["machine"]
    load = lambda xs: ", ".join(f"{x:.2f}" for x in xs) if xs else "unknown"  # noqa: E731
    lines = [
        f"offload-ref bench --peers on {m['device']} ({m['device_name']}); offload-ref on "
        f"{m['offload_ref_platform']}; every offloader copies to {m['device']} (bytes counted "
        "per forward, Note [Fair peers])",
        f"{m['date_utc']} UTC, commit {m['commit']}, torch {m['torch']}, Python {m['python']}, "
        f"{m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch thread; load average "
        f"{load(m['load_average_start'])} at the start, {load(m['load_average_end'])} at the "
        "end (1, 5, 15 min)"
        + (f"; stream checking {'on' if m['stream_checking'] else 'off'}"
           if "stream_checking" in m else ""),
        "medians of interleaved round-robin samples; µs/block = (row - resident) / blocks; "
        "thread CPU leaves out time the machine gave to other processes, process CPU adds "
        "work on other threads",
    ]
    for entry in result["models"].values():
        unit = "blk" if entry["unit"] == "block" else "gen"
        lines += ["", entry["what"],
                  f"{'row':<37} {'H2D B':>9} {'D2H B':>9} {'ms wall':>8} {'ms thr':>8} "
                  f"{'x res thr':>9} {'µs/' + unit + ' wall':>11} {'µs/' + unit + ' thr':>10} "
                  f"{'µs/' + unit + ' proc':>11} exact"]
        for name, r in entry["rows"].items():
            lines.append(
                f"{name:<37} {r['h2d_bytes']:>9} {r['d2h_bytes']:>9} {r['step_s'] * 1e3:8.3f} "
                f"{r['step_thread_cpu_s'] * 1e3:8.3f} {r['x_resident_thread_cpu']:9.2f} "
                f"{r['per_block_overhead_us']:11.1f} "
                f"{r['per_block_overhead_thread_cpu_us']:10.1f} "
                f"{r['per_block_overhead_process_cpu_us']:11.1f} "
                f"{r['bitwise_equal_to_resident']}")
        ours = next(n for n in entry["rows"] if n.startswith("offload_ref"))
        for peer, ratio in entry["ratios"]["per_block_overhead_thread_cpu"].items():
            wall = entry["ratios"]["per_block_overhead_wall"][peer]
            lines.append(f"  {ours} / {peer}, µs per {entry['unit']} over resident: " + (
                f"{ratio:.2f}x thread CPU, " + (f"{wall:.2f}x wall" if isinstance(wall, float)
                                                 else wall)
                if isinstance(ratio, float) else ratio))
    for name, why in result["skipped"].items():
        lines.append(f"{name}: not run: {why}")
    return "\n".join(lines)
