"""The admission log (`--admission-log`): a line for every verdict, with the forecast, the stretch, the time left and
the rule that refused; a line for every admitted request's SLA token; and the bench's reading of it."""

import json
import time

import pytest

from bench import admission_trace
from service.admission import AdmissionController
from service.admission_log import AdmissionLog
from service.engine.admission import Rejected
from service.engine.commit import StepDone, Token
from service.engine.request import State
from service.latency_model import LatencyModel
from tests.test_admission import newcomer, run_steps, settled, step_done


def test_every_verdict_and_sla_token_is_a_line_that_says_why(tmp_path):
    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path)
    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)  # 128 ms to token 64
    adm = settled(AdmissionController(lat, 0.2, 64, 4, trace=trace), 1.05)
    running = newcomer(state=State.RUNNING)
    adm.check(running)  # admitted: 64 x 2.1 ms against 200 ms
    riding = newcomer(prompt_tokens=100)
    running.deadline = time.perf_counter() + 0.15  # on time alone, with 16 ms to spare
    adm.check(riding)  # rides beside it
    adm.release(riding)
    adm.consume(step_done(1, 0.0, at=adm._promises[running.id].at + 0.002))  # a step as the model says
    with pytest.raises(Rejected):
        adm.check(newcomer(prompt_tokens=400))  # its prefill launch would make the running one miss
    running.deadline = time.perf_counter() + 0.01
    running.output_ids = [0] * 10
    late = newcomer()
    late.arrival -= 0.15  # 150 ms spent before its verdict: 64 x 2.1 ms no longer fits
    with pytest.raises(Rejected):
        adm.check(late)
    promise = adm._promises[running.id]  # its latest: each verdict beside it forecasts it again
    came = run_steps(adm, promise.at, 64, 1, 0.003)  # steps of 3 ms where the model says 2
    adm.consume(Token(running, 7, 64, "", came))
    trace.close()

    lines = [json.loads(t) for t in path.read_text().splitlines()]
    verdicts = [x for x in lines if x["kind"] == "verdict"]
    assert [(v["admitted"], v["reason"], v["rule"]) for v in verdicts] == [
        (True, None, None), (True, None, None), (False, "overloaded", "delays"), (False, "overloaded", "late")]
    first, _, delays, refused = verdicts
    assert first["req"] == running.id and first["in_flight"] == 1 and first["level"] == {"in_flight": "1",
                                                                                        "prompt": "step"}
    assert first["stretch"] == pytest.approx(1.05) and first["forecast_ms"] == pytest.approx(134.4, rel=0.05)
    assert first["stretched_ms"] == pytest.approx(first["forecast_ms"] * 1.05, rel=1e-3)
    assert first["stretched_ms"] < first["left_ms"] <= 200
    assert delays["victim_over_ms"] > 0 > delays["victim_alone_over_ms"]  # late beside it, on time without it
    assert 0 <= delays["second_after_ms"] < 1e3  # its second forecast, after the first (here at once)
    assert "second_after_ms" not in first and "second_after_ms" not in refused  # nobody late beside them / refused
    assert delays["victim_model_ms"] == pytest.approx(2.0)  # the step it has run, as the model predicted it
    assert refused["since_arrival_ms"] >= 150 and refused["stretched_ms"] > refused["left_ms"]
    assert refused["in_flight"] == 2 and refused["prompt_tokens"] == 32
    (token,) = [x for x in lines if x["kind"] == "sla_token"]
    assert token["req"] == running.id and token["model_ms"] == pytest.approx(2 + 64 * 2)  # every step it waited on
    assert token["score"] == pytest.approx(64 * 3 / 130, rel=1e-3) == token["after_verdict_ms"] / token["model_ms"]
    assert token["latest_score"] == pytest.approx(token["after_verdict_ms"] / token["forecast_ms"], abs=1e-4)
    assert token["steps_ms"] == pytest.approx(token["model_ms"])  # steps not measured count as predicted
    assert token["late"] is True  # its deadline was moved to 10 ms from then

    s = admission_trace.summary(admission_trace.read(path))
    assert (s["verdicts"], s["admitted"], s["sla_tokens"], s["late"]) == (4, 2, 1, 1)
    assert s["refused"] == {"overloaded (delays)": 1, "overloaded (late)": 1}
    assert s["delays_refusals"] == 1
    assert s["second_forecasts"]["n"] == 1 and s["second_forecasts"]["max"] == delays["second_after_ms"]
    assert s["late_refusals"]["since_arrival_ms"]["p50"] >= 150
    assert s["late_refusals_by_stretch_alone"] == 0  # 150 ms gone: not even the bare forecast fits
    (level,) = s["levels"].values()
    assert level["score_p99"] == pytest.approx(token["score"])
    assert level["steps_over_model_p99"] == pytest.approx(1.0)  # the split: all of the score is around the steps
    assert level["wall_over_steps_p99"] == pytest.approx(token["score"], rel=1e-3)
    assert level["first_score_p99"] == pytest.approx(token["after_verdict_ms"] / first["forecast_ms"], abs=1e-4)
    text = "\n".join(admission_trace.markdown({"server": s}))
    assert "4 verdicts, 2 admitted; refused: 1 overloaded (delays), 1 overloaded (late)" in text
    assert "1 verdicts forecast twice (the `delays` rule)" in text


def test_the_trace_says_how_far_newcomers_forecast_once_were_off_by_the_steps_ahead_at_their_verdict():
    """A request whose latest forecast is its own verdict's is compared in the model clock's time, grouped by the
    steps the engine had launched (a request forecast again by a later verdict is left out: load came after it)."""
    def verdict(req, forecast, ahead, in_flight=2):
        return {"kind": "verdict", "req": req, "admitted": True, "forecast_ms": forecast, "ahead": ahead,
                "in_flight": in_flight, "level": {"in_flight": str(in_flight), "prompt": "step"}}

    def token(req, forecast, model):
        return {"kind": "sla_token", "req": req, "forecast_ms": forecast, "model_ms": model, "after_verdict_ms": model,
                "score": 1.0, "latest_score": 1.0, "stretch": 1.0, "late": False,
                "level": {"in_flight": "2", "prompt": "step"}}

    lines = [verdict("a", 80.0, 2), verdict("b", 90.0, 2), verdict("c", 70.0, 0, 1), verdict("d", 85.0, 2),
             token("a", 80.0, 81.5), token("b", 90.0, 92.5), token("c", 70.0, 70.25), token("d", 95.0, 99.0)]
    own = admission_trace.summary(lines)["own_forecasts"]
    assert set(own) == {"0 ahead", "2 ahead"}
    assert own["2 ahead"]["n"] == 2 and own["2 ahead"]["max"] == pytest.approx(2.5)  # d: forecast again, left out
    assert own["0 ahead"]["p50"] == pytest.approx(0.25)
    old = [{k: v for k, v in x.items() if k != "ahead"} for x in lines]
    assert set(admission_trace.summary(old)["own_forecasts"]) == {"alone", "beside others"}
    text = "\n".join(admission_trace.markdown({"server": admission_trace.summary(lines)}))
    assert "| 2 ahead | 2 |" in text


def test_a_forecast_past_the_horizon_is_null_and_a_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path)
    trace.record("verdict", t=1.0, req="r", admitted=False, forecast_ms=float("inf"), level={"in_flight": "1",
                                                                                           "prompt": "step"})
    trace.close()
    with open(path, "a") as f:
        f.write('{"kind": "verdict", "t": 2.0, "req"')  # a server killed mid-line
    (line,) = admission_trace.read(path)
    assert line["forecast_ms"] is None and line["req"] == "r"


def test_every_measured_step_is_a_line_and_the_trace_splits_them_by_kind(tmp_path):
    """A step's line holds what the model predicted for it before it learned from it, and what it took; the trace's
    table says which kind of step ran over: here the 2-row steps at 2,000 positions a row (a voice turn's) took 1.2x
    their prediction, the short-context ones as predicted, and a prompt chunk beside them is a kind of its own."""
    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path, step_every=1)
    lat = LatencyModel({1: 0.001, 2: 0.0011}, {16: 0.002}, max_rows=16, step_kv_s=1e-8)
    adm = AdmissionController(lat, 0.1, 64, 4, trace=trace)
    long = 2 * 2000
    predicted_long = lat.step(2, long)
    for _ in range(5):
        adm.consume(StepDone(rows=2, sampled=2, prompt_rows=0, kv_positions=long, launched=(),
                             seconds=1.2 * lat.step(2, long), at=time.perf_counter(), handed_over=0.0004))
        adm.consume(StepDone(rows=2, sampled=2, prompt_rows=0, kv_positions=0, launched=(),
                             seconds=lat.step(2), at=time.perf_counter()))
    adm.consume(StepDone(rows=16, sampled=2, prompt_rows=14, kv_positions=16 * 300, launched=(), seconds=0.002,
                         at=time.perf_counter()))
    adm.consume(StepDone(rows=1, sampled=1, prompt_rows=0, kv_positions=0, launched=(), seconds=0.0,
                         at=time.perf_counter()))  # not measured: no line
    trace.close()

    steps = [x for x in admission_trace.read(path) if x["kind"] == "step"]
    assert len(steps) == 11
    first = steps[0]
    assert (first["rows"], first["prompt_rows"], first["kv_positions"], first["launched"]) == (2, 0, long, 0)
    assert first["predicted_ms"] == pytest.approx(predicted_long * 1e3, abs=1e-3)
    assert first["ms"] == pytest.approx(1.2 * first["predicted_ms"], rel=1e-3)
    kinds = admission_trace.summary(admission_trace.read(path))["steps"]
    assert first["handed_ms"] == pytest.approx(0.4)  # a verdict ran within its cadence
    assert set(kinds) == {"decode, 2 rows, <2048 positions", "decode, 2 rows, <256 positions",
                          "chunk, 16 rows, <1024 positions", "every step, handed-over work within",
                          "every step, none within"}
    assert kinds["every step, handed-over work within"]["n"] == 5 and kinds["every step, none within"]["n"] == 6
    assert kinds["every step, handed-over work within"]["p50"] > 1.1 > kinds["every step, none within"]["p50"]
    slow = kinds["decode, 2 rows, <2048 positions"]
    # what the model learned from the first slow steps lowers the later ones' ratios a little: at most 1.2
    assert slow["n"] == 5 and 1.1 < slow["p50"] <= slow["p99"] <= 1.2 + 1e-3
    assert kinds["decode, 2 rows, <256 positions"]["p99"] == pytest.approx(1.0, abs=0.05)
    text = "\n".join(admission_trace.markdown({"server": admission_trace.summary(admission_trace.read(path))}))
    assert "| decode, 2 rows," in text and "Steps by kind" in text


def test_by_default_one_step_in_step_every_gets_a_line(tmp_path):
    """A thousand steps a second on a GPU: the log samples them (every STEP_EVERY-th measured step), so that its
    writer, formatting under the GIL the engine thread needs, does not slow the steps it measures."""
    from service.admission_log import STEP_EVERY

    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path)
    adm = AdmissionController(LatencyModel({1: 0.001}, {16: 0.002}, max_rows=16), 0.1, 64, 4, trace=trace)
    for i in range(10 * STEP_EVERY):
        adm.consume(StepDone(rows=1, sampled=1, prompt_rows=0, kv_positions=0, launched=(), seconds=0.001 + i * 1e-6,
                             at=time.perf_counter()))
    trace.close()
    steps = [x for x in admission_trace.read(path) if x["kind"] == "step"]
    assert STEP_EVERY > 1 and len(steps) == 10
    assert [round(x["ms"] * 1e3) for x in steps] == [1000 + i for i in range(STEP_EVERY - 1, 10 * STEP_EVERY,
                                                                               STEP_EVERY)]


def test_a_step_held_up_by_a_long_handed_task_gets_a_line_naming_it(tmp_path):
    """Every step (not the sample) with a handed-over task of 1 ms or more gets a `handed` line with each task's kind
    and time; the sampled step lines carry their tasks too; the trace says which kind of task held the steps up."""
    from service.admission import HANDED_LINE_S

    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path, step_every=4)
    lat = LatencyModel({1: 0.001}, {16: 0.002}, max_rows=16)
    adm = AdmissionController(lat, 0.1, 64, 4, trace=trace)
    held = (("prepare", 0.0002), ("verdict", 0.0066))  # a 6.6 ms forecast, as one H200 run logged
    for i in range(8):
        handed = held if i == 1 else (("delays", 0.0003),) if i % 2 else ()
        adm.consume(StepDone(rows=1, sampled=1, prompt_rows=0, kv_positions=0, launched=(),
                             seconds=0.001 + sum(t for _, t in handed), at=time.perf_counter(),
                             handed_over=sum(t for _, t in handed), handed=handed))
    trace.close()

    lines = admission_trace.read(path)
    (long,) = [x for x in lines if x["kind"] == "handed"]  # the 0.3 ms tasks stay under HANDED_LINE_S
    assert HANDED_LINE_S <= 0.0066 and long["tasks"] == [["prepare", 0.2], ["verdict", 6.6]]
    assert long["ms"] == pytest.approx(7.8) and long["handed_ms"] == pytest.approx(6.8)
    steps = [x for x in lines if x["kind"] == "step"]
    assert len(steps) == 2 and all(x["handed"] == [["delays", 0.3]] for x in steps)  # the 4th and 8th: i = 3, 7
    table = admission_trace.summary(lines)["handed"]
    assert table["delays"]["n"] == 2 and table["delays"]["long_steps"] == 0
    assert table["verdict"]["long_steps"] == 1 and table["verdict"]["long_max"] == pytest.approx(6.6)
    assert table["verdict"]["long_over"] == pytest.approx(7.8, rel=0.01)
    text = "\n".join(admission_trace.markdown({"server": admission_trace.summary(lines)}))
    assert "| verdict | 0 | – | – | – | 1 | 6.60 |" in text


def test_a_long_garbage_collection_is_a_line_and_the_trace_finds_it_beside_a_held_step(tmp_path):
    """A collection of 1 ms or more (GcWatch's TRACE_S) is a `gc` line; the trace counts them and says how many of the
    steps held up by a long handed-over task had one within their cadence (the task's time then was partly the
    collector's)."""
    import gc

    from service.metrics import Metrics
    from service.runtime import GcWatch

    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path)
    watch = GcWatch()
    watch.TRACE_S = 0.0  # every collection: a real one, run here, need not take a millisecond
    try:
        watch.install(Metrics(64), trace)
        t0 = time.perf_counter()
        gc.collect(2)
    finally:
        watch._uninstall()
        gc.unfreeze()
    trace.record("handed", t=time.perf_counter() + 0.001, ms=50.0, predicted_ms=1.0, tasks=[["verdict", 1.5]])
    trace.record("handed", t=t0 - 1.0, ms=2.0, predicted_ms=1.0, tasks=[["close", 1.2]])  # long before it
    trace.close()

    lines = admission_trace.read(path)
    collections = [x for x in lines if x["kind"] == "gc"]
    assert collections and collections[-1]["generation"] == 2 and collections[-1]["ms"] >= 0
    s = admission_trace.summary(lines)["gc"]
    assert s["n"] == len(collections) and s["gen2"] >= 1 and s["held_steps"] == 2 and s["held_with_gc"] == 1
    text = "\n".join(admission_trace.markdown({"server": admission_trace.summary(lines)}))
    assert "1 of the 2 steps with a task of 1 ms or more had one within their cadence" in text


def test_lines_written_in_batches_come_whole_in_order_and_live(tmp_path):
    """The writer wakes once a batch (service/admission_log.py WRITE_EVERY_S): a reader of the file while the server
    runs still sees every line recorded so far within a few batches, whole, in the order recorded; close() writes
    the rest."""
    path = tmp_path / "admission.jsonl"
    trace = AdmissionLog(path, write_every_s=0.02)
    for i in range(500):
        trace.record("step", t=float(i), ms=i / 3, handed=[["verdict", 0.4]])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and path.read_bytes().count(b"\n") < 500:
        time.sleep(0.01)
    live = path.read_bytes()
    assert live.count(b"\n") == 500 and live.endswith(b"\n")  # all of them, before close, and no half line
    for i in range(500, 600):
        trace.record("verdict", t=float(i), forecast_ms=float("inf"))
    trace.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["t"] for x in lines] == list(range(600))
    assert lines[3] == {"kind": "step", "t": 3.0, "ms": 1.0, "handed": [["verdict", 0.4]]}
    assert lines[-1]["kind"] == "verdict" and lines[-1]["forecast_ms"] is None  # past the horizon: null
