"""Turns a scheduler decision into tensors, runs the model, samples."""
