"""J.6 judges an offloader that serves a second thread against the pipeline serving the same two
calls with no offloader (found by an outside engine author: an offloader with no hooks at all
failed J.6 on the SD3 pipeline of real diffusers classes, whose scheduler keeps its step index
on itself, so two concurrent generations fail without any offloader too)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from offload_ref.contracts.offloader import offloader_implementation
from offload_ref.contracts.runner import run_checks
from offload_ref.fixtures import get_spec

THREADS = "check_second_thread_gets_a_clear_error_or_exact_output"


def _modules(pipeline: Any) -> list[nn.Module]:
    if isinstance(pipeline, nn.Module):
        return [pipeline]
    return [v for v in vars(pipeline).values() if isinstance(v, nn.Module)]


class _Resident:
    """Moves every parameter and buffer to the device at enable and back at disable, with no
    hooks: it serves any number of threads, as the pipeline alone does."""

    def __init__(self, device: torch.device, strategy: str) -> None:
        self.device = torch.device(device)
        self.saved: list[tuple[Any, str, torch.Tensor, bool]] | None = None

    def enable(self, pipeline: Any) -> None:
        if self.saved is not None:
            return
        saved, seen = [], set()
        for root in _modules(pipeline):
            for module in root.modules():
                for table, is_param in ((module._parameters, True), (module._buffers, False)):
                    for key, t in table.items():
                        if t is None or (id(table), key) in seen:
                            continue
                        seen.add((id(table), key))
                        saved.append((table, key, t.data if is_param else t, is_param))
        for table, key, t, is_param in saved:
            if is_param:
                table[key].data = t.to(self.device)
            else:
                table[key] = t.to(self.device)
        self.saved = saved

    def disable(self) -> None:
        for table, key, t, is_param in self.saved or ():
            if is_param:
                table[key].data = t
            else:
                table[key] = t
        self.saved = None

    def is_enabled(self) -> bool:
        return self.saved is not None


class _UnclearRefusal(_Resident):
    """Refuses a call while another thread is inside a component, with a message that does not
    say why ("slot 0 busy"): wrong on any pipeline, thread-safe or not."""

    def enable(self, pipeline: Any) -> None:
        super().enable(pipeline)
        self.inside: dict[int, int] = {}
        self.handles = []
        for module in _modules(pipeline) if not isinstance(pipeline, nn.Module) else \
                list(pipeline.children()):
            self.handles.append(module.register_forward_pre_hook(self._pre))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, module: nn.Module, args: Any) -> None:
        import threading

        me = threading.get_ident()
        if any(n for t, n in self.inside.items() if t != me):
            raise RuntimeError("slot 0 busy")
        self.inside[me] = self.inside.get(me, 0) + 1

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        import threading

        self.inside[threading.get_ident()] -= 1

    def disable(self) -> None:
        for handle in getattr(self, "handles", []):
            handle.remove()
        self.handles = []
        super().disable()


def _results(spec: Any, cls: type = _Resident) -> list[Any]:
    impl = offloader_implementation(lambda d, s: cls(d, s), name=f"tests:{cls.__name__}",
                                    validate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_checks([spec], checks=[THREADS], strategies=("model_level",),
                          include_global=False, impl=impl)


def test_a_pipeline_that_cannot_serve_two_threads_itself_is_not_blamed_on_the_offloader():
    pytest.importorskip("diffusers")
    from offload_ref.fixtures.diffusers_dit import SD3_SPEC

    (result,) = _results(SD3_SPEC)
    assert result.outcome == "not_applicable", (result.outcome, result.message)
    assert "the pipeline cannot serve two concurrent generations itself" in result.message
    assert "IndexError" in result.message  # what went wrong with no offloader


def test_an_offloader_serving_two_threads_on_a_pipeline_that_can_passes():
    (result,) = _results(get_spec("flux2"))
    assert result.outcome == "passed", (result.outcome, result.message)


def test_an_offloader_that_breaks_the_first_thread_is_named_at_fault():
    """The pipeline alone serves the two calls exactly, so a failure is the offloader's, and the
    verdict says so (an outside engine author's layerwise offloader unbound the first thread's
    block from the second thread: the diagnosis could not reproduce it with one thread and
    named no party)."""
    from offload_ref.contracts.mutants import MUTANTS

    mutant = next(m for m in MUTANTS if m.name == "concurrent_calls_unguarded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (result,) = run_checks([get_spec("flux2")], checks=[THREADS], strategies=("layer_wise",),
                               include_global=False, impl=mutant.impl)
    assert result.outcome in ("failed", "error"), (result.outcome, result.message)
    assert (f"at fault: the offloader {mutant.impl.name}: the pipeline alone, with no "
            "offloader, served the same two calls exactly") in result.message, result.message


def test_an_offloaders_own_failure_on_a_pipeline_that_cannot_serve_two_threads_is_not_excused():
    """An outside re-review: the first version excused any failure once the pipeline alone
    failed too; an offloader answering the second call with "slot 0 busy" went wrong another
    way than the pipeline does (its first thread's IndexError) and is at fault."""
    pytest.importorskip("diffusers")
    from offload_ref.fixtures.diffusers_dit import SD3_SPEC

    (result,) = _results(SD3_SPEC, _UnclearRefusal)
    assert result.outcome == "failed", (result.outcome, result.message)
    assert "does not say it is a concurrent call: RuntimeError: slot 0 busy" in result.message
    assert "at fault: the offloader tests:_UnclearRefusal: the pipeline alone, with no " \
           "offloader, goes wrong another way" in result.message, result.message
