"""The run folder contract: where every artifact lives, when a stage is complete, who may write.

Three things every stage shares (docs/design.md#run-folder):

- `Layout`: every artifact path under run_dir, in one place.
- `StageManifest`: run_dir/stages/<stage>.json records what a stage's outputs were made from
  (its inputs with sha256 content fingerprints, the settings that shape the outputs) and its
  state ("running" until the outputs are whole, then "complete"), plus what the last run did
  ("done", "already_complete", "partial", "failed"), which run_pipeline.py reads. A rerun whose
  inputs or settings differ is an error that names them and suggests --overwrite (never a silent
  mix), unless the stage declares that a change only means "redo" (it rewrites those outputs
  whole, e.g. 01b retokenizes after a tokenize.* change).
- `stage_lock` (common/core/stage_lock.py): an exclusive flock on run_dir/stages/<stage>.lock, held
  for the stage's life, and the refusals that keep one stage from deleting what another reads.

Fingerprints are sha256 of file contents, cached in run_dir/stages/hashes.json by (path, size,
mtime_ns) so a multi-GB input is read once. Shards are fingerprinted through hidden/index.json,
which holds each shard's sha256: hashing the index covers terabytes without reading them. Inputs are
named by what they are (a path relative to run_dir, "data.source", "target weights"), never by an
absolute path, and a path-valued setting is recorded by content (input_identity): data or a target
moved elsewhere is the same input.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from common.core.errors import ConfigError, DataError, PipelineError
from common.core.io import atomic_write_json, file_sha256

STAGES_DIR = "stages"
# The form of every stage's outputs, recorded in each stage manifest. A run folder of another version is refused
# with one line (StageManifest.check_version) and made again, not read through compatibility code: raise it when
# any stage's outputs change form (2: rounds in every hidden plan, hidden format 3, checkpoints' "round"; 3: 04 records
# hidden/index.json by its content without the target's path, 01b encodes control text in dataset answers as plain text).
RUN_FOLDER_VERSION = 3
HASH_CACHE = "hashes.json"
# The prompt sets 05 measures: held-out prompts of the training distribution (eval/outputs.jsonl,
# eval/baseline.json), evaluate.other_prompts ("other") and evaluate.prompt_sets (files suffixed -NAME).
HELD_OUT, OTHER = "held_out", "other"
TRAINING_SUMMARY, BEST_JSON = "training_summary.json", "best.json"  # in train/final/ and train/best/
PREDICTION_JSON = "prediction.json"  # in every export of 04: the eval that predicts it (05 reads it)


@dataclass(frozen=True)
class Layout:
    """Every artifact path of a run (README "Artifacts")."""

    run_dir: Path

    @classmethod
    def of(cls, cfg_or_dir) -> "Layout":
        run_dir = getattr(cfg_or_dir, "run_dir", cfg_or_dir)
        return cls(Path(run_dir))

    def name(self, path: Path) -> str:
        """A run-folder path as the manifests and messages name it: relative to run_dir."""
        return Path(path).relative_to(self.run_dir).as_posix()

    def named(self, *paths: Path) -> dict[str, Path]:
        """{name: path} for StageManifest inputs."""
        return {self.name(p): p for p in paths}

    # 01 / 01b
    @property
    def data(self) -> Path:
        return self.run_dir / "data"

    @property
    def prompts(self) -> Path:
        return self.data / "prompts.jsonl"

    @property
    def prepare_report(self) -> Path:
        return self.data / "prepare_report.json"

    @property
    def raw_responses(self) -> Path:
        return self.data / "raw_responses.jsonl"

    @property
    def failed(self) -> Path:
        return self.data / "failed.jsonl"

    @property
    def train_jsonl(self) -> Path:
        return self.data / "train.jsonl"

    @property
    def eval_jsonl(self) -> Path:
        return self.data / "eval.jsonl"

    def split_jsonl(self, split: str) -> Path:
        """data/train.jsonl or data/eval.jsonl: 01b's tokenized samples of one split."""
        return self.data / f"{split}.jsonl"

    @property
    def generate_report(self) -> Path:
        return self.data / "generate_report.json"

    def generate_outputs(self) -> list[Path]:
        """Everything 01b writes: what --overwrite removes."""
        return [self.raw_responses, self.failed, self.train_jsonl, self.eval_jsonl, self.generate_report]

    # 02
    @property
    def hidden(self) -> Path:
        return self.run_dir / "hidden"

    @property
    def hidden_index(self) -> Path:
        return self.hidden / "index.json"

    @property
    def hidden_plan(self) -> Path:
        return self.hidden / "plan.json"

    @property
    def hidden_consumed(self) -> Path:
        """Rounds mode: the rounds 04 has trained on and deleted (written by 04, read by 02)."""
        return self.hidden / "consumed.json"

    def shard(self, k: int) -> Path:
        return self.hidden / f"shard-{k:05d}.safetensors"

    def shard_files(self) -> list[Path]:
        return sorted(self.hidden.glob("shard-*.safetensors"))

    def index_fragment(self, rank: int) -> Path:
        """Rank `rank`'s part of the index under torchrun; rank 0 merges them into index.json."""
        return self.hidden / f"index.rank-{rank:05d}.json"

    def index_fragments(self) -> list[Path]:
        return sorted(self.hidden.glob("index.rank-*.json"))

    def vllm_requests(self, rank: int) -> Path:
        """02's vllm backend: the KV connector's per-request files of rank `rank` (removed when read)."""
        return self.hidden / f"vllm-requests.rank-{rank:05d}.tmp"

    def vllm_requests_dirs(self) -> list[Path]:
        """Every rank's vllm_requests directory on disk (a killed 02 leaves them)."""
        return sorted(self.hidden.glob("vllm-requests.rank-*.tmp"))

    # 03
    @property
    def vocab(self) -> Path:
        return self.run_dir / "vocab"

    @property
    def vocab_map(self) -> Path:
        return self.vocab / "vocab_map.safetensors"

    @property
    def vocab_report(self) -> Path:
        return self.vocab / "report.json"

    # 04
    @property
    def train(self) -> Path:
        return self.run_dir / "train"

    @property
    def checkpoints(self) -> Path:
        return self.train / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def checkpoint_tmp(self, step: int) -> Path:
        """A checkpoint is written here and renamed to checkpoint(step)."""
        return self.checkpoints / f".tmp-step-{step}"

    def checkpoint_dirs(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete checkpoint, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        steps = [(int(p.name[len("step-"):]), p) for p in self.checkpoints.iterdir()
                 if p.is_dir() and p.name.startswith("step-") and p.name[len("step-"):].isdigit()]
        return sorted(steps)

    def checkpoint_tmps(self) -> list[Path]:
        """Checkpoints a killed run left half written."""
        return sorted(self.checkpoints.glob(".tmp-step-*")) if self.checkpoints.is_dir() else []

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.train / "tb"

    @property
    def train_eval_report(self) -> Path:
        return self.train / "eval_report.json"

    @property
    def final(self) -> Path:
        return self.train / "final"

    @property
    def final_tmp(self) -> Path:
        """final/ is built here and renamed into place."""
        return self.train / ".tmp-final"

    @property
    def best(self) -> Path:
        """04's export of the checkpoint with the best replayed acceptance length, with best.json."""
        return self.train / "best"

    @property
    def best_tmp(self) -> Path:
        return self.train / ".tmp-best"

    def train_outputs(self) -> list[Path]:
        """Everything 04 writes: what --overwrite removes."""
        return [self.checkpoints, self.tensorboard, self.final, self.final_tmp, self.best, self.best_tmp, self.metrics,
                self.train_eval_report]

    # 05
    @property
    def eval(self) -> Path:
        return self.run_dir / "eval"

    @property
    def eval_report(self) -> Path:
        return self.eval / "report.json"

    @property
    def eval_plot(self) -> Path:
        return self.eval / "report.png"

    def eval_outputs_of(self, prompt_set: str) -> Path:
        return self.eval / ("outputs.jsonl" if prompt_set == HELD_OUT else f"outputs-{prompt_set}.jsonl")

    def baseline_of(self, prompt_set: str) -> Path:
        return self.eval / ("baseline.json" if prompt_set == HELD_OUT else f"baseline-{prompt_set}.json")

    @property
    def eval_outputs(self) -> Path:
        return self.eval_outputs_of(HELD_OUT)

    @property
    def baseline(self) -> Path:
        return self.baseline_of(HELD_OUT)

    def evaluate_outputs(self, prompt_sets: Iterable[str] = (OTHER,)) -> list[Path]:
        """Everything 05 writes under eval/ for the held-out prompts and these prompt sets: what --overwrite removes."""
        return [self.eval_report, self.eval_plot, *(p for s in (HELD_OUT, *prompt_sets)
                                                     for p in (self.eval_outputs_of(s), self.baseline_of(s)))]

    @property
    def compare(self) -> Path:
        """05 --compare DIR_A DIR_B: both drafts side by side."""
        return self.eval / "compare"

    @property
    def compare_report(self) -> Path:
        return self.compare / "report.json"

    @property
    def compare_plot(self) -> Path:
        return self.compare / "report.png"

    def compare_outputs_of(self, draft: str, prompt_set: str) -> Path:
        """One compared draft's ("a" or "b") outputs with and without it on a prompt set."""
        return self.compare / f"outputs-{draft}-{prompt_set}.jsonl"

    # bookkeeping
    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    def log(self, name: str) -> Path:
        """logs/<name>.log: a stage's output, or a vLLM server's, as run_pipeline.py captures it."""
        return self.logs / f"{name}.log"

    @property
    def pipeline_runs(self) -> Path:
        return self.logs / "pipeline_runs.jsonl"

    @property
    def stages(self) -> Path:
        return self.run_dir / STAGES_DIR

    def manifest(self, stage: str) -> Path:
        return self.stages / f"{stage}.json"

    def lock(self, stage: str) -> Path:
        return self.stages / f"{stage}.lock"


# ----------------------------------------------------------------------------- content fingerprints


def content_fingerprint(layout: Layout, path: str | os.PathLike, files: Iterable[Path] | None = None) -> str:
    """sha256 of a file's bytes; of a directory, of its `files` (default: all but temp files) by their names
    relative to it, in that order, and hashes: the same content at another path is the same input.

    Cached in stages/hashes.json by (absolute path, size, mtime_ns): a rewritten file gets a new
    mtime and is hashed again; an unchanged multi-GB file is read once.
    """
    path = Path(path)
    if path.is_dir():
        if files is None:
            files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".tmp-"))
        return combined_fingerprint((str(f.relative_to(path)), content_fingerprint(layout, f)) for f in files)
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns]  # taken before the read: a file rewritten meanwhile is hashed again next time
    hit = _read_hash_cache(layout).get(str(path.resolve()))
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    digest = file_sha256(path)
    _remember(layout, path, stamp, digest)
    return digest


def combined_fingerprint(parts: Iterable[tuple[str, str]]) -> str:
    """One fingerprint for several files from their (name, sha256), in the order given."""
    h = hashlib.sha256()
    for name, digest in parts:
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def input_identity(layout: Layout, value: str, files: Iterable[Path] | None = None) -> str:
    """What a path-valued setting (data.source, the tokenizer) names, by content: its content_fingerprint (of a
    folder: of `files`), so that the same data moved or copied elsewhere is the same input and a stage never redoes
    or refuses for a path; the value itself when it names nothing local (a hub id)."""
    path = Path(os.path.expanduser(value))
    return content_fingerprint(layout, path, files) if path.exists() else value


def remember_fingerprint(layout: Layout, path: str | os.PathLike, digest: str) -> None:
    """Record the sha256 of a file its writer hashed while writing it (02's shards), so a later
    content_fingerprint (04's shard check) does not read it again: hours of reading at Kimi scale."""
    st = Path(path).stat()
    _remember(layout, path, [st.st_size, st.st_mtime_ns], digest)


def _remember(layout: Layout, path: str | os.PathLike, stamp: list[int], digest: str) -> None:
    cache = _read_hash_cache(layout)  # read now: another stage may have added entries meanwhile
    cache[str(Path(path).resolve())] = {"stamp": stamp, "sha256": digest}
    # Keep the cache small: entries of files that are gone are dropped.
    _write_hash_cache(layout, {k: v for k, v in cache.items() if os.path.exists(k)})


def _write_hash_cache(layout: Layout, cache: dict) -> None:
    """Replace the cache file. Several processes may write it at once (ranks, stages running side
    by side), so each uses its own temp file (common.core.io.atomic_path would delete the others');
    the last writer wins, and a lost entry is only hashed again."""
    try:
        layout.stages.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{HASH_CACHE}.", dir=layout.stages)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cache, f)
        os.replace(tmp, layout.stages / HASH_CACHE)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.ENOENT):
            raise


def _read_hash_cache(layout: Layout) -> dict:
    try:
        data = json.loads((layout.stages / HASH_CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ----------------------------------------------------------------------------- the stage manifest


COMPLETE, RUNNING = "complete", "running"


class StageManifest:
    """run_dir/stages/<stage>.json. Typical use in a stage:

        manifest = StageManifest(layout, "03_build_vocab_map",
                                 inputs={"data/train.jsonl": layout.train_jsonl},
                                 settings={"draft_vocab_size": ...})
        status = manifest.begin(overwrite)      # "complete" | "resume" | "fresh"; raises on a mismatch
        if status == "complete": ...say so, manifest.record("already_complete"), return
        ...work (resuming partial outputs when status == "resume")...
        manifest.complete(result)               # last: the outputs are whole
    """

    def __init__(self, layout: Layout, stage: str, inputs: dict[str, str | os.PathLike] | None = None,
                 settings: dict | None = None, redo_on: Iterable[str] = ()):
        """inputs: {name: path (hashed here) or a precomputed fingerprint string}. redo_on: input
        names or setting keys whose change means "redo those outputs" instead of an error."""
        self.layout, self.stage = layout, stage
        self.path = layout.manifest(stage)
        self.inputs = {name: (value if isinstance(value, str) else content_fingerprint(layout, value))
                       for name, value in (inputs or {}).items()}
        self.settings = json.loads(json.dumps(settings or {}, sort_keys=True, default=str))
        self.redo_on = set(redo_on)
        self.previous = read_manifest(layout, stage)

    # -- deciding
    def changes(self) -> tuple[list[str], list[str]]:
        """(changes that are an error, changes that mean redo) against the previous manifest. Outputs made by
        another run-folder version are an error of their own (check_version)."""
        if self.previous is None:
            return [], []
        self.check_version()
        old_inputs, old_settings = self.previous.get("inputs") or {}, self.previous.get("settings") or {}
        changed = [name for name in sorted(set(old_inputs) | set(self.inputs)) if old_inputs.get(name) != self.inputs.get(name)]
        changed += [key for key in sorted(set(old_settings) | set(self.settings)) if old_settings.get(key) != self.settings.get(key)]
        return [c for c in changed if c not in self.redo_on], [c for c in changed if c in self.redo_on]

    def check_version(self) -> None:
        """One run-folder version: outputs recorded by another version of the pipeline are made again, not read
        through compatibility code (RUN_FOLDER_VERSION)."""
        found = self.previous.get("run_folder_version")
        if found != RUN_FOLDER_VERSION:
            made_by = "a later" if isinstance(found, int) and found > RUN_FOLDER_VERSION else "an earlier"
            raise DataError(f"{self.stage}: the outputs in {self.layout.run_dir} were made by {made_by} version of this "
                            f"pipeline ({self.path} records run-folder version {json.dumps(found)}, this code writes "
                            f"{RUN_FOLDER_VERSION}): rerun {self.stage}.py with --overwrite, and the stages after it")

    def mismatch_error(self, changed: list[str]) -> PipelineError:
        """DataError when an input file changed, ConfigError when only settings did."""
        old_settings = (self.previous or {}).get("settings") or {}
        old_inputs = (self.previous or {}).get("inputs") or {}
        parts, inputs_changed = [], False
        for c in changed:
            if c in self.inputs or c in old_inputs:
                inputs_changed = True
                parts.append(f"{c} changed" if c in self.inputs and c in old_inputs else
                             f"{c} is new" if c in self.inputs else f"{c} is gone")
            else:
                parts.append(f"{c}: {json.dumps(old_settings.get(c))} -> {json.dumps(self.settings.get(c))}")
        return (DataError if inputs_changed else ConfigError)(
            f"{self.stage}: the outputs in {self.layout.run_dir} were made from other inputs or settings ({'; '.join(parts)}); "
            f"rerun {self.stage}.py with --overwrite to rebuild them (and the stages after it), or restore the old ones"
        )

    def begin(self, overwrite: bool, outputs: Iterable[os.PathLike] = (), started: bool | None = None) -> str:
        """"complete", "resume" (partial outputs made from the same inputs) or "fresh".

        Raises the mismatch error when the outputs were made from other inputs or settings.
        With overwrite the previous record is dropped (the stage deletes its outputs). A complete
        record whose `outputs` are not all there any more (deleted by hand) means "resume".
        started: whether any output exists to be mixed with (default: any of `outputs` exists);
        when nothing was written yet, an earlier attempt's record does not bind this run.
        """
        outputs = list(outputs)
        if started is None:
            started = any(os.path.exists(p) for p in outputs) if outputs else True
        if not started:
            self.previous = None
        if overwrite:
            self.previous = None
            self.path.unlink(missing_ok=True)
            self._write(RUNNING, None, "running")
            return "fresh"
        errors, redo = self.changes()
        if errors:
            raise self.mismatch_error(errors)
        if self._recorded_complete(redo, outputs):
            return "complete"
        status = "fresh" if self.previous is None else "resume"
        self._write(RUNNING, (self.previous or {}).get("result"), "running")
        return status

    def is_complete(self, outputs: Iterable[os.PathLike] = ()) -> bool:
        """What begin() would call "complete", found without writing anything (a stage skips its costly checks)."""
        errors, redo = self.changes()
        return not errors and self._recorded_complete(redo, outputs)

    def _recorded_complete(self, redo: list, outputs: Iterable[os.PathLike]) -> bool:
        """The record says complete, nothing asks for a redo, and every output is still there."""
        return (self.previous is not None and self.previous.get("state") == COMPLETE and not redo
                and all(os.path.exists(p) for p in outputs))

    @property
    def result(self) -> dict:
        return dict((self.previous or {}).get("result") or {})

    # -- recording
    def complete(self, result: dict | None = None, outcome: str = "done") -> None:
        self._write(COMPLETE, result, outcome)

    def partial(self, result: dict | None = None, outcome: str = "partial") -> None:
        self._write(RUNNING, result, outcome)

    def record(self, outcome: str) -> None:
        """What this run did, without changing the state (e.g. "already_complete", "failed")."""
        prev = read_manifest(self.layout, self.stage) or {}
        self._write(prev.get("state", RUNNING), prev.get("result"), outcome)

    def _write(self, state: str, result: dict | None, outcome: str) -> None:
        record = {
            "stage": self.stage,
            "run_folder_version": RUN_FOLDER_VERSION,
            "state": state,
            "inputs": self.inputs,
            "settings": self.settings,
            "result": result or {},
            "last_run": {"outcome": outcome, "pid": os.getpid(),
                         "time": datetime.datetime.now().isoformat(timespec="microseconds")},
        }
        atomic_write_json(self.path, record)
        self.previous = record


def read_manifest(layout: Layout, stage: str) -> dict | None:
    """The stage's manifest, or None when there is none (or it is unreadable: treated as absent)."""
    try:
        data = json.loads(layout.manifest(stage).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def last_outcome(run_dir: str | os.PathLike, stage: str) -> str | None:
    """What the last run of `stage` did ("done", "already_complete", "partial", "failed"), from its manifest."""
    m = read_manifest(Layout.of(run_dir), stage)
    return ((m or {}).get("last_run") or {}).get("outcome")
