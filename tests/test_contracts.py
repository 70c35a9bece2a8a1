"""The conformance kit on every built-in fixture pipeline (``pytest -m contract``)."""

from __future__ import annotations

import pytest

from offload_ref.contracts.pytest_support import check_params
from offload_ref.fixtures import SPECS

# Distributed layerwise has no backend yet: only its pure resolution checks run.
_PARAMS = check_params(SPECS, include_global=True)


@pytest.mark.parametrize("check", _PARAMS)
def test_contract(check) -> None:
    check()


def test_the_catalogue_covers_every_fixture_and_section() -> None:
    ids = [p.id for p in _PARAMS]
    assert len(ids) >= 100, len(ids)
    for spec in SPECS:
        assert any(f"-{spec.name}-" in i for i in ids), f"no check runs on {spec.name}"
    sections = {p.values[0].info.section[0] for p in _PARAMS}
    assert set("ABCDEFG") <= sections, sections
