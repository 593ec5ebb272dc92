"""The generation server's API key: read from the environment variable named by
generate.api_key_env, sent as `Authorization: Bearer KEY`, and never written anywhere.

A full 01 -> 01b run against the fault server (tests/fault_server.py) with a distinctive key,
every library logging at DEBUG (openai, httpx, httpcore, asyncio): the key must not appear in
stdout, stderr, any file under run_dir, next to the config, or in the reports. A decoy key in
OPENAI_API_KEY must not be used. A server that rejects the key gives a one-line error that
names the variable, not the value. Putting the key itself in the config is refused (unknown key
generate.api_key; tests/pipeline/test_bad_inputs.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from fault_server import FaultServer, Faults

from common.core.io import iter_jsonl
from tests.helpers import REPO, RejectingServer, stage_env

KEY = "sk-eagle3-TEST-5ecr3t-9f1c2e7d4b"
DECOY = "sk-decoy-from-OPENAI_API_KEY-77aa"
KEY_ENV = "EAGLE3_GENERATION_KEY"

# Run a stage with the root logger at DEBUG before stage_main configures logging (its
# basicConfig is then a no-op), so every library's debug output reaches stderr.
DEBUG_WRAPPER = r'''
import logging, runpy, sys
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def run_stage(script: str, cfg: Path, env: dict, debug: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", DEBUG_WRAPPER] if debug else [sys.executable]
    return subprocess.run([*cmd, str(REPO / script), "--config", str(cfg)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=stage_env(**env))


def files_containing(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


def test_key_comes_from_the_env_var_reaches_the_server_and_is_never_written(tmp_path, chat_tokenizer_dir):
    from common.target.tokenization import load_tokenizer

    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "system", "content": "Be brief."},
                                                                    {"role": "user", "content": f"Question {i}?"}]}) + "\n"
                           for i in range(12)))
    tok = load_tokenizer(str(chat_tokenizer_dir))
    env = {KEY_ENV: KEY, "OPENAI_API_KEY": DECOY, "OPENAI_LOG": "debug"}
    with FaultServer(Faults(seed=1, p_500=0.2), tokenize_fn=lambda t: tok(t, add_special_tokens=False)["input_ids"]) as server:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(yaml.safe_dump({
            "run_dir": str(tmp_path / "run"), "target": {"model": str(chat_tokenizer_dir)},
            "data": {"source": str(src), "eval_fraction": 0.25},
            "generate": {"base_url": server.base_url, "api_key_env": KEY_ENV, "concurrency": 4, "timeout_s": 5,
                         "max_retries": 5, "backoff_initial_s": 0.01, "backoff_max_s": 0.02, "max_tokens": 16},
        }))
        prep = run_stage("01_prepare_data.py", cfg, env)
        gen = run_stage("01b_generate_synthetic.py", cfg, env)
        assert prep.returncode == 0, prep.stderr[-2000:]
        assert gen.returncode == 0, gen.stderr[-3000:]
        # The configured variable's value was sent, on every request, and nothing else.
        assert server.stats.auth_headers == {f"Bearer {KEY}"}
        assert server.stats.chat_requests >= 12 and server.stats.faults["500"] > 0  # retried requests too

    data = tmp_path / "run" / "data"
    assert len(list(iter_jsonl(data / "raw_responses.jsonl"))) == 12
    assert json.loads((data / "generate_report.json").read_text())["tokenizer_check"] == "match"
    assert "DEBUG" in gen.stderr and "openai" in gen.stderr  # debug logging was really on
    for name, text in [("01 stdout", prep.stdout), ("01 stderr", prep.stderr), ("01b stdout", gen.stdout),
                       ("01b stderr", gen.stderr)]:
        assert KEY not in text, f"API key leaked into {name}"
        assert KEY[-12:] not in text, f"part of the API key leaked into {name}"
    assert files_containing(tmp_path, KEY) == [] and files_containing(tmp_path, KEY[-12:]) == []
    assert files_containing(tmp_path, DECOY) == []


def test_rejected_key_is_a_one_line_error_naming_the_variable_not_the_value(tmp_path, chat_tokenizer_dir):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "prompts.jsonl").write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "hi"}],
                                                            "split": "train"}) + "\n")
    with RejectingServer() as server:
        cfg = tmp_path / "run.yaml"
        cfg.write_text(yaml.safe_dump({"run_dir": str(run), "target": {"model": str(chat_tokenizer_dir)},
                                       "generate": {"base_url": server.base_url, "api_key_env": KEY_ENV}}))
        res = run_stage("01b_generate_synthetic.py", cfg, {KEY_ENV: KEY}, debug=False)
        assert server.auth and set(server.auth) == {f"Bearer {KEY}"}
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "401" in lines[-1] and KEY_ENV in lines[-1]
    assert "Traceback" not in res.stderr and KEY not in res.stderr + res.stdout
    assert files_containing(tmp_path, KEY) == []
