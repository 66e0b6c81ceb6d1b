#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for tests and demos (Debian's slurm-wlm + munge, daemons as root).
#   scripts/slurm_local.sh start   # installs the packages when missing, writes the config, starts the daemons
#   scripts/slurm_local.sh stop    # stops the daemons; removes what `start` installed and wrote (nothing else)
# `start` records in $STATE what it added (packages it installed, files it created); `stop` removes exactly those,
# so a machine without SLURM is left without it (Lightning warns about an unused `srun` on every later run).
set -euo pipefail
cmd=${1:-start}
STATE=${UNIAP_SLURM_DIR:-/tmp/uniap-slurm}
CONF_DIR=/etc/slurm

daemons_down() {  # SIGTERM, then wait for them to exit (SIGKILL after 15 s)
  local d
  for d in slurmd slurmctld munged; do pkill -x "$d" 2>/dev/null || true; done
  for _ in $(seq 1 75); do
    pgrep -x 'slurmd|slurmctld|munged' >/dev/null || return 0
    sleep 0.2
  done
  for d in slurmd slurmctld munged; do pkill -9 -x "$d" 2>/dev/null || true; done
}

stop() {
  daemons_down
  if [ -s "$STATE/added-files" ]; then
    xargs -r rm -f < "$STATE/added-files"
  fi
  if [ -s "$STATE/added-packages" ]; then
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2046
    apt-get purge -y -qq $(cat "$STATE/added-packages") >/dev/null 2>&1 || true
  fi
  rm -rf "$STATE"
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
if [ "$cmd" != start ]; then echo "usage: $0 start|stop" >&2; exit 2; fi

mkdir -p "$STATE"
touch "$STATE/added-files" "$STATE/added-packages"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" != 0 ]; then echo "slurm-wlm and munge are missing and this is not root" >&2; exit 1; fi
  export DEBIAN_FRONTEND=noninteractive
  before=$(dpkg-query -W -f='${Package}\n' | sort)
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
  comm -13 <(echo "$before") <(dpkg-query -W -f='${Package}\n' | sort) >> "$STATE/added-packages"
fi

daemons_down
mkdir -p "$STATE"/{spool,ctld,log} "$CONF_DIR" /run/munge /var/log/munge /var/lib/munge /etc/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  echo /etc/munge/munge.key >> "$STATE/added-files"
fi
if [ ! -e "$CONF_DIR/slurm.conf" ] || grep -q "^ClusterName=uniap$" "$CONF_DIR/slurm.conf"; then
  grep -qx "$CONF_DIR/slurm.conf" "$STATE/added-files" || echo "$CONF_DIR/slurm.conf" >> "$STATE/added-files"
else
  echo "$CONF_DIR/slurm.conf exists and is not ours: not replaced" >&2; exit 1
fi
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
chmod 700 /etc/munge
runuser -u munge -- munged 2>/dev/null || munged --force

host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$CONF_DIR/slurm.conf" <<CONF
ClusterName=uniap
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
rm -f "$CONF_DIR/cgroup.conf"  # proctrack/linuxproc and task/none need no cgroups

slurmctld
slurmd
for _ in $(seq 1 60); do
  if sinfo -h -o "%t" 2>/dev/null | grep -qE "idle|mix|alloc"; then
    echo "slurm up on $host ($cpus CPUs)"; exit 0
  fi
  scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "slurm did not come up; logs in $STATE/log" >&2
tail -n 20 "$STATE"/log/*.log >&2 || true
exit 1
