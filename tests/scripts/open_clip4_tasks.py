"""Run by tests/test_clip_adapter_open_clip4.py with open_clip 4 (the main branch) ahead of the environment's 3.3
on PYTHONPATH: the adapter's patch of ``open_clip.create_task`` checked in one process, the results printed as
one JSON line. Not a test module itself (the primary environment has open_clip 3.3)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

import open_clip
from contrastkit.adapters.open_clip import (active_objective, build_clip_loss, check_open_clip_version, create_clip,
                                            patch, uses_tasks)


def args_for(**changes) -> argparse.Namespace:
    values = dict(model="contrastkit-tiny", distill=False, siglip=False, local_loss=False, gather_with_grad=False,
                  rank=0, world_size=1, loss_dist_impl=None, torchcompile=False, torchcompile_strategy="task")
    values.update(changes)
    return argparse.Namespace(**values)


def batch(model, n=8, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    size = model.visual.image_size
    size = size if isinstance(size, tuple) else (size, size)
    return {"image": torch.randn(n, 3, *size, generator=g),
            "text": torch.randint(1, model.vocab_size - 1, (n, model.context_length), generator=g)}


def loss_and_grads(task, inputs) -> tuple[dict, list]:
    task.zero_grad(set_to_none=True)
    losses, _ = task(inputs)
    losses["loss"].backward()
    grads = [p.grad.clone() for p in task.trainable_module.parameters() if p.grad is not None]
    return {k: v.item() for k, v in losses.items()}, grads


def main() -> dict:
    result = {"version": open_clip.__version__, "checked": check_open_clip_version(), "uses_tasks": uses_tasks()}
    torch.manual_seed(0)
    model = create_clip("contrastkit-tiny")[0]
    inputs = batch(model)
    original = open_clip.create_task
    with patch("dcl") as handle:
        result["patched_everywhere"] = [m.create_task is not original for m in (open_clip, open_clip.factory)]
        task = open_clip.create_task(args_for(), model)
        result["task"] = type(task).__name__
        result["loss"] = type(task.loss).__name__
        result["active"] = active_objective() is handle.objective
        eager, eager_grads = loss_and_grads(task, inputs)
        result["keys"] = sorted(eager)
        # the same loss called directly on the model's output: what CLIPTask sums is contrastkit's DCL
        with torch.no_grad():
            out = model(image=inputs["image"], text=inputs["text"])
        result["direct"] = build_clip_loss("dcl")(**out, output_dict=True)["contrastive_loss"].item()
        result["eager"] = eager
        # --torchcompile-strategy task: the task's training forward compiled, the loss inside the graph
        compiled_task = open_clip.create_task(args_for(torchcompile=True), model)
        compiled_task.compile(target="task", backend="aot_eager", compile_eval=False)
        compiled, compiled_grads = loss_and_grads(compiled_task, inputs)
        result["compiled"] = compiled
        result["compiled_grads_match"] = len(compiled_grads) == len(eager_grads) and all(
            torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(compiled_grads, eager_grads))
        # the loss alone captured in one graph (no graph break: nothing in it reads values on the host)
        torch._dynamo.reset()
        with torch.no_grad():
            out = model(image=inputs["image"], text=inputs["text"])
        whole = torch.compile(task.loss, fullgraph=True, backend="aot_eager")(**out, output_dict=True)
        result["fullgraph"] = whole["contrastive_loss"].item()
        # audio-text: a tiny CLAP (NaFlex spectrogram-ViT audio tower, timm's; HTSAT needs torchlibrosa) gets
        # CLAPTask, whose audio features reach the loss as image_features
        clap = open_clip.CLAP(embed_dim=32, output_dict=True,
                              audio_cfg={"model_type": "naflexvit", "mel_bins": 16, "patch_freq": 4, "patch_time": 4,
                                         "naflexvit_cfg": {"embed_dim": 32, "depth": 1, "num_heads": 2}},
                              text_cfg={"context_length": 16, "vocab_size": 1000, "width": 32, "heads": 2, "layers": 1})
        clap_task = open_clip.create_task(args_for(model="clap-tiny"), clap)
        result["clap_task"], result["clap_loss"] = type(clap_task).__name__, type(clap_task.loss).__name__
        audio = clap_task.create_dummy_batch(batch_size=4)
        g = torch.Generator().manual_seed(1)
        audio["audio"]["patches"] = torch.randn(audio["audio"]["patches"].shape, generator=g)
        audio["text"] = torch.randint(1, 999, audio["text"].shape, generator=g)
        result["clap"] = clap_task(audio)[0]["contrastive_loss"].item()
        with torch.no_grad():
            out = clap(audio=audio["audio"], text=audio["text"])
        result["clap_direct"] = build_clip_loss("dcl")(out["audio_features"], out["text_features"],
                                                       out["logit_scale"]).item()
        refusals = {}
        for kind, changes in (("siglip", {"siglip": True}), ("coca", {"model": "coca_ViT-B-32"}),
                              ("distill", {"distill": True})):
            try:
                open_clip.create_task(args_for(**changes), model)
            except ValueError as err:
                refusals[kind] = str(err)
        result["refusals"] = refusals
    result["restored"] = open_clip.create_task is original and open_clip.factory.create_task is original
    result["unpatched_loss"] = type(open_clip.create_task(args_for(), model).loss).__name__
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
    sys.exit(0)
