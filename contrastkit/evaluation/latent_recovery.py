"""Latent recovery: does an objective invert a known data-generating process? (Zimmermann et al., ICML 2021)

The setting of "Contrastive Learning Inverts the Data Generating Process" (Sec. 4, Theorem 2): latents z
uniform on the unit sphere S^{d-1}; a positive z~ drawn from the von Mises-Fisher conditional
p(z~ | z) ∝ exp(kappa z^T z~); observations x = g(z) through a fixed invertible MLP g; an MLP encoder f
trained with a contrastive objective on pairs (g(z), g(z~)), the other pairs of the batch as negatives.
With InfoNCE at the matched temperature (tau = 1 / kappa) the minimiser is f = A g^{-1}, A orthogonal,
so the latents are recovered up to a rotation, measured by the linear R^2 of z regressed on f(x) on
held-out samples. Everything is generated locally from the seed.

>>> result = train_recovery(RecoveryConfig(loss="dcl", batch_size=64, steps=500, seed=0))
>>> result["r2"], result["mcc"], result["baseline_r2"]
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from contrastkit.losses import build_loss, objective_options

FORMS = ("two_view", "queue")


@dataclass
class RecoveryConfig:
    loss: str = "infonce"
    form: str = "two_view"  # two_view: loss_fn(f(x), f(x~)); queue: MoCo (momentum keys, a queue of negatives)
    batch_size: int = 256
    steps: int = 1000
    dim: int = 10  # latent (and observation) dimension d
    kappa: float = 10.0  # vMF concentration of the positives
    temperature: float = 0.1  # matched to the conditional: 1 / kappa
    alpha: float = 256.0  # EqCo
    sigma: float = 0.5  # DCLW
    lam: float = 100.0  # UniGrad
    rho: float = 0.99  # UniGrad
    hidden: int = 128  # encoder width
    lr: float = 3e-3  # Adam at batch 256, scaled by sqrt(batch / 256) (one lr for all batches: b8 diverges at 3e-3)
    queue_size: int = 1024  # form "queue"
    momentum: float = 0.99  # form "queue": momentum encoder
    generator_layers: int = 3
    generator_condition: float = 4.0  # condition number of each generator weight matrix
    eval_samples: int = 4096  # regression fit and test sets, each
    seed: int = 0

    def check(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"latent recovery: form must be one of {', '.join(FORMS)}, got {self.form!r}")
        if self.form == "queue" and self.loss == "unigrad":
            raise ValueError("latent recovery: unigrad has no queue form (it uses momentum targets, not negatives)")
        if self.batch_size < 2:
            raise ValueError(f"latent recovery: batch_size must be >= 2 (the other pairs are the negatives), "
                             f"got {self.batch_size}")
        for name in ("steps", "dim", "hidden", "eval_samples", "queue_size", "generator_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"latent recovery: {name} must be >= 1, got {getattr(self, name)}")
        if self.dim < 2:
            raise ValueError(f"latent recovery: dim must be >= 2 (a sphere S^(d-1)), got {self.dim}")
        if self.kappa <= 0:
            raise ValueError(f"latent recovery: kappa must be > 0, got {self.kappa}")


# ---------------------------------------------------------------------------------------------- the generative process

def sample_sphere(n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """n points uniform on S^{dim-1} (normalised Gaussians), float64."""
    z = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return z / z.norm(dim=1, keepdim=True)


def sample_vmf(mu: torch.Tensor, kappa: float, generator: torch.Generator) -> torch.Tensor:
    """One draw from vMF(mu_i, kappa) per row of unit vectors ``mu`` [n, d] (Wood, 1994).

    The cosine w = <x, mu> is drawn by rejection from its marginal density ∝ exp(kappa w)(1 - w^2)^{(d-3)/2};
    the rest is a uniform direction orthogonal to mu: x = w mu + sqrt(1 - w^2) v."""
    n, d = mu.shape
    b = (d - 1) / (2 * kappa + math.sqrt(4 * kappa**2 + (d - 1) ** 2))
    x0 = (1 - b) / (1 + b)
    c = kappa * x0 + (d - 1) * math.log(1 - x0**2)
    w = torch.empty(n, dtype=torch.float64)
    todo = torch.arange(n)
    while todo.numel():
        m = todo.numel()
        # Beta((d-1)/2, (d-1)/2) as X / (X + Y), X and Y chi-square with d - 1 degrees of freedom
        chi = torch.randn(2, m, d - 1, generator=generator, dtype=torch.float64).square().sum(-1)
        eps = chi[0] / chi.sum(0)
        u = torch.rand(m, generator=generator, dtype=torch.float64)
        cand = (1 - (1 + b) * eps) / (1 - (1 - b) * eps)
        accept = kappa * cand + (d - 1) * torch.log(1 - x0 * cand) - c >= torch.log(u)
        w[todo[accept]] = cand[accept]
        todo = todo[~accept]
    v = torch.randn(n, d, generator=generator, dtype=torch.float64)
    v = v - (v * mu).sum(1, keepdim=True) * mu
    v = v / v.norm(dim=1, keepdim=True)
    return w[:, None] * mu + torch.sqrt((1 - w**2).clamp_min(0))[:, None] * v


def invertible_mlp(dim: int, layers: int, condition: float, generator: torch.Generator) -> nn.Sequential:
    """The generator g: ``layers`` square linear maps with leaky ReLU (slope 0.2) between them, each
    W = Q1 diag(s) Q2 with Q1, Q2 random orthogonal and s log-uniform in [1, condition] (rescaled to
    geometric mean 1): invertible, with every matrix's condition number at most ``condition``."""
    mods = []
    for i in range(layers):
        q1, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        q2, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        log_s = torch.rand(dim, generator=generator, dtype=torch.float64) * math.log(condition)
        s = torch.exp(log_s - log_s.mean())
        linear = nn.Linear(dim, dim, bias=False)
        linear.weight.data = (q1 * s) @ q2
        mods.append(linear)
        if i < layers - 1:
            mods.append(nn.LeakyReLU(0.2))
    return nn.Sequential(*mods).double().requires_grad_(False)


def encoder(dim: int, hidden: int) -> nn.Sequential:
    """f: an MLP d -> hidden -> hidden -> hidden -> d (leaky ReLU); the objectives normalise its output."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2),
                         nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, dim))


# ---------------------------------------------------------------------------------------------- the metrics

def linear_r2(features: torch.Tensor, latents: torch.Tensor, test_features: torch.Tensor,
              test_latents: torch.Tensor) -> float:
    """R^2 of the latents regressed linearly (with intercept, least squares) on the features: fitted on
    the first set, scored on the second, averaged over latent dimensions (1 - SSE / SST per dimension)."""
    def design(f):
        f = f.double()
        return torch.cat([f, torch.ones(len(f), 1, dtype=torch.float64)], dim=1)

    coef = torch.linalg.lstsq(design(features), latents.double()).solution
    pred = design(test_features) @ coef
    target = test_latents.double()
    sse = ((target - pred) ** 2).sum(0)
    sst = ((target - target.mean(0)) ** 2).sum(0)
    return float((1 - sse / sst).mean())


def hungarian(cost: torch.Tensor) -> list[int]:
    """Column assigned to each row minimising the total cost of a square matrix (Kuhn-Munkres with
    potentials, O(n^3))."""
    c = cost.double().tolist()
    n = len(c)
    inf = float("inf")
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)
    match, way = [0] * (n + 1), [0] * (n + 1)  # match[j]: row (1-based) assigned to column j
    for i in range(1, n + 1):
        match[0], j0 = i, 0
        minv, used = [inf] * (n + 1), [False] * (n + 1)
        while match[j0]:
            used[j0] = True
            i0, delta, j1 = match[j0], inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    cur = c[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(n + 1):
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    rows = [0] * n
    for j in range(1, n + 1):
        rows[match[j] - 1] = j - 1
    return rows


def mcc(features: torch.Tensor, latents: torch.Tensor) -> float:
    """Mean correlation coefficient: |Pearson correlation| between each latent and the feature dimension
    matched to it one-to-one (Hungarian), averaged. On the sphere the latents are identified only up to
    a rotation, so MCC near 1 is not expected there (it is for the permutation-identifiable settings)."""
    f = features.double() - features.double().mean(0)
    z = latents.double() - latents.double().mean(0)
    corr = (z.T @ f) / (z.norm(dim=0)[:, None] * f.norm(dim=0)[None].clamp_min(1e-12))
    assignment = hungarian(-corr.abs())
    return float(sum(corr[i, j].abs() for i, j in enumerate(assignment)) / len(assignment))


# ---------------------------------------------------------------------------------------------- training

def _evaluate(f: nn.Module, g: nn.Module, cfg: RecoveryConfig, generator: torch.Generator) -> dict:
    z_fit = sample_sphere(cfg.eval_samples, cfg.dim, generator)
    z_test = sample_sphere(cfg.eval_samples, cfg.dim, generator)
    with torch.no_grad():
        h_fit = nn.functional.normalize(f(g(z_fit).float()), dim=1)
        h_test = nn.functional.normalize(f(g(z_test).float()), dim=1)
    return {"r2": linear_r2(h_fit, z_fit, h_test, z_test), "mcc": mcc(h_test, z_test)}


def train_recovery(cfg: RecoveryConfig) -> dict:
    """Train an encoder on the setting of ``cfg``; returns R^2 and MCC of the trained encoder, of the
    same encoder at initialisation (baseline_r2, baseline_mcc) and of the raw observations x = g(z)
    (observation_r2), with the config and the seconds taken."""
    cfg.check()
    data_gen = torch.Generator().manual_seed(1_000_003 * cfg.seed + 17)
    g = invertible_mlp(cfg.dim, cfg.generator_layers, cfg.generator_condition, data_gen)
    torch.manual_seed(cfg.seed)
    f = encoder(cfg.dim, cfg.hidden)
    eval_gen = torch.Generator().manual_seed(1_000_003 * cfg.seed + 29)
    baseline = _evaluate(f, g, cfg, eval_gen)
    z_fit, z_test = sample_sphere(cfg.eval_samples, cfg.dim, eval_gen), sample_sphere(cfg.eval_samples, cfg.dim,
                                                                                     eval_gen)
    observation_r2 = linear_r2(g(z_fit), z_fit, g(z_test), z_test)

    loss_fn = build_loss(cfg.loss, **objective_options(cfg.loss, temperature=cfg.temperature, alpha=cfg.alpha,
                                                       sigma=cfg.sigma, lam=cfg.lam, rho=cfg.rho))
    optimizer = torch.optim.Adam(f.parameters(), lr=cfg.lr * math.sqrt(cfg.batch_size / 256))
    momentum_f = queue = None
    if cfg.form == "queue":
        momentum_f = encoder(cfg.dim, cfg.hidden).requires_grad_(False)
        momentum_f.load_state_dict(f.state_dict())
        queue = nn.functional.normalize(torch.randn(cfg.queue_size, cfg.dim, generator=data_gen), dim=1)
    started = time.time()
    losses = []
    for _ in range(cfg.steps):
        z = sample_sphere(cfg.batch_size, cfg.dim, data_gen)
        z_pos = sample_vmf(z, cfg.kappa, data_gen)
        x, x_pos = g(z).float(), g(z_pos).float()
        if cfg.form == "two_view":
            loss = loss_fn(f(x), f(x_pos))
        else:  # MoCo v2, symmetrised: each view's query against the other view's momentum key and the queue
            with torch.no_grad():
                k, k_pos = momentum_f(x), momentum_f(x_pos)
            loss = 0.5 * (loss_fn.query_key(f(x), k_pos, queue) + loss_fn.query_key(f(x_pos), k, queue))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if cfg.form == "queue":
            with torch.no_grad():
                for p, q in zip(momentum_f.parameters(), f.parameters()):
                    p.lerp_(q, 1 - cfg.momentum)
                keys = nn.functional.normalize(torch.cat([k, k_pos]), dim=1)
                queue = torch.cat([keys, queue])[:cfg.queue_size]
    seconds = time.time() - started
    result = _evaluate(f, g, cfg, eval_gen)
    return {**asdict(cfg), "r2": result["r2"], "mcc": result["mcc"], "baseline_r2": baseline["r2"],
            "baseline_mcc": baseline["mcc"], "observation_r2": observation_r2,
            "final_loss": float(torch.stack(losses[-50:]).mean()), "seconds": seconds}


# ---------------------------------------------------------------------------------------------- the grid

def run_grid(configs: list[RecoveryConfig], out_dir, processes: int = 1, log=print) -> list[dict]:
    """Run every config (one thread each, ``processes`` at a time), each result cached as a JSON file in
    ``out_dir/cells`` so an interrupted grid continues where it stopped; returns all results. A cached
    cell counts only if its stored config is the requested one (a changed default reruns it)."""
    import json
    from pathlib import Path

    from tqdm.auto import tqdm

    cells = Path(out_dir) / "cells"
    cells.mkdir(parents=True, exist_ok=True)
    todo = [c for c in configs if cached_result(c, out_dir) is None]
    log(f"{len(configs) - len(todo)} of {len(configs)} cells done, {len(todo)} to run on {processes} process(es)")
    bar = tqdm(total=len(todo), desc="latent recovery", unit="run")
    if processes > 1 and len(todo) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.imap_unordered(_run_one, todo)
            for result in results:
                _record(cells, RecoveryConfig(**_config_fields(result)), result, bar)
    else:
        for cfg in todo:
            _record(cells, cfg, _run_one(cfg), bar)
    bar.close()
    return [cached_result(c, out_dir) for c in configs]


def cached_result(cfg: RecoveryConfig, out_dir) -> dict | None:
    """The stored result of ``cfg`` in ``out_dir/cells``, or None if there is none or it was run with
    another config (a changed default, an edited file)."""
    import json
    from pathlib import Path

    path = Path(out_dir) / "cells" / f"{cell_name(cfg)}.json"
    result = json.loads(path.read_text()) if path.exists() else None
    return result if result is not None and _config_fields(result) == asdict(cfg) else None


def _record(cells, cfg: RecoveryConfig, result: dict, bar) -> None:
    import json

    (cells / f"{cell_name(cfg)}.json").write_text(json.dumps(result))
    bar.update(1)
    bar.write(f"{cell_name(cfg)}: R2 {result['r2']:.4f} ({result['seconds']:.0f} s)")


def _run_one(cfg: RecoveryConfig) -> dict:
    torch.set_num_threads(1)
    return train_recovery(cfg)


def _config_fields(result: dict) -> dict:
    return {k: result[k] for k in RecoveryConfig.__dataclass_fields__}


def cell_name(cfg: RecoveryConfig) -> str:
    """File name of a grid cell: every field that differs from the defaults, plus loss, form, batch, seed."""
    default = RecoveryConfig()
    extra = "".join(f"-{k}{v}" for k, v in asdict(cfg).items()
                    if k not in ("loss", "form", "batch_size", "seed") and v != getattr(default, k))
    return f"{cfg.loss}-{cfg.form}-b{cfg.batch_size}-s{cfg.seed}{extra}"


AXIS_SYMBOLS = {"batch_size": "B", "queue_size": "K"}  # what a grid varies along its columns / x axis
AXES = tuple(AXIS_SYMBOLS)


def per_seed(results: list[dict], loss: str, form: str, value: int, metric: str = "r2",
             axis: str = "batch_size") -> dict:
    """{seed: metric} of one grid cell: ``loss`` in ``form`` at ``axis`` = ``value``."""
    return {r["seed"]: r[metric] for r in results if r["loss"] == loss and r["form"] == form and r[axis] == value}


def paired(results: list[dict], a: tuple, b: tuple, metric: str = "r2", scale: float = 100.0,
           axis: str = "batch_size") -> dict | None:
    """Paired verdict of cell a = (loss, form, value on ``axis``) minus cell b over the seeds both have
    (None if none)."""
    from contrastkit.evaluation.stats import verdict

    va, vb = per_seed(results, *a, metric, axis), per_seed(results, *b, metric, axis)
    seeds = sorted(set(va) & set(vb))
    if not seeds:
        return None
    name = lambda c: f"{c[0]} ({c[1].replace('_', ' ')}, {AXIS_SYMBOLS[axis]}={c[2]})"  # noqa: E731
    return verdict(name(a), [scale * va[s] for s in seeds], name(b), [scale * vb[s] for s in seeds], digits=1)


def summarize(results: list[dict], metric: str = "r2", reference: str = "infonce", axis: str = "batch_size") -> dict:
    """{(loss, form): {value on ``axis``: interval over seeds}} and, per (form, value), the paired verdict
    (x 100) of every objective against ``reference``: {"metric", "axis", "cells", "verdicts"}."""
    from contrastkit.evaluation.stats import interval

    if axis not in AXES:
        raise ValueError(f"latent recovery: axis must be one of {', '.join(AXES)}, got {axis!r}")
    groups: dict = {}
    for r in results:
        groups.setdefault((r["loss"], r["form"]), {}).setdefault(r[axis], {})[r["seed"]] = r[metric]
    cells = {key: {v: {**interval([x for _, x in sorted(by_seed.items())]), "seeds": sorted(by_seed)}
                   for v, by_seed in sorted(values.items())} for key, values in groups.items()}
    verdicts = []
    for (loss, form), values in groups.items():
        if loss == reference or (reference, form) not in groups:
            continue
        for v in values:
            p = paired(results, (loss, form, v), (reference, form, v), metric, axis=axis)
            if p is not None:
                verdicts.append({**p, "form": form, axis: v})
    return {"metric": metric, "axis": axis, "cells": cells, "verdicts": verdicts}


def table(summary: dict, scale: float = 100.0) -> str:
    """Markdown: one row per (objective, form), one column per value of the summary's axis (batch or queue
    size), mean ± 95 % half-width."""
    cells, short = summary["cells"], AXIS_SYMBOLS[summary.get("axis", "batch_size")]
    batches = sorted({b for row in cells.values() for b in row})
    most = max(ci["n"] for row in cells.values() for ci in row.values())
    lines = ["| objective | form | " + " | ".join(f"{short} = {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for (loss, form), row in cells.items():
        entries = []
        for b in batches:
            ci = row.get(b)
            if ci is None:
                entries.append("-")
            elif ci["n"] == 1:
                entries.append(f"{scale * ci['mean']:.1f} (1 seed)")
            else:
                entries.append(f"{scale * ci['mean']:.1f} ± {scale * ci['half_width']:.1f}"
                               + (f" (n={ci['n']})" if ci["n"] < most else ""))
        lines.append(f"| {loss} | {form} | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path, title: str = "") -> None:
    """R^2 (%) against the summary's axis (batch or queue size) per objective, one panel per form, error
    bars the 95 % intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = [f for f in FORMS if any(form == f for _, form in summary["cells"])]
    fig, axes = plt.subplots(1, len(forms), figsize=(5.2 * len(forms), 4), squeeze=False)
    for ax, form in zip(axes[0], forms):
        for (loss, f), row in summary["cells"].items():
            if f != form:
                continue
            bs = sorted(row)
            means = [100 * row[b]["mean"] for b in bs]
            errs = [0.0 if row[b]["n"] == 1 else 100 * row[b]["half_width"] for b in bs]
            ax.errorbar(bs, means, yerr=errs, marker="o", capsize=3, label=loss)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(summary.get("axis", "batch_size").replace("_", " "))
        ax.set_ylabel(f"linear {summary['metric'].upper()} of the latents (%)")
        ax.set_title(form.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        import textwrap

        fig.suptitle("\n".join(textwrap.wrap(title, 60 * len(forms))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
