"""Entry points, each run as `python -m launch.<name>`: main, plan, multihost, tpu, xm_launch, make_data,
fault_inject, gen_build. Modules named `_*` and `flags_util` are their shared code."""
