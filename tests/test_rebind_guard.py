"""Note [Rebind guard]: while a backend is enabled, edits through ``.data`` are seen or refused.

``w.data += d`` (peft's LoRA merge, diffusers' ``fuse_lora``) bypasses the version counter and
``w.data = new`` (``module.to(dtype)``, layerwise casting) rebinds the tensor; without the guard
the next swap or block load dropped either silently.  The kit's §J.3 check
(``check_edits_through_data_are_exact_or_refused``) covers every fixture; these tests pin the
guard's own behaviour: classes, errors, pickling, rollback, disable.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, OffloadWeightEditError, get_offload_backend
from offload_ref.backends.base import OffloadEnableError
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import resident as resident_pipeline  # noqa: E402 (tests/ is on sys.path)

STRATEGIES = ("model_level", "layer_wise")


def _enabled(strategy: str, name: str = "flux2"):
    spec = get_spec(name)
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    return spec, pipeline, backend


def _run(spec, pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _tensors(pipeline: nn.Module) -> list[torch.Tensor]:
    return [*pipeline.parameters(), *pipeline.buffers()]


def _plain(pipeline: nn.Module) -> bool:
    return all(type(p) is nn.Parameter for p in pipeline.parameters()) and all(
        type(b) is torch.Tensor for b in pipeline.buffers())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_guarded_tensors_keep_their_kind_and_give_plain_results(strategy: str) -> None:
    spec, pipeline, backend = _enabled(strategy)
    try:
        assert not _plain(pipeline), "the backend guards the tensors it rebinds"
        assert all(isinstance(p, nn.Parameter) for p in pipeline.parameters())
        assert not any(isinstance(b, nn.Parameter) for b in pipeline.buffers())
        out = _run(spec, pipeline)
        assert type(out) is torch.Tensor
        w = next(pipeline.parameters())
        assert type(w * 2) is torch.Tensor and type(w.data) is torch.Tensor
        assert torch.equal(out, _run(spec, resident_pipeline(spec.build())))
    finally:
        backend.disable()
    assert _plain(pipeline)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_assigning_data_is_refused_naming_the_tensor_and_changes_nothing(strategy: str) -> None:
    spec, pipeline, backend = _enabled(strategy)
    try:
        _run(spec, pipeline)
        name, w = next((n, p) for n, p in pipeline.named_parameters() if p.dim() == 2)
        before = (w.data_ptr(), w.dtype, w.shape)
        with pytest.raises(OffloadWeightEditError, match=name.replace(".", r"\.")) as info:
            w.data = torch.zeros_like(w)
        assert "edit_weights" in str(info.value)
        assert (w.data_ptr(), w.dtype, w.shape) == before
        with pytest.raises(OffloadWeightEditError):
            pipeline.to(torch.float64)  # nn.Module._apply assigns .data
        assert {p.dtype for p in pipeline.parameters()} == {torch.float32}
        # A no-op conversion assigns each tensor to itself: allowed.  (Its dtype, not a device:
        # the resident tensors are on the device, the offloaded ones' masters on the host.)
        pipeline.to(torch.float32)
        w.data = w.data  # the same view: allowed
        assert torch.equal(_run(spec, pipeline), _run(spec, resident_pipeline(spec.build())))
    finally:
        backend.disable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_in_place_edit_through_data_is_refused_at_the_next_generation(strategy: str) -> None:
    spec, pipeline, backend = _enabled(strategy)
    _run(spec, pipeline)
    versions = {}
    for name, p in pipeline.named_parameters():
        versions[name] = p._version
    # A weight bound to real storage now (a loaded component or materialized block, or resident).
    with torch.no_grad():
        for p in pipeline.parameters():
            try:
                p.data.mul_(1.25)
            except RuntimeError:  # a streamed block's placeholder (one shared element)
                continue
    assert any(p._version != versions[n] for n, p in pipeline.named_parameters())
    # Layerwise refuses the streamed weights' reads (Note [Reads between forwards]): the
    # resident ones were edited, and the next generation names the half-applied edit.
    with pytest.raises(OffloadWeightEditError,
                       match="half-way" if strategy == "layer_wise" else "edited in place"):
        _run(spec, pipeline)
    backend.disable()  # layerwise: no streamed weight was edited, so nothing to warn about
    assert _plain(pipeline)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_copies_and_pickles_of_guarded_tensors_are_plain(strategy: str) -> None:
    spec, pipeline, backend = _enabled(strategy)
    try:
        tensors = _tensors(pipeline)
        if strategy == "layer_wise":
            # Streamed tensors between forwards hold placeholders: their copies are refused
            # (Note [Reads between forwards]); the resident ones copy as below.
            streamed = {id(t) for g in (g for r in backend.rings for g in r.groups)
                        for t in g.tensors}
            some = next(t for t in tensors if id(t) in streamed)
            for how in (copy.deepcopy, pickle.dumps):
                with pytest.raises(OffloadWeightEditError, match="outside its block's forward"):
                    how(some)
            with pytest.raises(OffloadWeightEditError, match="outside its block's forward"):
                torch.save(pipeline.state_dict(keep_vars=True), io.BytesIO())
            tensors = [t for t in tensors if id(t) not in streamed]
        copied = copy.deepcopy(tensors)
        assert [type(t) for t in copied] == [
            nn.Parameter if isinstance(t, nn.Parameter) else torch.Tensor for t in tensors]
        restored = pickle.loads(pickle.dumps(tensors))
        assert [type(t) for t in restored] == [type(t) for t in copied]
        if strategy != "layer_wise":
            buffer = io.BytesIO()
            torch.save(pipeline.state_dict(keep_vars=True), buffer)
            buffer.seek(0)
            loaded = torch.load(buffer)
            assert all(type(v) in (nn.Parameter, torch.Tensor) for v in loaded.values())
    finally:
        backend.disable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failed_enable_leaves_every_tensor_plain(strategy: str) -> None:
    spec = get_spec("flux2")
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    steps = list(backend.last_steps)
    backend.disable()
    guard = next(i for i, s in enumerate(steps) if s.startswith("guard .data"))
    for fail_at in (guard, guard + 1) if guard + 1 < len(steps) else (guard,):
        def inject(index: int, label: str, fail_at: int = fail_at) -> None:
            if index == fail_at:
                raise RuntimeError(f"injected at {label}")

        backend.fault_injector = inject
        with pytest.raises(OffloadEnableError):
            backend.enable(pipeline)
        assert _plain(pipeline), f"a rollback from step {fail_at} left guarded tensors"
    backend.fault_injector = None
    backend.enable(pipeline)
    backend.disable()
    assert _plain(pipeline)


def test_a_split_models_own_component_groups_guard_their_tensors() -> None:
    spec, pipeline, backend = _enabled("model_level", "cosmos3")
    try:
        assert not _plain(pipeline)
        w = next(p for p in pipeline.parameters() if p.dim() == 2)
        with pytest.raises(OffloadWeightEditError):
            w.data = torch.zeros_like(w)
    finally:
        backend.disable()
    assert _plain(pipeline)


def test_other_tensor_subclasses_keep_their_class() -> None:
    class Tagged(torch.Tensor):
        pass

    spec = get_spec("flux2")
    pipeline = spec.build()
    owner, name = next((m, n) for m in pipeline.transformer.modules()
                       for n, b in m.named_buffers(recurse=False) if b is not None)
    original = getattr(owner, name)
    tagged = original.as_subclass(Tagged)
    owner._buffers[name] = tagged
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=CpuPlatform())
    backend.enable(pipeline)
    try:
        assert type(owner._buffers[name]) is Tagged
    finally:
        backend.disable()
    assert type(owner._buffers[name]) is Tagged


def test_reads_of_streamed_data_between_forwards_are_refused_and_half_edits_are_caught() -> None:
    """Note [Reads between forwards]: before, diffusers' fuse_qkv_projections built NaN
    projections from the placeholders (for good, even after disable()), and a refused peft
    merge was left half-applied.  A pure read is refused and forgotten; a read refused after
    resident weights were edited makes the next generation refuse the half-applied edit."""
    spec, pipeline, backend = _enabled("layer_wise")
    reference = _run(spec, resident_pipeline(spec.build()))
    try:
        _run(spec, pipeline)
        streamed = [t for r in backend.rings for g in r.groups for t in g.tensors]
        block = backend.rings[0].blocks[1]
        weight = next(p for p in block.parameters())
        with pytest.raises(OffloadWeightEditError, match=r"\.data was read outside its block"):
            weight.data
        assert torch.equal(_run(spec, pipeline), reference)  # a pure read changed nothing
        seen = []  # inside the block's forward the same read is allowed, and true
        handle = block.register_forward_pre_hook(lambda m, a: seen.append(weight.data.clone()))
        try:
            assert torch.equal(_run(spec, pipeline), reference)
        finally:
            handle.remove()
        assert seen and not seen[0].isnan().any()
        resident = next(p for p in pipeline.parameters() if all(p is not t for t in streamed))
        with torch.no_grad():
            resident.data.mul_(1.25)  # what a merge does first to a resident layer
        with pytest.raises(OffloadWeightEditError):
            weight.data.mul_(1.25)  # ... and then to a streamed one: refused at the read
        with pytest.raises(OffloadWeightEditError, match="half-way"):
            _run(spec, pipeline)
    finally:
        backend.disable()
