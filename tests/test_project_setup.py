"""The README's two commands and CI stay in step."""

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
