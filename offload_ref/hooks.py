"""Named forward hooks on torch's native hook handles.

A :class:`ModelHook` is a pair of small callbacks; :class:`HookRegistry` installs it on a module
under a name with ``register_forward_pre_hook`` / ``register_forward_hook`` and keeps the handles.
Nothing wraps or replaces ``module.forward``.  A module with hooks carries one attribute,
``_offload_ref_hooks`` (name -> entry), so leaks are findable; removing its last hook deletes it and
leaves the module exactly as it was.  Each backend owns one registry and removes only the hooks it
registered, so backends with distinct hook names never disturb one another.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HOOKS_ATTR", "PIPELINE_ATTR", "HookRegistry", "ModelHook", "after_offload", "hook_names"]

HOOKS_ATTR = "_offload_ref_hooks"
#: Set on the pipeline while a backend owns it (at most one strategy owns offload hooks).
PIPELINE_ATTR = "_offload_ref_backend"
_AFTER_ATTR = "_offload_ref_after_offload"


def after_offload(hook: Any) -> Any:
    """Mark a torch forward hook to run after the offloader's post-hook (an observer of what the
    offloader leaves, such as the kit's residency checks); unmarked hooks run before it, with
    the weights still in place (Note [Outermost hooks] in backends/layerwise.py).  Returns
    ``hook``."""
    setattr(hook, _AFTER_ATTR, True)
    return hook


def runs_after_offload(hook: Any) -> bool:
    return getattr(hook, _AFTER_ATTR, False) is True


class ModelHook:
    """Callbacks around one module's forward.  Override what you need.

    ``pre_forward`` may return replacement ``(args, kwargs)``; ``post_forward`` may return a
    replacement output.  ``None`` keeps the originals.
    """

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        return None

    def post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return None

    #: The id of the torch forward hook that runs ``post_forward`` on the module this hook was
    #: last installed on (set by :meth:`HookRegistry.register_hook`).
    post_hook_id: int | None = None


@dataclass
class _Entry:
    hook: ModelHook
    handles: tuple[RemovableHandle, ...]
    owner: object  # the installing registry's token (an id() could be reused after GC)
    pre_id: int | None = None  # the torch pre-hook's id in ``module._forward_pre_hooks``


def _overrides(hook: ModelHook, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(ModelHook, name)


def hook_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the offload hooks currently installed on ``module`` (any registry)."""
    return tuple(module.__dict__.get(HOOKS_ATTR, {}))


class HookRegistry:
    """Installs and removes named :class:`ModelHook` s; remembers what it installed."""

    def __init__(self) -> None:
        # (id(module), name) -> (module, name), in installation order; a dict, so that removing
        # one of n hooks costs O(1), not a rebuilt list (a failed enable's rollback removes
        # them one by one)
        self._installed: dict[tuple[int, str], tuple[weakref.ref[nn.Module], str]] = {}
        self._token = object()

    def register_hook(self, module: nn.Module, name: str, hook: ModelHook) -> None:
        table: dict[str, _Entry] = module.__dict__.get(HOOKS_ATTR, {})
        if name in table:
            raise ValueError(
                f"a hook named {name!r} is already installed on {type(module).__name__}; "
                "remove it first (each backend uses distinct hook names)"
            )
        handles = []
        pre_id = None
        # The bound methods themselves (no wrapper frame per call): they keep the hook alive
        # exactly as long as the handles do.  The pre-hook goes before every hook that is not an
        # offload hook (a hook the module already has may read the weights the offloader is
        # about to place), after the offload hooks already installed (registration order).
        try:
            if _overrides(hook, "pre_forward"):
                handles.append(module.register_forward_pre_hook(hook.pre_forward,
                                                                with_kwargs=True, prepend=True))
                pre_id = handles[-1].id
                pre_hooks = module._forward_pre_hooks
                for entry in reversed(list(table.values())):
                    if entry.pre_id in pre_hooks:
                        pre_hooks.move_to_end(entry.pre_id, last=False)
            if _overrides(hook, "post_forward"):
                handles.append(module.register_forward_hook(hook.post_forward, with_kwargs=True,
                                                            always_call=True))
                hook.post_hook_id = handles[-1].id
            entry = _Entry(hook, tuple(handles), self._token, pre_id)
            # One line: listed in the table and in this registry together, the table stored
            # on the module if it is new (nothing half-registered if an exception comes first).
            table[name] = entry; self._installed.pop(key := (id(module), name), None); self._installed[key] = (weakref.ref(module), name); module.__dict__.setdefault(HOOKS_ATTR, table)  # noqa: E702,E501
        except BaseException:
            for h in handles:
                h.remove()
            raise

    def get_hook(self, module: nn.Module, name: str) -> ModelHook | None:
        entry = module.__dict__.get(HOOKS_ATTR, {}).get(name)
        return None if entry is None else entry.hook

    def remove_hook(self, module: nn.Module, name: str) -> None:
        table: dict[str, _Entry] = module.__dict__.get(HOOKS_ATTR, {})
        entry = table.get(name)
        if entry is None:
            return
        if entry.owner is not self._token:
            raise RuntimeError(
                f"hook {name!r} on {type(module).__name__} belongs to another registry; a backend "
                "removes only its own hooks"
            )
        for handle in entry.handles:
            handle.remove()
        del table[name]
        if not table:
            del module.__dict__[HOOKS_ATTR]
        key = (id(module), name)
        mine = self._installed.get(key)
        if mine is not None and mine[0]() is module:
            del self._installed[key]

    def installed(self) -> list[tuple[nn.Module, str]]:
        """The hooks this registry installed that are still in place, in installation order."""
        out = []
        for ref, name in self._installed.values():
            module = ref()
            if module is not None and name in module.__dict__.get(HOOKS_ATTR, {}):
                out.append((module, name))
        return out

    def remove_all(self) -> None:
        """Remove every hook this registry installed (newest first); raise after trying all."""
        errors = []
        for module, name in reversed(self.installed()):
            try:
                self.remove_hook(module, name)
            except Exception as exc:  # keep going: a partial removal is worse than a late error
                errors.append(exc)
        if errors:
            raise RuntimeError(f"failed to remove {len(errors)} hook(s): {errors}") from errors[0]
