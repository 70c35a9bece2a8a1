"""The conformance kit on tiny pipelines built around REAL diffusers / transformers classes.

This is the kit used the way an outside model author uses it: the pipelines in
``tests/real_models.py`` import only offload_ref's public names, declare their components with
``SupportsComponentDiscovery`` and their blocks with ``OffloadPlan`` (third-party model classes
cannot carry ``_layerwise_offload_blocks_attrs``), and call the real models through their forward.

Skipped, with the reason, where diffusers or transformers is not installed (the ``test`` extra
installs both, so CI runs them).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("diffusers", reason="the real-model conformance tests need diffusers")
pytest.importorskip("transformers", reason="the real-model conformance tests need transformers")

from offload_ref.contracts import CATALOGUE, parametrize_with_checks  # noqa: E402
from offload_ref.contracts.checks.lifecycle import REPEATED_ENABLE_CHECKS  # noqa: E402
from real_models import SPECS  # noqa: E402  (tests/ is on sys.path: rootdir conftest)

_BY_NAME = {s.name: s for s in SPECS}

# Skip-layer guidance runs blocks [0,1,2], [0,1,2], [0,2] each step: an order that is not
# first-order.  It used to be a strict expected failure of the prefetch check; the ring's
# call-order predictor now learns it (tests/test_call_order.py).
OFFLOAD_REF_EXPECTED_FAILURES: dict[str, str] = {}

# The whole catalogue on the two richest shapes: FLUX (one ring over two containers with
# heterogeneous blocks, bf16 DiT next to float32 CLIP and T5 encoder rings, T5's tied
# embedding) and the SD UNet (down_blocks + the single-module mid_block + up_blocks).
# And SD3 encoding its prompt as SD3 does (output_hidden_states=True), whose encoders gain
# transformers' own hooks on their first call: no check may take those for the offloader's.
OFFLOAD_REF_SPECS = [_BY_NAME["real_flux_bf16"], _BY_NAME["real_sd"],
                     _BY_NAME["real_sd3_hidden_states"]]


def test_real_model_offload(offload_ref_check):
    offload_ref_check()


# The other shapes (SD3 with skip-layer guidance, Wan's RoPE buffers) without the three costly
# lifecycle checks that inject a fault at every enable step or cycle enable/disable 100 times:
# those depend on the tensor count, not on the architecture, and run on the specs above.


@parametrize_with_checks(
    [_BY_NAME["real_sd3_slg"], _BY_NAME["real_wan"], _BY_NAME["real_sdxl_style"]],
    checks=sorted(c for c, info in CATALOGUE.items()
                  if info.scope != "global" and c not in REPEATED_ENABLE_CHECKS),
    expected_failures=OFFLOAD_REF_EXPECTED_FAILURES,
)
def test_real_model_offload_shapes(check):
    check()
