"""The inputs of tools/gpu/e2e.sh, made locally (nothing downloaded): every entry point's embedded
data and the small models that the third-party scripts load from a folder.

    python tools/gpu/e2e_data.py .e2e --speech-only   # on this machine: the speech set needs espeak-ng,
                                                       # which the GPU machine lacks; .e2e/ then travels
    python tools/gpu/e2e_data.py .e2e                 # on the GPU machine: the rest (absolute paths there)
    python tools/gpu/e2e_data.py DIR --small          # --dry-run's sizes

Writes into DIR (each part skipped where it is already there; made.json, written last, lists the parts, so that
a later call, one per run of e2e.sh, finds them all without importing the libraries that make them):
  speech/      the embedded speech set (contrastkit.data.speech, its tests' subset of 360 clips: fsc/ and
               voxceleb1/ layouts), for the wav2vec 2.0 and CLAP recipes and, as an audio folder, for
               transformers' wav2vec 2.0 pre-training script
  shapes/      the CLIP recipe's embedded image-text set (its train.csv is open_clip_train's --train-data)
  run_clip/    run_clip.py's --train_file (json lines) and a small CLIPModel (a word-level tokenizer over the
               captions): a ViT + BERT dual encoder this small starts with every caption at one point (the BERT
               and ViT poolers' tanh of a near-constant [CLS]; mean cosine 0.9999) and its loss sits at ln(batch)
  wav2vec2/    a small Wav2Vec2Config (stable layer norm, what the script requires) and its feature extractor
  st/          a small SentenceTransformer (BERT + mean pooling) over the paraphrase set's words
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

# (--small, full): the models' widths; the image sets' sizes
SIZES = {
    "shapes_pairs": (256, 4096), "zeroshot_per_class": (4, 50),
    "run_clip_pairs": (64, 1024), "hidden": (32, 256), "layers": (1, 4),
    "clip_width": (32, 128), "clip_layers": (1, 2), "clip_embed": (16, 64),  # contrastkit-tiny's widths
}


def speech(out: Path) -> Path:
    from contrastkit.data.speech import default_speech_data

    return default_speech_data(out / "speech", small=True)


def shapes(out: Path, small: bool) -> Path:
    from contrastkit.data.image_text import make_shapes_clip

    pairs, zeroshot = SIZES["shapes_pairs"][not small], SIZES["zeroshot_per_class"][not small]
    return make_shapes_clip(out / "shapes", num_train=pairs, num_zeroshot_per_class=zeroshot, progress=False)


def run_clip(out: Path, shapes_dir: Path, small: bool) -> None:
    root = out / "run_clip"
    if (root / "model" / "config.json").exists():
        return
    with open(shapes_dir / "train.csv", newline="") as f:
        rows = [{"image_path": r["filepath"], "caption": r["title"]} for r in csv.DictReader(f, delimiter="\t")]
    rows = rows[: SIZES["run_clip_pairs"][not small]]
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    clip_model(root / "model", [r["caption"] for r in rows], small)


def clip_model(root: Path, captions: list[str], small: bool, image_size: int = 32) -> None:
    """A CLIPModel of contrastkit-tiny's widths (random weights) with a word-level tokenizer over the captions
    and an image processor, saved where run_clip.py's --model_name_or_path reads them. The text tower pools at
    the first [SEP] (its eos_token_id; CLIP's legacy rule, the largest token id, takes id 2 to mean it)."""
    import torch
    import transformers as T

    from contrastkit.speech.clap import word_tokenizer

    tokenizer = word_tokenizer(root, captions, ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))  # [SEP] = 3
    assert tokenizer.sep_token_id != 2, "eos_token_id 2 selects CLIP's legacy pooling"
    width = SIZES["clip_width"][not small]
    common = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=SIZES["clip_layers"][not small],
                  num_attention_heads=4)
    text = dict(common, vocab_size=len(tokenizer), max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id)
    config = T.CLIPConfig(text_config=text, vision_config=dict(common, image_size=image_size, patch_size=8),
                          projection_dim=SIZES["clip_embed"][not small])
    torch.manual_seed(0)
    T.CLIPModel(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    T.ViTImageProcessor(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                        image_std=[0.5] * 3).save_pretrained(root)


def wav2vec2(out: Path) -> None:
    root = out / "wav2vec2"
    if (root / "preprocessor_config.json").exists():  # made: no import (a run of e2e.sh calls this each time)
        return
    from transformers import Wav2Vec2FeatureExtractor

    from contrastkit.speech.models import hf_config

    hf_config(feat_extract_norm="layer", do_stable_layer_norm=True).save_pretrained(root)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16_000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(root)


def sentence_model(out: Path, small: bool) -> None:
    root = out / "st"
    if (root / "modules.json").exists():  # made: no import (sentence-transformers' alone takes seconds)
        return
    import torch
    import transformers as T
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from contrastkit.data.paraphrase import paraphrase_split
    from contrastkit.speech.clap import word_tokenizer

    train, test = paraphrase_split(num_train=1024, num_test=256)
    bert = out / "st-bert"
    tokenizer = word_tokenizer(bert, [t for pair in train + test for t in pair])
    hidden, layers = SIZES["hidden"][not small], SIZES["layers"][not small]
    config = T.BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                          num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                          max_position_embeddings=64)
    torch.manual_seed(0)
    T.BertModel(config).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    encoder = Transformer(str(bert), max_seq_length=32)
    SentenceTransformer(modules=[encoder, Pooling(encoder.get_embedding_dimension(), "mean")]).save(str(root))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--small", action="store_true", help="--dry-run's sizes")
    p.add_argument("--speech-only", action="store_true", help="the speech set alone (it needs espeak-ng)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    made = a.out / "made.json"
    if not a.speech_only and made.is_file():
        record = json.loads(made.read_text())
        if record["small"] == a.small and all(Path(part).exists() for part in record["parts"]):
            print(f"made: {', '.join(record['parts'])} ({made})")
            return
    speech_dir = speech(a.out)
    print(f"speech set: {speech_dir}")
    if a.speech_only:
        return
    shapes_dir = shapes(a.out, a.small)
    print(f"image-text set: {shapes_dir}")
    run_clip(a.out, shapes_dir, a.small)
    wav2vec2(a.out)
    sentence_model(a.out, a.small)
    print(f"models: {a.out}/run_clip/model, {a.out}/wav2vec2, {a.out}/st")
    parts = [speech_dir, shapes_dir, a.out / "run_clip" / "model", a.out / "wav2vec2", a.out / "st"]
    made.write_text(json.dumps({"small": a.small, "parts": [str(part) for part in parts]}) + "\n")


if __name__ == "__main__":
    main()
