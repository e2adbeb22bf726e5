"""Import this module and every supported Hugging Face dual encoder (CLIP family, CLAP) trains with DCL.

    import contrastkit.adapters.hf_clip_dcl  # noqa: F401   (the one line added to a script)

It calls ``hf_clip.patch(None, loss=...)`` on import. The objective is DCL unless the environment
variable CONTRASTKIT_LOSS names another (infonce, dclw, eqco, cacr); CONTRASTKIT_TEMPERATURE fixes the
temperature (default: the model's learnable logit scale); CONTRASTKIT_GATHER=1 takes the negatives from
every process (gathered with gradient). All are checked here, at import, with errors that name the
variable. ``PATCH.undo()`` (or ``hf_clip.unpatch()``) undoes it.
"""

from contrastkit.adapters import hf_clip
from contrastkit.adapters.patching import patch_from_env

PATCH = patch_from_env(hf_clip.patch, gather=True)
