"""Speaker identification (VoxCeleb1 layout: wav/ and iden_split.txt) on a frozen wav2vec 2.0 upstream,
SUPERB-style (weighted layer sum, linear, mean pooling, linear; Adam); writes <out>/speaker_id.json and .png.

    python eval/speaker_id.py --upstream runs/wav2vec2-hf-dcl                # a recipe run (HF or fairseq2)
    python eval/speaker_id.py --upstream /models/wav2vec2-base --data /data/VoxCeleb1
"""

from contrastkit.evaluation import superb


def main(argv=None):
    return superb.main("speaker_id", __doc__, argv)


if __name__ == "__main__":
    main()
