"""Tests of kvpush_prod.transport (the package mirrors src/)."""
