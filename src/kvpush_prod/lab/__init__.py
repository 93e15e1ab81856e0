"""The lab: local engines, a P/D cluster on one machine, a client, the tiny model, the demo and
``serve``. Used by the demo, tests, chaos and benchmarks; the product never imports it.
"""
