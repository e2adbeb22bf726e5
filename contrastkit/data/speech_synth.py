"""Offline speech synthesis with espeak-ng: the library shipped in the PyPI package espeakng-loader
(through ctypes), or the ``espeak-ng`` program as a fallback. Returns float32 mono waveforms.

Deterministic through the library (each utterance in a fresh process, its noise seeded from the
utterance); the program fallback seeds the breathy voices' noise with the clock, so those vary per run.
"""

from __future__ import annotations

import ctypes
import functools
import io
import shutil
import subprocess
import zlib
from typing import Any, Callable

import numpy as np

_AUDIO_OUTPUT_SYNCHRONOUS = 0x02
_POS_CHARACTER, _CHARS_AUTO = 1, 0
_RATE, _PITCH, _RANGE = 1, 3, 4
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Library:
    """libespeak-ng from espeakng-loader, initialised once for synchronous synthesis into memory."""

    def __init__(self):
        import espeakng_loader

        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.sample_rate = self.lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0,
                                                      espeakng_loader.get_data_path().encode(), 0)
        if self.sample_rate <= 0:
            raise RuntimeError("espeak_Initialize failed")
        self.chunks: list[np.ndarray] = []

        def collect(wav, n, events):
            if n > 0:
                self.chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        self.callback = _CALLBACK(collect)  # keep a reference: the library calls it
        self.lib.espeak_SetSynthCallback(self.callback)

    def synth(self, text: str, voice: str, rate: int, pitch: int, pitch_range: int) -> tuple[np.ndarray, int]:
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        for key, value in ((_RATE, rate), (_PITCH, pitch), (_RANGE, pitch_range)):
            self.lib.espeak_SetParameter(key, value, 0)
        # espeak-ng seeds the noise of its breathy voices (en+f2, +f3, +f5, ...) with the clock at initialisation:
        # seeded from the utterance instead, the same job gives the same samples in any second
        self.lib.espeak_ng_SetRandSeed(zlib.crc32(repr((text, voice, rate, pitch, pitch_range)).encode()))
        self.chunks = []
        data = text.encode() + b"\0"
        if self.lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_AUTO, None, None) != 0:
            raise RuntimeError(f"espeak_Synth failed on {text!r}")
        self.lib.espeak_Synchronize()
        audio = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)
        return audio.astype(np.float32) / 32768.0, self.sample_rate


_LIBRARY: _Library | None = None


def synthesize(text: str, *, voice: str = "en", rate: int = 160, pitch: int = 50,
               pitch_range: int = 50) -> tuple[np.ndarray, int]:
    """(waveform float32 [T], sample rate) of ``text`` spoken by espeak-ng ``voice`` (e.g. "en+f3")."""
    return synthesize_many([dict(text=text, voice=voice, rate=rate, pitch=pitch, pitch_range=pitch_range)])[0]


def synthesize_many(jobs: list[dict], processes: int = 2, desc: str | None = None,
                    then: Callable[[np.ndarray, int, dict], Any] | None = None) -> list:
    """``synthesize(**job)`` for every job, each in a fresh forked process; with ``then``, what
    ``then(audio, sample_rate, job)`` returns (run in the child too, so post-processing is parallel).

    libespeak-ng keeps internal state from one utterance to the next (the same text comes out a few
    samples different the second time, even after re-initialising), so each utterance is synthesised in
    a child forked from this process, which never synthesises itself: every one starts from the same
    state and the output is deterministic.
    """
    import multiprocessing

    from tqdm import tqdm

    with multiprocessing.get_context("fork").Pool(processes, maxtasksperchild=1) as pool:
        results = pool.imap(functools.partial(_synthesize_here, then=then), jobs, chunksize=1)
        return list(tqdm(results, total=len(jobs), desc=desc, leave=False, disable=desc is None))


def _synthesize_here(job: dict, then=None):
    audio, sample_rate = _synthesize_one(job)
    return (audio, sample_rate) if then is None else then(audio, sample_rate, job)


def _synthesize_one(job: dict) -> tuple[np.ndarray, int]:
    global _LIBRARY
    try:
        if _LIBRARY is None:
            _LIBRARY = _Library()
        return _LIBRARY.synth(job["text"], job["voice"], job["rate"], job["pitch"], job["pitch_range"])
    except (ImportError, OSError):
        return _synthesize_program(job["text"], job["voice"], job["rate"], job["pitch"], job["pitch_range"])


def _synthesize_program(text, voice, rate, pitch, pitch_range) -> tuple[np.ndarray, int]:
    import soundfile

    program = shutil.which("espeak-ng") or shutil.which("espeak")
    if program is None:
        raise RuntimeError("speech synthesis needs espeak-ng: `pip install espeakng-loader` (ships the library) "
                           "or install the espeak-ng program (e.g. `apt-get install espeak-ng`)")
    cmd = [program, "-v", voice, "-s", str(rate), "-p", str(pitch), "-a", "100", "--stdout", text]
    wav = subprocess.run(cmd, check=True, capture_output=True).stdout
    audio, sr = soundfile.read(io.BytesIO(wav), dtype="float32")
    return audio, sr
