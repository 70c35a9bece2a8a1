"""Layout / HostMaster: the one host copy of every offloaded tensor (Note [Host master layout]).

Under test: ``HostMaster(Layout(named), CpuPlatform(), pin=True)`` then ``layout.views(flats)``
rebuilds every tensor with its shape, stride, dtype and values; tensors that shared a storage
share one in the rebuilt views at the same relative positions, unrelated tensors never alias;
only the touched span of a storage is stored, with exact sizes (no rounding); meta tensors and
dtype-reinterpreting views are rejected by name; nothing is pinned on the CPU platform.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_ref.host import HostMaster, Layout, address_phase, padded_span_bytes, region_bytes
from offload_ref.platform.base import aligned_empty
from offload_ref.platform import CpuPlatform

Named = Sequence[tuple[str, torch.Tensor]]


@pytest.fixture(scope="module")
def platform() -> Iterator[CpuPlatform]:
    p = CpuPlatform()
    try:
        yield p
    finally:
        p.close()


# -- helpers -------------------------------------------------------------------------------------


def _filled(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A flat tensor with distinct-ish, dtype-appropriate values."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _element_addresses(t: torch.Tensor) -> set[int]:
    """Byte addresses of the elements ``t`` can touch."""
    if t.numel() == 0:
        return set()
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return set((t.data_ptr() + offsets.flatten() * t.element_size()).tolist())


def _sharing_groups(named: Named) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, (_, t) in enumerate(named):
        if t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    return list(groups.values())


def _assert_round_trip(named: Named, platform: CpuPlatform, what: str) -> Layout:
    """Master + views rebuild ``named`` exactly, with the same sharing and no new aliasing."""
    originals = [(n, t.clone() if t.numel() else t, t) for n, t in named]
    layout = Layout(named)
    master = HostMaster(layout, platform, pin=True)
    try:
        views = layout.views(master.flats)
        assert len(views) == len(named), f"{what}: {len(views)} views for {len(named)} tensors"
        for (name, t), v, hv in zip(named, views, master.host_views()):
            where = f"{what}: {name}"
            assert v.shape == t.shape, f"{where}: shape {tuple(v.shape)} != {tuple(t.shape)}"
            assert v.dtype == t.dtype, f"{where}: dtype {v.dtype} != {t.dtype}"
            assert v.stride() == t.stride(), f"{where}: stride {v.stride()} != {t.stride()}"
            assert not v.is_meta and v.device.type == "cpu"
            torch.testing.assert_close(v, t, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, where=where: f"{where}: {m}")
            torch.testing.assert_close(hv, t, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, where=where: f"host_views {where}: {m}")
            if t.numel():  # Note [Aligned layout]: the address modulo 64 is kept
                assert v.data_ptr() % 64 == t.data_ptr() % 64, (
                    f"{where}: rebuilt at {v.data_ptr() % 64} bytes past a 64-byte boundary, "
                    f"was {t.data_ptr() % 64}")
        # Sharing: same storage, and the same relative byte positions as before.
        for group in _sharing_groups(named):
            first = group[0]
            for i in group[1:]:
                a, b = views[first], views[i]
                assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), (
                    f"{what}: {named[first][0]} and {named[i][0]} shared a storage; their "
                    "rebuilt views do not")
                before = named[i][1].data_ptr() - named[first][1].data_ptr()
                after = b.data_ptr() - a.data_ptr()
                assert after == before, (
                    f"{what}: {named[i][0]} sat {before} bytes from {named[first][0]}; rebuilt "
                    f"{after} bytes")
        # Unrelated tensors (different source storages) never alias.
        groups = _sharing_groups(named)
        addresses = [set().union(*(_element_addresses(views[i]) for i in g)) for g in groups]
        for (ga, aa), (gb, ab) in itertools.combinations(zip(groups, addresses), 2):
            overlap = aa & ab
            assert not overlap, (
                f"{what}: unrelated {[named[i][0] for i in ga]} and {[named[i][0] for i in gb]} "
                f"alias {len(overlap)} element(s) in the master")
        # Exact sizes: one flat per dtype, layout.nbytes in all.
        flat_bytes = sum(f.numel() * f.element_size() for f in master.flats.values())
        assert flat_bytes == layout.nbytes == master.nbytes, (
            f"{what}: flats hold {flat_bytes} bytes, layout says {layout.nbytes}")
        for dtype, flat in master.flats.items():
            assert flat.dtype == dtype and flat.dim() == 1
            assert flat.numel() == layout.numel[dtype]
            assert flat.untyped_storage().nbytes() == flat.numel() * flat.element_size(), (
                f"{what}: {dtype} flat storage is {flat.untyped_storage().nbytes()} bytes for "
                f"{flat.numel()} elements")
        assert not master.pinned and platform.pinned_bytes() == 0
        # The master is a copy: the originals are untouched and independent of it.
        for name, saved, t in originals:
            torch.testing.assert_close(t, saved, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m, name=name: f"{what}: source {name}: {m}")
            if t.numel():
                assert not (_element_addresses(t) & set().union(*map(_element_addresses, views)))
        return layout
    finally:
        master.release()


# -- the cases of the brief ------------------------------------------------------------------------


def test_contiguous_parameters_round_trip(platform) -> None:
    linear = torch.nn.Linear(4, 3)
    named = list(linear.named_parameters())
    layout = _assert_round_trip(named, platform, "contiguous")
    assert layout.weight_bytes == (4 * 3 + 3) * 4


def test_transposed_non_contiguous_weight_round_trips(platform) -> None:
    weight = _filled(15, torch.float32).view(3, 5).t()
    assert not weight.is_contiguous()
    layout = _assert_round_trip([("proj_out.weight", weight)], platform, "transposed")
    assert layout.weight_bytes == 15 * 4


def test_two_views_of_one_storage_keep_their_sharing(platform) -> None:
    base = _filled(16, torch.float32)
    a, b = base[2:10], base.view(4, 4).t()
    layout = _assert_round_trip([("a", a), ("b", b)], platform, "shared views")
    assert layout.weight_bytes == 16 * 4  # b touches the whole storage
    master = HostMaster(layout, platform, pin=True)
    va, vb = layout.views(master.flats)
    va[0] = 1234.0  # a write through one view is seen by the other, as before
    assert vb[2, 0].item() == 1234.0 and b[2, 0].item() != 1234.0
    master.release()


def test_offset_slice_stores_only_the_touched_span(platform) -> None:
    base = _filled(100, torch.float32)
    layout = _assert_round_trip([("slice", base[10:20])], platform, "offset slice")
    assert layout.weight_bytes == 10 * 4, layout.weight_bytes
    strided = base[10:30:2]  # touches elements 10..28
    layout = _assert_round_trip([("strided", strided)], platform, "strided slice")
    assert layout.weight_bytes == 19 * 4, layout.weight_bytes
    two = [("lo", base[40:45]), ("hi", base[50:52])]  # one storage: the span 40..52
    layout = _assert_round_trip(two, platform, "two slices")
    assert layout.weight_bytes == 12 * 4, layout.weight_bytes


def test_mixed_dtypes_round_trip(platform) -> None:
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]
    named = [(f"t_{str(d).split('.')[-1]}", _filled(6, d, seed=i).view(2, 3))
             for i, d in enumerate(dtypes)]
    named.append(("f32_t", _filled(6, torch.float32, seed=9).view(3, 2).t()))
    layout = _assert_round_trip(named, platform, "mixed dtypes")
    assert set(layout.numel) == set(dtypes)
    assert layout.numel[torch.float32] == 2 * 16  # two 24-byte segments, each in 64 bytes
    assert layout.weight_bytes == 6 * (4 + 8 + 2 + 8 + 1) + 6 * 4


def test_zero_element_tensors_round_trip(platform) -> None:
    base = _filled(8, torch.float32)
    named = [
        ("empty", torch.empty(0)),
        ("empty_3d", torch.empty(3, 0, 2)),
        ("empty_slice_of_base", base[3:3]),
        ("base", base),
        ("other", _filled(2, torch.float64)),
    ]
    layout = _assert_round_trip(named, platform, "zero-element")
    assert layout.weight_bytes == 8 * 4 + 2 * 8


def test_unrelated_zero_element_tensors_of_different_dtypes_round_trip(platform) -> None:
    named = [("empty_f32", torch.empty(0)), ("empty_i64", torch.empty(0, dtype=torch.int64))]
    _assert_round_trip(named, platform, "empty tensors of two dtypes")


def test_zero_element_view_does_not_widen_the_stored_span(platform) -> None:
    base = _filled(10, torch.float32)
    layout = Layout([("head", base[0:2]), ("empty_tail", base[8:8])])
    assert layout.weight_bytes == 2 * 4, layout.weight_bytes


def test_zero_dim_tensors_round_trip(platform) -> None:
    base = _filled(5, torch.float32)
    named = [
        ("scalar_f32", torch.tensor(1.5)),
        ("scalar_i64", torch.tensor(-7)),
        ("scalar_bool", torch.tensor(True)),
        ("element_of_base", base[3]),  # 0-dim view with storage_offset 3
        ("base_head", base[:2]),
    ]
    layout = _assert_round_trip(named, platform, "0-dim")
    assert sum(seg.numel for seg in layout.segments
               if seg.dtype == torch.float32) == 1 + 4  # scalar + base[0..3]


def test_exact_sizes_without_power_of_two_rounding(platform) -> None:
    layout = Layout([("three", _filled(3, torch.float32))])
    master = HostMaster(layout, platform, pin=True)
    try:
        # 12 weight bytes in one 64-byte aligned region (Note [Aligned layout]).
        assert layout.weight_bytes == 12 and layout.nbytes == master.nbytes == 64
        flat = master.flats[torch.float32]
        assert flat.numel() == 16 and flat.untyped_storage().nbytes() == 64
        assert platform.pinned_bytes() == 0 and not master.pinned
    finally:
        master.release()
    layout = Layout([("odd", _filled(7, torch.bfloat16)), ("bits", _filled(5, torch.bool))])
    assert layout.weight_bytes == 7 * 2 + 5


def test_meta_tensor_is_rejected_by_name() -> None:
    with pytest.raises(ValueError, match=r"blocks\.0\.weight.*meta"):
        Layout([("ok", torch.zeros(2)), ("blocks.0.weight", torch.empty(3, device="meta"))])


def test_views_of_one_storage_with_different_dtypes_are_rejected() -> None:
    base = torch.zeros(8)
    with pytest.raises(ValueError, match=r"as_f32.*as_i32|as_i32.*as_f32") as info:
        Layout([("as_f32", base), ("as_i32", base.view(torch.int32))])
    assert "float32" in str(info.value) and "int32" in str(info.value)


def test_pinned_bytes_stay_zero_on_the_cpu_platform(platform) -> None:
    layout = Layout([("w", _filled(64, torch.float32))])
    masters = [HostMaster(layout, platform, pin=True) for _ in range(3)]
    assert platform.pinned_bytes() == 0
    assert not any(m.pinned for m in masters)
    for m in masters:
        m.release()
    assert platform.pinned_bytes() == 0


# -- random layouts --------------------------------------------------------------------------------

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]


@st.composite
def _views_of_one_base(draw: st.DrawFn, index: int) -> list[tuple[str, torch.Tensor]]:
    dtype = draw(st.sampled_from(_DTYPES))
    numel = draw(st.integers(1, 48))
    base = _filled(numel, dtype, seed=draw(st.integers(0, 2**16)))
    views = []
    for j in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, 4)) for _ in range(ndim))
        stride = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
        span = sum((n - 1) * s for n, s in zip(shape, stride))
        if span >= numel:  # does not fit: fall back to a contiguous run
            length = draw(st.integers(1, numel))
            shape, stride, span = (length,), (1,), length - 1
        offset = draw(st.integers(0, numel - 1 - span))
        views.append((f"base{index}.view{j}", torch.as_strided(base, shape, stride, offset)))
    return views


@st.composite
def _named_tensors(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i in range(draw(st.integers(1, 3))):
        named += draw(_views_of_one_base(i))
    return draw(st.permutations(named))


@settings(derandomize=True, database=None, max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(named=_named_tensors())
def test_random_strided_views_round_trip(named: list[tuple[str, torch.Tensor]]) -> None:
    with CpuPlatform() as platform:
        layout = _assert_round_trip(named, platform, f"random layout {[n for n, _ in named]}")
    # Only the touched span of each storage is stored.
    spans: dict[int, tuple[int, int, int]] = {}
    for _, t in named:
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        key = t.untyped_storage().data_ptr()
        old = spans.get(key, (lo, hi, t.element_size()))
        spans[key] = (min(old[0], lo), max(old[1], hi), t.element_size())
    expected = sum((hi - lo) * size for lo, hi, size in spans.values())
    assert layout.weight_bytes == expected, (
        f"stored {layout.weight_bytes} bytes, touched spans {expected}")
    # Padding: what the plan predicts, and less than one region of slack per storage.
    assert layout.nbytes == padded_span_bytes([t for _, t in named], 64)
    assert layout.padding_bytes < 2 * 64 * max(1, len(spans))


# -- Note [Aligned layout] ------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [64, 256])
def test_every_view_keeps_its_alignment_phase(alignment: int) -> None:
    """Views at every element offset of one storage, and unrelated tensors between them, keep
    their address phase modulo the alignment in the master (the MKL GEMV defect: a weight moved
    4 bytes off a 64-byte boundary takes another kernel path)."""
    base = torch.randn(16 * 16 + 64)
    named = [(f"w{k}", base[k:k + 256].view(16, 16)) for k in range(0, 20, 3)]
    named += [("odd", torch.randn(5)), ("half", torch.randn(7).half()), ("b", base[1:2])]
    layout = Layout(named, alignment=alignment)
    flats = {d: aligned_empty(n, d, alignment) for d, n in layout.numel.items()}
    for (name, t), v in zip(named, layout.views(flats)):
        assert v.data_ptr() % 64 == t.data_ptr() % 64, name
        if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:  # alone
            assert v.data_ptr() % alignment == address_phase(t, alignment), name
    for dtype, n in layout.numel.items():
        assert (n * torch.empty((), dtype=dtype).element_size()) % alignment == 0
    assert layout.nbytes == padded_span_bytes([t for _, t in named], alignment)
    assert layout.weight_bytes + layout.padding_bytes == layout.nbytes


def test_phase_is_the_address_modulo_64_at_most() -> None:
    """A host tensor 64 bytes into a 256-byte window has phase 0 for a 256-byte platform (its
    device copy lands on a 256-byte boundary); a misaligned one keeps its offset modulo 64."""
    backing = aligned_empty(256, torch.float32, 256)
    assert address_phase(backing[16:32], 256) == 0 and address_phase(backing[16:32], 64) == 0
    assert address_phase(backing[1:], 64) == 4 and address_phase(backing[1:], 256) == 4
    assert address_phase(backing[17:], 256) == 4
    assert address_phase(backing[1:], 16) == 4 and address_phase(backing[4:], 16) == 0


def test_region_bytes() -> None:
    assert region_bytes(0, 0, 64) == 0
    assert region_bytes(0, 1, 64) == 64
    assert region_bytes(0, 64, 64) == 64
    assert region_bytes(4, 64, 64) == 128
    assert region_bytes(60, 4, 64) == 64


@pytest.mark.parametrize("alignment", [64, 256, 4096])
def test_aligned_empty(alignment: int) -> None:
    for numel in (0, 1, 3, 1000):
        for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.float64):
            t = aligned_empty(numel, dtype, alignment)
            assert t.numel() == numel and t.dtype == dtype
            if numel:
                assert t.data_ptr() % alignment == 0
