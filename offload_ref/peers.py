"""Other offloaders behind the kit's offloader protocol, so that the kit judges them as it judges
offload-ref (``offload-ref check --offloader offload_ref.peers:NAME``; ``offload-ref peers``
builds the conformance table of docs/peers.md).

Each factory is called as ``factory(device, strategy)`` and returns an object with
``enable(pipeline)``, ``disable()`` and ``is_enabled()`` (:mod:`offload_ref.contracts.offloader`).
An adapter drives its peer the way that peer's documentation tells a user to: it offloads the
pipeline's DiTs and encoders (found as offload-ref finds them: declarations, else well-known
names) with the peer's own call, moves the rest of the pipeline's modules (VAE, residents) to the
device as a user would, and on ``disable()`` removes the peer's hooks with the peer's own call and
moves those modules back.  What the peer leaves behind is the peer's result: the adapter repairs
nothing.  A pipeline a peer's API refuses (``enable_model_cpu_offload`` on an object that is not
a ``DiffusionPipeline``) raises ``NotImplementedError`` with the peer's own words: the kit reports
those cases not applicable.

Strategies: ``model_level`` is a peer that swaps whole components; ``layer_wise`` one that
streams parts of them (blocks, or every leaf module).  A peer asked for the other raises
``NotImplementedError``.

diffusers' group offloading is judged in each mode its documentation offers: without streams,
and with ``use_stream=True`` alone, with ``record_stream=True`` and with
``low_cpu_mem_usage=True`` (``*_stream``, ``*_stream_record``, ``*_stream_low_cpu_mem``), at block
and leaf level.  :func:`probe_upstream_reports` checks the installed diffusers for the stream
races reported upstream (Note [Upstream stream reports]); docs/peers.md shows its findings below
the table.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PEERS", "UPSTREAM_REPORTS", "UpstreamFinding", "UpstreamReport",
           "accelerate_cpu_offload", "diffusers_group_offload_block",
           "diffusers_group_offload_block_stream",
           "diffusers_group_offload_block_stream_low_cpu_mem",
           "diffusers_group_offload_block_stream_record", "diffusers_group_offload_leaf",
           "diffusers_group_offload_leaf_stream",
           "diffusers_group_offload_leaf_stream_low_cpu_mem",
           "diffusers_group_offload_leaf_stream_record", "diffusers_model_cpu_offload",
           "diffusers_sequential_cpu_offload", "offload_ref", "probe_upstream_reports",
           "upstream_reports_markdown"]


def _modules_of(pipeline: Any) -> list[tuple[str, nn.Module]]:
    """The pipeline's top-level modules: an ``nn.Module`` pipeline's children, a plain object's
    ``nn.Module`` attributes."""
    if isinstance(pipeline, nn.Module):
        return list(pipeline.named_children())
    return [(n, v) for n, v in vars(pipeline).items() if isinstance(v, nn.Module)]


class _Placement:
    """The modules an adapter moves to the device whole (those its peer does not offload), moved
    storage by storage and put back exactly: each tensor's host storage is kept and rebound on
    restore, so identity, sharing and values are as before."""

    def __init__(self) -> None:
        self._saved: list[tuple[dict[str, Any], str, torch.Tensor, bool]] = []

    def move(self, modules: list[nn.Module], device: torch.device) -> None:
        moved: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for module in modules:
                for sub in module.modules():
                    for registry in (sub._parameters, sub._buffers):
                        for name, t in list(registry.items()):
                            if t is None or t.device == device or t.is_meta:
                                continue
                            storage = t.untyped_storage()
                            target = moved.get(storage.data_ptr())
                            if target is None:
                                target = moved[storage.data_ptr()] = storage.to(device=device)
                            # an inference tensor stays one (a pipeline built under
                            # torch.inference_mode()): the adapter must not be what fails
                            with torch.inference_mode(t.is_inference()):
                                placed = torch.empty(0, dtype=t.dtype, device=device).set_(
                                    target, t.storage_offset(), t.size(), t.stride())
                            is_param = isinstance(t, nn.Parameter)
                            self._saved.append((registry, name, t.data if is_param else t,
                                                is_param))
                            if is_param:
                                t.data = placed
                            else:
                                registry[name] = placed

    def restore(self) -> None:
        with torch.no_grad():
            for registry, name, host, is_param in reversed(self._saved):
                if is_param:
                    registry[name].data = host
                else:
                    registry[name] = host
        self._saved.clear()


class _Peer:
    """The adapter's lifecycle; subclasses say how their peer installs and removes itself."""

    #: the strategy this peer implements
    strategy = "layer_wise"

    def __init__(self, device: torch.device, strategy: str) -> None:
        if strategy != self.strategy:
            raise NotImplementedError(f"{type(self).__name__.lstrip('_')} implements "
                                      f"{self.strategy}, not {strategy}")
        self.device = torch.device(device)
        self.pipeline: Any = None
        self._placement = _Placement()
        self._offloaded: list[nn.Module] = []

    def enable(self, pipeline: Any) -> None:
        if self.pipeline is pipeline:
            return
        if self.pipeline is not None:
            raise RuntimeError("this adapter already offloads another pipeline; disable() first")
        self.refuse(pipeline)
        from offload_ref.discovery import discover_components

        found = discover_components(pipeline)
        offloaded = {id(m) for _, m in (*found.dits, *found.encoders)}
        if not offloaded:
            raise NotImplementedError(f"{type(pipeline).__name__} has no DiT or encoder to "
                                      "offload (declare them, docs/model-authors.md)")
        self._offloaded = [m for _, m in (*found.dits, *found.encoders)]
        kept = [m for _, m in _modules_of(pipeline) if id(m) not in offloaded]
        self.pipeline = pipeline
        try:
            self._placement.move(kept, self.device)
            self.install(pipeline, self._offloaded)
        except BaseException:
            self.pipeline = None
            self._placement.restore()
            raise

    def disable(self) -> None:
        if self.pipeline is None:
            return
        try:
            self.remove(self.pipeline, self._offloaded)
        finally:
            self._placement.restore()
            self.pipeline, self._offloaded = None, []

    def is_enabled(self) -> bool:
        return self.pipeline is not None

    # -- what a peer implements ----------------------------------------------------------------

    def refuse(self, pipeline: Any) -> None:
        """Raise NotImplementedError when the peer's API does not take ``pipeline``."""

    def install(self, pipeline: Any, modules: list[nn.Module]) -> None:
        raise NotImplementedError

    def remove(self, pipeline: Any, modules: list[nn.Module]) -> None:
        raise NotImplementedError


class _OffloadRef(_Peer):
    """offload-ref's own backends through the protocol: the control row of the table."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        if strategy not in ("model_level", "layer_wise"):
            raise NotImplementedError(strategy)
        self.strategy = strategy
        super().__init__(device, strategy)
        self.backend: Any = None

    def enable(self, pipeline: Any) -> None:
        from offload_ref import OffloadConfig, get_offload_backend
        from offload_ref.plan import selectable_components

        if self.backend is None:
            config = OffloadConfig(strategy=self.strategy,
                                   components=selectable_components(pipeline, self.strategy))
            self.backend = get_offload_backend(config, self.device)
        self.backend.enable(pipeline)

    def disable(self) -> None:
        if self.backend is not None:
            self.backend.disable()

    def is_enabled(self) -> bool:
        return self.backend is not None and self.backend.is_enabled()


def _diffusers_pipeline(pipeline: Any, what: str) -> None:
    from diffusers import DiffusionPipeline

    if not isinstance(pipeline, DiffusionPipeline):
        raise NotImplementedError(f"diffusers' {what} is a method of DiffusionPipeline; "
                                  f"{type(pipeline).__name__} is not one")


class _DiffusersPipelineMethod(_Peer):
    """A ``DiffusionPipeline`` method that offloads the whole pipeline (``method(device=...)``);
    disable: ``remove_all_hooks()``."""

    method = ""

    def enable(self, pipeline: Any) -> None:
        _diffusers_pipeline(pipeline, self.method)
        if self.pipeline is not None and self.pipeline is not pipeline:
            raise RuntimeError("this adapter already offloads another pipeline; disable() first")
        getattr(pipeline, self.method)(device=self.device)
        self.pipeline = pipeline

    def disable(self) -> None:
        if self.pipeline is not None:
            self.pipeline.remove_all_hooks()
            self.pipeline = None


class _DiffusersModelCpuOffload(_DiffusersPipelineMethod):
    """``DiffusionPipeline.enable_model_cpu_offload(device=...)``."""

    strategy = "model_level"
    method = "enable_model_cpu_offload"


class _DiffusersSequentialCpuOffload(_DiffusersPipelineMethod):
    """``DiffusionPipeline.enable_sequential_cpu_offload(device=...)``: accelerate's hooks on
    every leaf module."""

    strategy = "layer_wise"
    method = "enable_sequential_cpu_offload"


class _DiffusersGroupOffload(_Peer):
    """``diffusers.hooks.apply_group_offloading`` on each DiT and encoder; disable: the hooks it
    registered removed through each module's ``HookRegistry``."""

    offload_type = "block_level"
    use_stream = False
    #: with ``use_stream``: ``record_stream`` (free a block's device tensors without waiting for
    #: the compute stream, the allocator told of their use) and ``low_cpu_mem_usage`` (pin the
    #: host copies at each onload instead of keeping pinned copies)
    record_stream = False
    low_cpu_mem_usage = False

    def install(self, pipeline: Any, modules: list[nn.Module]) -> None:
        from diffusers.hooks import apply_group_offloading

        options: dict[str, Any] = {"onload_device": self.device,
                                   "offload_device": torch.device("cpu"),
                                   "offload_type": self.offload_type,
                                   "use_stream": self.use_stream}
        if self.use_stream:
            options.update(record_stream=self.record_stream,
                           low_cpu_mem_usage=self.low_cpu_mem_usage)
        if self.offload_type == "block_level":
            options["num_blocks_per_group"] = 1
        for k, module in enumerate(modules):
            try:
                apply_group_offloading(module, **options)
            except ValueError as exc:
                if k:
                    raise
                # its API refused the first module before applying anything (use_stream on a
                # device whose backend has no streams, say): not applicable, in its words
                raise NotImplementedError(f"apply_group_offloading: {exc}") from exc

    def remove(self, pipeline: Any, modules: list[nn.Module]) -> None:
        from diffusers.hooks import group_offloading as g

        for module in modules:
            for sub in module.modules():
                registry = getattr(sub, "_diffusers_hook", None)
                if registry is None:
                    continue
                for name in (g._GROUP_OFFLOADING, g._LAYER_EXECUTION_TRACKER,
                             g._LAZY_PREFETCH_GROUP_OFFLOADING):
                    registry.remove_hook(name, recurse=False)


class _DiffusersGroupOffloadStream(_DiffusersGroupOffload):
    use_stream = True


class _DiffusersGroupOffloadStreamRecord(_DiffusersGroupOffloadStream):
    record_stream = True


class _DiffusersGroupOffloadStreamLowCpuMem(_DiffusersGroupOffloadStream):
    low_cpu_mem_usage = True


class _DiffusersLeafOffload(_DiffusersGroupOffload):
    offload_type = "leaf_level"


class _DiffusersLeafOffloadStream(_DiffusersLeafOffload):
    use_stream = True


class _DiffusersLeafOffloadStreamRecord(_DiffusersLeafOffloadStream):
    record_stream = True


class _DiffusersLeafOffloadStreamLowCpuMem(_DiffusersLeafOffloadStream):
    low_cpu_mem_usage = True


class _AccelerateCpuOffload(_Peer):
    """``accelerate.cpu_offload(module, execution_device=device)`` on each DiT and encoder;
    disable: ``accelerate.hooks.remove_hook_from_module(module, recurse=True)``."""

    def install(self, pipeline: Any, modules: list[nn.Module]) -> None:
        from accelerate import cpu_offload

        for module in modules:
            cpu_offload(module, execution_device=self.device)

    def remove(self, pipeline: Any, modules: list[nn.Module]) -> None:
        from accelerate.hooks import remove_hook_from_module

        for module in modules:
            remove_hook_from_module(module, recurse=True)


def _factory(cls: type[_Peer], doc: str) -> Callable[[torch.device, str], Any]:
    def factory(device: torch.device, strategy: str) -> Any:
        return cls(device, strategy)

    factory.__doc__ = doc
    return factory


offload_ref = _factory(_OffloadRef, "offload-ref's own backends (the control).")
diffusers_model_cpu_offload = _factory(
    _DiffusersModelCpuOffload, "diffusers' enable_model_cpu_offload (model level).")
diffusers_sequential_cpu_offload = _factory(
    _DiffusersSequentialCpuOffload, "diffusers' enable_sequential_cpu_offload (layerwise).")
diffusers_group_offload_block = _factory(
    _DiffusersGroupOffload, "diffusers' apply_group_offloading, block level, one block a group.")
diffusers_group_offload_block_stream = _factory(
    _DiffusersGroupOffloadStream, "diffusers' apply_group_offloading, block level, use_stream.")
diffusers_group_offload_block_stream_record = _factory(
    _DiffusersGroupOffloadStreamRecord,
    "diffusers' apply_group_offloading, block level, use_stream and record_stream.")
diffusers_group_offload_block_stream_low_cpu_mem = _factory(
    _DiffusersGroupOffloadStreamLowCpuMem,
    "diffusers' apply_group_offloading, block level, use_stream and low_cpu_mem_usage.")
diffusers_group_offload_leaf = _factory(
    _DiffusersLeafOffload, "diffusers' apply_group_offloading, leaf level.")
diffusers_group_offload_leaf_stream = _factory(
    _DiffusersLeafOffloadStream, "diffusers' apply_group_offloading, leaf level, use_stream.")
diffusers_group_offload_leaf_stream_record = _factory(
    _DiffusersLeafOffloadStreamRecord,
    "diffusers' apply_group_offloading, leaf level, use_stream and record_stream.")
diffusers_group_offload_leaf_stream_low_cpu_mem = _factory(
    _DiffusersLeafOffloadStreamLowCpuMem,
    "diffusers' apply_group_offloading, leaf level, use_stream and low_cpu_mem_usage.")
accelerate_cpu_offload = _factory(
    _AccelerateCpuOffload, "accelerate's cpu_offload on each DiT and encoder (layerwise: every "
                           "module's weights loaded at its forward).")

#: Table row name -> ``offload-ref check --offloader`` reference.
PEERS: dict[str, str] = {name: f"{__name__}:{name}" for name in (
    "offload_ref", "diffusers_model_cpu_offload", "diffusers_sequential_cpu_offload",
    "diffusers_group_offload_block", "diffusers_group_offload_block_stream",
    "diffusers_group_offload_block_stream_record",
    "diffusers_group_offload_block_stream_low_cpu_mem",
    "diffusers_group_offload_leaf", "diffusers_group_offload_leaf_stream",
    "diffusers_group_offload_leaf_stream_record",
    "diffusers_group_offload_leaf_stream_low_cpu_mem",
    "accelerate_cpu_offload")}


# -- diffusers' upstream stream reports, probed in the installed diffusers -----------------------
#
# Note [Upstream stream reports]: diffusers' group offloading with use_stream=True has had stream
# races reported upstream that gave silently wrong images on GPUs.  Each is probed here in the
# installed diffusers on the simulated accelerator under its stream sanitizer: a small model is
# group-offloaded (block level and leaf level) and called three times (the first call traces the
# order and copies blocking; the others prefetch), once as installed and once with the reported
# behaviour put back by a patch that changes only that.  The installed diffusers still has a report
# when its own run races in the report's way; it is free of it when its own run has no race and
# the patched run does (so the probe can see the bug); anything else is "not established".  The
# simulated device computes in program order, so its outputs stay right either way: the verdict
# comes from the sanitizer, never from the values.


class _SkipSynchronize:
    """A stream whose ``synchronize()`` returns at once; everything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def synchronize(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _BackendSkippingSynchronize:
    """diffusers' device backend whose ``current_stream()`` is a :class:`_SkipSynchronize`."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def current_stream(self, *args: Any, **kwargs: Any) -> _SkipSynchronize:
        return _SkipSynchronize(self._backend.current_stream(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@contextmanager
def _replaced(owner: type, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` inside the block, whether ``owner`` defines ``name`` or inherits it
    (then the inherited one is found again after)."""
    own = name in owner.__dict__
    original = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def _restore_11981(g: Any, device: torch.device) -> AbstractContextManager[None]:
    """A group prefetched by the group before it, that prefetches no group itself (the last of
    the traced order), computes without a wait for its copies: the hook's wait for exactly that
    group (added by diffusers#12077) skipped.  Hooks bind ``pre_forward`` when registered, so
    this must be in force when ``apply_group_offloading`` runs."""
    original = g.GroupOffloadingHook.pre_forward

    def pre_forward(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        group = self.group
        tensors = [p for m in group.modules for p in m.parameters()] + list(group.parameters)
        prefetched = (group.stream is not None and group.onload_leader is module
                      and not group.onload_self and bool(tensors)
                      and tensors[0].device != group.offload_device)
        last = self.next_group is None or self.next_group.onload_self
        if not (prefetched and last):
            return original(self, module, *args, **kwargs)
        stream, group.stream = group.stream, _SkipSynchronize(group.stream)
        try:
            return original(self, module, *args, **kwargs)
        finally:
            group.stream = stream

    return _replaced(g.GroupOffloadingHook, "pre_forward", pre_forward)


def _restore_12673(g: Any, device: torch.device) -> AbstractContextManager[None]:
    """``record_stream`` given the stream current inside the transfer stream's context (the
    transfer stream itself) instead of the compute stream read before entering it."""
    original = g.ModuleGroup._transfer_tensor_to_device

    def transfer(self: Any, tensor: torch.Tensor, source: torch.Tensor, stream: Any) -> Any:
        return original(self, tensor, source, self._torch_accelerator_module.current_stream())

    return _replaced(g.ModuleGroup, "_transfer_tensor_to_device", transfer)


def _restore_14657(g: Any, device: torch.device) -> AbstractContextManager[None]:
    """The disk path frees a group's device tensors without first synchronizing the compute
    stream (its ``current_stream().synchronize()`` returns at once)."""
    original = g.ModuleGroup._offload_to_disk

    def offload_to_disk(self: Any) -> Any:
        backend = self._torch_accelerator_module
        self._torch_accelerator_module = _BackendSkippingSynchronize(backend)
        try:
            return original(self)
        finally:
            self._torch_accelerator_module = backend

    return _replaced(g.ModuleGroup, "_offload_to_disk", offload_to_disk)


def _restore_13502(g: Any, device: torch.device) -> AbstractContextManager[None]:
    """Onloads return with nothing ordering their transfer-stream copies before the compute that
    reads them: every host synchronization with a stream other than the default one returns at
    once."""
    module = torch.get_device_module(device.type)
    stream_type = module.Stream
    original = stream_type.synchronize

    def synchronize(self: Any) -> Any:
        if self.stream_id != module.default_stream(self.device).stream_id:
            return None
        return original(self)

    return _replaced(stream_type, "synchronize", synchronize)


def _repair_13502(g: Any, device: torch.device) -> AbstractContextManager[None]:
    """#13502's proposed change (on its own, or on top of :func:`_restore_13502`): after each
    onload, the compute stream waits for the transfer stream (``wait_stream``, a device-side
    ordering)."""
    original = g.ModuleGroup.onload_

    def onload_(self: Any) -> Any:
        result = original(self)
        if self.stream is not None:
            torch.accelerator.current_stream(self.onload_device).wait_stream(self.stream)
        return result

    return _replaced(g.ModuleGroup, "onload_", onload_)


@dataclass(frozen=True)
class UpstreamReport:
    """One stream race in diffusers' group offloading: an upstream report, or (``number`` None)
    one these probes found that none of those reports is about."""

    #: the diffusers issue or pull request number; None: not an upstream report
    number: int | None
    #: its state upstream, in words ("issue, closed: fixed by #12077")
    upstream: str
    #: what went wrong, in our words
    reported: str
    #: what the probe puts back into the installed diffusers ("" with ``restore`` None)
    restored: str
    #: ``apply_group_offloading`` options besides ``use_stream=True`` (``offload_to_disk_path``:
    #: True means a fresh temporary folder)
    options: tuple[tuple[str, Any], ...]
    #: the race kinds it gives
    kinds: tuple[str, ...]
    #: ``restore(group_offloading_module, device)``: a context manager putting the reported
    #: behaviour back (None: the installed diffusers is probed alone)
    restore: Callable[[Any, torch.device], AbstractContextManager[None]] | None
    #: the ordering the report's fix adds, applied on top of ``restore`` (None: not probed)
    repair: Callable[[Any, torch.device], AbstractContextManager[None]] | None = None
    #: the probe models (:data:`_SHAPES`) it is probed on
    shapes: tuple[str, ...] = ("framed",)
    #: each call also runs backward (an input that requires grad, frozen weights)
    backward: bool = False
    #: "issues" or "pull"
    thread: str = "issues"

    @property
    def title(self) -> str:
        return "found here" if self.number is None else f"diffusers#{self.number}"

    @property
    def url(self) -> str | None:
        if self.number is None:
            return None
        return f"https://github.com/huggingface/diffusers/{self.thread}/{self.number}"


#: The reports of docs/peers.md (facts: their upstream threads), oldest first, then what the
#: probes found beyond them.
UPSTREAM_REPORTS: tuple[UpstreamReport, ...] = (
    UpstreamReport(
        11981, "issue, closed: fixed by #12077",
        "outputs off (cosine similarity about 0.9) with use_stream=True: a group prefetched by "
        "the group before it, and the last one of the traced order (a top-level affine "
        "LayerNorm's parameters, say), was computed without any wait for its copies",
        "the wait before computing a prefetched group that prefetches nothing itself, skipped",
        (), ("read-after-write",), _restore_11981),
    UpstreamReport(
        12673, "issue, closed: fixed by #12721",
        "a mess of an image with record_stream=True: record_stream was given the stream current "
        "inside the transfer stream's context, the transfer stream itself, so a block's device "
        "memory was freed and handed out again while the compute stream could still be reading "
        "it",
        "record_stream given the stream current inside the transfer stream's context",
        (("record_stream", True),), ("use-after-free",), _restore_12673),
    UpstreamReport(
        14657, "pull request, merged",
        "all-NaN outputs with offload_to_disk_path (leaf level, no record_stream): the disk "
        "path freed a group's device storage before the compute stream had finished with it, "
        "and the next onload was given that memory",
        "the disk path's synchronization with the compute stream before freeing, skipped",
        (("offload_to_disk_path", True),), ("use-after-free",), _restore_14657,
        thread="pull"),
    UpstreamReport(
        13502, "pull request, open",
        "wrong outputs in about 98% of iterations on ROCm (gfx1101): onloads issue their copies "
        "on the transfer stream and return with no wait_stream making the compute stream wait; "
        "torch's CUDA sanitizer flagged an addmm reading a tensor last written by a "
        "transfer-stream copy",
        "every host synchronization with the transfer stream, skipped (so nothing orders the "
        "copies before the compute); then #13502's wait_stream added on top",
        (), ("read-after-write",), _restore_13502, _repair_13502,
        shapes=("framed", "blocks_only", "own_tensors"), thread="pull"),
    UpstreamReport(
        None, "not among the reports above",
        "backward through a group-offloaded model without record_stream: a weight autograd "
        "saved for backward outlives the group's offload (which synchronizes the compute "
        "stream, then drops the device tensor); it is freed after backward read it on the "
        "compute stream, with nothing waiting for that read, and the transfer stream's next "
        "onload is given the memory",
        "", (), ("use-after-free",), None, shapes=("linear",), backward=True),
)


class _ProbeBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.ff(x).relu() + x)


class _ProbeFramed(nn.Module):
    """Blocks in a ModuleList (block level), Linear leaves and LayerNorms whose parameters form
    parameter-only groups (leaf level), layers around the blocks, and a top-level affine
    LayerNorm last in the order (#11981's shape)."""

    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.blocks = nn.ModuleList(_ProbeBlock(width) for _ in range(blocks))
        self.norm_out = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.norm_out(x)


class _ProbeBlocksOnly(nn.Module):
    """Nothing at the top level but the block list."""

    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_ProbeBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _ProbeOwnTensors(nn.Module):
    """A module whose tensors are its own (a buffer and a parameter), with no layer under it
    (a mel-spectrogram front end's window and filterbank, say)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.register_buffer("window", torch.rand(width))
        self.scale = nn.Parameter(torch.rand(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.window) @ self.scale


class _ProbeLinear(nn.Module):
    """Linear layers only (a LayerNorm's backward reads its weight through the parameter, which
    the offload has moved back to the host by then: a device error, not a race)."""

    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.proj_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x).relu()
        return self.proj_out(x)


#: The probe models: name -> (class, what it is, in words).
_SHAPES: dict[str, tuple[type[nn.Module], str]] = {
    "framed": (_ProbeFramed, "an input Linear, three blocks (a Linear and a LayerNorm) in a "
                             "ModuleList, a top-level affine LayerNorm last"),
    "blocks_only": (_ProbeBlocksOnly, "the same three blocks in a ModuleList, nothing else at "
                                      "the top level"),
    "own_tensors": (_ProbeOwnTensors, "a buffer and a parameter of the module itself, no layer "
                                      "under it"),
    "linear": (_ProbeLinear, "an input Linear, three Linear blocks in a ModuleList, an output "
                             "Linear; backward through it"),
}


@dataclass
class UpstreamFinding:
    """One report probed at one offload type on one probe model."""

    report: UpstreamReport
    offload_type: str
    shape: str
    #: the races of the installed diffusers' run
    installed: list[Any]
    #: the races with the reported behaviour put back (None: nothing put back)
    restored: list[Any] | None
    #: the races with it put back and the report's fix added (None: not probed)
    repaired: list[Any] | None
    #: every call of every run gave the un-offloaded output (and input gradient) bit for bit
    exact: bool

    @property
    def verdict(self) -> str:
        """``present`` (the installed diffusers races the report's way), ``absent`` (it does not
        race, and the probe sees the bug once put back), ``none found`` (no race, nothing put
        back) or ``not established``."""
        if any(r.kind in self.report.kinds for r in self.installed):
            return "present"
        if self.installed:
            return "not established"
        if self.restored is None:
            return "none found"
        if any(r.kind in self.report.kinds for r in self.restored):
            return "absent"
        return "not established"


def _probe_once(report: UpstreamReport, offload_type: str, shape: str, device: torch.device,
                patches: Sequence[Callable[[Any, torch.device], AbstractContextManager[None]]],
                ) -> tuple[list[Any], bool]:
    import tempfile
    from contextlib import ExitStack

    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks import group_offloading as g

    from offload_ref.contracts.streams import name_memory
    from offload_ref.platform import simulated

    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(0)
        model = _SHAPES[shape][0]().eval().requires_grad_(False)
        with torch.no_grad():  # no zero or unit parameter: a lost weight must show
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape))
        x = torch.randn(2, 8).pin_memory()  # its copies synchronize nothing

    def call(module: nn.Module) -> list[torch.Tensor]:
        # the input copied non_blocking from pinned memory and the results left on the device
        # until every call is made: a blocking copy would synchronize the host with the compute
        # stream between calls, ordering what a GPU would not
        with torch.set_grad_enabled(report.backward):
            inputs = x.to(device, non_blocking=True).requires_grad_(report.backward)
            out = module(inputs)
            if not report.backward:
                return [out]
            out.sum().backward()
            return [out.detach(), inputs.grad]

    expected = call(copy.deepcopy(model).to(device))
    options = dict(report.options)
    with ExitStack() as stack:
        if options.get("offload_to_disk_path"):
            options["offload_to_disk_path"] = stack.enter_context(tempfile.TemporaryDirectory())
        if offload_type == "block_level":
            options["num_blocks_per_group"] = 1
        for patch in patches:
            stack.enter_context(patch(g, device))
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type=offload_type, use_stream=True, **options)
        simulated.set_tensor_namer(lambda index, address, nbytes:
                                   name_memory([model], address, nbytes))
        stack.callback(simulated.set_tensor_namer, None)
        simulated.clear_races()
        with simulated.stream_checking():
            results = [call(model) for _ in range(3)]
            found = simulated.races(clear=True)
    exact = all(torch.equal(a.cpu(), b.cpu()) for result in results
                for a, b in zip(result, expected))
    return found, exact


def probe_upstream_reports(reports: Sequence[UpstreamReport] = UPSTREAM_REPORTS,
                           offload_types: Sequence[str] = ("block_level", "leaf_level"),
                           ) -> list[UpstreamFinding]:
    """Probe each report in the installed diffusers on ``hpu:0`` (Note [Upstream stream
    reports]).  Raises RuntimeError naming the reason when it cannot (no diffusers, no simulated
    accelerator)."""
    from offload_ref.platform import simulated

    if not simulated.available():  # first: diffusers' import asks torch for its accelerator
        raise RuntimeError(f"the simulated accelerator is unavailable: "
                           f"{simulated.unavailable_reason()}")
    try:
        import diffusers.hooks.group_offloading  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"diffusers is not installed ({exc})") from exc
    device = simulated.device(0)
    findings = []
    for report in reports:
        for shape in report.shapes:
            for offload_type in offload_types:
                installed, exact = _probe_once(report, offload_type, shape, device, ())
                restored = repaired = None
                if report.restore is not None:
                    restored, ok = _probe_once(report, offload_type, shape, device,
                                               (report.restore,))
                    exact = exact and ok
                if report.restore is not None and report.repair is not None:
                    repaired, ok = _probe_once(report, offload_type, shape, device,
                                               (report.restore, report.repair))
                    exact = exact and ok
                findings.append(UpstreamFinding(report, offload_type, shape, installed,
                                                restored, repaired, exact))
    return findings


def _stream_words(access: Any) -> str:
    if access.stream == -1:
        return "the host"
    return "the compute (default) stream" if access.stream == 0 else "the transfer stream"


def _race_words(race: Any) -> str:
    """A race in one line, streams named by their role here (their ids vary from run to run)."""
    from offload_ref.contracts.streams import frame_text

    def access(a: Any) -> str:
        op = a.op + (f" ({a.argument})" if a.argument else "")
        at = f" at {frame_text(a.where[0])}" if a.where else " (no source line captured)"
        return f"{_stream_words(a)} {'wrote' if a.write else 'read'} it in {op}{at}"

    text = (f"{race.kind} on {race.tensor}: {access(race.current)}, while earlier "
            f"{access(race.previous)} and nothing ordered that before")
    if race.freed_at:
        text += f" (freed at {frame_text(race.freed_at[0])} and handed out again)"
    return text.replace("|", "/")


def _races_cell(races: list[Any]) -> str:
    if not races:
        return "no race"
    kinds = sorted({r.kind for r in races})
    return (f"{len(races)} race{'s' if len(races) > 1 else ''} ({', '.join(kinds)}), e.g. "
            f"{_race_words(races[0])}")


def _report_verdict(found: Sequence[UpstreamFinding]) -> str:
    seen = {f.verdict for f in found}
    for verdict in ("present", "not established"):
        if verdict in seen:
            return verdict
    return seen.pop() if len(seen) == 1 else "not established"


#: The diffusers version whose code the explanations below were read in.
_READ_IN = "0.42.1"


def upstream_reports_markdown(findings: Sequence[UpstreamFinding] | str) -> list[str]:
    """docs/peers.md's section on the upstream reports: ``findings`` from
    :func:`probe_upstream_reports`, or why they could not be probed."""
    out = ["## diffusers' upstream stream reports, probed in the installed diffusers", ""]
    if isinstance(findings, str):
        return out + [f"Not probed: {findings}.", ""]
    import inspect

    import diffusers
    from diffusers.hooks import group_offloading

    version = diffusers.__version__
    levels = list(dict.fromkeys(f.offload_type for f in findings))
    shapes = list(dict.fromkeys(f.shape for f in findings))
    out += [
        f"Which stream races reported upstream against diffusers' group offloading the "
        f"installed diffusers ({version}) still has, probed while this page was generated "
        "(`offload_ref.peers.probe_upstream_reports`, Note [Upstream stream reports] there; "
        "tests/test_peers_streams.py).  Small models are group-offloaded to hpu:0 with "
        "`use_stream=True` and called three times (the first call traces the order and "
        "copies blocking, the others prefetch) under the simulated accelerator's "
        "happens-before stream sanitizer: once as installed, and once with the reported "
        "behaviour put back by a patch that changes only that.  **present**: the installed "
        "diffusers races the report's way; **absent**: it does not race, and the same run "
        "with the behaviour put back does, so the probe sees the bug; **none found**: nothing "
        "was put back and the installed diffusers does not race.  The simulated device "
        "computes in program order, so the outputs are bit-exact either way: the verdict is "
        "the sanitizer's, not the values'.  Streams are named by their role (the compute "
        "stream is the default stream; diffusers' own stream is the transfer stream).  The "
        "models: " + "; ".join(f"*{s}*: {_SHAPES[s][1]}" for s in shapes) + ".",
        "",
        "| report | what went wrong | model | put back for the probe | "
        + " | ".join(f"{level}" for level in levels) + " | verdict |",
        "|---|---|---|---|" + "---|" * len(levels) + "---|",
    ]
    groups: dict[tuple[Any, str], list[UpstreamFinding]] = {}
    for f in findings:
        groups.setdefault((f.report, f.shape), []).append(f)
    verdicts: dict[UpstreamReport, list[UpstreamFinding]] = {}
    shown: set[UpstreamReport] = set()
    for (r, shape), found in groups.items():
        verdicts.setdefault(r, []).extend(found)
        cells = []
        for level in levels:
            f = next((f for f in found if f.offload_type == level), None)
            if f is None:
                cells.append("not probed")
                continue
            cell = f"as installed: {_races_cell(f.installed)}"
            if f.restored is not None:
                cell += f"; put back: {_races_cell(f.restored)}"
            if f.repaired is not None:
                cell += f"; put back with #{r.number}'s change added: {_races_cell(f.repaired)}"
            if not f.exact:
                cell += " (an output differed from the un-offloaded one)"
            cells.append(cell)
        title = f"[{r.title}]({r.url})" if r.url else r.title
        what = "(as above)" if r in shown else r.reported
        shown.add(r)
        out.append(f"| {title} ({r.upstream}) | {what} | {shape} | {r.restored or 'nothing'} | "
                   + " | ".join(cells) + f" | **{_report_verdict(found)}** |")

    def names(verdict: str) -> str:
        picked = []
        for r, found in verdicts.items():
            if r.number is None or _report_verdict(found) != verdict:
                continue
            where = ""
            if verdict == "present":
                where = " (" + ", ".join(f"{f.offload_type} on *{f.shape}*" for f in found
                                         if f.verdict == "present") + ")"
            picked.append(f"#{r.number}{where}")
        return ", ".join(picked) or "none"

    out += ["", f"In short, diffusers {version} still has: {names('present')}; is free of: "
                f"{names('absent')}; not established: {names('not established')}.  Its "
                "hooks/group_offloading.py "
                + ("calls" if "wait_stream" in inspect.getsource(group_offloading)
                   else "never calls") + " `wait_stream`."]
    ordered = [f for f in findings if f.repaired is not None and not f.installed
               and f.restored and not f.repaired]
    if ordered:
        f = ordered[0]
        out[-1] += (f"  On *{f.shape}* what orders its compute after the transfer stream's "
                    "copies is its host synchronizations with the transfer stream "
                    f"(`stream.synchronize()`): with them skipped the probe races "
                    f"({len(f.restored)} races at {f.offload_type}), and with "
                    f"#{f.report.number}'s `wait_stream` in their place it does not.  A host "
                    "synchronization orders as much as a `wait_stream` (torch's CUDA sanitizer "
                    "counts it too), the host waiting for it.")
    unordered = {(f.shape, f.offload_type) for f in findings
                 if f.report.number == 13502 and f.verdict == "present"}
    why = {  # read in diffusers _READ_IN's hooks/group_offloading.py
        ("blocks_only", "block_level"):
            "at block level diffusers registers its lazy-prefetch hook (which makes the first "
            "call copy blocking and chains the prefetches with their waits) only with the group "
            "of what lies outside the blocks, and there is none",
        ("own_tensors", "leaf_level"):
            "at leaf level the module's own tensors form a group on the module itself, which "
            "the lazy-prefetch hook neither makes copy blocking on the first call nor chains "
            "(it traces only the layers under the module; soulx_singer's mel front end has "
            "this shape)",
    }
    for shape, level in sorted(unordered):
        if version == _READ_IN and (shape, level) in why:
            out[-1] += (f"  On *{shape}* nothing orders them: {why[shape, level]}, so the group "
                        "onloads itself on the transfer stream (non_blocking) and is computed "
                        "at once, with no synchronization, on every call: #13502's hazard, on a "
                        "GPU a layer computed with weights still being copied.")
    extra = [r for r in verdicts if r.number is None and _report_verdict(verdicts[r]) ==
             "present"]
    for r in extra:
        levels_found = ", ".join(f"{f.offload_type} on *{f.shape}*" for f in verdicts[r]
                                 if f.verdict == "present")
        out[-1] += f"  Found here beyond the reports ({levels_found}): {r.reported}."
    out[-1] += ("  Only what the probes and the table's pipelines run is established: other "
                "models, `num_blocks_per_group` above 1 and modules called outside the traced "
                "order are not.")
    out.append("")
    return out
