"""A model's attention profile and what a search space derives from it (issue 40 item 2).

Measures (or reads from the profiles cache `kvtune tune` uses) the per-layer attention profile
at a context (kvtune/autotune/search/attention_profile.py) with the geometry a conf/search space
takes, then prints each layer's figures and the space's derived selection groups: each group's
largest need, budget share and reuse, and the csa_topk candidate, as `kvtune tune` would draw them.

    .venv/bin/python -m benchmarks.attention_profiles [--model smollm2-135m] [--context 2048]
        [--search default] [--groups 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from kvtune.autotune.cache import JsonCache, default_cache_folder
from kvtune.autotune.search.attention_profile import attention_profile
from kvtune.autotune.search.profiles import Profiles
from kvtune.autotune.search.sensitivity import RuntimeSettings
from kvtune.autotune.search.space import SearchConfig
from kvtune.runtime.arch import arch_from_folder
from kvtune.runtime.model_source import resolve_model

SEARCH_DIR = Path(__file__).resolve().parents[1] / "conf" / "search"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--search", default="default")
    parser.add_argument("--groups", type=int, default=3)
    args = parser.parse_args()
    folder = resolve_model(args.model)
    arch = arch_from_folder(folder)
    search = yaml.safe_load((SEARCH_DIR / f"{args.search}.yaml").read_text())
    config = SearchConfig.from_dict(search, arch)
    geometry = config.profile_geometry(args.context)
    cache = JsonCache(default_cache_folder("profiles"))
    profile = attention_profile(folder, geometry, RuntimeSettings(), cache)
    print(f"{args.model} at {args.context} tokens: {geometry}")
    print("| layer | older mass | blocks needed | choice overlap | key outlier |")
    print("|---|---|---|---|---|")
    rows = zip(
        profile.older_mass,
        profile.blocks_needed,
        profile.choice_overlap,
        profile.key_outlier,
        strict=True,
    )
    for layer, (mass, need, overlap, outlier) in enumerate(rows):
        print(f"| {layer} | {mass:.3f} | {need:.1f} | {overlap:.2f} | {outlier:.1f} |")
    profiles = Profiles(None, profile)
    groups = profiles.selection_groups(args.groups, arch.num_layers)
    assert groups is not None
    print(f"\ncsa_topk candidate: {profiles.budget(groups)} blocks of {geometry.block_size}")
    print("| selection group | layers | largest need | share | reuses |")
    print("|---|---|---|---|---|")
    derived = zip(
        groups,
        profiles.group_needs(groups),
        profiles.shares(groups),
        profiles.reuses(groups),
        strict=True,
    )
    for index, (layers, need, share, reuse) in enumerate(derived):
        print(f"| {index} | {', '.join(map(str, layers))} | {need:.1f} | {share} | {reuse} |")
    print(f"\nper-channel keys: {profiles.channel_keys()}")


if __name__ == "__main__":
    main()
