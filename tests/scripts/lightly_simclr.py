"""lightly's SimCLR example for PyTorch Lightning with contrastkit's DCL in place of lightly's NTXentLoss, on the
embedded shapes images: the LightningModule docs/ecosystems/lightly.md shows (tests/test_lightly.py checks that the
page's class is this one), trained on one process or on several (``strategy="ddp"``, gloo on the CPU; Lightning
starts the other processes by running this script again, as it does for a user's script):

    python tests/scripts/lightly_simclr.py --out runs/lightly --devices 2 --steps 4 --num-images 320

Every process draws the same views (one seed, in the order of the images), and one process shuffles them as
Lightning's DistributedSampler does for several, which gives each its share of every global batch: P processes at
a batch of B / P see the batches one process sees at B. Writes OUT/losses.json on rank 0: the number of processes, the loss of each step over every process's batch,
and the loss of a fixed batch of views before and after training (one process). ``--compare-lightly`` (several
processes): the gathered losses of lightly's own classes against contrastkit's on the same features, per process,
after training, in OUT/lightly.json. tests/test_lightly.py imports main() for the one-process run.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
from lightly.models.modules import SimCLRProjectionHead
from lightly.transforms import SimCLRTransform
from torch import nn
from torchvision.transforms.functional import to_pil_image

from contrastkit.data.images import ShapesImages
from contrastkit.losses import build_loss


class SimCLR(pl.LightningModule):
    def __init__(self, gather_distributed=False):
        super().__init__()
        self.backbone = nn.Sequential(  # a tiny CNN for 16 x 16 images, in place of lightly's ResNet-18
            nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.projection_head = SimCLRProjectionHead(64, 64, 32, batch_norm=False)
        self.criterion = build_loss("dcl", gather_distributed=gather_distributed)  # was: NTXentLoss(...)

    def forward(self, x):
        return self.projection_head(self.backbone(x))

    def training_step(self, batch, batch_index):
        (x0, x1), _ = batch
        loss = self.criterion(self.forward(x0), self.forward(x1))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def views(num_images: int, seed: int = 0) -> list:
    """The embedded shapes (16 x 16) through lightly's SimCLRTransform, two views each, drawn from one seed."""
    transform = SimCLRTransform(input_size=16, cj_strength=0.5, min_scale=0.25, gaussian_blur=0.0)
    torch.manual_seed(seed)
    return [(transform(to_pil_image(image)), label) for image, label in ShapesImages("train", size=16,
                                                                                     num_images=num_images, seed=seed)]


class Record(pl.Callback):
    """The loss of each step over every process's batch (their mean: the batches are of one size)."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(module.all_gather(outputs["loss"].detach()).mean()))


def fixed_batch_loss(model: SimCLR, batch: list) -> float:
    """DCL of the model's projections of a fixed batch of views (one process, no gradient)."""
    x0 = torch.stack([v[0] for v, _ in batch])
    x1 = torch.stack([v[1] for v, _ in batch])
    with torch.no_grad():
        return float(build_loss("dcl")(model(x0), model(x1)))


def compare_with_lightly(out: Path, per_process: int = 16, dim: int = 32) -> None:
    """lightly's NTXentLoss, DCLLoss and DCLWLoss with gather_distributed=True against contrastkit's infonce (at
    lightly's temperature 0.5), dcl and dclw with gather_distributed=True, on this process's rows of one float64
    batch: each process's loss and the gradient of its rows; beside them each's mean over the processes against
    one process on the whole batch."""
    import warnings

    import torch.distributed as dist
    from lightly.loss import DCLLoss, DCLWLoss, NTXentLoss

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(123)
    whole = [torch.randn(per_process * world, dim, generator=g, dtype=torch.float64) for _ in range(2)]
    pairs = {"infonce": (NTXentLoss(temperature=0.5, gather_distributed=True),
                         build_loss("infonce", temperature=0.5, gather_distributed=True),
                         NTXentLoss(temperature=0.5), build_loss("infonce", temperature=0.5)),
             "dcl": (DCLLoss(gather_distributed=True), build_loss("dcl", gather_distributed=True), DCLLoss(),
                     build_loss("dcl")),
             "dclw": (DCLWLoss(gather_distributed=True), build_loss("dclw", gather_distributed=True), DCLWLoss(),
                      build_loss("dclw"))}
    result = {}
    with warnings.catch_warnings():  # lightly's DCLW weights copy-construct a tensor
        warnings.simplefilter("ignore", UserWarning)
        for name, (theirs, ours, theirs_one, ours_one) in pairs.items():
            values, grads = [], []
            for loss_fn in (theirs, ours):
                z = [w[rank * per_process:(rank + 1) * per_process].clone().requires_grad_() for w in whole]
                loss = loss_fn(*z)
                loss.backward()
                values.append(loss.detach())
                grads.append(torch.cat([v.grad for v in z]))
            local = torch.stack([values[0], values[1], (values[0] - values[1]).abs(),
                                 (grads[0] - grads[1]).abs().max(), grads[1].abs().max()])
            every = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            mean_theirs = float(torch.stack([e[0] for e in every]).mean())
            mean_ours = float(torch.stack([e[1] for e in every]).mean())
            result[name] = {"lightly": [float(e[0]) for e in every], "contrastkit": [float(e[1]) for e in every],
                            "loss_difference": [float(e[2]) for e in every],
                            "grad_difference": [float(e[3]) for e in every],
                            "grad_scale": [float(e[4]) for e in every],
                            "lightly_mean_minus_one_process": mean_theirs - float(theirs_one(*whole)),
                            "contrastkit_mean_minus_one_process": mean_ours - float(ours_one(*whole))}
    if rank == 0:
        (out / "lightly.json").write_text(json.dumps(result, indent=1))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for losses.json")
    parser.add_argument("--devices", type=int, default=1, help="processes (several: strategy='ddp', gloo on the CPU)")
    parser.add_argument("--steps", type=int, default=4, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch, split over the processes")
    parser.add_argument("--num-images", type=int, help="images to train on (default: steps x batch size, one epoch); "
                        "their order is drawn from their number, so runs to compare take the same")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-lightly", action="store_true", help="lightly's losses gathered, against ours")
    args = parser.parse_args(argv)
    if args.batch_size % args.devices:
        parser.error(f"--batch-size {args.batch_size} does not split over {args.devices} processes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = views(args.num_images or args.steps * args.batch_size, args.seed)
    fixed = views(64, args.seed + 1)
    pl.seed_everything(args.seed, verbose=False)
    model = SimCLR(gather_distributed=args.devices > 1)
    before = fixed_batch_loss(model, fixed)
    # Shuffled as Lightning's DistributedSampler shuffles for several processes, in place of this sampler
    # (torch.randperm from the seed seed_everything gives it; the sampler's own generator, which the DataLoader does
    # not draw from), so that each global batch holds the same images on one process and on several.
    sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(args.seed))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // args.devices, sampler=sampler,
                                         drop_last=True)
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[record])
    trainer.fit(model, loader)
    result = {"processes": trainer.world_size, "losses": record.losses, "before": before,
              "after": fixed_batch_loss(model, fixed)}
    if args.compare_lightly and trainer.world_size > 1:
        compare_with_lightly(out)
    if trainer.is_global_zero:
        (out / "losses.json").write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
