"""The command line every stage shares: --config, --set, --overwrite.

A stage script is a thin wrapper:

    from common.core.cli import stage_main
    def run(cfg, args): ...
    if __name__ == "__main__":
        stage_main("01_prepare_data", __doc__, run)

User errors (PipelineError) print one line and exit 2; Ctrl-C exits 130. Processes a stage starts
(vLLM's engine, an api_server) are stopped when the stage dies, SIGKILL included (common.core.reaper). Each stage holds
an exclusive lock on run_dir for its life (common.core.run_folder.stage_lock): a second copy on the
same run_dir exits 2 naming the holder's pid.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from typing import Callable

from common.core.errors import PipelineError, printable


def build_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the run's YAML config, e.g. configs/tiny.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.lr=1e-4 (repeatable; value parsed as YAML)",
    )
    parser.add_argument("--overwrite", action="store_true", help="discard this stage's outputs and start over")
    return parser


def _stage_lock(cfg, stage: str):
    """One copy of a stage per run_dir. Under torchrun only global rank 0 takes it: the ranks of
    one launch are one copy (a second launch fails on its rank 0, and torchrun stops the rest)."""
    import contextlib
    import os

    from common.core.run_folder import stage_lock

    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    return stage_lock(cfg.run_dir, stage)


def stage_main(
    prog: str,
    description: str | None,
    run: Callable[[object, argparse.Namespace], int | None],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    parser = build_parser(prog, description)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Heavy imports (torch, transformers) happen after --help has been served.
    from common.core.config import load_config

    from common.core.reaper import watch_children

    watch_children()  # the engine processes this stage may start die with it, even on SIGKILL
    try:
        cfg = load_config(args.config, args.overrides)
        with _stage_lock(cfg, prog):
            code = run(cfg, args)
    except PipelineError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f" while writing {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; free space (or fix the filesystem) and rerun: finished work is kept",
              file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished work is saved, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)
