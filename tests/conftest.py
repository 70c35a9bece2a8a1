"""Session settings for the project's own tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread():
    """The fixture pipelines are tiny: intra-op thread hand-offs would dominate their run time
    (about 40x on a 2-core machine).  Restored at the end of the session."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_configure(config):
    """Load the simulated accelerator before anything asks torch for its accelerator (torch looks
    its HPU hooks up once per process), so every check runs where host and device differ."""
    import os

    from offload_ref.platform import simulated

    # pytester's subprocesses run with HOME in their temporary folder: without the cache folder
    # named, each would build the simulated accelerator anew (35-45 s a test)
    os.environ.setdefault("OFFLOAD_REF_SIM_CACHE", str(simulated._cache_dir().parent))
    simulated.available()
    # The catalogue's modules, imported once and for the whole session: an in-process pytester
    # run (tests/test_kit_pytest.py) drops the modules it imported first when it ends, so a
    # check module first imported there was imported anew by a later test, and registering its
    # checks again replaced catalogue entries that test had patched (tests/test_kit_report.py's
    # more_blocks_needed: its cases then ran as the unpatched checks, under pytest-xdist only).
    from offload_ref.contracts.runner import load_catalogue

    load_catalogue()


def pytest_report_header(config):
    from offload_ref.platform import simulated

    reason = simulated.unavailable_reason()
    if reason is None:
        return ["offload-ref: device storage on hpu:0 (offload-ref's simulated accelerator); "
                "placement checks are on"]
    return [f"offload-ref: PLACEMENT CHECKS ARE OFF: the simulated accelerator is not available "
            f"({reason}); host and device are both the CPU"]
