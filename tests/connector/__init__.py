"""Tests of kvpush_prod.connector (the package mirrors src/)."""
