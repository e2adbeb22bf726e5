"""Image-text training through open_clip: the training loop and the comparison of objectives (the model
configs and their creation live with the open_clip adapter)."""
