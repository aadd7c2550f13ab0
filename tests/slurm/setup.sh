#!/usr/bin/env bash
# Bring up a real single-node Slurm cluster on localhost for the Slurm tests:
# Debian's slurm-wlm and munge, with job accounting (slurmdbd on MariaDB), so
# that `sacct` answers the Slurm executor's status queries and records every job
# step. Needs root and Debian (12); no systemd: each daemon is started by hand.
#
# Idempotent: with the cluster up it returns at once. Exits non-zero, with the
# daemons' log tails, when the cluster does not come up.
#
# The names tests and users see: cluster `ortflow`, partition `batch`, account
# `ortflow` (the values in workflow/profiles/slurm/config.yaml).
set -euo pipefail

CLUSTER=ortflow
PARTITION=batch
ACCOUNT=ortflow
PACKAGES=(slurm-wlm slurmdbd munge libpmix2 mariadb-server)
LOGS=/var/log/slurm

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

node_ready() { sinfo -h -p "$PARTITION" -o %t | grep -qE '^(idle|mix|alloc)'; }

slurm_conf() {
    cat <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$(hostname -s)(127.0.0.1)
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
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
$(slurmd -C | head -n 1) NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
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

mkdir -p "$LOGS" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd

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
[[ -f /run/slurmd.pid ]] && kill -0 "$(cat /run/slurmd.pid)" 2>/dev/null || slurmd
wait_for "node $(hostname -s)" node_ready
cluster_up || fail "the cluster is not usable (sinfo: $(sinfo 2>&1 | tr '\n' ' '))"
echo "Slurm cluster $CLUSTER is up: partition $PARTITION, account $ACCOUNT, node $(hostname -s)"
