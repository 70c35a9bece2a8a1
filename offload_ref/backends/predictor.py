"""The call-order predictor: which block of a ring runs next (Note [The ring] in ring.py)."""

from __future__ import annotations

__all__ = ["CallOrderPredictor"]


class CallOrderPredictor:
    """Predicts which block of a ring runs next, from the order the caller has run them.

    It continues the most recent earlier occurrence of the longest recent run of calls that
    matches the latest calls (up to ``window`` calls back).  Any order that repeats with a
    period shorter than the kept history is predicted exactly from its second period on:
    plain passes, skipped blocks, a reasoner once then a generator every step, and orders that
    are not first-order (skip-layer guidance runs blocks [0,1,2], [0,1,2], [0,2] each step, so
    block 0 is followed by 1 or by 2).  Before the order has repeated, it predicts k + 1
    (wrap-around).  While the order keeps repeating, each call costs O(1); a misprediction
    costs one bounded search."""

    def __init__(self, n: int, *, window: int = 32, history: int = 4096,
                 candidates: int = 64) -> None:
        self.n = n
        self.window = window
        self.cap = max(history, 8 * n)
        self.candidates = candidates
        self.history: list[int] = []
        self._positions: dict[int, list[int]] = {}
        self._match: int | None = None  # index j < len - 1 with history[j] == the last call

    def observe(self, k: int) -> None:
        h = self.history
        m = self._match
        self._match = m + 1 if m is not None and h[m + 1] == k else None
        h.append(k)
        self._positions.setdefault(k, []).append(len(h) - 1)
        if self._match is None:
            self._match = self._search()
        if len(h) > self.cap:
            self._trim()

    def call(self, k: int) -> int:
        """Observe the call of block ``k`` and return the block expected after it: the ring's
        pre-hook makes this one call per block (Note [Fast path] in ring.py).  While the order
        keeps repeating it takes the short path; otherwise it is ``observe`` then ``predict``."""
        h = self.history
        m = self._match
        if m is not None and h[m + 1] == k and len(h) < self.cap:
            self._match = m = m + 1
            self._positions[k].append(len(h))
            h.append(k)
        else:
            self.observe(k)
            h = self.history  # a trim replaces the list
            m = self._match
        return h[m + 1] if m is not None else (k + 1) % self.n

    def predict_after(self, q: int) -> int:
        """The block expected after ``q`` when ``q`` is the one predicted next (a fill's
        look-ahead: Note [Pinned staging] in staging.py)."""
        m, h = self._match, self.history
        if m is not None and m + 2 < len(h) and h[m + 1] == q:
            return h[m + 2]
        return (q + 1) % self.n

    def ahead(self, q: int, depth: int) -> list[int]:
        """The ``depth`` blocks expected from ``q`` on, when ``q`` is the one predicted next
        (``q`` first): the matched history continued, as the order it repeats (period: the
        distance from the match to the last call), or k + 1 (wrap-around) with no match (Note
        [Prefetch depth] in ring.py)."""
        m, h = self._match, self.history
        if m is None or m + 1 >= len(h) or h[m + 1] != q:
            return [(q + i) % self.n for i in range(depth)]
        period = len(h) - 1 - m
        out = []
        for i in range(m + 1, m + 1 + depth):
            while i >= len(h):
                i -= period
            out.append(h[i])
        return out

    def repair(self) -> None:
        """Rebuild the derived state from the history, after an ``observe`` or a trim that was
        interrupted between two statements (Note [Interrupted blocks] in ring.py)."""
        positions: dict[int, list[int]] = {}
        for i, k in enumerate(self.history):
            positions.setdefault(k, []).append(i)
        self._positions = positions
        self._match = None
        if self.history:
            self._match = self._search()

    def predict(self, k: int) -> int:
        """The block expected after ``k`` (the call just observed)."""
        if self._match is not None:
            return self.history[self._match + 1]
        return (k + 1) % self.n

    def _search(self) -> int | None:
        h = self.history
        last = len(h) - 1
        best, best_len = None, 0
        for j in reversed(self._positions[h[last]][-self.candidates - 1:-1]):
            length = 1
            while length < self.window and j - length >= 0 and h[j - length] == h[last - length]:
                length += 1
            if length > best_len:
                best, best_len = j, length
                if length == self.window:
                    break
        return best

    def _trim(self) -> None:
        drop = len(self.history) // 2
        self.history = self.history[drop:]
        self._positions = {}
        for i, k in enumerate(self.history):
            self._positions.setdefault(k, []).append(i)
        if self._match is not None:
            self._match = self._match - drop if self._match >= drop else None
