"""Catalogue §B (rollback on failed enable), §C (disable / enable cycles) and §J.1 (interrupts)."""

from __future__ import annotations

import random
from typing import Any

from torch import nn

from ..registry import check, fail, not_applicable
from ..facts import (
    named_module_tensors,
    collected,
    hook_changes,
    hook_residue,
    offload_attributes,
    snapshot,
    storage_groups,
    weak_hooks,
)

#: The single-process strategies (distributed layerwise has its own checks, §H, across ranks;
#: some single-process checks run it too, with a world of one).
SINGLE_PROCESS = ("model_level", "layer_wise")

#: The checks that repeat a whole enable many times over: a fault at every mutation step of
#: enable (the two checks share one sweep) and 100 enable/disable cycles.  Their cost grows with
#: the pipeline's tensors and enable steps; the kit's own mutants run them only where a mutant
#: claims one (``Mutant.checks``).
REPEATED_ENABLE_CHECKS = frozenset({
    "check_failed_enable_restores_the_pipeline",
    "check_failed_enable_releases_memory_and_chains_the_cause",
    "check_cycles_do_not_grow_memory",
})


class InjectedFault(RuntimeError):
    """The fault the kit injects at one mutation step of enable."""


def _dry_run_steps(case: Any) -> tuple[list[str], BaseException | None]:
    """The mutation steps of one enable, and the error of that enable when the pipeline makes it
    fail on its own (a module that refuses hooks, say): then the steps are those up to and
    including the failing one, and the rollback contracts hold for that failure as well."""
    pipeline = case.build()
    before = snapshot(pipeline)
    backend = case.backend()
    steps: list[str] = []
    backend.fault_injector = lambda index, label: steps.append(label)
    try:
        backend.enable(pipeline)
    except Exception as exc:  # noqa: BLE001 - the pipeline's own failure: rolled back as well
        natural: BaseException | None = exc
    else:
        natural = None
        backend.disable()
    finally:
        backend.fault_injector = None
    if not steps and natural is not None:
        # Rejected before its first mutation (a resolver error names the pipeline's topology):
        # nothing to roll back, and no step to inject a fault at.  That is the author's to fix,
        # not the offloader's, provided the rejection really changed nothing.
        problems = before.diff(snapshot(pipeline)) + hook_residue(pipeline)
        if problems:
            fail(f"enable on {type(pipeline).__name__} failed before its first recorded "
                 f"mutation step ({type(natural).__name__}: {natural}) yet changed the "
                 f"pipeline: {problems[:4]}")
        not_applicable(f"enable rejects this pipeline before changing anything "
                       f"({type(natural).__name__}: {natural}); there is nothing to roll back")
    if not steps:
        fail(f"enable on {type(pipeline).__name__} went through no mutation step; the kit "
             "cannot inject faults (does the backend use a Transaction?)")
    return steps, natural


def _fail_at(case: Any, k: int | None, pipeline: Any = None
             ) -> tuple[Any, Any, Any, BaseException]:
    """Enable a (fresh) pipeline with a fault at step ``k`` (``None``: no fault, for a pipeline
    whose enable fails on its own); return (pipeline, backend, platform, error)."""
    pipeline = pipeline if pipeline is not None else case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)

    def inject(index: int, label: str) -> None:
        if index == k:
            raise InjectedFault(f"injected fault at step {k} ({label})")

    backend.fault_injector = inject
    try:
        backend.enable(pipeline)
    except Exception as exc:  # the contract: any failure surfaces, chained to the cause
        error = exc
    else:
        fail(f"enable succeeded although step {k} raised {InjectedFault.__name__}" if k is not
             None else "enable succeeded although it failed on the same pipeline before")
    finally:
        backend.fault_injector = None
    return pipeline, backend, platform, error


def _faults(steps: list[str], natural: BaseException | None) -> list[tuple[int | None, str]]:
    """(step to fault, what) for every step, then the pipeline's own failure if there is one."""
    faults: list[tuple[int | None, str]] = [(k, f"a fault at step {k} ({label})")
                                            for k, label in enumerate(steps)]
    if natural is not None:
        faults.append((None, f"the pipeline's own failure at step {len(steps) - 1} "
                             f"({steps[-1]}: {type(_root(natural)).__name__})"))
    return faults


def _root(exc: BaseException) -> BaseException:
    return _chain(exc)[-1]


def _chain(exc: BaseException | None) -> list[BaseException]:
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return out


# Note [One pipeline through every fault]
#     The rollback checks inject a fault at each mutation step of enable (hundreds of steps on
#     a large fixture), and each used to build a fresh pipeline for it: about a fifth of their
#     time.  A failed enable must leave the pipeline exactly as built, which is what
#     check_failed_enable_restores_the_pipeline verifies after every fault, so the checks run
#     one pipeline through the faults in turn.  Whatever a failed enable might leave behind
#     unseen could then show up at a later step instead of its own, so a step that fails on the
#     reused pipeline is run again on a fresh build, and that run is the verdict: the checks
#     fail at the same step, with the same message, as with a fresh pipeline per step.


class _Built:
    """A pipeline as built, with what it was then: its snapshot with values and its storage
    sharing (the tensors' identities are part of a snapshot, so it is taken of this object)."""

    def __init__(self, case: Any, values: bool = True) -> None:
        self.pipeline = case.build()
        self.values = values
        self.snapshot = snapshot(self.pipeline, values=values)
        self.groups = storage_groups(self.pipeline)

    def problems(self) -> list[str]:
        """How the pipeline now differs from when it was built."""
        pipeline = self.pipeline
        problems = self.snapshot.diff(snapshot(pipeline, values=self.values, live=True),
                                      pointers=False)
        if storage_groups(pipeline) != self.groups:
            problems.append(f"storage sharing changed: {self.groups} -> "
                            f"{storage_groups(pipeline)}")
        problems += [f"hook left: {h}" for h in hook_residue(pipeline)]
        problems += [f"attribute left: {a}" for a in offload_attributes(pipeline)]
        return problems


@check("B", strategies=SINGLE_PROCESS, shares="failed-enable-sweep")
def check_failed_enable_restores_the_pipeline(case) -> None:
    """A fault at any mutation step of enable leaves every tensor, hook and attribute as before."""
    _one_sweep_for_two_checks(case, "restore")


@check("B", strategies=SINGLE_PROCESS, shares="failed-enable-sweep")
def check_failed_enable_releases_memory_and_chains_the_cause(case) -> None:
    """After a failed enable: no device or pinned bytes of ours, backend disabled, the injected
    fault (or the pipeline's own error) in the exception chain."""
    _one_sweep_for_two_checks(case, "release")


# Note [One fault sweep for two checks]
#     The two checks above inject a fault at every mutation step of enable and judge what the
#     failed enable left: the pipeline (restore) and the memory, the backend's state and the
#     exception chain (release).  The sweep was most of their time (a third of a fixture's
#     cases), and each ran its own.  Now whichever runs first sweeps once and judges both at
#     every step, each exactly as it would alone (Note [One pipeline through every fault]: a
#     judgement that fails on the reused pipeline is repeated on a fresh build, whose verdict
#     stands; release is judged first, so nothing the restore judgement does is measured), and
#     leaves the other's verdict in this process for it: its message and severity, or a pass.
#     The other finds it only for the same pipeline spec, strategy, implementation (a mutant is
#     one), config and device, and takes it once; where it runs in another process (pytest-xdist:
#     the plugin puts both in one load group) it sweeps again.

_SWEEPS: dict[tuple, dict[str, tuple[str, str, Any] | None]] = {}


def _sweep_key(case: Any) -> tuple:
    # an Implementation's repr names its functions with their addresses: a mutant is another
    return (case.spec, case.strategy, repr(case.impl), str(case.device), repr(case.config()))


def _one_sweep_for_two_checks(case: Any, which: str) -> None:
    key = _sweep_key(case)
    held = _SWEEPS.pop(key, None)
    if held is not None and which in held:
        outcome = held[which]
    else:
        outcomes = _sweep_both(case)
        outcome = outcomes.pop(which)
        _SWEEPS[key] = outcomes
    if outcome is None:
        return
    kind, message, severity = outcome
    if kind == "not_applicable":
        not_applicable(message)
    fail(message, severity)


def _sweep_both(case: Any) -> dict[str, tuple[str, str, Any] | None]:
    """The verdicts of both checks (Note [One fault sweep for two checks]): None (passed) or
    ``(kind, message, severity)``."""
    from ..registry import CheckFailure, CheckNotApplicable

    try:
        steps, natural = _dry_run_steps(case)
    except CheckFailure as exc:
        return dict.fromkeys(("restore", "release"), ("fail", str(exc), exc.severity))
    except CheckNotApplicable as exc:
        return dict.fromkeys(("restore", "release"), ("not_applicable", str(exc), None))
    verdicts: dict[str, tuple[str, str, Any] | None] = {"restore": None, "release": None}

    def judge(name: str, k: int | None, what: str, built: _Built, failed: Any) -> None:
        if name == "release":
            _judge_release(k, what, natural, *failed[1:])
        else:
            _judge_restore(what, built)

    def fresh() -> _Built:
        return _Built(case, values=True)

    built = fresh()
    for k, what in _faults(steps, natural):
        open_ = [name for name in ("release", "restore") if verdicts[name] is None]
        if not open_:
            break
        failed = _fail_at(case, k, built.pipeline)
        unmet = []
        for name in open_:  # release first: it measures what the failed enable left
            try:
                judge(name, k, what, built, failed)
            except CheckFailure:
                unmet.append(name)
        if not unmet:
            if "restore" not in open_ and built.problems():
                built = fresh()  # left changed (restore's failure, reported): start anew
            continue
        for name in unmet:  # the verdict of a fresh pipeline stands
            again = fresh()
            try:
                judge(name, k, what, again, _fail_at(case, k, again.pipeline))
            except CheckFailure as exc:
                verdicts[name] = ("fail", str(exc), exc.severity)
        built = fresh()  # it passed there, or is reported: go on from a fresh one
    return verdicts


def _judge_restore(what: str, built: _Built) -> None:
    problems = built.problems()
    if problems:
        fail(f"after {what} the pipeline is not restored: {problems[:6]}")


def _judge_release(k: int | None, what: str, natural: BaseException | None, backend: Any,
                   platform: Any, error: BaseException) -> None:
    """What a failed enable (:func:`_fail_at`'s backend, platform and error) left: the cause in
    the chain, the backend disabled, no bytes held."""
    chain = _chain(error)
    if k is not None and not any(isinstance(e, InjectedFault) for e in chain):
        fail(f"{what}: the raised {type(error).__name__} does not chain the cause: {error}",
             severity="error")
    if k is None and not any(type(e) is type(_root(natural)) and str(e) == str(_root(natural))
                             for e in chain):
        fail(f"{what}: the raised {type(error).__name__} does not chain the pipeline's "
             f"error {_root(natural)!r}: {error}", severity="error")
    if backend.is_enabled():
        fail(f"{what}: is_enabled() is True after a failed enable")
    held = (platform.memory_allocated(), platform.pinned_bytes(), platform.host_allocated())
    if any(held):
        fail(f"{what}: (device, pinned, host) bytes {held} are still held")


@check("B", strategies=SINGLE_PROCESS)
def check_failed_enable_can_be_retried(case) -> None:
    """After a failed enable, a second enable on the same pipeline works and matches the
    reference (for a pipeline whose enable fails on its own: fails again the same way, and the
    pipeline still runs exactly as before)."""
    steps, natural = _dry_run_steps(case)
    reference = case.reference()
    if natural is not None:
        pipeline, backend, _, _ = _fail_at(case, None)
        try:
            backend.enable(pipeline)
        except Exception as exc:  # noqa: BLE001 - compared with the first failure below
            again = _root(exc)
        else:
            fail("a retried enable succeeded on a pipeline whose enable failed before")
        first = _root(natural)
        if type(again) is not type(first) or str(again) != str(first):
            fail(f"a retried enable failed differently: {again!r}, first {first!r} (state "
                 f"left by the failed enable?)")
        case.compare("after two failed enables, not offloaded", case.run(pipeline), reference)
        return
    for k in sorted({0, len(steps) // 2, len(steps) - 1}):
        pipeline, backend, platform, _ = _fail_at(case, k)
        backend.enable(pipeline)
        if not backend.is_enabled():
            fail(f"retry after a fault at step {k}: backend not enabled")
        case.compare(f"retry after a fault at step {k}", case.run(pipeline), reference)
        backend.disable()


@check("C", strategies=SINGLE_PROCESS)
def check_enable_disable_cycles_match_the_reference(case) -> None:
    """Every cycle: offloaded output = reference; after disable, plain output = the output of
    an un-offloaded pipeline on the host."""
    reference = case.reference()
    pipeline = case.build()
    backend = case.backend()
    for cycle in range(3):
        backend.enable(pipeline)
        case.compare(f"cycle {cycle}, offloaded", case.run(pipeline), reference)
        backend.disable()
        case.compare(f"cycle {cycle}, after disable", case.run(pipeline),
                     case.host_reference())


@check("C", strategies=SINGLE_PROCESS)
def check_disable_removes_every_trace(case) -> None:
    """After disable: no hook, registry or _offload_ref_* attribute; hooks are collected.

    The baseline is a pipeline that ran the same generation without offloading, not the
    pipeline before enable: models change themselves on their first call (transformers installs
    output-capturing hooks on the first ``output_hidden_states=True`` call; pipelines cache
    tables), and those are not the offloader's traces."""
    pipeline = case.build()
    plain = case.build()
    case.run(plain)  # un-offloaded, on the host: the model's own lazy state
    expected = snapshot(plain)
    backend = case.backend()
    backend.enable(pipeline)
    case.run(pipeline)
    refs = weak_hooks(pipeline)
    backend.disable()
    problems = [f"hook left: {h}" for h in hook_residue(pipeline)]
    problems += [f"attribute left: {a}" for a in offload_attributes(pipeline)]
    after = snapshot(pipeline)
    for path in sorted(expected.hooks):
        if expected.hooks[path] != after.hooks.get(path):
            problems.append(f"{path or '<root>'}: hooks "
                            f"{hook_changes(expected.hooks[path], after.hooks.get(path))} "
                            "(an un-offloaded run left the first)")
        added = set(after.dict_keys.get(path, ())) - set(expected.dict_keys[path])
        removed = set(expected.dict_keys[path]) - set(after.dict_keys.get(path, ()))
        if added or removed:
            problems.append(f"{path or '<root>'}: attributes added {sorted(added)}, removed "
                            f"{sorted(removed)} (against an un-offloaded run)")
    if after.global_hooks != expected.global_hooks:
        problems.append(f"module-global hooks {after.global_hooks}, where an un-offloaded run "
                        f"leaves {expected.global_hooks}")
    alive = collected(refs)
    if alive:
        problems.append(f"{len(alive)} hook object(s) still alive after disable: {alive[:3]}")
    if problems:
        fail(f"disable left traces on {type(pipeline).__name__}: {problems[:6]}")


@check("C", strategies=SINGLE_PROCESS)
def check_disable_restores_parameters_and_placement(case) -> None:
    """After disable: same Parameter objects, same values, dtypes, strides, storage sharing and
    original placement; device and pinned bytes back to the baseline."""
    pipeline = case.build()
    platform = case.platform()
    before = snapshot(pipeline, values=True)
    groups = storage_groups(pipeline)
    placement = {n: platform.is_resident(t) for n, t in named_module_tensors(pipeline)}
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    case.run(pipeline)
    backend.disable()
    after = snapshot(pipeline, values=True)
    problems = []
    for name, meta in before.tensors.items():
        now = after.tensors.get(name)
        if now is None or now[0] != meta[0]:
            problems.append(f"{name}: not the same tensor object")
        elif (now[1],) + now[3:] != (meta[1],) + meta[3:]:
            problems.append(f"{name}: (device, dtype, shape, stride, offset) "
                            f"{(meta[1],) + meta[3:]} -> {(now[1],) + now[3:]}")
    problems += [p for p in before.diff(after) if p.startswith("values")]
    if storage_groups(pipeline) != groups:
        problems.append(f"storage sharing {groups} -> {storage_groups(pipeline)}")
    moved = [n for n, t in named_module_tensors(pipeline)
             if platform.is_resident(t) != placement.get(n)]
    if moved:
        problems.append(f"placement differs from before enable: {moved[:4]}")
    if platform.memory_allocated() or platform.pinned_bytes():
        problems.append(f"{platform.memory_allocated()} device / {platform.pinned_bytes()} "
                        "pinned bytes still held")
    if problems:
        fail(f"disable did not restore {type(pipeline).__name__}: {problems[:6]}")




@check("C", strategies=SINGLE_PROCESS)
def check_second_disable_is_a_noop(case) -> None:
    """disable() twice: the second changes nothing and raises nothing."""
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    backend.disable()
    before = snapshot(pipeline, values=True)
    backend.disable()
    problems = before.diff(snapshot(pipeline, values=True))
    if problems or backend.is_enabled():
        fail(f"a second disable changed the pipeline: {problems[:5]}")


@check("C", strategies=SINGLE_PROCESS)
def check_second_enable_is_idempotent_and_exclusive(case) -> None:
    """enable() twice on one pipeline is a no-op (documented); enabling a second pipeline, or a
    second backend on an owned pipeline, raises RuntimeError."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)
    held, hooks = platform.memory_allocated(), hook_residue(pipeline)
    backend.enable(pipeline)
    if platform.memory_allocated() != held or hook_residue(pipeline) != hooks:
        fail("a second enable on the same pipeline changed device bytes or hooks")
    case.compare("after a second enable", case.run(pipeline), case.reference())
    other = case.build()
    try:
        backend.enable(other)
    except RuntimeError:
        pass
    else:
        fail("enable on a second pipeline while enabled did not raise RuntimeError")
    rival = case.backend()
    try:
        rival.enable(pipeline)
    except RuntimeError:
        pass
    else:
        fail("a second backend enabled on a pipeline another backend owns")
    if hook_residue(other):
        fail("the rejected enable left hooks on the second pipeline")
    backend.disable()


@check("C", strategies=SINGLE_PROCESS)
def check_cycles_do_not_grow_memory(case) -> None:
    """100 enable/disable cycles: device, pinned and host-master bytes return to the baseline
    every time."""
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    def held() -> tuple[int, int, int]:
        return platform.memory_allocated(), platform.pinned_bytes(), platform.host_allocated()

    base = held()
    for cycle in range(100):
        backend.enable(pipeline)
        if cycle % 25 == 0:
            case.run(pipeline)
        backend.disable()
        if held() != base:
            fail(f"after cycle {cycle}: (device, pinned, host) bytes {held()} != baseline {base}")


@check("C", strategies=SINGLE_PROCESS)
def check_random_lifecycle_sequences_keep_invariants(case) -> None:
    """Seeded random sequences of enable / forward / disable / component activation: outputs
    always match and a disabled pipeline carries no trace."""
    reference = case.reference()
    rng = random.Random(f"{case.label}")
    for sequence in range(3):
        pipeline = case.build()
        platform = case.platform()
        backend = case.backend(platform=platform)
        ops = []
        for _ in range(10):
            op = rng.choice(["enable", "forward", "disable", "phase"])
            ops.append(op)
            if op == "enable":
                backend.enable(pipeline)
            elif op == "disable":
                backend.disable()
            elif op == "forward":
                case.compare(f"sequence {sequence} {ops}", case.run(pipeline),
                             reference if backend.is_enabled() else case.host_reference())
            elif op == "phase" and backend.is_enabled() and hasattr(backend, "use_component"):
                paths = [c.path for c in backend.plan.components] if backend.plan else []
                if paths:
                    with backend.use_component(rng.choice(paths)):
                        pass
            if not backend.is_enabled():
                residue = hook_residue(pipeline) + offload_attributes(pipeline)
                if residue or platform.memory_allocated():
                    fail(f"sequence {sequence} {ops}: disabled pipeline keeps {residue[:3]} and "
                         f"{platform.memory_allocated()} device bytes")
        backend.disable()


# -- §J.1: interrupts --------------------------------------------------------------------------


class _KitInterrupt(KeyboardInterrupt):
    """The Ctrl-C the kit raises inside a block's (or a component's) forward."""


def interrupt_targets(case: Any, pipeline: Any) -> list[tuple[str, Any]]:
    """Where to interrupt: two blocks of every ring (layerwise: a second interrupt in another
    block of the same ring), or every swapped component (model level)."""
    plan = case.resolve(pipeline)
    if case.strategy.value != "model_level":
        targets = []
        for ring in plan.rings:
            blocks = list(zip(ring.streamed_paths, ring.streamed_blocks))
            if len(blocks) >= 2:
                targets += [blocks[len(blocks) // 2], blocks[-1]]
        return targets
    targets = [(c.path, c.module) for c in plan.components if c.role in ("dit", "encoder")]
    if not targets and plan.delegated:  # a split model: inside the components it declares
        from offload_ref.discovery import get_submodule_path

        for path in getattr(pipeline, "_dit_modules", ()):
            module = get_submodule_path(pipeline, path)
            if isinstance(module, nn.Module):
                targets.append((path, module))
    return targets


def _arm(module: Any) -> Any:
    """Raise _KitInterrupt once, from a pre-hook registered after the offloader's: the
    offloader's pre-hook has run, torch skips its post-hook (always_call covers Exception
    only), as for a Ctrl-C inside the forward."""
    def hook(mod: Any, args: Any) -> None:
        handle.remove()
        raise _KitInterrupt

    handle = module.register_forward_pre_hook(hook)
    return handle


def run_interrupted(case: Any, pipeline: Any, module: Any, inputs: Any = None) -> bool:
    """One generation with a Ctrl-C raised inside ``module``'s call (:func:`_arm`); whether it
    came out of the generation (it does not when the module never runs)."""
    handle = _arm(module)
    try:
        case.run(pipeline, inputs)
    except _KitInterrupt:
        return True
    finally:
        handle.remove()
    return False


@check("J.1", strategies=(*SINGLE_PROCESS, "distributed_layer_wise"))
def check_interrupt_inside_a_block_leaves_a_recoverable_ring(case) -> None:
    """A KeyboardInterrupt inside a block's forward (model level: a component's) leaves a state
    the next generation recovers from: bitwise output, and from the pass after on the same
    synchronous recoveries per generation as a clean run; disable then holds no device bytes."""
    reference = case.reference()
    pipeline = case.build()
    platform = case.platform()
    backend = case.backend(platform=platform)
    backend.enable(pipeline)

    def generation(what: str) -> int:
        before = backend.stats().sync_recoveries
        case.compare(what, case.run(pipeline), reference)
        return backend.stats().sync_recoveries - before

    generation("warm-up generation")
    clean = generation("clean generation")
    interrupted = 0
    for path, module in interrupt_targets(case, pipeline):
        interrupted += run_interrupted(case, pipeline, module)
        generation(f"the generation after an interrupt inside {path}")
        again = generation(f"the second generation after an interrupt inside {path}")
        if again > clean:
            fail(f"after an interrupt inside {path}: {again} synchronous recoveries per "
                 f"generation, {clean} in a clean run (a block left running after the "
                 "interrupt still holds its slot)")
    if not interrupted:
        fail("precondition: no interrupt target ran during a generation")
    backend.disable()
    if platform.memory_allocated():
        fail(f"after interrupts and disable, {platform.memory_allocated()} device bytes are "
             "still held")
