"""Evaluation logic (zero-shot, kNN, linear probe, speaker ID, intent); eval/ scripts are thin wrappers."""
