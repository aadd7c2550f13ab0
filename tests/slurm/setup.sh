#!/usr/bin/env bash
# Bring up a real Slurm cluster on this one machine for the Slurm tests:
# Debian's slurm-wlm and munge, with job accounting (slurmdbd on MariaDB), so
# that `sacct` answers the Slurm executor's status queries and records every job
# step. Needs root and Debian (12); no systemd: each daemon is started by hand.
#
# Three compute nodes, one cluster (so CI sets it up once):
# - this machine's own node (`slurmd -C`, with 4 CPUs: see slurm_conf),
#   partition `batch`, for tests/test_slurm.py;
# - node1 and node2, partition `twonodes`, for tests/test_slurm_two_nodes.py:
#   each a slurmd in its own network namespace (ortflow-node1, -node2) and UTS
#   namespace (its own hostname), on a bridge this script creates (ortflow-br,
#   10.77.0.1/24; the nodes are 10.77.0.11 and .12). They share the machine's
#   filesystem (the mount namespace), as cluster nodes share /home: the munge
#   socket, the project folder and its virtualenv. slurmctld listens on the
#   bridge address, so that every node reaches it; nothing else is routed.
#
# Idempotent: with the cluster up it returns at once. Exits non-zero, with the
# daemons' log tails, when the cluster does not come up. tests/slurm/teardown.sh
# removes it.
#
# The names tests and users see: cluster `ortflow`, partitions `batch` and
# `twonodes`, account `ortflow` (the values in profiles/slurm/config.yaml).
set -euo pipefail

CLUSTER=ortflow
PARTITION=batch
ACCOUNT=ortflow
PACKAGES=(slurm-wlm slurmdbd munge libpmix2 mariadb-server iproute2)
BATCH_CPUS=4
LOGS=/var/log/slurm
source "$(dirname "$0")/nodes.sh"

fail() {
    echo "tests/slurm/setup.sh: $*" >&2
    for log in "$LOGS"/*.log /var/log/munge/munged.log /var/log/mysql-ortflow.log; do
        [[ -f $log ]] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
    done
    exit 1
}

# Wait up to 30 s for a command to succeed.
wait_for() {
    local what=$1
    shift
    for _ in $(seq 60); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    fail "$what did not come up (waited 30 s for: $*)"
}

# Every node of the cluster answers (idle, or running a job).
node_ready() {
    local ready
    ready=$(sinfo -h -N -o '%N %t' | grep -cE ' (idle|mix|alloc)$')
    ((ready == 1 + ${#NODES[@]}))
}

slurm_conf() {
    cat <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)($BRIDGE_ADDR)
SlurmUser=root
AuthType=auth/munge
# No cgroups without systemd: track processes through /proc, bind no CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# OpenMPI 5 speaks PMIx only (with pmi2 each rank starts alone, as rank 0 of 1).
MpiDefault=pmix
ReturnToService=2
# Finished jobs stay visible to squeue/scontrol for 5 minutes.
MinJobAge=300
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
# Keep the executor's --comment (rule_<name>) in sacct: which rule each job ran.
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
StateSaveLocation=/var/lib/slurm/slurmctld
# %n, the node's name, keeps the slurmd of the nodes on one filesystem apart:
# their spool (with the PMIx server's sockets), pid file, log and the PMIx
# clients' temporary folder (TmpFS).
SlurmdSpoolDir=/var/lib/slurm/slurmd-%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=$LOGS/slurmd-%n.log
TmpFS=/var/lib/slurm/tmp-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=$LOGS/slurmctld.log
# A node that stops answering is DOWN after 20 s (default 300), and its jobs
# fail (NODE_FAIL) rather than wait for it.
SlurmdTimeout=20
# A job whose node failed ends as NODE_FAIL; Slurm does not queue it again
# (Snakemake decides what runs next).
JobRequeue=0
# The batch node says it has $BATCH_CPUS CPUs whatever this machine has (slurmd
# trusts slurm.conf over what it counts): a sweep's two 2-task trainings, and
# the jobs after them, run side by side rather than queue. They are short and
# mostly start-up; on 2 CPUs the second training waited for the first, and the
# first point's next jobs for the second training.
SlurmdParameters=config_overrides
$(slurmd -C | head -n 1 | sed -E "s/ CPUs=[0-9]+/ CPUs=$BATCH_CPUS/; s/ SocketsPerBoard=[0-9]+/ SocketsPerBoard=1/;
    s/ CoresPerSocket=[0-9]+/ CoresPerSocket=$BATCH_CPUS/; s/ ThreadsPerCore=[0-9]+/ ThreadsPerCore=1/") NodeAddr=127.0.0.1 State=UNKNOWN
$(for node in "${NODES[@]}"; do
    slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]*/NodeName=$node/"
    echo " NodeAddr=${NODE_ADDR[$node]} State=UNKNOWN"
done | paste -d '' - -)
PartitionName=$PARTITION Nodes=$(hostname -s) Default=YES MaxTime=INFINITE State=UP
PartitionName=$TWO_NODE_PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=INFINITE State=UP
EOF
}

cluster_up() {
    command -v slurmd >/dev/null &&
        [[ $(slurm_conf) == "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]] &&
        scontrol ping 2>/dev/null | grep -q UP &&
        node_ready &&
        sacctmgr -n show account "$ACCOUNT" format=account 2>/dev/null | grep -qw "$ACCOUNT"
}

if cluster_up; then
    echo "Slurm cluster $CLUSTER is up"
    exit 0
fi

[[ $(id -u) == 0 ]] || fail "must run as root (it installs packages and starts daemons)"

# ---- packages
missing=()
for package in "${PACKAGES[@]}"; do
    dpkg-query -W -f '${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
        missing+=("$package")
done
if ((${#missing[@]})); then
    echo "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || fail "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null ||
        fail "apt-get install ${missing[*]} failed"
fi

# libpmix2 ships only libpmix.so.2, and Slurm's PMIx plugin opens libpmix.so:
# without the link, `srun --mpi=pmix` cannot start an MPI step.
pmix_lib=/usr/lib/x86_64-linux-gnu/pmix2/lib
[[ -e $pmix_lib/libpmix.so ]] || ln -s libpmix.so.2 "$pmix_lib/libpmix.so"

mkdir -p "$LOGS" /var/lib/slurm/slurmctld
for node in "$(hostname -s)" "${NODES[@]}"; do mkdir -p "/var/lib/slurm/tmp-$node"; done

# ---- the network of the namespace nodes: a bridge on the host, and in each
# node's namespace one end of a veth pair (eth0) whose other end is on the bridge
command -v ip >/dev/null && ip netns list >/dev/null 2>&1 ||
    fail "needs \`ip netns\` (iproute2) for the namespace nodes ${NODES[*]}"
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    error=$(ip link add "$BRIDGE" type bridge 2>&1) ||
        fail "cannot create the bridge $BRIDGE for the namespace nodes ($error): needs root with CAP_NET_ADMIN"
fi
ip addr replace "$BRIDGE_ADDR/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
for node in "${NODES[@]}"; do
    netns=$(netns_of "$node") veth=$(veth_of "$node")
    if ! [[ -e /run/netns/$netns ]]; then
        error=$(ip netns add "$netns" 2>&1) ||
            fail "cannot create the network namespace $netns for node $node ($error): needs root with CAP_SYS_ADMIN (a VM or a privileged container)"
    fi
    ip link show "$veth" >/dev/null 2>&1 || ip link add "$veth" type veth peer name eth0 netns "$netns"
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$netns" addr replace "${NODE_ADDR[$node]}/24" dev eth0
    ip -n "$netns" link set eth0 up
    ip -n "$netns" link set lo up
done

# ---- munge: authenticates every Slurm message
[[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile /etc/munge/munge.key
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge
chown munge:munge /run/munge /var/log/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    su -s /bin/sh munge -c munged
    wait_for munged sh -c 'munge -n </dev/null | unmunge'
fi

# ---- MariaDB, local socket only: slurmdbd's store
mkdir -p /run/mysqld
chown mysql:mysql /run/mysqld
if ! mariadb -e 'select 1' >/dev/null 2>&1; then
    setsid mariadbd --user=mysql --skip-networking </dev/null >/var/log/mysql-ortflow.log 2>&1 &
    wait_for mariadbd mariadb -e 'select 1'
fi
mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

# ---- configuration. The daemons run as root: a throwaway test cluster, and it
# spares the ownership of state, log and spool folders.
cat >/etc/slurm/slurmdbd.conf <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
LogFile=$LOGS/slurmdbd.log
PidFile=/run/slurmdbd.pid
EOF
chmod 600 /etc/slurm/slurmdbd.conf

# A cluster running with an older configuration is stopped, to restart below.
if ! [[ $(slurm_conf) == "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]]; then
    scontrol shutdown >/dev/null 2>&1 && sleep 2 || true
    slurm_conf >/etc/slurm/slurm.conf
fi

# OpenMPI's PMIx client otherwise tries munge for its own security handshake.
echo "PMIxEnv=PMIX_MCA_psec=native" >/etc/slurm/mpi.conf

# ---- slurmdbd, then the cluster and the account in it
if ! sacctmgr -n show cluster >/dev/null 2>&1; then
    slurmdbd
    wait_for slurmdbd sacctmgr -n show cluster
fi
sacctmgr -n show cluster format=cluster | grep -qw "$CLUSTER" ||
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n show account "$ACCOUNT" format=account | grep -qw "$ACCOUNT" ||
    sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="ortflow tests" >/dev/null
sacctmgr -n show association user=root account="$ACCOUNT" format=user | grep -qw root ||
    sacctmgr -i add user root account="$ACCOUNT" cluster="$CLUSTER" >/dev/null

# ---- slurmctld and slurmd
if ! scontrol ping 2>/dev/null | grep -q UP; then
    slurmctld
    wait_for slurmctld sh -c 'scontrol ping | grep -q UP'
fi
slurmd_running() { [[ -f /run/slurmd-$1.pid ]] && kill -0 "$(cat "/run/slurmd-$1.pid")" 2>/dev/null; }
slurmd_running "$(hostname -s)" || slurmd
# A namespace node's slurmd, and so every job step it starts, runs in the
# node's network namespace and in a UTS namespace of its own named after it.
for node in "${NODES[@]}"; do
    slurmd_running "$node" ||
        nsenter --net="/run/netns/$(netns_of "$node")" unshare --uts \
            sh -c "hostname $node && exec slurmd -N $node"
done
wait_for "nodes $(hostname -s) ${NODES[*]}" node_ready
cluster_up || fail "the cluster is not usable (sinfo: $(sinfo 2>&1 | tr '\n' ' '))"
echo "Slurm cluster $CLUSTER is up: account $ACCOUNT; partition $PARTITION: node $(hostname -s);" \
    "partition $TWO_NODE_PARTITION: nodes$(for node in "${NODES[@]}"; do printf ' %s (%s)' "$node" "${NODE_ADDR[$node]}"; done)"
