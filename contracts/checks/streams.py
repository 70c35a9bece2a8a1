"""Catalogue §S: stream ordering, judged by the simulated accelerator's happens-before sanitizer.

Every case of the kit runs under the sanitizer (Note [The kit's stream checking] in
contracts/streams.py), so a race fails whatever case it happens in.  The check here gives each
pipeline and strategy a stream verdict of its own, even where no other check fails: it drives
the offloader through ``enable()``, two generations and ``disable()``, then computes once more on
the device with the pipeline resident (an allocation that reuses the memory the offloader freed:
a block freed while another stream may still use it is then reported).  offload-ref's own
backends run here on the accelerator platform (``Implementation.make_accelerator_platform``:
``torch.Stream`` / ``torch.Event``, the code a GPU runs); any other offloader brings its own
streams.
"""

from __future__ import annotations

import torch

from ..registry import check, not_applicable
from ..streams import off_reason, watching
from .lifecycle import BACKENDS

__all__ = ["STREAM_CHECKS"]

#: The checks of this module.
STREAM_CHECKS = frozenset({"check_device_accesses_are_ordered_across_streams"})

_GENERATIONS = 2


@check("S", strategies=BACKENDS)
def check_device_accesses_are_ordered_across_streams(case) -> None:
    """From ``enable()`` through two generations and ``disable()``, and a resident generation
    after it that reuses the freed device memory, every device access is ordered across streams:
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
        backend.enable(pipeline)
        try:
            for _ in range(_GENERATIONS):
                with torch.inference_mode():
                    pipeline(**case.inputs())
        finally:
            backend.disable()
        del pipeline, backend
        with torch.inference_mode():
            case.build_resident()(**case.inputs())
