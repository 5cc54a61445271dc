"""The export half of tracing (``tracing.py``): a span processor that
never blocks a request. Ended spans wait in a bounded queue that one thread
exports in batches; a span that finds the queue full, or whose batch fails to
export (a collector slow, down or refusing), is dropped and counted."""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExportResult

log = logging.getLogger("appliance.tracing")

MAX_BATCH_SPANS = 512
EXPORT_INTERVAL_S = 1.0
SHUTDOWN_FLUSH_S = 5.0


class BoundedExport(SpanProcessor):
    """A span processor: ended spans wait in a bounded queue that a thread exports in batches.
    ``on_end`` never blocks; ``dropped(n)`` hears of every span that did not fit or failed to export."""

    def __init__(self, exporter: Any, dropped: Callable[[int], None], max_queue: int,
                 max_batch: int = MAX_BATCH_SPANS, interval_s: float = EXPORT_INTERVAL_S):
        self.exporter, self._dropped = exporter, dropped
        self.max_queue, self.max_batch, self.interval_s = max_queue, max_batch, interval_s
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self.exported = self.failed_exports = 0
        self._thread = threading.Thread(target=self._run, name="appliance-trace-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: Any) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            if self._stop.is_set() or len(self._queue) >= self.max_queue:
                full = True
            else:
                full = False
                self._queue.append(span)
                self._idle.clear()
                if len(self._queue) >= self.max_batch:
                    self._wake.set()
        if full:
            self._dropped(1)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._export_queued()
        self._export_queued()

    def _export_queued(self) -> None:
        while True:
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
                if not batch:
                    self._idle.set()
                    return
            try:
                ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
            except Exception as e:  # noqa: BLE001 (an exporter failure costs spans, never the server)
                log.debug("span export raised: %s", e)
                ok = False
            if ok:
                self.exported += len(batch)
            else:
                self.failed_exports += 1
                if self.failed_exports == 1 or self.failed_exports % 100 == 0:
                    log.warning("could not export %d span(s) to the trace collector (%d failed exports so far); "
                                "dropped", len(batch), self.failed_exports)
                self._dropped(len(batch))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._wake.set()
        return self._idle.wait(timeout_millis / 1000)

    def shutdown(self) -> None:
        with self._lock:
            self._stop.set()
        self._wake.set()
        self._thread.join(SHUTDOWN_FLUSH_S)
        with self._lock:
            left = len(self._queue)
            self._queue.clear()
        if left:
            self._dropped(left)
        self.exporter.shutdown()
