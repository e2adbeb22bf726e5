"""Latent recovery after Zimmermann et al. (ICML 2021): every objective x batch size x seed, linear R^2 and MCC.

    python benchmarks/latent_recovery.py --out-dir docs/latent_recovery              # the default grid (minutes)
    python benchmarks/latent_recovery.py --sweep queue_size --losses infonce,eqco --batch-sizes 32 \
        --queue-sizes 16,64,256,1024,4096 --out-dir docs/latent_recovery/negatives   # EqCo: K at a fixed batch

Writes cells/*.json (one per run; an interrupted grid continues), results.json, results.md (mean ± 95 %
interval over seeds, and every objective's paired verdict against InfoNCE) and r2.png to --out-dir.
``--sweep batch_size`` (the default) varies the batch (two-view and queue forms); ``--sweep queue_size``
varies the queue, the negatives K of the queue form, at each of ``--batch-sizes``.
"""

import argparse
import json
import platform
from dataclasses import replace
from pathlib import Path

from contrastkit.evaluation.latent_recovery import (AXES, FORMS, RecoveryConfig, cached_result, paired, plot, run_grid,
                                                    summarize, table)
from contrastkit.evaluation.stats import interval
from contrastkit.losses import available_losses


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one value")
    return values


def main(argv=None):
    d = RecoveryConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="runs/latent-recovery")
    p.add_argument("--losses", default="infonce,dcl,dclw,eqco,cacr,unigrad")
    p.add_argument("--forms", default="two_view,queue", help=f"of {', '.join(FORMS)}")
    p.add_argument("--batch-sizes", type=int_list, default=[8, 64, 256])
    p.add_argument("--queue-batch-sizes", type=int_list, default=[8, 64],
                   help="batch sizes of the queue form (its negatives are the queue, so fewer are needed)")
    p.add_argument("--seeds", type=int_list, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr, help="Adam at batch 256; sqrt(B / 256) times it at B")
    p.add_argument("--kappa", type=float, default=d.kappa)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--queue-sizes", type=int_list, default=[d.queue_size],
                   help="queue form: keys in the queue (several with --sweep queue_size)")
    p.add_argument("--alpha", type=float, default=d.alpha, help="EqCo's alpha")
    p.add_argument("--lam", type=float, default=d.lam, help="UniGrad's lambda")
    p.add_argument("--rho", type=float, default=d.rho, help="UniGrad's moving average of F (0: this batch's F)")
    p.add_argument("--sweep", default="batch_size", choices=AXES,
                   help="the axis of the table and plot: batch size (both forms) or queue size (queue form)")
    p.add_argument("--processes", type=int, default=1, help="runs in parallel, one thread each")
    p.add_argument("--report-only", action="store_true", help="tabulate the finished cells, train nothing")
    args = p.parse_args(argv)
    losses = [name for name in args.losses.split(",") if name]
    unknown = set(losses) - set(available_losses())
    if unknown:
        p.error(f"unknown losses {sorted(unknown)}; choose from {', '.join(available_losses())}")
    forms = [f for f in args.forms.split(",") if f]
    if set(forms) - set(FORMS):
        p.error(f"unknown forms {sorted(set(forms) - set(FORMS))}; choose from {', '.join(FORMS)}")
    if min(args.batch_sizes + args.queue_batch_sizes) < 2:
        p.error("batch sizes must be >= 2 (the other pairs of the batch are the negatives)")
    if min(args.queue_sizes) < 1:
        p.error("queue sizes must be >= 1")
    if args.sweep == "queue_size":  # the queue form only, at each of --batch-sizes
        forms, args.queue_batch_sizes = ["queue"], args.batch_sizes
        losses = [name for name in losses if name != "unigrad"]  # no queue form
    elif len(args.queue_sizes) > 1:
        p.error("several --queue-sizes need --sweep queue_size")
    if args.steps < 1 or args.processes < 1:
        p.error("--steps and --processes must be >= 1")

    base = replace(d, steps=args.steps, lr=args.lr, kappa=args.kappa, temperature=args.temperature,
                   hidden=args.hidden, alpha=args.alpha, lam=args.lam, rho=args.rho)
    configs = [replace(base, loss=loss, form=form, batch_size=b, queue_size=k, seed=s)  # seed-major: a cut-short
               for s in args.seeds for form in forms for loss in losses          # grid is whole over its seeds
               if not (form == "queue" and loss == "unigrad")
               for b in (args.batch_sizes if form == "two_view" else args.queue_batch_sizes)
               for k in args.queue_sizes]
    out = Path(args.out_dir)
    if args.report_only:
        configs = [c for c in configs if cached_result(c, out) is not None]
        if not configs:
            p.error(f"--report-only: no finished cells of this grid in {out / 'cells'}")
    results = run_grid(configs, out, args.processes)

    axis, main_form = args.sweep, forms[0]
    summaries = {metric: summarize(results, metric, axis=axis) for metric in ("r2", "mcc")}
    baseline = interval([r["baseline_r2"] for r in results if r["form"] == main_form and r["loss"] == losses[0]
                         and r[axis] == results[0][axis]])
    observed = [r["observation_r2"] for r in results if r["loss"] == losses[0] and r["form"] == main_form]
    settings = {k: v for k, v in vars(args).items() if k not in ("out_dir", "processes", "report_only")}
    seconds = sum(r["seconds"] for r in results)
    lines = [f"# Latent recovery (Zimmermann et al., ICML 2021): linear R^2 (%) of the true latents",
             "", f"Settings: {settings}; d = {base.dim}, encoder width {base.hidden}, Adam.",
             f"Training time summed over the {len(results)} runs: {seconds / 60:.1f} min "
             f"({platform.processor() or platform.machine()}, one thread per run).", "",
             "Mean ± half-width of the 95 % t-interval over seeds (each seed: its own generator g, encoder "
             "init and data).", "", table(summaries["r2"]),
             f"Baselines: the encoder at initialisation {100 * baseline['mean']:.1f}"
             + (f" ± {100 * baseline['half_width']:.1f}" if baseline["n"] > 1 else "")
             + f"; a linear map of the raw observations x = g(z): {100 * sum(observed) / len(observed):.1f} "
               "(mean over seeds).", "",
             "MCC (%) (on the sphere the latents are identified up to a rotation only, so MCC is not expected "
             "to reach 100):", "", table(summaries["mcc"]),
             "Paired verdicts (points of R^2, same seeds; resolved = the 95 % interval excludes 0), every "
             "objective against InfoNCE:", ""]
    lines += [f"- {v['text']}" for v in summaries["r2"]["verdicts"]]
    # DCLW >= DCL (DCL paper), and each objective's dependence on the axis (EqCo: none on K with alpha fixed)
    values = sorted({r[axis] for r in results if r["form"] == main_form})
    extra = [paired(results, ("dclw", main_form, v), ("dcl", main_form, v), axis=axis) for v in values]
    extra += [paired(results, (loss, main_form, values[0]), (loss, main_form, values[-1]), axis=axis)
              for loss in losses] if len(values) > 1 else []
    lines += ["", f"DCLW against DCL, and each objective at the smallest against the largest {axis.replace('_', ' ')} "
                  f"({main_form.replace('_', ' ')} form):", ""]
    lines += [f"- {v['text']}" for v in extra if v is not None]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"settings": settings, "runs": results}, indent=1) + "\n")
    counts = [ci["n"] for row in summaries["r2"]["cells"].values() for ci in row.values()]
    seeds = f"{min(counts)}-{max(counts)} seeds" if min(counts) != max(counts) else f"{max(counts)} seeds"
    fixed = "" if "queue" not in forms else (f", queue {args.queue_sizes[0]}" if axis == "batch_size" else
                                             ", batch " + ",".join(map(str, args.batch_sizes)))
    plot(summaries["r2"], out / "r2.png", title=f"latent recovery, d = {base.dim}, kappa = {base.kappa}, "
                                                 f"tau = {base.temperature}, {base.steps} steps{fixed}, "
                                                 f"{seeds} (95 % intervals)")
    print((out / "results.md").read_text())


if __name__ == "__main__":
    main()
