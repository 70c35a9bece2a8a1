"""Topology the resolver decides (issue 8, sections 2 and 4).

* Residents nested inside a swapped component stay on the device while the rest swaps; inside a
  streamed block they are rejected (a block streams whole).
* Every topology error a backend could meet at enable is raised by the pure resolver first, and
  enable raises the same class before any mutation.
* A VAE may be selected when the pipeline declares its lifecycle; on-demand encoders with
  declared block containers stream their rings; encoders have kinds (text / image); split-model
  delegation receives the parallel facts its signature accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref import (
    OffloadConfig,
    OffloadPlan,
    OffloadTopologyError,
    SupportsComponentDiscovery,
    execution_device,
    get_offload_backend,
    resolve_offload_plan,
)
from offload_ref.platform import CpuPlatform
from device_helpers import resident  # noqa: E402 (tests/ is on sys.path)

DIM = 8


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class _Dit(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self) -> None:
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(1, DIM), nn.SiLU(), nn.Linear(DIM, DIM))
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.proj_out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.time_embed(torch.ones(x.shape[0], 1, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.proj_out(h)


class _Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dit = _Dit()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.final_norm = nn.LayerNorm(DIM)
        self.lifecycle: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.final_norm(h)


class _Staged:
    """Residency the pipeline manages: ``load_to_device`` moves what the module owns (its
    ``_owned()`` parts) to the device the pipeline computes on (set by the pipeline before each
    call); ``offload_to_cpu`` puts the host tensors back; both are recorded."""

    execution_device = torch.device("cpu")

    def _owned(self) -> list[nn.Module]:
        return [self]

    def load_to_device(self) -> None:
        self.lifecycle.append("load")
        self._parked = [(p, p.data) for m in self._owned() for p in m.parameters()]
        for module in self._owned():
            module.to(self.execution_device)  # keeps the Parameters, assigns their .data

    def offload_to_cpu(self) -> None:
        self.lifecycle.append("offload")
        for parameter, on_host in self._parked:
            parameter.data = on_host


class _StagedEncoder(_Staged, _Encoder):
    """An encoder whose residency the pipeline manages; its blocks are the backend's to stream
    when declared (then ``load_to_device`` moves the rest)."""

    def _owned(self) -> list[nn.Module]:
        return [self.embed, self.final_norm]


class _Vae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.conv(x))


class _StagedVae(_Staged, _Vae):
    def __init__(self) -> None:
        super().__init__()
        self.lifecycle: list[str] = []


class _Pipe(nn.Module, SupportsComponentDiscovery):
    """text_encoder -> backbone.dit -> vae, with ``backbone.dit.time_embed`` declared resident."""

    _dit_modules = ["backbone.dit"]
    _encoder_modules = ["text_encoder"]
    _vae_modules = ["vae"]
    _resident_modules = ["backbone.dit.time_embed"]

    def __init__(self, encoder: type[nn.Module] = _Encoder, vae: type[nn.Module] = _Vae) -> None:
        super().__init__()
        self.text_encoder = encoder()
        self.backbone = _Backbone()
        self.vae = vae()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = execution_device(self)
        x = x.to(device)  # inputs go where the pipeline computes
        staged = [m for m in (self.text_encoder, self.vae) if hasattr(m, "load_to_device")]
        for module in staged:
            module.execution_device = device
        if self.text_encoder in staged:
            self.text_encoder.load_to_device()
        cond = self.text_encoder(x)
        if self.text_encoder in staged:
            self.text_encoder.offload_to_cpu()
        h = self.backbone.dit(cond)
        if self.vae in staged:
            self.vae.load_to_device()
        out = self.vae(h)
        if self.vae in staged:
            self.vae.offload_to_cpu()
        return out


def _build(cls: Callable[[], nn.Module] = _Pipe, **attrs: Any) -> nn.Module:
    torch.manual_seed(0)
    pipe = cls()
    pipe.eval().requires_grad_(False)
    for name, value in attrs.items():
        pipe.__dict__[name] = value  # per-instance declarations
    return pipe


def _inputs() -> torch.Tensor:
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))


def _run(pipe: nn.Module) -> torch.Tensor:
    """One call, on the device the pipeline computes on (references: the pipeline resident)."""
    with torch.inference_mode():
        return pipe(_inputs())


def _own_tensors(module: nn.Module, nested: nn.Module) -> list[torch.Tensor]:
    skip = {id(t) for t in list(nested.parameters()) + list(nested.buffers())}
    return [t for t in list(module.parameters()) + list(module.buffers()) if id(t) not in skip]


def _no_hooks(pipe: nn.Module) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in pipe.modules())


# -- §2: residents nested inside a swapped component ------------------------------------------


@pytest.mark.parametrize("strategy", ["model_level", "layer_wise"])
def test_resident_nested_in_the_dit_stays_on_the_device(strategy: str) -> None:
    reference = _run(resident(_build()))
    pipe = _build()
    dit, embed = pipe.backbone.dit, pipe.backbone.dit.time_embed
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(OffloadConfig(strategy=strategy), platform=platform)
    seen: list[str] = []

    def at_encoder(module, args):
        assert all(platform.is_resident(t) for t in embed.parameters()), "time_embed left"
        if strategy == "model_level":  # the rest of the DiT is on the host
            assert not any(platform.is_resident(t) for t in _own_tensors(dit, embed))
        seen.append("encoder")

    def at_dit(module, args):
        assert all(platform.is_resident(t) for t in embed.parameters())
        seen.append("dit")

    try:
        backend.enable(pipe)
        h1 = pipe.text_encoder.register_forward_pre_hook(at_encoder)
        h2 = dit.register_forward_pre_hook(at_dit)
        for _ in range(2):
            assert torch.equal(_run(pipe), reference)
        h1.remove(), h2.remove()
        assert seen == ["encoder", "dit"] * 2
        assert backend.plan.predicted_device_bytes() == backend.stats().peak_device_bytes
        if strategy == "model_level":
            own = sum(t.numel() * t.element_size() for t in _own_tensors(dit, embed))
            assert dict(backend.swap_log())["backbone.dit"] == own
    finally:
        backend.disable()
        platform.close()
    assert _no_hooks(pipe)


def test_resident_inside_a_streamed_block_is_rejected_by_the_resolver() -> None:
    pipe = _build(_resident_modules=["backbone.dit.blocks.1.norm"])
    with pytest.raises(OffloadTopologyError,
                       match=r"backbone\.dit\.blocks\.1\.norm.*backbone\.dit\.blocks\.1"):
        resolve_offload_plan(pipe, OffloadConfig(strategy="layer_wise"))
    # Model level has no blocks: the resident stays on the device while the DiT swaps.
    plan = resolve_offload_plan(pipe, OffloadConfig(strategy="model_level"))
    assert plan.component("backbone.dit.blocks.1.norm").role == "resident"


# -- §2: every topology error a backend can meet at enable comes from the resolver -------------


def _tied_resident() -> nn.Module:
    """A declared resident that shares a weight with the swapped DiT."""
    pipe = _build(_resident_modules=["head"])
    pipe.head = nn.Linear(DIM, DIM)
    pipe.head.weight = pipe.backbone.dit.proj_out.weight
    return pipe


def _tied_encoder() -> nn.Module:
    """An encoder that shares a weight with the DiT: two swap groups, one storage."""
    pipe = _build()
    pipe.text_encoder.embed.weight = pipe.backbone.dit.proj_out.weight
    return pipe


def _tied_pipeline_state() -> nn.Module:
    """Undeclared pipeline state (kept on the device) that views the swapped DiT's weight."""
    pipe = _build()
    pipe.register_buffer("lut", pipe.backbone.dit.proj_out.weight.data[0], persistent=False)
    return pipe


def _dit_holds_encoder() -> nn.Module:
    """The DiT holds the encoder module itself (issue 11 item 9a): one module in two swap groups."""
    pipe = _build()
    pipe.backbone.dit.text_proj = pipe.text_encoder
    return pipe


def _encoder_inside_dit() -> nn.Module:
    """An encoder declared at a path inside the DiT (issue 11 item 9b)."""
    return _build(_encoder_modules=["text_encoder", "backbone.dit.proj_out"])


def _with_plan(**fields: Any) -> Callable[[], nn.Module]:
    return lambda: _build(_offload_plan=OffloadPlan(**fields))


_DLO = dict(strategy="distributed_layer_wise")
_NESTED = ("must be declared in _resident_modules", "or drop")

BAD_TOPOLOGIES: list[tuple[str, Callable[[], nn.Module], Callable[[], OffloadConfig], tuple[str, ...]]] = [
    ("resident_in_block", lambda: _build(_resident_modules=["backbone.dit.blocks.1.norm"]),
     lambda: OffloadConfig(strategy="layer_wise"), ("backbone.dit.blocks.1.norm", "_resident_modules")),
    ("resident_tied_to_swapped_dit", _tied_resident, lambda: OffloadConfig(strategy="model_level"),
     ("head.weight", "backbone.dit", "one offload group")),
    ("encoder_tied_to_dit", _tied_encoder, lambda: OffloadConfig(strategy="model_level"),
     ("text_encoder", "backbone.dit", "one offload group")),
    ("pipeline_state_tied_to_dit", _tied_pipeline_state, lambda: OffloadConfig(strategy="model_level"),
     ("lut", "backbone.dit", "one offload group")),
    ("vae_without_lifecycle_layer", _build,
     lambda: OffloadConfig(strategy="layer_wise", components=("dit", "vae")),
     ("'vae'", "on_demand_component_paths", "load_to_device")),
    ("vae_without_lifecycle_module", _build,
     lambda: OffloadConfig(strategy="model_level", components=("dit", "text_encoder", "vae")),
     ("'vae'", "on_demand_component_paths", "load_to_device")),
    ("vae_declared_but_no_methods", lambda: _build(
        _offload_plan=OffloadPlan(on_demand_component_paths=("vae",))),
     lambda: OffloadConfig(strategy="layer_wise", components=("dit", "vae")),
     ("'vae'", "load_to_device", "offload_to_cpu")),
    ("vae_selected_but_absent", lambda: _build(_vae_modules=[]),
     lambda: OffloadConfig(strategy="layer_wise", components=("dit", "vae")),
     ("No VAE", "_vae_modules")),
    # Issue 11 item 9: what `plan` shows clean, `enable` must not reject or serve wrongly.
    *[(f"dit_holds_encoder_{s}", _dit_holds_encoder, lambda s=s: OffloadConfig(strategy=s),
       ("'text_encoder'", "'backbone.dit'", *_NESTED))
      for s in ("model_level", "layer_wise", "distributed_layer_wise")],
    *[(f"encoder_inside_dit_{s}", _encoder_inside_dit, lambda s=s: OffloadConfig(strategy=s),
       ("'backbone.dit.proj_out'", "'backbone.dit'", *_NESTED))
      for s in ("model_level", "layer_wise", "distributed_layer_wise")],
    *[(f"block_attrs_key_names_no_dit_{s}", _with_plan(block_attrs={"backbone.dti": ("blocks",)}),
       lambda s=s: OffloadConfig(strategy=s),
       ("OffloadPlan.block_attrs", "'backbone.dti'", "['backbone.dit']", "did you mean 'backbone.dit'"))
      for s in ("model_level", "layer_wise")],
    ("block_attrs_key_names_an_encoder", _with_plan(block_attrs={"text_encoder": ("blocks",)}),
     lambda: OffloadConfig(strategy="layer_wise"),
     ("OffloadPlan.block_attrs", "'text_encoder'", "is an encoder, not a DiT", "['backbone.dit']")),
    ("encoder_block_attrs_key_names_no_encoder",
     _with_plan(encoder_block_attrs={"text_encodr": ("blocks",)}),
     lambda: OffloadConfig(strategy="layer_wise", components=("dit", "text_encoder")),
     ("OffloadPlan.encoder_block_attrs", "'text_encodr'", "['text_encoder']",
      "did you mean 'text_encoder'")),
    ("resident_dit_paths_names_no_dit", _with_plan(resident_dit_paths=("backbone.dt",)),
     lambda: OffloadConfig(**_DLO),
     ("OffloadPlan.resident_dit_paths", "'backbone.dt'", "did you mean 'backbone.dit'")),
    ("dlo_weight_replication_names_no_encoder",
     _with_plan(encoder_dlo_weight_replication=("backbone.dit",)),
     lambda: OffloadConfig(**_DLO),
     ("OffloadPlan.encoder_dlo_weight_replication", "'backbone.dit'", "no encoder",
      "['text_encoder']")),
]


@pytest.mark.parametrize("name,make,config,mentions", BAD_TOPOLOGIES,
                         ids=[b[0] for b in BAD_TOPOLOGIES])
def test_every_enable_topology_error_comes_from_the_resolver(name, make, config, mentions) -> None:
    pipe, config = make(), config()
    with pytest.raises(OffloadTopologyError) as resolved:
        resolve_offload_plan(pipe, config)
    for word in mentions:
        assert word in str(resolved.value), (name, word, str(resolved.value))
    before = {n: (t.data_ptr(), t.device) for n, t in pipe.state_dict(keep_vars=True).items()}
    platform = CpuPlatform()
    backend = get_offload_backend(config, platform=platform)
    try:
        with pytest.raises(OffloadTopologyError) as enabled:
            backend.enable(pipe)
        assert str(enabled.value) == str(resolved.value)
        assert not backend.is_enabled()
        assert platform.memory_allocated() == 0 and platform.pinned_bytes() == 0
        assert platform.host_allocated() == 0
        assert not backend.registry.installed() and _no_hooks(pipe)
        after = {n: (t.data_ptr(), t.device) for n, t in pipe.state_dict(keep_vars=True).items()}
        assert after == before
    finally:
        platform.close()


# -- §4: VAE selection with a declared lifecycle ----------------------------------------------


@pytest.mark.parametrize("strategy,components", [
    ("layer_wise", ("dit", "vae")),
    ("model_level", ("dit", "text_encoder", "vae")),
])
def test_vae_selection_reuses_the_declared_lifecycle(strategy: str, components: tuple) -> None:
    plan_decl = OffloadPlan(on_demand_component_paths=("vae",))
    reference = _run(resident(_build(lambda: _Pipe(vae=_StagedVae), _offload_plan=plan_decl)))
    pipe = _build(lambda: _Pipe(vae=_StagedVae), _offload_plan=plan_decl)
    config = OffloadConfig(strategy=strategy, components=components)
    plan = resolve_offload_plan(pipe, config)
    vae = plan.component("vae")
    assert vae.selected and vae.on_demand
    before = [t.data_ptr() for t in pipe.vae.parameters()]
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(config, platform=platform)
    try:
        backend.enable(pipe)
        assert [t.data_ptr() for t in pipe.vae.parameters()] == before  # the pipeline's
        assert not any(platform.is_resident(t) for t in pipe.vae.parameters())
        assert torch.equal(_run(pipe), reference)
        assert pipe.vae.lifecycle == ["load", "offload"]
        assert backend.plan.predicted_device_bytes() == backend.stats().peak_device_bytes
    finally:
        backend.disable()
        platform.close()
    assert [t.data_ptr() for t in pipe.vae.parameters()] == before


def test_vae_is_never_selected_by_default() -> None:
    for config in (OffloadConfig(strategy="model_level"), OffloadConfig(strategy="layer_wise"),
                   OffloadConfig.from_mapping({"mode": "module", "components": ["dit"]})):
        assert "vae" not in config.components
    assert OffloadConfig.from_mapping({"mode": "layer", "components": ["dit", "vae"]}).selects("vae")
    with pytest.raises(ValueError, match="layer_options.*'vae'"):
        OffloadConfig.from_mapping({"mode": "layer", "components": ["dit", "vae"],
                                    "layer_options": {"vae": {}}})


# -- §4: on-demand encoders with declared block containers stream their rings -----------------


def test_on_demand_encoder_streams_its_rings_and_keeps_its_lifecycle() -> None:
    plan_decl = OffloadPlan(encoder_block_attrs={"text_encoder": ("blocks",)},
                            on_demand_component_paths=("text_encoder",))
    make = lambda: _build(lambda: _Pipe(encoder=_StagedEncoder), _offload_plan=plan_decl)  # noqa: E731
    reference = _run(resident(make()))
    pipe = make()
    config = OffloadConfig(strategy="layer_wise", components=("dit", "text_encoder"))
    encoder = pipe.text_encoder
    non_block = list(encoder.embed.parameters()) + list(encoder.final_norm.parameters())
    before = [t.data_ptr() for t in non_block]
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(config, platform=platform)
    materialized: list[bool] = []
    try:
        backend.enable(pipe)
        assert backend.materialized_blocks()["text_encoder.blocks"] == [0]
        assert all(b._forward_pre_hooks for b in encoder.blocks), "encoder blocks not hooked"
        h = encoder.blocks[1].register_forward_pre_hook(
            lambda m, a: materialized.append(all(platform.is_resident(t) for t in m.parameters())))
        for _ in range(2):
            assert torch.equal(_run(pipe), reference)
        h.remove()
        assert materialized == [True, True]
        assert backend.materialized_blocks()["text_encoder.blocks"] == [0]
        # Non-block residency stays the pipeline's: the backend never placed those tensors.
        assert [t.data_ptr() for t in non_block] == before
        assert not any(platform.is_resident(t) for t in non_block)
        assert encoder.lifecycle == ["load", "offload"] * 2
        assert backend.plan.predicted_device_bytes() == backend.stats().peak_device_bytes
    finally:
        backend.disable()
        platform.close()
    assert _no_hooks(pipe)


# -- §4: encoder kinds --------------------------------------------------------------------------


class _KindsPipe(_Pipe):
    _encoder_modules = ["text_encoder", "image_encoder"]
    _resident_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.image_encoder = _Encoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(execution_device(self))
        cond = self.text_encoder(x) + self.image_encoder(x)
        return self.vae(self.backbone.dit(cond))


def test_image_encoder_stays_resident_when_only_text_encoder_is_selected() -> None:
    reference = _run(resident(_build(_KindsPipe)))
    pipe = _build(_KindsPipe)
    config = OffloadConfig(strategy="model_level", components=("dit", "text_encoder"))
    plan = resolve_offload_plan(pipe, config)
    assert plan.component("text_encoder").selected
    assert plan.component("image_encoder").role == "encoder"
    assert not plan.component("image_encoder").selected
    platform = CpuPlatform(race_amplifier=True)
    backend = get_offload_backend(config, platform=platform)
    states: list[tuple[bool, bool]] = []
    try:
        backend.enable(pipe)
        h = pipe.backbone.dit.register_forward_pre_hook(lambda m, a: states.append((
            all(platform.is_resident(t) for t in pipe.image_encoder.parameters()),
            any(platform.is_resident(t) for t in pipe.text_encoder.parameters()))))
        assert torch.equal(_run(pipe), reference)
        h.remove()
        assert states == [(True, False)]  # image encoder on the device, text encoder swapped
        assert "image_encoder" not in dict(backend.swap_log())
        assert backend.plan.predicted_device_bytes() == backend.stats().peak_device_bytes
    finally:
        backend.disable()
        platform.close()


def test_encoder_kinds_come_from_declarations_then_names() -> None:
    pipe = _build(_KindsPipe)
    both = resolve_offload_plan(pipe, OffloadConfig(strategy="model_level"))
    assert all(c.selected for c in both.encoders)  # the default selects every encoder kind
    legacy = OffloadConfig.from_od_config(type("Od", (), {"enable_cpu_offload": True})())
    assert all(c.selected for c in resolve_offload_plan(pipe, legacy).encoders)
    only_images = OffloadConfig(strategy="model_level", components=("dit", "image_encoder"))
    plan = resolve_offload_plan(pipe, only_images)
    assert [c.path for c in plan.encoders if c.selected] == ["image_encoder"]
    # A declaration beats the attribute name.
    pipe.__dict__["_offload_plan"] = OffloadPlan(
        encoder_component_types={"image_encoder": "text_encoder"})
    plan = resolve_offload_plan(pipe, OffloadConfig(strategy="model_level",
                                                    components=("dit", "text_encoder")))
    assert all(c.selected for c in plan.encoders)
    with pytest.raises(ValueError, match="encoder_component_types.*'vae'.*text_encoder"):
        OffloadPlan(encoder_component_types={"image_encoder": "vae"})


# -- §4: split-model delegation receives the parallel facts -----------------------------------


class _Split(nn.Module):
    def __init__(self, enable: Callable[..., None]) -> None:
        super().__init__()
        self.received: dict[str, Any] = {}
        self._enable = enable

    def enable_omni_model_cpu_offload(self, **kwargs: Any) -> None:  # replaced per instance
        raise NotImplementedError

    def disable_omni_model_cpu_offload(self) -> None:
        self.received["disabled"] = True


def _split_with(signature: str) -> _Split:
    namespace: dict[str, Any] = {}
    exec(f"def enable(self, {signature}):\n    self.received.update(locals())\n"
         "    self.received.pop('self')\n", namespace)
    cls = type("KitSplit", (_Split,), {"enable_omni_model_cpu_offload": namespace["enable"]})
    return cls(namespace["enable"])


@pytest.mark.parametrize("signature,expected", [
    ("*, device, pin_memory", {"device", "pin_memory"}),
    ("*, device, pin_memory, use_hsdp, world_size",
     {"device", "pin_memory", "use_hsdp", "world_size"}),
    ("*, device, pin_memory, **kwargs",
     {"device", "pin_memory", "kwargs"}),
])
def test_delegation_passes_the_parallel_facts_it_accepts(signature: str, expected: set) -> None:
    pipe = _split_with(signature)
    config = OffloadConfig(strategy="model_level", components=("dit",), use_hsdp=True,
                           world_size=2, pin_memory=False)
    platform = CpuPlatform()
    backend = get_offload_backend(config, platform=platform)
    try:
        backend.enable(pipe)
        received = dict(pipe.received)
    finally:
        backend.disable()
        platform.close()
    assert set(received) == expected
    assert received["pin_memory"] is False
    facts = received.get("kwargs", received)
    if "use_hsdp" in facts or "kwargs" in received:
        assert facts["use_hsdp"] is True and facts["world_size"] == 2
    if "kwargs" in received:
        assert facts["components"] == ("dit",) and facts["platform"] is platform
