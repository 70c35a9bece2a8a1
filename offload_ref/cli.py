"""``offload-ref``: run the conformance kit, explain a plan, benchmark.

    offload-ref check [--pipeline NAME]... [--spec MODULE:ATTR]... [--check ID]...
                      [--strategy S]... [--list] [--json]
    offload-ref plan  --pipeline NAME [--strategy S]
    offload-ref bench [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _specs(args: argparse.Namespace) -> list[Any]:
    from offload_ref.contracts.spec import load_object
    from offload_ref.fixtures import SPECS, get_spec

    specs = [get_spec(name) for name in args.pipeline]
    for ref in args.spec:
        obj = load_object(ref) if ":" in ref else None
        specs.extend(obj if isinstance(obj, (list, tuple)) else [obj])
    if not args.pipeline and not args.spec:
        specs = list(SPECS)
    return specs


def _cmd_check(args: argparse.Namespace) -> int:
    from offload_ref.contracts.runner import iter_cases, load_catalogue, run_checks

    if args.list:
        for info in sorted(load_catalogue().values(), key=lambda i: (i.section, i.id)):
            print(f"§{info.section:<5} {info.id:<62} {info.title}")
        return 0
    import torch

    torch.set_num_threads(args.torch_threads)
    specs = _specs(args)
    include_global = not args.spec or bool(args.pipeline)
    checks = args.check or None
    strategies = args.strategy or None
    total = len(iter_cases(specs, checks=checks, strategies=strategies,
                           include_global=include_global))
    print(f"offload-ref check: {total} cases over {len(specs)} pipeline(s)", file=sys.stderr)
    results = run_checks(specs, checks=checks, strategies=strategies,
                         include_global=include_global)
    if args.json:
        print(json.dumps([{"check": r.id.check, "pipeline": r.id.spec, "strategy": r.id.strategy,
                           "outcome": r.outcome, "message": r.message,
                           "seconds": round(r.seconds, 4)} for r in results], indent=2))
    else:
        _print_table(results)
    return 0 if all(r.ok for r in results) else 1


def _print_table(results: Sequence[Any]) -> None:
    rows: dict[tuple[str, str], Counter] = {}
    for r in results:
        rows.setdefault((r.id.spec or "(global)", r.id.strategy or "-"), Counter())[r.outcome] += 1
    header = f"{'pipeline':<16} {'strategy':<24} {'passed':>6} {'failed':>6} {'error':>6}"
    print(header)
    print("-" * len(header))
    for (spec, strategy), counts in sorted(rows.items()):
        print(f"{spec:<16} {strategy:<24} {counts['passed'] + counts['xfailed']:>6} "
              f"{counts['failed'] + counts['xpassed']:>6} {counts['error']:>6}")
    bad = [r for r in results if not r.ok]
    passed = sum(r.ok for r in results)
    print("-" * len(header))
    for r in bad:
        print(f"\n{r.outcome.upper()} {r.id}\n  {r.message.strip()}\n  reproduce: {r.id.repro()}")
    print(f"\n{passed} passed, {len(bad)} failed")


def _cmd_plan(args: argparse.Namespace) -> int:
    from offload_ref.config import OffloadConfig
    from offload_ref.plan import resolve_offload_plan, selectable_components

    specs = _specs(args)
    strategies = args.strategy or None
    for spec in specs:
        for strategy in strategies or spec.strategies:
            pipeline = spec.build()
            components = selectable_components(pipeline, strategy)
            config = OffloadConfig(strategy=strategy, components=components)
            print(f"== {spec.name} ==")
            try:
                print(resolve_offload_plan(pipeline, config).describe())
            except ValueError as exc:
                print(f"rejected: {exc}")
            print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="offload-ref", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def selection(p: argparse.ArgumentParser) -> None:
        p.add_argument("--pipeline", action="append", default=[],
                       help="a built-in fixture name (default: all)")
        p.add_argument("--spec", action="append", default=[], metavar="MODULE:ATTR",
                       help="your own PipelineSpec (or list of specs)")
        p.add_argument("--strategy", action="append", default=[],
                       choices=["model_level", "layer_wise", "distributed_layer_wise"])

    p_check = sub.add_parser("check", help="run the conformance kit")
    selection(p_check)
    p_check.add_argument("--check", action="append", default=[], metavar="ID")
    p_check.add_argument("--list", action="store_true", help="list the check catalogue")
    p_check.add_argument("--json", action="store_true")
    p_check.add_argument("--torch-threads", type=int, default=1, metavar="N",
                         help="torch intra-op threads while checking (default 1: the built-in "
                              "pipelines are tiny, and thread hand-offs dominate their run time)")
    p_check.set_defaults(func=_cmd_check)

    p_plan = sub.add_parser("plan", help="explain the resolved topology of a pipeline")
    selection(p_plan)
    p_plan.set_defaults(func=_cmd_plan)

    from offload_ref.bench import add_bench_parser

    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
