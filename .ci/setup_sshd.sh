#!/usr/bin/env bash
# Installs what tests/launcher needs on a fresh Debian machine: an OpenSSH
# server and client (the launcher tests start real sshd processes on loopback
# addresses) and iproute2 (the netns tests build two "hosts" on one machine).
# Idempotent: it does nothing when everything is already there, and runs
# `apt-get update` at most once.
set -euo pipefail

missing=()
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v ssh-keygen >/dev/null 2>&1 || missing+=(openssh-client)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v pgrep >/dev/null 2>&1 || missing+=(procps)

if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup_sshd.sh: need root to install: ${missing[*]}" >&2
        exit 1
    fi
    # Sort and deduplicate: openssh-client may be listed twice.
    packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    # shellcheck disable=SC2086  # word splitting of the package list is wanted
    apt-get install -y -q --no-install-recommends $packages
fi

# sshd refuses to start without its privilege-separation directory.
mkdir -p /run/sshd
chmod 0755 /run/sshd
echo "setup_sshd.sh: sshd at /usr/sbin/sshd ($(/usr/sbin/sshd -V 2>&1 | head -n1 || true))"
