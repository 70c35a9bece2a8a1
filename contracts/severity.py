"""How bad a failure is: its severity, so that a verdict weighs what it found.

A failed case says *that* a contract does not hold; its severity says what a user would suffer
from it, one of four levels, worst first (:class:`Severity`):

``wrong output``
    a generation, or a value the user reads (a weight through ``.data`` or ``state_dict()``, a
    gradient), differs from the un-offloaded truth, or the pipeline's tensors are no longer the
    model as built (another dtype, device, layout or sharing): silently wrong numbers.  A
    stream race (:mod:`.streams`) is one too: the simulated accelerator's values are right, but
    on a GPU the same ordering computes with bytes still being copied.
``error``
    an exception raised into the user's generation, ``enable()`` or ``disable()`` (a device
    mismatch, a crash, a retry that fails), the wrong exception where a clear one is the
    contract, or a state that makes the user's next call raise (weights left as inference
    tensors, or on the host where the pipeline placed them on the device): loud, but the
    user's run stops.
``memory``
    memory not returned or held beyond the contract: device bytes left after ``disable()``, a
    peak over the plan's bound, more blocks resident than the strategy allows, host memory that
    grows with cycles, copies the plan does not need.
``trace``
    a leftover trace that changes nothing computed: an attribute (diffusers' ``_all_hooks``,
    ``_diffusers_hook``), a hook or registry left after ``disable()``, a tensor object replaced
    by an equal one, a warning or a statistic that is off.

Where the level comes from, first match:

1. the failure site: ``fail(message, severity=...)`` (:func:`~.registry.fail`) says what it
   found;
2. an exception that is not a :class:`~.registry.CheckFailure` (the case's outcome is
   ``error``) is an error raised into the user's code: ``error``;
3. a failure whose message lists the kit's own "not as built" problems (attributes added,
   values changed, bytes held: ``contracts/facts.py`` and ``observable.py`` word them)
   is as bad as the worst problem it lists (:func:`of_problems`);
4. the check's default (:data:`DEFAULTS`, by what the check asserts), or the ``severity=`` a
   check registered outside the kit gives :func:`~.registry.check`; but a failure that
   reports an exception out of the user's generation, ``enable()`` or ``disable()`` ("the
   first thread's generation failed: IndexError: ...") is an ``error``, whatever the check;
5. otherwise ``wrong output``: a check that says nothing of its failures is never taken for a
   lesser one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import Enum

__all__ = ["DECLARED", "DEFAULTS", "Severity", "declare", "default_for", "judge", "of_problems",
           "worst"]


class Severity(str, Enum):
    """The four levels, worst first (their order is their rank)."""

    WRONG_OUTPUT = "wrong output"
    ERROR = "error"
    MEMORY = "memory"
    TRACE = "trace"

    @property
    def rank(self) -> int:
        """0 for the worst level."""
        return list(Severity).index(self)

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value: Severity | str) -> Severity:
        """The level ``value`` names (a member, its value ``"wrong output"`` or its name
        ``"WRONG_OUTPUT"``); anything else is a ``ValueError`` listing the levels."""
        if isinstance(value, cls):
            return value
        text = str(value).strip()
        for member in cls:
            if text in (member.value, member.name, member.name.lower()):
                return member
        raise ValueError(f"unknown severity {value!r}; one of "
                         + ", ".join(repr(m.value) for m in cls) + " (worst first)")


W, E, M, T = Severity.WRONG_OUTPUT, Severity.ERROR, Severity.MEMORY, Severity.TRACE

#: The kit's checks whose default is not ``wrong output`` (every other check asserts values a
#: user computes with, or an invalid setup accepted that would compute them wrongly), by what
#: each asserts.
DEFAULTS: dict[str, Severity] = {
    # §A: what the resolver warns about
    "check_attribute_scan_warns_once_per_pipeline_class": T,
    # §B: a failed enable -- its state is judged problem by problem (of_problems); what remains
    # is the error itself (not chained, not retryable) or the bytes it held
    "check_failed_enable_can_be_retried": E,
    "check_failed_enable_releases_memory_and_chains_the_cause": M,
    "check_failed_enable_restores_the_pipeline": T,
    "check_enable_failing_part_way_leaves_the_pipeline_as_it_was": T,
    # §C: what disable leaves
    "check_cycles_do_not_grow_memory": M,
    "check_disable_removes_every_trace": T,
    "check_disable_restores_parameters_and_placement": T,
    "check_every_disable_restores_tensors_and_frees_the_device": T,
    "check_second_disable_is_a_noop": T,
    "check_second_enable_changes_nothing_observable": T,
    "check_second_enable_is_idempotent_and_exclusive": E,
    # §D: a shared storage copied apart holds its bytes twice
    "check_shared_storage_stays_shared_while_enabled": M,
    # §E: what a split model keeps resident, and its refusals
    "check_split_model_keeps_exactly_one_component_resident": M,
    "check_split_model_rejects_unknown_component": E,
    "check_split_model_failed_enable_calls_disable": E,
    # §F: bytes and copies
    "check_peak_device_bytes_stay_within_the_plan_bound": M,
    "check_model_level_keeps_one_group_resident": M,
    "check_model_level_swaps_move_component_bytes_host_to_device_only": M,
    "check_stats_match_what_the_platform_saw": T,
    "check_layerwise_keeps_at_most_two_blocks_resident": M,
    "check_layerwise_materializes_only_block_zero_between_passes": M,
    "check_layerwise_prefetches_the_next_block_before_it_runs": M,
    "check_offloaded_tensors_keep_their_alignment": W,
    # §H: per-rank bytes, and errors that must reach every rank
    "check_allgather_host_bytes_per_rank_are_one_over_world": M,
    "check_allgather_keeps_two_slots_per_rank": M,
    "check_no_collective_at_enable": E,
    "check_wave_with_unequal_steps_is_rejected_before_any_collective": E,
    "check_failed_rank_makes_every_rank_raise_naming_it": E,
    "check_rank_whose_plan_is_skipped_makes_every_rank_raise": E,
    # §J: refusals that must be clear errors
    "check_cyclic_module_graph_is_rejected_before_mutation": E,
    "check_sparse_buffer_is_rejected_before_mutation": E,
}
del W, E, M, T

#: The kit's "not as built" problem texts, each with its level (first match wins).  They are
#: written by ``Snapshot.diff`` (contracts/facts.py) and the state checks of
#: contracts/checks/observable.py and lifecycle.py.
_PROBLEMS: tuple[tuple[re.Pattern[str], Severity], ...] = tuple(
    (re.compile(pattern), level) for pattern, level in (
        # values a user computes with
        (r"^values of \S+ changed", Severity.WRONG_OUTPUT),
        (r"^storage sharing ", Severity.WRONG_OUTPUT),
        # bytes
        (r"bytes (are )?still (allocated|held)|^device bytes |bytes \S+ are still held|"
         r"\bbytes \d+ -> \d+", Severity.MEMORY),
        # residue that computes nothing
        (r": not the same tensor object$", Severity.TRACE),
        (r"^module \S+ attributes: ", Severity.TRACE),
        (r"^module \S+ hooks: ", Severity.TRACE),
        (r"^module-global hooks ", Severity.TRACE),
        (r"^torch\.distributed initialization state changed", Severity.TRACE),
        (r"^is_enabled\(\) is True", Severity.TRACE),
    ))

#: A failure whose first line reports an exception out of the user's own call (a generation,
#: enable() or disable()), which a check that compares outputs caught before any output.
_RAISED = re.compile(r"\b(generation|enable\(\)|disable\(\))[^:;]*\b(failed|raised):? "
                     r"[A-Z]\w*(Error|Exception|Interrupt|Exit)\b"
                     r"|\bwas refused without saying what to do\b"
                     # a state that makes the next call raise: weights the model was built with
                     # as ordinary tensors left as inference tensors
                     r"|\bweights are inference tensors\b")

#: A failure message listing problems: ``...: ['problem', "problem", ...]`` (a Python list, as
#: the checks print ``problems[:6]``).
_LIST = re.compile(r":\s*(\[(?:'|\").*(?:'|\")\])\s*$", re.DOTALL)


#: The fields of a tensor's record in ``Snapshot.diff``'s ``tensor NAME: (...) -> (...)`` and in
#: observable.py's ``NAME: (device, dtype, shape, stride, requires_grad, inference) A -> B``.
_SNAPSHOT_FIELDS = ("id", "device", "data_ptr", "dtype", "shape", "stride", "offset",
                    "requires_grad", "inference")
_META_FIELDS = ("device", "dtype", "shape", "stride", "requires_grad", "inference")
_TENSOR_CHANGE = re.compile(r"^tensor \S+: (\(.*\)|None) -> (\(.*\)|None)$")
_META_CHANGE = re.compile(r": \(device, dtype, shape, stride, requires_grad, inference\) "
                          r"(\(.*\)) -> (\(.*\))$")


def _fields(text: str) -> list[str] | None:
    """The top-level comma-separated fields of a tuple's repr (None for ``None``)."""
    text = text.strip()
    if text == "None" or not (text.startswith("(") and text.endswith(")")):
        return None
    out, depth, start = [], 0, 1
    for i, ch in enumerate(text[1:-1], 1):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    out.append(text[start:-1].strip())
    return out


def _tensor_change(names: tuple[str, ...], before: str, after: str) -> Severity:
    """A tensor's record changed: another dtype, shape or stride computes other numbers (a
    tensor gone too); another grad mode (an inference tensor) makes a later backward or edit
    raise; left on an accelerator it holds device bytes; another object or address alone is a
    trace."""
    a, b = _fields(before), _fields(after)
    if a is None or b is None or len(a) != len(names) or len(b) != len(names):
        return Severity.WRONG_OUTPUT  # a tensor appeared or vanished
    changed = {n for n, x, y in zip(names, a, b) if x != y}
    if changed & {"dtype", "shape", "stride"}:
        return Severity.WRONG_OUTPUT
    if changed & {"requires_grad", "inference"}:
        return Severity.ERROR
    if "device" in changed:
        now = b[names.index("device")]
        # left on an accelerator: its bytes stay held; moved to the host: the pipeline's own
        # placement is gone, and its next generation mixes devices
        return Severity.ERROR if "cpu" in now else Severity.MEMORY
    return Severity.TRACE


def of_problems(problems: Iterable[str]) -> Severity | None:
    """The worst level among the kit's "not as built" problem texts; None when one of them is
    not a text the kit knows (the caller falls back to the check's default)."""
    found: list[Severity] = []
    for problem in problems:
        change = _TENSOR_CHANGE.search(problem)
        meta = _META_CHANGE.search(problem) if change is None else None
        if change is not None or meta is not None:
            names = _SNAPSHOT_FIELDS if change is not None else _META_FIELDS
            match = change if change is not None else meta
            found.append(_tensor_change(names, match.group(1), match.group(2)))
            continue
        for pattern, level in _PROBLEMS:
            if pattern.search(problem):
                found.append(level)
                break
        else:
            return None  # a problem the table does not know: do not guess from the others
    return worst(found)


def _listed_problems(message: str) -> list[str] | None:
    """The problem list at the end of a failure's first line, if it has one."""
    import ast

    first = message.strip().splitlines()[0] if message.strip() else ""
    match = _LIST.search(first)
    if match is None:
        return None
    try:
        value = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return None
    return [str(v) for v in value] if isinstance(value, list) and value else None


def worst(levels: Iterable[Severity | str | None]) -> Severity | None:
    """The worst of ``levels`` (None entries ignored); None when there is none."""
    known = [Severity.of(v) for v in levels if v is not None]
    return min(known, key=lambda s: s.rank) if known else None


#: check id -> the ``severity=`` it was registered with (:func:`~.registry.check` records it)
DECLARED: dict[str, Severity] = {}


def declare(check_id: str, level: Severity | str | None) -> None:
    """Record the level ``check_id`` was registered with (None: forget it)."""
    if level is None:
        DECLARED.pop(check_id, None)
    else:
        DECLARED[check_id] = Severity.of(level)


def default_for(check_id: str) -> Severity:
    """What a failure of ``check_id`` is when its site says nothing: the ``severity=`` it was
    registered with, else :data:`DEFAULTS`, else ``wrong output``."""
    return DECLARED.get(check_id) or DEFAULTS.get(check_id, Severity.WRONG_OUTPUT)


def judge(check_id: str, outcome: str, message: str = "",
          stated: Severity | str | None = None) -> Severity | None:
    """The severity of one case (None for an outcome that is no failure).  ``stated`` is the
    ``severity`` the failure site gave its :class:`~.registry.CheckFailure`, if any: it
    decides."""
    if outcome not in ("failed", "error"):
        return None
    if stated is not None:
        return Severity.of(stated)
    if outcome == "error":
        return Severity.ERROR
    problems = _listed_problems(message)
    if problems is not None:
        level = of_problems(problems)
        if level is not None:
            return level
    first = message.strip().splitlines()[0] if message.strip() else ""
    if _RAISED.search(first):
        return Severity.ERROR  # it found an exception in the user's call, not an output
    return default_for(check_id)
