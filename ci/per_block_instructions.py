"""Instructions per block of layerwise host overhead, counted by valgrind's callgrind.

Wall-clock figures of a few microseconds per block move by 2x on a shared machine from one run
to the next; instruction counts do not (they vary by well under 1 % between runs).  This script
runs the many-blocks DiT (``offload_ref.fixtures.many_blocks``: 64 x ``nn.Linear(8, 8)``) under
callgrind with instrumentation switched on only around ``--forwards`` warm forwards, once per
variant, and prints the instructions per block above the resident model:

* ``hooks``: no-op forward pre- and post-hooks on every block and a no-op pre-hook on its
  ``nn.Linear`` (what torch's hook dispatch alone costs for the hooks layerwise installs);
* ``floor``: those hooks doing only the work no layerwise offloader with offload-ref's guarantees
  can skip (Note [Per-block floor] in ``offload_ref/bench_floor.py``: one copy, four rebinds,
  the guarded parameter class); layerwise's count above it is its own bookkeeping;
* ``layerwise``: offload-ref layerwise on the inline-stream platform (Note [Per-block overhead]
  in ``offload_ref/bench.py``), or with ``--device hpu:0`` on the accelerator platform over the
  simulated accelerator (the code a GPU runs; the resident model there too, stream checking
  off as in ``offload-ref bench --peers``);
* with ``--peers`` (needs ``--device``): ``diffusers_group_offload_block`` and
  ``accelerate_cpu_offload`` (``offload_ref.peers``, copying to the same device), the peers of
  ``offload-ref bench --peers`` counted the same way.

Usage: ``python ci/per_block_instructions.py [--forwards N] [--device hpu:0 [--peers]]`` (needs
``valgrind`` on PATH; about a minute per variant).  Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

BLOCKS = 64
VARIANTS = ("resident", "hooks", "floor", "layerwise")
PEERS = ("diffusers_group_offload_block", "accelerate_cpu_offload")


def _child(variant: str, forwards: int, device: str | None) -> None:
    import contextlib

    import torch

    checking = contextlib.nullcontext()
    if device is not None:
        from offload_ref.platform import simulated

        simulated.load()  # before torch is asked for its accelerator
        checking = simulated.stream_checking(False)
    torch.set_num_threads(1)
    from offload_ref.backends.layerwise import LayerWiseOffloadBackend
    from offload_ref.config import OffloadConfig, OffloadStrategy
    from offload_ref.contracts.case import move_to_device
    from offload_ref.fixtures.many_blocks import build_pipeline, make_input
    from offload_ref.platform import get_platform
    from offload_ref.platform.inline import InlinePlatform

    pipe = build_pipeline(0, BLOCKS)
    x = make_input(0)
    if device is not None:
        x = x.to(device)
        if variant in ("resident", "hooks"):
            pipe = move_to_device(pipe, torch.device(device))
    backend = None
    if variant == "hooks":
        def pre(module, args, kwargs):
            return None

        def post(module, args, kwargs, output):
            return None

        for block in pipe.transformer.blocks:
            block.register_forward_pre_hook(pre, with_kwargs=True)
            block.register_forward_hook(post, with_kwargs=True, always_call=True)
            block.fc.register_forward_pre_hook(pre, with_kwargs=True)
    elif variant == "floor":
        from offload_ref.bench_floor import floor_hooks

        floor_hooks(list(pipe.transformer.blocks))
    elif variant in PEERS:
        from offload_ref import peers

        backend = getattr(peers, variant)(torch.device(device), "layer_wise")
        backend.enable(pipe)
    elif variant == "layerwise":
        platform = InlinePlatform(device="cpu") if device is None else get_platform(device)
        backend = LayerWiseOffloadBackend(OffloadConfig(strategy=OffloadStrategy.LAYER_WISE),
                                          platform)
        backend.enable(pipe)
    control = ["callgrind_control", "-i"]
    with checking, torch.inference_mode():
        for _ in range(5):
            pipe.transformer(x)
        subprocess.run([*control, "on", str(os.getpid())], check=True, capture_output=True)
        for _ in range(forwards):
            pipe.transformer(x)
        subprocess.run([*control, "off", str(os.getpid())], check=True, capture_output=True)
    if backend is not None:
        backend.disable()


def _count(variant: str, forwards: int, device: str | None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={os.path.join(tmp, 'out')}",
               sys.executable, __file__, "--child", variant, "--forwards", str(forwards)]
        if device is not None:
            cmd += ["--device", device]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{variant}: valgrind failed:\n{run.stderr[-2000:]}")
        found = re.search(r"Collected : (\d+)", run.stderr)
        if found is None:
            raise SystemExit(f"{variant}: no instruction count in valgrind's output")
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=30)
    parser.add_argument("--device", default=None,
                        help="hpu:0: the accelerator platform over the simulated accelerator "
                             "(default: the inline platform on the host)")
    parser.add_argument("--peers", action="store_true",
                        help="also count diffusers block-level group offloading and accelerate's "
                             "cpu_offload (with --device)")
    parser.add_argument("--child", choices=VARIANTS + PEERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.forwards, args.device)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind (with callgrind_control) is not on PATH")
    if args.peers and args.device is None:
        raise SystemExit("--peers needs --device (the peers copy to a device)")
    variants = VARIANTS + (PEERS if args.peers else ())
    per_forward = {v: _count(v, args.forwards, args.device) / args.forwards for v in variants}
    base = per_forward["resident"]
    print(f"{'variant':<30} {'instructions / forward':>24} {'over resident / block':>22}")
    for v in variants:
        print(f"{v:<30} {per_forward[v]:>24,.0f} {(per_forward[v] - base) / BLOCKS:>22,.0f}")


if __name__ == "__main__":
    main()
