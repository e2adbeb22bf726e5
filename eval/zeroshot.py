"""Zero-shot classification of an open_clip checkpoint on an ImageNet-layout folder.

    python eval/zeroshot.py --model contrastkit-tiny --checkpoint runs/clip-dcl/checkpoints/step_300 --data DIR
    python eval/zeroshot.py --model ViT-B-32 --checkpoint logs/run/checkpoints/epoch_32.pt --data imagenet/val

--data defaults to the embedded shapes held-out split. Writes zeroshot.json and zeroshot.png (per-class
recall) to --out-dir (default: beside the checkpoint).
"""

import argparse
import json
from pathlib import Path

from contrastkit.evaluation.zeroshot import evaluate_zeroshot, load_clip_checkpoint, plot_per_class


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="contrastkit-tiny", help="open_clip config name")
    p.add_argument("--checkpoint", help="accelerate checkpoint folder, model.safetensors, or open_clip_train .pt; "
                                        "none: random initialisation (a chance-level baseline)")
    p.add_argument("--data", help="ImageNet-layout folder (default: the embedded shapes zero-shot split)")
    p.add_argument("--data-dir", help="where the embedded data is generated (default ~/.cache/contrastkit)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--out-dir")
    args = p.parse_args(argv)

    from contrastkit.clip_train import create_clip

    model, preprocess, tokenizer = create_clip(args.model)
    if args.checkpoint:
        load_clip_checkpoint(model, args.checkpoint)
    data = args.data
    if data is None:
        from contrastkit.data.image_text import make_shapes_clip

        data = make_shapes_clip(args.data_dir) / "zeroshot"
    result = evaluate_zeroshot(model, tokenizer, preprocess, data, batch_size=args.batch_size, workers=args.workers,
                               progress=True, per_class=True)
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
