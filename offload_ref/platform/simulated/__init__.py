"""offload-ref's simulated accelerator: a second torch device on a machine without a GPU.

A C++ extension (``simdevice.cpp`` beside this file, Note [Simulated accelerator] there) registers a
device type whose memory is host memory and whose ops run the CPU's own kernels on the same bytes,
bit-exactly.  A host tensor meeting one of its tensors raises torch's same-device error, as on a
GPU, so placement bugs show on a CPU-only machine.  It takes torch's in-tree ``hpu`` device type:
``torch.device("hpu:0")`` is the simulated device 0.

It is compiled on first use with ``torch.utils.cpp_extension.load`` (g++ and ninja; about 30-60 s
cold) into a cache keyed by the torch version and the source's hash, then loads in milliseconds.
When it cannot be built or loaded (no compiler, a real HPU plugin owns the device type, or
``OFFLOAD_REF_SIM=0``), :func:`available` is False and :func:`unavailable_reason` says why; nothing
else breaks.

Environment:

* ``OFFLOAD_REF_SIM=0``: never load it (placement checks are then off, and the kit says so);
* ``OFFLOAD_REF_SIM_DEVICES``: how many devices (default 2: ``hpu:0`` and ``hpu:1``);
* ``OFFLOAD_REF_SIM_CAPACITY``: bytes per device (a whole number >= 1, else the device is
  unavailable with a reason naming it); an allocation past it raises
  ``torch.OutOfMemoryError`` as CUDA's allocator does (also :func:`set_capacity`);
* ``OFFLOAD_REF_SIM_CACHE``: the build cache folder (default ``~/.cache/offload_ref``);
* ``OFFLOAD_REF_SIM_CRASH_FILE`` (:data:`CRASH_FILE_ENV`): a file that the crash record is appended
  to, read when the extension loads.  On a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT)
  the extension writes one line, ``offload-ref simulated accelerator: fatal signal 11 (SIGSEGV)
  while running aten::mul.Tensor on hpu``, to stderr and to that file, then lets the signal go on
  (to Python's faulthandler if it is enabled), so the process still dies of it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "CHECK_STREAMS_ENV",
    "CRASH_FILE_ENV",
    "CRASH_RECORD_PREFIX",
    "DEVICE_TYPE",
    "Access",
    "Race",
    "SimulatedAcceleratorUnavailable",
    "available",
    "capacity",
    "check_streams",
    "clear_races",
    "describe_device",
    "device",
    "load",
    "races",
    "set_capacity",
    "set_tensor_namer",
    "stream_checking",
    "unavailable_reason",
]

DEVICE_TYPE = "hpu"
#: the environment variable naming the file the crash record is appended to (read at load)
CRASH_FILE_ENV = "OFFLOAD_REF_SIM_CRASH_FILE"
#: the environment variable that turns stream checking on for plain library use (the kit turns it
#: on itself)
CHECK_STREAMS_ENV = "OFFLOAD_REF_SIM_CHECK_STREAMS"
#: how the crash record's one line starts
CRASH_RECORD_PREFIX = "offload-ref simulated accelerator: fatal signal "
_SOURCE = Path(__file__).with_name("simdevice.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


class SimulatedAcceleratorUnavailable(RuntimeError):
    """The simulated accelerator cannot be built or loaded here; the message says why."""


def _cache_dir() -> Path:
    base = os.environ.get("OFFLOAD_REF_SIM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "offload_ref")
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    version = torch.__version__.replace("+", "_").replace(".", "_")
    return Path(base) / f"simdevice-torch{version}-{digest}"


def _device_count() -> int:
    raw = os.environ.get("OFFLOAD_REF_SIM_DEVICES", "2")
    try:
        count = int(raw)
    except ValueError:
        raise SimulatedAcceleratorUnavailable(
            f"OFFLOAD_REF_SIM_DEVICES={raw!r} is not an integer (1 to 8)") from None
    if not 1 <= count <= 8:
        raise SimulatedAcceleratorUnavailable(
            f"OFFLOAD_REF_SIM_DEVICES={count} is out of range (1 to 8)")
    return count


def _capacity() -> int | None:
    """``OFFLOAD_REF_SIM_CAPACITY`` as bytes per device (None: not set, no limit)."""
    raw = os.environ.get("OFFLOAD_REF_SIM_CAPACITY", "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SimulatedAcceleratorUnavailable(
            f"OFFLOAD_REF_SIM_CAPACITY={raw!r} is not a whole number of bytes (such as "
            f"1073741824); unset it for no limit") from None
    if value < 1:
        raise SimulatedAcceleratorUnavailable(
            f"OFFLOAD_REF_SIM_CAPACITY={value}: a capacity is at least 1 byte; unset it for no "
            f"limit")
    return value


def _refusal() -> str | None:
    """Why the simulated accelerator must not load here (None: it may)."""
    if os.environ.get("OFFLOAD_REF_SIM", "1").strip().lower() in ("0", "false", "no", "off"):
        return "OFFLOAD_REF_SIM=0 turns it off"
    try:
        _capacity()
        _device_count()
    except SimulatedAcceleratorUnavailable as exc:
        return str(exc)
    owner = getattr(torch, "hpu", None)
    if "habana_frameworks" in sys.modules or (
            owner is not None and not getattr(owner, "_offload_ref_simulated", False)):
        return ("a real HPU backend (habana_frameworks) owns torch's 'hpu' device type in this "
                "process; the simulated accelerator registers on that type and would clash")
    if shutil.which("ninja") is None and not _prebuilt():
        return "ninja is not installed (pip install ninja), and no build is cached"
    if shutil.which(os.environ.get("CXX", "c++")) is None and not _prebuilt():
        return "no C++ compiler (c++ / $CXX) was found, and no build is cached"
    return None


def _prebuilt() -> bool:
    folder = _cache_dir()
    return folder.is_dir() and any(folder.glob("*.so"))


def _patch_manual_seed(module: ModuleType) -> None:
    """``torch.manual_seed`` reseeds the device generators too, as it does CUDA's."""
    original = torch.random.manual_seed
    if getattr(original, "_offload_ref_sim", False):
        return

    @functools.wraps(original)
    def manual_seed(seed: int) -> torch.Generator:
        result = original(seed)
        module.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return result

    manual_seed._offload_ref_sim = True  # type: ignore[attr-defined]
    torch.random.manual_seed = manual_seed
    torch.manual_seed = manual_seed


def _drain_autograd_threads(device_count: int) -> None:
    """At exit: let torch's autograd device threads drop what the last backward left them.

    Every backward (torch 2.13) stashes a Python ``contextvars`` context in the thread-local
    state that its graph task captures; the device thread that finishes the task releases it a
    moment after ``backward()`` returns.  When that release comes while the interpreter is
    finalizing, it needs the GIL, the thread is made to exit, and the process aborts ("terminate
    called without an active exception", SIGABRT) after a run that succeeded: on a GPU too, but
    it would be read here as a crash of the simulated accelerator.  A tiny backward through each
    device's thread, run through the engine directly (so it stashes nothing), is queued behind
    the last task, so when it returns every earlier task has been released."""
    from torch.autograd import Variable

    roots = []
    for index in range(device_count):
        leaf = torch.zeros((), device=torch.device(DEVICE_TYPE, index), requires_grad=True)
        roots.append(leaf * 1.0)
    Variable._execution_engine.run_backward(  # see the docstring
        tuple(roots), tuple(torch.ones_like(r) for r in roots), False, False, (), True, True)


def _drain_at_exit(device_count: int) -> None:
    try:
        _drain_autograd_threads(device_count)
    except Exception:  # noqa: BLE001 (best effort at exit: never turn an exit into an error)
        pass


_NAME = "offload_ref_simdevice"


def _unsafe(path: Path, what: str) -> str | None:
    """Why ``path`` (a cache folder or the built library) must not be trusted, or None.

    Note [Who may write the build cache]: the loader runs whatever library lies in the cache
    folder, in every process that uses the simulated accelerator.  With the cache in a shared
    place (``OFFLOAD_REF_SIM_CACHE``, or ``XDG_CACHE_HOME`` on a shared CI runner) another user
    could plant one.  So the folder and the library must belong to this user and be writable
    by no one else; otherwise nothing is imported or built there, and the reason names the path
    and the fix."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    owner = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if st.st_uid != owner:
        return (f"the simulated accelerator's {what} {path} belongs to another user (uid "
                f"{st.st_uid}, this process runs as {owner}): offload-ref will not load or build "
                f"code there; remove it, or point OFFLOAD_REF_SIM_CACHE at a folder of your own")
    if st.st_mode & 0o022:
        return (f"the simulated accelerator's {what} {path} is writable by others (mode "
                f"{st.st_mode & 0o777:o}): offload-ref will not load or build code there; run "
                f"`chmod go-w {path}`, or point OFFLOAD_REF_SIM_CACHE at a folder of your own")
    return None


def _import_built(folder: Path) -> ModuleType | None:
    """The extension already built in ``folder`` (keyed by torch version and source hash), or
    None when there is none or it does not import (a build cut off mid-link).  Raises
    :class:`SimulatedAcceleratorUnavailable` for a folder or library another user could have
    written (Note [Who may write the build cache])."""
    import importlib.util

    built = folder / f"{_NAME}.so"
    if not built.is_file():
        return None
    for path, what in ((folder, "cache folder"), (built, "built library")):
        reason = _unsafe(path, what)
        if reason is not None:
            raise SimulatedAcceleratorUnavailable(reason)
    try:
        spec = importlib.util.spec_from_file_location(_NAME, built)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError):
        return None
    return module


def _built_extension() -> ModuleType:
    """Import the cached build, or build it.  A process that builds holds an exclusive
    ``flock`` on ``build.lock``, which the kernel releases when the process ends however it
    ends, so a build interrupted by Ctrl-C or a kill never leaves the next process waiting
    (torch's own build baton, a plain file, would: it is removed here under the flock)."""
    import fcntl

    folder = _cache_dir()
    module = _import_built(folder)
    if module is not None:
        return module
    folder.mkdir(parents=True, exist_ok=True, mode=0o755)
    reason = _unsafe(folder, "cache folder")
    if reason is not None:
        raise SimulatedAcceleratorUnavailable(reason)
    try:  # never through a symlink, never truncating what is there
        fd = os.open(folder / "build.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise SimulatedAcceleratorUnavailable(
            f"cannot open the build lock {folder / 'build.lock'} ({exc.strerror}; a symlink is "
            f"refused): remove it, or point OFFLOAD_REF_SIM_CACHE at a folder of your own"
        ) from None
    with os.fdopen(fd, "w") as lock:
        try:  # concurrent processes wait for one build
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _say(f"waiting for another process compiling the simulated accelerator into "
                 f"{folder} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            module = _import_built(folder)  # built by the process we waited for
            if module is not None:
                return module
            (folder / "lock").unlink(missing_ok=True)  # a stale baton of a killed build
            from torch.utils import cpp_extension

            _say(f"compiling the simulated accelerator (once for this source and torch "
                 f"version, about 30-60 s on 2 cores) into {folder} ...")
            start = time.monotonic()
            built = cpp_extension.load(
                name=_NAME,
                sources=[str(_SOURCE)],
                build_directory=str(folder),
                extra_cflags=["-O2", "-std=c++17"],
                verbose=False,
            )
            _say(f"compiled the simulated accelerator in {time.monotonic() - start:.0f} s")
            return built
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _say(line: str) -> None:
    """A line on stderr for a wait a person would otherwise watch in silence (the first
    build)."""
    print(f"offload-ref: {line}", file=sys.stderr, flush=True)


def load() -> ModuleType:
    """Build (once, cached) and register the simulated accelerator; returns the extension.

    Raises :class:`SimulatedAcceleratorUnavailable` saying why it cannot."""
    global _module, _failure
    with _lock:
        if _module is not None:
            return _module
        if _failure is not None:
            raise SimulatedAcceleratorUnavailable(_failure)
        reason = _refusal()
        if reason is None:
            try:
                module = _built_extension()
                reason = module.init(_device_count()) or None
            except SimulatedAcceleratorUnavailable as exc:
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001 (a build failure is a reason, not a crash)
                text = str(exc).strip().splitlines()
                reason = (f"building it failed ({type(exc).__name__}: "
                          f"{text[-1] if text else ''})")
            else:
                if reason is None:
                    capacity = _capacity()
                    if capacity is not None:
                        for index in range(module.device_count()):
                            module.set_capacity(index, capacity)
                    if getattr(torch, "hpu", None) is None:
                        from ._device_module import build_device_module

                        torch._register_device_module(DEVICE_TYPE, build_device_module(module))
                    if os.environ.get(CHECK_STREAMS_ENV, "0").strip().lower() in (
                            "1", "true", "yes", "on"):
                        module.check_streams(True)
                    _patch_manual_seed(module)
                    module.manual_seed(torch.initial_seed() & 0xFFFF_FFFF_FFFF_FFFF)
                    import atexit

                    atexit.register(_drain_at_exit, module.device_count())
                    _module = module
                    return module
        _failure = reason
        raise SimulatedAcceleratorUnavailable(reason)


def available() -> bool:
    """Whether the simulated accelerator is (or can now be) loaded; loads it."""
    try:
        load()
    except SimulatedAcceleratorUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why the simulated accelerator is not available (None when it is); loads it."""
    try:
        load()
    except SimulatedAcceleratorUnavailable as exc:
        return str(exc)
    return None


def device(index: int = 0) -> torch.device:
    """``torch.device("hpu", index)``, loading the simulated accelerator first."""
    load()
    return torch.device(DEVICE_TYPE, index)


def describe_device(device: torch.device | str) -> str:
    """A device as offload-ref prints it: ``hpu:0 (offload-ref's simulated accelerator)`` when
    ``device`` is the simulated accelerator, ``str(device)`` otherwise."""
    parsed = torch.device(device)
    if parsed.type == DEVICE_TYPE and _module is not None:
        index = 0 if parsed.index is None else parsed.index
        return f"{DEVICE_TYPE}:{index} (offload-ref's simulated accelerator)"
    return str(parsed)


def set_capacity(nbytes: int | None, index: int = 0) -> None:
    """Limit device ``index`` to ``nbytes`` (None: unlimited); an allocation past it raises
    ``torch.OutOfMemoryError``."""
    load().set_capacity(index, -1 if nbytes is None else int(nbytes))


def capacity(index: int = 0) -> int | None:
    """Device ``index``'s capacity in bytes (None: unlimited)."""
    value = load().capacity(index)
    return None if value < 0 else int(value)


# -- stream checking (Note [Stream sanitizer] in simdevice.cpp) -------------------------------------


@dataclass(frozen=True)
class Access:
    """One access to device (or pinned host) memory, as the stream sanitizer recorded it."""

    #: ``torch.Stream.stream_id``; 0 is the device's default stream, -1 the host
    stream: int
    #: "the default stream of hpu:0", "stream 3 of hpu:0", "the host"
    stream_name: str
    #: "aten::addmm", "copy host to device (non_blocking)", "free", ...
    op: str
    #: the schema argument ("mat2", "self", "src"); "" when there is none
    argument: str
    write: bool
    #: the innermost frames outside torch, "path/file.py:123 in forward"; () when not captured
    where: tuple[str, ...]

    def describe(self) -> str:
        verb = "wrote" if self.write else "read"
        what = f"{self.op}" + (f" ({self.argument})" if self.argument else "")
        place = f" at {self.where[0]}" if self.where else " (no source line captured)"
        return f"{self.stream_name} {verb} it in {what}{place}"


@dataclass(frozen=True)
class Race:
    """Two accesses to the same memory on different streams, neither ordered before the other,
    at least one a write (or memory reused while another stream may still use it)."""

    kind: str
    device: int
    tensor: str
    current: Access
    previous: Access
    freed_at: tuple[str, ...]
    advice: str

    def __str__(self) -> str:
        text = (f"stream race ({self.kind}) on {self.tensor} (hpu:{self.device}, offload-ref's "
                f"simulated accelerator): {self.current.describe()}, while earlier "
                f"{self.previous.describe()}, and nothing ordered that before this")
        if self.freed_at:
            text += f"; the memory was freed at {self.freed_at[0]} and reused"
        return f"{text}. {self.advice}" if self.advice else f"{text}."


def check_streams(enabled: bool | None = None) -> bool:
    """Turn stream checking on or off (None: leave it) and return whether it is on.

    Off for plain library use unless ``OFFLOAD_REF_SIM_CHECK_STREAMS=1``; the kit turns it on."""
    module = load()
    if enabled is not None:
        module.check_streams(bool(enabled))
    return bool(module.checking_streams())


@contextmanager
def stream_checking(enabled: bool = True) -> Iterator[None]:
    """Stream checking on (or off) inside the block; the previous setting is restored after."""
    previous = check_streams()
    check_streams(enabled)
    try:
        yield
    finally:
        check_streams(previous)


def _access(raw: dict) -> Access:
    return Access(int(raw["stream"]), str(raw["stream_name"]), str(raw["op"]),
                  str(raw["argument"]), bool(raw["write"]), tuple(raw["where"]))


def _advice(kind: str, current: Access, previous: Access) -> str:
    """The missing ordering, in words."""
    now, then = current.stream_name, previous.stream_name
    if kind == "read-after-write":
        return (f"Make {now} wait for the write before it reads: record an event on {then} "
                f"after the write and call wait_event(event) on {now} before the read (or "
                f"wait_stream on {now} for all of {then}'s work).")
    if kind == "write-after-read":
        return (f"{now} overwrote memory that {then} may still be reading: before the write, "
                f"make {now} wait for an event recorded on {then} after its last read.")
    if kind == "write-after-write":
        return (f"Order the two writes: make {now} wait for an event recorded on {then} after "
                f"its write.")
    if kind == "use-after-free":
        return (f"The memory was freed while {then} may still have been using it, and the "
                f"allocator gave it to {now}: call tensor.record_stream() with {then} before "
                f"dropping the tensor, or make the allocating stream wait for {then} before the "
                f"tensor is freed.")
    if kind == "host-read-before-sync":
        return (f"A non_blocking copy by {then} is complete only after a synchronization: call "
                f"synchronize() on that stream, or on an event recorded after the copy, before "
                f"the host reads the result.")
    if kind == "host-write-before-copy-done":
        return (f"The host changed pinned memory that a non_blocking copy by {then} may still "
                f"be using: synchronize on an event recorded after the copy before reusing the "
                f"buffer.")
    return ""


def races(*, clear: bool = False) -> list[Race]:
    """The races found since the last :func:`clear_races` (each distinct race once)."""
    found = []
    for r in load().races(bool(clear)):
        current, previous = _access(r["current"]), _access(r["previous"])
        found.append(Race(str(r["kind"]), int(r["device"]), str(r["tensor"]), current,
                          previous, tuple(r["freed_at"]),
                          _advice(str(r["kind"]), current, previous)))
    return found


def clear_races() -> None:
    """Forget the races found so far."""
    load().races(True)


def set_tensor_namer(fn: Callable[[int, int, int], str | None] | None) -> None:
    """``fn(device_index, address, nbytes)`` names the memory ``[address, address + nbytes)`` of
    ``hpu:device_index`` when a race is found there (a module path, say), or returns None.  It is
    called with the GIL held while the racing op runs (the sanitizer's own lock released), and must
    run no device op itself."""
    load().set_tensor_namer(fn)
