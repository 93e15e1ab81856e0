"""Tests of kvpush_prod.core (the package mirrors src/)."""
