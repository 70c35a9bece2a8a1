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


def pytest_report_header(config):
    from offload_ref.platform import simulated

    reason = simulated.unavailable_reason()
    if reason is None:
        return ["offload-ref: device storage on hpu:0 (offload-ref's simulated accelerator); "
                "placement checks are on"]
    return [f"offload-ref: PLACEMENT CHECKS ARE OFF: the simulated accelerator is not available "
            f"({reason}); host and device are both the CPU"]
