"""Pure protocol core: no vllm, nixl, sockets, threads, sleeps or clock reads.

Time is always an argument; outputs are actions for the shells to carry out.
"""
