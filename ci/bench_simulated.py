"""What the simulated accelerator costs, in one run (ratios: these machines are shared and noisy).

    python ci/bench_simulated.py            # load time from the build cache, per-op overhead
    python ci/bench_simulated.py --cold     # also a cold compile, in a fresh cache folder

Prints a table: the median time of each workload on the CPU and on ``hpu:0`` (the same bytes,
CPU's kernels through the extension's dispatch fallback), and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _load_seconds(cache: str | None) -> float:
    env = dict(os.environ)
    if cache is not None:
        env["OFFLOAD_REF_SIM_CACHE"] = cache
    code = ("import time, torch; from offload_ref.platform import simulated; t = time.perf_counter();"
            " simulated.load(); print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _median(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="also time a cold compile")
    args = parser.parse_args()
    if args.cold:
        with tempfile.TemporaryDirectory() as cache:
            cold = _load_seconds(cache)
            cached = _load_seconds(cache)
        print(f"compile + load, cold cache: {cold:.1f} s; load from the cache: {cached:.2f} s")
    else:
        print(f"load from the cache: {_load_seconds(None):.2f} s")

    import torch

    from offload_ref.contracts.case import move_to_device
    from offload_ref.fixtures import get_spec
    from offload_ref.platform import simulated

    simulated.load()
    torch.set_num_threads(1)
    dev = torch.device("hpu", 0)
    small = torch.randn(8)
    mat = torch.randn(256, 256)
    big = torch.randn(4 << 20)  # 16 MiB
    big_dev = torch.empty_like(big, device=dev)
    big_host = torch.empty_like(big)
    spec = get_spec("sd3")
    host_pipe, dev_pipe = spec.build(), move_to_device(spec.build(), dev)
    inputs = spec.make_inputs()

    def generation(pipe):
        with torch.inference_mode():
            pipe(**inputs)

    rows = [
        ("tiny add (per-op overhead)", lambda: small + small, lambda: small_d + small_d, 2000),
        ("matmul 256x256", lambda: mat @ mat, lambda: mat_d @ mat_d, 200),
        ("16 MiB copy (host->host vs host->device)", lambda: big_host.copy_(big),
         lambda: big_dev.copy_(big), 50),
        ("sd3 fixture generation (whole pipeline)", lambda: generation(host_pipe),
         lambda: generation(dev_pipe), 20),
    ]
    small_d, mat_d = small.to(dev), mat.to(dev)
    print(f"{'workload':<44} {'cpu':>12} {'hpu:0':>12} {'ratio':>7}")
    for name, on_cpu, on_dev, repeat in rows:
        a, b = _median(on_cpu, repeat), _median(on_dev, repeat)
        print(f"{name:<44} {a * 1e6:>10.1f}us {b * 1e6:>10.1f}us {b / a:>6.2f}x")
    print(f"per-op overhead (tiny add): {(_median(lambda: small_d + small_d, 2000) - _median(lambda: small + small, 2000)) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
