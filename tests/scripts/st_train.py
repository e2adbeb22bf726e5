"""SentenceTransformerTrainer, unchanged, with contrastkit's loss on the embedded paraphrase pairs: what a
user runs. On several processes (a global batch of 8 split over them, negatives gathered from all):

    accelerate launch --multi_gpu --num_processes 2 tests/scripts/st_train.py --out DIR --loss dclw --steps 4

writes the number of processes and the logged losses to DIR/losses.json, of MultipleNegativesLoss and
then of CachedMultipleNegativesLoss (mini-batches of half the process's batch). ``--loss mnrl``: the library's
own MultipleNegativesRankingLoss (or its cached form), the baseline.
tests/test_sentence_transformers.py imports train() for the one-process run it compares with, and
train_and_score() for the learning check. tools/gpu/e2e.sh runs one form on a model folder of its own, on
whatever device there is (``--model DIR [--cached] [--bf16]``).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

from contrastkit.adapters.sentence_transformers import CachedMultipleNegativesLoss, MultipleNegativesLoss
from contrastkit.data.paraphrase import paraphrase_split
from contrastkit.evaluation.text_retrieval import load_minilm, retrieval_scores


def _trainer(model, out, pairs, *, loss, batch, steps, cached, dropout, logging_steps=1, bf16=False, use_cpu=True,
             seed=0):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dropout:  # one process and two draw different dropout masks; the comparison needs none
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    args = SentenceTransformerTrainingArguments(
        output_dir=out, per_device_train_batch_size=batch // world, max_steps=steps, learning_rate=1e-4,
        warmup_steps=0, logging_steps=logging_steps, seed=seed, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=use_cpu, bf16=bf16, dataloader_num_workers=0, ddp_backend="gloo" if world > 1 and use_cpu else None)
    if loss == "mnrl":  # sentence-transformers' own loss
        from sentence_transformers.sentence_transformer import losses

        own = losses.CachedMultipleNegativesRankingLoss if cached else losses.MultipleNegativesRankingLoss
        loss_fn = own(model, gather_across_devices=world > 1, **({"mini_batch_size": batch // 2} if cached else {}))
    elif cached:
        loss_fn = CachedMultipleNegativesLoss(model, loss, mini_batch_size=batch // 2, gather_across_devices=world > 1)
    else:
        loss_fn = MultipleNegativesLoss(model, loss, gather_across_devices=world > 1)
    data = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [d for _, d in pairs]})
    return SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss_fn)


def train(out: str, *, loss: str, steps: int) -> dict:
    """The logged loss of each of ``steps`` steps at a global batch of 8, dropout off, with the plain loss
    and with the cached one, each from the pretrained weights."""
    pairs, _ = paraphrase_split(num_train=8 * steps, num_test=8)
    result = {}
    for cached in (False, True):
        torch.manual_seed(0)
        trainer = _trainer(load_minilm(), out, pairs, loss=loss, batch=8, steps=steps, cached=cached, dropout=False)
        trainer.train()
        result["cached" if cached else "plain"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["world_size"] = trainer.args.world_size
    if trainer.is_world_process_zero():
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "losses.json").write_text(json.dumps(result))
    return result


def train_and_score(out: str, *, loss: str, cached: bool = False, steps: int = 12,
                    seed: int = 0) -> tuple[float, float, list[float]]:
    """MRR@10 of 64 held-out queries before and after ``steps`` steps at batch 16 on the first 16 x ``steps`` of
    192 training pairs (12 steps: one epoch), and the 4 losses logged (every steps / 4); ``seed`` draws the
    dropout masks and the order of the pairs."""
    torch.manual_seed(seed)
    pairs, test = paraphrase_split(num_train=192, num_test=64)
    model = load_minilm()
    before = retrieval_scores(model, test)["mrr@10"]
    trainer = _trainer(model, out, pairs[:16 * steps], loss=loss, batch=16, steps=steps, cached=cached, dropout=True,
                       logging_steps=max(1, steps // 4), seed=seed)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return before, retrieval_scores(model, test)["mrr@10"], losses


def train_model(model_dir: str, out: str, *, loss: str, steps: int, batch: int, cached: bool, bf16: bool) -> list:
    """One form on the model saved in ``model_dir``, with dropout, on the default device: the logged losses."""
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    pairs, _ = paraphrase_split(num_train=min(batch * steps, 4096), num_test=8)
    trainer = _trainer(SentenceTransformer(model_dir), out, pairs, loss=loss, batch=batch, steps=steps, cached=cached,
                       dropout=True, logging_steps=max(1, steps // 10), bf16=bf16, use_cpu=False)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--loss", default="dcl", help="contrastkit's objective, or mnrl: the library's own loss")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--model", help="a SentenceTransformer folder: train one form of the loss on it")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--cached", action="store_true")
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    if a.model:
        print(train_model(a.model, a.out, loss=a.loss, steps=a.steps, batch=a.batch_size, cached=a.cached,
                          bf16=a.bf16))
    else:
        train(a.out, loss=a.loss, steps=a.steps)
