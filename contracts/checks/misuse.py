"""Catalogue §J: what users do next to a plain generation -- edit weights, read a state dict,
record autograd, copy a module -- is served exactly or refused loudly (a call from a second
thread, §J.6: threads.py)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from offload_ref.discovery import get_submodule_path

from ..registry import check, fail, not_applicable, one_line
from ..facts import (Identities, same_values, first_dit, leaves_of, module_view, scalable,
                    tensors_equal, values_equal)
from .lifecycle import SINGLE_PROCESS

_EDIT_SCALE = 1.25  # a power-of-two-free factor: every edited weight changes


def _floating(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if scalable(v)}


def edit_every_weight(pipeline: nn.Module) -> None:
    """The edit under test: load a scaled copy of every floating weight (as a LoRA merge or a
    checkpoint reload does), then scale the first parameter in place once more.  Weights no
    multiply applies to, offloaded or not (float8, wrapper subclasses: :func:`..facts.scalable`),
    are left out, here and in the reference alike."""
    scaled = {k: v * _EDIT_SCALE for k, v in _floating(pipeline.state_dict()).items()}
    pipeline.load_state_dict(scaled, strict=False)
    first = next((p for p in pipeline.parameters() if scalable(p)), None)
    if first is not None:
        with torch.no_grad():
            first.mul_(2.0)


#: The grad mode of the generations around a weight edit: ``torch.no_grad()``, as a user who
#: edits weights (or fine-tunes) runs a pipeline; under ``torch.inference_mode()`` every tensor
#: the pipeline makes during a generation would be an inference tensor that no edit can touch,
#: offloaded or not (``CheckCase.run``).
_EDITING = "no_grad"


def _edited_after_a_generation(case: Any, edit: Any) -> Any:
    """An un-offloaded pipeline on the device that has run one generation and then had ``edit``
    applied: the reference of a check that edits an offloaded pipeline after a generation (what
    the pipeline makes during a generation, it has made here too)."""
    reference = case.build_resident()
    case.run(reference, grad_mode=_EDITING)
    edit(module_view(reference))
    return reference


def _has_nan(t: torch.Tensor) -> bool:
    """Whether ``t`` (a wrapper subclass: any of its inner tensors) holds a NaN."""
    return any(x.is_floating_point() and bool(x.detach().isnan().any()) for x in leaves_of(t))


def same_state(what: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if set(got) != set(want):
        fail(f"{what}: state_dict keys differ: {sorted(set(got) ^ set(want))[:4]}")
    bad = [k for k in want if got[k].is_meta or got[k].shape != want[k].shape
           or not tensors_equal(got[k].detach(), want[k].detach(), nan_equal=True)
           or _has_nan(got[k])]
    if bad:
        fail(f"{what}: {len(bad)} state_dict entries differ from the true weights "
             f"(e.g. {bad[:3]}); an offloaded pipeline's state_dict must return the weights, not "
             "placeholders")


@check("J.3", strategies=SINGLE_PROCESS)
def check_edit_weights_round_trip_takes_effect_exactly(case) -> None:
    """Weights edited inside ``backend.edit_weights()`` (``load_state_dict`` of scaled weights and
    an in-place ``mul_``) take effect exactly: the next generation equals an un-offloaded
    pipeline taken through the same steps (a generation, the edit, a generation), bit for bit,
    and ``disable()`` leaves the edited weights."""
    edited_reference = _edited_after_a_generation(case, edit_every_weight)
    want = case.run(edited_reference, grad_mode=_EDITING)
    want_state = module_view(edited_reference).state_dict()
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    case.run(pipeline, grad_mode=_EDITING)  # edit a pipeline that has run (prefetched blocks,
    # a loaded component)
    with backend.edit_weights() as pipe:
        if pipe is not pipeline:
            fail("edit_weights() must yield the pipeline it edits")
        edit_every_weight(module_view(pipe))
    if not backend.is_enabled():
        fail("the backend is not enabled again after edit_weights()")
    case.compare("after edit_weights", case.run(pipeline, grad_mode=_EDITING), want)
    backend.disable()
    same_state("after disable", module_view(pipeline).state_dict(), want_state)


def _edit_through_data(pipeline: nn.Module, how: str,
                       refusals: tuple[type[BaseException], ...],
                       only: Any = None) -> tuple[int, int, int]:
    """Scale every floating parameter through ``.data`` (those ``only(p)`` holds for, when
    given): in place (``w.data.mul_``, what peft's LoRA merge and diffusers' ``fuse_lora`` do)
    or by assigning a new tensor (``w.data = ...``, what ``module.to(dtype)`` and layerwise
    casting do); neither bumps ``w._version``.  Each tensor is tried on its own; returns
    (edited, refused by the offloader -- an exception of ``refusals`` --, refused by torch).
    Parameters no multiply applies to even un-offloaded (float8, wrapper subclasses:
    :func:`..facts.scalable`) are not tried, in the pipeline and the reference alike."""
    counts = [0, 0, 0]
    with torch.no_grad():
        for p in pipeline.parameters():
            if not scalable(p) or (only is not None and not only(p)):
                continue
            try:
                if how == "in place":
                    p.data.mul_(_EDIT_SCALE)
                else:
                    p.data = p.data * _EDIT_SCALE
                counts[0] += 1
            except refusals:
                counts[1] += 1
            except RuntimeError:  # e.g. an in-place write to a placeholder's one element
                counts[2] += 1
    return counts[0], counts[1], counts[2]


@check("J.3", strategies=SINGLE_PROCESS)
def check_edits_through_data_are_exact_or_refused(case) -> None:
    """Outside ``edit_weights()``, an edit through ``.data`` (in place, or assigning a new
    tensor) is refused loudly with ``OffloadWeightEditError``, at the edit or at the next
    generation, or honoured exactly: the next generation equals an un-offloaded pipeline with
    the same edit (or, if the edit itself was refused, the unedited reference).  Never dropped
    by the next swap or block load.  (An offloader judged through the protocol may refuse with
    any exception: :mod:`..capabilities`.)"""
    refusals = case.impl.capabilities.refusals
    original = case.reference()
    for how in ("in place", "assigned"):
        edited_reference = _edited_after_a_generation(
            case, lambda m, how=how: _edit_through_data(m, how, ()))
        want = case.run(edited_reference, grad_mode=_EDITING)
        pipeline = case.build()
        backend = case.backend()
        built = Identities(module_view(pipeline).parameters())
        backend.enable(pipeline)
        try:
            case.run(pipeline, grad_mode=_EDITING)  # edit a pipeline that has run (prefetched
            # blocks, a loaded one)
            # The weights the offloader was given; then any the pipeline made itself during the
            # generation (no offloader knows them: their edit is the pipeline's own business).
            edited, refused, torch_refused = _edit_through_data(
                module_view(pipeline), how, refusals, only=lambda p: p in built)
            made, _, _ = _edit_through_data(module_view(pipeline), how, (),
                                            only=lambda p: p not in built)
            if not refused and not torch_refused:
                expected, what = want, "the edited reference"
            elif not edited and not torch_refused and not made:
                expected, what = original, "the unedited reference (the edit was refused)"
            elif not edited and not torch_refused:
                expected = case.run(_made_edited(case, how), grad_mode=_EDITING)
                what = (f"the reference with the edit of the {made} weight(s) the pipeline made "
                        "during its generation alone (the offloader refused the others)")
            else:  # applied in part: only a refusal is right
                expected, what = None, ""
            try:
                got = case.run(pipeline, grad_mode=_EDITING)
            except refusals:
                continue  # refused loudly
            if expected is None:
                fail(f"an edit through .data ({how}) was applied to {edited} weights and refused "
                     f"for {refused + torch_refused}, and the next generation ran without "
                     f"{' or '.join(r.__name__ for r in refusals)}: a half-applied edit must be "
                     "refused")
            case.compare(f"after an edit through .data ({how}), against {what}", got, expected)
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # disable() warns about restored edits
                backend.disable()


def _made_edited(case: Any, how: str) -> Any:
    """An un-offloaded pipeline on the device that has run one generation and had the weights it
    made during it (not those it was built with) edited through ``.data``, ``how``."""
    reference = case.build_resident()
    built = Identities(module_view(reference).parameters())
    case.run(reference, grad_mode=_EDITING)
    _edit_through_data(module_view(reference), how, (), only=lambda p: p not in built)
    return reference


def _refusal_words(refusals: tuple[type[BaseException], ...]) -> str:
    """How the implementation under test may refuse a misuse, for advice: offload-ref's own
    class, or any exception for an offloader judged through the protocol."""
    if any(r is Exception or r is BaseException for r in refusals):
        return "with an exception that says why"
    return "with " + " or ".join(r.__name__ for r in refusals)


@check("J.3", strategies=SINGLE_PROCESS)
def check_reads_through_data_are_true_or_refused(case) -> None:
    """Between generations, reading a parameter through ``.data`` (as diffusers'
    ``fuse_qkv_projections`` and peft's merge do before they build on it) gives its true value
    or is refused (offload-ref: ``OffloadWeightEditError``; an offloader judged through the
    protocol: any exception): never a placeholder or a slot still filling.
    Pure reads change nothing: the next generation is exact."""
    refusals = case.impl.capabilities.refusals
    reference = module_view(case.build())
    want = dict(reference.named_parameters(remove_duplicate=False))
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    try:
        case.run(pipeline)  # read a pipeline that has run (prefetched blocks, a loaded one)
        view = module_view(pipeline)
        bad, refused = [], 0
        # Parameters: buffers keep their class while enabled (Note [Rebind guard] in
        # backends/rebind_guard.py: torch.compile rejects Tensor subclasses other than Parameters).
        for name, t in view.named_parameters(remove_duplicate=False):
            if t is None or name not in want:
                continue
            try:
                value = t.data.clone()
            except refusals:
                refused += 1
                continue
            if value.is_meta or value.shape != want[name].shape or not tensors_equal(
                    value, want[name].detach(), nan_equal=True) or _has_nan(value):
                bad.append(name)
        if bad:
            fail(f"{len(bad)} weight(s) read through .data between generations gave other values "
                 f"than the true weights (e.g. {bad[:3]}; {refused} reads were refused): code "
                 "that builds on .data (fused projections, LoRA merges) would be silently wrong; "
                 "between generations keep each weight bound to its true value (a parked copy "
                 f"on the host), or refuse such reads {_refusal_words(refusals)}")
        case.compare("after reads through .data", case.run(pipeline), case.reference())
    finally:
        backend.disable()


@check("J.4", strategies=SINGLE_PROCESS)
def check_state_dict_while_enabled_returns_true_weights(case) -> None:
    """While enabled -- before and after a generation, for the pipeline and for each of its
    children -- ``state_dict()`` returns the true weights bit for bit (a checkpoint saved then
    is the model, not placeholders)."""
    reference = case.build()
    want = module_view(reference).state_dict()
    # After a generation, what an un-offloaded pipeline holds after one (a model may make
    # tensors on its first call).
    generated = case.build()
    case.run(generated)
    case.forget_runs()
    want_after = module_view(generated).state_dict()
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    same_state("after enable", module_view(pipeline).state_dict(), want)
    case.run(pipeline)
    same_state("after a generation", module_view(pipeline).state_dict(), want_after)
    want = want_after
    for name, child in module_view(pipeline).named_children():
        prefix = f"{name}."
        same_state(f"{name}.state_dict()", child.state_dict(),
                    {k[len(prefix):]: v for k, v in want.items() if k.startswith(prefix)})
    case.compare("after state_dict", case.run(pipeline), case.reference())
    backend.disable()


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _grads(pipeline: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in pipeline.named_parameters()}


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _leaves(v)]
    return [t for v in getattr(tree, "__dict__", {}).values() for t in _leaves(v)] \
        if hasattr(tree, "__dataclass_fields__") else []


def _fresh(tree: Any) -> Any:
    """Ordinary copies of the tensors of ``tree`` (captured under inference mode)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_fresh(v) for v in tree)
    return tree


def _first_calls(case: Any, pipeline: Any, paths: list[str]) -> dict[str, tuple]:
    """The arguments of the first call of each module at ``paths`` during one generation (under
    ``torch.no_grad()``: what the pipeline makes in it stays ordinary tensors, which a user who
    goes on to fine-tune can unfreeze)."""
    from offload_ref.discovery import get_submodule_path

    calls: dict[str, tuple] = {}
    handles = []
    for path in paths:
        def grab(module, args, kwargs, path=path):
            if path not in calls:
                with torch.inference_mode(False):
                    calls[path] = (_fresh(args), _fresh(kwargs))
        handles.append(get_submodule_path(pipeline, path).register_forward_pre_hook(
            grab, with_kwargs=True))
    try:
        case.run(pipeline, grad_mode="no_grad")
    finally:
        for h in handles:
            h.remove()
    return calls


def _backward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    with torch.enable_grad():
        out = module(*_fresh(args), **_fresh(kwargs))
        loss = sum(t.float().sum() for t in _leaves(out) if t.requires_grad)
        if isinstance(loss, torch.Tensor):  # else its output does not depend on its weights
            loss.backward()


def _input_grads(module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor | None]:
    """Frozen weights, floating inputs requiring grad: the gradients of those inputs (autograd
    saves the weights for them, frozen or not)."""
    args, kwargs = _fresh(args), _fresh(kwargs)
    inputs = [t for t in _leaves((args, kwargs)) if t.is_floating_point()]
    for t in inputs:
        t.requires_grad_(True)
    with torch.enable_grad():
        out = module(*args, **kwargs)
        loss = sum(t.float().sum() for t in _leaves(out) if t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
    return [None if t.grad is None else t.grad.detach().clone() for t in inputs]


# Split models delegate model level to their own ComponentGroups (one thread per model).
@check("J.5", strategies=SINGLE_PROCESS, requires=("not delegates_model_level",),
       needs="a pipeline that does not delegate model level to its own component groups")
def check_backward_is_exact_or_refused_at_forward(case) -> None:
    """Calling an offloaded component (each DiT and encoder, with the arguments the pipeline
    gives it) with autograd recording -- while its weights require grad, and again with frozen
    weights and inputs that require grad -- is refused before it runs with a RuntimeError that
    says what to do, or, if served, gives the un-offloaded gradients bit for bit: never a NaN or
    wrong gradient.  The next generation is exact.  A call whose un-offloaded backward raises
    (a model that writes into a view autograd saved) has nothing to compare with and is not
    judged; if no call can be, the check does not apply."""
    from offload_ref.discovery import get_submodule_path

    reference = case.build_resident()
    paths = [c.path for c in case.resolve(reference).components
             if c.role in ("dit", "encoder") and c.selected and not c.on_demand]
    calls = _first_calls(case, reference, paths)
    module_view(reference).requires_grad_(True)  # fixtures are frozen; a fine-tuning user
    # unfreezes them
    want: dict[str, dict] = {}
    unjudged: list[str] = []  # (path, mode) whose un-offloaded backward raised: nothing to compare
    for path, (args, kwargs) in calls.items():
        module = get_submodule_path(reference, path)
        module.zero_grad(set_to_none=True)
        try:
            _backward(module, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the model's own: that path is not judged
            unjudged.append(f"{path} with weights requiring grad: {one_line(exc)}")
            continue
        want[path] = _grads(module)
    pipeline = case.build()
    built = Identities(p for p in module_view(pipeline).parameters() if not p.is_inference())
    backend = case.backend()
    backend.enable(pipeline)
    # Steady state (prefetched blocks, a loaded component): a first call makes what the pipeline
    # makes on one (under no_grad: ordinary tensors, as the reference's), then a generation under
    # inference mode, as an engine runs one.
    case.run(pipeline, grad_mode="no_grad")
    case.run(pipeline)
    named = list(module_view(pipeline).named_parameters())
    inference = [n for n, p in named if p.is_inference() and p in built]
    if inference:
        backend.disable()
        fail(f"after a generation under torch.inference_mode() the enabled pipeline's weights "
             f"are inference tensors ({len(inference)}, e.g. {inference[:3]}; the model was "
             f"built with ordinary ones): unfreezing them for fine-tuning raises 'Setting "
             "requires_grad=True on inference tensor outside InferenceMode'; rebind device "
             "copies made during inference mode as ordinary tensors", severity="error")
    for _, p in named:  # a fine-tuning user unfreezes them; a parameter the pipeline made anew
        if not p.is_inference():  # in the kit's inference-mode generation is the pipeline's
            p.requires_grad_(True)  # own (it makes it again when called)
    for path, (args, kwargs) in calls.items():
        if path not in want:
            continue
        module = get_submodule_path(pipeline, path)
        try:
            _backward(module, args, kwargs)
        except RuntimeError as exc:
            if "grad" not in str(exc) or "no_grad" not in str(exc):
                fail(f"calling {path} with autograd was refused without saying what to do "
                     f"(run under torch.no_grad() / inference_mode, or freeze the weights): "
                     f"{exc}", severity="error")
            got = [n for n, p in module.named_parameters() if p.grad is not None]
            if got:
                fail(f"the grad-mode call of {path} was refused after gradients existed: "
                     f"{got[:3]}", severity="error")
            continue
        got = _grads(module)
        bad = [n for n in want[path] if (got[n] is None) != (want[path][n] is None) or (
            want[path][n] is not None and not values_equal(got[n], want[path][n]))]
        if bad:
            fail(f"backward through offloaded {path} gave {len(bad)} wrong or NaN gradients "
                 f"(e.g. {bad[:3]}); refuse grad-mode forwards at forward time instead")
    # Frozen weights are saved for the backward too: the gradient of an input that requires
    # grad flows through them (guidance by gradient, or a LoRA upstream).
    module_view(reference).requires_grad_(False)
    module_view(pipeline).requires_grad_(False)
    judged = len(want)
    for path, (args, kwargs) in calls.items():
        try:
            want_inputs = _input_grads(get_submodule_path(reference, path), args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the model's own: that path is not judged
            unjudged.append(f"{path} with an input requiring grad: {one_line(exc)}")
            continue
        judged += 1
        try:
            got_inputs = _input_grads(get_submodule_path(pipeline, path), args, kwargs)
        except RuntimeError as exc:
            if "grad" not in str(exc) or "no_grad" not in str(exc):
                fail(f"calling {path} with an input requiring grad was refused without saying "
                     f"what to do (run under torch.no_grad() / inference_mode, or detach the "
                     f"inputs): {exc}", severity="error")
            continue
        bad = [i for i, (g, w) in enumerate(zip(got_inputs, want_inputs))
               if (g is None) != (w is None) or (w is not None and not values_equal(g, w))]
        if bad:
            fail(f"with frozen weights, backward through offloaded {path} gave wrong or NaN "
                 f"gradients for {len(bad)} of its inputs: autograd saved offloaded weights "
                 "that were rebound after the forward; refuse such forwards at forward time")
    if not judged:
        backend.disable()
        not_applicable(f"the un-offloaded model's backward raises, so there are no gradients to "
                       f"compare with: {unjudged[0]}"
                       + (f" (and {len(unjudged) - 1} more)" if len(unjudged) > 1 else ""))
    case.compare("the next generation", case.run(pipeline), case.reference())
    backend.disable()


class _GraphWatch:
    """What autograd records during one generation: the tensors it saves for a backward (their
    count and bytes, each tensor once, by the component that was running), the components whose output requires
    grad, and the component that was running last (where a refusal came from)."""

    def __init__(self, components: list[tuple[str, nn.Module]], device: torch.device,
                 modules: dict[int, str] | None = None) -> None:
        self.components, self.device = components, device
        self.saved: dict[str, list[int]] = {}  # component -> [count, bytes, device bytes]
        self.recording: list[str] = []  # components whose output requires grad, in call order
        self.running: list[str] = []  # the components entered and not yet left
        self.last: str | None = None  # the component entered last
        self._seen: set[tuple[Any, ...]] = set()  # the tensors saved so far (they stay alive)
        #: id -> path of every module of the pipeline, watched at each forward by global hooks
        #: (they run before any module's own hooks, so before an offloader's)
        self._paths = modules or {}
        #: the pipeline's modules entered and not yet left, each with torch.is_grad_enabled()
        #: at its entry; an exception leaves the chain it was raised in (no always_call)
        self.calls: list[tuple[str, bool]] = []
        self.grad_on: list[str] = []  # modules entered with grad mode on, first entry each

    def _module_enter(self, module: nn.Module, args: Any) -> None:
        path = self._paths.get(id(module))
        if path is None:
            return
        on = torch.is_grad_enabled()
        self.calls.append((path, on))
        if on and path not in self.grad_on:
            self.grad_on.append(path)

    def _module_leave(self, module: nn.Module, args: Any, out: Any) -> None:
        path = self._paths.get(id(module))
        for k in range(len(self.calls) - 1, -1, -1):  # deeper entries: an exception caught
            if self.calls[k][0] == path:                # inside the pipeline left them
                del self.calls[k:]
                break

    def _enter(self, path: str) -> None:
        self.running.append(path)
        self.last = path

    def _leave(self, path: str, out: Any) -> None:
        if self.running and self.running[-1] == path:
            self.running.pop()
        if path not in self.recording and any(t.requires_grad for t in _leaves(out)):
            self.recording.append(path)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = leaves_of(t)  # a wrapper subclass: its inner tensors (Note [Wrapper subclasses])
        key = (str(t.device), tuple(x.data_ptr() if x.numel() else id(x) for x in held),
               t.numel(), t.dtype)
        if key in self._seen:  # saved again (a weight at every step): held once
            return t
        self._seen.add(key)
        where = self.running[-1] if self.running else "the pipeline's own code"
        entry = self.saved.setdefault(where, [0, 0, 0])
        nbytes = sum(x.numel() * x.element_size() for x in held)
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += nbytes if t.device == self.device else 0
        return t

    def __enter__(self) -> _GraphWatch:
        self._handles = []
        for path, module in self.components:
            self._handles.append(module.register_forward_pre_hook(  # before an offloader's
                lambda m, args, path=path: self._enter(path), prepend=True))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, path=path: self._leave(path, out), always_call=True))
        if self._paths:
            self._handles.append(nn.modules.module.register_module_forward_pre_hook(
                self._module_enter))
            self._handles.append(nn.modules.module.register_module_forward_hook(
                self._module_leave))
        self._saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saving.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._saving.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def cost(self) -> str:
        """What the recorded graph holds for a backward, by component (empty: nothing)."""
        parts = [f"{where}: {n} distinct tensor(s), {total} bytes ({on_device} on the device)"
                 for where, (n, total, on_device) in self.saved.items()]
        return "; ".join(parts)


@check("J.5", strategies=SINGLE_PROCESS)
def check_generation_in_the_pipelines_own_grad_mode_records_no_graph(case) -> None:
    """A generation run as a user's plain call runs it -- grad mode on, no ``torch.no_grad()`` or
    ``torch.inference_mode()`` from the caller, so that the pipeline's own ``@torch.no_grad()``
    (diffusers' pipelines have one on ``__call__``) decides -- records no autograd graph while
    offloaded: it is not refused, saves no tensor for a backward, returns no output that requires
    grad, and equals the reference.  A pipeline that forgot ``no_grad`` while its weights require
    grad fails, naming the component and what it costs: offload-ref's
    ``OffloadAutogradError`` (another offloader's refusal), or the bytes held for a backward.
    An exception is taken for a refusal of grad only where grad mode was on at the forward it
    was raised in (recorded at every module's forward) and it is ``OffloadAutogradError`` or
    the same generation under ``torch.no_grad()`` does not raise; any other exception is the
    case's error, reported as it is (the checks that run a generation judge it)."""
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    view = module_view(pipeline)
    components = list(view.named_children())
    watch = _GraphWatch(components, case.device,
                        {id(m): path for path, m in view.named_modules() if path})
    fix = ("run the generation under torch.no_grad() inside the pipeline: decorate its "
           "__call__ (or forward) with @torch.no_grad(), as diffusers' pipelines do, or "
           "freeze its weights with requires_grad_(False)")
    got, error = None, None
    try:
        try:
            with watch:
                got = case.run(pipeline, grad_mode="own")
        except Exception as exc:  # noqa: BLE001 - judged below, once the frames are gone
            error = exc
        if error is not None:
            raised_in = watch.calls[-1] if watch.calls else None  # the innermost forward
            grad_on = raised_in[1] if raised_in is not None else bool(watch.grad_on)
            refusal = grad_on and (_is_autograd_refusal(error) or _runs_under_no_grad(case))
            if not refusal:
                error.add_note(_not_a_grad_refusal(raised_in, watch.grad_on))
                raise error
            component = (raised_in[0].split(".")[0] if raised_in is not None else watch.last)
            where = f" inside {component}" if component else ""
            at = (f" (at {raised_in[0]}'s forward, entered with grad mode on)"
                  if raised_in is not None and raised_in[0] != component else "")
            fail(f"a generation in the pipeline's own grad mode (a plain call: grad mode on, no "
                 f"torch.no_grad() around it) raised{where} {type(error).__name__}: {error}"
                 f"{at}{_trainable(view, component)}.  A user calling the pipeline gets this "
                 f"refusal; {fix}", severity="error")
        held = [p for p, t in _output_leaves(got) if t.requires_grad]
        if watch.saved or held or watch.recording:
            fail(f"a generation in the pipeline's own grad mode (a plain call: grad mode on, no "
                 f"torch.no_grad() around it) recorded an autograd graph"
                 f"{' in ' + ', '.join(watch.recording) if watch.recording else ''}: it holds "
                 f"{watch.cost() or 'no saved tensor'} for a backward nobody runs"
                 f"{f', and its output requires grad ({held[:3]})' if held else ''}, until the "
                 f"output is dropped.  {fix[0].upper()}{fix[1:]}", severity="memory")
        case.compare("a generation in the pipeline's own grad mode", got, case.reference())
    finally:
        backend.disable()


def _is_autograd_refusal(error: BaseException) -> bool:
    """``error`` (or an exception it chains) is offload-ref's refusal of a grad-mode forward."""
    from offload_ref.backends.refusals import OffloadAutogradError

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OffloadAutogradError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _runs_under_no_grad(case: Any) -> bool:
    """Whether the same generation, under ``torch.no_grad()`` on a fresh pipeline and offloader,
    runs without raising: then grad mode is what made the plain call raise (an offloader's own
    refusal of grad, in its own words).  Run only when a plain call raised."""
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    try:
        case.run(pipeline, grad_mode="no_grad")
    except Exception:  # noqa: BLE001 - it raises without grad too: not a refusal of grad
        return False
    finally:
        backend.disable()
    return True


def _not_a_grad_refusal(raised_in: tuple[str, bool] | None, grad_on: list[str]) -> str:
    """The note J.5 adds to an exception that is no refusal of grad mode."""
    if raised_in is not None and not raised_in[1]:
        why = (f"grad mode was off at {raised_in[0]}'s forward, where it was raised (the "
               "pipeline's own torch.no_grad() decided)")
    elif not grad_on:
        why = "grad mode was off at every forward of the pipeline's modules"
    else:
        why = ("the same generation under torch.no_grad() raises too, so grad mode is not its "
               "cause")
    return (f"(a generation in the pipeline's own grad mode, a plain call, raised this; {why}: "
            "it is no missing torch.no_grad(), but this case's error, as the checks that run a "
            "generation report it)")


def _trainable(view: nn.Module, component: str | None) -> str:
    """``; N of COMPONENT's weights require grad (e.g. [...])`` -- counted over the component the
    refusal came from, else over the pipeline ('' when none does)."""
    names = [n for n, p in view.named_parameters() if p.requires_grad]
    own = [n for n in names if component and (n == component or n.startswith(component + "."))]
    if own:
        return f"; {len(own)} of {component}'s weights require grad (e.g. {own[:2]})"
    if names:
        return f"; {len(names)} of the pipeline's weights require grad (e.g. {names[:2]})"
    return ""


def _output_leaves(out: Any) -> list[tuple[str, torch.Tensor]]:
    from ..outputs import leaves

    return [(p, t) for p, t in leaves(out) if isinstance(t, torch.Tensor)]


@check("J.8", strategies=SINGLE_PROCESS)
def check_copies_of_an_enabled_pipeline_are_refused_or_exact(case) -> None:
    """While enabled, ``copy.deepcopy`` and pickling of the pipeline and of each of its children
    either raise a ``TypeError`` (or, for a streamed tensor, ``OffloadWeightEditError``) that
    names a way out (``disable()``, ``edit_weights()``) or give an exact copy (its
    ``state_dict`` equals the true weights): never a copy holding placeholders, and never
    torch's "cannot pickle '_thread.lock' object" from deep inside.  The pipeline stays exact."""
    import copy
    import io
    import pickle

    from offload_ref import OffloadWeightEditError

    # Judged against the un-offloaded pipeline's own behaviour, after a generation as the
    # enabled one is copied after one: models change themselves on a first call (transformers
    # installs its output-capturing hooks, local functions pickle cannot store, lazily).
    plain_pipeline = case.build()
    case.run(plain_pipeline, grad_mode="no_grad")
    case.forget_runs()
    reference = module_view(plain_pipeline)
    want = reference.state_dict()
    routes = (("copy.deepcopy", copy.deepcopy),
              ("pickle", lambda m: pickle.loads(pickle.dumps(m))),
              ("torch.save", lambda m: _torch_round_trip(m, io)))
    # A route that fails on the un-offloaded pipeline too (a class pickle cannot find, a local
    # function) is the model's own limit, not the offloader's: it is not tried.
    plain: set[tuple[str, str]] = set()
    limits: list[str] = []
    for name, module in [("", reference), *reference.named_children()]:
        for how, make in routes:
            try:
                make(module)
            except Exception as exc:  # noqa: BLE001 - any failure rules the route out
                limits.append(f"{how} of {name or 'the pipeline'}: {type(exc).__name__}: "
                              f"{str(exc)[:160]}")
                continue
            plain.add((name, how))
    del plain_pipeline, reference
    if not plain:
        not_applicable(f"the un-offloaded pipeline cannot be copied either, after a generation "
                       f"({'; '.join(limits[:3])}"
                       f"{f'; and {len(limits) - 3} more' if len(limits) > 3 else ''}): there is "
                       "no copy to judge the offloader's against")
    pipeline = case.build()
    backend = case.backend()
    backend.enable(pipeline)
    try:
        case.run(pipeline)  # copy a pipeline that has run (a loaded component, bound blocks)
        view = module_view(pipeline)
        targets = [("the pipeline", "", "", view), *((name, name, f"{name}.", child)
                                                     for name, child in view.named_children())]
        for what, key, prefix, module in targets:
            expected = {k[len(prefix):]: v for k, v in want.items() if k.startswith(prefix)}
            for how, make in routes:
                if (key, how) not in plain:
                    continue
                try:
                    copied = make(module)
                except (TypeError, OffloadWeightEditError) as exc:  # a module, or a tensor
                    if "disable()" not in str(exc) and "edit_weights()" not in str(exc):
                        fail(f"{how} of {what} while enabled raised a TypeError that names no "
                             f"way out: {str(exc)[:200]!r}; refuse with a message that says "
                             "to disable() first (or to copy inside edit_weights())",
                             severity="error")
                    continue
                same_state(f"{how} of {what} while enabled", copied.state_dict(), expected)
        case.compare("after copies of the enabled pipeline", case.run(pipeline),
                     case.reference())
    finally:
        backend.disable()


def _torch_round_trip(module: nn.Module, io: Any) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@check("J.3", strategies=SINGLE_PROCESS)
def check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change(case) -> None:
    """Between generations, outside ``edit_weights()``, ``p.mul_(s)`` for each floating
    parameter of the DiT in turn (a hand-written LoRA fuse, a rescale) either edits every one
    or is refused at the first, before any weight changed, with an exception that says what to
    do (``OffloadWeightEditError`` for offload-ref).  Never a mix: the next generation equals the
    un-offloaded pipeline taken through the same steps (a generation, the same edit or none, a
    generation) or is refused, and after ``disable()`` the DiT holds what that pipeline holds,
    weight by weight (a weight the pipeline itself makes anew during a generation holds the
    edit in neither)."""
    refusals = case.impl.capabilities.refusals
    path, _ = first_dit(case.build())
    # The un-offloaded pipeline through the same steps, edited: what the edit must give.
    edited_reference, edited_output = _edited_in_place(case, path, edit=True)
    pipeline = case.build()
    backend = case.backend()
    built = Identities(p for _, p in _dit_weights(pipeline, path))
    backend.enable(pipeline)
    try:
        case.run(pipeline, grad_mode="no_grad")  # a pipeline that has run (prefetched blocks)
        # The weights the offloader was given first; then any the pipeline made itself during
        # the generation (no offloader knows them, so none can refuse their edit).
        weights = _dit_weights(pipeline, path)
        weights = ([(n, t) for n, t in weights if t in built]
                   + [(n, t) for n, t in weights if t not in built])
        done, stopped = 0, None
        with torch.no_grad():
            for name, t in weights:
                try:
                    t.mul_(_EDIT_SCALE)
                except Exception as exc:  # noqa: BLE001 - judged below
                    stopped = (name, exc)
                    break
                done += 1
        if stopped is not None:
            name, exc = stopped
            if done:
                fail(f"p.mul_({_EDIT_SCALE}) for each of the {len(weights)} weights of DiT "
                     f"{path!r} changed {done} and then stopped at {name} with "
                     f"{type(exc).__name__}: {exc}: the pipeline now holds part of the edit.  "
                     "Refuse the first weight the edit cannot honour before any weight changes "
                     "(offload-ref refuses every in-place edit of a streamed component outside "
                     "edit_weights())")
            if not isinstance(exc, refusals):
                fail(f"p.mul_({_EDIT_SCALE}) on {name} raised {type(exc).__name__}: {exc}; a "
                     f"refusal must say what to do ({', '.join(r.__name__ for r in refusals)} "
                     "naming edit_weights())", severity="error")
        # The un-offloaded pipeline through the same steps, unedited: what a refused edit keeps.
        unedited, unedited_output = _edited_in_place(case, path, edit=False)
        what = "unedited" if stopped else "edited"
        step = 1  # the reference's state after the edit and the next generation
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a refused edit is reported with a warning
                got = case.run(pipeline, grad_mode="no_grad")
        except refusals:
            step = 0  # refused loudly: the generation did not run, so is not taken into account
        else:
            case.compare(f"after an in-place edit of every DiT weight ({what})", got,
                         unedited_output if stopped else edited_output)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # disable() may say what it restored
            backend.disable()
    edited_state, unedited = edited_reference[step], unedited[step]
    expected = unedited if stopped else edited_state
    after = dict(_dit_weights(pipeline, path))
    names = [n for n in expected if n in after]
    wrong = [n for n in names if not same_values(after[n].detach().cpu(), expected[n])]
    if not wrong:
        return
    # Each weight against the un-offloaded pipeline's, edited and not: only a weight that holds
    # the edit there and not here (or the other way round) is named.
    holds = [n for n in wrong if same_values(after[n].detach().cpu(), edited_state[n])]
    kept = [n for n in wrong if same_values(after[n].detach().cpu(), unedited[n])]
    if stopped is not None:
        fail(f"the in-place edit of DiT {path!r} was refused, and after disable() {len(holds)} "
             f"of its weights hold it (e.g. {holds[:2]}) where the un-offloaded pipeline holds "
             f"none of it; {len(wrong) - len(holds)} more differ from it (e.g. "
             f"{sorted(set(wrong) - set(holds))[:2]}): the edit must stay whole or be refused "
             "before any weight changes")
    if kept:
        fail(f"every weight of DiT {path!r} was edited in place, and disable() dropped the "
             f"edit of {len(kept)} (e.g. {kept[:2]}) that the un-offloaded pipeline holds after "
             "the same steps"
             + (f"; {len(wrong) - len(kept)} more differ from it otherwise (e.g. "
                f"{sorted(set(wrong) - set(kept))[:2]})" if len(wrong) > len(kept) else ""))
    fail(f"after an in-place edit of every weight of DiT {path!r} and disable(), {len(wrong)} of "
         f"its weights (e.g. {wrong[:2]}) hold neither the edited nor the unedited values of the "
         "un-offloaded pipeline taken through the same steps")


def _edited_in_place(case: Any, path: str, *, edit: bool
                     ) -> tuple[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], Any]:
    """An un-offloaded pipeline (on the device) taken through the steps of the in-place edit
    check: a generation, ``p.mul_`` on each floating DiT weight (``edit``), a generation.  Its
    DiT weights on the host by name before and after the last generation, and its output.  Not
    applicable when the un-offloaded pipeline refuses the edit itself (the offloader cannot be
    asked to do better)."""
    reference = case.build_resident()
    case.run(reference, grad_mode="no_grad")
    if edit:
        with torch.no_grad():
            for name, t in _dit_weights(reference, path):
                try:
                    t.mul_(_EDIT_SCALE)
                except Exception as exc:  # noqa: BLE001 - the model's own limit
                    not_applicable(f"the un-offloaded pipeline refuses the in-place edit too: "
                                   f"{name}.mul_({_EDIT_SCALE}) raised {type(exc).__name__}: "
                                   f"{exc}")
    before = {n: t.detach().cpu().clone() for n, t in _dit_weights(reference, path)}
    output = case.run(reference, grad_mode="no_grad")
    return (before, {n: t.detach().cpu().clone() for n, t in _dit_weights(reference, path)}), \
        output


def _dit_weights(pipeline: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    """The DiT's floating, non-empty parameters that a multiply applies to (not float8 or a
    wrapper subclass: :func:`..facts.scalable`), in ``parameters()`` order."""
    from offload_ref.discovery import get_submodule_path

    dit = get_submodule_path(pipeline, path)
    return [(f"{path}.{n}", p) for n, p in dit.named_parameters() if scalable(p)]
