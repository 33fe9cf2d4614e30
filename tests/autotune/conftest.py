"""Fixtures for tuner tests: a tiny random Llama, tiny presets, and `kvtune` as a subprocess.

Studies in tests run the real pipeline (Hydra, Optuna storage, MLflow sqlite store, the
runtime and the accuracy suite) on a 2-layer random model with a one-document perplexity suite,
so a trial takes seconds. Their presets live in a temporary config folder that Hydra searches
(hydra.searchpath), next to the project's conf/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.runtime.conftest import build_tiny_model

KVTUNE = [
    sys.executable,
    "-c",
    "import sys; from kvtune.autotune.cli.main import main; sys.exit(main())",
]

TINY_PRESETS = {
    "eval/tiny.yaml": {
        "name": "tiny",
        "model": "smollm2-135m",
        "seed": 0,
        "context_tokens": 256,
        "tasks": {"wiki_ppl": {"docs": 1}},
        "batch_tokens": 1024,
        "max_num_seqs": 2,
    },
    "workload/tiny.yaml": {
        "name": "tiny",
        "context_len": 64,
        "max_model_len": 256,
        "batch": 2,
        "decode_tokens": 4,
        "prompt_len": {"median": 32, "min": 8, "max": 96},
        "output_len": {"median": 6, "min": 2, "max": 12},
        "trace_requests": 3,
        "arrival_rate": 20.0,
        "seed": 0,
    },
    "workload/tiny2.yaml": {
        "name": "tiny2",
        "context_len": 48,
        "max_model_len": 256,
        "batch": 1,
        "decode_tokens": 4,
        "prompt_len": {"median": 24, "min": 8, "max": 64},
        "output_len": {"median": 4, "min": 2, "max": 8},
        "trace_requests": 2,
        "arrival_rate": 20.0,
        "seed": 1,
    },
    "search/tiny.yaml": {
        "layer_groups": "all",
        "k_dtype": ["fp16", "fp8", "fp4"],
        "v_dtype": ["fp16", "fp8", "fp4"],
        "group_size": [8, 16, "tensor"],
        "scale_dtype": ["fp16", "e4m3"],
        "recent_unquantized": [0, 16],
        "csa_ratio": [1, 2],
        "csa_window": [16, 32],
        "csa_sinks": [4],
        "block_size": [8, 16],
        "chunk_size": [32],
    },
}


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_conf(tmp_path_factory) -> Path:
    """A config folder with the tiny eval, workload and search presets."""
    root = tmp_path_factory.mktemp("conf")
    for name, data in TINY_PRESETS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data))
    return root


@pytest.fixture(scope="session")
def kvtune_cache(tmp_path_factory) -> Path:
    """One kvtune cache for the session's studies (converted models, suites, evaluations)."""
    return tmp_path_factory.mktemp("kvtune-cache")


@pytest.fixture()
def tiny_study_args(tiny_model_folder, tiny_conf) -> list[str]:
    """Overrides that make `kvtune tune` study the tiny model on the tiny presets."""
    return [
        f"hydra.searchpath=[file://{tiny_conf}]",
        f"model.path={tiny_model_folder}",
        "model.name=tiny",
        "eval=tiny",
        "workload=tiny",
        "search=tiny",
        "study.heartbeat_interval_s=1",
        "study.grace_period_s=4",
        "study.engine_presets=[]",  # tests that measure them name them
    ]


def kvtune_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "KVTUNE_CACHE": str(cache), "MLFLOW_DISABLE_TELEMETRY": "true"}


def run_kvtune(
    *args: str, cwd: Path, cache: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`kvtune <args>` in cwd, as a user runs it."""
    return subprocess.run(
        [*KVTUNE, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=kvtune_env(cache),
        timeout=timeout,
    )


def start_kvtune(*args: str, cwd: Path, cache: Path, log: Path) -> subprocess.Popen:
    """`kvtune <args>` in the background, output to log."""
    with log.open("w") as out:
        return subprocess.Popen(
            [*KVTUNE, *args], cwd=cwd, env=kvtune_env(cache), stdout=out, stderr=subprocess.STDOUT
        )
