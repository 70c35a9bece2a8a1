"""load_safetensors: a module's weights as memory-mapped views of safetensors files.

Under test: every persistent tensor is rebound to a file view keeping its Python object and
requires_grad (CPU-built and meta-built modules, inference tensors); tied Parameters stay one
object whichever of their names the file holds; non-persistent buffers keep their exact bits;
``post_load_weights`` hooks run deepest first, once each, and what they do survives; every
validation names the dotted path, the file and the fix, and changes nothing; a failure while
binding or in a hook (RuntimeError or KeyboardInterrupt) restores every object, storage, value and
registration; ``is_file_backed`` follows the tensor's current storage; and anonymous RSS stays flat
for a meta-built model while the same weights built on the CPU grow it (Linux only).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from offload_ref import LoadReport, anonymous_rss_bytes, is_file_backed, load_safetensors
from offload_ref import loading

# -- models ------------------------------------------------------------------------------------


class Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class TimeEmbedder(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, dim)

    def post_load_weights(self) -> None:
        self.to(torch.float32)  # timestep embeddings need fp32

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.fc(t.float())


class Tiny(nn.Module):
    """A persistent buffer, a non-persistent one, a tied Parameter and a post-load hook."""

    def __init__(self, dim: int = 32, rope: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(16, dim)
        self.time = TimeEmbedder(dim)
        self.tok = nn.Embedding(16, dim)
        self.head = nn.Linear(dim, 16, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter under two names
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        if rope:
            self.rope = Rotary(dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) + self.time(t).to(x.dtype)
        if hasattr(self, "rope"):
            h = h * torch.cos(self.rope.inv_freq).repeat(2).to(x.dtype)
        return self.head(h * self.scale)


def _tiny(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu", **kw) -> Tiny:
    torch.manual_seed(seed)
    with torch.device(device):
        m = Tiny(**kw).to(dtype)
    with torch.no_grad():
        if device != "meta":
            m.scale.mul_(seed + 1)
    return m


def _save(model: nn.Module, path: Path, *, prefix: str = "", drop: tuple[str, ...] = (),
          extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Save ``model`` like a checkpoint: a tied tensor once, under its first name."""
    seen, out = set(), {}
    for name, t in model.state_dict().items():
        if name in drop or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        out[prefix + name] = t.contiguous().clone()
    out.update(extra or {})
    save_file(out, str(path))
    return path


def _state(model: nn.Module) -> dict[str, tuple[int, int, torch.Tensor, bool, torch.dtype]]:
    """name -> (object id, storage address, value copy, requires_grad, dtype), every tensor."""
    return {n: (id(t), t.untyped_storage().data_ptr() if t.device.type != "meta" else 0,
                t.detach().clone() if t.device.type != "meta" else None, t.requires_grad, t.dtype)
            for n, t in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]}


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _state(model)
    assert after.keys() == before.keys()
    for name, (oid, ptr, value, grad, dtype) in before.items():
        a_oid, a_ptr, a_value, a_grad, a_dtype = after[name]
        assert (a_oid, a_ptr, a_grad, a_dtype) == (oid, ptr, grad, dtype), name
        if value is not None:
            assert torch.equal(a_value.view(torch.uint8), value.view(torch.uint8)), name


def _inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(4, 16, generator=g).to(dtype), torch.randn(4, 8, generator=g)


@pytest.fixture
def ckpt(tmp_path: Path) -> tuple[Tiny, Path]:
    twin = _tiny(0)
    return twin, _save(twin, tmp_path / "tiny.safetensors")


# -- binding -----------------------------------------------------------------------------------


def test_cpu_built_module_is_rebound_to_the_file_keeping_objects(ckpt) -> None:
    twin, path = ckpt
    model = _tiny(1)
    model.proj.bias.requires_grad_(False)
    objects = {n: id(t) for n, t in model.named_parameters(remove_duplicate=False)}
    buffers = {n: id(t) for n, t in model.named_buffers(remove_duplicate=False)}

    report = load_safetensors(model, path)

    assert isinstance(report, LoadReport)
    assert report.files == (str(path),)
    assert report.tensors == 6  # proj.{weight,bias}, time.fc.{weight,bias}, tok.weight, scale
    assert {n: id(t) for n, t in model.named_parameters(remove_duplicate=False)} == objects
    assert {n: id(t) for n, t in model.named_buffers(remove_duplicate=False)} == buffers
    assert model.proj.weight.requires_grad and not model.proj.bias.requires_grad
    for name, t in twin.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    for name, t in model.state_dict().items():
        assert is_file_backed(t) == (name != "rope.inv_freq"), name
    assert report.file_backed_bytes == sum(
        t.numel() * t.element_size() for n, t in model.named_parameters()) + model.scale.nbytes
    assert report.post_load_hooks == ("time",)
    x, t = _inputs()
    assert torch.equal(model(x, t), twin(x, t))


def test_meta_built_module_is_materialized_from_the_file(ckpt) -> None:
    twin, path = ckpt
    model = _tiny(1, device="meta", rope=False)
    model.rope = Rotary(32)  # a non-persistent buffer is re-created on the CPU, as advised
    objects = {n: id(t) for n, t in model.named_parameters(remove_duplicate=False)}
    model.proj.weight.requires_grad_(False)
    model.proj.weight.tag = "kept"  # attributes of a swapped Parameter survive

    report = load_safetensors(model, path)

    assert report.tensors == 6
    assert {n: id(t) for n, t in model.named_parameters(remove_duplicate=False)} == objects
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert type(model.proj.weight) is nn.Parameter and model.proj.weight.tag == "kept"
    assert not model.proj.weight.requires_grad and model.proj.bias.requires_grad
    assert all(is_file_backed(t) for n, t in model.state_dict().items() if n != "rope.inv_freq")
    x, t = _inputs()
    assert torch.equal(model(x, t), twin(x, t))


def test_inference_mode_module_loads_and_runs_outside_inference_mode(ckpt) -> None:
    twin, path = ckpt
    with torch.inference_mode():
        model = _tiny(1)
    load_safetensors(model, path)
    assert is_file_backed(model.proj.weight) and not model.proj.weight.is_inference()
    x, t = _inputs()
    assert torch.equal(model(x, t), twin(x, t))


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("saved_as", ["tok.weight", "head.weight"])
def test_tied_parameter_stays_one_object_whichever_name_the_file_holds(
        tmp_path: Path, device: str, saved_as: str) -> None:
    twin = _tiny(0)
    other = "head.weight" if saved_as == "tok.weight" else "tok.weight"
    path = _save(twin, tmp_path / "t.safetensors", drop=("tok.weight",),
                 extra={saved_as: twin.tok.weight.detach().clone()})
    model = _tiny(1, device=device, rope=device == "cpu")
    if device == "meta":
        model.rope = Rotary(32)
    tied = model.tok.weight

    report = load_safetensors(model, path)

    assert model.tok.weight is tied and model.head.weight is tied, other
    assert model.head.weight.untyped_storage().data_ptr() == model.tok.weight.data_ptr()
    assert is_file_backed(tied) and torch.equal(tied, twin.tok.weight)
    assert report.tensors == 6


def test_both_names_of_a_tied_parameter_in_the_file_are_one_tensor(tmp_path: Path) -> None:
    twin = _tiny(0)
    path = _save(twin, tmp_path / "t.safetensors",
                 extra={"head.weight": twin.tok.weight.detach().clone()})
    model = _tiny(1)
    assert load_safetensors(model, path).tensors == 6  # head.weight is not "unexpected"
    assert model.head.weight is model.tok.weight


def test_non_persistent_buffer_keeps_its_exact_bits(ckpt) -> None:
    _, path = ckpt
    model = _tiny(1)
    buf = model.rope.inv_freq
    bits = buf.clone()
    load_safetensors(model, path)
    assert model.rope.inv_freq is buf and not is_file_backed(buf)
    assert torch.equal(buf.view(torch.int32), bits.view(torch.int32))


def test_non_persistent_buffer_wiped_by_a_hook_is_restored_with_a_warning(ckpt) -> None:
    _, path = ckpt
    model = _tiny(1)
    buf = model.rope.inv_freq
    storage, bits = buf.data_ptr(), buf.clone()

    def wipe() -> None:  # a naive "materialize" step
        model.rope.inv_freq.zero_()
        model.rope.register_buffer("inv_freq", torch.empty(16), persistent=False)

    model.rope.post_load_weights = wipe
    with pytest.warns(UserWarning, match=r"rope\.inv_freq.*restored"):
        report = load_safetensors(model, path)
    assert report.post_load_hooks == ("time", "rope")  # in registration order
    assert model.rope.inv_freq is buf and buf.data_ptr() == storage
    assert torch.equal(buf.view(torch.int32), bits.view(torch.int32))


# -- post_load_weights --------------------------------------------------------------------------


def test_post_load_cast_survives_and_leaves_the_file(tmp_path: Path) -> None:
    twin = _tiny(0, dtype=torch.bfloat16)
    path = _save(twin, tmp_path / "bf16.safetensors")
    model = _tiny(1, dtype=torch.bfloat16, device="meta", rope=False)
    model.rope = Rotary(32).to(torch.bfloat16)
    report = load_safetensors(model, path)

    assert report.post_load_hooks == ("time",)
    assert model.time.fc.weight.dtype == torch.float32 and model.proj.weight.dtype == torch.bfloat16
    assert torch.equal(model.time.fc.weight, twin.time.fc.weight.float())
    assert not is_file_backed(model.time.fc.weight) and is_file_backed(model.proj.weight)
    assert report.file_backed_bytes == sum(
        t.nbytes for n, t in model.state_dict().items()
        if not n.startswith(("time.", "rope.", "head.")))  # head.weight is tok.weight


class _Logged(nn.Module):
    def __init__(self, log: list[str], name: str, *children: nn.Module) -> None:
        super().__init__()
        self.name, self.log = name, log
        self.lin = nn.Linear(2, 2)
        self.kids = nn.ModuleList(children)

    def post_load_weights(self) -> None:
        self.log.append(self.name)


def test_post_load_hooks_run_deepest_first_once_each(tmp_path: Path) -> None:
    log: list[str] = []
    shared = _Logged(log, "shared")
    model = _Logged(log, "root", _Logged(log, "a", shared), _Logged(log, "b", shared))
    holder = nn.Module()
    holder.post_load_weights = nn.Linear(1, 1)  # a submodule of that name is not a hook
    model.kids.append(holder)
    path = _save(model, tmp_path / "l.safetensors")
    report = load_safetensors(model, path)
    assert log == ["shared", "a", "b", "root"]
    assert report.post_load_hooks == ("kids.0.kids.0", "kids.0", "kids.1", "")


# -- validation ---------------------------------------------------------------------------------


def _rejects(model: nn.Module, paths, *patterns: str, exc=ValueError, **kw) -> str:
    before = _state(model)
    with pytest.raises(exc) as info:
        load_safetensors(model, paths, **kw)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, (pattern, message)
    _assert_unchanged(model, before)
    return message


def test_missing_and_unexpected_keys_are_reported_together(tmp_path: Path) -> None:
    twin = _tiny(0)
    path = _save(twin, tmp_path / "m.safetensors", drop=("proj.bias",),
                 extra={"proj.gain": torch.ones(3)})
    _rejects(_tiny(1), path, "2 problem(s)", "missing: 'proj.bias'", str(path),
             "unexpected: 'proj.gain'", "strict=False", "nothing was changed")


def test_module_and_file_problems_are_one_error(tmp_path: Path) -> None:
    path = _save(_tiny(0), tmp_path / "m.safetensors", drop=("proj.bias",))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 3)
    _rejects(_tiny(1, device="meta"), path, "2 problem(s)", "'rope.inv_freq' is on the meta",
             "missing: 'proj.bias'")
    _rejects(_tiny(1, device="meta"), [path, junk], "2 problem(s)",
             "'rope.inv_freq' is on the meta", f"cannot read {str(junk)!r}")


def test_missing_tied_parameter_names_every_name(tmp_path: Path) -> None:
    path = _save(_tiny(0), tmp_path / "m.safetensors", drop=("tok.weight", "head.weight"))
    _rejects(_tiny(1), path, "'tok.weight' (tied: 'head.weight')", "key 'tok.weight', "
             "'head.weight'")


def test_strict_false_skips_missing_and_unexpected_keys(tmp_path: Path) -> None:
    twin = _tiny(0)
    path = _save(twin, tmp_path / "m.safetensors", drop=("proj.bias",),
                 extra={"proj.gain": torch.ones(3)})
    model = _tiny(1)
    bias, value = model.proj.bias, model.proj.bias.detach().clone()
    report = load_safetensors(model, path, strict=False)
    assert report.tensors == 5
    assert model.proj.bias is bias and torch.equal(bias, value) and not is_file_backed(bias)
    assert is_file_backed(model.proj.weight)


@pytest.mark.parametrize("strict", [True, False])
def test_shape_and_dtype_mismatches_are_never_skipped(tmp_path: Path, strict: bool) -> None:
    twin = _tiny(0)
    path = _save(twin, tmp_path / "m.safetensors", drop=("proj.weight", "scale"),
                 extra={"proj.weight": torch.zeros(32, 15), "scale": torch.zeros(32).half()})
    _rejects(_tiny(1), path, "mismatch: 'proj.weight' expects shape (32, 16) dtype torch.float32",
             f"'proj.weight' in {str(path)!r} has shape (32, 15)",
             "'scale' expects shape (32,) dtype torch.float32", "dtype torch.float16",
             "checkpoint's config and dtype", strict=strict)


def test_key_in_two_shards_names_both_files(tmp_path: Path) -> None:
    twin = _tiny(0)
    a = _save(twin, tmp_path / "a.safetensors")
    b = _save(twin, tmp_path / "b.safetensors", drop=tuple(twin.state_dict()),
              extra={"proj.bias": torch.zeros(32)})
    _rejects(_tiny(1), [a, b], f"'proj.bias' is in both {str(a)!r} and {str(b)!r}",
             "remove it from one shard")


def test_sharded_checkpoint_with_a_prefix(tmp_path: Path) -> None:
    twin = _tiny(0)
    names = [n for n in twin.state_dict() if n not in ("head.weight", "rope.inv_freq")]
    first = tuple(names[: len(names) // 2])
    second = tuple(n for n in twin.state_dict() if n not in first and n != "head.weight")
    a = _save(twin, tmp_path / "a.safetensors", prefix="transformer.", drop=second,
              extra={"text_encoder.w": torch.ones(2)})  # another component's key: not ours
    b = _save(twin, tmp_path / "b.safetensors", prefix="transformer.", drop=first)
    model = _tiny(1)
    report = load_safetensors(model, [a, str(b)], prefix="transformer.")
    assert report.files == (str(a), str(b)) and report.tensors == 6
    x, t = _inputs()
    assert torch.equal(model(x, t), twin(x, t))
    _rejects(_tiny(1), [a, b], "missing: 'proj.weight'", "fix prefix=")


@pytest.mark.parametrize("kw, patterns", [
    ({"tensor_parallel_size": 2}, ["tensor_parallel_size=2 is not supported",
                                   "not this rank's shard", "tensor_parallel_size=1"]),
    ({"quantization": "fp8"}, ["quantization='fp8' is not supported", "no longer be the file's",
                               "quantization=None"]),
])
def test_tensor_parallel_and_quantization_are_rejected(ckpt, kw, patterns) -> None:
    _, path = ckpt
    _rejects(_tiny(1), path, *patterns, **kw)


def test_bad_arguments_are_rejected(ckpt, tmp_path: Path) -> None:
    _, path = ckpt
    with pytest.raises(TypeError, match="loads into an nn.Module, got dict"):
        load_safetensors({"w": torch.ones(1)}, path)
    _rejects(_tiny(1), [], "paths is empty")
    _rejects(_tiny(1), [path, str(path)], "listed twice")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    _rejects(_tiny(1), tmp_path / "junk.safetensors", "cannot read",
             str(tmp_path / "junk.safetensors"))
    _rejects(_tiny(1), tmp_path / "absent.safetensors", "cannot read", "absent.safetensors")


def test_non_persistent_buffer_on_meta_is_rejected_with_the_fix(ckpt) -> None:
    _, path = ckpt
    _rejects(_tiny(1, device="meta"), path, "non-persistent buffer 'rope.inv_freq' is on the meta",
             "Build the module on the CPU", "Rotary.register_buffer('inv_freq'",
             "persistent=False)", "persistent=True")


def test_offloaded_module_is_rejected(ckpt) -> None:
    _, path = ckpt
    model = _tiny(1)
    model.proj.__dict__["_offload_ref_hooks"] = {"layerwise": object()}
    _rejects(model, path, "offloading is enabled on 'proj'", "disable offloading first")


def test_tensor_left_on_meta_is_an_error_and_rolled_back(tmp_path: Path) -> None:
    path = _save(_tiny(0), tmp_path / "m.safetensors", drop=("proj.bias",))
    model = _tiny(1, device="meta", rope=False)
    weight = model.proj.weight
    _rejects(model, path, "still on the meta device after loading: 'proj.bias'",
             "every change was rolled back", strict=False)
    assert model.proj.weight is weight and weight.device.type == "meta"


# -- rollback ----------------------------------------------------------------------------------


def _failing_hook(model: Tiny, error: BaseException):
    def hook() -> None:
        model.float()  # rebinds every parameter and re-registers every buffer...
        model.rope.inv_freq.mul_(3)  # ...edits a non-persistent buffer in place...
        model.tok.weight.requires_grad_(False)
        model.extra = nn.Linear(1, 1)  # ...registers a submodule...
        raise error  # ...and fails
    return hook


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()],
                         ids=["RuntimeError", "KeyboardInterrupt"])
def test_failing_hook_restores_everything(tmp_path: Path, device: str, error) -> None:
    path = _save(_tiny(0, dtype=torch.bfloat16), tmp_path / "m.safetensors")
    model = _tiny(1, dtype=torch.bfloat16, device=device, rope=device == "cpu")
    if device == "meta":
        model.rope = Rotary(32).to(torch.bfloat16)
    model.post_load_weights = _failing_hook(model, error)
    before = _state(model)
    registered = {n: dict(m._modules) for n, m in model.named_modules()}

    with pytest.raises(type(error)) as info:
        load_safetensors(model, path)

    if isinstance(error, Exception):
        assert "post_load_weights() of '<root>' (Tiny)" in str(info.value)
        assert "rolled back" in str(info.value) and info.value.__cause__ is error
    else:
        assert info.value is error  # a BaseException propagates unchanged
    _assert_unchanged(model, before)
    assert {n: dict(m._modules) for n, m in model.named_modules()} == registered
    assert not any(is_file_backed(t) for t in model.state_dict().values())


def test_failure_while_binding_restores_the_tensors_already_bound(ckpt, monkeypatch) -> None:
    _, path = ckpt
    model = _tiny(1, device="meta", rope=False)
    model.rope = Rotary(32)
    before = _state(model)
    real, calls = torch.utils.swap_tensors, []

    def flaky(a, b):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("swap failed")
        return real(a, b)

    monkeypatch.setattr(torch.utils, "swap_tensors", flaky)
    with pytest.raises(RuntimeError, match=r"while binding '.*swap failed.*rolled back") as info:
        load_safetensors(model, path)
    assert str(info.value.__cause__) == "swap failed"
    _assert_unchanged(model, before)
    assert all(t.device.type == "meta" for t in model.parameters())


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_interrupt_right_after_a_rebind_is_rolled_back_too(ckpt, monkeypatch, device) -> None:
    """Ctrl-C landing just after the 3rd rebind, before anything else runs: on the CPU after
    ``t.data = view`` (in the registry call that follows it), on meta inside ``swap_tensors``
    once the swap is done.  That rebind is undone too."""
    _, path = ckpt
    model = _tiny(1, device=device, rope=device == "cpu")
    if device == "meta":
        model.rope = Rotary(32)
    before = _state(model)
    calls = []

    def interrupt_after(real):
        def wrapper(*args):
            result = real(*args)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return result
        return wrapper

    if device == "cpu":
        monkeypatch.setattr(loading, "_register", interrupt_after(loading._register))
    else:
        monkeypatch.setattr(torch.utils, "swap_tensors", interrupt_after(torch.utils.swap_tensors))
    with pytest.raises(KeyboardInterrupt):
        load_safetensors(model, path)
    _assert_unchanged(model, before)
    assert not any(is_file_backed(t) for t in model.state_dict().values())


def test_interrupt_inside_the_rollback_is_held_until_it_finishes() -> None:
    undo, done = loading._Undo(), []
    undo.push(lambda: done.append("first"))
    state = {"n": 0}

    def interrupted_once() -> None:
        state["n"] += 1
        if state["n"] == 1:
            raise KeyboardInterrupt
        done.append("second")

    undo.push(interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        undo.rollback()
    assert done == ["second", "first"]


# -- is_file_backed ----------------------------------------------------------------------------


def test_is_file_backed_follows_the_current_storage(ckpt) -> None:
    _, path = ckpt
    model = _tiny(1)
    w = model.proj.weight
    assert not is_file_backed(w)
    load_safetensors(model, path)
    assert is_file_backed(w) and is_file_backed(w[1:]) and is_file_backed(w.T)
    assert not is_file_backed(w.detach().clone())
    w.data = torch.zeros_like(w)
    assert not is_file_backed(w) and is_file_backed(model.proj.bias)
    with pytest.raises(TypeError):
        is_file_backed(w.tolist())


def test_registry_drops_a_mapping_once_its_storage_is_gone(ckpt) -> None:
    _, path = ckpt
    gc.collect()
    entries = len(loading._MAPPED)
    model = _tiny(1)
    load_safetensors(model, path)
    assert len(loading._MAPPED) == entries + 6  # one mapped storage per tensor
    del model
    gc.collect()
    assert len(loading._MAPPED) == entries


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_views_lie_inside_a_mapping_of_their_file(ckpt) -> None:
    _, path = ckpt
    model = _tiny(1)
    load_safetensors(model, path)
    ranges = loading._file_mappings([str(path)])[str(path)]
    assert ranges and all(loading._in_file(t, ranges) for t in model.parameters())
    assert not loading._in_file(model.rope.inv_freq, ranges)


def test_a_view_outside_the_file_mapping_is_loaded_but_not_file_backed(ckpt, monkeypatch) -> None:
    twin, path = ckpt
    monkeypatch.setattr(loading, "_file_mappings", lambda paths: {p: [] for p in paths})
    model = _tiny(1)
    with pytest.warns(UserWarning, match="outside any mapping of their file"):
        report = load_safetensors(model, path)
    assert report.tensors == 6 and report.file_backed_bytes == 0
    assert not is_file_backed(model.proj.weight) and torch.equal(model.proj.weight,
                                                                 twin.proj.weight)


# -- memory ------------------------------------------------------------------------------------


class Big(nn.Module):
    """~42 MB of fp32 weights; the big matrix is above glibc's largest mmap threshold (32 MB),
    so building it on the CPU always maps fresh anonymous pages."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4096, 2560)
        self.down = nn.Linear(2560, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.mark.skipif(anonymous_rss_bytes() is None, reason="needs RssAnon (/proc/self/status)")
def _heap_returned() -> None:
    """Free what is garbage and hand the allocator's free pages back to the kernel (glibc's
    ``malloc_trim``), so that an allocation measured next faults in new pages: in a worker that
    ran other tests, glibc serves a tensor of a few MiB from heap pages an earlier test freed
    (its mmap threshold grows after each large free), and RSS would not move."""
    import ctypes
    import ctypes.util

    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def test_anonymous_rss_stays_flat_for_a_meta_built_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    twin = Big()
    path = tmp_path / "big.safetensors"
    save_file(dict(twin.state_dict()), str(path))
    weight_bytes = sum(t.nbytes for t in twin.state_dict().values())
    assert 32 * 2**20 < weight_bytes < 64 * 2**20
    _heap_returned()

    before = anonymous_rss_bytes()
    with torch.device("meta"):
        model = Big()
    load_safetensors(model, path)
    touched = sum(float(t.sum()) for t in model.state_dict().values())  # read every page
    grown = anonymous_rss_bytes() - before
    assert math.isfinite(touched)
    assert grown < 0.05 * weight_bytes, (grown, weight_bytes)

    _heap_returned()
    before = anonymous_rss_bytes()
    control = Big()  # the same weights built the ordinary way
    grown_control = anonymous_rss_bytes() - before
    assert grown_control > 0.9 * weight_bytes, (grown_control, weight_bytes)
    del control

    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(x), twin(x))


@pytest.mark.parametrize("kind", ["fifo", "folder", "/dev/null"])
def test_a_source_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path: Path,
                                                                           kind: str) -> None:
    """A FIFO once blocked safe_open for good (Ctrl-C did not interrupt it)."""
    import os

    if kind == "fifo":
        path = tmp_path / "weights.safetensors"
        os.mkfifo(path)
        words = "it is a FIFO, not a regular file"
    elif kind == "folder":
        path = tmp_path
        words = "it is a folder, not a regular file"
    else:
        path = Path(kind)
        words = "it is a device or socket, not a regular file"
    module = nn.Linear(2, 2)
    before = module.weight.detach().clone()
    with pytest.raises(ValueError, match=words):
        load_safetensors(module, path)
    assert torch.equal(module.weight, before)
