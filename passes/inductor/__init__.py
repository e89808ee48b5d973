"""The memory model's knowledge of Inductor's lowering: which nodes become kernels of their
own and which fuse (``kernel_local``, ``node_kinds``), the C++ backend's loop ranges
(``loop_ranges``), attention biases Inductor copies (``attention_bias_copies``), and the two
graph passes that put the joint graph in the order Inductor computes it
(``smaller_matmuls_first``, ``unfused_mm_add``)."""
