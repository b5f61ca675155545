"""clustersim: a discrete-event simulator of large-scale transformer training.

Give it a model, a cluster and a parallel plan; it tells how long one training step takes, where the
time goes, and whether it fits in memory.

>>> import simulator
>>> simulator.__version__
'0.1.0'
"""

from __future__ import annotations

__version__ = "0.1.0"
