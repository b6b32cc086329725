"""Tiny tokenizers, text encoders and VAEs of the real classes, built locally (no hub), for the tiny twins.

The vocabularies are small (characters and a few merges), so the tiny models encode any prompt; their
weights are random. Used only to build the tiny twins (``tiny-sana``, ``tiny-flux``, ``tiny-sd3``,
``tiny-z-image``, ``tiny-qwen-image``, ``tiny-flux2``) on first use and in tests; the real families load the
published tokenizers and encoders from ``model.path``.
"""

from __future__ import annotations

import string

import torch
from transformers import (
    CLIPConfig,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    GemmaTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
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


#: ChatML turns with the Qwen2.5-VL image and video placeholders (``content`` a string or a list of parts).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen2_5_vl_processor(max_pixels: int = 112 * 112) -> tuple[Qwen2_5_VLProcessor, dict[str, int]]:
    """A ``Qwen2_5_VLProcessor``: byte-level Qwen tokenizer (no merges) with ChatML's and the vision tokens, Qwen2-VL
    image and video processors (at least 56 x 56, at most ``max_pixels`` pixels) and the chat template. Returns it
    and the token ids a ``Qwen2_5_VLConfig`` needs: ``eos_token_id`` (``<|im_end|>``), ``pad_token_id``
    (``<|endoftext|>``), ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
    ``vision_end_token_id``."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    tokenizer = qwen_tokenizer()  # the vision tokens follow ChatML's
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *vision]})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    pixels = {"min_pixels": 56 * 56, "max_pixels": max_pixels}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**pixels),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    )
    names = {"eos_token_id": "<|im_end|>", "pad_token_id": "<|endoftext|>", "image_token_id": "<|image_pad|>"}
    names |= {"video_token_id": "<|video_pad|>", "vision_start_token_id": "<|vision_start|>"}
    names |= {"vision_end_token_id": "<|vision_end|>"}
    return processor, {key: tokenizer.convert_tokens_to_ids(token) for key, token in names.items()}


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


def qwen2_5_vl(
    vocab_size: int, eos_token_id: int, pad_token_id: int | None, vision_ids: dict[str, int], seed: int = 0
) -> Qwen2_5_VLForConditionalGeneration:
    """A small Qwen2.5-VL (2 text layers of width 32, a 1-block vision tower) with its LM head: Qwen-Image's text
    encoder and a VLM judge's model. ``vision_ids``: ``image_token_id``, ``video_token_id``,
    ``vision_start_token_id`` and ``vision_end_token_id``."""
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": vocab_size,
                "rope_scaling": {"mrope_section": [2, 2, 4], "rope_type": "default", "type": "default"},
                "rope_theta": 1000000.0,
                "bos_token_id": None,
                "eos_token_id": eos_token_id,
                "pad_token_id": pad_token_id,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 32,
            },
            vocab_size=vocab_size,
            bos_token_id=None,
            eos_token_id=eos_token_id,
            **vision_ids,
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


def clip_model(
    tokenizer: CLIPTokenizer,
    text: dict[str, int],
    vision: dict[str, int],
    projection_dim: int,
    *,
    vocab_size: int | None = None,
    seed: int = 0,
) -> CLIPModel:
    """A CLIPModel (text and vision towers, projections) over ``tokenizer`` with random weights: ``text`` and
    ``vision`` are transformers' ``CLIPTextConfig``/``CLIPVisionConfig`` sizes (``hidden_size``, ``num_hidden_layers``,
    ...; the vision tower's ``image_size`` and ``patch_size``), the vocabulary the tokenizer's unless ``vocab_size``
    (a published model's, for its parameter count). For the reward tests and benchmarks."""
    config = CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size or len(tokenizer),
            max_position_embeddings=77,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **text,
        ),
        vision_config=vision,
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    return CLIPModel(config)


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


#: The tiny VAEs' shared layout: two blocks of 8 channels (x2 downsampling), no (post-)quant convs, 32 px.
_TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(8, 8),
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
)


def autoencoder_kl(
    scaling_factor: float, shift_factor: float, seed: int = 0, latent_channels: int = 4
):  # -> diffusers.AutoencoderKL
    """A 2-block ``AutoencoderKL`` (x2 downsampling, 4 latent channels unless told) with the family's scaling and
    shift."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        **_TINY_VAE, latent_channels=latent_channels, scaling_factor=scaling_factor, shift_factor=shift_factor
    )


def flux2_vae(seed: int = 0):  # -> diffusers.AutoencoderKLFlux2
    """A 2-block ``AutoencoderKLFlux2`` (x2 downsampling, 4 latent channels) whose batch-norm running statistics are
    not (0, 1), so decoding exercises FLUX.2's de-normalisation."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**_TINY_VAE, latent_channels=4)
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.2, 0.2, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    return vae


#: Mistral's chat turns, enough for FLUX.2-dev's system + user messages (content lists of text parts).
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}"
    "[/INST]{% endif %}{% endfor %}"
)


def pixtral_processor():  # -> transformers.PixtralProcessor
    """A Pixtral processor (what FLUX.2-dev's pipeline calls its tokenizer): a byte-level BPE without merges with
    Mistral's control tokens, and a Pixtral image processor (never given an image here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    controls = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", "<pad>", *controls])}
    for c in sorted(ByteLevel.alphabet()):
        vocab.setdefault(c, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=controls,
        model_max_length=4096,
    )
    return PixtralProcessor(
        image_processor=PixtralImageProcessor(patch_size=16),
        tokenizer=tokenizer,
        patch_size=16,
        chat_template=MISTRAL_CHAT_TEMPLATE,
        image_token="[IMG]",
        image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]",
    )


def mistral3_encoder(tokenizer, hidden: int, layers: int = 3, seed: int = 0):
    """A small ``Mistral3ForConditionalGeneration`` (a 1-layer Pixtral vision tower that a text prompt never
    reaches); FLUX.2-dev reads its text hidden states."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": hidden // 2,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 4096,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 32,
            "patch_size": 16,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    return Mistral3ForConditionalGeneration(config).eval()
