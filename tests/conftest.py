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
