"""offload-ref's simulated accelerator: a second torch device on a machine without a GPU.

A C++ extension (``simdevice.cpp`` beside this file, Note [Simulated accelerator] there) registers a
device type whose memory is host memory and whose ops run the CPU's own kernels on the same bytes,
bit-exactly.  A host tensor meeting one of its tensors raises torch's same-device error, as on a
GPU, so placement bugs show on a CPU-only machine.  It takes torch's in-tree ``hpu`` device type:
``torch.device("hpu:0")`` is the simulated device 0.

It is compiled on first use with ``torch.utils.cpp_extension.load`` (g++ and ninja; about 30-50 s
cold) into a cache keyed by the torch version and the source's hash, then loads in milliseconds.
When it cannot be built or loaded (no compiler, a real HPU plugin owns the device type, or
``OFFLOAD_REF_SIM=0``), :func:`available` is False and :func:`unavailable_reason` says why; nothing
else breaks.

Environment:

* ``OFFLOAD_REF_SIM=0``: never load it (placement checks are then off, and the kit says so);
* ``OFFLOAD_REF_SIM_DEVICES``: how many devices (default 2: ``hpu:0`` and ``hpu:1``);
* ``OFFLOAD_REF_SIM_CAPACITY``: bytes per device; an allocation past it raises
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
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "CRASH_FILE_ENV",
    "CRASH_RECORD_PREFIX",
    "DEVICE_TYPE",
    "SimulatedAcceleratorUnavailable",
    "available",
    "capacity",
    "describe_device",
    "device",
    "load",
    "set_capacity",
    "unavailable_reason",
]

DEVICE_TYPE = "hpu"
#: the environment variable naming the file the crash record is appended to (read at load)
CRASH_FILE_ENV = "OFFLOAD_REF_SIM_CRASH_FILE"
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


def _refusal() -> str | None:
    """Why the simulated accelerator must not load here (None: it may)."""
    if os.environ.get("OFFLOAD_REF_SIM", "1").strip().lower() in ("0", "false", "no", "off"):
        return "OFFLOAD_REF_SIM=0 turns it off"
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


def _import_built(folder: Path) -> ModuleType | None:
    """The extension already built in ``folder`` (keyed by torch version and source hash), or
    None when there is none or it does not import (a build cut off mid-link)."""
    import importlib.util

    built = folder / f"{_NAME}.so"
    if not built.is_file():
        return None
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
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes wait for one build
        try:
            module = _import_built(folder)  # built by the process we waited for
            if module is not None:
                return module
            (folder / "lock").unlink(missing_ok=True)  # a stale baton of a killed build
            from torch.utils import cpp_extension

            return cpp_extension.load(
                name=_NAME,
                sources=[str(_SOURCE)],
                build_directory=str(folder),
                extra_cflags=["-O2", "-std=c++17"],
                verbose=False,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
                    capacity_env = os.environ.get("OFFLOAD_REF_SIM_CAPACITY")
                    if capacity_env:
                        for index in range(module.device_count()):
                            module.set_capacity(index, int(capacity_env))
                    if getattr(torch, "hpu", None) is None:
                        from ._device_module import build_device_module

                        torch._register_device_module(DEVICE_TYPE, build_device_module(module))
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
