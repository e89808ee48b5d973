"""User tools beside the backend: ``explain``, ``sweep``, ``max_batch``, ``profile_step``, the
command line's verbs (``demo``, ``cli_explain``, ``bench``, ``model_check``), and the studies
``model_check`` runs (``calibrate``: a profile's constants fitted to measured steps;
``solve_exhaustive``: the exact optimum of small graphs)."""
