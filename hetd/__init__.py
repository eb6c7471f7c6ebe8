"""hetd: a parameter server for training one model on workers that are not alike."""

__version__ = "0.1.0"
