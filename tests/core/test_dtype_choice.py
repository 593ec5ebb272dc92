"""dtype auto: bfloat16 on CUDA or a CPU with native bf16, float32 on any other CPU (issue 42, item 2)."""

from unittest import mock

import pytest

from common.core import dtype_choice
from common.core.config import config_from_dict, load_config
from common.core.dtype_choice import Machine, auto_dtype, cpu_native_bf16, resolve_dtypes
from tests.helpers import write_yaml

AVX2_EPYC = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}  # the flags of the AVX2-only machine, in short
SAPPHIRE_RAPIDS = AVX2_EPYC | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
GRAVITON3 = {"fp", "asimd", "sve", "bf16", "i8mm"}  # aarch64 'Features'


@pytest.mark.parametrize("flags, native", [(AVX2_EPYC, False), ({"avx512f", "avx512bw"}, False),
                                           (SAPPHIRE_RAPIDS, True), (GRAVITON3, True), (set(), False)])
def test_native_bf16_is_read_from_the_cpu_flags(flags, native):
    found, evidence = cpu_native_bf16(flags)
    assert found is native
    assert ("bf16" in evidence) if native else ("no avx512_bf16" in evidence)


def _machine(cuda=False, flags=AVX2_EPYC) -> Machine:
    native, evidence = cpu_native_bf16(flags)
    return Machine(cuda=cuda, cpu_native_bf16=native, cpu_evidence=evidence)


def test_auto_is_float32_on_a_cpu_without_bf16_and_bf16_elsewhere():
    assert auto_dtype(_machine(flags=AVX2_EPYC))[0] == "float32"
    assert auto_dtype(_machine(flags=SAPPHIRE_RAPIDS))[0] == "bfloat16"
    assert auto_dtype(_machine(flags=GRAVITON3))[0] == "bfloat16"
    assert auto_dtype(_machine(cuda=True, flags=AVX2_EPYC)) == ("bfloat16", "CUDA")


def test_resolving_auto_names_the_choice_and_its_reason_once_per_key():
    cfg = config_from_dict({}, resolve_dtypes=False)
    assert (cfg.target.dtype, cfg.extract.dtype) == ("auto", "auto")  # the defaults
    lines = resolve_dtypes(cfg, _machine(flags=AVX2_EPYC))
    assert (cfg.target.dtype, cfg.extract.dtype) == ("float32", "float32")
    assert [level for level, _ in lines] == ["info", "info"]
    assert lines[0][1].startswith("target.dtype: auto = float32 (CPU without native bf16 (torch capability ")
    assert "~60x slower" in lines[0][1] and lines[1][1].startswith("extract.dtype: auto = float32")
    assert resolve_dtypes(cfg, _machine(flags=AVX2_EPYC)) == []  # resolved values stay, nothing more to say


def test_an_explicit_bf16_on_a_cpu_without_it_is_kept_with_the_slowdown():
    cfg = config_from_dict({"target": {"dtype": "bfloat16"}, "extract": {"dtype": "float32"}}, resolve_dtypes=False)
    lines = resolve_dtypes(cfg, _machine(flags=AVX2_EPYC))
    assert (cfg.target.dtype, cfg.extract.dtype) == ("bfloat16", "float32")
    assert len(lines) == 1 and lines[0][0] == "warning"
    assert lines[0][1].startswith("target.dtype: bfloat16 on a CPU without native bf16") and "~60x slower" in lines[0][1]
    for machine in (_machine(flags=SAPPHIRE_RAPIDS), _machine(cuda=True)):  # native bf16: nothing to warn of
        cfg = config_from_dict({"target": {"dtype": "bfloat16"}}, resolve_dtypes=False)
        assert [line for line in resolve_dtypes(cfg, machine) if line[1].startswith("target")] == []


def test_load_config_resolves_auto_on_a_cpu_without_bf16_and_says_so_once(tmp_path, capsys):
    """The capability injected where the stages read it (/proc/cpuinfo's flags), through the loader every stage uses;
    the choice is said once, where the target runs (announce: 02's extractor, the vLLM server of 01b and 05)."""
    path = write_yaml(tmp_path / "run.yaml", {"run_dir": str(tmp_path / "run"), "target": {"dtype": "bfloat16"}})
    dtype_choice.this_machine.cache_clear()
    try:
        with mock.patch.object(dtype_choice, "_cpuinfo_flags", return_value=set(AVX2_EPYC)), \
                mock.patch("torch.cuda.is_available", return_value=False):
            cfg = load_config(path, ["train.lr=1e-3", "target.dtype=auto"])  # two passes inside: file, then overrides
    finally:
        dtype_choice.this_machine.cache_clear()
    assert (cfg.target.dtype, cfg.extract.dtype) == ("float32", "float32")
    assert cfg.to_dict()["extract"]["dtype"] == "float32"  # what the stages record and compare
    assert capsys.readouterr() == ("", "")  # loading says nothing: a stage that never runs the target stays quiet
    dtype_choice.announce()
    dtype_choice.announce()
    out, err = capsys.readouterr()
    said = out.splitlines()
    assert err == "" and len(said) == 2 and all("auto = float32 (CPU without native bf16" in line for line in said)
    assert said[0].startswith("target.dtype") and said[1].startswith("extract.dtype")


def test_an_emulated_bf16_is_a_warning_on_stderr(capsys):
    cfg = config_from_dict({"target": {"dtype": "bfloat16"}, "extract": {"dtype": "float32"}}, resolve_dtypes=False)
    dtype_choice.remember(resolve_dtypes(cfg, _machine(flags=AVX2_EPYC)))
    dtype_choice.announce()
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("warning: target.dtype: bfloat16 on a CPU without native bf16") and "~60x" in err


def test_this_machine_agrees_with_torch_where_torch_can_tell():
    """On x86 torch checks the same instruction set for its bf16 kernels: the flag reading must not disagree."""
    import platform

    import torch

    if platform.machine() not in ("x86_64", "AMD64") or not hasattr(torch.cpu, "_is_avx512_bf16_supported"):
        pytest.skip("torch reports avx512_bf16 on x86 only")
    native, _ = cpu_native_bf16()
    assert native == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
