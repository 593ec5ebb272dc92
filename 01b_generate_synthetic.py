"""Stage 01b: generate the target's own answers to the prompts, then tokenize them.

Reads data/prompts.jsonl (from 01_prepare_data.py), sends every prompt to a running
OpenAI-compatible server (vLLM) at generate.base_url with generate.concurrency requests in
flight, and answers multi-turn prompts turn by turn. Writes, under run_dir:
  data/raw_responses.jsonl  one line per finished id (reasoning, content, usage, turns)
  data/failed.jsonl         ids that still failed after retries, with the reason
  data/train.jsonl, data/eval.jsonl   {"id", "input_ids", "loss_mask"} via the target's chat template
  data/generate_report.json counts, rates, in-flight statistics, tokenization counts

Start a server first, e.g.:
  python -m vllm.entrypoints.openai.api_server --model TARGET_DIR --port 8000 --reasoning-parser deepseek_r1
The API key is read from the environment variable named by generate.api_key_env.
Rerunning skips finished ids and retries failed ones; Ctrl-C / SIGTERM stop cleanly (exit 130).
"""

from common.core.cli import stage_main


def run(cfg, args):
    from common.data.generate import run_stage

    return run_stage(cfg, overwrite=args.overwrite)


if __name__ == "__main__":
    stage_main("01b_generate_synthetic", __doc__, run)
