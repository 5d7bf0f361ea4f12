"""Horovod front end for ckpt-suite.

Placeholder: the Horovod front end arrives in a later release.
"""
