"""InfoNCE vs DCL wav2vec 2.0 upstreams on the embedded spoken commands (or --data): speaker ID and intent
accuracy as a table (OUT/comparison.md, .json) and a plot (OUT/comparison.png).

    OMP_NUM_THREADS=1 python recipes/wav2vec2/compare.py --seeds 0 1 2
"""

from contrastkit.cli import parse
from contrastkit.evaluation.superb import DownstreamConfig
from contrastkit.speech.compare import SpeechCompareArgs, compare
from contrastkit.speech.pretrain import PretrainConfig


def main(argv=None):
    a = parse(SpeechCompareArgs, description=__doc__, argv=argv)
    compare(a.out, a.losses, a.seeds, PretrainConfig(backend=a.backend, steps=a.steps, batch_size=a.batch_size,
                                                     save_every=a.steps, log_every=10),
            DownstreamConfig(epochs=a.epochs), a.data)


if __name__ == "__main__":
    main()
