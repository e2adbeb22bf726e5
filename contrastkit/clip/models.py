"""open_clip models for the recipe and the evals: contrastkit's own configs (contrastkit-tiny) and creation
with random initialisation (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_MODEL = "contrastkit-tiny"


def register_configs() -> None:
    """Make the model configs that ship with contrastkit (e.g. contrastkit-tiny) known to open_clip."""
    import open_clip

    if DEFAULT_MODEL not in open_clip.list_models():
        open_clip.add_model_config(CONFIG_DIR)


def check_model(name: str) -> None:
    """Raise ValueError unless ``name`` is an open_clip config (contrastkit's included)."""
    import open_clip

    register_configs()
    if name not in open_clip.list_models():
        known = open_clip.list_models()
        raise ValueError(f"unknown open_clip model config {name!r}; e.g. {', '.join(known[:8])}, ... "
                         f"({len(known)} known, see open_clip.list_models())")


def create_clip(name: str, **model_options):
    """(model, preprocess, tokenizer) for an open_clip config name, randomly initialised (no download);
    ``model_options`` go to the model class (e.g. ``nonscalar_logit_scale=True``: FSDP2 shards no scalar)."""
    import open_clip

    check_model(name)
    model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=None, output_dict=True,
                                                                 **model_options)
    return model, preprocess, open_clip.get_tokenizer(name)
