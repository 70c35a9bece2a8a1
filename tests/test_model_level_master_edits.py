"""Model level on an accelerator: a component's tensors go back to their pinned host masters only
after the copies that read those masters are done (an event recorded after the load's copies is
synchronized at offload), so a later edit through ``.data`` of an offloaded tensor, which writes
its master, never races a non_blocking copy still reading it (found by the stream sanitizer: the
kit's check_edits_through_data_are_exact_or_refused on wan22_t2v, cosmos3, wan22_i2v)."""

from __future__ import annotations

import pytest
import torch

from offload_ref import OffloadConfig, OffloadWeightEditError, get_offload_backend
from offload_ref.fixtures import get_spec
from offload_ref.platform import AcceleratorPlatform, simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")


@pytest.mark.parametrize("name", ["wan22_t2v", "flux2"])
def test_an_edit_of_an_offloaded_weight_never_races_the_copy_that_read_its_master(name) -> None:
    spec = get_spec(name)
    pipeline = spec.build()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"),
                                  platform=AcceleratorPlatform(simulated.device(0)))
    simulated.clear_races()
    with simulated.stream_checking():
        backend.enable(pipeline)
        try:
            with torch.no_grad():
                pipeline(**spec.make_inputs())
            with torch.no_grad():
                for p in pipeline.parameters():  # the masters of the offloaded components
                    if p.device.type == "cpu" and p.is_floating_point():
                        p.data.mul_(0.5)
            try:
                with torch.no_grad():
                    pipeline(**spec.make_inputs())
            except OffloadWeightEditError:
                pass  # refused: fine, as long as nothing raced
        finally:
            backend.disable()
        races = simulated.races(clear=True)
    assert races == [], "\n".join(map(str, races))
