"""Intent classification (Fluent Speech Commands layout: data/*_data.csv and wavs/) on a frozen wav2vec 2.0 upstream,
SUPERB-style (weighted layer sum, linear, mean pooling, linear; Adam); writes <out>/intent.json and .png.

    python eval/intent.py --upstream runs/wav2vec2-hf-dcl                # a recipe run (HF or fairseq2)
    python eval/intent.py --upstream /models/wav2vec2-base --data /data/fluent_speech_commands_dataset
"""

import argparse

from contrastkit.evaluation.superb import DownstreamConfig, intent, write_report

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--upstream", required=True, help="recipe run folder, HF model folder or fairseq2 export")
p.add_argument("--data", default=None, help="dataset root (default: the embedded spoken commands)")
p.add_argument("--out", default=None, help="default: <upstream>/eval")
p.add_argument("--epochs", type=int, default=150)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

result = intent(a.upstream, a.data, DownstreamConfig(epochs=a.epochs, lr=a.lr, seed=a.seed))
path = write_report(result, a.out or f"{a.upstream.rstrip('/')}/eval")
print(f"intent test accuracy {result['test_accuracy']:.4f} (dev {result['dev_accuracy']:.4f}, epoch {result['best_epoch']}) -> {path}")
