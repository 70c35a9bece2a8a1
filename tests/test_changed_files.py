"""Note [Changed files] (offload_ref/loading.py): a file that load_safetensors mapped and that is
truncated or overwritten in place afterwards is refused, with the file and the first tensor it
no longer covers named, before any of its pages is read (a truncated page kills the process with
SIGBUS); disable() that leaves tensors on a changed file warns; a checkpoint replaced the safe
way (a new file renamed over the path) changes nothing.  The scenarios that would crash run in a
child interpreter (tests/changed_files_worker.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from offload_ref import (MappedFileChangedError, OffloadConfig, get_offload_backend,
                         load_safetensors)
from offload_ref.contracts.checks.distributed import MMAP_PREFIX, _unique_contiguous
from offload_ref.fixtures import get_spec
from offload_ref.loading import changed_mapped_files, mapped_files, verify_mapped_files

WORKER = Path(__file__).with_name("changed_files_worker.py")


def _run(scenario: str, tmp_path: Path, strategy: str) -> str:
    done = subprocess.run([sys.executable, str(WORKER), scenario, str(tmp_path), strategy],
                          capture_output=True, text=True, timeout=300)
    # -7 / 135: SIGBUS, a mapped page past the end of the truncated file was read
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    return done.stdout


@pytest.mark.parametrize("strategy", ["layer_wise", "model_level"])
def test_a_file_truncated_before_enable_is_refused_naming_file_and_tensor(tmp_path, strategy):
    out = _run("truncate-before-enable", tmp_path, strategy)
    assert "REFUSED True" in out and "NOT-ENABLED" in out, out
    assert "was truncated after load_safetensors mapped it" in out
    assert "tensor 'transformer.transformer_blocks." in out and "enable() was refused" in out


def test_a_file_truncated_while_layerwise_streams_it_refuses_the_next_fill(tmp_path):
    out = _run("truncate-while-enabled", tmp_path, "layer_wise")
    assert "REFUSED True" in out and "the copy of block 'transformer." in out, out
    assert "WARNED" in out  # disable() put the tensors back on the truncated file: it says so


@pytest.mark.parametrize("variant", ["layer_wise", "layer_wise+staging", "layer_wise@hpu"])
def test_a_file_truncated_under_a_queued_fill_is_refused_where_the_copy_runs(tmp_path, variant):
    # Note [Deferred reads of file pages]: the copy of block 1 (or a staging) passed its check
    # when it was issued and is held until block 0's forward has truncated the file; without a
    # check where it runs, it reads a page past the end (SIGBUS).  Plain fills on the CPU
    # platform's copy stream, fills through pinned staging there, and the accelerator
    # platform's staging thread.
    out = _run("truncate-while-a-fill-is-queued", tmp_path, variant)
    assert "REFUSED True" in out and "was refused before reading it" in out, out
    assert "-> 4096 bytes)" in out  # refused for the truncation block 0's forward made
    assert "WARNED" in out


@pytest.mark.parametrize("strategy", ["layer_wise", "model_level"])
def test_state_dict_after_a_truncation_refuses_or_reads_its_own_copies(tmp_path, strategy):
    out = _run("truncate-then-state-dict", tmp_path, strategy)
    if strategy == "layer_wise":  # its true values are the file pages: checked, not read
        assert "REFUSED True" in out and "for state_dict()" in out, out
    else:  # host copies made at enable
        assert "READ" in out and "SILENT" in out, out


def test_a_file_overwritten_under_a_queued_fill_is_refused_for_that_block(tmp_path):
    # The queued copy of block 1 would read the new bytes: its check where it runs refuses it
    # and names block 1.  Without that check block 1 computes with the other bytes and the
    # refusal comes one fill later, naming single_transformer_blocks.0 (seen).
    out = _run("overwrite-while-a-fill-is-queued", tmp_path, "layer_wise")
    assert "REFUSED True" in out and "modified in place" in out, out
    assert "transformer.transformer_blocks.1" in out, out
    assert "WARNED" in out


def test_model_level_keeps_its_copies_when_the_file_is_truncated_after_enable(tmp_path):
    out = _run("truncate-while-enabled", tmp_path, "model_level")
    assert "GENERATED" in out and "SILENT" in out, out  # host copies: the file is not read again


def _loaded(tmp_path: Path):
    spec = get_spec("flux2")
    path = tmp_path / "transformer.safetensors"
    state = _unique_contiguous(spec.build().transformer.state_dict())
    save_file({MMAP_PREFIX + k: v for k, v in state.items()}, str(path))
    old = os.stat(path).st_mtime_ns - 10**9  # a checkpoint written before this second
    os.utime(path, ns=(old, old))
    pipeline = spec.build()
    load_safetensors(pipeline.transformer, path, prefix=MMAP_PREFIX)
    return spec, pipeline, path, state


def _generate(spec, pipeline):
    with torch.inference_mode():
        out = pipeline(**spec.make_inputs())
    return getattr(out, "images", out)


def _overwrite_in_place(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:  # the same inode, the same size, other bytes
        f.seek(size // 2)
        f.write(b"\xff" * (size - size // 2))


def test_an_in_place_overwrite_under_layerwise_is_refused_not_computed_with(tmp_path):
    spec, pipeline, path, _ = _loaded(tmp_path)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"))
    backend.enable(pipeline)
    try:
        first = _generate(spec, pipeline)
        _overwrite_in_place(path)
        with pytest.raises(MappedFileChangedError, match="modified in place") as caught:
            _generate(spec, pipeline)
        assert caught.value.path == str(path)
    finally:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            backend.disable()
    assert any("changed since load_safetensors mapped it" in str(w.message) for w in said)
    assert torch.isfinite(first).all()
    # enabling again on the changed file is refused too, before any change
    with pytest.raises(MappedFileChangedError, match="enable"):
        backend.enable(pipeline)
    assert not backend.is_enabled()


def test_a_checkpoint_replaced_by_rename_changes_nothing(tmp_path):
    spec, pipeline, path, state = _loaded(tmp_path)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"))
    backend.enable(pipeline)
    try:
        first = _generate(spec, pipeline)
        fresh = tmp_path / "new.safetensors"
        save_file({MMAP_PREFIX + k: torch.zeros_like(v) for k, v in state.items()}, str(fresh))
        os.replace(fresh, path)  # the safe way: the mapping keeps the old inode
        assert torch.equal(_generate(spec, pipeline), first)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            backend.disable()


def test_the_uses_name_each_tensors_range_and_a_truncation_names_the_first_lost(tmp_path):
    _, pipeline, path, _ = _loaded(tmp_path)
    named = list(pipeline.transformer.named_parameters())
    (use,) = mapped_files(named)
    assert use.file.path == str(path)
    size = path.stat().st_size
    assert all(0 < lo < hi <= size for _, lo, hi in use.ranges)
    verify_mapped_files([use], "nothing")  # unchanged: silent
    cut = sorted(use.ranges, key=lambda r: r[1])[len(use.ranges) // 2]
    os.truncate(path, cut[1] + 1)  # the tensor starting at cut[1] is cut short
    lost = next(n for n, lo, hi in use.ranges if hi > cut[1] + 1)
    (said,) = changed_mapped_files([use])
    assert f"tensor {lost!r}" in said and "truncated" in said
    os.truncate(path, size)  # grown back with zeros: still a change (mtime)
    assert changed_mapped_files([use])
