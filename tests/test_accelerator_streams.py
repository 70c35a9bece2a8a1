"""offload-ref's accelerator platform (the code path a GPU runs: ``torch.Stream``, ``torch.Event``,
``torch.accelerator``) under the simulated accelerator's happens-before stream sanitizer: every
fixture x strategy, the ring's recovery paths, a failed enable's rollback, the pinned staging pool
and distributed layerwise (AllGather on a communication stream, two gloo ranks) leave no race;
each stream mutant of contracts/mutants/streams.py leaves the race it was made to leave.

The simulated streams run at once, in program order, so an ordering defect changes no output
there: the sanitizer's race list is what these tests read (``simulated.races()``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend, load_safetensors
from offload_ref.backends.distributed import AllGatherTransport, DistributedLayerWiseOffloadBackend
from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION, move_to_device
from offload_ref.contracts.outputs import leaves
from offload_ref.distributed import _backend_selftest as st
from offload_ref.distributed import run_ranks
from offload_ref.fixtures import SPECS, get_spec
from offload_ref.platform import AcceleratorPlatform, get_platform, simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

DEV = torch.device("hpu", 0)
STRATEGIES = ("model_level", "layer_wise", "distributed_layer_wise")
CASES = [(spec, strategy) for spec in SPECS for strategy in STRATEGIES if spec.supports(strategy)]
IDS = [f"{s.name}-{t}" for s, t in CASES]


# -- helpers --------------------------------------------------------------------------------------


@contextlib.contextmanager
def sanitized() -> Iterator[list[simulated.Race]]:
    """Stream checking on inside the block, starting from no race; the list it yields holds the
    races found in the block once it ends."""
    found: list[simulated.Race] = []
    with simulated.stream_checking():
        simulated.clear_races()
        try:
            yield found
        finally:
            found.extend(simulated.races(clear=True))


def _explain(races: list[simulated.Race]) -> str:
    return "\n\n".join(str(r) for r in races[:5]) + (
        f"\n\n... and {len(races) - 5} more" if len(races) > 5 else "")


def _generate(spec: Any, pipeline: Any) -> Any:
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _same(got: Any, want: Any) -> bool:
    g, w = leaves(got), leaves(want)
    return len(g) == len(w) and all(torch.equal(a.cpu(), b.cpu()) for (_, a), (_, b) in zip(g, w))


def _reuse_freed_device_memory(sizes: list[int]) -> None:
    """What the next user of the device does after a disable: allocate (and write) memory of the
    sizes just freed, on the default stream, which the allocator serves from the freed blocks."""
    held = [torch.empty(n, dtype=torch.uint8, device=DEV) for n in sizes]
    for t in held:
        t.fill_(0)
    torch.accelerator.synchronize(DEV)


def _slot_sizes(backend: Any) -> list[int]:
    return [s.storage.untyped_storage().nbytes() for ring in getattr(backend, "rings", ())
            for s in ring.slots]


def _cycle(spec: Any, backend: Any, pipeline: Any, want: Any) -> list[bool]:
    """The lifecycle a user runs: enable, two generations, an edit_weights round trip (disable
    and enable), one more generation, disable, then the freed memory handed out again."""
    backend.enable(pipeline)
    equal = []
    try:
        equal += [_same(_generate(spec, pipeline), want) for _ in range(2)]
        with backend.edit_weights():
            pass
        equal.append(_same(_generate(spec, pipeline), want))
        sizes = _slot_sizes(backend)
    finally:
        backend.disable()
    _reuse_freed_device_memory(sizes)
    return equal


# -- every fixture x strategy ---------------------------------------------------------------------


@pytest.mark.parametrize("spec,strategy", CASES, ids=IDS)
def test_the_accelerator_platform_leaves_no_race_on_any_fixture(spec, strategy: str) -> None:
    want = _generate(spec, move_to_device(spec.build(), DEV))
    platform = get_platform("hpu")
    assert isinstance(platform, AcceleratorPlatform)
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    with sanitized() as races:
        equal = _cycle(spec, backend, pipeline, want)
    assert not races, f"{spec.name} {strategy}:\n{_explain(races)}"
    assert equal == [True, True, True], (spec.name, strategy)


@pytest.mark.parametrize("name,config", [
    ("cosmos3", OffloadConfig(strategy="distributed_layer_wise", components=("dit",),
                              layer_options={"dit": {"resident_layers": 1}})),
    ("flux2", OffloadConfig(strategy="layer_wise", pin_memory=False)),
    ("flux2", OffloadConfig(strategy="model_level", pin_memory=False)),
], ids=["resident_layers", "layer_wise-pageable", "model_level-pageable"])
def test_resident_layers_and_pageable_masters_leave_no_race(name: str, config) -> None:
    """Distributed layerwise's resident leading blocks (non-block state to the ring), and
    pageable host masters (copies the host waits for) on the accelerator platform."""
    spec = get_spec(name)
    want = _generate(spec, move_to_device(spec.build(), DEV))
    backend = get_offload_backend(config, platform=get_platform("hpu"))
    with sanitized() as races:
        equal = _cycle(spec, backend, spec.build(), want)
    assert not races, f"{config}:\n{_explain(races)}"
    assert equal == [True, True, True], config


# -- the ring's other paths -------------------------------------------------------------------


class _InterruptOnce:
    """A forward pre-hook raising KeyboardInterrupt at its block's first call (Ctrl-C inside a
    streamed block)."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt("inside a streamed block")


def _flux2_blocks(pipeline: Any) -> list[nn.Module]:
    dit = pipeline.transformer
    return [*dit.transformer_blocks, *dit.single_transformer_blocks]


def test_recovery_after_an_interrupt_and_a_skipped_block_leaves_no_race() -> None:
    """Note [Interrupted blocks] (ring.py): a Ctrl-C inside a block, then a block the caller
    skips (a synchronous load, and a prefetched block that never runs), each followed by
    generations: the recovery's events order every slot as the steady state does."""
    spec = get_spec("flux2")
    reference = move_to_device(spec.build(), DEV)
    want = _generate(spec, reference)
    st._skipping(reference.transformer.transformer_blocks, 1)
    want_skipped = _generate(spec, reference)
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"),
                                  platform=get_platform("hpu"))
    equal = []
    with sanitized() as races:
        backend.enable(pipeline)
        try:
            for index in (2, 0, 4):
                handle = _flux2_blocks(pipeline)[index].register_forward_pre_hook(
                    _InterruptOnce())
                with pytest.raises(KeyboardInterrupt), handle:
                    _generate(spec, pipeline)
                equal.append(_same(_generate(spec, pipeline), want))
            st._skipping(pipeline.transformer.transformer_blocks, 1)
            equal += [_same(_generate(spec, pipeline), want_skipped) for _ in range(2)]
            st._skipping(pipeline.transformer.transformer_blocks, None)
            equal.append(_same(_generate(spec, pipeline), want))
            sizes = _slot_sizes(backend)
        finally:
            backend.disable()
        _reuse_freed_device_memory(sizes)
    assert not races, _explain(races)
    assert equal == [True] * 6


def _rollbacks(strategy: str, platform: Any) -> list[simulated.Race]:
    """Enable of flux2 fails at a step (the kit's fault injection), is rolled back and retried
    by a fresh backend, which generates once and disables: at the first and last steps, and at
    each step that issues copies (resident state, a ring's prefetch of block 0) and the one after
    it, where a failure leaves copies in flight when the rollback frees their memory and the
    retry's allocations reuse it.  The races found."""
    spec = get_spec("flux2")
    probe = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    probe.enable(spec.build())
    labels = probe.last_steps
    probe.disable()
    copies = [i for i, label in enumerate(labels) if label.startswith(("copy", "prefetch"))]
    assert copies, labels
    steps = sorted({0, *copies, *(i + 1 for i in copies), len(labels) - 1})
    with sanitized() as races:
        for step in steps:
            pipeline = spec.build()
            backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)

            def fail(index: int, label: str, step: int = step) -> None:
                if index == step:
                    raise RuntimeError(f"injected at step {index} ({label})")

            backend.fault_injector = fail
            with pytest.raises(Exception, match="injected"):
                backend.enable(pipeline)
            backend.fault_injector = None
            backend.enable(pipeline)
            _generate(spec, pipeline)
            backend.disable()
    return races


@pytest.mark.parametrize("strategy", ["layer_wise", "model_level"])
def test_a_failed_enable_rolls_back_without_a_race(strategy: str) -> None:
    races = _rollbacks(strategy, get_platform("hpu"))
    assert not races, _explain(races)


def test_a_rollback_that_frees_slots_before_the_copy_stream_is_a_use_after_free() -> None:
    """The control of the test above: a platform whose synchronize() waits for the compute
    stream alone (contracts/mutants/streams.py) frees a slot the copy stream may still write."""
    from offload_ref.contracts.mutants.streams import compute_only_synchronize

    races = _rollbacks("layer_wise", compute_only_synchronize())
    assert "use-after-free" in {r.kind for r in races}, _explain(races)


# -- the pinned staging pool ----------------------------------------------------------------------

MMAP_BLOCKS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("streams") / "dit.safetensors"
    st.save_mmap_twin(str(path), MMAP_BLOCKS)
    return str(path)


def _mmap_loaded(path: str) -> nn.Module:
    with torch.device("meta"):
        pipeline = st.MmapPipeline(MMAP_BLOCKS).eval().requires_grad_(False)
    load_safetensors(pipeline.transformer, path)
    return pipeline


def _staged_run(checkpoint: str, slots: int | None) -> tuple[list[simulated.Race], list[bool],
                                                             Any]:
    """The mmap-loaded twin streamed through the pinned staging pool (``staging_slots``) on the
    accelerator platform: three generations, disable, the slots' memory reused.  The races
    found, whether each generation matched, and the backend's stats."""
    with torch.inference_mode():
        want = st.mmap_twin(MMAP_BLOCKS)(st.mmap_input())
    pipeline = _mmap_loaded(checkpoint)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise", staging_slots=slots),
                                  platform=get_platform("hpu"))
    with sanitized() as races:
        backend.enable(pipeline)
        try:
            pool = backend._staging
            assert pool is not None and all(slot.buffer.is_pinned() for slot in pool.slots)
            got = []
            for _ in range(3):
                with torch.inference_mode():
                    got.append(torch.equal(pipeline(st.mmap_input()).cpu(), want))
            stats = backend.stats()
            sizes = _slot_sizes(backend)
        finally:
            backend.disable()
        _reuse_freed_device_memory(sizes)
    return races, got, stats


@pytest.mark.parametrize("slots", [None, 3])
def test_the_pinned_staging_pool_leaves_no_race(checkpoint: str, slots: int | None) -> None:
    """Note [Pinned staging]: the staging thread writes a pinned slot on the host after the copy
    that last read it (its event, synchronized on the host), the copy stream reads it after the
    staging's event; the sanitizer tracks the pinned memory as it tracks device memory."""
    races, got, stats = _staged_run(checkpoint, slots)
    assert not races, _explain(races)
    assert got == [True] * 3
    assert stats.staging_hits > 0 and stats.staging_bytes > 0


def test_a_staging_slot_rewritten_before_its_copy_is_a_host_race(checkpoint: str,
                                                                  monkeypatch) -> None:
    """The control of the test above: a pool whose staging thread does not wait for the copy
    that last read a slot writes pinned memory a non_blocking copy may still be reading."""
    from offload_ref.backends import layerwise, staging

    class Hasty(staging.StagingPool):
        def _after_reader(self, p: int) -> None:
            pass  # neither the host wait nor the staging stream's wait for the slot's read

    monkeypatch.setattr(layerwise, "StagingPool", Hasty)
    races, got, _ = _staged_run(checkpoint, None)
    assert "host-write-before-copy-done" in {r.kind for r in races}, _explain(races)
    assert got == [True] * 3


# -- distributed layerwise across two gloo ranks --------------------------------------------------


class _GatherWrites(AllGatherTransport):
    """The real transport, whose gather also writes the gathered image on the communication
    stream, by a uint8 add of 0 that changes no byte: the sanitizer takes the output of
    ``c10d::_allgather_base_`` for a read (its schema does not mark it written), so without
    this the gather's writes are not checked against compute's reads."""

    def gather(self, slot: Any, k: int) -> None:
        super().gather(slot, k)
        out, _ = self.slot_views(slot, k)
        with self.platform.stream(self.comm_stream):
            out.add_(0)


class _ReadyBeforeGather(_GatherWrites):
    """The control: the copy stream named as a fill's last writer, so the ring records the
    slot's ready event there, after the shard copy and not after the gather (compute's wait then
    orders nothing of the gather's writes)."""

    def writers(self) -> tuple[Any, ...]:
        return (self.comm_stream, self.streams.copy)


#: The runs of a rank: transfer, the AllGather transport (None: the backend's own).
RANK_RUNS = {"allgather": ("allgather", None), "allgather-writes": ("allgather", _GatherWrites),
             "rank-local": ("rank-local", None), "control": ("allgather", _ReadyBeforeGather)}


def rank_under_the_sanitizer(rank: int, world: int) -> dict[str, Any]:
    """On a spawned rank: flux2 streamed by distributed layerwise on the accelerator platform,
    AllGather (the gather on the communication stream; also with its writes made visible to the
    sanitizer) and rank-local, stream checking on: the races found, and whether each generation
    matched this rank's un-offloaded reference.  Under AllGather also a skipped block and a
    Ctrl-C inside a block (the recovery orders the gather).  Last, the control: the ready event
    recorded before the gather."""
    torch.set_num_threads(1)
    simulated.check_streams(True)
    request = st._request(rank)
    spec = get_spec(st.FIXTURE)
    reference = move_to_device(spec.build(), DEV)
    want = st._run(reference, request).cpu()
    st._skipping(reference.transformer.transformer_blocks, 1)
    want_skipped = st._run(reference, request).cpu()
    out: dict[str, Any] = {"rank": rank, "checking": simulated.check_streams(), "equal": {},
                           "races": {}, "kinds": {}}
    platform = get_platform("hpu")
    for run, (transfer, transport) in RANK_RUNS.items():
        simulated.clear_races()
        equal = []
        pipeline = spec.build()
        backend = st._backend(st._config(transfer), platform=platform, timeout_s=30.0)
        if transport is not None:
            backend.allgather_transport_class = transport
        backend.enable(pipeline)
        try:
            equal += [torch.equal(st._run(pipeline, request).cpu(), want) for _ in range(2)]
            if transfer == "allgather" and run != "control":
                st._skipping(pipeline.transformer.transformer_blocks, 1)
                equal.append(torch.equal(st._run(pipeline, request).cpu(), want_skipped))
                st._skipping(pipeline.transformer.transformer_blocks, None)
                handle = _flux2_blocks(pipeline)[2].register_forward_pre_hook(_InterruptOnce())
                try:
                    st._run(pipeline, request)
                except KeyboardInterrupt:
                    pass
                finally:
                    handle.remove()
                equal.append(torch.equal(st._run(pipeline, request).cpu(), want))
            sizes = _slot_sizes(backend)
        finally:
            backend.disable()
        _reuse_freed_device_memory(sizes)
        races = simulated.races(clear=True)
        out["equal"][run] = equal
        out["races"][run] = [str(r) for r in races]
        # (kind, whether the earlier access was the gather's write, on the communication stream)
        out["kinds"][run] = sorted({(r.kind, r.previous.op.startswith("aten::add")
                                     and r.previous.write) for r in races})
    return out


@pytest.mark.distributed
def test_distributed_layerwise_on_two_ranks_leaves_no_race() -> None:
    start = time.monotonic()
    ranks = run_ranks(rank_under_the_sanitizer, 2, timeout_s=90.0)
    assert time.monotonic() - start < 60.0
    for obs in ranks:
        assert obs["checking"], obs
        for run in ("allgather", "allgather-writes", "rank-local"):
            races = obs["races"][run]
            assert not races, f"rank {obs['rank']} {run}:\n" + "\n\n".join(races[:5])
        assert obs["equal"] == {"allgather": [True] * 4, "allgather-writes": [True] * 4,
                                "rank-local": [True] * 2, "control": [True] * 2}, obs
        # The control: compute read a slot the gather wrote, unordered, and the sanitizer saw it.
        assert ("read-after-write", True) in obs["kinds"]["control"], obs["races"]["control"]


# -- the stream mutants leave their races ---------------------------------------------------------


def _run_impl(make_platform: Callable[[], Any], make_backend: Callable[..., Any]
              ) -> tuple[list[simulated.Race], list[bool]]:
    """flux2 under layerwise offload built by ``make_backend`` on ``make_platform()``: the races
    the lifecycle leaves, and whether each generation matched."""
    spec = get_spec("flux2")
    want = _generate(spec, move_to_device(spec.build(), DEV))
    backend = make_backend(OffloadConfig(strategy="layer_wise"), make_platform())
    with sanitized() as races:
        equal = _cycle(spec, backend, spec.build(), want)
    return races, equal


def _declared(name: str) -> tuple[Callable[[], Any], Callable[..., Any]]:
    from offload_ref.contracts.mutants import MUTANTS

    impl = next(m for m in MUTANTS if m.name == name).impl
    return impl.make_accelerator_platform, impl.make_backend


def _slot_freed_before_the_copy_stream() -> tuple[Callable[[], Any], Callable[..., Any]]:
    from offload_ref.contracts.mutants.streams import compute_only_synchronize

    return compute_only_synchronize, DEFAULT_IMPLEMENTATION.make_backend


MUTANT_RACES = {
    "accelerator_ready_wait_skipped": "read-after-write",
    "accelerator_free_wait_skipped": "write-after-read",
    "accelerator_ready_recorded_on_compute": "read-after-write",
    "slot_freed_before_the_copy_stream": "use-after-free",  # not a declared mutant yet
}


def test_the_real_implementation_on_the_mutants_platform_leaves_no_race() -> None:
    """The control of the test below: the mutants' harness with nothing broken."""
    races, equal = _run_impl(DEFAULT_IMPLEMENTATION.make_accelerator_platform,
                             DEFAULT_IMPLEMENTATION.make_backend)
    assert not races, _explain(races)
    assert all(equal)


@pytest.mark.parametrize("name,kind", sorted(MUTANT_RACES.items()))
def test_each_stream_mutant_leaves_its_race_and_no_wrong_output(name: str, kind: str) -> None:
    """contracts/mutants/streams.py: each defect leaves a race of its kind between two streams
    (and, the streams running in program order, exact outputs)."""
    make_platform, make_backend = (_slot_freed_before_the_copy_stream()
                                   if name == "slot_freed_before_the_copy_stream"
                                   else _declared(name))
    races, equal = _run_impl(make_platform, make_backend)
    assert all(equal), "the simulated streams run in program order: outputs stay exact"
    kinds = {r.kind for r in races}
    assert kind in kinds, f"{name}: expected a {kind} race, got {sorted(kinds)}:\n" \
                          f"{_explain(races)}"
    race = next(r for r in races if r.kind == kind)
    assert race.current.stream != race.previous.stream, str(race)


def test_a_platform_on_another_device_leaves_the_callers_current_device_and_stream() -> None:
    # Note [The current device after a stream switch]: restoring hpu:1's stream made hpu:1 the
    # current device, under a caller working on hpu:0
    assert torch.accelerator.device_count() >= 2
    platform = AcceleratorPlatform(torch.device("hpu", 1))
    before = (torch.accelerator.current_device_index(),
              torch.accelerator.current_stream(0), torch.accelerator.current_stream(1))
    assert before[0] == 0
    copy = platform.Stream()
    with platform.stream(copy):
        assert torch.accelerator.current_stream(1) == copy
    after, then = platform.Event(), platform.Event()
    after.record(platform.current_stream())
    host = torch.ones(8).pin_memory()
    dst = torch.empty(8, device=platform.device)
    platform.fill(copy, after, [(dst, host)], then)
    platform.synchronize()
    assert (torch.accelerator.current_device_index(), torch.accelerator.current_stream(0),
            torch.accelerator.current_stream(1)) == before
    assert torch.equal(dst.cpu(), host)
