"""Backend edge cases found in review: collected pipelines, nested block calls, tied heads."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from offload_ref import (
    OffloadConfig,
    OffloadPlan,
    SupportsComponentDiscovery,
    execution_device,
    get_offload_backend,
)
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import host, on_device, resident  # noqa: E402 (tests/ is on sys.path)


@pytest.mark.parametrize("name,strategy", [("flux2", "layer_wise"), ("flux2", "model_level"),
                                           ("cosmos3", "model_level")])
def test_a_pipeline_collected_while_enabled_releases_everything(name: str, strategy: str) -> None:
    spec = get_spec(name)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    pipeline = spec.build()
    backend.enable(pipeline)
    del pipeline
    gc.collect()
    assert not backend.is_enabled()
    again = spec.build()
    backend.enable(again)  # cleans up the orphaned state first
    with torch.inference_mode():
        out = again(**spec.make_inputs())
    with torch.inference_mode():
        reference = resident(spec.build())(**spec.make_inputs())
    assert torch.equal(out, reference)  # both on the device
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return self.inner(y) if self.inner is not None else y


class _Dit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.blocks[1].__dict__["inner"] = self.blocks[3]  # block 1 calls block 3 (unregistered)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:3]:
            x = block(x)
        return x


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})

    def __init__(self, tie_head: bool = False) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(8, 8)
        self.transformer = _Dit()
        self.head = nn.Linear(8, 8)
        if tie_head:  # a pipeline-level head reusing a block weight
            self.head.weight = self.transformer.blocks[2].fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(execution_device(self))  # inputs go where the pipeline computes
        return self.head(self.transformer(self.text_encoder(x)))


def _pipe(tie_head: bool) -> _Pipe:
    torch.manual_seed(0)
    return _Pipe(tie_head)


@pytest.mark.parametrize("tie_head", [False, True])
def test_nested_block_calls_and_tied_heads_stay_exact(tie_head: bool) -> None:
    pipeline, x = _pipe(tie_head), torch.randn(2, 8)
    with torch.inference_mode():
        reference = resident(_pipe(tie_head))(x)  # the same weights, whole on the device
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    backend.enable(pipeline)
    for _ in range(3):
        with torch.inference_mode():
            assert torch.equal(pipeline(x), reference)
    assert not platform.hazards
    backend.disable()
    platform.close()


class _AdaNormBlock(nn.Module):
    """A DiT block: its norm owns a label embedding that the model also calls directly."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.Module()
        self.norm.emb = nn.Embedding(1001, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.norm.emb(labels))


class _SubmoduleDit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_AdaNormBlock() for _ in range(3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, labels)
        # diffusers' DiTTransformer2DModel: ``self.transformer_blocks[0].norm1.emb(...)`` after
        # the loop, a submodule of block 0 called outside block 0's forward.
        return x * self.blocks[0].norm.emb(labels)


class _SubmodulePipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _vae_modules: list[str] = []
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _SubmoduleDit()

    def forward(self, x: torch.Tensor, labels: torch.Tensor, steps: int = 2) -> torch.Tensor:
        x, labels = x.to(execution_device(self)), labels.to(execution_device(self))
        for _ in range(steps):
            x = self.transformer(x, labels)
        return x


def _submodule_pipe() -> _SubmodulePipe:
    torch.manual_seed(0)
    return _SubmodulePipe().eval().requires_grad_(False)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_block_submodule_called_outside_its_block_reads_its_weights(prefetch: bool) -> None:
    # The model calls a submodule of block 0 after the block loop, when block 0 is only
    # prefetched (its copy may be in flight) or not materialized at all (prefetch off).
    x, labels = torch.randn(2, 16), torch.tensor([1, 7])
    with torch.inference_mode():
        reference = resident(_submodule_pipe())(x, labels)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    if not prefetch:
        backend.prefetch = False
    pipe = _submodule_pipe()
    for _ in range(2):
        backend.enable(pipe)
        for _ in range(3):
            with torch.inference_mode():
                out = pipe(x, labels)
            assert torch.equal(out, reference)
        backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


def _forward_hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in module.modules())


def _enabled_submodule_pipe(**call: int) -> tuple:
    """Inputs, the resident output for them, and a layerwise-enabled pipeline (its platform and
    backend) for the part-hook tests."""
    x, labels = torch.randn(2, 16), torch.tensor([1, 7])
    with torch.inference_mode():
        reference = resident(_submodule_pipe())(x, labels, **call)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    pipe = _submodule_pipe()
    backend.enable(pipe)
    return (x, labels), reference, platform, backend, pipe


class _InterruptOutsideCall:
    """A pre-hook that raises KeyboardInterrupt in the outside call of ``blocks[0].norm.emb``
    (its second call of a forward) while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.calls = 0

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1
        if self.armed and self.calls % 2 == 0:
            self.armed = False
            raise KeyboardInterrupt


def test_an_outside_part_call_leaves_no_post_hook_behind_even_when_interrupted() -> None:
    # Note [One-shot part post-hooks] (layerwise.py): the post-hook of an outside part call is
    # registered for that call and gone after it, after an interrupt, and after disable().
    (x, labels), reference, platform, backend, pipe = _enabled_submodule_pipe()
    emb = pipe.transformer.blocks[0].norm.emb
    interrupt = _InterruptOutsideCall()
    handle = emb.register_forward_pre_hook(interrupt)  # runs after the part hook
    enabled = _forward_hooks(pipe)
    # the blocks' own post-hooks and the DiT's edit guard (Note [Edits between forwards]), no
    # part's
    assert enabled == len(pipe.transformer.blocks) + 1
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(pipe(x, labels), reference)
            assert _forward_hooks(pipe) == enabled
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            pipe(x, labels)
        assert _forward_hooks(emb) == 1  # the interrupted call's post-hook never ran
        assert torch.equal(pipe(x, labels), reference)
        assert _forward_hooks(pipe) == enabled  # found stale at the next call, and removed
        interrupt.armed = True
        with pytest.raises(KeyboardInterrupt):
            pipe(x, labels)
    handle.remove()
    backend.disable()
    assert _forward_hooks(pipe) == 0
    assert not emb._forward_pre_hooks
    with torch.inference_mode():  # disabled: on the host again
        assert torch.equal(pipe(x, labels), host(reference))
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


def test_parts_carry_a_permanent_post_hook_where_torch_would_not_run_a_one_shot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_ref.backends import layerwise

    assert layerwise._one_shot_post_hooks_run()  # the pinned torch: the cheap path is in use
    monkeypatch.setattr(layerwise, "_one_shot_post_hooks_run", lambda: False)
    (x, labels), reference, platform, backend, pipe = _enabled_submodule_pipe()
    parts = sum(1 for m in pipe.transformer.modules() if "offload_ref.layerwise.part"
                in m.__dict__.get("_offload_ref_hooks", {}))
    assert _forward_hooks(pipe) == len(pipe.transformer.blocks) + parts + 1  # + edit guard
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(pipe(x, labels), reference)
    backend.disable()
    assert _forward_hooks(pipe) == 0
    platform.close()


def test_another_threads_call_of_a_block_part_is_refused_and_leaves_the_outside_call_whole(
        ) -> None:
    # Thread B calls blocks[0].norm.emb while the main thread is inside its outside call: B is
    # refused (Note [One thread at a time]), and the main thread's one-shot post-hook, which
    # torch also runs in B for B's failed call, is left for the main thread's call.
    import threading

    from offload_ref import OffloadConcurrencyError

    (x, labels), reference, platform, backend, pipe = _enabled_submodule_pipe(steps=1)
    emb = pipe.transformer.blocks[0].norm.emb
    inside, other_done = threading.Event(), threading.Event()
    main = threading.get_ident()
    state = {"calls": 0}

    def pause(module: nn.Module, args: tuple) -> None:
        if threading.get_ident() != main:
            return
        state["calls"] += 1
        if state["calls"] % 2 == 0:  # the outside call
            inside.set()
            assert other_done.wait(10)

    errors: list[BaseException] = []

    def other() -> None:
        assert inside.wait(10)
        try:
            with torch.inference_mode():
                emb(on_device(labels))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)
        finally:
            other_done.set()

    handle = emb.register_forward_pre_hook(pause)
    enabled = _forward_hooks(pipe)
    thread = threading.Thread(target=other)
    thread.start()
    with torch.inference_mode():
        out = pipe(x, labels, steps=1)  # one pass: no later block call recovers a lost finish
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], OffloadConcurrencyError), errors
    assert torch.equal(out, reference)
    assert backend.rings[0].running == []  # the outside call was finished by its own post-hook
    assert _forward_hooks(pipe) == enabled
    with torch.inference_mode():
        assert torch.equal(pipe(x, labels, steps=1), reference)
    handle.remove()
    backend.disable()
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


def test_an_outside_part_call_that_raises_surfaces_its_own_error() -> None:
    # torch runs always_call hooks of a failed forward while iterating the module's hook dict
    # itself: a one-shot post-hook that removed itself there would replace the model's error
    # with "dictionary changed size during iteration" (Note [One-shot part post-hooks]).
    (x, labels), reference, platform, backend, pipe = _enabled_submodule_pipe()
    emb = pipe.transformer.blocks[0].norm.emb
    enabled = _forward_hooks(pipe)
    calls = {"n": 0}

    def fail_outside(module: nn.Module, args: tuple) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first outside call: a hook registered after the one-shot
            module.register_forward_hook(lambda m, a, out: None, always_call=True)
            raise ValueError("the model's own error")

    handle = emb.register_forward_pre_hook(fail_outside)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="the model's own error"):
            pipe(x, labels)
        for _ in range(2):
            assert torch.equal(pipe(x, labels), reference)
    assert _forward_hooks(pipe) == enabled + 1  # the hook fail_outside added
    handle.remove()
    backend.disable()
    assert _forward_hooks(pipe) == 1
    platform.close()


class _HeadBlock(nn.Module):
    """A block whose ``head`` only the model calls, after the block loop."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _HeadDit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_HeadBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.blocks[0].head(x)


class _HeadPipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _vae_modules: list[str] = []
    _offload_plan = OffloadPlan(block_attrs={"transformer": ("blocks",)})

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _HeadDit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x.to(execution_device(self)))


def _head_pipe() -> _HeadPipe:
    torch.manual_seed(0)
    return _HeadPipe().eval().requires_grad_(False)


def test_an_interrupted_call_of_a_part_used_only_outside_its_block_recovers() -> None:
    # Ctrl-C inside the outside call of a part its block never calls: the call's post-hook is
    # left behind, and the next outside call registers its own.  Each post-hook removes only
    # itself, so the next call is exact (a hook that removed the other's, still in torch's list
    # for that call, got called with the wrong arguments).
    x = torch.randn(2, 16)
    with torch.inference_mode():
        reference = resident(_head_pipe())(x)
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    pipe = _head_pipe()
    backend.enable(pipe)
    head = pipe.transformer.blocks[0].head
    armed = {"on": False}

    def interrupt(module: nn.Module, args: tuple) -> None:
        if armed["on"]:
            armed["on"] = False
            raise KeyboardInterrupt

    handle = head.register_forward_pre_hook(interrupt)  # runs after the part hook
    enabled = _forward_hooks(pipe)
    with torch.inference_mode():
        assert torch.equal(pipe(x), reference)
        armed["on"] = True
        with pytest.raises(KeyboardInterrupt):
            pipe(x)
        assert _forward_hooks(head) == 1  # the interrupted call's post-hook stayed
        for _ in range(3):
            assert torch.equal(pipe(x), reference)
            assert _forward_hooks(pipe) == enabled
    handle.remove()
    backend.disable()
    assert _forward_hooks(pipe) == 0
    assert (platform.memory_allocated(), platform.host_allocated()) == (0, 0)
    platform.close()


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_meta_weights_in_every_component_are_named_as_never_materialized(strategy: str) -> None:
    """All meta tensors report storage 0; two meta components must not read as shared storage."""
    from offload_ref.backends.base import OffloadEnableError

    spec = get_spec("flux2")
    pipeline = spec.build()
    pipeline.to("meta")
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=CpuPlatform())
    with pytest.raises(OffloadEnableError, match="meta tensor \\(never materialized\\)") as info:
        backend.enable(pipeline)
    assert "shares storage" not in str(info.value)
    assert not backend.is_enabled()


@pytest.mark.parametrize("first", ["model_level", "layer_wise"])
@pytest.mark.parametrize("second", ["model_level", "layer_wise"])
def test_a_module_shared_with_an_offloaded_pipeline_is_refused_by_name(first, second) -> None:
    """Before: ownership was recorded on the pipeline only, so a second pipeline built from the
    first one's components (``Pipe2(**pipe1.components)``) could be enabled by another backend
    over the same transformer, or failed with a false "shares storage" error (an outside
    review, round 2)."""
    spec = get_spec("flux2")
    reference = resident(spec.build())
    with torch.inference_mode():
        want = reference(**spec.make_inputs())
    one, two = spec.build(), spec.build()
    two.transformer = one.transformer  # shared, as diffusers' components are
    b1 = get_offload_backend(OffloadConfig(strategy=first), platform=CpuPlatform())
    b2 = get_offload_backend(OffloadConfig(strategy=second), platform=CpuPlatform())
    b1.enable(one)
    try:
        with pytest.raises(RuntimeError, match=f"shares a module with a pipeline that "
                                               f"{type(b1).__name__} offloads"):
            b2.enable(two)
        assert not b2.is_enabled()
        with torch.inference_mode():
            assert torch.equal(one(**spec.make_inputs()), want)
    finally:
        b1.disable()
    b2.enable(two)  # once the first backend let go
    with torch.inference_mode():
        assert torch.equal(two(**spec.make_inputs()), want)
    b2.disable()
