"""The README's two commands and CI stay in step; the repository's packages shadow no other
distribution's."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_exactly_two_commands():
    text = (ROOT / "README.md").read_text()
    assert text.index("```bash") < text.index("\n## ")
    assert len(readme_commands()) == 2


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert "pytest" in test_command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_kvtune_installs_one_top_level_package():
    top_level = importlib.metadata.distribution("kvtune").read_text("top_level.txt")
    assert top_level.split() == ["kvtune"]


def test_no_repository_package_shadows_an_installed_distribution():
    """pytest and `python -m` put the repository root first on sys.path, so each package folder
    there hides any installed package of its name: a top-level `kernels` once hid Hugging
    Face's, and `import transformers` (>= 5.25 requires it) failed."""
    installed = importlib.metadata.packages_distributions()
    folders = [path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file()]
    clashes = {
        name: installed[name] for name in folders if set(installed.get(name, [])) - {"kvtune"}
    }
    assert not clashes


def test_transformers_imports_from_the_repository_root():
    code = "from transformers import LlamaConfig; import kvtune.runtime"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
