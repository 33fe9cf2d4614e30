"""The rules between policy fields declare what they read (the search space checks some of them
over every combination of the candidates of exactly those fields)."""

import random
from collections.abc import Iterator, Mapping
from typing import Any

from kvtune.runtime.kv_dtypes import KV_DTYPES
from kvtune.runtime.policy import (
    BLOCK_SIZES,
    CSA_INDEX_DTYPES,
    CSA_INDEXES,
    CSA_RATIOS,
    CSA_STAGINGS,
    CSA_SUMMARIES,
    K_SCALE_AXES,
    KEEP_FRACTIONS,
    SCALE_DTYPES,
    KVPolicy,
)
from kvtune.runtime.policy.rules import RULES

# Values each field may take on its own; the rules between them are what is under test.
POOLS: dict[str, list[Any]] = {
    "k_dtype": list(KV_DTYPES),
    "v_dtype": list(KV_DTYPES),
    "layer_dtypes": [None, ("fp8/int4", "lloyd4/fp4_4over6"), ("int4_tq/fp16", "fp16/fp16")],
    "group_size": [16, 64, "tensor"],
    "k_group_size": [None, 32, "tensor"],
    "scale_dtype": list(SCALE_DTYPES),
    "k_scale_axis": list(K_SCALE_AXES),
    "recent_unquantized": [0, 64, 1024],
    "csa_ratio": [*CSA_RATIOS, 3],
    "csa_window": [0, 64, 256, 2048],
    "csa_summary": list(CSA_SUMMARIES),
    "csa_topk": [0, 8],
    "layer_csa_topk": [None, (0, 8)],
    "csa_index": list(CSA_INDEXES),
    "csa_index_dtype": list(CSA_INDEX_DTYPES),
    "csa_host": [False, True],
    "csa_staging": list(CSA_STAGINGS),
    "csa_select_every": [1, 4],
    "csa_rescore": [1, 4],
    "layer_csa_select_every": [None, (1, 4)],
    "csa_keep": list(KEEP_FRACTIONS),
    "block_size": list(BLOCK_SIZES),
    "chunk_size": [256, 100],
}


class Recording(Mapping):
    """Field values that remember which fields were read."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = values
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def test_every_rule_reads_only_the_fields_it_declares():
    rng = random.Random(0)
    defaults = vars(KVPolicy())
    read = {id(rule): set() for rule in RULES}
    broken = {id(rule): 0 for rule in RULES}
    for _ in range(4000):
        values = {**defaults, **{name: rng.choice(pool) for name, pool in POOLS.items()}}
        for rule in RULES:
            fields = Recording(values)
            broken[id(rule)] += not rule.holds(fields)
            assert fields.read <= set(rule.reads), (rule.blame, fields.read - set(rule.reads))
            read[id(rule)] |= fields.read
    for rule in RULES:
        assert read[id(rule)] == set(rule.reads), rule.blame  # each declared field is read
        assert broken[id(rule)] > 0, rule.blame  # the samples reach the branch that breaks it
