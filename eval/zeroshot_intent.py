"""Zero-shot intent classification of a CLAP model from text prompts (one per intent, written from the
intent's labels) on the Fluent Speech Commands test split; writes a JSON (accuracy, top-5, mean per-class
recall, chance).

    python eval/zeroshot_intent.py --model runs/clap-dcl/model                 # the embedded spoken commands
    python eval/zeroshot_intent.py --model runs/clap-dcl --data /data/fluent_speech_commands_dataset --out zs.json
"""

from contrastkit.cli import one_line_errors, parse
from contrastkit.speech.clap import ZeroShotIntentArgs, evaluate_saved


def main(argv=None):
    args = parse(ZeroShotIntentArgs, description=__doc__, argv=argv)
    with one_line_errors(ValueError, FileNotFoundError):
        result = evaluate_saved(args)
    print(f"zero-shot intent accuracy {result['accuracy']:.4f} (top-5 {result['top5']:.4f}, chance "
          f"{result['chance']:.4f}) on {result['num_clips']} clips, {result['num_intents']} intents; {result['data']}")


if __name__ == "__main__":
    main()
