"""Other tools' checkpoint formats, in and out: one module per format (issue #38).

Each module converts between a checkpoint of ours and one format another tool reads or writes,
streaming tensor by tensor where the format allows and verifying every byte read from ours.
Nothing here is imported by the core: the ``ckpt`` CLI and the front ends import a module when a
command or option asks for its format.
"""
