"""Distributed layerwise offload: the layerwise ring across the ranks of a ``torch.distributed``
process group (gloo on CPU, NCCL on CUDA), each rank running its own request.

Note [AllGather transport]
    Each rank keeps 1/world of every block in host memory.  A block's *slot image* is the bytes
    its per-dtype flats occupy in a slot (Note [Slot layout] in ring.py), ``image`` bytes long.
    It is cut into ``world`` shards of ``S = round_up(ceil(image / world), alignment)`` bytes;
    rank ``r`` keeps bytes ``[r*S, (r+1)*S)``, zero past the image.  Filling slot ``s`` with
    block ``k``::

        copy stream   wait free[s]; H2D of this rank's shard into slot[s][r*S:(r+1)*S];
                      record copied[s]
        comm stream   wait copied[s]; all_gather_into_tensor(slot[s][:world*S],
                      slot[s][r*S:(r+1)*S]) (in place, as FSDP2 gathers); record ready[s]

    Compute waits ready[s] as for any fill, so a read of the slot is ordered after the gather;
    the CPU platform checks it (the gather is submitted with the slot as what it reads and
    writes).  One collective per block whatever its dtypes, exactly two slots per rank whatever
    the model size (``world * S`` bytes each, at most ``world * alignment`` bytes over the
    largest aligned block).  Weights only: each rank's activations stay its own, so ranks run
    different requests (DP multi-concurrency).

Note [Collective safety]
    Every fill is a collective, so every rank must issue the same fills in the same order:

    * Enable issues none: block 0 is loaded by the first forward that calls it (ranks may
      enable several pipelines, or build other rings, in different orders).
    * Before committing, every rank publishes a digest of its ring schedule (ring names, block
      counts, shard sizes, world) through the process group's store and checks that all agree
      (:class:`~offload_ref.distributed.Rendezvous`).  A rank that fails anywhere in enable
      publishes its failure for that round instead, so every other rank raises promptly with
      an error naming it; a rank that dies or hangs is named when the bounded timeout expires.
      Every rank then rolls back: no rank is left enabled waiting in a collective its peers
      will never issue, and enable is never retried behind the caller's back.
    * During a generation the fills follow the block calls, which are the same on every rank
      when every rank runs the same pipeline with the same number of steps (the wave rule of
      :class:`~offload_ref.distributed.WaveRunner`).

Note [Gather tags]
    If the ranks' calls differ after all (one rank makes an extra guidance call, a rank that
    failed mid-generation goes on, one rank disables while another generates), their fills pair
    up wrongly: with blocks of equal size every gather completes, and each rank rebuilds a
    block from shards of different blocks, silently.  So on CPU tensors (gloo) every fill first
    gathers a tag of three int64s -- disable's or a generation's, the block index, the number of
    fills since enable -- and raises :class:`OffloadScheduleError` on every rank, naming each
    rank's tag, before the data is gathered.  One more small collective per block, done wherever
    the group's collectives run on the host (gloo, whether the blocks are host tensors or live on
    the simulated accelerator, whose memory is host memory); not done for NCCL, where reading the
    tags back would stall the host on every block (NCCL runs rely on the schedule rule above).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from .. import _spans
from ..config import OffloadStrategy, WeightTransfer
from ..plan import OffloadTopologyError, ResolvedOffloadPlan, RingPlan, shard_bytes
from .groups import TensorGroup
from .layerwise import LayerWiseOffloadBackend
from .slots import RingStreams, Slot
from .transaction import Transaction
from .transports import RankLocalTransport, Transport

__all__ = ["AllGatherTransport", "DistributedLayerWiseOffloadBackend",
           "DistributedLayerwiseOffloadBackend"]


_WHERE = "ring=%s block=%d slot=%d"  # span names (Note [Spans] in _spans.py)


class OffloadScheduleError(RuntimeError):
    """Ranks gathered different blocks at the same collective (Note [Gather tags])."""


_KINDS = ("a generation", "disable")


def _incomplete(where: str, exc: BaseException) -> RuntimeError:
    return RuntimeError(
        f"{where}: the AllGather of a block did not complete ({type(exc).__name__}: {exc}).  A "
        "peer rank probably failed, was stopped, or made other calls; every rank must make the "
        "same DiT calls.  This rank holds 1/world of each block and cannot rebuild its weights "
        "alone: restart every rank's pipeline")


def _host_collectives(group: Any) -> bool:
    """Whether ``group``'s collectives run on the host (gloo), whatever device their tensors are
    on: reading a gathered tag back then stalls nothing (Note [Gather tags])."""
    import torch.distributed as dist

    return str(dist.get_backend(group)).lower() == "gloo"


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: Any,
                tag: torch.Tensor | None = None, where: str = "") -> None:
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if tag is not None:  # Note [Gather tags]: before the data, so no rank gathers a mix
        tags = torch.empty(dist.get_world_size(group) * tag.numel(), dtype=tag.dtype)
        try:
            gather(tags, tag, group=group)
        except Exception as exc:  # a peer that failed, stopped, or timed out
            raise _incomplete(where, exc) from exc
        tags = tags.view(-1, tag.numel())
        if not bool((tags == tags[0]).all()):
            seen = "; ".join(f"rank {r}: block {int(b)}, fill #{int(n)} of {_KINDS[int(c)]}"
                             for r, (c, b, n) in enumerate(tags.tolist()))
            raise OffloadScheduleError(
                f"{where}: the ranks are gathering different blocks at the same collective "
                f"({seen}).  Every rank must make the same DiT calls in the same order (the "
                "same steps, the same guidance calls, disable and edit_weights on every rank); "
                "a rank that failed mid-generation and went on leaves the others out of step.  "
                "The gathered blocks would mix the ranks' weights, so nothing was gathered: "
                "restart every rank's pipeline")
    try:
        gather(output, shard, group=group)
    except Exception as exc:  # a peer that failed, stopped, or timed out
        raise _incomplete(where, exc) from exc


def weights_digest(image: torch.Tensor, chunk: int = 1 << 20) -> int:
    """A digest of a block image's bytes that sees where each byte is: the sum of its 32-bit
    words, each times an odd multiplier that depends on its position, modulo 2**64.  A plain
    sum missed two weights of one shape swapped (``to_q`` / ``to_k``), a transposed weight,
    and two compensating one-ulp edits; any single changed word changes this one.  Integer
    sums wrap and commute, so the result is the same whatever the reduction order."""
    words = image.view(torch.int32)
    total = 0
    for start in range(0, words.numel(), chunk):
        w = words[start:start + chunk].to(torch.int64)
        position = torch.arange(start, start + w.numel(), dtype=torch.int64)
        total += int((w * (position * 0x9E3779B1 + 1)).sum())
    return total % (1 << 64)


class AllGatherTransport(Transport):
    """Keeps this rank's zero-padded 1/world shard of every block; a fill copies the shard into
    its place in the slot and gathers the others into theirs.  See Note [AllGather transport]."""

    name = "allgather"
    collective = True
    restores_through_slots = True

    def __init__(self, group: Any, rank: int, world: int, alignment: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.alignment = alignment
        self.shards: list[torch.Tensor] = []
        self.shard_bytes: list[int] = []
        self.image_bytes: list[int] = []
        self.shard_weight_bytes: list[int] = []  # weight bytes (padding excluded) in my shard
        self.checksums: list[int] = []  # per block: weights_digest of its whole image
        self.copied: list[Any] = []
        self._shard_of: dict[int, torch.Tensor] = {}  # id(group) -> its shard, for release
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._sequence = 0  # fills issued since enable (Note [Gather tags])
        self._kind = 0  # 0: a generation's fills, 1: disable's
        self._tagged = _host_collectives(group)  # Note [Gather tags]

    # -- enable ---------------------------------------------------------------------------------

    def build_master(self, txn: Transaction, group: TensorGroup,
                     sections: dict[torch.dtype, tuple[int, int]], image_bytes: int) -> None:
        S = shard_bytes(image_bytes, self.world, self.alignment)
        image = torch.zeros(self.world * S, dtype=torch.uint8)  # zero past the weights
        flats = {dtype: image.narrow(0, offset, numel * dtype.itemsize).view(dtype)
                 for dtype, (offset, numel) in sections.items()}
        group.layout.pack_into(flats, lambda dst, src: dst.copy_(src))
        shard = txn.host_empty(f"{group.label} shard {self.rank}/{self.world}", S, torch.uint8,
                               self.pin)
        shard.copy_(image.narrow(0, self.rank * S, S))
        # A checksum of the whole block, which every rank still holds here: ranks whose weights
        # differ would gather a mix of both (Note [Collective safety]).
        self.checksums.append(weights_digest(image) if S else 0)
        lo, hi = self.rank * S, (self.rank + 1) * S
        weight = 0
        for seg in group.layout.segments:
            start = sections[seg.dtype][0] + seg.offset * seg.dtype.itemsize
            end = start + seg.numel * seg.dtype.itemsize
            weight += max(0, min(end, hi) - max(start, lo))
        self.shards.append(shard)
        self._shard_of[id(group)] = shard
        self.shard_bytes.append(S)
        self.image_bytes.append(image_bytes)
        self.shard_weight_bytes.append(weight)
        if not self.copied:
            self.copied = [self.platform.Event() for _ in range(2)]
        group.master = None  # the shard is this rank's host side of the block
        self.stats.add_host(weight, S - weight, pinned=self.platform.pin_memory_supported
                            and self.pin)

    def slot_bytes(self, image_bytes: int) -> int:
        return self.world * shard_bytes(image_bytes, self.world, self.alignment)

    # -- fills ----------------------------------------------------------------------------------

    def bind(self, streams, stats, label, *, pin, predict_after) -> None:
        if streams.comm is None:
            raise RuntimeError(f"ring {label}: an AllGather transport gathers on the communication "
                               "stream of its RingStreams, and none was given")
        super().bind(streams, stats, label, pin=pin, predict_after=predict_after)

    @property
    def comm_stream(self) -> Any:
        """The communication stream the gathers run on (the rings' ``RingStreams.comm``)."""
        return self.streams.comm

    def slot_views(self, slot: Slot, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``k``'s whole image in ``slot`` and this rank's shard of it (the gather's
        output and input)."""
        views = self._views.get((k, slot.index))
        if views is None:
            S = self.shard_bytes[k]
            out = slot.storage.narrow(0, 0, self.world * S)
            views = self._views[(k, slot.index)] = (out, out.narrow(0, self.rank * S, S))
        return views

    def copy_shard(self, slot: Slot, k: int) -> None:
        """The first half of a fill: this rank's shard into its place in ``slot``, on the copy
        stream after the slot's last reader, recording the slot's shard-copied event."""
        platform = self.platform
        copy_stream = self.streams.copy
        _, mine = self.slot_views(slot, k)
        with platform.stream(copy_stream):
            copy_stream.wait_event(slot.free)
            # The previous gather into this slot ran on the communication stream: a block that
            # was prefetched and then skipped (skip-layer guidance) never recorded the slot's
            # free event after it, so the copy below waits for that gather itself (a rank-local
            # fill needs no such wait: all its writes are on the copy stream).
            copy_stream.wait_event(slot.ready)
            span = _spans.stream_enter(platform, "copy", _WHERE, self.label, k, slot.index)
            platform.copy_(mine, self.shards[k])
            _spans.stream_exit(platform, span)
            self.copied[slot.index].record(copy_stream)

    def gather(self, slot: Slot, k: int) -> None:
        """The second half of a fill: the AllGather of block ``k``'s shards into ``slot``, on the
        communication stream after the shard copy; the work is issued, not waited for."""
        platform = self.platform
        out, mine = self.slot_views(slot, k)
        tag = None
        if self._tagged:  # Note [Gather tags]: host-run collectives (gloo) only
            self._sequence += 1
            tag = torch.tensor([self._kind, k, self._sequence], dtype=torch.int64)
        with platform.stream(self.comm_stream):
            self.comm_stream.wait_event(self.copied[slot.index])
            span = _spans.stream_enter(platform, "collective", _WHERE, self.label, k, slot.index)
            platform.submit(functools.partial(_all_gather, out, mine, self.group, tag,
                                              f"ring {self.label}"),
                            reads=(slot.storage,), writes=(slot.storage,))
            _spans.stream_exit(platform, span)

    def fill(self, slot: Slot, k: int, group: TensorGroup) -> None:
        self.copy_shard(slot, k)
        self.gather(slot, k)  # the last writer: the ring records slot.ready on comm_stream

    def shard_sizes(self) -> list[int]:
        return list(self.shard_bytes)

    def block_checksums(self) -> list[int]:
        return list(self.checksums)

    def host_shards(self) -> list[torch.Tensor] | None:
        return list(self.shards)

    def writers(self) -> tuple[Any, ...]:
        # A fill copies this rank's shard on the copy stream, then gathers on the
        # communication stream: the last writer of a slot is the gather.
        return (self.streams.copy, self.comm_stream)

    def count_fill(self, k: int, group: TensorGroup) -> None:
        weight = self.shard_weight_bytes[k]
        self.stats.add_h2d(weight, self.shard_bytes[k] - weight)
        self.stats.collective_bytes += self.world * self.shard_bytes[k]

    # -- disable --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def disabling(self) -> Iterator[None]:
        """Around disable's fills, which rebuild each block through slot 0 (every rank disables
        together): their gathers are tagged as disable's (Note [Gather tags])."""
        self._kind = 1
        try:
            yield
        finally:
            self._kind = 0

    def true_value(self, k: int, group: TensorGroup, i: int) -> torch.Tensor:
        raise RuntimeError(
            f"state_dict() while {group.label} streams with AllGather: this rank holds "
            f"1/{self.world} of the block's bytes, and rebuilding it takes a collective that every "
            "rank would have to issue; call backend.disable() on every rank first (it gathers "
            "the full weights back), or use weight_transfer='rank-local'"
        )

    def release(self, group: TensorGroup) -> None:
        shard = self._shard_of.pop(id(group), None)
        if shard is not None:
            self.platform.host_free(shard)
        self._views = {}


class DistributedLayerWiseOffloadBackend(LayerWiseOffloadBackend):
    """Layerwise offload across the ranks of a process group.  Selected by
    ``enable_distributed_layerwise_offload`` (+ ``dlo_use_allgather``, ``dlo_resident_layers``,
    ``data_parallel_size``) or compact ``mode="layer"`` with ``weight_transfer="allgather"`` or
    ``resident_layers``.

    * Rings whose component uses ``weight_transfer="allgather"`` keep 1/world of each block per
      rank and rebuild it with an AllGather (Note [AllGather transport]); rank-local rings stream
      each rank's full host copy, with no collective.  With a world of one (torch.distributed
      not initialized, or a one-rank group), AllGather is rank-local.
    * ``resident_layers`` leading blocks of a declared resident DiT stay on the device for the
      whole generation (they are non-block state to the ring).
    * Ranks agree before the first collective (Note [Collective safety]).

    ``process_group`` is the data-parallel group (default: the default group); ``timeout_s``
    bounds how long a rank waits for the others at enable.

    Seams: :class:`~offload_ref.backends.layerwise.LayerWiseOffloadBackend`'s.  This class fills
    four of them: :meth:`resolve` (a rank whose plan is skipped raises, Note [Collective
    safety]), :meth:`transport_for` (AllGather rings), :meth:`before_commit` (the ranks agree)
    and :meth:`enable_failed` (a failed rank tells the others).  Policy class:
    ``allgather_transport_class``, the transport of an AllGather ring.
    """

    strategy = OffloadStrategy.DISTRIBUTED_LAYER_WISE
    hook_name = "offload_ref.distributed_layerwise"
    allgather_transport_class: type[AllGatherTransport] = AllGatherTransport

    def __init__(self, config, platform, *, process_group: Any = None,
                 timeout_s: float = 60.0, prefetch: bool = True, rendezvous: Any = None) -> None:
        super().__init__(config, platform, prefetch=prefetch)
        self.process_group = process_group
        self.timeout_s = timeout_s
        self._rendezvous = rendezvous
        self.rank, self.world = 0, 1
        self._comm_stream: Any = None
        self._agreeing = False

    # -- the process group ----------------------------------------------------------------------

    def _resolve_group(self) -> None:
        """Rank and world of the data-parallel group, checked against the config (before any
        mutation)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            group = self.process_group
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        elif self.process_group is not None:
            raise RuntimeError(
                "DistributedLayerWiseOffloadBackend: a process_group was given but "
                "torch.distributed is not initialized; call torch.distributed.init_process_group "
                "first (torchrun sets up what it needs)")
        else:
            self.rank, self.world = 0, 1
        if self.world > 1 and self._rendezvous is None:
            # Before the checks below: a rank whose config is refused must still publish its
            # failure for this enable round (Note [Collective safety]), or its next enable would
            # pair with its peers' round of this one.
            from ..distributed.rendezvous import Rendezvous

            self._rendezvous = Rendezvous.default(
                self.process_group, namespace="offload_ref/dlo", timeout_s=self.timeout_s)
        gathers = any(o.weight_transfer is WeightTransfer.ALLGATHER
                      for o in self._options()) and self.world > 1
        if self.config.world_size > 1 and self.config.world_size != self.world:
            raise RuntimeError(
                f"data_parallel_size (OffloadConfig.world_size) = {self.config.world_size}, but "
                f"this process's data-parallel group has {self.world} rank(s); launch "
                f"{self.config.world_size} processes (torchrun --nproc-per-node "
                f"{self.config.world_size} ...) and initialize torch.distributed before enable")
        if gathers and self.config.world_size != self.world:
            raise RuntimeError(
                f"weight_transfer='allgather' across {self.world} ranks needs data_parallel_size "
                f"(OffloadConfig.world_size) = {self.world}, got {self.config.world_size}; set it "
                "so the plan predicts each rank's shard sizes")
        if gathers:
            backend = str(dist.get_backend(self.process_group)).lower()
            needs = "nccl" if self.platform.name == "cuda" else "gloo"
            if needs not in backend:
                raise RuntimeError(
                    f"AllGather of {self.platform.name} slots needs a {needs} process group, but "
                    f"the group uses {backend}; initialize it with "
                    f"init_process_group({needs!r}) (or a group created for it)")

    def _options(self) -> list[Any]:
        return [self.config.options_for(c) for c in self.config.components]

    # -- enable ---------------------------------------------------------------------------------

    def enable(self, pipeline: Any) -> None:
        if self.is_enabled() and self.pipeline is pipeline:
            return
        self._agreeing = False
        try:
            self._resolve_group()
            super().enable(pipeline)
        except BaseException as exc:
            self.enable_failed(exc)  # once per round: a no-op if the rendezvous itself raised
            raise

    def resolve(self, pipeline: Any) -> ResolvedOffloadPlan:
        plan = super().resolve(pipeline)
        if plan.skip_reason is not None and self.world > 1:
            # Note [Collective safety]: a rank that would skip while its peers enable would
            # run un-offloaded beside them (and never meet their rounds).  It raises, before
            # any collective, and enable() publishes the reason to the others' round.
            raise OffloadTopologyError(
                f"distributed layerwise offload on rank {self.rank} of {self.world}: this "
                f"rank's plan is skipped ({plan.skip_reason}) while its peers enable theirs; "
                "every rank must offload the same pipeline (a rank running un-offloaded beside "
                "offloaded ones would never meet their collectives).  Fix this rank's pipeline "
                "or declarations, or disable distributed offload on every rank")
        return plan

    def transport_for(self, ring_plan: RingPlan) -> Transport | None:
        if ring_plan.transfer is not WeightTransfer.ALLGATHER or self.world == 1:
            return RankLocalTransport()
        return self.allgather_transport_class(self.process_group, self.rank, self.world,
                                              self.platform.alignment)

    def ring_streams(self) -> RingStreams:
        """The copy stream, and with more than one rank the communication stream AllGather rings
        gather on (created at the first enable that can gather, reused by every later one)."""
        if self.world > 1 and self._comm_stream is None:
            self._comm_stream = self.platform.Stream()
        return RingStreams(self.platform, self._copy_stream, self._comm_stream)

    def schedule(self) -> list[dict[str, Any]]:
        """What every rank must agree on: each ring's blocks, transport and shard sizes."""
        out = []
        for ring in self.rings:
            t = ring.transport
            out.append({"ring": ring.label, "blocks": len(ring.blocks), "transport": t.name,
                        "shards": t.shard_sizes(),
                        "slot_bytes": ring.slot_bytes})
        return out

    def before_commit(self, txn: Transaction) -> None:
        if self._rendezvous is None or self.world == 1:
            return
        txn.step("agree with every rank")
        digest = hashlib.sha256(json.dumps(
            {"world": self.world, "strategy": self.config.strategy.value,
             "components": list(self.config.components), "rings": self.schedule()},
            sort_keys=True).encode()).hexdigest()[:16]
        # The rings in words before the digest, so that a disagreement says what differs.
        rings = ", ".join(f"{r['ring']} x{r['blocks']} {r['transport']}" for r in self.schedule())
        self._agreeing = True  # from here the round is taken, whatever it raises
        self._rendezvous.agree("enable", f"{rings} #{digest}", what=(
            "the ring schedule (rings, blocks, shard sizes) of distributed layerwise enable; "
            "every rank must enable the same pipelines, configured alike, in the same order"))
        sums = [(ring.label, k, c) for ring in self.rings
                for k, c in enumerate(ring.transport.block_checksums())]
        if sums:
            txn.step("agree on the streamed weights")
            self._rendezvous.agree("weights", hashlib.sha256(
                json.dumps(sums).encode()).hexdigest()[:16], what=(
                "a checksum of the AllGather-streamed weights: each rank keeps 1/world of every "
                "block and rebuilds it from the others' shards, so the weights must be identical "
                "on every rank (load the same checkpoint everywhere, and apply edits such as "
                "LoRA on every rank)"))

    def enable_failed(self, exc: BaseException) -> None:
        if self._rendezvous is not None and not self._agreeing:
            self._agreeing = True
            try:
                self._rendezvous.fail("enable", f"{type(exc).__name__}: {exc}"[:2000])
            except Exception:  # noqa: BLE001 - the original error is the one to raise
                pass

    def host_shards(self) -> dict[str, list[torch.Tensor]]:
        """Ring label -> this rank's host shard of each block (AllGather rings only)."""
        return {ring.label: shards for ring in self.rings
                if (shards := ring.transport.host_shards()) is not None}


# The old name (``Layerwise``), kept for one release.
DistributedLayerwiseOffloadBackend = DistributedLayerWiseOffloadBackend  # old name
