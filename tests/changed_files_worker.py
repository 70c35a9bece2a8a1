"""Scenarios of tests/test_changed_files.py that would kill the process (SIGBUS) if a truncated
mapped file were read: each runs in its own interpreter, prints what happened, exits 0."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from offload_ref import OffloadConfig, get_offload_backend, load_safetensors
from offload_ref.contracts.checks.distributed import MMAP_PREFIX, _unique_contiguous
from offload_ref.fixtures import get_spec
from offload_ref.loading import MappedFileChangedError
from safetensors.torch import save_file


def _loaded(folder: str):
    spec = get_spec("flux2")
    path = os.path.join(folder, "transformer.safetensors")
    state = _unique_contiguous(spec.build().transformer.state_dict())
    save_file({MMAP_PREFIX + k: v for k, v in state.items()}, path)
    pipeline = spec.build()
    load_safetensors(pipeline.transformer, path, prefix=MMAP_PREFIX)
    return spec, pipeline, path


def _generate(spec, pipeline):
    with torch.inference_mode():
        out = pipeline(**spec.make_inputs())
    return getattr(out, "images", out)


def main(scenario: str, folder: str, strategy: str) -> None:
    spec, pipeline, path = _loaded(folder)
    backend = get_offload_backend(OffloadConfig(strategy=strategy))
    if scenario == "truncate-before-enable":
        os.truncate(path, os.path.getsize(path) // 2)
        try:
            backend.enable(pipeline)
        except MappedFileChangedError as exc:
            print("REFUSED", exc.path == path, str(exc))
        print("ENABLED" if backend.is_enabled() else "NOT-ENABLED")
        return
    backend.enable(pipeline)
    _generate(spec, pipeline)
    os.truncate(path, os.path.getsize(path) // 2)
    try:
        _generate(spec, pipeline)
        print("GENERATED")
    except MappedFileChangedError as exc:
        print("REFUSED", exc.path == path, str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.disable()
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    print("WARNED" if any("changed since load_safetensors mapped it" in m for m in said)
          else "SILENT", said[:1])


if __name__ == "__main__":
    main(*sys.argv[1:])
