"""What a backend reports: the bytes it holds and moves (``OffloadBackend.stats()``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadStats"]


@dataclass
class OffloadStats:
    """Bytes of one backend, counted since ``enable``.

    Weight counts never include alignment padding (Note [Aligned layout] in host.py); the
    ``*_padding_bytes`` fields hold it, so weight + padding is what the platform holds or copied.
    """

    host_bytes: int = 0  # host master weight bytes held
    pinned_bytes: int = 0  # host bytes page-locked for the masters (their padding included)
    device_weight_bytes: int = 0  # device bytes the backend holds for weights right now
    h2d_bytes: int = 0  # host -> device weight bytes moved during inference
    d2h_bytes: int = 0  # device -> host weight bytes moved during inference (always 0 here)
    swaps: int = 0  # component loads (model-level) or block materializations (layerwise)
    sync_recoveries: int = 0  # layerwise: blocks loaded synchronously (skipped or mispredicted)
    peak_device_weight_bytes: int = 0  # the most device_weight_bytes held at once
    host_padding_bytes: int = 0  # alignment padding inside the host masters
    device_padding_bytes: int = 0  # alignment padding inside the device buffers held now
    h2d_padding_bytes: int = 0  # padding copied along with h2d_bytes (whole flat buffers)
    peak_device_bytes: int = 0  # the most device bytes held at once, padding included
    file_backed_bytes: int = 0  # host weight bytes that are file pages (mmap-loaded), not copies
    collective_bytes: int = 0  # bytes written into slots by collectives (distributed AllGather)
    # Note [Pinned staging] (backends/staging.py): fills of file-backed blocks.
    staging_hits: int = 0  # the block was staged in advance
    staging_misses: int = 0  # staged when its fill came
    staging_bytes: int = 0  # bytes staged from file pages into the pool
    staging_wait_ns: int = 0  # host time fills waited for their slot to be staged
    staging_pool_bytes: int = 0  # bytes of the pool's slots

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def hold_device(self, weight: int, padding: int) -> None:
        self.device_weight_bytes += weight
        self.device_padding_bytes += padding
        self.peak_device_weight_bytes = max(self.peak_device_weight_bytes,
                                            self.device_weight_bytes)
        self.peak_device_bytes = max(self.peak_device_bytes,
                                     self.device_weight_bytes + self.device_padding_bytes)

    def release_device(self, weight: int, padding: int) -> None:
        self.device_weight_bytes -= weight
        self.device_padding_bytes -= padding

    def add_host(self, weight: int, padding: int, *, pinned: bool) -> None:
        self.host_bytes += weight
        self.host_padding_bytes += padding
        if pinned:
            self.pinned_bytes += weight + padding

    def add_h2d(self, weight: int, padding: int) -> None:
        self.h2d_bytes += weight
        self.h2d_padding_bytes += padding
