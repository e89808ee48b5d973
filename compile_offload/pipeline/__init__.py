"""The compile pipeline: the ``offload_remat`` backend (``backend``), the partitioner Inductor
calls (``partitioner``), planning one joint graph (``planning``), the budget loop that checks
each plan against the kernels Inductor generated (``budget_loop``), and what they need: the
plan cache, records for cache-served compiles, DDP buckets, dynamic sizes, device profiles and
the placement of planned offloads in the partitioned graphs."""
