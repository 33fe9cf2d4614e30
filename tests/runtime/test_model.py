"""The decoder against transformers on the same weights (fp32, CPU), and the attention contract
the engine relies on: post-RoPE keys cached once give the same logits as a full recompute.

Relative error is max |ours - transformers| / max |transformers| over all logits compared.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from kvtune.runtime.errors import ConfigError
from kvtune.runtime.model import DecoderModel, DenseCausalAttention
from kvtune.runtime.tokenizer import Tokenizer

TOLERANCE = 1e-4
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.1,  # large enough that attention patterns and RoPE matter
)
TINY_MODELS = {
    "llama-gqa2": LlamaConfig(**SMALL, num_key_value_heads=2),
    "llama-bias": LlamaConfig(**SMALL, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    # original context 32, head_dim 16: RoPE pairs in all three llama3 bands (kept, blended,
    # slowed); the test sequences reach position 40.
    "llama3-rope": LlamaConfig(
        **SMALL,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
    ),
    "mistral-gqa4": MistralConfig(**SMALL, num_key_value_heads=1, sliding_window=None),
    "qwen2-tied": Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
}
SEQ_LENS = (13, 41)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


@pytest.fixture(params=sorted(TINY_MODELS))
def tiny_pair(request, tmp_path) -> tuple[torch.nn.Module, DecoderModel]:
    """(transformers model, our model) on the same random weights, saved as safetensors."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(TINY_MODELS[request.param]).eval()
    reference.save_pretrained(tmp_path)
    return reference, DecoderModel.from_checkpoint(tmp_path, dtype="fp32")


def packed_inputs(seq_lens, vocab_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random sequences and the positions of their packing (each restarts at 0)."""
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(vocab_size, (n,), generator=generator) for n in seq_lens]
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    return sequences, positions


@torch.no_grad()
def test_packed_logits_match_transformers(tiny_pair):
    reference, model = tiny_pair
    sequences, positions = packed_inputs(SEQ_LENS, model.config.vocab_size)
    hidden = model(torch.cat(sequences), positions, DenseCausalAttention(SEQ_LENS))
    ours = model.logits(hidden).split(SEQ_LENS)
    for seq, logits in zip(sequences, ours, strict=True):
        assert relative_error(logits, reference(seq[None]).logits[0]) < TOLERANCE


class CachingAttention:
    """The smallest paged-cache stand-in: keeps each layer's post-RoPE k and v of one sequence
    and lets each new query attend to every cached token up to its own position."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer_index, q, k, v):
        cached_k, cached_v = self.keys[layer_index], self.values[layer_index]
        keys = k if cached_k is None else torch.cat([cached_k, k])
        values = v if cached_v is None else torch.cat([cached_v, v])
        self.keys[layer_index], self.values[layer_index] = keys, values
        visible = torch.ones(q.shape[0], keys.shape[0], dtype=torch.bool)
        visible = visible.tril(diagonal=keys.shape[0] - q.shape[0])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=visible,
            enable_gqa=True,
        )
        return out.transpose(0, 1)


@torch.no_grad()
def test_chunked_prefill_and_decode_over_cached_keys_match_full_recompute(tiny_pair):
    _, model = tiny_pair
    (tokens,), _ = packed_inputs([20], model.config.vocab_size)
    full = model.logits(model(tokens, torch.arange(20), DenseCausalAttention([20])))
    cache = CachingAttention(model.config.num_layers)
    steps = [range(0, 7), range(7, 16), *[range(i, i + 1) for i in range(16, 20)]]
    incremental = torch.cat(
        [model.logits(model(tokens[list(s)], torch.tensor(list(s)), cache)) for s in steps]
    )
    assert relative_error(incremental, full) < 1e-5


@torch.no_grad()
def test_bf16_weights_and_logits_stay_close_to_fp32(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TINY_MODELS["llama-gqa2"]).save_pretrained(tmp_path)
    (tokens,), positions = packed_inputs([24], SMALL["vocab_size"])
    logits = {}
    for dtype in ("fp32", "bf16"):
        model = DecoderModel.from_checkpoint(tmp_path, dtype=dtype)
        logits[dtype] = model.logits(model(tokens, positions, DenseCausalAttention([24])))
    assert model.dtype == torch.bfloat16 and logits["bf16"].dtype == torch.float32
    assert relative_error(logits["bf16"], logits["fp32"]) < 0.05


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="model.dtype='fp8'"):
        DecoderModel.from_checkpoint(tmp_path, dtype="fp8")


@pytest.fixture(scope="module")
def smollm2(smollm2_folder) -> tuple[DecoderModel, torch.nn.Module, list[int]]:
    """Our SmolLM2, transformers' Llama on the same folder, and a chat prompt's ids."""
    model = DecoderModel.from_checkpoint(smollm2_folder, dtype="fp32")
    reference = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    prompt = Tokenizer.from_folder(smollm2_folder).encode_chat(
        [{"role": "user", "content": "Name the capital of France in one word."}]
    )
    return model, reference, prompt


@torch.no_grad()
def test_smollm2_logits_match_transformers(smollm2):
    model, reference, prompt = smollm2
    ids = torch.tensor(prompt)
    ours = model.logits(model(ids, torch.arange(len(ids)), DenseCausalAttention([len(ids)])))
    assert relative_error(ours, reference(ids[None]).logits[0]) < TOLERANCE


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_greedy_tokens_match_transformers_generate(smollm2):
    model, reference, prompt = smollm2
    new_tokens = 8
    ids = list(prompt)
    for _ in range(new_tokens):  # full recompute: the whole sequence every step
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention([len(ids)]))
        ids.append(int(model.logits(hidden[-1:]).argmax(-1)))
    # An explicit mask: the prompt holds <|im_end|>, which is also the pad token, and generate
    # would otherwise mask it out as padding.
    expected = reference.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )[0].tolist()
    assert ids == expected
