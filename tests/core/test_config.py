"""Config loading: overrides, validation, error messages, path resolution."""

import collections
import contextlib
import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path
from unittest import mock

import pytest

from common.core.config import Config, config_from_dict, load_config, parse_override, validate
from common.core.errors import ConfigError
from tests.helpers import error_line, run_stage, write_yaml

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_configs_load():
    tiny = load_config(ROOT / "configs/tiny.yaml")
    assert tiny.target.aux_layer_ids == [1, 2, 3]
    assert Path(tiny.run_dir).is_absolute() and tiny.run_dir.endswith("runs/tiny")
    kimi = load_config(ROOT / "configs/kimi-k2.5.yaml")
    assert kimi.target.model == "moonshotai/Kimi-K2.5"  # hub id stays a hub id
    assert kimi.target.aux_layer_ids == [2, 30, 58]
    assert kimi.vocab.draft_vocab_size == 163840  # the full vocab, as the published MLA draft
    assert kimi.draft.architecture == "Eagle3DeepseekV2ForCausalLM"
    assert kimi.extract.storage == "fp8"  # half the disk of bf16 (docs/design.md#fp8-hidden-states)
    assert kimi.server.tensor_parallel_size == 8


def test_every_contract_key_settable_with_set(tmp_path):
    overrides = [
        "run_dir=out", "target.model=m", "target.aux_layer_ids=[1,2,3]", "data.source=s", "data.max_samples=10",
        "data.eval_fraction=0.2", "data.seed=3", "generate.base_url=http://x/v1", "generate.model=foo",
        "generate.concurrency=7", "generate.timeout_s=9", "generate.max_retries=2", "generate.max_tokens=11",
        "generate.temperature=0", "tokenize.max_seq_len=99", "vocab.draft_vocab_size=500", "train.ttt_steps=3",
        "train.max_steps=12", "train.lr=1e-4",
    ]
    cfg = config_from_dict({}, overrides)
    assert cfg.target.aux_layer_ids == [1, 2, 3]
    assert cfg.data.max_samples == 10 and cfg.data.eval_fraction == 0.2
    assert cfg.generate.concurrency == 7 and cfg.generate.timeout_s == 9.0 and cfg.generate.temperature == 0.0
    assert cfg.tokenize.max_seq_len == 99 and cfg.vocab.draft_vocab_size == 500
    assert cfg.train.ttt_steps == 3 and cfg.train.max_steps == 12 and cfg.train.lr == pytest.approx(1e-4)
    assert cfg.data.seed == 3 and cfg.generate.model == "foo"


def test_set_null_and_yaml_values():
    assert parse_override("target.aux_layer_ids=null") == ("target.aux_layer_ids", None)
    # YAML 1.1 reads 1e-4 (no dot) as a string; an override is a number either way
    for text, number in [("train.lr=1e-4", 1e-4), ("train.lr=2.5E-5", 2.5e-5), ("train.lr=0.001", 0.001)]:
        key, value = parse_override(text)
        assert key == "train.lr" and type(value) is float and value == number
    assert parse_override("generate.model=1e") == ("generate.model", "1e")  # not a number: stays a string
    cfg = config_from_dict({"target": {"aux_layer_ids": [1, 2]}}, ["target.aux_layer_ids=null"])
    assert cfg.target.aux_layer_ids is None


@pytest.mark.parametrize(
    "tree, overrides, message",
    [
        ({"trian": {}}, [], "unknown config key 'trian'; did you mean 'train'?"),
        ({"train": {"ttt_step": 3}}, [], "unknown config key 'train.ttt_step'; did you mean 'train.ttt_steps'?"),
        ({}, ["generate.concurency=3"], "did you mean 'generate.concurrency'"),
        ({"train": {"lr": "fast"}}, [], "config key 'train.lr' must be a number, got 'fast'"),
        ({"train": {"ttt_steps": 2.5}}, [], "config key 'train.ttt_steps' must be an integer, got 2.5"),
        ({"target": {"trust_remote_code": "yes"}}, [], "must be true or false"),
        ({"target": {"aux_layer_ids": [1, 1, 2]}}, [], "duplicated ids [1, 1, 2]"),
        ({"data": {"eval_fraction": 1.5}}, [], "config key 'data.eval_fraction' must be >= 0 and < 1, got 1.5"),
        ({"train": 3}, [], "section 'train' must be a mapping"),
        ({}, ["train.lr"], "--set expects KEY=VALUE"),
        ({"extract": {"stream": True}}, [], "extract.stream is true but extract.max_disk_gb is null"),
        ({}, ["extract.stream_wait_minutes=0"], "config key 'extract.stream_wait_minutes' must be > 0 and <= 10080, got 0"),
    ],
)
def test_bad_config_messages(tree, overrides, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(tree, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_paths_resolve_relative_to_config_file(tmp_path):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "cfgs" / "run.yaml").write_text("run_dir: ../out\ntarget:\n  model: ../model\ndata:\n  source: org/hub-dataset\n")
    cfg = load_config(tmp_path / "cfgs" / "run.yaml")
    assert cfg.run_dir == str((tmp_path / "out").resolve())
    assert cfg.target.model == str((tmp_path / "model").resolve())
    assert cfg.data.source == "org/hub-dataset"


def test_cli_unknown_key_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run_dir: out\nvocab:\n  draft_vocab: 3\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "03_build_vocab_map.py"), "--config", str(cfg)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: unknown config key 'vocab.draft_vocab'; did you mean 'vocab.draft_vocab_size'?"


def test_defaults_are_a_valid_config():
    cfg = Config()
    validate(cfg)  # raises ConfigError if a default breaks a rule
    assert cfg.train.ttt_steps == 7 and cfg.train.loss_decay == 0.8
    assert cfg.generate.concurrency == 128 and cfg.generate.timeout_s >= 3600


@pytest.mark.parametrize("override, message", [
    ("train.log_every=0", "config key 'train.log_every' must be >= 1 and <= 1000000000000, got 0"),
    ("train.checkpoint_every=0", "config key 'train.checkpoint_every' must be >= 1 and <= 1000000000000, got 0"),
    ("train.betas=[0.9,2.0]", "config key 'train.betas[1]' must be >= 0 and < 1, got 2.0"),
    ("generate.backoff_initial_s=-1", "config key 'generate.backoff_initial_s' must be >= 0 and <= 3600, got -1.0"),
    ("generate.temperature=-3", "config key 'generate.temperature' must be >= 0, got -3.0"),
    ("generate.top_p=7", "config key 'generate.top_p' must be > 0 and <= 1, got 7.0"),
    ("train.warmup_ratio=5", "config key 'train.warmup_ratio' must be >= 0 and <= 1, got 5.0"),
    ("train.grad_clip=-1", "config key 'train.grad_clip' must be >= 0 and <= 1000000, got -1.0"),
    ("train.epochs=0", "config key 'train.epochs' must be >= 1 and <= 100000, got 0"),
    ("train.eval_every=-1", "config key 'train.eval_every' must be >= 0 and <= 1000000000000, got -1"),
    ("extract.min_free_disk_gb=-100", "config key 'extract.min_free_disk_gb' must be >= 0 and <= 1000000, got -100.0"),
    ("train.num_workers=-2", "config key 'train.num_workers' must be >= 0 and <= 1024, got -2"),
    ("server.port=99999", "config key 'server.port' must be >= 0 and <= 65535, got 99999"),
    ("evaluate.num_prompts=0", "config key 'evaluate.num_prompts' must be >= 1 and <= 10000000, got 0"),
    ("generate.max_failure_fraction=1.5", "config key 'generate.max_failure_fraction' must be >= 0 and <= 1, got 1.5"),
    ("train.precision=bf17", "config key 'train.precision' must be one of auto, bf16, fp32, got 'bf17'; did you mean 'bf16'?"),
    ("train.learning_rate=1e-4", "unknown config key 'train.learning_rate'; did you mean 'train.lr'?"),
    # non-finite numbers and seeds numpy cannot take, refused at load
    ("train.lr=.inf", "config key 'train.lr' must be a finite number, got inf"),
    ("train.lr=.nan", "config key 'train.lr' must be a finite number, got nan"),
    ("extract.min_free_disk_gb=.inf", "config key 'extract.min_free_disk_gb' must be a finite number, got inf"),
    ("generate.timeout_s=-.inf", "config key 'generate.timeout_s' must be a finite number, got -inf"),
    ("train.seed=-1", "config key 'train.seed' must be >= 0 and <= 2147483647, got -1"),
    ("train.seed=1e30", "config key 'train.seed' must be >= 0 and <= 2147483647, got 1000000000000000019884624838656"),
    ("data.seed=4294967296", "config key 'data.seed' must be >= 0 and <= 2147483647, got 4294967296"),
    # a port out of range in the URL: one line here, not an ExceptionGroup traceback in 01b
    ("generate.base_url=http://127.0.0.1:99999/v1", "config key 'generate.base_url' is not a valid URL (Port out of range "
                                                    "0-65535): 'http://127.0.0.1:99999/v1'; for example http://127.0.0.1:8000/v1"),
    ("generate.base_url=localhost:8000/v1", "config key 'generate.base_url' must be an http(s) URL with a host (and a port "
                                            "in 1..65535), got 'localhost:8000/v1'; for example http://127.0.0.1:8000/v1"),
])
def test_config_values_are_checked_at_load(tmp_path, override, message):
    """A bad value (out of range, not finite, a wrong choice or key, a bad URL) is one `error:` line when the
    config loads, before the stage writes anything."""
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run")})
    line = error_line(run_stage("03_build_vocab_map.py", cfg, "--set", override, timeout=120))
    assert line == f"error: {message}"
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_config_duplicate_keys_are_an_error(tmp_path):
    """A key given twice in one section is an error naming both lines (plain YAML keeps the last silently)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run_dir: out\ntrain:\n  lr: 1.0e-4\n  max_steps: 10\n  lr: 3.0e-4\n")
    error_line(run_stage("04_train.py", cfg, timeout=120),
               f"config key 'lr' appears twice in one section of {cfg} (lines 3 and 5); keep one of them")


# ---- hostile YAML


def test_yaml_merge_keys_work_and_complex_keys_are_one_line(tmp_path):
    cfg = tmp_path / "merge.yaml"
    cfg.write_text("run_dir: run\ngenerate: &sampling\n  max_tokens: 64\n  temperature: 0.0\n  concurrency: 4\n"
                   "evaluate:\n  <<: *sampling\n  concurrency: 8\n")
    loaded = load_config(cfg)
    assert (loaded.evaluate.max_tokens, loaded.evaluate.temperature, loaded.evaluate.concurrency) == (64, 0.0, 8)
    assert loaded.generate.concurrency == 4
    cfg.write_text("run_dir: run\n? [a, b]\n: 1\n")
    with pytest.raises(ConfigError, match="line 2: a config key must be a plain name, got a sequence"):
        load_config(cfg)
    cfg.write_text("run_dir: run\ntrain:\n  lr: 0.1\n  <<: {lr: 0.2, max_steps: 3}\n  lr: 0.3\n")
    with pytest.raises(ConfigError, match="config key 'lr' appears twice"):  # merged keys do not count, repeated ones do
        load_config(cfg)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["run_dir: run", "generate:", "  extra_body:", '    l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]  # 9^9 = 387M strings
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    line = error_line(run_stage("01_prepare_data.py", cfg, timeout=60))
    assert "expands to more than 100,000 values through its YAML aliases" in line


@pytest.mark.parametrize("script", ["01_prepare_data.py", "03_build_vocab_map.py", "05_evaluate.py", "run_pipeline.py"])
def test_run_dir_on_a_file_is_one_error_line(tmp_path, script):
    """run_dir on a file (or under one) is one error line from every stage, not a NotADirectoryError traceback;
    the file is left as it was."""
    (tmp_path / "afile").write_text("not a folder")
    for run_dir in ("afile", "afile/run"):
        cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": run_dir})
        error_line(run_stage(script, cfg, timeout=120), f"run_dir {tmp_path / run_dir}: {tmp_path / 'afile'} is a file, "
                                                        f"not a directory")
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_a_numeric_run_dir_is_a_folder_next_to_the_yaml(tmp_path):
    """`run_dir: 5` is the folder "5" next to the YAML, like any relative path, not one under the working directory."""
    (tmp_path / "configs").mkdir()
    cfg = tmp_path / "configs" / "run.yaml"
    cfg.write_text("run_dir: 5\n")
    assert load_config(cfg).run_dir == str(tmp_path / "configs" / "5")


# ---- hostile YAML through --set as in the file, and nesting that would overflow Python's stack


@contextlib.contextmanager
def counted_yaml_work():
    """The config reader's work while in the block, counted: YAML nodes composed (one per node or alias of the
    text), visits of _expanded_shape (two per distinct node), documents constructed into Python values."""
    from common.core import yaml_safe

    work: collections.Counter = collections.Counter()
    compose, children, construct = (yaml_safe._UniqueKeyLoader.compose_node, yaml_safe._children,
                                    yaml_safe._UniqueKeyLoader.construct_document)

    def counted(key, fn):
        def call(*args):
            work[key] += 1
            return fn(*args)
        return call

    with mock.patch.object(yaml_safe._UniqueKeyLoader, "compose_node", counted("composed", compose)), \
            mock.patch.object(yaml_safe, "_children", counted("walked", children)), \
            mock.patch.object(yaml_safe._UniqueKeyLoader, "construct_document", counted("constructed", construct)):
        yield work


def _refused_quickly(cfg: Path, *args: str, fragment: str, tmp_path: Path) -> str:
    """The stage refuses in one line before it writes anything; and the refusal costs work in proportion to the
    text, not to what it stands for (10^7 values, 5,000 or 50,000 levels): read again in this process, the hostile
    text (the --set value, or the file) is composed to at most a few hundred nodes (the depth limit stops the
    nesting), each node is sized once, and nothing is constructed. Counted, not timed: the --set bomb ran 6.6 s and
    more before, but a stage's wall-clock time on a loaded machine is mostly its start."""
    res = run_stage("03_build_vocab_map.py", cfg, *args, timeout=120)  # the timeout: a hang guard only
    line = error_line(res, fragment)  # exit 2, one `error:` line, no RecursionError traceback
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with counted_yaml_work() as work, pytest.raises(ConfigError, match=re.escape(fragment)):
        parse_override(args[1]) if args else load_config(cfg)  # args: ("--set", "KEY=VALUE")
    assert work["constructed"] == 0, work  # refused before any value was built, let alone expanded
    assert work["composed"] <= 200 and work["walked"] <= 2 * work["composed"], work
    return line


def test_deep_nesting_in_the_file_is_one_line(tmp_path):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\ngenerate:\n  extra_body:\n    x: {'[' * 50_000}{']' * 50_000}\n")
    line = _refused_quickly(cfg, fragment="the YAML is nested more than 64 levels deep", tmp_path=tmp_path)
    assert line.startswith(f"error: {cfg}, line 4: ")


def test_deep_nesting_and_an_alias_bomb_in_set_are_refused_as_in_the_file(tmp_path):
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run")})
    line = _refused_quickly(cfg, "--set", f"generate.extra_body={{x: {'[' * 5000}{']' * 5000}}}",
                            fragment="the YAML is nested more than 64 levels deep", tmp_path=tmp_path)
    assert line.startswith("error: --set generate.extra_body, line 1: ")
    levels = ["&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]  # 10^7 values once expanded
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    line = _refused_quickly(cfg, "--set", f"generate.extra_body={{x: [{', '.join(levels)}]}}", tmp_path=tmp_path,
                            fragment="expands to more than 100,000 values through its YAML aliases")
    assert line.startswith("error: --set generate.extra_body expands")


def test_nesting_through_aliases_and_a_value_that_contains_itself_are_refused(tmp_path):
    # each anchor 50 levels deep around the previous one: 1,500 levels once expanded, from 3 KB of text
    chain = ", ".join(f"a{i}: &a{i} {'[' * 50}{f'*a{i - 1}' if i else '1'}{']' * 50}" for i in range(30))
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(f"run_dir: run\ngenerate:\n  extra_body: {{{chain}}}\n")
    for load in (lambda: load_config(cfg), lambda: config_from_dict({}, [f"generate.extra_body={{{chain}}}"])):
        with pytest.raises(ConfigError, match="nests more than 64 levels deep through its YAML aliases"):
            load()
    for value in ("&a {x: *a}", "&a [1, *a]"):
        with pytest.raises(ConfigError, match="line 1: a YAML alias .* inside its own anchor makes a value that contains itself"):
            parse_override(f"generate.extra_body={value}")


def test_nesting_a_config_needs_still_loads(tmp_path):
    nested = "{a: " * 30 + "1" + "}" * 30  # a JSON schema in extra_body nests this much at most
    cfg = config_from_dict({}, [f"generate.extra_body={{schema: {nested}}}", "generate.extra_body.n=&n [1, 2]"])
    node = cfg.generate.extra_body["schema"]
    for _ in range(29):
        node = node["a"]
    assert node == {"a": 1} and cfg.generate.extra_body["n"] == [1, 2]
    assert parse_override("data.system_prompt=You are: [x") == ("data.system_prompt", "You are: [x")  # not YAML: text


# ---- absurd counts, numbers that overflow once turned into bytes, and every float's nan/inf


@pytest.mark.parametrize("override, message", [
    # counts: each has a sane maximum
    ("generate.concurrency=1e9", "config key 'generate.concurrency' must be >= 1 and <= 16384, got 1000000000"),
    ("train.ttt_steps=100000", "config key 'train.ttt_steps' must be >= 1 and <= 256, got 100000"),
    ("extract.shard_max_tokens=1e12", "config key 'extract.shard_max_tokens' must be >= 1 and <= 67108864, got 1000000000000"),
    ("evaluate.num_speculative_tokens=1000", "config key 'evaluate.num_speculative_tokens' must be >= 1 and <= 256, got 1000"),
    # sizes that become bytes: finite, and bounded well below an overflow
    ("extract.max_disk_gb=1e300", "config key 'extract.max_disk_gb' must be > 0 and <= 1000000, got 1e+300"),
    ("extract.max_disk_gb=.inf", "config key 'extract.max_disk_gb' must be a finite number, got inf"),
    ("extract.max_disk_gb=.nan", "config key 'extract.max_disk_gb' must be a finite number, got nan"),
    ("extract.max_disk_gb=-1", "config key 'extract.max_disk_gb' must be > 0 and <= 1000000, got -1.0"),
    ("extract.max_disk_gb=0", "config key 'extract.max_disk_gb' must be > 0 and <= 1000000, got 0.0"),
    ("extract.max_disk_gb=1000001", "config key 'extract.max_disk_gb' must be > 0 and <= 1000000, got 1000001.0"),
    ("extract.min_free_disk_gb=1e300", "config key 'extract.min_free_disk_gb' must be >= 0 and <= 1000000, got 1e+300"),
    ("train.gpu_memory_gb=1e300", "config key 'train.gpu_memory_gb' must be > 0 and <= 100000, got 1e+300"),
])
def test_counts_and_sizes_have_upper_bounds(override, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"run_dir": "run"}, [override])
    assert str(e.value) == message


def test_a_bound_reads_the_same_as_an_int_or_a_float():
    """Equal Ranges share one cached Annotated type (typing compares 10**6 == 1e6), so a key's message must not
    depend on which of the two spellings typing saw first."""
    from common.core.config import Range

    assert Range(ge=0, le=1e6).describe() == Range(ge=0, le=10**6).describe() == ">= 0 and <= 1000000"
    assert Range(gt=0, lt=0.5).describe() == "> 0 and < 0.5"


@pytest.mark.parametrize("key, bound, message", [
    ("train.checkpoint_every", 10**12, "config key 'train.checkpoint_every' must be >= 1 and <= 1000000000000, got 1000000000001"),
    ("train.log_every", 10**12, "config key 'train.log_every' must be >= 1 and <= 1000000000000, got 1000000000001"),
    ("train.eval_every", 10**12, "config key 'train.eval_every' must be >= 0 and <= 1000000000000, got 1000000000001"),
    ("data.max_samples", 10**9, "config key 'data.max_samples' must be >= 1 and <= 1000000000, got 1000000001"),
])
def test_step_intervals_and_max_samples_are_bounded(key, bound, message):
    """Each is accepted at its upper bound (train.max_steps' for the step intervals) and refused one above it,
    in one line."""
    section, name = key.split(".")
    assert getattr(getattr(config_from_dict({"run_dir": "run"}, [f"{key}={bound}"]), section), name) == bound
    with pytest.raises(ConfigError) as e:
        config_from_dict({"run_dir": "run"}, [f"{key}={bound + 1}"])
    assert str(e.value) == message and "\n" not in message


@pytest.mark.parametrize("key, bound, above, message", [
    ("draft.rope_theta", 1e12, 1.5e12, "must be > 0 and <= 1000000000000, got 1500000000000.0"),
    ("draft.rms_norm_eps", 1, 2, "must be > 0 and <= 1, got 2.0"),
    ("train.weight_decay", 1, 2, "must be >= 0 and <= 1, got 2.0"),
    ("train.grad_clip", 1e6, 2e6, "must be >= 0 and <= 1000000, got 2000000.0"),
])
def test_float_settings_are_bounded(key, bound, above, message):
    """A float setting beyond any sane value (a typo such as rms_norm_eps=1e6) is refused in one line before a run
    starts; the bound itself is accepted. (train.lr has no bound: test_train's diverged run needs lr 1e30, and 04
    stops a diverging run at its first non-finite gradient.)"""
    section, name = key.split(".")
    assert getattr(getattr(config_from_dict({"run_dir": "run"}, [f"{key}={bound}"]), section), name) == bound
    with pytest.raises(ConfigError) as e:
        config_from_dict({"run_dir": "run"}, [f"{key}={above}"])
    assert str(e.value) == f"config key '{key}' {message}"


def test_a_refused_disk_budget_deletes_nothing(tmp_path):
    """02 --overwrite with a disk budget refused at load (1e300 GB, an OverflowError once in bytes) refuses before it
    clears hidden/; the largest budget allowed turns into bytes without overflow."""
    shard = tmp_path / "run" / "hidden" / "shard-00000.safetensors"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"kept")
    cfg = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run")})
    error_line(run_stage("02_extract_hidden.py", cfg, "--overwrite", "--set", "extract.max_disk_gb=1e300", timeout=120),
               "config key 'extract.max_disk_gb' must be > 0 and <= 1000000, got 1e+300")
    assert shard.read_bytes() == b"kept"
    # the largest budget allowed is bytes without overflow
    assert int(config_from_dict({"run_dir": "run"}, ["extract.max_disk_gb=1e6"]).extract.max_disk_gb * 1e9) == 10**15


def _float_keys() -> list[str]:
    """Every config key whose value is one float (Optional and Annotated unwrapped)."""
    keys = []
    for section, section_tp in typing.get_type_hints(Config).items():
        if not dataclasses.is_dataclass(section_tp):
            continue
        for name, tp in typing.get_type_hints(section_tp, include_extras=True).items():
            args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is typing.Union else [tp]
            base = typing.get_args(args[0])[0] if typing.get_origin(args[0]) is typing.Annotated else args[0]
            if len(args) == 1 and base is float:
                keys.append(f"{section}.{name}")
    return keys


def test_every_float_key_refuses_nan_and_inf():
    keys = _float_keys()
    assert {"extract.max_disk_gb", "train.lr", "generate.timeout_s", "draft.rope_theta"} <= set(keys) and len(keys) > 20
    for key in keys:
        for value in (".nan", ".inf", "-.inf"):
            with pytest.raises(ConfigError, match=f"config key '{key}' must be a finite number"):
                config_from_dict({"run_dir": "run"}, [f"{key}={value}"])
