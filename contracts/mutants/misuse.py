"""Mutants of what users do next to a generation (§J.3-§J.8): the checks they fail are in
checks/misuse.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from offload_ref.backends.call_guard import CallGuard
from offload_ref.backends.layerwise import LayerWiseOffloadBackend
from offload_ref.backends.model_level import ModelLevelOffloadBackend
from offload_ref.backends.refusals import RefusalPolicy
from offload_ref.split import ComponentGroups

from ._declare import MISUSE_LAYER, MISUSE_MODEL, SPLIT_THREADS, backend_with, declare
from .split import _cosmos3_with


class _EditsUnguarded(LayerWiseOffloadBackend):
    """Streams without refusing in-place edits between forwards: a loop editing every DiT weight
    changes the resident ones and stops at the first placeholder with torch's raw error."""

    def after_guard(self, txn) -> None:
        pass


declare(
    "edits_unguarded",
    "an in-place edit of every DiT weight between generations changes the resident ones and stops "
    "at the first streamed one",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_EditsUnguarded),
    kills={"check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change"},
)


def _editing_in_place(base: type) -> type:
    """edit_weights() that yields the enabled pipeline: edits hit masters and placeholders."""

    @contextlib.contextmanager
    def edit_weights(self):
        yield self.pipeline

    return type(f"EditsInPlace{base.__name__}", (base,), {"edit_weights": edit_weights})


declare(
    "edit_weights_in_place_layerwise",
    "edit_weights() does not re-read: edits hit the ring",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_editing_in_place(LayerWiseOffloadBackend)),
    kills={"check_edit_weights_round_trip_takes_effect_exactly"},
)

declare(
    "edit_weights_in_place_model_level",
    "edit_weights() does not re-read: edits hit masters and device copies",
    MISUSE_MODEL,
    make_backend=backend_with(
        ModelLevelOffloadBackend=_editing_in_place(ModelLevelOffloadBackend)),
    kills={"check_edit_weights_round_trip_takes_effect_exactly"},
)


class _PlaceholderStateDict(LayerWiseOffloadBackend):
    """state_dict() reads whatever the tensors are bound to (placeholders between blocks)."""

    def offloaded_tensors(self):
        return {key: None for key in super().offloaded_tensors()}


declare(
    "state_dict_returns_placeholders",
    "state_dict() while enabled returns the NaN placeholders of streamed blocks",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_PlaceholderStateDict),
    kills={"check_state_dict_while_enabled_returns_true_weights"},
)


def _unguarded(base: type) -> type:
    """Edits through ``.data`` pass unseen (no Note [Rebind guard]): the next swap drops them."""
    return type(f"Unguarded{base.__name__}", (base,), {"rebound_tensors": lambda self: []})


declare(
    "data_edits_unguarded_layerwise",
    "an edit through .data outside edit_weights() is dropped by the next block load",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_unguarded(LayerWiseOffloadBackend)),
    kills={
        "check_in_place_edit_of_every_dit_weight_is_whole_or_refused_before_any_change",
        "check_edits_through_data_are_exact_or_refused",
        "check_reads_through_data_are_true_or_refused",  # no guard, so no read guard either
    },
)

declare(
    "data_edits_unguarded_model_level",
    "an edit through .data outside edit_weights() is dropped by the next swap",
    MISUSE_MODEL,
    make_backend=backend_with(ModelLevelOffloadBackend=_unguarded(ModelLevelOffloadBackend)),
    kills={"check_edits_through_data_are_exact_or_refused"},
)


def _refusing(policy: type[RefusalPolicy], base: type = LayerWiseOffloadBackend) -> type:
    """``base`` with another refusal policy (Note [Refusal policy] in backends/refusals.py)."""
    return type(f"{base.__name__}{policy.__name__}", (base,), {"refusal_policy_class": policy})


class _AutogradAllowed(RefusalPolicy):
    def refuse_autograd(self, label, names, tensors, args=(), kwargs=None, module=None) -> None:
        pass


declare(
    "backward_not_refused",
    "a grad-mode forward through streamed blocks is not refused",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_refusing(_AutogradAllowed)),
    kills={"check_backward_is_exact_or_refused_at_forward"},
)


class _ReadsBetweenForwardsAllowed(RefusalPolicy):
    """Note [Reads between forwards] undone: ``.data`` of a streamed tensor reads whatever it is
    bound to (NaN placeholders, a slot still filling) between forwards."""

    refuses_reads_between_forwards = False


declare(
    "reads_between_forwards_allowed",
    "reading a streamed weight's .data between forwards gives its placeholder (diffusers' "
    "fuse_qkv_projections builds NaN projections from it)",
    MISUSE_LAYER,
    make_backend=backend_with(
        LayerWiseOffloadBackend=_refusing(_ReadsBetweenForwardsAllowed)),
    kills={"check_reads_through_data_are_true_or_refused"},
)


class _WeightsOnlyAutograd(RefusalPolicy):
    """Note [Autograd] checking only whether the offloaded weights require grad: a frozen
    weight is still saved for the gradient of an input, and read back as a placeholder."""

    def refuse_autograd(self, label, names, tensors, args=(), kwargs=None, module=None) -> None:
        super().refuse_autograd(label, names, tensors)


declare(
    "frozen_backward_not_refused",
    "a grad-mode forward through frozen streamed weights with an input that requires grad is not "
    "refused (autograd saves the placeholders)",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_refusing(_WeightsOnlyAutograd)),
    kills={"check_backward_is_exact_or_refused_at_forward"},
)


class _LetsEveryThreadIn(CallGuard):
    """A call guard that never refuses a second thread (Note [One thread at a time] undone):
    nothing is recorded, so ``exclusive()`` waits for nobody."""

    def enter(self, label: str, frame: Any) -> bool:
        return True

    def holds(self, frame: Any) -> bool:
        return True

    def exit(self, frame: Any) -> bool:
        return True

    # ... and a component's whole forward (Note [Component entries]) records nothing either
    def enter_component(self, label: str, frame: Any) -> bool:
        return True

    def holds_component(self, frame: Any) -> bool:
        return True

    def exit_component(self, frame: Any) -> None:
        return None


class _UnguardedGroups(ComponentGroups):
    """ComponentGroups whose contexts let every thread in: a second thread swaps the groups
    while the first runs inside one."""

    call_guard_class = _LetsEveryThreadIn


declare(
    "split_threads_unguarded",
    "a split model's component groups let a second thread swap while the first runs",
    SPLIT_THREADS,
    factory=_cosmos3_with(_UnguardedGroups),
    kills={"check_second_thread_gets_a_clear_error_or_exact_output"},
)


class _UnguardedCalls(LayerWiseOffloadBackend):
    call_guard_class = _LetsEveryThreadIn


declare(
    "concurrent_calls_unguarded",
    "a second thread runs the ring while the first is inside",
    MISUSE_LAYER,
    make_backend=backend_with(LayerWiseOffloadBackend=_UnguardedCalls),
    kills={"check_second_thread_gets_a_clear_error_or_exact_output"},
)


class _CopiesAllowed(RefusalPolicy):
    """Note [No copies while enabled] undone: a deep copy or pickle of an enabled module
    copies its hooks, and fails deep inside with torch's "cannot pickle '_thread.lock'"."""

    def refuse_copy(self, subject: str) -> None:
        pass


declare(
    "copies_not_refused",
    "copy.deepcopy of an enabled module copies its offload hooks",
    dict(pipelines=("flux2",), sections=("J.8",), strategies=("model_level", "layer_wise")),
    make_backend=backend_with(
        LayerWiseOffloadBackend=_refusing(_CopiesAllowed),
        ModelLevelOffloadBackend=_refusing(_CopiesAllowed, ModelLevelOffloadBackend)),
    kills={"check_copies_of_an_enabled_pipeline_are_refused_or_exact"},
)


# -- §J.5: a pipeline that forgot torch.no_grad() ---------------------------------------------


def _forgets_no_grad() -> type:
    """flux2's pipeline class with its ``forward`` undecorated: no ``@torch.no_grad()``."""
    from offload_ref.fixtures._common import FlowMatchPipeline
    from offload_ref.fixtures.flux2 import Flux2Pipeline

    return type("Flux2PipelineWithoutNoGrad", (Flux2Pipeline,),
                {"forward": FlowMatchPipeline.forward.__wrapped__,
                 "__module__": __name__})


def flux2_without_no_grad(seed: int = 0) -> Any:
    """flux2 as an author who forgot ``@torch.no_grad()`` builds it: its ``__call__`` runs in the
    caller's grad mode, and its weights require grad (as ``from_pretrained`` leaves them)."""
    from offload_ref.fixtures.flux2 import build_pipeline

    pipeline = build_pipeline(seed)
    pipeline.__class__ = _forgets_no_grad()
    return pipeline.requires_grad_(True)


declare(
    "pipeline_without_no_grad",
    "the pipeline's __call__ has no @torch.no_grad() and its weights require grad: a plain call "
    "records an autograd graph through the offloaded components",
    dict(pipelines=("flux2",), sections=("J.5",), strategies=("model_level", "layer_wise")),
    factory=flux2_without_no_grad,
    kills={"check_generation_in_the_pipelines_own_grad_mode_records_no_graph"},
)
