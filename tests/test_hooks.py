"""HookRegistry / ModelHook: named hooks on torch's native hook handles.

Under test: callbacks run around ``forward`` in order and may replace its arguments or output;
names are unique per module; registries coexist and each removes only its own hooks; removing the
last hook leaves the module exactly as it was (``forward`` is never wrapped); removed hooks are
garbage-collected; a post hook runs when ``forward`` raises; ``remove_all`` tries every hook.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.hooks import HOOKS_ATTR, HookRegistry, ModelHook, hook_names


class _Scale(nn.Module):
    """forward(x, *, scale=1.0) -> x * scale, recording each call in ``log``."""

    def __init__(self, log: list[str] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.log = log if log is not None else []

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        self.log.append("forward")
        return x * self.weight * scale


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("boom in forward")


class _Recorder(ModelHook):
    """Appends ``pre:<tag>`` / ``post:<tag>`` to a shared log."""

    def __init__(self, log: list[str], tag: str) -> None:
        self.log = log
        self.tag = tag
        self.outputs: list[Any] = []

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.log.append(f"pre:{self.tag}")

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.log.append(f"post:{self.tag}")
        self.outputs.append(output)


class _PreOnly(ModelHook):
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        return None


def _module_state(module: nn.Module) -> dict[str, Any]:
    """What "the module is exactly as before" means for hooks."""
    return {
        "dict_keys": sorted(module.__dict__),
        "pre_hooks": dict(module._forward_pre_hooks),
        "hooks": dict(module._forward_hooks),
        "pre_with_kwargs": dict(module._forward_pre_hooks_with_kwargs),
        "with_kwargs": dict(module._forward_hooks_with_kwargs),
        "always_called": dict(module._forward_hooks_always_called),
    }


def _assert_forward_untouched(module: nn.Module, where: str) -> None:
    assert "forward" not in module.__dict__, f"{where}: module.forward was replaced on the instance"
    assert module.forward.__func__ is type(module).forward, (
        f"{where}: module.forward is {module.forward!r}, not {type(module).__name__}.forward"
    )


def test_pre_and_post_callbacks_run_in_order_around_forward() -> None:
    log: list[str] = []
    module = _Scale(log)
    first, second = _Recorder(log, "a"), _Recorder(log, "b")
    registry = HookRegistry()
    registry.register_hook(module, "a", first)
    registry.register_hook(module, "b", second)
    out = module(torch.ones(2))
    assert log == ["pre:a", "pre:b", "forward", "post:a", "post:b"], log
    assert first.outputs and first.outputs[0] is out
    registry.remove_all()


def test_pre_hook_can_replace_args_and_kwargs() -> None:
    class Replace(ModelHook):
        def pre_forward(self, module, args, kwargs):
            return (args[0] + 1,), {**kwargs, "scale": 10.0}

    module = _Scale()
    registry = HookRegistry()
    registry.register_hook(module, "replace", Replace())
    out = module(torch.zeros(2), scale=2.0)
    torch.testing.assert_close(out, torch.full((2,), 10.0),
                               msg="pre hook replacing (args, kwargs): forward saw the originals")
    registry.remove_all()
    torch.testing.assert_close(module(torch.zeros(2), scale=2.0), torch.zeros(2),
                               msg="after removal the pre hook still replaces arguments")


def test_post_hook_can_replace_output_and_none_keeps_it() -> None:
    sentinel = torch.tensor([42.0])

    class Replace(ModelHook):
        def post_forward(self, module, args, kwargs, output):
            return sentinel

    module = _Scale()
    registry = HookRegistry()
    registry.register_hook(module, "keep", _Recorder([], "keep"))  # returns None: keeps output
    assert torch.equal(module(torch.ones(2)), torch.ones(2))
    registry.register_hook(module, "replace", Replace())
    assert module(torch.ones(2)) is sentinel, "post hook's return value did not replace the output"
    registry.remove_all()


def test_duplicate_name_raises_value_error_naming_it() -> None:
    module = _Scale()
    registry, other = HookRegistry(), HookRegistry()
    registry.register_hook(module, "offload_ref.dup", _PreOnly())
    before = _module_state(module)
    for reg in (registry, other):
        with pytest.raises(ValueError, match=r"offload_ref\.dup"):
            reg.register_hook(module, "offload_ref.dup", _Recorder([], "x"))
    assert _module_state(module) == before, "a rejected registration changed the module"
    assert hook_names(module) == ("offload_ref.dup",)
    registry.remove_all()


def test_two_registries_coexist_and_remove_only_their_own_hooks() -> None:
    log: list[str] = []
    module = _Scale(log)
    pristine = _module_state(module)
    a, b = HookRegistry(), HookRegistry()
    a.register_hook(module, "a.hook", _Recorder(log, "a"))
    b.register_hook(module, "b.hook", _Recorder(log, "b"))
    module(torch.ones(2))
    assert log == ["pre:a", "pre:b", "forward", "post:a", "post:b"], log

    a.remove_all()
    assert hook_names(module) == ("b.hook",), hook_names(module)
    assert a.installed() == []
    assert b.installed() == [(module, "b.hook")]
    log.clear()
    module(torch.ones(2))
    assert log == ["pre:b", "forward", "post:b"], f"b's hooks stopped firing after a.remove_all: {log}"

    b.remove_all()
    assert _module_state(module) == pristine
    log.clear()
    module(torch.ones(2))
    assert log == ["forward"], log


def test_removing_a_hook_of_another_registry_raises() -> None:
    module = _Scale()
    owner, intruder = HookRegistry(), HookRegistry()
    owner.register_hook(module, "owned", _Recorder([], "o"))
    with pytest.raises(RuntimeError, match="another registry"):
        intruder.remove_hook(module, "owned")
    assert hook_names(module) == ("owned",)
    intruder.remove_all()  # has nothing of its own: a no-op
    assert hook_names(module) == ("owned",)
    owner.remove_all()
    assert hook_names(module) == ()


def test_a_new_registry_reusing_a_dead_owners_id_cannot_remove_its_hooks() -> None:
    module = _Scale()
    hook = _PreOnly()

    def install_with_a_temporary_registry() -> int:
        registry = HookRegistry()
        registry.register_hook(module, "orphan", hook)
        return id(registry)

    dead_id = install_with_a_temporary_registry()  # the owner is freed on return
    keep = []
    for _ in range(1000):  # CPython reuses the freed address almost at once
        candidate = HookRegistry()
        if id(candidate) == dead_id:
            break
        keep.append(candidate)
    else:
        pytest.skip("no registry reused the collected owner's id() in this interpreter")
    with pytest.raises(RuntimeError, match="another registry"):
        candidate.remove_hook(module, "orphan")


def test_removing_the_last_hook_leaves_the_module_exactly_as_before() -> None:
    module = _Scale()
    pristine = _module_state(module)
    out_before = module(torch.arange(2.0))
    _assert_forward_untouched(module, "before registration")
    registry = HookRegistry()
    registry.register_hook(module, "pre", _PreOnly())
    registry.register_hook(module, "both", _Recorder([], "both"))
    _assert_forward_untouched(module, "with hooks installed")
    assert HOOKS_ATTR in module.__dict__
    assert set(module.__dict__) - set(pristine["dict_keys"]) == {HOOKS_ATTR}, (
        f"registration added attributes other than {HOOKS_ATTR}: "
        f"{sorted(set(module.__dict__) - set(pristine['dict_keys']))}")
    module(torch.arange(2.0))
    _assert_forward_untouched(module, "after a hooked forward")

    registry.remove_hook(module, "pre")
    assert HOOKS_ATTR in module.__dict__, "removing one of two hooks dropped the table"
    registry.remove_hook(module, "both")
    assert HOOKS_ATTR not in module.__dict__
    assert not hasattr(module, HOOKS_ATTR)
    assert not module._forward_pre_hooks and not module._forward_hooks
    assert _module_state(module) == pristine
    _assert_forward_untouched(module, "after removal")
    assert torch.equal(module(torch.arange(2.0)), out_before)
    registry.remove_hook(module, "both")  # removing what is gone is a no-op
    assert _module_state(module) == pristine


def test_hooks_are_garbage_collected_after_removal() -> None:
    module = _Scale()
    registry = HookRegistry()
    hooks = {"pre": _PreOnly(), "both": _Recorder([], "both"), "plain": ModelHook()}
    for name, hook in hooks.items():
        registry.register_hook(module, name, hook)
    module(torch.ones(2))
    refs = {name: weakref.ref(hook) for name, hook in hooks.items()}
    del hooks, hook
    gc.collect()
    assert all(r() is not None for r in refs.values()), "an installed hook was collected"
    registry.remove_hook(module, "pre")
    registry.remove_all()
    gc.collect()
    alive = [name for name, r in refs.items() if r() is not None]
    assert alive == [], f"hooks {alive} are still referenced after removal"


def test_post_hook_runs_when_forward_raises_and_the_error_propagates() -> None:
    log: list[str] = []
    module = _Boom()
    registry = HookRegistry()
    recorder = _Recorder(log, "p")
    registry.register_hook(module, "p", recorder)
    with pytest.raises(KeyError, match="boom in forward"):
        module(torch.ones(1))
    assert log == ["pre:p", "post:p"], f"post hook did not run after forward raised: {log}"
    assert recorder.outputs == [None]
    registry.remove_all()


def test_installed_lists_hooks_in_installation_order() -> None:
    m1, m2 = _Scale(), _Scale()
    registry, other = HookRegistry(), HookRegistry()
    registry.register_hook(m2, "z", _PreOnly())
    other.register_hook(m1, "other", _PreOnly())
    registry.register_hook(m1, "a", _PreOnly())
    registry.register_hook(m2, "b", _PreOnly())
    assert registry.installed() == [(m2, "z"), (m1, "a"), (m2, "b")]
    registry.remove_hook(m2, "z")
    registry.register_hook(m2, "z", _PreOnly())
    assert registry.installed() == [(m1, "a"), (m2, "b"), (m2, "z")]
    assert other.installed() == [(m1, "other")]
    assert hook_names(m1) == ("other", "a")
    registry.remove_all()
    other.remove_all()
    assert registry.installed() == [] and hook_names(m1) == () and hook_names(m2) == ()


def test_remove_all_keeps_going_after_a_failed_removal_and_raises_at_the_end() -> None:
    modules = [_Scale() for _ in range(3)]
    pristine = [_module_state(m) for m in modules]
    registry = HookRegistry()
    for i, module in enumerate(modules):
        registry.register_hook(module, f"h{i}", _Recorder([], str(i)))

    class _BadHandle:
        def remove(self) -> None:
            raise OSError("handle refuses to go")

    entry = modules[1].__dict__[HOOKS_ATTR]["h1"]
    good_handles = entry.handles
    entry.handles = (_BadHandle(),)
    with pytest.raises(RuntimeError, match="failed to remove 1 hook") as info:
        registry.remove_all()
    assert isinstance(info.value.__cause__, OSError), info.value.__cause__
    for i in (0, 2):
        assert _module_state(modules[i]) == pristine[i], f"h{i} was not removed"
    assert registry.installed() == [(modules[1], "h1")]
    entry.handles = good_handles  # repaired: a retry finishes the job
    registry.remove_all()
    assert _module_state(modules[1]) == pristine[1]
    assert registry.installed() == []


def test_offload_pre_hooks_run_before_the_modules_own_in_registration_order() -> None:
    """Note [Outermost hooks] (backends/layerwise.py): a pre-hook the module already had runs
    after every offload pre-hook, which keep the order they were installed in."""
    log: list[str] = []
    module = nn.Linear(2, 2)
    module.register_forward_pre_hook(lambda m, args: log.append("pre:user"))
    first, second = HookRegistry(), HookRegistry()
    first.register_hook(module, "a", _Recorder(log, "a"))
    second.register_hook(module, "b", _Recorder(log, "b"))
    module.register_forward_pre_hook(lambda m, args: log.append("pre:later"))
    module(torch.ones(2))
    assert log == ["pre:a", "pre:b", "pre:user", "pre:later", "post:a", "post:b"], log
    first.remove_all()
    second.remove_all()
    log.clear()
    module(torch.ones(2))
    assert log == ["pre:user", "pre:later"], log
