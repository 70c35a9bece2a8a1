"""What reading an mmap-loaded safetensors tensor costs in anonymous and file-backed memory
(docs/mmap-loading.md): a 64 MiB fp32 tensor saved, its file read into the page cache, then
opened with ``safe_open`` and ``get_tensor``, every element read, and one in-place write.  Prints
the growth of ``RssAnon`` and ``RssFile`` (``/proc/self/status``, Linux) after each step.

    python ci/mmap_rss.py
"""

from __future__ import annotations

import os
import tempfile


def _rss() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, kib, _ = line.split()
                out[key[:-1]] = int(kib) / 1024
    return out


def main() -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.safetensors")
        save_file({"w": torch.randn(16 * 1024 * 1024)}, path)  # 64 MiB of fp32
        with open(path, "rb") as f:  # into the page cache, as a file served before
            while f.read(1 << 24):
                pass
        before = _rss()
        tensor = safe_open(path, "pt").get_tensor("w")
        steps = [("get_tensor", lambda: None), ("read every element (t.sum())", tensor.sum),
                 ("write to it in place (t.mul_(...))", lambda: tensor.mul_(1.0001))]
        print(f"torch {torch.__version__}; RssAnon / RssFile growth from before get_tensor, MiB")
        for name, step in steps:
            step()
            now = _rss()
            print(f"{name:36s} RssAnon {now['RssAnon'] - before['RssAnon']:+8.2f}   "
                  f"RssFile {now['RssFile'] - before['RssFile']:+8.1f}")


if __name__ == "__main__":
    main()
