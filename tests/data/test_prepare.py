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
from common.core.sources import row_messages
from common.data.prepare import prepare_prompts, split_of
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
        "malformed_json": 2, "invalid_utf8": 1, "truncated_json_tail": 0, "bad_fields": 6, "no_user_turn": 1, "empty": 2,
        "no_answer": 0, "duplicate": 1, "over_max_samples": 1,
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


def test_prompt_sets_are_checked_by_01_before_any_generation(tmp_path, write_config, run_dir):
    """Issue 33, case 7: a prompt set that shares a prompt with the training split, or that cannot be read, was refused
    only at 05's baseline, after 01b's whole generation. 01 refuses it before it writes anything."""
    rows = [json.loads(line) for line in (REPO / "data" / "sample_prompts.jsonl").read_text().splitlines()][:40]
    source = write_jsonl(tmp_path / "source.jsonl", rows)
    train_prompt = next(m["content"] for m in rows[0]["messages"] if m["role"] == "user")
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"question_id": 1, "turns": ["A question nobody trains on."]},
                                                   {"question_id": 2, "turns": [train_prompt]}])
    cfg = write_config({"data": {"source": str(source), "eval_fraction": 0.0},
                        "evaluate": {"prompt_sets": {"bench": str(bench)}}})
    p = run_cli("--config", str(cfg))
    error_line(p, f"evaluate.prompt_sets.bench {bench} shares 1 prompt(s) with the training data (first: 2)")
    assert not (run_dir / "data").exists()

    cfg = write_config({"data": {"source": str(source)}, "evaluate": {"prompt_sets": {"gone": str(tmp_path / "gone.jsonl")}}})
    error_line(run_cli("--config", str(cfg)), "evaluate.prompt_sets.gone file not found")
    assert not (run_dir / "data").exists()


# ----------------------------------------------------------------------------- a JSON array cut short (issue 33, case 4)


def sharegpt_array(n: int) -> tuple[bytes, list[int]]:
    """A ShareGPT-shaped JSON array of n records (multi-byte text: bytes are not characters) and each record's
    first byte."""
    records = [json.dumps({"id": f"sg-{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: café, 中文, 😀?"}, {"from": "gpt", "value": "An answer. " * 5}]},
        ensure_ascii=False).encode() for i in range(n)]
    starts, at = [], len(b"[\n")
    for r in records:
        starts.append(at)
        at += len(r) + len(b",\n")
    return b"[\n" + b",\n".join(records) + b"\n]\n", starts


def test_a_json_array_cut_mid_record_keeps_its_complete_records(tmp_path, write_config, run_dir):
    """The real case: ShareGPT_V3 as a 125 MB array cut mid-record was read line by line ("604540 rows read;
    malformed_json 604540"). 01 keeps the complete records, counts the torn tail and says where the file ends."""
    data, starts = sharegpt_array(50)
    cut = starts[39] + 30  # inside record 40
    src = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    src.write_bytes(data[:cut])
    p = run_cli("--config", str(write_config({"data": {"source": str(src)}})))
    assert p.returncode == 0, p.stderr
    tail = (f"{src}: the JSON array ends at byte {cut} inside record 40 (which starts at byte {starts[39]}): the file is "
            f"cut short, with 39 complete records before it")
    assert f"{tail}; 01 keeps those" in p.stderr and "Traceback" not in p.stderr
    assert "dropped 1 (truncated_json_tail 1)" in p.stdout
    report = json.loads((run_dir / "data" / "prepare_report.json").read_text())
    assert report["counts"]["read"] == 40 and report["counts"]["kept"] == 39
    assert {k: v for k, v in report["counts"]["dropped"].items() if v} == {"truncated_json_tail": 1}
    assert report["truncated_json_tails"] == [tail]
    assert [r["id"] for r in read_prompts(run_dir)] == [f"src-sg-{i}" for i in range(39)]


def test_a_json_array_cut_between_records_keeps_them_all(tmp_path, monkeypatch):
    """Cut after a record's comma, read through a window of a few characters (the reader slides a window along
    the file: a 125 MB array is never held whole)."""
    import common.core.sources as sources

    monkeypatch.setattr(sources, "_WINDOW", 16)
    data, starts = sharegpt_array(30)
    src = tmp_path / "cut.json"
    src.write_bytes(data[:starts[20]])  # records 1..20, each with its comma
    report = prepare_prompts(make_cfg(tmp_path / "run", source=str(src)), progress=False)
    assert report["counts"]["kept"] == 20 and report["counts"]["dropped"]["truncated_json_tail"] == 1
    assert report["truncated_json_tails"] == [
        f"{src}: the JSON array ends at byte {starts[20]} after record 20, without the array's closing ']': the file "
        f"is cut short, with 20 complete records before it"]
    assert [r["id"] for r in read_prompts(tmp_path / "run")] == [f"src-sg-{i}" for i in range(20)]


def test_a_json_array_cut_at_any_byte_yields_its_complete_records(tmp_path, monkeypatch):
    """Every cut of a small array, read through a 5-character window: its complete records, then one
    truncated_json_tail naming the file's size (an error when no record is complete); whole, it reads whole."""
    import common.core.sources as sources
    from common.core.sources import iter_source

    monkeypatch.setattr(sources, "_WINDOW", 5)
    array, starts = sharegpt_array(3)
    whole = json.loads(array)
    src = tmp_path / "a.json"
    for prefix in (b"", b"\xef\xbb\xbf \n"):  # a UTF-8 BOM and whitespace before the '[' are skipped
        data = prefix + array
        ends = [len(prefix) + e for e in (starts[1] - 2, starts[2] - 2, len(array) - 3)]  # each record's last byte + 1
        for cut in range(len(prefix) + 1, len(data) + 1):
            src.write_bytes(data[:cut])
            complete = sum(end <= cut for end in ends)
            if not complete:
                with pytest.raises(DataError, match=f"ends at byte {cut} .*with 0 complete records before it"):
                    list(iter_source(str(src), None, "train"))
                continue
            got = list(iter_source(str(src), None, "train"))
            assert [row for _, row, _, _ in got[:complete]] == whole[:complete], cut
            if cut <= data.rindex(b"]"):  # the closing ']' is cut off
                assert len(got) == complete + 1 and got[-1][2] == "truncated_json_tail", cut
                assert f"ends at byte {cut} " in got[-1][3], (cut, got[-1])
            else:
                assert len(got) == 3, cut


def test_a_json_array_cut_inside_its_first_record_is_one_error_line(tmp_path, write_config, run_dir):
    data, starts = sharegpt_array(5)
    src = tmp_path / "cut.json"
    src.write_bytes(data[:starts[0] + 40])
    p = run_cli("--config", str(write_config({"data": {"source": str(src)}})))
    error_line(p, f"{src}: the JSON array ends at byte {starts[0] + 40} inside record 1 (which starts at byte 2): the file "
                  f"is cut short, with 0 complete records before it; download or copy the file again")
    assert not (run_dir / "data").exists()


def test_garbage_after_a_complete_json_array_is_one_error_line(tmp_path, write_config, run_dir):
    data, _ = sharegpt_array(5)
    src = tmp_path / "two.json"
    src.write_bytes(data + b"[{\"id\": \"a second array\"}]\n")
    p = run_cli("--config", str(write_config({"data": {"source": str(src)}})))
    error_line(p, f"{src}: the JSON array ends at byte {len(data.rstrip())} (5 complete records), but the file goes on "
                  f"('[{{\"id\": \"a second", "the array must be the whole file: remove what follows it")
    assert not (run_dir / "data").exists()


# ----------------------------------------------------------------------------- the source by content (issue 33, case 11)


def test_a_moved_source_is_the_same_source(tmp_path, write_config, run_dir):
    """data.source moved to another path, same bytes: 01 is complete and rewrites nothing (it was refused: "source
    ... is gone; source ... is new", and --overwrite would have redone 01b downstream). Other bytes are a change."""
    (tmp_path / "a").mkdir()
    src = write_jsonl(tmp_path / "a" / "in.jsonl", [SHAREGPT, OPENAI])
    assert run_cli("--config", str(write_config({"data": {"source": str(src)}}))).returncode == 0
    outputs = [run_dir / "data" / "prompts.jsonl", run_dir / "data" / "prepare_report.json"]
    def state() -> list:
        return [(f.read_bytes(), f.stat().st_mtime_ns) for f in outputs]

    before = state()
    moved = tmp_path / "b" / "renamed.jsonl"
    moved.parent.mkdir()
    src.rename(moved)
    cfg = write_config({"data": {"source": str(moved)}})
    p = run_cli("--config", str(cfg))
    assert p.returncode == 0 and "already complete" in p.stdout, p.stderr
    assert state() == before
    manifest = json.loads((run_dir / "stages" / "01_prepare_data.json").read_text())
    assert manifest["inputs"] == {"data.source": hashlib.sha256(moved.read_bytes()).hexdigest()}
    assert "data.source" not in manifest["settings"]

    write_jsonl(moved, [SHAREGPT])
    error_line(run_cli("--config", str(cfg)), "01_prepare_data: the outputs in", "(data.source changed)", "--overwrite")
    assert state() == before


def test_a_moved_source_folder_is_the_same_source_and_a_renamed_file_in_it_is_not(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    write_jsonl(src / "a.jsonl", [SHAREGPT])
    write_jsonl(src / "sub" / "b.jsonl", [OPENAI])
    (src / "notes.txt").write_text("not data")
    run = tmp_path / "run"
    assert prepare_prompts(make_cfg(run, source=str(src)), progress=False)["status"] == "done"
    (src / "notes.txt").write_text("changed, still not data")  # only the data files are the source
    moved = tmp_path / "elsewhere"
    src.rename(moved)
    assert prepare_prompts(make_cfg(run, source=str(moved)), progress=False)["status"] == "already_complete"
    (moved / "a.jsonl").rename(moved / "c.jsonl")  # read in another order: another source
    with pytest.raises(DataError, match=r"data\.source changed.*--overwrite"):
        prepare_prompts(make_cfg(run, source=str(moved)), progress=False)


@pytest.mark.parametrize("folder", [False, True])
def test_a_run_folder_whose_01_was_made_by_an_earlier_version_is_one_error_line(tmp_path, folder):
    """01's manifest from an earlier version (it recorded the source by path: "source PATH" inputs, the path a
    setting, and no run-folder version) is refused with one line, not read through compatibility code; --overwrite
    makes 01's outputs again, recorded by content."""
    src = tmp_path / "src"
    src.mkdir()
    files = [write_jsonl(src / "a.jsonl", [SHAREGPT])] + ([write_jsonl(src / "b.jsonl", [OPENAI])] if folder else [])
    source = src if folder else files[0]
    run = tmp_path / "run"
    prepare_prompts(make_cfg(run, source=str(source)), progress=False)
    path = run / "stages" / "01_prepare_data.json"
    manifest = json.loads(path.read_text())
    new_inputs = manifest["inputs"]
    manifest["inputs"] = {f"source {f}": hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    manifest["settings"]["data.source"] = str(source)
    del manifest["run_folder_version"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"^01_prepare_data: .* made by an earlier version of this pipeline .*: rerun "
                                        r"01_prepare_data.py with --overwrite, and the stages after it$"):
        prepare_prompts(make_cfg(run, source=str(source)), progress=False)
    assert prepare_prompts(make_cfg(run, source=str(source)), overwrite=True, progress=False)["status"] == "done"
    assert json.loads(path.read_text())["inputs"] == new_inputs
