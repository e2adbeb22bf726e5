"""wav2vec 2.0 pre-training with any contrastkit objective, Hugging Face or fairseq2 backend.

    accelerate launch recipes/wav2vec2/train.py --backend hf --loss dcl          # embedded default audio
    accelerate launch recipes/wav2vec2/train.py --backend fairseq2 --loss infonce --data /data/fsc

Writes OUT/metrics.jsonl, OUT/metrics.png, OUT/summary.json, OUT/checkpoints/checkpoint_<step> (resumed from
automatically; --no-resume starts over) and OUT/upstream (for eval/speaker_id.py and eval/intent.py).
"""

from contrastkit.cli import one_line_errors, parse
from contrastkit.speech.pretrain import PretrainConfig, pretrain


def main(argv=None):
    cfg = parse(PretrainConfig, description=__doc__, argv=argv)
    with one_line_errors():
        summary = pretrain(cfg)
    if summary:
        print(summary)
    if summary.get("skipped_audio"):  # the last line says what the run left out
        print(f"skipped {summary['skipped_audio']} audio file(s) that could not be read (the warning above names one; "
              "summary.json's skipped_audio)")


if __name__ == "__main__":
    main()
