#!/usr/bin/env bash
# The start-up import time of an image's two processes, measured inside a container of it (buildah,
# no engine): the CPU time (user + system) and the wall time of a fresh `python3 -c "import
# cli.main, netagent.daemon"` (what `netagent run` loads before it touches the node) and of
# `... controller.app` (`netagent controller`), as the image's user, median of N runs each. CPU
# time is the figure to compare on a busy machine: the wall time adds whatever else runs.
#
#   hack/release/importtime.sh IMAGE [N]     # N defaults to 7
set -euo pipefail
image=${1:?usage: importtime.sh IMAGE [N]}
runs=${2:-7}
[[ $runs =~ ^[1-9][0-9]*$ ]] || { echo "importtime: N must be a positive integer, not '$runs'" >&2; exit 2; }
ctr=$(buildah from --quiet --pull-never "$image")
trap 'buildah rm "$ctr" >/dev/null' EXIT
# the outer interpreter only times its children; each child is a new process, as at a pod's start
buildah run --network=none "$ctr" -- python3 -c '
import statistics, subprocess, sys, time
runs = int(sys.argv[1])
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
for name, modules in (("agent", "cli.main, netagent.daemon"), ("controller", "cli.main, controller.app")):
    wall, used = [], []
    for _ in range(runs):
        start, cpu0 = time.perf_counter(), cpu()
        subprocess.run([sys.executable, "-c", "import " + modules], check=True)
        wall.append(time.perf_counter() - start)
        used.append(cpu() - cpu0)
    print(f"{name}: import {modules}: CPU median {statistics.median(used):.2f} s, wall median "
          f"{statistics.median(wall):.2f} s (min {min(wall):.2f}) of {runs}")
' "$runs"
