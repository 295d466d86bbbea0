"""Python's garbage collections paced by the engine thread (service/engine/collector.py): once installed, CPython does
not collect by itself below the backstop, the collection a step is beside is the one due (generation 1 every
GEN1_EVERY, a full one after FULL_EVERY of those, or when the engine goes idle) and only where it fits the step's
slack or the young containers have piled up, and an admission verdict handed to the engine thread no longer has a
collection start inside it: the engine runs it right after, and the step's handed-over work says so. The GC's state is
the process's: each test starts from a full collection and leaves CPython's threshold as it found it."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from service.engine.collector import BACKSTOP, FULL_EVERY, GEN1_EVERY, PACE, Collector
from service.engine.commit import StepDone
from service.engine.request import SamplingParams
from service.model.loader import load_model
from tests.test_engine import recorded_engine


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


@pytest.fixture
def collector() -> Iterator[Collector]:
    """An installed collector, from a full collection (every generation's count at 0); uninstalled afterwards."""
    assert gc.isenabled()
    c = Collector()
    gc.collect()
    c.install()
    try:
        yield c
    finally:
        c.uninstall()


@pytest.fixture
def collections() -> Iterator[list[dict]]:
    """The collections this test's thread starts from now on: each one's info (generation, then what it collected)."""
    seen: list[dict] = []
    me = threading.get_ident()

    def callback(phase: str, info: dict) -> None:
        if phase == "stop" and threading.get_ident() == me:
            seen.append(dict(info))

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def cyclic_garbage(n: int) -> None:
    """`n` young containers that only a collection frees (each list holds itself)."""
    for _ in range(n):
        a: list = []
        a.append(a)


def test_installed_cpython_leaves_collections_to_the_collector_and_uninstall_restores_its_threshold(collections):
    """Three paces of young cyclic garbage start no collection of CPython's own (the backstop is 20 paces); the
    collection beside a step with time to spare is a generation-0 one that frees it, timed; uninstall() gives back the
    threshold install() found."""
    assert BACKSTOP > 3 * PACE
    before = gc.get_threshold()
    c = Collector()
    gc.collect()
    seen = collections
    seen.clear()
    try:
        assert c.install() is c
        assert gc.get_threshold()[0] == BACKSTOP
        cyclic_garbage(3 * PACE)
        assert seen == [] and gc.get_count()[0] >= 3 * PACE  # none of CPython's own: the garbage is still there
        swept = c.beside_step(1.0)
        assert swept is not None
        kind, seconds = swept
        assert kind == "gc0" and seconds > 0
        assert [i["generation"] for i in seen] == [0] and seen[0]["collected"] >= 3 * PACE
        assert gc.get_count()[0] < PACE
    finally:
        c.uninstall()
    assert gc.get_threshold() == before
    c.uninstall()  # a second uninstall changes nothing
    assert gc.get_threshold() == before


def test_install_twice_keeps_the_threshold_it_found_first():
    """A second install() must not save the raised threshold as the one to restore."""
    before = gc.get_threshold()
    c = Collector()
    try:
        c.install()
        c.install()
    finally:
        c.uninstall()
    assert gc.get_threshold() == before


def test_every_gen1_everyth_collection_beside_a_step_is_of_generation_1(collector, collections):
    """Collections beside steps follow CPython's own pacing: GEN1_EVERY - 1 of generation 0, then one of generation 1
    (which the counts then show: generation 0's reset, one more of generation 1 since the last full collection)."""
    gc.collect()  # counts from 0: what pytest allocated since the fixture's collection left out
    collections.clear()
    kinds = []
    for _ in range(GEN1_EVERY):
        cyclic_garbage(PACE + PACE // 4)
        swept = collector.beside_step(1.0)
        assert swept is not None
        kinds.append(swept[0])
    assert kinds == ["gc0"] * (GEN1_EVERY - 1) + ["gc1"]
    assert [i["generation"] for i in collections] == [0] * (GEN1_EVERY - 1) + [1]
    assert all(i["collected"] >= PACE for i in collections)
    assert gc.get_count()[1:] == (0, 1)


def test_a_full_collection_runs_beside_a_step_after_full_every_gen1_ones(collector, collections):
    """FULL_EVERY - 1 collections of generation 1 since the last full one, and GEN1_EVERY - 1 of generation 0 since:
    the one due is full, and it runs beside a step like any other: where slack is left (or young containers are at
    twice the pace)."""
    gc.collect()  # counts from 0: what pytest allocated since the fixture's collection left out
    collections.clear()
    for _ in range(FULL_EVERY - 1):
        gc.collect(1)
    for _ in range(GEN1_EVERY - 1):
        gc.collect(0)
    assert gc.get_count()[1:] == (GEN1_EVERY - 1, FULL_EVERY - 1)
    collections.clear()
    cyclic_garbage(PACE + PACE // 4)
    assert collector.due() == 2
    assert collector.beside_step(0.0) is None and collections == []
    swept = collector.beside_step(1e-6)
    assert swept is not None and swept[0] == "gc2"
    assert [i["generation"] for i in collections] == [2]
    assert gc.get_count()[1:] == (0, 0)


def test_a_collection_waits_for_slack_until_young_containers_reach_twice_the_pace(collector, collections):
    """Nothing due below the pace, whatever the slack; a due collection beside a step whose slack the handed-over work
    used up waits (none runs) until the young containers reach twice the pace, then runs anyway; with any slack left it
    runs at once."""
    gc.collect()  # counts from 0: what pytest allocated since the fixture's collection left out
    collections.clear()
    cyclic_garbage(PACE * 4 // 5)
    assert gc.get_count()[0] < PACE
    assert collector.due() is None
    assert collector.beside_step(1.0) is None and collections == []
    cyclic_garbage(PACE // 4)
    assert PACE <= gc.get_count()[0] < 2 * PACE
    assert collector.beside_step(0.0) is None and collector.beside_step(-0.001) is None and collections == []
    assert gc.get_count()[0] >= PACE  # the garbage is still there
    cyclic_garbage(PACE + PACE // 4)
    assert gc.get_count()[0] >= 2 * PACE
    swept = collector.beside_step(-0.001)
    assert swept is not None and swept[0] == "gc0"
    assert [i["generation"] for i in collections] == [0] and collections[0]["collected"] >= 2 * PACE
    collections.clear()
    cyclic_garbage(PACE + PACE // 4)
    assert gc.get_count()[0] < 2 * PACE
    swept = collector.beside_step(1e-6)  # a little slack left: at once
    assert swept is not None and swept[0] == "gc0" and [i["generation"] for i in collections] == [0]


def test_a_collections_seconds_are_what_the_clock_read_around_it():
    """The (kind, seconds) a collection reports is what the collector's clock read before and after it."""
    ticks = iter([10.0, 10.002])
    c = Collector(clock=lambda: next(ticks))
    gc.collect()
    c.install()
    try:
        cyclic_garbage(PACE + PACE // 4)
        swept = c.beside_step(1.0)
    finally:
        c.uninstall()
    assert swept == ("gc0", pytest.approx(0.002))


def test_when_idle_runs_a_full_collection_where_a_gen1_one_ran_since_the_last(collector, collections):
    """Before the engine waits for work: nothing where nothing is due; a full collection where one of generation 1 has
    run since the last full one (every count reset); else the one due."""
    gc.collect()  # counts from 0: what pytest allocated since the fixture's collection left out
    collections.clear()
    assert collector.when_idle() is None and collections == []
    for _ in range(GEN1_EVERY):
        cyclic_garbage(PACE + PACE // 4)
        collector.beside_step(1.0)
    assert gc.get_count()[2] == 1 and collections[-1]["generation"] == 1
    collections.clear()
    swept = collector.when_idle()
    assert swept is not None and swept[0] == "gc2" and swept[1] > 0
    assert [i["generation"] for i in collections] == [2]
    young, gen0s, gen1s = gc.get_count()
    assert (gen0s, gen1s) == (0, 0) and young < PACE
    assert collector.when_idle() is None  # the full one ran: nothing more
    collections.clear()
    cyclic_garbage(PACE + PACE // 4)
    swept = collector.when_idle()
    assert swept is not None and swept[0] == "gc0"
    assert [i["generation"] for i in collections] == [0]


def test_a_verdict_handed_to_the_engine_has_no_collection_inside_it_and_one_runs_beside_the_step(tiny):
    """A verdict allocating three paces of young containers on the engine thread: no collection starts inside it (it
    would hold the GIL and the step), the engine thread runs one right after it, beside the same step, and that step's
    handed-over work names it, after the verdict, with its seconds (counted in the step's handed-over time). Gone
    idle after a collection of generation 1, the engine thread runs a full one."""
    eng, _ = recorded_engine(tiny, overlap=True)
    steps: list[StepDone] = []
    consume = eng.admission.consume
    eng.admission.consume = lambda ev: (steps.append(ev) if isinstance(ev, StepDone) else None, consume(ev))[1]
    log: list[tuple[str, ...]] = []  # in order: the task's start and end, and the engine thread's collections

    def callback(phase: str, info: dict) -> None:
        name = threading.current_thread().name
        if phase == "start" and name == "parley-engine":
            log.append(("gc", str(info["generation"])))

    def verdict() -> None:
        log.append(("task start",))
        cyclic_garbage(3 * PACE)
        log.append(("task end",))

    gc.collect()
    eng.collector = Collector().install()
    gc.callbacks.append(callback)
    eng.start()
    try:
        got = threading.Event()
        eng.submit([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   lambda d: d.finish_reason and got.set())
        deadline = time.monotonic() + 20
        while not steps and time.monotonic() < deadline:
            time.sleep(0.001)
        assert steps
        eng.run_soon(verdict, kind="verdict")
        assert got.wait(20)
        gc.collect(1)  # a collection of generation 1 since the last full one: the idle engine runs a full one
        woken = len(log)
        eng.run_soon(lambda: None)  # wakes it
        deadline = time.monotonic() + 5
        while ("gc", "2") not in log[woken:] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ("gc", "2") in log[woken:]
    finally:
        eng.stop()
        gc.callbacks.remove(callback)
        eng.collector.uninstall()
    assert ("task end",) in log
    start, end = log.index(("task start",)), log.index(("task end",))
    assert [e for e in log[start:end] if e[0] == "gc"] == []  # none inside the verdict
    assert any(e[0] == "gc" for e in log[end:])  # the engine thread's, after it
    (beside,) = [s for s in steps if any(kind == "verdict" for kind, _ in s.handed)]
    kinds = [kind for kind, _ in beside.handed]
    assert len(kinds) == 2 and kinds[0] == "verdict"
    assert kinds[1] in ("gc0", "gc1", "gc2")  # collected right after it, beside the same step
    assert beside.handed[1][1] > 0 and beside.handed_over >= beside.handed[0][1] + beside.handed[1][1]
    assert any(kind.startswith("gc") and seconds > 0 for s in steps for kind, seconds in s.handed)
