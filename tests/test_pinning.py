"""The page layout behind CudaPlatform's exact pinning, checked without a GPU."""

from __future__ import annotations

import pytest
import torch

from offload_ref.platform.cuda import page_aligned_buffer


@pytest.mark.parametrize("numel,dtype", [(1, torch.float64), (3, torch.float32),
                                         (1024, torch.float32), (5000, torch.bfloat16),
                                         (4097, torch.uint8)])
def test_pinned_range_is_whole_private_pages(numel: int, dtype: torch.dtype) -> None:
    page = 4096
    tensor, start, span = page_aligned_buffer(numel, dtype, page)
    nbytes = numel * tensor.element_size()
    assert tensor.numel() == numel and tensor.dtype == dtype
    assert start == tensor.data_ptr() and start % page == 0
    assert span % page == 0 and nbytes <= span < nbytes + page  # rounded to a page, no more
    backing = tensor.untyped_storage()
    assert backing.data_ptr() <= start and start + span <= backing.data_ptr() + backing.nbytes()
    tensor.fill_(1)  # usable memory
    assert bool((tensor == 1).all())
