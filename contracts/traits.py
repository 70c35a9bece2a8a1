"""What a spec check may require of a pipeline: one frozen record of facts per (spec, strategy).

A check names the traits it requires instead of probing the pipeline itself::

    @check("A.5", requires=("has_vae", "not delegates_model_level"))

The runner keeps one record per (spec, strategy) (``checks/_traits.py``,
:func:`~offload_ref.contracts.checks._traits.traits_of`), each trait probed once, for every check
that requires it, and plans a check whose requirement does not hold as not applicable, with the
reason, before anything runs.  A requirement is

* ``"trait"``: the trait holds (is truthy);
* ``"not trait"``: it does not;
* ``"trait>=N"``: a count trait is at least ``N``.

The reason a case does not apply is the probe's own explanation where it has one (a
:class:`Missing` value, or the count and what it counted), else ``needs <the check's needs>``;
a check's ``needs`` defaults to the texts of the traits it requires, joined by "and".  Checks
registered outside the kit may still pass an ``applies(spec, strategy)`` predicate (and
``needs``); the runner asks it after the requirements, on the same planning path.

This module only declares; it imports nothing of the kit, so that the registry can validate a
check's requirements when it is registered.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Missing", "PipelineTraits", "Requirement", "TRAITS", "name_in", "needs_of", "parse",
           "required_traits", "unmet"]


@dataclass(frozen=True)
class Missing:
    """A trait the pipeline lacks, with the reason the report prints (falsy)."""

    why: str

    def __bool__(self) -> bool:
        return False


def _trait(needs: str, *, needs_not: str = "", at_least: str = "", at_least_why: str = "",
           reads: tuple[str, ...] = ()) -> Any:
    """A field of :class:`PipelineTraits` that a check may require.

    ``needs``: what a check requiring it needs (the reason printed when it does not hold);
    ``needs_not``: the same for ``"not <trait>"`` (default: "a pipeline without <needs>");
    ``at_least`` / ``at_least_why``: for a count, the needs text and the reason of ``>=N``
    (``{n}`` the number, ``{words}`` it spelled out, ``{value}`` the count, and the traits
    named in ``reads``, probed with it).
    """
    return field(default=None, metadata={"needs": needs, "needs_not": needs_not,
                                         "at_least": at_least, "at_least_why": at_least_why,
                                         "reads": reads})


@dataclass(frozen=True)
class PipelineTraits:
    """The facts about one pipeline spec under one strategy that decide which checks apply,
    each computed once (``checks/_traits.py``).  Only the traits in :attr:`probed` are known
    (the others are None): the kit probes those the selected checks require, so that selecting
    one check costs its own probes only.  A trait whose probe raised is None and its exception
    is in :attr:`errors`: a check requiring it is reported as an error of planning (with that
    exception), the checks that do not are unaffected."""

    spec: str
    strategy: str
    #: The strategy is model level and the pipeline implements SupportsModelCpuOffload
    #: (``enable_omni_model_cpu_offload``): offload-ref hands model level to the pipeline.
    delegates_model_level: bool = _trait(
        "a pipeline implementing SupportsModelCpuOffload",
        needs_not="a pipeline that does not delegate model level (SupportsModelCpuOffload)")
    #: It delegates model level, and its phases are ComponentGroups the kit can observe.
    split_model: bool = _trait(
        "a split model (SupportsModelCpuOffload) whose phases are component groups")
    #: A split model with the Cosmos3 phases 'reasoner' and 'generator' in one ComponentGroups.
    reasoner_and_generator: bool = _trait(
        "a split model with 'reasoner' and 'generator' phases")
    #: The pipeline has a VAE (offload_ref.discovery finds one).
    has_vae: bool = _trait("a declared VAE")
    #: The path of the first DiT, None when there is none.
    dit_path: str | None = _trait("a DiT")
    #: How many blocks the first DiT's declared block containers hold; None when there is no
    #: DiT (``dit_blocks>=N`` then holds: the check runs and fails naming the pipeline).
    dit_blocks: int | None = _trait(
        "a DiT with declared blocks", at_least="a DiT with {words} or more declared blocks",
        at_least_why="needs a DiT with {n} or more declared blocks; {dit_path} has {value}",
        reads=("dit_path",))
    #: ``(encoder path, container)`` of the first encoder holding an nn.ModuleList of two or
    #: more, or None.
    encoder_block_list: tuple[str, str] | None = _trait(
        "an encoder holding a block list (an nn.ModuleList of two or more)")
    #: Two or more of its tensors share one storage (a tied weight, views, aliases).
    shares_storage: bool = _trait(
        "tensors that share storage (a tied weight, views or aliases of one weight)")
    #: ``<block>.<parameter>`` of a parameter of the second streamed block of a ring that has
    #: a twin of the same name, shape and dtype in the first (so the two can be tied), or None
    #: (also when the plan does not resolve).
    tie_candidate: str | None = _trait(
        "two streamed blocks holding a parameter of the same name, shape and dtype (to tie)")
    #: ``<container>[<index>]`` of a block that can be left out of a streamed nn.ModuleList of
    #: three or more (the pipeline iterates the list, and runs without it), or why not.
    skippable_block: str | Missing = _trait(
        "a streamed nn.ModuleList of three or more blocks that the pipeline iterates (so one can "
        "be skipped)")
    #: The spec's factory and inputs are ``module:attr`` strings (spawned ranks import them).
    importable: bool | Missing = _trait(
        "an importable factory and inputs (module:attr, so that spawned ranks can rebuild the "
        "pipeline)")
    #: A DiT ring streams two or more blocks under the strategy, or why not.
    streams_blocks: bool | Missing = _trait("a DiT ring streaming two or more blocks")
    #: The traits probed, whose values above are known.
    probed: frozenset[str] = frozenset()
    #: ``(trait, exception)`` for each trait whose probe raised.
    errors: tuple[tuple[str, BaseException], ...] = field(default=(), compare=False)


#: The traits a check may require, by name: their fields.
TRAITS: dict[str, dataclasses.Field] = {
    f.name: f for f in dataclasses.fields(PipelineTraits) if "needs" in f.metadata}

_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_SYNTAX = re.compile(r"^\s*(?:(not)\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?:>=\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Requirement:
    """One parsed requirement: ``trait``, ``not trait`` or ``trait>=n``."""

    trait: str
    negated: bool = False
    at_least: int | None = None

    @property
    def meta(self) -> Mapping[str, Any]:
        return TRAITS[self.trait].metadata

    @property
    def needs(self) -> str:
        """What a check needs for this requirement to hold (its default ``needs`` text)."""
        meta = self.meta
        if self.at_least is not None:
            words = _WORDS[self.at_least] if self.at_least < len(_WORDS) else str(self.at_least)
            return meta["at_least"].format(n=self.at_least, words=words)
        if self.negated:
            return meta["needs_not"] or f"a pipeline without {meta['needs']}"
        return meta["needs"]

    def holds(self, value: Any) -> bool:
        if self.at_least is not None:
            return value is None or value >= self.at_least
        return not value if self.negated else bool(value)

    def why(self, values: Mapping[str, Any], needs: str) -> str:
        """The reason it does not hold, given the record's ``values`` and the check's ``needs``."""
        value = values[self.trait]
        if isinstance(value, Missing) and not self.negated:
            return value.why
        if self.at_least is not None and self.meta["at_least_why"]:
            return self.meta["at_least_why"].format(n=self.at_least, value=value, **values)
        return f"needs {needs}"


@functools.lru_cache(maxsize=None)
def parse(requirement: str) -> Requirement:
    """Parse one requirement; ``ValueError`` for bad syntax, an unknown trait (naming the traits)
    or ``>=`` on a trait that is no count."""
    match = _SYNTAX.match(requirement) if isinstance(requirement, str) else None
    if match is None:
        raise ValueError(f"requirement {requirement!r}: expected 'trait', 'not trait' or "
                         f"'trait>=N'; traits: {', '.join(TRAITS)}")
    negated, name, at_least = match.group(1) is not None, match.group(2), match.group(3)
    if name not in TRAITS:
        raise ValueError(f"requirement {requirement!r}: unknown trait {name!r}; traits: "
                         f"{', '.join(TRAITS)}")
    if at_least is not None and (negated or not TRAITS[name].metadata["at_least"]):
        counts = [n for n, f in TRAITS.items() if f.metadata["at_least"]]
        raise ValueError(f"requirement {requirement!r}: '>=' takes a count trait without 'not' "
                         f"({', '.join(counts)})")
    return Requirement(name, negated, None if at_least is None else int(at_least))


def name_in(requirement: Any) -> str | None:
    """The trait a requirement text names, if it is well formed."""
    match = _SYNTAX.match(requirement) if isinstance(requirement, str) else None
    return match.group(2) if match else None


def required_traits(requirements: Iterable[str]) -> set[str]:
    """The traits ``requirements`` read (those they name, and those their reasons name)."""
    return {name for r in requirements
            for name in (parse(r).trait, *TRAITS[parse(r).trait].metadata["reads"])}


def needs_of(requirements: Iterable[str]) -> str:
    """The default ``needs`` text of a check requiring ``requirements``."""
    return " and ".join(parse(r).needs for r in requirements)


def unmet(traits: PipelineTraits | Mapping[str, Any], requirements: Iterable[str],
          needs: str) -> str | None:
    """None when every requirement holds for ``traits`` (a record, or a mapping of the trait
    values a requirement reads); else the reason the first that does not hold gives.  A trait
    whose probe raised raises that exception here; one the record has not probed is a
    ``ValueError`` (ask ``traits_of`` for it)."""
    if isinstance(traits, PipelineTraits):
        errors, probed = dict(traits.errors), traits.probed
        values = {f.name: getattr(traits, f.name) for f in dataclasses.fields(traits)}
    else:
        errors, probed, values = {}, None, dict(traits)
    for text in requirements:
        req = parse(text)
        if req.trait in errors:
            raise errors[req.trait]
        unprobed = [] if probed is None else sorted(required_traits([text]) - probed)
        if unprobed:
            raise ValueError(f"the traits of {traits.spec} under {traits.strategy} do not include "
                             f"{', '.join(unprobed)}: not probed (ask traits_of for them)")
        if not req.holds(values[req.trait]):
            return req.why(values, needs)
    return None
