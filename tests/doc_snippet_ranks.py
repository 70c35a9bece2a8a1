"""The rank function of docs/distributed-coordination.md's run_ranks example
(tests/test_docs_snippets.py): importable, so spawned ranks can run it."""

from __future__ import annotations


def check(rank: int, world: int, spec_name: str) -> str:
    return f"{spec_name} on rank {rank} of {world}"
