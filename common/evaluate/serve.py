"""05's side of vLLM: the target's server, the timed requests, and the acceptance the counters give.

- `target_server`: the target with the cfg.server settings, with or without the draft
  (`speculative_config`: method eagle3, evaluate.num_speculative_tokens draft tokens).
- `warm_up`, `send_set`: one untimed request, then a prompt set sent with evaluate's sampling
  (evaluate.concurrency in flight; a set whose rows have categories, category by category) and timed,
  evaluate.throughput_repeats times: a `PromptRun` (the first run's outputs; tokens/s the median of the runs;
  each run's step counters, read from /metrics around it: common.evaluate.steps explains the speedup with them).
  The requests are common.serving.chat's, 01b's client and request body: generate.extra_body and
  generate.enable_thinking reach them too.
- `measure_with_draft`: target + draft, each prompt set between its own /metrics scrapes, a pair per category
  (the set's numbers: the sum of its windows' deltas), then its turn 2 (the prompts the target-alone run built,
  `Baseline.turn_2`) in windows of its own; `acceptance_metrics` turns a counter delta into the report's numbers
  (the counter-delta method of `vllm bench serve` and speculators' evaluate.py).

The tests swap `target_server` and `_chat` for fakes: this module calls both by their names here.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from common.core.config import Config
from common.core.errors import PipelineError
from common.core.run_folder import HELD_OUT, Layout
from common.evaluate.prompt_sets import PromptSet
from common.serving.chat import chat_request, make_client, parse_completion, served_model


@dataclass
class PromptRun:
    """One prompt set sent to one server, timed, evaluate.throughput_repeats times. outputs (of the first run):
    {prompt id: {"reasoning", "content", "finish_reason", "usage", "latency_s"}} (+ vLLM's token ids with
    evaluate.replay_served), in prompt order; wall_s and output_tokens: the first run's; tokens_per_s: the median
    of tokens_per_s_runs, one per run. step_counters_runs: per run, vLLM's decode-step counters over it
    (common.serving.vllm_server.step_metrics; None for a run whose server exposed none), or None where nothing was read
    (a run not timed)."""

    model: str
    outputs: dict[str, dict]
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    tokens_per_s_runs: list[float]
    step_counters_runs: Optional[list[Optional[dict]]] = None

    @classmethod
    def from_json(cls, doc: dict) -> PromptRun:
        """The run in a cached baseline file (its other entries, "key" and "created", left out). A file without one of
        its fields raises KeyError (stage.cached_baseline: measured again)."""
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls)})

    def throughput(self) -> dict:
        """The report's throughput entry of this run."""
        runs = self.tokens_per_s_runs
        return {"output_tokens": self.output_tokens, "wall_s": self.wall_s, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_runs": runs, "tokens_per_s_range": [min(runs), max(runs)]}


@dataclass
class DraftRun:
    """One prompt set (or its turn 2) on the target + draft: the timed run, acceptance_metrics' numbers for its
    windows (the sum of their counter deltas), each category's numbers from its own window, and the set's turn 2."""

    run: PromptRun
    acceptance: dict
    categories: dict[str, dict] = field(default_factory=dict)
    turn_2: Optional[DraftRun] = None


@dataclass
class SecondTurn:
    """A set's turn 2 on the target alone: the prompts built from its own turn-1 answers (what both servers send), the
    ones left out ({reason: count}: too long for the server with the answer), and their run (None when none is left)."""

    prompts: list[dict]
    left_out: dict
    run: Optional[PromptRun]


@dataclass
class Baseline:
    """A prompt set on the target alone: turn 1, timed evaluate.throughput_repeats times, and, for a set with later
    turns, turn 2."""

    run: PromptRun
    turn_2: Optional[SecondTurn] = None

    def to_json(self) -> dict:
        """Its entries in the cache file: turn 1's at the top level, and, for a set with later turns, "turn_2"."""
        t = self.turn_2
        return {**asdict(self.run),
                **({"turn_2": {"prompts": t.prompts, "left_out": t.left_out, "run": t.run and asdict(t.run)}} if t else {})}

    @classmethod
    def from_json(cls, doc: dict) -> Baseline:
        t = doc.get("turn_2")
        return cls(PromptRun.from_json(doc), t and SecondTurn(t["prompts"], t["left_out"], t["run"] and PromptRun.from_json(t["run"])))


def sampling_params(cfg: Config) -> dict:
    """The sampling every request of 05 uses (a key of the report and of the baseline)."""
    e = cfg.evaluate
    return {"temperature": e.temperature, "max_tokens": e.max_tokens, "concurrency": e.concurrency,
            "enable_thinking": cfg.generate.enable_thinking}


# ----------------------------------------------------------------------------- acceptance from counters


def acceptance_metrics(delta: dict, num_speculative_tokens: int) -> dict:
    """The report's acceptance numbers from a counter delta (common.serving.vllm_server.metrics_delta).

    acceptance length = 1 + accepted / drafts; per-position rate[i] = accepted_per_pos[i] / drafts
    for i < k (positions vLLM never reported count as 0); draft acceptance rate = accepted / draft tokens.
    """
    drafts = delta["num_drafts"]
    if drafts <= 0:
        raise PipelineError(
            "vLLM recorded no speculative drafts during the evaluation (spec_decode_num_drafts did not move); "
            "check that the server runs with the draft (speculative_config) and that the prompts produced output"
        )
    if min(drafts, delta["num_draft_tokens"], delta["num_accepted_tokens"], *delta["num_accepted_tokens_per_pos"].values()) < 0:
        raise PipelineError("vLLM's spec-decode counters went down between two scrapes (did the server restart?); rerun 05_evaluate.py")
    per_pos = _per_position(delta, num_speculative_tokens)
    return {
        "acceptance_length": 1.0 + delta["num_accepted_tokens"] / drafts,
        "per_position_acceptance": [v / drafts for v in per_pos],
        "draft_acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"] if delta["num_draft_tokens"] else 0.0,
        "num_speculative_tokens": num_speculative_tokens,
        "counters": _counters(delta, num_speculative_tokens),
    }


def _per_position(delta: dict, num_speculative_tokens: int) -> list[float]:
    return [float(delta["num_accepted_tokens_per_pos"].get(i, 0.0)) for i in range(num_speculative_tokens)]


def _counters(delta: dict, num_speculative_tokens: int) -> dict:
    return {"num_drafts": int(round(delta["num_drafts"])), "num_draft_tokens": int(round(delta["num_draft_tokens"])),
            "num_accepted_tokens": int(round(delta["num_accepted_tokens"])),
            "num_accepted_tokens_per_pos": [int(round(v)) for v in _per_position(delta, num_speculative_tokens)]}


def category_acceptance(delta: dict, num_speculative_tokens: int) -> dict:
    """A category's numbers from its own window. A window without drafts (every answer a token or two) has no
    acceptance length, and is no error: its set's windows together may still have drafts."""
    if delta["num_drafts"] == 0:
        return {"acceptance_length": None, "per_position_acceptance": None, "counters": _counters(delta, num_speculative_tokens)}
    acceptance = acceptance_metrics(delta, num_speculative_tokens)
    return {key: acceptance[key] for key in ("acceptance_length", "per_position_acceptance", "counters")}


def summed(deltas: list[dict]) -> dict:
    """The counter delta of several windows together."""
    per_pos: Counter = Counter()
    for d in deltas:
        per_pos.update(d["num_accepted_tokens_per_pos"])
    return {**{key: sum(d[key] for d in deltas) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "num_accepted_tokens_per_pos": dict(per_pos)}


# ----------------------------------------------------------------------------- servers


def speculative_config(cfg: Config, draft_dir: Path) -> dict:
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": cfg.evaluate.num_speculative_tokens}


def target_server(cfg: Config, speculative: Optional[dict] = None, log_path: Optional[Path] = None):
    """A VllmServer for cfg.target.model with the cfg.server settings (tensor parallel etc.).

    The target runs in target.dtype (float32 for the tiny default), the dtype 02 extracts the
    training features in, unless server.extra_args already sets --dtype; on CPU a float32 MLA
    target gets the attention backend that runs it (cpu_attention_backend). A config with a built
    chat_template set gets --trust-request-chat-template: those requests carry their own template.
    """
    from common.core import dtype_choice
    from common.serving.vllm_server import VllmServer, cpu_attention_backend

    dtype_choice.announce()  # target.dtype: what auto chose here, and why (01b's server in run_pipeline, 05's)
    extra = list(cfg.server.extra_args)
    given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in extra)  # noqa: E731
    if not given("--dtype"):
        extra += ["--dtype", cfg.target.dtype]
    backend = cpu_attention_backend(cfg.target.model, cfg.target.dtype)
    if backend and not given("--attention-backend"):
        extra += ["--attention-backend", backend]
    if cfg.evaluate.sends_chat_templates() and not given("--trust-request-chat-template"):
        extra += ["--trust-request-chat-template"]  # a built chat_template set's requests carry their template
    return VllmServer.from_config(cfg, speculative_config=speculative, log_path=log_path, extra_args=extra)


# ----------------------------------------------------------------------------- requests


def eval_client(cfg: Config, base_url: str):
    """A blocking client of common.serving.chat for evaluate.concurrency threads, with openai-python's
    2 retries (a timed measurement has no retry accounting of its own)."""
    return make_client(cfg.generate, base_url, connections=cfg.evaluate.concurrency, blocking=True, max_retries=2)


def _chat(cfg: Config, client, model: str, prompt: dict, max_tokens: int) -> dict:
    """One request of common.serving.chat's for a prompt ({"messages", "chat_template"?}): evaluate.temperature,
    generate.extra_body and enable_thinking, and (evaluate.replay_served) the exact token ids the replay on the
    served outputs needs."""
    t0 = time.monotonic()
    resp = client.chat.completions.create(**chat_request(
        cfg.generate, model, prompt["messages"], max_tokens=max_tokens, temperature=cfg.evaluate.temperature,
        return_token_ids=cfg.evaluate.replay_served, chat_template=prompt.get("chat_template")))
    out = parse_completion(resp)
    out["latency_s"] = round(time.monotonic() - t0, 3)
    return out


def template_hint(prompt: dict) -> str:
    """What to do when a server refuses a request that carries its own chat template (vLLM answers 400 unless started
    with --trust-request-chat-template; the servers the pipeline starts have it, one of your own may not)."""
    return ("; this prompt set sends its own chat template (a built chat_template set): start your vLLM server with "
            "--trust-request-chat-template, or leave --base-url out so 05 starts one" if prompt.get("chat_template") else "")


def warm_up(cfg: Config, base_url: str, prompts: list[dict]) -> None:
    """One short request, so that the timed run does not pay for first-request setup.

    Call it before the first /metrics scrape: its drafts must not count.
    """
    import openai

    client = eval_client(cfg, base_url)
    try:
        _chat(cfg, client, cfg.generate.model or served_model(client), prompts[0], 8)
    except openai.BadRequestError as e:
        raise PipelineError(f"the vLLM server at {base_url} refused the warm-up request ({' '.join(str(e).split())[:200]})"
                            f"{template_hint(prompts[0])}") from None
    except openai.OpenAIError as e:  # the engine died on its first request (out of memory, a bad draft, ...)
        raise PipelineError(f"the vLLM server at {base_url} failed its warm-up request ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:200]}); it may have died: see its log under run_dir/logs/") from None


def repeat_timing(cfg: Config, base_url: str, prompts: list[dict], run: PromptRun, desc: str,
                  scrape: Optional[Callable[[], Optional[dict]]] = None) -> PromptRun:
    """`run` after evaluate.throughput_repeats - 1 more timed runs of the same prompts: its tokens/s is then the
    median of all (its outputs stay the first run's), and, with scrape, each run's step counters are kept."""
    n = cfg.evaluate.throughput_repeats
    more = [send_set(cfg, base_url, prompts, f"{desc}, timed run {i + 1}/{n}", scrape)[0]
            for i in range(len(run.tokens_per_s_runs), n)]
    rates = run.tokens_per_s_runs + [r.tokens_per_s for r in more]
    steps = None if run.step_counters_runs is None else run.step_counters_runs + [c for r in more for c in r.step_counters_runs or [None]]
    return dataclasses.replace(run, tokens_per_s=round(statistics.median(rates), 2), tokens_per_s_runs=rates,
                               step_counters_runs=steps)


def run_prompts(cfg: Config, base_url: str, prompts: list[dict], desc: str = "eval") -> PromptRun:
    """Send every prompt (cfg.evaluate sampling, evaluate.concurrency in flight), timed: one run."""
    import openai
    from tqdm import tqdm

    client = eval_client(cfg, base_url)
    model = cfg.generate.model or served_model(client)
    outputs: dict[str, dict] = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=cfg.evaluate.concurrency) as pool:
        futures = {pool.submit(_chat, cfg, client, model, p, cfg.evaluate.max_tokens): p for p in prompts}
        for fut in tqdm(as_completed(futures), total=len(futures), desc=desc, mininterval=1.0):
            prompt = futures[fut]
            try:
                outputs[prompt["id"]] = fut.result()
            except openai.OpenAIError as e:
                why = template_hint(prompt) if isinstance(e, openai.BadRequestError) else ""
                raise PipelineError(
                    f"request for prompt {prompt['id']} to {base_url} failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                    f"{why or '; see the vLLM server log under run_dir/logs/'}"
                ) from None
    wall = time.monotonic() - t0
    tokens = sum(int(o["usage"].get("completion_tokens", 0)) for o in outputs.values())
    rate = round(tokens / wall, 2) if wall > 0 else 0.0
    return PromptRun(model=model, outputs={p["id"]: outputs[p["id"]] for p in prompts}, wall_s=round(wall, 3),
                     output_tokens=tokens, tokens_per_s=rate, tokens_per_s_runs=[rate])


def categories_of(prompts: list[dict]) -> dict[Optional[str], list[dict]]:
    """A set's prompts by category, the categories in the order they first come (rows without one: None)."""
    groups: dict[Optional[str], list[dict]] = {}
    for p in prompts:
        groups.setdefault(p.get("category"), []).append(p)
    return groups


def send_set(cfg: Config, base_url: str, prompts: list[dict], desc: str,
             scrape: Optional[Callable[[], Optional[dict]]] = None) -> tuple[PromptRun, dict[Optional[str], dict]]:
    """One timed run of a set, sent category by category (evaluate.concurrency in flight within a category; a set
    without categories at once): every run of a set, on either server, has this shape, so their tokens/s compare.
    With scrape (a read of the server's /metrics: parsed samples, or None where it could not be read), also each
    category's spec-decode counter delta (acceptance per category needs a window of its own) and the run's step
    counters (its windows' together). The scrapes sit outside the timed part of each window."""
    from common.serving.vllm_server import metrics_delta, spec_decode_metrics

    runs, deltas, steps = [], {}, []
    for category, group in categories_of(prompts).items():
        before = scrape() if scrape else None
        runs.append(run_prompts(cfg, base_url, group, desc if category is None else f"{desc}, {category}"))
        if scrape:
            after = scrape()
            if before is not None and after is not None:
                deltas[category] = metrics_delta(spec_decode_metrics(after), spec_decode_metrics(before))
            steps.append(window_steps(after, before, runs[-1]))
    run = joined(runs, prompts)
    if scrape:
        run.step_counters_runs = [summed_steps(steps)]
    return run, deltas


def window_steps(after: Optional[dict], before: Optional[dict], run: PromptRun) -> Optional[dict]:
    """A window's step counters (vLLM's, between two scrapes: common.serving.vllm_server.step_metrics), + the time its
    requests took as the client saw them, added up (what vLLM's decode time is a share of); None without them."""
    from common.serving.vllm_server import step_metrics, step_metrics_delta

    delta = None if after is None or before is None else step_metrics_delta(step_metrics(after), step_metrics(before))
    return delta and {**delta, "client_latency_s_sum": round(sum(o["latency_s"] for o in run.outputs.values()), 3)}


def summed_steps(windows: list[Optional[dict]]) -> Optional[dict]:
    """The step counters of a run's windows together; None when a window has none."""
    if not windows or None in windows:
        return None
    return {key: sum(w[key] for w in windows) for key in windows[0]}


def scrape_or_none(base_url: str) -> Optional[dict]:
    """/metrics of the target-alone server, or None: its tokens/s do not need it, and a server 05 did not start (the
    generation server, behind a proxy) may not serve it; the report then says the step times were not read."""
    from common.serving.vllm_server import scrape_metrics

    try:
        return scrape_metrics(base_url)
    except PipelineError:
        return None


def joined(runs: list[PromptRun], prompts: list[dict]) -> PromptRun:
    """The runs of a set's windows as one run of the set: its outputs in prompt order, tokens/s over the windows' time."""
    if len(runs) == 1:
        return runs[0]
    outputs = {pid: o for r in runs for pid, o in r.outputs.items()}
    wall, tokens = round(sum(r.wall_s for r in runs), 3), sum(r.output_tokens for r in runs)
    rate = round(tokens / wall, 2) if wall > 0 else 0.0
    return PromptRun(model=runs[0].model, outputs={p["id"]: outputs[p["id"]] for p in prompts}, wall_s=wall,
                     output_tokens=tokens, tokens_per_s=rate, tokens_per_s_runs=[rate])


def measure_turn(cfg: Config, base_url: str, prompts: list[dict], desc: str) -> DraftRun:
    """One run of a set's turn on the target + draft: a window per category; the set's numbers from their sum, so
    that the set's counters are exactly its categories' together."""
    from common.serving.vllm_server import scrape_metrics

    k = cfg.evaluate.num_speculative_tokens
    run, deltas = send_set(cfg, base_url, prompts, desc, lambda: scrape_metrics(base_url))
    sizes = Counter(p.get("category") for p in prompts)
    return DraftRun(run, acceptance_metrics(summed(list(deltas.values())), k),
                    {c: {"num_prompts": sizes[c], **category_acceptance(d, k)} for c, d in deltas.items() if c is not None})


def measure_with_draft(cfg: Config, layout: Layout, sets: dict[str, PromptSet], draft: Path,
                       log_name: str = "vllm_eval_draft", on_ready: Callable[[], None] = lambda: None,
                       second_turns: Optional[dict[str, list[dict]]] = None) -> dict[str, DraftRun]:
    """Target + draft: each prompt set in its windows (its first run: the outputs the report compares and replays),
    then its further timed runs, then its turn 2 (second_turns: {set: the prompts of the target-alone run's turn 2},
    the same conversations the target alone got). on_ready runs once the server is up and answered its warm-up
    request (05 --overwrite deletes the previous outputs there)."""
    from common.serving.vllm_server import scrape_metrics

    k = cfg.evaluate.num_speculative_tokens
    measured = {}
    with target_server(cfg, speculative_config(cfg, draft), log_path=layout.log(log_name)) as server:
        warm_up(cfg, server.base_url, sets[HELD_OUT].prompts)
        on_ready()
        for name, prompt_set in sets.items():
            desc = f"target + draft (k={k}, {name})"
            m = measure_turn(cfg, server.base_url, prompt_set.prompts, desc)
            m.run = repeat_timing(cfg, server.base_url, prompt_set.prompts, m.run, desc, lambda: scrape_metrics(server.base_url))
            if (second_turns or {}).get(name):
                m.turn_2 = measure_turn(cfg, server.base_url, second_turns[name], f"{desc}, turn 2")
            measured[name] = m
    return measured
