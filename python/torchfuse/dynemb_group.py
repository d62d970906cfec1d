"""The former name of :mod:`torchfuse.dynemb_tables` (table-batched steps), kept as an alias."""
import sys

from . import dynemb_tables as _tables

sys.modules[__name__] = _tables
