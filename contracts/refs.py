"""Pipeline specs from ``"module:attr"`` references, as ``offload-ref check`` receives them.

A reference names a :class:`PipelineSpec`, a list or tuple of them, or a *factory*: a callable
that builds a pipeline and takes no arguments or a ``seed=`` parameter.  A factory becomes a spec
named after its attribute whose ``factory`` and ``inputs`` stay ``"module:attr"`` strings, so that
spawned ranks (catalogue §H) can rebuild it:

* a factory that takes ``seed=`` is used as it is;
* a factory without one is reached through :data:`without_seed`:
  ``"offload_ref.contracts.refs:without_seed.my_pkg.testing:build"`` calls ``build()`` under
  ``torch.manual_seed(seed)`` (the global RNG is restored afterwards), so two builds of one seed
  have equal weights;
* without inputs, the pipeline is called with no arguments (:func:`no_inputs`).

A reference that does not resolve raises :class:`RefError`, whose message is one line naming the
value and what to do about it.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .calling import RefError, call_seeded, call_unseeded, load_object, takes_seed
from .spec import PipelineSpec

__all__ = ["RefError", "call_seeded", "call_unseeded", "load_specs", "no_inputs", "resolve",
           "specs_from", "without_seed"]

DEFAULT_STRATEGIES = ("model_level", "layer_wise")


def import_from_the_current_folder() -> None:
    """Put the current folder first on ``sys.path`` (and on ``PYTHONPATH``, for the processes
    the kit spawns), as ``python -m`` does: ``offload-ref check mymodule:SPEC`` and
    ``--offload-ref-spec mymodule:SPEC`` then find ``mymodule.py`` where they are run."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *parts])


def resolve(ref: str) -> Any:
    """The object ``ref`` names, or :class:`RefError` saying why there is none."""
    if not isinstance(ref, str) or ":" not in ref:
        raise RefError(f"{ref!r} is not a reference: expected MODULE:ATTR, "
                       f"e.g. my_package.testing:SPEC")
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise RefError(f"{ref!r} is not a reference: expected MODULE:ATTR with both parts, "
                       f"e.g. my_package.testing:SPEC")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise RefError(f"{ref!r}: cannot import module {module_name!r} (no module named "
                       f"{missing!r}) from {os.getcwd()}; install the package, run from the folder that "
                       f"holds it, or put that folder on PYTHONPATH"
                       ) from None
    except Exception as exc:  # noqa: BLE001 - the author's module failed while importing
        raise RefError(f"{ref!r}: cannot import module {module_name!r}: importing it raised "
                       f"{type(exc).__name__}: {_one_line(exc)}") from None
    done: list[str] = []
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = f"{module_name}:{'.'.join(done)}" if done else f"module {module_name}"
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise RefError(f"{ref!r}: {where} has no attribute {part!r}{hint}") from None
        done.append(part)
    return obj


def load_specs(ref: str, *, inputs: str | None = None,
               strategies: Iterable[str] | None = None) -> list[PipelineSpec]:
    """The specs ``ref`` names.  A factory becomes one spec (see the module docstring) with
    ``inputs`` (a reference to ``inputs(seed=...)`` or to a callable taking no arguments) and
    ``strategies`` (default: model_level and layer_wise)."""
    return specs_from(ref, resolve(ref), inputs=inputs, strategies=strategies)


def specs_from(ref: str, obj: Any, *, inputs: str | None = None,
               strategies: Iterable[str] | None = None) -> list[PipelineSpec]:
    """:func:`load_specs` of ``obj``, the object ``ref`` names."""
    if isinstance(obj, PipelineSpec):
        return [obj]
    if isinstance(obj, (list, tuple)):
        bad = [type(o).__name__ for o in obj if not isinstance(o, PipelineSpec)]
        if bad or not obj:
            what = f"holds a {bad[0]}" if bad else "is empty"
            raise RefError(f"{ref!r} {what}: a list or tuple must hold PipelineSpec objects only")
        return list(obj)
    if callable(obj):
        return [_factory_spec(ref, obj, inputs, strategies)]
    raise RefError(f"{ref!r} is of type {type(obj).__name__}: expected a PipelineSpec, a list of "
                   f"them, or a factory (a callable taking no arguments or seed=)")


def _adapted(ref: str, func: Callable[..., Any]) -> str:
    return ref if takes_seed(func, ref) else f"{__name__}:without_seed.{ref}"


def _factory_spec(ref: str, factory: Callable[..., Any], inputs: str | None,
                  strategies: Iterable[str] | None) -> PipelineSpec:
    if inputs is None:
        inputs_ref = f"{__name__}:no_inputs"
    else:
        inputs_obj = resolve(inputs)
        if not callable(inputs_obj):
            raise RefError(f"{inputs!r} is of type {type(inputs_obj).__name__}: --inputs must "
                           f"name a callable returning the pipeline's keyword arguments")
        inputs_ref = _adapted(inputs, inputs_obj)
    return PipelineSpec(
        name=ref.rpartition(":")[2].rpartition(".")[2],
        factory=_adapted(ref, factory),
        inputs=inputs_ref,
        strategies=tuple(strategies or DEFAULT_STRATEGIES),
        description=f"factory {ref}",
    )


def no_inputs(seed: int = 0) -> Mapping[str, Any]:
    """The inputs of a pipeline called without arguments."""
    return {}


class _WithoutSeed:
    """``without_seed.<module>:<attr>``: the attribute path collects the reference (see the
    module docstring); calling it calls the referenced object with no arguments."""

    def __init__(self, ref: str = "") -> None:
        self._ref = ref

    def __getattr__(self, part: str) -> _WithoutSeed:
        if part.startswith("__"):
            raise AttributeError(part)
        return _WithoutSeed(f"{self._ref}.{part}" if self._ref else part)

    def __call__(self, seed: int = 0) -> Any:
        return call_unseeded(load_object(self._ref), seed)

    def __repr__(self) -> str:
        return f"{__name__}:without_seed.{self._ref}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_WithoutSeed, (self._ref,))


without_seed = _WithoutSeed()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
