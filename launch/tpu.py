"""Commands that start a config's job on TPU multi-slice (printed; run with --run).

  python -m launch.tpu --config=configs/paper_qwq32b.py --project=my-proj --zone=us-east5-a
  python -m launch.tpu --config=configs/v5p_128.py --method=xpk --cluster=my-gke --run

The slice shape comes from `config.plan` (topology "v5p:8x8x8", num_slices 2 → 2 x v5p-1024, Google's
accelerator names count TensorCores: 2 per v5p chip). --method=qr: a queued resource of num_slices nodes
(multislice, DCN between them), then `gcloud ... ssh --worker=all` runs the same command on every host;
JAX's multi-host runtime (MEGASCALE env set by the queued resource) forms one job over all slices.
--method=xpk: one `xpk workload create` on a GKE cluster. --pathways installs the pathways extra (and uses
`xpk workload create-pathways`) so the controller's `rlax.multihost.maybe_init_pathways()` gives one
controller over all slices. `--config.<field>` overrides given here reach the hosts' launch.main too.
"""

import shlex
import subprocess
import sys

from absl import app, flags

from launch.flags_util import config_args, define_config, parse_or_exit

CONFIG = define_config(None)
METHOD = flags.DEFINE_enum("method", "qr", ["qr", "xpk"], "queued resources + ssh, or xpk on GKE.")
NAME = flags.DEFINE_string("name", "rlax", "Queued-resource / workload name.")
PROJECT = flags.DEFINE_string("project", "$PROJECT", "GCP project.")
ZONE = flags.DEFINE_string("zone", "$ZONE", "GCP zone with the TPU capacity.")
CLUSTER = flags.DEFINE_string("cluster", "$CLUSTER", "xpk: GKE cluster name.")
RUNTIME = flags.DEFINE_string("runtime_version", "v2-alpha-tpuv5", "qr: TPU VM runtime image.")
REPO = flags.DEFINE_string("repo", "https://github.com/$USER/rlax.git", "Where hosts get the code.")
PATHWAYS = flags.DEFINE_bool("pathways", False, "Install the pathways extra on hosts.")
RUN = flags.DEFINE_bool("run", False, "Run the commands instead of printing them.")
CONFIG_ARG = flags.DEFINE_string("config_path", "", "Config path as hosts see it (default: --config's).")


def accelerator_type(topology: str) -> str:
  """'v5p:8x8x8' → 'v5p-1024' (TensorCores = 2 x chips on v5p/v4; chips on v5e/v6e)."""
  try:
    gen, dims = topology.split(":")
    chips = 1
    for d in dims.split("x"):
      chips *= int(d)
  except ValueError:
    raise ValueError(f"plan.topology={topology!r} is not '<generation>:<AxBxC>' (e.g. 'v5p:8x8x8')") from None
  cores = chips * 2 if gen in ("v4", "v5p") else chips
  return f"{gen}-{cores}"


def commands(c, main_args: dict[str, str]) -> list[str]:
  """The shell commands, in order, for --method; each is one line. `main_args`: launch.main's flags."""
  acc = accelerator_type(c.plan.topology)
  extras = ".[tpu,pathways]" if PATHWAYS.value else ".[tpu]"
  main_flags = " ".join(shlex.quote(f"--{k}={v}") for k, v in main_args.items())
  job = (f"git clone {REPO.value} rlax 2>/dev/null || git -C rlax pull; cd rlax && "
         f"pip install -e {shlex.quote(extras)} && python -m launch.main {main_flags}")
  if METHOD.value == "xpk":
    verb = "create-pathways" if PATHWAYS.value else "create"
    return [f"xpk workload {verb} --cluster={CLUSTER.value} --workload={NAME.value} --tpu-type={acc} "
            f"--num-slices={c.plan.num_slices} --project={PROJECT.value} --zone={ZONE.value} "
            f"--command={shlex.quote(job)}"]
  where = f"--project={PROJECT.value} --zone={ZONE.value}"
  cmds = [f"gcloud compute tpus queued-resources create {NAME.value} --node-count={c.plan.num_slices} "
          f"--node-prefix={NAME.value} --accelerator-type={acc} --runtime-version={RUNTIME.value} {where}",
          f"until [ \"$(gcloud compute tpus queued-resources describe {NAME.value} {where} "
          f"--format='value(state.state)')\" = ACTIVE ]; do sleep 30; done"]
  for i in range(c.plan.num_slices):
    cmds.append(f"gcloud compute tpus tpu-vm ssh {NAME.value}-{i} {where} --worker=all "
                f"--command={shlex.quote(job)} &")
  cmds.append("wait")
  return cmds


def main(argv):
  del argv
  c = CONFIG.value
  if c is None or "plan" not in c:
    print("rlax: tpu: the config needs a `plan` section with topology/num_slices (configs/paper_qwq32b.py)",
          file=sys.stderr)
    sys.exit(2)
  main_args = config_args()  # --config and its overrides reach the hosts' launch.main
  if CONFIG_ARG.value:
    main_args["config"] = CONFIG_ARG.value
  try:
    cmds = commands(c, main_args)
  except ValueError as e:
    print(f"rlax: tpu: {e}", file=sys.stderr)
    sys.exit(2)
  print("\n".join(cmds))
  if RUN.value:
    sys.exit(subprocess.run(["bash", "-ec", "\n".join(cmds)]).returncode)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_or_exit)
