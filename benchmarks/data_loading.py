"""Samples per second of the CLIP recipe's shard loader against open_clip_train's own get_wds_dataset.

    python benchmarks/data_loading.py                          # shards written from the embedded data
    python benchmarks/data_loading.py --shards '/data/cc3m/{00000..00031}.tar' --model ViT-B-32 --workers 8

Both read the same shards with the same loader workers, batch size, shuffle buffer (5000, yielding from
1000) and preprocessing (the model's open_clip transform and tokenizer), in this one process; rounds
alternate the two loaders. Per round and loader: the time from creating the loader to its first batch
(worker start, shuffle-buffer fill), then samples per second over the next --batches batches. Reported:
the median over the rounds and the ratio recipe / open_clip_train (above 1: the recipe's is faster).

Without --shards it writes --samples pairs of the embedded shapes data (64 px JPEGs) as img2dataset
would, in shards of --per-shard, under --work-dir. Writes OUT/data_loading.{json,md}.

open_clip_train 3.3's loader needs webdataset < 0.2.96 (later releases end each shard with a marker its
group_by_keys_nothrow cannot read: KeyError 'fname'); the recipe's reads both.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def recipe_loader(urls, preprocess, tokenizer, batch, workers, stop):
    from contrastkit.data.shards import ShardStream

    stream = ShardStream(urls, preprocess, tokenizer, local_batch=batch, steps_per_epoch=stop, start=0, stop=stop,
                         workers=workers, seed=0)
    return torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers)


def open_clip_loader(urls, preprocess, tokenizer, batch, workers, stop):
    from open_clip_train.data import get_wds_dataset

    args = SimpleNamespace(train_data="::".join(urls), train_num_samples=stop * batch, dataset_resampled=False,
                           train_data_upsampling_factors=None, seed=0, batch_size=batch, world_size=1,
                           workers=workers)
    return get_wds_dataset(args, preprocess, is_train=True, epoch=0, tokenizer=tokenizer).dataloader


def measure(make, batches: int) -> dict:
    started = time.perf_counter()
    loader = make()
    it = iter(loader)
    first = next(it)[0]
    to_first = time.perf_counter() - started
    samples, t0 = 0, time.perf_counter()
    for _ in range(batches):
        samples += len(next(it)[0])
    rate = samples / (time.perf_counter() - t0)
    del it, loader
    return {"first_batch_s": to_first, "samples_per_s": rate, "batch_shape": list(first.shape)}


def write_shards(work_dir: Path, samples: int, per_shard: int) -> str:
    from PIL import Image

    from contrastkit.data.image_text import make_shapes_clip
    from contrastkit.data.shards import write_img2dataset_shards

    out = work_dir / f"shards-n{samples}-p{per_shard}"
    if not (out / "done").exists():
        root = make_shapes_clip(work_dir, num_train=samples, num_zeroshot_per_class=1)
        rows = list(csv.DictReader(open(root / "train.csv"), delimiter="\t"))
        write_img2dataset_shards(out, ((Image.open(r["filepath"]), r["title"]) for r in rows), per_shard)
        (out / "done").write_text("ok\n")
    return str(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", help="shards (pattern, '::'-joined, or folder); default: written from the "
                                         "embedded data")
    parser.add_argument("--samples", type=int, default=16384, help="embedded data: pairs written")
    parser.add_argument("--per-shard", type=int, default=1024, help="embedded data: pairs per shard")
    parser.add_argument("--work-dir", default="/tmp/contrastkit-data-loading", help="where the shards are written")
    parser.add_argument("--model", default="contrastkit-tiny", help="open_clip config whose preprocessing is used")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=100, help="batches timed after the first, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="docs/data_loading")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1 (open_clip_train's loader needs a worker per shard stream)")

    import webdataset

    from contrastkit.adapters.open_clip import create_clip
    from contrastkit.data.shards import shard_urls

    data = args.shards or write_shards(Path(args.work_dir), args.samples, args.per_shard)
    urls = shard_urls(data)
    _, preprocess, tokenizer = create_clip(args.model)
    stop = args.batches + 1
    if len(urls) < args.workers:
        parser.error(f"{len(urls)} shards for {args.workers} workers: both loaders need a shard per worker")
    loaders = {"recipe": recipe_loader, "open_clip_train": open_clip_loader}
    runs = {name: [] for name in loaders}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in (list(loaders) if r % 2 == 0 else list(loaders)[::-1]):
            result = measure(lambda: loaders[name](urls, preprocess, tokenizer, args.batch_size, args.workers, stop),
                             args.batches)
            runs[name].append(result)
            print(f"round {r} {name}: {result['samples_per_s']:.0f} samples/s, first batch "
                  f"{result['first_batch_s']:.2f} s", flush=True)
    median = {name: {key: statistics.median(x[key] for x in rs) for key in ("samples_per_s", "first_batch_s")}
              for name, rs in runs.items()}
    ratio = median["recipe"]["samples_per_s"] / median["open_clip_train"]["samples_per_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "commit": commit, "shards": len(urls), "data": data, "model": args.model, "workers": args.workers,
            "batch_size": args.batch_size, "batches": args.batches, "rounds": args.rounds,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "webdataset": webdataset.__version__,
            "load_average_1min": [load_before, os.getloadavg()[0]]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_loading.json").write_text(json.dumps({"meta": meta, "median": median, "ratio": ratio,
                                                       "runs": runs}, indent=1) + "\n")
    lines = ["# Shard loading: the recipe's loader vs open_clip_train's get_wds_dataset", "",
             f"`{meta['command']}` at {commit}: {len(urls)} shards, model {args.model}'s preprocessing, "
             f"{args.workers} workers, batch {args.batch_size}, {args.batches} batches timed after the first, "
             f"median of {args.rounds} rounds (alternating order); torch {torch.__version__}, webdataset "
             f"{webdataset.__version__}, {meta['cpu']} with {os.cpu_count()} cores, 1-minute load average "
             f"{load_before:.1f} before and {meta['load_average_1min'][1]:.1f} after (other jobs included).", "",
             "| loader | samples/s | first batch (s) |", "|---|---|---|"]
    lines += [f"| {name} | {m['samples_per_s']:.0f} | {m['first_batch_s']:.2f} |" for name, m in median.items()]
    lines += ["", f"Ratio recipe / open_clip_train: **{ratio:.2f}x** samples/s."]
    (out / "data_loading.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
