"""Train a CLIP model with a contrastkit objective and report zero-shot accuracy.

    accelerate launch recipes/clip/train.py --loss dcl            # embedded shapes data, tiny model, a few minutes
    accelerate launch recipes/clip/train.py --loss dclw --model ViT-B-32 --data pairs.tsv --zeroshot imagenet/val
"""

import argparse
from dataclasses import fields

from contrastkit.adapters.open_clip import CLIP_LOSSES
from contrastkit.clip_train import ClipTrainConfig, train


def parse_args(argv=None) -> ClipTrainConfig:
    defaults = ClipTrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", default=defaults.loss, help=f"one of {', '.join(CLIP_LOSSES)}")
    p.add_argument("--loss-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a loss option, e.g. sigma=0.5 (dclw), alpha=256 (eqco), t_neg=2 (cacr)")
    p.add_argument("--model", default=defaults.model, help="any open_clip config name (random init, no download)")
    p.add_argument("--data", help="open_clip CSV/TSV (filepath, title) or a Hugging Face image folder with captions; "
                                  "default: the embedded shapes data")
    p.add_argument("--data-dir", help="where the embedded data is generated (default ~/.cache/contrastkit)")
    p.add_argument("--num-train", type=int, default=defaults.num_train, help="embedded data: training pairs")
    p.add_argument("--zeroshot-per-class", type=int, default=defaults.zeroshot_per_class,
                   help="embedded data: held-out zero-shot images per class")
    p.add_argument("--img-key", default=defaults.img_key, help="CSV image path column")
    p.add_argument("--caption-key", help="caption column (default: title for CSV, text for an image folder)")
    p.add_argument("--csv-separator", help="CSV separator (default: tab, or comma for a .csv without tabs)")
    p.add_argument("--zeroshot", help="ImageNet-layout folder for zero-shot evaluation "
                                      "(default: the embedded held-out split)")
    p.add_argument("--out-dir", help="default runs/clip-<loss>")
    for name in ("batch_size", "steps", "warmup", "log_every", "eval_every", "save_every", "seed", "workers"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out-dir")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    options = {}
    for item in args.loss_option:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--loss-option takes key=value, got {item!r}")
        options[key] = float(value)
    values = {f.name: getattr(args, f.name) for f in fields(ClipTrainConfig) if hasattr(args, f.name)}
    values.update(loss_options=options, out_dir=args.out_dir or f"runs/clip-{args.loss}", progress=not args.no_progress)
    return ClipTrainConfig(**values)


if __name__ == "__main__":
    summary = train(parse_args())
    if "zeroshot_top1" in summary:
        print(f"zero-shot top-1 {summary['zeroshot_top1']:.3f} (top-5 {summary['zeroshot_top5']:.3f}, chance "
              f"{summary['zeroshot_chance']:.3f}) on {summary['zeroshot_num_images']} held-out images; "
              f"loss {summary['loss_name']}, {summary['steps']} steps; report in {summary['config']['out_dir']}")
