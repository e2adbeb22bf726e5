"""Train a CLIP model with a contrastkit objective and report zero-shot accuracy.

    accelerate launch recipes/clip/train.py --loss dcl            # embedded shapes data, tiny model, a few minutes
    accelerate launch recipes/clip/train.py --loss dclw --model ViT-B-32 --data pairs.tsv --zeroshot imagenet/val
    accelerate launch recipes/clip/train.py --loss dcl --data '/data/cc3m/{00000..00331}.tar' --workers 4
    python recipes/clip/train.py --config run.yaml --lr 5e-4      # values from a YAML file, the flag overrides
"""

from contrastkit.cli import one_line_errors, parse
from contrastkit.clip.train import ClipTrainConfig, train
from contrastkit.data.shards import DataError


def main(argv=None):
    cfg = parse(ClipTrainConfig, description=__doc__, argv=argv)
    with one_line_errors(DataError):  # bad shards found while streaming: bad input, exit 2
        summary = train(cfg)
    if "zeroshot_top1" in summary:
        bad = summary.get("bad_samples")  # the last line says what the run left out
        skipped = (f"; skipped {bad} unusable sample(s): an image that did not decode, or no image or caption (each "
                   "replaced by the next; summary.json's bad_samples)") if bad else ""
        print(f"zero-shot top-1 {summary['zeroshot_top1']:.3f} (top-5 {summary['zeroshot_top5']:.3f}, chance "
              f"{summary['zeroshot_chance']:.3f}) on {summary['zeroshot_num_images']} held-out images; "
              f"loss {summary['loss_name']}, {summary['steps']} steps; report in {summary['config']['out_dir']}"
              f"{skipped}")


if __name__ == "__main__":
    main()
