"""The resolver: :class:`Resolver` turns a pipeline's declarations and an
:class:`OffloadConfig` into a :class:`ResolvedOffloadPlan` (components, roles, selection, rings),
raising every topology error before anything is placed (Note [Resolution is pure] in
plan/__init__.py)."""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config import ENCODER_KINDS, OffloadConfig, OffloadStrategy, WeightTransfer
from ..host import ALLOCATOR_ALIGNMENT, span_facts
from ..discovery import (
    _MISSING,
    ModuleCycleError,
    OffloadDeclarationWarning,
    discover_components,
    get_submodule_path,
    require_acyclic,
    supports_model_cpu_offload,
)
from .declarations import OffloadPlan, OffloadTopologyError, encoder_kind
from .ownership import _ring_aliases, _with_shared
from .prediction import (_other_state_bytes, _ring_tensors, _span_bytes, host_allocations,
                         predict_device_bytes, staging_budget_error)
from .resolved import (
    ComponentRole,
    ResolvedComponent,
    ResolvedOffloadPlan,
    RingPlan,
    _streamed_tensors,
    owned_tensors,
)
from .tree import _has_readable_storage, _storage_key, _subtree, named_tensors, pipeline_state


class Resolver:
    """Resolves one pipeline for one config: ``Resolver(pipeline, config).resolve()`` is
    :func:`~offload_ref.plan.resolve_offload_plan` for a config that is not ``"auto"``
    (``alignment`` and ``resident_heads`` as there).  Pure (Note [Resolution is pure]).

    Seams (a subclass may override; each is one named rule of resolution, called by
    :meth:`resolve`, so a subclass changes that rule alone):

    * :meth:`check_acyclic`: the cycle check discovery runs before it walks a module tree;
    * :meth:`validate_delegated`: the input validation of a split model that delegates model
      level (it runs instead of everything below);
    * :meth:`reject_unreadable_storage`: lazy, sparse and unreadable tensors, rejected;
    * :meth:`container_names`: where a DiT's layerwise blocks are declared;
    * :meth:`vae_components`: the VAEs, with their selection and lifecycle;
    * :meth:`check_unique_ownership`: a block belongs to one ring, and nothing inside a
      streamed block is a component of its own;
    * :meth:`check_one_group_per_storage`: model level's groups share no storage.
    """

    def __init__(self, pipeline: Any, config: OffloadConfig,
                 alignment: int = ALLOCATOR_ALIGNMENT,
                 resident_heads: Mapping[str, int] | None = None,
                 prefetch_depth: int = 1) -> None:
        self.pipeline = pipeline
        self.prefetch_depth = prefetch_depth
        self.config = config
        self.alignment = alignment
        self.cls_name = type(pipeline).__name__
        self.warnings: list[str] = []
        plan = getattr(pipeline, "_offload_plan", None)
        if plan is not None and not isinstance(plan, OffloadPlan):
            raise TypeError(
                f"{self.cls_name}._offload_plan must be an offload_ref.OffloadPlan, got "
                f"{type(plan).__name__}"
            )
        self.plan = plan or OffloadPlan()
        # Plain layerwise's resident heads: the model's declaration, or auto's choice.
        self.heads: Mapping[str, int] = (self.plan.layerwise_resident_layers
                                         if resident_heads is None else resident_heads)
        self.head_source = ("OffloadPlan.layerwise_resident_layers" if resident_heads is None
                            else "the resident head strategy='auto' chose")

    @property
    def explicit(self) -> bool:
        return self.config.explicit

    def fail_or_warn(self, message: str) -> None:
        """Explicit selections turn declaration problems into errors; legacy ones warn."""
        if self.explicit:
            raise OffloadTopologyError(message)
        self.warnings.append(message)
        warnings.warn(message, OffloadDeclarationWarning, stacklevel=4)

    def resolve(self) -> ResolvedOffloadPlan:
        with span_facts():  # Note [Span facts] in host.py
            return self._resolve()

    def _resolve(self) -> ResolvedOffloadPlan:
        strategy = self.config.strategy
        if strategy is OffloadStrategy.NONE:
            return ResolvedOffloadPlan(strategy, skip_reason="offloading is disabled")
        if strategy is OffloadStrategy.MODEL_LEVEL and supports_model_cpu_offload(self.pipeline):
            self.validate_delegated()
            return ResolvedOffloadPlan(strategy, delegated=True, host_allocations=None)

        try:
            found = discover_components(self.pipeline, warn=self._warn_scan,
                                        check_acyclic=self.check_acyclic)
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        for role, path in found.missing:
            wanted = {"dit": "dit", "encoder": "text_encoder"}.get(role)
            message = (
                f"{self.cls_name}: declared {role} path {path!r} does not exist on the pipeline; "
                "fix the declaration in _" + role + "_modules"
            )
            if wanted is not None and self.config.selects(wanted):
                self.fail_or_warn(message)
            else:
                self.warnings.append(message)

        self.reject_unreadable_storage(found)
        self._check_plan_keys(found)  # before a strategy reads them: a typo would be ignored
        if strategy is OffloadStrategy.MODEL_LEVEL:
            components = self._model_level(found)
        else:
            components = self._layerwise(found)
        if isinstance(components, str):
            return ResolvedOffloadPlan(strategy, skip_reason=components,
                                       warnings=tuple(self.warnings))
        components = _with_nested(components)
        self._check_nesting(components)
        self.check_unique_ownership(components)
        if strategy is OffloadStrategy.MODEL_LEVEL:
            self.check_one_group_per_storage(components)
        components = _with_shared(self.pipeline, components)
        self._check_staging_budget(components)
        plan = ResolvedOffloadPlan(strategy, tuple(components), warnings=tuple(self.warnings),
                                   other_state_bytes=_other_state_bytes(
                                       self.pipeline, components, self.alignment),
                                   alignment=self.alignment,
                                   world_size=self.config.world_size)
        rings = _ring_tensors(plan)  # one walk of the streamed blocks for both predictions
        return dataclasses.replace(plan, device_bytes_bound=predict_device_bytes(plan, rings),
                                   host_allocations=host_allocations(plan, rings))

    def _check_staging_budget(self, components: list[ResolvedComponent]) -> None:
        """A staging budget must hold two slots of the largest block served from file pages
        (Note [Pinned staging] in backends/staging.py); refused here, before any mutation."""
        budget = self.config.staging_budget_bytes
        if budget is None or self.config.strategy is OffloadStrategy.MODEL_LEVEL:
            return
        from ..loading import is_file_backed

        largest = 0
        for c in components:
            for s in c.rings:
                if len(s.streamed_blocks) < 2 or s.transfer is not WeightTransfer.RANK_LOCAL:
                    continue
                for k in range(len(s.streamed_blocks)):
                    tensors = _streamed_tensors(s, k)
                    if any(t.numel() and is_file_backed(t) for t in tensors):
                        largest = max(largest, _span_bytes(tensors, self.alignment))
        if largest and budget < 2 * largest:
            raise OffloadTopologyError(f"{self.cls_name}: "
                                       f"{staging_budget_error(budget, largest)}")

    def check_acyclic(self, root: nn.Module, prefix: str = "") -> None:
        """Seam: the cycle check :func:`~offload_ref.discovery.discover_components` runs on the
        pipeline's module tree (or on each discovered component's, ``prefix`` its path and a
        dot) before anything walks it: raises :class:`~offload_ref.discovery.ModuleCycleError`
        naming the back edge (:func:`~offload_ref.discovery.require_acyclic`), which
        :meth:`resolve` reports as an OffloadTopologyError."""
        require_acyclic(root, prefix)

    def validate_delegated(self) -> None:
        """Seam.  A split model's own component groups walk its module tree and copy its
        tensors as any backend does: it gets the same input validation (a cycle, a sparse or
        unreadable tensor named with its path), before its enable_omni_model_cpu_offload
        mutates it."""
        try:
            found = discover_components(self.pipeline, warn=lambda message: None,
                                        check_acyclic=self.check_acyclic)
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        self.reject_unreadable_storage(found)

    def reject_unreadable_storage(self, found) -> None:
        """Seam (``found``: the :class:`~offload_ref.discovery.ComponentSet`).  Tensor
        subclasses without readable storage (DTensor, other wrapper subclasses) have no storage
        a host master could copy or a rebind could keep: reject them here, before anything is
        placed (the storage-key helpers would crash on them later).  Lazy (uninitialized) and
        non-strided (sparse) tensors likewise."""
        if isinstance(self.pipeline, nn.Module):
            roots = [("", self.pipeline)]
        else:
            roots = [(f"{path}.", module) for group in (found.dits, found.encoders, found.vaes,
                                                        found.residents)
                     for path, module in group]
        for prefix, root in roots:
            for name, t in named_tensors(root, ""):
                if isinstance(t, nn.parameter.UninitializedTensorMixin):
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} is uninitialized (a lazy "
                        f"module such as nn.LazyLinear that has not run yet): its size is not "
                        "known, so no host master or device slot can be planned.  Run one "
                        "forward of the pipeline (or of that module) before enabling offload"
                    )
                if t.layout is not torch.strided:
                    layout = str(t.layout)
                    kind = "sparse" if t.is_sparse or "sparse" in layout else "non-strided"
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} has layout {layout} "
                        f"({kind}); offload-ref offloads dense strided tensors only (a host "
                        "master is a flat copy of a strided storage).  Convert it with "
                        ".to_dense() before enabling offload, or keep it out of the module tree "
                        "(a plain attribute, not a parameter or buffer), where it stays where it "
                        "is (docs/model-authors.md)"
                    )
                if not _has_readable_storage(t):
                    raise OffloadTopologyError(
                        f"{self.cls_name}: tensor {prefix + name!r} is a {type(t).__name__}, a "
                        "tensor subclass whose storage cannot be read: a DTensor from FSDP/HSDP "
                        "or tensor parallelism (its local tensor is one rank's shard, not the "
                        "weight), or a wrapper subclass that does not name its inner tensors "
                        "(__tensor_flatten__ / __tensor_unflatten__, as torchao's tensors do); "
                        "offload-ref offloads plain tensors, and wrapper subclasses by their inner "
                        "tensors.  Materialize it before enabling offload (a DTensor: "
                        ".full_tensor() or .to_local()), give the subclass that protocol, or do "
                        "not combine offload with sharded parameters (docs/model-authors.md)"
                    )

    def _warn_scan(self, message: str) -> None:
        warnings.warn(message, OffloadDeclarationWarning, stacklevel=5)
        self.warnings.append(message)

    # -- model level ---------------------------------------------------------------------------

    def _model_level(self, found) -> list[ResolvedComponent] | str:
        wants_dit = self.config.selects("dit")
        wants_encoder = any(self.config.selects(kind) for kind in ENCODER_KINDS)
        if not found.dits:
            message = (
                f"{self.cls_name}: model-level offload requires a DiT/transformer module; declare "
                "it in _dit_modules (offload_ref.SupportsComponentDiscovery)"
            )
            if self.explicit:
                raise OffloadTopologyError(message)
            return "no DiT module found; model-level offload has nothing to swap"
        dits_swap_each_other = wants_dit and not wants_encoder and len(found.dits) > 1
        if not found.encoders and self.explicit and not dits_swap_each_other:
            raise OffloadTopologyError(
                f"{self.cls_name}: model-level offload requires an encoder execution stage to "
                "swap against; declare it in _encoder_modules (or select only 'dit' on a "
                "pipeline with at least two DiTs)"
            )
        comps = [ResolvedComponent(p, m, ComponentRole.DIT, wants_dit) for p, m in found.dits]
        for p, m in found.encoders:
            kind = self._encoder_kind(p)
            comps.append(ResolvedComponent(p, m, ComponentRole.ENCODER, self.config.selects(kind),
                                           kind=kind))
        comps += self.vae_components(found, on_demand=set())
        comps += [ResolvedComponent(p, m, ComponentRole.RESIDENT, False)
                  for p, m in found.residents]
        return comps

    # -- kinds and lifecycles ------------------------------------------------------------------

    def _encoder_kind(self, path: str) -> str:
        return encoder_kind(self.plan, path)

    def vae_components(self, found, on_demand: set[str]) -> list[ResolvedComponent]:
        """Seam: the VAE components of ``found`` (the
        :class:`~offload_ref.discovery.ComponentSet`).  Selecting ``"vae"`` hands every VAE to
        the lifecycle its pipeline declares; a VAE that is not selected stays on the device (or,
        listed in ``on_demand``, the pipeline's)."""
        selected = self.config.selects("vae")
        if selected and not found.vaes:
            raise OffloadTopologyError(
                f"{self.cls_name}: No VAE modules found for the 'vae' selection; declare them in "
                "_vae_modules (offload_ref.SupportsComponentDiscovery) or drop 'vae' from "
                "components"
            )
        comps = []
        for path, module in found.vaes:
            if selected:
                if path not in self.plan.on_demand_component_paths:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: selected VAE {path!r} requires a pipeline-managed "
                        f"lifecycle: list {path!r} in OffloadPlan.on_demand_component_paths and "
                        f"implement load_to_device() and offload_to_cpu() on "
                        f"{type(module).__name__}, or drop 'vae' from components"
                    )
                self._require_lifecycle(path, module)
                comps.append(ResolvedComponent(path, module, ComponentRole.VAE, True, True))
                continue
            staged = path in on_demand
            if staged:
                self._require_lifecycle(path, module)
            comps.append(ResolvedComponent(path, module, ComponentRole.VAE, False, staged))
        return comps

    # -- layerwise -----------------------------------------------------------------------------

    def _layerwise(self, found) -> list[ResolvedComponent] | str:
        wants_dit = self.config.selects("dit")
        wants_encoder = any(self.config.selects(kind) for kind in ENCODER_KINDS)
        if not found.dits:
            if wants_dit and self.explicit:
                raise OffloadTopologyError(
                    f"{self.cls_name}: No DiT/transformer modules found for layerwise offload; "
                    "declare them in _dit_modules (offload_ref.SupportsComponentDiscovery)"
                )
            if not wants_encoder or not self.explicit:
                return "no DiT module found; layerwise offload is a no-op for this pipeline"
        if wants_encoder and self.explicit and not found.encoders:
            raise OffloadTopologyError(
                f"{self.cls_name}: component 'text_encoder' is selected but no text encoder "
                "modules were found; declare them in _encoder_modules "
                "(offload_ref.SupportsComponentDiscovery) or drop 'text_encoder' from components"
            )
        on_demand = set(self.plan.on_demand_component_paths)
        comps: list[ResolvedComponent] = []
        for path, module in found.dits:
            rings: list[RingPlan] = []
            if wants_dit:
                rings = self._dit_rings(path, module)
            comps.append(ResolvedComponent(path, module, ComponentRole.DIT, bool(rings), False,
                                           tuple(rings)))
        for path, module in found.encoders:
            # A pipeline-managed encoder is left to the pipeline whether or not it is selected
            # (as a VAE is): the backend never places it, but streams its declared rings.
            rings, staged = [], path in on_demand
            if staged:
                self._require_lifecycle(path, module)
            kind = self._encoder_kind(path)
            selected = self.config.selects(kind)
            if selected:
                rings = self._encoder_rings(path, module, kind)
                if staged and not rings and self._transfer(kind) is \
                        WeightTransfer.ALLGATHER and self.config.world_size > 1:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: on-demand encoder {path!r} cannot use AllGather "
                        "without a model-declared streamable block plan; declare "
                        "OffloadPlan.encoder_block_attrs or use weight_transfer='rank-local'"
                    )
                if not rings and not staged:
                    self.fail_or_warn(
                        f"{self.cls_name}: selected {kind.replace('_', ' ')} {path!r} requires a "
                        "model-declared streamable or on-demand plan; declare "
                        f"OffloadPlan(encoder_block_attrs={{{path!r}: (<container>,)}}) or list "
                        "it in OffloadPlan.on_demand_component_paths"
                    )
            comps.append(ResolvedComponent(path, module, ComponentRole.ENCODER,
                                           bool(rings) or (staged and selected),
                                           staged, tuple(rings), kind))
        comps += self.vae_components(found, on_demand)
        for path, module in found.residents:
            comps.append(ResolvedComponent(path, module, ComponentRole.RESIDENT, False))
        for path, container in self.plan.offload_submodules.items():
            comps.append(self._submodule(path, container))
        if not self.explicit and not any(c.selected for c in comps):
            return ("nothing to stream: no selected component has a streamable block plan "
                    f"({'; '.join(self.warnings) or 'see the declarations'})")
        if self.explicit and not any(c.selected for c in comps):
            raise OffloadTopologyError(
                f"{self.cls_name}: none of the selected components {list(self.config.components)} "
                "has a model-declared streamable or on-demand plan"
            )
        return comps

    def _transfer(self, component: str) -> WeightTransfer:
        if self.config.strategy is not OffloadStrategy.DISTRIBUTED_LAYER_WISE:
            return WeightTransfer.RANK_LOCAL
        return self.config.options_for(component).weight_transfer

    def _require_lifecycle(self, path: str, module: nn.Module) -> None:
        missing = [
            name for name in ("load_to_device", "offload_to_cpu")
            if not callable(getattr(module, name, None))
        ]
        if missing:
            raise OffloadTopologyError(
                f"{self.cls_name}: on-demand component {path!r} ({type(module).__name__}) must "
                f"implement load_to_device() and offload_to_cpu(); missing: {missing}"
            )

    def container_names(self, path: str, module: nn.Module) -> tuple[tuple[str, ...], str]:
        """Seam: the attribute names of the block containers of the DiT ``module`` at ``path``,
        and the declaration they come from (for messages); ``((), "")`` when it declares none.
        ``OffloadPlan.block_attrs`` wins over the class's ``_layerwise_offload_blocks_attrs``."""
        if path in self.plan.block_attrs:
            return tuple(self.plan.block_attrs[path]), f"OffloadPlan.block_attrs[{path!r}]"
        names = getattr(module, "_layerwise_offload_blocks_attrs", None)
        if names is None:
            single = getattr(module, "_layerwise_offload_blocks_attr", None)
            names = None if single is None else [single]
        if names is None:
            return (), ""
        if isinstance(names, str):
            names = [names]
        return tuple(names), f"{type(module).__name__}._layerwise_offload_blocks_attrs"

    def _blocks_of(
        self, owner_path: str, owner: nn.Module, names: Iterable[str], source: str
    ) -> tuple[list[nn.Module], list[str], list[str]]:
        blocks, block_paths, container_paths = [], [], []
        for name in names:
            container = get_submodule_path(owner, name)
            full = f"{owner_path}.{name}"
            if container is _MISSING or container is None:
                raise OffloadTopologyError(
                    f"{self.cls_name}: container {full!r} declared in {source} does not exist on "
                    f"{type(owner).__name__}; fix the declaration or add the attribute"
                )
            container_paths.append(full)
            if isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                entries = (container.items() if isinstance(container, nn.ModuleDict)
                           else enumerate(container))
                for key, block in _stage_blocks(list(entries)):
                    blocks.append(block)
                    block_paths.append(f"{full}.{key}")
            elif isinstance(container, nn.Module):
                blocks.append(container)  # a single module is one block
                block_paths.append(full)
            else:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {full!r} declared in {source} is a "
                    f"{type(container).__name__}, not a module container; point it at an "
                    "nn.ModuleList of blocks"
                )
        return blocks, block_paths, container_paths

    def _dit_rings(self, path: str, module: nn.Module) -> list[RingPlan]:
        names, source = self.container_names(path, module)
        if not names:
            self.fail_or_warn(
                f"{self.cls_name}: DiT {path!r} ({type(module).__name__}) has no streamable "
                "layerwise-offload blocks; declare _layerwise_offload_blocks_attrs on "
                f"{type(module).__name__} or OffloadPlan(block_attrs={{{path!r}: (...)}})"
            )
            return []
        blocks, block_paths, container_paths = self._blocks_of(path, module, names, source)
        head, kept = 0, ()
        options = self.config.options_for("dit")
        strategy = self.config.strategy
        if strategy is OffloadStrategy.LAYER_WISE and self.heads.get(path, 0):
            head, kept = self._resident_blocks(path, len(blocks))
        if strategy is OffloadStrategy.DISTRIBUTED_LAYER_WISE and options.resident_layers:
            if path not in self.plan.resident_dit_paths:
                self.fail_or_warn(
                    f"{self.cls_name}: resident_layers={options.resident_layers} needs DiT "
                    f"{path!r} in OffloadPlan.resident_dit_paths"
                )
            else:
                head = min(options.resident_layers, len(blocks))
                if len(blocks) - head == 1:
                    if self.explicit:
                        raise OffloadTopologyError(
                            f"{self.cls_name}: DiT {path!r} has {len(blocks)} blocks; "
                            f"resident_layers={options.resident_layers} leaves only one streaming "
                            "block; lower resident_layers or keep every block resident"
                        )
                    head = len(blocks)
        streaming = len(blocks) - head
        if streaming == 0 and head:
            pass  # every block resident: nothing streams, nothing to check
        elif streaming < 2:
            self.fail_or_warn(
                f"{self.cls_name}: layerwise offload requires at least two blocks; DiT {path!r} "
                f"has {len(blocks)} in {list(container_paths)} ({source})"
            )
            return []
        return [self._ring_plan(path, module, container_paths, blocks, block_paths, head,
                            self._transfer("dit"), kept)]

    def _encoder_rings(self, path: str, module: nn.Module, kind: str) -> list[RingPlan]:
        names = self.plan.encoder_block_attrs.get(path)
        if not names:
            return []
        transfer = self._transfer(kind)
        if transfer is WeightTransfer.ALLGATHER and self.config.world_size > 1 and \
                path not in self.plan.encoder_dlo_weight_replication:
            raise OffloadTopologyError(
                f"{self.cls_name}: encoder {path!r} with weight_transfer='allgather' needs its "
                "loaded weights declared identical on every rank: add it to "
                "OffloadPlan.encoder_dlo_weight_replication, or use weight_transfer='rank-local'"
            )
        rings = []
        source = f"OffloadPlan.encoder_block_attrs[{path!r}]"
        for name in names:  # each declared encoder container streams as its own ring
            blocks, block_paths, container_paths = self._blocks_of(path, module, [name], source)
            if len(blocks) < 2:
                self.fail_or_warn(
                    f"{self.cls_name}: {container_paths[0]!r} declared in {source} is not a "
                    f"streamable block list (it has {len(blocks)} block)"
                )
                continue
            rings.append(self._ring_plan(path, module, container_paths, blocks, block_paths, 0,
                                      transfer))
        return rings

    def _submodule(self, path: str, container: str) -> ResolvedComponent:
        module = get_submodule_path(self.pipeline, path)
        if not isinstance(module, nn.Module):
            raise OffloadTopologyError(
                f"{self.cls_name}: OffloadPlan.offload_submodules names {path!r}, which is not a "
                "module of the pipeline"
            )
        try:
            require_acyclic(module, f"{path}.")
        except ModuleCycleError as exc:
            raise OffloadTopologyError(f"{self.cls_name}: {exc}") from None
        target = get_submodule_path(module, container)
        if isinstance(target, (nn.ModuleList, nn.Sequential)) and len(target) >= 2:
            blocks, block_paths, container_paths = self._blocks_of(
                path, module, [container], f"OffloadPlan.offload_submodules[{path!r}]")
            ring = self._ring_plan(path, module, container_paths, blocks, block_paths, 0,
                                self._transfer("dit"))
            return ResolvedComponent(path, module, ComponentRole.DIT, True, False, (ring,))
        self.warnings.append(
            f"{self.cls_name}: {path}.{container} is not a streamable block list; {path!r} is "
            "treated as an on-demand component"
        )
        self._require_lifecycle(path, module)
        return ResolvedComponent(path, module, ComponentRole.DIT, True, True)

    def _ring_plan(self, owner_path, owner, container_paths, blocks, block_paths, head, transfer,
               kept=()):
        aliases = _ring_aliases(owner_path, owner, blocks, block_paths)
        return RingPlan(owner_path, tuple(container_paths), tuple(blocks), tuple(block_paths),
                        head, transfer, aliases, prefetch_depth=self.prefetch_depth,
                        resident_blocks=kept)

    # Note [Resident blocks]
    #     Plain layerwise keeps some blocks of a DiT on the device, placed once at enable and
    #     never hooked; the ring streams the others, in order, wrapping around, and prefetches
    #     only them.  ``OffloadPlan.layerwise_resident_layers[path]`` says which: a count r, or a
    #     tuple of block indices (exactly those).  For a count, ``layerwise_resident_policy``
    #     says where: ``"leading"`` (blocks 0..r-1, a resident head, the default) or
    #     ``"strided"`` (blocks floor(i * n / r + 1/2), i < r, spread through the ring: while a
    #     resident block computes, the copy of the next streamed block runs beside it, where a
    #     leading head leaves the copy engine idle).  At least two blocks stream.  A set that is
    #     the leading blocks is stored as ``RingPlan.resident_head``; any other as
    #     ``RingPlan.resident_blocks``.  ``strategy="auto"`` keeps a leading head (Note [Auto
    #     mode] in plan/auto.py).

    def _resident_blocks(self, path: str, n: int) -> tuple[int, tuple[int, ...]]:
        """(resident head, other resident indices) of DiT ``path`` with ``n`` blocks."""
        value = self.heads[path]
        policy = self.plan.layerwise_resident_policy.get(path, "leading")
        where = f"{self.head_source}[{path!r}] = {value!r}"
        if isinstance(value, tuple):
            out = [i for i in value if i >= n]
            if out:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {where} names block(s) {out} of DiT {path!r}, which has "
                    f"{n} blocks (indices 0..{n - 1})")
            kept = value
        elif policy == "strided":
            kept = tuple(sorted({int(i * n / value + 0.5) for i in range(value)}))
        else:
            kept = tuple(range(value))
        if n - len(kept) < 2:
            raise OffloadTopologyError(
                f"{self.cls_name}: {where} leaves {max(n - len(kept), 0)} of the {n} blocks of "
                f"DiT {path!r} streaming; layerwise offload streams at least two; keep at most "
                f"{max(n - 2, 0)} resident")
        if kept == tuple(range(len(kept))):
            return len(kept), ()
        return 0, kept

    # -- declarations and nesting --------------------------------------------------------------

    def _check_plan_keys(self, found) -> None:
        """Every path an :class:`OffloadPlan` field keys on names a discovered component of the
        field's role: a key that names nothing would be ignored, so what it asks for (a ring, a
        resident head, AllGather) would silently not happen.  Keys naming a declared path that
        does not exist were already reported (with the declaration to fix)."""
        missing = {path for _, path in found.missing}
        dits = [p for p, _ in found.dits]
        encoders = [p for p, _ in found.encoders]
        fields = (("block_attrs", self.plan.block_attrs, "DiT", dits, "_dit_modules"),
                  ("resident_dit_paths", self.plan.resident_dit_paths, "DiT", dits,
                   "_dit_modules"),
                  ("encoder_block_attrs", self.plan.encoder_block_attrs, "encoder", encoders,
                   "_encoder_modules"),
                  ("encoder_dlo_weight_replication", self.plan.encoder_dlo_weight_replication,
                   "encoder", encoders, "_encoder_modules"))
        other = {"DiT": ("encoder", encoders), "encoder": ("DiT", dits)}
        # A resident head is new: a key naming no DiT is refused under every config.
        for name in ("layerwise_resident_layers", "layerwise_resident_policy"):
            for key in getattr(self.plan, name):
                if key not in dits and key not in missing:
                    close = difflib.get_close_matches(key, dits, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise OffloadTopologyError(
                        f"{self.cls_name}: OffloadPlan.{name} names {key!r}, which is no DiT "
                        f"of the pipeline; discovered DiTs: {dits}{hint}.  Fix the key, or "
                        f"declare {key!r} in _dit_modules"
                    )
        for name, keys, role, paths, declaration in fields:
            if not paths:
                continue  # no component of the role at all: the strategy reports that (legacy
                # configs record a no-op), with the declaration to fix
            for key in keys:
                if key in paths or key in missing:
                    continue
                close = difflib.get_close_matches(key, paths, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                if key in other[role][1]:
                    hint = f" ({key!r} is an {other[role][0]}, not a {role})"
                self.fail_or_warn(
                    f"{self.cls_name}: OffloadPlan.{name} names {key!r}, which is no {role} of "
                    f"the pipeline; discovered {role}s: {paths}{hint}.  Fix the key, or declare "
                    f"{key!r} in {declaration}"
                )

    def _check_nesting(self, components: list[ResolvedComponent]) -> None:
        """A component inside another component's module tree keeps a residency of its own only
        as a declared resident (or as a part of the same role: a DiT submodule of a DiT).  An
        encoder inside a DiT (or a DiT inside an encoder, or a VAE inside either) would be
        swapped out while the module around it runs, or the other way round: reject it here,
        so what ``plan`` shows is what ``enable`` does."""
        by_path = {c.path: c for c in components}
        for outer in components:
            for path in outer.nested:
                inner = by_path[path]
                if inner.role in (ComponentRole.RESIDENT, outer.role):
                    continue
                raise OffloadTopologyError(
                    f"{self.cls_name}: {_ROLE_WORD[inner.role]} {inner.path!r} lies inside the "
                    f"{_ROLE_WORD[outer.role]} {outer.path!r} (one module tree); a component "
                    f"nested in a component of another role must be declared in "
                    f"_resident_modules (it then stays on the "
                    f"device), or drop {inner.path!r} from _{inner.role}_modules (it then "
                    f"follows {outer.path!r}); or move the module out of {outer.path!r}"
                )

    # -- ownership -----------------------------------------------------------------------------

    def check_unique_ownership(self, components: list[ResolvedComponent]) -> None:
        """Seam.  A block belongs to one ring.  (Submodules or tensors shared between blocks are
        handled by storage, see Note [Ownership by identity] in plan/ownership.py: a stateless
        module such as one GELU reused by every block is harmless.)"""
        owners: dict[int, str] = {}
        for comp in components:
            for ring in comp.rings:
                for block, bpath in zip(ring.blocks, ring.block_paths):
                    other = owners.get(id(block))
                    if other is not None and other != bpath:
                        raise OffloadTopologyError(
                            f"{self.cls_name}: block {bpath!r} is claimed by both {other!r} and "
                            f"{bpath!r}; a block may belong to one ring only"
                        )
                    owners[id(block)] = bpath
        # A streamed block must not also be a whole component of another role, nor contain one:
        # a block streams whole, so nothing inside it can keep a residency of its own.
        inside: dict[int, str] = {}  # id of a module strictly inside a streamed block -> block
        for comp in components:
            for ring in comp.rings:
                for block, bpath in zip(ring.streamed_blocks, ring.streamed_paths):
                    for sub in block.modules():
                        if sub is not block:
                            inside.setdefault(id(sub), bpath)
        for comp in components:
            if id(comp.module) in owners and not comp.rings:
                raise OffloadTopologyError(
                    f"{self.cls_name}: component {comp.path!r} is claimed by both its own "
                    f"declaration and the ring block {owners[id(comp.module)]!r}"
                )
            if id(comp.module) in inside:
                raise OffloadTopologyError(
                    f"{self.cls_name}: {comp.role} {comp.path!r} lies inside the streamed block "
                    f"{inside[id(comp.module)]!r}; a block streams whole, so nothing inside it "
                    f"can stay {'resident' if comp.role == 'resident' else 'its own component'}: "
                    f"drop {comp.path!r} from _{comp.role}_modules (it then streams with its "
                    "block), or move it out of the block container"
                )

    def check_one_group_per_storage(self, components: list[ResolvedComponent]) -> None:
        """Seam (model level only).  Model level moves each swap group (one DiT, one encoder)
        on its own and keeps the rest on the device (or leaves it to the pipeline): a storage
        reachable from two groups would need two masters, or two device copies that drift
        apart."""
        plan = ResolvedOffloadPlan(self.config.strategy, tuple(components))
        claimed: dict[tuple, tuple[str, str]] = {}  # storage -> (tensor path, group)
        resident = "the resident state (kept on the device)"

        def claim(group: str, named: Iterable[tuple[str, torch.Tensor]]) -> None:
            for name, t in named:
                if t is None or not t.numel():
                    continue
                other = claimed.setdefault(_storage_key(t), (name, group))
                if other[1] != group:
                    raise OffloadTopologyError(
                        f"{self.cls_name}: {name} (in {group}) shares storage with {other[0]} "
                        f"(in {other[1]}); a tensor can belong to one offload group only, and "
                        "model-level offload moves these groups separately: untie the tensors, "
                        "or declare both parts as one component"
                    )

        for comp in components:
            if comp.on_demand:
                group = f"pipeline-managed {comp.path!r}"
            elif comp.selected and comp.role in (ComponentRole.DIT, ComponentRole.ENCODER):
                group = f"swap group {comp.path!r}"
            else:
                group = resident
            claim(group, owned_tensors(plan, comp))
        claim(resident, pipeline_state(self.pipeline, [c.module for c in components]))


_ROLE_WORD = {ComponentRole.DIT: "DiT", ComponentRole.ENCODER: "encoder", ComponentRole.VAE: "VAE",
              ComponentRole.RESIDENT: "resident"}


# Note [Pipeline-parallel stages]
#     Under pipeline parallelism a DiT's block list keeps its full length on every stage, and
#     the blocks of other stages are placeholders: modules that hold no parameter and no buffer
#     (vLLM's ``PPMissingLayer`` is an ``nn.Identity``), which the stage's forward never calls
#     (it runs ``blocks[start_layer:end_layer]``).  A ring over the whole list would hold them
#     as blocks: the call-order predictor would first guess a placeholder after the stage's
#     last block, and the first block of every later pass would be loaded synchronously until
#     it learned the order (vLLM-Omni's static ring never learned it: PR #6456).  So the
#     resolver leaves placeholders out of the ring: a declared container that holds at least
#     one block with tensors streams only the blocks with tensors, under their own paths
#     (``blocks.4``: indices are those of the list), and the ring wraps around the stage's own
#     slice from the first pass.  When the DiT's ``start_layer``/``end_layer`` cover exactly the
#     blocks with tensors, that slice is the same set; when they do not (attributes of another
#     meaning, a second container), they slice nothing.  Each container is judged on its own.
#     Resident block counts and indices (``layerwise_resident_layers``) count the ring's blocks.
#     A container whose blocks all hold no tensor is left as it is.


def _stage_blocks(entries: list[tuple[Any, nn.Module]]) -> list[tuple[Any, nn.Module]]:
    """The entries of a declared block container that stream (Note [Pipeline-parallel
    stages]): every entry, unless some hold tensors, then those only."""
    def holds_tensors(block: nn.Module) -> bool:
        return any(t is not None for m in _subtree(block)
                   for t in (*m._parameters.values(), *m._buffers.values()))

    kept = [(key, block) for key, block in entries if holds_tensors(block)]
    return kept if kept else entries


def _with_nested(components: list[ResolvedComponent]) -> list[ResolvedComponent]:
    """Record, per component, the other components inside its module tree (by identity)."""
    out = []
    for comp in components:
        subs = {id(m) for m in comp.module.modules()}
        nested = tuple(c.path for c in components
                       if c.module is not comp.module and id(c.module) in subs)
        out.append(dataclasses.replace(comp, nested=nested) if nested else comp)
    return out
