"""What starting ranks costs: two-rank ``run_ranks`` calls of a trivial function, forked from the
fork server against spawned, interleaved in one run (docs/distributed-coordination.md#run_ranks).

    python3 ci/run_ranks_cost.py [--calls N]

Prints each start method's wall time per call (median and range, the fork server's first call
apart: it starts the server) and the CPU time the ranks used, read from their own clocks
(``time.process_time`` at the end of the rank function; a forked rank's clock starts at its
fork), with the machine's load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from offload_ref.distributed import _selftest, run_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5, help="calls per start method (default 5)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    first = time.perf_counter()
    run_ranks(_selftest.rank_cpu_seconds, 2, timeout_s=120.0)
    first = time.perf_counter() - first
    wall: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    rank_cpu: dict[str, list[float]] = {"forkserver": [], "spawn": []}
    for _ in range(args.calls):
        for method in wall:
            start = time.perf_counter()
            cpu = run_ranks(_selftest.rank_cpu_seconds, 2, timeout_s=120.0, start_method=method)
            wall[method].append(time.perf_counter() - start)
            rank_cpu[method].append(sum(cpu))
    print(f"load average (1 min) before: {load:.2f}, after: {os.getloadavg()[0]:.2f}")
    print(f"forkserver, first call (starts the server, imports torch there): {first:.2f} s")
    for method in wall:
        w = wall[method]
        print(f"{method:>10}: {statistics.median(w):.2f} s a call (min {min(w):.2f}, max "
              f"{max(w):.2f}, {len(w)} calls); the two ranks' CPU "
              f"{statistics.median(rank_cpu[method]):.2f} s a call (median)")
    ratio = statistics.median(wall["forkserver"]) / statistics.median(wall["spawn"])
    print(f"forkserver / spawn, wall: {ratio:.3f}x")


if __name__ == "__main__":
    main()
