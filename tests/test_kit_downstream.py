"""The kit as an outside author runs it (issue 11 acceptance): a downstream package written into a
temporary folder outside the repository, no conftest, nothing installed but offload-ref itself.

Every route runs in a subprocess from that folder, so a dependence on this repository's conftest,
its ``tests`` folder or its fixture names would fail here:

* ``offload-ref check pkg:GoodPipeline`` (a class as the factory) exits 0 with a green matrix;
* a pipeline whose encoder and DiT share a block fails, and the report names both paths;
* a pipeline whose modules refuse forward hooks fails, and its rollback checks pass;
* pytest on the author's own test file (``OFFLOAD_REF_SPECS`` and ``parametrize_with_checks``),
  under ``-n 2``, and ``pytest --pyargs offload_ref.contracts --offload-ref-spec REF`` with no test
  file at all.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_TIMEOUT_S = 300
_REPO = Path(__file__).resolve().parents[1]

_PIPELINES = '"""An outside author\'s tiny text-to-image pipelines, declared for offload-ref.\n\nNothing here imports the project\'s fixtures or relies on its conftest.\n"""\nimport torch\nfrom torch import nn\n\nfrom offload_ref import SupportsComponentDiscovery\nfrom offload_ref.contracts import PipelineSpec\n\nDIM = 16\n\n\nclass Block(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.norm = nn.LayerNorm(DIM)\n        self.attn = nn.Linear(DIM, DIM)\n        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))\n\n    def forward(self, x, temb):\n        x = x + self.attn(self.norm(x) + temb)\n        return x + self.mlp(x)\n\n\nclass AcmeTransformer(nn.Module):\n    _layerwise_offload_blocks_attrs = ["blocks"]\n\n    def __init__(self, depth=4):\n        super().__init__()\n        self.time = nn.Linear(1, DIM)\n        self.blocks = nn.ModuleList(Block() for _ in range(depth))\n        self.out = nn.Linear(DIM, DIM)\n\n    def forward(self, x, t):\n        temb = self.time(t.reshape(1, 1, 1))\n        for block in self.blocks:\n            x = block(x, temb)\n        return self.out(x)\n\n\nclass AcmeTextEncoder(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.embed = nn.Embedding(32, DIM)\n        self.proj = nn.Linear(DIM, DIM)\n\n    def forward(self, ids):\n        return self.proj(self.embed(ids)).mean(dim=1, keepdim=True)\n\n\nclass AcmeDecoder(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.proj = nn.Linear(DIM, 3)\n\n    def forward(self, x):\n        return self.proj(x)\n\n\nclass GoodPipeline(SupportsComponentDiscovery, nn.Module):\n    _dit_modules = ["transformer"]\n    _encoder_modules = ["text_encoder"]\n    _vae_modules = ["vae"]\n\n    def __init__(self):\n        super().__init__()\n        self.text_encoder = AcmeTextEncoder()\n        self.transformer = AcmeTransformer()\n        self.vae = AcmeDecoder()\n        self.eval()\n        self.requires_grad_(False)\n\n    @torch.no_grad()\n    def forward(self, prompt_ids=None, steps=3):\n        device = self.vae.proj.weight.device\n        ids = torch.arange(6).reshape(1, 6) if prompt_ids is None else prompt_ids\n        cond = self.text_encoder(ids.to(device))\n        x = torch.randn(1, 8, DIM, generator=torch.Generator().manual_seed(0)).to(device)\n        for step in range(steps):\n            t = torch.full((1,), 1.0 - step / steps, device=device)\n            x = x - self.transformer(x + cond, t) / steps\n        return {"images": self.vae(x), "steps": steps}\n\n\nclass SharedBlockPipeline(GoodPipeline):\n    """The encoder reuses the DiT\'s first block: offloading one would move the other\'s weights."""\n\n    def __init__(self):\n        super().__init__()\n        self.text_encoder.refine = self.transformer.blocks[0]\n\n\nclass _RefusesHooks:\n    """Refuses forward hooks, as some compiled or scripted modules do."""\n\n    def register_forward_pre_hook(self, *args, **kwargs):\n        raise RuntimeError(f"{type(self).__name__} does not support forward hooks")\n\n    register_forward_hook = register_forward_pre_hook\n\n\nclass FusedBlock(_RefusesHooks, Block):\n    pass\n\n\nclass FusedTransformer(_RefusesHooks, AcmeTransformer):\n    def __init__(self, depth=4):\n        super().__init__(depth)\n        self.blocks = nn.ModuleList(FusedBlock() for _ in range(depth))\n\n\nclass HookRefusingPipeline(GoodPipeline):\n    def __init__(self):\n        super().__init__()\n        self.transformer = FusedTransformer()\n        self.requires_grad_(False)\n\n\ndef make_inputs(seed=0):\n    return {"prompt_ids": torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(seed))}\n\n\nSPEC = PipelineSpec(name="acme", factory="acme_offload.pipelines:GoodPipeline",\n                    inputs="acme_offload.pipelines:make_inputs")\n'

_AUTHOR_TESTS = textwrap.dedent('''
    from offload_ref.contracts import parametrize_with_checks

    from acme_offload.pipelines import SPEC

    OFFLOAD_REF_SPECS = [SPEC]


    def test_offload(offload_ref_check):
        offload_ref_check()


    @parametrize_with_checks([SPEC])
    def test_offload_decorated(check):
        check()
''')

# a few cheap checks, one per area, for the pytest routes (the CLI routes run the whole kit)
_SUBSET = ("check_plan_resolution_is_pure or check_failed_enable_restores_the_pipeline or "
           "check_offloaded_output_matches_reference_bitwise or "
           "check_state_dict_while_enabled_returns_true_weights")


@pytest.fixture(scope="module")
def downstream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("downstream")
    assert _REPO not in root.parents
    package = root / "acme_offload"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "pipelines.py").write_text(_PIPELINES)
    (root / "tests").mkdir()
    (root / "tests" / "test_acme_offload.py").write_text(_AUTHOR_TESTS)
    return root


def _run(args: list[str], root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["PYTHONPATH"] = str(root)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    proc = subprocess.run(args, check=False, cwd=root, env=env, capture_output=True, text=True,
                          timeout=_TIMEOUT_S)
    return proc


def _cli(args: list[str], root: Path) -> subprocess.CompletedProcess:
    return _run([str(Path(sys.executable).with_name("offload-ref")), "check", *args], root)


def _pytest(args: list[str], root: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], root)


def test_good_pipeline_class_passes_the_whole_kit(downstream: Path) -> None:
    proc = _cli(["acme_offload.pipelines:GoodPipeline", "--json", "report.json"], downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"^GoodPipeline\s+layer_wise\s+ok \d+", proc.stdout, re.M), out
    assert re.search(r"^GoodPipeline\s+model_level\s+ok \d+", proc.stdout, re.M), out
    summary = json.loads((downstream / "report.json").read_text())["summary"]
    assert summary["failed"] == summary["error"] == 0 and summary["passed"] > 50, summary


def test_encoder_sharing_a_dit_block_fails_naming_both_paths(downstream: Path) -> None:
    proc = _cli(["acme_offload.pipelines:SharedBlockPipeline"], downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"^SharedBlockPipeline\s+model_level\s+FAIL", proc.stdout, re.M), out
    failures = proc.stdout.partition("\nFAILED")[2] + proc.stdout.partition("\nERROR")[2]
    assert "text_encoder.refine" in failures and "transformer.blocks.0" in failures, out


def test_modules_refusing_hooks_fail_and_rollback_checks_pass(downstream: Path) -> None:
    proc = _cli(["acme_offload.pipelines:HookRefusingPipeline", "--json", "hooks.json"],
                downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "does not support forward hooks" in proc.stdout, out
    report = json.loads((downstream / "hooks.json").read_text())
    rollback = [r for r in report["results"] if r["section"] == "B"]
    # the three fault-injection checks and the one injecting from outside, both strategies
    assert len(rollback) == 8 and all(r["outcome"] == "passed" for r in rollback), rollback
    assert {m["cell"] for m in report["matrix"] if m["area"] == "B"} == {"ok 4"}
    assert report["summary"]["error"] + report["summary"]["failed"] > 0


def test_author_test_file_runs_under_xdist_with_the_matrix(downstream: Path) -> None:
    proc = _pytest(["tests", "-n", "2", "-k", _SUBSET], downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b16 passed\b", proc.stdout), out  # 4 checks x 2 strategies x 2 routes
    assert "offload-ref conformance matrix" in proc.stdout, out
    assert re.search(r"^acme\s+layer_wise\s+", proc.stdout, re.M), out


@pytest.mark.parametrize("ref", ["acme_offload.pipelines:SPEC",
                                 "acme_offload.pipelines:GoodPipeline"])
def test_pyargs_route_needs_no_test_file(downstream: Path, ref: str) -> None:
    proc = _pytest(["--pyargs", "offload_ref.contracts", "-m", "contract",
                    "--offload-ref-spec", ref, "-k", _SUBSET], downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b[1-9]\d* passed\b", proc.stdout), out
    assert "offload-ref conformance matrix" in proc.stdout, out


def test_pyargs_route_without_a_spec_says_what_to_pass(downstream: Path) -> None:
    proc = _pytest(["--pyargs", "offload_ref.contracts"], downstream)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "--offload-ref-spec" in out, out
