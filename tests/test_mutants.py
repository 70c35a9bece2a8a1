"""The kit proves itself: every deliberately broken offloader fails exactly the checks it should,
and every check of sections A-F is failed by at least one mutant (§G: test_mutants_config.py)."""

from __future__ import annotations

import warnings

import pytest

from offload_ref.contracts.checks import distributed
from offload_ref.contracts.mutants import MUTANTS
from offload_ref.contracts.runner import load_catalogue
from device_helpers import SIMULATED  # noqa: E402 (tests/ is on sys.path)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_fails_exactly_its_checks(mutant, monkeypatch) -> None:
    # A collective the other rank never matches (eager_collective_at_enable) raises after the
    # two-rank batch's collective timeout, 20 s; every check's verdict is the same at 6 s
    # (H.5's bound on a prompt failure is FAIL_TIMEOUT_S / 2, 4 s), and the ranks' own
    # collectives on the tiny fixtures take milliseconds.
    monkeypatch.setattr(distributed, "COLLECTIVE_TIMEOUT_S", 6.0)
    assert distributed.COLLECTIVE_TIMEOUT_S > distributed.FAIL_TIMEOUT_S / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # broken hooks raise inside forward on purpose
        failed = mutant.run()
    expected = mutant.expected_kills(placement=SIMULATED)
    assert failed == expected, (
        f"{mutant.name} ({mutant.defect}): unexpected failures {sorted(failed - expected)}, "
        f"missing failures {sorted(expected - failed)}")


def test_every_pipeline_check_is_killed_by_some_mutant() -> None:
    ids = {i.id for i in load_catalogue().values() if i.scope == "spec"}
    killed = set().union(*(m.kills for m in MUTANTS))
    assert ids <= killed, f"checks no mutant fails (they cannot be shown to fail): {sorted(ids - killed)}"


def test_the_repeated_enable_checks_are_catalogue_checks_some_mutant_claims() -> None:
    """Mutant.checks and the whole-kit tests leave out REPEATED_ENABLE_CHECKS by name: a name
    that is no check would leave out nothing, and one no mutant claims would never run here."""
    from offload_ref.contracts.checks.lifecycle import REPEATED_ENABLE_CHECKS

    assert REPEATED_ENABLE_CHECKS <= set(load_catalogue())
    for check in REPEATED_ENABLE_CHECKS:
        assert any(check in m.checks() for m in MUTANTS), check


def test_mutant_names_are_unique_and_described() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert all(m.defect and m.kills for m in MUTANTS)
