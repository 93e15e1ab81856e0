"""Tests of kvpush_prod.sim (the package mirrors src/)."""
