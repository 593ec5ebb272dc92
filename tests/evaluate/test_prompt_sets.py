"""05's prompt sets (evaluate.prompt_sets) and 05 --compare, on the fake vLLM server of test_evaluate.py.

Benchmark files in the shapes they are published in (MT-bench `turns`, GSM8K `question` as a JSON array,
HumanEval `prompt` as parquet, MATH `problem`, chat `messages` / `conversations`), read with 01's reader;
the stage measures each set between its own scrapes, caches a baseline per set and prints a line per set;
--compare puts two drafts side by side. The real vLLM run of both is the slow test at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.core.config import config_from_dict
from common.core.errors import ConfigError, DataError
from common.evaluate import serve
from common.evaluate import stage as evaluate
from common.evaluate.compare import run_compare
from common.evaluate.prompt_sets import load_prompt_sets
from common.evaluate.report import set_part, summary_lines
from tests.evaluate.test_evaluate import RunEnv, cli_config, run_env, serve_fakes, write_draft  # noqa: F401 (run_env: a fixture)
from tests.helpers import FakeVllm, error_line, run_stage as run_cli


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def benchmark_files(root: Path) -> dict[str, Path]:
    """Three small benchmark sets as published: MT-bench (FastChat's question.jsonl), GSM8K (a JSON array
    without ids), HumanEval (parquet), each with a row 05 cannot use."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    mt_bench = write_jsonl(root / "mt_bench" / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post about Hawaii.", "Rewrite it in rhymes."]},
        {"question_id": 82, "category": "writing", "turns": ["Draft an email asking for feedback."]},
        {"question_id": 83, "category": "roleplay", "reference": ["no turns in this row"]},  # counted: no_prompt_field
        '{"question_id": 84, "turns": ["a torn line"',  # counted: malformed_json
        {"question_id": 85, "category": "math", "turns": ["Solve x^2 = 4."]},
    ])
    gsm8k = root / "gsm8k.json"
    gsm8k.write_text(json.dumps([{"question": f"Natalia sold {n} clips. How many are left?", "answer": "#### 1"}
                                 for n in range(6)]))
    humaneval = root / "humaneval.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"task_id": "HumanEval/0", "prompt": "def has_close_elements(numbers, threshold):\n", "entry_point": "f"},
        {"task_id": "HumanEval/1", "prompt": "   ", "entry_point": "g"},  # counted: empty
        {"task_id": "HumanEval/2", "prompt": "def truncate_number(number: float) -> float:\n", "entry_point": "h"},
    ]), humaneval)
    return {"mt_bench": mt_bench, "gsm8k": gsm8k, "humaneval": humaneval}


def with_sets(cfg, prompt_sets: dict, **evaluate_keys):
    tree = cfg.to_dict()
    return config_from_dict({**tree, "evaluate": {**tree["evaluate"], "prompt_sets": prompt_sets, **evaluate_keys}})


def test_benchmark_shapes_are_read_first_turn_with_their_ids_and_odd_rows_counted(run_env, tmp_path):
    files = benchmark_files(tmp_path)
    chat = write_jsonl(tmp_path / "chat" / "rows.jsonl", [
        {"id": "c1", "category": "planning",
         "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Plan a picnic."},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and a second turn"}]},
        {"id": "c2", "conversations": [{"from": "human", "value": "Name three rivers."}]},
        {"id": "c3", "prompt": [{"role": "user", "content": "A prompt given as chat messages."}]},
        {"id": "c4", "problem": "Find the sum of the roots of x^2 - 5x + 6."},  # MATH
        {"id": "c5", "text": "Continue this story: once upon a time"},
        {"id": "c6", "messages": [{"role": "system", "content": "only a system turn"}]},  # counted: no_user_turn
        {"id": "c7", "question": 42},  # counted: bad_fields
    ])
    cfg = with_sets(run_env.cfg, {**{name: str(path) for name, path in files.items()}, "chat": str(chat.parent)})
    sets = load_prompt_sets(cfg)
    assert list(sets) == ["held_out", "chat", "gsm8k", "humaneval", "mt_bench"]  # in name order

    mt = sets["mt_bench"]  # MT-bench: the first turn is the prompt, the later ones and the category kept; question_id the id
    assert mt.prompts == [{"id": "81", "messages": [{"role": "user", "content": "Compose a travel blog post about Hawaii."}],
                           "later_turns": ["Rewrite it in rhymes."], "category": "writing"},
                          {"id": "82", "messages": [{"role": "user", "content": "Draft an email asking for feedback."}],
                           "category": "writing"},
                          {"id": "85", "messages": [{"role": "user", "content": "Solve x^2 = 4."}], "category": "math"}]
    assert mt.rows_read == 5 and mt.rows_skipped == {"no_prompt_field": 1, "malformed_json": 1}
    assert mt.first_skipped == f"{files['mt_bench']}:3 (no_prompt_field)"
    # GSM8K: no ids in the rows, so NAME-ROW; evaluate.num_prompts (4) of its 6 rows
    gsm8k = sets["gsm8k"]
    assert [p["id"] for p in gsm8k.prompts] == ["gsm8k-1", "gsm8k-2", "gsm8k-3", "gsm8k-4"] and gsm8k.rows_read == 4
    assert gsm8k.prompts[2] == {"id": "gsm8k-3", "messages": [{"role": "user", "content": "Natalia sold 2 clips. How many are left?"}]}
    he = sets["humaneval"]
    assert [p["id"] for p in he.prompts] == ["HumanEval/0", "HumanEval/2"] and he.rows_skipped == {"empty": 1}
    assert he.prompts[1]["messages"][0]["content"] == "def truncate_number(number: float) -> float:\n"
    chat_set = sets["chat"]
    assert [p["id"] for p in chat_set.prompts] == ["c1", "c2", "c3", "c4"]  # the first 4 usable rows
    assert chat_set.prompts[0] == {"id": "c1", "category": "planning",  # any shape keeps a category; later turns: lists of turns only
                                   "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Plan a picnic."}]}
    assert chat_set.prompts[3]["messages"] == [{"role": "user", "content": "Find the sum of the roots of x^2 - 5x + 6."}]
    assert chat_set.describe() == {"source": str(chat.parent), "rows_read": 4, "rows_skipped": {}}
    # past the first num_prompts usable rows nothing is read: c6 and c7 are counted with a larger limit
    cfg = with_sets(run_env.cfg, {"chat": str(chat)}, num_prompts=10)
    assert load_prompt_sets(cfg)["chat"].rows_skipped == {"no_user_turn": 1, "bad_fields": 1}


def test_a_set_with_no_usable_row_or_no_file_is_one_error_line(run_env, tmp_path):
    """Nothing is measured and nothing written under eval/: the refusal comes before any server."""
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"answer": "4"}, {"turns": []}])
    cfg = with_sets(run_env.cfg, {"odd": str(odd)})
    res = run_cli("05_evaluate.py", cli_config(RunEnv(cfg, run_env.run, run_env.final)), timeout=120)
    error_line(res, f"evaluate.prompt_sets.odd ({odd}) has no usable prompt (2 rows read; skipped: no_prompt_field 1, empty 1; "
                    f"first: {odd}:1 (no_prompt_field)); each row needs messages or conversations with a user turn, turns "
                    f"(MT-bench), prompt (HumanEval), question (GSM8K), problem (MATH) or text")
    assert not (run_env.run / "eval").exists()

    cfg = with_sets(run_env.cfg, {"gone": str(tmp_path / "gone.jsonl")})
    with pytest.raises(DataError, match=r"evaluate.prompt_sets.gone file not found: .*gone.jsonl; check evaluate.prompt_sets.gone "):
        load_prompt_sets(cfg)
    # 01's reader's refusals name the set's key
    (tmp_path / "empty-dir").mkdir()
    cfg = with_sets(run_env.cfg, {"folder": str(tmp_path / "empty-dir")})
    with pytest.raises(DataError, match=r"^evaluate.prompt_sets.folder directory .*empty-dir holds no .jsonl, .json or .parquet files"):
        load_prompt_sets(cfg)


def test_prompts_longer_than_the_server_context_are_left_out_per_set_before_any_request(run_env, tmp_path):
    """A prompt of server.max_model_len tokens or more (as the chat template renders it) is a 400 from vLLM: each set
    leaves such prompts out and counts them (the held-out one too), still measuring num_prompts of the rest; a set left
    with nothing is one error line naming its key, before any server starts."""
    long_text = "Summarise this: " + "and more " * 300  # ~600 tokens
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"question_id": i, "turns": [long_text if i in (2, 3) else f"new topic {i}"]}
                                                    for i in range(1, 7)])
    prompts_path = run_env.run / "data" / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    rows[1]["messages"][-1]["content"] = long_text  # p1: the first eval-split prompt
    prompts_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = with_sets(run_env.cfg, {"mixed": str(mixed)}).to_dict()
    cfg = config_from_dict({**tree, "server": {**tree["server"], "max_model_len": 256}})
    sets = load_prompt_sets(cfg)
    assert [p["id"] for p in sets["mixed"].prompts] == ["1", "4", "5", "6"]
    assert sets["mixed"].rows_skipped == {"over_max_model_len": 2}
    assert [p["id"] for p in sets["held_out"].prompts] == ["p3", "p5", "p7", "p9"]
    assert sets["held_out"].rows_skipped == {"over_max_model_len": 1}

    only_long = write_jsonl(tmp_path / "long.jsonl", [{"question_id": i, "turns": [long_text]} for i in range(2)])
    tree = with_sets(run_env.cfg, {"long": str(only_long)}).to_dict()
    cfg = config_from_dict({**tree, "server": {**tree["server"], "max_model_len": 256}})
    res = run_cli("05_evaluate.py", cli_config(RunEnv(cfg, run_env.run, run_env.final)), timeout=120)
    error_line(res, f"evaluate.prompt_sets.long ({only_long}) has no usable prompt (2 rows read; skipped: over_max_model_len 2",
               "or raise server.max_model_len")
    assert not (run_env.run / "eval").exists()


def test_a_set_sharing_a_prompt_with_the_training_data_is_refused(run_env, tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"question_id": 1, "turns": ["new topic"]},
                                                    {"question_id": 2, "turns": ["question 4", "more"]}])  # a train prompt
    with pytest.raises(DataError, match=r"evaluate.prompt_sets.mixed .*mixed.jsonl shares 1 prompt.* training data .first: 2."):
        load_prompt_sets(with_sets(run_env.cfg, {"mixed": str(mixed)}))


@pytest.mark.parametrize("sets, other, message", [
    ({"a/b": "x.jsonl"}, None, "a prompt set's name must be letters, digits"),
    ({"held_out": "x.jsonl"}, None, "the name 'held_out' is taken (the eval split of data.source)"),
    ({"other": "x.jsonl"}, "o.jsonl", "the name 'other' is taken (evaluate.other_prompts)"),
    ({"gsm8k": {"source": "openai/gsm8k", "spilt": "test"}}, None, "must be a file, a directory or a datasets hub name"),
    ({"gsm8k": ""}, None, "must be a file, a directory or a datasets hub name"),
    ({"gsm8k": ["a.jsonl"]}, None, "must be a file, a directory or a datasets hub name"),
])
def test_prompt_sets_are_checked_when_the_config_is_loaded(tmp_path, sets, other, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_dict({"run_dir": str(tmp_path), "evaluate": {"prompt_sets": sets, "other_prompts": other}})
    # a hub set names its subset and split; the split defaults to "test" (where benchmarks keep their questions)
    cfg = config_from_dict({"run_dir": str(tmp_path), "evaluate": {"prompt_sets": {
        "gsm8k": {"source": "openai/gsm8k", "subset": "main"}, "mt": {"source": "HuggingFaceH4/mt_bench_prompts", "split": "train"}}}})
    assert cfg.evaluate.prompt_set_specs() == {"gsm8k": {"source": "openai/gsm8k", "subset": "main", "split": "test"},
                                               "mt": {"source": "HuggingFaceH4/mt_bench_prompts", "subset": None, "split": "train"}}


def test_three_prompt_sets_each_measured_with_its_counts_baseline_plot_and_line(run_env, tmp_path, capsys):
    files = benchmark_files(tmp_path)
    cfg = with_sets(run_env.cfg, {name: str(path) for name, path in files.items()})
    assert evaluate.run_stage(cfg) == 0
    run = run_env.run
    report = json.loads((run / "eval" / "report.json").read_text())
    sets = report["prompt_sets"]
    assert list(sets) == ["gsm8k", "humaneval", "mt_bench"] and report["other_prompts"] is None
    counts = {name: (s["num_prompts"], s["rows_read"], s["rows_skipped"]) for name, s in sets.items()}
    assert counts == {"mt_bench": (3, 5, {"no_prompt_field": 1, "malformed_json": 1}), "gsm8k": (4, 4, {}),
                      "humaneval": (2, 3, {"empty": 1})}
    for name, s in sets.items():  # 10 drafts, 9 accepted per request (FakeVllm), scraped per set
        n = s["num_prompts"]
        assert s["source"] == str(files[name])
        assert s["counters"] == {"num_drafts": 10 * n, "num_draft_tokens": 30 * n, "num_accepted_tokens": 9 * n,
                                 "num_accepted_tokens_per_pos": [5 * n, 3 * n, n]}
        assert s["acceptance_length"] == pytest.approx(1.9) and s["outputs"]["identical"] == s["outputs"]["compared"] == n
        assert s["throughput"]["with_draft"]["tokens_per_s"] > 0 and s["throughput"]["speedup"] > 0
        rows = [json.loads(line) for line in Path(s["files"]["outputs"]).read_text().splitlines()]
        assert Path(s["files"]["outputs"]) == run / "eval" / f"outputs-{name}.jsonl" and len(rows) == n
        baseline = json.loads((run / "eval" / f"baseline-{name}.json").read_text())  # cached per set
        assert sorted(baseline["outputs"]) == sorted(r["id"] for r in rows)
    assert report["num_prompts"] == 4 and report["counters"]["num_drafts"] == 40  # the held-out set, as before
    # one server of the target alone first (mt_bench's turn 2 needs its answers): a warm-up per set, every set and
    # mt_bench's one turn-2 prompt; then one with the draft: a warm-up, every set, the same turn-2 prompt
    assert [s["speculative"] is not None for s in run_env.started] == [False, True]
    target_server, draft_server = (s["server"] for s in run_env.started)
    assert len(draft_server.requests) == 1 + 4 + 3 + 4 + 2 + 1 and len(target_server.requests) == 4 * 1 + 4 + 3 + 4 + 2 + 1
    assert evaluate.missing_baselines(cfg) == []
    assert (run / "eval" / "report.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "05_evaluate: acceptance length 1.90 (k=3) | per-position 0.50/0.30/0.10" in out
    for line in ("prompt set mt_bench (3 prompts, 2 rows skipped): acceptance length 1.90 (k=3) | per-position 0.50/0.30/0.10",
                 "prompt set gsm8k (4 prompts): acceptance length 1.90", "prompt set humaneval (2 prompts, 1 rows skipped): "):
        assert f"05_evaluate: {line}" in out

    # The same sets again: already complete, every set's line printed, no server started.
    n = len(run_env.started)
    assert evaluate.run_stage(cfg) == 0
    out = capsys.readouterr().out
    assert "already complete" in out and "05_evaluate: prompt set humaneval (2 prompts" in out and len(run_env.started) == n
    # One set fewer: measured again; the baselines of the sets kept are reused.
    del files["gsm8k"]
    assert evaluate.run_stage(with_sets(run_env.cfg, {name: str(path) for name, path in files.items()})) == 0
    assert [s["speculative"] is not None for s in run_env.started[n:]] == [True]
    assert list(json.loads((run / "eval" / "report.json").read_text())["prompt_sets"]) == ["humaneval", "mt_bench"]


def test_relative_prompt_set_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    """Like data.source: a file or directory next to the config file, wherever 05 runs from; a hub name is left as is."""
    import yaml

    from common.core.config import load_config

    write_jsonl(tmp_path / "cfg" / "sets" / "gsm.jsonl", [{"question": "What is 2 + 2?"}])
    (tmp_path / "cfg" / "run.yaml").write_text(yaml.safe_dump({"run_dir": "run", "evaluate": {"prompt_sets": {
        "gsm": "sets/gsm.jsonl", "folder": {"source": "./sets", "split": "test"}, "hub": {"source": "openai/gsm8k", "subset": "main"}}}}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for overrides in ([], ["evaluate.num_prompts=3"]):  # with --set the tree is loaded again relative to the cwd: resolved already
        cfg = load_config(tmp_path / "cfg" / "run.yaml", overrides)
        assert cfg.evaluate.prompt_set_specs() == {
            "folder": {"source": str(tmp_path / "cfg" / "sets"), "subset": None, "split": "test"},
            "gsm": {"source": str(tmp_path / "cfg" / "sets" / "gsm.jsonl"), "subset": None, "split": "test"},
            "hub": {"source": "openai/gsm8k", "subset": "main", "split": "test"}}


# ----------------------------------------------------------------------------- --compare


def plain_files(run: Path) -> dict[str, bytes]:
    """The files of a plain 05 run under eval/ (eval/compare/ left out)."""
    return {p.name: p.read_bytes() for p in sorted((run / "eval").iterdir()) if p.is_file()}


class WeakerDraftVllm(FakeVllm):
    """FakeVllm whose draft never gets its last position accepted: 5 + 3 + 0 of 30 draft tokens per request
    (acceptance length 1.8 where FakeVllm's is 1.9)."""

    def accepted_per_pos(self, body):
        return [5, 3, 0]


def test_compare_puts_two_drafts_side_by_side_on_the_same_prompts(run_env, tmp_path, monkeypatch, capsys):
    weaker = write_draft(tmp_path / "fine-tuned" / "train" / "final", b"weights of another run")

    def make_server(speculative):
        cls = WeakerDraftVllm if speculative and speculative["model"] == str(weaker) else FakeVllm
        return cls(with_draft=speculative is not None)

    serve_fakes(run_env, monkeypatch, make_server)
    files = benchmark_files(tmp_path)
    cfg = with_sets(run_env.cfg, {"mt_bench": str(files["mt_bench"]), "humaneval": str(files["humaneval"])})
    assert evaluate.run_stage(cfg) == 0  # a plain run first: --compare must leave its report alone
    plain = plain_files(run_env.run)
    n = len(run_env.started)

    assert run_compare(cfg, [str(run_env.final), str(weaker)]) == 0
    # one server per draft, the same settings; the target-alone baselines of the plain run are reused
    started = run_env.started[n:]
    assert [s["speculative"] for s in started] == [serve.speculative_config(cfg, run_env.final), serve.speculative_config(cfg, weaker)]
    assert [s["log"].name for s in started] == ["vllm_compare_a.log", "vllm_compare_b.log"]
    sent = [sorted((body["messages"][-1]["content"], body["max_tokens"]) for body in s["server"].requests) for s in started]
    assert sent[0] == sent[1] and len(sent[0]) == 1 + 4 + 3 + 2 + 1  # the same prompts, turn 2 too (2 in flight: in any order)
    assert plain_files(run_env.run) == plain  # byte-identical: report.json, report.png, outputs, baselines

    comparison = json.loads((run_env.run / "eval" / "compare" / "report.json").read_text())
    assert comparison["drafts"] == {"a": str(run_env.final), "b": str(weaker)}
    assert comparison["acceptance_length"] == {name: {"a": pytest.approx(1.9), "b": pytest.approx(1.8), "b_minus_a": pytest.approx(-0.1)}
                                               for name in ("held_out", "mt_bench", "humaneval")}
    # mt_bench's turn 2 (one prompt with a second turn), side by side too
    assert comparison["turn_2_acceptance_length"] == {"mt_bench": {"a": pytest.approx(1.9), "b": pytest.approx(1.8),
                                                                   "b_minus_a": pytest.approx(-0.1)}}
    assert comparison["per_position_acceptance"]["humaneval"] == {"a": pytest.approx([0.5, 0.3, 0.1]), "b": pytest.approx([0.5, 0.3, 0.0])}
    assert {name: s["num_prompts"] for name, s in comparison["prompt_sets"].items()} == {"held_out": 4, "humaneval": 2, "mt_bench": 3}
    a, b = comparison["reports"]["a"], comparison["reports"]["b"]
    assert a["offline"]["step"] == 40 and a["offline_missing"] is None  # this run's train/final: 04's prediction
    assert b["offline"] is None and f"{weaker} has no prediction.json: 04 predicted nothing for it" in b["offline_missing"]
    assert b["prompt_sets"]["mt_bench"]["counters"]["num_accepted_tokens"] == 8 * 3
    assert a["throughput"]["without_draft"] == b["throughput"]["without_draft"]  # one baseline for both
    for label in ("a", "b"):
        rows = (run_env.run / "eval" / "compare" / f"outputs-{label}-mt_bench.jsonl").read_text().splitlines()
        assert [json.loads(r)["id"] for r in rows] == ["81", "82", "85"]
    assert (run_env.run / "eval" / "compare" / "report.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert f"05_evaluate: compare (k=3): a = {run_env.final} (offline prediction 2.02); b = {weaker} (no offline prediction)" in out
    assert "05_evaluate: held_out (4 prompts): acceptance length a 1.90 | b 1.80 | b - a -0.10 | tokens/s vs the target alone: a " in out
    assert "05_evaluate: humaneval (2 prompts): acceptance length a 1.90 | b 1.80 | b - a -0.10" in out
    assert "05_evaluate: mt_bench turn 2 (1 prompts): acceptance length a 1.90 | b 1.80 | b - a -0.10" in out

    # Again: already complete, no server; the other order is another comparison, measured again.
    n = len(run_env.started)
    assert run_compare(cfg, [str(run_env.final), str(weaker)]) == 0
    assert "already complete" in capsys.readouterr().out and len(run_env.started) == n
    assert run_compare(cfg, [str(weaker), str(run_env.final)]) == 0
    assert json.loads((run_env.run / "eval" / "compare" / "report.json").read_text())["acceptance_length"]["held_out"]["b_minus_a"] \
        == pytest.approx(0.1)


def test_compare_refuses_a_missing_draft_and_a_second_draft_flag_in_one_line(run_env, tmp_path):
    res = run_cli("05_evaluate.py", cli_config(run_env), "--compare", str(run_env.final), str(tmp_path / "nothing"), timeout=120)
    error_line(res, f"no trained draft at {tmp_path / 'nothing'} (config.json missing)")
    res = run_cli("05_evaluate.py", cli_config(run_env), "--compare", str(run_env.final), str(run_env.final),
                  "--draft", str(run_env.final), timeout=120)
    error_line(res, "argument --draft: not allowed with argument --compare")
    assert not (run_env.run / "eval").exists()


# ----------------------------------------------------------------------------- a real vLLM server


def random_draft(target_dir: Path, out: Path, seed: int) -> Path:
    """An untrained full-vocab draft for the tiny target, exported as 04 exports: vLLM serves it, accepting little."""
    import torch
    from transformers import AutoConfig

    from common.model.draft import DraftModelConfig, Eagle3DraftModel
    from common.model.export import export_vllm_draft

    target = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    model = Eagle3DraftModel(DraftModelConfig(
        hidden_size=target.hidden_size, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
        aux_layer_ids=[1, 2, 3]))
    return export_vllm_draft(model, out)


def check_step_times(part: dict, runs: int) -> None:
    """A set's step times from a real vLLM: every timed run read on both servers, positive and self-consistent."""
    st = part["step_times"]
    print({key: st[key] for key in ("target_step_s", "iteration_s", "cost_ratio", "tokens_per_iteration", "acceptance_length",
                                    "speedup_from_steps", "measured_speedup", "decode_share")})
    assert st["measured"] is True, st
    assert len(st["target_step_s_runs"]) == len(st["iteration_s_runs"]) == runs
    assert min(st["target_step_s_runs"] + st["iteration_s_runs"]) > 0 and st["target_step_s"] > 0 and st["iteration_s"] > 0
    assert st["target_tokens_per_step"] == 1.0  # the target alone: one decode token per request and iteration
    # with the draft, the client's tokens per iteration are the counters' acceptance length (greedy: every run the same
    # outputs; a last iteration cut short by max_tokens counts its accepted tokens in the counters only)
    assert abs(st["tokens_per_iteration"] - part["acceptance_length"]) <= 0.1, st
    assert st["cost_ratio"] == pytest.approx(st["iteration_s"] / st["target_step_s"], rel=1e-3)
    assert st["speedup_from_steps"] == pytest.approx(part["acceptance_length"] / st["cost_ratio"], rel=1e-3)
    assert st["measured_speedup"] == part["throughput"]["speedup"] > 0
    for side in ("with_draft", "without_draft"):  # each request's decode time is the sum of its inter-token latencies
        counters = st["counters"][side]
        assert counters["decode_s_sum"] == pytest.approx(counters["iteration_s_sum"], rel=1e-3), (side, counters)
        # ... and a part of its latency at the client (each rounded to the ms)
        assert 0 < st["decode_share"][side] <= 1 + 0.001 * counters["requests"] / counters["client_latency_s_sum"], (side, st)


@pytest.mark.slow
@pytest.mark.vllm
def test_real_vllm_compare_of_two_drafts_on_three_benchmark_sets(tiny_target_dir, tmp_path):
    """05_evaluate.py --compare on the tiny target in vLLM-CPU: two (untrained) drafts, the held-out prompts and three
    benchmark-shaped sets, three servers (one per draft, one of the target alone). Both drafts are measured on every
    set with the number of prompts read, greedy outputs identical with and without either draft, and vLLM's step
    times of the same timed runs explain the speedup (common.evaluate.steps)."""
    from conftest import TINY_REASONING_PARSER
    from tests.helpers import stage_env, write_yaml

    run = tmp_path / "run"
    write_jsonl(run / "data" / "prompts.jsonl", [
        {"id": f"p{i}", "messages": [{"role": "user", "content": text}], "split": "eval"}
        for i, text in enumerate(["What is 12 plus 30?", "Write a haiku about the moon.", "What is the capital of France?"])])
    sets = benchmark_files(tmp_path / "sets")
    drafts = [random_draft(tiny_target_dir, tmp_path / f"draft-{seed}", seed) for seed in (0, 1)]
    cfg = write_yaml(tmp_path / "run.yaml", {
        "run_dir": str(run), "target": {"model": str(tiny_target_dir), "aux_layer_ids": [1, 2, 3], "dtype": "float32"},
        "evaluate": {"num_prompts": 3, "max_tokens": 24, "concurrency": 4,
                     "prompt_sets": {name: str(path) for name, path in sets.items()}},
        "server": {"max_model_len": 1024, "enforce_eager": True, "reasoning_parser": TINY_REASONING_PARSER}})
    res = run_cli("05_evaluate.py", cfg, "--compare", *map(str, drafts), env=stage_env(), timeout=1200)
    assert res.returncode == 0, res.stderr[-5000:]
    comparison = json.loads((run / "eval" / "compare" / "report.json").read_text())
    assert {name: s["num_prompts"] for name, s in comparison["prompt_sets"].items()} == {
        "held_out": 3, "gsm8k": 3, "humaneval": 2, "mt_bench": 3}
    for label, report in comparison["reports"].items():
        print(label, {name: round(comparison["acceptance_length"][name][label], 3) for name in comparison["prompt_sets"]})
        for name in comparison["prompt_sets"]:
            part = set_part(report, name)
            assert part["counters"]["num_drafts"] > 0 and 1.0 <= part["acceptance_length"] <= 4.0
            assert part["outputs"]["identical"] == part["outputs"]["compared"] == part["num_prompts"], (label, name, part["outputs"])
            check_step_times(part, runs=3)
        # 05's summary of this report says why on every set the draft slows (a random draft: most of them)
        slower = [name for name in comparison["prompt_sets"] if set_part(report, name)["throughput"]["speedup"] < 1]
        why = [line for line in summary_lines(report) if ": the draft slows serving (" in line]
        assert len(why) == len(slower) and all(" draft steps + verification) costs " in line for line in why), why
        assert report["offline"] is None and report["offline_missing"]
    held_out_line = [line for line in res.stdout.splitlines() if "acceptance length a " in line][0]
    assert held_out_line.startswith("05_evaluate: held_out (3 prompts): acceptance length a ")
    assert comparison["cost_ratio"]["held_out"] == {label: comparison["reports"][label]["step_times"]["cost_ratio"] for label in "ab"}
    assert f"| an iteration with the draft costs a {comparison['cost_ratio']['held_out']['a']:.2f}x, b " in held_out_line
    assert not (run / "eval" / "report.json").exists()
