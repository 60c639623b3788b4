"""The scheduler (priorities, budgets, back-pressure, failures, stats) and lazy async capture."""

import threading
import time

import numpy as np
import pytest
import torch

import forkpoint as fp
from forkpoint.engine import Budget, Priority, Scheduler
from forkpoint.engine.save import SaveOptions
from helpers.unpaced import encode_every_chunk
from forkpoint.engine.staging import StagingPool
from forkpoint.state.hooks import CaptureGuard
import procs


def test_idle_workers_sleep_until_a_task_comes():
    """With nothing queued the workers wait to be woken instead of polling: every open
    repository has a dozen of them, and a process with many open (a notebook, a test
    session) was slowed several times over by their wake-ups. A task queued later still runs,
    and one queued behind a used-up resource runs once the resource is given back."""
    sched = Scheduler(Budget(cpu_workers=1), threads=4, background_threads=1)
    picks = []
    pick = sched._pick
    sched._pick = lambda lane: (picks.append(1), pick(lane))[1]
    time.sleep(1.2)
    assert picks == []
    gate = threading.Event()
    first = sched.submit("x", gate.wait, priority=0, needs={"cpu": 1})
    second = sched.submit("x", lambda: "ran", priority=0, needs={"cpu": 1})
    gate.set()
    assert first.result(timeout=60) and second.result(timeout=60) == "ran"
    sched.shutdown()


def test_priorities_order_ready_tasks():
    sched = Scheduler(Budget(cpu_workers=1), threads=1)
    gate = threading.Event()
    blocker = sched.submit("x", gate.wait, priority=0, needs={"cpu": 1})
    order = []
    for prio, name in [(Priority.GC, "gc"), (Priority.FLUSH, "flush"), (Priority.COMMIT, "commit"),
                       (Priority.RESTORE, "restore")]:
        sched.submit(name, lambda n=name: order.append(n), priority=prio, needs={"cpu": 1})
    gate.set()
    sched.shutdown()
    assert blocker.done() and order == ["restore", "commit", "flush", "gc"]


def test_staging_budget_is_never_exceeded_and_leases_span_tasks():
    sched = Scheduler(Budget(staging_bytes=100, cpu_workers=4, default_io_slots=4), threads=8)
    in_use, peak, lock = [0], [0], threading.Lock()

    def grab(n):
        with lock:
            in_use[0] += n
            peak[0] = max(peak[0], in_use[0])
        time.sleep(0.01)

    def drop(n):
        time.sleep(0.01)
        with lock:
            in_use[0] -= n

    for i in range(30):
        n = 10 + (i % 4) * 10
        cap = sched.submit("capture", lambda n=n: grab(n), priority=Priority.CAPTURE,
                           needs={"staging": n, "cpu": 1}, frees={"cpu": 1}, nbytes=n)
        sched.submit("write", lambda n=n: drop(n), priority=Priority.WRITE, needs={"io:t": 1},
                     frees={"io:t": 1, "staging": n}, deps=[cap], nbytes=n, tier="t")
    sched.shutdown()
    stats = sched.stats()
    assert peak[0] <= 100 and stats["resources"]["staging"]["peak"] <= 100
    assert stats["resources"]["staging"]["used"] == 0
    assert stats["stages"]["write"]["done"] == 30 and stats["tiers"]["t"]["bytes_done"] == sum(
        10 + (i % 4) * 10 for i in range(30))


def test_failed_dependency_fails_dependents_and_returns_leases():
    sched = Scheduler(Budget(staging_bytes=10), threads=2)

    def boom():
        raise OSError("disk on fire")

    cap = sched.submit("capture", boom, priority=0, needs={"staging": 10}, frees={})
    write = sched.submit("write", lambda: 1, priority=1, frees={"staging": 10}, deps=[cap])
    after = sched.submit("commit", lambda: "ran", priority=2, after=[write])
    with pytest.raises(OSError, match="disk on fire"):
        write.result(5)
    assert after.result(5) == "ran"
    sched.shutdown()
    assert sched.stats()["resources"]["staging"]["used"] == 0


def test_a_dependent_starts_when_its_dependency_settles_not_at_the_next_event():
    """The workers are woken after a task's future is set: woken before, an idle worker found
    the dependent not ready and slept until some later event (here, up to 0.5 s)."""
    sched = Scheduler(Budget(cpu_workers=2), threads=2)
    gate = threading.Event()
    first = sched.submit("first", gate.wait, priority=0)
    settled = {}
    set_result = first.future.set_result

    def slow_set_result(result):
        time.sleep(0.05)
        settled["at"] = time.perf_counter()
        set_result(result)

    first.future.set_result = slow_set_result
    long = sched.submit("long", lambda: time.sleep(1.5), priority=1, deps=[first])
    dependent = sched.submit("dependent", time.perf_counter, priority=2, deps=[first])
    time.sleep(0.1)
    gate.set()
    started = dependent.result(5)
    assert started - settled["at"] < 0.25
    long.result(5)
    sched.shutdown()


def test_oversized_task_runs_alone():
    sched = Scheduler(Budget(staging_bytes=10), threads=2)
    t = sched.submit("capture", lambda: "big", priority=0, needs={"staging": 50})
    assert t.result(5) == "big"
    sched.shutdown()


def test_held_resources_inside_tasks_stay_within_their_budget():
    """Six tasks each encode twice under `hold("encode")` with a budget of two encoders: never
    more than two hold it at once, a holder that raises gives it back, stats show the peak."""
    sched = Scheduler(Budget(encoders=2), threads=6)
    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def work(fail):
        for _ in range(2):
            with sched.hold("encode"):
                with lock:
                    state["now"] += 1
                    state["peak"] = max(state["peak"], state["now"])
                time.sleep(0.02)
                with lock:
                    state["now"] -= 1
                if fail:
                    raise RuntimeError("encoder failed")

    tasks = [sched.submit("write", lambda f=(i == 0): work(f), priority=Priority.WRITE) for i in range(6)]
    for t in tasks[1:]:
        t.result(timeout=10)
    with pytest.raises(RuntimeError):
        tasks[0].result(timeout=10)
    stats = sched.stats()["resources"]["encode"]
    assert state["peak"] == 2 and stats["peak"] == 2 and stats["used"] == 0 and stats["capacity"] == 2
    sched.shutdown()


def test_background_tasks_run_only_on_their_lane_until_promoted():
    sched = Scheduler(Budget(), threads=3, background_threads=1)
    gate, ran = threading.Event(), {}

    def blocker():
        ran["blocker"] = threading.current_thread().name
        gate.wait(10)

    first = sched.submit("encode", blocker, priority=Priority.FLUSH, background=True)
    second = sched.submit("encode", lambda: threading.current_thread().name,
                          priority=Priority.FLUSH, background=True)
    ordinary = sched.submit("write", lambda: threading.current_thread().name, priority=Priority.GC)
    assert "background" not in ordinary.result(5)
    time.sleep(0.2)
    assert not second.done(), "a background task ran beside a busy background lane"
    assert "background" in ran["blocker"]
    sched.promote([second])
    assert "background" not in second.result(5)
    gate.set()
    first.result(5)
    sched.shutdown()


def test_a_pick_does_not_walk_waiting_or_blocked_tasks(monkeypatch):
    """Tasks waiting on dependencies and tasks whose resource is used up are not looked at by
    each pick: with 3000 of each queued, a task that fits runs after a few budget checks (a
    walk over the queue, as before, made every pick cost thousands and a save of N chunks
    cost N squared)."""
    sched = Scheduler(Budget(cpu_workers=1), threads=2)
    gate = threading.Event()
    blocker = sched.submit("hold", gate.wait, priority=0, needs={"cpu": 1})
    while not sched.stats()["resources"]["cpu"]["used"]:
        time.sleep(0.01)
    blocked = [sched.submit("capture", int, priority=0, needs={"cpu": 1}) for _ in range(3000)]
    waiting = [sched.submit("write", int, priority=0, deps=[blocker]) for _ in range(3000)]
    checks = []
    real_fits = Scheduler._fits
    monkeypatch.setattr(Scheduler, "_fits", lambda self, needs: checks.append(needs) or real_fits(self, needs))
    probe = sched.submit("probe", lambda: "ran", priority=Priority.GC, needs={"io:t": 1})
    assert probe.result(5) == "ran"
    assert len(checks) < 50
    gate.set()
    assert all(t.result(10) == 0 for t in blocked + waiting)
    sched.shutdown()


def test_a_task_may_wait_for_tasks_of_another_scheduler():
    """A dependency owned by another scheduler (another repository in the process) holds the
    task back until it finishes; the task then runs on its own scheduler's threads, and a
    failure there fails it."""
    first, second = Scheduler(threads=2, name="first"), Scheduler(threads=2, name="second")
    gate = threading.Event()
    upstream = first.submit("up", lambda: gate.wait(10) and "up", priority=0)
    failing = first.submit("bad", lambda: gate.wait(10) and 1 / 0, priority=0)
    down = second.submit("down", lambda: threading.current_thread().name, priority=0, deps=[upstream])
    doomed = second.submit("doomed", int, priority=0, deps=[failing])
    late = second.submit("late", lambda: "late", priority=0, after=[failing])
    time.sleep(0.2)
    assert not (down.done() or doomed.done() or late.done())
    gate.set()
    assert down.result(5).startswith("second")
    with pytest.raises(ZeroDivisionError):
        doomed.result(5)
    assert late.result(5) == "late"
    settled = second.submit("settled", lambda: "ran", priority=0, deps=[upstream])
    assert settled.result(5) == "ran"
    first.shutdown()
    second.shutdown()


def test_random_dags_keep_dependencies_budgets_and_failures():
    """Random DAGs with random needs, failures and `after` edges: each task starts only after
    its dependencies, no budget is exceeded (tasks count their own use), a failure reaches
    every task that depends on it and nothing else, and every task ends."""
    import random

    rng = random.Random(7)
    caps = {"cpu": 2, "io:a": 3, "staging": 100}
    sched = Scheduler(Budget(cpu_workers=2, staging_bytes=100, io_slots={"a": 3}), threads=6,
                      background_threads=2)
    lock, use, over = threading.Lock(), dict.fromkeys(caps, 0), []
    tasks, doomed = [], set()

    def body(i, needs, deps, fail):
        with lock:
            if not all(tasks[d].done() for d in deps):
                over.append(f"task {i} started before its dependencies")
            for r, n in needs.items():
                use[r] += n
                if use[r] > caps[r] and n <= caps[r]:
                    over.append(f"{r} at {use[r]}")
        time.sleep(rng.random() * 0.002)
        with lock:
            for r, n in needs.items():
                use[r] -= n
        if fail:
            raise ValueError(f"task {i}")
        return i

    for i in range(400):
        deps = rng.sample(range(i), k=min(i, rng.randint(0, 3)))
        after = rng.sample(range(i), k=min(i, rng.randint(0, 1)))
        needs = {r: rng.randint(0, cap) for r, cap in caps.items() if rng.random() < 0.5}
        fail = rng.random() < 0.03
        if fail or any(d in doomed for d in deps):
            doomed.add(i)
        task = sched.submit("t", lambda i=i, n=needs, d=deps + after, f=fail: body(i, n, d, f),
                            priority=rng.randint(0, 7), needs=needs, deps=[tasks[d] for d in deps],
                            after=[tasks[a] for a in after], background=rng.random() < 0.2)
        tasks.append(task)
        if rng.random() < 0.05:
            sched.promote(rng.sample(tasks, k=min(3, len(tasks))))
    for i, task in enumerate(tasks):
        if i in doomed:
            with pytest.raises(ValueError):
                task.result(30)
        else:
            assert task.result(30) == i
    sched.shutdown()
    assert not over and doomed
    assert sched.stats()["queued"] == 0 and all(v["used"] == 0 for v in sched.stats()["resources"].values())


def test_finished_saves_leave_nothing_reachable_behind(tmp_path):
    """Each commit waits for the one before it; a finished task must not keep that chain (every
    task, closure and leaf record of every earlier save) reachable."""
    import gc

    from forkpoint.engine.scheduler import Task
    from forkpoint.format.manifest import Leaf

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.history.cache.limit = 3  # leaf tables kept in memory (MANIFESTS_CACHED in use)
    state = {f"w{i}": torch.randn(50_000) for i in range(20)}

    def alive_after(saves: int) -> tuple[int, int]:
        for i in range(saves):
            if i % 2:
                repo.save(state, step=i)
            else:
                repo.save(state, step=i, sync=False).wait()
        repo.drain()
        gc.collect()
        live = [type(o) for o in gc.get_objects()]
        return live.count(Task), live.count(Leaf)

    tasks, leaves = alive_after(4)
    assert alive_after(8) <= (tasks, leaves)
    assert len(repo.log()) == 12 and [v.step for v in repo.versions()][-2:] == [6, 7]
    repo.close()


def test_a_lossless_save_encodes_within_the_encoder_budget(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless", encode_later=False)
    assert repo.stats()["resources"]["encode"]["capacity"] >= 1
    state = {f"w{i}": torch.randn(1 << 18) for i in range(8)}
    v = repo.save(state)
    encode = repo.stats()["resources"]["encode"]
    assert 1 <= encode["peak"] <= encode["capacity"] and encode["used"] == 0
    assert {c.codec for leaf in repo.manifest(v.id).leaves for c in leaf.chunks} == {"float-planes"}


def _count_encodes(monkeypatch) -> list:
    """A list that gets one entry per chunk a save encodes."""
    from forkpoint.engine.objectwriter import ObjectWriter

    real = ObjectWriter._encode
    seen = []

    def counted(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ObjectWriter, "_encode", counted)
    return seen


def _save_with_object_writes_held(repo, monkeypatch, state, sync: bool, seen: list, held: int):
    """Save `state` in a thread while every object write waits; once `held` encodes are `seen`
    (or 30 s passed) and half a second more, let the writes go. (version, encodes seen while
    the writes were held)."""
    gate = threading.Event()
    real_write = repo.store.write

    def gated(key, parts, durable=True):
        if key.startswith("objects/"):
            gate.wait(60)
        return real_write(key, parts, durable)

    monkeypatch.setattr(repo.store, "write", gated)
    saved = []
    saver = threading.Thread(target=lambda: saved.append(repo.save(state, sync=sync)))
    saver.start()
    deadline = time.monotonic() + 30
    while len(seen) < held and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)
    encoded_while_held = len(seen)
    gate.set()
    saver.join()
    return (saved[0] if sync else saved[0].wait()), encoded_while_held


@pytest.mark.parametrize("sync", [True, False])
def test_chunks_are_encoded_while_every_write_to_the_store_waits(tmp_path, monkeypatch, sync):
    """Encoding a chunk takes no I/O slot: with every object write held back, chunks still get
    encoded beyond the I/O slots (before, the writes that held the slots kept the rest waiting),
    up to the budget of chunks encoded and not yet written (their payloads' memory). A chunk
    the store already holds is not encoded again. (The store does not pace: every chunk is encoded.)"""
    repo = encode_every_chunk(fp.Repo(str(tmp_path / "r"), create=True, codec="lossless"))
    seen = _count_encodes(monkeypatch)
    slots, ahead = repo.scheduler.limit("io:tier0"), repo.scheduler.limit("encoded")
    chunks = 2 * ahead
    state = {f"w{i}": torch.randn(1 << 19) for i in range(chunks)}
    first, encoded_while_held = _save_with_object_writes_held(repo, monkeypatch, state, sync, seen, ahead)
    assert slots < ahead and encoded_while_held == ahead and len(seen) == chunks
    seen.clear()
    state["w0"] += 1
    second = repo.save(state, sync=sync)
    second = second.wait() if not sync else second
    assert len(seen) == 1
    for v in (first, second):
        assert {c.codec for leaf in repo.manifest(v.id).leaves for c in leaf.chunks} == {"float-planes"}
    assert torch.equal(repo.load(second.id)["w0"], state["w0"]) and torch.equal(repo.load(first.id)["w1"], state["w1"])
    repo.close()


def test_the_pacer_encodes_only_while_the_store_has_writes_waiting():
    from forkpoint.engine.pacing import EncodePacer

    pacer = EncodePacer(slots=3, cores=1 << 10)  # so many cores that the CPU is never short
    for _ in range(5):
        pacer.add()
    assert pacer.least == 6 and pacer.encodes()  # too few chunks to pace: all encoded
    pacer.add()
    decisions = []
    for _ in range(5):
        decisions.append(pacer.encodes())
        pacer.ready()
    assert decisions == [False, False, False, True, True] and pacer.waiting == 5
    for _ in range(3):
        pacer.written()
    assert not pacer.encodes() and (pacer.encoded, pacer.raw) == (3, 4)
    off = EncodePacer(slots=3, enabled=False)
    for _ in range(10):
        off.add()
    assert off.encodes() and off.raw == 0


def test_after_a_save_the_store_bound_the_next_encodes_its_first_chunks():
    """The first slots' worth of a save's chunks find nothing waiting. Where the last save
    encoded 90% of its chunks past its start-up (the store bound it), they are encoded, and up
    to twice the slots, chunks still in their capture count as waiting. A save that wrote
    more than a tenth of those chunks raw makes the next one wait for a backlog again."""
    from forkpoint.engine.pacing import EncodePacer, PaceMemory

    memory = PaceMemory()

    def paced(chunks: int, ready: bool, drained_before: tuple = ()) -> list[bool]:
        pacer = EncodePacer(slots=3, cores=1 << 10, memory=memory)
        for _ in range(chunks):
            pacer.add()
        decisions = []
        for i in range(chunks):
            if i in drained_before:  # writes end until one slot is free
                for _ in range(pacer.waiting - pacer.slots + 1):
                    pacer.written()
            decisions.append(pacer.encodes())
            if ready:
                pacer.ready()
        pacer.finish()
        return decisions

    assert paced(8, ready=True) == [False] * 3 + [True] * 5 and memory.store_bound
    # primed: the first three encode, the next three find three captures under way
    assert paced(8, ready=False) == [True] * 6 + [False] * 2 and not memory.store_bound
    assert paced(8, ready=True) == [False] * 3 + [True] * 5 and memory.store_bound
    # past the start-up, 8 of 10 encoded (a slot fell free twice): not bound enough
    decisions = paced(16, ready=True, drained_before=(10, 13))
    assert decisions[6:].count(False) == 2 and decisions[:3] == [True] * 3 and not memory.store_bound
    assert paced(8, ready=True)[:3] == [False] * 3
    unpaced = EncodePacer(slots=3, enabled=False, memory=memory)
    for _ in range(8):
        unpaced.add()
        unpaced.encodes()
    unpaced.finish()
    assert memory.store_bound  # a save that was not paced teaches nothing


def _timed_saves(memory, seconds: dict, count: int, slow: tuple = ()) -> list[bool]:
    """`count` saves of 16 chunks of 1 MiB paced with `memory`, each taking `seconds[way]`
    (True: paced, False: written raw) by its clock, twice that for the saves numbered in
    `slow`; the way each took. Every chunk finds the slots full, so a paced save encodes them
    all and a raw one none."""
    from forkpoint.engine.pacing import EncodePacer

    ways = []
    for i in range(count):
        pacer = EncodePacer(slots=3, cores=1 << 10, memory=memory)
        for _ in range(16):
            pacer.add(1 << 20)
        pacer.waiting = 3
        decisions = {pacer.encodes() for _ in range(16)}
        assert decisions == {pacer.paced}
        pacer.started = time.perf_counter() - seconds[pacer.paced] * (2 if i in slow else 1)
        pacer.finish()
        ways.append(pacer.paced)
    return ways


def test_a_repository_writes_raw_while_its_raw_saves_measure_faster_than_paced_ones():
    """The process's first save is paced and not timed, the second is paced, the third written
    raw, each timed. Raw 25% faster: the next saves are raw, paced tried again every 8th,
    then every 16th while it stays slower. Raw only 10% faster (within PACED_MARGIN): saves
    stay paced, raw retried every 8th, then 16th, even where one paced save took twice as
    long (each way is judged by the median of its last saves). Small saves time nothing."""
    from forkpoint.engine.pacing import EncodePacer, PaceMemory

    slower = PaceMemory()
    ways = _timed_saves(slower, {True: 1.0, False: 0.8}, 28)
    assert ways[:3] == [True, True, False]
    assert [i for i, way in enumerate(ways) if way] == [0, 1, 10, 26]
    near = PaceMemory()
    ways = _timed_saves(near, {True: 1.0, False: 0.9}, 28, slow=(5,))
    assert [i for i, way in enumerate(ways) if not way] == [2, 10, 26]
    small = PaceMemory()
    for _ in range(4):
        pacer = EncodePacer(slots=3, memory=small)
        for _ in range(16):
            pacer.add(256 << 10)  # 4 MiB in all: too little to time
        assert pacer.paced
        pacer.finish()
    assert small.ways.rates == {}


class _SetLoad:
    """A CoreLoad whose measure the test sets."""

    def __init__(self, measure):
        self.last = measure

    def measure(self):
        return self.last


def test_the_pacer_writes_raw_while_the_process_keeps_its_cores_busy():
    """Full slots, but the process used all its cores (one, here) over the last window: the CPU
    is short, so the chunk is written raw; after an idle spell it is encoded again. (The
    clocks are the test's: wall and CPU seconds set, not measured.)"""
    from forkpoint.engine.cpuload import LoadMeasure
    from forkpoint.engine.pacing import CPU_WINDOW, EncodePacer

    clocks = {"wall": 100.0, "cpu": 5.0}
    pacer = EncodePacer(slots=1, least=1, cores=1, load=_SetLoad(LoadMeasure()),  # this process's use alone
                        clock=lambda: (clocks["wall"], clocks["cpu"]))
    pacer.add()
    pacer.ready()
    assert pacer.encodes()  # the first look only marks the clocks
    clocks["wall"] += 2 * CPU_WINDOW
    clocks["cpu"] += 2 * CPU_WINDOW  # one core busy throughout
    assert not pacer.encodes(), "a process keeping its cores busy gets its chunks written raw"
    clocks["wall"] += 2 * CPU_WINDOW
    clocks["cpu"] += 0.1 * CPU_WINDOW
    assert pacer.encodes(), "after an idle spell chunks are encoded again"


def test_the_pacer_counts_what_other_processes_take_of_its_cores():
    """Full slots and an idle process: a measure within the save of two cores all busy has the
    chunk written raw; one begun before the save counts only the others' part (a training step
    of this process between saves is not the save's load): 1.9 cores busy, 0.2 of them others,
    encodes; 1.9 others does not."""
    from forkpoint.engine.cpuload import LoadMeasure
    from forkpoint.engine.pacing import CPU_WINDOW, EncodePacer

    def verdict(measure_at):
        now = [50.0]
        pacer = EncodePacer(slots=1, least=1, cores=2, load=_SetLoad(None), clock=lambda: (now[0], 7.0))
        pacer.load.last = measure_at(pacer.started)
        pacer.add()
        pacer.ready()
        pacer.encodes()
        now[0] += 2 * CPU_WINDOW
        return pacer.encodes()

    assert verdict(lambda t0: LoadMeasure(t0, others=0.1, total=0.3))
    assert not verdict(lambda t0: LoadMeasure(t0 + 0.01, others=0.2, total=1.9))
    assert verdict(lambda t0: LoadMeasure(t0 - 1.0, others=0.2, total=1.9))
    assert not verdict(lambda t0: LoadMeasure(t0 - 1.0, others=1.9, total=1.95))


def test_the_pacer_writes_raw_while_other_processes_keep_its_cores_busy():
    """The cores' idle counters stand still (other processes keep both cores busy) though this
    process idles: the measure shows two cores taken by others, and a paced chunk with every
    slot full is written raw; once the cores idle again, chunks are encoded. (The counters and
    clocks are the test's.)"""
    from forkpoint.engine.cpuload import LOAD_WINDOW, CoreLoad
    from forkpoint.engine.pacing import EncodePacer

    t = {"wall": 10.0, "idle": 1000.0}
    load = CoreLoad(idle=lambda: (t["idle"], 2), clock=lambda: t["wall"], cpu=lambda: 3.0)
    load.measure()
    t["wall"] += 3 * LOAD_WINDOW
    assert load.measure().others == pytest.approx(2.0)
    pacer = EncodePacer(slots=1, least=1, cores=2, load=load, clock=lambda: (t["wall"], 3.0))
    pacer.add()
    pacer.ready()
    pacer.encodes()
    t["wall"] += 3 * LOAD_WINDOW
    assert not pacer.encodes(), "cores busy with other processes: written raw"
    t["wall"] += 3 * LOAD_WINDOW
    t["idle"] += 2 * 3 * LOAD_WINDOW
    assert pacer.encodes(), "cores idle again: encoded"


def test_the_cores_idle_counters_are_read_from_the_system():
    """The one measure that reads the machine: the system's counters give idle seconds (since
    boot) for the cores this process may use."""
    from forkpoint.engine.cpuload import _affinity, idle_seconds

    first = idle_seconds(_affinity())
    assert first is not None and first[1] >= 1 and first[0] > 0


@pytest.mark.parametrize("sync", [True, False])
def test_a_paced_save_writes_raw_what_its_turn_finds_the_store_idle_for(tmp_path, monkeypatch, sync):
    """With every object write held back, the backlog grows one chunk per capture: the first
    I/O slots' worth of chunks (one more where a capture started while the one before it was
    still running) are written raw, since a free slot means the save is not bound by the store;
    the rest are encoded. The version round-trips exactly and records each chunk's codec. (The
    process is given so many cores that its CPU is never short: the count rule alone.)"""
    from forkpoint.engine import scheduler
    from forkpoint.engine.pacing import EncodePacer

    monkeypatch.setattr(scheduler, "usable_cores", lambda: 1 << 10)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    seen = _count_encodes(monkeypatch)
    decisions = []
    decide = EncodePacer.encodes
    monkeypatch.setattr(EncodePacer, "encodes", lambda pacer: decisions.append(decide(pacer)) or decisions[-1])
    slots, ahead, encoders = (repo.scheduler.limit(r) for r in ("io:tier0", "encoded", "encode"))
    state = {f"w{i}": torch.randn(1 << 19) for i in range(2 * ahead)}
    version, encoded_while_held = _save_with_object_writes_held(repo, monkeypatch, state, sync, seen,
                                                               ahead - slots - encoders + 1)
    assert ahead - slots - encoders + 1 <= encoded_while_held <= ahead - slots
    codecs = [c.codec for leaf in repo.manifest(version.id).leaves for c in leaf.chunks]
    assert codecs.count("raw") == len(codecs) - len(seen) >= slots and "float-planes" in codecs
    loaded = repo.load(version.id)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert decisions[:slots] == [False] * slots
    repo.close()


def _store_bound_pacer(memory, slots: int, chunks: int, clock: list) -> list[bool]:
    """Run one save's worth of pacer events against a store that bounds it throughout: every
    chunk is counted at scheduling, and a write ends only when more than `slots` captured
    chunks wait. The cores are idle (the test's counters) and the clocks are the test's, which
    advance 10 ms a chunk. The pacer's decisions, in order."""
    from forkpoint.engine.cpuload import CoreLoad
    from forkpoint.engine.pacing import EncodePacer

    load = CoreLoad(idle=lambda: (2 * clock[0], 2), clock=lambda: clock[0], cpu=lambda: 0.0)
    pacer = EncodePacer(slots=slots, cores=2, load=load, memory=memory, clock=lambda: (clock[0], 0.0))
    for _ in range(chunks):
        pacer.add(1 << 20)
    decisions = []
    for _ in range(chunks):
        decisions.append(pacer.encodes())
        pacer.ready()
        if pacer.waiting > slots:
            pacer.written()
        clock[0] += 0.01
    while pacer.waiting:
        pacer.written()
    pacer.finish()
    return decisions


def test_a_save_after_one_a_slow_store_bound_encodes_its_first_chunks():
    """A store that bounds the whole save: the first save writes its first slots' worth of
    chunks raw (nothing waits yet) and encodes the rest; it remembers that the store bound it,
    so the next save encodes from its first chunk, before any write waits."""
    from forkpoint.engine.pacing import PaceMemory

    slots, memory, clock = 4, PaceMemory(), [100.0]
    before = _store_bound_pacer(memory, slots, 8 * slots, clock)
    assert before == [False] * slots + [True] * 7 * slots
    assert memory.store_bound and memory.warm
    after = _store_bound_pacer(memory, slots, 8 * slots, clock)
    assert after == [True] * 8 * slots


@pytest.mark.parametrize("sync", [True, False])
def test_a_save_that_remembers_a_store_bound_encodes_its_first_chunks_with_the_writes_held(tmp_path, monkeypatch,
                                                                                           sync):
    """The repository's pace memory says the store bound its last save: with every object write
    held back (nothing waits for a slot yet), the save's first slots' worth of chunks are
    encoded all the same, and the version restores exactly. (The process is given so many
    cores that its CPU is never short.)"""
    from forkpoint.engine import scheduler
    from forkpoint.engine.pacing import EncodePacer

    monkeypatch.setattr(scheduler, "usable_cores", lambda: 1 << 10)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    repo._pacing.store_bound = repo._pacing.warm = True
    seen = _count_encodes(monkeypatch)
    decisions = []
    decide = EncodePacer.encodes
    monkeypatch.setattr(EncodePacer, "encodes", lambda pacer: decisions.append(decide(pacer)) or decisions[-1])
    slots = repo.scheduler.limit("io:tier0")
    state = {f"w{i}": torch.randn(1 << 18) for i in range(8 * slots)}
    version, encoded_while_held = _save_with_object_writes_held(repo, monkeypatch, state, sync, seen, slots)
    assert decisions[:slots] == [True] * slots and encoded_while_held >= slots
    loaded = repo.load(version.id)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    repo.close()


def test_where_encoding_makes_saves_slower_a_repository_writes_them_raw(tmp_path, monkeypatch):
    """Object writes take 20 ms (the store bounds the save, so a paced save encodes) and each
    encode 60 ms more (so encoding makes it slower than a raw save). The first two saves are
    paced, the third is written raw and measures faster: the fourth is written raw too. Every
    version restores exactly, and a raw way's chunks record codec raw. The pacer's clock counts
    only those simulated costs (the writes as if the store's slots overlapped them), so the
    rates it measures do not depend on how busy the machine is."""
    from forkpoint.engine import pacing, scheduler
    from forkpoint.engine.objectwriter import ObjectWriter

    monkeypatch.setattr(scheduler, "usable_cores", lambda: 1 << 10)
    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    slots = repo.scheduler.limit("io:tier0")
    simulated, lock = [0.0], threading.Lock()

    def spend(seconds: float, counted: float) -> None:
        time.sleep(seconds)
        with lock:
            simulated[0] += counted

    monkeypatch.setattr(pacing, "process_clocks", lambda: (simulated[0], 0.0))
    write = repo.store.write
    monkeypatch.setattr(repo.store, "write", lambda key, parts, durable=True: (
        spend(0.02, 0.02 / slots) if key.startswith("objects/") else None, write(key, parts, durable))[1])
    encode = ObjectWriter.encode_ahead
    monkeypatch.setattr(ObjectWriter, "encode_ahead", lambda *a, **k: (spend(0.06, 0.06), encode(*a, **k))[1])
    state = {f"w{i}": torch.randn(1 << 18) for i in range(4 * slots)}
    saves = []
    for _ in range(4):
        saves.append((repo.save(state), {k: v.clone() for k, v in state.items()}))
        state = {k: v * 2 for k, v in state.items()}
    encoded = [sum(c.codec != "raw" for leaf in repo.manifest(v.id).leaves for c in leaf.chunks) for v, _ in saves]
    assert encoded[1] > 0 and encoded[2:] == [0, 0], encoded
    assert repo._pacing.ways.rates[False] > repo._pacing.ways.rates[True]
    for version, values in saves:
        loaded = repo.load(version.id)
        assert all(torch.equal(loaded[k], v) for k, v in values.items())
    repo.close()


def test_saves_to_memory_encode_every_chunk_unpaced():
    """Writes to memory never wait, so a paced save there would write nearly every chunk raw:
    the memory store is not paced, and its lossless saves encode every chunk."""
    repo = fp.Repo("mem://unpaced-lossless", create=True, codec="lossless")
    state = {f"w{i}": torch.randn(1 << 18) for i in range(4 * repo.scheduler.limit("io:tier0"))}
    version = repo.save(state)
    assert {c.codec for leaf in repo.manifest(version.id).leaves for c in leaf.chunks} == {"float-planes"}
    assert torch.equal(repo.load(version.id)["w5"], state["w5"])
    repo.close()


def test_a_store_that_does_not_pace_has_every_chunk_encoded_even_behind_a_slow_encoder(tmp_path, monkeypatch):
    """An encoder far slower than the store: where the store does not pace encoding, every
    chunk of a lossless save is encoded anyway (the chunks' decisions are the pacer's own
    elsewhere, tested with its inputs set)."""
    from forkpoint.engine.objectwriter import ObjectWriter

    real = ObjectWriter._encode
    monkeypatch.setattr(ObjectWriter, "_encode", lambda *a, **k: (time.sleep(0.05), real(*a, **k))[1])
    state = {f"w{i}": torch.randn(1 << 18) for i in range(32)}
    repo = encode_every_chunk(fp.Repo(str(tmp_path / "r"), create=True, codec="lossless"))
    version = repo.save(state)
    assert {c.codec for leaf in repo.manifest(version.id).leaves for c in leaf.chunks} == {"float-planes"}
    assert all(torch.equal(repo.load(version.id)[k], v) for k, v in state.items())
    repo.close()


@pytest.mark.parametrize("sync", [True, False])
def test_a_failed_encode_fails_the_save_and_gives_every_buffer_back(tmp_path, monkeypatch, sync):
    from forkpoint.engine.objectwriter import ObjectWriter

    repo = fp.Repo(str(tmp_path / "r"), create=True, codec="lossless")
    state = {f"w{i}": torch.randn(1 << 19) for i in range(4)}
    kept = repo.save(state, step=1)
    real = ObjectWriter._encode
    calls = [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("encoder out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(ObjectWriter, "_encode", failing)
    for t in state.values():
        t.mul_(2)
    with pytest.raises(MemoryError, match="simulated"):
        pending = repo.save(state, step=2, sync=sync)
        if not sync:
            pending.wait()
    repo.drain()
    assert repo.head("main") == kept.id and torch.equal(repo.load(kept.id)["w3"], state["w3"] / 2)
    resources = repo.stats()["resources"]
    assert all(resources[r]["used"] == 0 for r in ("staging", "window", "encode", "io:tier0")), resources
    assert repo.staging.outstanding == 0
    monkeypatch.setattr(ObjectWriter, "_encode", real)
    assert repo.save(state, step=3).step == 3
    repo.close()


def test_a_repository_dropped_unclosed_stops_its_threads_once_collected(tmp_path):
    """A repository the program drops without close(), once its async save has committed (the
    save's tasks hold it till then), is collected, and its scheduler's threads then end. A
    closed one's threads end at close, as before."""
    import gc
    import weakref

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.save({"w": torch.arange(1000.0)})
    pending = repo.save({"w": torch.arange(1000.0) * 2}, sync=False)
    pending.wait()
    threads, collected = list(repo.scheduler.threads), weakref.ref(repo)
    assert threads and all(t.is_alive() for t in threads)
    del repo, pending
    gc.collect()
    assert collected() is None
    deadline = time.monotonic() + 60  # a hang guard: they end as soon as the stop runs
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads)
    reopened = fp.Repo(str(tmp_path / "r"))
    assert torch.equal(reopened.load("main")["w"], torch.arange(1000.0) * 2)
    assert len(reopened.log("main")) == 2
    closed_threads = list(reopened.scheduler.threads)
    reopened.close()
    assert not any(t.is_alive() for t in closed_threads)


def test_a_save_in_flight_when_the_program_ends_commits_before_exit(tmp_path):
    """A program that starts an asynchronous save and ends without waiting for it or closing the
    repository still commits it: repositories left open are closed at interpreter exit."""
    import sys

    script = (
        "import sys, torch, forkpoint as fp\n"
        "repo = fp.Repo(sys.argv[1], create=True, codec='lossless')\n"
        "state = {f'w{i}': torch.full((1 << 20,), float(i)) for i in range(24)}\n"
        "repo.save(state, step=7, sync=False)\n"
    )
    path = str(tmp_path / "r")
    done = procs.run([sys.executable, "-c", script, path], timeout=procs.CHILD_SECONDS)
    assert done.returncode == 0, done.stderr[-2000:]
    repo = fp.Repo(path)
    assert repo.version(repo.head("main")).step == 7
    assert torch.equal(repo.load("main")["w23"], torch.full((1 << 20,), 23.0))
    repo.close()


def test_asynchronous_saves_in_flight_are_bounded(tmp_path):
    """Saves asked for faster than they commit wait for the oldest instead of piling up."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    real_barrier = repo.store.barrier

    def slow_commit(keys):
        keys = list(keys)
        if any(k.startswith("versions/") for k in keys):
            time.sleep(0.2)
        return real_barrier(keys)

    repo.store.barrier = slow_commit
    pending = []
    for i in range(6):
        pending.append(repo.save({"i": np.full(10, i)}, step=i, sync=False))
        assert sum(not p.done() for p in pending) <= repo.options.max_pending == 2
    assert [p.wait().step for p in pending] == list(range(6))
    assert [v.step for v in repo.log()] == list(range(5, -1, -1))
    assert np.array_equal(repo.load("main")["i"], np.full(10, 5))
    repo.options.max_pending = 1
    for i in range(6, 9):
        pending.append(repo.save({"i": np.full(10, i)}, step=i, sync=False))
        assert pending[-2].done(), "each asynchronous save waits for the one before to commit"
        assert sum(not p.done() for p in pending) <= 1
    assert pending[-1].wait().step == 8
    repo.close()
    shared = SaveOptions(chunk_bytes=1 << 20)
    both = fp.Repo(str(tmp_path / "both"), create=True, codec="lossless", options=shared, delta=True)
    assert (both.options.codec, both.options.chunk_bytes, both.options.delta) == ("lossless", 1 << 20, fp.Delta())
    assert shared == SaveOptions(chunk_bytes=1 << 20), "the caller's options are not changed"
    leaf = both.manifest(both.save({"w": np.ones(300_000, np.float32)}).id).leaves[0]
    assert len(leaf.chunks) == 2 and {c.codec for c in leaf.chunks} == {"float-planes"}
    both.close()
    for bad in ({"max_pending": 0}, {"chunk_bytes": 0}, {"chunk_bytes": 1}, {"workers": 1.5}, {"staging_bytes": -1}):
        with pytest.raises(ValueError, match=f"SaveOptions.{next(iter(bad))} must be an int >= "):
            SaveOptions(**bad)


def test_staging_pool_reuses_and_respects_limit():
    pool = StagingPool(limit=100)
    a = pool.get(60)
    pool.give(a)
    assert pool.get(60) is a
    b = pool.get(50)
    pool.give(a)
    pool.give(b)
    assert pool.kept <= 100


def test_async_save_captures_state_at_call_time_with_hooks(repo):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = fp.Checkpointer(repo, {"model": model, "optim": opt}, every=1)
    expected = {}
    for step in range(6):
        loss = model(torch.randn(32, 512)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected[step] = {k: v.clone() for k, v in model.state_dict().items()}
        ck.step(step)
    ck.close()
    for v in repo.log():
        saved = repo.load(v.id)["model"]
        for k, t in expected[v.step].items():
            assert torch.equal(saved[k], t), (v.step, k)
    assert repo.stats()["stages"]["capture"]["done"] > 0


def test_state_larger_than_staging_budget_streams(tmp_path):
    budget = 4 << 20
    repo = fp.Repo(str(tmp_path / "r"), create=True,
                   options=SaveOptions(staging_bytes=budget, chunk_bytes=1 << 20))
    state = {f"w{i}": torch.randn(1 << 20) for i in range(10)}
    pending = repo.save(state, sync=False)
    pending.wait_capture()
    for t in state.values():
        t.zero_()
    v = pending.wait()
    stats = repo.stats()
    assert stats["resources"]["staging"]["peak"] <= budget
    assert v.logical_bytes == 40 << 20
    out = repo.load()
    torch.manual_seed(0)
    assert not torch.equal(out["w0"], torch.zeros(1 << 20))
    repo.close()


def test_async_save_errors_surface_and_next_save_works(tmp_path, monkeypatch):
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    real = repo.store.write
    calls = [0]

    def failing(key, parts, durable=True):
        calls[0] += key.startswith("objects/")
        if key.startswith("objects/") and calls[0] == 1:
            raise fp.errors.StorageFullError("no space left (simulated)")
        return real(key, parts, durable)

    monkeypatch.setattr(repo.store, "write", failing)
    p = repo.save({"w": np.ones(10)}, sync=False)
    with pytest.raises(fp.errors.StorageFullError):
        p.wait()
    assert repo.head("main") is None
    assert repo.save({"w": np.ones(10)}, step=1).step == 1
    assert repo.stats()["resources"]["staging"]["used"] == 0
    repo.close()


def test_warm_staging_prepares_exactly_the_buffers_a_save_uses(tmp_path):
    repo = fp.Repo(str(tmp_path / "r"), create=True, options=SaveOptions(chunk_bytes=1 << 20))
    state = {"big": torch.randn(3 << 18), "small": torch.randn(100), "n": 3}
    warmed = repo.warm_staging(state)
    assert warmed == repo.staging.kept == 3 * (1 << 20) + 400
    kept_before = {size: list(bufs) for size, bufs in repo.staging.free.items()}
    pending = repo.save(state, sync=False)
    pending.wait()
    reused = sum(1 for size, bufs in kept_before.items() for b in bufs
                 if any(b is x for x in repo.staging.free.get(size, [])))
    assert reused == 4, "every staging buffer of the save came from the warmed pool"
    assert torch.equal(repo.load()["big"], state["big"])
    repo.close()


class _DeviceFence:
    """Stands for a device-to-host copy in flight: records how the guard treated it."""

    def __init__(self):
        self.ordered = self.waited = 0

    def done(self):
        return False

    def order(self):
        self.ordered += 1

    def result(self):
        self.waited += 1


def test_guard_orders_device_copies_in_hooks_and_blocks_only_on_explicit_wait():
    guard = CaptureGuard()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fence = _DeviceFence()
    guard.add({model.weight.data_ptr(): [fence]})
    guard.install([opt])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert (fence.ordered, fence.waited) == (1, 0)
    assert guard.waited == 0.0
    guard.wait()
    assert (fence.ordered, fence.waited) == (1, 1)
    guard.remove()


def test_host_leaves_never_wait_for_device_copies_in_a_shared_pack(tmp_path):
    """Small host leaves (AdamW's step counters) and small device leaves (biases) go to
    different packs, so the capture of a host leaf, which the optimizer hook waits for on the
    host, never waits for a device-to-host copy still queued behind the device's work."""
    from forkpoint.engine.save import layout, schedule_save
    from forkpoint.state.flatten import flatten
    from forkpoint.storage.memory import MemoryStore

    released = threading.Event()

    class SlowCopy:
        def wait(self):
            released.wait(30)

        def release(self):
            pass

    state = {"bias": torch.randn(300), "step": torch.tensor(7.0), "other": torch.randn(50)}
    _, flat = flatten(state, copy=False)
    flat[0].data.device, flat[0].data.pending = "cuda:0", SlowCopy()
    packs = [[i for i, _, _ in members] for kind, (members, _) in layout(flat, SaveOptions()) if kind == "pack"]
    assert sorted(packs) == [[0], [1, 2]], packs

    sched = Scheduler(Budget())
    try:
        plan = schedule_save(sched, MemoryStore("mem://pack-test"), "t0", flat, {}, SaveOptions(),
                             StagingPool(1 << 30), "staging")
        host_captures = plan.captures[1] + plan.captures[2]
        for task in host_captures:
            task.result(timeout=10)
        assert not any(t.done() for t in plan.captures[0]), "the device leaf's pack waits for its copy"
    finally:
        released.set()
        sched.shutdown()


def test_deferred_device_copies_cover_exactly_the_bytes_this_process_stores():
    """A distributed save launches each device copy for the pieces its rank writes: the row
    ranges of its chunks, whole small leaves of its packs, nothing for leaves it does not write."""
    from forkpoint.engine.save import launch_device_copies, layout
    from forkpoint.state.flatten import flatten

    class HeldCopy:
        launched = False

        def launch(self, ranges):
            self.launched, self.ranges = True, ranges

    state = {"big": torch.randn(64, 1024), "other": torch.randn(64, 1024), "small": torch.randn(10)}
    _, flat = flatten(state, copy=False)
    for fl in flat:
        fl.data.pending = HeldCopy()
    opts = SaveOptions(chunk_bytes=16 << 10, small_leaf_bytes=1 << 10)
    big = next(i for i, fl in enumerate(flat) if fl.path == "big")

    def select(i, box):
        return i == big and box[0][0] % 8 == 0 or flat[i].path == "small"

    launch_device_copies(flat, opts, select)
    copies = {fl.path: fl.data.pending for fl in flat}
    row = 1024 * 4
    assert copies["big"].ranges == [(r * row, (r + 4) * row) for r in range(0, 64, 8)]
    assert copies["other"].ranges == [], "a leaf this rank does not write is not copied"
    assert copies["small"].ranges == [(0, 40)]
    stored = [(i, piece.__array_interface__["data"][0]) for kind, (i, pieces) in layout(flat, opts, select)
              if kind == "chunks" for piece, _ in pieces]
    assert len(stored) == 8 and all(i == big for i, _ in stored)


def test_the_manifest_cache_is_bounded_by_leaves_and_keeps_the_newest(tmp_path):
    from forkpoint.format.manifest import Leaf, Manifest, Version
    from forkpoint.repo.history import ManifestCache

    def manifest(vid, n):
        return Manifest(Version(vid, [], "main", 0, 0.0), {}, [Leaf(f"l{i}", "torch", "float32", [1], 4)
                                                                for i in range(n)])

    cache = ManifestCache(limit=64, leaf_limit=10)
    for vid in "abc":
        cache.put(vid, manifest(vid, 4))
    assert list(cache.full) == ["b", "c"] and cache.leaves == 8
    cache.put("c", manifest("c", 5))
    assert list(cache.full) == ["b", "c"] and cache.leaves == 9
    cache.put("big", manifest("big", 30))
    assert list(cache.full) == ["big"] and cache.leaves == 30
    assert cache.pop("big").version.id == "big" and cache.leaves == 0 and cache.pop("big", 1) == 1
    assert {"a", "b", "c"} <= set(cache.records) and cache.get("a") is None

    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.history.cache.leaf_limit = 50
    state = {f"w{i}": torch.full((3,), float(i)) for i in range(40)}
    for step in range(3):
        state["w0"] += 1
        repo.save(state, step=step)
    assert len(repo.history.cache.full) == 1 and repo.history.cache.leaves == 40
    assert repo.load("main~2")["w0"].tolist() == [1.0] * 3 and len(repo.history.cache.full) == 1
    repo.close()


def test_the_record_cache_keeps_the_most_recently_used_records(tmp_path):
    """Version records (about 2 KB each) are kept for the RECORDS_CACHED most recently used
    versions, not for every version a long run ever saved; a walk past them reads them again."""
    repo = fp.Repo(str(tmp_path / "r"), create=True)
    repo.history.cache.record_limit = 4
    for step in range(10):
        repo.save({"x": np.full(3, step)}, step=step)
    cache = repo.history.cache
    assert len(cache.records) == 4 and [cache.records[v].step for v in cache.records] == [6, 7, 8, 9]
    oldest = next(iter(cache.records))
    assert cache.record(oldest).step == 6 and list(cache.records)[-1] == oldest
    assert [v.step for v in repo.log()] == list(range(9, -1, -1)) and len(cache.records) == 4
    assert fp.Repo(repo.url).log(limit=3)[2].step == 7 and repo.version("main~9").step == 0
    repo.close()


def test_gc_pauses_nest_across_threads_and_restore_the_collector():
    import gc

    from forkpoint.engine.gcpause import gc_paused

    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            entered.set()
            release.wait(10)

    with gc_paused():
        assert not gc.isenabled()
        t = threading.Thread(target=other)
        t.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still running
    release.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before the pause: left off
    finally:
        gc.enable()


def test_a_save_that_fails_or_succeeds_leaves_the_collector_on(repo):
    """The collector is paused through a synchronous save, a load and a restore (their callers
    wait anyway), and on again after each, whether it succeeded or raised."""
    import gc

    from forkpoint.errors import RefNotFoundError, StateMismatchError, UnsupportedTypeError

    with pytest.raises(UnsupportedTypeError):
        repo.save({"f": lambda: 0})
    assert gc.isenabled()
    repo.save({f"w{i}": torch.ones(2) * i for i in range(100)}, sync=False).wait()
    seen = []
    commit = repo._commit
    repo._commit = lambda manifest: (seen.append(gc.isenabled()), commit(manifest))[1]
    repo.save({"w": torch.ones(2), "probe": Probe(lambda: None)})
    assert seen == [False] and gc.isenabled()  # paused through the synchronous save's commit
    repo.save({"w": torch.ones(2), "probe": Probe(lambda: None)}, sync=False).wait()
    assert seen == [False, True] and gc.isenabled()  # not while an asynchronous one runs alone
    del repo._commit
    seen.clear()
    assert torch.equal(repo.load()["w"], torch.ones(2)) and gc.isenabled()
    with pytest.raises(RefNotFoundError):
        repo.load("no-such-branch")
    live = {"w": torch.zeros(2), "probe": Probe(lambda: seen.append(gc.isenabled()))}
    repo.restore(live)
    assert torch.equal(live["w"], torch.ones(2)) and seen == [False, False] and gc.isenabled()
    with pytest.raises(StateMismatchError):
        repo.restore({"w": torch.zeros(3)})
    assert gc.isenabled()


class Probe:
    """A stateful object that calls `hook` whenever it is saved or restored."""

    def __init__(self, hook):
        self.hook = hook

    def state_dict(self):
        self.hook()
        return {}

    def load_state_dict(self, sd):
        self.hook()


def test_a_capture_guard_waits_once_per_distinct_task_however_many_tensors_it_covers():
    """A pack capture covers thousands of small tensors: a wait and a pending check must cost
    per distinct task (before, the optimizer hook called every task once per tensor)."""

    class Capture:
        def __init__(self):
            self.finished, self.calls = False, 0

        def done(self):
            self.calls += 1
            return self.finished

        def result(self):
            self.calls += 1
            self.finished = True

    guard, packs = CaptureGuard(), [Capture(), Capture()]
    guard.add({ptr: [packs[ptr % 2]] for ptr in range(1, 10_001)})
    assert guard.pending()
    guard.wait()
    assert all(p.finished and p.calls <= 4 for p in packs) and not guard.pending()
    late = Capture()
    guard.add({5: [late], 6: [late]})
    guard.wait([torch.empty(0)])  # a tensor it does not cover: nothing to wait for
    assert not late.finished and guard.pending()
    other = Capture()
    guard.add({7: [other]})
    other.finished = True
    assert guard.pending() and sorted(guard._by_ptr) == [5, 6]  # finished ones leave the map
