"""What a check receives: the pipeline under test, the strategy, and the implementation."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from offload_ref.config import OffloadConfig, OffloadStrategy
from offload_ref.plan.tree import wrapper_inner
from offload_ref.plan import resolve_offload_plan, selectable_components
from offload_ref.platform import CpuPlatform

from offload_ref.backends.base import backend_of

from .capabilities import OFFLOAD_REF, Capabilities
from .diagnosis import Run, diagnose
from .placement import Owners
from .spec import PipelineSpec

#: Generations a case remembers for a diagnosis (a check compares the latest ones).
_KEPT_RUNS = 16

__all__ = ["CheckCase", "GRAD_MODES", "Implementation", "DEFAULT_IMPLEMENTATION", "kit_device",
           "move_to_device", "on_device_index"]

#: The accelerator index :func:`kit_device` answers (:func:`on_device_index` changes it for a
#: block: the checks that run an offloader on ``hpu:1``).
_DEVICE_INDEX: contextvars.ContextVar[int] = contextvars.ContextVar("kit_device_index",
                                                                     default=0)


def kit_device() -> torch.device:
    """The device the kit computes on: the simulated accelerator's ``hpu:0`` when it is available
    (host and device differ, as on a GPU), else the CPU (single-device mode:
    ``OFFLOAD_REF_SIM=0`` or ``offload-ref check --single-device``).  Inside
    :func:`on_device_index` the accelerator's device of that index (``hpu:1``)."""
    from offload_ref.platform import simulated

    return simulated.device(_DEVICE_INDEX.get()) if simulated.available() else \
        torch.device("cpu")


@contextlib.contextmanager
def on_device_index(index: int) -> Iterator[torch.device]:
    """Within the block, :func:`kit_device` is the accelerator's device ``index``: the device the
    kit hands offload-ref's platform (``Implementation.make_platform``) and an offloader's factory
    (``factory(device, strategy)``), and where a :class:`CheckCase` made inside computes.  So an
    offloader that ignores the index it is given (it moves to device 0, or to the bare device
    type) puts its tensors on another device than the pipeline computes on."""
    token = _DEVICE_INDEX.set(index)
    try:
        yield kit_device()
    finally:
        _DEVICE_INDEX.reset(token)


def on_kit_device(pipeline: Any) -> Any:
    """``pipeline`` moved whole to :func:`kit_device` (:func:`move_to_device`): an un-offloaded
    reference that computes where the offloaded runs do."""
    return move_to_device(pipeline, kit_device())


def move_to_device(pipeline: Any, device: torch.device) -> Any:
    """Move every parameter and buffer of ``pipeline`` (an ``nn.Module`` or a plain object holding
    modules) to ``device`` in place, storage by storage: tensors that share a storage still share
    one, and each keeps its address phase (Note [Aligned layout] in offload_ref/host.py: its
    address modulo 64), as in an offloaded run: its storage offset, and the phase of the storage
    itself, which is not 0 for a storage that does not start on a 64-byte boundary (a
    safetensors mmap view, ``torch.frombuffer``); see :func:`_device_storage`.  (``Module.to``
    would copy each tensor to a fresh, fully aligned allocation: another kernel path for a
    weight stored off alignment, and so other last bits.)  Parameter objects are kept; returns
    ``pipeline``."""
    from .facts import module_view

    if device.type == "cpu":
        return pipeline
    view = module_view(pipeline)
    moved: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}

    def placed(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in moved:
            moved[key] = _device_storage(storage, device)
        target, phase = moved[key]
        if phase % tensor.element_size():  # a view reinterpreting the storage
            target, phase = storage.to(device=device), 0
        return torch.empty(0, dtype=tensor.dtype, device=device).set_(
            target, tensor.storage_offset() + phase // tensor.element_size(),
            tensor.size(), tensor.stride())

    with torch.no_grad():
        for module in view.modules():
            for registry in (module._parameters, module._buffers):
                for name, tensor in list(registry.items()):
                    if tensor is None or tensor.device == device or tensor.is_meta:
                        continue
                    if wrapper_inner(tensor) is not None:
                        _move_wrapper(tensor, device, placed)
                    elif isinstance(tensor, nn.Parameter):
                        tensor.data = placed(tensor)
                    else:
                        registry[name] = placed(tensor)
    return pipeline


def _move_wrapper(wrapper: torch.Tensor, device: torch.device,
                  placed: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Move a wrapper subclass's inner tensors to ``device`` in place (``placed`` gives a plain
    tensor's device twin), and give the wrapper the metadata of one built around them there
    (Note [Wrapper subclasses] in offload_ref/plan/tree.py).  A module-level function: a
    recursive closure would be a reference cycle holding the moved storages until the next
    garbage collection, and device bytes with them."""
    names, ctx = wrapper.__tensor_flatten__()
    for _, inner in wrapper_inner(wrapper) or ():
        if inner.device == device or inner.is_meta:
            continue
        if wrapper_inner(inner) is not None:
            _move_wrapper(inner, device, placed)
        else:
            inner.data = placed(inner)
    wrapper.data = type(wrapper).__tensor_unflatten__(
        {name: getattr(wrapper, name) for name in names}, ctx, wrapper.size(), wrapper.stride())


def _device_storage(storage: torch.UntypedStorage,
                    device: torch.device) -> tuple[torch.UntypedStorage, int]:
    """A copy of ``storage`` on ``device`` and the bytes it starts past its allocation's start:
    the host storage's address modulo 64, so that every tensor over the copy keeps its address
    modulo 64.  (``storage.to(device)`` starts on a fresh 64-byte boundary: a safetensors mmap
    view 4 bytes past one would then be computed on at another alignment than an offloader,
    which keeps the phase, computes on it, and MKL's GEMV gives other last bits on AMD EPYC.)"""
    phase = storage.data_ptr() % 64
    flat = torch.empty(phase + storage.nbytes(), dtype=torch.uint8, device=device)
    host = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    flat[phase:].copy_(host)
    return flat.untyped_storage(), phase


def _make_backend(config: OffloadConfig, platform: Any) -> Any:
    from offload_ref.backends import get_offload_backend

    return get_offload_backend(config, platform=platform)


def _make_platform() -> Any:
    return CpuPlatform(device=kit_device(), race_amplifier=True)


def _make_accelerator_platform() -> Any:
    from offload_ref.platform.accelerator import AcceleratorPlatform

    return AcceleratorPlatform(kit_device())


def _load_safetensors(module: Any, paths: Any, **kwargs: Any) -> Any:
    from offload_ref.loading import load_safetensors

    return load_safetensors(module, paths, **kwargs)


def _make_wave_runner(pipeline: Any) -> Any:
    from offload_ref.distributed import WaveRunner

    return WaveRunner(pipeline)


@dataclass(frozen=True)
class Implementation:
    """The offloader under test.  The kit's own tests swap parts for deliberately broken ones
    (mutants) to prove that each check can fail."""

    name: str = "offload_ref"
    resolve_offload_plan: Callable[..., Any] = resolve_offload_plan
    config_from_od_config: Callable[[Any], OffloadConfig] = OffloadConfig.from_od_config
    config_from_mapping: Callable[..., OffloadConfig] = OffloadConfig.from_mapping
    make_backend: Callable[[OffloadConfig, Any], Any] = _make_backend
    make_platform: Callable[[], Any] = _make_platform
    #: The platform ``check_device_accesses_are_ordered_across_streams`` (§S) runs offload-ref's
    #: backends on: :class:`~offload_ref.platform.accelerator.AcceleratorPlatform` on the kit's
    #: device, the ``torch.Stream`` / ``torch.Event`` code a GPU runs, whose streams the
    #: simulated accelerator's sanitizer orders (the CPU platform's copy threads all run on the
    #: device's default stream: its own order checker judges them).
    make_accelerator_platform: Callable[[], Any] = _make_accelerator_platform
    #: What the kit can see of it (:mod:`.capabilities` decides which checks apply from this).
    capabilities: Capabilities = OFFLOAD_REF
    #: ``(strategy, why)`` for each strategy it does not offer: those cases are not applicable.
    unsupported_strategies: tuple[tuple[str, str], ...] = ()
    #: The loader of §H's mmap scenario: ``load_safetensors(module, paths)`` as
    #: :func:`offload_ref.load_safetensors` (the kit's mutants swap it).
    load_safetensors: Callable[..., Any] = _load_safetensors
    #: The DP wave runner of §H: ``make_wave_runner(pipeline)`` with a ``run(request)`` as
    #: :class:`offload_ref.distributed.WaveRunner`.
    make_wave_runner: Callable[[Any], Any] = _make_wave_runner
    #: How a spawned rank (catalogue §H) rebuilds it when its callables are not importable by
    #: name: a ``"module:attr"`` reference to a function taking :attr:`name` and returning the
    #: implementation and a context to enter around the rank's work (the kit's mutants).
    in_rank: str | None = None

    def unsupported(self, strategy: str) -> str | None:
        """Why this implementation does not offer ``strategy``, or None when it does."""
        return dict(self.unsupported_strategies).get(strategy)

    def replace(self, **changes: Any) -> Implementation:
        return dataclasses.replace(self, **changes)


DEFAULT_IMPLEMENTATION = Implementation()


def _own_grad_mode() -> contextlib.AbstractContextManager:
    """Grad mode as a user's plain call has it: on, and outside inference mode."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode(False))
    stack.enter_context(torch.enable_grad())
    return stack


#: The grad modes :meth:`CheckCase.run` runs a generation in.
GRAD_MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "inference": torch.inference_mode,
    "no_grad": torch.no_grad,
    "own": _own_grad_mode,
}


@dataclass
class CheckCase:
    """One (check, pipeline spec, strategy) instance.  Resources it creates are closed by
    :meth:`close` (the runner calls it)."""

    spec: PipelineSpec | None
    strategy: OffloadStrategy | None
    impl: Implementation = DEFAULT_IMPLEMENTATION
    _platforms: list[Any] = field(default_factory=list)
    _reference: Any = None
    _components: tuple[str, ...] | None = None
    #: The latest generations :meth:`run` made (output, pipeline, inputs), newest last, so that a
    #: failed :meth:`compare` can rerun them for its diagnosis; the reference is kept apart.
    _runs: list[Run] = field(default_factory=list)
    _reference_run: Run | None = None
    _host_reference: Any = None
    _host_reference_run: Run | None = None
    _device: torch.device | None = None
    #: weak references to the pipelines :meth:`build` made (the stream sanitizer names racing
    #: memory by their tensors' module paths: contracts/streams.py)
    _built: list[Any] = field(default_factory=list)
    #: The config of the latest backend :meth:`backend` made (None: the case's own): what the
    #: check was enabling when it failed, for a diagnosis that reruns it.
    last_config: OffloadConfig | None = None

    # -- pipelines ------------------------------------------------------------------------------

    def build(self) -> Any:
        assert self.spec is not None, "a global check has no pipeline"
        pipeline = self.spec.build()
        try:
            self._built.append(weakref.ref(pipeline))
        except TypeError:  # an object that takes no weak reference: its tensors go unnamed
            pass
        if self._components is None and self.strategy is not None:
            # What :meth:`config` selects, read off the first pipeline as built, before the
            # check holds it: a fresh build of its own for it was one more build per case.
            # Reading declarations changes nothing; a pipeline it cannot read is left to
            # config, which raises where it always did.
            try:
                self._components = selectable_components(pipeline, self.strategy)
            except Exception:  # noqa: BLE001 - config() reads a fresh build and raises there
                pass
        return pipeline

    def built_pipelines(self) -> list[Any]:
        """The pipelines :meth:`build` made that are still alive (held weakly)."""
        alive = [ref() for ref in self._built]
        return [p for p in alive if p is not None]

    @property
    def device(self) -> torch.device:
        """Where this case computes: the device of the platform under test (the simulated
        accelerator's ``hpu:0`` by default, so host and device differ; ``cpu`` in single-device
        mode)."""
        if self._device is None:
            self._device = kit_device()
        return self._device

    def build_resident(self) -> Any:
        """A fresh pipeline moved whole to :attr:`device`, as a user with enough device memory
        runs it: the reference every offloaded run is compared with (Contract P.1)."""
        pipeline = self.build()
        return move_to_device(pipeline, self.device)

    def inputs(self) -> dict[str, Any]:
        assert self.spec is not None
        return self.spec.make_inputs()

    def run(self, pipeline: Any, inputs: dict[str, Any] | None = None, *,
            grad_mode: str = "inference") -> torch.Tensor:
        """One generation, remembered (the pipeline weakly) for the diagnosis of a failed
        :meth:`compare`.  ``grad_mode`` (:data:`GRAD_MODES`): under ``torch.inference_mode()``
        (the default: how an engine such as vLLM-Omni runs a pipeline), under ``torch.no_grad()``
        (a user who goes on to edit or fine-tune the weights: every tensor the pipeline makes
        during the generation is an ordinary tensor, as the pipeline's own ``@torch.no_grad()``
        makes it, where inference mode would make it an inference tensor that nobody can edit or
        train, offloaded or not), or ``"own"``: as a user's plain call runs it, grad mode on and
        the pipeline's own ``no_grad`` (or none) deciding."""
        if grad_mode not in GRAD_MODES:
            raise ValueError(f"grad_mode={grad_mode!r}: expected one of {', '.join(GRAD_MODES)}")
        with GRAD_MODES[grad_mode]():
            output = pipeline(**(inputs if inputs is not None else self.inputs()))
        self._runs.append(Run.of(output, pipeline, inputs))
        del self._runs[:-_KEPT_RUNS]
        return output

    def forget_runs(self) -> None:
        """Drop the generations :meth:`run` remembered: their outputs hold device bytes that a
        check measuring the device must not count as the offloader's (the reference stays)."""
        self._runs.clear()

    def reference(self) -> torch.Tensor:
        """The output of a fresh pipeline with no offloading, moved whole to :attr:`device`
        (computed once per case)."""
        if self._reference is None:
            self._reference = self.run(self.build_resident())
            self._runs.pop()
            self._reference_run = Run(self._reference, None, None, fresh=True)
        return self._reference

    def host_reference(self) -> torch.Tensor:
        """The output of a fresh pipeline with no offloading, left on the host: what a pipeline
        computes after ``disable()`` (computed once per case).  Equal to :meth:`reference`
        unless the pipeline's output depends on its device (a generator on the execution device
        draws other numbers on the host than on a GPU), which is no offloading defect."""
        if self._host_reference is None:
            if self.device.type == "cpu":
                self._host_reference = self.reference()
            else:
                self._host_reference = self.run(self.build())
                self._runs.pop()
                self._host_reference_run = Run(self._host_reference, None, None, fresh=True)
        return self._host_reference

    def compare(self, what: str, got: Any, want: Any) -> None:
        """:func:`~offload_ref.contracts.observe.compare_outputs`, and on a mismatch a
        diagnosis appended to the failure: the first module whose output diverged (a rerun of
        both generations with hooks on every module) and the tensors read while off the device.
        ``got`` and ``want`` should be outputs of :meth:`run` (or :meth:`reference`)."""
        from .observe import compare_outputs

        compare_outputs(what, got, want, case=self)

    def diagnose(self, got: Any, want: Any) -> str:
        """The diagnosis lines for a failed comparison of ``got`` with ``want`` (both outputs of
        :meth:`run`); run only once the comparison has failed."""
        got_run, want_run = self._run_of(got), self._run_of(want)
        if got_run is None or want_run is None:
            which = "output under test" if got_run is None else "reference output"
            return (f"\n  diagnosis: not run (the {which} was not produced by case.run(), so the "
                    "kit cannot rerun it)")
        return diagnose(got_run, want_run, rebuild=self.build_resident, make_inputs=self.inputs,
                        resident=lambda t, pipe=got_run.pipeline: self._resident(pipe, t),
                        enabled=lambda p: backend_of(p) is not None, owners=self._owners)

    def _run_of(self, output: Any) -> Run | None:
        if self._reference_run is not None and self._reference_run.output is output:
            return self._reference_run
        if self._host_reference_run is not None and self._host_reference_run.output is output:
            return self._host_reference_run
        return next((r for r in reversed(self._runs) if r.output is output), None)

    def _resident(self, pipeline_ref: Any, tensor: torch.Tensor) -> bool:
        from .facts import resident  # a wrapper subclass: by its inner tensors

        pipeline = pipeline_ref() if pipeline_ref is not None else None
        backend = backend_of(pipeline) if pipeline is not None else None
        platform = getattr(backend, "platform", None)
        platforms = [platform] if platform is not None else self._platforms
        return any(resident(p, tensor) for p in platforms)

    def _owners(self, pipeline: Any) -> Owners:
        """The offloaded components and streamed blocks of ``pipeline``: its backend's plan, or
        (a backend without one) the plan the kit resolves for this case."""
        plan = getattr(backend_of(pipeline), "plan", None)
        return Owners.of(plan if plan is not None else
                         resolve_offload_plan(self.build(), self.config()))

    # -- offloader ------------------------------------------------------------------------------

    def config(self, **overrides: Any) -> OffloadConfig:
        """The explicit config of this case's strategy, selecting everything the pipeline can
        offload (``offload_ref.plan.selectable_components``)."""
        assert self.strategy is not None
        if self._components is None:
            self._components = selectable_components(self.build(), self.strategy)
        fields = {"strategy": self.strategy, "components": self._components}
        fields.update(overrides)
        return OffloadConfig(**fields)

    def resolve(self, pipeline: Any, config: OffloadConfig | None = None) -> Any:
        return self.impl.resolve_offload_plan(pipeline, config or self.config())

    def platform(self) -> Any:
        p = self.impl.make_platform()
        self._platforms.append(p)
        return p

    def accelerator_platform(self) -> Any:
        """A platform of ``impl.make_accelerator_platform`` (closed with the case)."""
        p = self.impl.make_accelerator_platform()
        self._platforms.append(p)
        return p

    def backend(self, config: OffloadConfig | None = None, platform: Any = None) -> Any:
        platform = platform if platform is not None else self.platform()
        self.last_config = config
        backend = self.impl.make_backend(config or self.config(), platform)
        if backend is None:
            raise AssertionError(f"no backend for {config or self.config()}")
        return backend

    def close(self) -> None:
        for p in self._platforms:
            close = getattr(p, "close", None)
            if close is not None:
                close()
        self._platforms.clear()

    @property
    def label(self) -> str:
        parts = [self.spec.name if self.spec else "-", str(self.strategy or "-")]
        return "/".join(parts)
