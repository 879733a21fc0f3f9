"""edgeinfer: serve large language models close to their users."""

__version__ = "0.1.0"
