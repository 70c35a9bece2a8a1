"""Quantized and wrapper-subclass weights (issue 38, item 1; Note [Wrapper subclasses] in
offload_ref/plan/tree.py, Note [Guarded wrappers] in offload_ref/backends/rebind_guard.py).

A wrapper subclass (torchao's ``Float8Tensor``, the fixture's ``ScaledFP8Weight``) streams by its
inner tensors, and the module keeps the wrapper object: inside the forward it has the type,
dtype, shape and strides it was built with, on the execution device; ``disable()`` gives it back
on the host, exactly.  A tensor subclass without ``__tensor_flatten__`` (and a DTensor) is
refused before anything changes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from offload_ref import (OffloadConfig, OffloadStrategy, OffloadTopologyError,
                         OffloadWeightEditError, SupportsComponentDiscovery, get_offload_backend)
from offload_ref.fixtures.quantized_dit import (FP8Linear, ScaledFP8Weight, build_pipeline,
                                                make_inputs)
from offload_ref.plan.tree import named_tensors, tensor_leaves
from device_helpers import DEVICE, resident  # noqa: E402 (tests/ is on sys.path)

STRATEGIES = ("model_level", "layer_wise")


def _backend(strategy: str):
    return get_offload_backend(OffloadConfig(strategy=OffloadStrategy(strategy)), device=DEVICE)


def _wrapped(pipeline) -> dict[str, ScaledFP8Weight]:
    return {f"transformer.{n}": p for n, p in pipeline.transformer.named_parameters()
            if isinstance(p, ScaledFP8Weight)}


def _host_bits(t: torch.Tensor) -> list[tuple[str, torch.dtype, tuple, tuple, bytes]]:
    return [(n, x.dtype, tuple(x.shape), x.stride(), bytes(x.detach().cpu().contiguous()
                                                           .reshape(-1).view(torch.uint8)))
            for n, x in tensor_leaves("", t)]


def test_the_fixture_holds_what_it_claims() -> None:
    pipe = build_pipeline(0)
    wrapped = _wrapped(pipe)
    assert len(wrapped) == 19  # 8 projections x 2 joint blocks, 2 single-block MLPs, proj_out
    assert all(type(w) is ScaledFP8Weight and w.qdata.dtype == torch.float8_e4m3fn
               for w in wrapped.values())
    fp8 = [m for m in pipe.modules() if isinstance(m, FP8Linear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    transposed = pipe.transformer.single_transformer_blocks[0].proj_out.weight
    assert not transposed.is_contiguous()
    # the walks yield a wrapper's inner tensors in its place
    names = [n for n, _ in named_tensors(pipe.transformer)]
    assert "transformer_blocks.0.attn.to_q.weight.qdata" in names
    assert "transformer_blocks.0.attn.to_q.weight.scale" in names
    assert "transformer_blocks.0.attn.to_q.weight" not in names


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_wrapper_weights_stream_exactly_and_keep_their_type_inside_forward(strategy: str) -> None:
    want = resident(build_pipeline(0))(**make_inputs(0))
    pipe = build_pipeline(0)
    built = {n: (type(w), w.dtype, tuple(w.shape), w.stride(), _host_bits(w))
             for n, w in _wrapped(pipe).items()}
    seen: list[tuple] = []

    def look(module: nn.Module, args: tuple) -> None:
        w = module.weight
        seen.append((type(w), w.dtype, tuple(w.shape), w.stride(), w.device,
                     [x.device for _, x in tensor_leaves("", w)]))

    for block in (pipe.transformer.transformer_blocks[1], pipe.transformer):
        target = block.attn.to_k if block is not pipe.transformer else block.proj_out
        target.register_forward_pre_hook(look)
    backend = _backend(strategy)
    backend.enable(pipe)
    try:
        for _ in range(2):
            assert torch.equal(pipe(**make_inputs(0)), want)
    finally:
        backend.disable()
    assert seen
    for cls, dtype, shape, stride, device, inner in seen:
        assert cls is ScaledFP8Weight and dtype == torch.float32
        assert device == DEVICE and all(d == DEVICE for d in inner)
    shapes = {(s[2], s[3]) for s in seen}
    assert shapes <= {(b[2], b[3]) for b in built.values()}
    after = {n: (type(w), w.dtype, tuple(w.shape), w.stride(), _host_bits(w))
             for n, w in _wrapped(pipe).items()}
    assert after == built  # the same class, metadata and bytes, on the host
    assert all(w.device.type == "cpu" for w in _wrapped(pipe).values())
    assert torch.equal(pipe(**make_inputs(0)), build_pipeline(0)(**make_inputs(0)))


def test_layerwise_refuses_a_wrappers_data_between_forwards_and_its_state_dict_is_true() -> None:
    pipe = build_pipeline(0)
    truth = {n: _host_bits(w) for n, w in _wrapped(pipe).items()}
    backend = _backend("layer_wise")
    backend.enable(pipe)
    try:
        pipe(**make_inputs(0))
        streamed = pipe.transformer.transformer_blocks[0].attn.to_q.weight
        with pytest.raises(OffloadWeightEditError, match="outside its block's forward"):
            streamed.data  # noqa: B018 (the read is the test)
        assert isinstance(streamed, ScaledFP8Weight)
        with pytest.raises(OffloadWeightEditError, match="assigned a new tensor"):
            streamed.data = torch.zeros(streamed.shape)
        resident_w = pipe.transformer.proj_out.weight  # resident: readable, and true
        assert _host_bits(resident_w.data) == truth["transformer.proj_out.weight"]
        state = pipe.transformer.state_dict()
        for name, bits in truth.items():
            value = state[name.removeprefix("transformer.")]
            assert type(value) is ScaledFP8Weight and _host_bits(value) == bits, name
    finally:
        backend.disable()
    assert {n: _host_bits(w) for n, w in _wrapped(pipe).items()} == truth


def test_model_level_refuses_assigning_a_wrappers_data() -> None:
    pipe = build_pipeline(0)
    backend = _backend("model_level")
    backend.enable(pipe)
    try:
        pipe(**make_inputs(0))
        w = pipe.transformer.transformer_blocks[0].attn.to_q.weight
        with pytest.raises(OffloadWeightEditError, match="assigned a new tensor"):
            w.data = torch.zeros(w.shape)
    finally:
        backend.disable()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pipeline_built_under_inference_mode_round_trips(strategy: str) -> None:
    want = resident(build_pipeline(0))(**make_inputs(0))
    with torch.inference_mode():
        pipe = build_pipeline(0)
    w = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert w.is_inference()
    backend = _backend(strategy)
    backend.enable(pipe)
    try:
        assert not w.is_inference()
        assert torch.equal(pipe(**make_inputs(0)), want)  # outside inference mode too
    finally:
        backend.disable()
    assert w.is_inference() and w.qdata.is_inference() and type(w) is ScaledFP8Weight


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failed_enable_leaves_every_wrapper_as_built(strategy: str) -> None:
    pipe = build_pipeline(0)
    built = {n: (type(w), w.device, _host_bits(w)) for n, w in _wrapped(pipe).items()}
    backend = _backend(strategy)
    steps = []

    def fail_late(index: int, label: str) -> None:
        steps.append(label)
        if "wrapper subclasses take" in label:
            raise RuntimeError("injected")

    backend.fault_injector = fail_late
    with pytest.raises(Exception, match="injected"):
        backend.enable(pipe)
    assert any("wrapper subclasses take" in s for s in steps)
    assert {n: (type(w), w.device, _host_bits(w)) for n, w in _wrapped(pipe).items()} == built


class _Opaque(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__``: its data cannot be reached."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Opaque:
        self = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device)
        self._inner = inner
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return _Opaque(args[0]._inner.detach())
        unwrap = lambda t: t._inner if isinstance(t, _Opaque) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class _OpaquePipeline(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = nn.Linear(4, 4)
        self.transformer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.transformer._layerwise_offload_blocks_attrs = []
        self.transformer[1].weight = nn.Parameter(_Opaque(torch.randn(4, 4)),
                                                  requires_grad=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_subclass_without_tensor_flatten_is_refused_before_any_change(strategy: str) -> None:
    pipe = _OpaquePipeline()
    before = [(n, type(t), t.device) for n, t in pipe.named_parameters()]
    backend = _backend(strategy)
    with pytest.raises(OffloadTopologyError, match=r"transformer\.1\.weight.*_Opaque"):
        backend.enable(pipe)
    assert not backend.is_enabled()
    assert [(n, type(t), t.device) for n, t in pipe.named_parameters()] == before


def test_a_dtensor_stays_refused(tmp_path) -> None:
    """A DTensor is a wrapper too, but its inner tensor is one rank's shard: refused, as before
    (in a child process: a process group must not outlive the test)."""
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        from offload_ref import (OffloadConfig, OffloadStrategy, OffloadTopologyError,
                                 SupportsComponentDiscovery, get_offload_backend)
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / 'store')!r}, 1),
                                rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))

        class P(nn.Module, SupportsComponentDiscovery):
            _dit_modules = ["transformer"]
            _encoder_modules = []
            _vae_modules = []
            def __init__(self):
                super().__init__()
                self.transformer = nn.Linear(4, 4)
                self.transformer.weight = nn.Parameter(
                    distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))

        backend = get_offload_backend(
            OffloadConfig(strategy=OffloadStrategy.MODEL_LEVEL), device="cpu")
        try:
            backend.enable(P())
        except OffloadTopologyError as exc:
            print("REFUSED", exc)
        dist.destroy_process_group()
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert "REFUSED" in run.stdout, run.stderr[-2000:]
    assert "DTensor" in run.stdout and "transformer.weight" in run.stdout


def test_torchao_float8_weights_stream_exactly() -> None:
    """torchao's own ``Float8Tensor`` (weight-only FP8), where torchao installs."""
    quantization = pytest.importorskip("torchao.quantization")
    from offload_ref.fixtures import flux2

    def build():
        pipe = flux2.build_pipeline(0)
        quantization.quantize_(pipe.transformer.transformer_blocks,
                               quantization.Float8WeightOnlyConfig())
        return pipe

    want = resident(build())(**flux2.make_inputs(0))
    for strategy in STRATEGIES:
        pipe = build()
        linear = pipe.transformer.transformer_blocks[1].attn.to_q
        w = linear.weight
        kind = type(w)
        assert kind.__name__ == "Float8Tensor"
        seen = []
        linear.register_forward_pre_hook(
            lambda m, a: seen.append((type(m.weight), m.weight.device)))
        backend = _backend(strategy)
        backend.enable(pipe)
        try:
            assert torch.equal(pipe(**flux2.make_inputs(0)), want), strategy
        finally:
            backend.disable()
        assert seen and all(k is kind and d == DEVICE for k, d in seen), (strategy, seen)
        assert type(w) is kind and w.device.type == "cpu"
