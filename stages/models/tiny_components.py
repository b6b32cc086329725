"""Tiny tokenizers, text encoders and VAEs of the real classes, built locally (no hub), for the tiny families.

The vocabularies are small (characters and a few merges), so the tiny models encode any prompt; their
weights are random. Used only to build the tiny families (``tiny-sana``, ``tiny-flux``, ``tiny-sd3``,
``tiny-z-image``, ``tiny-qwen-image``, ``tiny-flux2``) on first use and in tests; the real families load the
published tokenizers and encoders from ``model.path``.
"""

from __future__ import annotations

import string

import torch
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

_CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation


def clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """CLIP's byte-level BPE over the 256-byte alphabet (and its ``</w>`` forms), no merges, 77 tokens.
    SD3's second tokenizer pads with ``!``, as the published CLIP-G tokenizer does."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab |= {c + "</w>": len(alphabet) + i for i, c in enumerate(alphabet)}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], pad_token=pad_token, model_max_length=77)


def t5_tokenizer() -> T5TokenizerFast:
    """A T5-style Unigram tokenizer (pad 0, eos 1, unk 2) over characters and ``▁``-prefixed characters."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + c, -4.0) for c in _CHARS] + [(c, -5.0) for c in _CHARS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def gemma_tokenizer() -> GemmaTokenizer:
    """A Gemma-style byte-fallback BPE (pad 0, eos 1, bos 2, unk 3), adding BOS like the published one."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    vocab |= {f"<0x{i:02X}>": 5 + i for i in range(256)}
    for c in ["▁", *_CHARS, "\n"]:
        vocab.setdefault(c, len(vocab))
    merges = []
    for c in string.ascii_lowercase:
        vocab["▁" + c] = len(vocab)
        merges.append(("▁", c))
    return GemmaTokenizer(
        vocab=vocab, merges=merges, model_max_length=8192, add_bos_token=True, add_eos_token=False, padding_side="right"
    )


#: The chat template of the tiny Qwen tokenizers: Qwen's ChatML turns (``<|im_start|>role\n...<|im_end|>\n``),
#: enough for the pipelines' ``apply_chat_template`` and prompt templates; the published tokenizers ship their own.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tokenizer() -> Qwen2Tokenizer:
    """Qwen's byte-level BPE over the 256-byte alphabet, no merges, with the ChatML special tokens
    (``<|endoftext|>`` pads, as the published Qwen2.5/Qwen3 tokenizers) and a ChatML chat template."""
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=4096
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def qwen3_encoder(
    tokenizer: Qwen2Tokenizer, hidden: int, seed: int = 0, layers: int = 2, lm_head: bool = False
) -> Qwen3Model | Qwen3ForCausalLM:
    """A small Qwen3 model, without the LM head (Z-Image's ``Qwen3Model``) or with it (FLUX.2-klein's
    ``Qwen3ForCausalLM``); the pipelines read its hidden states."""
    torch.manual_seed(seed)
    return (Qwen3ForCausalLM if lm_head else Qwen3Model)(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=hidden // 2,
            max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()


def clip_text_model(
    tokenizer: CLIPTokenizer, hidden: int, projection: int | None = None, seed: int = 0, act: str = "quick_gelu"
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A 2-layer CLIP text model (with the projection head when ``projection`` is given)."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection or hidden,
        hidden_act=act,
        layer_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return (CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)).eval()


def t5_encoder(tokenizer: T5TokenizerFast, d_model: int, seed: int = 0) -> T5EncoderModel:
    """A 2-layer T5 v1.1-style encoder (gated GELU, untied embeddings)."""
    torch.manual_seed(seed)
    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=8,
            d_ff=2 * d_model,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()


def gemma2_encoder(tokenizer: GemmaTokenizer, hidden: int, seed: int = 0) -> Gemma2Model:
    """A 2-layer Gemma-2 model (SANA takes its last hidden state, so the model without the LM head)."""
    torch.manual_seed(seed)
    return Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=8192,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).eval()


def autoencoder_kl(
    scaling_factor: float, shift_factor: float, seed: int = 0, latent_channels: int = 4
):  # -> diffusers.AutoencoderKL
    """A 2-block ``AutoencoderKL`` (x2 downsampling, 4 latent channels unless told) with the family's scaling and
    shift."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )
