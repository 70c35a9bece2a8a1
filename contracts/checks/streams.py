"""Catalogue §S: stream ordering, judged by the simulated accelerator's happens-before sanitizer.

Every case of the kit runs under the sanitizer (Note [The kit's stream checking] in
contracts/streams.py), so a race fails whatever case it happens in.  The check here gives each
pipeline and strategy a stream verdict of its own, even where no other check fails: it drives
the offloader through ``enable()``, two generations and ``disable()``, then allocates and writes
one block of each size the pipeline's tensors were bound to on the device (the memory the
offloader freed, reused: a block freed while another stream may still use it is then reported)
and computes once more with the pipeline resident.  offload-ref's own
backends run here on the accelerator platform (``Implementation.make_accelerator_platform``:
``torch.Stream`` / ``torch.Event``, the code a GPU runs); any other offloader brings its own
streams.
"""

from __future__ import annotations

import gc

import torch

from ..registry import check, not_applicable
from ..blame import named_modules
from ..streams import name_range, note_bindings, note_pipeline, off_reason, watching
from ..facts import module_tensors
from .lifecycle import SINGLE_PROCESS

__all__ = ["STREAM_CHECKS"]

#: The checks of this module.
STREAM_CHECKS = frozenset({"check_device_accesses_are_ordered_across_streams"})

_GENERATIONS = 2


@check("S", strategies=SINGLE_PROCESS)
def check_device_accesses_are_ordered_across_streams(case) -> None:
    """From ``enable()`` through two generations and ``disable()``, and allocations after it that
    reuse the device memory the offloader freed, every device access is ordered across streams:
    no read of bytes a copy stream's write was not waited for, no slot refilled while a read of
    it may still run, no device memory freed and reused while another stream may still use it,
    no ``non_blocking`` device-to-host copy read before a synchronize."""
    reason = off_reason()
    if reason is not None:
        not_applicable(f"stream checking is off: {reason}")
    platform = case.accelerator_platform() if case.impl.capabilities.internals else None
    with watching(case, case.impl.name):  # nothing under the runner, which watches every case
        pipeline = case.build()
        backend = case.backend(platform=platform)
        storages: dict[int, tuple[int, list[str]]] = {}
        backend.enable(pipeline)
        paths = {id(m): p for p, m in named_modules(pipeline)}
        # a global forward hook runs before the module's own forward hooks (an offloader's
        # park): each module's tensors are still bound to what its forward computed with
        watch = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, output: _note_storages(module, paths, case.device, storages))
        try:
            for _ in range(_GENERATIONS):
                with torch.inference_mode():
                    pipeline(**case.inputs())
        finally:
            watch.remove()
            backend.disable()
        note_pipeline(pipeline)  # its files tell the pipeline's races from the offloader's
        del pipeline, backend
        gc.collect()
        _reuse(storages, case.device)
        with torch.inference_mode():
            case.build_resident()(**case.inputs())


def _note_storages(module: torch.nn.Module, paths: dict[int, str], device: torch.device,
                   storages: dict[int, tuple[int, list[str]]]) -> None:
    """Record the device storages ``module``'s own tensors were bound to as it ran (address ->
    bytes and the module paths of the tensors bound there in turn, the latest last): a slot, a
    swapped component's copy, whatever the offloader allocated; and the memory of each tensor for
    the names of races (:func:`~..streams.note_bindings`).  A wrapper subclass by its inner
    tensors, which hold its storage (Note [Wrapper subclasses] in offload_ref/plan/tree.py)."""
    path = paths.get(id(module))
    if path is None:
        return
    note_bindings(module, path, device)
    for name, t in module_tensors(module, recurse=False, remove_duplicate=False):
        if t.device == device:
            storage = t.untyped_storage()
            full = f"{path}.{name}" if path else name
            nbytes, names = storages.setdefault(storage.data_ptr(), (storage.nbytes(), []))
            if full in names:
                names.remove(full)
            names.append(full)
            if storage.nbytes() > nbytes:
                storages[storage.data_ptr()] = (storage.nbytes(), names)


def _reuse(storages: dict[int, tuple[int, list[str]]], device: torch.device) -> None:
    """Allocate and write, on the current stream, one block of each size the offloader's device
    storages had, as many as there were: the simulated allocator hands a freed block to the next
    request of its rounded size (Note [Caching allocator] in simdevice.cpp), so memory freed while
    another stream may still use it is reused here, and the sanitizer reports it, naming the
    tensor that memory held last (and how many it held in turn, when several: a slot)."""
    blocks = []
    for nbytes, _ in sorted((n, len(names)) for n, names in storages.values()):
        if nbytes:
            block = torch.empty(nbytes, dtype=torch.uint8, device=device)
            held = storages.get(block.data_ptr())
            if held is not None:
                names = held[1]
                several = (f"; it held {len(names)} tensors in turn, before it "
                           + ", ".join(reversed(names[-4:-1]))
                           + (" ..." if len(names) > 4 else "") if len(names) > 1 else "")
                name_range(block.data_ptr(), nbytes,
                           f"the device memory last bound to {names[-1]} (freed at disable(), "
                           f"allocated again by the kit{several})")
            blocks.append(block)
    for block in blocks:
        block.zero_()
    del blocks
