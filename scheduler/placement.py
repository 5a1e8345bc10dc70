"""Tier-2 placement: which rollout worker generates each request of a round, and moving queued ones.

    from scheduler.placement import place
    place(requests, num_workers=4, method="lpt", kv_capacity=850_000)   # sets request.worker

`lpt` (longest predicted first): requests sorted by predicted cost (prompt + predicted response tokens),
each given to the least-loaded worker among those whose KV cache can hold it (any worker if none can;
the engine will then preempt). This is Graham's LPT rule, so the largest worker load is within
(4/3 - 1/(3W)) of the best possible split. `round_robin` is the baseline that ignores predictions.

`WorkerQueues` is the runtime half, used by the driver and the simulator alike: each worker's requests
wait in its own queue (longest first) until the engine has a free slot; when a worker drains its queue
early (it ran ahead of its prediction) it takes the longest queued request of the worker with the most
queued predicted load. Only requests never started move, so nothing is lost.

Left out: heterogeneous workers inside one layout (all engines of a round share one TP).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Iterable

from scheduler.protocol import Request

PLACEMENTS = ("round_robin", "lpt")


def cost(request: Request) -> float:
    """Predicted token load of a request: context it builds up (prompt + predicted response)."""
    remaining = max(1.0, request.predicted_length - request.sample.response_length)
    return len(request.sample.prompt_tokens) + request.sample.response_length + remaining


def place(requests: list[Request], num_workers: int, method: str = "lpt", kv_capacity: int | list[int] | None = None) -> list[float]:
    """Assigns `request.worker` for every request; returns the predicted load per worker."""
    if num_workers < 1:
        raise ValueError("num_workers must be >= 1")
    loads = [0.0] * num_workers
    if method == "round_robin":
        for i, r in enumerate(requests):
            r.worker = i % num_workers
            loads[r.worker] += cost(r)
        return loads
    if method != "lpt":
        raise ValueError(f"placement={method!r}; expected one of {PLACEMENTS}")
    caps = kv_capacity if isinstance(kv_capacity, list) else [kv_capacity] * num_workers
    smallest = min((c for c in caps if c is not None), default=None)
    heap = [(0.0, w) for w in range(num_workers)]
    for r in sorted(requests, key=cost, reverse=True):
        c = cost(r)
        if smallest is None or c <= smallest:
            load, w = heapq.heappop(heap)  # every engine can hold it: least loaded wins
        else:  # least loaded among the engines that can hold it; any engine if none can (it will preempt)
            fits = [x for x in range(num_workers) if caps[x] is None or c <= caps[x]]
            w = min(fits or range(num_workers), key=lambda x: (loads[x], x))
            load = loads[w]
            heap = [(ld, x) for ld, x in heap if x != w]
            heapq.heapify(heap)
        heapq.heappush(heap, (load + c, w))
        r.worker = w
        loads[w] = load + c
    return loads


class WorkerQueues:
    """Per-worker queues of placed requests that have not started yet, with work stealing."""

    def __init__(self, num_workers: int, steal: bool = True) -> None:
        self.queues: list[deque[Request]] = [deque() for _ in range(num_workers)]
        self.steal_enabled = steal
        self.load = [0.0] * num_workers  # queued predicted load per worker, kept current for stealing
        self.moves = 0  # requests moved between workers (reported in the simulator's stats)

    def add(self, requests: Iterable[Request]) -> None:
        for r in sorted(requests, key=cost, reverse=True):  # longest first: long requests start early
            self.queues[r.worker].append(r)
            self.load[r.worker] += cost(r)

    def queued_load(self, worker: int) -> float:
        return self.load[worker]

    def _take(self, worker: int, r: Request) -> Request:
        q = self.queues[worker]
        if q[0] is r:
            q.popleft()
        else:  # by identity: requests compare by value, and two may look alike
            del q[next(i for i, x in enumerate(q) if x is r)]
        self.load[worker] = self.load[worker] - cost(r) if q else 0.0
        return r

    def pop(self, worker: int, steal: bool = True) -> Request | None:
        """Next request for `worker`, stealing from the most loaded queue when its own is empty."""
        if self.queues[worker]:
            return self._take(worker, self.queues[worker][0])
        if not (self.steal_enabled and steal):
            return None
        donor = max(range(len(self.queues)), key=lambda w: self.load[w])
        if not self.queues[donor]:
            return None
        r = self._take(donor, self.queues[donor][0])  # its longest queued request
        r.worker = worker
        self.moves += 1
        return r

    def remove(self, sample_id: str) -> Request | None:
        for w, q in enumerate(self.queues):
            for r in q:
                if r.sample.sample_id == sample_id:
                    return self._take(w, r)
        return None

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues)

    def drain(self) -> list[Request]:
        out = [r for q in self.queues for r in q]
        for q in self.queues:
            q.clear()
        self.load = [0.0] * len(self.queues)
        return out
