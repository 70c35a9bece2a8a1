"""``strategy="auto"``: the strategies it weighs for a budget, each with its predicted peak
device bytes, the resident heads of the chosen layer strategy, and the choice.

Note [Auto mode]
    ``strategy="auto"`` weighs, coarsest first: none (every weight resident), model level (every
    selectable component swaps), layerwise (the DiTs stream), layerwise with encoder rings
    (every encoder kind with declared blocks streams too).  Each is resolved purely, as an
    explicit config, and its predicted peak device bytes (``predict_device_bytes``, which
    equals the measured ``stats().peak_device_bytes``) is compared with the budget; the first
    that fits is the plan.  A strategy that cannot serve the pipeline (no encoder, no blocks)
    or whose peak cannot be predicted (model level delegated to a split model) is skipped,
    with its reason.
    Nothing fitting is an OffloadTopologyError before any mutation.  Layer strategies are
    weighed without a resident head; when one is chosen, the budget left between its peak and
    the next coarser strategy's is filled with the largest resident head whose predicted peak
    fits (``head_candidates``: k leading blocks of every DiT ring, at least two still
    streaming).  The prediction is not monotone in k (moving the largest block into the head
    shrinks both slots), so every k is weighed, not searched.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config import OffloadConfig, OffloadStrategy
from ..discovery import discover_components, get_submodule_path
from ..host import ALLOCATOR_ALIGNMENT
from .declarations import OffloadPlan, OffloadTopologyError, selectable_components
from .prediction import _span_bytes
from .resolved import AutoCandidate, AutoChoice, ResolvedOffloadPlan
from .resolver import Resolver
from .tree import named_tensors, pipeline_state


def resident_plan(pipeline: Any, *, alignment: int = ALLOCATOR_ALIGNMENT) -> ResolvedOffloadPlan:
    """The "none" candidate of auto mode: every tensor of the pipeline resident on the device,
    except the components the pipeline manages itself (``on_demand_component_paths``).  Pure."""
    plan = getattr(pipeline, "_offload_plan", None)
    managed = []
    if isinstance(plan, OffloadPlan):
        for path in plan.on_demand_component_paths:
            module = get_submodule_path(pipeline, path)
            if isinstance(module, nn.Module):
                managed.append(module)
    named = resident_state(pipeline, managed)
    total = _span_bytes((t for _, t in named), alignment)
    return ResolvedOffloadPlan(OffloadStrategy.NONE, other_state_bytes=total,
                               device_bytes_bound=total, alignment=alignment)


def resident_state(pipeline: Any,
                   managed: Iterable[nn.Module] = ()) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``pipeline`` outside ``managed``: its state (:func:`pipeline_state`) and
    the discovered components' (a plain-object pipeline may reach one through a non-module)."""
    managed = list(managed)
    named = pipeline_state(pipeline, managed)
    seen = {id(t) for _, t in named}
    excluded = {id(m) for root in managed for m in root.modules()}
    found = discover_components(pipeline, warn=lambda message: None)
    for group in (found.dits, found.encoders, found.vaes, found.residents):
        for path, module in group:
            if id(module) in excluded:
                continue
            for name, t in named_tensors(module, path):
                if id(t) not in seen:
                    seen.add(id(t))
                    named.append((name, t))
    return named


def auto_candidates(pipeline: Any, config: OffloadConfig | None = None, *,
                    alignment: int = ALLOCATOR_ALIGNMENT) -> list[AutoCandidate]:
    """The strategies ``strategy="auto"`` weighs for ``pipeline``, coarsest first, each with its
    predicted peak device bytes or the reason it cannot serve the pipeline (Note [Auto mode]).
    ``config`` (an auto config) lends its ``pin_memory``.  Pure."""
    pin = config.pin_memory if config is not None else True
    cands = [AutoCandidate("none", OffloadConfig(pin_memory=pin),
                           resident_plan(pipeline, alignment=alignment).predicted_device_bytes())]
    layer_all = selectable_components(pipeline, OffloadStrategy.LAYER_WISE)
    configs = [("model_level", OffloadStrategy.MODEL_LEVEL,
                selectable_components(pipeline, OffloadStrategy.MODEL_LEVEL)),
               ("layer_wise", OffloadStrategy.LAYER_WISE, ("dit",))]
    if layer_all != ("dit",):
        configs.append(("layer_wise+encoders", OffloadStrategy.LAYER_WISE, layer_all))
    staging = {} if config is None else {"staging_slots": config.staging_slots,
                                         "staging_budget_bytes": config.staging_budget_bytes}
    for name, strategy, components in configs:
        cfg = OffloadConfig(strategy=strategy, components=components, pin_memory=pin,
                            **(staging if strategy is OffloadStrategy.LAYER_WISE else {}))
        # Layer candidates are weighed without a head; the chosen one then fills the budget
        # with the largest head that fits (head_candidates).
        heads = () if strategy is OffloadStrategy.LAYER_WISE else None
        try:
            with warnings.catch_warnings():  # the chosen plan warns when it is enabled
                warnings.simplefilter("ignore")
                plan = Resolver(pipeline, cfg, alignment,
                                None if heads is None else {}).resolve()
        except OffloadTopologyError as exc:
            cands.append(AutoCandidate(name, cfg, None, str(exc)))
            continue
        if plan.delegated:
            cands.append(AutoCandidate(name, cfg, None, "delegated to the pipeline's "
                                       "enable_omni_model_cpu_offload, whose peak the plan "
                                       "cannot predict"))
        elif plan.skip_reason is not None:
            cands.append(AutoCandidate(name, cfg, None, plan.skip_reason))
        else:
            cands.append(AutoCandidate(name, cfg, plan.predicted_device_bytes(), heads=heads))
    return cands


def head_candidates(pipeline: Any, candidate: AutoCandidate, *,
                    alignment: int = ALLOCATOR_ALIGNMENT) -> list[AutoCandidate]:
    """A layer candidate with each resident head auto may keep: k = 0, 1, ... leading blocks of
    every DiT ring (capped per ring so that two blocks still stream), each with its predicted
    peak (Note [Auto mode]).  Empty for a candidate that is not plain layerwise or streams no
    DiT ring.  Pure."""
    if candidate.predicted is None or candidate.config.strategy is not OffloadStrategy.LAYER_WISE:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resolver = Resolver(pipeline, candidate.config, alignment, {})
        base = resolver.resolve()
        # A DiT's own ring (a submodule that owns its residency keeps none: offload_submodules)
        rings = {c.path: len(s.blocks) for c in base.dits for s in c.rings
                 if len(s.streamed_blocks) >= 2 and c.path not in resolver.plan.offload_submodules}
        if not rings:
            return []
        out = []
        for k in range(max(rings.values()) - 1):
            heads = tuple((path, min(k, n - 2)) for path, n in rings.items())
            plan = base if not k else Resolver(pipeline, candidate.config, alignment,
                                               dict(heads)).resolve()
            out.append(dataclasses.replace(candidate, predicted=plan.predicted_device_bytes(),
                                           heads=heads))
    return out


def choose_auto(candidates: Iterable[AutoCandidate], budget: int) -> AutoCandidate:
    """The first (coarsest) candidate whose prediction fits ``budget``; an
    OffloadTopologyError naming the smallest achievable peak when none does."""
    candidates = list(candidates)
    for c in candidates:
        if c.predicted is not None and c.predicted <= budget:
            return c
    feasible = [c for c in candidates if c.predicted is not None]
    if not feasible:  # "none" always has a prediction; kept for a mutated candidate list
        raise OffloadTopologyError(f"strategy='auto': no strategy can serve this pipeline: "
                                   f"{'; '.join(f'{c.name}: {c.reason}' for c in candidates)}")
    best = min(feasible, key=lambda c: c.predicted)
    weighed = "; ".join(f"{c.name} {c.predicted}" if c.predicted is not None
                        else f"{c.name} not achievable" for c in candidates)
    layerwise = next((c for c in candidates if c.name == "layer_wise"), None)
    if best.name in ("none", "model_level") and (layerwise is None or layerwise.predicted is None):
        fix = ("raise the budget, or declare the DiT's blocks (_layerwise_offload_blocks_attrs "
               "or OffloadPlan.block_attrs) so layerwise can stream them")
    elif best.name in ("none", "model_level"):  # layerwise resolves, and needs more here
        fix = (f"raise the budget: layerwise already streams the DiT's blocks and predicts "
               f"{layerwise.predicted} bytes, more than {best.name}'s {best.predicted} (its "
               f"slots and the DiT's non-block state outweigh what {best.name} keeps)")
    elif best.name == "layer_wise":
        fix = ("raise the budget, or declare the encoders' blocks "
               "(OffloadPlan.encoder_block_attrs) so layerwise streams them too")
    else:
        fix = "raise the budget (layerwise with encoder rings is the finest strategy)"
    raise OffloadTopologyError(
        f"strategy='auto': no strategy fits device_budget_bytes={budget}; the smallest "
        f"achievable predicted peak is {best.predicted} bytes ({best.label()}); predicted "
        f"peaks: {weighed}.  Fix: {fix}"
    )


def _resolve_auto(pipeline: Any, config: OffloadConfig, alignment: int) -> ResolvedOffloadPlan:
    budget = config.device_budget_bytes
    assert budget is not None  # OffloadConfig requires it with strategy="auto"
    candidates = auto_candidates(pipeline, config, alignment=alignment)
    chosen = choose_auto(candidates, budget)
    choice = AutoChoice(budget, chosen.name, tuple(candidates),
                        tuple(head_candidates(pipeline, chosen, alignment=alignment)))
    return dataclasses.replace(resolve_candidate(pipeline, choice.picked, alignment=alignment),
                               auto=choice)


def resolve_candidate(pipeline: Any, candidate: AutoCandidate, *,
                      alignment: int = ALLOCATOR_ALIGNMENT) -> ResolvedOffloadPlan:
    """The plan of one auto candidate (the resident plan for "none"), with its resident head."""
    if candidate.name == "none":
        return resident_plan(pipeline, alignment=alignment)
    return Resolver(pipeline, candidate.config, alignment, candidate.resident_heads).resolve()
