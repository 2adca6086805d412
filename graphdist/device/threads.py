"""Thread budgets: with a worker thread per device (or per core), each worker's BLAS and
Numba calls must use only its share of the cores, or 4 workers x 2 BLAS threads fight over
2 cores (measured: a 4-replica MLP step 2.4x slower than with one BLAS thread per worker)."""

from __future__ import annotations

import functools
import os
import sys
import threading

# Numba's OpenMP threads spin after each parallel region by default; on a small machine
# they then steal the cores BLAS needs (measured: a matmul right after a fused Adam kernel
# ran 2.3x slower). Passive waiting costs a few microseconds per kernel launch instead.
# setdefault: an explicit OMP_WAIT_POLICY from the user wins. Must run before numba's
# OpenMP layer loads, so graphdist/__init__.py imports this module.
ENV_SET: dict = {}    # what graphdist added to os.environ (benchmarks hide it from peers)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = ENV_SET["OMP_WAIT_POLICY"] = "passive"

# OpenBLAS's worker threads spin for 2^n TSC ticks after each GEMM (n = 28 by default: about
# 0.1 s); a parallel Numba kernel that runs right after one gets half of a 2-core machine
# (max-pool gradient: 7.1 ms right after a matmul, 3.6 ms alone). n = 14 (about 6 us) puts
# them to sleep before the next kernel gets going but keeps them awake across the few
# microseconds between two GEMMs in a row (a dense layer's two gradients): with the minimum,
# 4, every GEMM woke a sleeping worker, which a step of 4 replicas (4x the GEMM calls) paid
# 4x. Against 4, fresh processes in ABBA order at a quiet moment (3 runs each; median of
# their medians, then of their mins, ms): the GPT-2-style step on 4 replicas 33.6 -> 33.1
# and 33.2 -> 32.1, the tutorial CNN 22.4 -> 22.0 / 21.9 -> 21.3 (1 device) and 24.8 ->
# 24.5 / 24.4 -> 23.9 (4 replicas); the GPT-2-style step on 1 device and the MLP within
# 0.5% (4 was itself chosen against the default 28: the CNN step 53-55 -> 51 ms;
# under a neighbour's load the two tie). Set before numpy loads OpenBLAS, or after it
# (_retime_loaded_openblas); an explicit setting wins.
THREAD_TIMEOUT = "14"
NUMPY_FIRST = "numpy" in sys.modules    # OpenBLAS already loaded (see _retime_loaded_openblas)
if "OPENBLAS_THREAD_TIMEOUT" not in os.environ and not NUMPY_FIRST:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = ENV_SET["OPENBLAS_THREAD_TIMEOUT"] = THREAD_TIMEOUT


def _retime_loaded_openblas() -> bool:
    """With numpy (so OpenBLAS) already loaded, set the thread timeout anyway: put it in the
    environment, have OpenBLAS read its environment again (openblas_read_env) and stop its
    worker threads (blas_thread_shutdown_, as it does before a fork): the next GEMM starts
    them afresh with the new timeout. Those are exported functions of the OpenBLAS numpy
    bundles; any other BLAS (or a missing symbol) leaves things as they are: False."""
    import ctypes

    from graphdist.kernels.gemm import numpy_module_handle

    handle = numpy_module_handle()
    try:
        read_env, shutdown = handle.openblas_read_env, handle.blas_thread_shutdown_
        timeout = handle.openblas_thread_timeout
    except AttributeError:
        return False
    timeout.restype = ctypes.c_int
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = ENV_SET["OPENBLAS_THREAD_TIMEOUT"] = THREAD_TIMEOUT
    read_env()
    if timeout() != int(THREAD_TIMEOUT):       # it did not read it: undo
        del os.environ["OPENBLAS_THREAD_TIMEOUT"], ENV_SET["OPENBLAS_THREAD_TIMEOUT"]
        return False
    shutdown()
    return True


# numpy first (as most scripts import it): measured before this existed, the tutorial CNN's
# step ran 34 against 30.7 ms on 2 cores (OpenBLAS's threads spun after each GEMM)
RETIMED = NUMPY_FIRST and "OPENBLAS_THREAD_TIMEOUT" not in os.environ \
    and _retime_loaded_openblas()


_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def blas_kernels() -> str:
    """What `graphdist devices` says of the GEMMs every matmul and convolution runs on:
    OpenBLAS's kernel family and who chose it, with a hint when the environment pins AVX2
    kernels on a CPU that has AVX-512 (GEMMs 1.6-1.9x slower, docs/benchmarks.md)."""
    chosen = os.environ.get("OPENBLAS_CORETYPE")
    by = ("set by graphdist" if ENV_SET.get("OPENBLAS_CORETYPE") == chosen
          else "set in the environment")
    text = (f"OPENBLAS_CORETYPE={chosen} ({by})" if chosen
            else "OpenBLAS picks its kernels from the CPU model")
    if chosen and chosen.lower() in ("haswell", "zen", "sandybridge") \
            and _AVX512 <= _cpu_flags():
        text += ("; this CPU has AVX-512: unset OPENBLAS_CORETYPE before starting Python and "
                 "graphdist picks SkylakeX (sgemm 1.8x faster on the AMD EPYC "
                 "of docs/benchmarks.md)")
    return text


def _prefer_avx512_blas() -> None:
    """OpenBLAS picks its kernels from the CPU model; on CPUs it does not recognize (AMD
    EPYC VMs here) it falls back to Haswell (AVX2) kernels although AVX-512 is there:
    measured sgemm 209 GFLOP/s vs 378 with OPENBLAS_CORETYPE=SkylakeX on 2 cores. Only
    effective when numpy has not been imported yet; an explicit setting wins."""
    if "numpy" in sys.modules or "OPENBLAS_CORETYPE" in os.environ:
        return
    if _AVX512 <= _cpu_flags():
        os.environ["OPENBLAS_CORETYPE"] = ENV_SET["OPENBLAS_CORETYPE"] = "SkylakeX"


_prefer_avx512_blas()

_lock = threading.Lock()
_blas_now = [None]


_processes_per_host = [1]


def set_processes_per_host(count: int) -> None:
    """Worker processes sharing this host (a multi-worker strategy's workers on one
    machine): each then counts its share of the cores as its own."""
    _processes_per_host[0] = max(1, int(count))


_affinity_of: dict = {}     # pid -> _affinity(): asked ~11 times a CNN step, 8 us each


def _affinity() -> tuple[int, int]:
    """(the cores this process may run on, the host's cores), read once per process (a
    worker is pinned when it starts, before graphdist runs anything)."""
    pid = os.getpid()
    if pid not in _affinity_of:
        try:
            mine = len(os.sched_getaffinity(0))
            _affinity_of[pid] = (mine, os.cpu_count() or mine)
        except AttributeError:
            _affinity_of[pid] = (os.cpu_count() or 1,) * 2
    return _affinity_of[pid]


def cores() -> int:
    """The cores this process may use: those it may run on, divided among the worker
    processes of this host when they are not pinned apart."""
    mine, total = _affinity()
    if mine < total:          # pinned (mpiexec -bind-to core): these are ours alone
        return mine
    return max(1, mine // _processes_per_host[0])


def oversubscribed() -> bool:
    """More worker processes share this process's cores than there are cores (not pinned
    apart): a process waiting on the others should give its core to them as it polls."""
    mine, total = _affinity()
    return mine == total and _processes_per_host[0] > mine


def share(workers: int) -> int:
    """Threads each of `workers` concurrent device workers may use."""
    return max(1, cores() // max(1, workers))


@functools.cache
def _controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def set_blas_threads(n: int | None) -> None:
    """Process-wide BLAS thread count (None: the library default, all cores)."""
    n = cores() if n is None else n
    with _lock:
        if _blas_now[0] == n:
            return
        _controller().limit(limits=n, user_api="blas")
        _blas_now[0] = n


def set_numba_threads(n: int | None) -> int | None:
    """Numba's large parallel kernels launched from this thread use n threads from now on
    (thread-local; None: every Numba thread; kernels/common.py sets it when the next one
    runs). Returns what the thread wanted before. Nothing before Numba is loaded."""
    if "numba" not in sys.modules:
        return None
    from graphdist.kernels.common import want_numba_threads

    return want_numba_threads(n)


# ---------------------------------------------------------------- thread pools
class ForkSafePool:
    """A ThreadPoolExecutor made on first use, and made anew in a forked child: the child
    has the parent's pool but none of its threads, so work handed to it would wait for
    ever. The device threads of a thread-per-device step, a program's communication
    thread and the parts of a split batch all run on one."""

    def __init__(self, workers: int, name: str):
        self.workers, self.name = max(1, workers), name
        self._pool, self._pid = None, None
        self._lock = threading.Lock()

    def submit(self, fn, *args):
        with self._lock:
            if self._pid != os.getpid():
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
                self._pid = os.getpid()
        return self._pool.submit(fn, *args)


# ---------------------------------------------------------------- a batch split over the cores
_split_pool: list = []                 # the ForkSafePool of the parts, once needed

# below this many bytes of output a batch is not split: the hand-off costs more than it saves
SPLIT_MIN_BYTES = 1 << 20


def split_batch(n: int, run, out_bytes: int, parts: int | None = None) -> None:
    """run(part) over the `n` items of a batch (part: a slice of them): in one call, or,
    where the caller has every core's BLAS threads (one program: not a device worker of a
    thread-per-device step, which has its share) and the output is large, in one part per
    core, each on a thread of its own with its share of the BLAS threads. A convolution's im2col copies
    and epilogues, single-threaded numpy or Numba passes between its GEMMs, then keep every
    core busy (the tutorial CNN's second conv2d + bias + relu, batch 256: 7.5 -> 3.4 ms on
    2 cores). `run` must compute each item's result as the whole call does (rows of a GEMM
    do not depend on the others). `parts`: that many parts, whatever the cores, the size
    and the BLAS threads the caller has (run one after another where they are not split
    over the cores): for a result summed over the parts, whose bits must then depend on
    nothing else (they once depended on another thread's BLAS setting at the moment: the
    background warm-up's, which changed a CNN step's fourth loss in one run out of four)."""
    every = cores()
    k = min(n, parts or every)
    if k < 2 or _alone(out_bytes) and parts is None:
        run(slice(0, n))
        return
    bounds = [n * i // k for i in range(k + 1)]
    side_by_side([functools.partial(run, slice(a, b)) for a, b in zip(bounds, bounds[1:])],
                 out_bytes)     # (alone: `parts` parts still, one after another: same bits)


def _alone(out_bytes: int) -> bool:
    """Whether work of this output size runs on the caller's thread alone: one core, a
    small output, or a caller with its share of the cores only (a device worker)."""
    every = cores()
    return every < 2 or out_bytes < SPLIT_MIN_BYTES or (_blas_now[0] or every) < every


def side_by_side(runs: list, out_bytes: int) -> None:
    """Each of `runs` (callables of no argument) on a thread of its own with its share of
    the BLAS threads, where the caller has every core and the output is large; else one
    after another on the caller's thread. Each part's Numba kernels get its share of the
    threads too (two parts each launching two Numba threads ran four on two cores: the
    tutorial CNN's step 18.2-18.8 -> 16.5-17.0 ms). Each must give its result whatever the
    threads it gets (a split_batch inside one then runs whole, or its fixed parts in
    turn)."""
    if len(runs) < 2 or _alone(out_bytes):
        for run in runs:
            run()
        return
    every = cores()
    if not _split_pool:
        _split_pool.append(ForkSafePool(every - 1, "graphdist-split"))
    before, share = _blas_now[0], max(1, every // len(runs))

    def with_share(run):
        wanted = set_numba_threads(share)      # thread-local: this part's Numba kernels too
        try:
            run()
        finally:
            set_numba_threads(wanted)

    set_blas_threads(share)
    try:
        futures = [_split_pool[0].submit(with_share, run) for run in runs[1:]]
        with_share(runs[0])
        for f in futures:
            f.result()
    finally:
        set_blas_threads(before)
