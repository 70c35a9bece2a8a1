"""`offload-ref plan`'s component lines read at a glance: one level of parentheses."""

from __future__ import annotations

import re

import pytest

from offload_ref import OffloadConfig
from offload_ref.fixtures import SPECS
from offload_ref.plan import resolve_offload_plan

# "  text_encoder (encoder, kind text_encoder, resident): 23104 bytes"
_COMPONENT = re.compile(r"^  (\S+) \((?P<flags>[^()]*)\): \d+ bytes$")


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_component_lines_have_one_level_of_parentheses(spec) -> None:
    pipeline = spec.build()
    for strategy in ("model_level", "layer_wise"):
        if not spec.supports(strategy):
            continue
        lines = resolve_offload_plan(pipeline, OffloadConfig(strategy=strategy)).describe()
        components = [ln for ln in lines.splitlines()
                      if ln.startswith("  ") and not ln.startswith("   ")]
        assert components or "delegated" in lines, lines
        for line in components:
            match = _COMPONENT.match(line)
            assert match, f"{spec.name}/{strategy}: {line!r}"
            flags = match["flags"].split(", ")
            assert "offloaded" in flags or "resident" in flags, line


def test_a_role_of_another_kind_names_the_kind_as_a_flag() -> None:
    spec = next(s for s in SPECS if s.name == "sd3")
    text = resolve_offload_plan(spec.build(), OffloadConfig(strategy="layer_wise")).describe()
    assert "  text_encoder (encoder, kind text_encoder, resident): " in text, text
