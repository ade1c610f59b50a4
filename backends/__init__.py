"""Inference backends behind one contract (:mod:`backends.base`), errors in :mod:`backends.errors`."""
