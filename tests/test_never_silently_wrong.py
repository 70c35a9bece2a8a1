"""Issue 9 (catalogue §J.3-J.6): weight edits, state_dict, autograd, threads and lifetime.

Each test names the defect it pins; all run on the CPU platform with the race amplifier where a
race could hide."""

from __future__ import annotations

import gc
import threading
import time
import types
import warnings

import pytest
import torch
from torch import nn

from offload_ref import (
    OffloadAutogradError,
    OffloadConcurrencyError,
    OffloadConfig,
    OffloadEnableError,
    OffloadWeightEditError,
    backend_of,
    execution_device,
    get_offload_backend,
)
from offload_ref.fixtures import get_spec
from offload_ref.platform import CpuPlatform
from device_helpers import SIMULATED, host, on_device, resident  # noqa: E402 (tests/ is on sys.path)

STRATEGIES = ["model_level", "layer_wise"]
SPEC = get_spec("flux2")


def _run(pipeline) -> torch.Tensor:
    with torch.inference_mode():
        return pipeline(**SPEC.make_inputs())


@pytest.fixture
def platform():
    p = CpuPlatform(race_amplifier=True)
    yield p
    p.close()


def _enabled(strategy: str, platform: CpuPlatform):
    pipeline = SPEC.build()
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    backend.enable(pipeline)
    return pipeline, backend


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- weight edits (J.3) ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_dict_while_enabled_is_refused_before_any_copy(strategy, platform) -> None:
    """Before: layerwise load_state_dict updated some tensors, then failed on a placeholder with
    torch's internal-overlap error; the mix survived disable (16 of 133 new)."""
    pipeline, backend = _enabled(strategy, platform)
    _run(pipeline)
    before = _state(pipeline)
    scaled = {k: v * 2 for k, v in before.items() if v.is_floating_point()}
    for target, prefix in ((pipeline, ""), (pipeline.transformer, "transformer.")):
        part = {k[len(prefix):]: v for k, v in scaled.items() if k.startswith(prefix)}
        with pytest.raises(OffloadWeightEditError, match="edit_weights"):
            target.load_state_dict(part, strict=False)
    backend.disable()
    # taken enabled (resident tensors on the device): compared by value with the host weights
    assert _equal_states(_state(pipeline), host(before)), "a refused load changed some weights"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_fusing_inside_edit_weights_takes_effect_exactly(strategy, platform) -> None:
    """The supported route: fuse a low-rank delta into a DiT block and a non-block weight."""
    def fuse(pipe) -> None:
        gen = torch.Generator().manual_seed(7)
        for linear in (pipe.transformer.single_transformer_blocks[1].proj_mlp,
                       pipe.transformer.x_embedder):
            out_f, in_f = linear.weight.shape
            down, up = torch.randn(2, in_f, generator=gen), torch.randn(out_f, 2, generator=gen)
            with torch.no_grad():
                linear.weight.add_(0.01 * up @ down)

    want_pipe = SPEC.build()
    fuse(want_pipe)
    want = _run(resident(want_pipe))
    pipeline, backend = _enabled(strategy, platform)
    _run(pipeline)
    with backend.edit_weights() as pipe:
        fuse(pipe)
    assert backend.is_enabled()
    assert torch.equal(_run(pipeline), want)
    backend.disable()
    assert _equal_states(_state(pipeline), host(_state(want_pipe)))  # want_pipe is resident


def test_in_place_edit_outside_edit_weights_is_refused_and_never_lost_silently(platform) -> None:
    """Before: model level dropped an in-place edit of a loaded component at the next swap and
    at disable (later generations used the old weights).  Now the next forward refuses it, and
    model level keeps it at disable."""
    pipeline, backend = _enabled("model_level", platform)
    _run(pipeline)  # the DiT is loaded
    weight = pipeline.transformer.transformer_blocks[0].img_mod.weight
    original = SPEC.build().transformer.transformer_blocks[0].img_mod.weight.detach().clone()
    with torch.no_grad():
        weight.mul_(2)
    with pytest.raises(OffloadWeightEditError, match="transformer_blocks.0.img_mod.weight"):
        _run(pipeline)
    with pytest.raises(OffloadWeightEditError):
        _run(pipeline)  # still refused: never served with the edit half applied
    backend.disable()
    assert torch.equal(pipeline.transformer.transformer_blocks[0].img_mod.weight, original * 2)
    reference = SPEC.build()
    with torch.no_grad():
        reference.transformer.transformer_blocks[0].img_mod.weight.mul_(2)
    assert torch.equal(_run(pipeline), _run(reference))  # disabled: both on the host


def _every_dit_parameter_doubled(pipeline) -> int:
    """What issue 25 found: ``p.mul_(2)`` for each DiT parameter, between generations.
    Returns how many were edited before an exception stopped the loop (which it re-raises)."""
    done = 0
    with torch.no_grad():
        for p in pipeline.transformer.parameters():
            try:
                p.mul_(2)
            except Exception as exc:
                exc.done = done
                raise
            done += 1
    return done


def test_layerwise_refuses_an_in_place_edit_of_a_streamed_component_before_any_change(
        platform) -> None:
    """Before: torch's raw "more than one element of the written-to tensor refers to a single
    memory location" after 18 (flux2: 51) of 141 DiT tensors were doubled, the message never
    naming edit_weights(), and the weights mixed.  Now the first tensor refuses, naming
    edit_weights(), nothing changes, and the next generation says what happened (and is
    exact)."""
    want = _run(resident(SPEC.build()))
    pipeline, backend = _enabled("layer_wise", platform)
    _run(pipeline)  # block 0 bound to its slot, the rest to placeholders
    before = _state(pipeline)
    with pytest.raises(OffloadWeightEditError, match="edit_weights") as info:
        _every_dit_parameter_doubled(pipeline)
    assert info.value.done == 0 and "no weight of this component changed" in str(info.value)
    assert _equal_states(_state(pipeline), before)
    # each kind of in-place write, on a streamed block and on the DiT's resident rest
    block = pipeline.transformer.transformer_blocks[1].img_mod
    for target in (block.weight, pipeline.transformer.x_embedder.weight):
        for edit in (lambda t: t.copy_(t * 2), lambda t: t.__setitem__(0, 1.0),
                     lambda t: t.__iadd__(1.0), lambda t: torch.nn.init.zeros_(t),
                     lambda t: torch.add(t, 1.0, out=t), lambda t: torch._foreach_mul_([t], 2.0)):
            with torch.no_grad(), pytest.raises(OffloadWeightEditError, match="edit_weights"):
                edit(target)
    assert _equal_states(_state(pipeline), before)
    block.weight.requires_grad_(False)  # metadata, not an edit
    assert type(block.weight * 1) is torch.Tensor  # other ops pass through, plain results
    with pytest.warns(RuntimeWarning, match="refused.*runs the weights as they were"):
        got = _run(pipeline)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(_run(pipeline), want)  # said once
        backend.disable()  # already said by the generation: nothing more
    assert _equal_states(host(_state(pipeline)), host(before))


def test_layerwise_edit_refused_after_other_components_changed_is_a_mix_said_twice(
        platform) -> None:
    """A loop that edits the text encoder (resident, editable) and then the DiT stops at the
    DiT's first tensor: the next generation refuses (the pipeline holds part of the edit), and
    disable() says which weights keep it."""
    pipeline, backend = _enabled("layer_wise", platform)
    with torch.no_grad():
        for p in pipeline.text_encoder.parameters():
            p.mul_(2)
        with pytest.raises(OffloadWeightEditError, match="edit_weights"):
            _every_dit_parameter_doubled(pipeline)
    with pytest.raises(OffloadWeightEditError, match="text_encoder.*half-way|half-way"):
        _run(pipeline)
    with pytest.raises(OffloadWeightEditError, match="half-way"):
        _run(pipeline)  # still refused
    with pytest.warns(RuntimeWarning, match="keep their edit after disable"):
        backend.disable()


def test_layerwise_edit_refused_then_disabled_says_so(platform) -> None:
    pipeline, backend = _enabled("layer_wise", platform)
    with pytest.raises(OffloadWeightEditError):
        _every_dit_parameter_doubled(pipeline)
    with pytest.warns(RuntimeWarning, match="disable\\(\\) leaves the weights as they were"):
        backend.disable()
    assert _equal_states(_state(pipeline), _state(SPEC.build()))
    _every_dit_parameter_doubled(pipeline)  # disabled: plain tensors again


def test_layerwise_streamed_buffer_edit_is_still_caught_by_its_version(platform) -> None:
    """Buffers keep their class (torch.compile): an in-place edit of a streamed block's buffer
    bound to its slot is refused at the block's next forward, and disable restores it loudly."""
    pipeline = SPEC.build()
    pipeline.transformer.transformer_blocks[0].register_buffer("kit_scale", torch.ones(4))
    backend = get_offload_backend(OffloadConfig(strategy="layer_wise"), platform=platform)
    backend.enable(pipeline)
    _run(pipeline)  # block 0 bound to its slot
    name, buf = "kit_scale", pipeline.transformer.transformer_blocks[0].kit_scale
    with torch.no_grad():
        buf.mul_(2)
    with pytest.raises(OffloadWeightEditError, match=name):
        _run(pipeline)
    with pytest.warns(RuntimeWarning, match=name):
        backend.disable()


# -- state_dict (J.4) ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_while_enabled_is_the_true_weights(strategy, platform) -> None:
    """Before: layerwise state_dict() returned NaN placeholders for streamed blocks (flux2: 84
    of 174 entries)."""
    want = _state(SPEC.build())
    pipeline, backend = _enabled(strategy, platform)
    for _ in range(2):
        # values: the true weights, wherever they live (resident ones on the device)
        assert _equal_states(host(_state(pipeline)), want)
        block = {k[len("transformer.transformer_blocks.1."):]: v for k, v in want.items()
                 if k.startswith("transformer.transformer_blocks.1.")}
        assert _equal_states(host(_state(pipeline.transformer.transformer_blocks[1])), block)
        _run(pipeline)
    backend.disable()


# -- autograd (J.5) --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_mode_forward_through_offloaded_weights_is_refused(strategy, platform) -> None:
    """Before: backward through streamed blocks gave NaN gradients with no error (flux2: 127 of
    133)."""
    pipeline, backend = _enabled(strategy, platform)
    _run(pipeline)
    pipeline.requires_grad_(True)
    latents, context = on_device((torch.randn(1, 16, 4), torch.randn(1, 6, 32)))
    t, guidance = on_device((torch.tensor([500.0]), torch.tensor([4000.0])))
    with pytest.raises(OffloadAutogradError, match="no_grad"):
        with torch.enable_grad():
            pipeline.transformer(latents, context, t, guidance=guidance)
    assert all(p.grad is None for p in pipeline.parameters())
    pipeline.requires_grad_(False)  # frozen weights: grad mode on is fine
    with torch.enable_grad():
        out = pipeline.transformer(latents, context, t, guidance=guidance)
    assert not out.isnan().any()
    assert torch.equal(_run(pipeline), _run(resident(SPEC.build())))
    backend.disable()


def test_frozen_streamed_weights_are_refused_when_a_gradient_would_flow_through_them(
        platform) -> None:
    """Before: with every weight frozen, the gradient of an input (guidance by gradient) or of a
    LoRA parameter added after enable read the placeholders autograd had saved: NaN gradients
    with no error (an outside review, round 2)."""
    pipeline, backend = _enabled("layer_wise", platform)
    _run(pipeline)
    context, t, guidance = on_device(
        (torch.randn(1, 6, 32), torch.tensor([500.0]), torch.tensor([4000.0])))
    latents = on_device(torch.randn(1, 16, 4)).requires_grad_(True)
    with pytest.raises(OffloadAutogradError, match="input .* requires grad.*no_grad"):
        with torch.enable_grad():
            pipeline.transformer(latents, context, t, guidance=guidance)
    assert latents.grad is None
    block = next(m for m in pipeline.transformer.modules() if hasattr(m, "attn"))
    adapter = nn.Parameter(on_device(torch.zeros(1)))  # added after enable, trainable
    block.register_parameter("adapter", adapter)
    try:
        with pytest.raises(OffloadAutogradError, match="adapter requires grad .*not offloaded"):
            with torch.enable_grad():
                pipeline.transformer(latents.detach(), context, t, guidance=guidance)
    finally:
        del block._parameters["adapter"]
    assert torch.equal(_run(pipeline), _run(resident(SPEC.build())))
    backend.disable()


# -- threads (J.6) ---------------------------------------------------------------------------


def _pause_inside(module: nn.Module, thread_name: str):
    entered, release = threading.Event(), threading.Event()

    def pre(mod, args):
        if threading.current_thread().name == thread_name and not entered.is_set():
            entered.set()
            release.wait(timeout=20)

    return module.register_forward_pre_hook(pre), entered, release


def _threaded(fn, name: str):
    box: dict = {}
    n = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(n)
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_second_thread_gets_a_clear_error_and_the_first_stays_exact(strategy, platform) -> None:
    """Before: two threads on one pipeline gave NaN outputs and StreamOrderErrors that persisted
    into later single-threaded runs."""
    reference = _run(resident(SPEC.build()))
    pipeline, backend = _enabled(strategy, platform)
    block = pipeline.transformer.single_transformer_blocks[-1]
    handle, entered, release = _pause_inside(block, "first")
    thread, box = _threaded(lambda: _run(pipeline), "first")
    assert entered.wait(timeout=20)
    with pytest.raises(OffloadConcurrencyError, match="one thread at a time"):
        _run(pipeline)
    release.set()
    thread.join(timeout=20)
    handle.remove()
    assert "error" not in box, box.get("error")
    assert torch.equal(box["out"], reference)
    assert torch.equal(_run(pipeline), reference)
    backend.disable()


def test_two_pipelines_with_their_own_backends_run_in_two_threads(platform) -> None:
    reference = _run(resident(SPEC.build()))
    pipes = [_enabled(s, platform) for s in STRATEGIES]
    threads = [_threaded(lambda p=p: [_run(p) for _ in range(3)], f"t{i}")
               for i, (p, _) in enumerate(pipes)]
    for thread, box in threads:
        thread.join(timeout=60)
        assert "error" not in box, box.get("error")
        assert all(torch.equal(out, reference) for out in box["out"])
    for _, backend in pipes:
        backend.disable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_from_another_thread_waits_for_the_running_forward(strategy, platform) -> None:
    """Before: disable() returned at once, then the generating thread rebound a block to
    placeholders after the masters were freed (flux2: 17 tensors NaN for good).  disable() waits
    for the block that is running; the rest of that generation then meets the restored host
    weights: exact on one device; where host and device differ (as on a GPU), exact if it got
    past its device work before disable() finished, else torch's same-device error -- never a
    wrong output."""
    reference = _run(resident(SPEC.build()))
    host_reference = _run(SPEC.build())
    want = _state(SPEC.build())
    pipeline, backend = _enabled(strategy, platform)
    block = pipeline.transformer.single_transformer_blocks[1]
    handle, entered, release = _pause_inside(block, "generating")
    thread, box = _threaded(lambda: _run(pipeline), "generating")
    assert entered.wait(timeout=20)
    disabling, done = _threaded(backend.disable, "disabling")
    time.sleep(0.2)
    assert disabling.is_alive(), "disable() returned while another thread was inside a block"
    release.set()
    thread.join(timeout=20)
    disabling.join(timeout=20)
    handle.remove()
    assert "error" not in done, done.get("error")
    if "error" in box:  # the generation went on after disable() took its weights back
        assert SIMULATED, box["error"]
        assert "Expected all tensors to be on the same device" in str(box["error"]), box
    else:  # it finished before (how far it got depends on the threads' timing)
        assert torch.equal(box["out"], reference)
    assert not backend.is_enabled()
    assert _equal_states(_state(pipeline), want), "weights were lost"
    assert torch.equal(_run(pipeline), host_reference)
    assert platform.memory_allocated() == 0


def _dit_inputs(pipeline):
    """The DiT's arguments in one generation of ``pipeline`` (device tensors)."""
    seen: list = []
    handle = pipeline.transformer.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args, kwargs)) if not seen else None,
        with_kwargs=True)
    try:
        _run(pipeline)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("where", ["x_embedder", "proj_out"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_from_another_thread_waits_for_the_whole_dit_forward(strategy, where,
                                                                       platform) -> None:
    """Issue 37: under layerwise, disable() from another thread returned while the DiT ran a
    non-block module (before its first block, after its last), and that forward died on the
    restored weights.  Now it waits for the DiT's whole forward (Note [Component entries] in
    call_guard.py), as under model level: the forward that was running ends exact."""
    pipeline, backend = _enabled(strategy, platform)
    args, kwargs = _dit_inputs(pipeline)
    twin = resident(SPEC.build())
    with torch.inference_mode():
        want = twin.transformer(*args, **kwargs)
    want = getattr(want, "sample", want)
    handle, entered, release = _pause_inside(getattr(pipeline.transformer, where), "dit")

    def forward():
        with torch.inference_mode():
            out = pipeline.transformer(*args, **kwargs)
        return getattr(out, "sample", out)

    thread, box = _threaded(forward, "dit")
    assert entered.wait(timeout=20)
    disabling, done = _threaded(backend.disable, "disabling")
    time.sleep(0.3)
    assert disabling.is_alive(), f"disable() returned while the DiT's {where} ran"
    release.set()
    thread.join(timeout=20)
    disabling.join(timeout=20)
    handle.remove()
    assert "error" not in done, done.get("error")
    assert "error" not in box, box.get("error")
    assert torch.equal(box["out"], want)
    assert not backend.is_enabled() and platform.memory_allocated() == 0


# -- lifetime --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_dropped_backend_stays_reachable_through_its_pipeline(strategy, platform) -> None:
    """Before: `del backend` left the pipeline offloaded with no way back ("disable that backend
    first" -- there was none)."""
    reference = _run(resident(SPEC.build()))
    pipeline, backend = _enabled(strategy, platform)
    del backend
    gc.collect()
    owner = backend_of(pipeline)
    assert owner is not None and owner.is_enabled()
    assert torch.equal(_run(pipeline), reference)
    owner.disable()
    assert backend_of(pipeline) is None
    assert platform.memory_allocated() == 0 and platform.host_allocated() == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_collected_pipeline_releases_its_buffers(strategy, platform) -> None:
    pipeline, backend = _enabled(strategy, platform)
    _run(pipeline)
    del pipeline
    gc.collect()
    assert not backend.is_enabled()
    assert platform.memory_allocated() == 0 and platform.host_allocated() == 0


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class _Dit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pipeline_without_weak_references_is_supported(strategy, platform) -> None:
    """Before: a SimpleNamespace pipeline failed after commit: nothing rolled back, a block left
    NaN, and it could never be enabled again."""
    def make():
        torch.manual_seed(0)
        return types.SimpleNamespace(transformer=_Dit().requires_grad_(False),
                                     text_encoder=_Encoder().requires_grad_(False))

    pipe = make()
    x = torch.randn(1, 8)

    def run(p=pipe):  # inputs go where the pipeline computes, as a correct pipeline does
        with torch.inference_mode():
            return p.transformer(p.text_encoder(x.to(execution_device(p))))

    reference = run()  # on the host, for the disabled pipeline
    on_device_reference = run(resident(make()))  # the reference of the offloaded runs
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback scan says it found undeclared components
        backend.enable(pipe)
    for _ in range(2):
        assert backend.is_enabled() and backend_of(pipe) is backend
        assert torch.equal(run(), on_device_reference)
        backend.disable()
        assert torch.equal(run(), reference)
        backend.enable(pipe)
    backend.disable()
    assert platform.memory_allocated() == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_edit_weights_whose_re_enable_fails_says_offload_is_off(strategy, platform) -> None:
    """Before: the resolver's bare error escaped edit_weights() and offload was off without a
    word (an outside review, round 2)."""
    pipeline, backend = _enabled(strategy, platform)
    with pytest.raises(OffloadEnableError, match="Offload is now off") as info:
        with backend.edit_weights() as pipe:  # an edit the resolver rejects: a sparse buffer
            pipe.transformer.register_buffer("mask", torch.eye(2).to_sparse())
    assert "sparse" in str(info.value)
    assert not backend.is_enabled() and backend_of(pipeline) is None
    del pipeline.transformer._buffers["mask"]
    backend.enable(pipeline)  # the fix, then enable again
    assert torch.equal(_run(pipeline), _run(resident(SPEC.build())))
    backend.disable()
