"""Overlap on GPUs without a GPU: tests/gpu/test_overlap_gpu.py (the NCCL all-reduce split
into a start on the communication streams and a wait before the first reader: structure,
bits, buffer lifetimes, profile lanes, and a wait taken out caught as a race) on the
numpy-backed CuPy stand-in with the CUDA kernels in numba's simulator, with 1 and 2
"physical" GPUs, in a child process (both are set up at import); and the stand-in's
stream-order checks of simulated kernels, NCCL calls and event times, which make those
runs meaningful."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _simulated(code_or_args, physical: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", GRAPHDIST_FAKE_CUPY=str(physical))
    cmd = [sys.executable, *code_or_args] if isinstance(code_or_args, list) else \
        [sys.executable, "-c", textwrap.dedent(code_or_args)]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("physical", [1, 2])
def test_overlapped_gpu_program_on_the_simulated_gpu(physical):
    proc = _simulated(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-m", "gpu",
                       "tests/gpu/test_overlap_gpu.py"], physical)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "7 passed" in summary and "skipped" not in summary, summary


def test_the_stand_in_orders_kernel_launches_and_nccl_calls():
    """A simulated kernel reads its arguments and writes what it changed on the current
    stream, and NCCL works on the stream each rank names: unordered, the stand-in raises."""
    proc = _simulated("""
        import sys
        sys.path.insert(0, "tests/gpu")
        import fake_cupy as cp
        fake_cupy = cp
        cp.install()
        from graphdist.kernels.reduce import all_reduce_gpu

        def raises(fn, what):
            try:
                fn()
            except cp.StreamRace as e:
                assert what in str(e), e
                return
            raise AssertionError("no StreamRace")

        with cp.cuda.Device(0):
            a, b = cp.cuda.Stream(), cp.cuda.Stream()
            with a:
                x, y = cp.ones(8, "float32"), cp.ones(8, "float32")
                out = cp.zeros(8, "float32")
            def reduce_on_b():
                with b:
                    all_reduce_gpu([x, y], "sum", outs=[out])
            raises(reduce_on_b, "read")                # the kernel reads a's x unordered
            b.wait_event(a.record())
            reduce_on_b()                              # ordered now: out = 2
            assert out.get().tolist() == [2.0] * 8
            def read_on_a():
                with a:
                    cp.add(out, 1)
            raises(read_on_a, "read")                  # the kernel wrote out on b
            a.wait_event(b.record())
            read_on_a()
        comms = cp.cuda.nccl.NcclCommunicator.initAll([0, 1])
        bufs, streams = [], []
        for d in (0, 1):
            with cp.cuda.Device(d):
                s = cp.cuda.Stream()
                with s:
                    bufs.append(cp.ones(4, "float32"))
                streams.append(cp.cuda.Stream())   # NCCL's stream, not the writer's
        def nccl_sum():
            cp.cuda.nccl.groupStart()
            for c, buf, s in zip(comms, bufs, streams):
                c.allReduce(buf.data.ptr, buf.data.ptr, 4, cp.cuda.nccl.NCCL_FLOAT32,
                            cp.cuda.nccl.NCCL_SUM, s.ptr)
            cp.cuda.nccl.groupEnd()
        raises(nccl_sum, "read")
        print("OK")
    """, physical=2)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_stand_in_times_events_on_the_host_clock():
    proc = _simulated("""
        import sys, time
        sys.path.insert(0, "tests/gpu")
        import fake_cupy as cp
        s = cp.cuda.Stream()
        first = s.record()
        time.sleep(0.01)
        second = s.record()
        ms = cp.cuda.get_elapsed_time(first, second)
        assert 10 <= ms < 1000, ms
        untimed = s.record(cp.cuda.Event(disable_timing=True))
        try:
            cp.cuda.get_elapsed_time(first, untimed)
        except RuntimeError:
            print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_bench_overlap_gpu_says_so_without_a_gpu(capsys):
    from bench import overlap

    assert overlap.main(["--gpu", "--no-save"]) is None
    assert "no GPU here" in capsys.readouterr().out


def test_bench_overlap_gpu_runs_on_the_simulated_gpu():
    """bench/overlap.py --gpu end to end on the tiny MLP (what a GPU session runs on the
    benchmark MLP): both settings timed and profiled, the GPU collectives in the profile."""
    proc = _simulated("""
        import sys
        sys.path.insert(0, "tests/gpu")
        import fake_cupy
        fake_cupy.install()
        from bench import overlap
        r = overlap.main(["--gpu", "--models", "tiny", "--steps", "1", "--profile-steps", "1",
                          "--bucket-mib", "0.001", "--no-save"])
        (row,) = r["results"]
        assert row["setup"] == "4 logical GPUs", row
        for k in ("on", "off"):
            assert row[k]["median_s"] > 0 and row[k]["collective_s"] > 0, row
            assert 0 <= row[k]["exposed_s"] <= row[k]["collective_s"] + 1e-12, row
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
