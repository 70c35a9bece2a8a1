"""Renamed classes keep their old names for one release: the same object, importable from the
same module, and in that module's ``__all__`` where the old name was."""

from __future__ import annotations

import importlib

import pytest

#: (module, old name, new name, whether the old name is in the module's ``__all__``)
RENAMED = [
    ("offload_ref.backends.layerwise", "LayerwiseOffloadHook", "LayerWiseOffloadHook", True),
    ("offload_ref.backends.layerwise", "LayerwisePartHook", "LayerWisePartHook", False),
    ("offload_ref.backends.distributed", "DistributedLayerwiseOffloadBackend",
     "DistributedLayerWiseOffloadBackend", True),
    ("offload_ref.backends.model_level", "SequentialOffloadHook", "ModelLevelOffloadHook", True),
    ("offload_ref.plan", "BlockStack", "RingPlan", True),
    ("offload_ref.plan.resolved", "BlockStack", "RingPlan", False),
]


@pytest.mark.parametrize("module, old, new, in_all", RENAMED,
                         ids=[f"{old}->{new}" for _, old, new, _ in RENAMED])
def test_the_old_name_is_the_new_class(module: str, old: str, new: str, in_all: bool) -> None:
    mod = importlib.import_module(module)
    assert getattr(mod, old) is getattr(mod, new)
    assert getattr(mod, new).__name__ == new
    exported = getattr(mod, "__all__", ())
    if in_all:
        assert old in exported and new in exported


def test_the_backend_table_names_the_new_classes() -> None:
    from offload_ref.backends.strategies import BACKENDS

    assert not [name for _, name in BACKENDS.values() if "Layerwise" in name]


def test_the_model_level_hook_is_named_after_its_strategy() -> None:
    """``hook_names(module)`` shows ``offload_ref.model_level`` (``offload_ref.sequential``
    before), as docs/strategies.md says."""
    from offload_ref import OffloadConfig, get_offload_backend
    from offload_ref.fixtures import get_spec
    from offload_ref.hooks import hook_names
    from offload_ref.platform.cpu import CpuPlatform

    pipe = get_spec("flux2").build()
    backend = get_offload_backend(OffloadConfig(strategy="model_level"), platform=CpuPlatform())
    backend.enable(pipe)
    try:
        names = {n for _, m in pipe.named_modules() for n in hook_names(m)}
    finally:
        backend.disable()
    assert names == {"offload_ref.model_level"}


def test_a_resolved_ring_is_a_ring_plan() -> None:
    from offload_ref import OffloadConfig
    from offload_ref.fixtures import get_spec
    from offload_ref.plan import BlockStack, RingPlan, resolve_offload_plan

    plan = resolve_offload_plan(get_spec("flux2").build(), OffloadConfig(strategy="layer_wise"))
    assert plan.rings and all(type(s) is RingPlan for s in plan.rings)
    assert all(isinstance(s, BlockStack) for s in plan.rings)
    # ``stacks``, the old name of ``rings``, for one release: the plan's and each component's
    assert plan.stacks == plan.rings
    assert all(c.stacks is c.rings for c in plan.components)


def test_a_block_rings_old_stack_attribute_is_its_plan() -> None:
    from offload_ref import OffloadConfig, get_offload_backend
    from offload_ref.fixtures import get_spec
    from offload_ref.platform.cpu import CpuPlatform

    pipe = get_spec("flux2").build()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=CpuPlatform())
    backend.enable(pipe)
    try:
        assert backend.rings and all(r.stack is r.plan for r in backend.rings)
        assert [r.plan for r in backend.rings] == [p for p in backend.plan.rings
                                                   if len(p.streamed_blocks) >= 2]
    finally:
        backend.disable()
