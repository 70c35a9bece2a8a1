"""Rank functions for tests/test_distributed_backend.py (distributed layerwise offload on real
spawned ranks, beyond what the conformance kit's §H checks cover).

They live in the package because :func:`~offload_ref.distributed.launch.run_ranks` imports a
rank function by module name and tests/ is not a package.  Each function returns plain
observations (booleans, numbers, messages, small tensors) for the parent to assert on, so that a
failed expectation shows up as a test failure there rather than as a rank error; a scenario that
raises is recorded with its traceback and the ranks meet before the next one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
from torch import nn

FIXTURE = "flux2"
OTHER_FIXTURE = "sd3"  # a DiT with another ring schedule (a ring of 3, other block sizes)
# Two rings, bfloat16 and float32 weights, and one ring whose thirds round differently to 32
# and to 64 bytes (a shard rounded to the wrong alignment shows).
THREE_RANK_FIXTURE = "cosmos3"
AGREE_TIMEOUT_S = 5.0  # the backends' rendezvous timeout in the scenarios below


# -- helpers ------------------------------------------------------------------------------------


def _spec(name: str = FIXTURE) -> Any:
    from offload_ref.fixtures import get_spec

    return get_spec(name)


def _request(rank: int, name: str = FIXTURE) -> dict[str, Any]:
    """This rank's own request (the spec's inputs for seed + rank)."""
    spec = _spec(name)
    from offload_ref.contracts.spec import load_object

    return dict(load_object(spec.inputs)(seed=spec.seed + rank))


def _run(pipeline: Any, request: dict[str, Any]) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**request)


def _reference(request: dict[str, Any], name: str = FIXTURE,
               edit: Callable[[Any], None] | None = None) -> torch.Tensor:
    """The output of a fresh, un-offloaded ``name`` pipeline (edited by ``edit`` first) on the
    kit's device."""
    from offload_ref.contracts.case import on_kit_device

    pipeline = _spec(name).build()
    if edit is not None:
        edit(pipeline)
    return _run(on_kit_device(pipeline), request)


def _config(transfer: str = "allgather", world_size: int = 2) -> Any:
    from offload_ref import OffloadConfig

    return OffloadConfig(strategy="distributed_layer_wise", components=("dit",),
                         layer_options={"dit": {"weight_transfer": transfer}},
                         world_size=world_size)


def _backend(config: Any, platform: Any = None, timeout_s: float = AGREE_TIMEOUT_S) -> Any:
    from offload_ref import get_offload_backend
    from offload_ref.platform import CpuPlatform

    platform = platform if platform is not None else CpuPlatform(race_amplifier=True)
    return get_offload_backend(config, platform=platform, timeout_s=timeout_s)


def _error(exc: BaseException) -> dict[str, Any]:
    """An error as observations; the cause chain's types and messages too (enable wraps)."""
    chain = []
    cause: BaseException | None = exc
    while cause is not None and len(chain) < 5:
        chain.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__
    return {"raised": type(exc).__name__, "message": str(exc), "chain": chain}


def _catch(call: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - observed
        return {**_error(exc), "seconds": time.monotonic() - start}
    return {"raised": None, "value": value, "seconds": time.monotonic() - start}


def tensor_state(pipeline: nn.Module) -> dict[str, tuple[int, int, torch.Tensor]]:
    """name -> (id of the tensor object, its data pointer, a copy of its value)."""
    named = list(pipeline.named_parameters(remove_duplicate=False))
    named += [(n, b) for n, b in pipeline.named_buffers(remove_duplicate=False) if b is not None]
    return {n: (id(t), t.data_ptr(), t.detach().clone()) for n, t in named}


def untouched(pipeline: nn.Module, before: dict[str, tuple[int, int, torch.Tensor]],
              backend: Any, platform: Any) -> list[str]:
    """What an enable that failed before any mutation changed (nothing, if it is right)."""
    from offload_ref.backends.base import PIPELINE_ATTR
    from offload_ref.hooks import HOOKS_ATTR

    problems = []
    now = tensor_state(pipeline)
    if now.keys() != before.keys():
        problems.append(f"tensor names changed: {sorted(now.keys() ^ before.keys())[:5]}")
    for name, (oid, ptr, value) in before.items():
        if name not in now:
            continue
        nid, nptr, nvalue = now[name]
        if (nid, nptr) != (oid, ptr):
            problems.append(f"{name} was rebound")
        elif not torch.equal(nvalue.nan_to_num(), value.nan_to_num()):
            problems.append(f"{name} changed value")
    for path, module in pipeline.named_modules():
        if module.__dict__.get(HOOKS_ATTR):
            problems.append(f"{path or '<root>'} carries offload hooks "
                            f"{list(module.__dict__[HOOKS_ATTR])}")
        if module._forward_pre_hooks or module._forward_hooks:
            problems.append(f"{path or '<root>'} has forward hooks")
        if module._state_dict_hooks or module._load_state_dict_pre_hooks:
            problems.append(f"{path or '<root>'} has state-dict hooks")
    if PIPELINE_ATTR in pipeline.__dict__:
        problems.append(f"the pipeline carries {PIPELINE_ATTR}")
    if backend.is_enabled():
        problems.append("the backend is enabled")
    if platform.memory_allocated():
        problems.append(f"{platform.memory_allocated()} device bytes allocated")
    if platform.host_allocated():
        problems.append(f"{platform.host_allocated()} host bytes allocated")
    return problems


def _batch(scenarios: list[tuple[str, Callable[[int, int], Any]]], rank: int, world: int,
           namespace: str) -> dict[str, Any]:
    """Run every scenario on this rank; the ranks meet after each one (a scenario that raised
    is recorded, the next one still starts together)."""
    from offload_ref.distributed import Rendezvous

    rendezvous = Rendezvous.default(namespace=namespace, timeout_s=30.0)
    out: dict[str, Any] = {"rank": rank, "world": world, "seconds": {}}
    for name, scenario in scenarios:
        start = time.monotonic()
        try:
            out[name] = scenario(rank, world)
        except BaseException as exc:  # noqa: BLE001 - recorded for the parent's assertions
            out[name] = {"error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}
        out["seconds"][name] = time.monotonic() - start
        rendezvous.exchange("scenario", name)
    return out


# -- the two-rank scenarios ---------------------------------------------------------------------


def _world_size_one(rank: int, world: int) -> dict[str, Any]:
    """data_parallel_size (world_size) = 1 with AllGather in a two-rank group: refused on every
    rank before any mutation."""
    pipeline = _spec().build()
    before = tensor_state(pipeline)
    backend = _backend(_config("allgather", world_size=1))
    got = _catch(lambda: backend.enable(pipeline))
    got["problems"] = untouched(pipeline, before, backend, backend.platform)
    return got


def _different_weights(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's DiT weights differ from rank 0's (an edit made on one rank only): AllGather would
    rebuild blocks from a mix of both, so enable is refused on every rank, nothing mutated."""
    pipeline = _spec().build()
    if rank == 1:
        with torch.no_grad():
            next(pipeline.transformer.transformer_blocks[0].parameters()).add_(1.0)
    before = tensor_state(pipeline)
    backend = _backend(_config("allgather"))
    got = _catch(lambda: backend.enable(pipeline))
    got["problems"] = untouched(pipeline, before, backend, backend.platform)
    return got


def _state_dict(rank: int, world: int) -> dict[str, Any]:
    """state_dict() of the DiT while AllGather streams it, then after disable."""
    request = _request(rank)
    pipeline = _spec().build()
    backend = _backend(_config("allgather", world))
    backend.enable(pipeline)
    _run(pipeline, request)  # block 0 is materialized now, the others hold placeholders
    obs: dict[str, Any] = {"while_enabled": _catch(lambda: pipeline.transformer.state_dict()),
                           "pipeline_while_enabled": _catch(lambda: pipeline.state_dict())}
    obs["collective_bytes"] = backend.stats().collective_bytes
    backend.disable()
    got = _catch(lambda: pipeline.transformer.state_dict())
    fresh = _spec().build().transformer.state_dict()
    if got["raised"] is None:
        state = got.pop("value")
        got["keys_equal"] = state.keys() == fresh.keys()
        got["differs"] = [k for k in fresh if k in state and not torch.equal(state[k], fresh[k])]
    obs["after_disable"] = got
    return obs


def _edit(pipeline: nn.Module) -> None:
    """The same in-place edits of DiT weights: two streamed blocks (a double-stream and a
    single-stream one) and one non-block weight."""
    dit = pipeline.transformer
    with torch.no_grad():
        dit.transformer_blocks[1].img_mod.weight.mul_(-0.5)
        dit.single_transformer_blocks[2].proj_out.bias.add_(0.25)
        dit.proj_out.weight.mul_(1.5)


def _edit_weights(rank: int, world: int) -> dict[str, Any]:
    """edit_weights() under AllGather, identically on every rank."""
    request = _request(rank)
    unedited = _reference(request)
    reference = _reference(request, edit=_edit)
    reference_pipeline = _spec().build()  # the edited host weights disable must restore
    _edit(reference_pipeline)
    pipeline = _spec().build()
    backend = _backend(_config("allgather", world))
    backend.enable(pipeline)
    before_edit = _run(pipeline, request)
    with backend.edit_weights() as pipe:
        enabled_inside = backend.is_enabled()
        _edit(pipe)
    obs: dict[str, Any] = {"enabled_inside": enabled_inside,
                           "enabled_after": backend.is_enabled()}
    stats_before = backend.stats().collective_bytes
    obs["output"] = _run(pipeline, request)
    obs["gathered"] = backend.stats().collective_bytes - stats_before
    obs["transports"] = sorted({r.transport.name for r in backend.rings})
    backend.disable()
    want = tensor_state(reference_pipeline)
    obs["state_differs"] = [n for n, (_, _, t) in tensor_state(pipeline).items()
                            if not torch.equal(t, want[n][2])]
    obs.update(reference=reference, unedited=unedited, before_edit=before_edit)
    return obs


def _enable_orders(rank: int, world: int) -> dict[str, Any]:
    """Two pipelines enabled in opposite orders on the two ranks: A then B on rank 0, B then A
    on rank 1; first with different ring schedules (flux2 and sd3), then with two pipelines of
    the same kind (flux2 twice)."""
    obs: dict[str, Any] = {}
    a, b = _spec().build(), _spec(OTHER_FIXTURE).build()
    state_a, state_b = tensor_state(a), tensor_state(b)
    backend_a, backend_b = _backend(_config()), _backend(_config())
    order = [("A", backend_a, a), ("B", backend_b, b)]
    if rank == 1:
        order.reverse()
    start = time.monotonic()
    for name, backend, pipeline in order:
        obs[f"enable_{name}"] = _catch(lambda: backend.enable(pipeline))
    obs["seconds"] = time.monotonic() - start
    obs["untouched_A"] = untouched(a, state_a, backend_a, backend_a.platform)
    obs["untouched_B"] = untouched(b, state_b, backend_b, backend_b.platform)
    # Afterwards, the same order on every rank works: nothing is left out of step.
    request = _request(rank)
    obs["same_order"] = _catch(lambda: backend_a.enable(a))
    if backend_a.is_enabled():
        obs["same_order_output"] = _run(a, request)
        backend_a.disable()
    obs["same_order_reference"] = _reference(request)

    # Two pipelines with one schedule, enabled in opposite orders: the digests agree.
    a1, a2 = _spec().build(), _spec().build()
    b1, b2 = _backend(_config()), _backend(_config())
    pairs = [(b1, a1), (b2, a2)]
    for backend, pipeline in (pairs if rank == 0 else pairs[::-1]):
        obs.setdefault("same_kind", []).append(_catch(lambda: backend.enable(pipeline)))
    if b1.is_enabled() and b2.is_enabled():
        obs["same_kind_output"] = _run(a1, request)  # both ranks run a1: its gathers match
        b1.disable()  # disable gathers too: same order on every rank
        b2.disable()
    return obs


def _asymmetric_config(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 alone is misconfigured (data_parallel_size 1 with AllGather): rank 0 must raise
    within its timeout naming rank 1, and both ranks' next enable (configured alike) works."""
    pipeline = _spec().build()
    before = tensor_state(pipeline)
    backend = _backend(_config("allgather", world_size=1 if rank == 1 else 2), timeout_s=2.0)
    obs: dict[str, Any] = {"first": _catch(lambda: backend.enable(pipeline))}
    obs["problems"] = untouched(pipeline, before, backend, backend.platform)
    good = _backend(_config("allgather", world_size=2), timeout_s=AGREE_TIMEOUT_S)
    obs["retry"] = _catch(lambda: good.enable(pipeline))
    # Run (and disable: it gathers too) only if every rank's retry is enabled; a rank enabled
    # alone would wait in its first gather forever.
    from offload_ref.distributed import Rendezvous

    check = Rendezvous.default(namespace="offload_ref/test_backend/retry", timeout_s=30.0)
    obs["retry_enabled"] = check.exchange("enabled", str(good.is_enabled()))
    if obs["retry_enabled"] == ["True"] * world:
        request = _request(rank)
        obs["retry_output"] = _run(pipeline, request)
        good.disable()
        obs["retry_reference"] = _reference(request)
    return obs


def _cli(rank: int, world: int) -> dict[str, Any]:
    """``run_rank`` of ``python -m offload_ref.distributed`` for both transfers, inside the
    already initialized process group."""
    from offload_ref.distributed.__main__ import run_rank

    obs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for transfer in ("allgather", "rank-local"):
            path = os.path.join(tmp, f"{transfer}-{{rank}}.json")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                got = _catch(lambda: run_rank(["--pipeline", FIXTURE, "--transfer", transfer,
                                               "--device", "cpu", "--timeout", "60",
                                               "--json", path]))
            got["printed"] = printed.getvalue()
            mine = path.replace("{rank}", str(rank))
            got["json"] = None
            if os.path.exists(mine):
                with open(mine) as f:
                    got["json"] = json.load(f)
            obs[transfer] = got
    return obs


class _SkipsOne(nn.ModuleList):
    """A block list whose iteration leaves out one block, as skip-layer guidance does."""

    def __iter__(self) -> Any:
        skip = self.__dict__["_skip"]
        return (m for i, m in enumerate(super().__iter__()) if i != skip)


def _skipping(container: nn.ModuleList, index: int | None) -> None:
    if index is None:
        container.__class__ = nn.ModuleList
        container.__dict__.pop("_skip", None)
    else:
        container.__dict__["_skip"] = index
        container.__class__ = _SkipsOne


def _skipped_block(rank: int, world: int) -> dict[str, Any]:
    """Both ranks skip the same block (diffusers' skip_layers): the ring recovers, and no gather
    into a slot races the copy of the next fill.  Before, the next fill into the slot of the
    prefetched, skipped block did not wait for its gather (StreamOrderError here, a race on
    CUDA)."""
    request = _request(rank)
    from offload_ref.contracts.case import on_kit_device

    reference = on_kit_device(_spec().build())
    plain = _run(reference, request)
    _skipping(reference.transformer.transformer_blocks, 1)
    skipped = _run(reference, request)
    pipeline = _spec().build()
    backend = _backend(_config("allgather"))
    backend.enable(pipeline)
    try:
        got = [torch.equal(_run(pipeline, request), plain)]
        _skipping(pipeline.transformer.transformer_blocks, 1)
        got += [torch.equal(_run(pipeline, request), skipped) for _ in range(2)]
        _skipping(pipeline.transformer.transformer_blocks, None)
        got.append(torch.equal(_run(pipeline, request), plain))
    finally:
        backend.disable()
    return {"equal": got}


def _asymmetric_calls(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 makes one DiT call more than rank 1 (a guidance call on one rank only), then both
    disable.  Before: with blocks of equal size every gather completed, and rank 0's output and
    rank 1's restored weights silently mixed blocks (Note [Gather tags]).  Now every rank
    raises OffloadScheduleError naming both ranks' blocks.  Last in the batch: the backends are
    left enabled (a rank holds 1/world of each block, which only its peers can complete)."""
    request = _request(rank)
    pipeline = _spec().build()
    backend = _backend(_config("allgather"))
    backend.enable(pipeline)
    errors = []
    try:
        for _ in range(2 if rank == 0 else 1):
            _run(pipeline, request)
    except Exception as exc:  # noqa: BLE001 - recorded for the parent's assertions
        errors.append(f"{type(exc).__name__}: {exc}")
    try:
        backend.disable()
    except Exception as exc:  # noqa: BLE001 - recorded for the parent's assertions
        errors.append(f"{type(exc).__name__}: {exc}")
    return {"errors": errors}


def _skipped_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's DiT has no blocks (a legacy config: its plan is skipped, not refused) while rank
    0's streams.  Before: rank 1 ran un-offloaded with no error while rank 0 raised.  Now both
    raise, rank 1 before any collective, each naming rank 1 and its skip reason, and nothing
    changed on either."""
    import dataclasses
    import warnings

    pipeline = _spec().build()
    if rank == 1:
        pipeline.transformer.transformer_blocks = nn.ModuleList()
        pipeline.transformer.single_transformer_blocks = nn.ModuleList()
    before = tensor_state(pipeline)
    backend = _backend(dataclasses.replace(_config("rank-local"), explicit=False), timeout_s=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy config warns about the empty containers
        obs: dict[str, Any] = {"first": _catch(lambda: backend.enable(pipeline))}
    obs["problems"] = untouched(pipeline, before, backend, backend.platform)
    return obs


class _InterruptOnce:
    """A forward pre-hook raising KeyboardInterrupt at its block's first call (Ctrl-C inside a
    streamed block, on every rank alike)."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt("inside a streamed block")


def _interrupted_allgather(rank: int, world: int) -> dict[str, Any]:
    """Ctrl-C inside a streamed block of an AllGather ring on both ranks, then new generations
    (race amplifier on).  Before: the ring's recovery assumed the copy stream was the last
    writer of each slot, but under AllGather it is the communication stream, so the next
    generation raised StreamOrderError on both ranks (on CUDA: a fill racing a gather into the
    same slot)."""
    request = _request(rank)
    want = _reference(request)
    pipeline = _spec().build()
    backend = _backend(_config("allgather"))
    backend.enable(pipeline)
    obs: dict[str, Any] = {"equal": [], "errors": []}
    try:
        for index in (2, 0, 4):  # inside the second ring's first block, block 0, the last
            blocks = [*pipeline.transformer.transformer_blocks,
                      *pipeline.transformer.single_transformer_blocks]
            handle = blocks[index].register_forward_pre_hook(_InterruptOnce())
            try:
                _run(pipeline, request)
                obs["errors"].append(f"block {index}: no interrupt")
            except KeyboardInterrupt:
                pass
            finally:
                handle.remove()
            for _ in range(2):
                try:
                    obs["equal"].append(torch.equal(_run(pipeline, request), want))
                except Exception as exc:  # noqa: BLE001 - recorded for the parent
                    obs["errors"].append(f"after block {index}: {type(exc).__name__}: {exc}")
                    break
    finally:
        backend.disable()
    obs["device_bytes"] = backend.platform.memory_allocated()
    return obs


TWO_RANK_SCENARIOS = [
    ("world_size_one", _world_size_one),
    ("state_dict", _state_dict),
    ("edit_weights", _edit_weights),
    ("enable_orders", _enable_orders),
    ("cli", _cli),
    ("skipped_block", _skipped_block),
    ("interrupted_allgather", _interrupted_allgather),
    ("skipped_rank", _skipped_rank),
    # Last: if a refusal took no round, every later enable of the batch would be out of step.
    ("asymmetric_config", _asymmetric_config),
    ("different_weights", _different_weights),
    ("asymmetric_calls", _asymmetric_calls),  # leaves its backends enabled: keep it last
]


def two_rank_batch(rank: int, world: int) -> dict[str, Any]:
    """Every two-rank scenario of tests/test_distributed_backend.py, in sequence."""
    assert world == 2, world
    return _batch(TWO_RANK_SCENARIOS, rank, world, "offload_ref/test_backend")


# -- three ranks ----------------------------------------------------------------------------------


def _plan_block_bytes(pipeline: nn.Module, config: Any) -> int:
    """Weight bytes of every streamed block of a pipeline that is not offloaded (each storage
    span once)."""
    from offload_ref import resolve_offload_plan
    from offload_ref.contracts.checks.distributed import streamed_block_bytes

    return streamed_block_bytes(resolve_offload_plan(pipeline, config))


def three_ranks(rank: int, world: int, name: str = THREE_RANK_FIXTURE) -> dict[str, Any]:
    """AllGather across three ranks: this rank's output, shard sizes and shard padding."""
    request = _request(rank, name)
    fresh = _spec(name).build()
    block_bytes = _plan_block_bytes(fresh, _config("allgather", world))
    reference = _reference(request, name)
    pipeline = _spec(name).build()
    backend = _backend(_config("allgather", world))
    backend.enable(pipeline)
    obs: dict[str, Any] = {"rank": rank, "world": backend.world, "block_bytes": block_bytes,
                           "alignment": backend.platform.alignment}
    obs["output"] = _run(pipeline, request)
    obs["reference"] = reference
    obs["stats"] = backend.stats().as_dict()
    rings = {}
    for ring in backend.rings:
        t = ring.transport
        tails = []
        for k, shard in enumerate(getattr(t, "shards", ())):
            lo = min(shard.numel(), max(0, t.image_bytes[k] - rank * t.shard_bytes[k]))
            tails.append(int(shard[lo:].count_nonzero()))
        rings[ring.label] = {
            "transport": t.name,
            # each block's slot image, from the ring's own layout (Note [Slot layout])
            "images": [sum(numel * d.itemsize
                           for d, (_, numel) in sections.items()) for sections in ring.sections],
            "shard_numel": [int(s.numel()) for s in getattr(t, "shards", ())],
            "nonzero_padding": tails, "slot_bytes": ring.slot_bytes,
            "slots": [int(s.storage.numel()) for s in ring.slots]}
    obs["rings"] = rings
    backend.disable()
    want = tensor_state(fresh)
    obs["restored_differs"] = [n for n, (_, _, t) in tensor_state(pipeline).items()
                               if not torch.equal(t, want[n][2])]
    return obs


# -- file-backed weights and anonymous memory ---------------------------------------------------

MMAP_BLOCKS = 64
MMAP_IN, MMAP_OUT = 256, 512  # a block: Linear(256, 512), 0.5 MB of fp32 weights
#: RssAnon that a streamed generation may add for reasons that are not the weights: malloc arenas
#: and stacks of the platform's worker threads, which start anew for the measured run.  It moves
#: in steps between runs of the same code (measured: 1.1 MB or 3.1 MB with a staging pool, 1.1 MB
#: or 1.6 MB without), so a bound without it fails by luck; a host copy of the blocks (33.7 MB)
#: is still ten times over it.
MMAP_RSS_SLACK = 3 * 2**20


class MmapBlock(nn.Module):
    """One block of the memory test's DiT: a 512 x 256 fp32 projection and its bias."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(MMAP_IN, MMAP_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)[..., :MMAP_IN] * 0.01


class MmapDit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, n_blocks: int = MMAP_BLOCKS) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(MMAP_IN)
        self.blocks = nn.ModuleList(MmapBlock() for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for block in self.blocks:
            x = block(x)
        return x


class MmapPipeline(nn.Module):
    """A pipeline whose only component is the DiT (declared, so nothing is guessed)."""

    _dit_modules = ["transformer"]
    _encoder_modules: list[str] = []
    _vae_modules: list[str] = []

    def __init__(self, n_blocks: int = MMAP_BLOCKS) -> None:
        super().__init__()
        self.transformer = MmapDit(n_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The DiT's resident norm says where it computes (its blocks may be parked on the host).
        return self.transformer(x.to(self.transformer.norm.weight.device))


def mmap_twin(n_blocks: int = MMAP_BLOCKS, seed: int = 0) -> MmapPipeline:
    """The memory test's pipeline built on the CPU the ordinary way."""
    torch.manual_seed(seed)
    return MmapPipeline(n_blocks).eval().requires_grad_(False)


def mmap_input() -> torch.Tensor:
    return torch.randn(2, MMAP_IN, generator=torch.Generator().manual_seed(1))


def save_mmap_twin(path: str, n_blocks: int = MMAP_BLOCKS) -> None:
    """The twin's DiT as a safetensors file whose every tensor starts 64-byte aligned, as the
    twin's own (freshly allocated) tensors do: the tests compare a run of the loaded DiT with a
    run of the twin bit for bit, and kernels pick their path by a weight's address (MKL's GEMV
    on AMD EPYC), so both must compute at the same alignment on every machine.  safetensors'
    own writer pads the header to 8 bytes only, which would put every tensor at one phase that
    is not 16-byte aligned (Note [File-backed weights] in loading.py)."""
    import json
    import struct

    state = mmap_twin(n_blocks).transformer.state_dict()
    header: dict[str, Any] = {}
    offset = 0
    for name, t in state.items():
        assert t.dtype == torch.float32 and t.is_contiguous(), name
        nbytes = t.numel() * t.element_size()
        assert nbytes % 64 == 0, f"{name}: {nbytes} bytes would misalign the next tensor"
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-(8 + len(text))) % 64)  # the data section starts 64-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in state.values():
            f.write(t.numpy().tobytes())


def mmap_weight_bytes(n_blocks: int = MMAP_BLOCKS) -> tuple[int, int]:
    """(the DiT's weight bytes, its streamed blocks' weight bytes), from a meta build."""
    with torch.device("meta"):
        model = MmapPipeline(n_blocks)
    total = sum(t.numel() * t.element_size() for t in model.transformer.state_dict().values())
    blocks = sum(t.numel() * t.element_size()
                 for t in model.transformer.blocks.state_dict().values())
    return total, blocks


def _streamed(pipeline: nn.Module, map_files: bool,
              staging_slots: int | None = None) -> tuple[Any, torch.Tensor]:
    """Distributed layerwise (rank-local) enabled on ``pipeline`` and one forward: the backend
    (left enabled) and the output."""
    import dataclasses

    backend = _backend(dataclasses.replace(_config("rank-local", world_size=1),
                                           staging_slots=staging_slots))
    if not map_files:  # the deliberately broken variant: a host copy of every block
        from offload_ref.backends.transports import RankLocalTransport

        backend.transport_for = lambda stack: RankLocalTransport(map_files=False)
    backend.enable(pipeline)
    with torch.inference_mode():
        out = pipeline(mmap_input())
    return backend, out


def _loaded(path: str, n_blocks: int) -> tuple[MmapPipeline, Any]:
    from offload_ref import load_safetensors

    with torch.device("meta"):
        pipeline = MmapPipeline(n_blocks).eval().requires_grad_(False)
    return pipeline, load_safetensors(pipeline.transformer, path)


def mmap_rss(rank: int, world: int, path: str, warm_path: str,
             map_files: bool = True, staging_slots: int | None = None) -> dict[str, Any]:
    """RssAnon growth of (1) a meta-built DiT loaded from ``path`` with load_safetensors, then
    streamed rank-local, one forward; (2) the same DiT built on the CPU the ordinary way and
    streamed the same way.  ``warm_path`` holds a two-block twin that runs the same code once
    first (imports, first-call caches, worker threads).  ``map_files=False`` breaks (1) on
    purpose (a host copy of every block); ``staging_slots`` streams (1) through a pinned
    staging pool of that many slots (Note [Pinned staging])."""
    import gc

    from offload_ref import anonymous_rss_bytes

    pipeline, _ = _loaded(warm_path, 2)  # the warm-up: every code path once
    backend, _ = _streamed(pipeline, map_files, staging_slots)
    backend.disable()
    backend.platform.close()
    del backend, pipeline
    gc.collect()
    total, blocks = mmap_weight_bytes()
    obs: dict[str, Any] = {"weight_bytes": total, "block_bytes": blocks}

    before = anonymous_rss_bytes()
    pipeline, report = _loaded(path, MMAP_BLOCKS)
    backend, out = _streamed(pipeline, map_files, staging_slots)
    obs["mmap_growth"] = anonymous_rss_bytes() - before
    obs["report_file_backed_bytes"] = report.file_backed_bytes
    obs["stats"] = backend.stats().as_dict()
    obs["mmap_output"] = out
    backend.disable()
    backend.platform.close()
    del backend, pipeline, out
    gc.collect()

    before = anonymous_rss_bytes()
    pipeline = mmap_twin()
    backend, out = _streamed(pipeline, True)
    obs["cpu_growth"] = anonymous_rss_bytes() - before
    obs["cpu_stats"] = backend.stats().as_dict()
    obs["cpu_output"] = out
    backend.disable()
    backend.platform.close()
    return obs
