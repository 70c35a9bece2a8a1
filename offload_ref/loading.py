"""Loading a module's weights as views of safetensors files (memory-mapped, not copied).

Note [File-backed weights]
    ``safe_open(path, framework="pt").get_tensor(key)`` maps the file (``mmap``, ``MAP_PRIVATE``)
    and returns a tensor whose storage is a window of that mapping: no bytes are read until a
    page is touched, and the pages it touches are page-cache pages (``RssFile`` on Linux), shared
    by every process that maps the same file, not anonymous memory.  :func:`load_safetensors`
    rebinds every persistent tensor of a module to such a view, so a module built on the meta
    device costs no anonymous memory for its weights at all.  Writing to a loaded tensor in place
    copies the touched pages (copy-on-write); the file never changes.  The converse does not
    hold: overwriting or truncating the file in place while it is mapped changes (or, truncated,
    faults on) the loaded weights, so replace checkpoints by writing a new file and renaming it.

    safetensors packs tensors back to back without padding, so a view is aligned only to its
    dtype's size plus whatever the header length gives.  Kernels that pick their path by address
    (MKL's matrix-vector product: 4- and 8-byte aligned weights give other last bits than 16-byte
    aligned ones) can therefore differ in the last bits from the same weights in a freshly
    allocated (64-byte aligned) tensor.  Matrix-matrix products were bit-identical in our
    measurements.  Offloading keeps each view's address modulo 64 in its slots and device copies
    (Note [Aligned layout] in host.py), so an offloaded run of a loaded module computes at the
    alignment the un-offloaded one does; ``Module.to(device)`` copies start aligned instead.

Note [Load transaction]
    Everything is validated before the first mutation: the arguments, the module's tensors, every
    file's keys, and every key's shape and dtype (from the views themselves: creating a view reads
    no data), and all problems are reported in one ``ValueError``.  Then the tensors are rebound
    (``t.data = view`` on the CPU, ``torch.utils.swap_tensors`` on the meta device and for inference
    tensors, so the Python objects never change), the ``post_load_weights`` hooks run, and the
    non-persistent buffers are checked against the copies taken before.  Every mutation records its
    undo; if anything raises, a ``KeyboardInterrupt`` included, the undo log runs in reverse and the
    module is left as it was (same objects, storages, values and registrations).  The original
    storages are kept alive until the load commits, so peak host memory of a CPU-built module is its
    old weights plus the pages touched.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

# The ownership markers come from hooks.py, not from the backends: the resolver imports this
# module, and importing the backends inside a load would count as that load's anonymous memory.
from .hooks import HOOKS_ATTR, PIPELINE_ATTR

__all__ = ["LoadReport", "MappedFileChangedError", "MappedUse", "anonymous_rss_bytes",
           "any_file_backed",
           "changed_mapped_files", "is_file_backed", "load_safetensors", "mapped_files",
           "verify_mapped_files"]

PathLike = Union[str, "os.PathLike[str]"]

_PROC_STATUS = "/proc/self/status"
_PROC_MAPS = "/proc/self/maps"


# -- is this tensor file-backed? ---------------------------------------------------------------


class _File:
    """One file as :func:`load_safetensors` mapped it: a descriptor of the mapped inode (kept
    open while any of its mapped storages lives) and its size and modification time then (Note
    [Changed files])."""

    __slots__ = ("path", "fd", "size", "mtime_ns", "__weakref__")

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        st = os.fstat(self.fd)
        self.size, self.mtime_ns = st.st_size, st.st_mtime_ns

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):  # closed already, or at interpreter exit
            pass


@dataclass(frozen=True)
class _Mapped:
    storage: weakref.ref  # the mapped UntypedStorage; dead once the mapping is released
    path: str
    file: _File | None = None  # None: the file could not be opened again after mapping
    offset: int | None = None  # the file offset of the storage's first byte (None: unknown)


# (storage data_ptr, id(storage)) -> _Mapped.  torch keeps one Python object per live storage
# (PyObject preservation), so a weak reference to it lives exactly as long as the storage does,
# and its callback drops the entry: an address reused by a later allocation is never mistaken
# for a mapped one.
_MAPPED: dict[tuple[int, int], _Mapped] = {}


def _register(storage: torch.UntypedStorage, path: str, file: _File | None = None,
              offset: int | None = None) -> tuple[int, int]:
    key = (storage.data_ptr(), id(storage))
    holder: list[_Mapped] = []

    def _drop(_ref: weakref.ref, key: tuple[int, int] = key) -> None:
        if holder and _MAPPED.get(key) is holder[0]:
            _MAPPED.pop(key, None)

    entry = _Mapped(weakref.ref(storage, _drop), path, file, offset)
    holder.append(entry)
    _MAPPED[key] = entry
    return key


def _unregister(key: tuple[int, int]) -> None:
    _MAPPED.pop(key, None)


def _mapped_entry(t: torch.Tensor) -> _Mapped | None:
    if t.device.type != "cpu" or t.layout != torch.strided:
        return None
    storage = t.untyped_storage()
    entry = _MAPPED.get((storage.data_ptr(), id(storage)))
    if entry is None or entry.storage() is not storage:
        return None
    return entry


def is_file_backed(t: torch.Tensor) -> bool:
    """True iff ``t``'s current storage is one :func:`load_safetensors` mapped from a file.

    Views of a loaded tensor (``t[0]``, ``t.T``) share its storage and are file-backed too; a copy,
    or the same tensor after ``t.data = other``, is not.  Zero-size tensors own no file pages and
    are never file-backed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"is_file_backed expects a torch.Tensor, got {type(t).__name__}")
    return _mapped_entry(t) is not None


# -- has a mapped file changed? (Note [Changed files]) -------------------------------------------

# Note [Changed files]
#     A loaded tensor reads its file's pages, so the file must stay as it was loaded.  Truncated in
#     place, a page past the new end kills the process with SIGBUS when touched; overwritten in
#     place, the weights silently become the new bytes.  Each load keeps a descriptor of every
#     file it mapped (the inode itself, so a file replaced by renaming a new one over its path,
#     the safe way, is not mistaken for a change) with its size and mtime.  Before a step reads
#     file pages (``enable()`` of every backend; each fill of a block served from file pages under
#     layerwise, and the staging look-ahead) ``verify_mapped_files`` fstats each file involved and
#     refuses with :class:`MappedFileChangedError` if its size or mtime changed, naming the file
#     and, for a truncation, the first tensor no longer covered.  ``disable()`` that leaves
#     tensors bound to a changed file warns.  A read that runs later than the step that issued
#     it (a copy stream's worker on the CPU platform, the staging thread) checks again where it
#     runs and hands a refusal to the host (Note [Deferred reads of file pages] in
#     backends/transports.py).  Not detected: a change between one fstat and the copy right
#     after it on the same thread, and a change that restores the size and the mtime (a writer
#     that sets the mtime back on purpose).  One fstat per file per check, so a fill costs
#     about a microsecond more.


def any_file_backed() -> bool:
    """Whether any storage :func:`load_safetensors` mapped is alive (a cheap guard for the
    checks of Note [Changed files])."""
    return bool(_MAPPED)


class MappedFileChangedError(RuntimeError):
    """A file that :func:`load_safetensors` mapped was truncated or overwritten in place after
    loading (Note [Changed files]); ``path`` names it."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class MappedUse:
    """One mapped file and the byte ranges of it some tensors read: (name, first byte, end)."""

    file: _File
    ranges: tuple[tuple[str, int, int], ...]


def mapped_files(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[MappedUse, ...]:
    """The files ``named``'s file-backed tensors read, with each tensor's byte range in its file
    (for :func:`verify_mapped_files`; computed once, checked per step)."""
    if not _MAPPED:
        return ()
    uses: dict[int, tuple[_File, list[tuple[str, int, int]]]] = {}
    for name, t in named:
        entry = _mapped_entry(t) if isinstance(t, torch.Tensor) and t.numel() else None
        if entry is None or entry.file is None:
            continue
        if entry.offset is None:
            lo, hi = 0, 0  # unknown place in the file: checked for any change only
        else:
            start = t.data_ptr() - t.untyped_storage().data_ptr()
            lo = entry.offset + start
            hi = lo + _extent_bytes(t)
        uses.setdefault(id(entry.file), (entry.file, []))[1].append((name, lo, hi))
    return tuple(MappedUse(f, tuple(sorted(r, key=lambda x: (x[1], x[0]))))
                 for f, r in uses.values())


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (any strides)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n)) * t.element_size()


def verify_mapped_files(uses: Sequence[MappedUse], doing: str) -> None:
    """Raise :class:`MappedFileChangedError` if a file of ``uses`` changed size or mtime since it
    was loaded (Note [Changed files]); ``doing`` names the step refused, for the message."""
    error = mapped_file_change(uses, doing)
    if error is not None:
        raise error


def mapped_file_change(uses: Sequence[MappedUse], doing: str) -> MappedFileChangedError | None:
    """The error :func:`verify_mapped_files` would raise, without raising it (None: no file of
    ``uses`` changed): for a check that runs where nothing can catch (a copy stream's worker)
    and hands its verdict to the host."""
    for use in uses:
        problem = _changed(use)
        if problem is not None:
            return MappedFileChangedError(f"{problem}; {doing} was refused before reading it. "
                                          f"{_FIX}", use.file.path)
    return None


def changed_mapped_files(uses: Sequence[MappedUse]) -> list[str]:
    """What changed of each file of ``uses`` (empty: nothing), as :func:`verify_mapped_files`
    would say it."""
    return [p for p in map(_changed, uses) if p is not None]


_FIX = ("Load the weights again from an intact file (load_safetensors), and replace a "
        "checkpoint by writing a new file and renaming it over the old path, never in place")


def _changed(use: MappedUse) -> str | None:
    f = use.file
    try:
        st = os.fstat(f.fd)
    except OSError as exc:
        return f"{f.path!r}, mapped by load_safetensors, cannot be checked: {exc.strerror}"
    if st.st_size == f.size and st.st_mtime_ns == f.mtime_ns:
        return None
    if st.st_size < f.size:
        lost = next(((n, lo, hi) for n, lo, hi in use.ranges if hi > st.st_size), None)
        which = (f"tensor {lost[0]!r} (bytes {lost[1]}-{lost[2]} of the file) is no longer in it"
                 if lost is not None else "no tensor loaded from it is past its new end")
        return (f"{f.path!r} was truncated after load_safetensors mapped it ({f.size} -> "
                f"{st.st_size} bytes): {which}, and reading a mapped page past the end of a file "
                "kills the process (SIGBUS)")
    return (f"{f.path!r} was modified in place after load_safetensors mapped it (size {f.size} "
            f"-> {st.st_size} bytes, mtime changed): the loaded tensors now read the new bytes, "
            "not the checkpoint that was loaded")


def anonymous_rss_bytes() -> int | None:
    """This process's anonymous resident memory (``RssAnon`` of ``/proc/self/status``) in bytes,
    or None where the kernel does not report it (not Linux, or a kernel before 4.5)."""
    try:
        with open(_PROC_STATUS, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


# -- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadReport:
    """What :func:`load_safetensors` did.

    ``files``: the files read, as given.  ``tensors``: distinct tensors rebound to file views (a
    tied Parameter counts once).  ``file_backed_bytes``: bytes of those tensors still viewing file
    pages after the ``post_load_weights`` hooks ran (a hook that casts a submodule moves its
    tensors to ordinary memory).  ``post_load_hooks``: dotted paths of the modules whose
    ``post_load_weights`` ran, in call order (``""`` is the module itself)."""

    files: tuple[str, ...]
    tensors: int
    file_backed_bytes: int
    post_load_hooks: tuple[str, ...]


# -- what the module holds ----------------------------------------------------------------------


@dataclass
class _Slot:
    """One distinct tensor object of the module and every name it is reachable under."""

    tensor: torch.Tensor
    names: list[str]  # its state_dict names (persistent registrations)
    other_names: list[str]  # its non-persistent buffer names
    owners: list[tuple[nn.Module, str, bool]]  # (module, attribute, persistent) registering it

    @property
    def persistent(self) -> bool:
        return bool(self.names)


def _walk(module: nn.Module) -> tuple[list[_Slot], list[_Slot], list[str]]:
    """(persistent slots, non-persistent buffer slots, modules with extra state), in the order
    ``state_dict()`` lists names (state_dict hooks are not applied)."""
    slots: dict[int, _Slot] = {}
    extra: list[str] = []
    for path, sub in module.named_modules(remove_duplicate=False):
        dot = f"{path}." if path else ""
        non_persistent = sub._non_persistent_buffers_set
        entries = [(n, t, True) for n, t in sub._parameters.items()]
        entries += [(n, t, n not in non_persistent) for n, t in sub._buffers.items()]
        for name, t, persistent in entries:
            if t is None:
                continue
            slot = slots.get(id(t))
            if slot is None:
                slot = slots[id(t)] = _Slot(t, [], [], [])
            (slot.names if persistent else slot.other_names).append(dot + name)
            slot.owners.append((sub, name, persistent))
        if type(sub).get_extra_state is not nn.Module.get_extra_state:
            extra.append(path)
    persistent = [s for s in slots.values() if s.persistent]
    others = [s for s in slots.values() if not s.persistent]
    return persistent, others, extra


def _label(slot: _Slot) -> str:
    first, *rest = slot.names or slot.other_names
    return f"{first!r} (tied: {', '.join(map(repr, rest))})" if rest else repr(first)


# -- validation ---------------------------------------------------------------------------------


def _normalize_paths(paths: Any) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        items = [paths]
    elif isinstance(paths, Sequence) and not isinstance(paths, (bytes, bytearray)):
        items = list(paths)
    else:
        raise TypeError(
            "load_safetensors: paths must be a path (str or os.PathLike) or a sequence of paths, "
            f"got {type(paths).__name__}")
    if not items:
        raise ValueError("load_safetensors: paths is empty; pass the .safetensors file(s) to read")
    out = []
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"load_safetensors: each path must be a str or os.PathLike, got "
                            f"{type(p).__name__} ({p!r})")
        out.append(os.fspath(p))
    seen: dict[str, str] = {}
    for p in out:
        real = os.path.realpath(p)
        if real in seen:
            raise ValueError(f"load_safetensors: {p!r} is listed twice (also as {seen[real]!r}); "
                             "list each shard once")
        seen[real] = p
    return out


def _check_arguments(module: Any, tensor_parallel_size: Any, quantization: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_safetensors loads into an nn.Module, got {type(module).__name__}; "
                        "pass the model (or the pipeline component) itself")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) \
            or tensor_parallel_size < 1:
        raise ValueError(f"load_safetensors: tensor_parallel_size must be a positive int, got "
                         f"{tensor_parallel_size!r}")
    if tensor_parallel_size > 1:
        raise ValueError(
            f"load_safetensors: tensor_parallel_size={tensor_parallel_size} is not supported: a "
            "memory-mapped view is a whole tensor of the file, not this rank's shard, so "
            "tensor-parallel ranks would each hold full weights; load with "
            "tensor_parallel_size=1, or use a loader that slices shards (safe_open(...).get_slice) "
            "into ordinary tensors")
    if quantization is not None:
        raise ValueError(
            f"load_safetensors: quantization={quantization!r} is not supported: online "
            "quantization rewrites the weights after loading, so they would no longer be the "
            "file's bytes and nothing would stay memory-mapped; load with quantization=None, or "
            "save a checkpoint that is already quantized and load that")


def _module_problems(module: nn.Module, persistent: list[_Slot], others: list[_Slot],
                     extra: list[str], strict: bool) -> list[str]:
    problems = []
    hooked = [path or "<root>" for path, sub in module.named_modules()
              if sub.__dict__.get(HOOKS_ATTR) or sub.__dict__.get(PIPELINE_ATTR) is not None]
    if hooked:
        problems.append(
            f"offloading is enabled on {', '.join(map(repr, hooked))}: its tensors are host "
            "masters and device copies owned by the backend; disable offloading first, load, then "
            "enable it again")
    for slot in persistent + others:
        t, where = slot.tensor, _label(slot)
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
            problems.append(f"{where} is a {type(t).__name__}, not a plain tensor or Parameter: "
                            "materialize it (full_tensor() / to_local()) before loading")
        elif t.layout != torch.strided:
            problems.append(f"{where} has layout {t.layout}; only dense (strided) tensors can view "
                            "a file: convert it with .to_dense() before loading")
        elif t.device.type not in ("cpu", "meta"):
            problems.append(f"{where} is on {t.device}; mmap views live in host memory: move the "
                            "module to the CPU (module.cpu()) or build it under "
                            "torch.device('meta') before loading")
        elif slot.persistent and (t.device.type == "meta" or t.is_inference()) \
                and weakref.getweakrefcount(t):
            problems.append(f"{where} has weak references, so it cannot be swapped in place "
                            "(torch.utils.swap_tensors); drop them before loading")
    for slot in others:
        if slot.tensor.device.type == "meta":
            owner, attr, _ = slot.owners[0]
            problems.append(
                f"non-persistent buffer {_label(slot)} is on the meta device: it is not in the "
                "checkpoint (persistent=False), so loading cannot give it values.  Build the "
                "module on the CPU, or re-create it on the CPU before loading (e.g. "
                f"{type(owner).__name__}.register_buffer({attr!r}, <tensor computed as in "
                "__init__>, persistent=False)), or register it with persistent=True and save it "
                "in the checkpoint")
    if strict and extra:
        problems.append(
            f"{', '.join(repr(p or '<root>') for p in extra)} define get_extra_state(), which "
            "safetensors files cannot hold; pass strict=False to load the tensors and restore "
            "the extra state yourself (module.set_extra_state)")
    return problems


@dataclass
class _Binding:
    slot: _Slot
    view: torch.Tensor
    path: str
    key: str


def _open_files(paths: list[str]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Open every file; returns (path -> handle, key -> path, problems): unreadable files, and
    keys that two files both hold."""
    from safetensors import safe_open

    import stat

    handles: dict[str, Any] = {}
    problems = []
    for p in paths:
        try:
            mode = os.stat(p).st_mode
        except OSError as exc:
            problems.append(f"cannot read {p!r} as a safetensors file: {exc.strerror}")
            continue
        if not stat.S_ISREG(mode):  # a FIFO would block safe_open for good, past Ctrl-C
            kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device or socket")
            problems.append(f"cannot read {p!r} as a safetensors file: it is {kind}, not a "
                            f"regular file")
            continue
        try:
            handles[p] = safe_open(p, framework="pt")
        except Exception as exc:  # noqa: BLE001 - SafetensorError is not exported everywhere
            problems.append(f"cannot read {p!r} as a safetensors file: {exc}")
    where: dict[str, str] = {}
    for p, f in handles.items():
        for key in f.keys():
            other = where.setdefault(key, p)
            if other != p:
                problems.append(f"key {key!r} is in both {other!r} and {p!r}; a sharded "
                                "checkpoint must hold each tensor once (remove it from one shard)")
    return handles, where, problems


def _match(persistent: list[_Slot], handles: dict[str, Any], where: dict[str, str], prefix: str,
           strict: bool) -> tuple[list[_Binding], list[str]]:
    files = list(handles)
    bindings: list[_Binding] = []
    problems: list[str] = []
    used: set[str] = set()
    for slot in persistent:
        found = [(prefix + n, where[prefix + n]) for n in slot.names if prefix + n in where]
        if not found:
            if strict:
                keys = ", ".join(repr(prefix + n) for n in slot.names)
                problems.append(
                    f"missing: {_label(slot)} (key {keys}) is in none of {files}; pass the "
                    "shard that holds it, fix prefix=, or pass strict=False to keep its current "
                    "value")
            continue
        first = None
        for key, path in found:
            used.add(key)
            view = handles[path].get_tensor(key)
            t = slot.tensor
            if tuple(view.shape) != tuple(t.shape) or view.dtype != t.dtype:
                problems.append(
                    f"mismatch: {_label(slot)} expects shape {tuple(t.shape)} dtype {t.dtype}, "
                    f"but {key!r} in {path!r} has shape {tuple(view.shape)} dtype {view.dtype}; "
                    "build the module with the checkpoint's config and dtype (or convert the "
                    "checkpoint)")
            elif first is None:
                first = _Binding(slot, view, path, key)
        if first is not None:
            bindings.append(first)
    if strict:
        unexpected = sorted(k for k in where if k.startswith(prefix) and k not in used)
        for key in unexpected:
            problems.append(f"unexpected: {key!r} in {where[key]!r} matches no tensor of the "
                            "module; fix prefix=, build the matching module, or pass "
                            "strict=False to ignore it")
    return bindings, problems


def _reopen(paths: list[str]) -> dict[str, _File]:
    """A :class:`_File` of each path that can be opened again (Note [Changed files])."""
    out = {}
    for p in paths:
        try:
            out[p] = _File(p)
        except OSError:
            pass  # mapped all the same; its changes go unchecked
    return out


def _file_offset(storage: torch.UntypedStorage,
                 ranges: list[tuple[int, int, int]] | None) -> int | None:
    """The file offset of ``storage``'s first byte, from the mapping that holds it."""
    ptr = storage.data_ptr()
    for lo, hi, offset in ranges or ():
        if lo <= ptr < hi:
            return offset + ptr - lo
    return None


def _file_mappings(paths: list[str]) -> dict[str, list[tuple[int, int, int]]] | None:
    """Address ranges of this process's mappings of each file (Linux), with the file offset of
    each range's start, or None."""
    ids = {}
    for p in paths:
        st = os.stat(p)
        ids[p] = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino, os.path.realpath(p))
    ranges: dict[str, list[tuple[int, int, int]]] = {p: [] for p in paths}
    try:
        with open(_PROC_MAPS, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        span, _perms, offset_field, dev, inode, name = fields
        name = name.rstrip("\n")
        if name.endswith(" (deleted)"):
            name = name[: -len(" (deleted)")]
        try:
            lo, hi = (int(x, 16) for x in span.split("-"))
            offset = int(offset_field, 16)
            major, minor = (int(x, 16) for x in dev.split(":"))
            ino = int(inode)
        except ValueError:
            continue
        for p, (maj, mnr, i, real) in ids.items():
            # overlayfs shows the lower file's device and inode: the path decides there
            if (major, minor, ino) == (maj, mnr, i) or name == real:
                ranges[p].append((lo, hi, offset))
    return ranges


def _in_file(view: torch.Tensor, ranges: list[tuple[int, int, int]]) -> bool:
    lo = view.untyped_storage().data_ptr()
    hi = lo + view.untyped_storage().nbytes()
    return any(a <= lo and hi <= b for a, b, _ in ranges)


# -- mutation -----------------------------------------------------------------------------------


class _Undo:
    """The undo log of one load (Note [Load transaction])."""

    def __init__(self) -> None:
        self._log: list[Callable[[], None]] = []

    def push(self, fn: Callable[[], None]) -> None:
        self._log.append(fn)

    def rollback(self) -> None:
        """Run every undo step, newest first.  A KeyboardInterrupt that lands inside the rollback
        is held until the rollback has finished, then raised; other failures are collected."""
        errors: list[Exception] = []
        interrupt: BaseException | None = None
        tries = 0
        while self._log:
            fn = self._log[-1]
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - undo everything we can before reporting
                errors.append(exc)
            except BaseException as exc:  # noqa: BLE001 - finish first: every step is idempotent
                interrupt = interrupt or exc
                tries += 1
                if tries < 3:
                    continue  # the same step again
                errors.append(RuntimeError(f"an undo step was interrupted {tries} times"))
            tries = 0
            self._log.pop()
        if interrupt is not None:
            raise interrupt
        if errors:
            raise RuntimeError(f"load_safetensors: rollback left {len(errors)} change(s) "
                               f"undone: {errors}") from errors[0]

    def commit(self) -> None:
        self._log = []  # drops the original storages


def _where(t: torch.Tensor) -> tuple:
    """What a tensor views: its storage, dtype, device and geometry."""
    return (t.untyped_storage().data_ptr(), t.dtype, t.device, t.shape, t.stride(),
            t.storage_offset())


def _swap_in(t: torch.Tensor, view: torch.Tensor, undo: _Undo) -> None:
    """Make ``t`` (on meta, or an inference tensor) view ``view`` in place, keeping its Python
    object, class, requires_grad and attributes.

    The undo is recorded before the swap and tells from the tensors themselves whether the swap
    happened, so an interrupt between the swap and any bookkeeping cannot strand it."""
    fresh = view.detach()
    if type(t) is not torch.Tensor:  # nn.Parameter and its subclasses
        fresh = torch.Tensor._make_subclass(type(t), fresh, t.requires_grad)
    elif t.requires_grad:
        fresh.requires_grad_(True)
    fresh.__dict__.update(t.__dict__)
    original = (t.device, t.is_inference())  # never (cpu, False): see the caller

    def unswap() -> None:
        if (fresh.device, fresh.is_inference()) == original:  # fresh holds the original
            torch.utils.swap_tensors(t, fresh)

    undo.push(unswap)
    torch.utils.swap_tensors(t, fresh)


def _snapshot_registrations(module: nn.Module, undo: _Undo) -> None:
    """Record every module's registrations so that a hook which re-registers tensors or
    submodules is undone too."""
    for sub in module.modules():
        saved = (dict(sub._parameters), dict(sub._buffers), set(sub._non_persistent_buffers_set),
                 dict(sub._modules))

        def restore(sub: nn.Module = sub, saved: tuple = saved) -> None:
            params, buffers, non_persistent, modules = saved
            for current, old in ((sub._parameters, params), (sub._buffers, buffers),
                                 (sub._modules, modules)):
                if list(current) != list(old) or any(current[k] is not v for k, v in old.items()):
                    current.clear()
                    current.update(old)
            if sub._non_persistent_buffers_set != non_persistent:
                sub._non_persistent_buffers_set.clear()
                sub._non_persistent_buffers_set.update(non_persistent)

        undo.push(restore)


def _snapshot_tensor(t: torch.Tensor, undo: _Undo) -> None:
    """Record ``t``'s storage binding and requires_grad (hooks may rebind or cast it)."""
    if t.device.type == "meta" or t.is_inference():
        return  # rebound by swap only; undone by the swap's own undo
    data, requires_grad = t.data, t.requires_grad

    def restore() -> None:
        if _where(t) != _where(data):
            t.data = data
        if t.requires_grad != requires_grad:
            t.requires_grad_(requires_grad)

    undo.push(restore)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.numel() == 0:
        return True
    if a.dtype.is_floating_point or a.dtype.is_complex:
        # compare bytes, not values: NaN payloads and -0.0 count
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return torch.equal(a, b)


def _post_load_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, each after all of its submodules (post-order, deepest first)."""
    seen: set[int] = set()
    order: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module, bool]] = [("", module, False)]
    while stack:
        path, m, expanded = stack.pop()
        if expanded:
            order.append((path, m))
            continue
        if id(m) in seen:
            continue
        seen.add(id(m))
        stack.append((path, m, True))
        children = [(f"{path}.{n}" if path else n, c) for n, c in m._modules.items()
                    if c is not None]
        for child in reversed(children):
            if id(child[1]) not in seen:
                stack.append((child[0], child[1], False))
    return order


def _post_load_hook(m: nn.Module) -> Callable[[], Any] | None:
    attr = m.__dict__.get("post_load_weights", getattr(type(m), "post_load_weights", None))
    if attr is None or isinstance(attr, nn.Module) or not callable(attr):
        return None
    return getattr(m, "post_load_weights")


# -- the loader ---------------------------------------------------------------------------------


def load_safetensors(module: nn.Module, paths: PathLike | Sequence[PathLike], *,
                     prefix: str = "", strict: bool = True, tensor_parallel_size: int = 1,
                     quantization: str | None = None) -> LoadReport:
    """Rebind every persistent tensor of ``module`` to a memory-mapped view of the safetensors
    file(s) ``paths`` (Note [File-backed weights]), then run the ``post_load_weights`` hooks.

    File keys are ``prefix`` + the names of ``module.state_dict()``.  A tied Parameter (one object
    under several names) is loaded from whichever of its names the files hold.  Everything is
    validated first and every problem is reported in one ``ValueError``; ``strict=False`` allows
    missing and unexpected keys but never a shape or dtype mismatch.  The Python objects are kept
    (only their storage changes) and a failure anywhere leaves the module exactly as it was (Note
    [Load transaction]).  Returns a :class:`LoadReport`."""
    _check_arguments(module, tensor_parallel_size, quantization)
    files = _normalize_paths(paths)
    if not isinstance(prefix, str):
        raise TypeError(f"load_safetensors: prefix must be a str, got {type(prefix).__name__}")
    persistent, others, extra = _walk(module)
    problems = _module_problems(module, persistent, others, extra, strict)
    handles, where, file_problems = _open_files(files)
    problems += file_problems
    bindings: list[_Binding] = []
    if len(handles) == len(files):  # keys can only be matched against every file
        bindings, match_problems = _match(persistent, handles, where, prefix, strict)
        problems += match_problems
    if problems:
        raise ValueError(f"load_safetensors({type(module).__name__}) from {files}: "
                         f"{len(problems)} problem(s), nothing was changed:\n  - "
                         + "\n  - ".join(problems))
    del handles  # the views keep their mappings alive

    mapped = _file_mappings(files)
    copied = [b for b in bindings if b.view.untyped_storage().nbytes() and mapped is not None
              and not _in_file(b.view, mapped[b.path])]
    if copied:
        warnings.warn(
            f"load_safetensors: safetensors returned {len(copied)} tensor(s) outside any mapping "
            f"of their file (first: {copied[0].key!r} of {copied[0].path!r}); they are loaded but "
            "not file-backed (they count as anonymous memory)", stacklevel=2)
    copied_ids = {id(b) for b in copied}
    opened = _reopen(files)  # Note [Changed files]

    # Copies of what loading must not change (Note [Load transaction]).
    kept = [(s, s.tensor.data, s.tensor.detach().clone()) for s in others]
    bound_ids = {id(b.slot.tensor) for b in bindings}
    kept += [(s, s.tensor.data, s.tensor.detach().clone()) for s in persistent
             if id(s.tensor) not in bound_ids and s.tensor.device.type != "meta"]

    undo = _Undo()
    step = "preparing"
    try:
        # Pushed in this order so that the rollback (newest first) rebinds every tensor before
        # it compares values, and re-registers last.
        _snapshot_registrations(module, undo)
        for s, _, saved in kept:  # in-place edits by a hook
            def restore_values(t: torch.Tensor = s.tensor, saved: torch.Tensor = saved) -> None:
                if not _bits_equal(t.data, saved):
                    with torch.no_grad():
                        t.data.copy_(saved)
            undo.push(restore_values)
        for s in persistent + others:
            _snapshot_tensor(s.tensor, undo)
        for b in bindings:
            step = f"binding {b.slot.names[0]!r} to {b.key!r} of {b.path!r}"
            t = b.slot.tensor
            # Each undo is recorded before its mutation and is idempotent: an interrupt between
            # the two is rolled back too.
            if t.device.type == "meta" or t.is_inference():
                _swap_in(t, b.view, undo)
            else:
                old = t.data
                undo.push(lambda t=t, old=old: setattr(t, "data", old))
                t.data = b.view
            storage = b.view.untyped_storage()
            if storage.nbytes() and id(b) not in copied_ids:
                undo.push(lambda key=(storage.data_ptr(), id(storage)): _unregister(key))
                _register(storage, b.path, opened.get(b.path),
                          _file_offset(storage, mapped.get(b.path) if mapped else None))

        ran: list[str] = []
        for path, sub in _post_load_order(module):
            hook = _post_load_hook(sub)
            if hook is None:
                continue
            step = f"post_load_weights() of {path or '<root>'!r} ({type(sub).__name__})"
            hook()
            ran.append(path)

        step = "checking the non-persistent buffers"
        restored = _restore_non_persistent(others, kept)
        if restored:
            warnings.warn(
                f"load_safetensors: a post_load_weights hook changed non-persistent buffer(s) "
                f"{', '.join(map(repr, restored))}; they were restored to their values before "
                "loading (they are not in the checkpoint)", stacklevel=2)

        step = "checking for tensors left on the meta device"
        left = [n for n, t in [*module.named_parameters(remove_duplicate=False),
                               *module.named_buffers(remove_duplicate=False)]
                if t.device.type == "meta"]
        if left:
            raise _LeftOnMeta(
                f"load_safetensors({type(module).__name__}): {len(left)} tensor(s) are still on "
                f"the meta device after loading: {', '.join(map(repr, left))}; pass the files "
                "that hold them (with strict=False they are skipped), or build those submodules "
                "on the CPU; every change was rolled back")
    except BaseException as exc:
        undo.rollback()
        if isinstance(exc, _LeftOnMeta):
            raise ValueError(str(exc)) from None
        if not isinstance(exc, Exception):
            raise
        raise RuntimeError(f"load_safetensors({type(module).__name__}) failed while {step}: "
                           f"{exc}; every change was rolled back") from exc
    undo.commit()

    counted: set[int] = set()
    file_bytes = 0
    for b in bindings:
        t = b.slot.tensor
        if is_file_backed(t) and id(t) not in counted:
            counted.add(id(t))
            file_bytes += t.numel() * t.element_size()
    return LoadReport(files=tuple(files), tensors=len(bindings), file_backed_bytes=file_bytes,
                      post_load_hooks=tuple(ran))


class _LeftOnMeta(Exception):
    pass


def _restore_non_persistent(others: list[_Slot],
                            kept: list[tuple[_Slot, torch.Tensor, torch.Tensor]]) -> list[str]:
    """Give every non-persistent buffer back its registration, storage and exact values; returns
    the names that had to be restored."""
    saved = {id(s): (data, value) for s, data, value in kept}
    restored = []
    for s in others:
        t, (data, value), changed = s.tensor, saved[id(s)], False
        for owner, attr, _ in s.owners:
            if owner._buffers.get(attr) is not t or attr not in owner._non_persistent_buffers_set:
                owner._buffers[attr] = t
                owner._non_persistent_buffers_set.add(attr)
                changed = True
        if _where(t) != _where(data):
            t.data = data
            changed = True
        if not _bits_equal(t.data, value):
            with torch.no_grad():
                t.data.copy_(value)
            changed = True
        if changed:
            restored.append(s.other_names[0])
    return restored
