"""``torch.hpu``: the device module of offload-ref's simulated accelerator.

torch imports a device type's module to initialize it lazily (``tensor.to``), and device-generic
code (``torch.get_device_module("hpu")``, diffusers' ``TorchDeviceBackend``) reaches streams,
events, random-number state and memory statistics through it.  :func:`build_device_module` makes
it over the loaded extension.  It offers what ``torch.cuda`` offers for those, with CUDA's
signatures and semantics: :class:`Stream` (a ``torch.Stream`` subclass) and :class:`Event` (which
makes a ``torch.Event`` of the device), ``current_stream``, ``default_stream``, ``set_stream``,
``stream`` (a :class:`StreamContext`), ``synchronize``, the device queries and the memory
statistics (which ``torch.accelerator`` serves from the extension's allocator)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Union

import torch

DEVICE_TYPE = "hpu"
#: what ``get_device_name`` answers
DEVICE_NAME = "offload-ref simulated accelerator"

_Device = Union[torch.device, str, int, None]


def _device_count() -> int:
    return int(torch.accelerator.device_count())


def _check_accelerator(what: str) -> None:
    """``torch.accelerator`` serves the process's one accelerator; the device module delegates to
    it only when that is this one (else it would answer for another device)."""
    current = torch.accelerator.current_accelerator()
    if current is None or current.type != DEVICE_TYPE:
        raise RuntimeError(
            f"torch.{DEVICE_TYPE}.{what}: torch.accelerator serves "
            f"{'no accelerator' if current is None else repr(current.type)} in this process, not "
            f"offload-ref's simulated accelerator ({DEVICE_TYPE!r}), so its answer would be "
            f"another device's; run without another accelerator (or OFFLOAD_REF_SIM=0)")


def _index(device: _Device, what: str) -> int:
    """The device index ``device`` names on the simulated accelerator (None or a negative index:
    the current device); raises ValueError naming ``what`` for another device type or an index
    that does not exist."""
    _check_accelerator(what)
    if isinstance(device, torch.Stream):
        device = device.device
    if device is None:
        return int(torch.accelerator.current_device_index())
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"torch.{DEVICE_TYPE}.{what}: a device is a torch.device, a str or an int, "
                        f"not {type(device).__name__}")
    if isinstance(device, int):
        index = device
    else:
        parsed = torch.device(device)
        if parsed.type != DEVICE_TYPE:
            raise ValueError(
                f"torch.{DEVICE_TYPE}.{what}: {parsed} is not a device of offload-ref's simulated "
                f"accelerator (its devices are {DEVICE_TYPE}:0 ... "
                f"{DEVICE_TYPE}:{_device_count() - 1}); use "
                f"torch.get_device_module({parsed.type!r}) for it")
        index = -1 if parsed.index is None else parsed.index
    if index < 0:
        return int(torch.accelerator.current_device_index())
    if index >= _device_count():
        raise ValueError(f"torch.{DEVICE_TYPE}.{what}: {DEVICE_TYPE}:{index} does not exist "
                         f"(offload-ref's simulated accelerator has {_device_count()} devices; "
                         f"OFFLOAD_REF_SIM_DEVICES sets how many)")
    return index


def _hpu(device: _Device, what: str) -> torch.device:
    return torch.device(DEVICE_TYPE, _index(device, what))


class _StreamType(type):
    """``isinstance(s, torch.hpu.Stream)``: ``s`` is a ``torch.Stream`` of the simulated
    accelerator (``torch.accelerator.current_stream()``'s too)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Stream) and obj.device.type == DEVICE_TYPE


class Stream(torch.Stream, metaclass=_StreamType):
    """``torch.hpu.Stream(device=None, priority=0)``: a new stream of ``device`` (the current
    device when None), as ``torch.cuda.Stream``.  Streams compute synchronously; with stream
    checking on (``offload_ref.platform.simulated.stream_checking``) the order the program gives
    their work is checked as a GPU would need it.  The priority is accepted and ignored."""

    def __new__(cls, device: _Device = None, priority: int = 0, **kwargs: Any) -> Stream:
        if kwargs:  # an existing stream: stream_id=, device_index=, device_type=
            existing = super().__new__(cls, **kwargs)
            if existing.device.type != DEVICE_TYPE:
                raise ValueError(f"torch.{DEVICE_TYPE}.Stream: {kwargs} names a stream of "
                                 f"{existing.device}, not of offload-ref's simulated accelerator")
            return existing
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"torch.{DEVICE_TYPE}.Stream: priority is an int, not "
                            f"{type(priority).__name__}")
        return super().__new__(cls, _hpu(device, "Stream"), priority=priority)

    @classmethod
    def _of(cls, stream: torch.Stream) -> Stream:
        return cls(stream_id=stream.stream_id, device_index=stream.device_index,
                   device_type=stream.device_type)

    def record_event(self, event: torch.Event | None = None) -> torch.Event:
        """Record ``event`` (a new :class:`Event` when None) on this stream and return it."""
        if event is None:
            event = Event(device=self.device)
        event.record(self)
        return event


class _EventType(type):
    """``isinstance(e, torch.hpu.Event)``: ``e`` is a ``torch.Event`` of the simulated
    accelerator (one recorded there, or made for ``hpu``)."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == DEVICE_TYPE


class Event(metaclass=_EventType):
    """``torch.hpu.Event(enable_timing=False, blocking=False, interprocess=False)``, as
    ``torch.cuda.Event``: recorded on a stream (the current one when none is given), waited on by
    another, timed with ``elapsed_time`` when ``enable_timing``.

    It makes a plain ``torch.Event`` of the device: torch's ``elapsed_time`` and
    ``torch.Stream.record_event`` accept no subclass of ``torch.Event``; ``isinstance(e,
    torch.hpu.Event)`` holds for every ``torch.Event`` of the simulated accelerator."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False,  # type: ignore[misc]
                interprocess: bool = False, *, device: _Device = None) -> torch.Event:
        where = torch.device(DEVICE_TYPE) if device is None else _hpu(device, "Event")
        return torch.Event(where, enable_timing=enable_timing, blocking=blocking,
                           interprocess=interprocess)


def current_stream(device: _Device = None) -> Stream:
    """The current stream of ``device`` (the current device when None) in this thread."""
    return Stream._of(torch.accelerator.current_stream(_index(device, "current_stream")))


def default_stream(device: _Device = None) -> Stream:
    """The default stream (stream id 0) of ``device`` (the current device when None)."""
    index = _index(device, "default_stream")
    return Stream(stream_id=0, device_index=index,
                  device_type=torch.accelerator.current_stream(index).device_type)


def _require_stream(stream: object, what: str) -> torch.Stream:
    if not isinstance(stream, torch.Stream):
        raise TypeError(f"torch.{DEVICE_TYPE}.{what}: expected a torch.Stream of "
                        f"{DEVICE_TYPE} (torch.{DEVICE_TYPE}.Stream()), got "
                        f"{type(stream).__name__}")
    if stream.device.type != DEVICE_TYPE:
        raise ValueError(f"torch.{DEVICE_TYPE}.{what}: {stream} is a stream of "
                         f"{stream.device}, not of offload-ref's simulated accelerator; use "
                         f"torch.get_device_module({stream.device.type!r}) for it")
    return stream


def set_stream(stream: torch.Stream | None) -> None:
    """Make ``stream`` the current stream of its device in this thread, and its device the
    current device (as ``torch.cuda.set_stream``); None changes nothing."""
    if stream is None:
        return
    _check_accelerator("set_stream")
    torch.accelerator.set_stream(_require_stream(stream, "set_stream"))


class StreamContext:
    """``with torch.hpu.stream(s):``: ``s`` is the current stream (and its device the current
    device) inside the block; the previous stream of each device it touched, and the previous
    current device, are restored after.  A no-op when ``s`` is None."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = None if stream is None else _require_stream(stream, "stream")
        self._previous: list[torch.Stream] = []

    def __enter__(self) -> torch.Stream | None:
        if self.stream is None:
            return None
        _check_accelerator("stream")
        here = torch.accelerator.current_stream()  # the current device's current stream
        self._previous = [here]
        if here.device != self.stream.device:
            self._previous.insert(0, torch.accelerator.current_stream(self.stream.device_index))
        torch.accelerator.set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        # the stream's own device first, the device that was current last (set_stream also makes
        # a stream's device current)
        for previous in self._previous:
            torch.accelerator.set_stream(previous)
        self._previous = []


def stream(stream: torch.Stream | None) -> StreamContext:
    """``with torch.hpu.stream(s):`` (see :class:`StreamContext`); None: no change."""
    return StreamContext(stream)


def synchronize(device: _Device = None) -> None:
    """Wait for all work on every stream of ``device`` (the current device when None)."""
    torch.accelerator.synchronize(_index(device, "synchronize"))


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.hpu.get_device_properties`` answers (the fields of ``torch.cuda``'s that mean
    something here)."""

    name: str
    index: int
    #: the device's capacity (``OFFLOAD_REF_SIM_CAPACITY``), else the 1 TiB ``mem_get_info``
    #: reports for an unlimited device
    total_memory: int


class _DeviceContext:
    """``torch.hpu.device(d)``: device ``d`` is current inside the block (torch's storage moves
    and serialization enter it)."""

    def __init__(self, device: torch.device | str | int | None) -> None:
        if isinstance(device, int) or device is None:
            self._index = device
        else:
            self._index = torch.device(device).index
        self._context = torch.accelerator.device_index(self._index)

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self._context.__exit__(*exc_info)


def _memory_functions() -> dict[str, Any]:
    """The memory statistics, ``torch.cuda``'s names over ``torch.accelerator``'s (which reads the
    extension's allocator)."""
    memory = torch.accelerator

    def memory_stats(device: _Device = None) -> OrderedDict[str, Any]:
        """The allocator's statistics of ``device``, ``torch.cuda.memory_stats``'s keys."""
        return memory.memory_stats(_index(device, "memory_stats"))

    def memory_allocated(device: _Device = None) -> int:
        """Bytes held by live tensors on ``device``."""
        return int(memory.memory_allocated(_index(device, "memory_allocated")))

    def max_memory_allocated(device: _Device = None) -> int:
        """The peak of ``memory_allocated`` since the last ``reset_peak_memory_stats``."""
        return int(memory.max_memory_allocated(_index(device, "max_memory_allocated")))

    def memory_reserved(device: _Device = None) -> int:
        """Bytes the allocator holds on ``device``."""
        return int(memory.memory_reserved(_index(device, "memory_reserved")))

    def max_memory_reserved(device: _Device = None) -> int:
        """The peak of ``memory_reserved`` since the last ``reset_peak_memory_stats``."""
        return int(memory.max_memory_reserved(_index(device, "max_memory_reserved")))

    def reset_peak_memory_stats(device: _Device = None) -> None:
        """Peaks start again from the current values."""
        memory.reset_peak_memory_stats(_index(device, "reset_peak_memory_stats"))

    def reset_max_memory_allocated(device: _Device = None) -> None:
        """As ``torch.cuda.reset_max_memory_allocated``: resets every peak."""
        memory.reset_peak_memory_stats(_index(device, "reset_max_memory_allocated"))

    def reset_max_memory_reserved(device: _Device = None) -> None:
        """As ``torch.cuda.reset_max_memory_cached``: resets every peak."""
        memory.reset_peak_memory_stats(_index(device, "reset_max_memory_reserved"))

    def reset_accumulated_memory_stats(device: _Device = None) -> None:
        """The allocated/freed counters start again from zero."""
        memory.reset_accumulated_memory_stats(
            _index(device, "reset_accumulated_memory_stats"))

    def empty_cache() -> None:
        """Return the allocator's cached free blocks."""
        _check_accelerator("empty_cache")
        memory.empty_cache()

    def mem_get_info(device: _Device = None) -> tuple[int, int]:
        """``(free, total)`` bytes of ``device``: its capacity less what is allocated (an
        unlimited device reports 1 TiB)."""
        free, total = memory.get_memory_info(_index(device, "mem_get_info"))
        return int(free), int(total)

    return {f.__name__: f for f in (
        memory_stats, memory_allocated, max_memory_allocated, memory_reserved,
        max_memory_reserved, reset_peak_memory_stats, reset_max_memory_allocated,
        reset_max_memory_reserved, reset_accumulated_memory_stats, empty_cache, mem_get_info)}


def build_device_module(module: ModuleType) -> ModuleType:
    """``torch.hpu``: torch imports it to initialize the device type lazily (``tensor.to``)."""
    device_module = ModuleType("torch.hpu", "offload-ref's simulated accelerator (see "
                               "offload_ref.platform.simulated)")
    device_module._offload_ref_simulated = True  # type: ignore[attr-defined]
    device_module._lazy_init = lambda: None  # type: ignore[attr-defined]
    device_module.init = lambda: None  # type: ignore[attr-defined]
    device_module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    device_module.is_available = lambda: True  # type: ignore[attr-defined]
    device_module.is_initialized = lambda: True  # type: ignore[attr-defined]
    device_module.device_count = module.device_count  # type: ignore[attr-defined]
    device_module.current_device = torch.accelerator.current_device_index  # type: ignore

    def set_device(device: torch.device | str | int) -> None:
        """Make ``device`` the current device of this thread."""
        torch.accelerator.set_device_index(_index(device, "set_device"))

    def get_device_name(device: _Device = None) -> str:
        """Every device is named ``offload-ref simulated accelerator``."""
        _index(device, "get_device_name")
        return DEVICE_NAME

    def get_device_properties(device: _Device = None) -> DeviceProperties:
        """The device's name, index and memory (``total_memory``)."""
        index = _index(device, "get_device_properties")
        return DeviceProperties(DEVICE_NAME, index, torch.accelerator.get_memory_info(index)[1])

    device_module.set_device = set_device  # type: ignore[attr-defined]
    device_module.get_device_name = get_device_name  # type: ignore[attr-defined]
    device_module.get_device_properties = get_device_properties  # type: ignore[attr-defined]
    device_module.device = _DeviceContext  # type: ignore[attr-defined]
    for name, value in (("Stream", Stream), ("Event", Event), ("StreamContext", StreamContext),
                        ("current_stream", current_stream), ("default_stream", default_stream),
                        ("set_stream", set_stream), ("stream", stream),
                        ("synchronize", synchronize), ("DeviceProperties", DeviceProperties),
                        *_memory_functions().items()):
        setattr(device_module, name, value)

    def manual_seed(seed: int) -> None:
        module.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def index_of(device: torch.device | str | int) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.type != DEVICE_TYPE:
            raise ValueError(f"{device} is not a device of offload-ref's simulated accelerator "
                             f"(its devices are {DEVICE_TYPE}:0 ... "
                             f"{DEVICE_TYPE}:{module.device_count() - 1})")
        return torch.accelerator.current_device_index() if device.index is None else device.index

    def get_rng_state(device: torch.device | str | int = DEVICE_TYPE) -> torch.Tensor:
        return module.get_rng_state(index_of(device))

    def set_rng_state(new_state: torch.Tensor,
                      device: torch.device | str | int = DEVICE_TYPE) -> None:
        module.set_rng_state(index_of(device), new_state.detach().to("cpu", torch.uint8))

    def get_rng_state_all() -> list[torch.Tensor]:
        return [module.get_rng_state(i) for i in range(module.device_count())]

    def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
        for i, new_state in enumerate(new_states):
            set_rng_state(new_state, i)

    device_module.manual_seed = manual_seed  # type: ignore[attr-defined]
    device_module.manual_seed_all = manual_seed  # type: ignore[attr-defined]
    device_module.get_rng_state = get_rng_state  # type: ignore[attr-defined]
    device_module.set_rng_state = set_rng_state  # type: ignore[attr-defined]
    device_module.get_rng_state_all = get_rng_state_all  # type: ignore[attr-defined]
    device_module.set_rng_state_all = set_rng_state_all  # type: ignore[attr-defined]
    device_module.initial_seed = (  # type: ignore[attr-defined]
        lambda: module.initial_seed(torch.accelerator.current_device_index()))
    return device_module
