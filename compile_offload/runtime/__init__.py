"""What runs with the compiled step: the offload, wait and reload ops on a side stream
(``ops``), the pinned host pool (``pinned_pool``), and the allocator's measure of a step's peak
(``memory_tracker``, ``verify_budget``)."""
