"""The CPU work's threads follow the cores other work leaves free (cpu_threads.py), moving OpenBLAS's
count only where that changes no number."""

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


def write_proc(root, cores: list[tuple[int, int]], own_ticks: int) -> None:
    """A /proc whose cores have each been busy and idle for the given ticks, of which this process
    took ``own_ticks`` (user time; the command name holds parentheses)."""
    (root / "self").mkdir(exist_ok=True)
    busy, idle = sum(c[0] for c in cores), sum(c[1] for c in cores)
    lines = [f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b // 2} {b - b // 2} 0 {i_} 0 0 0 0 0 0" for i, (b, i_) in enumerate(cores)]
    (root / "stat").write_text("\n".join(lines) + "\nintr 1 2\nctxt 3\n")
    fields = ["S"] + ["0"] * 10 + [str(own_ticks), "0"] + ["0"] * 30
    (root / "self" / "stat").write_text(f"42 (python (a) b) {' '.join(fields)}\n")


def test_counters_are_read_from_proc_for_the_cores_the_process_may_use(tmp_path):
    write_proc(tmp_path, [(100, 200), (50, 50), (30, 70)], own_ticks=120)
    sample, cores = read_sample(str(tmp_path), cpus={0, 2})
    assert (sample.busy, sample.total, sample.own, cores) == (130, 400, 120, 2)
    assert read_sample(str(tmp_path), cpus={5}) is None  # none of its cores listed
    assert read_sample(str(tmp_path / "absent")) is None


def test_the_cores_left_are_those_other_work_did_not_take():
    before = Sample(0.0, busy=0, total=0, own=0)
    # 2 cores for 100 ticks each: this process alone kept both busy
    assert busy_elsewhere(before, Sample(1.0, busy=200, total=200, own=200), cores=2) == 0
    assert threads_for(0, cores=2) == 2
    # another process kept one core busy while this one used the other
    assert busy_elsewhere(before, Sample(1.0, busy=200, total=200, own=100), cores=2) == 1
    assert threads_for(1, cores=2) == 1
    # every core taken elsewhere: still one thread
    assert threads_for(busy_elsewhere(before, Sample(1.0, 200, 200, 0), cores=2), cores=2) == 1
    assert threads_for(0.4, cores=3) == 3 and threads_for(0.6, cores=3) == 2
    assert busy_elsewhere(before, before, cores=2) == 0  # no time passed


def follow_twice(root, first: list[tuple[int, int]], second: list[tuple[int, int]], own: int) -> int:
    """A follower's count after two readings of the /proc at ``root`` (cores 0 and 1)."""
    follower = cpu_threads._Follower(str(root), cpus={0, 1})
    write_proc(root, first, own_ticks=0)
    follower.follow()
    follower.last = replace(follower.last, at=follower.last.at - cpu_threads.INTERVAL_S)
    write_proc(root, second, own_ticks=own)
    return follower.follow()


@needs_openblas
def test_openblas_runs_on_the_cores_left_unless_its_count_was_set(tmp_path, monkeypatch):
    blas = cpu_threads.openblas()
    before = blas.openblas_get_num_threads()
    for name in cpu_threads.SET_BY_USER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_threads, "sums_agree", lambda blas: True)  # as with its SkylakeX kernels
    both_busy = [(100, 0), (100, 0)]
    try:
        # another process kept one of the two cores busy (100 of 200 ticks), this one the other
        assert follow_twice(tmp_path, [(0, 0), (0, 0)], both_busy, own=100) == 1
        assert blas.openblas_get_num_threads() == 1
        assert follow_twice(tmp_path, [(0, 0), (0, 0)], both_busy, own=200) == 2  # it alone: both cores
        assert blas.openblas_get_num_threads() == 2
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
        assert follow_twice(tmp_path, [(0, 0), (0, 0)], both_busy, own=100) == 1  # numpy's split still follows
        assert blas.openblas_get_num_threads() == 2  # OpenBLAS's count is the user's
        monkeypatch.delenv("OPENBLAS_NUM_THREADS")
        monkeypatch.setattr(cpu_threads, "sums_agree", lambda blas: False)  # as with its Haswell kernels
        assert follow_twice(tmp_path, [(0, 0), (0, 0)], both_busy, own=100) == 1
        assert blas.openblas_get_num_threads() == 2  # moving it would move the answers' last bits
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
def test_where_openblas_count_moves_it_changes_no_product(rows, depth, width):
    """Where ``sums_agree`` lets the count move (OpenBLAS's SkylakeX kernels), products at the released
    model's widths (a canvas, an AR token, an expert's rows) give the same bits on one thread and on
    two, both ways round (x @ w and w's transpose)."""
    if not cpu_threads.sums_agree(cpu_threads.openblas()):
        pytest.skip("this OpenBLAS sums in another order on another thread count: its count is left alone")
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
    """The engine re-sets the count as the load moves; where it may (``sums_agree``), an answer does
    not depend on it (the numpy kernels' split included)."""
    from mlx_dgemma import generate

    if not cpu_threads.sums_agree(cpu_threads.openblas()):
        pytest.skip("this OpenBLAS sums in another order on another thread count: its count is left alone")

    model, tokenizer = demo
    monkeypatch.setattr("mlx_dgemma.model.kernels.PARALLEL_MIN_ELEMENTS", 0)  # split every numpy pass
    answers = []
    for threads in (1, 2):
        with cpu_threads.pinned(threads):
            answers.append(generate(model, tokenizer, "sort: 9 4 7 1 8 2", seed=3, policy=policy, max_tokens=40))
            assert cpu_threads.openblas().openblas_get_num_threads() == threads  # the engine left it
    assert answers[0] == answers[1]
