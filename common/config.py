"""The run configuration: one YAML file per run, validated against typed dataclasses.

`load_config(path, overrides)` reads the YAML, applies `--set a.b=value` overrides (the value
is parsed as YAML, so `--set train.lr=1e-4` and `--set target.aux_layer_ids=[1,2,3]` work),
and checks every key and type. Unknown keys name the closest valid key. Relative paths in
the file are resolved against the directory of the YAML file, so a config works from any cwd.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from common.errors import ConfigError


@dataclass
class TargetConfig:
    model: str = ""  # local directory or hub id of the target model
    tokenizer: Optional[str] = None  # defaults to `model`
    # Aux layer ids in vLLM's convention (id k = residual stream after k decoder layers).
    # null = vLLM's default (2, N//2, N-3).
    aux_layer_ids: Optional[list[int]] = None
    trust_remote_code: bool = False
    dtype: str = "bfloat16"  # dtype the target runs in during extraction
    # How 02 places the target: auto | single (one GPU per process) | any transformers
    # device_map ("balanced", "sequential") to shard a target too big for one GPU.
    device_map: str = "auto"


@dataclass
class DataConfig:
    source: str = ""  # local .json/.jsonl/.parquet file or directory, or a `datasets` hub name
    split: str = "train"  # split of a hub dataset
    subset: Optional[str] = None  # hub dataset config name
    max_samples: Optional[int] = None
    eval_fraction: float = 0.05
    seed: int = 0
    system_prompt: Optional[str] = None  # prepended to every prompt that has none
    max_user_turns: int = 1  # user turns kept per prompt; 01b answers them one by one
    dedupe: bool = True


@dataclass
class GenerateConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: Optional[str] = None  # served model name; null = the first one the server lists
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key
    concurrency: int = 128
    timeout_s: float = 3600.0  # per request; must exceed the longest generation
    max_retries: int = 8
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    max_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    fsync_every: int = 32  # results per fsync of raw_responses.jsonl
    enable_thinking: Optional[bool] = None  # passed as chat_template_kwargs when set
    extra_body: dict = field(default_factory=dict)  # merged into every request body


@dataclass
class TokenizeConfig:
    max_seq_len: int = 2048
    # What to do with samples longer than max_seq_len: "truncate" or "drop".
    overlong: str = "truncate"
    # Where 01b takes a sample's token ids from: "template" re-renders the stored conversation
    # with the tokenizer's chat template (loss on every assistant turn); "server" asks vLLM for
    # the exact ids (`return_token_ids`, vLLM >= 0.10): the last turn's prompt ids (loss 0) +
    # its completion ids (loss 1). "server" is needed when the template cannot reproduce what
    # the model generated (e.g. Kimi-K2.5 strips the reasoning of the turn it renders).
    token_ids_from: str = "template"


@dataclass
class ExtractConfig:
    dtype: str = "bfloat16"  # dtype of stored hidden states
    batch_max_tokens: int = 16384  # tokens per forward batch (token budget, not sample count)
    shard_max_tokens: int = 262144  # tokens per output shard
    device: str = "auto"  # auto | cpu | cuda
    min_free_disk_gb: float = 1.0  # head-room kept free on top of the estimate
    verify: str = "sha256"  # how a rerun checks existing shards: sha256 (full read) | size (fast, huge runs)


@dataclass
class VocabConfig:
    draft_vocab_size: int = 32000


@dataclass
class DraftConfig:
    # null = same as the target.
    hidden_size: Optional[int] = None
    intermediate_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    num_hidden_layers: int = 1
    rope_theta: Optional[float] = None
    rms_norm_eps: Optional[float] = None
    norm_before_residual: bool = False
    max_position_embeddings: Optional[int] = None


@dataclass
class TrainConfig:
    ttt_steps: int = 7
    loss_decay: float = 0.8
    max_steps: Optional[int] = None  # optimizer steps; null = epochs * steps per epoch
    epochs: int = 10
    lr: float = 1e-4
    min_lr: float = 0.0
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 0.5
    batch_max_tokens: int = 8192  # tokens per micro-batch per process
    grad_accum: int = 1
    gradient_checkpointing: bool = False
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    eval_every: int = 500
    log_every: int = 10
    seed: int = 0
    parallel: str = "ddp"  # ddp | fsdp
    num_workers: int = 0  # background threads reading the next micro-batches from the shards
    attention_impl: str = "chunked"  # TTT attention: chunked (exact, low memory) | flex (CUDA, compiled) | naive (reference)


@dataclass
class EvaluateConfig:
    num_prompts: int = 64
    num_speculative_tokens: int = 3
    max_tokens: int = 256
    temperature: float = 0.0
    concurrency: int = 16


@dataclass
class ServerConfig:
    """How the pipeline starts vLLM itself (demo, evaluation, tests)."""

    port: int = 0  # 0 = pick a free loopback port
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    startup_timeout_s: float = 900.0
    extra_args: list[str] = field(default_factory=list)
    reasoning_parser: Optional[str] = None


@dataclass
class Config:
    run_dir: str = "runs/default"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Keys whose values are filesystem paths, resolved relative to the YAML file's directory.
# A value that does not exist locally is left as is (it may be a hub id).
_PATH_KEYS = {("run_dir",), ("target", "model"), ("target", "tokenizer"), ("data", "source")}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Check (and lightly coerce) `value` against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_value(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        return [_check_value(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    raise ConfigError(f"config key '{key}': unsupported type {_type_name(tp)}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = f"section '{prefix.rstrip('.')}'" if prefix else "the config file"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            valid = [f"{prefix}{name}" for name in fields]
            close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(valid)}"
            raise ConfigError(f"unknown config key '{full}'{hint}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{full}.")
        else:
            kwargs[key] = _check_value(value, tp, full)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", parsed value). The value is read as YAML (`null`, `[1,2]`, `1e-4`)."""
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE (for example train.lr=1e-4), got '{text}'")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE, got '{text}' with an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _resolve_paths(tree: dict, base: Path) -> None:
    for path_key in _PATH_KEYS:
        node = tree
        for part in path_key[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if not isinstance(node, dict):
            continue
        value = node.get(path_key[-1])
        if not isinstance(value, str) or not value or os.path.isabs(value):
            continue
        value = os.path.expanduser(value)
        candidate = (base / value).resolve()
        # run_dir is always a path; the others only when they exist (else: hub id).
        if path_key == ("run_dir",) or candidate.exists() or value.startswith("."):
            node[path_key[-1]] = str(candidate)


def config_from_dict(tree: dict, overrides: list[str] = (), base_dir: Path | None = None) -> Config:
    tree = dict(tree or {})
    tree = yaml.safe_load(yaml.safe_dump(tree))  # deep copy with plain types
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    if base_dir is not None:
        _resolve_paths(tree, base_dir)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}; pass --config configs/<run>.yaml")
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e}); save it as UTF-8") from None
    if tree is not None and not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must contain a mapping of sections, got {type(tree).__name__}")
    # Overrides are resolved relative to the cwd, file values relative to the file.
    cfg_file = config_from_dict(tree or {}, [], base_dir=path.resolve().parent)
    if not overrides:
        return cfg_file
    return config_from_dict(cfg_file.to_dict(), overrides, base_dir=Path.cwd())


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(cfg: Config) -> None:
    """Value checks that types alone cannot express."""
    _require(bool(cfg.run_dir), "run_dir must be set (the directory every stage writes under)")
    ids = cfg.target.aux_layer_ids
    if ids is not None:
        _require(len(ids) >= 1, "target.aux_layer_ids must list at least one layer id, or be null for the default")
        _require(
            len(set(ids)) == len(ids),
            f"target.aux_layer_ids has duplicated ids {ids}; vLLM collapses duplicates, so give distinct ids",
        )
        _require(all(i >= 0 for i in ids), f"target.aux_layer_ids must be >= 0, got {ids}")
    _require(0.0 <= cfg.data.eval_fraction < 1.0, f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    _require(cfg.data.max_samples is None or cfg.data.max_samples > 0, f"data.max_samples must be positive or null, got {cfg.data.max_samples}")
    _require(cfg.data.max_user_turns >= 1, f"data.max_user_turns must be >= 1, got {cfg.data.max_user_turns}")
    g = cfg.generate
    _require(g.concurrency >= 1, f"generate.concurrency must be >= 1, got {g.concurrency}")
    _require(g.timeout_s > 0, f"generate.timeout_s must be > 0, got {g.timeout_s}")
    _require(g.max_retries >= 0, f"generate.max_retries must be >= 0, got {g.max_retries}")
    _require(g.max_tokens >= 1, f"generate.max_tokens must be >= 1, got {g.max_tokens}")
    _require(g.fsync_every >= 1, f"generate.fsync_every must be >= 1, got {g.fsync_every}")
    _require(cfg.tokenize.max_seq_len >= 8, f"tokenize.max_seq_len must be >= 8, got {cfg.tokenize.max_seq_len}")
    _require(cfg.tokenize.overlong in ("truncate", "drop"), f"tokenize.overlong must be 'truncate' or 'drop', got '{cfg.tokenize.overlong}'")
    _require(
        cfg.tokenize.token_ids_from in ("template", "server"),
        f"tokenize.token_ids_from must be 'template' or 'server', got '{cfg.tokenize.token_ids_from}'",
    )
    _require(cfg.extract.dtype in ("bfloat16", "float16", "float32"), f"extract.dtype must be bfloat16, float16 or float32, got '{cfg.extract.dtype}'")
    _require(cfg.extract.batch_max_tokens >= 1 and cfg.extract.shard_max_tokens >= 1, "extract.batch_max_tokens and extract.shard_max_tokens must be >= 1")
    _require(cfg.vocab.draft_vocab_size >= 1, f"vocab.draft_vocab_size must be >= 1, got {cfg.vocab.draft_vocab_size}")
    t = cfg.train
    _require(t.ttt_steps >= 1, f"train.ttt_steps must be >= 1, got {t.ttt_steps}")
    _require(0.0 < t.loss_decay <= 1.0, f"train.loss_decay must be in (0, 1], got {t.loss_decay}")
    _require(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _require(t.max_steps is None or t.max_steps >= 1, f"train.max_steps must be >= 1 or null, got {t.max_steps}")
    _require(len(t.betas) == 2, f"train.betas must have two values, got {t.betas}")
    _require(t.precision in ("auto", "bf16", "fp32"), f"train.precision must be auto, bf16 or fp32, got '{t.precision}'")
    _require(t.parallel in ("ddp", "fsdp"), f"train.parallel must be ddp or fsdp, got '{t.parallel}'")
    _require(t.grad_accum >= 1 and t.batch_max_tokens >= 1, "train.grad_accum and train.batch_max_tokens must be >= 1")
    _require(t.keep_checkpoints >= 1, f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
    _require(cfg.draft.num_hidden_layers >= 1, f"draft.num_hidden_layers must be >= 1, got {cfg.draft.num_hidden_layers}")


def api_key_from_env(cfg: Config) -> str:
    """The API key for the generation server. Never logged."""
    return os.environ.get(cfg.generate.api_key_env) or "EMPTY"
