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
