"""The check catalogue: plain importable functions with stable public ids."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CATALOGUE", "CheckFailure", "CheckInfo", "check", "fail"]


class CheckFailure(AssertionError):
    """A contract does not hold.  The message names the check, the object and both values."""


def fail(message: str) -> None:
    raise CheckFailure(message)


ALL_STRATEGIES = ("model_level", "layer_wise", "distributed_layer_wise")


@dataclass(frozen=True)
class CheckInfo:
    """One check of the catalogue.

    ``scope="spec"`` checks run once per pipeline spec and strategy (for the strategies the spec
    supports among ``strategies``); ``scope="global"`` checks need no pipeline and run once.
    ``applies(spec, strategy)`` narrows a spec check to pipelines with the needed shape (a
    check that does not apply is not generated, it is never skipped).
    """

    id: str
    func: Callable[[Any], None]
    section: str
    scope: str = "spec"
    strategies: tuple[str, ...] = ALL_STRATEGIES
    applies: Callable[[Any, str], bool] | None = None
    requires_support: bool = True  # the spec must list the strategy (False: resolution-only)
    title: str = ""

    def __call__(self, case: Any) -> None:
        self.func(case)


CATALOGUE: dict[str, CheckInfo] = {}


def check(
    section: str,
    *,
    scope: str = "spec",
    strategies: tuple[str, ...] = ALL_STRATEGIES,
    applies: Callable[[Any, str], bool] | None = None,
    requires_support: bool = True,
) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    """Register a check function; its name is its public id (``check_<subject>_<behaviour>``)."""

    def register(func: Callable[[Any], None]) -> Callable[[Any], None]:
        name = func.__name__
        if not name.startswith("check_"):
            raise ValueError(f"check ids start with 'check_': {name}")
        if name in CATALOGUE:
            raise ValueError(f"duplicate check id {name}")
        doc = (func.__doc__ or "").strip().splitlines()
        CATALOGUE[name] = CheckInfo(name, func, section, scope, tuple(strategies), applies,
                                    requires_support, doc[0] if doc else "")
        return func

    return register
