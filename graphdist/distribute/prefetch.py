"""Input prefetch: a background thread that prepares the next k steps' batches and places
their shards on the replicas' devices while the current step computes.

What a step's batch is (splitting, grouping) lives in input.py; this file only runs a
generator of prepared batches ahead of its consumer and stops it cleanly.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator

import numpy as np

from graphdist.device.backends import backend_for
from graphdist.distribute.values import PerReplica, map_structure

_POLL = 0.05          # seconds a waiting thread sleeps between looks at the stop event
_JOIN_TIMEOUT = 5.0   # how long close() waits for a producer still inside the input's next()
_STEP, _END, _ERROR = "step", "end", "error"


def placer(devices) -> Callable | None:
    """A function that copies each replica's shards of a batch to its device, or None when
    the devices are host devices: numpy shards are used where they lie, never copied."""
    backends = [backend_for(d) for d in devices]
    if all(b.xp is np for b in backends):
        return None
    # GPU: backend.to_device copies on the device's own stream, the stream its steps run on,
    # since the backend has no side stream to offer. The copy is thus queued in order before
    # the step that reads it (no event to wait on, and CuPy's per-stream memory pool never
    # hands the buffer to another stream while a step still reads it); the host-side work
    # (reading the input, splitting, staging the copy) is what overlaps the step.

    def place(batch):
        def leaf(v):
            if isinstance(v, PerReplica):
                return PerReplica([b.to_device(x) for b, x in zip(backends, v.values)],
                                  v.devices)
            return backends[0].to_device(v) if len(backends) == 1 else v

        return map_structure(leaf, batch)

    return place


class Prefetcher:
    """Runs `steps` (a generator of prepared batches) on a daemon thread, at most `depth`
    batches ahead of `get()`: the thread takes a slot before it pulls the next batch from
    the input, and `get()` gives the slot back, so the input is never read further ahead.

    The thread keeps no reference to this object: when it is closed or garbage-collected
    (a finalizer), the stop event is set and the thread, which only ever waits in timed
    waits for a slot, ends at once, unless it is inside the input's own next() (then
    close() waits up to _JOIN_TIMEOUT for it)."""

    def __init__(self, steps: Iterator, depth: int):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        slots = threading.Semaphore(depth)
        self._slots = slots
        stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(steps, self._queue, slots, stop),
                                        name="graphdist-prefetch", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _shutdown, stop, self._queue, slots,
                                          self._thread)

    def get(self):
        """The next prepared batch; raises StopIteration at the end of the input, and the
        input's own exception (same object: type, message and traceback) where it failed."""
        while True:
            try:
                kind, value = self._queue.get(timeout=_POLL * 10)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    kind, value = _END, None    # stopped (closed) before it said why
                    break
        self._slots.release()
        if kind is _STEP:
            return value
        self.close()
        if kind is _END:
            raise StopIteration
        raise value

    def close(self) -> None:
        """Stop the thread and wait (bounded) for it to end; idempotent."""
        self._finalizer()


def _take_slot(slots: threading.Semaphore, stop: threading.Event) -> bool:
    while not stop.is_set():
        if slots.acquire(timeout=_POLL):
            return not stop.is_set()
    return False


def _produce(steps: Iterator, q: queue.Queue, slots, stop: threading.Event) -> None:
    try:
        # put() below never blocks: every item holds one of `depth` slots, and the queue
        # has room for `depth`; the timed slot wait is where this thread notices `stop`
        while _take_slot(slots, stop):
            try:
                q.put((_STEP, next(steps)))
            except StopIteration:
                q.put((_END, None))
                return
            # any exception, SystemExit from the input included, is the consumer's to see
            except BaseException as error:   # noqa: BLE001
                q.put((_ERROR, error))
                return
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()


def _shutdown(stop: threading.Event, q: queue.Queue, slots: threading.Semaphore,
              thread: threading.Thread) -> None:
    stop.set()
    slots.release()                  # wakes a thread waiting for a slot: it sees `stop` now
    _drain(q)                        # free the staged batches (device buffers) now
    if thread is not threading.current_thread():   # a finalizer may run on any thread
        thread.join(_JOIN_TIMEOUT)
        _drain(q)                    # and the one it may have staged meanwhile


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
