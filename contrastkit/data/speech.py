"""Speech data: the embedded default (spoken commands in several voices, synthesised offline) and
loaders for the on-disk formats of Fluent Speech Commands and VoxCeleb1 identification.

The embedded default is written in both real layouts, so the same loaders read it and a user's copy:

- Fluent Speech Commands: ``data/{train,valid,test}_data.csv`` with columns path, speakerId,
  transcription, action, object, location (path relative to the dataset root); speakers disjoint
  across the splits.
- VoxCeleb1 identification: ``wav/<speaker>/<video>/<utt>.wav`` and ``iden_split.txt`` lines
  ``<1|2|3> <speaker>/<video>/<utt>.wav`` (1 train, 2 dev, 3 test); every speaker in every split.

>>> root = default_speech_data()                # cached, ~3 min the first time
>>> train = read_fsc(root / "fsc", "train")     # list of dicts
>>> wave = load_audio(train[0]["path"])         # float32 [T] at 16 kHz
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import torch

SAMPLE_RATE = 16_000
FSC_COLUMNS = ("path", "speakerId", "transcription", "action", "object", "location")
FSC_SPLITS = ("train", "valid", "test")
VOX_SPLITS = {"train": "1", "dev": "2", "test": "3"}

# (transcription, action, object, location): Fluent Speech Commands' own label vocabulary; like FSC,
# some intents have several phrasings.
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
    ("Turn on the lamp", "activate", "lamp", "none"),
    ("Switch off the lamp", "deactivate", "lamp", "none"),
    ("Lights on", "activate", "lights", "none"),
    ("Bring me some juice", "bring", "juice", "none"),
    ("Get me my socks", "bring", "socks", "none"),
    ("Make it louder", "increase", "volume", "none"),
    ("Turn the volume down", "decrease", "volume", "none"),
    ("Turn up the heat in the bedroom", "increase", "heat", "bedroom"),
    ("Switch off the washroom lights", "deactivate", "lights", "washroom"),
    ("Turn the temperature up in the kitchen", "increase", "heat", "kitchen"),
    ("Switch the language to Chinese", "change language", "Chinese", "none"),
    ("Pause the music", "deactivate", "music", "none"),
]
# (speaker id, espeak-ng voice (accent + variant), pitch, rate): forty different voices; each speaker
# also has a room of its own (reverberation, microphone tilt, noise level: _room).
VOICES = [
    ("id10001", "en+m1", 35, 165), ("id10002", "en+f2", 70, 175), ("id10003", "en-us+m3", 45, 150),
    ("id10004", "en+f4", 80, 160), ("id10005", "en-gb-x-rp+m7", 25, 170), ("id10006", "en-us+f3", 60, 185),
    ("id10007", "en+croak", 40, 155), ("id10008", "en-gb-scotland+f5", 75, 165),
    ("id10009", "en-us+m2", 55, 190), ("id10010", "en+klatt", 50, 160),
    ("id10011", "en-us-nyc+m4", 40, 170), ("id10012", "en-029+f1", 72, 160),
    ("id10013", "en-gb-x-gbclan+m5", 30, 150), ("id10014", "en-gb-x-gbcwmd+f3", 65, 180),
    ("id10015", "en+m6", 45, 175), ("id10016", "en-us+f5", 78, 155), ("id10017", "en-gb-x-rp+klatt2", 50, 165),
    ("id10018", "en-gb-scotland+m8", 38, 185), ("id10019", "en+Annie", 68, 170), ("id10020", "en-us+Andy", 42, 160),
    ("id10021", "en-029+m2", 52, 150), ("id10022", "en-us-nyc+f4", 74, 175), ("id10023", "en-gb-x-gbclan+f2", 62, 165),
    ("id10024", "en+klatt3", 48, 180), ("id10025", "en-gb-x-rp+f1", 70, 150), ("id10026", "en-us+m7", 32, 165),
    ("id10027", "en-gb-x-gbcwmd+m1", 44, 190), ("id10028", "en+linda", 66, 160), ("id10029", "en-us+Gene", 36, 175),
    ("id10030", "en-gb-scotland+f4", 80, 155), ("id10031", "en-029+klatt4", 46, 170),
    ("id10032", "en-us-nyc+Jacky", 58, 160), ("id10033", "en+steph", 72, 185), ("id10034", "en-gb-x-rp+max", 40, 155),
    ("id10035", "en-us+belinda", 64, 170), ("id10036", "en-gb-x-gbclan+m3", 34, 175),
    ("id10037", "en+grandpa", 30, 145),
    ("id10038", "en-us+aunty", 76, 165), ("id10039", "en-gb-x-gbcwmd+m6", 54, 160), ("id10040", "en+Lee", 50, 175),
]
TAKES = 4
# The small subset (the tests'): the first 10 speakers x 12 commands x 3 takes, the same clips as in the full set.
SMALL = (10, 12, 3)
# v5: v4's clips, but 6 breathy voices (+f2, +f3, +f5 variants) seeded per utterance: in v4 espeak-ng seeded
# their noise with the clock, so each generation differed (v4: 40 voices in rooms of their own, 24 commands,
# 4 takes; v3: 10 x 12 x 3)
VERSION = "speech_commands_v5"


def fsc_split(speaker: int) -> str:
    """FSC split of a speaker (by index): 3 of every 5 train, 1 valid, 1 test (speakers disjoint)."""
    return ("train", "train", "train", "valid", "test")[speaker % 5]


def voxceleb_split(command: int) -> str:
    """VoxCeleb1 split code of a command (by index): 4 of every 6 train (1), 1 dev (2), 1 test (3); every
    speaker says every command, so every speaker is in every split and test sentences are new."""
    return "1" if command % 6 < 4 else "2" if command % 6 == 4 else "3"


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


def default_speech_data(cache_dir: str | Path | None = None, *, small: bool = False) -> Path:
    """The embedded default, generated once (deterministic; 167 s on the 2 shared cores, 373 s under heavy
    load) and cached: ``<dir>/fsc`` (FSC layout) and ``<dir>/voxceleb1`` (VoxCeleb1 identification layout),
    the same 3840 clips: 24 commands x 40 voices x 4 takes, 16 kHz (test splits: 768 utterances for intent,
    640 for speaker ID). small: the tests' subset, 10 voices x 12 commands x 3 takes (360 clips, 25 s under
    load; test splits 72 and 60).
    Default cache: $CONTRASTKIT_DATA or ~/.cache/contrastkit."""
    base = Path(cache_dir or os.environ.get("CONTRASTKIT_DATA") or Path.home() / ".cache" / "contrastkit")
    name = VERSION + ("-small" if small else "")
    root = base / name
    if (root / "done.json").is_file():
        return root
    tmp = base / f"{name}.tmp{os.getpid()}"
    speakers, commands, takes = SMALL if small else (len(VOICES), len(COMMANDS), TAKES)
    _generate(tmp, [(s, c, t) for s in range(speakers) for c in range(commands) for t in range(takes)])
    try:
        tmp.rename(root)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _room(speaker: int) -> tuple[np.ndarray, float, float]:
    """A speaker's room: (impulse response, microphone tilt, noise level), drawn from the speaker's seed.

    The response is the direct sound plus a tail of exponentially decaying noise (reverberation time
    0.05-0.35 s, 5-30 % of the energy); the tilt is a first-order filter x[n] - a x[n-1]."""
    rng = np.random.default_rng([7, speaker])
    rt60, wet = rng.uniform(0.05, 0.35), rng.uniform(0.05, 0.3)
    t = np.arange(int(rt60 * SAMPLE_RATE)) / SAMPLE_RATE
    tail = rng.normal(size=t.size) * np.exp(-6.9 * t / rt60)
    response = np.sqrt(wet) * tail / np.linalg.norm(tail)
    response[0] = 1.0
    return response, float(rng.uniform(-0.6, 0.6)), float(rng.uniform(0.001, 0.008))


def _job(speaker: int, command: int, take: int) -> dict:
    """The synthesis parameters of one clip: the speaker's voice with the take's jitter of pitch and rate."""
    rng = np.random.default_rng(1000 * speaker + 10 * command + take)
    _, voice, pitch, rate = VOICES[speaker]
    return dict(text=COMMANDS[command][0], voice=voice, pitch=pitch + int(rng.integers(-6, 7)),
                rate=rate + int(rng.integers(-15, 16)), pitch_range=50, clip=(speaker, command, take))


def _finish(audio: np.ndarray, rate: int, job: dict) -> np.ndarray:
    """A synthesised clip to 16 kHz int16 in its speaker's room: resampled (exact band-limited FFT
    resampling, after padding with silence to a whole number of 441-sample blocks: 22050 / 16000 =
    441 / 320), filtered, reverberated, set to a take's level, with a little noise."""
    speaker, command, take = job["clip"]
    if rate != 22050:
        raise ValueError(f"espeak-ng synthesised at {rate} Hz, expected 22050")
    x = np.pad(audio.astype(np.float64), (0, -len(audio) % 441))
    n = len(x) * 320 // 441
    x = np.fft.irfft(np.fft.rfft(x)[:n // 2 + 1], n) * (n / len(x))
    response, tilt, noise = _room(speaker)
    x = np.append(x[:1], x[1:] - tilt * x[:-1])
    size = 1 << int(np.ceil(np.log2(len(x) + len(response))))
    x = np.fft.irfft(np.fft.rfft(x, size) * np.fft.rfft(response, size), size)[:len(x)]
    rng = np.random.default_rng([10**6, speaker, command, take])
    x = x * rng.uniform(0.4, 0.8) / (np.abs(x).max() + 1e-9) + rng.normal(0, noise, len(x))
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def _clips(clips: list[tuple[int, int, int]], desc: str | None = None) -> list[np.ndarray]:
    """The int16 waveforms at 16 kHz of (speaker, command, take) clips: deterministic, whatever the order."""
    from contrastkit.data.speech_synth import synthesize_many

    return synthesize_many([_job(*c) for c in clips], desc=desc, then=_finish)


def _generate(root: Path, clips: list[tuple[int, int, int]]) -> None:
    import soundfile

    fsc_rows, iden_lines = [], []
    waves = _clips(clips, desc=f"synthesising {len(clips)} speech commands")
    for (s, c, take), wave in zip(clips, waves):
        speaker = VOICES[s][0]
        text, action, obj, location = COMMANDS[c]
        name = hashlib.sha1(f"{speaker}-{c}-{take}".encode()).hexdigest()[:12]
        fsc_path = Path("wavs") / "speakers" / speaker / f"{name}.wav"
        (root / "fsc" / fsc_path).parent.mkdir(parents=True, exist_ok=True)
        soundfile.write(str(root / "fsc" / fsc_path), wave, SAMPLE_RATE, subtype="PCM_16")
        fsc_rows.append({"split": fsc_split(s), "path": str(fsc_path), "speaker": speaker,
                         "transcription": text, "action": action, "object": obj, "location": location})
        # VoxCeleb1: each take is a "video"; the same file, hard-linked where the file system allows
        vox_rel = f"{speaker}/take{take}/{c + 1:05d}.wav"
        (root / "voxceleb1" / "wav" / vox_rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(root / "fsc" / fsc_path, root / "voxceleb1" / "wav" / vox_rel)
        except OSError:
            shutil.copyfile(root / "fsc" / fsc_path, root / "voxceleb1" / "wav" / vox_rel)
        iden_lines.append(f"{voxceleb_split(c)} {vox_rel}")
    write_fsc(root / "fsc", fsc_rows)
    (root / "voxceleb1" / "iden_split.txt").write_text("\n".join(iden_lines) + "\n")
    (root / "done.json").write_text(json.dumps({"version": VERSION, "clips": len(clips)}) + "\n")
