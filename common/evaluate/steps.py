"""Why a draft speeds serving up or slows it down: vLLM's own timing of 05's timed runs (issue 34).

vLLM 0.32 times decode iterations per request (vllm:inter_token_latency_seconds: one observation per running
request per engine iteration that gives it tokens, however many) and counts the tokens (vllm:generation_tokens)
and finished requests (vllm:request_decode_time_seconds_count); nothing in it times the drafter apart from the
target's verification. Their deltas over every timed run (common.serving.vllm_server.step_metrics), pooled over
the runs ("counters": iterations, iteration_s_sum, generation_tokens, requests, decode_s_sum, and the client's
client_latency_s_sum), give a set's "step_times":

measured
  target_step_s         target alone: seconds per decode step (one token per request and step)
  iteration_s           with the draft: seconds per engine iteration, as one: the drafter's k passes, one target
                        forward verifying k+1 tokens per request, and the rejection sampling
  tokens_per_iteration  with the draft: decode tokens / iterations (target_tokens_per_step: the same without,
                        1.0 by construction: a check of the counting)
  decode_share          per server: the requests' decode time in vLLM / their latency at the client, both added up
                        over the requests: how much of the measured tokens/s the step times can explain
derived
  cost_ratio            iteration_s / target_step_s
  speedup_from_steps    acceptance_length / cost_ratio: the decode speedup the step times imply. The measured
                        tokens/s ratio (measured_speedup) also pays prefills, HTTP and each window's tail: the two
                        agree where decode_share is near 1 on both servers (long answers), not where it is small
  beyond_target_step_s  iteration_s - target_step_s: the drafter and what verifying k+1 tokens costs beyond one,
                        together. Verification reads the same weights and KV cache as a target step over the same
                        requests and computes more tokens, so it costs at least a step: this bounds the drafter's
                        time from above; it is not a measurement of it.
"""

from __future__ import annotations

from typing import Optional


def pooled(runs: Optional[list[Optional[dict]]]) -> Optional[dict]:
    """The step counters of every timed run together; None where a run has none."""
    if not runs or None in runs:
        return None
    return {key: sum(r[key] for r in runs) for key in runs[0]}


def seconds_per_iteration(counters: dict) -> Optional[float]:
    return counters["iteration_s_sum"] / counters["iterations"] if counters["iterations"] > 0 else None


def tokens_per_iteration(counters: dict) -> Optional[float]:
    """Decode tokens per iteration: each request's first token comes from its prefill, not from an iteration."""
    return (counters["generation_tokens"] - counters["requests"]) / counters["iterations"] if counters["iterations"] > 0 else None


def decode_share(counters: dict) -> Optional[float]:
    """The requests' decode time in vLLM over their latency at the client (None for counters without the latter)."""
    client = counters.get("client_latency_s_sum")
    return round(counters["decode_s_sum"] / client, 4) if client else None


def _not_read(runs: Optional[list], side: str) -> str:
    from common.serving.vllm_server import ITL

    if runs is None:
        return f"the {side} server's /metrics was not read"
    return f"the {side} server's /metrics has no {ITL} for every timed run"


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def step_times(with_draft_runs: Optional[list], without_draft_runs: Optional[list], acceptance_length: float,
               measured_speedup: Optional[float]) -> dict:
    """A set's "step_times" (module docstring) from both servers' step counters per timed run; {"measured": False,
    "reason"} where a server gave none."""
    with_draft, alone = pooled(with_draft_runs), pooled(without_draft_runs)
    if alone is None or with_draft is None:
        return {"measured": False, "reason": _not_read(without_draft_runs, "target-alone") if alone is None
                else _not_read(with_draft_runs, "draft's")}
    step_s, iteration_s = seconds_per_iteration(alone), seconds_per_iteration(with_draft)
    if not step_s or not iteration_s:
        return {"measured": False, "reason": "no decode iteration in the timed runs (every answer a single token)"}
    cost = iteration_s / step_s
    return {
        "measured": True,
        "target_step_s": round(step_s, 6),
        "target_step_s_runs": [_round(seconds_per_iteration(r), 6) for r in without_draft_runs],
        "target_tokens_per_step": round(tokens_per_iteration(alone), 4),
        "iteration_s": round(iteration_s, 6),
        "iteration_s_runs": [_round(seconds_per_iteration(r), 6) for r in with_draft_runs],
        "tokens_per_iteration": round(tokens_per_iteration(with_draft), 4),
        "acceptance_length": acceptance_length,
        "decode_iterations": {"with_draft": int(with_draft["iterations"]), "without_draft": int(alone["iterations"])},
        "decode_share": {"with_draft": decode_share(with_draft), "without_draft": decode_share(alone)},
        "cost_ratio": round(cost, 4),
        "speedup_from_steps": round(acceptance_length / cost, 4),
        "measured_speedup": measured_speedup,
        "beyond_target_step_s": round(iteration_s - step_s, 6),
        "beyond_target_step_share": round((iteration_s - step_s) / iteration_s, 4),
        "counters": {"with_draft": with_draft, "without_draft": alone},  # what the numbers above come from
    }


def slowdown_line(part: dict) -> Optional[str]:
    """Why the draft slows serving, for a set (its report part) whose median tokens/s ratio is below 1.0 and whose
    step times were measured; None otherwise."""
    speedup = (part.get("throughput") or {}).get("speedup")
    st = part["step_times"]
    if speedup is None or speedup >= 1.0 or not st.get("measured"):
        return None
    al, cost = st["acceptance_length"], st["cost_ratio"]
    line = (f"the draft slows serving ({speedup:.2f}x tokens/s): each iteration ({part['num_speculative_tokens']} draft "
            f"steps + verification) costs {cost:.2f}x a target step ({1000 * st['iteration_s']:.1f} vs "
            f"{1000 * st['target_step_s']:.1f} ms) and yields {al:.2f} tokens: {al:.2f} / {cost:.2f} = "
            f"{st['speedup_from_steps']:.2f}x in decode")
    share = st.get("decode_share") or {}
    if None not in (share.get("with_draft"), share.get("without_draft")):  # where decode is little of the time, it says so
        line += f", which is {100 * share['with_draft']:.0f}% of the requests' time with the draft, {100 * share['without_draft']:.0f}% without"
    return line
