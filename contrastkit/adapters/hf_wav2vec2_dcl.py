"""Import this module and every Hugging Face wav2vec 2.0 pre-training model trains with DCL.

    import contrastkit.adapters.hf_wav2vec2_dcl  # noqa: F401   (the one line added to a script)

It calls ``hf_wav2vec2.patch(None, loss=...)`` on import. The objective is DCL unless the environment
variable CONTRASTKIT_LOSS names another (infonce, dclw, eqco, cacr); CONTRASTKIT_TEMPERATURE sets the
temperature (default: the model's ``contrastive_logits_temperature``). Both are checked here, at import,
with errors that name the variable. ``PATCH.undo()`` (or ``hf_wav2vec2.unpatch()``) undoes it.
"""

from contrastkit.adapters import hf_wav2vec2
from contrastkit.adapters.patching import patch_from_env

PATCH = patch_from_env(hf_wav2vec2.patch)
