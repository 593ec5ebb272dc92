"""Stage 01 (common/data/prepare.py, 01_prepare_data.py): reading, normalising, ids, splits, drops."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.config import config_from_dict
from common.core.errors import ConfigError, DataError
from common.data.prepare import prepare_prompts, row_messages, split_of
from tests.helpers import error_line
from tests.helpers import REPO, stage_env


def make_cfg(run_dir: Path, **data) -> object:
    return config_from_dict({"run_dir": str(run_dir), "data": data})


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_prompts(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "data" / "prompts.jsonl").read_text().splitlines()]


def hash_id(messages: list[dict]) -> str:
    canonical = json.dumps(messages, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


SHAREGPT = {
    "id": "conv-1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "What is 2 + 2?"},
        {"from": "gpt", "value": "4"},
        {"from": "human", "value": "And 3 + 3?"},
        {"from": "chatgpt", "value": "6"},
    ],
}
OPENAI = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "this picture."}]},
        {"role": "assistant", "content": "A cat."},
    ]
}


def test_row_messages_normalises_both_shapes():
    assert row_messages(SHAREGPT) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ]
    assert row_messages(OPENAI) == [
        {"role": "user", "content": "Describe\nthis picture."},
        {"role": "assistant", "content": "A cat."},
    ]
    bot = {"conversations": [{"from": "USER", "value": "hi"}, {"from": "bot", "value": None}]}
    assert row_messages(bot) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]


def test_prepare_keeps_system_and_first_user_turns(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, OPENAI])
    run = tmp_path / "run"
    report = prepare_prompts(make_cfg(run, source=str(src), eval_fraction=0.0), progress=False)
    rows = read_prompts(run)
    openai_kept = [{"role": "user", "content": "Describe\nthis picture."}]
    assert rows == [
        {"id": "src-conv-1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
         "split": "train"},
        {"id": hash_id(openai_kept), "messages": openai_kept, "split": "train"},
    ]
    assert report["status"] == "done"
    assert report["counts"]["read"] == 2 and report["counts"]["kept"] == 2

    # Two user turns: the assistant turn between them is dropped; the config system prompt
    # only fills in where the source has none.
    run2 = tmp_path / "run2"
    prepare_prompts(make_cfg(run2, source=str(src), max_user_turns=2, system_prompt="You are helpful."), progress=False)
    rows = read_prompts(run2)
    assert rows[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    assert rows[1]["messages"] == [{"role": "system", "content": "You are helpful."}] + openai_kept
    assert rows[1]["id"] == hash_id(rows[1]["messages"])


def test_ids_stable_across_runs_and_max_samples(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(50)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    a = tmp_path / "a"
    b = tmp_path / "b"
    prepare_prompts(make_cfg(a, source=str(src), eval_fraction=0.3), progress=False)
    prepare_prompts(make_cfg(b, source=str(src), eval_fraction=0.3, max_samples=20), progress=False)
    full, part = read_prompts(a), read_prompts(b)
    assert [r["id"] for r in full] == [hash_id([{"role": "user", "content": f"question {i}"}]) for i in range(50)]
    assert part == full[:20]  # first N in source order, same ids, same splits
    report = json.loads((b / "data" / "prepare_report.json").read_text())
    assert report["counts"]["dropped"]["over_max_samples"] == 30


def test_duplicate_source_ids_fall_back_to_hash(tmp_path):
    rows = [
        {"id": "x", "messages": [{"role": "user", "content": "one"}]},
        {"id": "x", "messages": [{"role": "user", "content": "two"}]},
        {"id": 7, "messages": [{"role": "user", "content": "three"}]},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    prepare_prompts(make_cfg(tmp_path / "run", source=str(src)), progress=False)
    ids = [r["id"] for r in read_prompts(tmp_path / "run")]
    assert ids == [hash_id([{"role": "user", "content": "one"}]), hash_id([{"role": "user", "content": "two"}]), "src-7"]


def test_dedupe(tmp_path):
    same = {"messages": [{"role": "user", "content": "same question"}]}
    other = {"conversations": [{"from": "human", "value": "same question"}, {"from": "gpt", "value": "a different answer"}]}
    src = write_jsonl(tmp_path / "in.jsonl", [same, other, {"messages": [{"role": "user", "content": "new"}]}, same])
    report = prepare_prompts(make_cfg(tmp_path / "on", source=str(src)), progress=False)
    assert report["counts"]["kept"] == 2
    assert report["counts"]["dropped"]["duplicate"] == 2
    # Dedupe off: all four kept, the identical prompts still get distinct ids.
    prepare_prompts(make_cfg(tmp_path / "off", source=str(src), dedupe=False), progress=False)
    ids = [r["id"] for r in read_prompts(tmp_path / "off")]
    h = hash_id([{"role": "user", "content": "same question"}])
    assert ids == [h, f"{h}-2", hash_id([{"role": "user", "content": "new"}]), f"{h}-3"]


def test_split_fraction_and_determinism(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"prompt number {i}"}]} for i in range(2000)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    r1 = prepare_prompts(make_cfg(tmp_path / "r1", source=str(src), eval_fraction=0.2, seed=3), progress=False)
    r2 = prepare_prompts(make_cfg(tmp_path / "r2", source=str(src), eval_fraction=0.2, seed=3), progress=False)
    r3 = prepare_prompts(make_cfg(tmp_path / "r3", source=str(src), eval_fraction=0.2, seed=4), progress=False)
    assert 340 <= r1["counts"]["eval"] <= 460  # 2000 * 0.2 = 400 expected
    assert r1["counts"]["eval"] + r1["counts"]["train"] == 2000
    s1 = [r["split"] for r in read_prompts(tmp_path / "r1")]
    assert s1 == [r["split"] for r in read_prompts(tmp_path / "r2")]
    assert s1 != [r["split"] for r in read_prompts(tmp_path / "r3")]
    assert all(r["split"] == split_of(r["id"], 3, 0.2) for r in read_prompts(tmp_path / "r1"))
    # The split is a pure function of (seed, id).
    assert split_of("abc", 0, 0.0) == "train"
    assert [split_of(f"id{i}", 0, 0.5) for i in range(6)] == [split_of(f"id{i}", 0, 0.5) for i in range(6)]


def test_each_drop_reason_is_counted(tmp_path):
    good = {"messages": [{"role": "user", "content": "a fine prompt"}]}
    lines = [
        json.dumps(good).encode(),                                              # 1 kept
        b'{"messages": [{"role": "user", "content": "unterminated',             # 2 malformed_json
        b'["a list, not an object"]',                                           # 3 malformed_json
        '{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"),  # 4 invalid_utf8
        json.dumps({"conversations": []}).encode(),                             # 5 empty
        json.dumps({"messages": [{"role": "user", "content": "  \n "}]}).encode(),  # 6 empty
        json.dumps({"messages": [{"role": "system", "content": "only a system prompt"}]}).encode(),  # 7 no_user_turn
        json.dumps({"conversations": "not a list"}).encode(),                   # 8 bad_fields
        json.dumps({"messages": [{"role": "user", "content": 42}]}).encode(),    # 9 bad_fields
        json.dumps({"messages": [{"role": 1, "content": "x"}]}).encode(),       # 10 bad_fields
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}).encode(),  # 11 bad_fields
        json.dumps({"text": "no conversation field"}).encode(),                 # 12 bad_fields
        json.dumps({"messages": ["a string turn"]}).encode(),                   # 13 bad_fields
        json.dumps(good).encode(),                                              # 14 duplicate
        json.dumps({"messages": [{"role": "user", "content": "another"}]}).encode(),  # 15 over_max_samples
    ]
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n\n")
    report = prepare_prompts(make_cfg(tmp_path / "run", source=str(src), max_samples=1), progress=False)
    assert report["counts"]["read"] == 15
    assert report["counts"]["kept"] == 1
    assert report["counts"]["dropped"] == {
        "malformed_json": 2, "invalid_utf8": 1, "bad_fields": 6, "no_user_turn": 1, "empty": 2, "duplicate": 1,
        "over_max_samples": 1,
    }
    wheres = [(e["where"], e["reason"]) for e in report["skipped_examples"]]
    assert wheres[:4] == [(f"{src}:2", "malformed_json"), (f"{src}:3", "malformed_json"), (f"{src}:4", "invalid_utf8"),
                          (f"{src}:5", "empty")]
    assert read_prompts(tmp_path / "run") == [
        {"id": hash_id(good["messages"]), "messages": good["messages"], "split": split_of(hash_id(good["messages"]), 0, 0.05)}
    ]


def test_json_parquet_and_directory_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"id": "p1", "conversations": [{"from": "human", "value": "parquet prompt one"}, {"from": "gpt", "value": "ok"}]},
        {"id": "p2", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "parquet prompt two"}]},
    ]
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), src_dir / "b.parquet")
    (src_dir / "a.json").write_text(json.dumps([OPENAI, {"messages": [{"role": "user", "content": "json two"}]}]), encoding="utf-8")
    (src_dir / "notes.txt").write_text("ignored", encoding="utf-8")

    prepare_prompts(make_cfg(tmp_path / "pq", source=str(src_dir / "b.parquet"), eval_fraction=0.0), progress=False)
    assert read_prompts(tmp_path / "pq") == [
        {"id": "src-p1", "messages": [{"role": "user", "content": "parquet prompt one"}], "split": "train"},
        {"id": "src-p2", "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "parquet prompt two"}],
         "split": "train"},
    ]
    report = prepare_prompts(make_cfg(tmp_path / "dir", source=str(src_dir), eval_fraction=0.0), progress=False)
    got = read_prompts(tmp_path / "dir")
    # Files in name order: a.json then b.parquet.
    assert [r["messages"][-1]["content"] for r in got] == ["Describe\nthis picture.", "json two", "parquet prompt one", "parquet prompt two"]
    assert report["counts"]["read"] == 4
    # A .json file that is really JSONL is read line by line.
    (tmp_path / "lines.json").write_text(json.dumps(OPENAI) + "\n" + json.dumps(SHAREGPT) + "\n", encoding="utf-8")
    report = prepare_prompts(make_cfg(tmp_path / "lines", source=str(tmp_path / "lines.json")), progress=False)
    assert report["counts"]["kept"] == 2


def test_rerun_says_complete_and_config_change_needs_overwrite(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, OPENAI])
    run = tmp_path / "run"
    assert prepare_prompts(make_cfg(run, source=str(src)), progress=False)["status"] == "done"
    before = (run / "data" / "prompts.jsonl").stat().st_mtime_ns
    assert prepare_prompts(make_cfg(run, source=str(src)), progress=False)["status"] == "already_complete"
    assert (run / "data" / "prompts.jsonl").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match=r"data\.max_user_turns.*--overwrite"):
        prepare_prompts(make_cfg(run, source=str(src), max_user_turns=2), progress=False)
    report = prepare_prompts(make_cfg(run, source=str(src), max_user_turns=2), overwrite=True, progress=False)
    assert report["status"] == "done"
    assert len(read_prompts(run)[0]["messages"]) == 3


def test_no_usable_rows_and_missing_source_are_clear_errors(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])
    with pytest.raises(DataError, match="no usable prompts.*no_user_turn 1"):
        prepare_prompts(make_cfg(tmp_path / "run", source=str(src)), progress=False)
    with pytest.raises(DataError, match="data.source file not found"):
        prepare_prompts(make_cfg(tmp_path / "run", source=str(tmp_path / "missing.jsonl")), progress=False)
    with pytest.raises(ConfigError, match="data.source is not set"):
        prepare_prompts(make_cfg(tmp_path / "run"), progress=False)


def test_sample_dataset_is_small_varied_and_reproducible(tmp_path):
    from common.demo.chat_corpus import sample_prompt_rows

    path = REPO / "data" / "sample_prompts.jsonl"
    assert path.stat().st_size < 300 * 1024
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows == sample_prompt_rows(len(rows), 0)  # scripts/make_sample_data.py output
    assert 300 <= len(rows) <= 500
    n_sharegpt = sum("conversations" in r for r in rows)
    assert 0.3 * len(rows) < n_sharegpt < 0.7 * len(rows)
    turns = [r.get("conversations") or r.get("messages") for r in rows]
    roles = [[t.get("from") or t.get("role") for t in conv] for conv in turns]
    assert sum(1 for rs in roles if rs.count("human") + rs.count("user") > 1) >= 20  # multi-turn
    assert sum(1 for rs in roles if "system" in rs) >= 20
    assert {r["category"] for r in rows} == {"math", "code", "writing", "facts", "reasoning", "multi-turn"}

    report = prepare_prompts(make_cfg(tmp_path / "run", source=str(path)), progress=False)
    c = report["counts"]
    assert c["read"] == len(rows) and c["kept"] >= 300
    assert sum(c["dropped"].values()) == c["dropped"]["duplicate"]  # nothing malformed in our own data
    assert c["eval"] > 0 and c["train"] > c["eval"]


# ----------------------------------------------------------------------------- the CLI


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "01_prepare_data.py"), *args], cwd=REPO, capture_output=True,
                          text=True, env=stage_env(**(env_extra or {})), timeout=120)


def test_cli_help():
    p = run_cli("--help")
    assert p.returncode == 0
    assert "--config" in p.stdout and "--overwrite" in p.stdout and "prompts.jsonl" in p.stdout


def test_cli_end_to_end_and_user_errors(tmp_path, write_config, run_dir):
    cfg = write_config({"data": {"source": str(REPO / "data" / "sample_prompts.jsonl"), "max_samples": 100}})
    p = run_cli("--config", str(cfg))
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("01_prepare_data: read 400 rows, kept 100 prompts")
    assert len(read_prompts(run_dir)) == 100

    p = run_cli("--config", str(cfg))
    assert p.returncode == 0 and "already complete" in p.stdout

    p = run_cli("--config", str(cfg), "--set", "data.max_sampels=5")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.max_sampels" in lines[0] and "data.max_samples" in lines[0]

    p = run_cli("--config", str(cfg), "--set", "data.source=/nonexistent/prompts.jsonl")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "not found" in lines[0] and "/nonexistent/prompts.jsonl" in lines[0]

    p = run_cli("--config", str(cfg), "--set", "data.max_samples=50")
    assert p.returncode == 2 and "--overwrite" in p.stderr

    p = run_cli("--config", str(cfg), "--set", "data.max_samples=50", "--overwrite")
    assert p.returncode == 0 and len(read_prompts(run_dir)) == 50


def test_cli_hub_dataset_unavailable_is_one_line(write_config):
    # The hub code path is real; offline it must fail with one clear line, not a traceback.
    cfg = write_config({"data": {"source": "eagle3-no-such-org/no-such-dataset"}})
    p = run_cli("--config", str(cfg), env_extra={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    error_line(p, "could not load dataset 'eagle3-no-such-org/no-such-dataset'")


def test_a_refused_overwrite_keeps_the_previous_prompts(tmp_path):
    """Issue 25, case 11: every refusal comes before --overwrite deletes anything (01 dropped its report
    before it found the new source unusable)."""
    run = tmp_path / "run"
    assert prepare_prompts(make_cfg(run, source=str(write_jsonl(tmp_path / "in.jsonl", [SHAREGPT, OPENAI]))),
                           progress=False)["status"] == "done"
    before = {p.name: p.read_bytes() for p in (run / "data").iterdir()}
    unusable = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "system", "content": "s"}]}])
    with pytest.raises(DataError, match="no usable prompts"):
        prepare_prompts(make_cfg(run, source=str(unusable)), overwrite=True, progress=False)
    assert {p.name: p.read_bytes() for p in (run / "data").iterdir()} == before
