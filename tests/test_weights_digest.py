"""The cross-rank weight check of AllGather rings (``weights_digest``).  Before, it was the int32
sum of a block's bytes: an outside review's rank with ``to_q`` and ``to_k`` swapped, a weight
transposed, or two compensating one-ulp edits enabled fine and computed wrong outputs."""

from __future__ import annotations

import torch

from offload_ref.backends.distributed import weights_digest


def _image(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def test_the_digest_sees_swaps_transposes_and_compensating_edits() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    base = weights_digest(_image(q, k))
    assert weights_digest(_image(q.clone(), k.clone())) == base
    assert weights_digest(_image(k, q)) != base  # to_q / to_k swapped
    assert weights_digest(_image(q.t(), k)) != base  # a transposed weight
    words = _image(q, k).view(torch.int32).clone()
    words[3] += 1
    words[10] -= 1  # the plain sum is unchanged
    assert int(words.sum()) == int(_image(q, k).view(torch.int32).sum())
    assert weights_digest(words.view(torch.uint8)) != base


def test_the_digest_does_not_depend_on_its_chunking() -> None:
    image = _image(torch.randn(1000))
    assert weights_digest(image, chunk=7) == weights_digest(image, chunk=1 << 20)
