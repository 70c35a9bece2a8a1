"""The offloader protocol: how the kit judges any offloader, not only offload-ref's backends.

An offloader under test is named by a *factory*, ``MODULE:ATTR``, called as
``factory(device, strategy)`` with the device the kit computes on (:func:`~.case.kit_device`)
and ``strategy`` one of :data:`STRATEGIES`.  It returns an object with vLLM-Omni's
``OffloadBackend`` lifecycle:

* ``enable(pipeline)``: install offloading on ``pipeline`` (a plain object or an ``nn.Module``);
  raising ``NotImplementedError`` says "this offloader does not serve this pipeline" (its API
  refuses it), and the case is reported not applicable with that text;
* ``disable()``: remove it, leaving the pipeline as it was built;
* ``is_enabled() -> bool``.

The device is ``hpu:0`` (or the CPU in single-device mode) for every check but
``check_offloader_keeps_to_the_device_index_it_was_given``, which calls the factory with
``hpu:1`` and fails an offloader that puts a tensor on another device than the one it was given
(the bare device type, or index 0).

A factory that does not offer a strategy raises ``NotImplementedError`` when called with it:
that strategy's cases are not applicable, with the reason.  A bad reference, a factory with the
wrong signature, or an object missing a method is an :class:`OffloaderError` (one line) before
any check runs.

Which checks judge such an offloader is decided by :mod:`.capabilities` alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .capabilities import PROTOCOL
from .case import Implementation, kit_device
from .escapes import describe, is_users_interrupt, raised_by
from .registry import CheckNotApplicable

__all__ = ["METHODS", "Offloader", "OffloaderError", "OffloaderRefusal", "ProtocolBackend",
           "STRATEGIES", "load_offloader", "offloader_implementation"]

#: The strategies a factory is asked for.
STRATEGIES = ("model_level", "layer_wise")
#: What the object a factory returns must have.
METHODS = ("enable", "disable", "is_enabled")
_NO_DLO = ("the offloader protocol has no distributed strategy (offload-ref's own is judged by "
           "§H)")


@runtime_checkable
class Offloader(Protocol):
    """What ``factory(device, strategy)`` returns."""

    def enable(self, pipeline: Any) -> None: ...

    def disable(self) -> None: ...

    def is_enabled(self) -> bool: ...


class OffloaderError(ValueError):
    """An offloader the kit cannot use: the message is one line naming the reference and the fix."""


class OffloaderRefusal(CheckNotApplicable):
    """``enable()`` raised ``NotImplementedError``: the offloader does not serve this pipeline."""


class ProtocolBackend:
    """An offloader behind the protocol, driven by the checks as they drive a backend: exactly
    ``enable``, ``disable`` and ``is_enabled`` (no ``plan``, no ``stats()``)."""

    plan = None

    def __init__(self, offloader: Any, name: str, strategy: str) -> None:
        self.offloader, self.name, self.strategy = offloader, name, strategy

    def enable(self, pipeline: Any) -> None:
        from .blame import hooks_of, named_modules
        from .streams import note_offloader

        before = {id(m): set(hooks_of(m)) for _, m in named_modules(pipeline)}
        note_offloader(self.offloader)
        try:
            self.offloader.enable(pipeline)
        except NotImplementedError as exc:
            raise OffloaderRefusal(
                f"{self.name} does not offload {type(pipeline).__name__} under {self.strategy}: "
                f"{exc or 'NotImplementedError'}") from exc
        except BaseException as exc:
            _mark(exc, f"the offloader {self.name}'s enable()")
            raise
        # the code of the hooks it added is the offloader's (a stream race's party: blame.py)
        note_offloader(*(hook for _, m in named_modules(pipeline)
                         for key, hook in hooks_of(m).items()
                         if key not in before.get(id(m), ())))

    def disable(self) -> None:
        try:
            self.offloader.disable()
        except BaseException as exc:
            _mark(exc, f"the offloader {self.name}'s disable()")
            raise

    def is_enabled(self) -> bool:
        try:
            value = self.offloader.is_enabled()
        except BaseException as exc:
            _mark(exc, f"the offloader {self.name}'s is_enabled()")
            raise
        if not isinstance(value, bool):
            raise TypeError(f"{self.name}: is_enabled() returned {value!r} "
                            f"({type(value).__name__}), not a bool")
        return value

    def __repr__(self) -> str:
        return f"ProtocolBackend({self.name}, {self.strategy})"


def _mark(exc: BaseException, who: str) -> None:
    """Name the party of a ``BaseException`` that is no ``Exception`` (``SystemExit``, a
    ``KeyboardInterrupt`` the code raised itself, ...) escaping the offloader's code: the runner
    reports it as an error of the case, naming ``who`` (Note [Escaping exceptions])."""
    if not isinstance(exc, Exception) and not is_users_interrupt(exc):
        raised_by(exc, who)


@dataclass(frozen=True)
class _Backends:
    """``Implementation.make_backend`` for a factory: a fresh offloader per backend."""

    factory: Callable[..., Any]
    name: str
    #: None: the kit's device when the backend is made (:func:`~.case.kit_device`: ``hpu:0``,
    #: or ``hpu:1`` for the checks that vary the device index, so that an offloader that ignores
    #: the index it is given is caught)
    device: torch.device | None

    def __call__(self, config: Any, platform: Any) -> ProtocolBackend:
        strategy = str(getattr(config.strategy, "value", config.strategy))
        device = self.device if self.device is not None else kit_device()
        try:
            offloader = self.factory(device, strategy)
        except BaseException as exc:
            _mark(exc, f"the offloader factory {self.name}({str(device)!r}, {strategy!r})")
            raise
        return ProtocolBackend(offloader, self.name, strategy)


def load_offloader(ref: str) -> Implementation:
    """The implementation ``MODULE:ATTR`` names (see the module docstring), validated."""
    from .refs import RefError, resolve

    try:
        factory = resolve(ref)
    except RefError as exc:
        raise OffloaderError(str(exc)) from None
    except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
        if is_users_interrupt(exc):
            raise
        raise OffloaderError(f"{ref!r}: importing its module raised {describe(exc)}; fix the "
                             "module") from None
    return offloader_implementation(factory, name=ref)


def offloader_implementation(factory: Callable[..., Any], name: str | None = None,
                             device: torch.device | None = None, *,
                             validate: bool = True) -> Implementation:
    """An :class:`~.case.Implementation` judging the offloaders ``factory`` makes through the
    protocol.  Calls the factory once per strategy to validate what it returns (``validate=False``:
    a factory known to be well-formed, not called until a check runs; the kit's mutants)."""
    name = name or getattr(factory, "__qualname__", repr(factory))
    if not validate:
        return Implementation(name=name, make_backend=_Backends(factory, name, device),
                              capabilities=PROTOCOL,
                              unsupported_strategies=(("distributed_layer_wise", _NO_DLO),))
    if not callable(factory):
        raise OffloaderError(f"{name!r} is a {type(factory).__name__}, not a factory: expected a "
                             "callable factory(device, strategy) returning an object with "
                             "enable(pipeline), disable() and is_enabled()")
    given, device = device, device if device is not None else kit_device()
    try:
        inspect.signature(factory).bind(device, STRATEGIES[0])
    except TypeError as exc:
        raise OffloaderError(f"{name!r} cannot be called as factory(device, strategy) ({exc}); "
                             "give it two positional parameters: the torch.device and the "
                             "strategy name") from None
    except ValueError:  # no signature (a builtin): calling it below says what it takes
        pass
    unsupported: dict[str, str] = {}
    for strategy in STRATEGIES:
        try:
            offloader = factory(device, strategy)
        except NotImplementedError as exc:
            unsupported[strategy] = (f"{name} does not offer {strategy}: "
                                     f"{exc or 'NotImplementedError'}")
            continue
        except Exception as exc:  # noqa: BLE001 - reported as the one usage error
            raise OffloaderError(f"{name}({device!s}, {strategy!r}) raised "
                                 f"{type(exc).__name__}: {exc}; a factory that does not offer a "
                                 "strategy raises NotImplementedError") from None
        except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
            if is_users_interrupt(exc):
                raise
            raise OffloaderError(
                f"{name}({device!s}, {strategy!r}), called to validate the factory before any "
                f"case ran, raised {describe(exc)}; a factory returns an "
                "offloader, raises NotImplementedError for a strategy it does not offer, or "
                "raises an Exception") from None
        missing = [m for m in METHODS if not callable(getattr(offloader, m, None))]
        if missing:
            raise OffloaderError(
                f"{name}({device!s}, {strategy!r}) returned a {type(offloader).__name__} "
                f"without {', '.join(f'{m}()' for m in missing)}; the protocol needs "
                "enable(pipeline), disable() and is_enabled()")
    if len(unsupported) == len(STRATEGIES):
        raise OffloaderError(f"{name} offers no strategy: {'; '.join(unsupported.values())}")
    unsupported["distributed_layer_wise"] = _NO_DLO
    return Implementation(name=name, make_backend=_Backends(factory, name, given),
                          capabilities=PROTOCOL,
                          unsupported_strategies=tuple(sorted(unsupported.items())))
