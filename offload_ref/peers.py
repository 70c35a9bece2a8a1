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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PEERS", "accelerate_cpu_offload", "diffusers_group_offload_block",
           "diffusers_group_offload_block_stream", "diffusers_group_offload_leaf",
           "diffusers_group_offload_leaf_stream", "diffusers_model_cpu_offload",
           "diffusers_sequential_cpu_offload", "offload_ref"]


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

    def install(self, pipeline: Any, modules: list[nn.Module]) -> None:
        from diffusers.hooks import apply_group_offloading

        options: dict[str, Any] = {"onload_device": self.device,
                                   "offload_device": torch.device("cpu"),
                                   "offload_type": self.offload_type,
                                   "use_stream": self.use_stream}
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


class _DiffusersLeafOffload(_DiffusersGroupOffload):
    offload_type = "leaf_level"


class _DiffusersLeafOffloadStream(_DiffusersLeafOffload):
    use_stream = True


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
diffusers_group_offload_leaf = _factory(
    _DiffusersLeafOffload, "diffusers' apply_group_offloading, leaf level.")
diffusers_group_offload_leaf_stream = _factory(
    _DiffusersLeafOffloadStream, "diffusers' apply_group_offloading, leaf level, use_stream.")
accelerate_cpu_offload = _factory(
    _AccelerateCpuOffload, "accelerate's cpu_offload on each DiT and encoder (layerwise: every "
                           "module's weights loaded at its forward).")

#: Table row name -> ``offload-ref check --offloader`` reference.
PEERS: dict[str, str] = {name: f"{__name__}:{name}" for name in (
    "offload_ref", "diffusers_model_cpu_offload", "diffusers_sequential_cpu_offload",
    "diffusers_group_offload_block", "diffusers_group_offload_block_stream",
    "diffusers_group_offload_leaf", "diffusers_group_offload_leaf_stream",
    "accelerate_cpu_offload")}
