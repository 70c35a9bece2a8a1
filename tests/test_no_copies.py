"""Note [No copies while enabled]: ``copy.deepcopy`` / pickling of an enabled module is refused.

Before, ``copy.deepcopy(pipe.transformer)`` and ``torch.save(pipe.transformer, f)`` of an
enabled pipeline failed deep inside torch with "cannot pickle '_thread.lock' object" or "Can't
pickle local object '_refuse_load_hook.<locals>.hook'"; a module whose first unpicklable object
came late would first have copied its NaN placeholders.  Now every object a backend attaches
refuses with a TypeError naming the module and the ways out, and each way out gives an exact
copy.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import host, resident  # noqa: E402 (tests/ is on sys.path)

STRATEGIES = ("model_level", "layer_wise")


def _build(name: str = "flux2"):
    spec = get_spec(name)
    return spec, spec.build()


def _run(spec, pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _dit(pipeline: nn.Module) -> nn.Module:
    return pipeline.transformer


def _refused(fn, *words: str) -> None:
    with pytest.raises(TypeError, match="while offload-ref offloads it") as info:
        fn()
    message = str(info.value)
    for word in ("backend.disable()", "edit_weights()", "state_dict()", *words):
        assert word in message, (word, message)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_copying_or_pickling_an_enabled_module_is_refused_by_name(strategy: str) -> None:
    spec, pipeline = _build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    try:
        _run(spec, pipeline)
        dit = _dit(pipeline)
        for fn in (lambda: copy.deepcopy(dit), lambda: pickle.dumps(dit),
                   lambda: torch.save(dit, io.BytesIO()), lambda: copy.deepcopy(pipeline)):
            _refused(fn)
        _refused(lambda: copy.deepcopy(dit), "transformer")
        if strategy == "layer_wise":
            block_path, block = next((n, m) for n, m in dit.named_modules()
                                     if n.count(".") == 1 and n.split(".")[1].isdigit())
            _refused(lambda: copy.deepcopy(block), f"block 'transformer.{block_path}'")
        # The pipeline still runs and is exact afterwards: a refused copy changed nothing.
        fresh_spec, reference = _build()
        assert torch.equal(_run(spec, pipeline), _run(fresh_spec, resident(reference)))
    finally:
        backend.disable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_way_out_gives_an_exact_copy(strategy: str) -> None:
    spec, pipeline = _build()
    reference_spec, reference = _build()
    expected = _run(reference_spec, resident(reference_spec.build()))  # on the device
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    backend.enable(pipeline)
    try:
        _run(spec, pipeline)
        # state_dict() holds the true weights while enabled, and saves.
        buffer = io.BytesIO()
        torch.save(_dit(pipeline).state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
        for key, value in _dit(reference).state_dict().items():
            assert torch.equal(host(saved[key]), value), key  # resident ones are on the device
        # Inside edit_weights() the pipeline is plain: a deep copy runs on its own.
        with backend.edit_weights() as plain:
            copied = copy.deepcopy(plain)
        assert all(type(p) is nn.Parameter for p in copied.parameters())
        # Weights, not outputs: a copy's fresh storage may start at another alignment, and
        # MKL's kernel path (so the last bits) depends on it, with or without offload.
        _same_weights(copied, reference)
        assert torch.equal(_run(spec, pipeline), expected)
    finally:
        backend.disable()
    # After disable() too, pickled and back.
    _same_weights(pickle.loads(pickle.dumps(pipeline)), reference)


def _same_weights(copied: nn.Module, reference: nn.Module) -> None:
    got, want = copied.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
