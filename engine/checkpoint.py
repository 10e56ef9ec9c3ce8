"""Checkpoints: save and resume at a window boundary (being written)."""


def save_checkpoint(engine, path, *, data=None, client_state=None):
    raise NotImplementedError


def load_checkpoint(engine, path, *, data=None):
    raise NotImplementedError
