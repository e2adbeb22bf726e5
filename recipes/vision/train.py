"""SimCLR, MoCo v2 or SiMo with any contrastkit objective; weighted kNN on the held-out split.

    accelerate launch recipes/vision/train.py --method simclr --loss dcl --batch-size 32      # 10 epochs of the shapes
    accelerate launch --num_processes 2 --cpu recipes/vision/train.py --method moco --queue-size 1024 --loss eqco
    python recipes/vision/train.py --data /data/imagenet --image-size 224 --backbone resnet50 --no-small-images ...
    python recipes/vision/train.py --config run.yaml --loss-option chunk_size=512 --report-to tensorboard

Writes metrics.jsonl, metrics.png, summary.json, config.json, backbone.pt and checkpoints/ to --out-dir;
--resume continues from the newest complete checkpoint there.
"""

from contrastkit.cli import one_line_errors, parse
from contrastkit.vision.train import VisionConfig, train


def main(argv=None):
    cfg = parse(VisionConfig, description=__doc__, argv=argv)
    with one_line_errors():
        summary = train(cfg)
    if summary.get("skipped_images"):  # the last line says what the run left out
        print(f"skipped {summary['skipped_images']} unreadable image file(s) of the image folders (the warning above "
              "names some; summary.json's skipped_images)")
    return summary


if __name__ == "__main__":
    main()
