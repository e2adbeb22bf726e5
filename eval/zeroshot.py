"""Zero-shot classification of an open_clip checkpoint on an ImageNet-layout folder.

    python eval/zeroshot.py --model contrastkit-tiny --checkpoint runs/clip-dcl/checkpoints/checkpoint_300 --data DIR
    python eval/zeroshot.py --model ViT-B-32 --checkpoint logs/run/checkpoints/epoch_32.pt --data imagenet/val

--data defaults to the embedded shapes held-out split. Writes zeroshot.json and zeroshot.png (per-class
recall) to --out-dir (default: beside the checkpoint).
"""

import json
from pathlib import Path

from contrastkit.adapters.open_clip import create_clip
from contrastkit.cli import one_line_errors, parse
from contrastkit.evaluation.zeroshot import ZeroShotArgs, evaluate_zeroshot, load_clip_checkpoint, plot_per_class


def main(argv=None):
    args = parse(ZeroShotArgs, description=__doc__, argv=argv)
    model, preprocess, tokenizer = create_clip(args.model)
    if args.checkpoint:
        with one_line_errors(ValueError, OSError):  # not a checkpoint of this model, or one that would run code
            load_clip_checkpoint(model, args.checkpoint)
    model.to(args.device)
    data = args.data
    if data is None:
        from contrastkit.data.image_text import make_shapes_clip

        data = make_shapes_clip(args.data_dir) / "zeroshot"
    result = evaluate_zeroshot(model, tokenizer, preprocess, data, batch_size=args.batch_size, workers=args.workers,
                               device=args.device, progress=True, per_class=True)
    out = Path(args.out_dir or (Path(args.checkpoint).parent if args.checkpoint else "runs/zeroshot"))
    out.mkdir(parents=True, exist_ok=True)
    result.update(model=args.model, checkpoint=args.checkpoint, data=str(data))
    (out / "zeroshot.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_per_class(result, out / "zeroshot.png")
    print(f"zero-shot on {data}: top-1 {result['top1']:.4f}, top-5 {result['top5']:.4f}, mean per-class recall "
          f"{result['mean_per_class_recall']:.4f} ({result['num_images']} images, {result['num_classes']} classes); "
          f"{out / 'zeroshot.json'}")


if __name__ == "__main__":
    main()
