"""Cache keys are content: the model's bytes, the suite and its task data, the producing code and,
for latencies only, the machine. Checked on the real tiny model and real on-disk caches: a
changed input misses, the same content under another path hits, and no path enters a key."""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.eval_validity import validity_key
from kvtune.autotune.cache import JsonCache, key_digest
from kvtune.autotune.config.settings import DeviceSpec, ServeSettings
from kvtune.autotune.config.workload import Workload
from kvtune.autotune.evaluation import load_suite
from kvtune.autotune.evaluation.baseline_cache import baseline_key, baseline_run, suite_fingerprint
from kvtune.autotune.evaluation.evaluator import eval_cache_dir
from kvtune.autotune.evaluation.task_files import task_folder
from kvtune.autotune.search.sensitivity import RuntimeSettings, layer_sensitivity, sensitivity_key
from kvtune.autotune.study.objectives import TrialContext, TrialEvaluator
from kvtune.kernels.native.build import active_kernels
from kvtune.runtime import KVPolicy
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.fingerprint import model_fingerprint, source_fingerprint
from kvtune.runtime.tokenizer import Tokenizer
from tests.autotune.conftest import TINY_PRESETS

WEIGHTS = "model.safetensors"
POLICY = KVPolicy("fp8", "fp4", group_size=16, scale_dtype="e4m3")


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def change_weights(folder: Path, tensor: str = "model.layers.0.self_attn.k_proj.weight") -> None:
    """Rewrite the weights file in place (same path) with one tensor scaled by 1.5."""
    path = folder / WEIGHTS
    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    tensors[tensor] = tensors[tensor] * 1.5
    save_file(tensors, path, metadata=metadata)


def tiny_suite(model: Path, **changes):
    return load_suite({**TINY_PRESETS["eval/tiny.yaml"], "model": str(model), **changes})


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_code_fingerprint_changes_with_an_edit_and_only_then(tmp_path):
    files = {"pkg/__init__.py": "", "pkg/core.py": "SCALE = 2\n", "pkg/sub/io.py": "X = 1\n"}
    tree = write_tree(tmp_path / "a", files) / "pkg"
    before = source_fingerprint([tree])
    assert source_fingerprint([tree]) == before  # re-run, no edit
    elsewhere = write_tree(tmp_path / "b", files) / "pkg"
    assert source_fingerprint([elsewhere]) == before  # the same code in another place

    (tree / "sub" / "io.py").write_text("X = 3\n")  # same size, other bytes
    edited = source_fingerprint([tree])
    assert edited != before
    (tree / "sub" / "io.py").write_text("X = 1\n")
    assert source_fingerprint([tree]) == before  # reverted
    (tree / "extra.py").write_text("")
    added = source_fingerprint([tree])
    assert added not in (before, edited)  # a new module counts
    (tree / "sub" / "io.py").rename(tree / "io.py")
    assert source_fingerprint([tree]) != added  # so does where a module sits in its package


def test_model_fingerprint_follows_bytes_not_path_or_mtime(tiny_model_folder, tmp_path):
    a = copy_model(tiny_model_folder, tmp_path / "a")
    b = copy_model(tiny_model_folder, tmp_path / "b")
    assert model_fingerprint(a) == model_fingerprint(b) == model_fingerprint(tiny_model_folder)
    before = model_fingerprint(a)
    stat = (a / WEIGHTS).stat()
    os.utime(a / WEIGHTS, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same bytes
    assert model_fingerprint(a) == before
    change_weights(a)
    assert model_fingerprint(a) != before
    assert model_fingerprint(b) == before


def test_sensitivity_cache_misses_on_new_weights_and_hits_a_copy(tiny_model_folder, tmp_path):
    a = copy_model(tiny_model_folder, tmp_path / "a")
    b = copy_model(tiny_model_folder, tmp_path / "b")
    cache = JsonCache(tmp_path / "sensitivity")
    arch = arch_from_folder(a)
    first = layer_sensitivity(str(a), a, arch, RuntimeSettings(), cache)
    assert layer_sensitivity(str(b), b, arch, RuntimeSettings(), cache) == first
    assert len(list(cache.folder.iterdir())) == 1  # the copy hit

    change_weights(a)
    changed = layer_sensitivity(str(a), a, arch, RuntimeSettings(), cache)
    assert len(list(cache.folder.iterdir())) == 2  # same path, new bytes: measured again
    assert changed != first


def test_baseline_misses_when_the_suite_or_its_task_data_change(tiny_model_folder, tmp_path):
    root = tmp_path / "eval"
    model = tiny_model_folder
    tokenizer = Tokenizer.from_folder(model)
    suite = tiny_suite(model)
    folder = task_folder(suite, tokenizer, root)
    assert baseline_run(suite, folder, model, root)[1] is True
    assert baseline_run(suite, folder, model, root)[1] is False

    # The same definition under another name, and the model under another path: a hit.
    copy = copy_model(model, tmp_path / "copy")
    renamed = tiny_suite(copy, name="renamed")
    renamed_folder = task_folder(renamed, tokenizer, root)
    assert baseline_run(renamed, renamed_folder, copy, root)[1] is False

    # A setting that leaves the task data alone but decides the scores: a miss.
    longer_tail = tiny_suite(model, kl_tail_tokens=4)
    assert baseline_run(longer_tail, task_folder(longer_tail, tokenizer, root), model, root)[1]

    # The same definition with other generated rows (a changed generator): a miss.
    data_file = folder.path / "wiki_ppl.jsonl"
    row = json.loads(data_file.read_text().splitlines()[0])
    row["text"] = row["text"][: len(row["text"]) // 2]
    data_file.write_text(json.dumps(row) + "\n")
    regenerated = task_folder(suite, tokenizer, root)
    assert suite_fingerprint(suite, regenerated) != suite_fingerprint(suite, folder)
    assert baseline_run(suite, regenerated, model, root)[1] is True


@pytest.fixture()
def trial_context(tiny_model_folder, tmp_path, monkeypatch) -> TrialContext:
    """The tiny model on the tiny suite and workload, with a fresh kvtune cache."""
    monkeypatch.setenv("KVTUNE_CACHE", str(tmp_path / "kvtune"))
    workload = Workload.from_dict(TINY_PRESETS["workload/tiny.yaml"])
    return TrialContext(
        model=str(tiny_model_folder),
        folder=tiny_model_folder,
        arch=arch_from_folder(tiny_model_folder),
        device=DeviceSpec("test", 16.0, 100.0),
        serve=ServeSettings(max_model_len=workload.max_model_len),
        workload=workload,
        suite=tiny_suite(tiny_model_folder).to_dict(),
        runtime=RuntimeSettings(),
    )


def test_another_machine_re_measures_latency_and_reuses_accuracy(trial_context, tmp_path):
    cache = JsonCache(tmp_path / "evaluations")
    here = TrialEvaluator(trial_context, cache)
    first, cached = here(POLICY)
    assert not cached and len(list(cache.folder.iterdir())) == 2  # accuracy and latency
    again, cached = TrialEvaluator(trial_context, cache)(POLICY)
    assert cached and again == first

    other = {**here.machine, "cpu": "another CPU model"}
    there, cached = TrialEvaluator(trial_context, cache, machine=other)(POLICY)
    assert not cached and len(list(cache.folder.iterdir())) == 3  # one new latency entry
    # Accuracy read back (its recorded cost too), latency timed again.
    for name in ("accuracy_retention", "kl", "eval_seconds"):
        assert there[name] == first[name]
    assert there["latency_seconds"] != first["latency_seconds"]


def test_no_key_holds_a_path(tiny_model_folder, trial_context, tmp_path):
    """Every cache's key, built for the same model at two paths: equal, and path-free."""
    copy = copy_model(tiny_model_folder, tmp_path / "copy")
    copied_context = dataclasses.replace(
        trial_context, model=str(copy), folder=copy, suite=tiny_suite(copy).to_dict()
    )
    tokenizer = Tokenizer.from_folder(tiny_model_folder)

    def keys(folder: Path, context: TrialContext) -> list[dict]:
        suite = tiny_suite(folder)
        evaluator = TrialEvaluator(context, None)
        return [
            baseline_key(suite, task_folder(suite, tokenizer, eval_cache_dir()), folder),
            evaluator.accuracy_key(POLICY),
            evaluator.latency_key(POLICY),
            sensitivity_key(folder, RuntimeSettings()),
            validity_key(POLICY, suite),
        ]

    original, copied = keys(tiny_model_folder, trial_context), keys(copy, copied_context)
    assert original == copied
    for key in original:
        text = json.dumps(key)
        assert str(tmp_path) not in text and str(tiny_model_folder) not in text
        assert str(Path.home()) not in text
    with pytest.raises(TypeError):
        key_digest({"model": tiny_model_folder})  # a Path cannot slip into a key


def test_weights_change_misses_every_key(tiny_model_folder, trial_context, tmp_path):
    model = copy_model(tiny_model_folder, tmp_path / "model")
    context = dataclasses.replace(
        trial_context, model=str(model), folder=model, suite=tiny_suite(model).to_dict()
    )

    def keys() -> list[str]:
        evaluator = TrialEvaluator(context, None)
        return [
            key_digest(evaluator.accuracy_key(POLICY)),
            key_digest(evaluator.latency_key(POLICY)),
            key_digest(sensitivity_key(model, RuntimeSettings())),
            key_digest(validity_key(POLICY, tiny_suite(model))),
        ]

    before = keys()
    change_weights(model)
    after = keys()
    assert all(old != new for old, new in zip(before, after, strict=True))


def test_every_key_names_the_compute_path(tiny_model_folder, trial_context, monkeypatch):
    """The C kernels and their torch twins differ in the last bits: with KVTUNE_NATIVE=0 (set
    as the native build code reads it, in the environment) the torch paths compute, and every
    key of a cached number misses; unset again, every key is what it was."""
    if not any(active_kernels().values()):
        pytest.skip("no native kernel builds here: the torch paths run either way")
    suite = tiny_suite(tiny_model_folder)
    folder = task_folder(suite, Tokenizer.from_folder(tiny_model_folder), eval_cache_dir())

    def keys() -> list[str]:
        evaluator = TrialEvaluator(trial_context, None)
        return [
            key_digest(key)
            for key in (
                baseline_key(suite, folder, tiny_model_folder),
                evaluator.accuracy_key(POLICY),
                evaluator.latency_key(POLICY),
                sensitivity_key(tiny_model_folder, RuntimeSettings()),
                validity_key(POLICY, suite),
            )
        ]

    native = keys()
    monkeypatch.setenv("KVTUNE_NATIVE", "0")
    assert not any(active_kernels().values())
    torch_only = keys()
    assert all(a != b for a, b in zip(native, torch_only, strict=True))
    monkeypatch.delenv("KVTUNE_NATIVE")
    assert keys() == native
