"""Deliberately broken offloaders: the kit proves each check can fail.

Every mutant is the real implementation with one defect that other offloaders have shipped (see
``shared/reference``).  ``tests/test_mutants.py`` runs the catalogue against each one and asserts
exactly which checks fail; a check that no mutant kills is itself a failing test.

Each module holds the mutants whose checks are in the checks module of the same name
(``plan.py``: ``checks/plan.py``, ...; ``protocol.py``: offloaders judged through the public
protocol alone), each mutant declared once, next to its defect, with its scope and the exact
checks it fails (``_declare.declare``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..case import Implementation
from ._declare import Mutant, backend_with, declared, with_ring

# Importing a module declares its mutants: MUTANTS lists them in this order.
from . import (  # noqa: F401
    plan, lifecycle, aliases, split, residency, misuse, distributed, protocol, streams,
)

__all__ = ["MUTANTS", "Mutant", "backend_with", "in_rank", "with_ring"]

MUTANTS: tuple[Mutant, ...] = declared()


def in_rank(name: str) -> tuple[Implementation, Any]:
    """The mutant ``name``'s implementation, in a spawned rank (``Implementation.in_rank``), and
    the context the rank enters around its work (none: a mutant changes nothing in place)."""
    mutant = next(m for m in MUTANTS if m.name == name)
    return mutant.impl, contextlib.nullcontext()
