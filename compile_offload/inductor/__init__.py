"""Inductor's side: hooks that keep the plan's order in the code Inductor generates
(``copy_order``, ``plan_order_fusion``), the kernels it generated read back (``kernels``),
extern ops' workspaces measured (``op_workspace``), and a backward lowered at compile time
lowered again for ``retain_graph`` (``retain_graph``)."""
