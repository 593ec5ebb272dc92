"""Stage 01: read a chat dataset and write the prompts the pipeline will answer.

Reads data.source (a .jsonl/.json/.parquet file, a directory of them, or a `datasets` hub
name; ShareGPT or OpenAI shaped rows), keeps the system prompt and the first
data.max_user_turns user turns of each conversation, drops unusable rows with a counted
reason, and writes, under run_dir:

  data/prompts.jsonl         {"id", "messages", "split": "train"|"eval"} per prompt
  data/prepare_report.json   counts read/kept/train/eval, drops by reason, skipped examples

Example:
  python 01_prepare_data.py --config configs/tiny.yaml --set data.max_samples=100
"""

from common.core.cli import stage_main


def run(cfg, args) -> int:
    from common.data.prepare import output_paths, prepare_prompts, summary_line
    from common.evaluate.prompt_sets import check_sets_before_training

    # 05's prompt sets must read and stay apart from the training split: said now, not after 01b's generation
    report = prepare_prompts(cfg, overwrite=args.overwrite, check_rows=lambda rows: check_sets_before_training(cfg, rows))
    prompts_path, _ = output_paths(cfg)
    if report["status"] == "already_complete":
        c = report["counts"]
        print(f"01_prepare_data: already complete ({c['kept']} prompts: {c['train']} train / {c['eval']} eval in {prompts_path}); "
              f"pass --overwrite to rebuild")
        return 0
    print(summary_line(report, prompts_path))
    return 0


if __name__ == "__main__":
    stage_main("01_prepare_data", __doc__, run)
