"""Import this module and every Hugging Face wav2vec 2.0 pre-training model trains with DCL.

    import contrastkit.adapters.hf_wav2vec2_dcl  # noqa: F401   (the one line added to a script)

It calls ``hf_wav2vec2.patch(None, loss=...)`` on import. The objective is DCL unless the environment
variable CONTRASTKIT_LOSS names another (infonce, dclw, eqco, cacr); CONTRASTKIT_TEMPERATURE sets the
temperature (default: the model's ``contrastive_logits_temperature``). ``hf_wav2vec2.unpatch()`` undoes it.
"""

import os

from contrastkit.adapters import hf_wav2vec2

_options = {}
if os.environ.get("CONTRASTKIT_TEMPERATURE"):
    _options["temperature"] = float(os.environ["CONTRASTKIT_TEMPERATURE"])
PATCH = hf_wav2vec2.patch(None, loss=os.environ.get("CONTRASTKIT_LOSS", "dcl"), **_options)
