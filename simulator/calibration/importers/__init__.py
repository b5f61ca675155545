"""Importers: third-party kernel and collective measurements translated into :class:`~..rows.Measurement` rows."""
