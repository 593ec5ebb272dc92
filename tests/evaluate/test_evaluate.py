"""Stage 05 without vLLM: metrics parsing, counter deltas, acceptance math, the plot, the report.

The whole-stage tests swap the vLLM server for a small fake OpenAI-compatible HTTP server that
answers deterministically and exposes spec-decode counters in Prometheus text on /metrics, so
the report's numbers can be checked exactly. The real-vLLM run is in tests/pipeline/test_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.config import config_from_dict
from common.core.errors import DataError, PipelineError
from common.core.run_folder import HELD_OUT
from common.evaluate import serve
from common.evaluate import stage as evaluate
from common.evaluate.draft import draft_fingerprint, offline_prediction
from common.evaluate.plots import plot_report, training_curves
from common.evaluate.prompt_sets import load_prompt_set
from common.evaluate.report import compare_outputs, mismatch_examples
from common.train.export import prediction_record
from common.serving.vllm_server import metrics_delta, parse_prometheus, scrape_metrics, spec_decode_metrics
from tests.helpers import FakeVllm, LocalHttpServer

ROOT = Path(__file__).resolve().parents[2]

# /metrics as vLLM 0.32 writes it (prometheus_client text format): counters carry `_total`, every
# series has model_name and engine labels (two engines here), `_created` gauges sit beside them,
# and unrelated metrics surround them.
METRICS_BEFORE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/runs/tiny/target"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/runs/tiny/target"} 812.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/runs/tiny/target"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="/runs/tiny/target"} 20.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="/runs/tiny/target"} 1.7962231244026146e+09
vllm:spec_decode_num_drafts_created{engine="1",model_name="/runs/tiny/target"} 1.7962231244026146e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/runs/tiny/target"} 300.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="/runs/tiny/target"} 60.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/runs/tiny/target"} 150.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="/runs/tiny/target"} 30.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/runs/tiny/target",position="0"} 80.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/runs/tiny/target",position="1"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/runs/tiny/target",position="2"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/runs/tiny/target",position="0"} 16.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/runs/tiny/target",position="1"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="/runs/tiny/target",position="2"} 4.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="/runs/tiny/target",position="0"} 1.796223124402662e+09
"""


def test_parse_recorded_metrics_sums_engines_and_reads_positions():
    m = spec_decode_metrics(parse_prometheus(METRICS_BEFORE))
    assert m["num_drafts"] == 120.0
    assert m["num_draft_tokens"] == 360.0
    assert m["num_accepted_tokens"] == 180.0
    assert m["num_accepted_tokens_per_pos"] == {0: 96.0, 1: 60.0, 2: 24.0}
    assert m["acceptance_length"] == pytest.approx(1.0 + 180 / 120)


def test_a_metrics_page_that_is_not_prometheus_text_is_a_clear_error():
    class HtmlServer(LocalHttpServer):  # e.g. a proxy's error page where vLLM should be
        def handle(self, request, method):
            self.reply(request, 200, "<html>502 Bad Gateway</html>\n", "text/html")

    with HtmlServer() as server:
        with pytest.raises(PipelineError, match=r"/metrics is not in the Prometheus text format"):
            scrape_metrics(server.base_url)


def test_counter_delta_and_acceptance_math_hand_checked():
    before = spec_decode_metrics(parse_prometheus(METRICS_BEFORE))
    # During the evaluation: 40 drafts of 3 tokens; 30 + 20 + 10 = 60 accepted.
    after_text = (
        METRICS_BEFORE.replace('drafts_total{engine="0",model_name="/runs/tiny/target"} 100.0', 'drafts_total{engine="0",model_name="/runs/tiny/target"} 130.0')
        .replace('drafts_total{engine="1",model_name="/runs/tiny/target"} 20.0', 'drafts_total{engine="1",model_name="/runs/tiny/target"} 30.0')
        .replace('draft_tokens_total{engine="0",model_name="/runs/tiny/target"} 300.0', 'draft_tokens_total{engine="0",model_name="/runs/tiny/target"} 420.0')
        .replace('accepted_tokens_total{engine="0",model_name="/runs/tiny/target"} 150.0', 'accepted_tokens_total{engine="0",model_name="/runs/tiny/target"} 210.0')
        .replace('position="0"} 80.0', 'position="0"} 110.0')
        .replace('position="1"} 50.0', 'position="1"} 70.0')
        .replace('position="2"} 20.0', 'position="2"} 30.0')
    )
    after = spec_decode_metrics(parse_prometheus(after_text))
    delta = metrics_delta(after, before)
    assert delta["num_drafts"] == 40 and delta["num_draft_tokens"] == 120 and delta["num_accepted_tokens"] == 60
    assert delta["num_accepted_tokens_per_pos"] == {0: 30.0, 1: 20.0, 2: 10.0}

    acc = serve.acceptance_metrics(delta, num_speculative_tokens=3)
    assert acc["acceptance_length"] == pytest.approx(1.0 + 60 / 40)  # 2.5
    assert acc["per_position_acceptance"] == pytest.approx([30 / 40, 20 / 40, 10 / 40])
    assert acc["draft_acceptance_rate"] == pytest.approx(60 / 120)
    assert acc["counters"] == {"num_drafts": 40, "num_draft_tokens": 120, "num_accepted_tokens": 60,
                               "num_accepted_tokens_per_pos": [30, 20, 10]}
    # The per-position rates add up to accepted/drafts, so AL = 1 + their sum.
    assert 1 + sum(acc["per_position_acceptance"]) == pytest.approx(acc["acceptance_length"])


def test_acceptance_metrics_pads_missing_positions_and_rejects_no_drafts():
    delta = {"num_drafts": 10.0, "num_draft_tokens": 40.0, "num_accepted_tokens": 7.0,
             "num_accepted_tokens_per_pos": {0: 5.0, 1: 2.0}}
    acc = serve.acceptance_metrics(delta, num_speculative_tokens=4)
    assert acc["per_position_acceptance"] == pytest.approx([0.5, 0.2, 0.0, 0.0])
    assert acc["acceptance_length"] == pytest.approx(1.7)
    with pytest.raises(PipelineError, match="no speculative drafts"):
        serve.acceptance_metrics({**delta, "num_drafts": 0.0}, 3)
    with pytest.raises(PipelineError, match="went down"):
        serve.acceptance_metrics({**delta, "num_accepted_tokens": -1.0}, 3)


def test_compare_outputs_counts_and_shows_mismatches():
    a = {"p1": {"reasoning": "r", "content": "same"}, "p2": {"reasoning": "", "content": "abcdef"}, "p3": {"content": "x"}}
    b = {"p1": {"reasoning": "r", "content": "same"}, "p2": {"reasoning": "", "content": "abcXef"}, "p3": {"content": "x"}}
    cmp = compare_outputs(a, b)
    assert cmp == {"compared": 3, "identical": 2, "mismatched_ids": ["p2"]}
    ex = mismatch_examples(cmp["mismatched_ids"], a, b)
    assert ex[0]["id"] == "p2" and ex[0]["first_difference_at_char"] == len("\n----\n") + 3


def test_training_curves_and_plot_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"type": "train", "step": s, "loss": 5.0 / s, "step_acc": [0.5 + s / 100, 0.3 + s / 200]} for s in (10, 20, 30)]
    rows.append({"type": "eval", "step": 30, "loss": 0.2, "step_acc": [0.8, 0.45]})
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"type": "train", "st')  # torn tail
    curves = training_curves(metrics)
    assert curves["train"]["loss"] == [(10, 0.5), (20, 0.25), (30, 5.0 / 30)]
    assert curves["train"]["acc"][1] == [(10, 0.3 + 10 / 200), (20, 0.3 + 20 / 200), (30, 0.3 + 30 / 200)]
    assert curves["eval"]["acc"] == {0: [(30, 0.8)], 1: [(30, 0.45)]}

    report = {"acceptance_length": 2.31, "num_speculative_tokens": 3, "per_position_acceptance": [0.71, 0.41, 0.19],
              "offline": {"expected_per_position": [0.8, 0.36, 0.072]}, "prompt_sets": {}}
    out = plot_report(report, metrics, tmp_path / "eval" / "report.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # No metrics file: still a figure (with a note), not an error.
    out2 = plot_report({**report, "offline": None}, tmp_path / "missing.jsonl", tmp_path / "r2.png")
    assert out2.stat().st_size > 5_000


# ----------------------------------------------------------------------------- the stage, on a fake server


def draft_config_json(aux_layer_ids=(1, 2, 3)) -> str:
    """A valid EAGLE-3 draft config.json, as 04 exports it (05 reads it before vLLM does)."""
    from common.model.draft import DraftModelConfig

    config = DraftModelConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, vocab_size=256, draft_vocab_size=128, target_hidden_size=64,
                              aux_layer_ids=list(aux_layer_ids))
    return json.dumps(config.to_vllm_config(), indent=2)


def write_draft(path: Path, weights: bytes, aux_layer_ids=(1, 2, 3), **records) -> Path:
    """A stand-in exported draft: a valid config.json, `weights` as model.safetensors (05 hashes them,
    the fake server never loads them), and records such as best_json={"step": 20} or prediction_json=
    prediction_of(eval_line) (04's prediction for it)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(draft_config_json(aux_layer_ids))
    (path / "model.safetensors").write_bytes(weights)
    for name, record in records.items():
        (path / name.replace("_json", ".json")).write_text(json.dumps(record))
    return path


def prediction_of(eval_line: dict, k: int = 3) -> dict:
    """prediction.json as 04 writes it into an export at the eval line's step (common.train.export)."""
    return prediction_record(eval_line["step"], k, eval_line, why_no_eval="unused: the eval is there")


class RunEnv:
    def __init__(self, cfg, run, final):
        self.cfg, self.run, self.final = cfg, run, final
        self.started: list[dict] = []  # servers the stage started, in order
        self.diverge: tuple[str, ...] = ()  # user texts whose reply changes with the draft
        self.die_on_chat = False  # the servers drop every chat request (an engine that died)


@pytest.fixture
def run_env(tmp_path, monkeypatch, chat_tokenizer_dir):
    """A run_dir with prompts, a fake draft and offline report; target_server swapped for FakeVllm. The target is a
    config and a tokenizer (05 counts each prompt's tokens against server.max_model_len)."""
    target = tmp_path / "target"
    shutil.copytree(chat_tokenizer_dir, target)
    (target / "config.json").write_text('{"model_type": "llama"}')
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    prompts = []
    for i in range(12):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}]
        if i == 3:  # multi-turn: only the first user turn is sent
            messages.append({"role": "user", "content": "and a follow-up"})
        prompts.append({"id": f"p{i}", "messages": messages, "split": "eval" if i % 2 else "train"})
    (run / "data" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    last_eval = {"type": "eval", "step": 40, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4, 0.3], "tau": {"3": 2.02, "4": 2.056}}
    final = write_draft(run / "train" / "final", b"fake weights v1", training_summary_json={"step": 40},
                        prediction_json=prediction_of(last_eval))
    (run / "train" / "eval_report.json").write_text(json.dumps(last_eval))
    (run / "train" / "metrics.jsonl").write_text(json.dumps({"type": "train", "step": 10, "loss": 3.0, "step_acc": [0.3, 0.2, 0.1, 0.05]}) + "\n")

    cfg = config_from_dict({
        "run_dir": str(run), "target": {"model": str(target), "dtype": "float32"},
        # one timed run per set (the request counts below); test_throughput_is_the_median_of_repeated_runs: more
        "evaluate": {"num_prompts": 4, "num_speculative_tokens": 3, "max_tokens": 64, "temperature": 0.0, "concurrency": 2,
                     "throughput_repeats": 1},
    })
    env = RunEnv(cfg, run, final)
    serve_fakes(env, monkeypatch, lambda speculative: FakeVllm(with_draft=speculative is not None, diverge=env.diverge,
                                                               die_on_chat=env.die_on_chat))
    return env


def serve_fakes(env, monkeypatch, make_server) -> None:
    """serve.target_server swapped for fake vLLM servers, make_server(speculative) each; every start is recorded in
    env.started (its speculative config, the server, its log path)."""
    @contextlib.contextmanager
    def fake_target_server(cfg_, speculative=None, log_path=None):
        with make_server(speculative) as server:
            env.started.append({"speculative": speculative, "server": server, "log": log_path})
            yield server

    monkeypatch.setattr(serve, "target_server", fake_target_server)


def test_eval_prompts_are_the_eval_split_first_turn(run_env):
    prompts = load_prompt_set(run_env.cfg, HELD_OUT).prompts
    assert [p["id"] for p in prompts] == ["p1", "p3", "p5", "p7"]
    assert prompts[1]["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "question 3"}]


def test_stage_report_schema_values_and_resume(run_env, capsys):
    cfg, run = run_env.cfg, run_env.run
    assert evaluate.run_stage(cfg) == 0
    report = json.loads((run / "eval" / "report.json").read_text())

    # Two servers: the draft one with the eagle3 speculative config, then the target alone.
    assert [s["speculative"] for s in run_env.started] == [
        {"method": "eagle3", "model": str(run_env.final), "num_speculative_tokens": 3}, None]
    # 4 timed requests with the draft (the warm-up came before the first scrape): 40 drafts, 36 accepted.
    assert report["counters"] == {"num_drafts": 40, "num_draft_tokens": 120, "num_accepted_tokens": 36,
                                  "num_accepted_tokens_per_pos": [20, 12, 4]}
    assert report["acceptance_length"] == pytest.approx(1.9)
    assert report["per_position_acceptance"] == pytest.approx([0.5, 0.3, 0.1])
    assert report["draft_acceptance_rate"] == pytest.approx(0.3)
    assert report["num_speculative_tokens"] == 3 and report["num_prompts"] == 4
    assert report["offline"]["expected_acceptance_length"] == pytest.approx(2.02)
    assert report["offline"]["step_acc"] == [0.6, 0.5, 0.4, 0.3]
    assert report["offline"]["expected_per_position"] == pytest.approx([0.6, 0.3, 0.12])
    assert report["outputs"] == {"compared": 4, "identical": 4, "mismatched_ids": [], "greedy": True,
                                 "all_identical": True, "mismatch_examples": []}
    tp = report["throughput"]
    assert tp["with_draft"]["output_tokens"] == tp["without_draft"]["output_tokens"] == 4 * 12
    assert tp["speedup"] == pytest.approx(tp["with_draft"]["tokens_per_s"] / tp["without_draft"]["tokens_per_s"], rel=1e-3)
    assert report["complete"] is True and report["draft_sha256"] == draft_fingerprint(run_env.final)
    assert set(report["sampling"]) == {"temperature", "max_tokens", "concurrency", "enable_thinking"}
    assert (run / "eval" / "report.png").stat().st_size > 5_000
    rows = [json.loads(line) for line in (run / "eval" / "outputs.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["p1", "p3", "p5", "p7"]
    assert rows[1]["with_draft"]["content"] == "answer to question 3" and rows[1]["identical"] is True
    out = capsys.readouterr().out
    assert "acceptance length 1.90 (k=3) | per-position 0.50/0.30/0.10" in out

    # Same draft, same config: nothing to do, no server started.
    n = len(run_env.started)
    assert evaluate.run_stage(cfg) == 0
    assert "already complete" in capsys.readouterr().out and len(run_env.started) == n

    # A new draft (different weights): evaluated again; the target-alone baseline is reused.
    (run_env.final / "model.safetensors").write_bytes(b"fake weights v2")
    assert evaluate.run_stage(cfg) == 0
    assert [s["speculative"] is not None for s in run_env.started[n:]] == [True]


def test_a_moved_run_and_target_are_measured_already(run_env, tmp_path, capsys):
    """Issue 33, case 11: 05 keyed its report on the draft's and the target's paths, so moving the run folder (or the
    target) measured everything again in vLLM. Both are keyed by content now: the moved run is complete, no server."""
    assert evaluate.run_stage(run_env.cfg) == 0
    report = (run_env.run / "eval" / "report.json").read_bytes()
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(run_env.run, moved / "run")
    shutil.move(tmp_path / "target", moved / "target")
    tree = run_env.cfg.to_dict()
    cfg = config_from_dict({**tree, "run_dir": str(moved / "run"), "target": {**tree["target"], "model": str(moved / "target")}})
    run_env.started.clear()
    capsys.readouterr()
    assert evaluate.run_stage(cfg) == 0
    assert "already complete" in capsys.readouterr().out and run_env.started == []
    assert (moved / "run" / "eval" / "report.json").read_bytes() == report
    # other target weights are another measurement
    (moved / "target" / "model.safetensors").write_bytes(b"other weights")
    assert evaluate.run_stage(cfg) == 0 and len(run_env.started) == 2


def test_stage_reports_greedy_mismatches(run_env, capsys):
    run_env.diverge = ("question 5",)
    assert evaluate.run_stage(run_env.cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    assert report["outputs"]["identical"] == 3 and report["outputs"]["mismatched_ids"] == ["p5"]
    assert report["outputs"]["all_identical"] is False
    assert report["outputs"]["mismatch_examples"][0]["with_draft"].endswith("answer to question 5 (diverged)")
    assert "WARNING" in capsys.readouterr().err


def test_baseline_only_on_a_running_server_is_reused(run_env, capsys):
    cfg = run_env.cfg
    with FakeVllm(with_draft=False) as server:
        assert evaluate.run_stage(cfg, baseline_only=True, base_url=server.base_url) == 0
        assert len(server.requests) == 5  # warm-up + 4 prompts
        assert evaluate.run_stage(cfg, baseline_only=True, base_url=server.base_url) == 0
        assert "baseline already complete" in capsys.readouterr().out
    assert evaluate.cached_baseline(cfg) is not None
    assert evaluate.run_stage(cfg) == 0
    assert [s["speculative"] is not None for s in run_env.started] == [True]  # no target-alone server
    # A different sampling setting invalidates the cached baseline.
    cfg2 = config_from_dict({**cfg.to_dict(), "evaluate": {**cfg.to_dict()["evaluate"], "max_tokens": 32}})
    assert evaluate.cached_baseline(cfg2) is None


def test_throughput_is_the_median_of_repeated_runs(run_env, capsys):
    """One timed run of a few seconds varied by tens of percent (0.79x and 0.94x for one draft on one machine):
    each server runs each set evaluate.throughput_repeats times; tokens/s is the median, with the runs and the
    speedup's range in the report and the summary line. The acceptance counters cover the first run only."""
    tree = run_env.cfg.to_dict()
    cfg = config_from_dict({**tree, "evaluate": {**tree["evaluate"], "throughput_repeats": 3}})
    assert evaluate.run_stage(cfg) == 0
    with_draft, alone = (s["server"] for s in run_env.started)
    assert len(with_draft.requests) == len(alone.requests) == 1 + 3 * 4  # warm-up + 3 runs of 4 prompts
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    tp = report["throughput"]
    for side in ("with_draft", "without_draft"):
        runs = tp[side]["tokens_per_s_runs"]
        assert len(runs) == 3 and tp[side]["tokens_per_s"] == round(sorted(runs)[1], 2)
        assert tp[side]["tokens_per_s_range"] == [min(runs), max(runs)]
    assert tp["speedup"] == round(tp["with_draft"]["tokens_per_s"] / tp["without_draft"]["tokens_per_s"], 4)
    low, high = tp["speedup_range"]
    assert low <= tp["speedup"] <= high
    assert f"x tokens/s ({low:.2f}-{high:.2f} over 3+3 runs" in capsys.readouterr().out
    assert report["counters"]["num_drafts"] == 10 * 4  # the first run's window only (FakeVllm: 10 drafts a request)


NOISE = ": more than the acceptance length allows, so the timing is noise (a busy machine?): raise evaluate.throughput_repeats"


@pytest.mark.parametrize("with_draft, without_draft, verdict, said", [
    ([60.0, 62.0, 70.0], [100.0, 98.0, 103.0], "slower", ": the draft slows serving"),
    ([220.0, 210.0, 230.0], [100.0, 98.0, 103.0], "faster", ""),
    ([90.0, 110.0, 100.0], [100.0, 95.0, 105.0], "within the runs' spread", ""),
    ([310.0, 320.0, 330.0], [100.0, 98.0, 103.0], "faster", NOISE),  # 3.0x at the least, with acceptance length 2.5
    ([240.0, 320.0, 330.0], [100.0, 98.0, 103.0], "faster", ""),  # the low end (2.33x) is possible
])
def test_the_speedup_says_plainly_when_the_draft_slows_serving(with_draft, without_draft, verdict, said):
    from common.evaluate.report import set_summary, speedup

    part = speedup(with_draft, without_draft)
    assert part["verdict"] == verdict
    assert part["speedup"] == round(sorted(with_draft)[1] / sorted(without_draft)[1], 4)
    assert part["speedup_range"] == [round(min(with_draft) / max(without_draft), 4), round(max(with_draft) / min(without_draft), 4)]
    line = set_summary({"acceptance_length": 2.5, "num_speculative_tokens": 3, "per_position_acceptance": [0.8, 0.5, 0.2],
                        "outputs": {"identical": 4, "compared": 4},
                        "throughput": {"with_draft": {"tokens_per_s_runs": with_draft},
                                       "without_draft": {"tokens_per_s_runs": without_draft}, **part}})
    low, high = part["speedup_range"]
    assert f"| {part['speedup']:.2f}x tokens/s ({low:.2f}-{high:.2f} over 3+3 runs{said}) |" in line


def test_missing_draft_is_a_clear_error(run_env):
    with pytest.raises(PipelineError, match="run 04_train.py first"):
        evaluate.run_stage(run_env.cfg, draft_dir=str(run_env.run / "nope"))


def test_cli_help_is_light():
    probe = (
        "import runpy, sys\n"
        "sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'vllm', 'matplotlib') if m in sys.modules))\n"
    )
    for script in ("05_evaluate.py", "run_pipeline.py"):
        res = subprocess.run([sys.executable, "-c", probe, str(ROOT / script)], capture_output=True, text=True, cwd=ROOT)
        assert res.returncode == 0, res.stderr
        assert "usage:" in res.stdout and "HEAVY []" in res.stdout, res.stdout


# ----------------------------------------------------------------------------- other-kind prompts, replay prediction


def write_other_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"o{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    return path


def with_other(cfg, path) -> object:
    tree = cfg.to_dict()
    return config_from_dict({**tree, "evaluate": {**tree["evaluate"], "other_prompts": str(path)}})


def test_other_prompts_are_measured_apart_and_baselined_on_the_generation_server(run_env, capsys):
    other = write_other_prompts(run_env.run.parent / "other.jsonl", ["plan a trip", "bake bread", "hello"])
    cfg = with_other(run_env.cfg, other)
    assert [p["id"] for p in load_prompt_set(cfg, "other").prompts] == ["o0", "o1", "o2"]
    assert evaluate.missing_baselines(cfg) == ["held_out", "other"]
    with FakeVllm(with_draft=False) as server:
        assert evaluate.run_stage(cfg, baseline_only=True, base_url=server.base_url) == 0
        assert len(server.requests) == 2 + 4 + 3  # a warm-up per set, 4 held-out and 3 other prompts
    assert evaluate.missing_baselines(cfg) == []
    assert evaluate.run_stage(cfg) == 0
    assert [s["speculative"] is not None for s in run_env.started] == [True]  # one server: the draft's
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    # held-out: 4 requests x (10 drafts, 9 accepted); other: 3 requests, scraped separately
    assert report["counters"]["num_drafts"] == 40 and report["num_prompts"] == 4
    o = report["other_prompts"]
    assert o["path"] == o["source"] == str(other) and o["num_prompts"] == 3 and o["rows_read"] == 3
    assert report["prompt_sets"] == {"other": {k: v for k, v in o.items() if k != "path"}}  # the same section
    assert o["counters"] == {"num_drafts": 30, "num_draft_tokens": 90, "num_accepted_tokens": 27,
                             "num_accepted_tokens_per_pos": [15, 9, 3]}
    assert o["acceptance_length"] == pytest.approx(1.9) and o["outputs"]["identical"] == 3
    rows = [json.loads(line) for line in (run_env.run / "eval" / "outputs-other.jsonl").read_text().splitlines()]
    assert [r["with_draft"]["content"] for r in rows] == ["answer to plan a trip", "answer to bake bread", "answer to hello"]
    assert ("05_evaluate: prompt set other (3 prompts): acceptance length 1.90 (k=3) | per-position 0.50/0.30/0.10"
            in capsys.readouterr().out)
    # Dropping the other set changes the report key: measured again.
    assert evaluate.run_stage(run_env.cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    assert report["other_prompts"] is None and report["prompt_sets"] == {}


def test_other_prompts_must_exist_and_stay_apart_from_training(run_env):
    cfg = with_other(run_env.cfg, run_env.run.parent / "missing.jsonl")
    with pytest.raises(DataError, match="evaluate.other_prompts file not found: .*missing.jsonl; check evaluate.other_prompts "):
        load_prompt_set(cfg, "other")
    # "question 2" is a train-split prompt of the run
    cfg = with_other(run_env.cfg, write_other_prompts(run_env.run.parent / "o.jsonl", ["new topic", "question 2"]))
    with pytest.raises(DataError, match="shares 1 prompt.* with the training data .first: o1."):
        load_prompt_set(cfg, "other")


def test_shipped_other_prompts_are_another_kind_than_the_sample_prompts():
    from common.demo.other_prompts import other_prompt_rows

    rows = [json.loads(line) for line in (ROOT / "data" / "other_prompts.jsonl").read_text().splitlines()]
    assert rows == other_prompt_rows()  # the shipped file is what the generator writes
    sample_users = {json.dumps(m.get("content", m.get("value"))).strip('"')
                    for line in (ROOT / "data" / "sample_prompts.jsonl").read_text().splitlines()
                    for m in (json.loads(line).get("messages") or json.loads(line).get("conversations") or [])
                    if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human")}
    assert len(sample_users) > 300
    other_users = [r["messages"][0]["content"] for r in rows]
    assert not sample_users & {json.dumps(t).strip('"') for t in other_users}
    assert len(set(r["kind"] for r in rows)) >= 8
    lengths = sorted(len(t) for t in other_users)
    assert lengths[0] < 10 and lengths[-1] > 1000  # one-word prompts to pasted texts


def test_offline_prediction_is_the_replay_with_its_error(run_env, capsys):
    eval_report = {"type": "eval", "step": 40, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4, 0.3], "tau": {"3": 2.02},
                   "replay": {"3": {"acceptance_length": 1.8, "per_position": [0.5, 0.2, 0.1], "rounds": 100,
                                    "accepted_per_pos": [50, 20, 10]}}}
    (run_env.final / "prediction.json").write_text(json.dumps(prediction_of(eval_report)))
    assert evaluate.run_stage(run_env.cfg) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    off = report["offline"]
    assert off["prediction"] == "replay" and off["expected_acceptance_length"] == 1.8
    assert off["expected_per_position"] == [0.5, 0.2, 0.1] and off["replay_rounds"] == 100
    assert off["product_formula"] == {"acceptance_length": 2.02, "per_position": pytest.approx([0.6, 0.3, 0.12])}
    assert report["offline_prediction_error"] == pytest.approx((1.8 - 1.9) / 1.9)
    assert "offline replay 1.80 (-5.3%)" in capsys.readouterr().out


def test_replay_served_needs_token_ids_from_the_server(run_env):
    """evaluate.replay_served asks vLLM for return_token_ids; a server that sends none is a clear error."""
    tree = run_env.cfg.to_dict()
    cfg = config_from_dict({**tree, "evaluate": {**tree["evaluate"], "replay_served": True}})
    with pytest.raises(PipelineError, match="returned no token ids for 4 prompt.*replay_served needs vLLM >= 0.10"):
        evaluate.run_stage(cfg)
    requests = run_env.started[0]["server"].requests
    assert len(requests) == 1 + 4  # warm-up + the held-out prompts (no other set configured)
    assert all(body.get("return_token_ids") is True for body in requests)


def test_requests_carry_generate_extra_body_like_01b(run_env):
    """05 sends 01b's request body (common.serving.chat): generate.extra_body and enable_thinking
    reach every request, with and without the draft; a changed extra_body is a new baseline."""
    tree = run_env.cfg.to_dict()
    extra = {"top_k": 1, "chat_template_kwargs": {"custom": "x"}}
    cfg = config_from_dict({**tree, "generate": {**tree["generate"], "extra_body": extra, "enable_thinking": False}})
    assert evaluate.run_stage(cfg) == 0
    requests = [body for s in run_env.started for body in s["server"].requests]
    assert len(requests) == 2 * (1 + 4)  # draft and target alone: warm-up + the held-out prompts
    for body in requests:
        assert body["top_k"] == 1 and body["chat_template_kwargs"] == {"custom": "x", "enable_thinking": False}
        assert "return_token_ids" not in body and "top_p" not in body and body["temperature"] == 0.0
    assert evaluate.cached_baseline(cfg) is not None
    other = config_from_dict({**tree, "generate": {**tree["generate"], "extra_body": {"top_k": 2}, "enable_thinking": False}})
    assert evaluate.cached_baseline(other) is None


def test_an_engine_that_dies_on_the_warm_up_request_is_one_error(run_env):
    """An engine that drops the warm-up request is one error line naming the server's log, not an
    openai.APIConnectionError traceback, and no report is written."""
    run_env.die_on_chat = True
    with pytest.raises(PipelineError, match="failed its warm-up request \\(APIConnectionError: .*see its log under run_dir/logs/"):
        evaluate.run_stage(run_env.cfg)
    assert not (run_env.run / "eval" / "report.json").exists()


# ----------------------------------------------------------------------------- a real vLLM server, SIGKILL


def _api_servers_of(pid: int) -> list:
    import psutil

    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    except psutil.Error:
        return []


@pytest.mark.slow
@pytest.mark.vllm
def test_sigkill_of_05_takes_its_vllm_server_with_it_and_the_rerun_starts(tmp_path):
    """A SIGKILL of 05 takes its vLLM api_server with it (one left running holds its GPU memory, ~70 GB per GPU
    at Kimi scale, and the rerun cannot start). Killed while its server starts, twice: nothing of ours is left
    (the reaper polls every 0.5 s; the 60 s wait is a hang guard, not a speed bound), and the rerun gets as far as
    starting its own server again."""
    import os
    import signal
    import time

    import psutil

    from common.demo.tiny_target import ensure_tiny_target
    from tests.helpers import REPO, write_yaml

    target = ensure_tiny_target("llama")
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}], "split": "eval"} for i in range(4)]
    (run / "data" / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    # a stand-in draft: both runs are killed while their server starts, long before it would load it
    write_draft(run / "train" / "final", b"never loaded")
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(run), "target": {"model": str(target)},
                                             "evaluate": {"num_prompts": 4, "max_tokens": 8}})
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1")
    for attempt in ("first run", "rerun"):
        proc = subprocess.Popen([sys.executable, str(REPO / "05_evaluate.py"), "--config", str(cfg)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (servers := _api_servers_of(proc.pid)):
                assert proc.poll() is None and time.monotonic() < deadline, f"{attempt}: no vLLM server started"
                time.sleep(0.05)
            time.sleep(1.0)
            ours = [p for p in psutil.Process(proc.pid).children(recursive=True) if "common.core.reaper" not in " ".join(p.cmdline())]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            _, left = psutil.wait_procs(ours, timeout=60)
            assert not left, (attempt, [" ".join(p.cmdline())[:80] for p in left])
            assert all(not s.is_running() for s in servers)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- which draft, which prediction


def eval_row(step: int, al: float, per_position: list[float]) -> dict:
    """04's eval line (train/metrics.jsonl, train/eval_report.json, an export's prediction.json) with the replay at k=3."""
    return {"type": "eval", "step": step, "loss": 1.0, "step_acc": [0.6, 0.5, 0.4], "tau": {"3": 2.02},
            "replay": {"3": {"acceptance_length": al, "per_position": per_position, "rounds": 100}}}


def test_05_compares_each_draft_with_its_own_prediction(run_env, tmp_path, capsys):
    """`--draft RUN/train/best` is compared with the best checkpoint's prediction, never the final draft's. The
    prediction is the prediction.json 04 wrote into the draft directory (its eval at the export's step), and it
    travels with the directory; a draft directory without one gets none, and the report says so."""
    run, train = run_env.run, run_env.run / "train"
    at_20, at_40 = eval_row(20, 2.2, [0.7, 0.4, 0.1]), eval_row(40, 1.8, [0.5, 0.2, 0.1])
    (train / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (at_20, at_40)))
    (train / "eval_report.json").write_text(json.dumps(at_40))  # the latest eval: the final draft's
    (run_env.final / "prediction.json").write_text(json.dumps(prediction_of(at_40)))
    best = write_draft(train / "best", b"weights of step 20", best_json={"step": 20, "k": 3, "acceptance_length": 2.2},
                       prediction_json=prediction_of(at_20))

    def evaluate_draft(draft) -> tuple[dict, str]:
        capsys.readouterr()
        assert evaluate.run_stage(run_env.cfg, draft_dir=str(draft)) == 0
        return json.loads((run / "eval" / "report.json").read_text()), capsys.readouterr().out

    report, out = evaluate_draft(best)
    assert report["draft"] == str(best)
    assert report["offline"]["step"] == 20 and report["offline"]["draft"] == str(best)
    assert report["offline"]["path"] == str(best / "prediction.json")
    assert report["offline"]["expected_acceptance_length"] == 2.2
    assert report["offline"]["expected_per_position"] == [0.7, 0.4, 0.1]
    assert report["offline_prediction_error"] == pytest.approx((2.2 - 1.9) / 1.9)
    assert "offline replay 2.20 (+15.8%)" in out

    # A copy of the best draft elsewhere: its prediction.json comes along, the same prediction.
    copy = shutil.copytree(best, tmp_path / "elsewhere" / "my-draft")
    (copy / "best.json").unlink()
    report, _ = evaluate_draft(copy)
    assert report["offline"]["step"] == 20 and report["offline"]["expected_acceptance_length"] == 2.2
    # read from the copy itself: nothing of the run is looked up for it (its logs of step 20 gone, the same)
    (train / "metrics.jsonl").write_text(json.dumps(at_40) + "\n")
    offline = offline_prediction(run_env.cfg, copy)
    assert offline.missing is None and offline.prediction["path"] == str(copy / "prediction.json")
    assert offline.prediction["draft"] == str(copy) and offline.prediction["step"] == 20
    assert offline.prediction["expected_acceptance_length"] == 2.2

    # The final draft: the last eval's prediction.
    report, _ = evaluate_draft(run_env.final)
    assert report["offline"]["step"] == 40 and report["offline"]["expected_acceptance_length"] == 1.8

    # A draft directory without prediction.json (not exported by this 04): no prediction, said so, never another draft's.
    other = write_draft(tmp_path / "other-draft", b"weights 04 never exported", training_summary_json={"step": 40})
    report, out = evaluate_draft(other)
    assert report["offline"] is None and report["offline_prediction_error"] is None
    assert report["offline_missing"].startswith(f"{other} has no prediction.json: 04 predicted nothing for it (")
    assert "no offline prediction for this draft" in out and "offline replay" not in out

    # The best draft whose step has no eval (04 recorded why in its prediction.json): none, not the final one's.
    (best / "prediction.json").write_text(json.dumps(prediction_record(20, 3, None, why_no_eval="the reason 04 gives")))
    report, _ = evaluate_draft(best)
    assert report["offline"] is None and "04 logged no eval at step 20" in report["offline_missing"]
    assert report["offline_missing"] == f"04 logged no eval at step 20: the reason 04 gives ({best / 'prediction.json'})"

    # A prediction.json that cannot be read (cut short): none, and the reason says which file and what to do.
    (best / "prediction.json").write_text('{"step": 20, "k": 3, "eval": {"ste')
    offline = offline_prediction(run_env.cfg, best)
    assert offline.prediction is None
    assert offline.missing.startswith(f"cannot read 04's prediction {best / 'prediction.json'} (")
    assert offline.missing.endswith("re-export the draft (rerun 04_train.py)")


def cli_config(run_env) -> Path:
    """run_env's config as a YAML file, for 05_evaluate.py's command line."""
    import yaml

    path = run_env.run.parent / "run.yaml"
    path.write_text(yaml.safe_dump(run_env.cfg.to_dict()))
    return path


def eval_files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "eval").iterdir())} if (run / "eval").is_dir() else {}


BROKEN_DRAFT_CONFIGS = {
    "truncated": (lambda text: text[:len(text) // 2], "is not a readable JSON file"),
    "no hidden_size": (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "hidden_size"}),
                       "has no 'hidden_size', which an EAGLE-3 draft config needs"),
    "no aux layer ids": (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if "aux" not in k and k != "eagle_config"}),
                         "has no eagle_aux_hidden_state_layer_ids"),
    "not an object": (lambda text: "[1, 2, 3]", "holds a JSON list, not a draft config object"),
}


@pytest.mark.parametrize("case", list(BROKEN_DRAFT_CONFIGS))
def test_05_refuses_a_broken_draft_config_before_vllm_and_before_overwrite_deletes(run_env, case):
    """A broken draft config.json (truncated, a key missing, not an object) is one error line from 05, before vLLM
    sees it (no vLLM traceback) and before --overwrite deletes the previous eval/ outputs."""
    from tests.helpers import error_line, run_stage as run_cli

    assert evaluate.run_stage(run_env.cfg) == 0
    before = eval_files(run_env.run)
    assert {"report.json", "report.png", "outputs.jsonl", "baseline.json"} <= set(before)
    damage, fragment = BROKEN_DRAFT_CONFIGS[case]
    (run_env.final / "config.json").write_text(damage((run_env.final / "config.json").read_text()))
    res = run_cli("05_evaluate.py", cli_config(run_env), "--overwrite", timeout=120)
    error_line(res, f"{run_env.final / 'config.json'} ", fragment, "re-export the draft (rerun 04_train.py)")
    assert "vllm" not in res.stderr.lower()
    assert eval_files(run_env.run) == before  # byte-identical: nothing deleted before the refusal


def test_05_overwrite_keeps_the_previous_outputs_until_vllm_runs_with_the_draft(run_env, monkeypatch):
    """--overwrite deletes the previous eval/ outputs only once vLLM runs with the draft and answered its warm-up:
    a vLLM that does not start, or an engine that dies on its first request, is an error that leaves them byte
    for byte (and the stage record complete); a working --overwrite then measures everything again, the
    target alone included."""
    from common.core.run_folder import Layout, read_manifest

    assert evaluate.run_stage(run_env.cfg) == 0
    before = eval_files(run_env.run)
    assert {"report.json", "report.png", "outputs.jsonl", "baseline.json"} <= set(before)

    @contextlib.contextmanager
    def vllm_that_does_not_start(cfg_, speculative=None, log_path=None):
        raise PipelineError("the vLLM server exited with code 1 while starting; see its log")
        yield

    with monkeypatch.context() as m:
        m.setattr(serve, "target_server", vllm_that_does_not_start)
        with pytest.raises(PipelineError, match="while starting"):
            evaluate.run_stage(run_env.cfg, overwrite=True)
    assert eval_files(run_env.run) == before
    run_env.die_on_chat = True
    with pytest.raises(PipelineError, match="failed its warm-up request"):
        evaluate.run_stage(run_env.cfg, overwrite=True)
    assert eval_files(run_env.run) == before
    assert read_manifest(Layout.of(run_env.cfg), "05_evaluate")["state"] == "complete"

    run_env.die_on_chat = False
    started = len(run_env.started)
    assert evaluate.run_stage(run_env.cfg, overwrite=True) == 0
    assert [s["speculative"] is not None for s in run_env.started[started:]] == [True, False]  # draft, then target alone
    after = eval_files(run_env.run)
    assert set(after) == set(before) and after["baseline.json"] != before["baseline.json"]  # measured again (new time)
    assert read_manifest(Layout.of(run_env.cfg), "05_evaluate")["state"] == "complete"


def test_05_refuses_a_draft_trained_on_other_aux_layers(run_env, tmp_path, capsys):
    """A draft whose eagle_aux_hidden_state_layer_ids differ from this run's extraction is refused in one line
    (this run's prediction says nothing about it); --foreign-draft measures it, without this run's prediction."""
    from tests.helpers import error_line, run_stage as run_cli

    (run_env.run / "hidden").mkdir()
    (run_env.run / "hidden" / "index.json").write_text(json.dumps({"format_version": 2, "aux_layer_ids": [1, 2, 3]}))
    foreign = write_draft(tmp_path / "published-draft", b"someone else's weights", aux_layer_ids=(2, 3, 4))
    res = run_cli("05_evaluate.py", cli_config(run_env), "--draft", str(foreign), timeout=120)
    error_line(res, f"the draft {foreign} reads the target's aux layers [2, 3, 4]",
               f"this run extracted [1, 2, 3] ({run_env.run / 'hidden' / 'index.json'})", "--foreign-draft")
    assert not (run_env.run / "eval").exists()

    assert evaluate.run_stage(run_env.cfg, draft_dir=str(foreign), foreign_draft=True) == 0
    report = json.loads((run_env.run / "eval" / "report.json").read_text())
    assert report["draft"] == str(foreign) and report["acceptance_length"] == pytest.approx(1.9)
    assert report["offline"] is None and report["offline_prediction_error"] is None
    assert report["offline_missing"] == "--foreign-draft: not this run's draft" and report["key"]["foreign_draft"] is True
    assert "offline replay" not in capsys.readouterr().out
    # this run's own draft (aux ids [1, 2, 3]) is still measured against its prediction
    assert evaluate.run_stage(run_env.cfg) == 0
    assert json.loads((run_env.run / "eval" / "report.json").read_text())["offline"]["step"] == 40
