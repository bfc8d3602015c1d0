#!/usr/bin/env bash
# A real one-node Slurm on this host, for the tests marked `slurm` (tests/test_slurm.py starts and stops it):
#
#   bash scripts/slurm/start.sh DIR      # then: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/slurm/stop.sh DIR
#
# Installs what is missing (apt-get: slurmctld slurmd slurm-client munge), then starts munged, slurmctld and slurmd
# for one node, this machine with its real CPUs and memory (`slurmd -C`), every file they write under DIR (a
# temporary directory: configuration, keys, sockets, state, logs). No daemon of the system's is used or touched:
# munged listens on DIR/munge.socket, the controller and the node daemon on free ports, and the commands find them
# through SLURM_CONF. Writes nothing outside DIR but the packages apt-get installs and, where the memory
# controller is usable, the jobs' cgroups (see below).
#
# Memory enforcement. Where this process's memory cgroup (cgroup v1) accepts child groups, it is bind-mounted at
# DIR/cgroup/memory and Slurm's task/cgroup puts each job under it with a limit of the job's --mem
# (ConstrainRAMSpace): the kernel kills a job's process over it, inside the job (jobs stay nested in the
# cgroup of whoever started Slurm). Where it is not (no cgroup v1 memory controller, no mount permission, or
# Slurm 22.05's cgroup/v2 plugin, which needs systemd), jobs run without cgroups and Slurm's accounting poll kills
# a job over its --mem (JobAcctGatherParams=OverMemoryKill, every 1 s). DIR/cgroup.state says which, in one line
# the tests print; both end the job OUT_OF_MEMORY. MEMCHUNK_SLURM_CGROUP=off starts it without cgroups wherever
# (to run the tests the way a machine without them does).
#
# Exit status: 0 started (DIR/env holds SLURM_CONF=...); 3 Slurm cannot be started here (not root, no apt-get,
# the packages do not install): the tests skip, saying this line, except with CI=true; anything else: it should
# have started and did not (the logs under DIR/log are printed).
set -euo pipefail
dir=${1:?usage: scripts/slurm/start.sh DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
cannot() { echo "slurm: cannot start here: $*" >&2; exit 3; }
say() { echo "slurm: $*"; }

[ "$(id -u)" = 0 ] || cannot "not root (munged, slurmd and job cgroups need root; CI runs as root)"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || cannot "Slurm is not installed and there is no apt-get to install it"
    say "installing slurmctld slurmd slurm-client munge (apt-get)"
    pkgs="slurmctld slurmd slurm-client munge"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs >"$dir/apt.log" 2>&1; then
        apt-get update -q >>"$dir/apt.log" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs >>"$dir/apt.log" 2>&1 \
            || cannot "apt-get install $pkgs failed: $(tail -n 3 "$dir/apt.log" | tr '\n' ' ')"
    fi
fi

mkdir -p "$dir/log" "$dir/ctld" "$dir/spool" "$dir/cgroup"
chmod 700 "$dir"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---------------------------------------------------------------------------- munge, on a socket of its own
key="$dir/munge.key"
[ -f "$key" ] || { head -c 1024 /dev/urandom >"$key"; chmod 400 "$key"; }
munged --socket="$dir/munge.socket" --key-file="$key" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" --force
for _ in $(seq 50); do [ -S "$dir/munge.socket" ] && break; sleep 0.1; done
munge -S "$dir/munge.socket" -n | unmunge -S "$dir/munge.socket" >/dev/null \
    || { cat "$dir/log/munged.log" >&2; echo "slurm: munged does not answer on $dir/munge.socket" >&2; exit 1; }

# ---------------------------------------------------------------------------- may jobs get a memory cgroup?
# cgroup v1 only (Slurm 22.05's cgroup/v2 plugin talks to systemd, which this kind of machine does not run). The
# probe makes and removes one child group under this process's own memory cgroup, with a limit.
cgroup_state="off: no cgroup v1 memory controller at /sys/fs/cgroup/memory"
own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
if [ "${MEMCHUNK_SLURM_CGROUP:-auto}" = off ]; then
    cgroup_state="off: MEMCHUNK_SLURM_CGROUP=off"
elif [ -n "$own" ] && [ -d "/sys/fs/cgroup/memory$own" ]; then
    probe="/sys/fs/cgroup/memory$own/memchunk-probe-$$"
    if mkdir "$probe" 2>/dev/null && echo $((64 * 1024 * 1024)) >"$probe/memory.limit_in_bytes" 2>/dev/null; then
        rmdir "$probe"
        mkdir -p "$dir/cgroup/memory"
        if mount --bind "/sys/fs/cgroup/memory$own" "$dir/cgroup/memory" 2>"$dir/log/mount.log"; then
            cgroup_state="on: cgroup v1 memory, jobs under /sys/fs/cgroup/memory$own/slurm (ConstrainRAMSpace)"
        else
            cgroup_state="off: cannot bind-mount this process's memory cgroup ($(head -c 200 "$dir/log/mount.log"))"
        fi
    else
        rmdir "$probe" 2>/dev/null || true
        cgroup_state="off: this process's memory cgroup /sys/fs/cgroup/memory$own does not accept a child with a limit"
    fi
fi

# ---------------------------------------------------------------------------- configuration
node=$(hostname -s)
hw=$(slurmd -C | head -n 1 | sed 's/^NodeName=[^ ]* //')  # CPUs=... RealMemory=...: what this node really has
ctld_port=$(free_port)
d_port=$(free_port)
write_conf() {  # $1: on/off (task/cgroup)
    local task=task/none params="OverMemoryKill"
    if [ "$1" = on ]; then task=task/cgroup; params="NoOverMemoryKill"; fi
    cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm/start.sh for the test suite; everything under $dir.
ClusterName=memchunk
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge.socket
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
# By process group: a job's worker whose batch script died first (reparented to init) is still the job's, and
# is killed with it (proctrack/linuxproc, by parent, lost such orphans; proctrack/cgroup needs the freezer).
ProctrackType=proctrack/pgid
TaskPlugin=$task
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=$params
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Look at the queue every 2 s (defaults 60 s and 30 s): a job held by --begin starts within seconds of its time.
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
KillWait=5
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
NodeName=$node NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    cat >"$dir/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=$dir/cgroup
CgroupAutomount=no
ConstrainCores=no
ConstrainDevices=no
ConstrainRAMSpace=yes
ConstrainSwapSpace=no
AllowedRAMSpace=100
EOF
}
export SLURM_CONF="$dir/slurm.conf"
echo "SLURM_CONF=$SLURM_CONF" >"$dir/env"

start_daemons() {
    slurmctld -i
    slurmd -N "$node"
    for _ in $(seq 100); do
        state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
        case "$state" in idle*|mixed*|allocated*) return 0 ;; esac
        case "$state" in down*|drain*) scontrol update nodename="$node" state=resume 2>/dev/null || true ;; esac
        sleep 0.2
    done
    return 1
}
stop_daemons() {
    for f in slurmd slurmctld; do
        if [ -f "$dir/$f.pid" ]; then kill "$(cat "$dir/$f.pid")" 2>/dev/null || true; fi
    done
    for _ in $(seq 50); do
        alive=0
        for f in slurmd slurmctld; do
            [ -f "$dir/$f.pid" ] && kill -0 "$(cat "$dir/$f.pid")" 2>/dev/null && alive=1
        done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    rm -f "$dir/slurmd.pid" "$dir/slurmctld.pid"
}

if [ "${cgroup_state%%:*}" = on ]; then
    write_conf on
    if ! start_daemons; then
        reason=$(grep -hiE "error|fatal" "$dir/log/slurmd.log" 2>/dev/null | tail -n 1 | cut -c1-200)
        stop_daemons
        umount "$dir/cgroup/memory" 2>/dev/null || true
        mv "$dir/log/slurmd.log" "$dir/log/slurmd-cgroup.log" 2>/dev/null || true
        cgroup_state="off: slurmd did not start with task/cgroup ($reason)"
    fi
fi
if [ "${cgroup_state%%:*}" != on ]; then
    write_conf off
    start_daemons || {
        echo "slurm: the node did not come up; logs:" >&2
        tail -n 30 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
        exit 1
    }
fi
if [ "${cgroup_state%%:*}" != on ]; then
    cgroup_state="$cgroup_state; a job over its --mem is killed by Slurm's accounting poll (OverMemoryKill, 1 s)"
fi
echo "$cgroup_state" >"$dir/cgroup.state"
say "up: node $node ($hw), controller 127.0.0.1:$ctld_port, SLURM_CONF=$SLURM_CONF"
say "memory cgroups $cgroup_state"
