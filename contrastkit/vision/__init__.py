"""Vision pre-training: backbones, augmentations, SimCLR / MoCo v2 / SiMo methods, the training loop."""
