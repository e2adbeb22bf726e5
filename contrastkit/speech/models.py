"""Small wav2vec 2.0 configurations (HF and fairseq2) that train on a CPU in minutes, and the masking /
distractor sampling / gumbel-temperature schedule of the wav2vec 2.0 recipe.
"""

from __future__ import annotations

import numpy as np
import torch

# A tiny model: 4 conv layers of total stride 160 (100 frames per second; wav2vec 2.0 base has 320, 50 per
# second, too coarse for 1 s clips), 2 transformer layers of width 64; masks of 10 frames (100 ms).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            conv_dim=(64, 64, 64, 64), conv_stride=(5, 4, 4, 2), conv_kernel=(10, 8, 4, 4),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
            codevector_dim=32, proj_codevector_dim=32, num_codevectors_per_group=32, num_codevector_groups=2,
            num_negatives=20, contrastive_logits_temperature=0.1, diversity_loss_weight=0.1,
            mask_time_prob=0.5, mask_time_length=10, feat_extract_norm="group", do_stable_layer_norm=False,
            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
            feat_quantizer_dropout=0.0, final_dropout=0.0, layerdrop=0.0)


def hf_config(conformer: bool = False, **overrides):
    """A tiny ``Wav2Vec2Config`` (or ``Wav2Vec2ConformerConfig``), ``overrides`` on top."""
    from transformers import Wav2Vec2Config, Wav2Vec2ConformerConfig

    options = {**TINY, **overrides}
    if conformer:
        options.setdefault("conv_depthwise_kernel_size", 7)
        options.setdefault("position_embeddings_type", "relative")
        return Wav2Vec2ConformerConfig(**options)
    return Wav2Vec2Config(**options)


def hf_model(conformer: bool = False, seed: int = 0, **overrides):
    """A freshly initialised tiny ``Wav2Vec2ForPreTraining`` (or the Conformer variant)."""
    from transformers import Wav2Vec2ConformerForPreTraining, Wav2Vec2ForPreTraining

    torch.manual_seed(seed)
    cls = Wav2Vec2ConformerForPreTraining if conformer else Wav2Vec2ForPreTraining
    return cls(hf_config(conformer, **overrides))


def hf_mask_and_negatives(model, batch_size: int, num_samples: int, rng: np.random.Generator,
                          attention_mask: torch.Tensor | None = None):
    """(mask_time_indices, sampled_negative_indices) for a batch, as the wav2vec 2.0 recipe draws them
    (HF's own ``_compute_mask_indices`` / ``_sample_negative_indices``, driven by ``rng`` so a resumed
    run draws the same). Padding frames are never masked nor used as distractors."""
    from transformers.models.wav2vec2 import modeling_wav2vec2 as mw

    frames = int(model._get_feat_extract_output_lengths(num_samples))
    sub_mask = None
    if attention_mask is not None:
        sub_mask = model._get_feature_vector_attention_mask(frames, attention_mask)
    state = np.random.get_state()
    np.random.seed(int(rng.integers(2**31)))  # HF's helpers use the global numpy RNG
    try:
        cfg = model.config
        mask = mw._compute_mask_indices((batch_size, frames), cfg.mask_time_prob, cfg.mask_time_length,
                                        attention_mask=sub_mask, min_masks=2)
        negatives = mw._sample_negative_indices((batch_size, frames), cfg.num_negatives, mask_time_indices=mask)
    finally:
        np.random.set_state(state)
    return torch.from_numpy(mask), torch.from_numpy(negatives.astype(np.int64))


def gumbel_temperature(step: int, max_temp: float = 2.0, min_temp: float = 0.5, decay: float = 0.999995) -> float:
    """The wav2vec 2.0 recipe's gumbel-softmax temperature: max_temp * decay^step, floored at min_temp."""
    return max(max_temp * decay**step, min_temp)


def fairseq2_config(**overrides):
    """A tiny fairseq2 ``Wav2Vec2Config`` matching ``TINY`` (same conv stack, widths, codebooks).

    overrides: fields of Wav2Vec2Config, or of its encoder config prefixed with ``encoder_``.
    """
    from fairseq2.models.wav2vec2 import Wav2Vec2Config, Wav2Vec2EncoderConfig

    enc = dict(model_dim=TINY["hidden_size"], feature_dim=TINY["conv_dim"][-1],
               feature_extractor_layer_descs=list(zip(TINY["conv_dim"], TINY["conv_kernel"], TINY["conv_stride"])),
               pos_conv_kernel_size=TINY["num_conv_pos_embeddings"],
               num_pos_conv_groups=TINY["num_conv_pos_embedding_groups"],
               num_encoder_layers=TINY["num_hidden_layers"], num_encoder_attn_heads=TINY["num_attention_heads"],
               ffn_inner_dim=TINY["intermediate_size"], dropout_p=0.0, attn_dropout_p=0.0, layer_drop_p=0.0,
               max_seq_len=2048)
    top = dict(final_dim=TINY["proj_codevector_dim"], quantized_dim=TINY["codevector_dim"],
               num_codebooks=TINY["num_codevector_groups"], num_codebook_entries=TINY["num_codevectors_per_group"],
               num_distractors=TINY["num_negatives"], logit_temp=TINY["contrastive_logits_temperature"],
               temporal_mask_span_len=TINY["mask_time_length"], max_temporal_mask_prob=TINY["mask_time_prob"],
               min_num_temporal_mask_spans=2)
    for key, value in overrides.items():
        if key.startswith("encoder_"):
            enc[key[len("encoder_"):]] = value
        else:
            top[key] = value
    return Wav2Vec2Config(encoder_config=Wav2Vec2EncoderConfig(**enc), **top)


def fairseq2_model(seed: int = 0, eager: bool | None = None, **overrides):
    """A freshly initialised tiny fairseq2 ``Wav2Vec2Model``; eager (default: when CUDA is unavailable)
    runs its quantiser without torch.compile (see contrastkit.adapters.fairseq2_wav2vec2)."""
    from fairseq2.models.wav2vec2 import create_wav2vec2_model

    from contrastkit.adapters.fairseq2_wav2vec2 import eager_quantizer

    torch.manual_seed(seed)
    model = create_wav2vec2_model(fairseq2_config(**overrides))
    if eager if eager is not None else not torch.cuda.is_available():
        eager_quantizer(model)
    return model
