"""The pinned staging pool's cost and effect on an mmap-loaded DiT (docs/distributed.md, "Pinned
staging"; docs/mmap-loading.md): the 64-block test DiT of ``tests/test_staging.py`` loaded from a
safetensors file, streamed rank-local for one forward through a pool of 0, 2 and 4 slots, in a
fresh rank each (``run_ranks``).  Prints RssAnon growth (bytes and % of the weights), staging hits
and misses, and the time fills waited for staging.

    python ci/staging_rss.py
"""

from __future__ import annotations

import os
import tempfile


def main() -> None:
    from offload_ref.distributed import _backend_selftest as st
    from offload_ref.distributed import run_ranks

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "dit.safetensors")
        warm = os.path.join(folder, "warm.safetensors")
        st.save_mmap_twin(path)
        st.save_mmap_twin(warm, 2)
        for slots in (0, 2, 4):
            [obs] = run_ranks(st.mmap_rss, 1, args=(path, warm, True, slots), timeout_s=120.0)
            stats, weights = obs["stats"], obs["weight_bytes"]
            print(f"staging slots {slots}: RssAnon +{obs['mmap_growth'] / 1e6:.2f} MB "
                  f"({100 * obs['mmap_growth'] / weights:.2f}% of {weights / 1e6:.1f} MB of "
                  f"weights); pool {stats['staging_pool_bytes'] / 1e6:.2f} MB, "
                  f"{stats['staging_hits']} hits, {stats['staging_misses']} misses, fills waited "
                  f"{stats['staging_wait_ns'] / 1e6:.2f} ms")


if __name__ == "__main__":
    main()
