"""prima: run one large language model across a ring of everyday devices."""

__version__ = "0.1.0"
