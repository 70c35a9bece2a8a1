"""Checks judged from torch's own observables alone, so that they judge any offloader.

They drive the offloader through ``enable`` / ``disable`` / ``is_enabled`` only, and look at what
torch shows: the pipeline's tensors (identity, values, dtype, device, strides, storage sharing),
its modules' hook dicts and attributes, and the device's allocated bytes
(``torch.accelerator.memory_allocated`` / ``max_memory_allocated``).  Failures are injected from
outside: a hook registration that raises part-way, a device allocation past the simulated
accelerator's capacity.  They run on offload-ref's backends too (the control), next to the
checks that also read its internals.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from offload_ref.plan import owned_tensors, resolve_offload_plan

from ..registry import CheckNotApplicable, check, fail, not_applicable
from ..observe import module_bytes, observe, tensor_bytes
from ..facts import (
    named_module_tensors,
    module_tensors,
    module_view,
    snapshot,
    storage_groups,
    storage_key,
)
from .lifecycle import SINGLE_PROCESS, interrupt_targets, run_interrupted
from .misuse import edit_every_weight, same_state

__all__ = ["DEVICE_MEMORY_CHECKS", "InjectedRegistrationError", "OBSERVABLE_CHECKS"]

#: The checks here that need a device apart from the host (``_device_memory(case)``): those that
#: read the device's allocated bytes, and the one that hands the offloader device 1.  Not
#: applicable where host and device are one (single-device mode), where nothing an offloader
#: keeps can be told apart and there is no device index to vary.
DEVICE_MEMORY_CHECKS = frozenset({
    "check_offloader_keeps_to_the_device_index_it_was_given",
    "check_every_disable_restores_tensors_and_frees_the_device",
    "check_second_enable_changes_nothing_observable",
    "check_enable_failing_part_way_leaves_the_pipeline_as_it_was",
    "check_peak_device_bytes_stay_within_the_plan_bound",
    "check_generation_after_an_interrupt_is_exact",
    "check_model_level_keeps_the_other_components_off_the_device_in_every_generation",
})

#: Generations the checks that judge residency or a peak run with the offloader enabled: a
#: defect that shows from the second one on (a park hook that removes itself after its first
#: call) keeps every component on the device there, and one generation never sees it.
_GENERATIONS = 2


# -- what torch shows --------------------------------------------------------------------------


def _device_memory(case: Any) -> torch.device:
    """The case's device, when torch can count its bytes apart from the host's."""
    device = case.device
    if device.type == "cpu":
        not_applicable("host and device are one here (single-device mode): the kit cannot see "
                       "what an offloader keeps on the device; run with the simulated "
                       "accelerator or on a GPU")
    return device


def _allocated(device: torch.device) -> int:
    """Live bytes on ``device`` once unreachable tensors are collected."""
    gc.collect()
    return torch.accelerator.memory_allocated(device)


def _left_by_a_generation(case: Any, device: torch.device) -> int:
    """Device bytes an un-offloaded generation leaves in the pipeline's own state (a scheduler's
    timesteps made on the execution device, a cache): not the offloader's to free.  A property
    of the pipeline, measured once per spec and device in a process."""
    key = (case.spec, str(device))
    if key not in _LEFT:
        resident = case.build_resident()
        before = _allocated(device)
        _generate(case, resident)
        _LEFT[key] = max(0, _allocated(device) - before)
    return _LEFT[key]


_LEFT: dict[tuple[Any, str], int] = {}


def _generate(case: Any, pipeline: Any) -> None:
    """One generation whose output is dropped (its device bytes are not the offloader's)."""
    with torch.inference_mode():
        pipeline(**case.inputs())


def _held(held: int, left: int, device: torch.device, pipeline: Any = None) -> str:
    text = (f"{held} bytes are still allocated on {device}"
            + (f" ({left} of them the pipeline's own, as an un-offloaded generation leaves)"
               if left else ""))
    if pipeline is None:
        return text
    on = _tensors_on(pipeline, device)
    if on:
        return text + f"; the pipeline's tensors there: {_some(on)}"
    return (text + "; none of the pipeline's tensors is there: the offloader holds those bytes "
            "itself (a device copy, a cache or a buffer it kept a reference to)")


def _tensors_on(pipeline: Any, device: torch.device) -> list[str]:
    """The paths of the pipeline's parameters and buffers whose storage is on ``device``."""
    return [name for name, t in named_module_tensors(module_view(pipeline))
            if t.device == device]


def _some(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" (and {len(names) - shown} more)"
                                       if len(names) > shown else "")


def _diff_tensors(before: Any, after: Any) -> list[str]:
    """What changed in the pipeline's tensors: identity, device, dtype, shape, stride,
    ``requires_grad``, inference-ness, and values.  Storage addresses and offsets may change (offload-ref rebuilds a storage with its
    alignment phase: Note [Aligned layout] in offload_ref/host.py)."""
    problems = []
    for name, meta in before.tensors.items():
        now = after.tensors.get(name)
        if now is None or now[0] != meta[0]:
            problems.append(f"{name}: not the same tensor object")
        elif (now[1],) + now[3:6] + now[7:] != (meta[1],) + meta[3:6] + meta[7:]:
            problems.append(f"{name}: (device, dtype, shape, stride, requires_grad, inference) "
                            f"{(meta[1],) + meta[3:6] + meta[7:]} -> "
                            f"{(now[1],) + now[3:6] + now[7:]}")
    problems += [p for p in before.diff(after) if p.startswith("values")]
    return problems


def _not_as_built(before: Any, after: Any) -> list[str]:
    """:func:`_diff_tensors`, then attributes and hooks added or removed."""
    return _diff_tensors(before, after) + [p for p in before.diff(after)
                                           if p.startswith("module ")]


# -- §C: what disable leaves -------------------------------------------------------------------


@check("C", strategies=SINGLE_PROCESS)
def check_every_disable_restores_tensors_and_frees_the_device(case) -> None:
    """After each of two enable / generate / disable cycles: the same Parameter and buffer
    objects, with their values, dtypes, devices, shapes, strides and storage sharing, and the
    device's allocated bytes (``torch.accelerator.memory_allocated``) back where they were
    before enable; ``is_enabled()`` is False."""
    device = _device_memory(case)
    pipeline = case.build()
    before, groups = snapshot(pipeline, values=True), storage_groups(pipeline)
    backend = case.backend()
    left = _left_by_a_generation(case, device)
    for cycle in range(2):  # the second starts from what the first left
        base = _allocated(device)
        backend.enable(pipeline)
        _generate(case, pipeline)
        backend.disable()
        problems = _diff_tensors(before, snapshot(pipeline, values=True))
        if storage_groups(pipeline) != groups:
            problems.append(f"storage sharing {groups} -> {storage_groups(pipeline)}")
        held = _allocated(device) - base
        if held > left:
            problems.append(_held(held, left, device, pipeline))
        if backend.is_enabled():
            problems.append("is_enabled() is True")
        if problems:
            fail(f"after disable (cycle {cycle}), {type(pipeline).__name__} is not as built: "
                 f"{problems[:6]}")


@check("C", strategies=SINGLE_PROCESS)
def check_second_enable_changes_nothing_observable(case) -> None:
    """A second ``enable()`` on an enabled pipeline raises or is a no-op: device bytes, hooks and
    attributes stay as the first enable left them, the next generation is exact, and one
    ``disable()`` then restores the pipeline as built (no device bytes; hooks and attributes as
    an un-offloaded run leaves them)."""
    device = _device_memory(case)
    reference = case.reference()
    left = _left_by_a_generation(case, device)
    plain = case.build()
    _generate(case, plain)  # models change themselves on a first call (transformers' hooks)
    expected = snapshot(plain)
    pipeline = case.build()
    before = snapshot(pipeline, values=True)
    base = _allocated(device)
    backend = case.backend()
    backend.enable(pipeline)
    _generate(case, pipeline)
    first, held = snapshot(pipeline), _allocated(device)
    try:
        backend.enable(pipeline)
    except CheckNotApplicable:
        raise
    except Exception:  # noqa: BLE001 - refusing a second enable is allowed
        pass
    second = snapshot(pipeline)
    problems = [p for p in first.diff(second) if not p.startswith("tensor ")]
    if _allocated(device) != held:
        problems.append(f"device bytes {held} -> {_allocated(device)}")
    if problems:
        fail(f"a second enable() changed the enabled pipeline: {problems[:6]}")
    case.compare("after a second enable()", case.run(pipeline), reference)
    backend.disable()
    case.forget_runs()
    after = snapshot(pipeline, values=True)
    problems = _diff_tensors(before, after) + [p for p in expected.diff(after)
                                               if p.startswith("module ")]
    held = _allocated(device) - base
    if held > left:
        problems.append(_held(held, left, device, pipeline))
    if problems:
        fail(f"after two enable() calls, one disable() did not restore the pipeline: "
             f"{problems[:6]}")


# -- §B: failures injected from outside --------------------------------------------------------


class InjectedRegistrationError(RuntimeError):
    """The kit's fault: a hook registration (or forward override) that fails part-way."""


class _Registrations:
    """Counts what an enable registers on modules -- forward (pre-)hooks, module-global hooks,
    ``module.forward`` overrides (accelerate's and diffusers' hooks) -- and fails one of them."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.labels: list[str] = []
        self.fail_at = fail_at

    def event(self, label: str) -> None:
        index = len(self.labels)
        self.labels.append(label)
        if index == self.fail_at:
            raise InjectedRegistrationError(f"offload-ref kit: registration #{index} ({label}) "
                                            "failed")

    @contextmanager
    def watching(self) -> Iterator[_Registrations]:
        module_cls, module_mod = nn.Module, nn.modules.module
        saved = {name: module_cls.__dict__[name] for name in (
            "register_forward_pre_hook", "register_forward_hook", "__setattr__")}
        saved_global = {name: getattr(module_mod, name) for name in (
            "register_module_forward_pre_hook", "register_module_forward_hook")}

        def method(name: str) -> Any:
            original = saved[name]

            def wrapper(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
                self.event(f"{type(module).__name__}.{name}")
                return original(module, *args, **kwargs)
            return wrapper

        def setattr_(module: nn.Module, name: str, value: Any) -> None:
            if name == "forward":
                self.event(f"{type(module).__name__}.forward = ...")
            saved["__setattr__"](module, name, value)

        def global_hook(name: str) -> Any:
            original = saved_global[name]

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.event(f"torch.nn.modules.module.{name}")
                return original(*args, **kwargs)
            return wrapper

        module_cls.register_forward_pre_hook = method("register_forward_pre_hook")
        module_cls.register_forward_hook = method("register_forward_hook")
        module_cls.__setattr__ = setattr_
        for name in saved_global:
            setattr(module_mod, name, global_hook(name))
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(module_cls, name, value)
            for name, value in saved_global.items():
                setattr(module_mod, name, value)


@contextmanager
def _capacity(device: torch.device, nbytes: int | None) -> Iterator[None]:
    """The simulated accelerator refusing allocations past ``nbytes`` (None: no change)."""
    if nbytes is None:
        yield
        return
    from offload_ref.platform import simulated

    index = device.index or 0
    previous = simulated.capacity(index)
    simulated.set_capacity(nbytes, index)
    try:
        yield
    finally:
        simulated.set_capacity(previous, index)


def _simulated(device: torch.device) -> bool:
    from offload_ref.platform import simulated

    return device.type == simulated.DEVICE_TYPE and simulated.available()


@check("B", strategies=SINGLE_PROCESS)
def check_enable_failing_part_way_leaves_the_pipeline_as_it_was(case) -> None:
    """A failure injected from outside part-way through ``enable()`` -- the first, a middle and
    the last hook registration (or ``forward`` override) raising, and a device allocation past
    the device's capacity -- makes ``enable()`` raise and leaves the pipeline as built: the same
    tensors and values, no hook or attribute added, no device bytes held, ``is_enabled()``
    False.  Enabling again then works and generates exactly.  (An ``enable()`` that survives the
    fault must still generate exactly; on a pipeline whose enable fails on its own, that
    failure must leave it as built.)"""
    device = _device_memory(case)
    reference = case.reference()
    pipeline, counted = case.build(), _Registrations()
    before, groups = snapshot(pipeline, values=True), storage_groups(pipeline)
    backend = case.backend()
    base = _allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    own_failure = None
    try:
        with counted.watching():
            backend.enable(pipeline)
    except CheckNotApplicable:
        raise
    except Exception as exc:  # noqa: BLE001 - the pipeline's own failure (it refuses hooks)
        own_failure = f"{type(exc).__name__}: {exc}"
    if own_failure is not None:  # judged once the exception (its frames' tensors) is gone
        _restored(f"enable() failing on its own ({own_failure})", pipeline, backend, before,
                  groups, device, base)
        return
    enable_bytes = torch.accelerator.max_memory_allocated(device) - base
    backend.disable()
    n = len(counted.labels)
    faults: list[tuple[str, int | None, int | None]] = [
        (f"registration #{k} ({counted.labels[k]}) raising", k, None)
        for k in sorted({0, n // 2, n - 1}) if n]
    if enable_bytes > 0 and _simulated(device):
        faults.append((f"a device allocation past {enable_bytes // 2} of the {enable_bytes} "
                       "bytes enable() allocates", None, enable_bytes // 2))
    if not faults:
        not_applicable("enable() registered no hook, overrode no forward and allocated nothing "
                       "on the device: there is nothing to fail part-way")
    for what, k, extra in faults:
        pipeline = case.build()
        before, groups = snapshot(pipeline, values=True), storage_groups(pipeline)
        backend = case.backend()
        base = _allocated(device)
        try:
            with _Registrations(k).watching(), _capacity(
                    device, None if extra is None else base + extra):
                backend.enable(pipeline)
        except CheckNotApplicable:
            raise
        except Exception:  # noqa: BLE001 - the contract: enable raises, and restores
            pass
        else:
            case.compare(f"enable() survived {what}: its generation", case.run(pipeline),
                         reference)
            backend.disable()
            continue
        _restored(f"{what} inside enable()", pipeline, backend, before, groups, device, base)
        backend.enable(pipeline)
        case.compare(f"enable() retried after {what}", case.run(pipeline), reference)
        backend.disable()


def _restored(what: str, pipeline: Any, backend: Any, before: Any,
              groups: list[tuple[str, ...]], device: torch.device, base: int) -> None:
    """Fail unless, after ``what``, the pipeline is as built, nothing is held on the device and
    the offloader says it is not enabled."""
    problems = _not_as_built(before, snapshot(pipeline, values=True))
    if storage_groups(pipeline) != groups:
        problems.append(f"storage sharing {groups} -> {storage_groups(pipeline)}")
    held = _allocated(device) - base
    if held > 0:
        problems.append(f"{held} bytes still allocated on {device}")
    if backend.is_enabled():
        problems.append("is_enabled() is True")
    if problems:
        fail(f"after {what}, the pipeline is not as built: {problems[:6]}")


# -- §D: shared storage, judged while enabled --------------------------------------------------


def _split_groups(pipeline: Any, groups: list[tuple[str, ...]]) -> list[str]:
    """The groups of names (sharing one storage as built) whose tensors no longer share one."""
    tensors = dict(named_module_tensors(pipeline))
    split = []
    for names in groups:
        places = {storage_key(t) for n in names
                  if (t := tensors.get(n)) is not None and t.numel() and not t.is_meta}
        if len(places) > 1:
            split.append(f"{'/'.join(names)} in {len(places)} storages")
    return split


@check("D", strategies=SINGLE_PROCESS, requires=("shares_storage",))
def check_shared_storage_stays_shared_while_enabled(case) -> None:
    """Tensors that share one storage as built (a Parameter reached by two paths, views and
    aliases of one weight) share one storage while enabled -- after enable, around every
    module's forward during a generation, and after it -- and the generation is exact: an
    offloader that copies them apart serves two weights where the model has one (judged while
    enabled: a careless disable() restores them)."""
    reference = case.reference()
    pipeline = case.build()
    groups = storage_groups(pipeline)
    backend = case.backend()
    backend.enable(pipeline)
    seen: dict[str, list[str]] = {}

    def look(where: str) -> None:
        for split in _split_groups(pipeline, groups):
            seen.setdefault(split, []).append(where)

    look("after enable")
    modules = list(module_view(pipeline).named_modules())
    with observe(modules, lambda path, m: look(f"before {path or '<root>'}.forward"),
                 lambda path, m: look(f"after {path or '<root>'}.forward")):
        got = case.run(pipeline)
    look("after a generation")
    backend.disable()
    if seen:
        lines = [f"{split} ({where[0]}{f' and {len(where) - 1} more' if len(where) > 1 else ''})"
                 for split, where in seen.items()]
        fail(f"tensors sharing one storage as built were copied apart while enabled: "
             f"{lines[:4]}")
    case.compare("with shared storage", got, reference)


# -- §F: peak device bytes ---------------------------------------------------------------------

#: The alignment the peak bound pads each storage to (CUDA's; the CPU platform uses 64).
_WIDEST_ALIGNMENT = 256


def _smallest_unit(case: Any, plan: Any) -> int:
    """The bytes of the smallest thing the plan moves off the device: a streamed block
    (layerwise), a swapped component's own tensors (model level)."""
    if case.strategy.value == "layer_wise":
        sizes = [module_bytes(b) for s in plan.rings if len(s.streamed_blocks) >= 2
                 for b in s.streamed_blocks]
    else:
        sizes = [tensor_bytes([t for _, t in owned_tensors(plan, c)]) for c in plan.components
                 if c.selected and c.role in ("dit", "encoder") and not c.on_demand]
    sizes = [s for s in sizes if s]
    if not sizes:
        not_applicable(f"the {case.strategy.value} plan moves nothing off the device")
    return min(sizes)


@check("F", strategies=SINGLE_PROCESS)
def check_peak_device_bytes_stay_within_the_plan_bound(case) -> None:
    """The device's peak allocated bytes from ``enable()`` through two generations
    (``torch.accelerator.max_memory_allocated``) stay within the strategy's bound from the
    resolved plan plus the activations an un-offloaded run of the pipeline needs over two
    generations (measured), with half the smallest unit the plan moves (a block, a component)
    of slack: an offloader that never offloads exceeds it, one that stops offloading after the
    first generation too, one that offloads without prefetching does not."""
    device = _device_memory(case)
    # The kit's own resolver (the oracle, whatever the implementation's), with the widest
    # alignment padding a platform uses (CUDA's 256 bytes): how an offloader pads is its own.
    plan = resolve_offload_plan(case.build(), case.config(), alignment=_WIDEST_ALIGNMENT)
    if plan.delegated or plan.skip_reason:
        not_applicable("the plan delegates to the pipeline or places nothing: "
                       f"{plan.skip_reason or 'enable_omni_model_cpu_offload'}")
    bound, slack = plan.predicted_device_bytes(), _smallest_unit(case, plan) // 2
    resident = case.build_resident()
    start = _allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    for _ in range(_GENERATIONS):
        _generate(case, resident)
    activations = torch.accelerator.max_memory_allocated(device) - start
    del resident
    pipeline = case.build()
    backend = case.backend()
    base = _allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    backend.enable(pipeline)
    peaks = []  # per generation, from enable()
    for _ in range(_GENERATIONS):
        _generate(case, pipeline)
        peaks.append(torch.accelerator.max_memory_allocated(device) - base)
    peak = peaks[-1]
    kept = _kept_between_generations(case, plan, pipeline, device)
    backend.disable()
    if peak > bound + activations + slack:
        first = next(g for g, p in enumerate(peaks, 1) if p > bound + activations + slack)
        fail(f"peak device bytes {peak} from enable() through {_GENERATIONS} generations exceed "
             f"the {case.strategy.value} bound {bound} (the plan's) + {activations} (activations "
             f"of an un-offloaded run) + {slack} (slack), from generation {first} on (peaks "
             f"{peaks}): weights that should be off the device are on it; {kept}")


def _kept_between_generations(case: Any, plan: Any, pipeline: Any, device: torch.device) -> str:
    """What of the offloaded weights is on the device after the last generation, by unit (a
    streamed block, without the tensors its ring keeps resident because they are shared; a
    swapped component), for a peak over the bound."""
    if case.strategy.value == "layer_wise":
        units = [(path, set(s.shared)) for s in plan.rings if len(s.streamed_blocks) >= 2
                 for path in s.streamed_paths]
        what, allowed = "streamed blocks", "a layerwise offloader keeps about one per ring"
    else:
        units = [(c.path, set()) for c in plan.components
                 if c.selected and c.role in ("dit", "encoder") and not c.on_demand]
        what, allowed = "swapped components", "a model-level offloader keeps one at a time"
    view = module_view(pipeline)
    on = []
    for path, shared in units:
        try:
            module = view.get_submodule(path)
        except AttributeError:
            continue
        if any(t.device == device and name not in shared
               for name, t in module_tensors(module, prefix=path, remove_duplicate=False)):
            on.append(path)
    if on:
        return (f"after the last generation {len(on)} of the {len(units)} {what} have tensors "
                f"on the device ({allowed}): {_some(on)}")
    return ("after the last generation none of the pipeline's offloaded tensors is on the "
            "device: the offloader holds those bytes itself (device copies it keeps, a cache)")


# -- §F: model-level residency, seen from outside -------------------------------------------


def _swapped(case: Any, pipeline: Any) -> list[tuple[str, str, nn.Module, list[nn.Module]]]:
    """``(path, role, module, own modules)`` of each component the kit's model-level plan swaps
    (each DiT and selected encoder), found in ``pipeline`` by path; its own modules leave out
    those of a component declared inside it (a resident nested in a DiT stays on the device)."""
    from offload_ref.discovery import get_submodule_path

    plan = resolve_offload_plan(case.build(), case.config())
    if plan.delegated or plan.skip_reason:
        not_applicable("the model-level plan delegates to the pipeline or places nothing: "
                       f"{plan.skip_reason or 'enable_omni_model_cpu_offload'}")
    paths = [c.path for c in plan.components]
    out = []
    for c in plan.components:
        if not (c.selected and c.role in ("dit", "encoder") and not c.on_demand):
            continue
        module = get_submodule_path(pipeline, c.path)
        if not isinstance(module, nn.Module):
            continue
        inner = {id(m) for p in paths if p.startswith(c.path + ".")
                 for m in getattr(get_submodule_path(pipeline, p), "modules", lambda: ())()}
        out.append((c.path, c.role, module, [m for m in module.modules() if id(m) not in inner]))
    if len(out) < 2 or not any(role == "dit" for _, role, _, _ in out):
        not_applicable("the model-level plan swaps fewer than two components: none can be on "
                       "the device while another runs")
    return out


def _on_device(modules: list[nn.Module], device: torch.device) -> tuple[int, int]:
    """How many of ``modules``' own tensors are on ``device``'s type now, and their bytes (a
    wrapper subclass: its inner tensors, which hold its bytes)."""
    seen: set[int] = set()
    count = nbytes = 0
    for module in modules:
        for _, t in module_tensors(module, recurse=False):
            if id(t) in seen or t.device.type != device.type:
                continue
            seen.add(id(t))
            count += 1
            nbytes += t.numel() * t.element_size()
    return count, nbytes


@check("F.1", strategies=("model_level",), requires=("not delegates_model_level",))
def check_model_level_keeps_the_other_components_off_the_device_in_every_generation(case
                                                                                    ) -> None:
    """In each of two generations, at the end of each swapped component's forward (before any
    hook after it runs): while a DiT runs, no tensor of another swapped component (an encoder,
    another DiT) is on the device; while an encoder runs, no tensor of a swapped DiT is.  Judged
    from the tensors' devices alone, so it judges any offloader: one that parks a component in
    its first generation only (a park hook that removes itself after its first call) keeps the
    encoders and the DiT on the device together from the second generation on."""
    device = _device_memory(case)
    pipeline = case.build()
    swapped = _swapped(case, pipeline)
    backend = case.backend()
    backend.enable(pipeline)
    generation = [0]
    problems: dict[tuple[str, str], str] = {}  # (running, resident) -> the first sighting
    observed: list[str] = []

    def at_end(path: str, role: str) -> None:
        observed.append(path)
        for other, other_role, _, modules in swapped:
            if (other == path or other.startswith(path + ".") or path.startswith(other + ".")
                    or (role != "dit" and other_role != "dit")):
                continue
            count, nbytes = _on_device(modules, device)
            if count and (path, other) not in problems:
                problems[(path, other)] = (
                    f"generation {generation[0]}: {other_role} {other} has {count} tensor(s) "
                    f"({nbytes} bytes) on {device} while {role} {path} runs")

    handles = []
    try:
        for path, role, module, _ in swapped:
            try:  # before the offloader's post-hooks: what was resident while it ran
                handles.append(module.register_forward_hook(
                    lambda m, args, out, path=path, role=role: at_end(path, role),
                    prepend=True))
            except Exception:  # noqa: BLE001 - a module that refuses hooks: not watched
                continue
        for g in range(1, _GENERATIONS + 1):
            generation[0] = g
            case.run(pipeline)
    finally:
        for handle in handles:
            handle.remove()
        backend.disable()
    if not observed:
        not_applicable("no swapped component's forward could be watched (its modules refuse "
                       "hooks)")
    if problems:
        lines = list(problems.values())
        fail(f"model-level residency violated: {'; '.join(lines[:4])}"
             f"{f' and {len(lines) - 4} more' if len(lines) > 4 else ''}.  A model-level "
             "offloader keeps one swapped component on the device at a time, in every "
             "generation (a hook that parks a component must stay installed while enabled)",
             severity="memory")


# -- §F: the device index the offloader was given ----------------------------------------------


def _another_index(device: torch.device) -> torch.device:
    """A device of ``device``'s type with another index (``hpu:1`` for ``hpu:0``); not applicable
    where the accelerator has one device."""
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if count < 2:
        not_applicable(f"{device.type} has {count} device(s) here: the kit cannot hand the "
                       "offloader a device index other than 0 (set OFFLOAD_REF_SIM_DEVICES=2, or "
                       "run on a machine with two GPUs)")
    return torch.device(device.type, 0 if (device.index or 0) else 1)


@check("F", strategies=SINGLE_PROCESS)
def check_offloader_keeps_to_the_device_index_it_was_given(case) -> None:
    """Given device 1 (``hpu:1``, or ``cuda:1``) instead of device 0, the offloader places every
    tensor it moves on device 1 -- after enable, before and after each module's forward during a
    generation, and after it -- and the generation equals the un-offloaded pipeline run on device
    1: an offloader that ignores the index it is given (moves to device 0, or to the bare device
    type, which is device 0) fails, naming the tensor."""
    from ..case import on_device_index

    other = _another_index(_device_memory(case))
    with on_device_index(other.index):
        case._device = other  # the reference, and every device bytes count, on device 1
        reference = case.reference()
        pipeline = case.build()
        backend = case.backend()
        wrong: dict[str, tuple[str, str]] = {}  # tensor -> (device, when first seen there)

        def look(when: str, tensors: Any) -> None:
            for name, t in tensors:
                if (t is not None and t.device.type == other.type and t.device != other
                        and name not in wrong):
                    wrong[name] = (str(t.device), when)

        def own(path: str, module: nn.Module) -> list[tuple[str, Any]]:
            """The module's own parameters and buffers (its children are looked at in theirs)."""
            prefix = f"{path}." if path else ""
            return [(f"{prefix}{n}", t) for registry in (module._parameters, module._buffers)
                    for n, t in registry.items()]

        backend.enable(pipeline)
        error = None
        try:
            look("after enable", named_module_tensors(pipeline))
            modules = list(module_view(pipeline).named_modules())
            with observe(modules,
                         lambda p, m: look(f"before {p or '<root>'}.forward", own(p, m)),
                         lambda p, m: look(f"after {p or '<root>'}.forward", own(p, m))):
                try:
                    got = case.run(pipeline)
                except Exception as exc:  # noqa: BLE001 - reported after the placement
                    error = exc
            look("after a generation", named_module_tensors(pipeline))
        finally:
            backend.disable()
    if wrong:
        lines = [f"{name} landed on {where} instead of {other} ({when})"
                 for name, (where, when) in list(wrong.items())[:4]]
        more = f" and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        fail(f"the offloader was given {other} and put {len(wrong)} tensor(s) on another device: "
             f"{'; '.join(lines)}{more}.  Move to the device the offloader was given, index "
             f"included (not {other.type!r}, which means device 0)"
             + (f"; the generation then raised {type(error).__name__}: {error}"
                if error is not None else ""),
             # a generation that raises stops the user's run; one that runs holds bytes on a
             # device the user kept for something else
             severity="error" if error is not None else "memory")
    if error is not None:
        raise error
    case.compare(f"a generation with the offloader on {other}", got, reference)


# -- §J: interrupts and edits ------------------------------------------------------------------


@check("J.1", strategies=SINGLE_PROCESS)
def check_generation_after_an_interrupt_is_exact(case) -> None:
    """A KeyboardInterrupt raised inside a block's call (model level: a component's) propagates
    out of the generation, the next generation is exact, and ``disable()`` then leaves no bytes
    on the device."""
    device = _device_memory(case)
    reference = case.reference()
    pipeline = case.build()
    targets = interrupt_targets(case, pipeline)[:2]  # offload-ref's J.1 tries every ring
    if not targets:
        not_applicable("the kit's plan names no block or component to interrupt")
    left = _left_by_a_generation(case, device)
    base = _allocated(device)
    backend = case.backend()
    backend.enable(pipeline)
    interrupted = 0
    for path, module in targets:
        interrupted += run_interrupted(case, pipeline, module)
        case.compare(f"the generation after an interrupt inside {path}", case.run(pipeline),
                     reference)
    if not interrupted:
        fail(f"precondition: no interrupt target ({[p for p, _ in targets][:3]}) ran during a "
             "generation")
    backend.disable()
    case.forget_runs()
    held = _allocated(device) - base
    if held > left:
        fail(f"after interrupts and disable(), {_held(held, left, device, pipeline)}")


@check("J.3", strategies=SINGLE_PROCESS)
def check_edit_between_cycles_takes_effect_and_survives_disable(case) -> None:
    """A weight edit made while disabled, between two enable / disable cycles
    (``load_state_dict`` of scaled weights, then an in-place ``mul_``), takes effect at the next
    enable -- the generation equals an un-offloaded pipeline carrying the same edit, not the
    first snapshot of the weights -- and survives the next ``disable()``."""
    # Generations under torch.no_grad(), as a user who edits weights runs them: under inference
    # mode a tensor the pipeline makes during a generation would be one no edit can touch.  The
    # references are taken through the same steps (a generation, the edit, ...).
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    case.compare("before the edit", case.run(pipeline, grad_mode="no_grad"), case.reference())
    backend.disable()
    edit_every_weight(module_view(pipeline))
    edited = case.build_resident()
    case.run(edited, grad_mode="no_grad")
    edit_every_weight(module_view(edited))
    want = case.run(edited, grad_mode="no_grad")
    backend.enable(pipeline)
    case.compare("the first generation after an edit made while disabled",
                 case.run(pipeline, grad_mode="no_grad"), want)
    backend.disable()
    host_edited = case.build()
    case.run(host_edited, grad_mode="no_grad")
    edit_every_weight(module_view(host_edited))
    case.run(host_edited, grad_mode="no_grad")
    same_state("after the next disable()", module_view(pipeline).state_dict(),
                module_view(host_edited).state_dict())


#: Every check of this module (they judge any offloader through the protocol).
OBSERVABLE_CHECKS = frozenset(name for name, value in list(globals().items())
                              if name.startswith("check_") and callable(value))

