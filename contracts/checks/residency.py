"""Catalogue §F: strategy behaviour, residency bounds and output parity."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from offload_ref.discovery import get_submodule_path
from offload_ref.plan.tree import tensor_leaves, wrapper_inner

from ..case import move_to_device
from ..registry import check, fail
from ..observe import (
    CopySpy,
    calls_in_a_fresh_generation,
    tensor_bytes,
    is_offloaded,
    is_resident,
    module_bytes,
    observe,
    tensors_of,
)
from ..facts import dit_blocks, first_dit, module_tensors, module_view, resident
from .lifecycle import SINGLE_PROCESS

LAYER_BACKENDS = ("layer_wise",)


# -- F.3 parity -------------------------------------------------------------------------------


@check("F.3", strategies=SINGLE_PROCESS)
def check_offloaded_output_matches_reference_bitwise(case) -> None:
    """Outputs equal the un-offloaded reference bit for bit (race amplifier on), twice in a row
    (the second run starts from the state the first left)."""
    reference = case.reference()
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    for run in range(2):
        case.compare(f"run {run}", case.run(pipeline), reference)
    backend.disable()


@check("F.3", strategies=SINGLE_PROCESS)
def check_offloaded_output_matches_reference_without_race_amplifier(case) -> None:
    """Outputs equal the reference on a plain CPU platform too (no delays, no poisoning)."""
    from offload_ref.platform import CpuPlatform

    reference = case.reference()
    pipeline = case.build()
    platform = CpuPlatform(race_amplifier=False)
    case._platforms.append(platform)
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    case.compare("plain platform", case.run(pipeline), reference)
    backend.disable()


# -- F.6 alignment ----------------------------------------------------------------------------


def _named_modules(pipeline: Any) -> list[tuple[str, nn.Module]]:
    return list(module_view(pipeline).named_modules(remove_duplicate=False))


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # a wrapper subclass by its inner tensors: they have the addresses (Note [Wrapper subclasses])
    return module_tensors(module, recurse=False)


@check("F.6", strategies=SINGLE_PROCESS)
def check_offloaded_tensors_keep_their_alignment(case) -> None:
    """Every tensor a strategy rebinds (host master view, device copy, ring slot view) and every
    tensor disable rebuilds keeps its address modulo the platform's alignment (modulo 64 at
    most: 64 bytes is what torch's allocators give a fresh storage), seen after enable, at every
    module's forward and after disable.  Kernels choose their path by alignment (MKL's GEMV on
    AMD EPYC, cuBLAS), so this is what makes bitwise parity hold on every machine; it fails on
    any machine when an offloader packs tensors without aligned padding."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    a = min(platform.alignment, 64)
    modules = _named_modules(pipeline)
    original = {(id(m), n): (t.data_ptr() % a, t.stride())
                for _, m in modules for n, t in _own_tensors(m) if t.numel()}
    problems: list[str] = []

    def look(moment: str, path: str, module: nn.Module) -> None:
        for name, t in _own_tensors(module):
            want = original.get((id(module), name))
            if want is None or not t.numel() or t.stride() != want[1]:
                continue  # new, empty, or a placeholder of a streamed block (stride 0)
            got = t.data_ptr() % a
            if got != want[0]:
                problems.append(f"{moment}: {path + '.' if path else ''}{name} sits {got} bytes "
                                f"past a {a}-byte boundary, {want[0]} before enable")

    backend.enable(pipeline)
    for path, module in modules:
        look("after enable", path, module)
    with observe(modules, lambda p, m: look(f"while {p or 'the pipeline'} runs", p, m)):
        case.run(pipeline)
    backend.disable()
    for path, module in modules:
        look("after disable", path, module)
    if problems:
        fail(f"{len(problems)} tensor(s) lost their alignment (pad each tensor's region to the "
             f"platform's alignment and keep its offset modulo {a}): {problems[:4]}")


@check("F.3", strategies=SINGLE_PROCESS)
def check_pipeline_built_under_inference_mode_matches_reference(case) -> None:
    """A pipeline built under torch.inference_mode() (its weights are inference tensors) matches
    the reference bit for bit with offload enabled, in and out of inference mode (no_grad), and
    after disable, with its inference tensors restored."""
    reference = case.reference()
    with torch.inference_mode():
        pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    try:
        case.compare("enabled, inference_mode", case.run(pipeline), reference)
        with torch.no_grad():
            case.compare("enabled, no_grad", pipeline(**case.inputs()), reference)
    finally:
        backend.disable()
    case.compare("after disable", case.run(pipeline), case.host_reference())
    state = module_view(pipeline).state_dict(keep_vars=True)  # a wrapper subclass, and the
    # inner tensors that hold its data (Note [Wrapper subclasses])
    named = [*state.items(), *(leaf for n, t in state.items() if wrapper_inner(t) is not None
                               for leaf in tensor_leaves(n, t))]
    normal = [n for n, t in named if t.numel() and not t.is_inference()]
    if normal:
        fail(f"after disable these tensors are no longer inference tensors: {normal[:5]}")


# -- F.1 model level --------------------------------------------------------------------------


def _model_level_setup(case: Any) -> tuple[Any, Any, Any, Any]:
    pipeline = case.build()
    platform = CopySpy(case.platform())
    backend = case.backend(platform=platform)
    plan = case.resolve(pipeline)
    return pipeline, platform, backend, plan


def _own(plan: Any, comp: Any) -> list[torch.Tensor]:
    """``comp``'s own tensors: its module's, minus those of the other components declared
    inside it (a resident nested in a DiT stays on the device while the DiT swaps).  Found by
    module identity here, independently of the library's bookkeeping."""
    subs = {id(m) for m in comp.module.modules()}
    inner = {id(t) for c in plan.components
             if c.module is not comp.module and id(c.module) in subs
             for t in tensors_of(c.module)}
    return [t for t in tensors_of(comp.module) if id(t) not in inner]


def _all_resident(platform: Any, tensors: list[torch.Tensor]) -> bool:
    return all(resident(platform, t) for t in tensors)


def _none_resident(platform: Any, tensors: list[torch.Tensor]) -> bool:
    return not any(resident(platform, t) for t in tensors)


@check("F.1", strategies=("model_level",), requires=("not delegates_model_level",))
def check_model_level_keeps_one_group_resident(case) -> None:
    """While an encoder runs every swapped DiT is on the host; while a DiT runs the swapped
    encoders and the other DiTs are on the host; VAEs, residents (also those declared inside a
    swapped component) and unselected components stay on the device; device bytes stay within
    one swap group (a component's own tensors) + resident state."""
    pipeline, platform, backend, plan = _model_level_setup(case)
    swapped = [c for c in plan.components
               if c.role in ("dit", "encoder") and c.selected and not c.on_demand]
    own = {c.path: _own(plan, c) for c in plan.components}
    dits = [(c.path, c.module) for c in plan.components if c.role == "dit"]
    encoders = [(c.path, c.module) for c in plan.components if c.role == "encoder"]
    always = [c.path for c in plan.components if c not in swapped and not c.on_demand]
    a = platform.alignment  # device copies hold each storage in an aligned region
    groups = [tensor_bytes(own[c.path], a) for c in swapped if c.role == "dit"]
    groups.append(tensor_bytes([t for c in swapped if c.role == "encoder" for t in own[c.path]],
                               a))
    backend.enable(pipeline)
    base = platform.memory_allocated()  # resident state, placed at enable
    bound = base + max(groups)
    problems: list[str] = []

    def before(path: str, module: nn.Module) -> None:
        if not _all_resident(platform, own[path]):
            problems.append(f"{path} runs while not resident")
        role = "dit" if any(m is module for _, m in dits) else "encoder"
        for c in swapped:
            if c.path != path and (c.role == "dit" or role == "dit") and \
                    not _none_resident(platform, own[c.path]):
                problems.append(f"{c.path} is on the device while {role} {path} runs")
        for p in always:
            if not _all_resident(platform, own[p]):
                problems.append(f"{p} left the device while {path} runs")
        if platform.memory_allocated() > bound:
            problems.append(f"{platform.memory_allocated()} device bytes while {path} runs > "
                            f"bound {bound} (resident {base} + largest group {max(groups)})")

    with observe(dits + encoders, before) as calls:
        case.run(pipeline)
    backend.disable()
    if not calls:
        fail("no DiT or encoder forward was observed")
    if problems:
        fail(f"model-level residency violated: {sorted(set(problems))[:6]}")


@check("F.1", strategies=("model_level",), requires=("not delegates_model_level",))
def check_model_level_swaps_move_component_bytes_host_to_device_only(case) -> None:
    """Each swap moves exactly the loaded component's own bytes host -> device (observed at the
    component's forward, before it runs); nothing moves device -> host."""
    pipeline, platform, backend, plan = _model_level_setup(case)
    # A swap copies the component's aligned flat buffers: its weight bytes plus padding.
    swappable = {c.path: tensor_bytes(_own(plan, c), platform.alignment) for c in plan.components
                 if c.role in ("dit", "encoder") and c.selected and not c.on_demand}
    watched = [(c.path, c.module) for c in plan.components if c.role in ("dit", "encoder")]
    backend.enable(pipeline)
    platform.copies.clear()
    problems: list[str] = []
    seen = [0]  # h2d bytes already attributed

    def before(path: str, module: nn.Module) -> None:
        moved = platform.bytes("h2d") - seen[0]
        seen[0] = platform.bytes("h2d")
        if moved not in (0, swappable.get(path, 0)):
            problems.append(f"{moved} bytes moved host -> device to run {path}, whose bytes are "
                            f"{swappable.get(path, 0)} (a swap moves exactly one component)")

    bypassed: dict[str, str] = {}  # component never entered -> a submodule of it that ran
    entered: set[str] = set()

    def submodule_runs(mod: nn.Module, args: Any) -> None:
        path = inside.get(id(mod))
        if path is not None and path[0] not in entered and path[0] not in bypassed:
            from ..placement import code_line

            bypassed[path[0]] = f"{path[1]} (called at {code_line()})"

    inside = {id(m): (c, f"{c}.{n}") for c, module in watched for n, m in module.named_modules()
              if n and c in swappable}
    handle = nn.modules.module.register_module_forward_pre_hook(submodule_runs)
    try:
        with observe(watched, lambda path, module: (entered.add(path), before(path, module))):
            case.run(pipeline)
    finally:
        handle.remove()
    stats = backend.stats()
    backend.disable()
    d2h = platform.bytes("d2h")
    if d2h or stats.d2h_bytes:
        fail(f"{d2h} bytes were copied device -> host during inference "
             f"(stats.d2h_bytes={stats.d2h_bytes}); offloading must rebind to the host master")
    if problems:
        fail(problems[0])
    never = [p for p in swappable if p not in entered]
    if never:
        ran = [f"{p}'s submodule {bypassed[p]} ran" for p in never if p in bypassed]
        fail(f"{', '.join(never)} never loaded: its forward did not run in a generation, so its "
             f"hooks never fired" + (f" ({'; '.join(ran)})" if ran else "") + ". A component "
             "run through another entry point (encode_prompt, get_text_features, one of its "
             "submodules) computes with its weights parked on the host. Fix: call the module "
             f"itself, or run that entry point inside `with backend.use_component({never[0]!r}):`")
    if platform.bytes("h2d") < sum(swappable.values()):
        fail(f"{platform.bytes('h2d')} bytes moved in a generation, less than one load of every "
             f"swappable component ({swappable})")


# -- F.2 layerwise ----------------------------------------------------------------------------


def rings_of(case: Any, pipeline: Any) -> list[Any]:
    return streaming_rings(case.resolve(pipeline))


def streaming_rings(plan: Any) -> list[Any]:
    """The rings of ``plan`` that stream (a ring: two or more streamed blocks)."""
    return [s for s in plan.rings if len(s.streamed_blocks) >= 2]


def _ring_tensors(stack: Any) -> list[list[torch.Tensor]]:
    """Per streamed block, the tensors the ring streams: the block's own, minus those it shares
    with something outside the block (kept resident once, see BlockStack.shared)."""
    shared = set(stack.shared)
    out = []
    for block, path in zip(stack.streamed_blocks, stack.streamed_paths):
        # a wrapper subclass by its inner tensors, under the paths the plan names them by
        named = module_tensors(block, prefix=path, remove_duplicate=False)
        seen: set[int] = set()
        ts = []
        for name, t in named:
            if t.numel() and name not in shared and id(t) not in seen:
                seen.add(id(t))
                ts.append(t)
        out.append(ts)
    return out


def _materialized(platform: Any, stack: Any) -> list[int]:
    return [k for k, ts in enumerate(_ring_tensors(stack))
            if ts and any(resident(platform, t) for t in ts)]


def _repeated_pass_start(case: Any, rings: list[Any]) -> list[int | None]:
    """Per ring: the block each pass calls first when a generation of a fresh, un-offloaded
    pipeline calls the ring's blocks as one pass repeated exactly, twice or more; None when it
    does not (one pass, skipped or reordered blocks in some passes)."""
    calls = calls_in_a_fresh_generation(case, lambda fresh: [
        (path, get_submodule_path(fresh, path))
        for stack in rings for path in stack.streamed_paths])
    out: list[int | None] = []
    for stack in rings:
        mine = [stack.streamed_paths.index(p) for p in calls if p in stack.streamed_paths]
        period = mine.index(mine[0], 1) if mine and mine.count(mine[0]) > 1 else 0
        repeated = period and len(mine) % period == 0 and mine == mine[:period] * (
            len(mine) // period)
        out.append(mine[0] if repeated else None)
    return out


@check("F.2", strategies=LAYER_BACKENDS)
def check_layerwise_materializes_only_block_zero_between_passes(case) -> None:
    """Between passes only one block of each ring is on the device: block 0 after enable, and
    after a generation whose passes all call the ring's blocks in one order, the block a pass
    calls first (the last block prefetched it, wrap-around; block 0 when the forward calls the
    ring's containers in the order they are declared)."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    rings = rings_of(case, pipeline)
    first = _repeated_pass_start(case, rings)
    backend.enable(pipeline)
    for moment in ("after enable", "after one generation", "after two generations"):
        for stack, k in zip(rings, first):
            got = _materialized(platform, stack)
            name = "+".join(stack.container_paths)
            if moment == "after enable":
                want, why = [0], " (block 0: nothing has run yet)"
            elif k is not None:  # one pass repeated: the ring has learned which block is first
                order = (": the forward calls the ring's containers in another order than they "
                         "are declared") if k else ""
                want, why = [k], f" (the block each pass calls first, {stack.streamed_paths[k]}" \
                                 f"{order})"
            elif len(got) != 1:
                fail(f"{moment}: ring {name} has blocks {got} on the device, expected exactly one")
            else:
                continue
            if got != want:
                fail(f"{moment}: ring {name} has blocks {got} on the device, expected exactly "
                     f"{want}{why}")
        case.run(pipeline)
    backend.disable()


@contextmanager
def _parts_outside_their_block(blocks: list[tuple[str, nn.Module]]) -> Iterator[list[str]]:
    """Yields a list that names each block of ``blocks`` whose parts ran inside a method of the
    block called directly (``block.forward(...)``) rather than inside its ``__call__``, with the
    line that called it."""
    from ..placement import entry_point

    outside: list[str] = []
    active: dict[int, int] = {}
    seen: set[str] = set()
    handles = []

    def enter(block: nn.Module, *_: Any) -> None:
        active[id(block)] = active.get(id(block), 0) + 1

    def leave(block: nn.Module, *_: Any) -> None:
        active[id(block)] = active.get(id(block), 1) - 1

    def part_runs(path: str, block_path: str, block: nn.Module) -> None:
        if active.get(id(block), 0) > 0 or block_path in seen:
            return
        entry = entry_point(block)
        # A part called on its own (diffusers' DiT runs transformer_blocks[0].norm1.emb after
        # its loop) is served by its part hooks (Note [Block parts] in ring.py): not a defect.
        if entry is None:
            return
        seen.add(block_path)
        if entry[0] == "forward":
            outside.append(f"{block_path} ran through {block_path}.forward(...) (called at "
                           f"{entry[1]}), which bypasses its hooks")
        else:
            outside.append(f"{block_path} ran through its method {entry[0]}() (called at "
                           f"{entry[1]}), not through {block_path}(...)")

    try:
        for block_path, block in blocks:
            handles.append(block.register_forward_pre_hook(enter))
            handles.append(block.register_forward_hook(leave, always_call=True))
            for name, part in block.named_modules():
                if part is not block and (part._parameters or part._buffers):
                    handles.append(part.register_forward_pre_hook(
                        lambda m, a, p=f"{block_path}.{name}", bp=block_path, b=block:
                        part_runs(p, bp, b)))
        yield outside
    finally:
        for h in handles:
            h.remove()


@check("F.2", strategies=LAYER_BACKENDS)
def check_layerwise_keeps_at_most_two_blocks_resident(case) -> None:
    """While block k runs it is resident, at most two blocks of its ring are, and device bytes
    stay within non-block bytes + 2 x the largest block of every ring."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    rings = rings_of(case, pipeline)
    a = platform.alignment  # bounds count each storage in its aligned region
    per_block = {id(s): [tensor_bytes(ts, a) for ts in _ring_tensors(s)] for s in rings}
    streamed = {id(b) for s in rings for b in s.streamed_blocks}
    nonblock = module_bytes(pipeline, a) - sum(sum(v) for v in per_block.values())
    bound = nonblock + sum(2 * max(v) for v in per_block.values())
    backend.enable(pipeline)
    problems: list[str] = []
    owner = {id(b): s for s in rings for b in s.streamed_blocks}

    def before(path: str, module: nn.Module) -> None:
        stack = owner[id(module)]
        if not is_resident(platform, module):
            problems.append(f"{path} runs while not resident")
        live = _materialized(platform, stack)
        if len(live) > 2:
            problems.append(f"{len(live)} blocks of {'+'.join(stack.container_paths)} resident "
                            f"while {path} runs: {live}")
        if platform.memory_allocated() > bound:
            problems.append(f"{platform.memory_allocated()} device bytes while {path} runs > "
                            f"bound {bound}")

    blocks = [(p, b) for s in rings for p, b in zip(s.streamed_paths,
                                                     s.streamed_blocks)]
    with observe(blocks, before) as calls, _parts_outside_their_block(blocks) as outside:
        case.run(pipeline)
    backend.disable()
    if outside:
        fail("a streamed block ran without its hooks: " + "; ".join(outside[:3]) + ". "
             "Offloaders that load a block in its hooks (diffusers' group offloading, "
             "accelerate's hooks) compute there with placeholders or host weights; offload-ref "
             "loads it synchronously from its parts' hooks, with no prefetch. Fix: call the "
             "block itself, block(...)")
    ran = set(calls)
    if len(ran) < len(streamed):
        silent = [p for p, _ in blocks if p not in ran]
        fail(f"only {len(ran)} of {len(streamed)} streamed blocks ran through their "
             f"forward hooks; never: {silent[:4]}{' ...' if len(silent) > 4 else ''}.  A block "
             "the pipeline calls as `block.forward(...)` (not `block(...)`) bypasses the hooks "
             "that load its weights, so it computes with whatever its tensors are bound to; "
             "call the module itself (or the block was skipped in this generation)")
    if problems:
        fail(f"layerwise residency violated: {sorted(set(problems))[:6]}")


@check("F.2", strategies=LAYER_BACKENDS)
def check_layerwise_prefetches_the_next_block_before_it_runs(case) -> None:
    """In a steady-state pass, the block that runs next (block 0 after the last: wrap-around)
    is already materialized while the current block runs, so no load waits for a copy issued
    too late.  Observed from the residency of the blocks, not from the backend's counters."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    rings = rings_of(case, pipeline)
    own = {id(b): (s, k) for s in rings for k, b in enumerate(s.streamed_blocks)}
    backend.enable(pipeline)
    case.run(pipeline)  # first pass: the ring learns the caller's order
    order: list[tuple[int, int]] = []  # (ring, block) in call order
    ready: list[list[int]] = []  # materialized blocks of that ring while it ran

    def before(path: str, module: nn.Module) -> None:
        stack, k = own[id(module)]
        order.append((id(stack), k))
        ready.append(_materialized(platform, stack))

    blocks = [(p, b) for s in rings for p, b in zip(s.streamed_paths,
                                                     s.streamed_blocks)]
    with observe(blocks, before):
        case.run(pipeline)
    late = []
    for i in range(len(order) - 1):
        (ring, k), (next_ring, nxt) = order[i], order[i + 1]
        if ring == next_ring and nxt != k and nxt not in ready[i]:
            late.append((k, nxt))
    backend.disable()
    if not order:
        fail("no streamed block ran")
    if late:
        fail(f"{len(late)} block(s) were not prefetched while their predecessor ran "
             f"(predecessor, block): {late[:4]}")


# -- F.4 skipped blocks -----------------------------------------------------------------------


class _SkippingList(nn.ModuleList):
    """A ModuleList whose iteration skips one index (a cache system skipping a block)."""

    _kit_skip: int = -1

    def __iter__(self):
        return iter([m for i, m in enumerate(self._modules.values()) if i != self._kit_skip])


def _skippable(case: Any, pipeline: Any) -> tuple[nn.ModuleList, int] | None:
    for stack in rings_of(case, pipeline):
        for path in stack.container_paths:
            container = get_submodule_path(pipeline, path)
            if isinstance(container, nn.ModuleList) and len(container) >= 3:
                return container, len(container) // 2
    return None


def skip_block(container: nn.ModuleList, index: int) -> None:
    container.__class__ = _SkippingList
    container.__dict__["_kit_skip"] = index


@check("F.4", strategies=LAYER_BACKENDS, requires=("skippable_block",))
def check_skipped_block_is_recovered(case) -> None:
    """A caller that skips a block (as cache systems do) still gets the right output (the
    reference with the same skip), the ring stays bounded, and a skip-free pass afterwards
    matches the plain reference."""
    reference_pipeline = case.build()
    container, index = _skippable(case, reference_pipeline)
    skip_block(container, index)
    skipped_reference = case.run(move_to_device(reference_pipeline, case.device))
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    rings = rings_of(case, pipeline)
    backend.enable(pipeline)
    container, index = _skippable(case, pipeline)
    skip_block(container, index)
    problems: list[str] = []

    def before(path: str, module: nn.Module) -> None:
        for stack in rings:
            if len(_materialized(platform, stack)) > 2:
                problems.append(f"ring {'+'.join(stack.container_paths)} holds more than two "
                                "blocks")

    blocks = [(p, b) for s in rings for p, b in zip(s.block_paths, s.blocks)]
    with observe(blocks, before):
        case.compare("with a skipped block", case.run(pipeline), skipped_reference)
        case.compare("skipped block, second run", case.run(pipeline), skipped_reference)
    container.__class__ = nn.ModuleList
    del container.__dict__["_kit_skip"]
    case.compare("after the skips stop", case.run(pipeline), case.reference())
    backend.disable()
    if problems:
        fail(sorted(set(problems))[0])


@check("F.5", strategies=LAYER_BACKENDS)
def check_layerwise_streams_every_block_of_every_ring(case) -> None:
    """Every streamed block of every ring (heterogeneous sizes, odd or even lengths, several
    rings) is materialized when it runs and released afterwards."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    rings = rings_of(case, pipeline)
    if not rings:
        fail("the plan streams no ring")
    backend.enable(pipeline)
    seen: dict[str, bool] = {}
    released: dict[str, bool] = {}

    def before(path: str, module: nn.Module) -> None:
        seen[path] = is_resident(platform, module)

    own = {p: ts for s in rings for p, ts in zip(s.streamed_paths,
                                                _ring_tensors(s))}

    def after(path: str, module: nn.Module) -> None:
        released[path] = not any(resident(platform, t) for t in own[path])

    blocks = [(p, b) for s in rings for p, b in zip(s.streamed_paths,
                                                     s.streamed_blocks)]
    with observe(blocks, before, after):
        case.run(pipeline)
    backend.disable()
    missing = [p for p, _ in blocks if p not in seen]
    not_resident = [p for p, ok in seen.items() if not ok]
    kept = [p for p, ok in released.items() if not ok]
    if missing or not_resident or kept:
        fail(f"blocks not run {missing[:3]}, run while not resident {not_resident[:3]}, kept on "
             f"the device after their forward {kept[:3]}")


# -- statistics -------------------------------------------------------------------------------


@check("F.1", strategies=SINGLE_PROCESS)
def check_stats_match_what_the_platform_saw(case) -> None:
    """stats() reports the device bytes the platform holds for the backend, the pinned bytes,
    and exactly the host -> device bytes copied (and no device -> host bytes)."""
    pipeline = case.build()
    platform = CopySpy(case.platform())
    backend = case.backend(platform=platform)
    base, host_base = platform.memory_allocated(), platform.host_allocated()
    backend.enable(pipeline)
    problems: list[str] = []

    def compare(moment: str, *_: Any) -> None:
        s = backend.stats()
        held = platform.memory_allocated() - base
        if s.device_weight_bytes + s.device_padding_bytes != held:
            problems.append(f"{moment}: stats().device_weight_bytes={s.device_weight_bytes} + "
                            f"device_padding_bytes={s.device_padding_bytes} but the platform "
                            f"holds {held} bytes")
        if s.pinned_bytes != platform.pinned_bytes():
            problems.append(f"{moment}: stats().pinned_bytes={s.pinned_bytes} but the platform "
                            f"has {platform.pinned_bytes()} pinned bytes")
        if s.host_bytes + s.host_padding_bytes != platform.host_allocated() - host_base:
            problems.append(f"{moment}: stats().host_bytes={s.host_bytes} + host_padding_bytes="
                            f"{s.host_padding_bytes} but the platform allocated "
                            f"{platform.host_allocated() - host_base} host bytes")
        if s.peak_device_bytes < held or s.peak_device_weight_bytes < s.device_weight_bytes:
            problems.append(f"{moment}: stats() peaks {s.peak_device_bytes} / "
                            f"{s.peak_device_weight_bytes} are below what is held now")

    compare("after enable")
    platform.copies.clear()
    h2d_before = backend.stats().h2d_bytes + backend.stats().h2d_padding_bytes
    with observe(list(module_view(pipeline).named_children()), lambda p, m: compare(f"while {p} runs")):
        case.run(pipeline)
    platform.synchronize()
    s = backend.stats()
    if s.h2d_bytes + s.h2d_padding_bytes - h2d_before != platform.bytes("h2d"):
        problems.append(f"a generation moved {platform.bytes('h2d')} bytes host -> device but "
                        f"stats().h2d_bytes + h2d_padding_bytes grew by "
                        f"{s.h2d_bytes + s.h2d_padding_bytes - h2d_before}")
    if s.d2h_bytes != platform.bytes("d2h"):
        problems.append(f"stats().d2h_bytes={s.d2h_bytes}, observed {platform.bytes('d2h')}")
    backend.disable()
    if problems:
        fail(sorted(set(problems))[0])


# -- F.7 a resident head ----------------------------------------------------------------------


def _hooks_of(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Module path (relative to ``module``) -> the registrants of its hook dicts."""
    from ..facts import HOOK_DICTS, hook_name

    return {name: tuple(hook_name(h) for d in HOOK_DICTS for h in getattr(sub, d).values())
            for name, sub in module.named_modules(remove_duplicate=False)}


def _head_sizes(n: int) -> list[int]:
    """The heads the check declares on a DiT of ``n`` blocks: one block, and the largest head
    that leaves two blocks streaming."""
    return sorted({1, n - 2})


@check("F.7", strategies=LAYER_BACKENDS, requires=("dit_blocks>=3",),
       needs="a DiT with three or more declared blocks (a head of one leaves two streaming)")
def check_resident_head_stays_put_unhooked_and_within_the_prediction(case) -> None:
    """A resident head declared in ``OffloadPlan.layerwise_resident_layers`` (one block, and the
    largest that leaves two streaming) is placed once at enable: its tensors are on the device
    at the same addresses through every generation of an enable, over two enable/disable
    cycles; no hook is added to the head blocks; only the streamed blocks are hooked; outputs
    match the reference; the measured peak device bytes equal the plan's prediction, which
    stays within the bytes outside the streamed blocks plus two of the largest streamed block
    of each ring (counted here, independently)."""
    from .plan import with_plan

    want = case.reference()
    probe = case.build()
    path, dit = first_dit(probe)
    n = len(dit_blocks(probe, path, dit))
    for k in _head_sizes(n):
        pipeline = case.build()
        with_plan(pipeline, layerwise_resident_layers={path: k})
        what = f"OffloadPlan.layerwise_resident_layers={{{path!r}: {k}}}"
        plan = case.resolve(pipeline)
        stack = next((s for c in plan.dits if c.path == path for s in c.rings), None)
        if stack is None or stack.resident_head != k:
            fail(f"{what}: the resolved plan keeps a head of "
                 f"{getattr(stack, 'resident_head', None)} blocks, expected {k}")
        head = list(zip(stack.block_paths[:k], stack.blocks[:k]))
        streamed = list(zip(stack.block_paths[k:], stack.streamed_blocks))
        hooks_before = {p: _hooks_of(b) for p, b in head}
        platform = case.platform()
        a = platform.alignment
        rings = [s for s in plan.rings if len(s.streamed_blocks) >= 2]  # encoders' too
        sizes = [[tensor_bytes(ts, a) for ts in _ring_tensors(s)] for s in rings]
        bound = (module_bytes(pipeline, a) - sum(map(sum, sizes))
                 + sum(2 * max(per_ring) for per_ring in sizes))
        backend = case.backend(platform=platform)
        for cycle in range(2):
            where = f"{what}, enable {cycle + 1}"
            backend.enable(pipeline)
            try:
                addresses = {name: t.data_ptr() for name, t in _head_tensors(head)}
                off = [p for p, b in head if not is_resident(platform, b)]
                if off:
                    fail(f"{where}: head block(s) {off} are not on the device after enable")
                added = [f"{p}.{sub}".rstrip(".") + f" ({after})"
                         for p, b in head for sub, after in _hooks_of(b).items()
                         if after != hooks_before[p].get(sub, ())]
                if added:
                    fail(f"{where}: hooks were added to the resident head: {added[:4]}; a head "
                         "block is placed once and runs as resident state, unhooked")
                unhooked = [p for p, b in streamed if not b._forward_pre_hooks]
                if unhooked:
                    fail(f"{where}: streamed block(s) {unhooked[:4]} carry no hook")
                peak = [0]

                def sample(_: str, __: nn.Module) -> None:
                    peak[0] = max(peak[0], platform.memory_allocated())

                for run in range(2):
                    with observe(streamed, sample):
                        got = case.run(pipeline)
                    case.compare(f"{where}, generation {run + 1}", got, want)
                    moved = [name for name, t in _head_tensors(head) if
                             addresses.get(name) != t.data_ptr()]
                    if moved:
                        fail(f"{where}: after generation {run + 1}, head tensors moved on the "
                             f"device: {moved[:4]}; a resident head keeps its addresses")
                stats = backend.stats()
                predicted = backend.plan.predicted_device_bytes()
            finally:
                backend.disable()
            if stats.peak_device_bytes != predicted or peak[0] > predicted:
                fail(f"{where}: measured peak device bytes {stats.peak_device_bytes} (sampled "
                     f"while blocks ran: {peak[0]}) differ from the plan's prediction "
                     f"{predicted}; the prediction must count the head as resident")
            if predicted > bound:
                fail(f"{where}: the plan predicts {predicted} device bytes, more than the "
                     f"{bound} bytes outside the streamed blocks plus two of the largest "
                     "streamed block of each ring")


def _head_tensors(head: list[tuple[str, nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for p, b in head
            for n, t in module_tensors(b, prefix=p, remove_duplicate=False) if t.numel()]
