"""Every ```python block of README.md and docs/*.md runs (issue 23, item 6).

A block runs as written, in a namespace that holds only what the surrounding prose says the reader
already has (a pipeline, a prompt, the files of a checkpoint); ``SETUPS`` builds those, keyed by a
line of the block.  A block no setup names runs in an empty namespace.  Signatures and shell lines
are fenced as ``text`` / ``bash``, not ``python``.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in _BLOCK.finditer(text):
            line = text[:m.start()].count("\n") + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", textwrap.dedent(m.group(2))))
    return out


# -- what the prose around a block gives the reader ---------------------------------------------


def _fixture(name: str = "flux2") -> tuple[Any, dict[str, Any]]:
    from offload_ref.fixtures import get_spec

    spec = get_spec(name)
    return spec.build(), spec.make_inputs()


@contextmanager
def _world_of_one(tmp: Path) -> Iterator[dict[str, Any]]:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield {}
    finally:
        dist.destroy_process_group()


@contextmanager
def _rendezvous(tmp: Path) -> Iterator[dict[str, Any]]:
    from offload_ref.distributed import Rendezvous

    with _world_of_one(tmp):
        yield {"Rendezvous": Rendezvous, "fingerprint": "plan-fingerprint"}


@contextmanager
def _waves(tmp: Path) -> Iterator[dict[str, Any]]:
    from offload_ref.distributed import WaveRunner

    pipeline, inputs = _fixture()
    ids, seed = inputs["prompt_ids"], inputs["generator_seed"]
    yield {"WaveRunner": WaveRunner, "pipeline": pipeline, "ids": ids, "seed": seed,
           "my_prompt": ids, "my_seed": seed}


@contextmanager
def _run_ranks(tmp: Path) -> Iterator[dict[str, Any]]:
    import doc_snippet_ranks  # tests/ is on sys.path (rootdir conftest)

    yield {"my_module": doc_snippet_ranks, "spec_name": "flux2"}


@contextmanager
def _checkpoint(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A model class and its two safetensors shards in the current folder."""
    from safetensors.torch import save_file
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.to_q = nn.Linear(dim, dim)

    class Block(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.attn = Attention(dim)

    class MyTransformer(nn.Module):
        def __init__(self, config: dict[str, int]) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(config["dim"]) for _ in range(2))

    config = {"dim": 8}
    state = {f"transformer.{k}": v.contiguous() for k, v in MyTransformer(config).state_dict().items()}
    names = sorted(state)
    save_file({k: state[k] for k in names[: len(names) // 2]}, str(tmp / "model-00001.safetensors"))
    save_file({k: state[k] for k in names[len(names) // 2:]}, str(tmp / "model-00002.safetensors"))
    monkeypatch.chdir(tmp)
    yield {"MyTransformer": MyTransformer, "config": config}


@contextmanager
def _my_package(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """The author's package of the block before (``my_package/testing.py``)."""
    from offload_ref.contracts import PipelineSpec

    package, testing = types.ModuleType("my_package"), types.ModuleType("my_package.testing")
    testing.SPEC = PipelineSpec(name="my_pipeline", factory="my_package.testing:build",
                                inputs="my_package.testing:make_inputs")
    package.testing = testing
    monkeypatch.setitem(sys.modules, "my_package", package)
    monkeypatch.setitem(sys.modules, "my_package.testing", testing)
    yield {}


@contextmanager
def _enabled(strategy: str) -> Iterator[dict[str, Any]]:
    from offload_ref import OffloadConfig, get_offload_backend

    pipeline, inputs = _fixture()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), device="cpu")
    backend.enable(pipeline)
    try:
        yield {"pipeline": pipeline, "pipe": pipeline, "inputs": inputs, "backend": backend}
    finally:
        backend.disable()


@contextmanager
def _lora(tmp: Path) -> Iterator[dict[str, Any]]:
    with _enabled("layer_wise") as ns:
        name, linear = next((n, m) for n, m in ns["pipe"].named_modules()
                            if isinstance(m, torch.nn.Linear) and ".blocks." in f".{n}.")
        rank = 2
        lora = {name: (torch.full((rank, linear.in_features), 0.01),
                       torch.full((linear.out_features, rank), 0.01), 0.5)}
        yield {**ns, "lora": lora, "extra_weights": {}}


@contextmanager
def _entry_point(tmp: Path) -> Iterator[dict[str, Any]]:
    with _enabled("model_level") as ns:
        pipeline = ns["pipeline"]
        prompt = ns["inputs"]["prompt_ids"].to(_execution_device(pipeline))
        pipeline.encode_prompt = lambda ids: pipeline.text_encoder.forward(ids)  # not __call__
        try:
            yield {**ns, "prompt": prompt}
        finally:
            del pipeline.encode_prompt


def _execution_device(pipeline: Any) -> torch.device:
    from offload_ref import execution_device

    return execution_device(pipeline)


#: a line of the block -> the namespace it runs in (built fresh for each run)
SETUPS: dict[str, Callable[..., Any]] = {
    "rv = Rendezvous.default(timeout_s=60.0)": lambda tmp, mp: _rendezvous(tmp),
    "runner = WaveRunner(pipeline)": lambda tmp, mp: _waves(tmp),
    "results = run_ranks(my_module.check": lambda tmp, mp: _run_ranks(tmp),
    "transformer = MyTransformer(config)": _checkpoint,
    "from my_package.testing import SPEC": _my_package,
    "backend = backend_of(pipe)": lambda tmp, mp: _lora(tmp),
    'with backend.use_component("text_encoder"):': lambda tmp, mp: _entry_point(tmp),
}


def _setup_for(code: str) -> Callable[..., Any] | None:
    found = [key for key in SETUPS if key in code]
    assert len(found) <= 1, found
    return SETUPS[found[0]] if found else None


BLOCKS = _blocks()


def test_the_docs_have_python_blocks_and_every_setup_is_used() -> None:
    assert len(BLOCKS) >= 15
    unused = [key for key in SETUPS if not any(key in code for _, code in BLOCKS)]
    assert not unused, f"setups for blocks that no longer exist: {unused}"


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_python_block_of_the_docs_runs(where: str, code: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _setup_for(code)
    with ExitStack() as stack:
        namespace: dict[str, Any] = {"__name__": f"doc_snippet_{abs(hash(where))}"}
        if setup is not None:
            namespace.update(stack.enter_context(setup(tmp_path, monkeypatch)))
        with torch.inference_mode():
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the docs' own code
