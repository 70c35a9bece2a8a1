"""Storage ownership of rings: a ring's aliases (tensors outside its blocks sharing their storage)
and the block tensors something else also uses (kept resident once).

Note [Ownership by identity]
    Blocks are identified by object identity, tensors by storage.  A block reachable from two
    components is rejected ("claimed by both").  A tensor of the ring's owner outside the blocks
    that shares storage with one block's tensor is recorded as a ring alias and travels with that
    block.  A block tensor that something else also uses (a second block, another component: a
    tied weight) is recorded in ``RingPlan.shared`` and kept resident once.  Either way no
    storage ever gets two masters or two independent device copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from ..discovery import get_submodule_path
from .resolved import ResolvedComponent, RingAlias
from .tree import _storage_key, named_tensors, tensor_leaves


def _direct_leaves(module: nn.Module) -> list[tuple[str, Any]]:
    """The module's own parameters and buffers, a wrapper subclass's inner tensors in its place
    (Note [Wrapper subclasses] in tree.py)."""
    out = []
    for registry in ("_parameters", "_buffers"):
        for name, t in module.__dict__.get(registry, {}).items():
            if t is not None:
                out += tensor_leaves(name, t)
    return out


def _ring_aliases(owner_path, owner, blocks, block_paths) -> tuple[RingAlias, ...]:
    """Tensors of ``owner`` outside the blocks that share storage with a block's tensor."""
    in_block: dict[tuple, tuple[str, str]] = {}
    block_tensor_ids: set[int] = set()
    for block, bpath in zip(blocks, block_paths):
        for name, t in named_tensors(block, bpath):
            block_tensor_ids.add(id(t))
            if t.numel():
                in_block.setdefault(_storage_key(t), (bpath, name))
    block_ids = {id(b) for b in blocks}
    aliases = []
    seen: set[str] = set()

    def walk(module: nn.Module, prefix: str) -> None:
        if id(module) in block_ids:
            return
        for name, t in _direct_leaves(module):
            if not t.numel():
                continue
            qual = f"{prefix}.{name}"
            hit = in_block.get(_storage_key(t))
            if hit is not None and qual not in seen:
                seen.add(qual)
                aliases.append(RingAlias(qual, hit[0], hit[1]))
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}.{name}")

    walk(owner, owner_path)
    return tuple(aliases)


def _shared_storages(pipeline: Any,
                     components: list[ResolvedComponent]) -> dict[tuple, list[str]]:
    """Storages of streamed-block tensors that something outside their block also uses: another
    block (of any ring), another component, or any other module of the pipeline.  Only the
    ring owner's own non-block tensors are exempt (they are ring aliases).  Modules are told
    apart by identity, so a block or DiT reachable under several paths is one module.  See
    Note [Ownership by identity]."""
    users: dict[tuple, list[str]] = {}  # storage -> tensor paths
    block_of: dict[tuple, set[int]] = {}  # storage -> ids of the blocks holding it
    owner_blocks: dict[int, set[int]] = {}  # ring owner id -> ids of its blocks
    block_ids: set[int] = set()
    for comp in components:
        for ring in comp.rings:
            owner = get_submodule_path(pipeline, ring.owner_path)
            mine = owner_blocks.setdefault(id(owner), set())
            for block, bpath in zip(ring.blocks, ring.block_paths):
                mine.add(id(block))
                block_ids.add(id(block))
                for name, t in named_tensors(block, bpath):
                    if t.numel():
                        key = _storage_key(t)
                        block_of.setdefault(key, set()).add(id(block))
                        users.setdefault(key, []).append(name)
    shared = {k: sorted(set(v)) for k, v in users.items() if len(block_of[k]) > 1}

    def note(key: tuple, qual: str) -> None:
        shared.setdefault(key, sorted(set(users[key])))
        if qual not in shared[key]:
            shared[key].append(qual)

    def walk(module: nn.Module, prefix: str, visited: set[int], stop: set[int],
             on_tensor: Callable[[tuple, str], None]) -> None:
        if id(module) in visited or id(module) in stop:
            return
        visited.add(id(module))
        for name, t in _direct_leaves(module):
            key = _storage_key(t) if t.numel() else None
            if key in block_of:
                on_tensor(key, f"{prefix}{name}")
        for name, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.", visited, stop, on_tensor)

    # Pass 1: every use outside the ring owners is a sharing use, whatever path reaches it
    # first.  Pass 2: inside an owner (outside its blocks), a tensor of exactly one of that
    # owner's blocks is a ring alias; anything else is sharing.
    owners = {id(get_submodule_path(pipeline, s.owner_path)): s.owner_path
              for c in components for s in c.rings}
    roots = [(pipeline, "")] if isinstance(pipeline, nn.Module) else [
        (c.module, f"{c.path}.") for c in components]
    outside: set[int] = set()
    for root, prefix in roots:
        walk(root, prefix, outside, block_ids | set(owners), note)
    inside: set[int] = set()
    for owner_id, owner_path in owners.items():
        owner = get_submodule_path(pipeline, owner_path)

        def on_owner_tensor(key: tuple, qual: str, owner_id: int = owner_id) -> None:
            if len(block_of[key]) != 1 or not block_of[key] <= owner_blocks[owner_id]:
                note(key, qual)

        walk(owner, f"{owner_path}.", inside, block_ids | (set(owners) - {owner_id}),
             on_owner_tensor)
    return shared


def _with_shared(pipeline: Any,
                 components: list[ResolvedComponent]) -> list[ResolvedComponent]:
    shared = _shared_storages(pipeline, components)
    if not shared:
        return components
    out = []
    for comp in components:
        rings = []
        for ring in comp.rings:
            mine = set()
            for block, bpath in zip(ring.blocks, ring.block_paths):
                for name, t in named_tensors(block, bpath):
                    if t.numel() and _storage_key(t) in shared:
                        mine.add(name)
            if not mine:
                rings.append(ring)
                continue
            keys = {k for k, names in shared.items() if mine & set(names)}
            aliases = tuple(a for a in ring.aliases
                            if not any(a.tensor_path in shared[k] for k in keys))
            rings.append(dataclasses.replace(ring, shared=tuple(sorted(mine)),
                                              aliases=aliases))
        out.append(dataclasses.replace(comp, rings=tuple(rings)))
    return out
