"""Stage 05: measure the trained draft in vLLM: acceptance length, per-position acceptance,
tokens/s with and without the draft, and whether greedy outputs stay identical.

Serves cfg.target.model with the draft in run_dir/train/final (or --draft DIR) as an EAGLE-3
speculator (evaluate.num_speculative_tokens draft tokens), sends the first
evaluate.num_prompts eval-split prompts of data/prompts.jsonl, and reads vLLM's
spec-decode counters from /metrics before and after. Then serves the target alone with the
same prompts and sampling (or reuses eval/baseline.json when it matches).
Then every prompt set of evaluate.prompt_sets (and evaluate.other_prompts, the set "other"): files or
hub datasets in the benchmark shapes (MT-bench turns, GSM8K question, MATH problem, HumanEval prompt,
chat messages), each row's first user turn, one summary line per set.
Writes, under run_dir/eval/: report.json, report.png, outputs.jsonl, baseline.json (and per prompt set
NAME: outputs-NAME.jsonl, baseline-NAME.json).

  --baseline-only --base-url URL   measure only the target-alone run on an already running
                                   server of the target (run_pipeline.py does this on its
                                   generation server, which saves one server start)
  --compare DIR_A DIR_B            measure two drafts (e.g. this run's train/final and a published or
                                   fine-tuned one) with the same server settings on the same prompts,
                                   side by side in eval/compare/report.json and report.png; one line per
                                   prompt set with both acceptance lengths and b - a. eval/report.json is
                                   left as it is.

The offline prediction in the report is 04's for the draft measured: the prediction.json 04 wrote
into the draft directory when it exported it (train/final, train/best, or a copy of either), its
eval at the draft's step (none, and the report says why, for a directory without one: a draft 04
did not export). A draft whose aux
layer ids differ from this run's extraction is refused; --foreign-draft measures it anyway
(e.g. a published draft for the same target), without this run's prediction.
"""

from common.core.cli import stage_main


def add_arguments(parser):
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--draft", help="draft directory to evaluate (default: run_dir/train/final)")
    which.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"),
                       help="measure two drafts side by side (eval/compare/), same server settings and prompts")
    which.add_argument("--baseline-only", action="store_true", help="only measure the target alone (needs --base-url)")
    parser.add_argument("--base-url", help="a running vLLM server of the target alone (http://host:port/v1) for the baseline")
    parser.add_argument("--foreign-draft", action="store_true",
                        help="measure a draft that is not this run's (other aux layer ids), without this run's offline prediction")


def run(cfg, args):
    from common.core.run_folder import Layout
    from common.core.stage_lock import refuse_read_while_written

    if not args.baseline_only:  # the draft(s) it measures: none under train/ while 04 writes there
        layout = Layout.of(cfg)
        refuse_read_while_written(cfg.run_dir, "05_evaluate", "04_train", layout.train, args.compare or [args.draft or layout.final])
    if args.compare:
        from common.evaluate.compare import run_compare

        return run_compare(cfg, args.compare, overwrite=args.overwrite, base_url=args.base_url, foreign_draft=args.foreign_draft)
    from common.evaluate.stage import run_stage

    return run_stage(cfg, draft_dir=args.draft, overwrite=args.overwrite, baseline_only=args.baseline_only, base_url=args.base_url,
                     foreign_draft=args.foreign_draft)


if __name__ == "__main__":
    stage_main("05_evaluate", __doc__, run, add_arguments)
