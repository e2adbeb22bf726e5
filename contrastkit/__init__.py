"""contrastkit: DCL, DCLW, EqCo, CACR and UniGrad as drop-in replacements for InfoNCE."""

__version__ = "0.1.0"
