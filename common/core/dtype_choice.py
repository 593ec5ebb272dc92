"""What `target.dtype: auto` and `extract.dtype: auto` mean on this machine.

bf16 is the dtype a GPU serves and extracts in, and it halves the hidden states on disk. On a CPU it is only fast
with native bf16 instructions (x86 avx512_bf16 or AMX, Arm's bf16 extension): without them PyTorch emulates it,
~60x slower than float32 (measured on an AVX2-only EPYC: a 512x576 @ 576x1536 matmul at 0.6 GFLOP/s in bf16 against
37.7 in float32, and the SmolLM2 route's 02 at 15 tok/s against ~250). So auto = bfloat16 on CUDA or on a CPU with
native bf16, float32 on any other CPU. An explicit bfloat16 is kept, with a warning where it is emulated.

The choice is made when a stage loads its config (common.core.config.load_config), and the resolved value is what
every stage records and compares: a run folder extracted in one dtype is never resumed in another. It is said where
the target runs (02's extractor, the vLLM server of 01b and 05: `announce`), once per process.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
_unsaid: list[tuple[str, str]] = []  # what load_config's choice has to say, until announce() says it
# the measured slowdown of emulated bf16, quoted in the warning (see the docstring)
EMULATED_BF16_SLOWDOWN = "~60x"


@dataclass(frozen=True)
class Machine:
    """Where the target runs: CUDA, or a CPU with or without native bf16 (and why we think so)."""

    cuda: bool
    cpu_native_bf16: bool
    cpu_evidence: str  # e.g. "cpu flags avx512_bf16" or "torch capability AVX2, no bf16 flags"


def cpu_native_bf16(flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU runs bf16 natively, and the evidence. `flags` injects /proc/cpuinfo's flags (tests)."""
    if flags is None:
        flags = _cpuinfo_flags()
    found = sorted(flags & {"avx512_bf16", "amx_bf16", "bf16"})  # x86 AVX512-BF16, x86 AMX, Arm FEAT_BF16
    if found:
        return True, f"cpu flags {' '.join(found)}"
    return False, f"torch capability {_torch_capability()}, no avx512_bf16 / amx_bf16 / bf16 cpu flag"


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):  # x86 | aarch64
            flags.update(value.split())
    return flags


def _torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@functools.lru_cache(maxsize=1)
def this_machine(use_cuda: bool = True) -> Machine:
    import torch

    native, evidence = cpu_native_bf16()
    return Machine(cuda=use_cuda and torch.cuda.is_available(), cpu_native_bf16=native, cpu_evidence=evidence)


def auto_dtype(machine: Machine) -> tuple[str, str]:
    """auto's dtype on this machine, and the reason in a few words."""
    if machine.cuda:
        return "bfloat16", "CUDA"
    if machine.cpu_native_bf16:
        return "bfloat16", f"CPU with native bf16 ({machine.cpu_evidence})"
    return "float32", f"CPU without native bf16 ({machine.cpu_evidence}), where bf16 runs {EMULATED_BF16_SLOWDOWN} slower"


def resolve_dtypes(cfg, machine: Machine | None = None) -> list[tuple[str, str]]:
    """Replace `auto` in target.dtype and extract.dtype by this machine's choice. Returns the lines to print,
    as (level, message): one info line per choice made, one warning per explicit bf16 that this CPU emulates."""
    if machine is None:
        machine = this_machine(cfg.extract.device != "cpu")
    keys = (("target.dtype", cfg.target), ("extract.dtype", cfg.extract))
    lines = []
    for key, section in keys:
        if section.dtype == AUTO:
            section.dtype, why = auto_dtype(machine)
            lines.append(("info", f"{key}: auto = {section.dtype} ({why})"))
        elif section.dtype == "bfloat16" and not machine.cuda and not machine.cpu_native_bf16:
            lines.append(("warning", f"{key}: bfloat16 on a CPU without native bf16 ({machine.cpu_evidence}) runs "
                                     f"{EMULATED_BF16_SLOWDOWN} slower than float32; kept as asked. Set {key}: auto "
                                     f"(float32 here) unless this run must match a bf16 one"))
    return lines


def remember(lines: list[tuple[str, str]]) -> None:
    """Keep load_config's lines for announce() (a stage that never runs the target says nothing)."""
    _unsaid[:] = lines


def announce() -> None:
    """Print the dtype choice of this process's config, once, where the target is about to run: the choice on
    stdout with the stage's progress, a warning on stderr."""
    for level, line in _unsaid:
        if level == "warning":
            print(f"warning: {line}", file=sys.stderr, flush=True)
        else:
            print(line, flush=True)
    _unsaid.clear()
