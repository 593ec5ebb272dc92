"""Why a draft slows serving (issue 34): vLLM's step times around 05's timed runs (common.evaluate.steps).

The /metrics text is made the way vLLM 0.32 makes it (vllm/v1/metrics/loggers.py): prometheus_client metrics of
its names and labels, observed as its IterationStats does (a request's first token from its prefill, then one
inter-token latency per engine iteration that gives it tokens, its decode time once it finishes), and read back with
the project's parser. The whole stage runs on tests/helpers.py's FakeVllm with those metrics added.
"""

from __future__ import annotations

import json

import pytest

from common.core.config import config_from_dict
from common.core.errors import DataError
from common.evaluate import serve
from common.evaluate import stage as evaluate
from common.evaluate.compare import compare_lines
from common.evaluate.report import read_back, summary_lines
from common.evaluate.steps import slowdown_line, step_times
from common.serving.vllm_server import (metrics_delta, parse_prometheus, spec_decode_metrics, step_metrics,
                                        step_metrics_delta)
from tests.evaluate.test_evaluate import run_env, serve_fakes  # noqa: F401 (run_env: a fixture)
from tests.helpers import FakeVllm


class VllmMetrics:
    """vLLM's decode-timing and spec-decode metrics in a registry of their own, fed request by request."""

    def __init__(self, num_speculative_tokens: int = 3, engines: tuple[str, ...] = ("0", "1")):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]

        def counter(name: str, extra: tuple = ()):
            return Counter(name, name, labelnames=labels + list(extra), registry=self.registry)

        self.generation_tokens = counter("vllm:generation_tokens")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "itl", labelnames=labels, registry=self.registry,
                             buckets=[0.01, 0.025, 0.05, 0.075, 0.1])
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "decode", labelnames=labels, registry=self.registry,
                                     buckets=[0.3, 0.5, 0.8, 1.0])
        self.drafts, self.draft_tokens = counter("vllm:spec_decode_num_drafts"), counter("vllm:spec_decode_num_draft_tokens")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens")
        self.per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", ("position",))
        self.k = num_speculative_tokens
        for engine in engines:  # vLLM makes each engine's series at start (create_metric_per_engine): all 0 until used
            for metric in (self.generation_tokens, self.itl, self.decode_time, self.drafts, self.draft_tokens, self.accepted):
                metric.labels("/runs/tiny/target", engine)

    def serve(self, engine: str, decode_outputs: list[int], iteration_s: float, spec: bool) -> None:
        """One request: its prefill's token, then one output per decode iteration (the tokens it gave), each
        iteration_s after the previous; with spec, each decode output is a verified draft of k tokens."""
        lab = ("/runs/tiny/target", engine)
        self.generation_tokens.labels(*lab).inc(1 + sum(decode_outputs))
        for tokens in decode_outputs:
            self.itl.labels(*lab).observe(iteration_s)
            if spec:
                self.drafts.labels(*lab).inc()
                self.draft_tokens.labels(*lab).inc(self.k)
                self.accepted.labels(*lab).inc(tokens - 1)
                for pos in range(tokens - 1):
                    self.per_pos.labels(*lab, str(pos)).inc()
        self.decode_time.labels(*lab).observe(iteration_s * len(decode_outputs))

    def samples(self) -> dict:
        from prometheus_client import generate_latest

        return parse_prometheus(generate_latest(self.registry).decode())


def test_step_counters_of_a_window_from_vllm_text_hand_checked():
    # Target alone: 4 requests of 12 tokens (1 from the prefill + 11 decode steps of 10 ms), over two engines.
    alone = VllmMetrics()
    alone.serve("0", [1] * 7, 0.010, spec=False)  # the warm-up: before the window
    before = alone.samples()
    for engine in ("0", "0", "1", "1"):
        alone.serve(engine, [1] * 11, 0.010, spec=False)
    d = step_metrics_delta(step_metrics(alone.samples()), step_metrics(before))
    assert d == pytest.approx({"iterations": 44, "iteration_s_sum": 0.44, "generation_tokens": 48, "requests": 4,
                               "decode_s_sum": 0.44})

    # With the draft: the same 12 tokens in 5 iterations of 29 ms (3 + 2 + 2 + 2 + 2 tokens).
    drafted = VllmMetrics()
    before = drafted.samples()
    for engine in ("0", "1", "0", "1"):
        drafted.serve(engine, [3, 2, 2, 2, 2], 0.029, spec=True)
    after = drafted.samples()
    d_draft = step_metrics_delta(step_metrics(after), step_metrics(before))
    assert d_draft == pytest.approx({"iterations": 20, "iteration_s_sum": 0.58, "generation_tokens": 48, "requests": 4,
                                     "decode_s_sum": 0.58})
    acceptance = serve.acceptance_metrics(metrics_delta(spec_decode_metrics(after), spec_decode_metrics(before)), 3)
    assert acceptance["acceptance_length"] == pytest.approx(1 + 24 / 20)  # 2.2: each draft's accepted + the bonus

    st = step_times([d_draft], [d], acceptance["acceptance_length"], measured_speedup=0.71)
    assert st["measured"] is True
    assert st["target_step_s"] == pytest.approx(0.010) and st["target_tokens_per_step"] == 1.0
    assert st["iteration_s"] == pytest.approx(0.029) and st["tokens_per_iteration"] == pytest.approx(2.2)
    assert st["cost_ratio"] == pytest.approx(2.9)
    assert st["speedup_from_steps"] == pytest.approx(2.2 / 2.9, abs=1e-4)  # 0.7586
    assert st["measured_speedup"] == 0.71
    assert st["beyond_target_step_s"] == pytest.approx(0.019) and st["beyond_target_step_share"] == pytest.approx(0.019 / 0.029, abs=1e-4)
    assert st["decode_iterations"] == {"with_draft": 20, "without_draft": 44}
    # Per request, the decode times add up to its inter-token latencies: the window holds whole requests.
    assert st["counters"]["with_draft"]["decode_s_sum"] == pytest.approx(st["counters"]["with_draft"]["iteration_s_sum"])

    # A series first shown within the window (prometheus_client shows a labelled one once it has a child) counts from 0.
    lazy = VllmMetrics(engines=())
    before = lazy.samples()
    assert step_metrics(before) is None
    lazy.serve("0", [1] * 11, 0.010, spec=False)
    assert step_metrics_delta(step_metrics(lazy.samples()), step_metrics(before)) == pytest.approx(
        {"iterations": 11, "iteration_s_sum": 0.11, "generation_tokens": 12, "requests": 1, "decode_s_sum": 0.11})
    assert step_metrics_delta(None, step_metrics(before)) is None


def test_step_times_pool_the_timed_runs_and_keep_each():
    def run(iterations: int, seconds: float, tokens: int, requests: int = 4) -> dict:
        return {"iterations": iterations, "iteration_s_sum": seconds, "generation_tokens": tokens, "requests": requests,
                "decode_s_sum": seconds, "client_latency_s_sum": 2 * seconds}

    alone = [run(44, 0.44, 48), run(44, 0.66, 48), run(44, 0.55, 48)]
    with_draft = [run(20, 0.60, 48), run(22, 0.66, 48), run(20, 0.50, 48)]
    st = step_times(with_draft, alone, 2.1, measured_speedup=0.8)
    assert st["target_step_s_runs"] == [0.01, 0.015, 0.0125] and st["iteration_s_runs"] == [0.03, 0.03, 0.025]
    assert st["target_step_s"] == pytest.approx(1.65 / 132)  # pooled: all iterations of all runs, not a mean of means
    assert st["iteration_s"] == pytest.approx(1.76 / 62, abs=1e-6)
    assert st["tokens_per_iteration"] == pytest.approx(132 / 62, abs=1e-4)
    assert st["cost_ratio"] == pytest.approx((1.76 / 62) / (1.65 / 132), abs=1e-4)
    assert st["speedup_from_steps"] == pytest.approx(2.1 / st["cost_ratio"], abs=1e-4)
    # the requests spent half their time (at the client) in vLLM's decode iterations
    assert st["decode_share"] == {"with_draft": 0.5, "without_draft": 0.5}


def test_step_times_say_why_they_are_missing():
    counters = {"iterations": 5, "iteration_s_sum": 0.1, "generation_tokens": 12, "requests": 1, "decode_s_sum": 0.1}
    # a server whose /metrics has no inter-token latency (an older vLLM, tests/helpers.py's FakeVllm)
    assert step_times([counters], [None], 2.0, 0.9) == {
        "measured": False, "reason": "the target-alone server's /metrics has no vllm:inter_token_latency_seconds for every timed run"}
    # a target-alone server whose /metrics could not be read (the generation server behind a proxy)
    assert step_times([counters], None, 2.0, 0.9) == {"measured": False, "reason": "the target-alone server's /metrics was not read"}
    assert step_times([counters, None], [counters], 2.0, 0.9)["reason"].startswith("the draft's server's /metrics has no")
    one_token = {**counters, "iterations": 0, "iteration_s_sum": 0.0, "generation_tokens": 1}
    assert step_times([one_token], [one_token], 1.0, None)["reason"] == "no decode iteration in the timed runs (every answer a single token)"


def part_of(speedup: float, step: dict) -> dict:
    return {"acceptance_length": 1.65, "num_speculative_tokens": 3, "per_position_acceptance": [0.4, 0.2, 0.05],
            "outputs": {"identical": 4, "compared": 4},
            "throughput": {"with_draft": {"tokens_per_s_runs": [50.0]}, "without_draft": {"tokens_per_s_runs": [100.0]},
                           "speedup": speedup, "speedup_range": [speedup, speedup], "verdict": "slower" if speedup < 1 else "faster"},
            "step_times": step}


SLOW = {"measured": True, "target_step_s": 0.0123, "iteration_s": 0.03567, "acceptance_length": 1.65, "cost_ratio": 2.9,
        "speedup_from_steps": 0.569, "decode_share": {"with_draft": 0.9512, "without_draft": 0.9}}


def test_the_summary_says_why_the_draft_slows_serving(tmp_path):
    said = ("the draft slows serving (0.55x tokens/s): each iteration (3 draft steps + verification) costs 2.90x a target "
            "step (35.7 vs 12.3 ms) and yields 1.65 tokens: 1.65 / 2.90 = 0.57x in decode, which is 95% of the requests' "
            "time with the draft, 90% without")
    assert slowdown_line(part_of(0.55, SLOW)) == said
    no_share = {k: v for k, v in SLOW.items() if k != "decode_share"}
    assert slowdown_line(part_of(0.55, no_share)) == said[:said.index(", which")]
    report = {**part_of(0.55, SLOW), "prompt_sets": {"gsm8k": {**part_of(0.55, SLOW), "num_prompts": 3}}}
    lines = summary_lines(report)
    assert lines[1] == f"held-out prompts: {said}"
    assert lines[2].startswith("prompt set gsm8k (3 prompts): acceptance length 1.65") and lines[3] == f"prompt set gsm8k: {said}"
    # nothing to explain at 1.0x and above; nothing to say without step times
    assert slowdown_line(part_of(1.2, SLOW)) is None
    assert slowdown_line(part_of(0.55, {"measured": False, "reason": "x"})) is None
    # a report without them was made by an earlier version (or another program): read back, one error line
    old = tmp_path / "report.json"
    old.write_text(json.dumps({k: v for k, v in report.items() if k != "step_times"}))
    with pytest.raises(DataError, match=r"report.json was made by an earlier version of this pipeline or another program "
                                        r"\(KeyError: 'step_times'\); rerun 05_evaluate.py with --overwrite$"):
        read_back(old, summary_lines)
    assert len(summary_lines({**part_of(1.2, SLOW), "prompt_sets": {}})) == 1


def test_compare_lines_put_the_iteration_cost_beside_the_speedup():
    comparison = {"num_speculative_tokens": 3, "prompt_sets": {"held_out": {"num_prompts": 4}},
                  "reports": {"a": {"draft": "A", "offline": None}, "b": {"draft": "B", "offline": None}},
                  "acceptance_length": {"held_out": {"a": 1.9, "b": 1.8, "b_minus_a": -0.1}},
                  "speedup": {"held_out": {"a": 0.62, "b": 0.58}}, "cost_ratio": {"held_out": {"a": 3.05, "b": 3.1}}}
    assert compare_lines(comparison)[1] == ("held_out (4 prompts): acceptance length a 1.90 | b 1.80 | b - a -0.10 | tokens/s "
                                            "vs the target alone: a 0.62x, b 0.58x | an iteration with the draft costs a "
                                            "3.05x, b 3.10x a target step")
    comparison["cost_ratio"] = {"held_out": {"a": None, "b": None}}  # step times not measured (/metrics not read)
    assert compare_lines(comparison)[1].endswith("tokens/s vs the target alone: a 0.62x, b 0.58x")


# ----------------------------------------------------------------------------- the whole stage


class TimedFakeVllm(FakeVllm):
    """FakeVllm with vLLM's decode timing on /metrics: a request of n tokens takes n - 1 steps of 10 ms on the target
    alone, (n - 1) // 2 iterations of 29 ms with the draft, whose 10 drafts accept 5 + 4 + 3 (acceptance length 2.2)."""

    def accepted_per_pos(self, body: dict) -> list[int]:
        return [5, 4, 3]

    def metrics_text(self) -> str:
        lab = 'engine="0",model_name="tiny"'
        with self.lock:
            tokens = [min(b["max_tokens"], len(f"answer to {b['messages'][-1]['content']}".split()) * 3) for b in self.requests]
        iterations = [(n - 1) // 2 if self.with_draft else n - 1 for n in tokens]
        seconds = 0.029 if self.with_draft else 0.010
        lines = ["# TYPE vllm:inter_token_latency_seconds histogram",
                 f"vllm:inter_token_latency_seconds_count{{{lab}}} {float(sum(iterations))}",
                 f"vllm:inter_token_latency_seconds_sum{{{lab}}} {seconds * sum(iterations)}",
                 "# TYPE vllm:request_decode_time_seconds histogram",
                 f"vllm:request_decode_time_seconds_count{{{lab}}} {float(len(tokens))}",
                 f"vllm:request_decode_time_seconds_sum{{{lab}}} {seconds * sum(iterations)}",
                 "# TYPE vllm:generation_tokens counter",
                 f"vllm:generation_tokens_total{{{lab}}} {float(sum(tokens))}"]
        return super().metrics_text() + "\n".join(lines) + "\n"


@pytest.fixture
def timed_env(run_env, monkeypatch):  # noqa: F811 (run_env: the fixture imported above)
    serve_fakes(run_env, monkeypatch, lambda speculative: TimedFakeVllm(with_draft=speculative is not None))
    tree = run_env.cfg.to_dict()
    run_env.cfg = config_from_dict({**tree, "evaluate": {**tree["evaluate"], "throughput_repeats": 2}})
    return run_env


def test_the_report_explains_the_speedup_with_both_servers_step_times(timed_env, capsys):
    cfg, run = timed_env.cfg, timed_env.run
    assert evaluate.run_stage(cfg) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    st = report["step_times"]
    # 4 prompts of 12 tokens, 2 timed runs on each server: 88 target steps of 10 ms, 40 iterations of 29 ms
    assert st["measured"] is True and st["decode_iterations"] == {"with_draft": 40, "without_draft": 88}
    assert st["target_step_s_runs"] == [0.01, 0.01] and st["iteration_s_runs"] == [0.029, 0.029]
    assert st["target_step_s"] == pytest.approx(0.010) and st["iteration_s"] == pytest.approx(0.029)
    assert st["target_tokens_per_step"] == 1.0 and st["tokens_per_iteration"] == pytest.approx(2.2)
    assert st["acceptance_length"] == report["acceptance_length"] == pytest.approx(2.2)
    assert st["cost_ratio"] == pytest.approx(2.9) and st["speedup_from_steps"] == pytest.approx(0.7586, abs=1e-4)
    assert st["measured_speedup"] == report["throughput"]["speedup"]
    alone = st["counters"]["without_draft"]
    assert {k: v for k, v in alone.items() if k != "client_latency_s_sum"} == pytest.approx(
        {"iterations": 88, "iteration_s_sum": 0.88, "generation_tokens": 96, "requests": 8, "decode_s_sum": 0.88})
    # the fake's step times are made up, the client's latencies real: the share is only their ratio here
    assert alone["client_latency_s_sum"] > 0
    assert st["decode_share"]["without_draft"] == round(0.88 / alone["client_latency_s_sum"], 4)
    # the tokens/s of a fake server are noise around 1.0x: the line says why exactly when the median is below 1.0x
    below = report["throughput"]["speedup"] < 1.0
    assert ("held-out prompts: the draft slows serving" in capsys.readouterr().out) == below

    # A target-alone run cached before 05 read the step counters is measured again, so that the report can say why.
    path = run / "eval" / "baseline.json"
    cached = json.loads(path.read_text())
    assert len(cached["step_counters_runs"]) == 2  # per timed run
    for counters in cached["step_counters_runs"]:
        assert {k: v for k, v in counters.items() if k != "client_latency_s_sum"} == pytest.approx(
            {"iterations": 44, "iteration_s_sum": 0.44, "generation_tokens": 48, "requests": 4, "decode_s_sum": 0.44})
    assert evaluate.cached_baseline(cfg) is not None
    del cached["step_counters_runs"]
    path.write_text(json.dumps(cached))
    assert evaluate.cached_baseline(cfg) is None


def test_a_server_without_step_timing_leaves_the_report_as_it_was_with_the_reason(run_env):  # noqa: F811
    assert evaluate.run_stage(run_env.cfg) == 0  # FakeVllm: spec-decode counters only
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    assert report["step_times"] == {"measured": False, "reason": "the target-alone server's /metrics has no "
                                                                 "vllm:inter_token_latency_seconds for every timed run"}
    assert report["acceptance_length"] == pytest.approx(1.9)
