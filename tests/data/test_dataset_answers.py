"""data.answers: training on the dataset's own answers (dataset), or on them where they exist and the target's
elsewhere (fill), next to the default regeneration. 01 keeps each user turn with the source's answer to it; 01b
copies the answered rows into raw_responses.jsonl as finished (no request), answers only the others, and
tokenizes both alike (loss on every assistant turn)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_server import FaultServer, Faults

from common.core.config import load_config
from common.core.errors import ConfigError
from common.core.io import iter_jsonl
from common.core.sources import keep_answered
from common.data.generate import check_before_server, run_stage
from common.data.prepare import prepare_prompts
from common.target.tokenization import load_tokenizer

U, A, S = "user", "assistant", "system"


def m(role: str, text: str) -> dict:
    return {"role": role, "content": text}


@pytest.mark.parametrize("messages, turns, fill, expected", [
    # every kept user turn answered: the conversation, both modes
    ([m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")], 2, False, [m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")]),
    ([m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")], 2, True, [m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")]),
    # max_user_turns cuts after the first answered turn; the source's system turn is kept
    ([m(S, "sys"), m(U, "q1"), m(A, "a1"), m(U, "q2"), m(A, "a2")], 1, False, [m(S, "sys"), m(U, "q1"), m(A, "a1")]),
    # the second turn unanswered: dataset keeps the answered turn; fill sends both user turns to 01b
    ([m(U, "q1"), m(A, "a1"), m(U, "q2")], 2, False, [m(U, "q1"), m(A, "a1")]),
    ([m(U, "q1"), m(A, "a1"), m(U, "q2")], 2, True, [m(U, "q1"), m(U, "q2")]),
    # an empty answer is no answer, and what follows it answered another history
    ([m(U, "q1"), m(A, "  "), m(U, "q2"), m(A, "a2")], 2, False, None),
    ([m(U, "q1"), m(A, "  "), m(U, "q2"), m(A, "a2")], 2, True, [m(U, "q1"), m(U, "q2")]),
    # two user turns in a row: the first has no answer of its own
    ([m(U, "q1"), m(U, "q1b"), m(A, "a")], 1, False, None),
    # an assistant turn first (a greeting) is not an answer to anything
    ([m(A, "hello"), m(U, "q1"), m(A, "a1")], 1, False, [m(U, "q1"), m(A, "a1")]),
])
def test_keep_answered(messages, turns, fill, expected):
    kept, reason = keep_answered(messages, None, turns, fill=fill)
    assert kept == expected
    assert reason == (None if expected is not None else "no_answer")


def test_keep_answered_keeps_01s_drop_reasons():
    assert keep_answered([m(A, "only an answer")], None, 1, fill=False) == (None, "no_user_turn")
    assert keep_answered([m(U, " "), m(A, "a")], None, 1, fill=True) == (None, "empty")


def sharegpt_source(path: Path) -> Path:
    """Six ShareGPT records: four answered, one with its first turn unanswered, one answered only on its first turn."""
    def conv(*turns):
        return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]
    records = [{"id": f"r{i}", "conversations": conv(f"What is {i} plus {i}?", f"{i} plus {i} is {2 * i}.",
                                                      f"And times {i}?", f"{i} times {i} is {i * i}.")} for i in range(4)]
    records.append({"id": "r4", "conversations": conv("Unanswered question?")})
    records.append({"id": "r5", "conversations": conv("Name a color.", "Blue.", "Another one?")})
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def test_dataset_answers_need_no_server_and_train_on_every_answer(tmp_path, write_config, run_dir, chat_tokenizer_dir):
    """data.answers=dataset: 01 keeps the answered turns (and counts the row without one); 01b sends nothing (its
    server URL is a closed port), copies each row once into raw_responses.jsonl, and the loss covers exactly the
    source's answers; a rerun is complete."""
    cfg_path = write_config({"target": {"model": str(chat_tokenizer_dir)},
                             "data": {"source": str(sharegpt_source(tmp_path / "sharegpt.json")), "answers": "dataset",
                                      "max_user_turns": 2, "eval_fraction": 0.0},
                             "generate": {"base_url": "http://127.0.0.1:9/v1", "timeout_s": 1.0, "max_retries": 0},
                             "tokenize": {"max_seq_len": 512}})
    cfg = load_config(cfg_path)
    report = prepare_prompts(cfg, progress=False)
    assert report["counts"]["kept"] == 5 and report["counts"]["dropped"]["no_answer"] == 1
    prompts = {r["id"]: r for r in iter_jsonl(run_dir / "data" / "prompts.jsonl")}
    assert prompts["src-r0"]["messages"] == [m(U, "What is 0 plus 0?"), m(A, "0 plus 0 is 0."), m(U, "And times 0?"),
                                             m(A, "0 times 0 is 0.")]
    assert prompts["src-r5"]["messages"] == [m(U, "Name a color."), m(A, "Blue.")]

    assert check_before_server(cfg) == "0 prompts to serve (5 with the dataset's answers), token ids from template: checked"
    assert run_stage(cfg) == 0
    assert check_before_server(cfg) == "01b complete (5 prompts)"  # run_pipeline's rerun renders no prompt again
    raw = list(iter_jsonl(run_dir / "data" / "raw_responses.jsonl"))
    assert sorted(r["id"] for r in raw) == sorted(prompts) and all(r["answers"] == "dataset" for r in raw)
    samples = {s["id"]: s for s in iter_jsonl(run_dir / "data" / "train.jsonl")}
    assert set(samples) == set(prompts)
    tok = load_tokenizer(str(chat_tokenizer_dir))
    for sid, sample in samples.items():
        learned = tok.decode([t for t, keep in zip(sample["input_ids"], sample["loss_mask"]) if keep])
        turns = prompts[sid]["messages"]
        assert all(x["content"] in learned for x in turns if x["role"] == A)
        assert not any(x["content"] in learned for x in turns if x["role"] == U)
    gen = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert gen["dataset_answers"] == 5 and gen["num_done"] == 5 and gen["complete"] and "this_run" not in gen

    before = (run_dir / "data" / "raw_responses.jsonl").read_bytes()
    assert run_stage(cfg) == 0
    assert (run_dir / "data" / "raw_responses.jsonl").read_bytes() == before


def test_fill_sends_only_the_unanswered_rows(tmp_path, write_config, run_dir, chat_tokenizer_dir, monkeypatch):
    """data.answers=fill: the rows answered in the source are copied; the others (an unanswered first turn, a second
    turn without an answer) go to the server, whole, and only they."""
    monkeypatch.setenv("EAGLE3_TEST_API_KEY", "sk-test")
    source = sharegpt_source(tmp_path / "sharegpt.json")
    with FaultServer(Faults(seed=5, reasoning=False)) as server:
        cfg = load_config(write_config({
            "target": {"model": str(chat_tokenizer_dir)},
            "data": {"source": str(source), "answers": "fill", "max_user_turns": 2, "eval_fraction": 0.0},
            "generate": {"base_url": server.base_url, "timeout_s": 5.0, "api_key_env": "EAGLE3_TEST_API_KEY", "max_tokens": 32},
            "tokenize": {"max_seq_len": 512}}))
        prepare_prompts(cfg, progress=False)
        assert run_stage(cfg) == 0
        sent = server.stats.requests_by_prompt
    assert dict(sent) == {"Unanswered question?": 1, "Name a color.": 2}  # requests, by the row's first user turn
    raw = {r["id"]: r for r in iter_jsonl(run_dir / "data" / "raw_responses.jsonl")}
    assert sorted(raw) == [f"src-r{i}" for i in range(6)]
    assert sorted(i for i, r in raw.items() if r.get("answers") == "dataset") == [f"src-r{i}" for i in range(4)]
    assert raw["src-r5"]["messages"][1]["content"] != "Blue."  # regenerated whole, not mixed with the source's
    gen = json.loads((run_dir / "data" / "generate_report.json").read_text())
    assert gen["dataset_answers"] == 4 and gen["num_done"] == 6 and gen["this_run"]["done"] == 2


def test_pipeline_starts_no_server_for_01b_when_every_row_is_answered(tmp_path, write_config, run_dir, chat_tokenizer_dir):
    import run_pipeline

    cfg = load_config(write_config({"target": {"model": str(chat_tokenizer_dir)},
                                    "data": {"source": str(sharegpt_source(tmp_path / "s.json")), "answers": "dataset"}}))
    prepare_prompts(cfg, progress=False)
    assert not run_pipeline.generation_pending(cfg)
    cfg.data.answers = "fill"
    prepare_prompts(cfg, overwrite=True, progress=False)
    assert run_pipeline.generation_pending(cfg)  # two rows lack an answer


def test_dataset_answers_with_server_token_ids_is_a_config_error(write_config):
    with pytest.raises(ConfigError) as e:
        load_config(write_config({"data": {"answers": "dataset"}, "tokenize": {"token_ids_from": "server"}}))
    assert "data.answers=dataset" in str(e.value) and "tokenize.token_ids_from: template" in str(e.value)
