"""Runtime test configs: the demo config with dotted overrides, and its `tiny` variant (configs/demo.py:tiny)."""

from configs import demo


def demo_config(workdir, arg=None, **over):
  """The demo config (`demo.get_config(arg)`) in `workdir` with `{"a.b": value}` overrides applied."""
  c = demo.get_config(arg)
  c.workdir = str(workdir)
  for k, v in over.items():
    node = c
    *path, last = k.split(".")
    for p in path:
      node = node[p]
    node[last] = v
  return c


def tiny_config(workdir, **over):
  return demo_config(workdir, "tiny", **over)
