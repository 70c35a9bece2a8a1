"""Scenarios of tests/test_changed_files.py that would kill the process (SIGBUS) if a truncated
mapped file were read: each runs in its own interpreter, prints what happened, exits 0."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from offload_ref import OffloadConfig, get_offload_backend, load_safetensors
from offload_ref.backends import staging
from offload_ref.contracts.checks.distributed import MMAP_PREFIX, _unique_contiguous
from offload_ref.fixtures import get_spec
from offload_ref.loading import MappedFileChangedError
from offload_ref.platform import get_platform
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


def _change_under_a_queued_fill(backend, pipeline, path: str, overwrite: bool) -> None:
    """From the next generation on, work submitted on a stream (the fills of file-backed blocks
    on the CPU platform) waits until block 0 has run; block 0's forward truncates the file (or
    overwrites its second half in place), so the copy of block 1, checked when it was issued in
    block 0's pre-hook, runs after the change (Note [Deferred reads of file pages] in
    offload_ref/backends/transports.py)."""
    platform = backend.platform
    submit = platform.submit
    gate = threading.Event()

    def gated_submit(fn, **kwargs):
        def gated():
            gate.wait(60)
            fn()

        return submit(gated, **kwargs)

    def change(module, args, output):
        if not gate.is_set():
            if overwrite:  # the same inode and size, other bytes
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.seek(size // 2)
                    f.write(b"\xff" * (size - size // 2))
            else:
                os.truncate(path, 4096)  # every block is past the new end
            gate.set()

    platform.submit = gated_submit
    if not getattr(platform, "stream_ordered_host_copies", False):
        # an accelerator: the staging thread reads the pages itself, so it is the one held
        staging._worker().put(lambda: gate.wait(60))
    pipeline.transformer.transformer_blocks[0].register_forward_hook(change)


def main(scenario: str, folder: str, strategy: str) -> None:
    spec, pipeline, path = _loaded(folder)
    # "+staging": file pages read through pinned staging slots; "@hpu": on the accelerator
    # platform over the simulated device (it pins, so it stages by default)
    strategy, _, device = strategy.partition("@")
    staged = strategy.endswith("+staging")
    config = OffloadConfig(strategy=strategy.removesuffix("+staging"),
                           staging_slots=2 if staged else None)
    backend = get_offload_backend(config, platform=get_platform(device) if device else None)
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
    if scenario.endswith("-while-a-fill-is-queued"):
        _change_under_a_queued_fill(backend, pipeline, path, scenario.startswith("overwrite"))
    else:
        os.truncate(path, os.path.getsize(path) // 2)
    try:
        if scenario == "truncate-then-state-dict":
            state = pipeline.transformer.state_dict()
            print("READ", sum(t.float().sum().item() for t in state.values()))
        else:
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
    if "@" in sys.argv[3]:
        from offload_ref.platform import simulated

        simulated.load()  # before anything asks torch for its accelerator
    main(*sys.argv[1:])
