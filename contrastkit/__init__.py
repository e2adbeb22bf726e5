"""contrastkit: DCL, DCLW, EqCo, CACR and UniGrad as drop-in replacements for InfoNCE."""

__version__ = "0.2.0"
