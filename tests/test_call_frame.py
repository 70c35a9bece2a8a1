"""``call_frame``: the hooks find the ``nn.Module`` call that runs them (Note [One thread at a
time] in call_guard.py keys every guard entry and running block by that frame)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from offload_ref.backends import call_guard
from offload_ref.backends.call_guard import call_frame


def _walk() -> object:
    """The nearest ``nn.Module._call_impl`` frame above the caller's caller, by walking."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not nn.Module._call_impl.__code__:
        frame = frame.f_back
    return frame


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_each_hook_finds_the_call_of_its_own_module() -> None:
    assert call_guard._INNER_CODE is not None  # the pinned torch: the first guess is in use
    seen: list[tuple[str, nn.Module, bool]] = []

    def record(where: str):
        def hook(module: nn.Module, *rest: object) -> None:
            frame = call_frame()
            seen.append((where, frame.f_locals["self"], frame is _walk()))
        return hook

    model = _Outer()
    for module in (model, model.inner):
        module.register_forward_pre_hook(record("pre"))
        module.register_forward_hook(record("post"), always_call=True)
    model(torch.zeros(1, 2))
    assert [(w, m) for w, m, _ in seen] == [("pre", model), ("pre", model.inner),
                                            ("post", model.inner), ("post", model)]
    assert all(same for _, _, same in seen)


def test_an_always_call_hook_after_an_exception_finds_its_call() -> None:
    # torch runs always_call hooks of a failed forward from _call_impl itself, not from inner.
    found: list[tuple[nn.Module, bool]] = []

    def post(module: nn.Module, args: tuple, output: object) -> None:
        frame = call_frame()
        found.append((frame.f_locals["self"], frame is _walk()))

    model = _Outer()
    model.inner.register_forward_pre_hook(lambda m, a: 1 / 0)
    model.inner.register_forward_hook(post, always_call=True)
    with pytest.raises(ZeroDivisionError):
        model(torch.zeros(1, 2))
    assert found == [(model.inner, True)]


def test_outside_any_module_call_there_is_none() -> None:
    assert call_frame() is None
