"""``ResolvedComponent.role`` is a :class:`ComponentRole`, a ``str`` Enum: code (and the kit) that
compares roles with, looks them up by, or prints them as plain strings sees what it saw before."""

from __future__ import annotations

import dataclasses
import json

import pytest

from offload_ref import OffloadConfig
from offload_ref.fixtures import get_spec
from offload_ref.plan import ComponentRole, resolve_offload_plan


@pytest.mark.parametrize("role", list(ComponentRole), ids=lambda r: r.value)
def test_a_role_is_its_string_everywhere_it_is_printed_or_looked_up(role: ComponentRole) -> None:
    value = role.value
    assert role == value and hash(role) == hash(value)
    assert {value: 1}[role] == 1 and {role: 1}[value] == 1
    assert str(role) == f"{role}" == "%s" % role == "{}".format(role) == value
    assert f"{role:>10}" == f"{value:>10}" and f"_{role}_modules" == f"_{value}_modules"
    assert json.dumps({role: [role]}) == json.dumps({value: [value]})
    assert ComponentRole(value) is role and ComponentRole(role) is role


def test_the_resolver_makes_members_and_a_plain_string_becomes_one() -> None:
    pipeline = get_spec("wan22_t2v").build()
    plan = resolve_offload_plan(pipeline, OffloadConfig(strategy="model_level"))
    assert plan.components and all(type(c.role) is ComponentRole for c in plan.components)
    assert {c.role for c in plan.components} == {"dit", "encoder", "vae"}
    assert plan.by_role("dit") == plan.by_role(ComponentRole.DIT) == plan.dits
    # The kind defaults to the role's value, a plain str (as it was).
    assert all(type(c.kind) is str for c in plan.components)
    vae = plan.by_role("vae")[0]
    as_encoder = dataclasses.replace(vae, role="encoder")
    assert as_encoder.role is ComponentRole.ENCODER and as_encoder.kind == "vae"
