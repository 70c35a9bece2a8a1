"""`offload-ref plan`'s predicted peak device bytes equal what the backends then hold."""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.fixtures import SPECS
from offload_ref.platform import CpuPlatform

CASES = [(spec, strategy) for spec in SPECS for strategy in ("model_level", "layer_wise")
         if spec.supports(strategy) and not (strategy == "model_level" and spec.name == "cosmos3")]


@pytest.mark.parametrize("spec,strategy", CASES, ids=[f"{s.name}-{t}" for s, t in CASES])
def test_predicted_peak_matches_the_measured_peak(spec, strategy: str) -> None:
    pipeline = spec.build()
    platform = CpuPlatform()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    try:
        backend.enable(pipeline)
        with torch.inference_mode():
            pipeline(**spec.make_inputs())
        measured = backend.stats().peak_device_bytes
        assert backend.plan.predicted_device_bytes() == measured, (spec.name, strategy)
    finally:
        backend.disable()
        platform.close()
