"""One pass over the dataset: :class:`_Epoch` (with workers) and :class:`_LocalEpoch`
(``num_workers=0``), and what the caller took, for resuming."""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from ..errors import revive
from .manager import _Slot, _Workers
from .wire import CHUNK, CHUNK_INDICES, END, OK
from .worker import _Fetcher, _resume_worker

# NOTE [ Resuming an epoch ]
#
# An epoch's state is where its caller is, never where the workers are: the batches the
# caller has taken, not those prefetched. A map-style epoch numbers its requests (the
# sampler's batches) 0, 1, 2... and keeps which the caller took: all those below
# ``done_below``, and ``taken`` above it (out of order, with in_order=False). Resuming
# restores the sampler as it was when the epoch started (its state_dict, its generator, or
# the shuffle's seed, kept as drawn), samples the epoch again and gives the workers only the
# requests not taken: batches prefetched at the snapshot are loaded again, none is lost and
# none comes twice. Batch k keeps its worker (``_Epoch._offset``) and the workers their seeds
# (``base_seed``). An iterable dataset is where each worker's part of it is: a worker whose
# dataset has ``state_dict`` sends the dataset's state with every batch, the parent keeps the
# state sent with the last batch the caller took from each worker, and a resumed worker calls
# ``load_state_dict`` with it before its first batch; a dataset without one is replayed (the
# worker loads and drops the batches its part had delivered: exact for a dataset that yields
# the same items every time). A retry after a crash (``recovery.retry``) resumes the dead
# worker's part the same way.


def _worker_resume(epoch: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Per worker, where its part of an iterable dataset resumes (see the NOTE above)."""
    out: list[dict[str, Any] | None] = []
    for w in epoch["workers"]:
        if w["state"] is not None:
            out.append({"state": w["state"]})
        else:
            out.append({"skip": int(w["yielded"])} if w["yielded"] else None)
    return out


def _untaken(
    requests: Iterator[Any], done_below: int, taken: set[int], positions: list[int]
) -> Iterator[Any]:
    """The requests of a resumed epoch that its caller had not taken; the number of each
    is appended to ``positions`` as it goes out."""
    for pos, request in enumerate(itertools.islice(requests, done_below, None), done_below):
        if pos in taken:
            continue
        positions.append(pos)
        yield request


class _Taken:
    """Which requests of a map-style epoch the caller took (see NOTE [ Resuming an epoch ]),
    and the epoch's start, for its state."""

    def __init__(self, info: dict[str, Any], resume: dict[str, Any] | None) -> None:
        self.info = info
        self.yielded = 0 if resume is None else int(resume["yielded"])
        self.done_below = 0
        self.taken: set[int] = set()
        # the request number of the i-th batch given out: ``first + i``, or (a resumed epoch
        # that had batches taken out of order) ``positions[i]``
        self.first = 0
        self.positions: list[int] | None = None
        requests = info["requests"]
        if resume is not None and "done_below" in resume:
            self.done_below = self.first = int(resume["done_below"])
            self.taken = {int(p) for p in resume["taken"]}
            if self.taken:
                self.positions = []
                requests = _untaken(requests, self.done_below, set(self.taken), self.positions)
            else:
                requests = itertools.islice(requests, self.first, None)
        self.requests = requests

    def took(self, i: int) -> None:
        """The caller took the ``i``-th batch given out this epoch."""
        self.yielded += 1
        pos = self.first + i if self.positions is None else self.positions[i]
        if pos == self.done_below:
            self.done_below = pos = pos + 1
            taken = self.taken
            while taken and pos in taken:
                taken.discard(pos)
                self.done_below = pos = pos + 1
        else:
            self.taken.add(pos)

    def state(self) -> dict[str, Any]:
        info = self.info
        return {
            "base_seed": info["base_seed"],
            "shuffle_seed": info["shuffle_seed"],
            "sampler": info["sampler"],
            "yielded": self.yielded,
            "done_below": self.done_below,
            "taken": sorted(self.taken),
        }


class _LocalEpoch:
    """An epoch loaded in this process (``num_workers=0``)."""

    def __init__(
        self,
        loader: Any,
        fetcher: _Fetcher,
        info: dict[str, Any],
        resume: dict[str, Any] | None,
    ) -> None:
        self.loader = loader
        self.fetcher = fetcher
        self._iterable = loader._iterable
        self._pinner = loader._pinner
        self._complete = False
        self._ended: str | None = None
        self._given = 0
        self._mark = _Taken(info, None if self._iterable else resume)
        self._requests = self._mark.requests
        self._answered, self._exhausted = 0, False
        if self._iterable and resume is not None:
            w = resume["workers"][0]
            self._answered, self._exhausted = int(w["yielded"]), bool(w["exhausted"])
            self._mark.yielded = int(resume["yielded"])
            _resume_worker(fetcher, _worker_resume(resume)[0])

    def __iter__(self) -> _LocalEpoch:
        return self

    def __next__(self) -> Any:
        if self._ended is not None:
            raise RuntimeError(
                f"this DataLoader iterator was stopped before its end: {self._ended}"
            )
        if self._complete:
            raise StopIteration
        if self._iterable:
            if self._exhausted:
                self._complete = True
                raise StopIteration
            try:
                batch = self.fetcher.fetch(None)
            except StopIteration:
                self._exhausted = self._complete = True
                raise
            self._answered += 1
            self._mark.yielded += 1
        else:
            try:
                indices = next(self._requests)
            except StopIteration:
                self._complete = True
                raise
            self._given += 1
            self._mark.took(self._given - 1)
            batch = self.fetcher.fetch(indices)
        return batch if self._pinner is None else self._pinner.pin(batch)

    def _state(self) -> dict[str, Any]:
        state = self._mark.state()
        if self._iterable:
            dataset = self.fetcher.dataset
            state["workers"] = [
                {
                    "state": dataset.state_dict() if self.loader._stateful else None,
                    "yielded": self._answered,
                    "exhausted": self._exhausted,
                }
            ]
            state["next_worker"] = 0
        return state

    def _abandon(self, why: str | None = None) -> None:
        if not self._complete:
            self._ended = why


class _Epoch:
    """One pass over the dataset (what ``iter(loader)`` returns).

    Batches are given to the workers a chunk at a time (``CHUNK``), ahead of when they are
    loaded; credits decide when they are loaded. In order, batches go to the workers round
    robin, torch's order: batch k to worker ``k % num_workers``, always (an iterable dataset
    skips the workers whose part ended), so a seed reproduces an epoch. The credit a taken
    batch frees goes back to its worker, for its batch ``depth`` turns further on: a worker
    loads ``prefetch_factor`` batches ahead, or (its batches small arrays that load fast, see
    ``_Workers.pace``) up to ``DEEP_AHEAD``, getting its credits back in groups of half that,
    so that it loads its next half while the parent takes the other workers' batches and the
    parent and the workers never take turns, each waiting for the other's wake-up. While
    batches are slow (credits one at a time), every worker stays busy. The parent reads each
    batch from the worker that holds it: no reorder buffer, and what the other workers loaded
    waits in their own channels.

    ``in_order=False`` gives each worker a new chunk when it runs low and takes whatever any
    worker has ready.
    """

    def __init__(
        self,
        loader: Any,
        workers: _Workers,
        info: dict[str, Any],
        resume: dict[str, Any] | None = None,
    ) -> None:
        self.loader = loader
        self.workers = workers
        self._iterable = loader._iterable
        # what the caller took, for state_dict() (see NOTE [ Resuming an epoch ])
        self._mark = _Taken(info, None if self._iterable else resume)
        self._requests = self._mark.requests
        self._complete = False  # the epoch reached its end
        # batch k of the epoch goes to the worker of batch ``_offset + k`` of a whole epoch
        self._offset = self._mark.done_below
        self._rot = 0  # iterable, in order: the worker whose batch comes first
        self._last_wid = -1
        if self._iterable and resume is not None:
            self._mark.yielded = int(resume["yielded"])
            self._rot = int(resume.get("next_worker", 0))
            for slot, w in zip(workers.slots, resume["workers"]):
                slot.answered, slot.wstate = int(w["yielded"]), w["state"]
                slot.exhausted = bool(w["exhausted"])
        self._sampling = True
        workers.floor = workers.next_bid  # older batches belong to an abandoned epoch
        self._in_order = loader.in_order
        self._timeout = loader.timeout or None
        self._finished = False
        self._ended: str | None = None  # why the epoch was ended from outside, before its end
        self._turns: collections.deque[_Slot] = collections.deque()  # in order: whose batch
        self._n = n = len(workers.slots)
        # the most a worker may load ahead (see _Workers.pace): batches are given this far
        self._ahead = ahead = workers.deep
        # in order, map-style, a credit is not handed back past the epoch's last batch
        self._positional = loader.in_order and not loader._iterable
        self._chunk = max(CHUNK, ahead)
        self._low = ahead + self._chunk // 2  # a worker holding fewer batches gets more
        self._low_all = self._low * n
        self._supply()
        while self._in_order and self._sampling and len(self._turns) < self._low_all:
            self._supply()  # rounds cut short by batches of many indices
        for slot in workers.slots:  # each worker's first batches, as far as its depth
            depth = slot.depth
            if self._positional:
                depth = sum(1 for s in itertools.islice(self._turns, depth * n) if s is slot)
            workers.grant(slot, depth)

    def __iter__(self) -> _Epoch:
        return self

    def _take(self, batches: int, step: int, max_indices: int) -> list[Any]:
        """Up to ``batches`` requests from the sampler, fewer (a multiple of ``step``, so that
        batch k of an epoch always goes to the same worker) where they hold more than
        ``max_indices`` indices between them."""
        requests: list[Any] = []
        indices = 0
        for request in self._requests:
            requests.append(request)
            indices += len(request) if type(request) is list else 1
            if len(requests) >= batches or (indices >= max_indices and len(requests) % step == 0):
                return requests
        self._sampling = False
        return requests

    def _supply(self) -> None:
        """Give the workers more batches: in order, a chunk to each in turn (one round);
        otherwise a chunk to each worker that runs low."""
        workers = self.workers
        active = [s for s in workers.slots if not s.exhausted]
        if not active:
            self._sampling = False
            return
        if not self._in_order:
            for slot in active:
                if len(slot.held) < self._low and self._sampling:
                    requests = self._take(self._chunk, 1, CHUNK_INDICES)
                    self._low = self._ahead + max(1, len(requests) // 2)
                    if requests:
                        first = workers.next_bid
                        workers.next_bid += len(requests)
                        workers.assign(slot, list(range(first, workers.next_bid)), requests)
            return
        k = len(active)
        # a multiple of the window (when the sampler has that many): the first round fills
        # the workers' credits, and each later one refills them
        requests = self._take(k * self._chunk, k, k * CHUNK_INDICES)
        # the next round is given once half of this one is taken (the workers never run dry,
        # and while the sampler goes on, the batch ``depth`` turns after the one taken is
        # known: see _free)
        self._low_all = self._ahead * k + len(requests) // 2 + 1
        if not requests:
            return
        first = workers.next_bid
        workers.next_bid += len(requests)
        if self._iterable:  # rounds start with the worker whose turn it is (a resumed epoch)
            shift = next((i for i, s in enumerate(active) if s.id >= self._rot), 0)
        else:  # rounds hold a batch of every worker in turn: batch k's worker is fixed
            shift = self._offset
        owners = [active[(j + shift) % k] for j in range(len(requests))]
        for slot in active:
            mine = [j for j in range(len(requests)) if owners[j] is slot]
            if mine:
                workers.assign(slot, [first + j for j in mine], [requests[j] for j in mine])
        self._turns.extend(owners)

    def __next__(self) -> Any:
        if self._finished:
            why = self._ended
            if why is not None:
                raise RuntimeError(f"this DataLoader iterator was stopped before its end: {why}")
            raise StopIteration
        workers = self.workers
        if workers.broken is not None:
            self._finished = True
            raise StopIteration
        turns = self._turns
        while True:
            if self._in_order:
                while self._sampling and len(turns) < self._low_all:
                    self._supply()
                if not turns:
                    self._finish()
                    raise StopIteration
                slot = turns.popleft()
                if slot.exhausted and slot.credit <= 0:
                    slot.held.popleft()  # given to a worker whose part of the data ended
                    continue
            else:
                if self._sampling:
                    self._supply()
                if not any(s.held for s in workers.slots):
                    self._finish()
                    raise StopIteration
                slot = workers.wait_any(self._timeout)
            reply = workers.read(slot, self._timeout)
            kind = reply[0]
            if kind == OK:
                self._free(slot)
                self._took(slot, reply)
                pinner = workers.pinner
                return reply[2] if pinner is None else pinner.pin(reply[2])
            if kind == END:
                slot.exhausted = True  # this worker's part of an iterable dataset is done
                if not self._in_order:
                    while len(slot.held) > slot.credit:
                        slot.held.pop()  # batches it will never be allowed to answer
                continue
            self._free(slot)
            self._took(slot, reply)
            raise revive(reply[2])  # a SystemExit of the dataset's is no exit here

    def _took(self, slot: _Slot, reply: Any) -> None:
        """The caller takes ``reply`` (a batch or its error) from ``slot``'s worker."""
        if self._iterable:
            self._mark.yielded += 1
            slot.answered += 1
            if len(reply) > 3:
                slot.wstate = reply[3]
            self._last_wid = slot.id
        else:
            self._mark.took(reply[1] - self.workers.floor)

    def _state(self) -> dict[str, Any]:
        """This epoch's part of ``DataLoader.state_dict()``."""
        state = self._mark.state()
        if self._iterable:
            slots = self.workers.slots
            state["workers"] = [
                {"state": s.wstate, "yielded": s.answered, "exhausted": s.exhausted} for s in slots
            ]
            turns = self._turns
            state["next_worker"] = (
                turns[0].id if turns else (self._last_wid + 1) % max(1, len(slots))
            )
        return state

    def _free(self, slot: _Slot) -> None:
        """The caller took a batch of ``slot``'s: its credit goes back to ``slot``'s worker,
        for its batch ``depth`` turns further on (in order, map-style: past the epoch's last
        batch no credit is needed)."""
        if self._positional:
            if len(self._turns) >= slot.depth * self._n:
                self.workers.give_back(slot)
        elif not slot.exhausted:
            self.workers.give_back(slot)

    def _finish(self) -> None:
        self._finished = self._complete = True
        if not self.loader.persistent_workers:
            self.workers.close()

    def _abandon(self, why: str | None = None) -> None:
        """Stop this epoch before its end: non-persistent workers stop now; persistent ones
        keep running, and what they loaded for this epoch is dropped at the next one. With
        ``why``, the next ``next()`` raises RuntimeError saying it (nobody is told of an
        epoch that was dropped, or broken off by its own caller)."""
        if self._finished:
            return
        self._finished = True
        self._ended = why
        if not self.loader.persistent_workers:
            self.workers.close()

    def __len__(self) -> int:
        return len(self.loader)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._abandon()
