"""The simulated accelerator (offload_ref.platform.simulated) and the accelerator platform on it:
a second device on a CPU-only machine, bit-exact to CPU, that raises torch's same-device error
when host and device tensors meet (Contract P.1)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.contracts.case import move_to_device
from offload_ref.fixtures import SPECS
from offload_ref.platform import AcceleratorPlatform, CpuPlatform, get_platform, simulated

pytestmark = pytest.mark.skipif(
    not simulated.available(),
    reason=f"the simulated accelerator is not available: {simulated.unavailable_reason()}")

DEV = torch.device("hpu", 0)
SAME_DEVICE = "Expected all tensors to be on the same device"
CASES = [(spec, strategy) for spec in SPECS for strategy in ("model_level", "layer_wise")
         if spec.supports(strategy) and not (strategy == "model_level" and spec.name == "cosmos3")]
IDS = [f"{s.name}-{t}" for s, t in CASES]


def _cpu(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


# -- the device itself ----------------------------------------------------------------------------


def test_device_is_distinct_and_named_for_what_it_is() -> None:
    x = torch.randn(4, 8).to(DEV)
    assert x.device == DEV and x.device != torch.device("cpu")
    assert x.data_ptr() % 256 == 0
    assert torch.accelerator.current_accelerator().type == "hpu"
    assert torch.accelerator.device_count() >= 2
    assert simulated.describe_device(DEV) == "hpu:0 (offload-ref's simulated accelerator)"


@pytest.mark.parametrize("op", ["linear", "layer_norm", "sdpa", "conv2d", "gelu_tanh", "silu",
                                "group_norm", "bf16_linear", "interpolate", "softmax", "cat"])
def test_ops_are_bit_exact_to_cpu(op: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    w = torch.randn(8, 8, generator=g)
    fns = {
        "linear": lambda x, w: F.linear(x, w),
        "layer_norm": lambda x, w: F.layer_norm(x, (8,)),
        "sdpa": lambda x, w: F.scaled_dot_product_attention(x, x * 0.5, x + 1),
        "conv2d": lambda x, w: F.conv2d(x, w[:4, :4].reshape(4, 4, 1, 1).repeat(1, 1, 3, 3)),
        "gelu_tanh": lambda x, w: F.gelu(x, approximate="tanh"),
        "silu": lambda x, w: F.silu(x),
        "group_norm": lambda x, w: F.group_norm(x, 2),
        "bf16_linear": lambda x, w: F.linear(x.bfloat16(), w.bfloat16()),
        "interpolate": lambda x, w: F.interpolate(x, scale_factor=2, mode="nearest"),
        "softmax": lambda x, w: torch.softmax(x, -1),
        "cat": lambda x, w: torch.cat([x, x * 2], dim=1),
    }
    want = fns[op](x, w)
    got = fns[op](x.to(DEV), w.to(DEV))
    assert got.device == DEV, op
    assert torch.equal(got.cpu(), want), op


def test_autograd_through_sdpa_and_layer_norm_is_bit_exact() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 8, generator=g)
    qc, qd = q.clone().requires_grad_(), q.to(DEV).requires_grad_()
    for t in (qc, qd):
        F.layer_norm(F.scaled_dot_product_attention(t, t, t), (8,)).sum().backward()
    assert qd.grad is not None and qd.grad.device == DEV
    assert torch.equal(qd.grad.cpu(), qc.grad)


def test_host_tensor_meeting_a_device_weight_is_torchs_same_device_error() -> None:
    lin = nn.Linear(8, 4).to(DEV)
    with pytest.raises(RuntimeError, match=SAME_DEVICE) as raised:
        lin(torch.randn(2, 8))
    # the error says what to do: inputs on the execution device, or a host-only run
    assert "offload_ref.execution_device(pipeline)" in str(raised.value)
    assert "CpuPlatform(device='cpu') or OFFLOAD_REF_SIM=0" in str(raised.value)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.cat([torch.ones(2, device=DEV), torch.ones(2)])
    # CUDA's rules: a 0-dim host tensor and host indices are allowed
    assert (torch.ones(2, device=DEV) + torch.tensor(2.0)).device == DEV
    assert torch.ones(4, 2, device=DEV)[torch.tensor([0, 3])].shape == (2, 2)
    # two simulated devices do not mix either
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.ones(2, device="hpu:1") + torch.ones(2, device=DEV)


def test_param_data_views_storage_sharing_and_module_to_keep_identity() -> None:
    module = nn.Linear(4, 4)
    weight = module.weight
    module.to(DEV)
    assert module.weight is weight and weight.device == DEV
    p = nn.Parameter(torch.zeros(3))
    p.data = torch.ones(3, device=DEV)
    assert p.device == DEV and torch.equal(p.cpu(), torch.ones(3))
    base = torch.zeros(4, 4, device=DEV)
    view = base[1:3].t()
    view.fill_(2.0)
    assert view._base is base and base.sum().item() == 16.0
    assert base.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    base.untyped_storage().resize_(0)
    assert base.untyped_storage().nbytes() == 0
    fresh = torch.empty(0, device=DEV).set_(torch.arange(6.0).to(DEV).untyped_storage(), 2, (2,),
                                            (1,))
    assert fresh.cpu().tolist() == [2.0, 3.0]


def test_memory_statistics_count_every_device_byte() -> None:
    torch.accelerator.reset_peak_memory_stats(DEV)
    before = torch.accelerator.memory_allocated(DEV)
    x = torch.empty(1000, device=DEV)
    assert torch.accelerator.memory_allocated(DEV) == before + 4000
    y = x * 2  # a fresh result is device memory too
    assert torch.accelerator.memory_allocated(DEV) == before + 8000
    del x, y
    assert torch.accelerator.memory_allocated(DEV) == before
    assert torch.accelerator.max_memory_allocated(DEV) >= before + 8000
    assert torch.accelerator.memory_stats(DEV)["allocated_bytes.all.current"] == before


def test_device_rng_differs_from_cpu_and_torch_manual_seed_reseeds_it() -> None:
    torch.manual_seed(0)
    a = torch.randn(8, device=DEV)
    torch.manual_seed(0)
    b = torch.randn(8)
    torch.manual_seed(0)
    c = torch.randn(8, device=DEV)
    assert not torch.equal(a.cpu(), b), "a generator on the wrong device must change the numbers"
    assert torch.equal(a, c)
    gen = torch.Generator(device=DEV).manual_seed(3)
    assert gen.device == DEV
    assert torch.equal(torch.randn(4, device=DEV, generator=gen).cpu(),
                       torch.randn(4, device=DEV, generator=torch.Generator(DEV).manual_seed(3))
                       .cpu())
    with pytest.raises(RuntimeError, match="device type for generator"):
        torch.randn(4, device=DEV, generator=torch.Generator().manual_seed(3))


def test_streams_events_and_pinned_memory() -> None:
    stream = torch.Stream(device=DEV)
    start, end = torch.Event(device=DEV, enable_timing=True), torch.Event(device=DEV,
                                                                           enable_timing=True)
    start.record()
    with stream:
        assert torch.accelerator.current_stream(DEV) == stream
        torch.ones(4, device=DEV).add_(1)
        end.record()
    assert torch.accelerator.current_stream(DEV) != stream
    assert end.query() and start.elapsed_time(end) >= 0
    torch.accelerator.synchronize(DEV)
    host = torch.randn(16)
    assert not host.is_pinned() and host.pin_memory().is_pinned()
    assert torch.empty(8, pin_memory=True).is_pinned()


def test_capacity_limit_raises_out_of_memory_like_cuda() -> None:
    try:
        simulated.set_capacity(torch.accelerator.memory_allocated(DEV) + 1024)
        with pytest.raises(torch.OutOfMemoryError, match="simulated accelerator"):
            torch.empty(1 << 20, device=DEV)
        torch.empty(64, device=DEV)  # within the capacity
    finally:
        simulated.set_capacity(None)


def test_unavailable_accelerator_falls_back_to_cpu_and_says_why() -> None:
    code = ("from offload_ref.platform import simulated, get_platform; "
            "print(simulated.available()); print(simulated.unavailable_reason()); "
            "print(get_platform('cpu').device)")
    env = {**os.environ, "OFFLOAD_REF_SIM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["False", "OFFLOAD_REF_SIM=0 turns it off", "cpu"]


_LATE = """
import warnings
import torch
warnings.simplefilter("always")
torch.accelerator.current_accelerator()  # torch looks up its accelerator hooks first
from offload_ref import OffloadConfig, get_offload_backend
from offload_ref.platform import CpuPlatform
CpuPlatform(device="cpu")  # single-device, asked for: no warning
backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), device="cpu")  # line 9
print(backend.platform.device)
CpuPlatform()  # said once per process
"""


@pytest.mark.parametrize("sim", ["1", "0"])
def test_a_cpu_platform_that_falls_back_to_single_device_says_so_once(sim: str) -> None:
    """``device="cpu"`` means device storage on the simulated accelerator; when it cannot load
    (here: torch looked up its accelerator hooks first), the run is single-device and placement
    goes unchecked: a warning says why, at the caller's line, once; not when OFFLOAD_REF_SIM=0
    asked for it."""
    out = subprocess.run([sys.executable, "-c", _LATE], env={**os.environ, "OFFLOAD_REF_SIM": sim},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["cpu"], out.stdout
    warned = [line for line in out.stderr.splitlines() if "RuntimeWarning" in line]
    if sim == "0":
        assert warned == [], out.stderr
    else:
        assert len(warned) == 1, out.stderr
        assert warned[0].startswith("<string>:9: RuntimeWarning: offload-ref: host and device are "
                                    "both 'cpu'"), warned
        assert "looked up its HPU hooks" in warned[0] and "importing diffusers" in warned[0]
        assert "CpuPlatform(device='cpu')" in warned[0]


def test_a_build_killed_mid_way_never_leaves_the_next_load_waiting(tmp_path) -> None:
    """A build cut off by Ctrl-C or a kill leaves torch's build baton (a plain ``lock`` file)
    behind; before, every later process waited on it forever.  The cached build is imported
    without the baton, and a build takes an flock that dies with its process."""
    import shutil

    from offload_ref.platform.simulated import _cache_dir

    built = _cache_dir() / "offload_ref_simdevice.so"
    assert built.is_file()
    env = {**os.environ, "OFFLOAD_REF_SIM_CACHE": str(tmp_path)}
    code = ("from offload_ref.platform import simulated; "
            "print(simulated._cache_dir()); print(simulated.available())")
    folder = subprocess.run([sys.executable, "-c", "from offload_ref.platform import simulated;"
                             " print(simulated._cache_dir())"], env={**env, "OFFLOAD_REF_SIM": "0"},
                            capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(folder)
    shutil.copy(built, folder)
    open(os.path.join(folder, "lock"), "w").close()  # the killed build's baton
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out == [folder, "True"]


# -- the platforms on it ---------------------------------------------------------------------------


def test_cpu_platform_keeps_device_storage_on_the_simulated_device() -> None:
    with CpuPlatform() as platform:
        assert platform.device == DEV
        slot = platform.empty(10, torch.float32)
        assert slot.device == DEV and platform.is_resident(slot)
        assert not platform.is_resident(torch.empty(10))
        platform.free(slot)
    with CpuPlatform(device="cpu") as single:
        assert single.device == torch.device("cpu")


def test_get_platform_picks_the_accelerator_platform_for_hpu() -> None:
    platform = get_platform("hpu:1")
    assert isinstance(platform, AcceleratorPlatform)
    assert platform.device == torch.device("hpu", 1)
    slot = platform.empty(64, torch.float32)
    assert slot.device == torch.device("hpu", 1) and slot.data_ptr() % 256 == 0
    pinned = platform.host_empty(10, torch.float32, pin=True)
    assert pinned.is_pinned() and platform.pinned_bytes() >= 40
    platform.host_free(pinned)
    platform.free(slot)


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_fixture_on_the_device_is_bit_exact_to_the_host(spec) -> None:
    want = _run(spec, spec.build())
    got = _run(spec, move_to_device(spec.build(), DEV))
    assert _same(got, want), spec.name


REAL = ("real_flux", "real_sd3", "real_wan")  # diffusers' own transformer classes, tiny


@pytest.mark.parametrize("name", REAL)
def test_tiny_diffusers_pipelines_on_the_device_are_bit_exact_to_the_host(name: str) -> None:
    """diffusers' Flux, SD3 and Wan transformers (with their text encoders and a VAE), whole on
    the device against whole on the host: the device is the CPU's numerics, so any difference
    the kit reports on these pipelines is offloading's, not the device's."""
    pytest.importorskip("diffusers", reason="diffusers not installed")
    pytest.importorskip("transformers", reason="transformers not installed")
    from real_models import SPECS as REAL_SPECS  # tests/ is on sys.path

    spec = next(s for s in REAL_SPECS if s.name == name)
    want = _run(spec, spec.build())
    got = _run(spec, move_to_device(spec.build(), DEV))
    assert _same(got, want), name


def _run(spec, pipeline):
    with torch.inference_mode():
        return pipeline(**spec.make_inputs())


def _same(got, want) -> bool:
    from offload_ref.contracts.outputs import leaves as flatten_output

    g, w = flatten_output(got), flatten_output(want)
    return len(g) == len(w) and all(
        a.device == DEV and torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(g, w))


@pytest.mark.parametrize("spec,strategy", CASES, ids=IDS)
def test_accelerator_platform_runs_every_fixture_exactly_within_the_predicted_peak(
        spec, strategy: str) -> None:
    """The code path a GPU runs (torch.Stream / torch.Event / torch.accelerator) on every
    fixture: bitwise parity with the pipeline on the device, and torch's own allocator peak equal
    to the plan's prediction."""
    want = _run(spec, move_to_device(spec.build(), DEV))
    pipeline = spec.build()
    platform = AcceleratorPlatform(DEV)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    # The reference pipeline (and an earlier test's) may sit in a reference cycle: collected
    # during the generation below, its device bytes would lower the peak under the baseline.
    gc.collect()
    baseline = torch.accelerator.memory_allocated(DEV)
    backend.enable(pipeline)
    try:
        torch.accelerator.reset_peak_memory_stats(DEV)
        with torch.inference_mode():
            got = pipeline(**spec.make_inputs())
        peak = torch.accelerator.max_memory_allocated(DEV) - baseline
        weights_peak = backend.stats().peak_device_bytes
        assert weights_peak == backend.plan.predicted_device_bytes(), (spec.name, strategy)
        assert peak >= weights_peak
        assert _same_devices(got, want), (spec.name, strategy)
    finally:
        backend.disable()
    assert torch.accelerator.memory_allocated(DEV) == baseline + _bytes_of(got)
    assert all(not t.device.type == "hpu" for t in pipeline_tensors(pipeline))


def _same_devices(got, want) -> bool:
    from offload_ref.contracts.outputs import leaves as flatten_output

    g, w = flatten_output(got), flatten_output(want)
    return len(g) == len(w) and all(torch.equal(a.cpu(), b.cpu()) for (_, a), (_, b) in zip(g, w))


def _bytes_of(output) -> int:
    from offload_ref.contracts.outputs import leaves as flatten_output

    return sum(t.untyped_storage().nbytes() for _, t in flatten_output(output)
               if t.device.type == "hpu")


def pipeline_tensors(pipeline):
    from offload_ref.contracts.facts import module_view

    view = module_view(pipeline)
    return [*view.parameters(), *(b for b in view.buffers() if b is not None)]


def test_enable_under_a_capacity_too_small_rolls_back_cleanly() -> None:
    spec = next(s for s in SPECS if s.name == "sd3")
    pipeline = spec.build()
    before = {n: (p, p.data_ptr(), p.device) for n, p in pipeline.named_parameters()}
    platform = AcceleratorPlatform(DEV)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    baseline = torch.accelerator.memory_allocated(DEV)
    try:
        simulated.set_capacity(baseline + 1024)
        with pytest.raises(Exception) as info:
            backend.enable(pipeline)
        chain, exc = [], info.value
        while exc is not None:
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        assert any(isinstance(e, torch.OutOfMemoryError) for e in chain), chain
    finally:
        simulated.set_capacity(None)
    assert not backend.is_enabled()
    assert torch.accelerator.memory_allocated(DEV) == baseline
    after = {n: (p, p.data_ptr(), p.device) for n, p in pipeline.named_parameters()}
    assert after == before
    backend.enable(pipeline)  # and it can be retried once the memory is there
    backend.disable()


def test_the_first_build_says_it_is_compiling_before_the_wait(tmp_path, monkeypatch, capsys
                                                              ) -> None:
    """The first use compiles for most of a minute: a line says so before it starts and when it
    ends (no compiler runs here: torch's build is replaced by a stand-in)."""
    from torch.utils import cpp_extension

    from offload_ref.platform import simulated as sim

    built = object()
    calls = []

    def fake_load(**kwargs):
        calls.append(kwargs["build_directory"])
        assert "compiling the simulated accelerator" in capsys.readouterr().err  # said first
        return built

    monkeypatch.setattr(sim, "_cache_dir", lambda: tmp_path / "fresh")
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert sim._built_extension() is built
    assert calls == [str(tmp_path / "fresh")]
    assert "compiled the simulated accelerator in" in capsys.readouterr().err


# -- who may write the build cache (Note [Who may write the build cache]) -------------------------

_PROBE = ("from offload_ref.platform import simulated; print(simulated.available()); "
          "print(simulated.unavailable_reason())")


def _probe(env: dict[str, str]) -> list[str]:
    return subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env},
                          capture_output=True, text=True, check=True, timeout=120
                          ).stdout.splitlines()


def _planted_cache(tmp_path) -> tuple[str, str]:
    """A cache folder under ``tmp_path`` holding a copy of the real build, as the loader would
    find it: (its folder, the library)."""
    import shutil

    from offload_ref.platform.simulated import _cache_dir

    folder = subprocess.run([sys.executable, "-c", "from offload_ref.platform import simulated;"
                             " print(simulated._cache_dir())"],
                            env={**os.environ, "OFFLOAD_REF_SIM_CACHE": str(tmp_path),
                                 "OFFLOAD_REF_SIM": "0"},
                            capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(folder)
    library = shutil.copy(_cache_dir() / "offload_ref_simdevice.so", folder)
    return folder, library


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX ownership")
def test_a_cache_folder_others_can_write_is_never_loaded_from(tmp_path) -> None:
    folder, _ = _planted_cache(tmp_path)
    os.chmod(folder, 0o777)
    available, reason = _probe({"OFFLOAD_REF_SIM_CACHE": str(tmp_path)})
    assert available == "False"
    assert f"cache folder {folder} is writable by others" in reason and "chmod go-w" in reason
    os.chmod(folder, 0o755)
    assert _probe({"OFFLOAD_REF_SIM_CACHE": str(tmp_path)})[0] == "True"  # the same, owned


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="giving a file to another user needs root")
def test_a_library_another_user_owns_is_never_loaded(tmp_path) -> None:
    _, library = _planted_cache(tmp_path)
    os.chown(library, 65534, 65534)  # nobody
    available, reason = _probe({"OFFLOAD_REF_SIM_CACHE": str(tmp_path)})
    assert available == "False"
    assert f"built library {library} belongs to another user" in reason, reason


def test_a_symlinked_build_lock_is_refused_and_its_target_untouched(tmp_path, monkeypatch
                                                                    ) -> None:
    from torch.utils import cpp_extension

    from offload_ref.platform import simulated as sim

    folder = tmp_path / "fresh"
    folder.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("x" * 1500)
    (folder / "build.lock").symlink_to(target)
    monkeypatch.setattr(sim, "_cache_dir", lambda: folder)
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: pytest.fail("built"))
    with pytest.raises(sim.SimulatedAcceleratorUnavailable, match="a symlink is refused"):
        sim._built_extension()
    assert target.read_text() == "x" * 1500


@pytest.mark.parametrize("raw", ["abc", "1e9", "-5", "0"])
def test_a_malformed_capacity_is_a_reason_naming_the_variable(raw: str) -> None:
    available, reason = _probe({"OFFLOAD_REF_SIM_CAPACITY": raw})
    assert available == "False" and reason.startswith("OFFLOAD_REF_SIM_CAPACITY="), reason
