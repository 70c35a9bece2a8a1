"""Catalogue §H: distributed layerwise offload across real processes (gloo on CPU).

Note [One spawn per batch]
    Each rank imports the kit, builds the pipeline and computes its references before the
    first scenario, so the checks of one pipeline share one start of two ranks: the first §H
    check of a (pipeline, implementation) pair starts two ranks
    (:func:`offload_ref.distributed.run_ranks`, a FileStore in a temporary folder, no ports, a
    join deadline); each rank runs every scenario below and returns what it observed, and each
    check judges its part of the observations.  A scenario that raises is recorded (type,
    message, traceback) and the ranks meet at a rendezvous before the next one, so one broken
    scenario fails its own checks only.  The observations are kept per process for the
    process's lifetime (the pytest plugin keeps a pipeline's §H checks on one xdist worker).

Each rank runs its own request (the spec's inputs for ``seed + rank``) and compares with the
single-process reference of that request, computed in the same rank: ranks run different
requests at once (DP multi-concurrency), and only weights cross between them.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_ref.config import OffloadStrategy
from offload_ref.plan.tree import wrapper_inner

from ..case import DEFAULT_IMPLEMENTATION, CheckCase, move_to_device
from ..registry import check, fail, not_applicable
from ..spec import load_object
from ..observe import compare_outputs, observe
from ..facts import (declare_no_dit, named_module_tensors, module_tensors, module_view, resident,
                    tensors_equal, values_equal)

WORLD = 2
#: The rendezvous timeout of the rank-failure scenario; a prompt failure takes milliseconds.
FAIL_TIMEOUT_S = 8.0
#: Join deadline of one batch (every scenario of one pipeline on both ranks).
BATCH_TIMEOUT_S = 240.0
#: The process group's timeout: a collective that the other rank never matches (a broken
#: implementation) raises after this, so the batch still reports every scenario.
COLLECTIVE_TIMEOUT_S = 20.0
DLO = ("distributed_layer_wise",)
#: Spawned ranks rebuild the pipeline from its ``module:attr`` references, and the checks judge
#: a ring: a DiT streaming two or more blocks.
_REQUIRES = ("importable", "streams_blocks")

_RESULTS: dict[tuple[Any, str], list[dict[str, Any]]] = {}


class InjectedRankFault(RuntimeError):
    """The fault the kit injects into one rank's enable."""


# -- the batch --------------------------------------------------------------------------------


def observations(case: Any) -> list[dict[str, Any]]:
    """Every rank's observations for ``case``'s pipeline (one spawn per pipeline and
    implementation per process; Note [One spawn per batch])."""
    from offload_ref.distributed import run_ranks

    key = (case.spec, case.impl.name)
    if key not in _RESULTS:
        try:
            _RESULTS[key] = run_ranks(_rank_batch, WORLD,
                                      args=(case.spec, case.impl.name, case.impl.in_rank),
                                      timeout_s=BATCH_TIMEOUT_S,
                                      collective_timeout_s=COLLECTIVE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - every check of the batch reports it, once run
            _RESULTS[key] = exc
    result = _RESULTS[key]
    if isinstance(result, Exception):
        fail(f"the two-rank batch of {case.spec.name} failed: {result}")
    return result


def _implementation(name: str, in_rank: str | None) -> tuple[Any, Any]:
    """The implementation the parent ran as ``name``, rebuilt in a spawned rank: offload-ref's
    own, or what ``in_rank`` (``Implementation.in_rank``, a ``module:attr`` reference) returns for
    ``name`` -- the implementation and a context to enter around the rank's scenarios."""
    if in_rank is not None:
        return load_object(in_rank)(name)
    if name != DEFAULT_IMPLEMENTATION.name:
        raise RuntimeError(f"implementation {name!r} cannot be rebuilt in a spawned rank: give it "
                           f"Implementation.in_rank, a 'module:attr' reference to a function "
                           f"returning (implementation, context) for its name")
    return DEFAULT_IMPLEMENTATION, contextlib.nullcontext()


def _rank_batch(rank: int, world: int, spec: Any, impl_name: str,
                in_rank: str | None) -> dict[str, Any]:
    """What one rank observes in every scenario (runs in a spawned rank)."""
    from offload_ref.distributed import Rendezvous

    impl, patch = _implementation(impl_name, in_rank)
    rendezvous = Rendezvous.default(namespace="offload_ref/kit", timeout_s=BATCH_TIMEOUT_S)
    out: dict[str, Any] = {"rank": rank}
    with patch, tempfile.TemporaryDirectory() as tmp:
        for name, scenario in _SCENARIOS:
            case = CheckCase(spec, OffloadStrategy.DISTRIBUTED_LAYER_WISE, impl)
            with _rank_streams_checked(rank) as races:
                try:
                    out[name] = scenario(case, rank, world, Path(tmp))
                except BaseException as exc:  # noqa: BLE001 - recorded for the parent's checks
                    out[name] = {"error": f"{type(exc).__name__}: {exc}",
                                 "traceback": traceback.format_exc()}
                finally:
                    with contextlib.suppress(Exception):
                        case.close()
            if races and "error" not in out[name]:
                # the scenario's check fails with the race (Note [The kit's stream checking])
                out[name] = {"error": races[0], "traceback": ""}
            rendezvous.exchange("scenario", name)  # both ranks start the next one together
    return out


@contextlib.contextmanager
def _rank_streams_checked(rank: int) -> Any:
    """Stream checking on in a spawned rank for one scenario, as the parent runs every case
    (contracts/streams.py); yields a list that holds, after the block, one line per race found
    (none where the simulated accelerator is unavailable in the rank)."""
    from ..streams import off_reason

    found: list[str] = []
    if off_reason() is not None:
        yield found
        return
    from offload_ref.platform import simulated

    previous = simulated.check_streams()
    simulated.clear_races()
    simulated.check_streams(True)
    try:
        yield found
    finally:
        simulated.check_streams(previous)
        found.extend(f"rank {rank}: {race}" for race in simulated.races(clear=True))


def _request(case: CheckCase, rank: int) -> dict[str, Any]:
    """This rank's own request: the spec's inputs for seed + rank."""
    return dict(load_object(case.spec.inputs)(seed=case.spec.seed + rank))


def _config(case: CheckCase, transfer: str, world: int, **dit: Any) -> Any:
    """The DiT streamed with ``transfer`` (encoders stay on the device: their rings are the
    single-process checks' business), across ``world`` ranks."""
    options = {"weight_transfer": transfer, **dit}
    return case.config(components=("dit",), layer_options={"dit": options}, world_size=world)


def streamed_block_bytes(plan: Any) -> int:
    """Weight bytes of every streamed block (each storage span once), from the plan of a pipeline
    that is not offloaded (an offloaded one holds placeholders); a wrapper subclass's are its
    inner tensors' (Note [Wrapper subclasses] in offload_ref/plan/tree.py)."""
    spans: dict[tuple[int, int, int], int] = {}
    for ring in plan.rings:
        for block in ring.streamed_blocks:
            for _, t in module_tensors(block):
                if t.numel():
                    key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                    spans[key] = t.numel() * t.element_size()
    return sum(spans.values())


def _state(pipeline: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in named_module_tensors(pipeline)}


def _restored(pipeline: nn.Module, fresh: nn.Module, platform: Any) -> list[str]:
    """Tensors of ``pipeline`` that differ from a fresh build, or that are still on the device."""
    want = _state(fresh)
    problems = []
    for n, t in named_module_tensors(pipeline):
        w = want.get(n)
        if w is None or t.shape != w.shape or t.dtype != w.dtype or not tensors_equal(
                t.detach(), w, nan_equal=True):
            problems.append(f"{n} differs from a fresh build")
        elif platform.is_resident(t):
            problems.append(f"{n} is still device storage")
    return problems


def _stats(backend: Any) -> dict[str, int]:
    return backend.stats().as_dict()


# -- scenarios (each runs on every rank) ---------------------------------------------------------


def _allgather(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    request = _request(case, rank)
    reference = case.run(case.build_resident(), request)
    pipeline = case.build()
    config = _config(case, "allgather", world)
    platform = case.platform()
    backend = case.backend(config, platform)
    backend.enable(pipeline)
    obs: dict[str, Any] = {"after_enable": _stats(backend),
                           "materialized_after_enable": sum(
                               len(v) for v in backend.materialized_blocks().values())}
    try:
        obs["output"] = case.run(pipeline, request)
    except Exception as exc:  # noqa: BLE001 - judged by the outputs check; the rest still counts
        obs["output"] = f"{type(exc).__name__}: {exc}"
    obs["stats"] = _stats(backend)
    obs["predicted_device_bytes"] = backend.plan.predicted_device_bytes()
    obs["block_bytes"] = streamed_block_bytes(case.resolve(case.build(), config))
    obs["slots"] = {r.label: len(r.slots) for r in backend.rings}
    obs["transports"] = {r.label: r.transport.name for r in backend.rings}
    padding = {}
    for ring in backend.rings:
        t = ring.transport
        for k, shard in enumerate(getattr(t, "shards", ())):
            tail = max(0, t.image_bytes[k] - rank * t.shard_bytes[k])
            nonzero = int(shard[tail:].count_nonzero()) if tail < shard.numel() else 0
            if nonzero:
                padding[ring.block_paths[k]] = nonzero
    obs["nonzero_padding"] = padding
    backend.disable()
    obs["restore_problems"] = _restored(pipeline, case.build(), platform)
    obs["device_bytes_after_disable"] = platform.memory_allocated()
    obs["host_bytes_after_disable"] = platform.host_allocated()
    backend.enable(pipeline)  # a second cycle, on the restored pipeline
    obs["output_second_cycle"] = case.run(pipeline, request)
    backend.disable()
    obs["restore_problems_second_cycle"] = _restored(pipeline, case.build(), platform)
    obs["reference"] = reference
    return obs


def _rank_local(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    request = _request(case, rank)
    reference = case.run(case.build_resident(), request)
    pipeline = case.build()
    declared = getattr(getattr(pipeline, "_offload_plan", None), "resident_dit_paths", ())
    dit = {"resident_layers": 1} if declared else {}
    config = _config(case, "rank-local", world, **dit)
    platform = case.platform()
    backend = case.backend(config, platform)
    backend.enable(pipeline)
    heads = [(s.block_paths[0], s.blocks[0]) for s in backend.plan.rings if s.resident_head]
    obs: dict[str, Any] = {"resident_layers": dit.get("resident_layers", 0)}
    obs["output"] = case.run(pipeline, request)
    obs["heads_resident"] = {p: all(resident(platform, t) for t in b.parameters())
                             for p, b in heads}
    obs["transports"] = {r.label: r.transport.name for r in backend.rings}
    obs["stats"] = _stats(backend)
    obs["block_bytes"] = streamed_block_bytes(case.resolve(case.build(), config))
    backend.disable()
    obs["restore_problems"] = _restored(pipeline, case.build(), platform)
    obs["reference"] = reference
    return obs


def _waves(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Waves on a rank-local backend: a wave that is wrongly accepted then runs unequal
    generations without collectives, so a broken runner fails the check instead of hanging
    both ranks in unmatched gathers."""
    from offload_ref.distributed import WaveMismatchError

    request = _request(case, rank)
    if "num_inference_steps" not in request:
        return {"not_applicable": "the spec's inputs state no num_inference_steps"}
    pipeline = case.build()
    backend = case.backend(_config(case, "rank-local", world), case.platform())
    backend.enable(pipeline)
    runner = case.impl.make_wave_runner(pipeline)
    obs: dict[str, Any] = {}
    steps = request["num_inference_steps"]
    variants = {
        "unequal": dict(request, num_inference_steps=steps + rank),
        "missing": {k: v for k, v in request.items() if k != "num_inference_steps"}
        if rank == world - 1 else request,
    }
    for name, wave in variants.items():
        before = backend.stats().swaps
        try:
            runner.run(wave)
            obs[name] = {"raised": None}
        except WaveMismatchError as exc:
            obs[name] = {"raised": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - e.g. the pipeline rejecting a missing value
            obs[name] = {"raised": None, "other": f"{type(exc).__name__}: {exc}"}
        obs[name]["blocks_loaded"] = backend.stats().swaps - before
    obs["equal_output"] = runner.run(request)
    backend.disable()
    obs["reference"] = case.run(case.build_resident(), request)
    return obs


def _rank_failure(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(_config(case, "allgather", world), platform)
    backend.timeout_s = FAIL_TIMEOUT_S
    failing = world - 1
    if rank == failing:
        def inject(index: int, label: str) -> None:
            if index == 2:
                raise InjectedRankFault(f"kit fault injected into rank {rank} at {label!r}")
        backend.fault_injector = inject
    start = time.perf_counter()
    error = None
    try:
        backend.enable(pipeline)
    except Exception as exc:  # noqa: BLE001 - observed
        error = f"{type(exc).__name__}: {exc}"
    obs = {"failing_rank": failing, "error": error, "seconds": time.perf_counter() - start,
           "enabled": backend.is_enabled(), "device_bytes": platform.memory_allocated(),
           "restore_problems": _restored(pipeline, case.build(), platform)}
    if backend.is_enabled():
        backend.disable()
    return obs


def _mmap(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Note [Both alignment phases]: the DiT files put every other tensor 64-byte aligned and
    the rest off a 16-byte boundary, and the scenario records the address of every tensor each
    module computes with, in the reference and in the offloaded run."""
    request = _request(case, rank)
    source = case.build()
    plan = case.resolve(source, case.config())
    wrapped = [(f"{comp.path}.{name}", type(t).__name__) for comp in plan.dits
               for name, t in comp.module.state_dict().items() if wrapper_inner(t) is not None]
    if wrapped:
        # Note [Wrapper subclasses] in offload_ref/plan/tree.py
        shown = ", ".join(f"{n} ({cls})" for n, cls in wrapped[:2])
        return {"not_applicable": (
            f"the DiT holds {len(wrapped)} wrapper-subclass weight(s) (quantized: {shown}"
            f"{' ...' if len(wrapped) > 2 else ''}): a safetensors file holds plain tensors "
            "only, and load_safetensors refuses a tensor subclass, so no DiT can be loaded as "
            "mmap views of a file")}
    files = {}
    for comp in plan.dits:
        path = tmp / f"{comp.path}-rank{rank}.safetensors"
        write_safetensors_at_phases(_unique_contiguous(comp.module.state_dict()), path,
                                    prefix=MMAP_PREFIX)
        files[comp.path] = path

    def loaded() -> tuple[nn.Module, list[str]]:
        pipeline = case.build()
        paths = []
        for comp in case.resolve(pipeline, case.config()).dits:
            case.impl.load_safetensors(comp.module, files[comp.path], prefix=MMAP_PREFIX)
            paths.append(comp.path)
        return pipeline, paths

    fresh = case.build()
    pipeline, dits = loaded()
    obs: dict[str, Any] = {"buffers": _non_persistent_differences(pipeline, fresh),
                           "file_phases": _dit_phases(pipeline, dits)}
    resident, _ = loaded()
    obs["reference_phases"], reference = _phases_while_running(
        case, move_to_device(resident, case.device), request)
    platform = case.platform()
    backend = case.backend(_config(case, "rank-local", world), platform)
    backend.enable(pipeline)
    obs["phases"], obs["output"] = _phases_while_running(case, pipeline, request)
    obs["stats"] = _stats(backend)
    backend.disable()
    obs["buffers_after_disable"] = _non_persistent_differences(pipeline, fresh)
    obs["reference"] = reference
    return obs


# Note [Both alignment phases]
#     Kernels pick their path by a weight's address: on AMD EPYC, MKL's matrix-vector product gives
#     other last bits for a weight that is not 16-byte aligned than for an aligned one (not on
#     Intel).  safetensors packs tensors back to back, so an mmap view sits wherever the file put
#     it; a reference computed on an aligned copy and an offloaded run on the file's phase (or the
#     other way round) then differ by an ulp on one machine and agree on the next.  So the kit
#     does not rely on the outputs alone: its files put tensors at both phases deliberately
#     (:func:`write_safetensors_at_phases`), and the alignment check compares the address modulo
#     64 of every tensor each module computes with, reference against offloaded run, which
#     differs on every machine when one side realigns.  The reference keeps each storage's
#     address modulo 64 on the device (``move_to_device``, as an offloader keeps it: Note
#     [Aligned layout] in offload_ref/host.py).

#: The key prefix of the mmap scenario's DiT tensors; the padding entries that place them
#: (:func:`write_safetensors_at_phases`) are outside it, so the loader ignores them.
MMAP_PREFIX = "dit."
_PAD_PREFIX = "kit_padding."
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
                torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3",
                torch.float8_e5m2: "F8_E5M2"}


def unaligned_phase(itemsize: int) -> int:
    """The phase (bytes past a 64-byte boundary) :func:`write_safetensors_at_phases` gives every
    other tensor: one element, so the tensor is off every 16-byte boundary (an element of 16
    bytes or more: 0, there is no unaligned phase to give)."""
    return itemsize if itemsize < 16 else 0


def write_safetensors_at_phases(state: dict[str, torch.Tensor], path: Path | str, *,
                                prefix: str = MMAP_PREFIX) -> dict[str, int]:
    """Write ``state`` as a safetensors file (keys ``prefix + name``) whose data section starts
    64-byte aligned and places the tensors, in ``state``'s order, alternately 64-byte aligned
    and :func:`unaligned_phase` bytes past a 64-byte boundary: uint8 padding entries (keys
    outside ``prefix``) fill the gaps, since safetensors allows no holes.  A file is mapped at a
    page boundary, so a view's address modulo 64 is its offset's.  Returns each name's phase
    (Note [Both alignment phases])."""
    import json
    import struct

    entries: list[tuple[str, str, list[int], bytes]] = []
    phases: dict[str, int] = {}
    offset = 0
    for i, (name, t) in enumerate(state.items()):
        t = t.detach().cpu().contiguous()
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"the kit's mmap scenario cannot write {name!r} of dtype {t.dtype}; "
                             f"it writes {sorted(map(str, _DTYPE_NAMES))}")
        want = 0 if i % 2 == 0 else unaligned_phase(t.element_size())
        gap = (want - offset) % 64
        if gap:
            entries.append((f"{_PAD_PREFIX}{i}", "U8", [gap], bytes(gap)))
            offset += gap
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries.append((prefix + name, _DTYPE_NAMES[t.dtype], list(t.shape), data))
        phases[name] = offset % 64
        offset += len(data)
    header: dict[str, Any] = {}
    start = 0
    for key, dtype, shape, data in entries:
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + len(data)]}
        start += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 64)  # the data section starts 64-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in entries:
            f.write(data)
    return phases


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # a wrapper subclass by its inner tensors: they have the addresses (Note [Wrapper subclasses])
    return [(n, t) for n, t in module_tensors(module, recurse=False) if t.numel()]


def _dit_phases(pipeline: Any, dits: list[str]) -> dict[str, int]:
    """Address modulo 64 of every tensor of the DiTs ``dits`` (dotted paths in the pipeline)."""
    out = {}
    for path, module in module_view(pipeline).named_modules(remove_duplicate=False):
        if any(path == d or path.startswith(d + ".") for d in dits):
            for name, t in _own_tensors(module):
                out[f"{path}.{name}"] = t.data_ptr() % 64
    return out


def _phases_while_running(case: CheckCase, pipeline: Any,
                          request: dict[str, Any]) -> tuple[dict[str, int], Any]:
    """(address modulo 64 of every tensor each module holds when its forward starts, after the
    offloader's hooks: the tensors it computes with; the output of one generation)."""
    seen: dict[str, int] = {}

    def look(path: str, module: nn.Module) -> None:
        for name, t in _own_tensors(module):
            if t.stride() and not all(t.stride()):
                continue  # a placeholder (stride 0) of a block in no slot
            seen.setdefault(f"{path}.{name}" if path else name, t.data_ptr() % 64)

    modules = list(module_view(pipeline).named_modules(remove_duplicate=False))
    with observe(modules, look):
        output = case.run(pipeline, request)
    return seen, output


def _unique_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict safetensors can save: each tensor once (tied names dropped), contiguous."""
    out, seen = {}, set()
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().clone()
    return out


def _non_persistent_differences(pipeline: nn.Module, fresh: nn.Module) -> list[str]:
    want = dict(module_view(fresh).named_buffers(remove_duplicate=False))
    problems = []
    for module_path, module in module_view(pipeline).named_modules():
        for name in module._non_persistent_buffers_set:
            full = f"{module_path}.{name}" if module_path else name
            got, w = module._buffers.get(name), want.get(full)
            if got is None or w is None:
                problems.append(f"{full} is missing")
            elif got.device.type == "meta" or not values_equal(got, w):
                problems.append(f"{full} differs from a fresh build")
    return problems


def _interrupted_allgather(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Ctrl-C inside a streamed block of an AllGather ring, at the same block on every rank
    (its middle block, then its last), each followed by two generations."""
    from .lifecycle import interrupt_targets, run_interrupted

    request = _request(case, rank)
    reference = case.run(case.build_resident(), request)
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(_config(case, "allgather", world), platform)
    backend.enable(pipeline)
    obs: dict[str, Any] = {"after": []}
    try:
        for path, module in interrupt_targets(case, pipeline):
            interrupted = run_interrupted(case, pipeline, module, request)
            outputs = []
            for _ in range(2):
                try:
                    outputs.append(case.run(pipeline, request))
                except Exception as exc:  # noqa: BLE001 - judged by the check
                    outputs.append(f"{type(exc).__name__}: {exc}")
                    break
            obs["after"].append({"path": path, "interrupted": interrupted, "outputs": outputs})
    finally:
        backend.disable()
    obs["device_bytes_after_disable"] = platform.memory_allocated()
    obs["reference"] = reference
    return obs


def _skipped_rank(case: CheckCase, rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """The last rank's pipeline declares no DiT (its ``_dit_modules`` emptied on the instance;
    under a legacy config its plan is skipped, not refused), while the other ranks' stream."""
    import dataclasses
    import warnings

    pipeline = case.build()
    config = dataclasses.replace(_config(case, "rank-local", world), explicit=False)
    if rank == world - 1:
        declare_no_dit(pipeline)
    platform = case.platform()
    backend = case.backend(config, platform)
    backend.timeout_s = FAIL_TIMEOUT_S
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a legacy config warns of what it skips
        try:
            backend.enable(pipeline)
            raised = None
        except Exception as exc:  # noqa: BLE001 - judged by the check
            raised = f"{type(exc).__name__}: {exc}"
    enabled = backend.is_enabled()
    if enabled:
        backend.disable()
    return {"raised": raised, "enabled": enabled, "plan_skipped": getattr(
        getattr(backend, "plan", None), "skip_reason", None),
        "device_bytes": platform.memory_allocated()}


#: The rank-failure scenarios come last: against a broken implementation they may leave the ranks
#: out of step (a rendezvous round one rank skipped, a collective the other never matches).
_SCENARIOS = (
    ("allgather", _allgather),
    ("rank_local", _rank_local),
    ("waves", _waves),
    ("mmap", _mmap),
    ("interrupted_allgather", _interrupted_allgather),
    ("rank_failure", _rank_failure),
    # Also out of step against a broken implementation: a rank that skips enable takes no
    # rendezvous round.
    ("skipped_rank", _skipped_rank),
)


# -- judging ------------------------------------------------------------------------------------


def _scenario(case: Any, name: str) -> list[dict[str, Any]]:
    ranks = observations(case)
    for obs in ranks:
        got = obs.get(name)
        if got is None:
            fail(f"rank {obs.get('rank')}: the {name} scenario did not run")
        if "error" in got and name != "rank_failure":
            fail(f"rank {obs['rank']}: the {name} scenario raised {got['error']}\n"
                 f"{got.get('traceback', '')}", severity="error")
    return [obs[name] for obs in ranks]


@check("H.1", strategies=DLO, requires=_REQUIRES)
def check_allgather_outputs_match_each_ranks_reference(case) -> None:
    """With AllGather across two ranks, each running its own request, every rank's output equals
    the single-process reference of its request, bit for bit, in two enable/disable cycles."""
    for rank, obs in enumerate(_scenario(case, "allgather")):
        if isinstance(obs["output"], str):
            fail(f"rank {rank}: the AllGather generation raised {obs['output']}",
                 severity="error")
        compare_outputs(f"rank {rank} (AllGather)", obs["output"], obs["reference"])
        compare_outputs(f"rank {rank} (AllGather, second cycle)", obs["output_second_cycle"],
                        obs["reference"])


@check("H.1", strategies=DLO, requires=_REQUIRES)
def check_allgather_host_bytes_per_rank_are_one_over_world(case) -> None:
    """Each rank's host bytes for the streamed blocks are at most 1/world of the block bytes +
    5% (alignment padding included), and the ranks together hold every block byte once."""
    ranks = _scenario(case, "allgather")
    total = ranks[0]["block_bytes"]
    held = [o["stats"]["host_bytes"] + o["stats"]["host_padding_bytes"] for o in ranks]
    weight = sum(o["stats"]["host_bytes"] for o in ranks)
    for rank, h in enumerate(held):
        if h > total / WORLD * 1.05:
            fail(f"rank {rank} holds {h} host bytes for streamed blocks of {total} bytes; at most "
                 f"1/{WORLD} + 5% = {total / WORLD * 1.05:.0f} with AllGather")
    if weight != total:
        fail(f"the ranks' host shards hold {weight} weight bytes together; the streamed blocks "
             f"have {total} (a byte lost or held twice)")


@check("H.1", strategies=DLO, requires=_REQUIRES)
def check_allgather_keeps_two_slots_per_rank(case) -> None:
    """Every AllGather ring holds exactly two device slots per rank, and each rank's peak device
    bytes equal the plan's prediction (non-block state + two gathered slots)."""
    for rank, obs in enumerate(_scenario(case, "allgather")):
        if any(n != 2 for n in obs["slots"].values()):
            fail(f"rank {rank}: ring slots {obs['slots']}; exactly two per ring")
        if "allgather" not in obs["transports"].values():
            fail(f"rank {rank}: no ring uses AllGather ({obs['transports']})")
        peak = obs["stats"]["peak_device_bytes"]
        if peak != obs["predicted_device_bytes"]:
            fail(f"rank {rank}: peak device bytes {peak} differ from the plan's prediction "
                 f"{obs['predicted_device_bytes']}")


@check("H.1", strategies=DLO, requires=_REQUIRES)
def check_allgather_shards_are_zero_padded(case) -> None:
    """Past a block's bytes, each rank's shard is zero (a gathered slot never carries stale or
    uninitialized host memory)."""
    for rank, obs in enumerate(_scenario(case, "allgather")):
        if obs["nonzero_padding"]:
            fail(f"rank {rank}: shard padding is not zero for {obs['nonzero_padding']} "
                 "(block: non-zero bytes); zero-pad each shard past the block's image")


@check("H.1", strategies=DLO, requires=_REQUIRES)
def check_no_collective_at_enable(case) -> None:
    """Enable issues no collective and materializes no block: the first gather is issued by the
    first forward, in the same order on every rank."""
    for rank, obs in enumerate(_scenario(case, "allgather")):
        if obs["after_enable"]["collective_bytes"] or obs["materialized_after_enable"]:
            fail(f"rank {rank}: enable gathered {obs['after_enable']['collective_bytes']} bytes "
                 f"and materialized {obs['materialized_after_enable']} block(s); enable must "
                 "issue no collective (ranks may enable in different orders)")
        if not obs["stats"]["collective_bytes"]:
            fail(f"rank {rank}: a generation issued no collective; AllGather was not used")


@check("H.2", strategies=DLO, requires=_REQUIRES)
def check_distributed_cycles_restore_every_rank(case) -> None:
    """After disable, on every rank, every tensor equals a fresh build and is off the device, in
    both AllGather cycles and in rank-local mode."""
    for rank, obs in enumerate(_scenario(case, "allgather")):
        problems = obs["restore_problems"] + obs["restore_problems_second_cycle"]
        if problems or obs["device_bytes_after_disable"] or obs["host_bytes_after_disable"]:
            fail(f"rank {rank}: after disable {problems[:5]}, device bytes "
                 f"{obs['device_bytes_after_disable']}, host shard bytes still allocated "
                 f"{obs['host_bytes_after_disable']}")
    for rank, obs in enumerate(_scenario(case, "rank_local")):
        if obs["restore_problems"]:
            fail(f"rank {rank} (rank-local): after disable {obs['restore_problems'][:5]}")


@check("H.3", strategies=DLO, requires=_REQUIRES)
def check_rank_local_outputs_match_each_ranks_reference(case) -> None:
    """Rank-local mode (and resident head layers where the pipeline declares a resident DiT):
    every rank matches its own reference bit for bit, without any collective, each rank holding
    every block byte, and head layers stay on the device."""
    for rank, obs in enumerate(_scenario(case, "rank_local")):
        compare_outputs(f"rank {rank} (rank-local)", obs["output"], obs["reference"])
        if obs["stats"]["collective_bytes"]:
            fail(f"rank {rank}: rank-local mode gathered {obs['stats']['collective_bytes']} bytes")
        if obs["stats"]["host_bytes"] < obs["block_bytes"]:
            fail(f"rank {rank}: rank-local host bytes {obs['stats']['host_bytes']} < block bytes "
                 f"{obs['block_bytes']}")
        if obs["resident_layers"] and not all(obs["heads_resident"].values()) or (
                obs["resident_layers"] and not obs["heads_resident"]):
            fail(f"rank {rank}: resident head layers {obs['heads_resident']} are not on the device")


@check("H.4", strategies=DLO, requires=_REQUIRES)
def check_wave_with_unequal_steps_is_rejected_before_any_collective(case) -> None:
    """A wave whose requests state different or missing num_inference_steps is rejected on every
    rank, naming each rank's value, before the pipeline runs (so before any collective); an
    equal wave matches each rank's reference."""
    ranks = _scenario(case, "waves")
    if "not_applicable" in ranks[0]:
        fail(f"not applicable: {ranks[0]['not_applicable']}")
    for rank, obs in enumerate(ranks):
        for name in ("unequal", "missing"):
            got = obs[name]
            if got["raised"] is None:
                fail(f"rank {rank}: a wave with {name} num_inference_steps was not rejected "
                     f"with WaveMismatchError ({got.get('other', 'it ran')}); every rank must "
                     "reject it before calling the pipeline")
            if "rank 1" not in got["raised"]:
                fail(f"rank {rank}: the {name}-steps error does not name rank 1: {got['raised']}")
            if got["blocks_loaded"]:
                fail(f"rank {rank}: the pipeline ran ({got['blocks_loaded']} blocks loaded) "
                     f"before the {name}-steps wave was rejected; with AllGather each load is a "
                     "collective")
        compare_outputs(f"rank {rank} (wave)", obs["equal_output"], obs["reference"])


@check("H.5", strategies=DLO, requires=_REQUIRES)
def check_failed_rank_makes_every_rank_raise_naming_it(case) -> None:
    """A fault injected into one rank's enable makes every rank's enable raise promptly (well
    within the timeout), the others naming the failed rank and its error; every rank is rolled
    back (disabled, no device bytes, tensors as built)."""
    ranks = _scenario(case, "rank_failure")
    failing = ranks[0]["failing_rank"]
    for rank, obs in enumerate(ranks):
        if obs["error"] is None or obs["enabled"]:
            fail(f"rank {rank}: enable succeeded although rank {failing} failed; every rank "
                 "must raise")
        if obs["device_bytes"] or obs["restore_problems"]:
            fail(f"rank {rank}: after the failed enable, device bytes {obs['device_bytes']}, "
                 f"{obs['restore_problems'][:3]}")
        if rank != failing:
            if f"rank {failing}" not in obs["error"] or "kit fault injected" not in obs["error"]:
                fail(f"rank {rank}: its error does not name rank {failing} and its fault: "
                     f"{obs['error']}")
            if obs["seconds"] > FAIL_TIMEOUT_S / 2:
                fail(f"rank {rank} raised after {obs['seconds']:.1f} s (timeout "
                     f"{FAIL_TIMEOUT_S} s); a failed rank must tell the others at once")


@check("H.6", strategies=DLO, requires=_REQUIRES)
def check_mmap_loaded_weights_keep_non_persistent_buffers(case) -> None:
    """DiT weights loaded as mmap views of safetensors files keep every non-persistent buffer
    exact, and rank-local streaming of the file-backed blocks matches the un-offloaded loaded
    pipeline bit for bit, keeping no host copy of them."""
    ranks = _scenario(case, "mmap")
    if "not_applicable" in ranks[0]:
        not_applicable(ranks[0]["not_applicable"])
    for rank, obs in enumerate(ranks):
        for key in ("buffers", "buffers_after_disable"):
            if obs[key]:
                fail(f"rank {rank}: non-persistent buffers after mmap loading: {obs[key][:5]}")
        compare_outputs(f"rank {rank} (mmap, rank-local)", obs["output"], obs["reference"])
        if not obs["stats"]["file_backed_bytes"]:
            fail(f"rank {rank}: no streamed block is served from its file pages "
                 f"(file_backed_bytes 0, host bytes {obs['stats']['host_bytes']})")


@check("H.6", strategies=DLO, requires=_REQUIRES)
def check_mmap_loaded_weights_keep_their_alignment(case) -> None:
    """Rank-local streaming of DiT weights loaded as mmap views computes with every tensor at
    the address modulo 64 the un-offloaded loaded pipeline computes with it, for files that put
    tensors both 64-byte aligned and off a 16-byte boundary: kernels pick their path by address
    (MKL's GEMV on AMD EPYC), so an offloader that realigns a file's tensors, or keeps the file's
    phase where the reference realigns, matches bit for bit on some CPUs only (Note [Both
    alignment phases])."""
    ranks = _scenario(case, "mmap")
    if "not_applicable" in ranks[0]:
        not_applicable(ranks[0]["not_applicable"])
    for rank, obs in enumerate(ranks):
        file_phases = obs["file_phases"]
        unaligned = [n for n, p in file_phases.items() if p % 16]
        if not unaligned or len(unaligned) == len(file_phases):
            fail(f"rank {rank}: precondition: the loaded DiT tensors sit at phases "
                 f"{sorted(set(file_phases.values()))} (address modulo 64); the kit's file puts "
                 "them both 64-byte aligned and off a 16-byte boundary, so the loader "
                 "(Implementation.load_safetensors) did not hand back views of the file")
        ref, got = obs["reference_phases"], obs["phases"]
        compared = [n for n in ref if n in got]
        if not any(n in compared for n in unaligned):
            fail(f"rank {rank}: precondition: no tensor the file puts off a 16-byte boundary "
                 f"({unaligned[:3]}) was seen in a forward of both runs")
        moved = [f"{n}: {got[n]} bytes past a 64-byte boundary offloaded, {ref[n]} in the "
                 "un-offloaded reference" for n in compared if got[n] != ref[n]]
        if moved:
            fail(f"rank {rank}: {len(moved)} of {len(compared)} tensor(s) are computed with at "
                 f"another address modulo 64 than in the reference: {moved[:4]}.  Kernels pick "
                 "their path by alignment (MKL's matrix-vector product on AMD EPYC gives other "
                 "last bits for a weight off a 16-byte boundary), so equal outputs here are "
                 "this CPU's luck: keep every tensor's address modulo 64 in host masters, "
                 "device copies and slots (Note [Aligned layout] in offload_ref/host.py)")


__all__ = [name for name in dir() if name.startswith("check_")] + [
    "MMAP_PREFIX", "observations", "streamed_block_bytes", "unaligned_phase",
    "write_safetensors_at_phases"]


@check("H.5", strategies=DLO, requires=_REQUIRES)
def check_rank_whose_plan_is_skipped_makes_every_rank_raise(case) -> None:
    """One rank's plan is skipped (it declares no DiT, under a legacy config) while the other's
    streams: every rank raises, each naming the skipped rank and its skip reason,
    no rank stays enabled, and no device bytes stay allocated; never a silent mix of offloaded
    and un-offloaded ranks."""
    ranks = _scenario(case, "skipped_rank")
    skipped = len(ranks) - 1
    for rank, obs in enumerate(ranks):
        if obs["raised"] is None or obs["enabled"]:
            state = "enabled" if obs["enabled"] else (
                f"skipped ({obs['plan_skipped']})" if obs["plan_skipped"] else "not enabled")
            fail(f"rank {rank} raised nothing and is {state} while rank {skipped}'s plan is "
                 "skipped: the ranks would run a mix of offloaded and un-offloaded pipelines")
        if f"rank {skipped}" not in obs["raised"] or "skipped" not in obs["raised"]:
            fail(f"rank {rank} raised, but without naming rank {skipped} and its skip reason: "
                 f"{obs['raised'][:400]}")
        if obs["device_bytes"]:
            fail(f"rank {rank}: {obs['device_bytes']} device bytes stay allocated")


@check("H.7", strategies=DLO, requires=_REQUIRES)
def check_allgather_generation_after_an_interrupt_is_exact(case) -> None:
    """A KeyboardInterrupt inside a streamed block of an AllGather ring (the same block on
    both ranks, race amplifier on) leaves a state the next generations recover from: each
    rank's output equals its reference, bit for bit, twice, and disable() then holds no device
    bytes.  (Recovery must order the compute stream after the last writer of each slot: the
    communication stream's gather, not only the copy stream.)"""
    for rank, obs in enumerate(_scenario(case, "interrupted_allgather")):
        if not any(a["interrupted"] for a in obs["after"]):
            fail(f"rank {rank}: precondition: no interrupt target ran during a generation")
        for after in obs["after"]:
            for i, out in enumerate(after["outputs"]):
                what = f"rank {rank}, generation {i + 1} after an interrupt inside {after['path']}"
                if isinstance(out, str):
                    fail(f"{what} raised {out}", severity="error")
                compare_outputs(what, out, obs["reference"])
        if obs["device_bytes_after_disable"]:
            fail(f"rank {rank}: after interrupts and disable, {obs['device_bytes_after_disable']} "
                 "device bytes are still held")
