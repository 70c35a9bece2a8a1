"""Host bytes and the host budget (issue 38, item 4; Note [Host bytes] in
offload_ref/plan/prediction.py, Note [Host budget] in offload_ref/host.py): the resolved plan
predicts the host bytes enable() allocates, the platform measures exactly that, and a plan over
``OffloadConfig.host_budget_bytes`` (or the room left in the container's memory limit) is refused
before anything is allocated."""

from __future__ import annotations

import pytest
import torch

from offload_ref import HostBudgetError, OffloadConfig, get_offload_backend, resolve_offload_plan
from offload_ref import host as host_module
from offload_ref.config import OffloadStrategy
from offload_ref.fixtures import SPECS, get_spec
from offload_ref.plan import selectable_components
from offload_ref.platform import CpuPlatform
from device_helpers import SIMULATED, kit_device  # noqa: E402 (tests/ is on sys.path)

_CASES = [(spec.name, strategy) for spec in SPECS for strategy in ("model_level", "layer_wise")
          if spec.supports(strategy)]


def _config(pipeline, strategy: str, **extra) -> OffloadConfig:
    s = OffloadStrategy(strategy)
    return OffloadConfig(strategy=s, components=selectable_components(pipeline, s), **extra)


def _platforms():
    yield "cpu", CpuPlatform(device=kit_device())
    if SIMULATED:
        from offload_ref.platform.accelerator import AcceleratorPlatform

        yield "accelerator", AcceleratorPlatform(kit_device())


@pytest.mark.parametrize("name, strategy", _CASES)
def test_measured_host_bytes_equal_the_plans_prediction(name: str, strategy: str) -> None:
    """On the CPU platform (nothing pinned) and on the accelerator platform over the simulated
    device (every master pinned): ``platform.host_allocated()`` after enable is the plan's
    ``predicted_host_bytes()``, and so are the pinned bytes where the platform pins."""
    for kind, platform in _platforms():
        pipeline = get_spec(name).build()
        config = _config(pipeline, strategy)
        plan = resolve_offload_plan(pipeline, config, alignment=platform.alignment)
        backend = get_offload_backend(config, platform=platform)
        try:
            backend.enable(pipeline)
            predicted = plan.predicted_host_bytes()
            if plan.delegated:  # a split model's own offload allocates: not predicted
                assert predicted is None
                continue
            assert predicted and platform.host_allocated() == predicted, (kind, plan.describe())
            stats = backend.stats()
            assert stats.host_bytes + stats.host_padding_bytes == predicted
            want_pinned = predicted if platform.pin_memory_supported else 0
            assert platform.pinned_bytes() == want_pinned, kind
        finally:
            backend.disable()
            platform.close()


def _tensor_state(pipeline) -> list[tuple[int, torch.device, int]]:
    return [(id(t), t.device, t.untyped_storage().data_ptr())
            for t in (*pipeline.parameters(), *pipeline.buffers())]


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_a_plan_over_the_host_budget_is_refused_before_any_allocation(strategy: str) -> None:
    pipeline = get_spec("flux2").build()
    need = resolve_offload_plan(pipeline, _config(pipeline, strategy)).predicted_host_bytes()
    before = _tensor_state(pipeline)
    platform = CpuPlatform(device=kit_device())
    backend = get_offload_backend(_config(pipeline, strategy, host_budget_bytes=need - 1),
                                  platform=platform)
    try:
        with pytest.raises(HostBudgetError) as info:
            backend.enable(pipeline)
        message = str(info.value)
        assert f"{need} host bytes" in message and f"budget of {need - 1} bytes" in message
        assert "OffloadConfig.host_budget_bytes" in message and "transformer" in message
        assert "nothing was allocated" in message
        assert (platform.host_allocated(), platform.memory_allocated()) == (0, 0)
        assert not backend.is_enabled() and _tensor_state(pipeline) == before
        # exactly the need fits
        fits = get_offload_backend(_config(pipeline, strategy, host_budget_bytes=need),
                                   platform=platform)
        fits.enable(pipeline)
        assert platform.host_allocated() == need
        fits.disable()
    finally:
        platform.close()


class _RoundingPlatform(CpuPlatform):
    """A CPU platform that says it pins, and locks each pinned request as a power of two."""

    pin_memory_supported = True

    def host_lock_bytes(self, nbytes: int) -> int:
        return 1 << (nbytes - 1).bit_length()


def test_pinned_requests_count_as_the_platform_locks_them() -> None:
    pipeline = get_spec("flux2").build()
    plan = resolve_offload_plan(pipeline, _config(pipeline, "layer_wise"))
    requested = plan.predicted_host_bytes()
    locked = sum(1 << (n - 1).bit_length() for _, n in plan.host_allocations)
    assert locked > requested
    platform = _RoundingPlatform(device=kit_device())
    try:
        refused = get_offload_backend(_config(pipeline, "layer_wise", host_budget_bytes=requested),
                                      platform=platform)
        with pytest.raises(HostBudgetError, match=f"would allocate {locked} host bytes .*"
                                                  f"{requested} requested"):
            refused.enable(pipeline)
        # unpinned, the same budget holds the requests
        unpinned = get_offload_backend(_config(pipeline, "layer_wise", pin_memory=False,
                                               host_budget_bytes=requested), platform=platform)
        unpinned.enable(pipeline)
        unpinned.disable()
    finally:
        platform.close()


def test_the_default_budget_is_the_room_left_in_the_container(monkeypatch) -> None:
    pipeline = get_spec("flux2").build()
    need = resolve_offload_plan(pipeline, _config(pipeline, "model_level")).predicted_host_bytes()
    limit = 16 * need
    monkeypatch.setattr(host_module, "container_memory", lambda: (limit, limit - need))
    platform = CpuPlatform(device=kit_device())
    try:
        with pytest.raises(HostBudgetError, match="room left in this container's memory limit"):
            get_offload_backend(_config(pipeline, "model_level"), platform=platform).enable(
                pipeline)
        monkeypatch.setattr(host_module, "container_memory", lambda: (limit, 0))
        backend = get_offload_backend(_config(pipeline, "model_level"), platform=platform)
        backend.enable(pipeline)
        backend.disable()
        monkeypatch.setattr(host_module, "container_memory", lambda: None)  # no limit
        assert host_module.host_budget(None) is None
    finally:
        platform.close()


def _cgroup(tmp_path, lines: str, files: dict[str, str]):
    tmp_path.mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(lines)
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return host_module.container_memory(str(tmp_path / "fs"), str(proc))


def test_container_memory_reads_cgroup_v2_and_v1(tmp_path) -> None:
    assert _cgroup(tmp_path / "a", "0::/job\n", {"job/memory.max": "1000\n",
                                                  "job/memory.current": "250\n"}) == (1000, 250)
    assert _cgroup(tmp_path / "b", "0::/job\n", {"job/memory.max": "max\n",
                                                  "job/memory.current": "250\n"}) is None
    assert _cgroup(tmp_path / "c", "4:memory:/job\n1:cpu:/other\n",
                   {"memory/job/memory.limit_in_bytes": "2048\n",
                    "memory/job/memory.usage_in_bytes": "1024\n"}) == (2048, 1024)
    assert _cgroup(tmp_path / "d", "4:memory:/job\n",
                   {"memory/job/memory.limit_in_bytes": str(2**63 - 4096),
                    "memory/job/memory.usage_in_bytes": "1"}) is None
    assert _cgroup(tmp_path / "e", "0::/gone\n", {}) is None
    assert host_module.container_memory(str(tmp_path), str(tmp_path / "missing")) is None


def test_the_plan_states_its_host_bound() -> None:
    pipeline = get_spec("flux2").build()
    plan = resolve_offload_plan(pipeline, _config(pipeline, "layer_wise"))
    assert f"predicted host bytes: {plan.predicted_host_bytes()} in " \
           f"{len(plan.host_allocations)} host master buffers" in plan.describe()


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1"])
def test_the_budget_must_be_a_positive_int(bad) -> None:
    with pytest.raises(ValueError, match="host_budget_bytes"):
        OffloadConfig(strategy="layer_wise", components=("dit",), host_budget_bytes=bad)


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_file_backed_weights_cost_only_their_groups_other_tensors(strategy, tmp_path) -> None:
    """Weights loaded from a safetensors file (file pages): a streamed block's tensors are served
    from the pages, so the host bytes are the exact-size copies of what is not on them (the
    non-persistent buffers); the prediction says so, and the CPU platform (which keeps no pinned
    staging pool) measures it."""
    from safetensors.torch import save_file

    from offload_ref import is_file_backed, load_safetensors

    pipeline = get_spec("flux2").build()
    path = tmp_path / "flux2.safetensors"
    save_file({k: v.contiguous() for k, v in pipeline.state_dict().items()}, str(path))
    load_safetensors(pipeline, path)
    assert any(is_file_backed(t) for t in pipeline.parameters())
    config = _config(pipeline, strategy)
    plan = resolve_offload_plan(pipeline, config)
    platform = CpuPlatform(device=kit_device())
    backend = get_offload_backend(config, platform=platform)
    try:
        backend.enable(pipeline)
        assert platform.host_allocated() == plan.predicted_host_bytes(), plan.host_allocations
        assert backend.stats().staging_pool_bytes == 0
    finally:
        backend.disable()
        platform.close()
