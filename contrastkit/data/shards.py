"""webdataset shards as img2dataset writes them (``00000.tar`` holding ``<key>.jpg``, ``<key>.txt``,
``<key>.json``, beside ``00000_stats.json``), streamed into the CLIP recipe and resumable exactly.

``--data`` names the shards as open_clip does: a brace pattern (``/data/{00000..00331}.tar``), several
joined by ``::`` (mixing datasets), or a folder of ``.tar`` files. Nothing is read before the first step
but each shard's ``_stats.json`` (img2dataset's sample count; open_clip's ``sizes.json`` also works), which
sizes an epoch unless ``--train-num-samples`` does.

The order of the data is a function of (seed, step) alone, so that a resumed run sees the batches of an
uninterrupted one:

- an epoch is ``steps_per_epoch`` global batches: the epoch's samples over the global batch, rounded
  down to a multiple of the loader workers W;
- the consumers are the P processes x W loader workers. The DataLoader takes its workers in turn, so
  step s is served by worker *role* v = s mod W of every process (a loader started at step s0 gives
  worker w the role (s0 + w) mod W);
- in epoch e the shards are permuted by (seed, e) and consumer (rank, v) reads every (P W)-th of them:
  every sample once per epoch when the shards hold equal counts (img2dataset's do, but for the last).
  With ``resampled`` (open_clip's ``--dataset-resampled``) it draws shards with replacement instead;
- its samples pass, undecoded, through webdataset's shuffle buffer seeded by (seed, e, rank, v); if its
  shards run out before the epoch does it reads them again, reshuffled (open_clip rolls over alike);
- images are decoded, transformed and captions tokenized after the buffer, in the worker. A sample whose
  image does not decode, or that has no image or caption, is skipped and counted; a shard with more than
  ``max_bad_fraction`` of such samples is a ``DataError`` that names it;
- every batch carries its consumer's position (epoch, samples taken from its stream, bad samples so far).
  ``ShardPositions`` keeps the latest per role and writes it into each checkpoint (one file per process);
  a resumed worker skips the samples its role had taken, reading them without decoding.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


class DataError(ValueError):
    """Training data that cannot be used, found while streaming it (often in a loader worker)."""

    def __init__(self, message: str):
        # A worker's exception reaches the main process rebuilt from its traceback text: keep the message.
        if "Traceback" in message:
            message = message.rstrip().splitlines()[-1].partition("DataError: ")[2] or message
        super().__init__(message)


def is_shards(data) -> bool:
    """Whether ``--data`` names webdataset shards: ``.tar`` patterns (``::``-joined) or a folder of them."""
    if data is None:
        return False
    path = Path(str(data))
    if path.is_dir():
        return any(path.glob("*.tar")) and not any(path.glob("metadata.*"))
    return all(part.endswith(".tar") for part in str(data).split("::"))


def shard_urls(data: str) -> list[str]:
    """The shard files of ``--data``: a folder's ``*.tar`` in name order, or the patterns expanded."""
    from webdataset.shardlists import expand_urls

    path = Path(data)
    if path.is_dir():
        urls = sorted(str(p) for p in path.glob("*.tar"))
    else:
        urls = expand_urls(data)
    missing = [u for u in urls if not Path(u).is_file()]
    if missing or not urls:
        raise FileNotFoundError(f"--data: {len(missing)} of {len(urls)} shards of {data!r} do not exist, "
                                f"e.g. {missing[0]!r}" if missing else f"--data: no shards in {data!r}")
    return urls


def count_samples(urls: list[str]) -> int | None:
    """Samples in the shards from img2dataset's ``<shard>_stats.json`` (``successes``) or open_clip's
    ``sizes.json``; None when a shard has neither."""
    total, sizes = 0, {}
    for url in urls:
        path = Path(url)
        stats = path.with_name(path.stem + "_stats.json")
        if stats.is_file():
            total += int(json.loads(stats.read_text())["successes"])
            continue
        listing = path.parent / "sizes.json"
        if listing not in sizes:
            sizes[listing] = json.loads(listing.read_text()) if listing.is_file() else {}
        if path.name not in sizes[listing]:
            return None
        total += int(sizes[listing][path.name])
    return total


def plan_epochs(data: str, global_batch: int, world: int, workers: int, *, num_samples: int | None = None,
                resampled: bool = False) -> tuple[list[str], int, int]:
    """Check the shards against the run and return (shard files, samples per epoch, steps per epoch).

    Raises FileNotFoundError / ValueError with a message for the command line's ``error:`` line.
    """
    urls = shard_urls(data)
    consumers = world * max(1, workers)
    if not resampled and len(urls) < consumers:
        raise ValueError(f"--data: {len(urls)} shards for {world} process(es) x {max(1, workers)} loader worker(s): "
                         f"need at least {consumers} shards (each worker reads whole shards), or --dataset-resampled")
    if num_samples is None:
        num_samples = count_samples(urls)
        if num_samples is None:
            raise ValueError(f"--data: the shards have no img2dataset _stats.json (or open_clip sizes.json) to "
                             f"count their samples; give --train-num-samples")
    per_worker = num_samples // global_batch // max(1, workers)
    if per_worker < 1:
        raise ValueError(f"--data: an epoch of {num_samples} samples is less than one global batch of {global_batch} "
                         f"per loader worker ({max(1, workers)})")
    return urls, num_samples, per_worker * max(1, workers)


@dataclass
class Position:
    """Where a worker role is: its epoch, samples taken from that epoch's stream, bad samples so far."""

    epoch: int = 0
    taken: int = 0
    bad: int = 0


class ShardStream(torch.utils.data.IterableDataset):
    """This process's batches (images, token ids, position) of the steps [start, stop), from the shards.

    ``positions`` maps a worker role to its ``Position`` at ``start`` (from a checkpoint); see the module
    docstring for the order. Use with ``DataLoader(stream, batch_size=None, num_workers=workers)``.
    """

    def __init__(self, urls: list[str], transform, tokenizer, *, local_batch: int, steps_per_epoch: int,
                 start: int, stop: int, rank: int = 0, world: int = 1, workers: int = 0, seed: int = 0,
                 resampled: bool = False, shuffle_buffer: int = 5000, image_keys=IMAGE_KEYS,
                 caption_key: str = "txt", max_bad_fraction: float = 0.1, positions: dict | None = None):
        super().__init__()
        self.urls, self.transform, self.tokenizer = urls, transform, tokenizer
        self.local_batch, self.steps_per_epoch, self.start, self.stop = local_batch, steps_per_epoch, start, stop
        self.rank, self.world, self.roles, self.seed = rank, world, max(1, workers), seed
        self.resampled, self.shuffle_buffer, self.max_bad_fraction = resampled, shuffle_buffer, max_bad_fraction
        self.image_keys, self.caption_key = tuple(image_keys), caption_key
        self.positions = positions or {}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        role = (self.start + worker) % self.roles
        mine = range(self.start + worker, self.stop, self.roles)  # the steps this worker serves
        saved = self.positions.get(role, Position())
        batches, epoch, bad = None, None, [saved.bad]
        for step in mine:
            if step // self.steps_per_epoch != epoch:
                epoch = step // self.steps_per_epoch
                skip = saved.taken if saved.epoch == epoch else 0
                batches = self._epoch(role, epoch, skip, bad)
            yield next(batches)

    def _shards(self, consumer: int, epoch: int, rng: random.Random):
        if self.resampled:
            return (rng.choice(self.urls) for _ in itertools.count())
        order = list(self.urls)
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[consumer::self.world * self.roles]

    def _samples(self, role: int, epoch: int, tally: dict):
        """The role's undecoded samples of ``epoch``, shuffled, pass after pass (endless)."""
        from webdataset.filters import _shuffle

        consumer = self.rank * self.roles + role
        rng = random.Random(f"{self.seed}:{epoch}:{consumer}")
        for _ in itertools.count():
            tally.clear()  # per shard: [samples read, bad, shard finished]
            yield from _shuffle(self._read(self._shards(consumer, epoch, rng), tally), self.shuffle_buffer,
                                min(1000, self.shuffle_buffer), rng=rng)

    def _read(self, shards, tally: dict):
        from webdataset.tariterators import tarfile_samples

        for url in shards:
            counts = tally.setdefault(url, [0, 0, False])
            counts[2] = False
            try:
                for sample in tarfile_samples([{"url": url}]):
                    counts[0] += 1
                    yield sample
            except Exception as err:
                raise DataError(f"{url}: not a readable tar shard ({type(err).__name__}: {err})") from None
            if counts[0] == 0:
                raise DataError(f"{url}: the shard holds no samples")
            counts[2] = True
            self._check(url, counts)

    def _check(self, url: str, counts: list) -> None:
        read, bad, finished = counts
        if finished and bad > self.max_bad_fraction * read:
            raise DataError(f"{url}: {bad} of its {read} samples are unusable (no image, an image that does not "
                            f"decode, or no caption): more than {self.max_bad_fraction:.0%} of the shard")

    def _decode(self, sample: dict):
        """(image tensor, caption) of a sample, or None when it cannot be used."""
        key = next((k for k in self.image_keys if k in sample), None)
        caption = sample.get(self.caption_key)
        if key is None or caption is None:
            return None
        try:
            with Image.open(io.BytesIO(sample[key])) as im:
                image = im.convert("RGB")
        except Exception:  # PIL raises many types for a bad file
            return None
        caption = caption.decode("utf-8") if isinstance(caption, bytes) else str(caption)
        return (self.transform(image) if self.transform is not None else image), caption

    def _epoch(self, role: int, epoch: int, skip: int, bad: list):
        tally = {}
        samples = self._samples(role, epoch, tally)
        for _ in range(skip):  # already trained on: read, not decoded
            next(samples)
        taken, images, captions = skip, [], []
        while True:
            sample = next(samples)
            taken += 1
            pair = self._decode(sample)
            if pair is None:
                bad[0] += 1
                counts = tally[sample["__url__"]]
                counts[1] += 1
                self._check(sample["__url__"], counts)
                continue
            images.append(pair[0])
            captions.append(pair[1])
            if len(images) == self.local_batch:
                texts = self.tokenizer(captions) if self.tokenizer is not None else captions
                yield torch.stack(images), texts, torch.tensor([role, epoch, taken, bad[0]])
                images, captions = [], []


class ShardPositions:
    """The latest ``Position`` of each of this process's worker roles, read from the batches; every process
    writes its own into each checkpoint folder (``data_position_<rank>.json``) and reads it back on resume,
    through accelerate's save/load-state pre-hooks."""

    def __init__(self, accelerator, workers: int):
        self.rank, self.world, self.workers = accelerator.process_index, accelerator.num_processes, max(1, workers)
        self.latest: dict[int, Position] = {}
        accelerator.register_save_state_pre_hook(self._save)
        accelerator.register_load_state_pre_hook(self._load)

    def update(self, meta: torch.Tensor) -> None:
        role, epoch, taken, bad = meta.tolist()  # a CPU tensor from the loader: no device sync
        self.latest[role] = Position(epoch, taken, bad)

    @property
    def bad(self) -> int:
        return sum(p.bad for p in self.latest.values())

    def _file(self, folder) -> Path:
        return Path(folder) / f"data_position_{self.rank}.json"

    def _save(self, models, weights, output_dir) -> None:
        layout = {"processes": self.world, "workers": self.workers}
        positions = {role: asdict(p) for role, p in self.latest.items()}
        self._file(output_dir).write_text(json.dumps({**layout, "positions": positions}) + "\n")

    def _load(self, models, input_dir) -> None:
        path = self._file(input_dir)
        if not path.is_file():
            raise DataError(f"--resume: {input_dir} holds no data position for process {self.rank} "
                            "(written by a run on other data?)")
        saved = json.loads(path.read_text())
        if (saved["processes"], saved["workers"]) != (self.world, self.workers):
            raise DataError(f"--resume: the checkpoint was written by {saved['processes']} process(es) x "
                            f"{saved['workers']} loader worker(s); resume with the same to continue exactly "
                            f"(now {self.world} x {self.workers})")
        self.latest = {int(role): Position(**p) for role, p in saved["positions"].items()}


def write_img2dataset_shards(out: str | Path, pairs, per_shard: int, *, image_format: str = "jpg") -> list[Path]:
    """Write (PIL image or encoded bytes, caption) pairs as img2dataset lays them out: ``00000.tar`` with
    ``<key>.jpg``, ``<key>.txt``, ``<key>.json``, plus ``00000.parquet`` and ``00000_stats.json``.

    For tests and benchmarks (real sets come from img2dataset itself); returns the shard paths.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from webdataset import TarWriter

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths, pairs = [], iter(pairs)
    for shard in itertools.count():
        chunk = list(itertools.islice(pairs, per_shard))
        if not chunk:
            return paths
        path = out / f"{shard:05d}.tar"
        rows = []
        with TarWriter(str(path)) as sink:
            for i, (image, caption) in enumerate(chunk):
                key = f"{shard:05d}{i:04d}"
                if not isinstance(image, bytes):
                    buffer = io.BytesIO()
                    image.convert("RGB").save(buffer, format="JPEG" if image_format == "jpg" else image_format)
                    image = buffer.getvalue()
                meta = {"key": key, "caption": caption, "status": "success", "url": f"file:///{key}.{image_format}"}
                sink.write({"__key__": key, image_format: image, "txt": caption, "json": meta})
                rows.append(meta)
        pq.write_table(pa.Table.from_pylist(rows), out / f"{shard:05d}.parquet")
        stats = {"count": len(chunk), "successes": len(chunk), "failed_to_download": 0, "failed_to_resize": 0,
                 "status_dict": {"success": len(chunk)}}
        (out / f"{shard:05d}_stats.json").write_text(json.dumps(stats, indent=4))
        paths.append(path)
