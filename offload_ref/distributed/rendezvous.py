"""Agreement between ranks through the c10d store, before any collective.

Note [Rendezvous rounds]
    A collective that one rank issues and another does not hangs both (until the process group's
    timeout, 30 minutes by default, if ever).  So everything the ranks must agree on before their
    first collective -- the plan, the wave's step count -- is exchanged through the process
    group's *store* instead, with our own timeout, and a rank that cannot take part says so.

    A *round* is one call of :meth:`Rendezvous.exchange` (or :meth:`~Rendezvous.fail`) on one
    topic by every rank.  Round numbers are per rank and per topic, drawn from the store
    (``add`` on a per-rank counter key), so two ``Rendezvous`` objects of one process on the same
    store and namespace never reuse a round.  Round ``n`` of ``topic`` uses the keys::

        {namespace}/{topic}/{n}/{rank}   b"ok:<value>" or b"fail:<reason>"   (one per rank)
        {namespace}/{topic}/{n}/!count   arrivals + BIG * aborts             (atomic add)
        {namespace}/{topic}/{n}/!result  b"go" or b"fail:<json>"              (written once)

    A rank that enters publishes its value, then adds 1 to ``!count``.  A rank that gives up --
    :meth:`fail`, its own timeout, an interrupt while waiting -- adds ``BIG``.  Because ``add`` is
    atomic, the order of these additions decides the round, the same way for every rank: it
    succeeds iff the ``world``-th arrival comes before the first abort.  The one rank whose
    addition decided it (the last arrival, or the first aborter) writes ``!result``; everyone else
    waits for that key.  There is no window in which one rank proceeds while another raises: a
    rank that times out just as the last rank arrives learns from its own ``add`` that the round
    had already succeeded, and proceeds too; a rank that arrives after an abort learns that it
    failed, at once, without waiting for its own timeout.

    Why not poll the per-rank keys alone: a rank that times out would have to withdraw the "ok" it
    published, and a late rank may read that "ok" just before the withdrawal, then issue its
    collective alone.

    Keys of round ``n - 1`` are deleted by the rank that decides round ``n`` a success: by then
    every rank has returned from round ``n - 1``.  Keys of failed rounds stay (they are few).

Store methods: only ``set``, ``get``, ``check``, ``add`` and ``delete_key`` are used.  ``FileStore``
(what :func:`~offload_ref.distributed.launch.run_ranks` uses), ``TCPStore``, ``HashStore`` and
``PrefixStore`` all have them in torch 2.13.  ``wait`` is not used: it raises only when the store's
own timeout passes (``FileStore`` rounds that up to whole seconds), so it cannot watch several
keys for a "fail" at the same time.  ``get`` is only called on a key that ``check`` has seen:
on a missing key it blocks for the store's timeout (minutes).  The counters (``!count``,
``!rounds``) are only ever touched by ``add``: ``add`` on a key that ``set`` wrote with text
raises on FileStore/HashStore, and on TCPStore breaks the connection to the server for good.
"""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["RankDisagreementError", "RankFailedError", "Rendezvous", "default_store"]

_BIG = 1 << 24  # one abort, in the !count key; above any arrival count
_PREVIEW = 120  # characters of a value shown in a message


class RankFailedError(RuntimeError):
    """One or more ranks failed (or never reported) in a rendezvous round.

    ``failed`` maps each failed rank to its reason: what it passed to :meth:`Rendezvous.fail`, or
    ``"did not report within T s"`` for a rank that stayed silent.
    """

    def __init__(self, message: str, failed: dict[int, str], *, topic: str = "",
                 rank: int = -1) -> None:
        super().__init__(message)
        self.failed = dict(sorted(failed.items()))
        self.topic = topic
        self.rank = rank

    def __reduce__(self):  # picklable with its attributes (it crosses process boundaries)
        return (_rebuild_failed, (str(self), self.failed, self.topic, self.rank))


class RankDisagreementError(RuntimeError):
    """The ranks exchanged values that should be equal and are not; ``values``: rank -> value."""

    def __init__(self, message: str, values: dict[int, str], *, what: str = "",
                 topic: str = "") -> None:
        super().__init__(message)
        self.values = dict(sorted(values.items()))
        self.what = what
        self.topic = topic

    def __reduce__(self):
        return (_rebuild_disagreement, (str(self), self.values, self.what, self.topic))


def _rebuild_failed(message: str, failed: dict[int, str], topic: str, rank: int
                    ) -> RankFailedError:
    return RankFailedError(message, failed, topic=topic, rank=rank)


def _rebuild_disagreement(message: str, values: dict[int, str], what: str, topic: str
                          ) -> RankDisagreementError:
    return RankDisagreementError(message, values, what=what, topic=topic)


def default_store() -> Any:
    """The c10d store of the initialized default process group.

    The one place that calls torch's private ``_get_default_store``.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch; "
                           "a Rendezvous needs its store")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
            "before Rendezvous.default(), or build Rendezvous(store, rank, world) yourself")
    from torch.distributed import distributed_c10d

    getter = getattr(distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise RuntimeError(
            "this torch version has no torch.distributed.distributed_c10d._get_default_store(); "
            "pass the store explicitly: Rendezvous(store, rank, world)")
    return getter()


def _preview(value: str) -> str:
    text = repr(value)
    if len(text) <= _PREVIEW:
        return text
    return text[:_PREVIEW - 5] + f"...' ({len(value)} chars)"


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _decode(data: bytes) -> str:
    return bytes(data).decode("utf-8", "surrogatepass")


class Rendezvous:
    """Rounds of value exchange between the ``world`` ranks that share ``store``.

    Every rank must call the same topics in the same order (see Note [Rendezvous rounds]); a rank
    that cannot call a round it should call, calls :meth:`fail` instead, so that the others raise
    at once instead of at their timeout.  ``timeout_s`` bounds each round; ``poll_s`` is the
    sleep between two looks at the store.
    """

    def __init__(self, store: Any, rank: int, world: int, *, namespace: str = "offload_ref",
                 timeout_s: float = 60.0, poll_s: float = 0.005) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
        if world >= _BIG:
            raise ValueError(f"world {world} is too large for a Rendezvous (at most {_BIG - 1})")
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s!r}")
        if store is None and world > 1:
            raise ValueError("a Rendezvous of more than one rank needs a store")
        self.store = store
        self.rank = rank
        self.world = world
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)

    def __repr__(self) -> str:
        return (f"Rendezvous(rank={self.rank}, world={self.world}, namespace={self.namespace!r}, "
                f"timeout_s={self.timeout_s})")

    @classmethod
    def default(cls, group: Any = None, *, namespace: str = "offload_ref",
                timeout_s: float = 60.0, poll_s: float = 0.005) -> Rendezvous:
        """A Rendezvous of ``group`` (default: the whole world) on the default group's store.

        Ranks are group ranks.  For a subgroup the namespace gets the group's global ranks as a
        suffix (``offload_ref/g0,2``), so that two groups never share keys.
        """
        import torch.distributed as dist

        store = default_store()
        if group is None or group is dist.group.WORLD:
            return cls(store, dist.get_rank(), dist.get_world_size(), namespace=namespace,
                       timeout_s=timeout_s, poll_s=poll_s)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the process "
                             f"group {group!r}; only members can rendezvous on it")
        members = dist.get_process_group_ranks(group)
        suffix = "g" + ",".join(str(r) for r in members)
        return cls(store, rank, dist.get_world_size(group), namespace=f"{namespace}/{suffix}",
                   timeout_s=timeout_s, poll_s=poll_s)

    # -- public rounds ---------------------------------------------------------------------------

    def exchange(self, topic: str, value: str) -> list[str]:
        """Publish ``value`` for this rank's next round of ``topic``; every rank's value, by rank.

        Raises :class:`RankFailedError` if another rank called :meth:`fail` for this round
        (promptly), or did not report within ``timeout_s`` (named, with its rank).
        """
        self._check_topic(topic)
        if not isinstance(value, str):
            raise TypeError(f"Rendezvous.exchange({topic!r}): value must be a str, "
                            f"got {type(value).__name__}")
        if self.world == 1:
            return [value]
        n = self._next_round(topic)
        self.store.set(self._key(topic, n, self.rank), b"ok:" + _encode(value))
        after = self.store.add(self._key(topic, n, "!count"), 1)
        try:
            if self._decides(after, 1):
                self.store.set(self._key(topic, n, "!result"), b"go")
                self._forget(topic, n - 1)
            elif after >= _BIG:  # an abort came first: the result is (being) written
                self._raise_failed(topic, n, self._wait_result(topic, n, grace=True))
            else:
                result = self._wait_result(topic, n, grace=False)
                if result is None:  # timed out: abort, unless the round has just succeeded
                    result = self._abort(topic, n, self._silent_ranks(topic, n))
                if result != b"go":
                    self._raise_failed(topic, n, result)
        except RankFailedError:
            raise
        except BaseException as exc:  # interrupted while waiting: do not leave the others waiting
            try:
                self._abort(topic, n, {self.rank: f"raised {type(exc).__name__} while waiting"},
                            wait=False)
            except Exception:
                pass
            raise
        return [self._value_of(topic, n, r) if r != self.rank else value
                for r in range(self.world)]

    def agree(self, topic: str, value: str, *, what: str) -> None:
        """:meth:`exchange`, then :class:`RankDisagreementError` on every rank unless all values
        are equal.  ``what`` names what was compared, in the message."""
        values = self.exchange(topic, value)
        if all(v == values[0] for v in values):
            return
        raise RankDisagreementError(self._disagreement(topic, what, values),
                                    dict(enumerate(values)), what=what, topic=topic)

    def fail(self, topic: str, reason: str) -> None:
        """Give up this rank's next round of ``topic``: the other ranks' same round raises
        :class:`RankFailedError` naming this rank and ``reason``, at once.  Returns (the caller
        raises its own error)."""
        self._check_topic(topic)
        reason = str(reason)
        if self.world == 1:
            return
        n = self._next_round(topic)
        self.store.set(self._key(topic, n, self.rank), b"fail:" + _encode(reason))
        self._abort(topic, n, {self.rank: reason}, wait=False)

    # -- the round protocol ----------------------------------------------------------------------

    def _key(self, topic: str, n: int, leaf: Any) -> str:
        return f"{self.namespace}/{topic}/{n}/{leaf}"

    def _next_round(self, topic: str) -> int:
        return int(self.store.add(f"{self.namespace}/{topic}/!rounds/{self.rank}", 1)) - 1

    def _decides(self, after: int, increment: int) -> bool:
        """Whether the ``add`` of ``increment`` that returned ``after`` decided the round."""
        before = after - increment
        if before >= _BIG:  # an abort came before this addition
            return False
        if increment == 1:
            return before + 1 == self.world  # the last arrival, and no abort yet
        return before < self.world  # the first abort, before the last arrival

    def _wait_result(self, topic: str, n: int, *, grace: bool) -> bytes | None:
        """``!result`` once written; None at the timeout (``grace``: the deciding rank is
        writing it right now, so a missing key after a few seconds means that rank died)."""
        key = self._key(topic, n, "!result")
        deadline = time.monotonic() + (min(max(1.0, self.timeout_s), 10.0) if grace
                                       else self.timeout_s)
        while not self.store.check([key]):
            if time.monotonic() >= deadline:
                if grace:
                    return b"fail:" + _encode(json.dumps({"failed": {
                        "-1": "the rank that decided this round died before writing its result"}}))
                return None
            time.sleep(self.poll_s)
        return bytes(self.store.get(key))

    def _abort(self, topic: str, n: int, failed: dict[int, str], *, wait: bool = True
               ) -> bytes | None:
        """Add an abort to round ``n``; write the failure if it decided the round.  The round's
        result (``wait``), which is b"go" if all ranks had arrived before the abort."""
        after = self.store.add(self._key(topic, n, "!count"), _BIG)
        if self._decides(after, _BIG):
            result = b"fail:" + _encode(json.dumps(
                {"by": self.rank, "failed": {str(r): why for r, why in failed.items()}}))
            self.store.set(self._key(topic, n, "!result"), result)
            return result
        return self._wait_result(topic, n, grace=True) if wait else None

    def _silent_ranks(self, topic: str, n: int) -> dict[int, str]:
        reason = f"did not report within {self.timeout_s} s"
        return {r: reason for r in range(self.world)
                if r != self.rank and not self.store.check([self._key(topic, n, r)])}

    def _value_of(self, topic: str, n: int, rank: int) -> str:
        raw = _decode(self.store.get(self._key(topic, n, rank)))
        kind, _, text = raw.partition(":")
        if kind != "ok":  # cannot happen after b"go": every rank arrived with "ok"
            raise RuntimeError(f"rendezvous {topic!r} round {n}: rank {rank} published {raw!r} "
                               f"in a round that succeeded")
        return text

    def _raise_failed(self, topic: str, n: int, result: bytes | None) -> None:
        failed: dict[int, str] = {}
        by = None
        raw = _decode(result or b"fail:{}")
        if raw.startswith("fail:"):
            try:
                info = json.loads(raw[len("fail:"):])
                failed = {int(r): str(why) for r, why in info.get("failed", {}).items()}
                by = info.get("by")
            except (ValueError, TypeError, AttributeError):
                failed = {-1: raw}
        for r in range(self.world):  # every rank's own fail() reason, not only the decider's
            key = self._key(topic, n, r)
            if r not in failed and self.store.check([key]):
                own = _decode(self.store.get(key))
                if own.startswith("fail:"):
                    failed[r] = own[len("fail:"):]
        silent = {r for r, why in failed.items() if why.startswith("did not report within")}
        parts = []
        for r, why in sorted(failed.items()):
            who = f"rank {r}" if r >= 0 else "unknown rank"
            hint = f" (crashed, hung, or not calling {topic!r})" if r in silent else ""
            parts.append(f"{who}: {why}{hint}")
        seen = f"rank {self.rank} of {self.world}"
        decided = f"; decided by rank {by}" if by is not None and by != self.rank else ""
        message = (f"rendezvous {topic!r} (round {n}, namespace {self.namespace!r}) failed, "
                   f"as seen by {seen}{decided}: " + "; ".join(parts))
        raise RankFailedError(message, failed, topic=topic, rank=self.rank)

    def _forget(self, topic: str, n: int) -> None:
        """Delete round ``n``'s keys (called when round ``n + 1`` succeeded: everyone is past
        round ``n``)."""
        if n < 0:
            return
        for leaf in (*range(self.world), "!count", "!result"):
            try:
                self.store.delete_key(self._key(topic, n, leaf))
            except Exception:  # a store without delete_key only keeps a few more bytes
                return

    def _disagreement(self, topic: str, what: str, values: list[str]) -> str:
        groups: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        # The reference is the value most ranks hold (rank 0's on a tie); show the others' diffs.
        reference = max(groups, key=lambda v: (len(groups[v]), -groups[v][0]))
        lines = []
        for v, ranks in sorted(groups.items(), key=lambda item: item[1][0]):
            who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
            if v == reference or len(v) <= _PREVIEW:
                lines.append(f"{who}: {_preview(v)}")
            else:
                at = _first_difference(reference, v)
                lo = max(0, at - 30)
                lines.append(f"{who}: differs at char {at}: ...{v[lo:at + 60]!r}... "
                             f"(vs ...{reference[lo:at + 60]!r}...)")
        return (f"ranks disagree on {what} (rendezvous {topic!r}, seen by rank {self.rank} of "
                f"{self.world}): " + "; ".join(lines))

    @staticmethod
    def _check_topic(topic: str) -> None:
        if not isinstance(topic, str) or not topic or "/" in topic or topic.startswith("!"):
            raise ValueError(f"a rendezvous topic is a non-empty str without '/' that does not "
                             f"start with '!', got {topic!r}")
