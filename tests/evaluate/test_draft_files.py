"""05 on a draft directory whose files cannot be read (a symlink loop, a directory or a dangling link where a file
should be, no permission): one error line naming the file and what to do, exit 2, before vLLM starts and before
--overwrite deletes the previous eval/ outputs."""

from __future__ import annotations

import os
import shutil

import pytest

from common.evaluate import stage as evaluate
from tests.evaluate.test_evaluate import cli_config, eval_files, run_env  # noqa: F401 (run_env: the fixture)
from tests.helpers import error_line, run_stage as run_cli

REDO_WEIGHTS = "restore the file or re-export the draft (rerun 04_train.py)"
REDO_CONFIG = "re-export the draft (rerun 04_train.py) or restore the file"


def loop(path):
    path.symlink_to(path.name)  # a link to itself: ELOOP on every open or stat


def directory(path):
    path.mkdir()


def dangling(path):
    path.symlink_to("gone.safetensors")


def unreadable(path):
    path.write_bytes(b"weights")
    path.chmod(0)


BROKEN_FILES = {  # the file replaced, how, and what the error line says
    "weights: a symlink loop": ("model.safetensors", loop, ["(Too many levels of symbolic links)", REDO_WEIGHTS]),
    "weights: a directory": ("model.safetensors", directory, ["is not a file", REDO_WEIGHTS]),
    "weights: a dangling link": ("model.safetensors", dangling, ["(No such file or directory)", REDO_WEIGHTS]),
    "weights: no permission": ("model.safetensors", unreadable, ["(Permission denied)", REDO_WEIGHTS]),
    "config.json: a symlink loop": ("config.json", loop, ["is not a readable JSON file", "Too many levels", REDO_CONFIG]),
    "config.json: a directory": ("config.json", directory, ["is not a readable JSON file", "Is a directory", REDO_CONFIG]),
}


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_05_draft_with_an_unreadable_file_is_one_error_and_deletes_nothing(run_env, tmp_path, case):
    name, damage, fragments = BROKEN_FILES[case]
    if damage is unreadable and os.geteuid() == 0:
        pytest.skip("root reads a file without permission")
    assert evaluate.run_stage(run_env.cfg) == 0  # previous outputs that --overwrite would delete
    before = eval_files(run_env.run)
    draft = tmp_path / "draft"
    shutil.copytree(run_env.final, draft)
    (draft / name).unlink()
    damage(draft / name)
    listing = sorted(os.listdir(draft))
    res = run_cli("05_evaluate.py", cli_config(run_env), "--draft", str(draft), "--overwrite", timeout=120)
    error_line(res, str(draft / name), *fragments)
    assert "vllm" not in res.stderr.lower()
    assert eval_files(run_env.run) == before and sorted(os.listdir(draft)) == listing  # nothing deleted
