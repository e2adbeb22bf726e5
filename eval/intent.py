"""Intent classification (Fluent Speech Commands layout: data/*_data.csv and wavs/) on a frozen wav2vec 2.0 upstream,
SUPERB-style (weighted layer sum, linear, mean pooling, linear; Adam); writes <out>/intent.json and .png.

    python eval/intent.py --upstream runs/wav2vec2-hf-dcl                # a recipe run (HF or fairseq2)
    python eval/intent.py --upstream /models/wav2vec2-base --data /data/fluent_speech_commands_dataset
"""

from contrastkit.evaluation import superb


def main(argv=None):
    return superb.main("intent", __doc__, argv)


if __name__ == "__main__":
    main()
