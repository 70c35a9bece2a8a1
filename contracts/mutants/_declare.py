"""What the mutant modules share: the :class:`Mutant` record, the scopes a mutant runs in,
and the helpers that swap a backend's class or patch a name for the run."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from offload_ref.backends import get_offload_backend
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing

from ..case import Implementation


@dataclass(frozen=True)
class Mutant:
    """One defect, where to run the catalogue against it, and exactly which checks it fails.

    ``pipelines`` are fixture names; ``sections`` select checks by catalogue section prefix (see `registry.doc_for`);
    ``patch`` (optional) is entered around the run for defects in shared helpers; ``factory``
    (optional) replaces the pipelines' factory for defects in the pipeline itself.
    """

    name: str
    defect: str
    impl: Implementation
    pipelines: tuple[str, ...]
    sections: tuple[str, ...]
    strategies: tuple[str, ...]
    kills: frozenset[str]
    patch: Callable[[], Any] | None = None
    factory: Callable[..., Any] | None = None
    placement_kills: frozenset[str] = frozenset()

    def expected_kills(self, placement: bool) -> frozenset[str]:
        """The checks this mutant fails: :attr:`kills`, plus :attr:`placement_kills` where host
        and device differ (``placement``: the kit runs on the simulated accelerator or a GPU),
        for a defect that leaves a tensor on the wrong device: one device hides it there."""
        if placement:
            return self.kills | self.placement_kills
        from ..checks.observable import DEVICE_MEMORY_CHECKS

        return self.kills - DEVICE_MEMORY_CHECKS

    def specs(self) -> list[Any]:
        from offload_ref.fixtures import get_spec

        specs = [get_spec(name) for name in self.pipelines]
        if self.factory is not None:
            specs = [dataclasses.replace(s, factory=self.factory) for s in specs]
        return specs

    def checks(self) -> list[str]:
        """The checks of :attr:`sections`.  A mutant of offload-ref's internals runs the checks
        judged from outside (checks/observable.py) only where they are among its kills: the
        protocol mutants prove those checks can fail, and each such check on every internal
        mutant would double the suite's time."""
        from ..checks.observable import OBSERVABLE_CHECKS
        from ..runner import load_catalogue

        ids = [i.id for i in load_catalogue().values()
               if i.scope == "spec" and i.section.startswith(self.sections)]
        if self.impl.capabilities.internals:
            claimed = self.kills | self.placement_kills
            ids = [i for i in ids if i not in OBSERVABLE_CHECKS or i in claimed]
        return sorted(ids)

    def run(self) -> set[str]:
        """The ids of the checks that fail (or error) against this mutant."""
        from ..runner import run_checks

        with (self.patch() if self.patch else contextlib.nullcontext()):
            results = run_checks(self.specs(), checks=self.checks(), strategies=self.strategies,
                                 impl=self.impl, include_global=False)
        return {r.id.check for r in results if not r.ok}


def _backend_with(**classes: type) -> Callable[[Any, Any], Any]:
    """``make_backend`` that swaps the class of the backend the real factory would build."""

    def make(config: Any, platform: Any) -> Any:
        backend = get_offload_backend(config, platform=platform)
        cls = classes.get(type(backend).__name__)
        if cls is not None:
            backend.__class__ = cls
        return backend

    return make


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _patched_all(owner: Any, **values: Any) -> contextlib.ExitStack:
    """``_patched`` for several names of one owner, undone together."""
    stack = contextlib.ExitStack()
    for name, value in values.items():
        stack.enter_context(_patched(owner, name, value))
    return stack


def _layerwise(ring: type[BlockRing], base: type = LayerWiseOffloadBackend) -> type:
    return type(f"Mutant{ring.__name__}", (base,), {"ring_class": ring})


_RESOLVER = dict(pipelines=("flux2",), sections=("A",),
                 strategies=("model_level", "layer_wise", "distributed_layer_wise"))
_MODEL_LEVEL = dict(pipelines=("wan22_t2v",), sections=("B", "C", "D", "F"),
                    strategies=("model_level",))
_LAYERWISE = dict(pipelines=("flux2",), sections=("B", "C", "D", "F"),
                  strategies=("layer_wise",))
_SPLIT = dict(pipelines=("cosmos3",), sections=("E",), strategies=("model_level",))
# Alignment defects change outputs only on machines whose kernels pick their path by alignment
# (MKL's GEMV on AMD EPYC): the parity checks would fail there and pass elsewhere, so these
# mutants run the alignment check alone, which fails on every machine.
_ALIGNMENT = dict(pipelines=("flux2", "cosmos3"), sections=("F.6",),
                  strategies=("model_level", "layer_wise"))
_MISUSE = ("J.3", "J.4", "J.5", "J.6", "J.8")
_MISUSE_LAYER = dict(pipelines=("flux2",), sections=_MISUSE, strategies=("layer_wise",))
_MISUSE_MODEL = dict(pipelines=("wan22_t2v",), sections=_MISUSE, strategies=("model_level",))
_J7 = dict(pipelines=("flux2",), sections=("J.7",), strategies=("model_level", "layer_wise"))
_SPLIT_THREADS = dict(pipelines=("cosmos3",), sections=("J.6",), strategies=("model_level",))
_J7_SPLIT = dict(pipelines=("cosmos3",), sections=("J.7",), strategies=("model_level",))
_INTERRUPTS = dict(pipelines=("flux2",), sections=("J.1",), strategies=("layer_wise",))
_DISTRIBUTED = dict(pipelines=("flux2",), sections=("H",),
                    strategies=("distributed_layer_wise",))
_NESTED_RESIDENT = dict(pipelines=("soulx_singer",), sections=("F",), strategies=("model_level",))
# wan22: every auto candidate has a prediction (encoder rings included)
_AUTO = dict(pipelines=("wan22_t2v",), sections=("A.8",), strategies=("layer_wise",))
# qwen_image: four blocks (heads of one and two), and a budget between layerwise's peak and
# model level's leaves room for a head
_HEAD = dict(pipelines=("qwen_image",), sections=("A.8", "F.7"), strategies=("layer_wise",))
# Offloaders judged through the public protocol alone (contracts/simple_offloader.py): a plain,
# correct offloader with one defect each.  Run on flux2 (both strategies) and sd3 (layerwise:
# a buffer outside the blocks views a block's weight).
_PROTOCOL = dict(pipelines=("flux2", "sd3"), sections=("B", "C", "D", "F", "J"),
                 strategies=("model_level", "layer_wise"))
