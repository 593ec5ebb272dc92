"""Write the embedded sample dataset, data/sample_prompts.jsonl.

The rows come from the same deterministic generator as the tiny target's training corpus
(common/demo/tiny_target.py), so the prompts the embedded pipeline sends are in the target's
distribution. The file mixes the two shapes stage 01 reads (ShareGPT `conversations` and
OpenAI `messages`), with some multi-turn rows and some system prompts.

    python scripts/make_sample_data.py [--n 400] [--seed 0] [--out data/sample_prompts.jsonl]
    python scripts/make_sample_data.py --other      # data/other_prompts.jsonl (common/demo/other_prompts.py):
                                                    # prompts of another kind, for 05 only, never training
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.core.io import write_jsonl_atomic  # noqa: E402
from common.demo.other_prompts import other_prompt_rows  # noqa: E402
from common.demo.chat_corpus import sample_prompt_rows  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", action="store_true", help="write the other-kind evaluation prompts instead")
    parser.add_argument("--n", type=int, default=None, help="number of rows (400; --other: 48)")
    parser.add_argument("--seed", type=int, default=None, help="0 (--other: 1234)")
    parser.add_argument("--out", default=None, help="data/sample_prompts.jsonl (--other: data/other_prompts.jsonl)")
    args = parser.parse_args()
    if args.other:
        rows = other_prompt_rows(args.n or 48, 1234 if args.seed is None else args.seed)
        args.out = args.out or str(REPO / "data" / "other_prompts.jsonl")
    else:
        rows = sample_prompt_rows(args.n or 400, args.seed or 0)
        args.out = args.out or str(REPO / "data" / "sample_prompts.jsonl")
    n = write_jsonl_atomic(args.out, rows)
    size_kb = Path(args.out).stat().st_size / 1024
    print(f"wrote {n} rows ({size_kb:.0f} KB) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
