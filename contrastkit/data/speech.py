"""Speech data: the embedded default (spoken commands in several voices, synthesised offline) and
loaders for the on-disk formats of Fluent Speech Commands and VoxCeleb1 identification.

The embedded default is written in both real layouts, so the same loaders read it and a user's copy:

- Fluent Speech Commands: ``data/{train,valid,test}_data.csv`` with columns path, speakerId,
  transcription, action, object, location (path relative to the dataset root); speakers disjoint
  across the splits.
- VoxCeleb1 identification: ``wav/<speaker>/<video>/<utt>.wav`` and ``iden_split.txt`` lines
  ``<1|2|3> <speaker>/<video>/<utt>.wav`` (1 train, 2 dev, 3 test); every speaker in every split.

>>> root = default_speech_data()                # cached, ~10 s the first time
>>> train = read_fsc(root / "fsc", "train")     # list of dicts
>>> wave = load_audio(train[0]["path"])         # float32 [T] at 16 kHz
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import torch

SAMPLE_RATE = 16_000
FSC_COLUMNS = ("path", "speakerId", "transcription", "action", "object", "location")
FSC_SPLITS = ("train", "valid", "test")
VOX_SPLITS = {"train": "1", "dev": "2", "test": "3"}

# (transcription, action, object, location): Fluent Speech Commands' own label vocabulary.
COMMANDS = [
    ("Turn on the lights", "activate", "lights", "none"),
    ("Turn off the lights in the kitchen", "deactivate", "lights", "kitchen"),
    ("Switch on the bedroom lights", "activate", "lights", "bedroom"),
    ("Turn the heat up", "increase", "heat", "none"),
    ("Turn down the heat in the washroom", "decrease", "heat", "washroom"),
    ("Increase the volume", "increase", "volume", "none"),
    ("Decrease the volume", "decrease", "volume", "none"),
    ("Play the music", "activate", "music", "none"),
    ("Stop the music", "deactivate", "music", "none"),
    ("Bring me my shoes", "bring", "shoes", "none"),
    ("Bring the newspaper", "bring", "newspaper", "none"),
    ("Change the language to German", "change language", "German", "none"),
]
# (speaker id, espeak-ng voice, pitch, rate): ten clearly different voices.
VOICES = [
    ("id10001", "en+m1", 35, 165), ("id10002", "en+f2", 70, 175), ("id10003", "en-us+m3", 45, 150),
    ("id10004", "en+f4", 80, 160), ("id10005", "en-gb-x-rp+m7", 25, 170), ("id10006", "en-us+f3", 60, 185),
    ("id10007", "en+croak", 40, 155), ("id10008", "en-gb-scotland+f5", 75, 165),
    ("id10009", "en-us+m2", 55, 190), ("id10010", "en+klatt", 50, 160),
]
TAKES = 3
FSC_SPLIT_OF_SPEAKER = ["train"] * 6 + ["valid"] * 2 + ["test"] * 2
VERSION = "speech_commands_v3"  # v3: resampled by torchcodec (FFmpeg), not torchaudio


# ----------------------------------------------------------------------------- audio


def resample(wave: torch.Tensor, orig_rate: int, sample_rate: int, *,
             backend: Literal["torchcodec", "torchaudio"] = "torchcodec") -> torch.Tensor:
    """Band-limited resampling of a mono float waveform [T] from ``orig_rate`` to ``sample_rate`` Hz.

    "torchcodec" (default): FFmpeg's resampler through torchcodec's AudioDecoder, the one that
    ``load_audio`` decodes with; the wave goes in as an in-memory float32 WAV, so nothing is rounded on
    the way. "torchaudio": its sinc interpolation, only where torchaudio is installed (its last release
    pins torch 2.11) and asked for.
    """
    if orig_rate == sample_rate:
        return wave
    if backend == "torchaudio":
        import torchaudio.functional as AF

        return AF.resample(wave, orig_rate, sample_rate)
    if backend != "torchcodec":
        raise ValueError(f"resample: backend must be 'torchcodec' or 'torchaudio', got {backend!r}")
    import soundfile
    from torchcodec.decoders import AudioDecoder

    buffer = io.BytesIO()
    soundfile.write(buffer, wave.numpy(), orig_rate, format="WAV", subtype="FLOAT")
    return AudioDecoder(buffer.getvalue(), sample_rate=sample_rate).get_all_samples().data[0]


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE, *, resample: bool = True) -> torch.Tensor:
    """Decode an audio file (any format FFmpeg reads: WAV, FLAC, MP3, M4A, ...) to float32 mono [T] at
    ``sample_rate`` with torchcodec (channels averaged; another rate resampled by FFmpeg).

    resample=False makes a file at another rate an error instead of resampling it.
    """
    from torchcodec.decoders import AudioDecoder

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        decoder = AudioDecoder(str(path), sample_rate=sample_rate, num_channels=1)
        rate = decoder.metadata.sample_rate
        wave = decoder.get_all_samples().data[0] if resample or rate == sample_rate else None
    except (RuntimeError, ValueError) as err:  # torchcodec raises these on data FFmpeg cannot read
        raise ValueError(f"cannot decode audio file {path}: {err}") from None
    if wave is None:
        raise ValueError(f"audio file {path} has sample rate {rate} Hz, expected {sample_rate} Hz")
    if wave.shape[0] == 0:
        raise ValueError(f"audio file {path} is empty (0 samples)")
    return wave


def load_waveforms(records: list[dict], sample_rate: int = SAMPLE_RATE,
                   max_bad_fraction: float = 0.05) -> tuple[list[torch.Tensor], list[dict]]:
    """Decode every record's ``path``; a few unreadable or missing files are skipped with one warning
    that counts them; more than ``max_bad_fraction`` of the set, or all of it, is an error."""
    if not records:
        raise ValueError("no utterances to load (empty split)")
    waves, kept, bad = [], [], []
    for r in records:
        try:
            waves.append(load_audio(r["path"], sample_rate))
            kept.append(r)
        except (FileNotFoundError, ValueError) as err:
            bad.append(str(err))
    if bad:
        if len(bad) > max_bad_fraction * len(records) or not kept:
            raise ValueError(f"{len(bad)} of {len(records)} audio files could not be read, e.g. {bad[0]}")
        warnings.warn(f"skipped {len(bad)} of {len(records)} audio files that could not be read, e.g. {bad[0]}")
    return waves, kept


# ----------------------------------------------------------------------------- Fluent Speech Commands


def read_fsc(root: str | Path, split: str) -> list[dict]:
    """Rows of ``root/data/<split>_data.csv`` as dicts (path made absolute, ``speaker`` = speakerId,
    ``intent`` = "action|object|location")."""
    if split not in FSC_SPLITS:
        raise ValueError(f"Fluent Speech Commands split must be one of {FSC_SPLITS}, got {split!r}")
    root = Path(root)
    csv_path = root / "data" / f"{split}_data.csv"
    if not csv_path.is_file():
        raise FileNotFoundError(f"Fluent Speech Commands: {csv_path} not found (is {root} the dataset root, "
                                "the folder holding data/ and wavs/?)")
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in FSC_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{csv_path} lacks the column(s) {missing}; found {reader.fieldnames}")
        rows = []
        for row in reader:
            rows.append({"path": str(root / row["path"]), "speaker": row["speakerId"],
                         "transcription": row["transcription"], "action": row["action"],
                         "object": row["object"], "location": row["location"],
                         "intent": f"{row['action']}|{row['object']}|{row['location']}"})
    if not rows:
        raise ValueError(f"{csv_path} has no rows (empty split {split!r})")
    return rows


def write_fsc(root: Path, rows: list[dict]) -> None:
    """Write the FSC CSVs for ``rows`` (each with split, path relative to root, speaker and labels)."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    for split in FSC_SPLITS:
        with (root / "data" / f"{split}_data.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["", *FSC_COLUMNS])
            for i, r in enumerate(r for r in rows if r["split"] == split):
                w.writerow([i, r["path"], r["speaker"], r["transcription"], r["action"], r["object"], r["location"]])


# ----------------------------------------------------------------------------- VoxCeleb1 identification


def read_voxceleb_iden(root: str | Path, split: str, split_file: str | Path | None = None) -> list[dict]:
    """Utterances of one split (train / dev / test) of ``iden_split.txt`` under ``root/wav``."""
    if split not in VOX_SPLITS:
        raise ValueError(f"VoxCeleb1 identification split must be one of {list(VOX_SPLITS)}, got {split!r}")
    root = Path(root)
    if split_file is None:
        candidates = [root / "iden_split.txt", root / "meta" / "iden_split.txt"]
        split_file = next((p for p in candidates if p.is_file()), candidates[0])
    split_file = Path(split_file)
    if not split_file.is_file():
        raise FileNotFoundError(f"VoxCeleb1: {split_file} not found (give the folder holding wav/ and iden_split.txt)")
    rows = []
    for n, line in enumerate(split_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or parts[0] not in VOX_SPLITS.values() or parts[1].count("/") != 2:
            raise ValueError(f"{split_file}:{n}: expected '<1|2|3> <speaker>/<video>/<utt>.wav', got {line!r}")
        if parts[0] == VOX_SPLITS[split]:
            rows.append({"path": str(root / "wav" / parts[1]), "speaker": parts[1].split("/")[0]})
    if not rows:
        raise ValueError(f"{split_file} lists no utterance for split {split!r} ({VOX_SPLITS[split]})")
    return rows


# ----------------------------------------------------------------------------- the embedded default


def default_speech_data(cache_dir: str | Path | None = None) -> Path:
    """The embedded default, generated once (deterministic) and cached: ``<dir>/fsc`` (FSC layout) and
    ``<dir>/voxceleb1`` (VoxCeleb1 identification layout), the same 360 clips: 12 commands x 10 voices
    x 3 takes, 16 kHz. Default cache: $CONTRASTKIT_DATA or ~/.cache/contrastkit."""
    base = Path(cache_dir or os.environ.get("CONTRASTKIT_DATA") or Path.home() / ".cache" / "contrastkit")
    root = base / VERSION
    if (root / "done.json").is_file():
        return root
    tmp = base / f"{VERSION}.tmp{os.getpid()}"
    _generate(tmp)
    try:
        tmp.rename(root)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _generate(root: Path) -> None:
    import soundfile
    from contrastkit.data.speech_synth import synthesize_many

    fsc_rows, iden_lines = [], []
    jobs = [(s, c, t) for s in range(len(VOICES)) for c in range(len(COMMANDS)) for t in range(TAKES)]
    params = []
    for s, c, take in jobs:
        rng = np.random.default_rng(1000 * s + 10 * c + take)
        _, voice, pitch, rate = VOICES[s]
        params.append(dict(text=COMMANDS[c][0], voice=voice, pitch=pitch + int(rng.integers(-6, 7)),
                           rate=rate + int(rng.integers(-15, 16)), pitch_range=50))
    audios = synthesize_many(params, desc="synthesising speech commands")
    for (s, c, take), (audio, sr) in zip(jobs, audios):
        speaker = VOICES[s][0]
        text, action, obj, location = COMMANDS[c]
        rng = np.random.default_rng(10**6 + 1000 * s + 10 * c + take)
        wave = resample(torch.from_numpy(audio), sr, SAMPLE_RATE).numpy()
        wave = wave + rng.normal(0, 0.003, wave.shape).astype(np.float32)  # a little room noise
        wave = np.clip(wave, -1, 1)
        name = hashlib.sha1(f"{speaker}-{c}-{take}".encode()).hexdigest()[:12]
        fsc_path = Path("wavs") / "speakers" / speaker / f"{name}.wav"
        (root / "fsc" / fsc_path).parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(root / "fsc" / fsc_path), wave, SAMPLE_RATE, subtype="PCM_16")
        fsc_rows.append({"split": FSC_SPLIT_OF_SPEAKER[s], "path": str(fsc_path), "speaker": speaker,
                         "transcription": text, "action": action, "object": obj, "location": location})
        # VoxCeleb1: each take is a "video"; commands 0-7 train, 8-9 dev, 10-11 test (all takes),
        # so every speaker is in every split and the test sentences are new to the classifier.
        video = f"take{take}"
        vox_rel = f"{speaker}/{video}/{c + 1:05d}.wav"
        (root / "voxceleb1" / "wav" / vox_rel).parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(root / "voxceleb1" / "wav" / vox_rel), wave, SAMPLE_RATE, subtype="PCM_16")
        iden_lines.append(f"{1 if c < 8 else 2 if c < 10 else 3} {vox_rel}")
    write_fsc(root / "fsc", fsc_rows)
    (root / "voxceleb1" / "iden_split.txt").write_text("\n".join(iden_lines) + "\n")
    (root / "done.json").write_text(json.dumps({"version": VERSION, "clips": len(jobs)}) + "\n")
