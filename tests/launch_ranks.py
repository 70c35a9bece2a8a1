"""Rank functions of tests/test_launch_ranks.py: importable, so spawned ranks can run them."""

from __future__ import annotations


def peers_up_at_start(rank: int, world: int) -> list[bool]:
    """Which ranks had returned from init_process_group when this rank's function started, by
    the keys run_ranks sets on the store (Note [Every rank is up before any leaves])."""
    import torch.distributed.distributed_c10d as c10d

    store = c10d._get_default_store()
    while isinstance(store, c10d.PrefixStore):  # the group's view of run_ranks' FileStore
        store = store.underlying_store
    return [store.check([f"offload_ref/up/{r}"]) for r in range(world)]


def setting_seen(rank: int, world: int, name: str) -> dict:
    """What a rank sees of its parent's setting at the call (Note [Forked from a server]): the
    environment variable ``name``, its parent process and its working folder; it also writes a
    line to its stdout and one to its stderr."""
    import os
    import sys

    print(f"rank {rank} writes to stdout", flush=True)
    print(f"rank {rank} writes to stderr", file=sys.stderr, flush=True)
    return {"value": os.environ.get(name), "parent": os.getppid(), "cwd": os.getcwd()}


def hang(rank: int, world: int) -> None:
    """Every rank sleeps past any deadline."""
    import time

    time.sleep(3600)
