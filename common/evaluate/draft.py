"""Which draft 05 measures, and what 04 predicted for it.

- `checked_draft`: the draft directory (this run's train/final, or --draft DIR), its config.json read and
  its aux layer ids checked against this run's before vLLM sees it, the fingerprint of its weights, and
  04's prediction for it: a `CheckedDraft`.
- `offline_prediction`: the draft is found among this run's exports (train/final, train/best) by its
  weights, at any path; its step is read from that export, and 04's eval at that step is the prediction
  (the replay of vLLM's rounds, common.model.acceptance, or the product formula). A draft 04 did not
  export gets none, and says why (`Offline.missing`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from common.core.config import Config
from common.core.errors import DataError, PipelineError
from common.core.io import file_sha256, iter_jsonl, read_json
from common.core.run_folder import Layout, content_fingerprint


@dataclass(frozen=True)
class Offline:
    """04's prediction for the draft measured (the report's "offline"), or None and why there is none."""

    prediction: Optional[dict] = None
    missing: Optional[str] = None


@dataclass(frozen=True)
class CheckedDraft:
    path: Path
    sha256: str  # draft_fingerprint: what identifies the draft, wherever it lies
    offline: Offline


def draft_fingerprint(draft_dir: Path, layout: Optional[Layout] = None) -> str:
    """sha256 over the draft's weights files (model.safetensors, or every *.safetensors in order).
    With the run's layout, each file's hash is cached in its stages/hashes.json (a Kimi-sized draft is GBs)."""
    from common.model.export import draft_weight_files  # imports torch: only when needed

    draft_dir = Path(draft_dir)
    files = draft_weight_files(draft_dir)
    if not files:
        raise PipelineError(f"no model.safetensors in the draft directory {draft_dir}; run 04_train.py first (it writes train/final/)")
    for f in files:
        check_readable(f)
    sha = file_sha256 if layout is None else (lambda f: content_fingerprint(layout, f))
    if len(files) == 1:
        return sha(files[0])
    return hashlib.sha256(json.dumps([[f.name, sha(f)] for f in files], sort_keys=True).encode()).hexdigest()


def check_readable(f: Path) -> None:
    """A weights file that cannot be read (a symlink loop, a dangling link, a directory, no permission) is one
    DataError naming it, before vLLM starts or --overwrite deletes anything (a directory would be hashed as its
    files, a FIFO would block the hash: only a regular file is opened)."""
    redo = "restore the file or re-export the draft (rerun 04_train.py), or pass --draft another draft directory"
    try:
        if not stat.S_ISREG(f.stat().st_mode):
            raise DataError(f"the draft's weights {f} is not a file (a directory or a device); {redo}")
        with open(f, "rb"):
            pass
    except OSError as e:
        raise DataError(f"cannot read the draft's weights {f} ({e.strerror or e}); {redo}") from None


def find_draft(cfg: Config, draft_dir: Optional[str]) -> Path:
    from common.model.export import CONFIG_NAME

    draft = Path(draft_dir) if draft_dir else Layout.of(cfg).final
    # anything there (a directory, a symlink loop, an unreadable file): read_draft_config says what is wrong with it
    if not os.path.lexists(draft / CONFIG_NAME):
        raise PipelineError(f"no trained draft at {draft} (config.json missing); run 04_train.py first or pass --draft DIR")
    return draft


def run_aux_layer_ids(cfg: Config) -> tuple[Optional[list[int]], str]:
    """The aux layer ids this run's draft reads, and where they come from: what 02 extracted
    (hidden/index.json), else target.aux_layer_ids when set, else (None, "")."""
    index = Layout.of(cfg).hidden_index
    if index.is_file():
        doc = read_json(index)
        ids = doc.get("aux_layer_ids") if isinstance(doc, dict) else None
        if isinstance(ids, list):
            return [int(i) for i in ids], str(index)
    if cfg.target.aux_layer_ids:
        return list(cfg.target.aux_layer_ids), "target.aux_layer_ids"
    return None, ""


def check_draft(cfg: Config, draft: Path, foreign_draft: bool) -> None:
    """The draft's config.json read and checked by us before vLLM sees it (a truncated file is one error
    line, not vLLM's traceback), and its aux layer ids against this run's: vLLM captures the layers the
    draft's config names, so a draft trained on other layers is another run's, and this run's
    prediction says nothing about it."""
    from common.model.export import read_draft_config

    ids = read_draft_config(draft).aux_layer_ids
    run_ids, source = run_aux_layer_ids(cfg)
    if run_ids is not None and ids != run_ids and not foreign_draft:
        raise DataError(
            f"the draft {draft} reads the target's aux layers {ids} (eagle_aux_hidden_state_layer_ids in its config.json) "
            f"but this run extracted {run_ids} ({source}): it is not this run's draft; evaluate this run's train/final "
            f"(drop --draft), or pass --foreign-draft to measure it anyway (reported without this run's offline prediction)")


def checked_draft(cfg: Config, layout: Layout, draft_dir: Optional[str], foreign_draft: bool) -> CheckedDraft:
    """The draft to measure (checked: check_draft), the fingerprint of its weights, and 04's prediction for it
    (none for --foreign-draft)."""
    draft = find_draft(cfg, draft_dir)
    check_draft(cfg, draft, foreign_draft)
    sha = draft_fingerprint(draft, layout)
    offline = Offline(missing="--foreign-draft: not this run's draft") if foreign_draft else offline_prediction(cfg, draft, sha)
    return CheckedDraft(draft, sha, offline)


# ----------------------------------------------------------------------------- 04's prediction


def eval_at_step(layout: Layout, step: int) -> tuple[Optional[dict], Path]:
    """04's eval at `step` and the file it is in: train/eval_report.json when it is that step's (the
    latest eval), else the eval line of train/metrics.jsonl (04 logs every eval there, in full)."""
    try:
        latest = read_json(layout.train_eval_report) if layout.train_eval_report.is_file() else None
    except (DataError, OSError):  # unreadable: the eval is looked up in metrics.jsonl
        latest = None
    if isinstance(latest, dict) and latest.get("step") == step:
        return latest, layout.train_eval_report
    if not layout.metrics.is_file():
        return None, layout.metrics
    found = None
    for row in iter_jsonl(layout.metrics, tolerate_torn_tail=True, strict=False):
        if row.get("type") == "eval" and row.get("step") == step:
            found = row  # the last one: a resumed run logs the steps after its checkpoint again
    return found, layout.metrics


def offline_prediction(cfg: Config, draft: Path, draft_sha: str) -> Offline:
    """04's offline prediction for this very draft, or why there is none.

    The draft is found among this run's exports by its weights (train/final, train/best, at any path),
    its step read from that export (training_summary.json, best.json), and the prediction is 04's eval
    at that step: `--draft RUN/train/best` is compared with the best checkpoint's prediction, never the
    final draft's.
    """
    layout = Layout.of(cfg)
    exports = layout.export_records
    # the very files: nothing to compare (realpath: an export that is a symlink loop is no match, not a RuntimeError)
    same = [d for d in exports if os.path.realpath(d) == os.path.realpath(draft)]

    def same_weights(d: Path) -> bool:
        try:
            return draft_fingerprint(d, layout) == draft_sha
        except PipelineError:  # no export there
            return False

    export = same[0] if same else next((d for d in exports if same_weights(d)), None)
    if export is None:
        return Offline(missing=f"{draft} has other weights than this run's train/final and train/best: 04 predicted nothing for it")
    try:
        record = read_json(export / exports[export])
    except (DataError, OSError) as e:  # OSError: a symlink loop, a directory or no permission there
        return Offline(missing=f"cannot tell which step {export} is ({e})")
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int):
        return Offline(missing=f"{export / exports[export]} records no step: cannot tell which eval predicts it")
    rep, path = eval_at_step(layout, step)
    if rep is None:
        return Offline(missing=f"04 logged no eval at step {step}, the step of {export} ({path})")
    return Offline(prediction=offline_report(cfg, rep, path, export))


def offline_report(cfg: Config, rep: dict, path: Path, export: Path) -> dict:
    """The offline prediction of vLLM's numbers from 04's eval at the draft's step.

    At k = evaluate.num_speculative_tokens: expected_acceptance_length and expected_per_position
    are the replay of vLLM's rounds (common.model.acceptance) when 04 reported it ("prediction": "replay"),
    else the product formula 1 + sum_j prod_{i<=j} step_acc[i]; "product_formula" always has the latter.
    """
    from common.model.acceptance import product_formula, product_per_position

    k = cfg.evaluate.num_speculative_tokens
    acc = [float(a) for a in rep.get("step_acc") or []]
    tau = (rep.get("tau") or {}).get(str(k))
    if tau is None and len(acc) >= k:
        tau = product_formula(acc, k)
    product = {"acceptance_length": tau, "per_position": product_per_position(acc, k)}
    replay = (rep.get("replay") or {}).get(str(k))
    out = {"path": str(path), "draft": str(export), "step": rep.get("step"), "loss": rep.get("loss"), "step_acc": acc,
           "product_formula": product}
    if replay:
        return out | {"prediction": "replay", "expected_acceptance_length": replay["acceptance_length"],
                      "expected_per_position": replay["per_position"], "replay_rounds": replay["rounds"]}
    return out | {"prediction": "product formula", "expected_acceptance_length": tau,
                  "expected_per_position": product["per_position"]}
