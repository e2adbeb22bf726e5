"""Train a tiny CLAP (Hugging Face ClapModel) on spoken commands with a contrastkit objective and report
zero-shot intent accuracy from text prompts.

    accelerate launch recipes/clap/train.py --loss dcl                 # embedded spoken commands, 2-4 min on a shared CPU
    accelerate launch recipes/clap/train.py --loss infonce --data /data/fluent_speech_commands_dataset
    python recipes/clap/train.py --loss dcl --caption transcript --steps 600 --out-dir runs/clap-transcript

Writes OUT/metrics.jsonl, OUT/metrics.png, OUT/summary.json, OUT/checkpoints/checkpoint_<step> (--resume
continues from the newest) and OUT/model (ClapModel.from_pretrained, with its tokenizer and feature extractor).
"""

from contrastkit.cli import one_line_errors, parse
from contrastkit.speech.clap import ClapTrainConfig, train


def main(argv=None):
    cfg = parse(ClapTrainConfig, description=__doc__, argv=argv)
    with one_line_errors(ValueError, FileNotFoundError):  # bad data found once it is read: exit 2
        summary = train(cfg)
    if "zeroshot_intent" in summary:
        now, before = summary["zeroshot_intent"], summary["zeroshot_intent_untrained"]
        print(f"zero-shot intent accuracy {now['accuracy']:.3f} (untrained {before['accuracy']:.3f}, chance "
              f"{now['chance']:.3f}) on {now['num_clips']} test clips of unseen speakers; loss {summary['loss_name']}, "
              f"{summary['steps']} steps; report in {summary['config']['out_dir']}")


if __name__ == "__main__":
    main()
