"""PyTorch Lightning front end for ckpt-suite.

Placeholder: the Lightning front end arrives in a later release.
"""
