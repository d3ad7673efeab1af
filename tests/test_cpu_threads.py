"""The CPU work's threads follow the cores other work leaves free (cpu_threads.py), and the count
changes no number."""

import os
import subprocess
import sys
import time
from dataclasses import replace

import mlx.core as mx
import pytest

from mlx_dgemma import cpu_threads, fast_blas
from mlx_dgemma.cpu_threads import Sample, busy_elsewhere, read_sample, threads_for

needs_openblas = pytest.mark.skipif(fast_blas.loaded is None, reason="OpenBLAS is not the BLAS in use")


def write_proc(root, busy_ticks: int, idle_ticks: int, own_ticks: int, cores: int = 2) -> None:
    """A /proc with ``cores`` cores whose counters say ``busy_ticks`` and ``idle_ticks`` in all, of
    which this process took ``own_ticks`` (user time; the command name holds parentheses)."""
    (root / "self").mkdir(exist_ok=True)
    per_core = "\n".join(f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(cores))
    (root / "stat").write_text(f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\n{per_core}\nintr 1 2\n")
    fields = ["S"] + ["0"] * 10 + [str(own_ticks), "0"] + ["0"] * 30
    (root / "self" / "stat").write_text(f"42 (python (a) b) {' '.join(fields)}\n")


def test_counters_are_read_from_proc(tmp_path):
    write_proc(tmp_path, busy_ticks=300, idle_ticks=700, own_ticks=120, cores=3)
    sample, cores = read_sample(str(tmp_path))
    assert (sample.busy, sample.total, sample.own, cores) == (300, 1000, 120, 3)
    assert read_sample(str(tmp_path / "absent")) is None


def test_the_cores_left_are_those_other_work_did_not_take():
    before = Sample(0.0, busy=0, total=0, own=0)
    # 2 cores for 100 ticks each: this process alone kept both busy
    assert busy_elsewhere(before, Sample(1.0, busy=200, total=200, own=200), cores=2) == 0
    assert threads_for(0, cores=2, usable=2) == 2
    # another process kept one core busy while this one used the other
    assert busy_elsewhere(before, Sample(1.0, busy=200, total=200, own=100), cores=2) == 1
    assert threads_for(1, cores=2, usable=2) == 1
    # every core taken elsewhere: still one thread; never more than this process may run on
    assert threads_for(busy_elsewhere(before, Sample(1.0, 200, 200, 0), cores=2), cores=2, usable=2) == 1
    assert threads_for(0, cores=8, usable=3) == 3
    assert busy_elsewhere(before, before, cores=2) == 0  # no time passed


def follow_twice(root, first: tuple[int, int, int], second: tuple[int, int, int]) -> int:
    """A follower's count after two readings of the /proc at ``root``."""
    follower = cpu_threads._Follower(str(root))
    write_proc(root, *first)
    follower.follow()
    follower.last = replace(follower.last, at=follower.last.at - cpu_threads.INTERVAL_S)
    write_proc(root, *second)
    return follower.follow()


@needs_openblas
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one thread whatever the load")
def test_openblas_runs_on_the_cores_left_unless_its_count_was_set(tmp_path, monkeypatch):
    blas = cpu_threads.openblas()
    before = blas.openblas_get_num_threads()
    for name in cpu_threads.SET_BY_USER:
        monkeypatch.delenv(name, raising=False)
    try:
        # another process kept one of the two cores busy (100 of 200 ticks), this one the other
        assert follow_twice(tmp_path, (0, 0, 0), (200, 0, 100)) == 1
        assert blas.openblas_get_num_threads() == 1
        assert follow_twice(tmp_path, (0, 0, 0), (200, 0, 200)) == 2  # it alone: both cores
        assert blas.openblas_get_num_threads() == 2
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
        assert follow_twice(tmp_path, (0, 0, 0), (200, 0, 100)) == 1  # numpy's split still follows
        assert blas.openblas_get_num_threads() == 2  # OpenBLAS's count is the user's
    finally:
        blas.openblas_set_num_threads(before)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc to read the load from")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one thread whatever the load")
def test_a_busy_core_beside_is_left_to_its_process():
    """Real counters: with another process spinning on a core, at most the other cores are used."""
    blas = cpu_threads.openblas()
    before = blas.openblas_get_num_threads() if blas else None
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        follower = cpu_threads._Follower()
        time.sleep(0.2)  # the spinner is running
        follower.follow()
        time.sleep(cpu_threads.INTERVAL_S + 0.1)
        assert 1 <= follower.follow() <= len(os.sched_getaffinity(0)) - 1
    finally:
        spin.kill()
        spin.wait()
        if blas:
            blas.openblas_set_num_threads(before)


@needs_openblas
@pytest.mark.parametrize(
    "rows, depth, width",
    [(256, 2816, 2112), (1, 2816, 2112), (1, 704, 2816), (33, 2816, 704), (256, 1024, 4096)],
)
def test_the_thread_count_changes_no_product(rows, depth, width):
    """Products at the released model's widths (a canvas, an AR token, an expert's rows) give the same
    bits on one thread and on two, both ways round (x @ w and w's transpose)."""
    x = mx.random.normal((rows, depth), key=mx.random.key(0))
    w = mx.random.normal((depth, width), key=mx.random.key(1))
    wt = mx.random.normal((width, depth), key=mx.random.key(2))
    results = []
    for threads in (1, 2):
        with cpu_threads.pinned(threads):
            assert cpu_threads.openblas().openblas_get_num_threads() == threads
            out = [x @ w, x @ wt.T]
            mx.eval(out)
        results.append(out)
    for one, two in zip(*results):
        assert mx.array_equal(one, two).item()


@needs_openblas
@pytest.mark.parametrize("policy", ["fast", "ar"])
def test_an_answer_is_the_same_on_one_thread_and_on_two(demo, policy, monkeypatch):
    """The engine re-sets the count as the load moves; an answer does not depend on it (the numpy
    kernels' split included)."""
    from mlx_dgemma import generate

    model, tokenizer = demo
    monkeypatch.setattr("mlx_dgemma.model.kernels.PARALLEL_MIN_ELEMENTS", 0)  # split every numpy pass
    answers = []
    for threads in (1, 2):
        with cpu_threads.pinned(threads):
            answers.append(generate(model, tokenizer, "sort: 9 4 7 1 8 2", seed=3, policy=policy, max_tokens=40))
            assert cpu_threads.openblas().openblas_get_num_threads() == threads  # the engine left it
    assert answers[0] == answers[1]
