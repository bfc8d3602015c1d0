#!/usr/bin/env bash
# Stop what scripts/slurm/start.sh DIR started, and only that: cancel its jobs, wait for their step daemons, stop
# slurmd, slurmctld and munged by the process ids in DIR, unmount DIR/cgroup/memory and remove the empty job
# cgroups left under it. Safe to run twice, or after a start that failed half way.
#
#   bash scripts/slurm/stop.sh DIR
set -uo pipefail
dir=${1:?usage: scripts/slurm/stop.sh DIR}
[ -d "$dir" ] || exit 0
dir=$(cd "$dir" && pwd)
export SLURM_CONF="$dir/slurm.conf"

alive() { [ -f "$dir/$1.pid" ] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }

# This Slurm's step daemons: slurmstepd processes started by our slurmd (they carry its SLURM_CONF).
our_stepds() {
    for p in /proc/[0-9]*; do
        [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ] || continue
        { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF" && echo "${p#/proc/}"
    done
}

# Processes of this Slurm's jobs still alive after their jobs ended (a job's environment carries the SLURM_CONF
# it was submitted with and its SLURM_JOB_ID).
our_job_processes() {
    for p in /proc/[0-9]*; do
        env=$({ tr '\0' '\n' <"$p/environ"; } 2>/dev/null) || continue
        grep -qx "SLURM_CONF=$SLURM_CONF" <<<"$env" && grep -q "^SLURM_JOB_ID=" <<<"$env" && echo "${p#/proc/}"
    done
}

if alive slurmctld; then
    scancel --full --quiet --user=root 2>/dev/null || true
    for _ in $(seq 100); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && [ -z "$(our_stepds)" ] && break
        sleep 0.2
    done
fi
left=$(our_job_processes)
for pid in $(our_stepds) $left; do kill -KILL "$pid" 2>/dev/null || true; done
for d in slurmd slurmctld munged; do
    if alive "$d"; then kill "$(cat "$dir/$d.pid")" 2>/dev/null || true; fi
done
for _ in $(seq 100); do
    alive slurmd || alive slurmctld || alive munged || break
    sleep 0.1
done
for d in slurmd slurmctld munged; do
    if alive "$d"; then kill -KILL "$(cat "$dir/$d.pid")" 2>/dev/null || true; fi
done
if mountpoint -q "$dir/cgroup/memory" 2>/dev/null; then
    # Job cgroups Slurm did not remove (a step killed above): deepest first, only empty ones (rmdir refuses others).
    find "$dir"/cgroup/memory/slurm* -depth -type d -exec rmdir {} \; 2>/dev/null || true
    umount "$dir/cgroup/memory" 2>/dev/null || umount -l "$dir/cgroup/memory" 2>/dev/null || true
fi
echo "slurm: stopped (DIR $dir); processes of ended jobs left running, killed: $(echo $left | wc -w)"
