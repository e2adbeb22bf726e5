"""Patch points that plug contrastkit losses into open_clip, Hugging Face and fairseq2 wav2vec 2.0."""
