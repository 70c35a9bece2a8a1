"""The resolver's own module walks list what torch's generators list, in the same order.

``offload_ref.plan`` reads ``_modules`` / ``_parameters`` / ``_buffers`` directly instead of
``named_parameters`` / ``named_buffers`` / ``parameters`` / ``buffers`` (several times cheaper
per module); these checks hold it to torch's results on random trees with shared submodules,
tied tensors, None entries and non-persistent buffers.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from offload_ref.plan import _tensors, named_tensors


def _torch_named(module: nn.Module, prefix: str) -> list[tuple[str, int]]:
    out = [(n, id(p)) for n, p in module.named_parameters(prefix=prefix, remove_duplicate=False)]
    out += [(n, id(b)) for n, b in module.named_buffers(prefix=prefix, remove_duplicate=False)
            if b is not None]
    return out


def _torch_distinct(*modules: nn.Module) -> list[int]:
    seen: set[int] = set()
    out = []
    for m in modules:
        for t in [*m.parameters(), *(b for b in m.buffers() if b is not None)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(id(t))
    return out


@st.composite
def _trees(draw: st.DrawFn) -> nn.Module:
    """A random module tree; later nodes may reuse an earlier node (a shared submodule) or an
    earlier tensor (a tied parameter), and registries hold None entries."""
    nodes: list[nn.Module] = [nn.Module()]
    tensors: list[torch.Tensor] = []
    for i in range(draw(st.integers(1, 12))):
        parent = nodes[draw(st.integers(0, len(nodes) - 1))]
        kind = draw(st.sampled_from(["new", "shared", "none"]))
        if kind == "shared" and len(nodes) > 1:
            child = nodes[draw(st.integers(1, len(nodes) - 1))]
            if child is parent or _contains(child, parent):
                continue  # keep the tree acyclic
            parent._modules[f"s{i}"] = child
        elif kind == "none":
            parent._modules[f"n{i}"] = None
        else:
            child = nn.Module()
            nodes.append(child)
            parent._modules[f"m{i}"] = child
        owner = nodes[draw(st.integers(0, len(nodes) - 1))]
        what = draw(st.sampled_from(["param", "tied", "buffer", "transient", "none_buffer",
                                     "none_param"]))
        if what == "tied" and tensors and isinstance(tensors[0], nn.Parameter):
            owner.register_parameter(f"t{i}", tensors[0])
        elif what in ("param", "tied"):
            p = nn.Parameter(torch.zeros(2))
            tensors.append(p)
            owner.register_parameter(f"p{i}", p)
        elif what == "buffer":
            owner.register_buffer(f"b{i}", torch.zeros(1))
        elif what == "transient":
            owner.register_buffer(f"b{i}", torch.zeros(1), persistent=False)
        elif what == "none_buffer":
            owner.register_buffer(f"b{i}", None)
        else:
            owner.register_parameter(f"p{i}", None)
    return nodes[0]


def _contains(root: nn.Module, target: nn.Module) -> bool:
    return any(m is target for m in root.modules())


@settings(max_examples=150, deadline=None)
@given(_trees(), st.sampled_from(["", "transformer", "a.b"]))
def test_tensors_of_lists_every_path_in_torchs_order(tree: nn.Module, prefix: str) -> None:
    assert [(n, id(t)) for n, t in named_tensors(tree, prefix)] == _torch_named(tree, prefix)


@settings(max_examples=150, deadline=None)
@given(_trees())
def test_tensors_lists_distinct_tensors_in_torchs_order(tree: nn.Module) -> None:
    subs = [m for m in tree.modules()][:3]
    assert [id(t) for t in _tensors(tree)] == _torch_distinct(tree)
    assert [id(t) for t in _tensors(*subs)] == _torch_distinct(*subs)


def test_a_module_that_contains_itself_still_fails_as_torchs_walk_does() -> None:
    outer = nn.Sequential(nn.Linear(1, 1))
    outer[0].loop = outer
    try:
        named_tensors(outer, "")
    except RecursionError:
        return
    raise AssertionError("a cyclic tree was walked without an error")
