#!/usr/bin/env bash
# Installs what tests/launcher/test_slurm.py needs on a fresh Debian machine: SLURM (slurm-wlm:
# slurmctld, slurmd, srun/salloc/sbatch) and munge, its authentication daemon, then makes sure a
# munge key exists and munged runs. The test fixture starts its own slurmctld and two slurmd
# nodes with a slurm.conf it writes per run (free ports, state under the test's tmp folder), so
# no /etc/slurm/slurm.conf is written here and concurrent runs never share a cluster; munged is
# the one shared daemon. Idempotent: it installs, creates and starts only what is missing.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
    echo "setup_slurm.sh: need root (packages, /etc/munge, munged)" >&2
    exit 1
fi

missing=()
[ -x /usr/sbin/slurmctld ] || missing+=(slurmctld)
[ -x /usr/sbin/slurmd ] || missing+=(slurmd)
command -v srun >/dev/null 2>&1 || missing+=(slurm-client)
[ -x /usr/sbin/munged ] || missing+=(munge)
if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

# Debian's munge package creates a key at install; a machine restored without it gets a new one.
if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi

# No systemd in CI containers: start munged by hand, as its own user, unless it already answers.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
fi
munge -n | unmunge >/dev/null
echo "setup_slurm.sh: $(slurmd -V 2>&1 | head -n1), munged answering"
