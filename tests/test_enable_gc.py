"""enable() runs with the automatic cyclic collector off and leaves it as it found it, whether
enable returns or raises (Note [No cyclic collection during enable] in backends/base.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.backends.base import OffloadEnableError
from offload_ref.fixtures.heavy import HeavyConfig
from offload_ref.fixtures.heavy import build_pipeline as build_heavy
from offload_ref.fixtures.many_blocks import build_pipeline
from offload_ref.platform import CpuPlatform


@pytest.fixture
def platform() -> Iterator[CpuPlatform]:
    was = gc.isenabled()
    with CpuPlatform() as p:
        yield p
    (gc.enable if was else gc.disable)()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
@pytest.mark.parametrize("collector_on", [True, False])
def test_enable_pauses_the_collector_and_restores_it(platform: CpuPlatform, strategy: str,
                                                     collector_on: bool) -> None:
    (gc.enable if collector_on else gc.disable)()
    seen: list[bool] = []
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.fault_injector = lambda i, label: seen.append(gc.isenabled())
    backend.enable(build_heavy(0, HeavyConfig(hidden=16, blocks=2)))
    try:
        assert seen and not any(seen), "the collector ran during enable"
        assert gc.isenabled() is collector_on
    finally:
        backend.disable()


def test_a_failed_enable_restores_the_collector(platform: CpuPlatform) -> None:
    gc.enable()
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)

    def fail(i: int, label: str) -> None:
        if i == 2:
            raise RuntimeError("injected")

    backend.fault_injector = fail
    with pytest.raises(OffloadEnableError):
        backend.enable(build_pipeline(0, 4))
    assert gc.isenabled()
    backend.fault_injector = None
    backend.enable(build_pipeline(0, 4))
    assert gc.isenabled()
    backend.disable()
