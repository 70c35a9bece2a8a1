"""Data-parallel waves: each rank runs its own request, all ranks in lockstep.

Note [Waves]
    In distributed layerwise offload every DiT block call is a collective (the ranks AllGather
    the block's weight shards), so all ranks must make the same block calls in the same order.
    Running a different request on each rank (different prompts, seeds) is fine as long as the
    *sequence* of DiT calls is the same.  A *wave* is one request per rank, started together.

    The step count decides how many DiT calls a generation makes, and pipelines have their own
    default for it, so every request of a wave must state the same explicit step count
    (``num_inference_steps``, an int >= 1).  Before calling the pipeline the ranks exchange their
    values through a :class:`~offload_ref.distributed.rendezvous.Rendezvous` (topic "wave");
    if a value is missing or invalid on any rank, or they differ, EVERY rank raises
    :class:`WaveMismatchError` -- before any collective, and without calling the pipeline.  A
    rank whose own request is invalid still publishes it (rather than raising alone, which would
    leave the others waiting).

    Limitations: only the step count is compared.  Any other input that changes the number or
    the order of DiT calls must also be equal across a wave, and is not checked: classifier-free
    guidance on for one request and off for another (a guidance scale of 1 skips the
    unconditional pass in many pipelines), a step at which a pipeline switches experts or stops
    guidance, an image input that adds an encoder pass, a different resolution or frame count
    where it changes the token count the AllGather'd blocks see, early stopping.  And a rank whose
    pipeline raises mid-wave leaves the others in a collective: that is for the backend's
    collectives (their timeout) to handle, not for this check.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from .rendezvous import Rendezvous

__all__ = ["WAVE_TOPIC", "WaveMismatchError", "WaveRunner", "run_wave"]

WAVE_TOPIC = "wave"
_MISSING = "missing"


class WaveMismatchError(ValueError):
    """The requests of a wave do not state one common step count.

    ``steps``: rank -> its step value (an int), ``"missing"`` (key absent or None) or
    ``"invalid: <repr>"`` (a bool, a non-int, or an int < 1).
    """

    def __init__(self, message: str, steps: dict[int, object], *, key: str = "") -> None:
        super().__init__(message)
        self.steps = dict(sorted(steps.items()))
        self.key = key

    def __reduce__(self):
        return (_rebuild, (str(self), self.steps, self.key))


def _rebuild(message: str, steps: dict[int, object], key: str) -> WaveMismatchError:
    return WaveMismatchError(message, steps, key=key)


def _encode_steps(request: Mapping[str, Any], key: str) -> str:
    """This rank's step value as published: "int:<n>", "missing" or "invalid:<repr>"."""
    if key not in request or request[key] is None:
        return _MISSING
    value = request[key]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
        return f"int:{int(value)}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"invalid:{type(value).__name__} {text}"


def _decode_steps(published: str) -> object:
    if published.startswith("int:"):
        return int(published[len("int:"):])
    if published.startswith("invalid:"):
        return "invalid: " + published[len("invalid:"):]
    return _MISSING


class WaveRunner:
    """Runs this rank's request of each wave, after the ranks agreed on the step count.

    ``pipeline(**request)`` is called with the request as given; ``steps_key`` names the step
    count's keyword.  ``rendezvous=None``: :meth:`Rendezvous.default` when torch.distributed is
    initialized (looked up at each :meth:`run`), otherwise a world of 1, where only this rank's
    own request is checked.  See Note [Waves] for the rules and the limitations: any other input
    that changes the number or order of DiT calls (classifier-free guidance on for one request and
    off for another, ...) must also be equal across a wave, and is not checked here.
    """

    def __init__(self, pipeline: Any, *, rendezvous: Rendezvous | None = None,
                 steps_key: str = "num_inference_steps") -> None:
        if not callable(pipeline):
            raise TypeError(f"WaveRunner: pipeline must be callable, got {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.rendezvous = rendezvous
        self.steps_key = steps_key

    def _rendezvous(self) -> Rendezvous:
        if self.rendezvous is not None:
            return self.rendezvous
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Rendezvous.default()
        return Rendezvous(None, 0, 1)

    def check(self, request: Mapping[str, Any]) -> int:
        """The wave's common step count, agreed with every rank (raises
        :class:`WaveMismatchError` on every rank otherwise).  :meth:`run` calls it."""
        if not isinstance(request, Mapping):
            raise TypeError(f"WaveRunner: a request is a mapping of keyword arguments, "
                            f"got {type(request).__name__}")
        rendezvous = self._rendezvous()
        published = rendezvous.exchange(WAVE_TOPIC, _encode_steps(request, self.steps_key))
        steps = {r: _decode_steps(v) for r, v in enumerate(published)}
        values = set(steps.values())
        if len(values) == 1 and isinstance(next(iter(values)), int):
            return next(iter(values))
        raise WaveMismatchError(self._message(steps, rendezvous), steps, key=self.steps_key)

    def run(self, request: Mapping[str, Any]) -> Any:
        """``pipeline(**request)``, once every rank's request states the same step count."""
        self.check(request)
        return self.pipeline(**request)

    def fail(self, reason: str) -> None:
        """This rank has no request for the wave (or cannot run it): the other ranks' :meth:`run`
        raises :class:`~offload_ref.distributed.rendezvous.RankFailedError` naming this rank and
        ``reason`` at once, instead of waiting for it until the rendezvous timeout."""
        self._rendezvous().fail(WAVE_TOPIC, reason)

    def _message(self, steps: dict[int, object], rendezvous: Rendezvous) -> str:
        key = self.steps_key
        ints = [v for v in steps.values() if isinstance(v, int)]
        listed = ", ".join(f"rank {r}: {v}" for r, v in steps.items())
        bad = [r for r, v in steps.items() if not isinstance(v, int)]
        if bad:
            problem = (f"{', '.join(f'rank {r}' for r in bad)} did not state a valid {key} "
                       f"(an int >= 1)")
        else:
            problem = f"the ranks' {key} differ"
        example = max(set(ints), key=ints.count) if ints else 20
        fix = (f"pass the same explicit {key}=<int> in every rank's request of a wave (e.g. "
               f"{key}={example}), or run requests with other step counts in another wave")
        where = (f"seen by rank {rendezvous.rank} of {rendezvous.world}"
                 if rendezvous.world > 1 else "single process")
        return (f"wave rejected before any collective ({where}): {problem}; {listed}. Every DiT "
                f"block call of a wave is a collective that all ranks must issue in the same "
                f"order, so the step count must be equal. Fix: {fix}. The pipeline was not called.")


def run_wave(pipeline: Any, request: Mapping[str, Any], *, rendezvous: Rendezvous | None = None,
             steps_key: str = "num_inference_steps") -> Any:
    """One wave: ``WaveRunner(pipeline, ...).run(request)``."""
    return WaveRunner(pipeline, rendezvous=rendezvous, steps_key=steps_key).run(request)
