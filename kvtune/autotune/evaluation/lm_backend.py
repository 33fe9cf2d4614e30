"""The `kvtune` lm-eval model: lm-eval requests scored by the kvtune runtime under a KV policy.

Log-likelihoods come from `LLM.prompt_logits_batch`, the chunked prefill through the policy's
quantized / compressed cache, so they measure exactly what serving under the policy would
compute. Tokenization and windowing follow lm-eval's `hf` model (context/continuation split,
rolling windows, left truncation), so with `auto` K/V dtypes the numbers equal lm-eval's own on
the same weights. Requests whose tokens are prefixes of others share their prefill pass
(prefill_plan.py). An optional observer sees the log-probabilities at every scored position
(fidelity.py records them against the uncompressed baseline). With a unit cache, each runtime
call's results (log-likelihoods, greedy answers, the observer's records) are stored as the call
finishes and read back on a rerun (unit_cache.py), so an interrupted evaluation resumes there.

    lm = KVTuneLM(model="smollm2-135m", k_dtype="fp8", v_dtype="fp8")
    lm_eval.simple_evaluate(model=lm, tasks=[...])
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvtune.autotune.evaluation.prefill_plan import PrefillUnit, prefill_units
from kvtune.autotune.evaluation.shared_generation import cut_at_stops, greedy_generate
from kvtune.autotune.evaluation.unit_cache import UnitCache, UnitRuns
from kvtune.runtime.llm import LLM, as_policy
from kvtune.runtime.policy import KVPolicy

DEFAULT_MAX_GEN_TOKS = 256


class Observer(Protocol):
    """Turns each scored request's log-probabilities into a record and keeps it.

    key: (context, continuation) of a loglikelihood request, (text, window index) of a rolling
    window. logprobs: fp32 log-softmax rows [num_tail + continuation tokens, vocab], the
    num_tail prompt positions before the continuation first. A record is plain data (tensors,
    numbers, None: what torch.load reads with weights_only) that the unit cache stores in place
    of the logits; `context` names by content what besides the logits decides the records of
    these requests (a reference they are compared with), for the cache's key.
    """

    def measure(self, key: tuple[str, ...], logprobs: torch.Tensor, num_tail: int) -> Any: ...

    def keep(self, key: tuple[str, ...], record: Any) -> None: ...

    def context(self, keys: Sequence[tuple[str, ...]]) -> str: ...


@dataclass(frozen=True)
class ScoringItem:
    """One scored span: the model reads `inputs`; its last len(targets) positions predict
    `targets`."""

    key: tuple[str, ...]
    inputs: list[int]
    targets: list[int]
    num_tail: int

    @property
    def end(self) -> int:
        return len(self.inputs)

    @property
    def first_read(self) -> int:
        """First position whose logits the item reads (its tail, then its targets)."""
        return self.end - len(self.targets) - self.num_tail


@register_model("kvtune")
class KVTuneLM(TemplateLM):
    """lm-eval model over the kvtune runtime (`--model kvtune --model_args k_dtype=fp8,...`).

    policy: a KVPolicy or dict; policy_fields (k_dtype=..., csa_ratio=...) override it field
    by field. kl_tail_tokens: prompt positions before each continuation also passed to the
    observer. batch_tokens: prompt tokens prefilled per runtime call (bounds the fp32 logits
    held at once; one call is one unit of the unit cache). units: where finished calls are
    stored and read back (None: nothing stored). batch_size: lm-eval's, used as max_num_seqs
    when it is a number; max_batch_size: accepted from lm-eval's command line, unused (the
    engine batches).
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        policy: KVPolicy | Mapping[str, Any] | None = None,
        backend: str = "torch",
        device: str = "cpu",
        dtype: str = "fp32",
        max_num_seqs: int = 4,
        max_model_len: int | None = None,
        batch_tokens: int = 8192,
        kl_tail_tokens: int = 0,
        observer: Observer | None = None,
        units: UnitCache | None = None,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        **policy_fields: Any,
    ) -> None:
        super().__init__()
        if policy_fields:
            policy = KVPolicy.from_dict({**as_policy(policy).to_dict(), **policy_fields})
        if isinstance(batch_size, int):
            max_num_seqs = batch_size
        self.llm = LLM(
            model,
            policy=policy,
            backend=backend,
            device=device,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            max_model_len=max_model_len,
        )
        self.model_name = model
        self.tokenizer = self.llm.tokenizer
        self.batch_tokens = batch_tokens
        self.kl_tail_tokens = kl_tail_tokens
        self.observer = observer
        self.runs = UnitRuns(self.llm, model, backend, units)

    @property
    def policy(self) -> KVPolicy:
        return self.llm.policy

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.token_id("eos_token")
        return eos if eos is not None else self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """Token before a rolling window's first token: BOS, else EOS (as lm-eval's hf)."""
        bos = self.tokenizer.token_id("bos_token")
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.config.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return DEFAULT_MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return self.model_name

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
    ) -> list[int]:
        """Token ids; by default with the tokenizer's special tokens, unless the text already
        starts with the BOS token (as lm-eval's hf model)."""
        if add_special_tokens is None:
            bos = self.tokenizer.special_tokens.get("bos_token")
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt)

    def _item(
        self, key: tuple[str, ...], context: list[int], continuation: list[int], tail: int
    ) -> ScoringItem:
        """lm-eval's hf truncation: keep the last max_length + 1 tokens, feed all but the last."""
        whole = (context + continuation)[-(self.max_length + 1) :]
        inputs = whole[:-1]
        targets = continuation[-min(len(continuation), len(inputs)) :] if continuation else []
        return ScoringItem(key, inputs, targets, min(tail, len(inputs) - len(targets)))

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        items = [
            self._item(key, context, continuation, self.kl_tail_tokens)
            for key, context, continuation in requests
        ]
        results = self._score(items, "loglikelihood", disable_tqdm)
        for item, result in zip(items, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", item.key, result)
        return results

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Sum of token log-likelihoods of each text over lm-eval's disjoint rolling windows."""
        items, owners = [], []
        for owner, (text,) in enumerate(request.args for request in requests):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for index, window in enumerate(windows):
                context, continuation = lm_utils.make_disjoint_window(window)
                items.append(self._item((text, str(index)), context, continuation, 0))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(
            owners, self._score(items, "loglikelihood_rolling", disable_tqdm), strict=True
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score(
        self, items: list[ScoringItem], what: str, disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """(log-likelihood of the targets, whether greedy decoding yields them) per item, one
        runtime call (and unit) per batch of prefill passes."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(items)
        units = prefill_units([item.inputs for item in items], self.batch_tokens)
        bar = tqdm(
            total=sum(len(items[h].inputs) for unit in units for h in unit.hosts),
            unit="tok",
            desc=f"kvtune {what}",
            disable=disable_tqdm,
        )
        with bar:
            for unit in units:
                # Each pass projects to the vocabulary only from the first position it serves.
                starts = [
                    min([items[i].first_read for i in indices] + [len(items[host].inputs) - 1])
                    for host, indices in zip(unit.hosts, unit.served, strict=True)
                ]
                reads = [
                    [position, items[i].end, items[i].targets, items[i].num_tail]
                    for position, indices in enumerate(unit.served)
                    for i in indices
                ]
                keys = [items[i].key for i in unit.members]
                inputs = {
                    "prompts": [items[h].inputs for h in unit.hosts],
                    "starts": starts,
                    "reads": reads,
                    "observed": self.observer.context(keys) if self.observer else None,
                }
                call = functools.partial(self._score_unit, items, unit, starts)
                for index, (logprob, greedy, record) in zip(
                    unit.members, self.runs.run(inputs, call), strict=True
                ):
                    results[index] = (logprob, greedy)
                    if self.observer is not None:
                        self.observer.keep(items[index].key, record)
                bar.update(sum(len(items[h].inputs) for h in unit.hosts))
        return results

    def _score_unit(
        self, items: list[ScoringItem], unit: PrefillUnit, starts: list[int]
    ) -> list[tuple[float, bool, Any]]:
        """One runtime call: (log-likelihood, greedy, observer record) per member item."""
        logits = self.llm.prompt_logits_batch([items[h].inputs for h in unit.hosts], starts)
        return [
            self._read(items[index], host_logits, start)
            for host_logits, start, indices in zip(logits, starts, unit.served, strict=True)
            for index in indices
        ]

    def _read(
        self, item: ScoringItem, logits: torch.Tensor, offset: int
    ) -> tuple[float, bool, Any]:
        """Score one item from its host's logits, whose first row is position `offset`."""
        rows = torch.log_softmax(logits[item.first_read - offset : item.end - offset].float(), -1)
        scored = rows[item.num_tail :]
        targets = torch.tensor(item.targets, dtype=torch.long)
        logprob = float(scored.gather(1, targets[:, None]).sum())
        greedy = bool((scored.argmax(dim=-1) == targets).all())
        record = None
        if self.observer is not None:
            record = self.observer.measure(item.key, rows, item.num_tail)
        return logprob, greedy, record

    def _greedy(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[list[int]]:
        """Greedy continuations (shared_generation.py), one runtime call (and unit) per batch of
        conversations: prompts read from one host's prefill."""
        outputs: list[list[int]] = [[] for _ in prompts]
        for unit in prefill_units(prompts, self.batch_tokens):
            members = [prompts[i] for i in unit.members]
            inputs = {"generate": members, "max_new_tokens": max_new, "until": until}
            call = functools.partial(self._generate_unit, members, max_new, until)
            for index, tokens in zip(unit.members, self.runs.run(inputs, call), strict=True):
                outputs[index] = tokens
        return outputs

    def _generate_unit(
        self, prompts: list[list[int]], max_new: int, until: list[str]
    ) -> list[list[int]]:
        """One runtime call: the greedy token ids of each prompt."""
        return greedy_generate(self.llm, prompts, max_new, until).token_ids

    def _sample(self, prompts: list[list[int]], max_new: int, temperature: float) -> list[Any]:
        """Sampled token ids: one call, never stored (the engine's one random stream runs
        through every call, so a call's results depend on the calls before it)."""
        generations = self.llm.generate(prompts, max_new, temperature)
        return [generation.token_ids for generation in generations]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Continuations cut at the first `until` string, batched through the engine per
        distinct set of generation arguments; greedy ones share the prefill of prompts that
        extend one another (shared_generation.py) and are stored per runtime call, sampled ones
        run one prompt each."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True)].append(index)
        results = [""] * len(requests)
        for kwargs_text, indices in tqdm(
            groups.items(), desc="kvtune generate", disable=disable_tqdm
        ):
            kwargs = json.loads(kwargs_text)
            # The engine stops at the tokenizer's EOS ids; `until` strings cut the text after.
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            contexts = [requests[i].args[0] for i in indices]
            prompts = [self.tok_encode(c)[-(self.max_length - max_new) :] for c in contexts]
            if temperature == 0:
                outputs = self._greedy(prompts, max_new, until)
            else:
                call = functools.partial(self._sample, prompts, max_new, temperature)
                outputs = self.runs.run(None, call)
            for index, output in zip(indices, outputs, strict=True):
                text = cut_at_stops(self.tokenizer.decode(output), until)
                results[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return results
