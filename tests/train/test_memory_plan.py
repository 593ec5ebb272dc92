"""04's memory planner (common/train/memory_plan.py, docs/design.md#memory-planner-04): its estimate
against the peak measured on CPU at two tiny sizes, its refusal, and its figures for the Kimi config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, clone_run, error_line, stage_env

PROBE = REPO / "tests" / "train" / "memory_probe.py"
# The estimate is an upper bound: never below the measured peak, at most this much above it. Most of
# the margin is the attention chunk, planned for a chunk that starts at a sample's last token (S =
# longest sample + 511 keys); the tiny data has no such chunk.
OVER = 1.3

SIZES = {
    # the fixture's draft (hidden 64, I 128, 4 heads / 2 KV of 16), 256 tokens, 3 TTT steps, no checkpointing
    "small": [],
    # 1024 tokens, 5 TTT steps, I 512, 8 heads / 4 KV of 32, gradient checkpointing on
    "larger+gc": ["train.batch_max_tokens=1024", "train.ttt_steps=5", "train.gradient_checkpointing=true",
                  "draft.intermediate_size=512", "draft.num_attention_heads=8", "draft.num_key_value_heads=4",
                  "draft.head_dim=32"],
    # EAGLE-3.1: the aux states' norms before fc and the normed state fed to each next step
    "eagle3.1": ["draft.fc_norm=true", "draft.norm_output=true"],
}


def probe_peak(cfg: Path, *args: str) -> dict:
    """tests/train/memory_probe.py over 3 training steps of the run `cfg`, in a fresh process: its result line
    (peak_bytes, estimate_bytes, estimate, step_peaks)."""
    out = subprocess.run([sys.executable, str(PROBE), str(cfg), "3", *args], env=stage_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("size", list(SIZES))
def test_estimate_bounds_the_measured_peak(hidden_run, tmp_path, size):
    """04's printed estimate vs the allocator's peak over 3 training steps (steady state: AdamW state
    exists from step 2), in a fresh process (tests/train/memory_probe.py explains the measurement)."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=3, eval_every=0, checkpoint_every=100)
    r = probe_peak(cfg, *SIZES[size])
    measured, estimate = r["peak_bytes"], r["estimate_bytes"]
    print(f"{size}: measured {measured / 1e6:.2f} MB, estimated {estimate / 1e6:.2f} MB "
          f"({estimate / measured:.2f}x): {r['estimate']}")
    assert measured <= estimate <= OVER * measured
    assert r["step_peaks"][1] > r["step_peaks"][0]  # AdamW's state from the first optimizer step on


def test_04_prints_the_plan_and_refuses_what_cannot_fit(hidden_run, tmp_path):
    cfg = clone_run(hidden_run, tmp_path, max_steps=2)
    base = [sys.executable, str(REPO / "04_train.py"), "--config", str(cfg)]
    # checkpointing forced off: nothing fits 9 MB as configured
    small = subprocess.run([*base, "--set", "train.gpu_memory_gb=0.009", "--set", "train.gradient_checkpointing=false"],
                           env=stage_env(), capture_output=True, text=True, timeout=300)
    assert small.returncode == 2
    assert "04_train: memory plan: peak ~" in small.stdout
    err = [line for line in small.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "does not fit 9.00 MB" in err[0] and "lower train.batch_max_tokens to" in err[0]
    assert "gradient_checkpointing: true" in err[0]
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()  # refused before anything was written
    # the suggested batch fits: 04 trains with it
    suggested = int(err[0].split("lower train.batch_max_tokens to ")[1].split()[0])
    ok = subprocess.run([*base, "--set", "train.gpu_memory_gb=0.009", "--set", "train.gradient_checkpointing=false",
                         "--set", f"train.batch_max_tokens={suggested}"], env=stage_env(), capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_04_turns_checkpointing_on_only_when_the_step_does_not_fit(hidden_run, tmp_path):
    """train.gradient_checkpointing null (the default): off when the step fits the capacity, on when only the
    recomputing step fits (9 MB here, where the step without it plans ~9.1 MB); printed as (auto)."""
    cfg = clone_run(hidden_run, tmp_path, max_steps=2)
    base = [sys.executable, str(REPO / "04_train.py"), "--config", str(cfg), "--overwrite"]
    roomy = subprocess.run([*base, "--set", "train.gpu_memory_gb=1"], env=stage_env(), capture_output=True, text=True,
                           timeout=300)
    assert roomy.returncode == 0, roomy.stderr[-2000:]
    assert "gradient_checkpointing off (auto)" in roomy.stdout
    tight = subprocess.run([*base, "--set", "train.gpu_memory_gb=0.009"], env=stage_env(), capture_output=True, text=True,
                           timeout=300)
    assert tight.returncode == 0, tight.stderr[-2000:]
    assert "gradient_checkpointing on (auto)" in tight.stdout


KIMI_TARGET = {"hidden_size": 7168, "vocab_size": 163840, "num_hidden_layers": 61, "torch_dtype": "bfloat16"}
# the Llama-style Kimi draft (lightseekorg/kimi-k2.5-eagle3's sizes, a 32000-token draft vocab); the shipped config's
# MLA draft: tests/train/test_memory_plan_mla.py
KIMI_DRAFT = ["draft.architecture=LlamaForCausalLMEagle3", "draft.rms_norm_eps=1e-6", "draft.hidden_size=7168", "draft.intermediate_size=12288", "draft.num_attention_heads=64",
              "draft.num_key_value_heads=64", "draft.head_dim=128", "vocab.draft_vocab_size=32000", "train.ttt_steps=7",
              "train.parallel=fsdp", "train.precision=bf16", "train.gradient_checkpointing=true"]


def _kimi(tokens: int, *extra: str):
    from common.core.config import load_config
    from common.train.memory_plan import plan_for_config

    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml", [*KIMI_DRAFT, f"train.batch_max_tokens={tokens}", *extra])
    return plan_for_config(cfg, 8, "cuda", target=dict(KIMI_TARGET))


def test_kimi_config_on_96_gb_cards():
    """The figures README quotes: 8 ranks of FSDP on 96 GB cards (RTX PRO 6000 Blackwell)."""
    for tokens in (16384, 20480):
        plan = _kimi(tokens)
        print(f"{tokens}: {plan.describe()}")
        assert plan.setting["trainable_params"] == pytest.approx(1.059e9, rel=0.01)
        assert 30e9 < plan.peak < 0.92 * 96e9
    # each setting moves the estimate the way it must
    assert _kimi(16384).peak < _kimi(20480).peak < _kimi(20480, "train.parallel=ddp").peak
    assert _kimi(20480).peak < _kimi(20480, "train.gradient_checkpointing=false").peak


def test_plan_memory_script_for_a_hub_target():
    args = [sys.executable, str(REPO / "scripts" / "plan_memory.py"), "--config", str(REPO / "configs" / "kimi-k2.5.yaml"),
            "--world-size", "8", "--gpu-memory-gb", "96", "--target-hidden-size", "7168", "--target-vocab-size", "163840",
            "--target-num-layers", "61", *[a for s in KIMI_DRAFT for a in ("--set", s)]]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "04_train: memory plan: peak ~" in out.stdout and "fits:" in out.stdout
    tight = [*args, "--set", "train.gradient_checkpointing=false", "--set", "train.batch_max_tokens=32768"]
    out = subprocess.run(tight, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "gradient_checkpointing: true" in out.stderr
    # tokenize.max_seq_len 20480 bounds a micro-batch from below: a smaller batch is offered only for shorter samples
    assert "lower train.batch_max_tokens" not in out.stderr
    out = subprocess.run([*tight, "--max-sample-len", "8192"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lower train.batch_max_tokens to" in out.stderr


# ---- the planners' numeric flags (nan, inf, ranks <= 0, an unknown dtype): one error line each, nothing accepted

PLAN_MEMORY = [sys.executable, str(REPO / "scripts" / "plan_memory.py"), "--config", str(REPO / "configs" / "kimi-k2.5.yaml"),
               "--target-config", str(REPO / "configs" / "targets" / "kimi-k2.5.json")]
PLAN_SERVING = [sys.executable, str(REPO / "scripts" / "plan_serving.py"), "--target",
                str(REPO / "configs" / "targets" / "kimi-k2.5.json"), "--gpu", "h200", "--max-model-len", "32768"]
FINITE_GPU_GB = "must be a finite number > 0 and <= 100000"


@pytest.mark.parametrize("script, args, message", [
    (PLAN_MEMORY, ["--gpu-memory-gb", "nan"], f"argument --gpu-memory-gb: {FINITE_GPU_GB}, got 'nan'"),
    (PLAN_MEMORY, ["--gpu-memory-gb", "inf"], f"argument --gpu-memory-gb: {FINITE_GPU_GB}, got 'inf'"),
    (PLAN_MEMORY, ["--gpu-memory-gb", "1e300"], f"argument --gpu-memory-gb: {FINITE_GPU_GB}, got '1e300'"),
    (PLAN_MEMORY, ["--gpu-memory-gb", "-1"], f"argument --gpu-memory-gb: {FINITE_GPU_GB}, got '-1'"),
    (PLAN_MEMORY, ["--gpu-memory-gb", "0"], f"argument --gpu-memory-gb: {FINITE_GPU_GB}, got '0'"),
    (PLAN_MEMORY, ["--world-size", "-3"], "argument --world-size: must be an integer >= 1 and <= 65536, got '-3'"),
    (PLAN_MEMORY, ["--world-size", "0"], "argument --world-size: must be an integer >= 1 and <= 65536, got '0'"),
    (PLAN_MEMORY, ["--world-size", "2.5"], "argument --world-size: must be an integer >= 1 and <= 65536, got '2.5'"),
    (PLAN_MEMORY, ["--max-sample-len", "0"], "argument --max-sample-len: must be an integer >= 1 and <= 67108864, got '0'"),
    (PLAN_MEMORY, ["--target-hidden-size", "-5"], "argument --target-hidden-size: must be an integer >= 1 and <= 131072, got '-5'"),
    (PLAN_MEMORY, ["--target-num-layers", "-1"], "argument --target-num-layers: must be an integer >= 1 and <= 4096, got '-1'"),
    (PLAN_MEMORY, ["--target-dtype", "int3"],
     "argument --target-dtype: invalid choice: 'int3' (choose from 'bfloat16', 'float16', 'float32')"),
    (PLAN_SERVING, ["--gpu-memory-gib", "nan"], f"argument --gpu-memory-gib: {FINITE_GPU_GB}, got 'nan'"),
    (PLAN_SERVING, ["--gpu-memory-gib", "0"], f"argument --gpu-memory-gib: {FINITE_GPU_GB}, got '0'"),
    (PLAN_SERVING, ["--tp", "0"], "argument --tp: must be an integer >= 1 and <= 1024, got '0'"),
    (PLAN_SERVING, ["--utilization", "inf"], "argument --utilization: must be a finite number > 0 and <= 1, got 'inf'"),
    (PLAN_SERVING, ["--max-model-len", "-1"], "argument --max-model-len: must be an integer >= 1 and <= 67108864, got '-1'"),
    (PLAN_SERVING, ["--tokens-per-request", "0"],
     "argument --tokens-per-request: must be an integer >= 1 and <= 67108864, got '0'"),
    (PLAN_SERVING, ["--activation-gib", "-5"], "argument --activation-gib: must be a finite number >= 0 and <= 100000, got '-5'"),
    (PLAN_SERVING, ["--weights-gib", "nan"], "argument --weights-gib: must be a finite number > 0 and <= 10000000, got 'nan'"),
])
def test_planner_flags_out_of_range_are_one_line(script, args, message):
    out = subprocess.run([*script, *args], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"error: {message}\n")


def test_plan_memory_world_size_from_the_environment_is_checked():
    env = {**os.environ, "WORLD_SIZE": "-1"}
    out = subprocess.run(PLAN_MEMORY, capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "error: argument --world-size: must be an integer >= 1 and <= 65536, got '-1'\n"
    out = subprocess.run([*PLAN_MEMORY, "--gpu-memory-gb", "96", "--world-size", "8"], capture_output=True, text=True,
                         timeout=120, env=env)  # the flag wins over the environment
    assert out.returncode == 0 and "fsdp x8" in out.stdout and "GPU capacity 96.00 GB" in out.stdout, out.stderr


def test_plan_serving_weights_from_the_target_json_are_checked(tmp_path):
    target = json.loads((REPO / "configs" / "targets" / "kimi-k2.5.json").read_text())
    bad = tmp_path / "target.json"
    bad.write_text(json.dumps({**target, "weights_gib": "lots"}))
    out = subprocess.run([*PLAN_SERVING[:3], str(bad), *PLAN_SERVING[4:]], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"error: {bad}: weights_gib must be a finite number > 0 and <= 10000000, got 'lots'\n"


# ---- a local target's config.json: its sizes checked like the --target-* flags (issue 33)

TINY_TARGET = {"hidden_size": 64, "vocab_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128, "torch_dtype": "float32"}
LOCAL_CONFIG_CASES = {  # config.json (a dict: TINY_TARGET's sizes changed; a string: the file's text) -> the error's fragment
    "a string size": ({"hidden_size": "64x"}, ": hidden_size must be an integer >= 1 and <= 131072, got '64x'"),
    "zero heads": ({"num_attention_heads": 0}, ": num_attention_heads must be an integer >= 1 and <= 16384, got 0"),
    "NaN": ({"intermediate_size": float("nan")}, ": intermediate_size must be an integer >= 1 and <= 1048576, got nan"),
    "negative layers": ({"num_hidden_layers": -1}, ": num_hidden_layers must be an integer >= 1 and <= 4096, got -1"),
    "a bool": ({"num_key_value_heads": True}, ": num_key_value_heads must be an integer >= 1 and <= 16384, got True"),
    "no heads": ({"num_attention_heads": None}, " has no num_attention_heads, which building the draft needs"),
    "nested text_config": ({"text_config": {**TINY_TARGET, "num_hidden_layers": 0}},
                           ": num_hidden_layers must be an integer >= 1 and <= 4096, got 0"),
    "not an object": ("[64, 256]", " holds a JSON list, not a config object; fix target.model"),
    "not JSON": ('{"hidden_size": 64', "error: cannot read the target's config "),
}


@pytest.mark.parametrize("case", list(LOCAL_CONFIG_CASES))
def test_plan_memory_checks_a_local_targets_sizes(tmp_path, case):
    """A string, zero, negative, bool or NaN size (or a missing one) in target.model/config.json is one error line
    naming the file, the key and the value, exit 2 (a ValueError or ZeroDivisionError traceback before)."""
    change, message = LOCAL_CONFIG_CASES[case]
    target = tmp_path / "target"
    target.mkdir()
    text = change if isinstance(change, str) else json.dumps({**TINY_TARGET, **change})  # NaN: json writes NaN
    (target / "config.json").write_text(text)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "plan_memory.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
                          "--set", f"target.model={target}", "--set", "vocab.draft_vocab_size=128", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    line = error_line(out, message)
    assert f"{target / 'config.json'}" in line and out.stdout == ""
    assert (target / "config.json").read_text() == text and os.listdir(target) == ["config.json"]  # nothing written


def test_plan_memory_plans_a_sound_local_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TINY_TARGET))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "plan_memory.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
                          "--set", f"target.model={target}", "--set", "vocab.draft_vocab_size=128", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "04_train: memory plan: peak ~" in out.stdout, out.stderr
