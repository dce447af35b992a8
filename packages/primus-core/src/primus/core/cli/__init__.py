"""The command line (``primus ...``, ``python -m primus.core.cli.app``): one module a command group, assembled in
:mod:`.app`. Top room: imports any room below (launch, run, planner, kernels/hf/data/profile, config, contracts);
nothing imports it."""
