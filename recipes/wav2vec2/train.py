"""wav2vec 2.0 pre-training with any contrastkit objective, Hugging Face or fairseq2 backend.

    accelerate launch recipes/wav2vec2/train.py --backend hf --loss dcl          # embedded default audio
    accelerate launch recipes/wav2vec2/train.py --backend fairseq2 --loss infonce --data /data/fsc

Writes OUT/metrics.jsonl, OUT/metrics.png, OUT/summary.json, OUT/checkpoints/step_<n> (resumed from
automatically; --no-resume starts over) and OUT/upstream (for eval/speaker_id.py and eval/intent.py).
"""

import argparse

from contrastkit.speech.pretrain import PretrainConfig, pretrain

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--backend", choices=["hf", "fairseq2"], default="hf")
p.add_argument("--loss", default="dcl", help="infonce, dcl, dclw, eqco or cacr")
p.add_argument("--temperature", type=float, default=None, help="default: the model's (0.1)")
p.add_argument("--data", default=None, help="FSC root, VoxCeleb1 root or a folder of audio (default: embedded)")
p.add_argument("--out", default=None, help="default: runs/wav2vec2-<backend>-<loss>")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch-size", type=int, default=8, help="per process")
p.add_argument("--lr", type=float, default=5e-4)
p.add_argument("--save-every", type=int, default=100)
p.add_argument("--log-every", type=int, default=10)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--conformer", action="store_true", help="HF only: Wav2Vec2ConformerForPreTraining")
p.add_argument("--no-resume", action="store_true")
a = p.parse_args()

cfg = PretrainConfig(backend=a.backend, loss=a.loss, temperature=a.temperature, data=a.data,
                     out_dir=a.out or f"runs/wav2vec2-{a.backend}-{a.loss}", steps=a.steps, batch_size=a.batch_size,
                     lr=a.lr, save_every=a.save_every, log_every=a.log_every, seed=a.seed, conformer=a.conformer)
summary = pretrain(cfg, resume=not a.no_resume)
if summary:
    print(summary)
