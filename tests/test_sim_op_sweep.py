"""The op sweep (ci/sim_op_sweep.py) itself, on a slice: real diffusers transformers and a few
OpInfo families, forward and backward on the simulated accelerator against the CPU, bitwise.
The whole sweep (every OpInfo, every dtype) is ``python ci/sim_op_sweep.py`` (about 5 min)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from offload_ref.platform import simulated

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not simulated.available(),
                       reason=f"the simulated accelerator is not available: "
                              f"{simulated.unavailable_reason()}"),
]

SCRIPT = Path(__file__).resolve().parents[1] / "ci" / "sim_op_sweep.py"


def _sweep():
    spec = importlib.util.spec_from_file_location("sim_op_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_op_sweep"] = module
    spec.loader.exec_module(module)
    return module


def test_real_diffusers_transformers_forward_and_backward_are_bit_exact(capsys) -> None:
    pytest.importorskip("diffusers")
    status = _sweep().main(["models", "--models", "flux", "--dtypes", "float32"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "1 ok" in out


def test_an_opinfo_slice_is_bit_exact(capsys) -> None:
    pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest "
                        "(pip install expecttest)")
    status = _sweep().main(["opinfo", "--ops", "nn.functional.[gs]*", "--dtypes",
                            "float32,complex64"])
    out = capsys.readouterr().out
    assert status == 0, out
