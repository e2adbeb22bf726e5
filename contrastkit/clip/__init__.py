"""Image-text training through open_clip: model configs and creation, the training loop, the comparison."""
