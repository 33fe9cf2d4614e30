"""The accuracy suite's settings: which tasks, how many samples, how long, on which runtime.

A suite is one frozen, validated dataclass with a YAML form (conf/eval/<preset>.yaml), so the
CLI, the tuner and the benchmarks share presets and a bad value fails before any model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvtune.autotune.config.settings import build_model_arch
from kvtune.runtime.arch import ModelArch, arch_from_folder
from kvtune.runtime.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
PRESET_DIR = CONF_DIR / "eval"
MODEL_PRESET_DIR = CONF_DIR / "model"
TASK_NAMES: tuple[str, ...] = (
    "wiki_ppl",
    "passkey",
    "multikey",
    "codes",
    "doc_mcq",
    "passkey_greedy",
    "multikey_greedy",
    "codes_greedy",
)
MIN_CONTEXT_TOKENS = 256


def _field(name: str) -> str:
    return f"eval.{name}"


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(_field(name), value, f"an integer >= {minimum}")
    return value


def model_arch(model: str) -> ModelArch:
    """A suite's model's architecture: its preset (conf/model/<model>.yaml) or a local folder's
    config.json; its max_position_embeddings bounds the suite's haystacks."""
    preset = MODEL_PRESET_DIR / f"{model}.yaml"
    if preset.is_file():
        return build_model_arch(yaml.safe_load(preset.read_text()))
    if Path(model).expanduser().is_dir():
        return arch_from_folder(model)
    presets = ", ".join(sorted(p.stem for p in MODEL_PRESET_DIR.glob("*.yaml")))
    raise ConfigError(_field("model"), model, f"a model preset ({presets}) or a local folder")


def _check_context(name: str, value: object, arch: ModelArch) -> int:
    """A haystack length: at least MIN_CONTEXT_TOKENS, at most the model's positions."""
    tokens = _check_int(name, value, MIN_CONTEXT_TOKENS)
    arch.check_context(tokens, _field(name))
    return tokens


@dataclass(frozen=True)
class TaskSize:
    """How much of one task a suite runs.

    docs: haystacks (each costs one prefill pass of about context_tokens).
    questions: questions asked about each haystack, one chat turn each; later turns extend the
        same prompt, so they share its prefill pass.
    context_tokens: this task's haystack length (tokens) when it differs from the suite's
        (a greedy task may run longer than the rest); None = the suite's.
    """

    docs: int
    questions: int = 1
    context_tokens: int | None = None


@dataclass(frozen=True)
class EvalSuite:
    """An accuracy suite: generated tasks (seeded) and the runtime that scores them.

    context_tokens: target prompt length of every haystack and perplexity document (tokens).
    tasks: task name -> TaskSize; tasks left out are not run.
    kl_tail_tokens: prompt positions before each answer whose next-token distributions also
        enter the KL divergence (besides the answer positions).
    batch_tokens: prompt tokens prefilled per runtime call; bounds the fp32 logits held at
        once (vocab x 4 bytes a token: 8192 tokens of SmolLM2 are 1.6 GB).
    backend, device, dtype, max_num_seqs: how the runtime runs (LLM arguments).
    """

    name: str = "custom"
    model: str = "smollm2-135m"
    seed: int = 0
    context_tokens: int = 1024
    tasks: Mapping[str, TaskSize] = dataclasses.field(
        default_factory=lambda: {name: TaskSize(docs=1) for name in TASK_NAMES}
    )
    kl_tail_tokens: int = 16
    batch_tokens: int = 8192
    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "fp32"
    max_num_seqs: int = 4

    def __post_init__(self) -> None:
        _check_int("seed", self.seed, 0)
        arch = model_arch(self.model)
        _check_context("context_tokens", self.context_tokens, arch)
        _check_int("kl_tail_tokens", self.kl_tail_tokens, 0)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if not self.tasks:
            raise ConfigError(_field("tasks"), {}, f"at least one of {', '.join(TASK_NAMES)}")
        sizes = {}
        for name, size in self.tasks.items():
            if name not in TASK_NAMES:
                raise ConfigError(_field(f"tasks.{name}"), size, f"a task: {', '.join(TASK_NAMES)}")
            sizes[name] = _task_size(name, size, arch)
        object.__setattr__(self, "tasks", sizes)
        longest = max([self.context_tokens] + [s.context_tokens or 0 for s in sizes.values()])
        _check_int("batch_tokens", self.batch_tokens, longest)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvalSuite:
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(
                    _field(str(key)), data[key], f"unknown field; known: {', '.join(sorted(known))}"
                )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (YAML form)."""
        data = dataclasses.asdict(self)
        data["tasks"] = {
            name: {k: v for k, v in dataclasses.asdict(size).items() if v is not None}
            for name, size in self.tasks.items()
        }
        return data

    def data_fingerprint(self) -> str:
        """Hash of what decides the generated task files (model, seed, lengths, sizes)."""
        fields = ("model", "seed", "context_tokens", "tasks")
        return _digest({k: v for k, v in self.to_dict().items() if k in fields})

    def task_context(self, name: str) -> int:
        """Haystack length (tokens) of one task: its own, else the suite's."""
        return self.tasks[name].context_tokens or self.context_tokens

    def run_fingerprint(self) -> str:
        """Hash of everything that decides a policy's scores except the policy (name aside)."""
        return _digest({k: v for k, v in self.to_dict().items() if k != "name"})


def _task_size(name: str, size: object, arch: ModelArch) -> TaskSize:
    if isinstance(size, TaskSize):
        values = dataclasses.asdict(size)
    elif isinstance(size, Mapping):
        values = dict(size)
    else:
        raise ConfigError(_field(f"tasks.{name}"), size, "a mapping {docs: N, questions: M}")
    unknown = set(values) - {"docs", "questions", "context_tokens"}
    if unknown:
        raise ConfigError(
            _field(f"tasks.{name}"), size, "only the fields docs, questions and context_tokens"
        )
    docs = _check_int(f"tasks.{name}.docs", values.get("docs"), 1)
    questions = _check_int(f"tasks.{name}.questions", values.get("questions", 1), 1)
    context = values.get("context_tokens")
    if context is not None:
        _check_context(f"tasks.{name}.context_tokens", context, arch)
    return TaskSize(docs, questions, context)


def _digest(data: Mapping[str, Any]) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def suite_presets() -> list[str]:
    """The names of the suite presets (conf/eval/<name>.yaml)."""
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def suite_fields(suite: str | Path, field: str = "eval") -> dict[str, Any]:
    """The fields a preset name (conf/eval/<name>.yaml) or a YAML path sets, unvalidated;
    field: what a bad name is reported as."""
    path = Path(suite)
    if not path.suffix:
        path = PRESET_DIR / f"{suite}.yaml"
        if not path.is_file():
            presets = ", ".join(suite_presets())
            raise ConfigError(field, str(suite), f"a preset ({presets}) or a YAML file")
    if not path.is_file():
        raise ConfigError(field, str(suite), "a preset name or an existing YAML file")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(field, str(suite), "a YAML mapping of suite fields")
    return dict(data)


def load_suite(suite: EvalSuite | Mapping[str, Any] | str | Path) -> EvalSuite:
    """A suite from itself, a dict, a preset name (conf/eval/<name>.yaml) or a YAML path."""
    if isinstance(suite, EvalSuite):
        return suite
    if isinstance(suite, Mapping):
        return EvalSuite.from_dict(suite)
    return EvalSuite.from_dict(suite_fields(suite))
