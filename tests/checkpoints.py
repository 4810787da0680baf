"""Tiny random checkpoints of the architectures the torch backend serves (specdec.runtime.architectures),
each with its family's features switched on, saved with the tests' character tokenizer.

Two layers, hidden 32-64, built from transformers' own config classes: no download. Windows are
shorter than every prompt the tests use, so a layer's sliding window changes what it computes.
Biases are filled in (transformers initialises them to zero, which would hide a bias the backend
dropped) and the output layer is scaled up, so near-ties between the top two tokens are rare.
"""

from __future__ import annotations

import torch

from tests.conftest import make_tokenizer

WINDOW = 6  # a sliding window shorter than every prompt of the tests
SMALL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# model_type -> what its tiny config switches on (beyond SMALL)
CONFIGS = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),  # MoE router
    "qwen2": dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),  # q/k/v biases; layer 1 windowed
    "qwen2_moe": dict(
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, head_dim=16),  # q/k norms
    "qwen3_moe": dict(
        use_sliding_window=True, sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
    "gemma": dict(head_dim=16),  # embedding scaling
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=20.0, final_logit_softcapping=10.0),
    "gemma3_text": dict(
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=10.0,
    ),
    "phi3": dict(sliding_window=WINDOW, partial_rotary_factor=0.5),
    "olmo2": {},  # q/k norms, post-norms
    "gpt_neox": dict(rotary_pct=0.25, use_parallel_residual=True),  # partial rotary, parallel blocks
    "gpt2": {},  # learned absolute positions
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True),
    "starcoder2": dict(sliding_window=WINDOW, use_bias=True),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "cohere": dict(logit_scale=0.5, use_qk_norm=True),
    "cohere2": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
    "exaone4": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0, embedding_multiplier=2.0),
    "glm": {},  # partial rotary, interleaved
    "glm4": {},  # post-norms
    "helium": dict(head_dim=8),
    "internlm3": {},
    "ernie4_5": {},
    "arcee": {},  # ReLU^2 MLP
    "gpt_bigcode": {},  # multi-query attention, learned positions
    "gptj": dict(rotary_dim=4),  # parallel attention and MLP, partial rotary
    "codegen": dict(rotary_dim=4),
}


def tiny_config(kind: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    tok = make_tokenizer()
    kwargs = {**SMALL, **CONFIGS.get(kind, {}), **overrides}
    if kind == "gpt2":
        kwargs.pop("intermediate_size")
        kwargs.pop("num_key_value_heads")
    return AutoConfig.for_model(
        kind,
        vocab_size=vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
        **kwargs,
    )


def tiny_checkpoint(
    path, kind: str, seed: int = 0, like=None, noise: float = 0.3, extra_rows: int = 0, vocab_size: int = 0, **overrides
) -> str:
    """A random `kind` model with the character tokenizer, saved to `path`. With `like` (a path): a
    copy of that model with Gaussian noise of relative size `noise` on every weight (a draft that
    agrees with it often, not always). `extra_rows`: the embeddings padded past the tokenizer by that
    many rows, as transformers pads them (resize_token_embeddings: the new rows are the old ones'
    mean, so never the argmax), a model whose output layer is larger than its vocabulary.
    `vocab_size`: that many rows from the start (another model's vocabulary), not the tokenizer's."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    with torch.no_grad():
        if like is not None:
            model = AutoModelForCausalLM.from_pretrained(like)
            for w in model.parameters():
                w.add_(noise * w.std() * torch.randn_like(w))
        else:
            model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab_size or len(tok), **overrides))
            for name, w in model.named_parameters():
                if name.endswith("bias"):
                    w.normal_(0.0, 0.2)
            model.get_output_embeddings().weight.mul_(30.0)
    if extra_rows or like is not None:  # a draft like a padded target: its own row count
        model.resize_token_embeddings(len(tok) + extra_rows)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
