"""What the ``offload-ref`` subcommands share: the arguments that select pipelines
(``--pipeline``, ``MODULE:ATTR``, ``--spec``, ``--inputs``, ``--name``) and the usage error.

Its own module so that a subcommand defined outside ``cli.py`` (``trace.py``) can
use it without importing ``cli.py``, which imports that subcommand.
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from collections.abc import Sequence
from typing import Any

__all__: list[str] = []


class _UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


def _closest(value: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _escaped(what: str, exc: BaseException) -> BaseException:
    """A SystemExit (or another BaseException) raised while a reference was loaded: a usage
    error naming it, never a silent exit (Note [Escaping exceptions] in contracts/escapes.py);
    the user's own Ctrl-C is returned as it is, to be raised again."""
    from offload_ref.contracts.escapes import describe, is_users_interrupt

    if is_users_interrupt(exc):
        return exc
    return _UsageError(f"{what}: loading it raised {describe(exc)}; fix the module")


def _selection(args: argparse.Namespace) -> tuple[list[Any], dict[Any, str]]:
    """The specs the arguments select, and for each the arguments that select it again (its
    reproduction lines use them)."""
    from offload_ref.contracts.refs import RefError, resolve, specs_from
    from offload_ref.contracts.spec import PipelineSpec
    from offload_ref.fixtures import SPECS, get_spec

    fixtures = [spec.name for spec in SPECS]
    specs: list[Any] = []
    sources: dict[Any, str] = {}
    for name in args.pipeline:
        if name not in fixtures:
            raise _UsageError(f"--pipeline {name!r}: no built-in fixture of that name"
                              f"{_closest(name, fixtures)} (fixtures: {', '.join(fixtures)}; "
                              f"your own pipeline goes in MODULE:ATTR)")
        specs.append(get_spec(name))
        sources[specs[-1]] = f"--pipeline {shlex.quote(name)}"
    if args.inputs:
        try:
            resolve(args.inputs)
        except RefError as exc:
            raise _UsageError(f"--inputs {exc}") from None
        except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
            raise _escaped(f"--inputs {args.inputs!r}", exc) from None
    any_factory = False
    for flag, ref in [("", r) for r in args.refs] + [("--spec ", r) for r in args.spec]:
        try:
            obj = resolve(ref)
            loaded = specs_from(ref, obj, inputs=args.inputs, strategies=args.strategy or None)
        except RefError as exc:
            raise _UsageError(f"{flag or 'MODULE:ATTR '}{exc}") from None
        except BaseException as exc:  # noqa: BLE001 - Note [Escaping exceptions]
            raise _escaped(f"{flag or 'MODULE:ATTR '}{ref!r}", exc) from None
        factory = not isinstance(obj, (PipelineSpec, list, tuple))
        any_factory |= factory
        source = f"{flag}{shlex.quote(ref)}"
        if factory and args.inputs:
            source += f" --inputs {shlex.quote(args.inputs)}"
        for spec in loaded:
            specs.append(spec)
            sources[spec] = (f"{source} --name {shlex.quote(spec.name)}"
                             if isinstance(obj, (list, tuple)) else source)
    if args.inputs and not any_factory:
        raise _UsageError(f"--inputs {args.inputs!r}: applies to a factory reference only (a "
                          f"PipelineSpec carries its own inputs); drop --inputs or name a factory")
    if not args.pipeline and not args.refs and not args.spec:
        specs = list(SPECS)
    if args.name:
        names = sorted({spec.name for spec in specs})
        for name in args.name:
            if name not in names:
                raise _UsageError(f"--name {name!r}: no selected pipeline has that name"
                                  f"{_closest(name, names)} (selected: {', '.join(names)})")
        specs = [spec for spec in specs if spec.name in args.name]
    return specs, sources
