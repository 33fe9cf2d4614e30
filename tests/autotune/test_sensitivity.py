"""The per-layer fp4 sensitivity profile on a real (tiny) model: one probe per layer and
stream, each the KL of a runtime with only that stream in fp4, cached per model."""

import math

import pytest

from kvtune.autotune.cache import JsonCache
from kvtune.autotune.search.sensitivity import (
    PROFILE_TEXT,
    RuntimeSettings,
    layer_sensitivity,
    mean_kl,
    probe_policy,
)
from kvtune.runtime import LLM, KVPolicy
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.tokenizer import Tokenizer


def test_profile_measures_every_layer_matches_a_fresh_probe_and_is_cached(
    tiny_model_folder, tmp_path
):
    folder, model = tiny_model_folder, str(tiny_model_folder)
    arch = arch_from_folder(folder)
    cache = JsonCache(tmp_path / "sensitivity")
    profile = layer_sensitivity(model, folder, arch, RuntimeSettings(), cache)
    assert len(profile.k_kl) == len(profile.v_kl) == arch.num_layers
    assert all(math.isfinite(kl) and kl > 0 for kl in profile.k_kl + profile.v_kl)

    ids = Tokenizer.from_folder(folder).encode(PROFILE_TEXT)
    reference = LLM(model, KVPolicy("auto", "auto")).prompt_logits(ids)
    for layer, stream, measured in ((0, "k", profile.k_kl[0]), (1, "v", profile.v_kl[1])):
        probe = LLM(model, probe_policy(arch, layer, stream)).prompt_logits(ids)
        assert measured == pytest.approx(mean_kl(reference, probe), rel=1e-6)

    again = layer_sensitivity(model, folder, arch, RuntimeSettings(), cache)
    assert again == profile
    assert len(list((tmp_path / "sensitivity").iterdir())) == 1
