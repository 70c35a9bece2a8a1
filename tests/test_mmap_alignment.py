"""Note [Both alignment phases] (contracts/checks/distributed.py): a reference and an offloaded
run of mmap-loaded weights compute with every tensor at the same address modulo 64, for files
that put tensors both 64-byte aligned and off a 16-byte boundary.  MKL's GEMV gives other last
bits for an unaligned weight on AMD EPYC only, so these tests compare addresses, not outputs:
they fail on any machine when one side realigns.  (The two-rank check itself is proven by the
mutant ``mmap_views_realigned_on_the_device``, tests/test_mutants.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload_ref import is_file_backed, load_safetensors
from offload_ref.contracts.case import DEFAULT_IMPLEMENTATION, CheckCase, move_to_device
from offload_ref.contracts.checks.distributed import (
    MMAP_PREFIX,
    _phases_while_running,
    _unique_contiguous,
    unaligned_phase,
    write_safetensors_at_phases,
)
from offload_ref.contracts.mutants import MUTANTS
from offload_ref.fixtures import get_spec
from offload_ref.host import LayoutRule
from device_helpers import DEVICE, SIMULATED  # noqa: E402 (tests/ is on sys.path)


def _written(tmp_path: Path, name: str = "flux2"):
    """A fixture's DiT written at both phases, and a function that builds the pipeline with its
    DiT loaded from that file."""
    spec = get_spec(name)
    source = spec.build()
    path = tmp_path / "transformer.safetensors"
    phases = write_safetensors_at_phases(_unique_contiguous(source.transformer.state_dict()), path)

    def loaded():
        pipeline = spec.build()
        load_safetensors(pipeline.transformer, path, prefix=MMAP_PREFIX)
        return pipeline

    return spec, source, phases, loaded


def test_the_kits_file_puts_tensors_at_both_phases(tmp_path: Path) -> None:
    _, source, phases, loaded = _written(tmp_path)
    pipeline = loaded()
    state = _unique_contiguous(source.transformer.state_dict())
    got = dict(pipeline.transformer.named_parameters())
    got.update(pipeline.transformer.named_buffers())
    seen = set()
    for i, (name, want) in enumerate(state.items()):
        t = got[name]
        assert is_file_backed(t), name
        assert torch.equal(t, want), name
        expected = 0 if i % 2 == 0 else unaligned_phase(t.element_size())
        assert phases[name] == expected == t.data_ptr() % 64, name
        seen.add(t.data_ptr() % 16 == 0)
    assert seen == {True, False}  # both phases, whatever this CPU


def test_move_to_device_keeps_the_address_phase_of_an_unaligned_storage(tmp_path: Path) -> None:
    _, _, phases, loaded = _written(tmp_path)
    host = loaded()
    before = {n: (t.data_ptr() % 64, t.detach().clone())
              for n, t in host.transformer.state_dict(keep_vars=True).items()}
    moved = move_to_device(loaded(), DEVICE)
    unaligned = 0
    for name, t in moved.transformer.state_dict(keep_vars=True).items():
        phase, values = before[name]
        assert t.device == DEVICE, name
        assert t.data_ptr() % 64 == phase, name
        assert torch.equal(t.cpu(), values), name
        unaligned += phase % 16 != 0
    assert unaligned
    if SIMULATED:  # a plain storage copy starts aligned: the old reference, the defect
        storage = host.transformer.x_embedder.bias.untyped_storage()
        assert storage.data_ptr() % 16 and storage.to(device=DEVICE).data_ptr() % 64 == 0


class _StorageStartsAligned(LayoutRule):
    """The broken variant: a storage's copy starts on a fresh 64-byte boundary."""

    def phase(self, storage_ptr: int, byte_offset: int, alignment: int) -> int:
        return byte_offset % min(alignment, 64)


@pytest.mark.parametrize("rule", [None, _StorageStartsAligned()], ids=["offload_ref", "realigned"])
def test_layerwise_computes_with_the_references_phases(tmp_path: Path, rule) -> None:
    """Single-process layerwise on the kit's device: every tensor a module computes with sits
    where the reference's does (modulo 64); a layout that realigns file views is caught on any
    machine.  The outputs are equal either way on this CPU."""
    spec, _, _, loaded = _written(tmp_path)
    case = CheckCase(spec, "layer_wise", DEFAULT_IMPLEMENTATION)
    request = dict(spec.make_inputs())
    ref_phases, want = _phases_while_running(case, move_to_device(loaded(), case.device), request)
    platform = case.platform()
    if rule is not None:
        platform.layout_rule = rule
    backend = case.backend(case.config(), platform)
    pipeline = loaded()
    backend.enable(pipeline)
    try:
        phases, got = _phases_while_running(case, pipeline, request)
    finally:
        backend.disable()
        case.close()
    compared = [n for n in ref_phases if n in phases]
    assert any(ref_phases[n] % 16 for n in compared)  # unaligned tensors were compared
    moved = [n for n in compared if phases[n] != ref_phases[n]]
    if rule is None:
        assert moved == []
        assert torch.equal(got.cpu(), want.cpu())
    else:
        assert moved and all(phases[n] == 0 for n in moved)
        assert all(ref_phases[n] for n in moved)


def test_the_check_is_proven_by_a_mutant() -> None:
    killers = [m for m in MUTANTS if "check_mmap_loaded_weights_keep_their_alignment" in m.kills]
    assert [m.name for m in killers] == ["mmap_views_realigned_on_the_device"]


def test_the_mmap_twin_file_is_aligned_like_the_twin(tmp_path: Path) -> None:
    """tests/test_staging.py and the distributed selftest compare a run of the loaded DiT with a
    run of its freshly allocated twin bit for bit: both must compute at one alignment."""
    from offload_ref.distributed._backend_selftest import MmapPipeline, mmap_twin, save_mmap_twin

    path = tmp_path / "twin.safetensors"
    save_mmap_twin(str(path), 4)
    with torch.device("meta"):
        loaded = MmapPipeline(4)
    load_safetensors(loaded.transformer, path)
    twin = mmap_twin(4)
    for (name, t), w in zip(loaded.transformer.state_dict().items(),
                            twin.transformer.state_dict().values()):
        assert is_file_backed(t) and torch.equal(t, w), name
        assert t.data_ptr() % 64 == w.data_ptr() % 64 == 0, name
