"""Calibration: measured kernels and collectives in, efficiency tables out, predictions checked.

* :mod:`.rows` — the tidy measurement row every source produces (our PyTorch profiler, third-party data).
* :mod:`.importers` — readers for public profiles (Vidur, nccl-tests, PyTorch profiler traces).
* :mod:`.fit` — rows to a :class:`~simulator.specs.calibration.CalibrationTable`, with a held-out residual
  report, and the device-independent default table.
* :mod:`.profile`, :mod:`.check` — the loop on real hardware (PyTorch, optional extra, imported lazily through
  :mod:`.torchlib`): time the kernels and collectives of a model, train a small real GPT and compare.
* :mod:`.host` — device and cluster profiles of the machine at hand from its own measurements.
* :mod:`.workflow` — the commands' compositions (fit files, the whole loop); :mod:`.cli` — ``clustersim calibrate``.

Nothing here is imported by the engine; the simulator reads only the fitted tables.
"""
