"""What the mutant modules share: the :class:`Mutant` record and its one declaration
(:func:`declare`), the scopes a mutant runs in, and the helpers that swap a backend's class or
its ring class (:func:`backend_with`, :func:`with_ring`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from offload_ref.backends import get_offload_backend
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.ring import BlockRing

from ..case import DEFAULT_IMPLEMENTATION, Implementation


@dataclass(frozen=True)
class Mutant:
    """One defect, where to run the catalogue against it, and exactly which checks it fails.

    ``pipelines`` are fixture names; ``sections`` select checks by catalogue section prefix
    (see `registry.doc_for`); ``factory`` (optional) replaces the pipelines' factory for defects
    in the pipeline itself.  A mutant changes nothing in place: its defect lives in ``impl``
    (classes that override the implementation's public seams, Note [Seams] in
    docs/architecture.md) or in ``factory``, so it applies to its own run only, in this process
    and in spawned ranks alike (``Implementation.in_rank``).
    """

    name: str
    defect: str
    impl: Implementation
    pipelines: tuple[str, ...]
    sections: tuple[str, ...]
    strategies: tuple[str, ...]
    kills: frozenset[str]
    factory: Callable[..., Any] | None = None
    placement_kills: frozenset[str] = frozenset()
    #: Check ids to run alone out of :attr:`sections` (empty: all of them): a defect whose
    #: other checks would fail on some machines only (ALIGNMENT_H).
    only: tuple[str, ...] = ()

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
        mutant would double the suite's time.  For the same reason a mutant runs the checks
        that repeat a whole enable (``REPEATED_ENABLE_CHECKS``: a fault at every step, 100
        cycles; a fifth of the mutants' time) only where it claims one of them, and then the
        checks it shares work with too (one fault sweep judges two): the mutants that claim
        them prove that they can fail, and the correct backends on every fixture that they
        pass."""
        from ..checks.lifecycle import REPEATED_ENABLE_CHECKS
        from ..checks.observable import OBSERVABLE_CHECKS
        from ..runner import load_catalogue

        catalogue = load_catalogue()
        ids = [i.id for i in catalogue.values()
               if i.scope == "spec" and i.section.startswith(self.sections)
               and (not self.only or i.id in self.only)]
        claimed = self.kills | self.placement_kills
        if self.impl.capabilities.internals:
            ids = [i for i in ids if i not in OBSERVABLE_CHECKS or i in claimed]
        shared = {catalogue[i].shares for i in claimed & REPEATED_ENABLE_CHECKS
                  if i in catalogue and catalogue[i].shares}
        ids = [i for i in ids if i not in REPEATED_ENABLE_CHECKS or i in claimed
               or (catalogue[i].shares and catalogue[i].shares in shared)]
        return sorted(ids)

    def run(self) -> set[str]:
        """The ids of the checks that fail (or error) against this mutant."""
        from ..runner import run_checks

        results = run_checks(self.specs(), checks=self.checks(), strategies=self.strategies,
                             impl=self.impl, include_global=False)
        return {r.id.check for r in results if not r.ok}


#: How a spawned rank gets a mutant back (``Implementation.in_rank``): the package's ``in_rank``,
#: which looks it up by name among the declared ones.
IN_RANK = f"{__package__}:in_rank"

_DECLARED: list[Mutant] = []


def declare(name: str, defect: str, scope: dict[str, Any], *, kills: Iterable[str],
            placement_kills: Iterable[str] = (),
            factory: Callable[..., Any] | None = None, impl: Implementation | None = None,
            **changes: Any) -> Mutant:
    """Declare the mutant ``name``: one defect, where the catalogue runs against it, and exactly
    the checks it fails (asserted by tests/test_mutants.py).

    ``scope``: its ``pipelines``, ``sections`` and ``strategies`` (the scopes below).  ``kills``:
    the checks it fails on every machine.  ``placement_kills``: what one device hides: where host
    and device differ, a tensor the defect leaves on the wrong device meets the other device's
    tensors in the next forward and raises torch's same-device error, so every check that runs
    one fails too (:meth:`Mutant.expected_kills`).  ``factory``: see :class:`Mutant`.
    ``changes`` replace parts of offload-ref's own implementation (``make_backend=``,
    ``resolve_offload_plan=``); ``impl`` is another offloader instead (the protocol mutants).
    """
    if impl is None:
        impl = DEFAULT_IMPLEMENTATION.replace(name=name, in_rank=IN_RANK, **changes)
    elif changes:
        raise TypeError(f"mutant {name!r}: impl= replaces the whole implementation; "
                        f"{sorted(changes)} would be ignored")
    mutant = Mutant(name, defect, impl, kills=frozenset(kills), factory=factory,
                    placement_kills=frozenset(placement_kills), **scope)
    _DECLARED.append(mutant)
    return mutant


def declared() -> tuple[Mutant, ...]:
    """Every mutant declared so far, in the order of the declarations."""
    return tuple(_DECLARED)


def backend_with(**classes: type) -> Callable[[Any, Any], Any]:
    """``make_backend`` that swaps the class of the backend the real factory would build."""

    def make(config: Any, platform: Any) -> Any:
        backend = get_offload_backend(config, platform=platform)
        cls = classes.get(type(backend).__name__)
        if cls is not None:
            backend.__class__ = cls
        return backend

    return make


def with_ring(ring: type[BlockRing], base: type = LayerWiseOffloadBackend) -> type:
    """``base`` (a layerwise backend class) with ``ring`` as its ``ring_class``."""
    return type(f"Mutant{ring.__name__}", (base,), {"ring_class": ring})


RESOLVER = dict(pipelines=("flux2",), sections=("A",),
                strategies=("model_level", "layer_wise", "distributed_layer_wise"))
MODEL_LEVEL = dict(pipelines=("wan22_t2v",), sections=("B", "C", "D", "F"),
                   strategies=("model_level",))
LAYERWISE = dict(pipelines=("flux2",), sections=("B", "C", "D", "F"),
                 strategies=("layer_wise",))
SPLIT = dict(pipelines=("cosmos3",), sections=("E",), strategies=("model_level",))
# Alignment defects change outputs only on machines whose kernels pick their path by alignment
# (MKL's GEMV on AMD EPYC): the parity checks would fail there and pass elsewhere, so these
# mutants run the alignment check alone, which fails on every machine.
ALIGNMENT = dict(pipelines=("flux2", "cosmos3"), sections=("F.6",),
                 strategies=("model_level", "layer_wise"))
MISUSE = ("J.3", "J.4", "J.5", "J.6", "J.8")
MISUSE_LAYER = dict(pipelines=("flux2",), sections=MISUSE, strategies=("layer_wise",))
MISUSE_MODEL = dict(pipelines=("wan22_t2v",), sections=MISUSE, strategies=("model_level",))
J7 = dict(pipelines=("flux2",), sections=("J.7",), strategies=("model_level", "layer_wise"))
SPLIT_THREADS = dict(pipelines=("cosmos3",), sections=("J.6",), strategies=("model_level",))
J7_SPLIT = dict(pipelines=("cosmos3",), sections=("J.7",), strategies=("model_level",))
INTERRUPTS = dict(pipelines=("flux2",), sections=("J.1",), strategies=("layer_wise",))
DISTRIBUTED = dict(pipelines=("flux2",), sections=("H",),
                   strategies=("distributed_layer_wise",))
# The same for the mmap scenario of §H: its parity check (H.6, non-persistent buffers and a
# bit-exact output) fails on AMD EPYC against an alignment defect and passes on Intel.
ALIGNMENT_H = dict(DISTRIBUTED, sections=("H.6",),
                   only=("check_mmap_loaded_weights_keep_their_alignment",))
NESTED_RESIDENT = dict(pipelines=("soulx_singer",), sections=("F",), strategies=("model_level",))
# wan22: every auto candidate has a prediction (encoder rings included)
AUTO = dict(pipelines=("wan22_t2v",), sections=("A.8",), strategies=("layer_wise",))
# qwen_image: four blocks (heads of one and two), and a budget between layerwise's peak and
# model level's leaves room for a head
HEAD = dict(pipelines=("qwen_image",), sections=("A.8", "F.7"), strategies=("layer_wise",))
# Offloaders judged through the public protocol alone (contracts/simple_offloader.py): a plain,
# correct offloader with one defect each.  Run on flux2 (both strategies) and sd3 (layerwise:
# a buffer outside the blocks views a block's weight).
PROTOCOL = dict(pipelines=("flux2", "sd3"), sections=("B", "C", "D", "F", "J"),
                strategies=("model_level", "layer_wise"))
