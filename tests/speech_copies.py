"""Tiny copies of the embedded speech data in FSC's and VoxCeleb1's own layouts, for the tests that run an
evaluation or a suite cell on them: a few dozen utterances, so the upstream's features (one forward pass per
utterance, the bulk of an evaluation's time) cost seconds, not the minute of the tests' 360-clip subset."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from contrastkit.data import speech


def tiny_copies(tmp_path, fsc_sizes: tuple[int, int, int] = (24, 8, 8)) -> tuple[Path, Path]:
    """FSC (24 train, 8 valid, 8 test utterances, or ``fsc_sizes``: 2 speakers each, (de)activate intents only;
    the first 12 of train hold both actions, both objects and 3 locations) and VoxCeleb1 (3 speakers: 4 train,
    2 dev, 2 test utterances each) copies under ``tmp_path``: (fsc, vox)."""
    src = speech.default_speech_data(small=True)
    fsc = tmp_path / "fsc"
    (fsc / "data").mkdir(parents=True)
    for split, n in zip(("train", "valid", "test"), fsc_sizes):
        rows = speech.read_fsc(src / "fsc", split)
        speakers = sorted({r["speaker"] for r in rows})[:2]
        picked = [r for r in rows if r["speaker"] in speakers and r["intent"].startswith(("activate", "deactivate"))][:n]
        with (fsc / "data" / f"{split}_data.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["", *speech.FSC_COLUMNS])
            for i, r in enumerate(picked):
                rel = Path(r["path"]).relative_to(src / "fsc")
                (fsc / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(r["path"], fsc / rel)
                w.writerow([i, rel, r["speaker"], r["transcription"], r["action"], r["object"], r["location"]])
    vox = tmp_path / "vox"
    lines = []
    for split, code in speech.VOX_SPLITS.items():
        rows = speech.read_voxceleb_iden(src / "voxceleb1", split)
        per_speaker = 4 if split == "train" else 2
        picked = [r for spk in ("id10001", "id10002", "id10003") for r in [r for r in rows if r["speaker"] == spk][:per_speaker]]
        for r in picked:
            rel = Path(r["path"]).relative_to(src / "voxceleb1" / "wav")
            (vox / "wav" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(r["path"], vox / "wav" / rel)
            lines.append(f"{code} {rel}")
    (vox / "iden_split.txt").write_text("\n".join(lines) + "\n")
    return fsc, vox
