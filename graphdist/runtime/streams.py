"""Ordering the streams of GPU devices inside one generated program.

The lowering asks a StreamOrder before and after each eqn it emits; the StreamOrder emits
the device switches and the event record/wait calls (on the backends' streams) that make
every cross-device read safe. Host devices have no streams and never get one.

A GPU device also has a communication stream (`GpuBackend.comm_stream`), where an
overlapped collective runs beside the compute (runtime/gpu_collectives.py); `Lane` is one
of a device's two streams with what the collectives do on it.
"""

from __future__ import annotations

import contextlib

from graphdist.ir import Var


class Lane:
    """One stream of a GPU device (its compute stream or its communication stream): record
    an event on it, make it wait on one, queue work on it."""

    def __init__(self, backend, stream):
        self.backend = backend
        self.stream = stream
        self.physical = backend.physical

    def record(self):
        with self.backend.cuda_device:      # an event belongs to its stream's device
            return self.stream.record()

    def wait(self, event) -> None:
        self.stream.wait_event(event)

    @contextlib.contextmanager
    def active(self):
        """This device and this stream current: CuPy calls queue work here."""
        with self.backend.cuda_device, self.stream:
            yield self

    def numba_stream(self):
        return self.backend.numba_stream(self.stream)


def compute_lane(backend) -> Lane:
    return Lane(backend, backend.stream)


def comm_lane(backend) -> Lane:
    return Lane(backend, backend.comm_stream)


class StreamOrder:
    """Orders work across the streams of the devices in one program (GPU backends).

    Each device queues its eqns on its own stream. When an eqn on device D reads a value
    made on device S's stream, D waits on an event S records right then (which covers the
    producer, issued earlier). Right after that eqn, S waits on D in turn, so S cannot
    overwrite the value's buffer (reused after its last use, or in the next step) while D
    may still read it. Waits already implied by an earlier one are left out.
    """

    def __init__(self, lowering):
        self.low = lowering
        self.made_on: dict = {}      # Var -> device whose stream wrote it
        self.issued: dict = {}       # device -> eqns queued on its stream so far
        self.seen: dict = {}         # (reader, writer) -> writer's count the reader waited on
        self.current = None
        self.pending_join: list = []

    def placed(self, device) -> str:
        """The device of an eqn or value; unplaced ones run on the program's device."""
        return device or self.low.backend.device

    def device_of(self, v) -> str:
        """The device whose stream wrote v."""
        return self.made_on.get(v, self.placed(v.device))

    def enter(self, device) -> None:
        if device != self.current:
            backend = self.low.backend_of(device)
            self.low.emit(f"{self.low.glob('D', backend.enter)}()")
            self.current = device

    def wait(self, reader, writer) -> None:
        mark = self.issued.get(writer, 0)
        if writer == reader or self.seen.get((reader, writer)) == mark:
            return
        event = f"{self.low.glob('R', self.low.backend_of(writer).record)}()"
        self.low.emit(f"{self.low.glob('Q', self.low.backend_of(reader).wait)}({event})")
        self.seen[(reader, writer)] = mark

    def start(self, args) -> None:
        """Arguments arrive as host arrays: copy each onto its device (on its stream)."""
        for v, name in args:
            device = self.placed(v.device)
            h2d = self.low.glob("H", self.low.backend_of(device).to_device)
            self.low.emit(f"{name} = {h2d}({name})")

    def before(self, eqn) -> None:
        device = self.placed(eqn.device)
        self.enter(device)
        if eqn.op.orders_own_streams:
            return     # it queues each device's part on that device's stream, and waits itself
        writers = {self.device_of(v) for v in eqn.inputs if isinstance(v, Var)}
        writers |= {v.device for v in eqn.outputs if v.device}   # buffers it writes elsewhere
        for writer in sorted(writers - {device}):
            self.wait(device, writer)
        self.pending_join = sorted(writers - {device})

    def after(self, eqn) -> None:
        device = self.placed(eqn.device)
        own = eqn.op.orders_own_streams
        for v in eqn.outputs:
            self.made_on[v] = v.device if own and v.device else device
        queued_on = {self.made_on[v] for v in eqn.outputs} | {device}
        for d in queued_on:
            self.issued[d] = self.issued.get(d, 0) + 1
        for writer in self.pending_join:        # the writer waits for this reader
            self.wait(writer, device)
        self.pending_join = []

    def before_write(self, state: Var, final) -> None:
        """A final value copied into a variable's storage: on the variable's stream."""
        device = self.placed(state.device)
        self.enter(device)
        if isinstance(final, Var):
            self.wait(device, self.device_of(final))

    def after_write(self, state: Var, final) -> None:
        device = self.placed(state.device)
        self.issued[device] = self.issued.get(device, 0) + 1
        if isinstance(final, Var) and self.device_of(final) != device:
            self.wait(self.device_of(final), device)   # its buffer is free once copied

    def to_host(self, v) -> str:
        return self.low.glob("T", self.low.backend_of(self.device_of(v)).to_host)
