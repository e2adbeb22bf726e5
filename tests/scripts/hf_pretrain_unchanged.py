"""A plain wav2vec 2.0 pre-training loop in the style of transformers' example
run_wav2vec2_pretraining_no_trainer.py, with no contrastkit in it: the tests run it as it is and with one
import line added, to show that the import alone switches the objective.

usage: python hf_pretrain_unchanged.py OUT.json
"""

import json
import sys

import numpy as np
import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForPreTraining
from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

torch.manual_seed(0)
np.random.seed(0)
config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=8,
                        num_conv_pos_embedding_groups=2, codevector_dim=16, proj_codevector_dim=16,
                        num_codevectors_per_group=16, num_codevector_groups=2, num_negatives=8,
                        mask_time_prob=0.4, mask_time_length=3)
model = Wav2Vec2ForPreTraining(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
for step in range(3):
    input_values = torch.randn(2, 1600)
    frames = int(model._get_feat_extract_output_lengths(1600))
    mask = _compute_mask_indices((2, frames), config.mask_time_prob, config.mask_time_length, min_masks=2)
    negatives = _sample_negative_indices((2, frames), config.num_negatives, mask_time_indices=mask)
    mask = torch.tensor(mask, dtype=torch.long)
    negatives = torch.tensor(negatives, dtype=torch.long)
    num_losses = mask.sum()
    outputs = model(input_values, mask_time_indices=mask, sampled_negative_indices=negatives)
    outputs.loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(1 / num_losses)
    optimizer.step()
    optimizer.zero_grad()
    model.set_gumbel_temperature(max(2.0 * 0.99 ** (step + 1), 0.5))
    losses.append({"loss": outputs.loss.item(), "contrastive_loss": outputs.contrastive_loss.item(),
                   "diversity_loss": outputs.diversity_loss.item(), "type": type(outputs).__name__})
json.dump(losses, open(sys.argv[1], "w"))
