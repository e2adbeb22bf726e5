"""Tiny Hugging Face dual encoders (random weights, built locally) and batches for them, for the adapter
tests. Nothing is downloaded."""

from __future__ import annotations

from contextlib import contextmanager

import torch

VOCAB, LENGTH, IMAGE = 64, 7, 16
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=32)
BERT = dict(TEXT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
VISION = dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
              num_attention_heads=4)

CLASSES = ("CLIPModel", "VisionTextDualEncoderModel", "MetaClip2Model", "ChineseCLIPModel", "AltCLIPModel",
           "AlignModel", "ClapModel")


def config(name: str):
    import transformers as T

    if name == "CLIPModel":
        return T.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=16)
    if name == "MetaClip2Model":
        return T.MetaClip2Config(text_config=TEXT, vision_config=VISION, projection_dim=16)
    if name == "VisionTextDualEncoderModel":
        return T.VisionTextDualEncoderConfig.from_vision_text_configs(
            T.ViTConfig(**VISION, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), T.BertConfig(**BERT),
            projection_dim=16)
    if name == "ChineseCLIPModel":
        return T.ChineseCLIPConfig(text_config=BERT, vision_config=VISION, projection_dim=16)
    if name == "AltCLIPModel":
        return T.AltCLIPConfig(text_config=dict(BERT, project_dim=16, pad_token_id=1), vision_config=VISION,
                               projection_dim=16)
    if name == "AlignModel":
        vision = dict(image_size=32, num_channels=3, kernel_sizes=[3, 3], in_channels=[32, 16], out_channels=[16, 24],
                      hidden_dim=32, strides=[1, 2], num_block_repeats=[1, 1], expand_ratios=[1, 6],
                      drop_connect_rate=0.0, dropout_rate=0.0)
        return T.AlignConfig(text_config=BERT, vision_config=vision, projection_dim=48)  # = its image embedding
    if name == "ClapModel":
        audio = dict(spec_size=32, num_mel_bins=16, window_size=4, patch_size=2, patch_stride=(2, 2), hidden_size=32,
                     patch_embeds_hidden_size=16,  # its last stage is 16 * 2 = hidden_size
                     depths=[1, 1], num_attention_heads=[2, 2], enable_fusion=False, projection_dim=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
        return T.ClapConfig(text_config=dict(BERT, pad_token_id=1, projection_dim=16), audio_config=audio,
                            projection_dim=16)
    raise KeyError(name)


def model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    import transformers as T

    torch.manual_seed(seed)
    return getattr(T, name)(config(name)).to(dtype).eval()


def batch(name: str, n: int = 6, seed: int = 0, offset: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """A batch of n pairs (rows offset .. offset + n of a fixed larger batch, for splitting over processes)."""
    g = torch.Generator().manual_seed(seed)
    total = max(16, offset + n)  # drawn at one size, so that slices of it agree
    ids = torch.randint(3, VOCAB, (total, LENGTH), generator=g)
    rows = slice(offset, offset + n)
    out = {"input_ids": ids[rows], "attention_mask": torch.ones_like(ids[rows])}
    if name == "ClapModel":
        out["input_features"] = torch.randn(total, 1, 32, 16, generator=g, dtype=dtype)[rows]
    else:
        size = 32 if name == "AlignModel" else IMAGE
        out["pixel_values"] = torch.randn(total, 3, size, size, generator=g, dtype=dtype)[rows]
    return out


@contextmanager
def float64():
    """float64 as torch's default dtype, for running the models in float64 (CLIP's text model builds its
    causal mask in the default dtype from the hidden states' dtype minimum)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def word_tokenizer(root, texts: list[str], specials=("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")):
    """A BERT word-piece tokenizer whose vocabulary is the texts' words (the CLAP recipe's, with these
    special tokens first), written to root/vocab.txt."""
    from contrastkit.speech.clap import word_tokenizer as build

    return build(root, texts, specials)


def dual_encoder_dir(root, captions: list[str], image_size: int = 32):
    """A tiny VisionTextDualEncoderModel (ViT + BERT, no dropout) saved with save_pretrained under root,
    with a word-level BERT tokenizer over the captions' words and a ViT image processor: what
    transformers' run_clip.py loads from --model_name_or_path. Nothing is downloaded."""
    from pathlib import Path

    import transformers as T

    root = Path(root)
    tokenizer = word_tokenizer(root, captions)
    vision = T.ViTConfig(**dict(VISION, image_size=image_size), hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    text = T.BertConfig(**dict(BERT, vocab_size=len(tokenizer)))
    torch.manual_seed(0)
    model = T.VisionTextDualEncoderModel(T.VisionTextDualEncoderConfig.from_vision_text_configs(
        vision, text, projection_dim=16))
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    T.ViTImageProcessor(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                        image_std=[0.5] * 3).save_pretrained(root)
    return root
