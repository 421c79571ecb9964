"""bmeg's version: one place, read by the package, the checkpoints and the server (and by
setuptools for the distribution), importing nothing so that any layer may use it."""

__version__ = "0.1.0"
