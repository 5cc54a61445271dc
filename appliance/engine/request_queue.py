"""Waiting queues of the scheduler (torch-free), as in vLLM V1's request_queue.

Both offer add / prepend / peek / pop / remove, ``len`` and iteration in
service order. A preempted request is prepended: under FCFS it goes back in
front; under priority it keeps its (priority, arrival_time) rank.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from appliance.engine.request import Request


class FCFSQueue:
    """Arrival order; a preempted request goes back in front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, r: Request) -> None:
        self._q.append(r)

    def prepend(self, r: Request) -> None:
        self._q.appendleft(r)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, r: Request) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Min-heap on (priority, arrival_time): smaller priority is served first."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._seq), r))

    prepend = add  # a preempted request keeps its (priority, arrival) rank

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, r: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not r]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap))
