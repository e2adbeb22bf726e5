"""InfoNCE vs DCL wav2vec 2.0 upstreams on the embedded spoken commands (or --data): speaker ID and intent
accuracy as a table (OUT/comparison.md, .json) and a plot (OUT/comparison.png).

    OMP_NUM_THREADS=1 python recipes/wav2vec2/compare.py --steps 400 --seeds 0 1
"""

import argparse

from contrastkit.evaluation.superb import DownstreamConfig
from contrastkit.speech.compare import compare
from contrastkit.speech.pretrain import PretrainConfig

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--backend", choices=["hf", "fairseq2"], default="hf")
p.add_argument("--losses", nargs="+", default=["infonce", "dcl"])
p.add_argument("--seeds", nargs="+", type=int, default=[0])
p.add_argument("--steps", type=int, default=400)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--epochs", type=int, default=150, help="downstream epochs")
p.add_argument("--data", default=None, help="a folder holding fsc/ and voxceleb1/ (default: embedded)")
p.add_argument("--out", default="runs/wav2vec2-compare")
a = p.parse_args()

compare(a.out, a.losses, a.seeds, PretrainConfig(backend=a.backend, steps=a.steps, batch_size=a.batch_size,
                                                 save_every=a.steps, log_every=10),
        DownstreamConfig(epochs=a.epochs), a.data)
