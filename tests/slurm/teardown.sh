#!/usr/bin/env bash
# Remove the test cluster of tests/slurm/setup.sh: stop its daemons (every
# slurmd, slurmctld, slurmdbd, MariaDB, munged), delete the namespace nodes'
# network (namespaces, veth pairs, bridge) and the state, spool, log and
# configuration files setup.sh wrote. The Debian packages stay installed (a
# later setup.sh then starts in seconds). Needs root.
set -uo pipefail
source "$(dirname "$0")/nodes.sh"

[[ $(id -u) == 0 ]] || { echo "tests/slurm/teardown.sh: must run as root" >&2; exit 1; }

# Stop a daemon by its pid file, waiting up to 10 s for it to go.
stop() {
    local pidfile=$1 pid
    [[ -f $pidfile ]] || return 0
    pid=$(cat "$pidfile")
    kill "$pid" 2>/dev/null
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f "$pidfile"
}

for pidfile in /run/slurmd-*.pid /run/slurmctld.pid /run/slurmdbd.pid; do stop "$pidfile"; done
if command -v mariadb-admin >/dev/null && mariadb -e 'select 1' >/dev/null 2>&1; then
    mariadb -e 'DROP DATABASE IF EXISTS slurm_acct_db' && mariadb-admin shutdown
fi
stop /run/munge/munged.pid

for node in "${NODES[@]}"; do
    # Job steps left in a node's namespace end with it.
    [[ -e /run/netns/$(netns_of "$node") ]] && ip netns pids "$(netns_of "$node")" | xargs -r kill -9
    # Deleting the namespace deletes its end of the veth pair, and so the pair.
    [[ -e /run/netns/$(netns_of "$node") ]] && ip netns del "$(netns_of "$node")"
done
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE"

rm -rf /var/lib/slurm/slurmctld /var/lib/slurm/slurmd-* /var/lib/slurm/tmp-* /var/log/slurm \
    /etc/slurm/slurm.conf /etc/slurm/slurmdbd.conf /etc/slurm/mpi.conf /var/log/mysql-ortflow.log
echo "the Slurm test cluster is removed"
