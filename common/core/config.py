"""The run configuration: one YAML file per run, validated against typed dataclasses.

`load_config(path, overrides)` reads the YAML (common.core.yaml_safe: hostile YAML is one error
line), applies `--set a.b=value` overrides (the value is parsed as YAML, so `--set train.lr=1e-4`
and `--set target.aux_layer_ids=[1,2,3]` work), and checks every key and type (ranges and choices;
every count has an upper bound). Unknown keys name the closest valid key. Relative paths in the
file are resolved against the directory of the YAML file, so a config works from any cwd.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import yaml

from common.core import dtype_choice
from common.core.errors import ConfigError
from common.core.yaml_safe import read_yaml_file, yaml_value


@dataclass(frozen=True)
class Range:
    """Allowed numeric range of a config key, written into its type: `Annotated[int, Range(ge=1)]`.
    Checked once, when the config is loaded; `argument()` checks a script's numeric flag the same way."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def check(self, value: Any, key: str) -> None:
        if not self.holds(value):
            raise ConfigError(f"config key '{key}' must be {self.describe()}, got {value!r}")

    def argument(self, kind: type = float) -> Callable[[str], Any]:
        """An argparse `type=`: a finite int or float in this range, else the error names the value and the range."""
        def parse(text: str):
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not math.isfinite(value) or not self.holds(value):  # inf is within a range open above
                what = "an integer" if kind is int else "a finite number"
                raise argparse.ArgumentTypeError(f"must be {what} {self.describe()}, got {text!r}")
            return value

        return parse

    def describe(self) -> str:
        def num(b: float) -> str:  # 10**6 and 1e6 alike: equal Ranges share one cached Annotated type
            return str(int(b)) if float(b).is_integer() and abs(b) < 1e15 else f"{b:g}"

        low = f">= {num(self.ge)}" if self.ge is not None else f"> {num(self.gt)}" if self.gt is not None else None
        high = f"<= {num(self.le)}" if self.le is not None else f"< {num(self.lt)}" if self.lt is not None else None
        return " and ".join(x for x in (low, high) if x)


NonNegative = Range(ge=0)
Fraction = Range(ge=0, le=1)
Seed = Range(ge=0, le=2**31 - 1)  # numpy takes seeds below 2**32; the ranks add their rank
MAX_DISK_GB = 10**6  # 1 EB: a disk size in GB becomes bytes (int(gb * 1e9)), where 1e300 overflows
GpuMemoryGB = Range(gt=0, le=100_000)  # one GPU's memory (GB or GiB), also the planners' --gpu-memory-* flags
TensorParallel = Range(ge=1, le=1024)
MemoryUtilization = Range(gt=0, le=1)  # vLLM's --gpu-memory-utilization
ModelLen = Range(ge=1, le=2**26)  # tokens of one sequence
Steps = Range(ge=1, le=10**12)  # optimizer steps, and intervals counted in them

TorchDtype = Literal["bfloat16", "float16", "float32"]
# a config's dtype: auto = bfloat16 on CUDA or a CPU with native bf16, float32 on other CPUs (common.core.dtype_choice)
ConfigDtype = Literal["auto", "bfloat16", "float16", "float32"]


@dataclass
class TargetConfig:
    model: str = ""  # local directory or hub id of the target model
    tokenizer: Optional[str] = None  # defaults to `model`
    # Aux layer ids in vLLM's convention (id k = residual stream after k decoder layers).
    # null = vLLM's default (2, N//2, N-3).
    aux_layer_ids: Optional[list[int]] = None
    trust_remote_code: bool = False
    dtype: ConfigDtype = "auto"  # dtype the target runs in (02's extraction, 05's and 01b's vLLM)
    # How 02 places the target: auto | single (one GPU per process) | any transformers
    # device_map ("balanced", "sequential") to shard a target too big for one GPU.
    device_map: str = "auto"


@dataclass
class DataConfig:
    source: str = ""  # local .json/.jsonl/.parquet file or directory, or a `datasets` hub name
    split: str = "train"  # split of a hub dataset
    subset: Optional[str] = None  # hub dataset config name
    max_samples: Optional[Annotated[int, Range(ge=1, le=10**9)]] = None
    eval_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.05
    seed: Annotated[int, Seed] = 0
    system_prompt: Optional[str] = None  # prepended to every prompt that has none
    max_user_turns: Annotated[int, Range(ge=1, le=256)] = 1  # user turns kept per prompt; 01b answers them one by one
    dedupe: bool = True
    # Whose answers the draft trains on: "regenerate" (the target's own, from 01b: the best data, and its slowest
    # stage), "dataset" (the source's assistant turns: no server for 01b; rows without an answer are dropped) or
    # "fill" (the source's where every kept user turn has one, 01b answers the rest). docs/design.md#answers
    answers: Literal["regenerate", "dataset", "fill"] = "regenerate"


@dataclass
class GenerateConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: Optional[str] = None  # served model name; null = the first one the server lists
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key
    concurrency: Annotated[int, Range(ge=1, le=16384)] = 128
    timeout_s: Annotated[float, Range(gt=0, le=604800)] = 3600.0  # per request; must exceed the longest generation
    max_retries: Annotated[int, Range(ge=0, le=1000)] = 8
    backoff_initial_s: Annotated[float, Range(ge=0, le=3600)] = 1.0
    backoff_max_s: Annotated[float, Range(ge=0, le=86400)] = 60.0
    max_tokens: Annotated[int, Range(ge=1, le=2**24)] = 2048
    temperature: Annotated[float, NonNegative] = 0.6
    top_p: Annotated[float, Range(gt=0, le=1)] = 0.95
    fsync_every: Annotated[int, Range(ge=1, le=10**6)] = 32  # results per fsync of raw_responses.jsonl
    enable_thinking: Optional[bool] = None  # passed as chat_template_kwargs when set
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    # 01b fails (exit 2, nothing tokenized) when more than this share of the prompts failed every retry.
    max_failure_fraction: Annotated[float, Fraction] = 0.1


@dataclass
class TokenizeConfig:
    max_seq_len: Annotated[int, Range(ge=8, le=2**24)] = 2048
    # What to do with samples longer than max_seq_len: "truncate" or "drop".
    overlong: Literal["truncate", "drop"] = "truncate"
    # Where 01b takes a sample's token ids from: "template" re-renders the stored conversation with the tokenizer's
    # chat template (loss on every assistant turn); "server" asks vLLM for the exact ids (`return_token_ids`, vLLM
    # >= 0.10): the last turn's prompt ids (loss 0) + its completion ids (loss 1). "server" is needed when the
    # template cannot reproduce what the model generated (e.g. Kimi-K2.5 strips the reasoning of the turn it renders).
    token_ids_from: Literal["template", "server"] = "template"


@dataclass
class ExtractConfig:
    dtype: ConfigDtype = "auto"  # dtype the hidden states are captured in (and stored in, with storage "full")
    # How the states are stored: "full" (extract.dtype) or "fp8" (e4m3 with a float32 scale per token per
    # tensor: ~half of bf16 on disk, decoded to the training dtype by 04; docs/design.md#fp8-hidden-states).
    storage: Literal["full", "fp8"] = "full"
    batch_max_tokens: Annotated[int, Range(ge=1, le=2**24)] = 16384  # tokens per forward batch (token budget, not sample count)
    shard_max_tokens: Annotated[int, Range(ge=1, le=2**26)] = 262144  # tokens per output shard
    device: Literal["auto", "cpu", "cuda"] = "auto"
    min_free_disk_gb: Annotated[float, Range(ge=0, le=MAX_DISK_GB)] = 1.0  # head-room kept free on top of the estimate
    # The most the hidden-state shards may take on disk. When the data set does not fit, 02 and 04 alternate
    # in rounds: a seeded random share of the train samples per round, re-extracted per epoch, each round
    # deleted once trained (docs/design.md#rounds-under-a-disk-budget). null = no bound (one extraction).
    max_disk_gb: Optional[Annotated[float, Range(gt=0, le=MAX_DISK_GB)]] = None
    # Streaming (needs max_disk_gb): 02 and 04 run at the same time on one run folder, e.g. on two GPU pools
    # or nodes sharing a filesystem. Rounds are cut at half the budget so 04 trains one while 02 extracts the
    # next; 02 waits while the folder is full, 04 waits for the next round (docs/design.md#streaming).
    stream: bool = False
    # How long a streaming stage waits while the other shows no sign of life (02: a new shard; 04: a metrics
    # line or a round trained) before it stops with an error (resumable: rerun it).
    stream_wait_minutes: Annotated[float, Range(gt=0, le=10080)] = 30.0
    verify: Literal["sha256", "size"] = "sha256"  # how a rerun checks existing shards: sha256 (full read) | size (fast, huge runs)
    # Who runs the target: vllm (its extract_hidden_states method: TP/EP, quantized MoE kernels, MLA),
    # hf (transformers + hooks: the reference, and for targets vLLM cannot run); auto = vllm where installed.
    backend: Literal["auto", "vllm", "hf"] = "auto"
    tensor_parallel_size: Annotated[int, TensorParallel] = 1  # vllm backend
    data_parallel_size: Annotated[int, Range(ge=1, le=4096)] = 1  # vllm backend: engine copies, one process each (MoE targets)
    enable_expert_parallel: bool = False  # vllm backend: experts split over the TP x DP GPUs instead of TP-sliced
    gpu_memory_utilization: Optional[Annotated[float, MemoryUtilization]] = None  # vllm backend; null = 0.9 GPU, 0.3 CPU


@dataclass
class VocabConfig:
    draft_vocab_size: Annotated[int, Range(ge=1, le=2**24)] = 32000


@dataclass
class DraftConfig:
    architecture: str = "LlamaForCausalLMEagle3"  # the draft family (common/model/draft/registry.py); init_from's wins
    # null = same as the target.
    hidden_size: Optional[Annotated[int, Range(ge=1, le=2**17)]] = None
    intermediate_size: Optional[Annotated[int, Range(ge=1, le=2**20)]] = None
    num_attention_heads: Optional[Annotated[int, Range(ge=1, le=4096)]] = None
    num_key_value_heads: Optional[Annotated[int, Range(ge=1, le=4096)]] = None
    head_dim: Optional[Annotated[int, Range(ge=1, le=4096)]] = None
    num_hidden_layers: Annotated[int, Range(ge=1, le=256)] = 1
    rope_theta: Optional[Annotated[float, Range(gt=0, le=1e12)]] = None  # published models use 1e4..1e8
    rms_norm_eps: Optional[Annotated[float, Range(gt=0, le=1)]] = None
    norm_before_residual: bool = False
    # EAGLE-3.1 (docs/design.md#eagle-31-the-norm-flags); all false = EAGLE-3. fc_norm: one RMSNorm per aux hidden
    # state before fc; norm_before_fc (the Llama draft only; not with fc_norm): one RMSNorm over their concatenation;
    # norm_output: the next draft step reads the normed output instead of the pre-norm one
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    max_position_embeddings: Optional[Annotated[int, Range(ge=1, le=2**26)]] = None
    # RoPE scaling of the draft, exported in its config.json so vLLM builds the same rotary: null = none (plain
    # RoPE at rope_theta); "target" = the target's own (e.g. Kimi-K2.5's yarn, factor 64 over 4096 positions);
    # or a mapping in transformers' form ({rope_type: yarn, factor: 64, original_max_position_embeddings: 4096}).
    rope_scaling: Optional[Literal["target"] | dict] = None


@dataclass
class TrainConfig:
    ttt_steps: Annotated[int, Range(ge=1, le=256)] = 7
    loss_decay: Annotated[float, Range(gt=0, le=1)] = 0.8
    max_steps: Optional[Annotated[int, Steps]] = None  # optimizer steps; null = epochs * steps per epoch
    epochs: Annotated[int, Range(ge=1, le=100000)] = 10
    lr: Annotated[float, Range(gt=0)] = 1e-4  # unbounded: a run that diverges stops at its first non-finite gradient
    min_lr: Annotated[float, NonNegative] = 0.0
    warmup_ratio: Annotated[float, Fraction] = 0.015
    weight_decay: Annotated[float, Range(ge=0, le=1)] = 0.0  # decoupled: a fraction of lr * w per step
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(default_factory=lambda: [0.9, 0.95])  # AdamW beta1, beta2
    grad_clip: Annotated[float, Range(ge=0, le=1e6)] = 0.5  # 0 = no clipping
    batch_max_tokens: Annotated[int, Range(ge=1, le=2**24)] = 8192  # tokens per micro-batch per process
    grad_accum: Annotated[int, Range(ge=1, le=2**16)] = 1
    # recompute each TTT step's layers in backward: null = only when 04's memory planner says the step does not
    # fit without (docs/design.md#memory-planner-04; no check on CPU without train.gpu_memory_gb: off)
    gradient_checkpointing: Optional[bool] = None
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    checkpoint_every: Annotated[int, Steps] = 500
    keep_checkpoints: Annotated[int, Range(ge=1, le=10000)] = 3
    eval_every: Annotated[int, Range(ge=0, le=Steps.le)] = 500  # 0 = only at the end
    log_every: Annotated[int, Steps] = 10
    seed: Annotated[int, Seed] = 0
    parallel: Literal["ddp", "fsdp"] = "ddp"
    num_workers: Annotated[int, Range(ge=0, le=1024)] = 0  # background threads reading the next micro-batches from the shards
    # TTT attention: auto (flex on a GPU where its backward runs and agrees with chunked, checked at the start;
    # else chunked) | chunked (exact, low memory, any device) | flex (CUDA, compiled) | naive (reference)
    attention_impl: Literal["auto", "chunked", "flex", "naive"] = "auto"
    compile: Optional[bool] = None  # torch.compile the decoder layers' dense parts; null = on CUDA, off on CPU
    init_lm_head: Literal["random", "target"] = "random"  # target: the target's lm_head rows of the draft vocab
    # start from a vLLM-format EAGLE-3 draft directory (another run's train/final, or a published draft for this
    # target) instead of random weights; its architecture is trained (docs/design.md#starting-from-a-published-draft)
    init_from: Optional[str] = None
    # the draft vocab with init_from: own = the init's (its d2t; 03's map is not used), remap = 03's, carrying over
    # the init's lm_head rows of the tokens both share (the others as init_lm_head says)
    init_vocab: Literal["own", "remap"] = "own"
    # the EAGLE-3.1 norm flags with init_from (draft.fc_norm, draft.norm_before_fc, draft.norm_output): match = the
    # init's must equal draft.*'s (a mismatch is refused); convert = train draft.*'s from the init's weights (a norm
    # the init lacks starts at 1, a norm it has that draft.* does not is dropped)
    init_norms: Literal["match", "convert"] = "match"
    # L2-SP: lambda of the penalty lambda * sum((w - w_init)^2) over the trainable weights, towards init_from's
    # (keeps a fine-tune from over-specialising; 1e-4 in published fine-tunes); 0 = off
    anchor_weight: Annotated[float, Range(ge=0, le=1e6)] = 0.0
    # the loss's denominator: step-0 positions with a loss (counted) or every token of the step, as the
    # official EAGLE-3 code's mean over all positions (all_tokens)
    loss_normalization: Literal["counted", "all_tokens"] = "counted"
    # memory per GPU that 04's memory planner checks against (docs/design.md#memory-planner-04); null = the
    # CUDA device's total, no check on CPU
    gpu_memory_gb: Optional[Annotated[float, GpuMemoryGB]] = None


@dataclass
class EvaluateConfig:
    num_prompts: Annotated[int, Range(ge=1, le=10**7)] = 64
    num_speculative_tokens: Annotated[int, Range(ge=1, le=256)] = 3
    max_tokens: Annotated[int, Range(ge=1, le=2**24)] = 256
    temperature: Annotated[float, NonNegative] = 0.0
    concurrency: Annotated[int, Range(ge=1, le=16384)] = 16
    # timed runs of each prompt set on each server (with and without the draft): tokens/s is their median, with
    # their spread (one run of a few seconds varies by tens of percent on a shared machine)
    throughput_repeats: Annotated[int, Range(ge=1, le=100)] = 3
    # a second prompt set of another kind than the training data (never a data.source): 05 measures it too, as
    # the prompt set named "other"
    other_prompts: Optional[str] = None
    # more prompt sets 05 measures, {name: source}: a local .json/.jsonl/.parquet file or directory, a datasets hub
    # name (split "test"), or {source, subset, split}; rows in the benchmark shapes (common/evaluate/prompt_sets.py);
    # or a set 05 builds from the eval split: {built: long_context, buckets?, prompts_per_bucket?},
    # {built: system_prompts} or {built: chat_template, template?} (common/evaluate/built_sets.py)
    prompt_sets: dict = field(default_factory=dict)
    # also replay vLLM's rounds over the exact outputs vLLM served (loads the target in transformers: for small targets)
    replay_served: bool = False

    def __post_init__(self):
        self.prompt_set_specs()  # checked when the config is loaded, not when 05 reaches the set

    def sends_chat_templates(self) -> bool:
        """Whether a prompt set's requests carry their own chat template (a built chat_template set): vLLM takes one
        only from a server started with --trust-request-chat-template."""
        return any(spec.get("built") == "chat_template" for spec in self.prompt_set_specs().values())

    def prompt_set_specs(self) -> dict[str, dict]:
        """prompt_sets as {name: {"source", "subset", "split"}} (a built set: {"built", ...}), in name order (the order of a config's keys is not
        kept: config_from_dict copies the tree through yaml.safe_dump). A name becomes a file name (eval/outputs-NAME.jsonl)."""
        from common.core.run_folder import HELD_OUT, OTHER

        specs = {}
        for name, spec in self.prompt_sets.items():
            key = f"evaluate.prompt_sets.{name}"
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
                raise ConfigError(f"config key '{key}': a prompt set's name must be letters, digits, '_', '.' or '-' "
                                  f"(at most 64, it names files under eval/), got {name!r}")
            taken = {HELD_OUT: "the eval split of data.source", OTHER: self.other_prompts and "evaluate.other_prompts"}.get(name)
            if taken:
                raise ConfigError(f"config key '{key}': the name '{name}' is taken ({taken}); name the set otherwise")
            spec = {"source": spec} if isinstance(spec, str) else spec
            if isinstance(spec, dict) and "built" in spec:  # made by 05 from the run's eval split
                specs[name] = built_prompt_set_spec(key, spec)
                continue
            valid = (isinstance(spec, dict) and set(spec) <= {"source", "subset", "split"} and isinstance(spec.get("source"), str)
                     and bool(spec["source"].strip()) and all(isinstance(spec.get(k), (str, type(None))) for k in ("subset", "split")))
            if not valid:
                raise ConfigError(f"config key '{key}' must be a file, a directory or a datasets hub name, or "
                                  f"{{source: ..., subset: ..., split: ...}}, got {spec!r}")
            specs[name] = {"source": spec["source"], "subset": spec.get("subset"), "split": spec.get("split") or "test"}
        return dict(sorted(specs.items()))


BUILT_PROMPT_SETS = ("long_context", "system_prompts", "chat_template")  # common/evaluate/built_sets.py makes them
BUILT_SET_KEYS = {"long_context": {"built", "buckets", "prompts_per_bucket"}, "system_prompts": {"built"},
                  "chat_template": {"built", "template"}}
DEFAULT_PROMPTS_PER_BUCKET = 4


def built_prompt_set_spec(key: str, spec: dict) -> dict:
    """A built set as configured -> {"built", ...}: long_context {"buckets", "prompts_per_bucket"} (buckets None: up
    to the target's context), chat_template {"template"} (None: built_sets.CHANGED_TEMPLATE); else one ConfigError."""
    kind = spec.get("built")
    if kind not in BUILT_PROMPT_SETS:
        raise ConfigError(f"config key '{key}.built' must be one of {', '.join(BUILT_PROMPT_SETS)}, got {kind!r}")
    allowed = BUILT_SET_KEYS[kind]
    if set(spec) - allowed:
        raise ConfigError(f"config key '{key}': a built {kind} set takes {', '.join(sorted(allowed))}, "
                          f"got {', '.join(sorted(set(spec) - allowed))}")
    if kind == "chat_template":
        return {"built": kind, "template": checked_template(f"{key}.template", spec.get("template"))}
    if kind != "long_context":
        return {"built": kind}
    buckets, per_bucket = spec.get("buckets"), spec.get("prompts_per_bucket", DEFAULT_PROMPTS_PER_BUCKET)
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if buckets is not None and not (isinstance(buckets, list) and buckets and all(is_int(b) and b >= 16 for b in buckets)
                                    and buckets == sorted(set(buckets))):
        raise ConfigError(f"config key '{key}.buckets' must be increasing prompt lengths in tokens (each at least 16), "
                          f"or left out (up to the target's context), got {buckets!r}")
    if not (is_int(per_bucket) and 1 <= per_bucket <= 10_000):
        raise ConfigError(f"config key '{key}.prompts_per_bucket' must be an integer from 1 to 10000, got {per_bucket!r}")
    return {"built": kind, "buckets": buckets, "prompts_per_bucket": per_bucket}


def checked_template(key: str, template) -> Optional[str]:
    """A chat template given in the config: None, or Jinja text that parses (checked at load, not when 05 sends it)."""
    if template is None:
        return None
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"config key '{key}' must be a chat template (Jinja text), or left out for the built-in one, "
                          f"got {template!r}")
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"config key '{key}' is not a valid Jinja template (line {e.lineno}: {e.message}); "
                          f"fix it, or leave it out for the built-in one") from None
    return template


@dataclass
class ServerConfig:
    """How the pipeline starts vLLM itself (demo, evaluation, tests)."""

    port: Annotated[int, Range(ge=0, le=65535)] = 0  # 0 = pick a free loopback port
    tensor_parallel_size: Annotated[int, TensorParallel] = 1
    max_model_len: Annotated[int, ModelLen] = 4096
    gpu_memory_utilization: Annotated[float, MemoryUtilization] = 0.9
    enforce_eager: bool = False
    startup_timeout_s: Annotated[float, Range(gt=0, le=604800)] = 900.0
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
_PATH_KEYS = {("run_dir",), ("target", "model"), ("target", "tokenizer"), ("data", "source"), ("evaluate", "other_prompts"),
              ("train", "init_from")}


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_value(value: Any, tp: Any, key: str) -> Any:
    """Check (and lightly coerce) `value` against the annotation `tp` (ranges and choices included)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        value = _check_value(value, base, key)
        for extra in extras:
            if isinstance(extra, Range):
                extra.check(value, key)
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(str, choices))}, got {value!r}{hint}")
        return value
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
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        if not math.isfinite(number):  # .inf / .nan pass every range check and break a stage hours later
            raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    raise ConfigError(f"config key '{key}': unsupported type {_type_name(tp)}")


# Names people bring from other trainers, and the key they mean here.
KEY_ALIASES = {"learning_rate": "lr", "num_epochs": "epochs", "steps": "max_steps", "gradient_accumulation_steps": "grad_accum",
               "max_grad_norm": "grad_clip", "warmup": "warmup_ratio", "num_draft_tokens": "num_speculative_tokens"}


def closest_key(name: str, valid: list[str]) -> Optional[str]:
    """The valid key of this section a mistyped `name` most likely means: a known alias, else the
    closest spelling (difflib), else one that shares a word with it; None if nothing is close."""
    alias = KEY_ALIASES.get(name.lower())
    if alias in valid:
        return alias
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.75)
    if close:
        return close[0]
    words = set(name.lower().split("_"))
    sharing = [v for v in valid if words & set(v.split("_"))]
    if len(sharing) == 1:
        return sharing[0]
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return close[0] if close else None


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        where = f"section '{prefix.rstrip('.')}'" if prefix else "the config file"
        raise ConfigError(f"{where} must be a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            close = closest_key(str(key), list(fields))
            valid = [f"{prefix}{name}" for name in fields]
            hint = f"; did you mean '{prefix}{close}'?" if close else f"; valid keys here: {', '.join(valid)}"
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
    """`a.b=value` -> ("a.b", parsed value). The value is read as YAML (`null`, `[1,2]`, `0.5`) by the file's
    reader (common.core.yaml_safe.yaml_value), and exponent numbers without a dot (`1e-4`) are floats."""
    if "=" not in text:
        raise ConfigError(f"--set expects KEY=VALUE (for example train.lr=1e-4), got '{text}'")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects KEY=VALUE, got '{text}' with an empty key")
    return key, yaml_value(raw, f"--set {key}")


def _resolve_path(node: dict, key: str, base: Path, always: bool = False) -> None:
    """node[key] made absolute against base: always (run_dir), else only when it exists there or starts with "."
    (else it may be a hub id)."""
    value = node.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # `run_dir: 5` is the folder "5" next to the YAML, like any relative path
    if not isinstance(value, str) or not value or os.path.isabs(value):
        return
    value = os.path.expanduser(value)
    candidate = (base / value).resolve()
    if always or candidate.exists() or value.startswith("."):
        node[key] = str(candidate)


def _resolve_paths(tree: dict, base: Path) -> None:
    for path_key in _PATH_KEYS:
        node = tree
        for part in path_key[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            _resolve_path(node, path_key[-1], base, always=path_key == ("run_dir",))
    # evaluate.prompt_sets: {name: a file, a directory or a hub name, or {source: ..., subset, split}}
    sets = tree.get("evaluate", {}).get("prompt_sets") if isinstance(tree.get("evaluate"), dict) else None
    if isinstance(sets, dict):
        for name, spec in sets.items():
            if isinstance(spec, dict):
                _resolve_path(spec, "source", base)
            else:
                _resolve_path(sets, name, base)


def config_from_dict(tree: dict, overrides: list[str] = (), base_dir: Path | None = None,
                     resolve_dtypes: bool = True) -> Config:
    """The checked Config of a YAML tree. With resolve_dtypes, `auto` dtypes become this machine's choice."""
    tree = dict(tree or {})
    tree = yaml.safe_load(yaml.safe_dump(tree))  # deep copy with plain types
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    if base_dir is not None:
        _resolve_paths(tree, base_dir)
    cfg = _build(Config, tree, "")
    validate(cfg)
    if resolve_dtypes:
        dtype_choice.resolve_dtypes(cfg)
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}; pass --config configs/<run>.yaml")
    tree = read_yaml_file(path)
    if tree is not None and not isinstance(tree, dict):
        raise ConfigError(f"config file {path} must contain a mapping of sections, got {type(tree).__name__}")
    # Overrides are resolved relative to the cwd, file values relative to the file.
    cfg = config_from_dict(tree or {}, [], base_dir=path.resolve().parent, resolve_dtypes=False)
    if overrides:
        cfg = config_from_dict(cfg.to_dict(), overrides, base_dir=Path.cwd(), resolve_dtypes=False)
    # the dtype auto chose here and why (or the warning for an emulated bf16), said where the target runs
    dtype_choice.remember(dtype_choice.resolve_dtypes(cfg))
    return cfg


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _check_url(url: str, key: str) -> None:
    """An http(s) URL with a host and, if given, a port in 1..65535 (the client's traceback otherwise)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when out of range or not a number
    except ValueError as e:
        raise ConfigError(f"config key '{key}' is not a valid URL ({e}): {url!r}; for example http://127.0.0.1:8000/v1") from None
    _require(parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0,
             f"config key '{key}' must be an http(s) URL with a host (and a port in 1..65535), got {url!r}; for example "
             f"http://127.0.0.1:8000/v1")


# fc_norm with norm_before_fc: vLLM would apply both, one after the other; the peers refuse it (speculators#670). Here
# for the run config, and for a draft's config.json in common/model/draft/config.py.
FC_NORMS_EXCLUSIVE = ("draft.fc_norm and draft.norm_before_fc are both true, and they are exclusive (fc_norm normalises "
                      "each aux hidden state before fc, norm_before_fc their concatenation); set one of them to false")


def validate(cfg: Config) -> None:
    """Value checks that types alone cannot express."""
    _require(bool(cfg.run_dir), "run_dir must be set (the directory every stage writes under)")
    existing = Path(cfg.run_dir)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # the nearest part of the path that exists must be a directory
    _require(existing.is_dir(), f"run_dir {cfg.run_dir}: {existing} is a file, not a directory; point run_dir at a "
                                f"directory (it is created when missing)")
    ids = cfg.target.aux_layer_ids
    if ids is not None:
        _require(len(ids) >= 1, "target.aux_layer_ids must list at least one layer id, or be null for the default")
        _require(
            len(set(ids)) == len(ids),
            f"target.aux_layer_ids has duplicated ids {ids}; vLLM collapses duplicates, so give distinct ids",
        )
        _require(all(i >= 0 for i in ids), f"target.aux_layer_ids must be >= 0, got {ids}")
    # Single values are checked by their types (Literal choices, Range bounds) in _check_value.
    g = cfg.generate
    _check_url(g.base_url, "generate.base_url")
    _require(g.backoff_max_s >= g.backoff_initial_s,
             f"generate.backoff_max_s ({g.backoff_max_s:g}) must be >= generate.backoff_initial_s ({g.backoff_initial_s:g})")
    _require(not cfg.extract.stream or cfg.extract.max_disk_gb is not None,
             "extract.stream is true but extract.max_disk_gb is null; streaming bounds the hidden-state folder: set "
             "extract.max_disk_gb (what hidden/ may hold), or set extract.stream: false")
    _require(cfg.data.answers == "regenerate" or cfg.tokenize.token_ids_from == "template",
             f"data.answers={cfg.data.answers} trains on the dataset's own answers, which have no server token ids, but "
             f"tokenize.token_ids_from=server; set tokenize.token_ids_from: template, or data.answers: regenerate")
    _require(not (cfg.draft.fc_norm and cfg.draft.norm_before_fc), FC_NORMS_EXCLUSIVE)
    t = cfg.train
    _require(len(t.betas) == 2, f"train.betas must have two values, got {t.betas}")
    _require(t.min_lr <= t.lr, f"train.min_lr ({t.min_lr:g}) must be <= train.lr ({t.lr:g})")
    _require(t.anchor_weight == 0 or t.init_from is not None,
             f"train.anchor_weight={t.anchor_weight:g} pulls the weights towards train.init_from's, but train.init_from is "
             f"null; set train.init_from to the draft to start from, or train.anchor_weight: 0")
