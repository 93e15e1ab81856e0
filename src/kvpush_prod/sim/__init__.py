"""``kvpush sim``: a discrete-event simulator of P/D clusters that drives the pure core
(Sender, Receiver, ChunkScheduler, CreditLedger, leases) to compare pull, plain push and kvpush."""
