"""Catalogue §D: tied aliases, shared parameters and views that share storage."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload_ref.discovery import get_submodule_path

from ..case import move_to_device
from ..registry import check, fail
from ..observe import observe
from ..facts import (
    named_module_tensors,
    first_dit,
    module_tensors,
    module_view,
    resident,
    snapshot,
    storage_groups,
    storage_key,
    values_equal,
)
from .lifecycle import SINGLE_PROCESS
from .residency import LAYER_BACKENDS, rings_of


def _add_kit_alias(case: Any, pipeline: Any) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Register on the DiT a buffer viewing a tensor of the last streamed block; return its
    path, the buffer and the block tensor."""
    path, dit = first_dit(pipeline)
    stack = [s for s in rings_of(case, pipeline) if s.owner_path == path][0]
    block = stack.streamed_blocks[-1]
    # a tensor with storage to view: a wrapper subclass's inner tensor, not the wrapper (its
    # view would be a plain tensor of its dequantized value: Note [Wrapper subclasses])
    target = next(t for _, t in module_tensors(block) if t.numel() > 1)
    dit.register_buffer("_kit_alias", target.data.view(-1)[1:], persistent=False)
    return f"{path}._kit_alias", dit._kit_alias, target


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return storage_key(a) == storage_key(b)


@check("D.1", strategies=LAYER_BACKENDS)
def check_block_alias_follows_its_block(case) -> None:
    """A DiT tensor aliasing a streamed block's tensor keeps sharing that block's storage while
    the block runs (correct values) and while it is offloaded (never a separate device copy),
    and is identical after disable."""
    pipeline = case.build()
    alias_path, alias, target = _add_kit_alias(case, pipeline)
    expected = alias.detach().clone()
    plan_aliases = [a.path for s in case.resolve(pipeline).rings for a in s.aliases]
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    problems: list[str] = []
    aliases = [(p, get_submodule_path(pipeline, p)) for p in plan_aliases]

    def check_now(moment: str) -> None:
        for p, t in aliases:
            if not isinstance(t, torch.Tensor):
                continue
            owner = target if p == alias_path else None
            if owner is not None and not _same_storage(t, owner):
                problems.append(f"{moment}: {p} no longer shares storage with its block tensor")
        if resident(platform, alias) and not resident(platform, target):
            problems.append(f"{moment}: {alias_path} is on the device while its block is not")

    check_now("after enable")
    block = [s for s in rings_of(case, pipeline) if s.owner_path == alias_path.rsplit(".", 1)[0]]
    blocks = [(s.block_paths[-1], s.streamed_blocks[-1]) for s in block]

    def before(path: str, module: nn.Module) -> None:
        check_now(f"while {path} runs")
        if not values_equal(alias.detach(), expected):
            problems.append(f"while {path} runs: {alias_path} has wrong values")

    with observe(blocks, before) as calls:
        case.run(pipeline)
    check_now("between passes")
    backend.disable()
    if not calls:
        fail("the aliased block never ran")
    if not _same_storage(alias, target) or not values_equal(alias, expected):
        problems.append(f"after disable {alias_path} lost its storage sharing or its values")
    if problems:
        fail(sorted(set(problems))[0])


def _tie_candidates(case: Any, pipeline: Any) -> tuple[Any, str, str] | None:
    return tie_candidate_in(rings_of(case, pipeline))


def tie_candidate_in(rings: list[Any]) -> tuple[Any, str, str] | None:
    """The first ring whose second streamed block holds a parameter with a twin (same name,
    shape and dtype, another tensor) in its first: (ring, parameter name, its path in the
    second block); None when no ring has one."""
    for stack in rings:
        blocks = stack.streamed_blocks
        first = dict(blocks[0].named_parameters())
        for name, p in blocks[1].named_parameters():
            q = first.get(name)
            if q is not None and q is not p and q.shape == p.shape and q.dtype == p.dtype:
                return stack, name, f"{stack.streamed_paths[1]}.{name}"
    return None


def _tie(stack: Any, name: str) -> None:
    owner_path, _, leaf = name.rpartition(".")
    shared = stack.streamed_blocks[0].get_parameter(name)
    module = stack.streamed_blocks[1].get_submodule(owner_path) if owner_path else \
        stack.streamed_blocks[1]
    setattr(module, leaf, shared)


@check("D.2", strategies=LAYER_BACKENDS, requires=("tie_candidate",))
def check_parameter_shared_by_two_blocks_is_never_copied_twice(case) -> None:
    """A Parameter shared by two streamed blocks either streams from one master (parity, and
    host bytes count it once) or is rejected before mutation with a message naming both paths."""
    pipeline = case.build()
    stack, name, second_path = _tie_candidates(case, pipeline)
    first_path = f"{stack.streamed_paths[0]}.{name}"
    _tie(stack, name)
    reference_pipeline = case.build()
    ref_stack, _, _ = _tie_candidates(case, reference_pipeline)
    _tie(ref_stack, name)
    reference = case.run(move_to_device(reference_pipeline, case.device))
    before = snapshot(pipeline, values=True)
    unique = {}
    for s in rings_of(case, pipeline):
        for b in s.streamed_blocks:
            for _, t in module_tensors(b):
                unique[storage_key(t)] = t.untyped_storage().nbytes()
    platform = case.platform()
    backend = case.backend(platform=platform)
    try:
        backend.enable(pipeline)
    except ValueError as exc:
        message = str(exc)
        missing = [p for p in (first_path, second_path) if p not in message]
        if missing:
            fail(f"the rejection of a tied parameter does not name {missing}: {message!r}")
        problems = before.diff(snapshot(pipeline, values=True))
        if problems or platform.memory_allocated():
            fail(f"the rejection of a tied parameter came after mutation: {problems[:4]}")
        return
    host = backend.stats().host_bytes
    case.compare("tied parameter", case.run(pipeline), reference)
    backend.disable()
    if host > sum(unique.values()):
        fail(f"host masters hold {host} bytes, more than the {sum(unique.values())} unique bytes "
             f"of the streamed blocks: the tied {name} has two masters")


@check("D.3", strategies=SINGLE_PROCESS)
def check_views_keep_strides_and_sharing(case) -> None:
    """Views that share storage (transposed weights, slices, offsets) keep their strides and
    their sharing while offloaded, while materialized, and after restore."""
    pipeline = case.build()
    meta = {n: (tuple(t.shape), tuple(t.stride())) for n, t in _named(pipeline)}
    groups = storage_groups(pipeline)
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    problems: list[str] = []

    added: set[str] = set()

    def compare(moment: str, modules: list[tuple[str, nn.Module]] | None = None) -> None:
        for name, t in _named(pipeline):
            if t.numel() == 0 or (modules is not None and not any(
                    name.startswith(p + ".") for p, _ in modules)):
                continue
            if name not in meta:  # made by the pipeline after enable(): no backend saw it
                if name not in added:
                    added.add(name)
                    problems.append(
                        f"{moment}: {name} was added after enable() (an adapter attached during "
                        "a call?): the backend never saw it, so it stays where it was made and "
                        "is neither offloaded nor restored; attach it inside `with "
                        "backend.edit_weights(): ...`, or before enable()")
                continue
            if not resident(platform, t) and (t.stride() == (0,) * t.dim() and t.dim()):
                continue  # a placeholder of a block that is not materialized
            if (tuple(t.shape), tuple(t.stride())) != meta[name]:
                problems.append(f"{moment}: {name} shape/stride {meta[name]} -> "
                                f"{(tuple(t.shape), tuple(t.stride()))}")
        now = storage_groups(pipeline)
        for group in groups:
            live = [g for g in now if set(group) <= set(g)]
            if not live and not any(_placeholder(pipeline, n) for n in group):
                problems.append(f"{moment}: {group} no longer share storage")

    compare("after enable")
    components = [(n, m) for n, m in module_view(pipeline).named_children()]
    with observe(components, lambda p, m: compare(f"while {p} runs", [(p, m)])):
        case.run(pipeline)
    backend.disable()
    compare("after disable")
    if storage_groups(pipeline) != groups:
        problems.append(f"after disable sharing {groups} -> {storage_groups(pipeline)}")
    if problems:
        fail(sorted(set(problems))[0])


def _named(pipeline: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return named_module_tensors(pipeline)  # a wrapper subclass by its inner tensors: they are views


def _placeholder(pipeline: nn.Module, name: str) -> bool:
    t = dict(_named(pipeline)).get(name)
    return t is not None and t.dim() > 0 and all(s == 0 for s in t.stride())
