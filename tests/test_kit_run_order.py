"""The order in which :func:`run_checks` runs its cases (Note [Rank batches last] in
contracts/runner.py)."""

from __future__ import annotations

from offload_ref.contracts.runner import run_checks


def test_the_two_rank_batches_run_after_every_other_case() -> None:
    """Note [Rank batches last] in contracts/runner.py: a section H case starts a two-rank batch
    (a second or more) and the first of them sorts before the rest, so run in plan order the
    progress of a run stood at 0% while they ran.  Every other case comes first."""
    from offload_ref.fixtures import get_spec

    batch = "check_allgather_generation_after_an_interrupt_is_exact"  # sorts first of all
    order: list[str] = []
    results = run_checks([get_spec("nextstep")], include_global=False,
                         checks=[batch, "check_attribute_scan_warns_once_per_pipeline_class",
                                 "check_offloaded_output_matches_reference_bitwise"],
                         strategies=("distributed_layer_wise", "layer_wise"),
                         progress=lambda done, total, r: order.append(r.id.check))
    assert all(r.ok for r in results), [(str(r.id), r.message[:200]) for r in results]
    assert order[-1] == batch and batch not in order[:-1], order
    assert len(order) >= 3, order
