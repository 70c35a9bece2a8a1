"""Stream ordering: every case the kit runs on the simulated accelerator runs under its
happens-before stream sanitizer, and a race is a failure of that case.

Note [The kit's stream checking]: the simulated accelerator (``hpu``) runs every stream in
program order, so its values are right whatever an offloader's streams do; its sanitizer
(offload_ref/platform/simulated, Note [Stream sanitizer] in simdevice.cpp) keeps per-stream vector
clocks instead and reports two accesses to the same memory on different streams, neither ordered
before the other, at least one a write (or memory reused while another stream may still use it).
On a GPU such a race computes with bytes still being copied, or overwrites bytes still being
read: a silently wrong output that shows only sometimes.  The check is by happens-before, not by
timing, so here it shows every run.

:func:`watching` wraps every case (``runner.run_case``: both ``offload-ref check`` and the pytest
route): stream checking on for the case, the races of earlier cases forgotten, a namer installed
that names racing memory by the module path of the pipeline tensor over it, and at the end the
races collected; any race fails the case (:class:`~.registry.CheckFailure`, severity ``wrong
output``) with :func:`race_report`'s message.  The party at fault is judged by
:func:`~.blame.race_party`: from the two accesses' frames (the offloader's files, noted during
the case; the pipeline's, noted while its pipelines were alive, since §S drops its pipeline
before the races are collected) and, where neither access is the offloader's code, from a rerun
of the pipeline resident with no offloader (:func:`races_alone`): the same race again is the
pipeline's own, none is the offloader's (its hooks ran the pipeline's code on a stream they made
current, say).  Memory no tensor is bound to when its race is found is named by the tensor a
module last computed with there (:func:`note_bindings`, recorded by §S at each forward's end).
``check_device_accesses_are_ordered_across_streams`` (checks/streams.py) gives every pipeline
and strategy a stream verdict of its own.

Where the simulated accelerator is unavailable (``--single-device``, ``OFFLOAD_REF_SIM=0``, no
compiler) stream checking is off, and the report's header says so and why (:func:`header_text`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from .registry import CheckFailure, CheckNotApplicable

__all__ = ["DOC", "bound_name", "current_streams_kept", "header_text", "name_memory",
           "name_range", "note_bindings", "note_pipeline", "off_reason", "race_report",
           "races_alone", "watching"]

#: Where a race report is explained.
DOC = "docs/model-authors.md#reading-a-race-report"

#: Groups of races (a kind between two streams) a failure shows: the first in full, the next
#: ones a line each, the rest counted; tensors named per group.
_SHOWN = 4
_LISTED = 8


def off_reason() -> str | None:
    """None when the kit checks stream ordering; else why it does not."""
    from offload_ref.platform import simulated

    reason = simulated.unavailable_reason()
    if reason is not None:
        if "OFFLOAD_REF_SIM=0" in reason:
            return ("--single-device (OFFLOAD_REF_SIM=0): host and device are both the CPU, with "
                    "no accelerator streams to check")
        return f"the simulated accelerator is unavailable: {reason}"
    if not hasattr(simulated.load(), "check_streams"):
        return ("this build of the simulated accelerator has no stream sanitizer "
                "(offload_ref/platform/simulated/simdevice.cpp)")
    return None


def header_text() -> str:
    """The report header's words on stream checking."""
    reason = off_reason()
    if reason is None:
        return "stream checking ON (happens-before, hpu streams)"
    return f"STREAM CHECKING OFF: {reason}"


# -- naming racing memory ----------------------------------------------------------------------


def _span(t: Any) -> tuple[int, int]:
    """``(first byte, bytes)`` a tensor's elements cover in memory."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), extent * t.element_size()


#: ``(address, bytes, name)`` of memory the running case named itself (:func:`name_range`).
_NAMED: list[tuple[int, int, str]] = []


def name_range(address: int, nbytes: int, name: str) -> None:
    """Name ``[address, address + nbytes)`` for the races of the running case (memory the kit
    allocates itself, such as the blocks §S reuses)."""
    _NAMED.append((address, nbytes, name))


#: The device memory modules computed with (:func:`note_bindings`): ``(device index, first
#: byte)`` -> ``[bytes, the module paths bound there in turn, the order of the latest binding]``.
_BOUND: dict[tuple[int, int], list[Any]] = {}
_BINDINGS = [0]


def note_bindings(module: Any, path: str, device: Any) -> None:
    """Record the memory on ``device`` that ``module``'s own parameters and buffers are bound to
    now, each by its module path (call it as the module's forward returns: what it computed
    with).  A race on memory no tensor is bound to when it is found (a ring slot between two
    blocks, a swapped-in copy already dropped) is named by the tensor bound there most recently
    (:func:`name_memory`).  A wrapper subclass is named by its inner tensors, which hold its
    memory (``.qdata``, ``.scale``: Note [Wrapper subclasses] in offload_ref/plan/tree.py)."""
    from .facts import module_tensors

    for name, t in module_tensors(module, recurse=False, remove_duplicate=False):
        if t.device != device:
            continue
        start, size = _span(t)
        if not size:
            continue
        full = f"{path}.{name}" if path else name
        _BINDINGS[0] += 1
        entry = _BOUND.setdefault((t.device.index or 0, start), [size, [], 0])
        entry[0] = max(entry[0], size)
        if not entry[1] or entry[1][-1] != full:
            entry[1].append(full)
        entry[2] = _BINDINGS[0]


def bound_name(device: int, address: int, nbytes: int) -> str | None:
    """The module path of the tensor bound most recently over most of ``[address, address +
    nbytes)`` on ``hpu:device`` (:func:`note_bindings`; each byte counts for its latest binding
    only), saying so, and which tensors were bound there before it when several were (a slot);
    None when none was."""
    end = address + max(int(nbytes), 1)
    hits = sorted(((order, start, size, names) for (index, start), (size, names, order)
                   in _BOUND.items() if index == device and start < end and address < start + size),
                  reverse=True)
    taken: list[tuple[int, int]] = []  # byte ranges a newer binding holds
    best: tuple[int, int, list[str]] | None = None
    for order, start, size, names in hits:
        if any(a < start + size and start < b for a, b in taken):
            continue  # bytes a newer binding took over
        taken.append((start, start + size))
        overlap = min(end, start + size) - max(address, start)
        if best is None or overlap > best[0]:
            best = (overlap, order, names)
    if best is None:
        return None
    names = list(dict.fromkeys(reversed(best[2])))  # newest first, each once
    if len(names) == 1:
        return f"{names[0]} (the tensor a module last computed with in that memory)"
    shown = ", ".join(names[1:4]) + (" ..." if len(names) > 4 else "")
    return (f"{names[0]} (the tensor a module last computed with in that memory, which held "
            f"{len(names)} tensors in turn; before it {shown})")


def name_memory(pipelines: Iterable[Any], address: int, nbytes: int,
                device: int | None = None) -> str | None:
    """The module path (``transformer.blocks.3.ff.weight``) of the parameter or buffer of
    ``pipelines`` whose elements cover most of ``[address, address + nbytes)``; else (with
    ``device``) the tensor a module computed with there most recently (:func:`bound_name`: a ring
    slot between blocks, a dropped swap-in); else one whose storage holds it (``the storage of
    PATH``: a slot's padding, a freed slab); None when no tensor of theirs is there."""
    from .blame import named_modules
    from .facts import module_tensors

    end = address + max(int(nbytes), 1)
    for start, size, name in reversed(_NAMED):
        if start < end and address < start + size:
            return name
    best: tuple[int, str] | None = None
    holder: str | None = None
    for pipeline in pipelines:
        for path, module in named_modules(pipeline):
            # a wrapper subclass by its inner tensors (Note [Wrapper subclasses])
            for name, t in module_tensors(module, recurse=False, remove_duplicate=False):
                if t.is_meta:
                    continue
                start, size = _span(t)
                overlap = min(end, start + size) - max(address, start)
                full = f"{path}.{name}" if path else name
                if overlap > 0:
                    if best is None or overlap > best[0]:
                        best = (overlap, full)
                elif holder is None:
                    storage = t.untyped_storage()
                    base = storage.data_ptr()
                    if base <= address < base + storage.nbytes():
                        holder = f"the storage of {full}"
    if best is not None:
        return best[1]
    bound = bound_name(device, address, nbytes) if device is not None else None
    return bound if bound is not None else holder


class _Namer:
    """The namer one case installs: the pipelines that case built (weakly held).  A race is found
    while its racing op runs, so the pipelines it found alive are noted (:func:`note_pipeline`)
    for the party at fault, judged after the case, when they may be gone."""

    def __init__(self, case: Any) -> None:
        self.case = case

    def __call__(self, device: int, address: int, nbytes: int) -> str | None:
        try:
            pipelines = self.case.built_pipelines()
            for pipeline in pipelines:
                note_pipeline(pipeline)
            return name_memory(pipelines, address, nbytes, device)
        except Exception:  # noqa: BLE001 - a name is a courtesy; the race is reported anyway
            return None


# -- whose code ---------------------------------------------------------------------------------

#: Source files of the offloader under test seen in this case: its hooks, its class, its factory
#: (:func:`note_offloader`).  offload-ref's own library files always count (its backends, its
#: platforms, the peers' adapters), its fixtures never (they are pipelines).
_OFFLOADER_FILES: set[str] = set()


def note_offloader(*objects: Any) -> None:
    """Remember the source files of ``objects`` (an offloader, its class, hooks, a factory) as
    the offloader's code for the races of the running case."""
    from .blame import code_file

    for obj in objects:
        path = code_file(obj)
        if path:
            _OFFLOADER_FILES.add(path)


def _offloader_files() -> set[str]:
    import offload_ref

    own = os.path.dirname(os.path.abspath(offload_ref.__file__))
    files = set(_OFFLOADER_FILES)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None) or ""
        if path.startswith(own + os.sep) and not path.startswith(
                os.path.join(own, "fixtures") + os.sep):
            files.add(os.path.abspath(path))
    return files


#: Source files of the pipelines of the running case (:func:`note_pipeline`): noted while they
#: are alive, since a check may drop its pipeline before the races are collected (§S does, to
#: reuse the memory its offloader freed).
_PIPELINE_FILES: set[str] = set()
_NOTED: set[int] = set()


def note_pipeline(pipeline: Any) -> None:
    """Remember the source files of ``pipeline``'s own code (its class, its modules' classes) as
    the pipeline's for the races of the running case."""
    from .blame import code_file, named_modules

    if id(pipeline) in _NOTED:
        return
    _NOTED.add(id(pipeline))
    _PIPELINE_FILES.add(code_file(type(pipeline)) or "")
    for _, module in named_modules(pipeline):
        _PIPELINE_FILES.add(code_file(type(module)) or "")
    _PIPELINE_FILES.discard("")


def _pipeline_files(case: Any) -> set[str]:
    """Source files of the pipelines' own code: their classes, their modules' classes (of the
    pipelines noted during the case and of those still alive), the spec's factory and inputs."""
    files: set[str] = set(_PIPELINE_FILES)
    for pipeline in case.built_pipelines():
        note_pipeline(pipeline)
    files |= _PIPELINE_FILES
    spec = getattr(case, "spec", None)
    for ref in (getattr(spec, "factory", None), getattr(spec, "inputs", None)):
        if isinstance(ref, str) and ":" in ref:
            module = sys.modules.get(ref.partition(":")[0])
            files.add(os.path.abspath(getattr(module, "__file__", "") or "") if module else "")
        elif ref is not None:
            files.add(code_file(ref) or "")
    files.discard("")
    return files


class current_streams_kept:  # noqa: N801 - used as a context manager, like contextlib's
    """The process's current accelerator device and each device's current stream, as they were
    on entry, made current again on exit (``torch.accelerator``; nothing where no accelerator is
    available).  ``changed`` then says what the block left changed, in words (empty: nothing).

    Note [Current device and streams between cases]: ``set_stream`` makes the stream's device
    the current one (CUDA's ``torch.cuda.set_stream`` does the same), and an offloader's
    ``Stream()`` is made on the current device.  A case that leaves another device or stream
    current (the kit's own rerun of :func:`races_alone` once did: it restored the streams of
    hpu:0 and hpu:1 in turn and left hpu:1 current) changes what the next cases run: diffusers'
    group offloading then made its copy stream on hpu:1 and copied to hpu:0 on hpu:0's default
    stream, so its race on hpu:0 went unseen, and a cell of docs/peers.md depended on which
    cases ran before it.  Every case runs inside one (``runner.run_case``); what it left changed
    is a failure of that case."""

    def __init__(self) -> None:
        self.device: int | None = None
        self.streams: list[Any] = []
        self.changed: list[str] = []

    def __enter__(self) -> current_streams_kept:
        import torch

        if torch.accelerator.is_available():
            self.device = torch.accelerator.current_device_index()
            self.streams = [torch.accelerator.current_stream(i)
                            for i in range(torch.accelerator.device_count())]
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device is None:
            return
        kind = torch.accelerator.current_accelerator().type
        now_device = torch.accelerator.current_device_index()  # before set_stream moves it
        for i, stream in enumerate(self.streams):
            now = torch.accelerator.current_stream(i)
            if now != stream:
                self.changed.append(f"the current stream of {kind}:{i} was left at stream "
                                    f"{now.stream_id} (it was stream {stream.stream_id})")
            torch.accelerator.set_stream(stream)
        if now_device != self.device:
            self.changed.append(f"the current device was left at {kind}:{now_device} (it was "
                                f"{kind}:{self.device})")
        torch.accelerator.set_device_index(self.device)


def _signature_lines(race: Any) -> tuple[Any, ...]:
    """A race as a rerun makes it again: its kind and the source line of each access (stream
    numbers differ between runs)."""
    return (race.kind, race.current.where[:1], race.previous.where[:1])


def races_alone(case: Any, race: Any) -> bool | None:
    """Whether the pipeline makes ``race`` (the same kind, the same two source lines) with no
    offloader: one generation of a fresh resident pipeline (:meth:`~.case.CheckCase.
    build_resident`) under the sanitizer, after a synchronization of every device (so nothing of
    the case can race with it) on each device's default stream.  None when the kit cannot tell
    (no pipeline spec, or the rerun failed)."""
    import torch
    from offload_ref.platform import simulated

    if getattr(case, "spec", None) is None or not hasattr(case, "build_resident"):
        return None
    module = torch.get_device_module("hpu")
    count = module.device_count()
    try:
        with current_streams_kept():  # set_stream also makes its device current
            for i in range(count):
                module.synchronize(i)
                module.set_stream(module.default_stream(i))
            with simulated.stream_checking(True):
                simulated.clear_races()
                try:
                    pipeline = case.build_resident()
                    with torch.inference_mode():
                        pipeline(**case.inputs())
                    del pipeline
                    for i in range(count):
                        module.synchronize(i)
                    again = simulated.races(clear=True)
                finally:
                    simulated.clear_races()
    except Exception:  # noqa: BLE001 - then the kit says it could not tell
        return None
    return _signature_lines(race) in {_signature_lines(r) for r in again}


# -- the report ---------------------------------------------------------------------------------

#: What a race of each kind means on a GPU, and the usual fix (where the sanitizer gives none).
_MEANING = {
    "read-after-write": ("it reads bytes another stream may still be writing",
                         "record an event on the writing stream after the write and wait on it "
                         "(stream.wait_event, or wait_stream) before the read"),
    "write-after-read": ("it overwrites bytes another stream may still be reading",
                         "record an event on the reading stream after its last read and wait on "
                         "it before the write (a slot is refilled only after its block ran)"),
    "write-after-write": ("two streams write the same bytes in no fixed order",
                          "order the second write after the first with an event wait"),
    "use-after-free": ("the memory was handed out again while another stream may still use it",
                       "call tensor.record_stream(stream) for each stream that used it, or make "
                       "the freeing stream wait for that stream, before dropping the tensor"),
    "host-read-before-sync": ("the host reads a non_blocking copy that may not have landed",
                              "synchronize the copying stream (or an event recorded after the "
                              "copy) before the host reads the result"),
    "host-write-before-copy-done": ("the host rewrites pinned memory a non_blocking copy may still "
                                    "be reading", "synchronize the copying stream (or an event "
                                    "recorded after the copy) before the host writes it again"),
}


def frame_text(frame: str) -> str:
    """A frame as the sanitizer writes it (``/abs/path/file.py:123 in forward``) with its file
    as the kit writes files (relative to the working folder or site-packages)."""
    from .blame import short_path

    path, sep, rest = frame.partition(":")
    return short_path(path) + sep + rest if sep else frame


def _at(access: Any) -> str:
    return (f" at {frame_text(access.where[0])}" if access.where else
            " (no source line captured)")


def _access(access: Any) -> str:
    verb = "wrote" if access.write else "read"
    op = access.op + (f" ({access.argument})" if access.argument else "")
    return f"{access.stream_name} {verb} it in {op}{_at(access)}"


def _earlier(access: Any) -> str:
    noun = "write" if access.write else "read"
    op = access.op + (f" ({access.argument})" if access.argument else "")
    return f"the {noun} by {access.stream_name} in {op}{_at(access)}"


def _headline(race: Any) -> str:
    text = (f"stream race ({race.kind}) on {race.tensor} (hpu:{race.device}): "
            f"{_access(race.current)}, while {_earlier(race.previous)} was not ordered before it")
    if race.freed_at:
        text += (f"; the memory had been freed at {frame_text(race.freed_at[0])} and was handed "
                 "out again")
    return text


def race_report(races: Sequence[Any], case: Any, offloader: str,
                alone: bool | None = None) -> str:
    """The failure message of the races one case found: the first in full (the tensor, both
    accesses, the missing ordering, the party at fault, why it matters), then the others.
    ``alone``: whether the pipeline makes the first race with no offloader
    (:func:`races_alone`; None: not known)."""
    from .blame import race_party

    offloader_files, pipeline_files = _offloader_files(), _pipeline_files(case)
    race = races[0]
    meaning, fix = _MEANING.get(race.kind, ("", ""))
    lines = [_headline(race)]
    callers = [f"{' <- '.join(map(frame_text, a.where[1:4]))} "
               f"(the {which} {'write' if a.write else 'read'})"
               for which, a in (("later", race.current), ("earlier", race.previous))
               if len(a.where) > 1]
    if callers:
        lines.append(f"  called from: {'; '.join(callers)}")
    lines.append(f"  missing ordering: {race.advice or fix}")
    party, why = race_party(race.current.where, race.previous.where, offloader_files,
                            pipeline_files, alone)
    who = f"the offloader {offloader}" if party == "offloader" else "the pipeline"
    lines.append(f"  at fault: {who}: {why}")
    lines.append(f"  on a GPU {meaning or 'the two accesses run in no fixed order'}: a silently "
                 "wrong output, seen only sometimes. The simulated accelerator runs each stream "
                 "in program order, so its values here were right; its sanitizer judges by "
                 f"happens-before, so the race shows on every run ({DOC})")
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for r in races:  # one missing ordering, many tensors (a block's weights)
        groups.setdefault(_signature(r), []).append(r)
    first, *others = groups.values()
    more = _other_tensors(first)
    if more:
        lines.append(f"  the same race between these two streams on {len(more)} more "
                     f"tensor(s): {_names(more)}")
    for group in others[:_SHOWN - 1]:
        more = _other_tensors(group)
        tail = f" (and on {len(more)} more tensor(s): {_names(more)})" if more else ""
        lines.append(f"  also: {_headline(group[0])}{tail}")
    rest = [r for group in others[_SHOWN - 1:] for r in group]
    if rest:
        lines.append(f"  and {len(rest)} more race(s): "
                     + "; ".join(f"{r.kind} on {r.tensor}" for r in rest[:_LISTED])
                     + (" ..." if len(rest) > _LISTED else ""))
    return "\n".join(lines)


def _signature(race: Any) -> tuple[Any, ...]:
    """A race's kind and its two streams: one missing ordering races on every tensor the two
    streams share (each weight of a block, read by its own op)."""
    return (race.kind, race.current.stream_name, race.previous.stream_name)


def _other_tensors(group: Sequence[Any]) -> list[str]:
    """The tensors of a group of races other than its first race's, each named once (one
    tensor races once per access: a weight read by two ops, or in two generations; and a
    memory-history label differs from access to access: :func:`_tensor_key`)."""
    shown = _tensor_key(group[0].tensor)
    return list(dict.fromkeys(k for k in map(_tensor_key, (r.tensor for r in group[1:]))
                              if k != shown))


def _tensor_key(label: str) -> str:
    """A race's tensor by its module path alone (``x.weight (the tensor a module last computed
    with in that memory, which held ...)`` -> ``x.weight``); an unnamed tensor (memory freed
    earlier, a tensor of some shape) by its whole label."""
    name = label.split(" (", 1)[0]
    return name if name and " " not in name else label


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:_LISTED]) + (" ..." if len(names) > _LISTED else "")


# -- one case under the sanitizer ------------------------------------------------------------

_ACTIVE: list[Any] = []


class watching:  # noqa: N801 - used as a context manager, like contextlib's
    """Stream checking on for one case (``case``: a :class:`~.case.CheckCase`; ``offloader``: how
    the report names the implementation under test): the previous setting is restored after,
    the races of earlier cases are forgotten first, and any race found is a
    :class:`~.registry.CheckFailure` raised on exit (an exception the case raised is kept as its
    cause, and its first line noted).  Nested inside another, it does nothing (the outer one
    reports).  Where stream checking is off (:func:`off_reason`) it does nothing."""

    def __init__(self, case: Any, offloader: str) -> None:
        self.case, self.offloader = case, offloader
        self.on = False
        self.previous = False

    def __enter__(self) -> watching:
        if _ACTIVE or off_reason() is not None:
            return self
        from offload_ref.platform import simulated

        self.on = True
        _ACTIVE.append(self)
        _OFFLOADER_FILES.clear()
        _PIPELINE_FILES.clear()
        _NOTED.clear()
        _NAMED.clear()
        _BOUND.clear()
        self.previous = simulated.check_streams()
        simulated.clear_races()
        simulated.set_tensor_namer(_Namer(self.case))
        simulated.check_streams(True)
        return self

    def _alone(self, race: Any) -> bool | None:
        """Whether the pipeline makes ``race`` with no offloader (:func:`races_alone`), asked only
        when no frame of either access is the offloader's code (then its frames decide)."""
        from .blame import _known

        if not race.current.where and not race.previous.where:
            return None  # a rerun could not tell the same race from another
        offloader = _offloader_files()
        if any(_known(f, offloader) for f in (*race.current.where, *race.previous.where)):
            return None
        return races_alone(self.case, race)

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self.on:
            return False
        from offload_ref.platform import simulated

        try:
            simulated.check_streams(self.previous)
            found = simulated.races(clear=True)
            if not found or (exc is not None and not isinstance(exc, Exception)):
                return False  # a KeyboardInterrupt, SystemExit: the runner's to report
            message = race_report(found, self.case, self.offloader, self._alone(found[0]))
        finally:
            simulated.set_tensor_namer(None)
            _ACTIVE.remove(self)
            _NAMED.clear()
            _BOUND.clear()
            _NOTED.clear()
        if exc is not None:
            first = (str(exc).strip().splitlines() or [""])[0]
            if isinstance(exc, CheckFailure):
                message += f"\n  the case also failed: {first}"
            elif isinstance(exc, CheckNotApplicable):
                message += f"\n  (the check then found it does not apply: {first})"
            else:
                message += f"\n  the case also raised {type(exc).__name__}: {first}"
        failure = CheckFailure(message, "wrong output")
        if exc is not None:
            raise failure from exc
        raise failure
